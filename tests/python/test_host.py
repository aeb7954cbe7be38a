"""vitrify.host: slab planning, segments (hypothesis), hugetlbfs checks, views, gather/scatter on
any machine; host<->GPU page copies under the `gpu` marker. Invariants: csrc/src/host/DESIGN.md."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vitrify
from vitrify import config, host
from vitrify._units import GiB, KiB, MiB

HAVE_TORCH = importlib.util.find_spec("torch") is not None


# ---- planning ---------------------------------------------------------------------------------


def test_plan_defaults_to_vitrify_max_slab_gb():
    assert host.default_max_slab_bytes() == int(config.settings().max_slab_gb * GiB)
    with config.override(max_slab_gb=0.5):
        assert host.default_max_slab_bytes() == GiB // 2
        plan = host.plan_slabs(2 * GiB, 64 * MiB)
        assert len(plan) == 4 and all(s["map_bytes"] <= GiB // 2 for s in plan)
    assert len(host.plan_slabs(2 * GiB, 64 * MiB)) == 1  # 480 GiB default: one slab


@pytest.mark.parametrize("total,page,ceiling,align,expect_pages", [
    (64 * MiB, 2 * MiB, 16 * MiB, 4096, [8, 8, 8, 8]),          # exact fit
    (10 * MiB, MiB, 4 * MiB, 4096, [4, 4, 2]),                   # remainder
    (300, 100, 480 * GiB, 4096, [3]),                            # tiny pool
    (5 * 8192, 8192, 8192, 4096, [1] * 5),                       # ceiling edge
    (7 * 3 * KiB, 3 * KiB, 10 * KiB, 4 * KiB, [2, 2, 2, 1]),     # page not dividing the ceiling
])
def test_plan_cases(total, page, ceiling, align, expect_pages):
    plan = host.plan_slabs(total, page, ceiling, align)
    assert [s["pages"] for s in plan] == expect_pages
    assert all(s["map_bytes"] <= ceiling and s["map_bytes"] % align == 0 for s in plan)


@pytest.mark.parametrize("args,needle", [
    ((0, 4096, MiB), r"total_bytes must be an int in \[1, "),
    ((4096, 0, MiB), r"page_bytes must be an int in \[1, "),
    ((10000, 4096, MiB), "not a multiple of page_bytes"),
    ((8192, 8192, 8191), "does not fit under the single-registration ceiling"),
])
def test_plan_rejects(args, needle):
    with pytest.raises(ValueError, match=needle):
        host.plan_slabs(*args)


# ---- the pool ---------------------------------------------------------------------------------


def small_pool(pages=10, page=4096, ceiling=3 * 4096, **kw) -> host.HostPool:
    return host.HostPool(pages * page, page, max_slab_bytes=ceiling, register=False, **kw)


def test_pool_slabs_addresses_and_segments():
    with small_pool() as pool:
        assert (pool.num_slabs, pool.num_pages, pool.pages_per_slab) == (4, 10, 3)
        assert not pool.registered and pool.registration()["registered"] is False
        for p in range(pool.num_pages):
            s = pool.slab_of(p)
            assert pool.page_address(p) == pool.slab_address(s) + (p - 3 * s) * 4096
        segs = pool.segments(2, 6)
        assert [(s.slab, s.first_page, s.pages) for s in segs] == [(0, 2, 1), (1, 3, 3), (2, 6, 2)]
        assert segs[1].address == pool.slab_address(1) and segs[1].nbytes == 3 * 4096
        assert pool.segments(5, 0) == []
        with pytest.raises(ValueError, match=r"count must be an int in \[0, 2\], got 3"):
            pool.segments(8, 3)
        with pytest.raises(ValueError, match=r"first_page must be an int in \[0, 9\], got 10"):
            pool.segments(10, 1)
        with pytest.raises(ValueError, match=r"page must be an int in \[0, 9\], got 10"):
            pool.page_address(10)
    assert pool.closed
    with pytest.raises(ValueError, match="closed"):
        pool.num_pages


@settings(max_examples=150, deadline=None)
@given(page=st.integers(1, 20000), pages=st.integers(1, 80), per=st.integers(1, 9),
       slack=st.integers(0, 4095), data=st.data())
def test_segments_never_straddle(page, pages, per, slack, data):
    """Invariant 3: every piece lies inside one slab; pieces tile the range in order."""
    ceiling = -(-page // 4096) * 4096 * per + slack
    with host.HostPool(pages * page, page, max_slab_bytes=ceiling, register=False) as pool:
        slabs = pool.slabs()
        first = data.draw(st.integers(0, pages - 1))
        count = data.draw(st.integers(0, pages - first))
        nxt = first
        for s in pool.segments(first, count):
            sl = slabs[s.slab]
            assert s.first_page == nxt and s.pages > 0
            assert sl["first_page"] <= s.first_page
            assert s.first_page + s.pages <= sl["first_page"] + sl["pages"], "straddles two slabs"
            assert s.address == pool.page_address(s.first_page)
            assert s.nbytes == s.pages * page
            nxt += s.pages
        assert nxt == first + count
        assert all(s["map_bytes"] <= ceiling for s in slabs)


def test_slab_array_is_a_zero_copy_view_that_outlives_close():
    pool = small_pool()
    a = pool.slab_array(1)
    assert a.dtype == np.uint8 and a.shape == (3 * 4096,)
    a[4096:8192] = 0xAB  # page 4
    assert ctypes.string_at(pool.page_address(4), 4096) == b"\xab" * 4096
    ctypes.memset(pool.page_address(5), 0x11, 16)
    assert bytes(a[8192:8208]) == b"\x11" * 16
    pool.close()  # the view keeps the slab mapped
    assert int(a[4096]) == 0xAB and int(a.sum()) == 0xAB * 4096 + 0x11 * 16


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_slab_tensor_is_a_zero_copy_torch_view():
    with small_pool() as pool:
        t = pool.slab_tensor(0)
        t[:4096] = 7
        assert ctypes.string_at(pool.page_address(0), 4096) == b"\x07" * 4096


def test_register_on_without_gpu_raises_unavailable():
    if vitrify.cuda_available():
        pytest.skip("a GPU is present (covered by the gpu tests)")
    with pytest.raises(vitrify.CudaUnavailableError):
        host.HostPool(4096, 4096, register=True)


@pytest.mark.skipif(not os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA"),
                    reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
def test_auto_registration_with_a_driver_but_no_device_stays_unregistered():
    code = ("import vitrify\nfrom vitrify import host\n"
            "assert vitrify.cuda_available(), vitrify.cuda_unavailable_reason()\n"
            "p = host.HostPool(8192, 4096)\nprint(p.registered, p.registration()['registered'])\n")
    env = dict(os.environ, VITRIFY_LIBCUDA_PATH=os.environ["VITRIFY_TEST_FAKE_LIBCUDA"])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_register_argument_is_checked():
    with pytest.raises(ValueError, match="register must be"):
        host.HostPool(4096, 4096, register="maybe")


def test_registration_guard_refuses_above_the_ceiling():
    buf = bytearray(8192)
    with pytest.raises(ValueError, match="refusing to register .* single-registration ceiling"):
        host.HostRegistration(buf, max_bytes=4096)
    with config.override(max_slab_gb=4096 / GiB):
        with pytest.raises(ValueError, match="VITRIFY_MAX_SLAB_GB"):
            host.HostRegistration(buf)


# ---- hugetlbfs --------------------------------------------------------------------------------


def test_hugetlbfs_capacity_message():
    host.check_hugetlbfs_capacity("/mnt/huge", 20 * MiB, fs_magic=host._native.HUGETLBFS_MAGIC,
                                  block_size=2 * MiB, free_blocks=10)
    with pytest.raises(MemoryError) as e:
        host.check_hugetlbfs_capacity("/mnt/huge", 30 * MiB,
                                      fs_magic=host._native.HUGETLBFS_MAGIC,
                                      block_size=2 * MiB, free_blocks=10)
    msg = str(e.value)
    for needle in ("/mnt/huge", "20.00 MiB", "30.00 MiB", "2.00 MiB", "nr_hugepages",
                   "make the pool smaller"):
        assert needle in msg, (needle, msg)


def test_hugetlbfs_mount_must_be_hugetlbfs(tmp_path):
    with pytest.raises(ValueError, match="not a hugetlbfs mount"):
        host.HostPool(MiB, MiB, hugetlbfs_mount=str(tmp_path), register=False)


def test_hugetlbfs_pool_fails_before_mapping_when_too_small(tmp_path):
    fake = (host._native.HUGETLBFS_MAGIC, 2 * MiB, 3)  # 3 free huge pages of 2 MiB
    with pytest.raises(MemoryError, match=r"needs 8\.00 MiB"):
        host.HostPool(7 * MiB, MiB, max_slab_bytes=2 * MiB, hugetlbfs_mount=str(tmp_path),
                      register=False, _fake_statfs=fake)
    assert os.listdir(tmp_path) == []


def test_hugetlbfs_file_backed_slabs_with_fake_statfs(tmp_path):
    fake = (host._native.HUGETLBFS_MAGIC, 4096, 1000)
    with host.HostPool(40 * KiB, 8 * KiB, max_slab_bytes=16 * KiB, hugetlbfs_mount=str(tmp_path),
                       register=False, _fake_statfs=fake) as pool:
        assert pool.num_slabs == 3
        for s in range(pool.num_slabs):
            pool.slab_array(s)[:] = s + 1
        assert ctypes.string_at(pool.page_address(4), 8 * KiB) == b"\x03" * (8 * KiB)
    assert os.listdir(tmp_path) == [], "slab files are unlinked at creation"


# ---- layouts and gather/scatter ---------------------------------------------------------------


def reference_gather(layout: host.PageLayout, page: int) -> bytes:
    out = b""
    for base in layout.components:
        for layer in range(layout.layers):
            out += ctypes.string_at(base + layer * layout.layer_stride + page * layout.page_stride,
                                    layout.slice_bytes)
    return out


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["layer_first", "page_first"]), comps=st.integers(1, 2),
       layers=st.integers(1, 6), pages=st.integers(1, 6), tokens=st.integers(1, 4),
       heads=st.integers(1, 3), dim=st.sampled_from([1, 8, 64]), item=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**32 - 1))
def test_gather_scatter_round_trip(kind, comps, layers, pages, tokens, heads, dim, item, seed):
    rng = np.random.default_rng(seed)
    size = layers * pages * tokens * heads * dim * item
    mems = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(comps)]
    layout = getattr(host.PageLayout, kind)([m.ctypes.data for m in mems], layers=layers,
                                            pages=pages, page_tokens=tokens, heads=heads,
                                            head_dim=dim, item_bytes=item)
    assert layout.blob_bytes == comps * layers * tokens * heads * dim * item
    slot = np.zeros(64 + layout.blob_bytes, dtype=np.uint8)  # blob after a 64-byte header
    for page in range(pages):
        host.gather(layout, page, slot.ctypes.data + 64, layout.blob_bytes)
        assert slot[64:].tobytes() == reference_gather(layout, page)
        assert not slot[:64].any()
    originals = [m.copy() for m in mems]
    blobs = rng.integers(0, 256, (pages, layout.blob_bytes), dtype=np.uint8)
    for page in range(pages):
        host.scatter(blobs[page], layout, page)
    for page in range(pages):
        assert reference_gather(layout, page) == blobs[page].tobytes()
    # Scattering the original blobs back restores every byte.
    back = [m.copy() for m in originals]
    orig_layout = getattr(host.PageLayout, kind)([m.ctypes.data for m in back], layers=layers,
                                                 pages=pages, page_tokens=tokens, heads=heads,
                                                 head_dim=dim, item_bytes=item)
    for page in range(pages):
        blob = bytearray(layout.blob_bytes)
        host.gather(orig_layout, page, blob)
        host.scatter(bytes(blob), layout, page)
    for m, o in zip(mems, originals):
        assert np.array_equal(m, o)


def test_strided_layout_like_sglang_single_tensor_kv():
    """SGLang's host buffer [2, layers, tokens, heads, dim]: K then V in one allocation."""
    layers, pages, page_tokens, heads, dim, item = 3, 5, 4, 2, 8, 2
    per_comp = layers * pages * page_tokens * heads * dim * item
    buf = np.random.default_rng(1).integers(0, 256, 2 * per_comp, dtype=np.uint8)
    slice_bytes = page_tokens * heads * dim * item
    lay = host.PageLayout.strided([buf.ctypes.data, buf.ctypes.data + per_comp],
                                  component_bytes=per_comp, layers=layers, pages=pages,
                                  slice_bytes=slice_bytes, layer_stride=pages * slice_bytes,
                                  page_stride=slice_bytes)
    ref = host.PageLayout.layer_first([buf.ctypes.data, buf.ctypes.data + per_comp],
                                      layers=layers, pages=pages, page_tokens=page_tokens,
                                      heads=heads, head_dim=dim, item_bytes=item)
    a, b = bytearray(lay.blob_bytes), bytearray(ref.blob_bytes)
    host.gather(lay, 3, a)
    host.gather(ref, 3, b)
    assert a == b == bytearray(reference_gather(lay, 3))


