"""What the KV stores do to the files and pages at their paths (issue 32; csrc/src/disk/DESIGN.md
D13, D22, H2): a link or a non-regular file where a store writes is refused naming it, its target
untouched; a failed open on a full filesystem leaves no file and frees its space; ``load`` of
another geometry refuses instead of wiping; a budget out of range is one line with the range.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile

import pytest

from vitrify import disk
from vitrify.disk import DiskStore
from vitrify.tier import HostStore

BASE = os.environ.get("VITRIFY_TEST_DIR") or tempfile.gettempdir()
SHM = "/dev/shm"


@pytest.fixture
def d():
    path = tempfile.mkdtemp(prefix="vitrify-safety-", dir=BASE)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def h():
    if not os.path.isdir(SHM):
        pytest.skip("no /dev/shm on this machine")
    path = tempfile.mkdtemp(prefix="vitrify-safety-", dir=SHM)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_tmpfs():
    """A tmpfs of 8 MiB on a fresh directory (needs root); skipped with the reason otherwise."""
    at = tempfile.mkdtemp(prefix="vitrify-small-fs-", dir=BASE)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", at],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(at)
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield at
    finally:
        subprocess.run(["umount", "-l", at], check=False)
        os.rmdir(at)


def free_bytes(path: str) -> int:
    v = os.statvfs(path)
    return v.f_bavail * v.f_frsize


def user_file(tmp_path, name: str = "notes.txt", data: bytes = b"abc") -> str:
    p = os.path.join(str(tmp_path), name)
    with open(p, "wb") as f:
        f.write(data)
    return p


# ------------------------------------------------------------------------------ links (b)
@pytest.mark.parametrize("tier", ["disk", "host"])
def test_a_link_at_the_slab_path_is_refused_naming_it_and_its_target_keeps_its_bytes(
        tier, d, h, tmp_path):
    target = user_file(tmp_path)
    where = d if tier == "disk" else h
    slab = os.path.join(where, "vitrify.kind0.slab")
    os.symlink(target, slab)
    open_store = (lambda **kw: DiskStore(where, 1 << 20, 4096, **kw)) if tier == "disk" else \
        (lambda **kw: HostStore(1 << 20, 4096, dir=where, **kw))
    with pytest.raises(OSError, match="is a symbolic link") as ei:
        open_store()
    assert ei.value.errno == errno.ELOOP
    assert f'"{slab}"' in str(ei.value) and "\n" not in str(ei.value)
    with open(target, "rb") as f:
        assert f.read() == b"abc"
    with pytest.raises(OSError, match="is a symbolic link"):
        open_store(mode="read")
    with pytest.raises(OSError, match="is a symbolic link"):
        open_store(cold_start="load")
    assert os.path.getsize(target) == 3
    # a FIFO there is refused at once (never waits for a writer)
    os.unlink(slab)
    os.mkfifo(slab)
    with pytest.raises(OSError, match="is a FIFO"):
        open_store()
    with pytest.raises(OSError, match="is a FIFO"):
        open_store(mode="read")


def test_owner_records_are_never_written_through_links(d, tmp_path):
    a = user_file(tmp_path, "a.txt", b"abc")
    b = user_file(tmp_path, "b.txt", b"xyz")
    slab = os.path.join(d, "vitrify.kind0.slab")
    os.symlink(a, slab + ".owner")
    os.symlink(b, f"{slab}.owner.{os.getpid()}.tmp")
    with DiskStore(d, 1 << 20, 4096) as s:
        assert s.put("k", b"page")
        assert not os.path.islink(slab + ".owner")
    with open(a, "rb") as f:
        assert f.read() == b"abc"
    with open(b, "rb") as f:
        assert f.read() == b"xyz"
    with DiskStore(d, 1 << 20, 4096, cold_start="load") as s:
        assert s.get("k") == b"page"


# ---------------------------------------------------------------- a failed open undone (d)
def test_a_failed_open_on_a_full_filesystem_leaves_no_file_and_frees_its_space(small_tmpfs):
    before = free_bytes(small_tmpfs)
    store_dir = os.path.join(small_tmpfs, "kv")  # created by the open: removed with it
    with pytest.raises(OSError) as ei:
        DiskStore(store_dir, 32 << 20, 4096)
    assert ei.value.errno == errno.ENOSPC and "\n" not in str(ei.value)
    assert "vitrify.kind0.slab" in str(ei.value)
    assert os.listdir(small_tmpfs) == []
    assert free_bytes(small_tmpfs) == before
    # two kinds, the second one does not fit: nothing of either stays
    with pytest.raises(OSError) as ei:
        DiskStore(small_tmpfs, 12 << 20, {"a": 4096, "b": 4096})
    assert ei.value.errno == errno.ENOSPC
    assert os.listdir(small_tmpfs) == []
    assert free_bytes(small_tmpfs) == before
    # a host store refused by its space check leaves no file (nor the directory it made)
    with pytest.raises(OSError) as ei:
        HostStore(32 << 20, 4096, dir=store_dir)
    assert ei.value.errno == errno.ENOSPC
    assert os.listdir(small_tmpfs) == []
    # a file that was there is not the open's to remove
    # (and since it is not a vitrify slab, the open refuses it before allocating anything)
    keep = user_file(small_tmpfs, "vitrify.kind0.slab")
    with pytest.raises(ValueError, match=r"is not a vitrify slab"):
        DiskStore(small_tmpfs, 32 << 20, 4096)
    with open(keep, "rb") as f:
        assert f.read() == b"abc"
    assert os.listdir(small_tmpfs) == ["vitrify.kind0.slab"]
    # and a store that fits works
    os.unlink(keep)
    with DiskStore(store_dir, 1 << 20, 4096) as s:
        assert s.put("k", b"v") and s.get("k") == b"v"


# ------------------------------------------------------------------------- budget (f)
def test_a_huge_budget_is_one_line_naming_budget_bytes_its_value_and_the_range(d):
    with pytest.raises(ValueError) as ei:
        DiskStore(d, 1 << 62, 4000)
    assert str(ei.value) == (
        "budget_bytes=4611686018427387904 gives kind 'default' 1125899906842623 slots of 4096 "
        "bytes per drive, more than the 4294967295 one slab file holds: budget_bytes must be in "
        "[8192, 17592186048511] for these kinds and 1 drive")
    assert os.listdir(d) == []
    lo, hi = disk.budget_range(1, [4000], [1.0])
    assert (lo, hi) == (8192, 17592186048511)
    with pytest.raises(ValueError, match=r"less than one 4096-byte slot .*must be in \[8192, "):
        DiskStore(d, lo - 1, 4000)
    with DiskStore(d, lo, 4000) as s:
        assert s.stats()["kinds"]["default"]["slots_total"] == 1
    # two kinds of other shares on two drives: the range covers both
    d2 = tempfile.mkdtemp(dir=BASE)
    try:
        lo2, hi2 = disk.budget_range(2, [4000, 100000], [1.0, 3.0])
        with pytest.raises(ValueError, match=rf"must be in \[{lo2}, {hi2}\] for these kinds "
                                             r"and 2 drives"):
            DiskStore([d, d2], hi2 + 1 << 4, {"a": 4000, "b": (100000, 3.0)})
    finally:
        shutil.rmtree(d2, ignore_errors=True)


# ------------------------------------------------------------------ load of another geometry (c)
@pytest.mark.parametrize("tier", ["disk", "host"])
def test_load_with_another_page_size_or_budget_refuses_naming_both_and_keeps_the_pages(tier, d, h):
    where = d if tier == "disk" else h

    def open_store(budget, page, **kw):
        if tier == "disk":
            return DiskStore(where, budget, page, **kw)
        return HostStore(budget, page, dir=where, **kw)

    pages = {f"k{i}": bytes([i]) * (1000 + i) for i in range(20)}
    with open_store(1 << 20, 16000) as s:
        assert all(s.batch_put(list(pages), list(pages.values())))
    slab = os.path.join(where, "vitrify.kind0.slab")
    size = os.path.getsize(slab)
    # another page size, even one of the same slot size (16100 and 16000 both take 16 KiB slots)
    for other in (8000, 16100):
        with pytest.raises(ValueError) as ei:
            open_store(1 << 20, other, cold_start="load")
        m = str(ei.value)
        assert "\n" not in m and f'"{slab}"' in m, m
        assert "on disk kind 0, page_bytes 16000" in m and f"requested kind 0, page_bytes {other}" in m
        assert 'cold_start="clear" to wipe it' in m
    # another budget: another slot count
    with pytest.raises(ValueError, match=r"on disk kind 0, page_bytes 16000, slot_bytes 16384, "
                                         r"63 slots, requested kind 0, page_bytes 16000, "
                                         r"slot_bytes 16384, 127 slots"):
        open_store(2 << 20, 16000, cold_start="load")
    assert os.path.getsize(slab) == size  # neither resized nor formatted
    with open_store(1 << 20, 16000, cold_start="load") as s:
        assert s.stats()["loaded_entries"] == 20
        assert s.batch_get(list(pages)) == list(pages.values())
    # wiping is only ever "clear"
    with open_store(1 << 20, 8000, cold_start="clear") as s:
        assert s.get("k3") is None


# ------------------------------------------------ a host tier larger than its mount (issue 33.7)
def test_a_host_tier_larger_than_its_mount_is_a_host_space_error_naming_need_and_free(h):
    """What the HiCache backend needs to start without the host tier: a distinct OSError
    (ENOSPC) with the mount, the bytes needed and free; nothing left behind."""
    from vitrify import tier

    free = free_bytes(h)
    with pytest.raises(tier.HostSpaceError) as ei:
        HostStore(free + (8 << 30), {"big": 1 << 30}, dir=h, name="big")
    e = ei.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert e.mount == "/dev/shm" and e.needed_bytes > e.free_bytes > 0
    assert f"needs {e.needed_bytes} more bytes" in str(e) and f"has {e.free_bytes} bytes free" in str(e)
    assert "\n" not in str(e) and disk.HostSpaceError is tier.HostSpaceError
    assert os.listdir(h) == []
    # a host tier that fits in what is free opens
    with HostStore(min(e.free_bytes // 4, 16 << 20), 4096, dir=h, name="small") as s:
        assert s.put("k", b"v") and s.get("k") == b"v"


@pytest.mark.parametrize("cold_start", ["load", "clear"])
def test_a_file_that_is_not_a_vitrify_slab_is_never_formatted(tmp_path, cold_start):
    """Review of issue 32: a user's regular file (or a hard link to one) at a slab path was
    formatted into a slab with only a hidden log line. It is refused in one line naming it,
    its bytes and the user's other link untouched."""
    probe = tmp_path / "probe"
    probe.mkdir()
    s = disk.DiskStore(str(probe), 4 << 20, {"kv": 65536}, name="t", cold_start="clear")
    name = os.path.basename(s.slab_path("kv"))
    s.close()
    user = tmp_path / "precious.txt"
    user.write_bytes(b"a user's 17 bytes")
    d = tmp_path / "store"
    d.mkdir()
    os.link(user, d / name)  # a hard link: O_NOFOLLOW does not see it
    with pytest.raises(ValueError, match=r"is not a vitrify slab \(no slab header\): vitrify "
                                         r"never overwrites a file it did not create") as e:
        disk.DiskStore(str(d), 4 << 20, {"kv": 65536}, name="t", cold_start=cold_start)
    assert "\n" not in str(e.value) and name in str(e.value)
    assert user.read_bytes() == b"a user's 17 bytes"
    big = bytes(range(256)) * 64  # larger than a slab header, not one
    user.write_bytes(big)
    with pytest.raises(ValueError, match=r"is not a vitrify slab"):
        disk.DiskStore(str(d), 4 << 20, {"kv": 65536}, name="t", cold_start=cold_start)
    assert user.read_bytes() == big


