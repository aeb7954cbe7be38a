"""VitrifyStorage's v2 (multi-pool) API against SGLang's own reference, HiCacheFile, on CPU.

The host pools are SGLang's real ones, grouped the way its hybrid pool assembler groups them
(``HostPoolGroup`` of ``PoolEntry``): the KV pool and an SWA pool are ``MHATokenToKVPoolHost``
over CPU device pools, the Mamba pool is a real ``MambaPoolHost``. The one stand-in: the Mamba
*device* pool the host pool copies its shapes from is a small namespace with real CPU tensors
(``num_mamba_layers``, ``size``, ``device``, ``mamba_cache.conv`` / ``.temporal``), because
SGLang's ``MambaPool`` needs a model's linear-state parameters; ``MambaPoolHost`` reads nothing
else from it on the storage path. The differential tests drive HiCacheFile (in a tmp dir) and
VitrifyStorage with the same v2 calls on the same pools and compare results and bytes.
"""

from __future__ import annotations

import logging
import types

import pytest

import hicache_cases

pytestmark = pytest.mark.sglang

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile, HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer,
    PoolTransferResult)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.memory_pool_host import (  # noqa: E402
    HostPoolGroup, MambaPoolHost, PoolEntry)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from vitrify import disk  # noqa: E402
from vitrify.integrations.sglang.hicache import VitrifyStorage, VitrifyStorageSettings  # noqa: E402

PAGE = 16
HEADS, DIM = 2, 64
KV_LAYERS, SWA_LAYERS = 4, 2
KV_BLOB = 2 * KV_LAYERS * PAGE * HEADS * DIM * 2     # 32 KiB
SWA_BLOB = 2 * SWA_LAYERS * PAGE * HEADS * DIM * 2   # 16 KiB
M_LAYERS = 3
MAMBA_BLOB = M_LAYERS * (4 * 3 * 2 + 2 * 4 * 8 * 4)  # conv bf16 (4,3) + temporal fp32 (2,4,8)
TRAILING = PoolHitPolicy.TRAILING_PAGES
ALL = PoolHitPolicy.ALL_PAGES


def _mha(layers, layout, tokens=512):
    dev = MHATokenToKVPool(size=tokens, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
                           head_dim=DIM, layer_num=layers, device="cpu",
                           enable_memory_saver=False, enable_alt_stream=False)
    return dev, MHATokenToKVPoolHost(dev, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")


def _mamba(layout="page_first", slots=32):
    dev = types.SimpleNamespace(
        num_mamba_layers=M_LAYERS, size=slots, device="cpu",
        mamba_cache=types.SimpleNamespace(
            conv=[torch.zeros(M_LAYERS, slots + 1, 4, 3, dtype=torch.bfloat16)],
            temporal=torch.zeros(M_LAYERS, slots + 1, 2, 4, 8, dtype=torch.float32)))
    return dev, MambaPoolHost(dev, 2.0, 0, pin_memory=False, device="cpu", layout=layout)


class Stack:
    """KV + SWA + Mamba host pools in SGLang's HostPoolGroup, and random fills."""

    def __init__(self, layout="page_first", mamba_layout="page_first"):
        kv_dev, self.kv = _mha(KV_LAYERS, layout)
        swa_dev, self.swa = _mha(SWA_LAYERS, layout)
        m_dev, self.mamba = _mamba(mamba_layout)
        ident = lambda i: i  # noqa: E731
        self.entries = [
            PoolEntry(PoolName.KV, self.kv, kv_dev, ident, is_primary_index_anchor=True),
            PoolEntry(PoolName.SWA, self.swa, swa_dev, ident),
            PoolEntry(PoolName.MAMBA, self.mamba, m_dev, ident),
        ]
        self.group = HostPoolGroup(self.entries)

    def fill(self, seed):
        g = torch.Generator().manual_seed(seed)
        for buf in (self.kv.kv_buffer, self.swa.kv_buffer, self.mamba.temporal_buffer,
                    *self.mamba.conv_buffer):
            flat = buf.view(-1)
            flat.copy_(torch.randn(flat.numel(), generator=g).to(flat.dtype))

    def zero(self):
        for buf in (self.kv.kv_buffer, self.swa.kv_buffer, self.mamba.temporal_buffer,
                    *self.mamba.conv_buffer):
            buf.zero_()

    def pool(self, name):
        return {PoolName.KV: self.kv, PoolName.SWA: self.swa, PoolName.MAMBA: self.mamba}[name]


def _pages(pool, idx, n):
    ps = pool.page_size
    return [pool.get_data_page(int(idx[i * ps]), flat=True).view(torch.uint8).clone()
            for i in range(n)]


def _keys(n, salt=0):
    return get_hash_str(list(range(salt, salt + n * PAGE)), None, page_size=PAGE)


def _config(extra, model="org/hybrid-model"):
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=False,
        model_name=model, extra_config=dict(extra))


