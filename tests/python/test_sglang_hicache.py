"""VitrifyStorage, the HiCache L3 backend, driven by unmodified SGLang (the pinned release) on CPU.

Everything here uses SGLang's own objects: the storage backend factory (``dynamic`` backend,
extra config naming our module and class), real host KV pools (``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost`` over a CPU device pool), SGLang's page hashes (``get_hash_str``) and,
for the end-to-end tests, a real ``HiCacheController`` whose backup and prefetch threads call
``batch_set_v1`` / ``batch_exists`` / ``batch_get_v1``. The one test seam: the controller module
picks ``torch.cuda`` for its streams and events at import; these tests swap in ``torch.cpu``
(same API, no device), and pin SGLang's parallel context (TP/PP ranks) with its own
``get_parallel().override``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time

import pytest

import hicache_cases

pytestmark = pytest.mark.sglang

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from vitrify import disk  # noqa: E402
from vitrify.integrations.sglang.hicache import VitrifyStorage, VitrifyStorageSettings  # noqa: E402

PAGE = 16            # tokens per page
LAYERS, HEADS, DIM = 4, 2, 64
BLOB = 2 * LAYERS * PAGE * HEADS * DIM * 2   # bytes of one MHA bf16 page: 32 KiB
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


_extra = hicache_cases.extra_config


def _mha_host(layout, tokens=512, dtype=torch.bfloat16, page=PAGE):
    dev = MHATokenToKVPool(size=tokens, page_size=page, dtype=dtype, head_num=HEADS,
                           head_dim=DIM, layer_num=LAYERS, device="cpu",
                           enable_memory_saver=False, enable_alt_stream=False)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, page, layout, pin_memory=False, device="cpu")
    return dev, host


def _mla_host(layout):
    dev = MLATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=64,
                           qk_rope_head_dim=16, layer_num=3, device="cpu",
                           enable_memory_saver=False)
    return MLATokenToKVPoolHost(dev, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")


def _fill_random(host, seed):
    g = torch.Generator().manual_seed(seed)
    flat = host.kv_buffer.view(-1)
    flat.copy_(torch.randn(flat.numel(), generator=g).to(flat.dtype))


def _config(extra, *, tp_rank=0, tp_size=1, model="org/tiny-model", mla=False):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=False, model_name=model, extra_config=dict(extra))


def _backend(host, extra, **kw) -> VitrifyStorage:
    """What SGLang does at attach: factory create, then register the host pool."""
    b = StorageBackendFactory.create_backend("dynamic", _config(extra, **kw), host)
    b.register_mem_pool_host(host)
    return b


def _pages(host, idx, n):
    return [host.get_data_page(int(idx[i * PAGE])).clone() for i in range(n)]


def _read_back(host, extra, keys, want) -> dict:
    """A restarted server (``cold_start="load"`` on ``extra``) reads every key into fresh host
    pages: all hits, every page as ``want``; returns its stats before it closes."""
    b = _backend(host, dict(extra, cold_start="load"))
    try:
        dst = host.alloc(len(keys) * PAGE)
        assert b.batch_get_v1(keys, dst) == [True] * len(keys)
        for i, page in enumerate(_pages(host, dst, len(keys))):
            assert torch.equal(page, want[i])
        return b.vitrify_stats()
    finally:
        b.close()


def _keys(n, salt=0):
    tokens = list(range(salt, salt + n * PAGE))
    return tokens, get_hash_str(tokens, None, page_size=PAGE)


# ---- the real HiCacheController --------------------------------------------------------------


@pytest.fixture
def controller_factory(monkeypatch):
    import sglang.srt.managers.cache_controller as ccm
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    monkeypatch.setattr(ccm, "device_module", torch.cpu)
    made = []

    def make(dev, host, extra):
        alloc = PagedTokenToKVPoolAllocator(dev.size, PAGE, torch.bfloat16, "cpu", dev, False)
        with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
            cc = ccm.HiCacheController(alloc, host, PAGE, tp_group=None,
                                       load_cache_event=threading.Event(), io_backend="direct",
                                       prefetch_threshold=PAGE, storage_backend="dynamic",
                                       model_name="org/tiny-model",
                                       storage_backend_extra_config=dict(extra))
        made.append(cc)
        return cc

    yield make
    for cc in made:
        cc.detach_storage_backend()


def _prefetch(cc, host, tokens, timeout=20.0):
    """What HiRadixCache does for a request: query, allocate host pages, hand over, wait."""
    cc.prefetch("req", tokens)
    op = cc.prefetch_hit_queue.get(timeout=timeout)
    hit = op.storage_hit_count
    idx = host.alloc(hit)
    op.host_indices = idx
    cc.prefetch_buffer.put(op)
    t = time.monotonic()
    while op.completed_tokens < hit and time.monotonic() - t < timeout:
        time.sleep(0.005)
    return op, idx


@pytest.mark.parametrize("layout", LAYOUTS)
def test_controller_backup_then_prefetch_v1(tmp_path, controller_factory, layout):
    """SGLang's backup thread writes through batch_set_v1; a prefetch (batch_exists for the hit
    count, batch_get_v1 into freshly allocated host pages) brings back the same bytes."""
    dev, host = _mha_host(layout)
    cc = controller_factory(dev, host, _extra(tmp_path))
    assert isinstance(cc.storage_backend, VitrifyStorage)
    assert cc.page_set_func.__name__ == "_page_set_zero_copy"
    assert cc.page_get_func.__name__ == "_page_get_zero_copy"

    n = 6
    _fill_random(host, 1)
    idx = host.alloc(n * PAGE)
    want = _pages(host, idx, n)
    tokens, hashes = _keys(n)
    cc.write_storage(idx, tokens, hash_value=hashes)
    op = cc.ack_backup_queue.get(timeout=20)
    assert op.completed_tokens == n * PAGE
    host.kv_buffer.zero_()

    op, got_idx = _prefetch(cc, host, tokens)
    assert op.storage_hit_count == n * PAGE
    assert op.completed_tokens == n * PAGE
    assert not set(got_idx.tolist()) & set(idx.tolist())  # other host pages than the source
    for i, page in enumerate(_pages(host, got_idx, n)):
        assert torch.equal(page, want[i]), f"page {i} differs after the round trip ({layout})"


def test_controller_prefetch_stops_at_first_missing_page(tmp_path, controller_factory):
    dev, host = _mha_host("page_first")
    cc = controller_factory(dev, host, _extra(tmp_path))
    _fill_random(host, 2)
    tokens, hashes = _keys(5)
    idx = host.alloc(3 * PAGE)
    cc.write_storage(idx, tokens[:3 * PAGE], hash_value=hashes[:3])  # only the first 3 pages
    assert cc.ack_backup_queue.get(timeout=20).completed_tokens == 3 * PAGE
    op, _ = _prefetch(cc, host, tokens)
    assert op.storage_hit_count == 3 * PAGE


# ---- the backend through the factory ---------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gathered_page_is_sglang_flat_page(tmp_path, layout):
    """vitrify's gathered page has exactly the bytes of SGLang's flat data page, so the v0 calls
    (tensors) and the v1 calls (host indices) share one key space."""
    _, host = _mha_host(layout)
    _fill_random(host, 3)
    b = _backend(host, _extra(tmp_path))
    try:
        idx = host.alloc(2 * PAGE)
        _, keys = _keys(2)
        assert b.batch_set_v1(keys, idx) == [True, True]
        for i, k in enumerate(keys):
            out = host.get_dummy_flat_data_page()
            assert b.get(k, out) is out
            assert torch.equal(out, host.get_data_page(int(idx[i * PAGE])))
        # and the other way round: v0 set, v1 get
        k2 = "v0-written"
        src = host.get_data_page(int(idx[0])).clone()
        assert b.set(k2, src)
        dst = host.alloc(PAGE)
        assert b.batch_get_v1([k2], dst) == [True]
        assert torch.equal(host.get_data_page(int(dst[0])), src)
    finally:
        b.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_pool_roundtrip(tmp_path, layout):
    host = _mla_host(layout)
    _fill_random(host, 4)
    b = _backend(host, _extra(tmp_path), mla=True)
    try:
        idx = host.alloc(3 * PAGE)
        want = _pages(host, idx, 3)
        _, keys = _keys(3)
        assert b.batch_set_v1(keys, idx) == [True] * 3
        host.kv_buffer.zero_()
        dst = host.alloc(3 * PAGE)
        assert b.batch_get_v1(keys, dst) == [True] * 3
        for i, page in enumerate(_pages(host, dst, 3)):
            assert torch.equal(page, want[i])
    finally:
        b.close()


def test_exists_is_a_prefix_count_and_set_dedups(tmp_path):
    _, host = _mha_host("layer_first")
    _fill_random(host, 5)
    b = _backend(host, _extra(tmp_path))
    try:
        idx = host.alloc(4 * PAGE)
        _, keys = _keys(4)
        assert b.batch_exists(keys) == 0
        assert b.batch_set_v1(keys[:2], idx[:2 * PAGE]) == [True, True]
        assert b.batch_exists(keys) == 2
        assert b.exists(keys[1]) and not b.exists(keys[2])
        assert b.batch_set_v1(keys, idx) == [True] * 4
        s = b.vitrify_stats()
        assert s["set_pages"] == 4 and s["set_dedup"] == 2
        assert s["store"]["kinds"]["kv"]["entries"] == 4
        assert b.batch_exists(keys) == 4
        assert b.batch_get_v1(["never-written"], host.alloc(PAGE)) == [False]
    finally:
        b.close()


def test_restart_cold_start_load_hits_clear_misses(tmp_path):
    _, host = _mha_host("page_first")
    _fill_random(host, 6)
    idx = host.alloc(5 * PAGE)
    want = _pages(host, idx, 5)
    _, keys = _keys(5)
    b = _backend(host, _extra(tmp_path))
    assert b.batch_set_v1(keys, idx) == [True] * 5
    b.close()

    host.kv_buffer.zero_()
    b2 = _backend(host, _extra(tmp_path, cold_start="load"))  # a restarted server
    try:
        assert b2.batch_exists(keys) == 5
        dst = host.alloc(5 * PAGE)
        assert b2.batch_get_v1(keys, dst) == [True] * 5
        for i, page in enumerate(_pages(host, dst, 5)):
            assert torch.equal(page, want[i])
        assert b2.vitrify_stats()["store"]["loaded_entries"] == 5
    finally:
        b2.close()

    b3 = _backend(host, _extra(tmp_path, cold_start="clear"))
    try:
        assert b3.batch_exists(keys) == 0
    finally:
        b3.close()
    b4 = _backend(host, _extra(tmp_path, cold_start="load"))  # cleared pages stay gone
    try:
        assert b4.batch_exists(keys) == 0
    finally:
        b4.close()


@pytest.fixture
def shm_dir():
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="vitrify-hicache-host-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_host_tier_serves_gets_first_and_survives_a_restart(tmp_path, shm_dir):
    """host_bytes: v1 sets land in the host tier and on disk; gets are served from the host tier;
    a restarted server (cold_start=load) maps the same host slabs and serves from memory even
    when the disk slabs are gone (a disk page would be read from the drive otherwise)."""
    _, host = _mha_host("page_first")
    _fill_random(host, 16)
    idx = host.alloc(5 * PAGE)
    want = _pages(host, idx, 5)
    _, keys = _keys(5)
    stats = tmp_path / "stats.json"
    extra = _extra(tmp_path, host_bytes=1 << 20, host_dir=shm_dir, stats_path=str(stats))
    b = _backend(host, extra)
    try:
        info = b.vitrify_stats()
        assert info["host"]["store"]["kinds"]["kv"]["slots_total"] >= 5
        assert b.batch_set_v1(keys, idx) == [True] * 5
        assert b.vitrify_stats()["host"]["store"]["kinds"]["kv"]["entries"] == 5
        assert b.vitrify_stats()["store"]["kinds"]["kv"]["entries"] == 5  # and on disk
        host_slab = b.vitrify_stats()["host"]["slab"]
        assert os.path.dirname(host_slab) == shm_dir
        assert os.stat(host_slab).st_mode & 0o777 == 0o600
        dst = host.alloc(5 * PAGE)
        assert b.batch_get_v1(keys, dst) == [True] * 5
        assert b.vitrify_stats()["host"]["host_hits"] == 5
        assert json.loads(stats.read_text())["host"] == {"host_hits": 5, "host_promotions": 0,
                                                         "host_set_failed": 0}
        assert b.vitrify_stats()["store"]["reloads"] == 0  # nothing read from the disk
        for i, page in enumerate(_pages(host, dst, 5)):
            assert torch.equal(page, want[i])
    finally:
        b.close()
    for f in os.listdir(tmp_path):  # the disk tier is gone; the host tier is not
        os.unlink(os.path.join(tmp_path, f))
    host.kv_buffer.zero_()
    b2 = _backend(host, dict(extra, cold_start="load"))
    try:
        assert b2.batch_exists(keys) == 5
    finally:
        b2.close()
    assert _read_back(host, extra, keys, want)["host"]["host_hits"] == 5


def test_host_tier_write_back_acknowledges_from_memory_and_writes_the_disk_behind(
        tmp_path, shm_dir):
    """host_write="back": a set the host tier takes whole is acknowledged from it; the disk
    store receives the same pages from the host tier on the write-back thread; close() waits
    for the queue; a restart finds every page on disk even with the host tier gone."""
    _, host = _mha_host("page_first")
    _fill_random(host, 18)
    idx = host.alloc(6 * PAGE)
    want = _pages(host, idx, 6)
    _, keys = _keys(6)
    slot = disk.slot_bytes_for(BLOB)
    extra = _extra(tmp_path, host_bytes=4096 + 32 * slot, host_dir=shm_dir, host_write="back")
    b = _backend(host, extra)
    try:
        wb = b._writeback
        assert wb is not None and wb.capacity == 8  # a quarter of the host tier's 32 slots
        assert b.batch_set_v1(keys, idx) == [True] * 6
        assert wb.flush(timeout=30)
        st = b.vitrify_stats()
        assert st["host"]["writeback_queued"] == 6 and st["host"]["writeback_written"] == 6
        assert st["host"]["writeback_lost"] == 0 and st["host"]["writeback_depth"] == 0
        assert st["store"]["kinds"]["kv"]["entries"] == 6  # on disk behind the host tier
        assert b.counters()["set_pages"] == 6
        # a batch that does not fit the queue (8 pages) is written through
        idx2 = host.alloc(10 * PAGE)
        _, keys2 = _keys(10, salt=10_000)
        assert b.batch_set_v1(keys2, idx2) == [True] * 10
        assert b.vitrify_stats()["host"]["writeback_queued"] == 6
        assert b.vitrify_stats()["store"]["kinds"]["kv"]["entries"] == 16
    finally:
        b.close()
    assert not wb._thread.is_alive()
    shutil.rmtree(shm_dir)  # the host tier is gone; the disk has every page
    os.makedirs(shm_dir)
    host.kv_buffer.zero_()
    assert _read_back(host, extra, keys, want)["store"]["reloads"] == 6


def test_host_tier_write_back_queue_is_dropped_by_clear_and_a_weight_switch(
        tmp_path, shm_dir, monkeypatch):
    """Pages queued for the disk when the stores are replaced (a weight switch) or cleared are
    dropped, never written into the new store; close() refuses new keys (those sets are
    written through) and writes what is queued."""
    from vitrify.integrations.sglang.hicache import writeback

    gate = threading.Event()
    take = writeback.WriteBack._take

    def gated_take(self):  # the write-back thread waits until the test opens the gate
        gate.wait(30)
        return take(self)
    monkeypatch.setattr(writeback.WriteBack, "_take", gated_take)
    _, host = _mha_host("page_first")
    _fill_random(host, 19)
    slot = disk.slot_bytes_for(BLOB)
    b = _backend(host, _extra(tmp_path, host_bytes=4096 + 32 * slot, host_dir=shm_dir,
                              host_write="back"))
    try:
        wb = b._writeback
        _, keys = _keys(4)
        assert b.batch_set_v1(keys, host.alloc(4 * PAGE)) == [True] * 4
        assert wb.depth() == 4  # the thread is held at the gate
        assert b.set_weight_version("step-2") is not None
        assert wb.counts["writeback_dropped"] == 4 and wb.depth() == 0
        _, keys2 = _keys(3, salt=20_000)
        assert b.batch_set_v1(keys2, host.alloc(3 * PAGE)) == [True] * 3
        assert b.clear() is True
        assert wb.counts["writeback_dropped"] == 7
        gate.set()
        assert wb.flush(timeout=30)
        st = b.vitrify_stats()
        assert st["host"]["writeback_written"] == 0 and st["host"]["writeback_lost"] == 0
        assert st["store"]["kinds"]["kv"]["entries"] == 0  # nothing of before on the disk
        _, keys3 = _keys(2, salt=30_000)
        assert b.batch_set_v1(keys3, host.alloc(2 * PAGE)) == [True] * 2
    finally:
        gate.set()
        b.close()
    assert b.vitrify_stats()["host"] is None  # closed
    assert wb.counts["writeback_written"] == 2  # close() wrote the queue


def test_write_back_queue_counts_dropped_lost_and_refuses_what_does_not_fit():
    """The write-back queue alone, with the backend's lock held by the test: a batch being
    written waits for it; what is queued meanwhile can be dropped; a page the host tier no
    longer has is lost, not written; offers beyond the capacity are refused whole."""
    from vitrify.integrations.sglang.hicache.writeback import WriteBack

    class Stub:
        def __init__(self):
            self.lock = threading.Lock()
            self.put = []
            self.errors = []
            self._host_store = self
            self._store = self
            self._state = self

        def shared(self):
            return self.lock

        def batch_get(self, keys, kind):
            return [None if k.startswith("gone") else k.encode() for k in keys]

        def batch_put(self, keys, datas, kind):
            self.put += list(zip(keys, datas))
            return [True] * len(keys)

        def _error(self, op, e):
            self.errors.append((op, e))

    stub = Stub()
    wb = WriteBack(stub, 4)
    try:
        with stub.lock:  # the thread takes the first batch, then waits for the lock
            assert wb.offer(["a", "gone-1"])
            deadline = time.monotonic() + 10
            while wb._busy == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert wb._busy == 2
            assert wb.offer(["b", "c"])
            assert not wb.offer(["d"])  # 2 busy + 2 queued: full
            assert wb.depth() == 4
            assert wb.drop() == 2
        assert wb.flush(timeout=10)
        assert stub.put == [("a", b"a")] and stub.errors == []
        assert wb.counts == {"writeback_queued": 4, "writeback_written": 1, "writeback_lost": 1,
                             "writeback_dropped": 2, "writeback_failed": 0}
    finally:
        wb.stop()
    assert not wb.offer(["e"])  # stopped


def test_host_write_setting_is_checked(tmp_path):
    with pytest.raises(ValueError, match="'host_write' must be 'through' or 'back'"):
        VitrifyStorageSettings.from_extra_config(_extra(tmp_path, host_write="behind"))
    assert VitrifyStorageSettings.from_extra_config(_extra(tmp_path)).host_write == "through"


def test_a_mistyped_key_is_refused_naming_it_and_the_valid_keys(tmp_path):
    """Issue 32: ``cold_strat`` was accepted with a warning hidden by default, and the backend
    ran with ``cold_start`` at its default: the opposite of what was asked."""
    with pytest.raises(ValueError) as e:
        VitrifyStorageSettings.from_extra_config(_extra(tmp_path, cold_strat="clear"))
    msg = str(e.value)
    assert msg.startswith("vitrify HiCache backend: unknown extra-config key(s) ['cold_strat']")
    assert "'cold_start'" in msg and "'module_path'" in msg and "\n" not in msg
    # several at once, all named; SGLang's own keys and vitrify's are accepted
    with pytest.raises(ValueError, match=r"key\(s\) \['budget', 'dir'\]"):
        VitrifyStorageSettings.from_extra_config(_extra(tmp_path, dir="x", budget=1))
    s = VitrifyStorageSettings.from_extra_config(_extra(tmp_path, cold_start="clear",
                                                        prefetch_threshold=256))
    assert s.cold_start == "clear"


def test_host_tier_promotes_disk_hits_and_clear_drops_both(tmp_path, shm_dir):
    _, host = _mha_host("layer_first")
    _fill_random(host, 17)
    idx = host.alloc(4 * PAGE)
    want = _pages(host, idx, 4)
    _, keys = _keys(4)
    # three host slots for four pages: the host tier's LRU evicts (demotes) the oldest
    slot = disk.slot_bytes_for(BLOB)
    b = _backend(host, _extra(tmp_path, host_bytes=4096 + 3 * slot, host_dir=shm_dir))
    try:
        assert b.batch_set_v1(keys, idx) == [True] * 4
        st = b.vitrify_stats()
        in_host = st["host"]["store"]["kinds"]["kv"]["entries"]
        assert in_host < 4 and st["store"]["kinds"]["kv"]["entries"] == 4
        dst = host.alloc(4 * PAGE)
        assert b.batch_get_v1(keys, dst) == [True] * 4  # host hits, the rest from the disk
        st = b.vitrify_stats()
        assert st["host"]["host_hits"] == in_host
        assert st["store"]["reloads"] == 4 - in_host
        assert st["host"]["host_promotions"] == 4 - in_host  # disk hits copied into the host
        for i, page in enumerate(_pages(host, dst, 4)):
            assert torch.equal(page, want[i])
        assert b.clear() is True
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys, host.alloc(4 * PAGE)) == [False] * 4
    finally:
        b.close()


def test_host_tier_config_errors(tmp_path):
    for bad, match in (({"host_bytes": -1}, "host_bytes"), ({"host_gb": "1"}, "host_gb"),
                       ({"host_bytes": 1, "host_gb": 1}, "at most one"),
                       ({"host_dir": ""}, "host_dir")):
        with pytest.raises(ValueError, match=match):
            VitrifyStorageSettings.from_extra_config(_extra(tmp_path, **bad))
    s = VitrifyStorageSettings.from_extra_config(_extra(tmp_path, host_gb=0.5))
    assert s.host_bytes == 500_000_000 and s.host_dir is None
    assert VitrifyStorageSettings.from_extra_config(_extra(tmp_path)).host_bytes == 0


def test_clear_drops_everything_also_for_a_restart(tmp_path):
    _, host = _mha_host("layer_first")
    _fill_random(host, 7)
    idx = host.alloc(3 * PAGE)
    _, keys = _keys(3)
    b = _backend(host, _extra(tmp_path))
    assert b.batch_set_v1(keys, idx) == [True] * 3
    assert b.clear() is True
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, host.alloc(3 * PAGE)) == [False] * 3
    assert b.batch_set_v1(keys[:1], idx[:PAGE]) == [True]  # usable after clear
    b.close()
    b2 = _backend(host, _extra(tmp_path))
    try:
        assert b2.batch_exists(keys) == 1
    finally:
        b2.close()


def _slot_of(path, key, slot_bytes):
    """File offset of the slot whose header holds ``key`` (vitrify's 32-byte key) in a slab."""
    k = disk.make_key(key)
    data = open(path, "rb").read()
    off = 4096
    while off + slot_bytes <= len(data):
        if k in data[off:off + disk.SLOT_HEADER_BYTES]:
            return off
        off += slot_bytes
    raise AssertionError(f"no slot holds {key!r} in {path}")


def test_corrupted_page_is_a_miss_never_wrong_bytes(tmp_path):
    _, host = _mha_host("page_first")
    _fill_random(host, 8)
    idx = host.alloc(4 * PAGE)
    want = _pages(host, idx, 4)
    _, keys = _keys(4)
    b = _backend(host, _extra(tmp_path))
    assert b.batch_set_v1(keys, idx) == [True] * 4
    path, slot = b.slab_paths[0], b.vitrify_stats()["store"]["kinds"]["kv"]["slot_bytes"]
    b.close()

    off = _slot_of(path, keys[2], slot) + disk.SLOT_HEADER_BYTES + 1000  # inside the payload
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))

    b2 = _backend(host, _extra(tmp_path, cold_start="load"))
    try:
        dst = host.alloc(4 * PAGE)
        host.kv_buffer.zero_()
        assert b2.batch_get_v1(keys, dst) == [True, True, False, True]
        got = _pages(host, dst, 4)
        for i in (0, 1, 3):
            assert torch.equal(got[i], want[i])
        assert not torch.equal(got[2], want[2])  # the bad page was not scattered
        assert b2.batch_exists(keys) == 2        # and it left the index
        assert b2.vitrify_stats()["store"]["verify_failures"] == 1
    finally:
        b2.close()


