"""One open DiskStore per slab file (csrc/src/disk/DESIGN.md D13), with real processes.

A second opener of the same directory and name — in this process or another — gets
``vitrify.disk.SlabLockedError`` naming the slab file and the holder's process id; a holder that
exits, or is SIGKILLed, never blocks the next open, which finds every acknowledged page.
"""

from __future__ import annotations

import errno
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest

from vitrify import disk
from vitrify.disk import DiskStore, SlabLockedError

BASE = os.environ.get("VITRIFY_TEST_DIR") or tempfile.gettempdir()
PAGE = 8192
BUDGET = 4096 + 16 * disk.slot_bytes_for(PAGE)
NAME = "shared"
KEYS = [f"k{i}" for i in range(8)]
DATAS = [bytes([i + 1]) * (1000 + 500 * i) for i in range(8)]

# Opens the store, puts the pages (acknowledged: written, fdatasync'd, indexed), says "ready",
# then waits for a line on stdin: "close" closes the store and exits, EOF exits without closing.
_CHILD = textwrap.dedent(f"""
    import sys
    from vitrify.disk import DiskStore
    s = DiskStore(sys.argv[1], {BUDGET}, {PAGE}, name={NAME!r})
    assert all(s.batch_put({KEYS!r}, {DATAS!r}))
    print("ready", flush=True)
    if sys.stdin.readline().strip() == "close":
        s.close()
""")


@pytest.fixture
def d():
    path = tempfile.mkdtemp(prefix="vitrify-lock-py-", dir=BASE)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def slab(d: str) -> str:
    return os.path.join(d, f"{NAME}.kind0.slab")


def open_store(d, **kw) -> DiskStore:
    return DiskStore(d, BUDGET, PAGE, name=NAME, **kw)


def start_holder(d: str) -> subprocess.Popen:
    """A child process holding the store of ``d``, its pages acknowledged."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, d], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([child.stdout], [], [], 30)
    line = child.stdout.readline().strip() if ready else ""
    if line != "ready":
        stop(child)
        pytest.fail(f"the holder did not get ready (said {line!r}, exit {child.returncode})")
    return child


def stop(child: subprocess.Popen) -> None:
    """Kill the child (if it still runs), reap it and close its pipes."""
    if child.poll() is None:
        child.kill()
    if child.stdin is not None and child.stdin.closed:
        child.stdin = None  # communicate() would flush it
    child.communicate(timeout=10)


def assert_refused_by(d: str, pid: int, cold_start: str) -> None:
    with pytest.raises(SlabLockedError) as ei:
        open_store(d, cold_start=cold_start)
    e = ei.value
    msg = str(e)
    assert isinstance(e, OSError) and e.errno == errno.EBUSY
    assert f'"{slab(d)}"' in msg and f"process {pid} " in msg, msg
    assert socket.gethostname() in msg and "\n" not in msg, msg
    assert e.path == slab(d)
    assert e.holder_pid == pid and e.holder_host == socket.gethostname()


def assert_pages(s: DiskStore) -> None:
    assert s.batch_get(KEYS) == DATAS


def test_sigkilled_holder_refuses_then_never_blocks_the_restart(d):
    child = start_holder(d)
    try:
        for cold_start in ("clear", "load"):  # refused before anything is cleared or scanned
            assert_refused_by(d, child.pid, cold_start)
    finally:
        stop(child)
    assert child.returncode == -9
    # Its owner record is stale now; the kernel dropped its lock with its files.
    with open(slab(d) + ".owner") as f:
        assert f"pid={child.pid} " in f.read()
    with open_store(d, cold_start="load") as s:
        # every put the child saw acknowledged is durable (D3), and the refused opens wiped nothing
        assert s.stats()["loaded_entries"] == len(KEYS)
        assert_pages(s)
        with open(slab(d) + ".owner") as f:
            assert f"pid={os.getpid()} " in f.read()


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_holder_that_exits_normally_releases_the_lock(d, how):
    child = start_holder(d)
    try:
        assert_refused_by(d, child.pid, "load")
        if how == "close":
            child.stdin.write("close\n")
        child.stdin.close()  # "exit": EOF, the process ends with its store open
        assert child.wait(timeout=30) == 0
    finally:
        stop(child)
    if how == "close":  # a closed store removes its owner record
        assert not os.path.exists(slab(d) + ".owner")
    with open_store(d, cold_start="load") as s:
        assert_pages(s)


def test_two_stores_in_one_process_and_a_refusal_leaves_nothing_locked(d):
    d2 = os.path.join(d, "second")
    os.mkdir(d2)
    a = open_store(d2)
    try:
        assert a.batch_put(KEYS[:2], DATAS[:2]) == [True, True]
        with pytest.raises(SlabLockedError) as ei:  # d is free, d2's slab is held: all refused
            DiskStore([d, d2], 2 * BUDGET, PAGE, name=NAME)
        assert ei.value.path == slab(d2) and ei.value.holder_pid == os.getpid()
        assert "(this process)" in str(ei.value)
        with open_store(d) as alone:  # the refusal left d's slab unlocked
            assert alone.exists(KEYS[0]) is False
        with DiskStore(d2, BUDGET, PAGE, name="other"):
            pass  # another name in the same directory is another set of files
        assert a.batch_get(KEYS[:2]) == DATAS[:2]
    finally:
        a.close()
    with open_store(d2, cold_start="load") as b:  # closed: opens, and nothing was lost
        assert b.batch_get(KEYS[:2]) == DATAS[:2]
    assert "SlabLockedError" in disk.__all__ and issubclass(SlabLockedError, OSError)


# Takes the OFD lock of the slab file the way a store does, then (like a holder that is slow to
# write its owner record) writes no record; says "locked" and waits for stdin to close.
_LATE_HOLDER = textwrap.dedent("""
    import fcntl, os, struct, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    print("locked", flush=True)
    sys.stdin.read()
""")


def test_a_record_left_by_a_dead_process_is_never_named_as_the_holder(d):
    """Issue 33 item 6: the new holder writes its record late; the record still names a process
    that has exited. The refusal says the holder is unknown, naming the dead pid as such."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(slab(d) + ".owner", "w") as f:
        f.write(f"pid={dead.pid} host={socket.gethostname()} since=2000-01-01T00:00:00Z\n")
    child = subprocess.Popen([sys.executable, "-c", _LATE_HOLDER, slab(d)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 30)
        assert ready and child.stdout.readline().strip() == "locked"
        with pytest.raises(SlabLockedError) as ei:
            open_store(d)
        msg = str(ei.value)
        assert (f'slab file "{slab(d)}" is held by an unknown process (the record names '
                f"{dead.pid}, which has exited)") in msg, msg
        assert f"process {dead.pid} " not in msg and "\n" not in msg
        assert ei.value.holder_pid is None and ei.value.holder_host is None
        assert ei.value.errno == errno.EBUSY
    finally:
        stop(child)
    with open_store(d) as s:  # the lock went with the holder
        assert s.put("k", b"v")