def test_load_refuses_a_slab_whose_header_is_damaged_and_clear_wipes_it(tmp_path):
    s = disk.DiskStore(str(tmp_path), 4 << 20, {"kv": 65536}, name="t", cold_start="clear")
    assert s.put("k", b"x" * 65536)
    path = s.slab_path("kv")
    s.close()
    with open(path, "r+b") as f:  # the header's version field, after the magic
        f.seek(4)
        b = f.read(1)
        f.seek(4)
        f.write(bytes([b[0] ^ 0xFF]))
    before = open(path, "rb").read()
    with pytest.raises(ValueError, match=r"cold_start=\"load\" refuses slab file .*its header is "
                                         r"damaged"):
        disk.DiskStore(str(tmp_path), 4 << 20, {"kv": 65536}, name="t", cold_start="load")
    assert open(path, "rb").read() == before  # nothing written
    s = disk.DiskStore(str(tmp_path), 4 << 20, {"kv": 65536}, name="t", cold_start="clear")
    assert s.get("k") is None
    s.close()


def test_a_slab_whose_creation_stopped_before_its_header_starts_empty(tmp_path):
    """A zeroed header (created and allocated, header never written) is vitrify's own: load
    starts it empty rather than refusing forever."""
    s = disk.DiskStore(str(tmp_path), 4 << 20, {"kv": 65536}, name="t", cold_start="clear")
    path = s.slab_path("kv")
    s.close()
    with open(path, "r+b") as f:
        f.write(b"\0" * 4096)
    s = disk.DiskStore(str(tmp_path), 4 << 20, {"kv": 65536}, name="t", cold_start="load")
    assert s.put("k", b"y" * 65536) and s.get("k") == b"y" * 65536
    s.close()
