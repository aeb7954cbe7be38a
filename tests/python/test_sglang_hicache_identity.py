"""The storage identity of VitrifyStorage (DESIGN.md invariants 10-12): a page stored under one
identity is a miss under any other, and a hit under the same one, for every field: model name and
path, weights revision and version (SGLang's published server args, the extra config, and
``set_weight_version`` after a weight update), quantization, KV cache dtype, the host pool's dtype,
page size and layout, and the parallel slice. Pools, keys and server args are SGLang's own
(``get_context()`` is the process-wide ServerArgs slot the scheduler publishes).
"""

from __future__ import annotations

import os
import types

import pytest

import hicache_cases

pytestmark = pytest.mark.sglang

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402

from test_sglang_hicache import PAGE, _backend, _fill_random, _keys, _mha_host, _pages  # noqa: E402
from test_sglang_hicache_v2 import Stack, _vitrify, _xfer  # noqa: E402
from test_sglang_hicache_v2 import _keys as _v2_keys  # noqa: E402

_extra = hicache_cases.extra_config

# What SGLang's scheduler publishes; every test starts from these values.
BASE_ARGS = {"model_path": "/models/org/tiny-model", "revision": "r1", "weight_version": "w1",
             "quantization": None, "kv_cache_dtype": "auto"}


@pytest.fixture(autouse=True)
def server_args(monkeypatch):
    """Publish ServerArgs-like values in SGLang's runtime context (restored after the test)."""
    args = types.SimpleNamespace(**BASE_ARGS)
    monkeypatch.setattr(get_context(), "_server_args", args)
    return args


def _store_and_close(tmp_path, host, n, **kw):
    _fill_random(host, 21)
    idx = host.alloc(n * PAGE)
    want = _pages(host, idx, n)
    _, keys = _keys(n)
    b = _backend(host, _extra(tmp_path), **kw)
    assert b.batch_set_v1(keys, idx) == [True] * n
    b.close()
    return keys, want


def _found(tmp_path, host, keys, **kw):
    """batch_exists, batch_get_v1 and the pages read of a fresh backend (cold_start load) on the
    same disk; a miss must be a miss, never an error."""
    b = _backend(host, _extra(tmp_path), **kw)
    try:
        ps = host.page_size
        dst = host.alloc(len(keys) * ps)
        found = b.batch_exists(keys), b.batch_get_v1(keys, dst)
        assert b.counters()["errors"] == 0
        return (*found, [host.get_data_page(int(dst[i * ps])) for i in range(len(keys))])
    finally:
        b.close()


