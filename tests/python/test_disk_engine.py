"""DiskStore's I/O engines (csrc/src/disk/DESIGN.md D25): io_uring, aio and psync give the same
bytes and the same slab files; a forced engine the kernel refuses is a one-line
``EngineUnavailableError``; ``auto`` falls back and logs at DEBUG.

Every engine the kernel running the test grants is tested; refusals come from the kernel or
from the ``VITRIFY_DISK_ENGINE_DENY`` test hook (comma-separated engine names refuse with EPERM).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import struct
import tempfile

import pytest

from vitrify import config, disk
from vitrify.disk import DiskStore, EngineUnavailableError

BASE = os.environ.get("VITRIFY_TEST_DIR") or tempfile.gettempdir()
PAGE = 20000


@pytest.fixture
def d():
    path = tempfile.mkdtemp(prefix="vitrify-engine-py-", dir=BASE)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    path = tempfile.mkdtemp(prefix="vitrify-engine-py-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def granted() -> list[str]:
    """The engines this kernel grants (each probed by opening a store with it)."""
    out = []
    root = tempfile.mkdtemp(prefix="vitrify-engine-probe-", dir=BASE)
    try:
        for e in ("psync", "aio", "io_uring"):
            try:
                DiskStore(os.path.join(root, e), 1 << 20, 4000, engine=e).close()
                out.append(e)
            except EngineUnavailableError:
                pass
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def content(i: int) -> bytes:
    seed = hashlib.sha256(i.to_bytes(8, "little")).digest()
    n = int.from_bytes(seed[:4], "little") % (PAGE + 1)
    return (seed * (n // 32 + 1))[:n]


def normalized(path: str, slot_bytes: int) -> bytes:
    """The slab file with the slab id, the creation time and the header CRCs over them zeroed
    (they differ between any two stores by design, DESIGN.md D7)."""
    b = bytearray(open(path, "rb").read())
    b[32:36] = bytes(4)
    b[40:48] = bytes(8)
    b[52:56] = bytes(4)
    for off in range(4096, len(b) - 63, slot_bytes):
        if struct.unpack_from("<I", b, off)[0] == 0x4C535456:
            b[off + 16:off + 20] = bytes(4)
            b[off + 60:off + 64] = bytes(4)
    return bytes(b)


def workload(s: DiskStore) -> list[bytes | None]:
    assert all(s.batch_put([f"k{i}" for i in range(40)], [content(i) for i in range(40)]))
    assert all(s.batch_put([f"k{i}" for i in range(20, 90)], [content(i) for i in range(20, 90)]))
    assert all(s.batch_delete([f"k{i}" for i in range(0, 90, 7)]))
    return s.batch_get([f"k{i}" for i in range(90)])


@pytest.mark.parametrize("where", ["drive", "tmpfs-buffered"])
def test_same_workload_same_bytes_and_same_files_on_every_engine(where, d, shm):
    """D25: identical payloads and identical slab files (slab id and time aside) on every engine
    the kernel grants, on the O_DIRECT drive and through the buffered fallback on tmpfs."""
    engines = granted()
    assert "psync" in engines
    seen, files = {}, {}
    for e in engines:
        root = os.path.join(d if where == "drive" else shm, e)
        with DiskStore(root, 4096 + 128 * disk.slot_bytes_for(PAGE), PAGE, name="eng", engine=e,
                       queue_depth=8, direct_io="off" if where != "drive" else None) as s:
            assert s.engine == e
            seen[e] = workload(s)
            assert s.stats()["verify_failures"] == 0
        files[e] = normalized(os.path.join(root, "eng.kind0.slab"), disk.slot_bytes_for(PAGE))
    for e in engines:
        assert seen[e] == [None if i % 7 == 0 else content(i) for i in range(90)], e
        assert files[e] == files["psync"], f"{e} wrote other bytes than psync"


def test_forced_engine_the_kernel_refuses_is_a_one_line_error(d):
    refused = r'^\[Errno 1\] disk engine "io_uring" is not available: .*EPERM'
    with config.override(disk_engine_deny="io_uring"), \
            pytest.raises(EngineUnavailableError, match=refused) as ei:
        DiskStore(os.path.join(d, "s"), 1 << 20, 4000, engine="io_uring")
    assert ei.value.errno == errno.EPERM
    assert ei.value.engine == "io_uring"
    assert isinstance(ei.value, OSError)
    assert "\n" not in str(ei.value)
    assert not os.path.exists(os.path.join(d, "s")), "the refused open left its directory"


def test_auto_falls_back_and_logs_at_debug(d, caplog):
    engines = granted()
    with config.override(disk_engine_deny="io_uring"), \
            caplog.at_level(logging.DEBUG, logger="vitrify"):
        with DiskStore(d, 1 << 20, 4000) as s:
            assert s.engine == ("aio" if "aio" in engines else "psync")
            assert s.put("a", b"bytes") and s.get("a") == b"bytes"
    assert any("io_uring" in r.getMessage() and "not available" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert all(r.levelno == logging.DEBUG for r in caplog.records
               if "engine" in r.getMessage())
    with config.override(disk_engine_deny="io_uring, aio"), \
            DiskStore(d, 1 << 20, 4000, cold_start="load") as s:
        assert s.engine == "psync"
        assert s.get("a") == b"bytes"


def test_engine_argument_is_checked(d, shm):
    with pytest.raises(ValueError, match="engine"):
        DiskStore(d, 1 << 20, 4000, engine="libaio")
    with pytest.raises(ValueError, match="queue_depth"):
        DiskStore(d, 1 << 20, 4000, queue_depth=0)
    with pytest.raises(ValueError, match="does not apply to the host tier"):
        DiskStore(shm, 1 << 20, 4000, tier="host", engine="io_uring")
    with DiskStore(shm, 1 << 20, 4000, tier="host") as h:
        assert h.engine == "mapped"


def test_truncated_slab_on_tmpfs_reads_misses_and_exact_bytes_on_every_engine(shm):
    """A short read (the slab cut in the middle of a slot) is a miss, never wrong bytes; whole
    slots read exactly, on each engine, through the buffered fallback."""
    for e in granted():
        root = os.path.join(shm, e)
        page = 6000  # 8 KiB slots
        with DiskStore(root, 4096 + 16 * disk.slot_bytes_for(page), page, name="t", engine=e,
                       direct_io="off") as s:
            datas = [bytes([i + 1]) * page for i in range(10)]
            assert all(s.batch_put([f"p{i}" for i in range(10)], datas))
            os.truncate(os.path.join(root, "t.kind0.slab"), 4096 + 5 * 8192 + 100)
            got = s.batch_get([f"p{i}" for i in range(10)])
            assert got[:5] == datas[:5], e
            assert got[5:] == [None] * 5, e


def test_the_deny_hook_is_read_from_the_environment_through_config(tmp_path):
    """VITRIFY_DISK_ENGINE_DENY reaches the core through vitrify.config at each open (the core
    reads no VITRIFY_* variable itself)."""
    import subprocess
    import sys

    code = ("import sys; from vitrify.disk import DiskStore, EngineUnavailableError\n"
            "try:\n    DiskStore(sys.argv[1], 1 << 20, 4000, engine='aio')\n"
            "except EngineUnavailableError as e:\n    print('refused', e.engine)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, "VITRIFY_DISK_ENGINE_DENY": "aio"})
    assert r.stdout.strip() == "refused aio", r.stdout + r.stderr