def test_full_budget_gc_keeps_writing_and_evicts_oldest(tmp_path):
    _, host = _mha_host("layer_first", tokens=1024)
    _fill_random(host, 9)
    slot = disk.slot_bytes_for(BLOB)
    b = _backend(host, _extra(tmp_path, budget_bytes=4096 + 40 * slot))
    try:
        assert b.vitrify_stats()["store"]["kinds"]["kv"]["slots_total"] == 40
        batches = []
        for salt in range(12):   # 12 batches x 8 pages = 96 pages into 40 slots
            idx = host.alloc(8 * PAGE)
            _, keys = _keys(8, salt=10_000 * (salt + 1))
            assert b.batch_set_v1(keys, idx) == [True] * 8, f"batch {salt} refused"
            host.free(idx)
            batches.append(keys)
        s = b.vitrify_stats()["store"]
        assert s["gc_reclaims"] > 0 and s["kinds"]["kv"]["slots_used"] <= 40
        assert b.batch_exists(batches[0]) == 0          # oldest evicted
        assert b.batch_exists(batches[-1]) == 8         # newest kept
    finally:
        b.close()


def test_per_rank_and_per_model_slabs(tmp_path):
    _, host = _mha_host("page_first")
    _fill_random(host, 10)
    idx = host.alloc(PAGE)
    _, keys = _keys(1)
    r0 = _backend(host, _extra(tmp_path), tp_rank=0, tp_size=2)
    r1 = _backend(host, _extra(tmp_path), tp_rank=1, tp_size=2)
    other = _backend(host, _extra(tmp_path), tp_rank=0, tp_size=2, model="org/other-model")
    try:
        assert "-tp0of2-" in r0.slab_paths[0] and "-tp1of2-" in r1.slab_paths[0]
        assert len({r0.slab_paths[0], r1.slab_paths[0], other.slab_paths[0]}) == 3
        assert r0.batch_set_v1(keys, idx) == [True]
        assert r0.batch_exists(keys) == 1
        assert r1.batch_exists(keys) == 0 and other.batch_exists(keys) == 0
    finally:
        for b in (r0, r1, other):
            b.close()


