"""The host tier (vitrify.tier; csrc/src/disk/DESIGN.md, Host tier, H1-H9) with real processes.

HostStore slabs in /dev/shm: 0600 files in a 0700 directory, surviving the writer (SIGKILL at
random points, then torn, bit-flipped, foreign and stale slabs: 0 wrong payloads, 0 acknowledged
losses), a reader process serving the writer's pages while the writer lives and after it was
killed, another user's slabs refused, too little space one line. TieredStore: write-back and
write-through, LRU demotion, promotion, restart. ``vitrify tier ls`` / ``tier clear``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap

import pytest

from vitrify import config, disk, tier
from vitrify.disk import DiskStore, SlabLockedError, make_key
from vitrify.tier import HostStore, TieredStore

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm on this machine")
BASE = os.environ.get("VITRIFY_TEST_DIR") or tempfile.gettempdir()
PAGE = 16000
SB = disk.slot_bytes_for(PAGE)


@pytest.fixture
def h():
    path = tempfile.mkdtemp(prefix="vitrify-tier-py-", dir=SHM)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def d():
    path = tempfile.mkdtemp(prefix="vitrify-tier-disk-", dir=BASE)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def content(i: int, n: int | None = None) -> bytes:
    n = length_of(i) if n is None else n
    seed = hashlib.sha256(i.to_bytes(8, "little")).digest()
    return (seed * (n // 32 + 1))[:n]


def length_of(i: int) -> int:
    return 1 + int.from_bytes(hashlib.sha256(b"len" + i.to_bytes(8, "little")).digest()[:4],
                              "little") % PAGE


def budget(slots: int) -> int:
    return 4096 + slots * SB


def run_child(code: str, *args: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    return child


def read_line(child: subprocess.Popen, timeout: float = 30) -> str:
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    return child.stdout.readline().strip() if ready else ""


def stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()
    child.communicate(timeout=10)


# ------------------------------------------------------------------------------------ basics
def test_round_trip_permissions_identity_and_restart(h):
    """H1-H3: 0600 slabs in a 0700 directory, the disk page format, pages found after restart."""
    store_dir = os.path.join(h, "user")
    with HostStore(budget(32), PAGE, dir=store_dir, name="m1") as s:
        assert all(s.batch_put([str(i) for i in range(20)], [content(i) for i in range(20)]))
        assert s.tier == "host" and not s.direct_io()
        path = s.slab_path()
        assert os.stat(store_dir).st_mode & 0o777 == 0o700
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.path.dirname(path) == store_dir and os.path.basename(path) == "m1.kind0.slab"
    with HostStore(budget(32), PAGE, dir=store_dir, name="m1", cold_start="load") as s:
        assert s.batch_get([str(i) for i in range(20)]) == [content(i) for i in range(20)]
        assert s.stats()["loaded_entries"] == 20
    # another identity (store name) never serves these pages: load refuses, clear starts empty
    shutil.copy(path, os.path.join(store_dir, "m2.kind0.slab"))
    with pytest.raises(ValueError, match="another store or geometry"):
        HostStore(budget(32), PAGE, dir=store_dir, name="m2", mode="read")
    with pytest.raises(ValueError, match="it belongs to another store"):
        HostStore(budget(32), PAGE, dir=store_dir, name="m2", cold_start="load")
    with HostStore(budget(32), PAGE, dir=store_dir, name="m2", cold_start="clear") as s:
        assert s.get("3") is None and s.stats()["loaded_entries"] == 0
    # ... and the same bytes read by a disk-tier store of the right name: one page format
    disk_dir = tempfile.mkdtemp(dir=BASE)
    try:
        shutil.copy(path, os.path.join(disk_dir, "m1.kind0.slab"))
        with DiskStore(disk_dir, budget(32), PAGE, name="m1", cold_start="load") as s:
            assert s.get("7") == content(7)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)


def test_default_dir_follows_the_setting(h):
    with config.override(host_dir=h):
        assert tier.default_dir() == os.path.join(h, f"vitrify-{os.geteuid()}")
        with HostStore(budget(4), PAGE, name="dflt") as s:
            assert s.slab_path().startswith(tier.default_dir() + "/")


def test_bad_places_and_too_little_space_are_one_line_errors(h, d):
    with pytest.raises(ValueError, match="not in memory") as ei:
        HostStore(budget(4), PAGE, dir=d)
    assert "\n" not in str(ei.value)
    with pytest.raises(ValueError, match="does not apply to the host tier"):
        HostStore(budget(4), PAGE, dir=h, direct_io="on")
    free = os.statvfs(h).f_bavail * os.statvfs(h).f_frsize
    with pytest.raises(OSError) as ei:
        HostStore(free + (8 << 30), {"big": 1 << 30}, dir=h, name="big")
    e = ei.value
    assert e.errno == errno.ENOSPC and "\n" not in str(e)
    assert '"/dev/shm"' in str(e) and "tmpfs" in str(e)
    need = int(str(e).split(" needs ")[1].split()[0])
    have = int(str(e).split(" which has ")[1].split()[0])
    assert need > have > 0
    assert not os.path.exists(os.path.join(h, "big.kind0.slab"))  # nothing grew, nothing left


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user")
def test_another_users_directory_and_slabs_are_refused(h):
    with HostStore(budget(4), PAGE, dir=h, name="u") as s:
        assert s.put("a", b"1")
        path = s.slab_path()
    os.chown(path, 4242, 4242)
    for mode in ("write", "read"):
        with pytest.raises(PermissionError, match="uid 4242") as ei:
            HostStore(budget(4), PAGE, dir=h, name="u", mode=mode, cold_start="load")
        assert path in str(ei.value) and "\n" not in str(ei.value)
    other = os.path.join(h, "theirs")
    os.mkdir(other, 0o700)
    os.chown(other, 4242, 4242)
    with pytest.raises(PermissionError, match="another user"):
        HostStore(budget(4), PAGE, dir=other, name="u")
    # a sticky shared directory of another user (like /dev/shm itself) is fine
    os.chmod(other, 0o1777)
    with HostStore(budget(4), PAGE, dir=other, name="u") as s:
        assert s.put("b", b"2") and os.stat(s.slab_path()).st_uid == os.geteuid()


# ------------------------------------------------------------------------------------ torture
_WRITER = textwrap.dedent("""
    import hashlib, sys
    from vitrify.tier import HostStore
    d, budget, page, start, count, first = sys.argv[1:7]
    page, start, count = int(page), int(start), int(count)
    def length_of(i):
        return 1 + int.from_bytes(hashlib.sha256(b"len" + i.to_bytes(8, "little")).digest()[:4], "little") % page
    def content(i):
        n = length_of(i)
        return (hashlib.sha256(i.to_bytes(8, "little")).digest() * (n // 32 + 1))[:n]
    s = HostStore(int(budget), page, dir=d, name="torture", cold_start="clear" if first == "1" else "load")
    print("ready", flush=True)
    for i in range(start, start + count):
        if s.put(str(i), content(i)):
            print(i, flush=True)
    print("done", flush=True)
    sys.stdin.readline()
""")


def _slot_keys(path: str, slots: int) -> dict[int, bytes]:
    """slot -> the 32-byte key its header names (whether or not it verifies)."""
    out = {}
    with open(path, "rb") as f:
        for s in range(slots):
            f.seek(4096 + s * SB + 24)
            out[s] = f.read(32)
    return out


def _host_torture(h: str, trials: int, seed: int) -> dict:
    """Writers SIGKILLed at random points; between restarts random faults in the shared memory
    (bit flips in headers and payloads, torn slot images, slots from another store's slab of the
    same name, a stale slab of an older generation). After every restart (load): every read is
    the exact bytes or a miss, and every acknowledged page whose slot no fault touched is there."""
    rng = random.Random(seed)
    per_trial = 30
    slots = max(512, trials * per_trial * 10 // 8)  # no GC: stays under 90 % of the slots
    assert trials * per_trial < 0.9 * slots
    b = budget(slots)
    other = tempfile.mkdtemp(prefix="vitrify-tier-other-", dir=SHM)
    counts = {"hit": 0, "miss": 0, "faults": 0, "lost": 0, "wrong": 0, "killed_mid": 0}
    acked: set[int] = set()
    damaged: set[bytes] = set()  # keys whose slot a fault touched
    path = os.path.join(h, "torture.kind0.slab")
    try:
        with HostStore(b, PAGE, dir=other, name="torture") as o:  # same name, other slab id
            assert all(o.batch_put([str(i) for i in range(per_trial)],
                                   [content(i) for i in range(per_trial)]))
            opath = o.slab_path()
        stale = None
        nxt = 0
        for t in range(trials):
            child = run_child(_WRITER, h, str(b), str(PAGE), str(nxt), str(per_trial),
                              "1" if t == 0 else "0")
            try:
                assert read_line(child) == "ready", f"trial {t}: writer did not start"
                # kill at a random point: before, during or after its puts
                lines = []
                for _ in range(rng.randrange(0, per_trial + 2)):
                    line = read_line(child)
                    if not line or line == "done":
                        break
                    lines.append(line)
                child.kill()
                out, _ = child.communicate(timeout=10)
            finally:
                stop(child)
            assert child.returncode == -9
            got = lines + [x for x in out.split() if x != "done"]
            counts["killed_mid"] += "done" not in out and len(got) < per_trial
            acked.update(int(x) for x in got)
            nxt += per_trial
            if t == 2:
                stale = open(path, "rb").read()  # an older generation, restored later
            # faults in the shared memory while nobody holds it
            with open(path, "r+b") as f, open(opath, "rb") as of:
                keys_at = _slot_keys(path, slots)
                for _ in range(rng.randrange(0, 4)):
                    slot = rng.randrange(min(slots, nxt))
                    off = 4096 + slot * SB
                    kind = rng.randrange(4)
                    if kind == 0:  # a header bit
                        p = off + rng.randrange(64)
                    elif kind == 1:  # a payload bit
                        p = off + 64 + rng.randrange(SB - 64)
                    if kind in (0, 1):
                        f.seek(p)
                        v = f.read(1)[0] ^ (1 << rng.randrange(8))
                        f.seek(p)
                        f.write(bytes([v]))
                    elif kind == 2:  # torn: the head of another slot's image
                        f.seek(4096 + rng.randrange(slots) * SB)
                        img = f.read(rng.randrange(1, SB))
                        f.seek(off)
                        f.write(img)
                    else:  # the same slot of another store's slab (same name, other slab id)
                        of.seek(off)
                        img = of.read(SB)
                        f.seek(off)
                        f.write(img)
                    damaged.add(keys_at[slot])
                    counts["faults"] += 1
            if t == trials - 2 and stale is not None:
                # a stale slab: an older image of the file (older slot ids, same slab id);
                # its pages are exact or missing, and everything acknowledged since is lost
                # legitimately (the whole file was replaced), so forget what we knew.
                with open(path, "r+b") as f:
                    f.write(stale)
                acked = set(range(0, 0))
                damaged = set()
                counts["stale"] = 1
            with HostStore(b, PAGE, dir=h, name="torture", cold_start="load") as s:
                for i in range(nxt + 3):
                    v = s.get(str(i))
                    if v is None:
                        counts["miss"] += 1
                        if i in acked and make_key(str(i)) not in damaged:
                            counts["lost"] += 1
                    elif v == content(i):
                        counts["hit"] += 1
                    else:
                        counts["wrong"] += 1
                k = s.stats()["kinds"]["default"]
                assert k["slots_used"] == k["entries"]
    finally:
        shutil.rmtree(other, ignore_errors=True)
    return counts


def test_host_torture_sigkill_faults_restart(h):
    counts = _host_torture(h, trials=12, seed=5)
    assert counts["wrong"] == 0, counts
    assert counts["lost"] == 0, counts
    assert counts["hit"] > 0 and counts["miss"] > 0 and counts["faults"] > 0, counts


@pytest.mark.long
def test_host_torture_long(h):
    counts = _host_torture(h, trials=150, seed=6)
    assert counts["wrong"] == 0 and counts["lost"] == 0, counts
    assert counts["hit"] > 1000 and counts["faults"] > 100, counts


# ------------------------------------------------------------------------------------ processes
_HOLDER = textwrap.dedent("""
    import sys
    from vitrify.tier import HostStore
    s = HostStore(int(sys.argv[2]), int(sys.argv[3]), dir=sys.argv[1], name="shared")
    assert all(s.batch_put([f"k{i}" for i in range(10)], [bytes([i + 1]) * (100 + i) for i in range(10)]))
    print("ready", flush=True)
    sys.stdin.readline()
""")
KEYS = [f"k{i}" for i in range(10)]
DATAS = [bytes([i + 1]) * (100 + i) for i in range(10)]


def test_reader_process_shares_the_writers_pages_and_outlives_a_killed_writer(h):
    """H7 with D13/D14: one writer process holds the lock; this process maps the slabs
    read-only and reads the same pages; after the writer is SIGKILLed the pages stay readable
    and a new writer loads them."""
    child = run_child(_HOLDER, h, str(budget(16)), str(PAGE))
    try:
        assert read_line(child) == "ready"
        with pytest.raises(SlabLockedError) as ei:
            HostStore(budget(16), PAGE, dir=h, name="shared", cold_start="load")
        assert ei.value.holder_pid == child.pid
        r = HostStore(budget(16), PAGE, dir=h, name="shared", mode="read")
        assert r.batch_get(KEYS) == DATAS
        with pytest.raises(OSError) as ei:
            r.put("x", b"1")
        assert ei.value.errno == errno.EROFS
        child.kill()
        child.wait(timeout=10)
        assert r.batch_get(KEYS) == DATAS
        assert r.refresh() == 10
        with HostStore(budget(16), PAGE, dir=h, name="shared", cold_start="load") as w:
            assert w.batch_get(KEYS) == DATAS
            assert w.put("later", b"L")
        r.refresh()
        assert r.get("later") == b"L"
        r.close()
    finally:
        stop(child)


# ------------------------------------------------------------------------------------ tiering
@pytest.mark.parametrize("write", ["back", "through"])
def test_tiered_put_get_demote_promote_and_restart(h, d, write):
    n = 40
    host = HostStore(budget(8), PAGE, dir=h, name="t")  # 8 slots: LRU evicts from the host
    disk_store = DiskStore(d, budget(64), PAGE, name="t")
    with TieredStore(host, disk_store, write=write) as t:
        for i in range(n):
            assert t.put(str(i), content(i))
            if write == "through":
                assert disk_store.exists(str(i))  # acknowledged means on disk
        t.flush()
        assert all(disk_store.exists(str(i)) for i in range(n))  # every page reached the disk
        assert host.stats()["kinds"]["default"]["entries"] <= 8  # the rest was demoted
        assert t.get("0") == content(0)  # a disk hit ...
        st = t.stats()
        assert st["disk_hits"] >= 1 and st["promotions"] >= 1
        assert host.exists("0")  # ... promoted into the host tier
        before = t.stats()["host_hits"]
        assert t.get("0") == content(0)
        assert t.stats()["host_hits"] == before + 1
        assert t.batch_get([str(i) for i in range(n)]) == [content(i) for i in range(n)]
        assert t.get("missing") is None and t.stats()["misses"] == 1
        assert t.delete("5") and t.get("5") is None
        assert t.stats()["writeback_queue"] == 0
    assert host.closed and disk_store.closed
    # restart: both tiers load; the host tier answers what it kept, the disk the rest
    host = HostStore(budget(8), PAGE, dir=h, name="t", cold_start="load")
    disk_store = DiskStore(d, budget(64), PAGE, name="t", cold_start="load")
    with TieredStore(host, disk_store, write=write) as t:
        assert host.stats()["loaded_entries"] > 0
        want = [None if i == 5 else content(i) for i in range(n)]
        assert t.batch_get([str(i) for i in range(n)]) == want
        assert t.stats()["host_hits"] > 0 and t.stats()["disk_hits"] > 0


def test_write_back_serves_pages_waiting_for_the_disk_and_full_host_goes_to_disk(h, d):
    host = HostStore(budget(2), PAGE, dir=h, name="wb", gc_high=0.99, gc_low=0.5)
    disk_store = DiskStore(d, budget(64), PAGE, name="wb")
    with TieredStore(host, disk_store, write="back", queue_pages=4) as t:
        ok = t.batch_put([str(i) for i in range(30)], [content(i) for i in range(30)])
        assert all(ok)
        assert t.batch_get([str(i) for i in range(30)]) == [content(i) for i in range(30)]
        t.flush()
        assert all(disk_store.batch_exists([str(i) for i in range(30)]))
        assert t.stats()["writebacks"] + 0 <= 30


def test_tiered_write_back_copies_any_buffer_type(h, d):
    """Write-back keeps its own copy of each page: the caller may reuse its buffer at once."""
    import numpy as np

    torch = pytest.importorskip("torch")
    host = HostStore(budget(8), PAGE, dir=h, name="buf")
    disk_store = DiskStore(d, budget(16), PAGE, name="buf")
    with TieredStore(host, disk_store, write="back") as t:
        a = np.arange(1000, dtype=np.int32)
        b = torch.arange(500, dtype=torch.float32)
        c = bytearray(b"xyz" * 100)
        assert t.batch_put(["a", "b", "c"], [a, b, c]) == [True] * 3
        want = [a.tobytes(), b.numpy().tobytes(), bytes(c)]
        a[:] = 0
        b.zero_()
        c[:] = b"\0" * len(c)
        t.flush()
        assert disk_store.batch_get(["a", "b", "c"]) == want
        assert t.batch_get(["a", "b", "c"]) == want


def test_tiered_read_only_view_in_another_process(h, d):
    host = HostStore(budget(16), PAGE, dir=h, name="ro")
    disk_store = DiskStore(d, budget(64), PAGE, name="ro")
    t = TieredStore(host, disk_store, write="through")
    try:
        assert all(t.batch_put([str(i) for i in range(12)], [content(i) for i in range(12)]))
        code = textwrap.dedent(f"""
            import hashlib, sys
            from vitrify.disk import DiskStore
            from vitrify.tier import HostStore, TieredStore
            h = HostStore({budget(16)}, {PAGE}, dir={h!r}, name="ro", mode="read")
            d = DiskStore({d!r}, {budget(64)}, {PAGE}, name="ro", mode="read")
            with TieredStore(h, d) as t:
                got = t.batch_get([str(i) for i in range(12)])
                digest = hashlib.sha256(b"".join(g or b"?" for g in got)).hexdigest()
                print(digest, t.stats()["host_hits"], flush=True)
                try:
                    t.put("x", b"1")
                except OSError as e:
                    print("refused", e.errno)
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.split("\n")
        want = hashlib.sha256(b"".join(content(i) for i in range(12))).hexdigest()
        assert lines[0].split() == [want, "12"]
        assert lines[1] == f"refused {errno.EROFS}"
    finally:
        t.close()


def test_tiered_store_argument_errors(h, d):
    with HostStore(budget(4), PAGE, dir=h, name="a") as host, \
            DiskStore(d, budget(4), 2 * PAGE, name="a") as other, \
            DiskStore(d, budget(4), PAGE, name="b") as same:
        with pytest.raises(ValueError, match="same kinds and page sizes"):
            TieredStore(host, other)
        with pytest.raises(ValueError, match="write must be one of 'back', 'through'"):
            TieredStore(host, same, write="sometimes")
        with pytest.raises(TypeError, match="disk must be a disk-tier DiskStore"):
            TieredStore(host, host)
        with pytest.raises(TypeError, match="host must be a HostStore"):
            TieredStore(same, same)


# ------------------------------------------------------------------------------------ tier ls/clear
def vitrify_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vitrify", *args], capture_output=True,
                          text=True, timeout=60)


def test_tier_ls_and_clear(h):
    child = run_child(_HOLDER, h, str(budget(16)), str(PAGE))
    try:
        assert read_line(child) == "ready"
        with HostStore(budget(4), PAGE, dir=h, name="idle") as s:
            s.put("a", b"1")
        shutil.copy(os.path.join(h, "idle.kind0.slab"), os.path.join(h, "copy.kind0.slab"))
        r = vitrify_cli("tier", "ls", "--dir", h, "--json")
        assert r.returncode == 0, r.stderr
        slabs = {s["name"]: s for s in json.loads(r.stdout)["slabs"]}
        assert set(slabs) == {"shared", "idle", "copy"}
        sh = slabs["shared"]
        assert sh["locked"] and sh["holder"]["pid"] == child.pid
        assert sh["bytes"] == budget(16) and sh["mode"] == "0600" and sh["uid"] == os.geteuid()
        assert sh["identity_ok"] and sh["slot_count"] == 16 and sh["kind"] == 0
        assert not slabs["idle"]["locked"] and slabs["idle"]["holder"] is None
        assert not slabs["copy"]["identity_ok"]  # another store's header under this name
        assert sh["last_use"].endswith("Z") and sh["created"].endswith("Z")
        text = vitrify_cli("tier", "ls", "--dir", h)
        assert text.returncode == 0 and f"pid {child.pid}" in text.stdout
        assert "3 slab(s)" in text.stdout and "(foreign)" in text.stdout
        # clear keeps the held slab (exit 1), removes the others with their owner records
        r = vitrify_cli("tier", "clear", "--dir", h)
        assert r.returncode == 1
        assert sorted(os.listdir(h)) == ["shared.kind0.slab", "shared.kind0.slab.owner"]
        assert "kept" in r.stdout and "--force" in r.stdout
        # the holder still serves and is unaffected
        r2 = HostStore(budget(16), PAGE, dir=h, name="shared", mode="read")
        assert r2.batch_get(KEYS) == DATAS
        r2.close()
        r = vitrify_cli("tier", "clear", "--dir", h, "--name", "shared", "--force")
        assert r.returncode == 0 and os.listdir(h) == []
    finally:
        stop(child)
    r = vitrify_cli("tier", "ls", "--dir", h)
    assert r.returncode == 0 and "no host slabs" in r.stdout


# ---- CUDA registration (H9) --------------------------------------------------------------------

_REGISTER = textwrap.dedent("""
    import json, sys
    from vitrify.tier import HostStore
    d, budget, page = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = {}
    try:
        w = HostStore(budget, page, dir=d, name="reg", register_device=0, register_threads=4)
    except Exception as e:
        # nothing held by the failed store: a writer of this process opens the same slabs
        with HostStore(budget, page, dir=d, name="reg") as again:
            reopened = again.put("b", b"y")
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "reopened": reopened}))
        sys.exit(0)
    assert w.put("a", b"x" * 100)
    out["writer"] = w.registration()
    r = HostStore(budget, page, dir=d, name="reg", mode="read", register_device=0)
    out["reader"] = r.registration()
    assert r.get("a") == b"x" * 100
    r.close()
    out["reader_closed"] = r._s is None
    w.close()
    out["plain"] = HostStore(budget, page, dir=d, name="reg2").registration()
    print(json.dumps(out))
""")


def _register_in_fake_driver(h: str, **env: str) -> dict:
    fake = os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA")
    if not fake or not os.path.exists(fake):
        pytest.skip("VITRIFY_TEST_FAKE_LIBCUDA not set or not built (make test sets it)")
    r = subprocess.run([sys.executable, "-c", _REGISTER, h, str(64 * SB + 4096), str(PAGE)],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, VITRIFY_LIBCUDA_PATH=fake, FAKE_CUDA_DEVICES="1",
                                **env))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_registration_of_writer_and_reader_mappings_is_timed(h):
    out = _register_in_fake_driver(h)
    for who in ("writer", "reader"):
        reg = out[who]
        assert reg["registered"] is True and reg["device"] == 0, reg
        assert reg["ranges"] == len(reg["range_seconds"]) >= 1
        assert reg["seconds"] >= max(reg["range_seconds"]) >= 0 and reg["threads"] >= 1
    assert out["plain"] == {"registered": False, "device": -1, "parallel": False, "threads": 0,
                            "seconds": 0.0, "ranges": 0, "range_seconds": []}