# Each case changes one field of the identity: (server args, host pool, backend kwargs).
CASES = {
    "model_name": ({}, {}, {"model": "org/other-model"}),
    "model_path": ({"model_path": "/models/org/tiny-model-v2"}, {}, {}),
    "revision": ({"revision": "r2"}, {}, {}),
    "weight_version": ({"weight_version": "w2"}, {}, {}),
    "quantization": ({"quantization": "fp8"}, {}, {}),
    "kv_cache_dtype": ({"kv_cache_dtype": "fp8_e4m3"}, {}, {}),
    "host_dtype": ({}, {"dtype": torch.float16}, {}),
    "page_size": ({}, {"page": PAGE // 2}, {}),
    "layout": ({}, {"layout": "layer_first"}, {}),
    "tp_rank": ({}, {}, {"tp_rank": 1, "tp_size": 2}),
    "tp_size": ({}, {}, {"tp_size": 2}),
}


@pytest.mark.parametrize("field", sorted(CASES))
def test_a_changed_identity_field_is_a_miss_and_the_same_identity_a_hit(tmp_path, server_args,
                                                                         field):
    args, pool, kw = CASES[field]
    host_kw = {"layout": "page_first", "dtype": torch.bfloat16, "page": PAGE}
    _, host = _mha_host(host_kw["layout"], dtype=host_kw["dtype"], page=host_kw["page"])
    keys, want = _store_and_close(tmp_path, host, 3)

    for k, v in args.items():
        setattr(server_args, k, v)
    host_kw.update(pool)
    _, other = _mha_host(host_kw.pop("layout"), **host_kw)
    n, got, _ = _found(tmp_path, other, keys, **kw)
    assert (n, got) == (0, [False] * 3), field

    for k, v in BASE_ARGS.items():   # the unchanged identity: every page, the same bytes
        setattr(server_args, k, v)
    n, got, pages = _found(tmp_path, host, keys)
    assert (n, got) == (3, [True] * 3)
    assert all(torch.equal(p, w) for p, w in zip(pages, want))


@pytest.mark.parametrize("key", ["revision", "weight_version"])
def test_extra_config_revision_and_weight_version_win_over_server_args(tmp_path, key):
    _, host = _mha_host("page_first")
    _fill_random(host, 22)
    idx = host.alloc(PAGE)
    _, keys = _keys(1)
    b = _backend(host, _extra(tmp_path, **{key: "from-config"}))
    try:
        assert b.identity()["model"][key] == "from-config"
        assert b.batch_set_v1(keys, idx) == [True]
    finally:
        b.close()
    for value, hit in (("from-config", 1), ("other", 0)):
        b = _backend(host, _extra(tmp_path, **{key: value}))
        try:
            assert b.batch_exists(keys) == hit, value
        finally:
            b.close()
    n, _, _ = _found(tmp_path, host, keys)   # the server args' value: another identity
    assert n == 0


def test_identity_lists_every_field(tmp_path, server_args):
    server_args.quantization = "awq"
    _, host = _mha_host("page_first")
    b = _backend(host, _extra(tmp_path), tp_rank=1, tp_size=2)
    try:
        ident = b.identity()
        assert ident["model"] == {"model_name": "org/tiny-model", **BASE_ARGS,
                                  "quantization": "awq"}
        assert ident["rank"] == "tp1of2-pp0of1-cp0of1"
        assert "page_first" in ident["pool"] and "torch.bfloat16" in ident["pool"]
        assert ident["store"] in b.slab_paths[0]
    finally:
        b.close()


def test_without_published_server_args_the_identity_has_none(tmp_path, monkeypatch):
    monkeypatch.setattr(get_context(), "_server_args", None)
    _, host = _mha_host("page_first")
    b = _backend(host, _extra(tmp_path))
    try:
        model = b.identity()["model"]
        assert model["model_name"] == "org/tiny-model"
        assert all(model[k] is None for k in BASE_ARGS)
    finally:
        b.close()


@pytest.mark.parametrize("bad", ["", 5, "a\nb", "x" * 257])
@pytest.mark.parametrize("key", ["revision", "weight_version"])
def test_bad_revision_or_weight_version_is_a_one_line_error(tmp_path, key, bad):
    _, host = _mha_host("page_first")
    with pytest.raises(ValueError, match=f"'{key}' must be a string") as e:
        _backend(host, _extra(tmp_path, **{key: bad}))
    assert "\n" not in str(e.value)


def test_set_weight_version_switches_the_identity_of_later_pages(tmp_path, server_args):
    _, host = _mha_host("page_first")
    _fill_random(host, 23)
    idx = host.alloc(4 * PAGE)
    want = _pages(host, idx, 4)
    _, keys = _keys(4)
    b = _backend(host, _extra(tmp_path))
    try:
        assert b.batch_set_v1(keys[:2], idx[:2 * PAGE]) == [True] * 2
        old_slabs = b.slab_paths
        name = b.set_weight_version("w2")
        assert b.identity()["model"]["weight_version"] == "w2"
        assert name == b.identity()["store"] and name in b.slab_paths[0]
        assert b.slab_paths != old_slabs and not any(os.path.exists(p) for p in old_slabs)
        assert b.batch_exists(keys[:2]) == 0      # pages of the old weights: misses
        assert b.batch_set_v1(keys[2:], idx[2 * PAGE:]) == [True] * 2
        assert b.set_weight_version("w2") == name  # unchanged: the same store, pages kept
        assert b.batch_exists(keys[2:]) == 2
        with pytest.raises(ValueError, match="'weight_version' must be a string"):
            b.set_weight_version("")
    finally:
        b.close()
    with pytest.raises(ValueError, match="closed backend"):
        b.set_weight_version("w3")

    server_args.weight_version = "w2"   # a restart with --weight-version w2 finds them
    n, got, pages = _found(tmp_path, host, keys[2:])
    assert (n, got) == (2, [True] * 2)
    assert all(torch.equal(p, w) for p, w in zip(pages, want[2:]))
    server_args.weight_version = "w1"   # and the old version's pages are gone
    assert _found(tmp_path, host, keys[:2])[0] == 0


def test_set_weight_version_before_the_pool_is_registered(tmp_path):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from test_sglang_hicache import _config

    _, host = _mha_host("page_first")
    b = StorageBackendFactory.create_backend("dynamic", _config(_extra(tmp_path)), host)
    assert b.set_weight_version("w7") is None
    b.register_mem_pool_host(host)
    try:
        assert b.identity()["model"]["weight_version"] == "w7"
        assert b.identity()["store"] in b.slab_paths[0]
    finally:
        b.close()


def test_set_weight_version_switches_every_extra_pool(tmp_path):
    stack = Stack()
    stack.fill(24)
    b = _vitrify(stack, tmp_path)
    try:
        keys = _v2_keys(2)
        transfers = [_xfer(PoolName.KV, keys, stack.kv.alloc(2 * PAGE)),
                     _xfer(PoolName.SWA, keys, stack.swa.alloc(2 * PAGE)),
                     _xfer(PoolName.MAMBA, keys, stack.mamba.alloc(2))]
        assert all(r == [True, True] for r in b.batch_set_v2(transfers).values())
        before = {k: e["name"] for k, e in b.vitrify_stats()["extra_pools"].items()}
        b.set_weight_version("w9")
        after = {k: e["name"] for k, e in b.vitrify_stats()["extra_pools"].items()}
        assert sorted(before) == sorted(after) == ["mamba", "swa"]
        assert all(before[k] != after[k] and "w9" not in after[k] for k in before)
        assert all(r == [False, False] for r in b.batch_get_v2(transfers).values())
        assert all(r == [True, True] for r in b.batch_set_v2(transfers).values())
        assert all(r == [True, True] for r in b.batch_get_v2(transfers).values())
        assert b.counters()["errors"] == 0 and b.counters()["v2_refused"] == 0
    finally:
        b.close()


def test_set_weight_version_while_sglang_threads_transfer(tmp_path):
    """Backup and prefetch threads keep calling during switches (invariant 12): no errors, every
    hit has the bytes written under the version then in force, pages of an older version miss."""
    import threading

    _, host = _mha_host("page_first", tokens=1024)
    _fill_random(host, 25)
    src = host.alloc(8 * PAGE)
    want = _pages(host, src, 8)
    _, keys = _keys(8)
    b = _backend(host, _extra(tmp_path))
    problems: list = []
    stop = threading.Event()

    def backup_and_prefetch():
        while not stop.is_set():
            ok = b.batch_set_v1(keys, src)
            if not all(ok):
                problems.append(f"set {ok}")
            dst = host.alloc(8 * PAGE)
            got = b.batch_get_v1(keys, dst)
            pages = _pages(host, dst, 8)
            problems.extend(f"bytes of page {i}" for i in range(8)
                            if got[i] and not torch.equal(pages[i], want[i]))
            host.free(dst)

    t = threading.Thread(target=backup_and_prefetch)
    t.start()
    try:
        names = {b.set_weight_version(f"w{v}") for v in range(2, 7)}
    finally:
        stop.set()
        t.join(60)
    try:
        assert not t.is_alive() and not problems
        assert len(names) == 5 and b.counters()["errors"] == 0
        assert b.identity()["model"]["weight_version"] == "w6"
        slabs = [f for f in os.listdir(tmp_path) if f.endswith(".slab")]
        assert slabs == [os.path.basename(b.slab_paths[0])]   # the old ones were deleted
    finally:
        b.close()


# ---- the host tier (host_bytes): the same identity rules, the pages in /dev/shm ------------------


@pytest.fixture
def shm_dir():
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="vitrify-identity-host-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _wipe(d):
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))