def test_errors_are_misses_and_never_raise(tmp_path, caplog):
    _, host = _mha_host("page_first")
    b = _backend(host, _extra(tmp_path))
    _, keys = _keys(2)
    idx = host.alloc(2 * PAGE)
    assert b.batch_set_v1(keys, idx[:PAGE]) == [False, False]      # wrong index count
    assert b.batch_get_v1(keys, idx[:PAGE + 1]) == [False, False]
    assert b.batch_set_v1(keys, idx + 1) == [False, False]         # not page aligned
    assert b.batch_set(keys, None) is False
    assert b.batch_get(keys, [None, None]) == [None, None]
    assert b.vitrify_stats()["errors"] == 5
    assert "treated as a miss" in caplog.text
    b.close()
    assert b.batch_set_v1(keys, idx) == [False, False]
    assert b.batch_get_v1(keys, idx) == [False, False]
    assert b.batch_exists(keys) == 0 and not b.exists(keys[0])
    assert b.clear() is False
    b.close()  # idempotent


def test_stats_hook_feeds_sglang_metrics(tmp_path):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    _, host = _mha_host("page_first")
    _fill_random(host, 11)
    b = _backend(host, _extra(tmp_path))
    try:
        idx = host.alloc(3 * PAGE)
        _, keys = _keys(3)
        b.batch_set_v1(keys, idx)
        b.batch_get_v1(keys, host.alloc(3 * PAGE))
        m = b.get_stats()
        assert isinstance(m, StorageMetrics)
        assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
        assert len(m.backup_bandwidth) == 1 and m.backup_bandwidth[0] > 0
        assert len(m.prefetch_bandwidth) == 1 and m.prefetch_bandwidth[0] > 0
        assert b.get_stats().prefetch_pgs == []   # drained per call, as SGLang expects
    finally:
        b.close()