_extra = hicache_cases.extra_config


def _vitrify(stack, d, **kw) -> VitrifyStorage:
    """What HybridCacheController.attach_storage_backend does: factory, v1 pool, v2 entries."""
    b = StorageBackendFactory.create_backend("dynamic", _config(_extra(d, **kw)), stack.group)
    b.register_mem_pool_host(stack.group)
    for e in stack.entries:
        b.register_mem_host_pool_v2(e.host_pool, e.name)
    return b


def _file(stack, d, monkeypatch) -> HiCacheFile:
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    f = HiCacheFile(_config({}), file_path=str(d))
    f.register_mem_pool_host(stack.group)
    for e in stack.entries:
        f.register_mem_host_pool_v2(e.host_pool, e.name)
    return f


def _xfer(name, keys, idx, policy=ALL):
    return PoolTransfer(name=name, host_indices=idx, keys=list(keys), hit_policy=policy)


def _same_set(a, b, transfers):
    ra, rb = a.batch_set_v2(transfers), b.batch_set_v2(transfers)
    assert ra == rb, f"batch_set_v2 differs: vitrify {ra} file {rb}"
    return ra


def _same_exists(a, b, keys, transfers):
    ra, rb = a.batch_exists_v2(keys, transfers), b.batch_exists_v2(keys, transfers)
    assert isinstance(ra, PoolTransferResult)
    assert (ra.kv_hit_pages, ra.extra_pool_hit_pages) == \
        (rb.kv_hit_pages, rb.extra_pool_hit_pages), f"exists differs: vitrify {ra} file {rb}"
    return ra


def _same_get(stack, a, b, transfers, want=None):
    """Both backends read the same transfers into the pools; results and bytes must agree
    (and equal ``want[name][i]`` for every hit when given)."""
    stack.zero()
    ra = a.batch_get_v2(transfers)
    got_a = {t.name: _pages(stack.pool(t.name), t.host_indices, len(t.keys)) for t in transfers}
    stack.zero()
    rb = b.batch_get_v2(transfers)
    got_b = {t.name: _pages(stack.pool(t.name), t.host_indices, len(t.keys)) for t in transfers}
    assert ra == rb, f"batch_get_v2 differs: vitrify {ra} file {rb}"
    for t in transfers:
        for i, ok in enumerate(ra[t.name]):
            if ok:
                assert torch.equal(got_a[t.name][i], got_b[t.name][i]), \
                    f"{t.name} page {i}: vitrify and file read different bytes"
                if want is not None:
                    assert torch.equal(got_a[t.name][i], want[t.name][i]), \
                        f"{t.name} page {i} differs from what was written"
    return ra


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_differential_set_exists_get_against_hicachefile(tmp_path, monkeypatch, layout):
    s = Stack(layout)
    s.fill(1)
    th = _vitrify(s, tmp_path / "vitrify")
    fb = _file(s, tmp_path / "file", monkeypatch)
    try:
        n = 6
        keys = _keys(n)
        kv_idx, swa_idx, m_idx = s.kv.alloc(n * PAGE), s.swa.alloc(n * PAGE), s.mamba.alloc(n)
        want = {PoolName.KV: _pages(s.kv, kv_idx, n), PoolName.SWA: _pages(s.swa, swa_idx, n),
                PoolName.MAMBA: _pages(s.mamba, m_idx, n)}
        # KV: all 6 pages. SWA: all but page 2 (a hole in the middle). Mamba: pages 2, 3, 5
        # (page 4 missing, the tail page present).
        swa_have = [0, 1, 3, 4, 5]
        m_have = [2, 3, 5]

        def sub(idx, pages, ps):
            return torch.cat([idx[i * ps:(i + 1) * ps] for i in pages])

        r = _same_set(th, fb, [
            _xfer(PoolName.KV, keys, kv_idx),
            _xfer(PoolName.SWA, [keys[i] for i in swa_have], sub(swa_idx, swa_have, PAGE)),
            _xfer(PoolName.MAMBA, [keys[i] for i in m_have], sub(m_idx, m_have, 1), TRAILING),
        ])
        assert r[PoolName.KV] == [True] * 6 and r[PoolName.MAMBA] == [True] * 3
        # writing again dedups and still answers True, like the file backend
        _same_set(th, fb, [_xfer(PoolName.SWA, keys[:2], swa_idx[:2 * PAGE])])

        cases = [
            [],                                                          # KV only
            [_xfer(PoolName.SWA, keys, swa_idx)],                        # all_pages: hole at 2
            [_xfer(PoolName.MAMBA, keys[-1:], m_idx[-1:], TRAILING)],    # tail page present
            [_xfer(PoolName.MAMBA, keys[-2:], m_idx[-2:], TRAILING)],    # last 2: (2,3) only
            [_xfer(PoolName.MAMBA, keys[-3:], m_idx[-3:], TRAILING)],    # 3 in a row: none
            [_xfer(PoolName.MAMBA, keys[-1:], m_idx[-1:], TRAILING),
             _xfer(PoolName.SWA, keys, swa_idx)],                        # min over pools
            [_xfer(PoolName.KV, keys, kv_idx)],                          # kv as a transfer
        ]
        expect = [6, 2, 6, 4, 0, 2, 6]
        for case, exp in zip(cases, expect):
            assert _same_exists(th, fb, keys, case).kv_hit_pages == exp, case
        # more keys than stored: the KV prefix stops at the tail
        longer = keys + _keys(2, salt=50_000)
        assert _same_exists(th, fb, longer, cases[2]).kv_hit_pages == 6
        assert _same_exists(th, fb, _keys(3, salt=90_000), cases[1]).kv_hit_pages == 0

        ra = _same_get(s, th, fb, [_xfer(PoolName.KV, keys, kv_idx),
                                   _xfer(PoolName.SWA, keys, swa_idx),
                                   _xfer(PoolName.MAMBA, keys, m_idx, TRAILING)], want)
        assert ra[PoolName.SWA] == [i in swa_have for i in range(6)]
        assert ra[PoolName.MAMBA] == [i in m_have for i in range(6)]
        s_ = th.vitrify_stats()
        assert s_["extra_pools"]["mamba"]["get_pages"] == 3
        assert s_["extra_pools"]["swa"]["set_dedup"] == 2
    finally:
        th.close()