@pytest.mark.parametrize("field", sorted(CASES))
def test_host_tier_a_changed_identity_field_is_a_miss(tmp_path, shm_dir, server_args, field):
    """With the disk slabs removed, only the host tier can answer: a changed identity field
    finds nothing there, the unchanged identity finds every page with its bytes."""
    args, pool, kw = CASES[field]
    host_kw = {"layout": "page_first", "dtype": torch.bfloat16, "page": PAGE}
    _, host = _mha_host(host_kw["layout"], dtype=host_kw["dtype"], page=host_kw["page"])
    extra = _extra(tmp_path, host_bytes=1 << 20, host_dir=shm_dir)
    _fill_random(host, 31)
    idx = host.alloc(3 * PAGE)
    want = _pages(host, idx, 3)
    _, keys = _keys(3)
    b = _backend(host, extra)
    assert b.batch_set_v1(keys, idx) == [True] * 3
    b.close()
    _wipe(tmp_path)

    def found(pool_host, **kw2):
        b = _backend(pool_host, extra, **kw2)
        try:
            ps = pool_host.page_size
            dst = pool_host.alloc(3 * ps)
            r = b.batch_exists(keys), b.batch_get_v1(keys, dst)
            assert b.counters()["errors"] == 0
            return (*r, [pool_host.get_data_page(int(dst[i * ps])) for i in range(3)])
        finally:
            b.close()
            _wipe(tmp_path)

    for k, v in args.items():
        setattr(server_args, k, v)
    host_kw.update(pool)
    _, other = _mha_host(host_kw.pop("layout"), **host_kw)
    n, got, _ = found(other, **kw)
    assert (n, got) == (0, [False] * 3), field
    for k, v in BASE_ARGS.items():
        setattr(server_args, k, v)
    n, got, pages = found(host)
    assert (n, got) == (3, [True] * 3), field
    assert all(torch.equal(p, w) for p, w in zip(pages, want))


def test_host_tier_set_weight_version_removes_the_old_host_slabs(tmp_path, shm_dir):
    _, host = _mha_host("page_first")
    _fill_random(host, 32)
    idx = host.alloc(2 * PAGE)
    _, keys = _keys(2)
    b = _backend(host, _extra(tmp_path, host_bytes=1 << 20, host_dir=shm_dir))
    try:
        assert b.batch_set_v1(keys, idx) == [True] * 2
        old = b.vitrify_stats()["host"]["slab"]
        assert os.path.exists(old)
        b.set_weight_version("w9")
        new = b.vitrify_stats()["host"]["slab"]
        assert new != old and not os.path.exists(old) and os.path.exists(new)
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, host.alloc(2 * PAGE)) == [False] * 2
    finally:
        b.close()