# ---- counters: counters() and the stats_path file --------------------------------------------

_ZERO = {k: 0 for k in ("set_pages", "set_bytes", "set_dedup", "set_failed", "get_pages",
                        "get_bytes", "get_misses", "exists_queries", "errors", "v2_refused")}


def _totals(c):
    """The backend's own running totals of a counters() dict (the rest are the stores')."""
    return {k: c[k] for k in _ZERO}


def test_counters_are_the_running_totals(tmp_path):
    """counters(): one int per total, a copy, the same numbers vitrify_stats() reports."""
    _, host = _mha_host("page_first")
    _fill_random(host, 15)
    b = _backend(host, _extra(tmp_path))
    try:
        assert _totals(b.counters()) == _ZERO
        _, keys = _keys(4)
        idx = host.alloc(4 * PAGE)
        assert b.batch_set_v1(keys[:3], idx[:3 * PAGE]) == [True] * 3
        assert b.batch_set_v1(keys[:3], idx[:3 * PAGE]) == [True] * 3   # already stored
        assert b.batch_get_v1(keys, host.alloc(4 * PAGE)) == [True] * 3 + [False]
        assert b.batch_exists(keys) == 3
        assert b.batch_set_v1(keys, idx[:PAGE]) == [False] * 4           # an error
        c = b.counters()
        assert _totals(c) == {**_ZERO, "set_pages": 3, "set_bytes": 3 * BLOB, "set_dedup": 3,
                     "get_pages": 3, "get_bytes": 3 * BLOB, "get_misses": 1,
                     "exists_queries": 1, "errors": 1}
        c["set_pages"] = 99
        assert b.counters()["set_pages"] == 3
        stats = b.vitrify_stats()
        assert {k: stats[k] for k in _ZERO} == _totals(b.counters())
    finally:
        b.close()
    assert b.counters()["get_pages"] == 3   # still readable after close