def test_mamba_layer_first_host_layout(tmp_path, monkeypatch):
    """MambaPoolHost's other layout (SGLang asserts page_first*, so page_first_direct)."""
    s = Stack("page_first", mamba_layout="page_first_direct")
    s.fill(2)
    th, fb = _vitrify(s, tmp_path / "t"), _file(s, tmp_path / "f", monkeypatch)
    try:
        keys, idx = _keys(3), s.mamba.alloc(3)
        want = {PoolName.MAMBA: _pages(s.mamba, idx, 3)}
        kv_idx = s.kv.alloc(3 * PAGE)
        _same_set(th, fb, [_xfer(PoolName.KV, keys, kv_idx), _xfer(PoolName.MAMBA, keys, idx)])
        assert _same_get(s, th, fb, [_xfer(PoolName.MAMBA, keys, idx)], want) == \
            {PoolName.MAMBA: [True] * 3}
    finally:
        th.close()


def test_restart_load_keeps_v2_pages_and_clear_drops_them(tmp_path, monkeypatch):
    s = Stack()
    s.fill(3)
    keys = _keys(4)
    kv_idx, swa_idx, m_idx = s.kv.alloc(4 * PAGE), s.swa.alloc(4 * PAGE), s.mamba.alloc(1)
    want = {PoolName.SWA: _pages(s.swa, swa_idx, 4), PoolName.MAMBA: _pages(s.mamba, m_idx, 1)}
    xs = [_xfer(PoolName.KV, keys, kv_idx), _xfer(PoolName.SWA, keys, swa_idx),
          _xfer(PoolName.MAMBA, keys[-1:], m_idx, TRAILING)]
    th = _vitrify(s, tmp_path / "t")
    assert th.batch_set_v2(xs) == {n: [True] * len(t.keys) for n, t in
                                   zip([PoolName.KV, PoolName.SWA, PoolName.MAMBA], xs)}
    paths = {k: ep["name"] for k, ep in th.vitrify_stats()["extra_pools"].items()}
    th.close()
    files = sorted(p.name for p in (tmp_path / "t").iterdir())
    assert any("-swa-tp0of1-pp0of1-cp0of1" in f for f in files), files
    assert any("-mamba-tp0of1-pp0of1-cp0of1" in f for f in files), files
    assert paths["swa"] != paths["mamba"]

    th2 = _vitrify(s, tmp_path / "t", cold_start="load")
    fb = _file(s, tmp_path / "f", monkeypatch)
    try:
        fb.batch_set_v2(xs)
        assert _same_exists(th2, fb, keys, xs[1:]).kv_hit_pages == 4
        got = _same_get(s, th2, fb, xs[1:], want)
        assert got == {PoolName.SWA: [True] * 4, PoolName.MAMBA: [True]}
        assert th2.vitrify_stats()["extra_pools"]["swa"]["store"]["loaded_entries"] == 4
        assert th2.clear() is True and fb.clear() is True
        assert _same_exists(th2, fb, keys, xs[1:]).kv_hit_pages == 0
        assert _same_get(s, th2, fb, xs) == {PoolName.KV: [False] * 4,
                                             PoolName.SWA: [False] * 4,
                                             PoolName.MAMBA: [False]}
        # still usable after clear
        assert th2.batch_set_v2(xs[2:]) == {PoolName.MAMBA: [True]}
    finally:
        th2.close()
    th3 = _vitrify(s, tmp_path / "t", cold_start="load")  # cleared pages stay gone
    try:
        st = th3.vitrify_stats()["extra_pools"]
        assert st["swa"]["store"]["kinds"]["kv"]["entries"] == 0
        assert st["mamba"]["store"]["kinds"]["kv"]["entries"] == 1
    finally:
        th3.close()


