"""Exportable regions (R15 in csrc/src/region/DESIGN.md): ``Region(exportable=True).export``
hands a span's chunks to another process as fds, which maps them as one range with
``_native.SharedBuffer.import_fds``. Against the fake driver in fresh processes (it backs
exportable memory with memfds, as test_shared_buffer.py does), and once on a real GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vitrify import _check
from vitrify.region import Region

from test_shared_buffer import fake_env, gpu_env, needs_fake  # noqa: E402

WORKER = Path(__file__).with_name("region_export_worker.py")
MiB = 1 << 20


def run_owner(env: dict) -> dict:
    p = subprocess.run([sys.executable, str(WORKER), "owner"], capture_output=True, text=True,
                       timeout=240, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"the owner printed no result (rc {p.returncode}):\n{p.stderr[-3000:]}"
    r = json.loads(lines[-1])
    assert r["ok"], r.get("traceback")
    return r


def check_round_trip(r: dict) -> None:
    assert r["exportable"]
    chunks = r["chunks"]
    assert len(chunks) == 4, chunks
    g = chunks[0][1]
    assert chunks == [[i * g, g] for i in range(4)]
    assert r["cloexec"], "exported fds must be close-on-exec"
    peer = r["peer"]
    assert peer["ok"], peer.get("traceback") or peer.get("error")
    assert r["peer_rc"] == 0
    assert peer["size"] == 4 * g
    assert r["peer_saw_the_region"], "the peer's import shows other bytes than the region holds"
    assert "import_fds" in peer["export_fd"]
    assert peer["release"] == 0
    assert r["region_sees_peer_write"], "the region does not see the peer's write"
    assert r["rest_untouched"]


@needs_fake
def test_a_second_process_maps_the_exported_span_as_one_range():
    check_round_trip(run_owner(fake_env()))


def test_exportable_must_be_a_bool():
    with pytest.raises(_check.ArgumentTypeError, match="exportable must be a bool"):
        Region(64 * MiB, exportable=1)


def _in_fake_process(code: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=fake_env(**extra))


@needs_fake
def test_export_arguments_and_errors_are_clear():
    code = r"""
import json, os
from vitrify import _native
from vitrify.region import Region
out = {}
def err(f):
    try:
        f()
        return "no error"
    except Exception as e:
        return type(e).__name__ + ": " + str(e)
plain = Region(64 << 20)
plain.preallocate(4 << 20, 2 << 20)
out["plain_exportable"] = plain.exportable
out["plain"] = err(lambda: plain.export(0, 1))
r = Region(64 << 20, exportable=True)
out["exportable"] = r.exportable
r.preallocate(6 << 20, 2 << 20)
out["zero"] = err(lambda: r.export(0, 0))
out["negative"] = err(lambda: r.export(-1, 1))
out["outside"] = err(lambda: r.export(r.size - 1, 2))
out["unmapped"] = err(lambda: r.export(4 << 20, 4 << 20))
cs = r.export(3 << 20, 2 << 20)
out["chunks"] = [[o, n] for o, n, _ in cs]
out["fd_types"] = all(isinstance(fd, int) and fd >= 0 for _, _, fd in cs)
pieces = [(fd, n) for _, n, fd in cs]
out["bad_size"] = err(lambda: _native.SharedBuffer.import_fds([(cs[0][2], 1 << 20)], 0))
out["empty"] = err(lambda: _native.SharedBuffer.import_fds([], 0))
with _native.SharedBuffer.import_fds(pieces, 0) as b:
    out["size"] = b.size
for _, _, fd in cs:
    os.close(fd)
r.close()
out["closed"] = err(lambda: r.export(0, 1))
print(json.dumps(out))
"""
    p = _in_fake_process(code)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["plain_exportable"] is False and out["exportable"] is True
    assert out["plain"].startswith("RuntimeError")
    assert "created without exportable=True" in out["plain"]
    assert out["zero"].startswith("ValueError") and "nbytes" in out["zero"]
    assert out["negative"].startswith("ValueError")
    assert out["outside"].startswith("ValueError") and "runs outside the region" in out["outside"]
    assert out["unmapped"].startswith("ValueError"), out["unmapped"]
    assert f"offset {6 * MiB} " in out["unmapped"] and "is not mapped" in out["unmapped"]
    assert out["chunks"] == [[2 * MiB, 2 * MiB], [4 * MiB, 2 * MiB]]
    assert out["fd_types"]
    assert out["bad_size"].startswith("ValueError") and "granularity" in out["bad_size"]
    assert out["empty"].startswith("ValueError")
    assert out["size"] == 4 * MiB
    assert out["closed"].startswith("RuntimeError") and "closed" in out["closed"]


@needs_fake
def test_a_device_without_fd_handles_is_named():
    code = r"""
from vitrify.region import Region
try:
    Region(64 << 20, exportable=True)
    print("no error")
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
Region(64 << 20).close()
print("plain ok")
"""
    p = _in_fake_process(code, FAKE_CUDA_POSIX_FD="0")
    assert "cannot export memory as a POSIX file descriptor" in p.stdout, p.stdout + p.stderr
    assert "an exportable region" in p.stdout
    assert "plain ok" in p.stdout
    missing = _in_fake_process(code, FAKE_CUDA_MISSING="cuMemExportToShareableHandle")
    assert "CudaUnavailableError" in missing.stdout, missing.stdout + missing.stderr
    assert "lacks cuMemExportToShareableHandle" in missing.stdout


@pytest.mark.gpu
def test_gpu_a_second_process_maps_the_exported_span_as_one_range():
    check_round_trip(run_owner(gpu_env()))
