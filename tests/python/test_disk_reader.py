"""Read-only DiskStores (csrc/src/disk/DESIGN.md D14): ``mode="read"`` opens the slab files
another open store writes — here a writer in another process — without its lock, serves its pages,
sees later ones after ``refresh()``, writes nothing, and refuses what it cannot read."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from vitrify import disk
from vitrify.disk import DiskStore

BASE = os.environ.get("VITRIFY_TEST_DIR") or tempfile.gettempdir()
PAGE = 8192
BUDGET = 4096 + 16 * disk.slot_bytes_for(PAGE)
NAME = "shared"

# A writer process: puts the pages named on each stdin line ("put a b c"), answers "ok"; EOF
# closes the store and exits.
_WRITER = textwrap.dedent(f"""
    import sys
    from vitrify.disk import DiskStore
    s = DiskStore(sys.argv[1], {BUDGET}, {PAGE}, name={NAME!r})
    print("ready", flush=True)
    for line in sys.stdin:
        op, *keys = line.split()
        if op == "put":
            assert all(s.batch_put(keys, [k.encode() * 100 for k in keys]))
        elif op == "clear":
            s.clear()
        elif op == "del":
            s.batch_delete(keys)
        elif op == "have":  # which of the keys the writer's index holds
            print("ok", "".join("1" if e else "0" for e in s.batch_exists(keys)), flush=True)
            continue
        print("ok", flush=True)
    s.close()
""")


def data(k: str) -> bytes:
    return k.encode() * 100


@pytest.fixture
def d():
    path = tempfile.mkdtemp(prefix="vitrify-reader-py-", dir=BASE)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Writer:
    def __init__(self, d: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", _WRITER, d], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def do(self, line: str) -> str:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        answer = self.p.stdout.readline().split()
        assert answer[:1] == ["ok"], answer
        return answer[1] if len(answer) > 1 else ""

    def close(self) -> None:
        self.p.stdin.close()
        assert self.p.wait(timeout=30) == 0
        self.p.stdout.close()


def reader(d: str, **kw) -> DiskStore:
    return DiskStore(d, BUDGET, PAGE, name=NAME, mode="read", **kw)


def test_reader_in_another_process_sees_pages_then_later_ones_after_refresh(d):
    w = Writer(d)
    try:
        w.do("put a b")
        with reader(d) as r:
            assert r.read_only and r.stats()["refreshes"] == 0
            assert r.batch_get(["a", "b", "c"]) == [data("a"), data("b"), None]
            w.do("put c")
            assert not r.exists("c")              # opened before c was committed
            assert r.refresh() == 3
            assert r.get("c") == data("c")
            assert r.refresh(min_interval=3600) is None   # rate-limited: skipped
            w.do("clear")
            assert r.get("a") in (None, data("a"))   # the old slot: a miss or its exact bytes
            w.do("put d")
            assert r.refresh() == 1                  # the new slab id: only d
            assert r.batch_exists(["a", "d"]) == [False, True]
            assert r.stats()["refreshes"] == 2
    finally:
        w.close()


def test_reader_never_writes_and_refuses_writes(d):
    w = Writer(d)
    try:
        w.do("put a b")
        before = {f: open(os.path.join(d, f), "rb").read() for f in os.listdir(d)}
        mtimes = {f: os.stat(os.path.join(d, f)).st_mtime_ns for f in os.listdir(d)}
        with reader(d) as r:
            for call in (lambda: r.put("x", b"1"), lambda: r.delete("a"), r.clear):
                with pytest.raises(OSError) as e:
                    call()
                assert e.value.errno == errno.EROFS
            assert r.get("a") == data("a")
            r.refresh()
        assert {f: open(os.path.join(d, f), "rb").read() for f in os.listdir(d)} == before
        assert {f: os.stat(os.path.join(d, f)).st_mtime_ns for f in os.listdir(d)} == mtimes
    finally:
        w.close()
    with DiskStore(d, BUDGET, PAGE, name=NAME, mode="write") as writable:
        with pytest.raises(OSError) as e:
            writable.refresh()
        assert e.value.errno == errno.EROFS


def test_reader_open_errors(d):
    with pytest.raises(FileNotFoundError):
        reader(d)
    with pytest.raises(FileNotFoundError):
        reader(os.path.join(d, "missing"))
    assert os.listdir(d) == []                   # nothing created
    with pytest.raises(ValueError, match="cold_start"):
        reader(d, cold_start="clear")
    with pytest.raises(ValueError, match="mode"):
        DiskStore(d, BUDGET, PAGE, name=NAME, mode="append")
    open(os.path.join(d, f"{NAME}.kind0.slab"), "wb").close()   # created, not formatted
    with pytest.raises(ValueError, match="holds 0 bytes"):
        reader(d)
    os.unlink(os.path.join(d, f"{NAME}.kind0.slab"))
    with DiskStore(d, BUDGET, PAGE, name=NAME) as w:
        w.put("a", b"x" * 10)
        with pytest.raises(ValueError, match="another store or geometry"):
            DiskStore(d, BUDGET - disk.slot_bytes_for(PAGE), PAGE, name=NAME, mode="read")
        with reader(d, cold_start="load") as r:
            assert r.get("a") == b"x" * 10


def test_a_refresh_never_finds_what_the_writer_deleted_or_evicted(d):
    """Issue 33 item 5: beside a writer in another process that overflows its 16 slots (GC
    evicts) and deletes, every page a refresh finds is one the writer still holds, with its
    bytes; none it deleted or evicted (their slots are zeroed before the call returns)."""
    w = Writer(d)
    refound = checked = 0
    try:
        w.do("put k0")
        with reader(d) as r:
            n = 1
            for rnd in range(40):
                w.do("put " + " ".join(f"k{i}" for i in range(n, n + 5)))
                n += 5
                w.do(f"del k{n - 2} k{n - 7}")
                r.refresh()
                keys = [f"k{i}" for i in range(n)]
                have = w.do("have " + " ".join(keys))
                for k, found, held in zip(keys, r.batch_exists(keys), have):
                    if not found:
                        continue
                    checked += 1
                    refound += held == "0"
                    assert r.get(k) in (data(k), None)  # never other bytes
        print(f"reader beside writer: {checked} pages found by refreshes, {refound} of them "
              f"deleted or evicted by the writer")
        assert checked > 300
        assert refound == 0
    finally:
        w.close()