def _flip_payload_byte(path, key, slot_bytes, at=100):
    k = disk.make_key(key)
    data = open(path, "rb").read()
    off = 4096
    while off + slot_bytes <= len(data):
        if k in data[off:off + disk.SLOT_HEADER_BYTES]:
            break
        off += slot_bytes
    else:
        raise AssertionError(f"no slot holds {key!r} in {path}")
    pos = off + disk.SLOT_HEADER_BYTES + at
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupted_extra_pool_slab_is_a_miss(tmp_path):
    s = Stack()
    s.fill(4)
    keys, idx = _keys(3), s.mamba.alloc(3)
    want = _pages(s.mamba, idx, 3)
    th = _vitrify(s, tmp_path)
    assert th.batch_set_v2([_xfer(PoolName.MAMBA, keys, idx)]) == {PoolName.MAMBA: [True] * 3}
    st = th.vitrify_stats()["extra_pools"]["mamba"]["store"]
    mamba_store = next(ep for n, ep in th._extra.items() if n == "mamba").store
    path = mamba_store.slab_path("kv", 0)
    th.close()
    _flip_payload_byte(path, keys[1], st["kinds"]["kv"]["slot_bytes"])
    th2 = _vitrify(s, tmp_path, cold_start="load")
    try:
        s.zero()
        assert th2.batch_get_v2([_xfer(PoolName.MAMBA, keys, idx)]) == \
            {PoolName.MAMBA: [True, False, True]}
        got = _pages(s.mamba, idx, 3)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        assert not torch.equal(got[1], want[1])  # the bad page was not written into the pool
        assert th2.vitrify_stats()["extra_pools"]["mamba"]["store"]["verify_failures"] == 1
    finally:
        th2.close()


