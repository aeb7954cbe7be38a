"""vitrify._native.SharedBuffer: VMM memory exported once as a POSIX fd and mapped by a second
process that receives the fd over a Unix socket (socket.send_fds / recv_fds), each side checking
the other's credentials (SO_PEERCRED). On CPU against the fake driver (fresh processes, as
test_session.py does: the fake backs exportable memory with memfds), and once on a real GPU.
R14 in csrc/src/region/DESIGN.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FAKE = os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA")
WORKER = Path(__file__).with_name("shared_buffer_worker.py")
MiB = 1 << 20

needs_fake = pytest.mark.skipif(not FAKE, reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test "
                                                 "sets it)")


def fake_env(**extra: str) -> dict:
    return dict(os.environ, VITRIFY_LIBCUDA_PATH=FAKE or "", FAKE_CUDA_DEVICES="1", **extra)


def gpu_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CUDA_")}
    env.pop("VITRIFY_LIBCUDA_PATH", None)
    return env


def run_owner(tmp_path: Path, size: int, env: dict) -> dict:
    sock = tmp_path / "shared.sock"
    p = subprocess.run([sys.executable, str(WORKER), "owner", str(sock), str(size)],
                       capture_output=True, text=True, timeout=180, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"the owner printed no result (rc {p.returncode}):\n{p.stderr[-3000:]}"
    r = json.loads(lines[-1])
    assert r["ok"], r.get("traceback")
    return r


def check_exchange(r: dict, size: int) -> None:
    assert r["size"] == size
    assert r["fd_cloexec"], "the exported fd must be close-on-exec"
    assert r["peer_credentials_ok"], (r["peer_credentials"], r["peer_pid"])
    assert r["peer_credentials"] == [r["peer_pid"], os.getuid(), os.getgid()]
    peer = r["peer"]
    assert peer["ok"], peer.get("traceback") or peer.get("error")
    assert r["peer_rc"] == 0
    assert peer["owner_credentials"][1:] == [os.getuid(), os.getgid()]
    assert peer["imported"]
    assert peer["same_bytes"], "the peer saw other bytes than the owner wrote"
    assert peer["release"] == 0
    assert r["answer"] == {"finished": True, "release": 0}
    assert r["head_is_peers"], "the owner does not see the peer's write"
    assert r["rest_untouched"]
    assert r["release"] == 0
    assert r["released_ptr"] == 0


@needs_fake
def test_a_second_process_maps_the_fd_sent_over_a_unix_socket(tmp_path):
    size = 6 * MiB
    r = run_owner(tmp_path, size, fake_env())
    check_exchange(r, size)
    # Nothing leaks in either process: the peer's import held a handle, a mapping and a
    # reservation but no bytes of its own, and released all three before it answered.
    peer = r["peer"]
    assert peer["live_before"] == [0, 0, 0, 0, 0]
    assert peer["live_while_mapped"] == [1, 1, 1, 0, 0]
    assert peer["live_after"] == [0, 0, 0, 0, 0]
    assert r["live_after"] == r["live_before"] == [0, 0, 0, 0, 0]


def _in_fake_process(code: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=fake_env(**extra))


@needs_fake
def test_one_process_imports_its_own_export_and_errors_are_clear():
    code = r"""
import os, json
from vitrify import _native
import vitrify
out = {}
a = _native.SharedBuffer(3 * 2**20 + 1)
out["size"] = a.size
a.write(0, b"vitrify" * 100)
fd = a.export_fd()
with _native.SharedBuffer.import_fd(fd, a.size) as b:
    out["same"] = b.read(0, 700) == b"vitrify" * 100
    out["distinct"] = b.ptr != a.ptr
    b.write(a.size - 3, b"end")
out["back"] = a.read(a.size - 3, 3) == b"end"
out["released_by_with"] = b.released
try:
    _native.SharedBuffer.import_fd(fd, 2 * 2**20)
except ValueError as e:
    out["mismatch"] = str(e)
os.close(fd)
try:
    _native.SharedBuffer.import_fd(fd, a.size)
except OSError as e:
    out["bad_fd_errno"] = e.errno
try:
    a.read(a.size, 1)
except ValueError as e:
    out["range"] = str(e)
out["release"] = a.release()
try:
    a.export_fd()
except ValueError as e:
    out["after_release"] = str(e)
print(json.dumps(out))
"""
    p = _in_fake_process(code)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["size"] == 4 * MiB
    assert out["same"] and out["distinct"] and out["back"] and out["released_by_with"]
    assert "holds 4194304 bytes" in out["mismatch"]
    assert "not the 2097152 bytes" in out["mismatch"]
    assert out["bad_fd_errno"] == 9  # EBADF
    assert "runs past the end of the shared buffer" in out["range"]
    assert out["release"] == 0
    assert "released" in out["after_release"]


@needs_fake
def test_an_old_driver_or_a_device_without_fd_handles_is_named():
    code = r"""
import vitrify
from vitrify import _native
try:
    _native.SharedBuffer(2**21)
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
"""
    old = _in_fake_process(code, FAKE_CUDA_MISSING="cuMemImportFromShareableHandle")
    assert "CudaUnavailableError" in old.stdout, old.stdout + old.stderr
    assert "lacks cuMemImportFromShareableHandle" in old.stdout
    no_fd = _in_fake_process(code, FAKE_CUDA_POSIX_FD="0")
    assert "cannot export memory as a POSIX file descriptor" in no_fd.stdout, (
        no_fd.stdout + no_fd.stderr)


@pytest.mark.gpu
def test_gpu_a_second_process_maps_the_fd_sent_over_a_unix_socket(tmp_path):
    size = 64 * MiB
    r = run_owner(tmp_path, size, gpu_env())
    check_exchange(r, size)
