"""vitrify.disk.DiskStore on a real filesystem (ext4 on CI; VITRIFY_TEST_DIR chooses the directory).

Invariant numbers refer to csrc/src/disk/DESIGN.md. The fault-injection trials run a small number
by default and >= 1e5 with ``-m long`` (or VITRIFY_LONG_TESTS=1).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vitrify import config, disk
from vitrify.disk import DiskStore, make_key

BASE = os.environ.get("VITRIFY_TEST_DIR") or tempfile.gettempdir()


@pytest.fixture
def d():
    path = tempfile.mkdtemp(prefix="vitrify-disk-py-", dir=BASE)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def content(i: int, n: int) -> bytes:
    """Deterministic bytes of key i (the store is content-addressed: one key, one content)."""
    seed = hashlib.sha256(i.to_bytes(8, "little")).digest()
    return (seed * (n // 32 + 1))[:n]


def length_of(i: int, page: int) -> int:
    return int.from_bytes(hashlib.sha256(b"len" + i.to_bytes(8, "little")).digest()[:4], "little") % (page + 1)


# ---------------------------------------------------------------------------------- basics
def test_round_trip_many_sizes_and_buffer_types(d):
    page = 3 * 4096
    with DiskStore(d, 1 << 20, page) as s:
        sizes = [0, 1, 63, 64, 4031, 4032, 4033, 4096, 8191, page - 1, page]
        for n in sizes:
            assert s.put(f"k{n}", content(n, n))
        for n in sizes:
            assert s.get(f"k{n}") == content(n, n), n
            assert s.size_of(f"k{n}") == n
        arr = np.arange(1000, dtype=np.float16)
        assert s.put("arr", arr)
        assert np.array_equal(np.frombuffer(s.get("arr"), dtype=np.float16), arr)
        assert s.put("ba", bytearray(b"xyz")) and s.put("mv", memoryview(b"0123456789")[2:5])
        assert s.get("ba") == b"xyz" and s.get("mv") == b"234"
        out = np.zeros(page, np.uint8)
        assert s.get_into("k4033", out) == 4033 and out[:4033].tobytes() == content(4033, 4033)
        assert s.get_into("absent", out) is None
        assert s.get("absent") is None
        with pytest.raises(ValueError, match="smaller"):
            s.get_into("k4096", bytearray(10))
        # str and bytes spell the same key; a different key never aliases
        assert s.get(b"k1") == content(1, 1)
        assert make_key("a") == make_key(b"a") != make_key("b")
        assert len(make_key("a")) == disk.KEY_BYTES == 32


def test_any_item_format_is_stored_as_its_bytes(d):
    """ctypes char arrays (format '<c'), structs and multi-dimensional arrays go in as their raw
    bytes (a '<c' buffer once crashed the native conversion)."""
    import ctypes

    with DiskStore(d, 1 << 20, 4096) as s:
        chars = (ctypes.c_char * 4096).from_buffer_copy(content(7, 4096))
        assert s.batch_put(["c"], [chars]) == [True] and s.put("c2", chars)
        assert s.get("c") == s.get("c2") == content(7, 4096)
        two_d = np.arange(64, dtype=np.int32).reshape(8, 8)
        assert s.put("2d", two_d) and s.get("2d") == two_d.tobytes()
        out = (ctypes.c_char * 4096)()
        assert s.get_into("c", out) == 4096 and bytes(out) == content(7, 4096)
        assert s.batch_get_into(["2d"], [np.zeros((8, 8), np.int32)]) == [256]


@pytest.mark.odirect
def test_slabs_use_o_direct_on_this_filesystem(d):
    with DiskStore(d, 1 << 20, 4096) as s:
        assert s.direct_io() and s.stats()["direct_io"]
    with config.override(direct_io="off"), DiskStore(d, 1 << 20, 4096, name="buf") as s:
        assert not s.direct_io()
        assert s.put("x", b"buffered") and s.get("x") == b"buffered"


def test_dedup_is_free(d):
    with DiskStore(d, 1 << 20, 8192) as s:
        assert s.batch_put(["a", "b"], [b"1" * 5000, b"2" * 5000]) == [True, True]
        before = s.stats()
        assert s.batch_put(["a", "b", "a"], [b"1" * 5000, b"2" * 5000, b"1" * 5000]) == [True] * 3
        after = s.stats()
        assert after["spills"] == before["spills"] == 2
        assert after["dedup_hits"] == before["dedup_hits"] + 3
        # duplicates inside one batch join the write in flight
        t = s.put_async(["c", "c"], [b"3", b"3"])
        assert t.wait() == [True, True]
        assert sorted(t.wait_results()) == ["duplicate", "stored"]


def test_zero_copy_slot_buffers(d):
    page = 64 << 10
    with DiskStore(d, 4 << 20, {"kv": page}) as s:
        bufs = [s.buffer("kv") for _ in range(4)]
        for i, b in enumerate(bufs):
            assert b.capacity == page and b.address % 64 == 0
            np.frombuffer(b.view(), dtype=np.uint8)[:] = i + 1  # gather straight into the slot
        ticket = s.put_buffers_async([f"p{i}" for i in range(4)], bufs, [page - i for i in range(4)])
        assert ticket.wait() == [True] * 4 and ticket.done()
        back = [s.buffer("kv") for _ in range(5)]
        got = s.get_buffers_async([f"p{i}" for i in range(4)] + ["nope"], back).wait()
        assert got == [page - i for i in range(4)] + [None]
        for i in range(4):
            assert bytes(back[i].view()[: page - i]) == bytes([i + 1]) * (page - i)
        assert s.get_buffers(["p0", "nope"], [back[4], back[3]]) == [page, None]
        assert bytes(back[4].view()) == bytes([1]) * page
        with pytest.raises(ValueError, match=r"sizes\[0\] must be in \[0, "):
            s.put_buffers(["x"], [bufs[0]], [page + 1])
        with pytest.raises(TypeError):
            s.put_buffers(["x"], [bytearray(10)], [1])


def test_kinds_budget_split_and_names(d):
    d2 = d + "-2"
    try:
        with DiskStore([d, d2], 8 << 20, {"k": (4096 - 64, 3), "v": (8192 - 64, 1)}) as s:
            st_ = s.stats()["kinds"]
            assert st_["k"]["slots_total"] > st_["v"]["slots_total"] * 2
            assert os.path.exists(os.path.join(d2, "vitrify.kind1.slab"))
            assert s.put("x", b"k-bytes", kind="k") and s.put("x", b"v-bytes", kind="v")
            assert s.get("x", kind="k") == b"k-bytes" and s.get("x", kind="v") == b"v-bytes"
            with pytest.raises(ValueError, match="kind must be given"):
                s.get("x")
            with pytest.raises(ValueError, match="kind 'q' is not a kind of this store"):
                s.get("x", kind="q")
    finally:
        shutil.rmtree(d2, ignore_errors=True)


def test_bad_arguments_are_clear_errors(d):
    with pytest.raises(ValueError, match="cold_start must be one of 'clear', 'load', got 'warm'"):
        DiskStore(d, 1 << 20, 4096, cold_start="warm")
    with pytest.raises(ValueError, match="direct_io"):
        DiskStore(d, 1 << 20, 4096, direct_io="sometimes")
    with pytest.raises(ValueError, match="budget_bytes"):
        DiskStore(d, 0, 4096)
    with pytest.raises(ValueError, match="less than one"):
        DiskStore(d, 5000, 4096)
    with pytest.raises(ValueError, match="page_bytes"):
        DiskStore(d, 1 << 20, {"a": -1})
    with pytest.raises(ValueError, match="gc_low"):
        DiskStore(d, 1 << 20, 4096, gc_low=0.95)
    s = DiskStore(d, 1 << 20, 4096)
    with pytest.raises(ValueError, match="more than the page size 4096"):
        s.put("big", b"x" * 4097)
    with pytest.raises(TypeError):
        s.put(123, b"x")
    s.close()
    s.close()
    assert s.closed
    with pytest.raises(ValueError, match="closed"):
        s.get("a")


# ---------------------------------------------------------------------------------- cold start
def test_clear_and_load_rebuild_exactly_the_live_set(d):
    page = 20000
    live = {}
    with DiskStore(d, 4 << 20, page) as s:
        for i in range(40):
            live[i] = content(i, length_of(i, page))
        assert all(s.batch_put(list(map(str, live)), list(live.values())))
        for i in (3, 9, 27):
            assert s.delete(str(i))
            del live[i]
    with DiskStore(d, 4 << 20, page, cold_start="load") as s:
        assert s.stats()["loaded_entries"] == len(live)
        for i in range(45):
            assert s.get(str(i)) == live.get(i), i
    with DiskStore(d, 4 << 20, page, cold_start="clear") as s:
        assert s.stats()["kinds"]["default"]["entries"] == 0 and s.get("0") is None
    with DiskStore(d, 4 << 20, page, cold_start="load") as s:
        assert s.stats()["loaded_entries"] == 0  # old bytes are inert after clear


def test_store_clear_drops_every_kind_and_load_sees_only_later_puts(d):
    kinds = {"k": 8000, "v": (4000, 2.0)}
    with DiskStore([os.path.join(d, "a"), os.path.join(d, "b")], 2 << 20, kinds) as s:
        for kind in kinds:
            assert all(s.batch_put([f"{kind}{i}" for i in range(10)],
                                   [content(i, 100 + i) for i in range(10)], kind))
        # a ticket not yet waited: its puts finish (stored or cancelled), never hang
        t = s.put_async([f"late{i}" for i in range(20)], [b"x" * 50] * 20, "v")
        s.clear()
        assert all(r in ("stored", "cancelled") for r in t.wait_results())
        st = s.stats()
        assert st["clears"] == 1 and st["in_flight_writes"] == 0
        assert all(k["entries"] == 0 and k["slots_used"] == 0 for k in st["kinds"].values())
        for kind in kinds:
            assert s.get(f"{kind}0", kind) is None
            assert not s.exists(f"{kind}1", kind)
        assert s.get("late0", "v") is None
        # stored again (not a duplicate of a dropped page), by the same threads
        assert s.put("k0", content(0, 100), "k")
        assert s.put("after", b"post-clear", "v")
        assert s.get("k0", "k") == content(0, 100)
        assert s.stats()["spills"] >= 2
    with DiskStore([os.path.join(d, "a"), os.path.join(d, "b")], 2 << 20, kinds,
                   cold_start="load", load_threads=1) as s:
        assert s.stats()["loaded_entries"] == 2
        assert s.get("k0", "k") == content(0, 100) and s.get("after", "v") == b"post-clear"
        assert s.get("k1", "k") is None and s.get("v0", "v") is None
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.clear()


def test_load_threads_give_the_same_index(d):
    page = 4000
    with DiskStore(d, 4096 + 3000 * 4096, page) as s:
        keys = [f"n{i}" for i in range(2000)]
        assert all(s.batch_put(keys, [content(i, 10 + i % 50) for i in range(2000)]))
        assert all(s.batch_delete(keys[::7]))
    live = set(keys) - set(keys[::7])
    for threads in (0, 1, 3, 16):
        with DiskStore(d, 4096 + 3000 * 4096, page, cold_start="load", load_threads=threads) as s:
            assert s.stats()["loaded_entries"] == len(live), threads
            assert s.batch_exists(keys) == [k in live for k in keys], threads
    for bad in (-1, 257, 1.5, True):
        with pytest.raises(ValueError, match="load_threads"):
            DiskStore(d, 1 << 20, page, load_threads=bad)


def test_load_refuses_a_slab_from_another_store_or_geometry_and_clear_wipes_it(d):
    """D7: a slab of another store (or geometry) is never served and never wiped by ``load``:
    it refuses naming both; only ``clear`` starts it empty."""
    other = tempfile.mkdtemp(dir=BASE)
    try:
        with DiskStore(other, 1 << 20, 4096, name="other") as s:
            s.put("a", b"from another store")
        with DiskStore(d, 1 << 20, 4096, name="mine") as s:
            s.put("a", b"mine")
        shutil.copy(os.path.join(other, "other.kind0.slab"), os.path.join(d, "mine.kind0.slab"))
        with pytest.raises(ValueError, match="it belongs to another store"):
            DiskStore(d, 1 << 20, 4096, name="mine", cold_start="load")
        with DiskStore(d, 1 << 20, 4096, name="mine", cold_start="clear") as s:
            assert s.stats()["loaded_entries"] == 0 and s.get("a") is None
            s.put("a", b"mine")
        # other geometry (budget) at the same path: refused, the page kept
        with pytest.raises(ValueError, match="127 slots, requested .* 255 slots"):
            DiskStore(d, 2 << 20, 4096, name="mine", cold_start="load")
        with DiskStore(d, 1 << 20, 4096, name="mine", cold_start="load") as s:
            assert s.get("a") == b"mine"
    finally:
        shutil.rmtree(other, ignore_errors=True)


# ---------------------------------------------------------------------------------- GC
def test_gc_evicts_coldest_first_and_never_leaks(d):
    page = 4096 - 64
    # 20 slots (one drive): GC at 18, down to 17
    with DiskStore(d, 4096 + 20 * 4096, page, write_threads=1, max_batch=1) as s:
        for i in range(17):
            assert s.put(f"k{i}", content(i, 100))
        for i in range(5):
            assert s.get(f"k{i}") is not None  # touch: the oldest become the hottest
        assert s.put("k17", content(17, 100))
        st_ = s.stats()
        assert st_["gc_reclaims"] == 1 and st_["kinds"]["default"]["slots_used"] == 17
        assert s.get("k5") is None
        assert all(s.get(f"k{i}") == content(i, 100) for i in list(range(5)) + list(range(6, 18)))
        for r in range(30):
            s.batch_put([f"r{r}-{j}" for j in range(5)], [content(r * 5 + j, 50) for j in range(5)])
        k = s.stats()["kinds"]["default"]
        assert k["slots_used"] == k["entries"] <= 20
        assert s.stats()["put_failures"] == 0


def test_concurrent_put_get_delete_with_gc_no_deadlock(d):
    page = 16384
    s = DiskStore(d, 4096 + 40 * slot_bytes(page), page, queue_capacity=4, max_batch=3)
    wrong, ops, stop = [], [0], threading.Event()

    def worker(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            i = rng.randrange(150)
            op = rng.random()
            if op < 0.45:
                s.batch_put([str(i), str(i + 1)], [content(i, length_of(i, page)),
                                                   content(i + 1, length_of(i + 1, page))])
            elif op < 0.9:
                got = s.get(str(i))
                if got is not None and got != content(i, length_of(i, page)):
                    wrong.append(i)
            else:
                s.delete(str(i))
            ops[0] += 1

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "deadlock: a worker did not finish"
    st_ = s.stats()
    s.close()
    assert wrong == []
    assert ops[0] > 50
    assert st_["gc_reclaims"] > 0
    k = st_["kinds"]["default"]
    assert k["slots_used"] == k["entries"], "a slot leaked"
    assert st_["in_flight_writes"] == st_["write_queue_depth"] == 0


def slot_bytes(page: int) -> int:
    return disk.slot_bytes_for(page)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "del", "reopen"]),
                              st.integers(0, 12)), max_size=40))
def test_model_based_against_a_dict(d, ops):
    page = 6000
    kw = dict(write_threads=1, gc_high=1.0, gc_low=0.99)  # big enough: no eviction here
    s = DiskStore(d, 4096 + 64 * slot_bytes(page), page, **kw)
    model = {}
    try:
        for op, i in ops:
            data = content(i, length_of(i, page))
            if op == "put":
                assert s.put(str(i), data)
                model[i] = data
            elif op == "get":
                assert s.get(str(i)) == model.get(i)
            elif op == "del":
                assert s.delete(str(i)) == (i in model)
                model.pop(i, None)
            else:
                s.close()
                s = DiskStore(d, 4096 + 64 * slot_bytes(page), page, cold_start="load", **kw)
                assert s.stats()["loaded_entries"] == len(model)
        for i in range(13):
            assert s.get(str(i)) == model.get(i)
    finally:
        s.close()
        DiskStore(d, 4096 + 64 * slot_bytes(page), page).close()  # clear for the next example


# ---------------------------------------------------------------------------------- faults
def _fault_trials(d, trials: int, seed: int) -> dict:
    """Random on-disk faults under a live store; every read must be exact bytes or a miss."""
    page, nkeys = 8192 - 64 - 1000, 24
    rng = random.Random(seed)
    budget = 4096 + 32 * slot_bytes(page)
    s = DiskStore(d, budget, page, name="fault")
    other_dir = tempfile.mkdtemp(dir=BASE)
    other = DiskStore(other_dir, budget, page, name="fault")  # same name, other slab id
    counts = {"miss": 0, "hit": 0, "reopen": 0}
    try:
        for i in range(nkeys):
            data = content(i, length_of(i, page))
            assert s.put(str(i), data) and other.put(str(i), data)
        path, opath = s.slab_path(), other.slab_path()
        sb = slot_bytes(page)
        fd = os.open(path, os.O_RDWR)
        ofd = os.open(opath, os.O_RDONLY)
        try:
            for t in range(trials):
                slot = rng.randrange(nkeys)
                off = 4096 + slot * sb
                # 0-4 in-place faults; 5 (truncate) and 6 (reopen with load) ~2 % each
                r = rng.random()
                kind = 5 if r < 0.02 else 6 if r < 0.04 else rng.randrange(5)
                if kind == 0:  # flip a bit in the header
                    p = off + rng.randrange(64)
                    b = os.pread(fd, 1, p)[0] ^ (1 << rng.randrange(8))
                    os.pwrite(fd, bytes([b]), p)
                elif kind == 1:  # flip a bit in the payload or pad
                    p = off + 64 + rng.randrange(sb - 64)
                    b = os.pread(fd, 1, p)[0] ^ (1 << rng.randrange(8))
                    os.pwrite(fd, bytes([b]), p)
                elif kind == 2:  # torn write: the head of another slot's image
                    src = 4096 + rng.randrange(nkeys) * sb
                    n = rng.randrange(1, sb)
                    os.pwrite(fd, os.pread(fd, n, src), off)
                elif kind == 3:  # a slot image from another store's slab, same position
                    os.pwrite(fd, os.pread(ofd, sb, off), off)
                elif kind == 4:  # random garbage somewhere in the slot
                    p = off + rng.randrange(sb)
                    os.pwrite(fd, os.urandom(rng.randrange(1, 200)), p)
                elif kind == 5:  # truncated file (the store's own preallocation is gone)
                    os.ftruncate(fd, off + rng.randrange(sb))
                else:  # close and reopen with load
                    s.close()
                    s = DiskStore(d, budget, page, name="fault", cold_start="load")
                    counts["reopen"] += 1
                    os.close(fd)
                    fd = os.open(path, os.O_RDWR)
                probe = [slot] + [rng.randrange(nkeys) for _ in range(2)]
                for i in probe:
                    got = s.get(str(i))
                    if got is None:
                        counts["miss"] += 1
                    else:
                        assert got == content(i, length_of(i, page)), f"wrong bytes, trial {t}"
                        counts["hit"] += 1
                if kind == 5 or rng.random() < 0.1:  # heal: re-store whatever went missing
                    if kind == 5:
                        s.close()
                        s = DiskStore(d, budget, page, name="fault", cold_start="load")
                        os.close(fd)
                        fd = os.open(path, os.O_RDWR)
                    for i in range(nkeys):
                        data = content(i, length_of(i, page))
                        assert s.put(str(i), data)
        finally:
            os.close(fd)
            os.close(ofd)
    finally:
        s.close()
        other.close()
        shutil.rmtree(other_dir, ignore_errors=True)
    return counts


def test_fault_injection_trials(d):
    counts = _fault_trials(d, 3000, seed=1)
    assert counts["miss"] > 0 and counts["hit"] > 0


@pytest.mark.long
def test_fault_injection_trials_long(d):
    counts = _fault_trials(d, 100_000, seed=2)
    assert counts["miss"] > 1000 and counts["hit"] > 1000


CHILD = textwrap.dedent("""
    import hashlib, sys
    from vitrify.disk import DiskStore
    d, page, start, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    def content(i, n):
        seed = hashlib.sha256(i.to_bytes(8, "little")).digest()
        return (seed * (n // 32 + 1))[:n]
    def length_of(i):
        return int.from_bytes(hashlib.sha256(b"len" + i.to_bytes(8, "little")).digest()[:4], "little") % (page + 1)
    s = DiskStore(d, BUDGET, page, name="crash", cold_start="clear" if first else "load")
    print("ready", flush=True)
    i = start
    while True:
        if s.put(str(i), content(i, length_of(i))):
            print(i, flush=True)
        i += 1
""")


def _crash_trials(d, trials: int, seed: int) -> int:
    """Kill a writer process at random points; after `load`, reads are exact or a miss and the
    keys acknowledged last are present (acknowledged = written, synced and indexed)."""
    page = 30000
    budget = 4096 + 48 * slot_bytes(page)
    rng = random.Random(seed)
    nxt, checked = 0, 0
    for t in range(trials):
        p = subprocess.Popen([sys.executable, "-c", CHILD.replace("BUDGET", str(budget)), d, str(page), str(nxt),
                              "1" if t == 0 else "0"], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.05))
        p.kill()
        out, _ = p.communicate()
        assert p.returncode == -9
        acked = [int(x) for x in out.split()]
        with DiskStore(d, budget, page, name="crash", cold_start="load") as s:
            for i in acked[-5:]:  # GC evicts the oldest first; the newest are always there
                assert s.get(str(i)) == content(i, length_of(i, page)), f"lost acked key {i}"
            hi = nxt + len(acked) + 3
            for i in range(max(0, hi - 200), hi):
                got = s.get(str(i))
                if got is not None:
                    assert got == content(i, length_of(i, page)), f"wrong bytes for {i}"
                checked += 1
            k = s.stats()["kinds"]["default"]
            assert k["slots_used"] == k["entries"]
        nxt += len(acked) + 3
    return checked


def test_crash_between_write_and_index(d):
    assert _crash_trials(d, 4, seed=3) > 0


@pytest.mark.long
def test_crash_between_write_and_index_long(d):
    assert _crash_trials(d, 1000, seed=4) > 0


# ---------------------------------------------------------------------------------- stats
def test_stats_and_prometheus(d):
    with DiskStore(d, 1 << 20, 4096, name="metrics") as s:
        s.put("a", b"1")
        s.get("a")
        s.get("b")
        st_ = s.stats()
        assert st_["spills"] == 1 and st_["reloads"] == 1 and st_["misses"] == 1
        assert 0 < st_["kinds"]["default"]["occupancy"] < 1
        for key in ("gc_reclaims", "write_errors", "in_flight_writes", "in_flight_reads",
                    "write_queue_depth", "read_queue_depth", "put_failures"):
            assert st_[key] == 0
        prom = pytest.importorskip("prometheus_client")
        reg = prom.CollectorRegistry()
        reg.register(s.prometheus_collector())
        text = prom.generate_latest(reg).decode()
        assert 'vitrify_disk_spills_total{store="metrics"} 1.0' in text
        assert 'vitrify_disk_slots_used{kind="default",store="metrics"} 1.0' in text


def test_page_mover_round_trip_dedup_wrong_length_and_bad_pages(tmp_path):
    """vitrify.disk.PageMover (DESIGN.md D15-D18) through the Python layer: host pages in
    several chunks to the store and back into other pages; stored keys are skipped; a page of
    another length is dropped; a bad page index raises ValueError and leaves nothing in flight."""
    from vitrify import host
    layers, pages = 2, 12
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 2 * layers * pages * 256, dtype=np.uint8)
    dst = np.full_like(src, 0xEE)

    def layout(mem):
        half = mem.size // 2
        return host.PageLayout.layer_first([mem.ctypes.data, mem.ctypes.data + half],
                                           layers=layers, pages=pages, page_tokens=2, heads=1,
                                           head_dim=128, item_bytes=1)

    ls, ld = layout(src), layout(dst)
    blob = ls.blob_bytes
    with DiskStore(str(tmp_path), 64 * disk.slot_bytes_for(blob) + 4096, blob) as s:
        mover = disk.PageMover(s, 2)
        assert mover.chunk == 2
        keys = [f"page{i}" for i in range(5)]
        assert mover.put_pages(keys[:2], ls, [0, 1]) == ([True, True], 0)
        s.put("short", b"x" * (blob // 2))
        ok, present = mover.put_pages(keys + ["short"], ls, [0, 1, 2, 3, 4, 5])
        assert ok == [True] * 6 and present == 3
        assert s.stats()["spills"] == 6  # 5 pages + "short", each written once
        hits, dropped = mover.get_pages(keys + ["short", "absent"], ld, [11, 10, 9, 8, 7, 6, 5])
        assert hits == [True] * 5 + [False, False]
        assert dropped == [(5, blob // 2)] and not s.exists("short")
        for i, p in enumerate([11, 10, 9, 8, 7]):
            back = bytearray(blob)
            host.gather(ld, p, back)
            assert bytes(back) == reference_page(ls, i), p
        untouched = bytearray(blob)
        host.gather(ld, 6, untouched)
        assert untouched == b"\xee" * blob
        with pytest.raises(ValueError):  # a page past the layout, refused before any I/O
            mover.put_pages(["x0", "x1", "x2"], ls, [0, 1, pages])
        with pytest.raises(ValueError, match="keys and pages differ"):
            mover.get_pages(keys, ld, [0])
        with pytest.raises(ValueError, match="host page 3 is named twice"):
            mover.get_pages(keys[:4], ld, [1, 3, 2, 3])
        st = s.stats()
        assert st["in_flight_writes"] == st["in_flight_reads"] == 0


def reference_page(lay, p):
    from vitrify import host
    out = bytearray(lay.blob_bytes)
    host.gather(lay, p, out)
    return bytes(out)