def test_unknown_and_twice_registered_pools_are_clean_false(tmp_path, caplog):
    s = Stack()
    s.fill(5)
    th = _vitrify(s, tmp_path)
    keys, idx = _keys(2), s.mamba.alloc(2)
    try:
        caplog.set_level(logging.INFO, logger="vitrify.sglang.hicache")
        # an unknown pool name (HiCacheFile raises KeyError here; vitrify answers False)
        r = th.batch_set_v2([_xfer(PoolName.INDEXER, keys, idx),
                             _xfer(PoolName.MAMBA, keys, idx)])
        assert r == {PoolName.INDEXER: [False, False], PoolName.MAMBA: [True, True]}
        assert th.batch_get_v2([_xfer("no-such-pool", keys, idx)]) == \
            {"no-such-pool": [False, False]}
        assert "no such pool registered" in caplog.text
        # the same pool again: harmless
        th.register_mem_host_pool_v2(s.mamba, PoolName.MAMBA)
        assert "registered again" in caplog.text
        assert th.batch_get_v2([_xfer(PoolName.MAMBA, keys, idx)]) == \
            {PoolName.MAMBA: [True, True]}
        # another pool under the same name: refused from now on, with a log line
        _, other = _mamba()
        th.register_mem_host_pool_v2(other, PoolName.MAMBA)
        assert "registered twice with different pools" in caplog.text
        assert th.batch_get_v2([_xfer(PoolName.MAMBA, keys, idx)]) == \
            {PoolName.MAMBA: [False, False]}
        assert th.batch_set_v2([_xfer(PoolName.MAMBA, keys, idx)]) == \
            {PoolName.MAMBA: [False, False]}
        assert th.batch_exists_v2(keys, [_xfer(PoolName.MAMBA, keys, idx)]).kv_hit_pages == 0
        # the other pools are unaffected; a length mismatch is all False, never raises
        sw = s.swa.alloc(2 * PAGE)
        assert th.batch_set_v2([_xfer(PoolName.SWA, keys, sw[:PAGE])]) == \
            {PoolName.SWA: [False, False]}
        assert th.batch_set_v2([_xfer(PoolName.SWA, keys, sw)]) == {PoolName.SWA: [True, True]}
        assert th.vitrify_stats()["v2_refused"] >= 4
    finally:
        th.close()
    # closed: everything is a clean miss
    assert th.batch_get_v2([_xfer(PoolName.SWA, keys, sw)]) == {PoolName.SWA: [False, False]}
    assert th.batch_exists_v2(keys, []).kv_hit_pages == 0


def test_pool_outside_the_group_gets_no_budget(tmp_path, caplog):
    """A pool that was not an entry of the registered HostPoolGroup has no disk budget."""
    s = Stack()
    th = _vitrify(s, tmp_path)
    try:
        _, extra = _mha(SWA_LAYERS, "page_first")
        th.register_mem_host_pool_v2(extra, PoolName.INDEXER)
        assert "no disk budget" in caplog.text
        keys = _keys(1)
        assert th.batch_set_v2([_xfer(PoolName.INDEXER, keys, extra.alloc(PAGE))]) == \
            {PoolName.INDEXER: [False]}
        assert th.vitrify_stats()["extra_pools"]["indexer"]["refused"]
    finally:
        th.close()


def test_kv_transfer_through_another_pool_is_refused(tmp_path, caplog):
    """v2 'kv' transfers use the v1 KV store; a 'kv' pool that is not the v1 pool's KV
    buffer would mix two geometries in one key space, so it is refused."""
    s = Stack()
    s.fill(6)
    b = StorageBackendFactory.create_backend("dynamic", _config(_extra(tmp_path)), s.group)
    b.register_mem_pool_host(s.group)
    _, other = _mha(KV_LAYERS, "page_first")
    b.register_mem_host_pool_v2(other, PoolName.KV)
    try:
        keys = _keys(1)
        assert b.batch_set_v2([_xfer(PoolName.KV, keys, other.alloc(PAGE))]) == \
            {PoolName.KV: [False]}
        assert "not the KV buffer" in caplog.text
    finally:
        b.close()


def test_budget_split_default_and_explicit(tmp_path):
    s = Stack()
    budget = 16 << 20
    th = _vitrify(s, tmp_path / "a")
    try:
        st = th.vitrify_stats()
        ex = st["extra_pools"]
        p = SWA_BLOB + MAMBA_BLOB
        e = int(budget * min(0.5, p / (KV_BLOB + p)))
        assert st["budget_bytes"] == budget - e
        assert ex["swa"]["budget_bytes"] == e * SWA_BLOB // p
        assert ex["mamba"]["budget_bytes"] == e * MAMBA_BLOB // p
        assert ex["swa"]["page_bytes"] == SWA_BLOB and ex["mamba"]["page_bytes"] == MAMBA_BLOB
        assert st["budget_bytes"] + ex["swa"]["budget_bytes"] + \
            ex["mamba"]["budget_bytes"] <= budget
    finally:
        th.close()
    th = _vitrify(s, tmp_path / "b", extra_pool_budget_bytes=4 << 20)
    try:
        st = th.vitrify_stats()
        assert st["budget_bytes"] == budget - (4 << 20)
        assert st["extra_pools"]["swa"]["budget_bytes"] == \
            (4 << 20) * SWA_BLOB // (SWA_BLOB + MAMBA_BLOB)
    finally:
        th.close()