def test_stats_path_file_follows_the_counters(tmp_path):
    """With stats_path the backend keeps counters() and its store's identity in a JSON file,
    replaced whole once the store is open and after every batch, error, clear and close."""
    path = tmp_path / "stats" / "hicache.json"   # its directory is created

    def read():
        return json.loads(path.read_text())

    _, host = _mha_host("page_first")
    _fill_random(host, 16)
    b = _backend(host, _extra(tmp_path / "d", stats_path=str(path)))
    try:
        d = read()
        assert d["pid"] == os.getpid() and d["closed"] is False
        assert _totals(d["counters"]) == _ZERO
        st = d["store"]
        assert st["page_bytes"] == BLOB and st["page_tokens"] == PAGE
        assert st["layout"] == "page_first" and st["cold_start"] == "load"
        assert st["slabs"] == b.slab_paths and st["name"] in st["slabs"][0]
        assert isinstance(st["o_direct"], bool) and st["budget_bytes"] == 16 << 20
        _, keys = _keys(2)
        idx = host.alloc(2 * PAGE)
        assert b.batch_set_v1(keys, idx) == [True, True]
        assert read()["counters"]["set_pages"] == 2
        assert b.batch_get_v1(keys, host.alloc(2 * PAGE)) == [True, True]
        assert read()["counters"]["get_pages"] == 2
        assert b.batch_get_v1(keys, idx[:1]) == [False, False]        # an error
        assert read()["counters"]["errors"] == 1
        b.batch_exists(keys)
        assert b.clear() is True
        assert _totals(read()["counters"]) == _totals(b.counters())
        assert b.counters()["exists_queries"] == 1
        assert [p.name for p in path.parent.iterdir()] == ["hicache.json"]   # no temporary
        assert read()["host"] is None  # no host tier
    finally:
        b.close()
    d = read()
    assert d["closed"] is True and d["counters"]["set_pages"] == 2


