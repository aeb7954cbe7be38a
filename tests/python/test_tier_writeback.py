"""The tiered store's write-back (vitrify.tier.TieredStore; csrc/src/disk/DESIGN.md H8, D24).

Nothing acknowledged is lost: a write-back page stays in the host tier, dirty, until the disk has
it (never evicted before, so a SIGKILL loses none), a restart queues every dirty page for the
disk again, a duplicate put leaves both tiers with the first bytes, a put that could never
become durable raises, a batch larger than the queue returns, and a store left open at the end
of a script flushes at exit instead of aborting the interpreter (issues 32 and 33).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from vitrify import disk
from vitrify.disk import DiskStore, make_key
from vitrify.tier import HostStore, TieredStore

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm on this machine")
BASE = os.environ.get("VITRIFY_TEST_DIR") or tempfile.gettempdir()
PAGE = 16000
SB = disk.slot_bytes_for(PAGE)


def budget(slots: int) -> int:
    return 4096 + slots * SB


def content(i: int, version: int = 0) -> bytes:
    seed = hashlib.sha256(f"{i}/{version}".encode()).digest()
    n = 1000 + int.from_bytes(seed[:2], "little") % (PAGE - 1000)
    return (seed * (n // 32 + 1))[:n]


@pytest.fixture
def h():
    path = tempfile.mkdtemp(prefix="vitrify-wb-host-", dir=SHM)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def d():
    path = tempfile.mkdtemp(prefix="vitrify-wb-disk-", dir=BASE)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def open_tiers(h: str, d: str, host_slots: int, disk_slots: int, *, load: bool = False,
               **kw) -> TieredStore:
    cs = "load" if load else "clear"
    return TieredStore(HostStore(budget(host_slots), PAGE, dir=h, name="wb", cold_start=cs),
                       DiskStore(d, budget(disk_slots), PAGE, name="wb", cold_start=cs), **kw)


def run_script(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


# --------------------------------------------------------------- left open at exit (32 a)
@pytest.mark.parametrize("pages", [2, 48])
def test_a_write_back_store_left_open_at_exit_flushes_and_the_interpreter_exits_cleanly(
        h, d, pages):
    """Issue 32: an unclosed write-back TieredStore aborted the interpreter ("terminate called
    without an active exception", exit 134) or printed nanobind's "leaked instances", and lost
    acknowledged pages. Now: exit status 0, nothing of the kind printed, every acknowledged page
    on the disk after the exit."""
    r = run_script(f"""
        import hashlib
        from vitrify.disk import DiskStore
        from vitrify.tier import HostStore, TieredStore
        def content(i):
            seed = hashlib.sha256(f"{{i}}/0".encode()).digest()
            n = 1000 + int.from_bytes(seed[:2], "little") % ({PAGE} - 1000)
            return (seed * (n // 32 + 1))[:n]
        t = TieredStore(HostStore({budget(64)}, {PAGE}, dir={h!r}, name="wb"),
                        DiskStore({d!r}, {budget(256)}, {PAGE}, name="wb"))
        ok = t.batch_put([str(i) for i in range({pages})], [content(i) for i in range({pages})])
        print("acked", sum(ok), flush=True)
        # no close(): the script just ends with the write-back queue full
    """)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "leaked" not in out and "terminate" not in out and "Traceback" not in out, out
    assert f"acked {pages}" in r.stdout
    with DiskStore(d, budget(256), PAGE, name="wb", cold_start="load") as s:
        assert s.batch_get([str(i) for i in range(pages)]) == [content(i) for i in range(pages)]
    with open_tiers(h, d, 64, 256, load=True) as t:
        assert t.stats()["dirty"] == 0  # the exit wrote every page back
        assert t.batch_get([str(i) for i in range(pages)]) == [content(i) for i in range(pages)]


def test_a_store_nobody_references_is_closed_and_flushed(h, d):
    """The write-back thread holds no reference to the TieredStore: dropping the last one
    closes it (queue flushed, both stores closed)."""
    import gc

    t = open_tiers(h, d, 32, 64)
    host, disk_store = t.host, t.disk
    assert all(t.batch_put([str(i) for i in range(20)], [content(i) for i in range(20)]))
    del t
    gc.collect()
    assert host.closed and disk_store.closed
    with DiskStore(d, budget(64), PAGE, name="wb", cold_start="load") as s:
        assert s.batch_get([str(i) for i in range(20)]) == [content(i) for i in range(20)]


# ------------------------------------------------------------------ a big batch (33.1)
@pytest.mark.parametrize("queue_pages", [1, 8])
def test_a_batch_larger_than_the_queue_returns(h, d, queue_pages):
    """Issue 33 item 1: a batch of more pages than queue_pages, all taken by the host tier,
    never returned (the putter waited for room without waking the write-back thread)."""
    t = open_tiers(h, d, 64, 128, queue_pages=queue_pages)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(t.batch_put(
        [str(i) for i in range(40)], [content(i) for i in range(40)])), daemon=True)
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():
        pytest.fail(f"batch_put of 40 pages with queue_pages={queue_pages} did not return "
                    f"within 60 s (deadlock)")
    try:
        assert result == [[True] * 40]
        assert t.stats()["writeback_queue"] <= queue_pages
        t.flush()
        assert all(t.disk.batch_exists([str(i) for i in range(40)]))
    finally:
        t.close()


# ------------------------------------------------- acknowledged pages never evicted (33.2)
def test_acknowledged_write_back_pages_are_in_a_tier_at_every_moment(h, d):
    """Issue 33 item 2: the host tier's LRU evicted pages still queued for the disk (then only
    in process memory). After every acknowledged put, every acknowledged page is in the host
    tier or on the disk (index look-ups: no waiting for the write-back)."""
    with open_tiers(h, d, 16, 512) as t:
        acked: list[str] = []
        worst = 0
        for i in range(300):
            assert t.put(str(i), content(i))
            acked.append(str(i))
            in_host = t.host.batch_exists(acked)
            on_disk = t.disk.batch_exists(acked)
            worst = max(worst, sum(not (a or b) for a, b in zip(in_host, on_disk)))
        assert worst == 0, f"{worst} acknowledged pages were in neither tier at one moment"
        st = t.stats()
        assert st["host"]["kinds"]["default"]["dirty"] <= 16
        t.flush()
        assert t.stats()["dirty"] == 0
        assert t.batch_get(acked) == [content(i) for i in range(300)]


_SIGKILL_CHILD = """
    import hashlib, os, signal, sys
    from vitrify.disk import DiskStore
    from vitrify.tier import HostStore, TieredStore
    h, d, acks = sys.argv[1:4]
    def content(i):
        seed = hashlib.sha256(f"{i}/0".encode()).digest()
        n = 1000 + int.from_bytes(seed[:2], "little") % (PAGE - 1000)
        return (seed * (n // 32 + 1))[:n]
    t = TieredStore(HostStore(HOST, PAGE, dir=h, name="wb"), DiskStore(d, DISK, PAGE, name="wb"))
    fd = os.open(acks, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for i in range(200):
        if t.put(str(i), content(i)):
            os.write(fd, f"{i}\\n".encode())  # acknowledged: recorded before the next put
    os.kill(os.getpid(), signal.SIGKILL)  # the queue full of pages not on the disk yet
"""


def test_acknowledged_write_back_pages_survive_a_sigkill_and_reach_the_disk(h, d):
    """Issue 33 items 2 and 3: a 24-slot host tier, 200 write-back puts, then SIGKILL (106-177
    acknowledged pages used to be in neither tier after the restart). The restart finds every
    acknowledged page and writes the dirty ones to the disk."""
    acks = os.path.join(d, "acks")
    code = textwrap.dedent(_SIGKILL_CHILD).replace("PAGE", str(PAGE)).replace(
        "HOST", str(budget(24))).replace("DISK", str(budget(400)))
    r = subprocess.run([sys.executable, "-c", code, h, d, acks], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    with open(acks) as f:
        acked = [int(x) for x in f.read().split()]
    assert len(acked) == 200
    with open_tiers(h, d, 24, 400, load=True) as t:
        got = t.batch_get([str(i) for i in acked])
        lost = sum(g is None for g in got)
        wrong = sum(g is not None and g != content(i) for i, g in zip(acked, got))
        print(f"SIGKILL after 200 write-back puts: {lost} acknowledged pages lost, {wrong} wrong")
        assert lost == 0 and wrong == 0
        print(f"{t.stats()['requeued']} dirty pages queued again on the restart")
        t.flush()
        assert t.stats()["dirty"] == 0
    with DiskStore(d, budget(400), PAGE, name="wb", cold_start="load") as s:
        assert s.batch_get([str(i) for i in acked]) == [content(i) for i in acked]


# ------------------------------------------------------------- dirty pages re-queued (33.3)
def test_opening_the_tiers_writes_every_dirty_host_page_to_the_disk(h, d):
    """Issue 33 item 3: pages acknowledged into the host tier but not on the disk when the last
    writer stopped (dirty in the host tier) are written back when the tiers open again; one
    whose disk copy is torn (it was being written) is written again."""
    with HostStore(budget(32), PAGE, dir=h, name="wb") as host:
        assert all(host.batch_put([str(i) for i in range(20)], [content(i) for i in range(20)],
                                  dirty=True))
    with DiskStore(d, budget(64), PAGE, name="wb") as s:
        assert s.put("7", content(7))
        slab, off = s.slab_path(), None
        # the slot of "7" is the first one: tear its payload (a write cut short)
        off = 4096 + 64 + 100
    with open(slab, "r+b") as f:
        f.seek(off)
        f.write(b"\xAA" * 16)
    with open_tiers(h, d, 32, 64, load=True) as t:
        assert t.stats()["requeued"] == 20
        t.flush()
        assert t.stats()["dirty"] == 0
    with DiskStore(d, budget(64), PAGE, name="wb", cold_start="load") as s:
        assert s.batch_get([str(i) for i in range(20)]) == [content(i) for i in range(20)]
    with HostStore(budget(32), PAGE, dir=h, name="wb", cold_start="load") as host:
        assert host.dirty_keys() == []  # marked clean in the slot headers too


# ------------------------------------------------------------ duplicate puts (33.4)
@pytest.mark.parametrize("write", ["back", "through"])
def test_a_duplicate_put_with_other_bytes_keeps_the_first_bytes_in_both_tiers(h, d, write):
    """Issue 33 item 4: the host tier kept the first bytes and the disk got the second. The
    rule (TieredStore docstring): the first write wins, in both tiers."""
    a, b = content(1, 0), content(1, 1)
    with open_tiers(h, d, 4, 64, write=write) as t:
        assert t.put("k", a) and t.put("k", b)
        assert t.batch_put(["j", "j"], [a, b]) == [True, True]  # within a batch too
        assert t.get("k") == a and t.get("j") == a
        t.flush()
        assert t.disk.get("k") == a and t.host.get("k") in (a, None)
        assert t.disk.get("j") == a
        # the host tier evicts "k" (it is on the disk), then another put of it: the disk's
        # bytes stay the first, the host tier does not take the new ones
        for i in range(100, 120):
            assert t.put(str(i), content(i))
        t.flush()
        t.batch_get([str(i) for i in range(100, 120)])  # promotions push "k" out
        assert not t.host.exists("k")
        assert t.put("k", b)
        t.flush()
        assert t.host.get("k") in (a, None) and t.disk.get("k") == a
        assert t.get("k") == a
        # the disk lost a page the host tier still holds: a put of it gives the disk the host's
        # (first) bytes
        assert t.put("m", a)
        t.flush()
        assert t.disk.delete("m")
        assert t.put("m", b)
        t.flush()
        assert t.host.get("m") in (a, None) and t.disk.get("m") == a and t.get("m") == a


# ------------------------------------------------------------ puts that cannot be durable (32 e)
def test_a_put_after_a_store_was_closed_under_the_tiered_store_raises(h, d):
    """Issue 32: write-back acknowledged puts after its disk store was closed."""
    t = open_tiers(h, d, 8, 16)
    assert t.put("before", b"x")
    t.disk.close()
    with pytest.raises(ValueError, match="its disk store is closed, so a page put now could "
                                         "never reach the disk") as ei:
        t.put("after", b"y")
    assert "\n" not in str(ei.value)
    with pytest.raises(ValueError, match="its disk store is closed"):
        t.batch_put(["a", "b"], [b"1", b"2"])
    assert not t.host.exists("after") and not t.host.exists("a")
    t.close()  # no hang: the page it could not write back stays dirty in the host tier
    t2 = open_tiers(h, d, 8, 16, write="through")
    t2.host.close()
    with pytest.raises(ValueError, match="its host store is closed"):
        t2.put("k", b"v")
    t2.close()


# -------------------------------------------------------- the page mover's dirty puts (33.2)
def test_the_page_mover_puts_write_back_pages_dirty_and_gc_keeps_them(h):
    """What an engine's own write-back (the HiCache backend's) needs: a PageMover put into the
    host tier may be dirty, so the host tier keeps the page until the disk has it."""
    import numpy as np

    from vitrify import host as vhost

    page = 4096
    kv = np.zeros((32, page), dtype=np.uint8)
    for p in range(32):
        kv[p] = p + 1
    layout = vhost.PageLayout.from_tensor(kv, token_dim=0, page_tokens=1)
    store = HostStore(4096 + 8 * 8192, page, dir=h, name="mv")  # 8 slots
    try:
        mover = disk.PageMover(store, chunk=4)
        ok, present = mover.put_pages([f"d{p}" for p in range(6)], layout, list(range(6)),
                                      dirty=True)
        assert ok == [True] * 6 and present == 0
        assert sorted(store.dirty_keys()) == sorted(make_key(f"d{p}") for p in range(6))
        for p in range(6, 32):  # clean pages after them: evicted, never the dirty ones
            mover.put_pages([f"c{p}"], layout, [p])
        assert store.batch_get([f"d{p}" for p in range(6)]) == [bytes([p + 1]) * page
                                                               for p in range(6)]
        assert store.mark_clean([f"d{p}" for p in range(6)]) == [True] * 6
        assert store.dirty_keys() == []
        with pytest.raises(ValueError, match="dirty puts are for the host tier"):
            with DiskStore(tempfile.mkdtemp(dir=BASE), 1 << 20, page) as ds:
                disk.PageMover(ds, chunk=2).put_pages(["x"], layout, [0], dirty=True)
    finally:
        store.close()
