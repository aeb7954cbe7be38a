"""Subprocess worker for tests/python/test_shared_buffer.py: two processes share one
``vitrify._native.SharedBuffer`` through a file descriptor sent over a Unix socket (SCM_RIGHTS),
on any driver (the fake one on CPU, where the worker also checks the fake's live objects).

    python shared_buffer_worker.py owner SOCKET_PATH SIZE
    python shared_buffer_worker.py peer  SOCKET_PATH OWNER_PID     (started by the owner)

The owner creates the buffer, fills it with pattern 3, listens on SOCKET_PATH and starts the
peer; it checks the peer's credentials (SO_PEERCRED: the peer's pid, our uid and gid) and sends
the size and the exported fd. The peer checks the owner's credentials the same way, imports the
fd, closes it, checks the bytes, writes pattern 9 over the first MiB, releases its mapping and
only then answers (every imported mapping is released before "finished" is signalled). The owner
then sees pattern 9 and the untouched rest. The last stdout line of each is JSON (``report``).
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct
import subprocess
import sys

from worker_result import report

MiB = 1 << 20


def pattern(n: int, seed: int, start: int = 0) -> bytes:
    """Byte i (from `start`) is (i * 7 + seed) mod 256: it repeats every 256 bytes."""
    block = bytes(((i * 7 + seed) & 0xFF) for i in range(256))
    first = start % 256
    return (block * ((first + n) // 256 + 1))[first:first + n]


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def fake_live() -> list[int] | None:
    """[reservations, handles, mappings, allocs, physical] of the fake driver, or None."""
    path = os.environ.get("VITRIFY_LIBCUDA_PATH", "")
    if not os.environ.get("FAKE_CUDA_DEVICES") or not path:
        return None
    counts = ctypes.CDLL(path).fake_cuda_counts  # the same library vitrify dlopen()ed
    out = (ctypes.c_uint64 * 5)()
    counts(out)
    return list(out)


def recv_line(sock: socket.socket) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise RuntimeError(f"the other side closed the socket after {buf!r}")
        buf += chunk
    return json.loads(buf)


def owner(path: str, size: int) -> dict:
    from vitrify import _native

    before = fake_live()
    buf = _native.SharedBuffer(size, 0)
    buf.write(0, pattern(buf.size, 3))
    fd = buf.export_fd()
    fd_cloexec = not os.get_inheritable(fd)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    env = dict(os.environ)
    peer = subprocess.Popen([sys.executable, __file__, "peer", path, str(os.getpid())],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    srv.settimeout(60)
    conn, _ = srv.accept()
    conn.settimeout(60)
    pid, uid, gid = peer_credentials(conn)
    creds_ok = (pid, uid, gid) == (peer.pid, os.getuid(), os.getgid())
    header = json.dumps({"size": buf.size, "device": 0}).encode() + b"\n"
    if creds_ok:
        socket.send_fds(conn, [header], [fd])
    os.close(fd)  # exported once, sent once: this process keeps no copy
    answer = recv_line(conn) if creds_ok else {}
    conn.close()
    srv.close()
    out, err = peer.communicate(timeout=60)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    peer_result = json.loads(lines[-1]) if lines else {"ok": False, "error": err[-3000:]}
    head = buf.read(0, MiB)
    rest = buf.read(MiB, buf.size - MiB)
    released = buf.release()
    return {
        "size": buf.size,
        "fd_cloexec": fd_cloexec,
        "peer_credentials": [pid, uid, gid],
        "peer_pid": peer.pid,
        "peer_credentials_ok": creds_ok,
        "answer": answer,
        "peer": peer_result,
        "peer_rc": peer.returncode,
        "head_is_peers": head == pattern(MiB, 9),
        "rest_untouched": rest == pattern(buf.size - MiB, 3, MiB),
        "release": released,
        "released_ptr": buf.ptr,
        "live_before": before,
        "live_after": fake_live(),
    }


def peer(path: str, owner_pid: int) -> dict:
    from vitrify import _native

    before = fake_live()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(path)
    creds = peer_credentials(sock)
    if creds != (owner_pid, os.getuid(), os.getgid()):
        raise RuntimeError(f"the socket's owner is {creds}, not the owner process {owner_pid}")
    msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
    assert len(fds) == 1, f"expected one fd, got {fds}"
    header = json.loads(msg)
    fd = fds[0]
    buf = _native.SharedBuffer.import_fd(fd, header["size"], header["device"])
    os.close(fd)  # import_fd does not consume the fd; the mapping holds its own reference
    same = buf.read(0, buf.size) == pattern(buf.size, 3)
    buf.write(0, pattern(MiB, 9))
    live_while_mapped = fake_live()
    released = buf.release()  # before "finished" is signalled
    result = {
        "owner_credentials": list(creds),
        "imported": buf.imported,
        "same_bytes": same,
        "release": released,
        "live_before": before,
        "live_while_mapped": live_while_mapped,
        "live_after": fake_live(),
    }
    sock.sendall(json.dumps({"finished": True, "release": released}).encode() + b"\n")
    sock.close()
    return result


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "owner":
        sys.exit(report(lambda: owner(sys.argv[2], int(sys.argv[3]))))
    sys.exit(report(lambda: peer(sys.argv[2], int(sys.argv[3]))))