def test_from_tensor_sglang_layer_first_and_page_first():
    """SGLang host buffers: layer_first [2, L, T, H, D] and page_first [2, T, L, H, D]."""
    L, T, H, D, pt = 3, 12, 2, 8, 4
    rng = np.random.default_rng(4)
    lf = rng.standard_normal((2, L, T, H, D)).astype(np.float16)
    lay = host.PageLayout.from_tensor(lf, component_dim=0, layer_dim=1, token_dim=2,
                                      page_tokens=pt)
    assert (lay.layers, lay.pages, len(lay.components)) == (L, T // pt, 2)
    blob = np.empty(lay.blob_bytes, dtype=np.uint8)
    host.gather(lay, 1, blob)
    want = np.concatenate([lf[c, l, pt:2 * pt].reshape(-1).view(np.uint8)
                           for c in range(2) for l in range(L)])
    assert np.array_equal(blob, want)
    pf = rng.standard_normal((2, T, L, H, D)).astype(np.float16)
    lay2 = host.PageLayout.from_tensor(pf, component_dim=0, token_dim=1, page_tokens=pt)
    assert (lay2.layers, lay2.pages) == (1, T // pt)
    host.gather(lay2, 2, blob)
    want2 = np.concatenate([pf[c, 2 * pt:3 * pt].reshape(-1).view(np.uint8) for c in range(2)])
    assert np.array_equal(blob[:lay2.blob_bytes], want2)
    # Round trip through scatter into a zeroed copy.
    dst = np.zeros_like(pf)
    lay3 = host.PageLayout.from_tensor(dst, component_dim=0, token_dim=1, page_tokens=pt)
    for p in range(T // pt):
        b = np.empty(lay2.blob_bytes, dtype=np.uint8)
        host.gather(lay2, p, b)
        host.scatter(b, lay3, p)
    assert np.array_equal(dst.view(np.uint16), pf.view(np.uint16))
    with pytest.raises(ValueError, match="must come before token_dim"):
        host.PageLayout.from_tensor(pf, layer_dim=2, token_dim=1, page_tokens=pt)
    with pytest.raises(ValueError, match="must divide"):
        host.PageLayout.from_tensor(pf, component_dim=0, token_dim=1, page_tokens=5)
    with pytest.raises(ValueError, match="not dense"):
        host.PageLayout.from_tensor(lf[..., ::2], component_dim=0, layer_dim=1, token_dim=2,
                                    page_tokens=pt)


def test_gather_pages_into_slot_stride_and_back():
    layers, pages = 4, 9
    mem = np.random.default_rng(2).integers(0, 256, layers * pages * 512, dtype=np.uint8)
    lay = host.PageLayout.page_first(mem.ctypes.data, layers=layers, pages=pages, page_tokens=2,
                                     heads=2, head_dim=64, item_bytes=2)
    slot = 4096
    slots = np.full(3 * slot, 0xEE, dtype=np.uint8)
    which = [8, 0, 3]
    host.gather_pages(lay, which, slots.ctypes.data + 64, stride=slot, capacity=slots.size - 64)
    for i, p in enumerate(which):
        assert slots[i * slot + 64:i * slot + 64 + lay.blob_bytes].tobytes() == \
            reference_gather(lay, p)
        assert slots[i * slot + 63] == 0xEE and slots[i * slot + 64 + lay.blob_bytes] == 0xEE
    saved = mem.copy()
    mem[:] = 0
    host.scatter_pages(slots.ctypes.data + 64, lay, which, stride=slot, nbytes=slots.size - 64)
    for p in which:
        s = slice(p * layers * 512, (p + 1) * layers * 512)
        assert np.array_equal(mem[s], saved[s])
    with pytest.raises(ValueError, match="appears twice"):
        host.scatter_pages(slots, lay, [1, 1], stride=slot)


def test_gather_each_into_separate_slot_buffers_and_back():
    layers, pages = 3, 6
    mem = np.random.default_rng(6).integers(0, 256, 2 * layers * pages * 256, dtype=np.uint8)
    half = mem.size // 2
    lay = host.PageLayout.layer_first([mem.ctypes.data, mem.ctypes.data + half], layers=layers,
                                      pages=pages, page_tokens=2, heads=1, head_dim=128,
                                      item_bytes=1)
    slots = [np.full(64 + lay.blob_bytes + 16, 0xEE, dtype=np.uint8) for _ in range(3)]
    which = [5, 1, 2]
    host.gather_each(lay, which, [s.ctypes.data + 64 for s in slots], lay.blob_bytes)
    for s, p in zip(slots, which):
        assert s[64:64 + lay.blob_bytes].tobytes() == reference_gather(lay, p)
        assert (s[:64] == 0xEE).all() and (s[64 + lay.blob_bytes:] == 0xEE).all()
    saved = mem.copy()
    mem[:] = 0
    host.scatter_each([s[64:64 + lay.blob_bytes] for s in slots], lay, which)
    orig = host.PageLayout.layer_first([saved.ctypes.data, saved.ctypes.data + half],
                                       layers=layers, pages=pages, page_tokens=2, heads=1,
                                       head_dim=128, item_bytes=1)
    for p in range(pages):
        assert reference_gather(lay, p) == (reference_gather(orig, p) if p in which
                                            else bytes(lay.blob_bytes)), p
    back = [bytearray(lay.blob_bytes) for _ in which]
    host.gather_each(lay, which, back)
    assert [bytes(b) for b in back] == [s[64:64 + lay.blob_bytes].tobytes() for s in slots]
    with pytest.raises(ValueError, match="pages and dsts differ in length: 3 pages, 2 destinations"):
        host.gather_each(lay, which, back[:2])
    with pytest.raises(ValueError, match="appears twice"):
        host.scatter_each(back[:2], lay, [1, 1])
    with pytest.raises(ValueError, match="needed"):
        host.gather_each(lay, [0], [bytearray(lay.blob_bytes - 1)])


def test_copier_threads_and_large_pages():
    c = host.Copier(threads=3)
    assert c.threads == 3
    layers, slice_bytes = 3, 3 * MiB + 5  # large enough for the multi-threaded path
    mem = np.random.default_rng(3).integers(0, 256, 2 * layers * slice_bytes, dtype=np.uint8)
    lay = host.PageLayout.strided(mem.ctypes.data, component_bytes=mem.size, layers=layers,
                                  pages=2, slice_bytes=slice_bytes, layer_stride=2 * slice_bytes,
                                  page_stride=slice_bytes)
    out = np.empty(lay.blob_bytes, dtype=np.uint8)
    c.gather(lay, 1, out)
    assert out.tobytes() == reference_gather(lay, 1)
    with pytest.raises(ValueError, match="threads must be"):
        host.Copier(threads=0)


@pytest.mark.parametrize("kw,needle", [
    (dict(layers=0), "layers must be positive"),
    (dict(slice_bytes=0), "slice_bytes must be positive"),
    (dict(page_stride=32), "slices overlap"),
    (dict(layer_stride=256), "strides must nest"),
    (dict(component_bytes=2047), "out of range"),
    (dict(layer_stride=2**63), r"layer_stride must be an int in \[0, "),
    (dict(page_stride=-1), r"page_stride must be an int in \[0, .*got -1"),
])
def test_bad_layouts_rejected(kw, needle):
    mem = np.zeros(1 << 16, dtype=np.uint8)
    args = dict(component_bytes=mem.size, layers=4, pages=8, slice_bytes=64, layer_stride=512,
                page_stride=64)
    args.update(kw)
    with pytest.raises(ValueError, match=needle):
        host.PageLayout.strided(mem.ctypes.data, **args)


def test_bad_gather_arguments():
    mem = np.zeros(4 * 8 * 64, dtype=np.uint8)
    lay = host.PageLayout.layer_first(mem.ctypes.data, layers=4, pages=8, page_tokens=1, heads=1,
                                      head_dim=64, item_bytes=1)
    with pytest.raises(ValueError, match=r"page must be an int in \[0, 7\], got 8"):
        host.gather(lay, 8, bytearray(lay.blob_bytes))
    with pytest.raises(ValueError, match="needed"):
        host.gather(lay, 0, bytearray(lay.blob_bytes - 1))
    with pytest.raises(ValueError, match="read-only"):
        host.gather(lay, 0, bytes(lay.blob_bytes))
    with pytest.raises(ValueError, match="raw address"):
        host.gather(lay, 0, mem.ctypes.data)
    with pytest.raises(ValueError, match="needed"):
        host.scatter(b"x" * (lay.blob_bytes - 1), lay, 0)
    with pytest.raises(ValueError, match="components 0 and 1 overlap"):
        host.PageLayout.layer_first([mem.ctypes.data, mem.ctypes.data + 64], layers=4, pages=8,
                                    page_tokens=1, heads=1, head_dim=64, item_bytes=1)


def test_gather_from_a_pool_slab():
    """A layout over pool memory: a page_first KV arena in slab 1."""
    with small_pool(pages=6, page=8192, ceiling=3 * 8192) as pool:
        arr = pool.slab_array(1)
        arr[:] = np.arange(arr.size, dtype=np.uint64).astype(np.uint8)
        lay = host.PageLayout.page_first(pool.slab_address(1), layers=4, pages=3, page_tokens=1,
                                         heads=1, head_dim=2048, item_bytes=1)
        blob = bytearray(lay.blob_bytes)
        host.gather(lay, 2, blob)
        assert bytes(blob) == arr[2 * 8192:3 * 8192].tobytes()


# ---- GPU --------------------------------------------------------------------------------------


def _emulated_driver() -> str | None:
    fake = os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA")
    return fake if fake and os.path.exists(fake) else None


@pytest.mark.skipif(_emulated_driver() is None,
                    reason="VITRIFY_TEST_FAKE_LIBCUDA not set or not built (make test sets it)")
@pytest.mark.parametrize("abi", ["13000", "12080"])
def test_gpu_tests_pass_on_the_host_emulated_driver(abi):
    """The gpu tests below, on the fake driver with one device (tests/cpp/fake_cuda/host.cpp):
    it refuses batch copies whose host range straddles two registrations, so the byte-exact
    checks have teeth on CPU."""
    env = dict(os.environ, VITRIFY_LIBCUDA_PATH=_emulated_driver(), FAKE_CUDA_DEVICES="1",
               FAKE_CUDA_VERSION=abi)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                        "no:cacheprovider", __file__], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 passed" in r.stdout, r.stdout


def _pattern(pages: int, page_bytes: int, salt: int) -> np.ndarray:
    i = np.arange(pages * page_bytes, dtype=np.uint64)
    return ((i * 7 + salt) ^ (i >> 9)).astype(np.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["batch", "loop"])
def test_gpu_transfers_across_slabs_byte_exact(path):
    if path == "batch" and not host.batch_copy_available():
        pytest.skip("driver has no cuMemcpyBatchAsync")
    page = 12 * KiB
    with host.HostPool(40 * page, page, max_slab_bytes=64 * KiB, register=True) as pool:
        assert pool.num_slabs == 8 and pool.registered
        data = _pattern(40, page, 1)
        for s in range(pool.num_slabs):
            sl = pool.slabs()[s]
            pool.slab_array(s)[:] = data[sl["first_page"] * page:(sl["first_page"] + sl["pages"]) * page]
        dev = vitrify._native.DeviceBuffer(32 * page, 0)
        stream = host.Stream(0)
        runs = [(3, 30, dev.ptr), (39, 1, dev.ptr + 30 * page), (0, 1, dev.ptr + 31 * page)]
        st = pool.to_device(runs, stream, path=path)
        stream.synchronize()
        assert st["path"] == path and st["bytes"] == 32 * page and st["copies"] == 9
        got = np.frombuffer(dev.read(32 * page), dtype=np.uint8)
        want = np.concatenate([data[3 * page:33 * page], data[39 * page:40 * page], data[:page]])
        assert np.array_equal(got, want)
        # Device -> host into the same pages.
        fresh = _pattern(32, page, 2)
        dev.write(fresh.tobytes())
        pool.to_host(runs, stream, path=path)
        stream.synchronize()
        now = np.concatenate([pool.slab_array(s) for s in range(pool.num_slabs)])
        want_host = data.copy()
        want_host[3 * page:33 * page] = fresh[:30 * page]
        want_host[39 * page:] = fresh[30 * page:31 * page]
        want_host[:page] = fresh[31 * page:]
        assert np.array_equal(now, want_host)


@pytest.mark.gpu
def test_gpu_registration_serial_vs_parallel_recorded():
    times = {}
    for parallel in (False, True):
        with host.HostPool(512 * MiB, 2 * MiB, max_slab_bytes=64 * MiB, register=True,
                           parallel=parallel) as pool:
            r = pool.registration()
            assert r["registered"] and r["parallel"] == parallel
            assert len(r["slab_seconds"]) == 8 and all(s > 0 for s in r["slab_seconds"])
            times[parallel] = r["seconds"]
    print(f"registration 512 MiB / 8 slabs: serial {times[False]:.3f} s, "
          f"parallel {times[True]:.3f} s")


def _torch_has_cuda() -> bool:
    # torch has its own CUDA runtime (not vitrify's driver seam): a CPU-only torch, or a CUDA
    # build on a machine without a GPU (e.g. under the host-emulated driver), cannot run this.
    if not HAVE_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _torch_has_cuda(), reason="torch is not installed or has no CUDA device")
def test_gpu_torch_stream_and_tensor():
    import torch

    page = 64 * KiB
    with host.HostPool(16 * page, page, max_slab_bytes=4 * page, register=True) as pool:
        for s in range(pool.num_slabs):
            pool.slab_tensor(s).copy_(torch.arange(4 * page, dtype=torch.int64).to(torch.uint8))
        dst = torch.zeros(16 * page, dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        st = pool.to_device((0, 16, dst.data_ptr()), s)
        s.synchronize()
        assert st["copies"] == 4
        want = torch.cat([pool.slab_tensor(i) for i in range(pool.num_slabs)])
        assert torch.equal(dst.cpu(), want)
        cur = torch.cuda.current_stream()
        dst.zero_()
        st = pool.to_device((0, 16, dst.data_ptr()), cur)
        torch.cuda.synchronize()
        if cur.cuda_stream == 0:  # the legacy default stream: the batch API refuses it
            assert st["path"] == "loop"
        assert torch.equal(dst.cpu(), want)