def test_plain_pool_keeps_the_whole_budget(tmp_path):
    """Without a HostPoolGroup (non-hybrid models) the KV store keeps all of budget_bytes."""
    _, kv = _mha(KV_LAYERS, "page_first")
    b = StorageBackendFactory.create_backend("dynamic", _config(_extra(tmp_path)), kv)
    b.register_mem_pool_host(kv)
    try:
        assert b.vitrify_stats()["budget_bytes"] == 16 << 20
        assert b.vitrify_stats()["extra_pools"] == {}
    finally:
        b.close()


@pytest.mark.parametrize("bad", [-1, 16 << 20, 1.5, True, "1"])
def test_extra_pool_budget_validation(tmp_path, bad):
    with pytest.raises(ValueError, match="extra_pool_budget_bytes"):
        VitrifyStorageSettings.from_extra_config(
            {"dirs": str(tmp_path), "budget_bytes": 16 << 20, "extra_pool_budget_bytes": bad})


def test_get_stats_counts_v2_batches(tmp_path):
    s = Stack()
    s.fill(7)
    th = _vitrify(s, tmp_path)
    try:
        keys, idx = _keys(3), s.mamba.alloc(3)
        th.get_stats()
        th.batch_set_v2([_xfer(PoolName.MAMBA, keys, idx)])
        th.batch_get_v2([_xfer(PoolName.MAMBA, keys, idx)])
        m = th.get_stats()
        assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
    finally:
        th.close()


def test_hybrid_cache_controller_round_trip(tmp_path, monkeypatch):
    """SGLang's real HybridCacheController (as its hybrid Mamba stack builds it, on the
    HostPoolGroup): attach registers every entry through register_mem_host_pool_v2; a backup
    writes KV through batch_set_v1 and the Mamba state through batch_set_v2; a prefetch asks
    batch_exists_v2, reads KV back through batch_get_v1 and the state through batch_get_v2.
    Test seam as in test_sglang_hicache.py: torch.cpu stands in for the device module."""
    import threading
    import time

    import sglang.srt.managers.cache_controller as ccm
    import sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller as hcm
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setattr(ccm, "device_module", torch.cpu)
    monkeypatch.setattr(hcm, "device_module", torch.cpu)
    s = Stack()
    s.fill(8)
    kv_dev = s.entries[0].device_pool
    alloc = PagedTokenToKVPoolAllocator(kv_dev.size, PAGE, torch.bfloat16, "cpu", kv_dev, False)
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        cc = hcm.HybridCacheController(
            alloc, s.group, PAGE, tp_group=None, load_cache_event=threading.Event(),
            io_backend="direct", prefetch_threshold=PAGE, storage_backend="dynamic",
            model_name="org/hybrid-model", storage_backend_extra_config=_extra(tmp_path))
    try:
        assert isinstance(cc.storage_backend, VitrifyStorage)
        assert sorted(cc.storage_backend._extra) == ["mamba", "swa"]
        n = 4
        tokens, keys = list(range(n * PAGE)), _keys(n)
        idx, m = s.kv.alloc(n * PAGE), s.mamba.alloc(1)
        want_kv, want_m = _pages(s.kv, idx, n), _pages(s.mamba, m, 1)[0]
        cc.write_storage(idx, tokens, hash_value=keys, extra_pools=[
            PoolTransfer(PoolName.MAMBA, host_indices=m, keys=keys[-1:], hit_policy=TRAILING)])
        op = cc.ack_backup_queue.get(timeout=20)
        assert op.completed_tokens == n * PAGE
        assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1}

        s.zero()
        m2 = s.mamba.alloc(1)
        cc.prefetch("req", tokens, extra_pools=[
            PoolTransfer(PoolName.MAMBA, host_indices=m2, keys=keys[-1:], hit_policy=TRAILING)])
        op = cc.prefetch_hit_queue.get(timeout=20)
        assert op.storage_hit_count == n * PAGE
        got_idx = s.kv.alloc(n * PAGE)
        op.host_indices = got_idx
        cc.prefetch_buffer.put(op)
        t = time.monotonic()
        while not (op.completed_tokens >= n * PAGE and op.pool_transfers_done) \
                and time.monotonic() - t < 20:
            time.sleep(0.01)
        assert op.completed_tokens == n * PAGE and op.pool_transfers_done
        assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1}
        for i, page in enumerate(_pages(s.kv, got_idx, n)):
            assert torch.equal(page, want_kv[i]), f"KV page {i} differs"
        assert torch.equal(_pages(s.mamba, m2, 1)[0], want_m), "Mamba state differs"
    finally:
        cc.detach_storage_backend()
