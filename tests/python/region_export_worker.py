"""Subprocess worker for tests/python/test_region_export.py: an exportable ``vitrify.Region``'s
span mapped in place by a second process (R15 in csrc/src/region/DESIGN.md), on any driver (the
fake one on CPU, a real GPU with the ``gpu`` marker).

    python region_export_worker.py owner
    python region_export_worker.py peer SOCKET_FD        (started by the owner)

The owner creates an exportable region, preallocates 4 chunks of one granularity each, fills one
allocation over them with random bytes, exports a span crossing the chunks (Region.export) and
sends the sizes and fds over a Unix socket pair (socket.send_fds), closing its fds after. The
peer imports them as one range (SharedBuffer.import_fds), closes the fds, reports a digest of
everything it sees, writes its own bytes straddling the boundary of the first two pieces,
releases the import and only then answers. The owner checks both directions. The last stdout
line is JSON (``report``).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

from worker_result import report


def peer_bytes(n: int) -> bytes:
    return bytes((i * 11 + 5) & 0xFF for i in range(256)) * (n // 256)


def owner() -> dict:
    from vitrify.region import Region

    out: dict = {}
    r = Region(64 << 20, exportable=True)
    g = r.granularity
    out["exportable"] = r.exportable
    r.preallocate(4 * g, g)
    a = r.allocate(4 * g)
    data = os.urandom(4 * g)
    r.write(a, data)
    chunks = r.export(a - r.base + 1, 3 * g)  # [1, 3g + 1): all four chunks
    out["chunks"] = [[o, n] for o, n, _ in chunks]
    out["cloexec"] = all(os.get_inheritable(fd) is False for _, _, fd in chunks)
    first = chunks[0][0]
    total = sum(n for _, n, _ in chunks)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with parent:
        p = subprocess.Popen([sys.executable, __file__, "peer", str(child.fileno())],
                             pass_fds=[child.fileno()], stdout=subprocess.PIPE, text=True)
        child.close()
        socket.send_fds(parent, [json.dumps(out["chunks"]).encode()],
                        [fd for _, _, fd in chunks])
        for _, _, fd in chunks:
            os.close(fd)  # the caller owns them: sent, then closed
        stdout, _ = p.communicate(timeout=120)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    out["peer"] = json.loads(lines[-1]) if lines else {"ok": False, "error": "no result"}
    out["peer_rc"] = p.returncode
    out["peer_saw_the_region"] = (
        out["peer"].get("sha") == hashlib.sha256(data[first:first + total]).hexdigest())
    n = 8192
    at = g - n // 2  # straddles the boundary of the first two pieces
    out["region_sees_peer_write"] = r.read(r.base + first + at, n) == peer_bytes(n)
    out["rest_untouched"] = r.read(r.base + first + at + n, 4096) == data[
        first + at + n:first + at + n + 4096]
    r.close()
    return out


def peer(sock_fd: int) -> dict:
    from vitrify import _native

    out: dict = {}
    s = socket.socket(fileno=sock_fd)
    msg, fds, _, _ = socket.recv_fds(s, 65536, 16)
    sizes = [n for _, n in json.loads(msg)]
    buf = _native.SharedBuffer.import_fds(list(zip(fds, sizes)), 0)
    for fd in fds:
        os.close(fd)
    out["size"] = buf.size
    out["sha"] = hashlib.sha256(buf.read(0, buf.size)).hexdigest()
    g = sizes[0]
    n = 8192
    buf.write(g - n // 2, peer_bytes(n))
    try:
        buf.export_fd()
        out["export_fd"] = "no error"
    except ValueError as e:
        out["export_fd"] = str(e)
    out["release"] = buf.release()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "owner":
        sys.exit(report(owner))
    else:
        sys.exit(report(lambda: peer(int(sys.argv[2]))))