def test_stats_path_per_rank_and_a_failed_write_never_fails_a_call(tmp_path, caplog):
    _, host = _mha_host("page_first")
    one = _extra(tmp_path, stats_path=str(tmp_path / "s.json"))
    with pytest.raises(ValueError, match=r"'stats_path' must contain \{rank\}.*tp_size=2"):
        StorageBackendFactory.create_backend("dynamic", _config(one, tp_size=2), None)
    b = _backend(host, _extra(tmp_path, stats_path=str(tmp_path / "s-{rank}.json")),
                 tp_rank=1, tp_size=2)
    try:
        path = tmp_path / "s-tp1of2-pp0of1-cp0of1.json"
        assert _totals(json.loads(path.read_text())["counters"]) == _ZERO
        path.unlink()
        path.mkdir()   # the file can no longer be replaced
        _, keys = _keys(1)
        with caplog.at_level(logging.WARNING, logger="vitrify.sglang.hicache"):
            assert b.batch_set_v1(keys, host.alloc(PAGE)) == [True]
            assert b.batch_get_v1(keys, host.alloc(PAGE)) == [True]
        assert caplog.text.count("cannot write 'stats_path'") == 1
        assert b.counters()["set_pages"] == 1 and b.counters()["errors"] == 0
        assert sorted(p.name for p in tmp_path.glob("s-*")) == [path.name]   # no temporary
    finally:
        b.close()


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad, match", [
    ({"dirs": None}, "dirs"),
    ({"dirs": []}, "dirs"),
    ({"budget_bytes": 0}, "budget_bytes"),
    ({"budget_gb": 1.0}, "exactly one"),
    ({"cold_start": "warm"}, "cold_start"),
    ({"direct_io": "maybe"}, "direct_io"),
    ({"staging_bytes": -1}, "staging_bytes"),
    ({"name": "a/b"}, "name"),
    ({"stats_path": 5}, "stats_path"),
    ({"stats_path": ""}, "stats_path"),
])
def test_config_errors_name_the_value(tmp_path, bad, match):
    extra = _extra(tmp_path)
    extra.update(bad)
    extra = {k: v for k, v in extra.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        StorageBackendFactory.create_backend("dynamic", _config(extra), None)


def test_config_defaults_and_budget_gb(tmp_path):
    s = VitrifyStorageSettings.from_extra_config({"dirs": str(tmp_path), "budget_gb": 2})
    assert s.dirs == (str(tmp_path),) and s.budget_bytes == 2_000_000_000
    assert s.cold_start == "load" and s.direct_io is None


def test_unsupported_pools_are_refused_at_attach(tmp_path):
    _, host = _mha_host("page_head")
    b = StorageBackendFactory.create_backend("dynamic", _config(_extra(tmp_path)), host)
    with pytest.raises(ValueError, match="page_head"):
        b.register_mem_pool_host(host)


def test_concurrent_set_get_exists(tmp_path):
    """SGLang's backup, prefetch and prefetch-I/O threads call in at the same time."""
    _, host = _mha_host("page_first", tokens=1024)
    _fill_random(host, 12)
    b = _backend(host, _extra(tmp_path))
    src = host.alloc(32 * PAGE)
    want = _pages(host, src, 32)
    _, keys = _keys(32)
    assert b.batch_set_v1(keys[:16], src[:16 * PAGE]) == [True] * 16
    errors = []

    def writer():
        for i in range(16, 32):
            if b.batch_set_v1([keys[i]], src[i * PAGE:(i + 1) * PAGE]) != [True]:
                errors.append(f"set {i}")

    def reader():
        for _ in range(10):
            dst = host.alloc(16 * PAGE)
            if b.batch_get_v1(keys[:16], dst) != [True] * 16:
                errors.append("get")
            got = _pages(host, dst, 16)
            if not all(torch.equal(got[i], want[i]) for i in range(16)):
                errors.append("bytes")
            host.free(dst)
            b.batch_exists(keys)

    ts = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    b.close()
    assert not any(t.is_alive() for t in ts)
    assert not errors


def test_v2_pool_without_budget_answers_nothing_stored(tmp_path):
    """A v2 pool registered next to a plain (non-group) host pool has no disk budget: its
    calls answer "nothing stored" and never raise (stored v2 pools: test_sglang_hicache_v2)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer, PoolTransferResult

    _, host = _mha_host("page_first")
    _fill_random(host, 13)
    b = _backend(host, _extra(tmp_path))
    try:
        idx = host.alloc(2 * PAGE)
        _, keys = _keys(2)
        assert b.batch_set_v1(keys, idx) == [True, True]
        b.register_mem_host_pool_v2(host, PoolName.MAMBA)
        t = PoolTransfer(name=PoolName.MAMBA, host_indices=idx, keys=list(keys))
        r = b.batch_exists_v2(keys, [t])
        assert isinstance(r, PoolTransferResult) and r.kv_hit_pages == 0
        assert b.batch_exists_v2(keys, None).kv_hit_pages == 2
        assert b.batch_set_v2([t]) == {PoolName.MAMBA: [False, False]}
        assert b.batch_get_v2([t]) == {PoolName.MAMBA: [False, False]}
        assert b.counters()["v2_refused"] == 2
    finally:
        b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_multi_chunk_pipelines_keep_pages_and_results_in_order(tmp_path, layout):
    """Staging for 3 pages per chunk: batches of 10 go through the double-buffered gather/write
    and read/scatter pipelines in 4 chunks; every page and every per-key result lands right."""
    _, host = _mha_host(layout, tokens=1024)
    _fill_random(host, 14)
    slot = disk.slot_bytes_for(BLOB)
    b = _backend(host, _extra(tmp_path, staging_bytes=2 * slot * 3))
    try:
        assert b._chunk == 3  # staging for 3 pages (the batch quarter is 32)
        src = host.alloc(10 * PAGE)
        want = _pages(host, src, 10)
        _, keys = _keys(10)
        assert b.batch_set_v1(keys[:4:2], torch.cat([src[0:PAGE], src[2 * PAGE:3 * PAGE]])) \
            == [True, True]
        assert b.batch_set_v1(keys, src) == [True] * 10
        assert b.vitrify_stats()["set_dedup"] == 2
        asked = keys[:5] + ["missing"] + keys[5:]
        dst = host.alloc(11 * PAGE)
        assert b.batch_get_v1(asked, dst) == [True] * 5 + [False] + [True] * 5
        got = _pages(host, dst, 11)
        for j, i in enumerate(list(range(5)) + [None] + list(range(5, 10))):
            if i is not None:
                assert torch.equal(got[j], want[i]), f"slot {j} (page {i}) differs"
    finally:
        b.close()


def test_a_second_server_reads_the_first_servers_host_tier(tmp_path, shm_dir):
    """role = "reader": a second server of the node with the same storage identity maps the
    first one's host and disk slabs read-only, serves their pages from the host tier, finds the
    pages written after it opened (a rescan on a miss), writes nothing and deletes nothing."""
    _, host = _mha_host("page_first")
    _fill_random(host, 21)
    idx = host.alloc(6 * PAGE)
    want = _pages(host, idx, 6)
    _, keys = _keys(6, salt=300)
    extra = _extra(tmp_path, host_bytes=1 << 20, host_dir=shm_dir, reader_refresh_s=0)
    w = _backend(host, extra)
    try:
        assert w.batch_set_v1(keys[:3], idx[:3 * PAGE]) == [True] * 3
        _, host2 = _mha_host("page_first")
        r = _backend(host2, dict(extra, role="reader"))
        try:
            assert r.identity()["role"] == "reader"
            assert r.batch_exists(keys) == 3
            dst = host2.alloc(3 * PAGE)
            assert r.batch_get_v1(keys[:3], dst) == [True] * 3
            assert all(torch.equal(p, want[i]) for i, p in enumerate(_pages(host2, dst, 3)))
            assert r.vitrify_stats()["host"]["host_hits"] == 3
            # written by the first server after the second opened: found by a rescan
            assert w.batch_set_v1(keys[3:], idx[3 * PAGE:]) == [True] * 3
            assert r.batch_exists(keys) == 6
            dst = host2.alloc(3 * PAGE)
            assert r.batch_get_v1(keys[3:], dst) == [True] * 3
            assert all(torch.equal(p, want[3 + i]) for i, p in enumerate(_pages(host2, dst, 3)))
            # the reader's own pages are not written anywhere
            _, other = _keys(2, salt=900)
            r.batch_set_v1(other, host2.alloc(2 * PAGE))
            assert w.batch_exists(other) == 0
            assert w.vitrify_stats()["host"]["store"]["kinds"]["kv"]["entries"] == 6
        finally:
            r.close()
        assert w.batch_exists(keys) == 6  # closing the reader removed nothing
    finally:
        w.close()
    with pytest.raises(ValueError, match="'role' must be 'writer' or 'reader'"):
        VitrifyStorageSettings.from_extra_config(dict(extra, role="boss"))


def test_a_host_tier_larger_than_its_mount_is_left_out_unless_required(tmp_path, shm_dir,
                                                                        caplog):
    """issue 33 item 7: host_bytes above the host directory's free space no longer stops the
    server: it starts without the host tier (one warning line; vitrify_stats says why) and
    serves from the disk. host_required = true keeps it an error naming the need and the free
    space, and nothing is left in the host directory either way."""
    import shutil as _shutil

    from vitrify import disk as _disk

    _, host = _mha_host("page_first")
    _fill_random(host, 16)
    idx = host.alloc(3 * PAGE)
    want = _pages(host, idx, 3)
    _, keys = _keys(3)
    too_big = _shutil.disk_usage(shm_dir).free + (64 << 30)
    extra = _extra(tmp_path, host_bytes=too_big, host_dir=shm_dir)
    with caplog.at_level("WARNING", logger="vitrify"):
        b = _backend(host, extra)
    try:
        info = b.vitrify_stats()
        assert info["host"] is None
        assert info["host_unavailable"].startswith("[Errno 28] host tier: the slabs")
        assert "bytes free" in info["host_unavailable"]
        warned = [r.getMessage() for r in caplog.records
                  if "running without the host tier" in r.getMessage()]
        assert len(warned) == 1 and "\n" not in warned[0]
        assert b.batch_set_v1(keys, idx) == [True] * 3  # served by the disk tier
        dst = host.alloc(3 * PAGE)
        assert b.batch_get_v1(keys, dst) == [True] * 3
        for i, page in enumerate(_pages(host, dst, 3)):
            assert torch.equal(page, want[i])
    finally:
        b.close()
    assert os.listdir(shm_dir) == []
    with pytest.raises(_disk.HostSpaceError, match=r"host tier: the slabs .* bytes free"):
        _backend(host, dict(extra, host_required=True))
    assert os.listdir(shm_dir) == []
    with pytest.raises(ValueError, match=r"'host_required' must be true or false, got 'yes'"):
        _backend(host, dict(extra, host_required="yes"))


def test_the_stats_file_is_never_written_through_a_link(tmp_path):
    """A link at stats_path's temporary name (review of issue 32) is removed, not followed."""
    _, host = _mha_host("page_first")
    victim = tmp_path / "victim.txt"
    victim.write_text("a user's file\n")
    stats = tmp_path / "stats.json"
    os.symlink(victim, f"{stats}.tmp{os.getpid()}")
    b = _backend(host, _extra(tmp_path, stats_path=str(stats)))
    try:
        assert json.loads(stats.read_text())["pid"] == os.getpid()
    finally:
        b.close()
    assert victim.read_text() == "a user's file\n"


def test_an_sglang_release_vitrify_does_not_know_is_refused_in_one_line(tmp_path, monkeypatch):
    """The backend reads everything release-specific through the plugin's version seam; a
    release without a version module is the plugin's one-line fatal naming the supported
    ones, before anything is created on disk."""
    from vitrify.integrations.sglang import state

    _, host = _mha_host("page_first")
    monkeypatch.setattr(state.STATE, "version", None)
    monkeypatch.setattr(state.STATE, "sglang_version", None)
    monkeypatch.setattr(sglang, "__version__", "0.5.99")
    with pytest.raises(state.PluginFatal, match=r"SGLang 0\.5\.99 is not supported; this "
                                                r"vitrify supports SGLang 0\.5\.17, 0\.5\.23"):
        _backend(host, _extra(tmp_path / "d"))
    assert not (tmp_path / "d").exists()