def test_a_refused_registration_is_one_error_and_leaves_nothing_held(h):
    out = _register_in_fake_driver(h, FAKE_CUDA_MAX_REGISTER="4096")
    assert "cuMemHostRegister" in out["error"], out
    assert out["reopened"] is True  # in the same process: the failed store held nothing


def test_register_device_is_for_the_host_tier_and_checked(h, d):
    with pytest.raises(ValueError, match="host tier only"):
        DiskStore(d, 4 * SB + 4096, PAGE, register_device=0)
    with pytest.raises(ValueError, match="register_device"):
        HostStore(4 * SB + 4096, PAGE, dir=h, register_device=-1)
    with pytest.raises(ValueError, match="register_threads"):
        HostStore(4 * SB + 4096, PAGE, dir=h, register_device=0, register_threads=0)


@pytest.mark.gpu
def test_gpu_registers_writer_and_reader_mappings(h):
    """The real driver: a writer's mapping registered read-write, a reader's PROT_READ mapping
    registered READ_ONLY (refused without that flag), both timed."""
    import vitrify
    if not vitrify.cuda_available():
        pytest.skip(f"no CUDA GPU: {vitrify.cuda_unavailable_reason()}")
    with HostStore(256 * SB + 4096, PAGE, dir=h, name="gpu", register_device=0) as w:
        assert w.put("a", b"x" * PAGE)
        reg = w.registration()
        assert reg["registered"] and reg["ranges"] >= 1
        with HostStore(256 * SB + 4096, PAGE, dir=h, name="gpu", mode="read",
                       register_device=0) as r:
            assert r.registration()["registered"] and r.get("a") == b"x" * PAGE
        assert w.get("a") == b"x" * PAGE
