"""vitrify's HiCache backend against whichever SGLang release is importable, on the CPU:
``test_sglang_hicache_versions.py`` runs this file in a fresh interpreter per supported release
(0.5.17 from the venv; 0.5.23 from a ``pip install --no-deps --target`` directory put first on
``sys.path``), so every class here is the release's own: ``HiCacheStorageConfig``, the storage
backend factory (``dynamic`` backend naming vitrify's module), real host KV pools (MHA and MLA),
SGLang's page hashes and its reference file backend, ``HiCacheFile``.

On 0.5.23 every backend the factory builds sits behind the release's failure-injector proxy
(``SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY`` set, no failures unless a case asks), as it does
in SGLang's own HiCache tests: the differential cases go through the proxy, and vitrify's
methods are reached with :func:`vitrify.integrations.sglang.hicache.vitrify_backend`.

Cases: registration and a round trip through the release's config and factory; the release's
real ``HiCacheController`` backing up and prefetching through vitrify (its threads); the same
set/get/exists sequence on vitrify and on HiCacheFile gives the same answers and the same payload
bytes (MHA in every layout, MLA; MLA under tensor parallelism with every rank a process); the v2
pools folded as the release's HiCacheFile folds them (0.5.23: ``restorable_prefix_pages``); the
failure injector at 50 % failures loses or corrupts nothing; the KV cache dtype (as the
release resolves it) and the host dtype are part of a page's identity; the refusals (0.5.23:
decode context parallelism, ``buffer_only`` host memory, an unknown hit policy; both: a host
layout vitrify cannot gather).

With ``VITRIFY_RELEASE_OUT`` naming a file, the release the cases ran against and the store
names of one geometry are written there for the runner.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

sglang = pytest.importorskip("sglang", reason="the HiCache release cases need sglang importable")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile, HiCacheStorage, HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

try:  # 0.5.23 moved the host pool group into pool_host/
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: E402
except ImportError:
    from sglang.srt.mem_cache.memory_pool_host import HostPoolGroup, PoolEntry  # noqa: E402

from vitrify.integrations.sglang import versions  # noqa: E402
from vitrify.integrations.sglang.hicache import VitrifyStorage, vitrify_backend  # noqa: E402

RELEASE = sglang.__version__
VER = versions.for_version(RELEASE)
HERE = Path(__file__).resolve().parent
PAGE = 16
LAYERS, HEADS, DIM = 4, 2, 64
MODEL = "org/tiny-model"
# 0.5.23's factory wraps the backend in this proxy when the test switches are set
INJECTOR = "HiCacheStorageFailureInjector"
DELAY_ENV = "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY"
FAILURE_ENV = "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"
HAS_INJECTOR = VER.HICACHE_PROXY is not None
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


# ---- the release's objects, built as its cache controller builds them ------------------------


def mha_host(layout, dtype=torch.bfloat16, page=PAGE, tokens=512, layers=LAYERS):
    """A real MHA host pool over a CPU device pool (0.5.23 builds host pools from the device
    pool's buffer info, 0.5.17 from the device pool itself)."""
    dev = MHATokenToKVPool(size=tokens, page_size=page, dtype=dtype, head_num=HEADS,
                           head_dim=DIM, layer_num=layers, device="cpu",
                           enable_memory_saver=False, enable_alt_stream=False)
    if hasattr(dev, "get_device_pool_infos"):
        info = dev.get_device_pool_infos()[0].buffer_info
        host = MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev.size,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer)
    else:
        host = MHATokenToKVPoolHost(dev, 2.0, 0, page, layout, pin_memory=False, device="cpu")
    return dev, host


def mla_host(layout, tokens=512):
    dev = MLATokenToKVPool(size=tokens, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=64,
                           qk_rope_head_dim=16, layer_num=3, device="cpu",
                           enable_memory_saver=False)
    if hasattr(dev, "get_device_pool_infos"):
        info = dev.get_device_pool_infos()[0].buffer_info
        return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev.size,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer,
                                    target_layer_num=dev.layer_num,
                                    override_kv_cache_dim=dev.kv_cache_dim)
    return MLATokenToKVPoolHost(dev, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")


def mamba_host(slots=32, layers=3):
    """A real MambaPoolHost (one state page per slot: conv bf16 (4, 3), temporal fp32 (2, 4, 8)
    per layer). 0.5.23 builds it from a MambaStateBufferInfo of real CPU tensors; 0.5.17 from a
    device pool, here a namespace holding the same tensors (SGLang's MambaPool needs a model's
    linear-state parameters, and the host pool reads nothing else of it)."""
    import types

    try:  # 0.5.23 moved it into pool_host/
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    except ImportError:
        from sglang.srt.mem_cache.memory_pool_host import MambaPoolHost

    temporal = torch.zeros(layers, slots + 1, 2, 4, 8, dtype=torch.float32)
    conv = torch.zeros(layers, slots + 1, 4, 3, dtype=torch.bfloat16)
    try:
        from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    except ImportError:
        dev = types.SimpleNamespace(num_mamba_layers=layers, size=slots, device="cpu",
                                    mamba_cache=types.SimpleNamespace(conv=[conv],
                                                                      temporal=temporal))
        return dev, MambaPoolHost(dev, 2.0, 0, pin_memory=False, device="cpu",
                                  layout="page_first")
    info = MambaStateBufferInfo(temporal=temporal, conv=(conv,))
    return None, MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False,
                               device="cpu", layout="page_first")


def _state_buffers(pool):
    """The tensors holding a pool's pages (KV pools: kv_buffer; Mamba: its state buffers)."""
    if hasattr(pool, "temporal_buffer"):
        return [pool.temporal_buffer, *pool.conv_buffer]
    return [pool.kv_buffer]


def fill_random(host, seed):
    g = torch.Generator().manual_seed(seed)
    flat = host.kv_buffer.view(-1)
    flat.copy_(torch.randn(flat.numel(), generator=g).to(flat.dtype))


def extra(d, **kw) -> dict:
    e = {"backend_name": "vitrify", "module_path": "vitrify.integrations.sglang.hicache",
         "class_name": "VitrifyStorage", "interface_v1": 1, "dirs": [str(d)],
         "budget_bytes": 16 << 20, "cold_start": "clear"}
    e.update(kw)
    return e


def config(ex, *, tp_rank=0, tp_size=1, mla=False, model=MODEL, **more):
    """The release's real HiCacheStorageConfig (0.5.23 validates its DCP fields)."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=False, model_name=model, extra_config=dict(ex), **more)


def attach(host, ex, **kw):
    """What the release's cache controller does at attach: the factory, the host pool, and on
    0.5.23 the end of the registration burst. Returns what the controller holds (0.5.23 with
    the injector switches set: the proxy)."""
    b = StorageBackendFactory.create_backend("dynamic", config(ex, **kw), host)
    b.register_mem_pool_host(host)
    if hasattr(HiCacheStorage, "on_host_pools_registered"):  # 0.5.23's hook
        b.on_host_pools_registered()
    return b


def reference(d, **kw) -> HiCacheFile:
    return HiCacheFile(config({}, **kw), file_path=str(d))


def keys(n, salt=0):
    return get_hash_str(list(range(salt, salt + n * PAGE)), None, page_size=PAGE)


def digest(t) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def page_digests(host, idx, n):
    ps = host.page_size
    return [digest(host.get_data_page(int(idx[i * ps]), flat=True)) for i in range(n)]


@pytest.fixture(autouse=True)
def quiet_release(monkeypatch):
    """Every case starts with no published server args, HiCacheFile's directory override unset
    and, on 0.5.23, the failure-injector proxy on with no failures (a delay of up to 1 ms)."""
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    monkeypatch.setattr(get_context(), "_server_args", None)
    if HAS_INJECTOR:
        monkeypatch.setenv(DELAY_ENV, "0.001")
        monkeypatch.setenv(FAILURE_ENV, "0")
    yield


def _behind(b) -> VitrifyStorage:
    """vitrify's backend behind what the controller holds, checking the proxy is there exactly
    on the release that has one."""
    inner = vitrify_backend(b)
    assert isinstance(inner, VitrifyStorage)
    if HAS_INJECTOR:
        assert type(b).__name__ == INJECTOR and not isinstance(b, VitrifyStorage)
    else:
        assert b is inner
    return inner


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(d)


def _record(**fields):
    out = os.environ.get("VITRIFY_RELEASE_OUT")
    if not out:
        return
    doc = json.loads(Path(out).read_text()) if Path(out).exists() else {}
    doc.update(fields)
    Path(out).write_text(json.dumps(doc))


# ---- registration through the release's classes ---------------------------------------------


def test_the_factory_builds_vitrifys_backend_and_a_v1_round_trip_keeps_the_bytes(tmp_path):
    _, host = mha_host("page_first")
    fill_random(host, 1)
    b = attach(host, extra(tmp_path))
    v = _behind(b)
    try:
        n = 5
        idx = host.alloc(n * PAGE)
        want = page_digests(host, idx, n)
        ks = keys(n)
        assert b.batch_set_v1(ks, idx) == [True] * n
        assert b.batch_exists(ks) == n
        dst = host.alloc(n * PAGE)
        assert b.batch_get_v1(ks, dst) == [True] * n
        assert page_digests(host, dst, n) == want
        c = v.counters()
        assert c["set_pages"] == n and c["get_pages"] == n and c["errors"] == 0
        ident = v.identity()
        _record(version=RELEASE, store=ident["store"], pool=ident["pool"],
                rank=ident["rank"])
    finally:
        b.close()


# ---- the differential test against HiCacheFile -----------------------------------------------


GEOMETRIES = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"),
              ("mla", "layer_first"), ("mla", "page_first")]


@pytest.mark.parametrize("kind,layout", GEOMETRIES)
def test_same_answers_and_payload_bytes_as_hicachefile(tmp_path, kind, layout):
    mla = kind == "mla"
    host = mla_host(layout) if mla else mha_host(layout)[1]
    fill_random(host, 7)
    b = attach(host, extra(tmp_path / "vitrify"), mla=mla)
    _behind(b)
    ref = reference(tmp_path / "file", mla=mla)
    assert vitrify_backend(ref) is None  # another backend is not taken for vitrify's
    try:
        a_keys, b_keys = keys(6), keys(3, salt=5000)
        # run A through vitrify's zero-copy path (host indices) and HiCacheFile's tensors
        a_idx = host.alloc(6 * PAGE)
        a_pages = [host.get_data_page(int(a_idx[i * PAGE]), flat=True).clone()
                   for i in range(6)]
        assert b.batch_set_v1(a_keys, a_idx) == [True] * 6
        assert [ref.set(k, p) for k, p in zip(a_keys, a_pages)] == [True] * 6
        # run B as tensors on both (SGLang's generic path)
        g = torch.Generator().manual_seed(99)
        dummy = host.get_dummy_flat_data_page()
        b_pages = [torch.randn(dummy.shape, generator=g).to(dummy.dtype) for _ in range(3)]
        assert b.batch_set(b_keys, b_pages) is True
        assert ref.batch_set(b_keys, b_pages) is True
        # again: already stored, still True on both
        assert b.batch_set_v1(a_keys[:2], a_idx[:2 * PAGE]) == [True] * 2
        assert ref.set(a_keys[0], a_pages[0]) is True

        missing = keys(2, salt=90_000)
        queries = [a_keys, a_keys[:3], a_keys[:3] + b_keys, b_keys, a_keys + missing,
                   missing + a_keys, [], b_keys[:1]]
        for q in queries:
            assert b.batch_exists(q) == ref.batch_exists(q), q
        assert [b.exists(k) for k in a_keys + missing] == \
            [ref.exists(k) for k in a_keys + missing]

        expect = [digest(p) for p in a_pages] + [digest(p) for p in b_pages]
        for run in (a_keys, b_keys, a_keys[:2] + missing[:1] + b_keys[:1]):
            dst = host.alloc(len(run) * PAGE)
            hits = b.batch_get_v1(run, dst)
            mine = [d if ok else None for d, ok in zip(page_digests(host, dst, len(run)), hits)]
            theirs = []
            for k in run:
                t = ref.get(k, host.get_dummy_flat_data_page())
                theirs.append(None if t is None else digest(t))
            assert mine == theirs, run
            # the v0 read (a tensor per key) gives the same bytes
            v0 = b.batch_get(run, [host.get_dummy_flat_data_page() for _ in run])
            assert [None if t is None else digest(t) for t in v0] == theirs
        assert [digest(ref.get(k, host.get_dummy_flat_data_page()))
                for k in a_keys + b_keys] == expect
    finally:
        b.close()


# MLA under tensor parallelism: each TP rank a process with the release's pools, vitrify's
# backend (rank 0 writes, the other ranks read the shared store) and HiCacheFile on one shared
# directory; one JSON command per stdin line, one "@@" JSON answer per command.
_RANK = textwrap.dedent(r"""
    import json, logging, sys
    sys.path.insert(0, sys.argv[5])
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    import sglang_hicache_release_cases as c
    rank, size, vdir, fdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    host = c.mla_host("page_first")
    if rank == 0:
        c.fill_random(host, 1234)
    else:
        host.kv_buffer.zero_()
    b = c.attach(host, c.extra(vdir, reader_refresh_s=0, reader_open_timeout_s=120),
                 tp_rank=rank, tp_size=size, mla=True)
    v = c.vitrify_backend(b)
    ref = c.reference(fdir, tp_rank=rank, tp_size=size, mla=True)

    def answer(obj):
        print("@@" + json.dumps(obj), flush=True)

    answer({"proxy": type(b).__name__, "store": v.identity()["store"],
            "role": v.identity()["role"]})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "set":
            ks = c.keys(cmd["n"], cmd["salt"])
            idx = host.alloc(cmd["n"] * c.PAGE)
            vr = b.batch_set_v1(ks, idx)
            fr = [ref.set(k, host.get_data_page(int(idx[i * c.PAGE]), flat=True))
                  for i, k in enumerate(ks)]
            answer({"vitrify": vr, "file": fr, "digests": c.page_digests(host, idx, cmd["n"])})
        elif cmd["op"] == "exists":
            ks = [k for salt, n in cmd["runs"] for k in c.keys(n, salt)]
            answer({"vitrify": b.batch_exists(ks), "file": ref.batch_exists(ks)})
        elif cmd["op"] == "get":
            ks = c.keys(cmd["n"], cmd["salt"])
            idx = host.alloc(cmd["n"] * c.PAGE)
            vr = b.batch_get_v1(ks, idx)
            fd = []
            for k in ks:
                t = ref.get(k, host.get_dummy_flat_data_page())
                fd.append(None if t is None else c.digest(t))
            answer({"vitrify": vr, "digests": c.page_digests(host, idx, cmd["n"]),
                    "file_digests": fd})
        elif cmd["op"] == "counters":
            answer(v.counters())
    b.close()
""")


def _read(p) -> dict:
    for line in p.stdout:
        if line.startswith("@@"):
            return json.loads(line[2:])
    raise AssertionError(f"a rank process exited with {p.wait()}")


@pytest.mark.parametrize("size", [2])
def test_mla_ranks_as_processes_read_rank0s_bytes_and_hit_like_hicachefile(tmp_path, size):
    fdir = tmp_path / "file"
    fdir.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(size),
                               str(tmp_path / "vitrify"), str(fdir), str(HERE)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in range(size)]

    def ask(r, **cmd):
        procs[r].stdin.write(json.dumps(cmd) + "\n")
        procs[r].stdin.flush()
        return _read(procs[r])

    try:
        hello = [_read(p) for p in procs]
        assert {h["proxy"] for h in hello} == {INJECTOR if HAS_INJECTOR else "VitrifyStorage"}
        assert len({h["store"] for h in hello}) == 1 and f"tpsharedof{size}" in hello[0]["store"]
        assert [h["role"] for h in hello] == ["writer"] + ["reader"] * (size - 1)
        a = ask(0, op="set", salt=0, n=6)     # SGLang backs MLA pages up from rank 0 only
        assert a["vitrify"] == [True] * 6 and a["file"] == [True] * 6
        queries = [[(0, 6)], [(0, 3)], [(0, 3), (7000, 2)], [(7000, 2)], [(0, 6), (8000, 1)]]
        for r in range(size):
            for q in queries:
                got = ask(r, op="exists", runs=q)
                assert got["vitrify"] == got["file"], (r, q, got)
            g = ask(r, op="get", salt=0, n=6)
            assert g["vitrify"] == [True] * 6
            assert g["digests"] == a["digests"] == g["file_digests"], r
        # written after the readers opened: found on a miss's rescan, the same bytes
        b2 = ask(0, op="set", salt=7000, n=2)
        for r in range(1, size):
            assert ask(r, op="exists", runs=[(7000, 2)]) == {"vitrify": 2, "file": 2}
            g = ask(r, op="get", salt=7000, n=2)
            assert g["digests"] == b2["digests"] == g["file_digests"]
        counters = [ask(r, op="counters") for r in range(size)]
        assert counters[0]["set_pages"] == 8
        assert all(c["errors"] == 0 for c in counters)
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
        rcs = [p.wait(timeout=120) for p in procs]
        for p in procs:
            p.stdout.close()
    assert rcs == [0] * size


# ---- the release's real HiCacheController ---------------------------------------------------


@pytest.fixture
def controller(monkeypatch):
    """A real HiCacheController of this release attaching vitrify's backend (through the proxy
    on 0.5.23): its backup thread calls batch_set_v1, its prefetch threads batch_exists and
    batch_get_v1. The one seam: the controller module picks torch.cuda for its streams and
    events at import; torch.cpu has the same API and no device."""
    import threading

    import sglang.srt.managers.cache_controller as ccm
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setattr(ccm, "device_module", torch.cpu)
    made = []

    def make(dev, host, ex):
        alloc = PagedTokenToKVPoolAllocator(dev.size, PAGE, torch.bfloat16, "cpu", dev, False)
        ranks = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        if RELEASE != "0.5.17":  # derived widths 0.5.23's attach reads
            ranks.update(attn_dcp_size=1, attn_dcp_rank=0)
        with get_parallel().override(**ranks):
            cc = ccm.HiCacheController(alloc, host, PAGE, tp_group=None,
                                       load_cache_event=threading.Event(), io_backend="direct",
                                       prefetch_threshold=PAGE, storage_backend="dynamic",
                                       model_name=MODEL, storage_backend_extra_config=dict(ex))
        made.append(cc)
        return cc

    yield make
    for cc in made:
        cc.detach_storage_backend()


def _loaded_tokens(cc, op, timeout=30.0) -> int:
    """Tokens the controller's prefetch loaded into the host pool: 0.5.23 acknowledges each
    batch through ``ack_prefetch_queue`` (the last ack has ``completed_req``); 0.5.17 counts
    them on the operation."""
    import time

    if hasattr(cc, "ack_prefetch_queue"):
        done = 0
        while True:
            ack = cc.ack_prefetch_queue.get(timeout=timeout)
            if ack.completed_tokens is not None:
                done = max(done, ack.completed_tokens)
            if ack.completed_req:
                return done
    t = time.monotonic()
    while op.completed_tokens < op.storage_hit_count and time.monotonic() - t < timeout:
        time.sleep(0.005)
    return op.completed_tokens


def test_the_releases_controller_backs_up_and_prefetches_the_same_bytes(tmp_path, controller):
    dev, host = mha_host("page_first")
    cc = controller(dev, host, extra(tmp_path))
    v = _behind(cc.storage_backend)
    assert cc.page_set_func.__name__ == "_page_set_zero_copy"  # interface_v1 through the proxy
    fill_random(host, 11)
    n = 5
    idx = host.alloc(n * PAGE)
    want = page_digests(host, idx, n)
    tokens = list(range(n * PAGE))
    cc.write_storage(idx, tokens, hash_value=get_hash_str(tokens, None, page_size=PAGE))
    assert cc.ack_backup_queue.get(timeout=30).completed_tokens == n * PAGE
    host.kv_buffer.zero_()
    cc.prefetch("req", tokens)
    op = cc.prefetch_hit_queue.get(timeout=30)
    assert op.storage_hit_count == n * PAGE
    got = host.alloc(op.storage_hit_count)
    op.host_indices = got
    cc.prefetch_buffer.put(op)
    assert _loaded_tokens(cc, op) == n * PAGE
    assert page_digests(host, got, n) == want
    c = v.counters()
    assert c["set_pages"] == n and c["get_pages"] == n and c["errors"] == 0


# ---- v2: the pools folded as the release's HiCacheFile folds them ----------------------------


class Group:
    """KV + two side pools (SWA and an indexer-named pool, both real MHA host pools) in the
    release's HostPoolGroup."""

    def __init__(self, mamba=False):
        kv_dev, self.kv = mha_host("page_first")
        swa_dev, self.swa = mha_host("page_first", layers=2)
        idx_dev, self.ind = mha_host("page_first", layers=1)
        ident = lambda i: i  # noqa: E731
        self.entries = [PoolEntry(PoolName.KV, self.kv, kv_dev, ident,
                                  is_primary_index_anchor=True),
                        PoolEntry(PoolName.SWA, self.swa, swa_dev, ident),
                        PoolEntry(PoolName.INDEXER, self.ind, idx_dev, ident)]
        self.pools = {PoolName.KV: self.kv, PoolName.SWA: self.swa, PoolName.INDEXER: self.ind}
        if mamba:
            m_dev, self.mamba = mamba_host()
            self.entries.append(PoolEntry(PoolName.MAMBA, self.mamba, m_dev, ident))
            self.pools[PoolName.MAMBA] = self.mamba
        self.group = HostPoolGroup(self.entries)
        self.fill(1)

    def fill(self, seed):
        g = torch.Generator().manual_seed(seed)
        for p in self.pools.values():
            for buf in _state_buffers(p):
                flat = buf.view(-1)
                flat.copy_(torch.randn(flat.numel(), generator=g).to(flat.dtype))

    def zero(self):
        for p in self.pools.values():
            for buf in _state_buffers(p):
                buf.zero_()

    def pages(self, name, idx, n):
        pool = self.pools[name]
        ps = pool.page_size
        return [digest(pool.get_data_page(int(idx[i * ps]), flat=True)) for i in range(n)]

    def register(self, backend):
        backend.register_mem_pool_host(self.group)
        for e in self.entries:
            backend.register_mem_host_pool_v2(e.host_pool, e.name)
        if hasattr(HiCacheStorage, "on_host_pools_registered"):
            backend.on_host_pools_registered()
        return backend


def _xfer(name, ks, idx, policy=PoolHitPolicy.ALL_PAGES):
    return PoolTransfer(name=name, host_indices=idx, keys=list(ks), hit_policy=policy)


def _answer(r) -> tuple:
    return (r.kv_hit_pages, dict(r.extra_pool_hit_pages),
            getattr(r, "restorable_prefix_pages", "absent"))


def test_v2_pools_fold_like_the_releases_hicachefile(tmp_path):
    """KV holds pages 0-5, the indexer (all pages) 0-3, SWA (its last 2 pages) only 3-4: SWA
    can restore a prefix of exactly 5 pages, the indexer 1-4. 0.5.17's HiCacheFile answers
    the minimum of the boundaries (4); 0.5.23's the longest prefix both restore (none: 0)."""
    s = Group()
    th = s.register(StorageBackendFactory.create_backend(
        "dynamic", config(extra(tmp_path / "vitrify")), s.group))
    fb = s.register(reference(tmp_path / "file"))
    try:
        ks = keys(6)
        kv_idx, swa_idx, ind_idx = (p.alloc(6 * PAGE) for p in (s.kv, s.swa, s.ind))

        def sub(idx, pages):
            return torch.cat([idx[i * PAGE:(i + 1) * PAGE] for i in pages])

        writes = [_xfer(PoolName.KV, ks, kv_idx),
                  _xfer(PoolName.INDEXER, ks[:4], sub(ind_idx, range(4))),
                  _xfer(PoolName.SWA, ks[3:5], sub(swa_idx, [3, 4]),
                        PoolHitPolicy.TRAILING_PAGES)]
        assert th.batch_set_v2(writes) == fb.batch_set_v2(writes)
        swa2 = _xfer(PoolName.SWA, ks[-2:], swa_idx[-2 * PAGE:], PoolHitPolicy.TRAILING_PAGES)
        ind = _xfer(PoolName.INDEXER, ks, ind_idx)
        cases = [([], 6), ([ind], 4), ([swa2], 5), ([swa2, ind], 4 if RELEASE == "0.5.17" else 0),
                 ([ind, swa2], 4 if RELEASE == "0.5.17" else 0)]
        for transfers, want in cases:
            mine, theirs = th.batch_exists_v2(ks, transfers), fb.batch_exists_v2(ks, transfers)
            assert _answer(mine) == _answer(theirs), transfers
            assert mine.kv_hit_pages == want, transfers
        if RELEASE != "0.5.17":
            assert th.batch_exists_v2(ks, [swa2]).restorable_prefix_pages == [5]
        got = th.batch_get_v2([ind])
        assert got == fb.batch_get_v2([ind]) and got[PoolName.INDEXER] == [True] * 4 + [False] * 2
        assert vitrify_backend(th).counters()["errors"] == 0
    finally:
        th.close()


def test_v2_with_a_mamba_pool_same_answers_and_bytes_as_hicachefile(tmp_path):
    """KV, SWA (all pages) and Mamba state (trailing pages, one page per slot) on the same
    host pool group: the same set / exists / get answers as the release's HiCacheFile, and
    the bytes read back are the bytes written, pool by pool."""
    s = Group(mamba=True)
    th = s.register(StorageBackendFactory.create_backend(
        "dynamic", config(extra(tmp_path / "vitrify")), s.group))
    fb = s.register(reference(tmp_path / "file"))
    TRAIL = PoolHitPolicy.TRAILING_PAGES
    try:
        n = 6
        ks = keys(n)
        kv_idx, swa_idx, m_idx = s.kv.alloc(n * PAGE), s.swa.alloc(n * PAGE), s.mamba.alloc(n)
        want = {PoolName.KV: s.pages(PoolName.KV, kv_idx, n),
                PoolName.SWA: s.pages(PoolName.SWA, swa_idx, n),
                PoolName.MAMBA: s.pages(PoolName.MAMBA, m_idx, n)}
        swa_have, m_have = [0, 1, 3, 4, 5], [2, 3, 5]

        def sub(idx, pages, ps):
            return torch.cat([idx[i * ps:(i + 1) * ps] for i in pages])

        writes = [_xfer(PoolName.KV, ks, kv_idx),
                  _xfer(PoolName.SWA, [ks[i] for i in swa_have], sub(swa_idx, swa_have, PAGE)),
                  _xfer(PoolName.MAMBA, [ks[i] for i in m_have], sub(m_idx, m_have, 1), TRAIL)]
        assert th.batch_set_v2(writes) == fb.batch_set_v2(writes)
        cases = [[], [_xfer(PoolName.SWA, ks, swa_idx)],
                 [_xfer(PoolName.MAMBA, ks[-1:], m_idx[-1:], TRAIL)],
                 [_xfer(PoolName.MAMBA, ks[-2:], m_idx[-2:], TRAIL)],
                 [_xfer(PoolName.MAMBA, ks[-3:], m_idx[-3:], TRAIL)],
                 [_xfer(PoolName.MAMBA, ks[-1:], m_idx[-1:], TRAIL),
                  _xfer(PoolName.SWA, ks, swa_idx)],
                 [_xfer(PoolName.KV, ks, kv_idx)]]
        answers = []
        for case in cases:
            mine, theirs = th.batch_exists_v2(ks, case), fb.batch_exists_v2(ks, case)
            assert _answer(mine) == _answer(theirs), case
            answers.append(mine.kv_hit_pages)
        assert answers[:5] + answers[6:] == [6, 2, 6, 4, 0, 6]
        reads = [_xfer(PoolName.KV, ks, kv_idx), _xfer(PoolName.SWA, ks, swa_idx),
                 _xfer(PoolName.MAMBA, ks, m_idx, TRAIL)]
        got = {}
        for name, b in (("vitrify", th), ("file", fb)):
            s.zero()
            r = b.batch_get_v2(reads)
            got[name] = (r, {t.name: s.pages(t.name, t.host_indices, n) for t in reads})
        assert got["vitrify"][0] == got["file"][0]
        r, pages = got["vitrify"]
        assert r[PoolName.MAMBA] == [i in m_have for i in range(n)]
        for t in reads:
            for i, ok in enumerate(r[t.name]):
                if ok:
                    assert pages[t.name][i] == want[t.name][i] == got["file"][1][t.name][i]
        assert vitrify_backend(th).counters()["errors"] == 0
    finally:
        th.close()


def test_end_of_registration_names_a_group_entry_never_registered(tmp_path, caplog):
    """``on_host_pools_registered`` (0.5.23 calls it after the v2 burst): an entry of the host
    pool group that never came through ``register_mem_host_pool_v2`` is named in one error
    line and its transfers are refused; without a host pool the hook fails the attach."""
    s = Group()
    b = StorageBackendFactory.create_backend("dynamic", config(extra(tmp_path / "v")), s.group)
    v = vitrify_backend(b)
    with pytest.raises(ValueError, match="without register_mem_pool_host"):
        v.on_host_pools_registered()
    b.register_mem_pool_host(s.group)
    for e in s.entries[:2]:  # kv and swa; the indexer entry never registered
        b.register_mem_host_pool_v2(e.host_pool, e.name)
    try:
        v.on_host_pools_registered()
        assert "pool(s) ['indexer'] of the host pool group were not registered" in caplog.text
        ks = keys(2)
        r = b.batch_set_v2([_xfer(PoolName.INDEXER, ks, s.ind.alloc(2 * PAGE))])
        assert r == {PoolName.INDEXER: [False, False]}
        assert v.counters()["v2_refused"] == 1
    finally:
        b.close()


def test_an_unknown_hit_policy_is_no_hit_never_a_guess(tmp_path, caplog):
    if not hasattr(PoolHitPolicy, "BLOCK_GROUPS"):  # 0.5.17: the two policies vitrify folds
        assert set(PoolHitPolicy) == {PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES}
        return
    s = Group()
    th = s.register(StorageBackendFactory.create_backend(
        "dynamic", config(extra(tmp_path / "vitrify")), s.group))
    fb = s.register(reference(tmp_path / "file"))
    try:
        ks = keys(3)
        idx = s.ind.alloc(3 * PAGE)
        w = [_xfer(PoolName.KV, ks, s.kv.alloc(3 * PAGE)), _xfer(PoolName.INDEXER, ks, idx)]
        assert th.batch_set_v2(w) == fb.batch_set_v2(w) == {PoolName.KV: [True] * 3,
                                                            PoolName.INDEXER: [True] * 3}
        blocks = _xfer(PoolName.INDEXER, ks, idx, PoolHitPolicy.BLOCK_GROUPS)
        with pytest.raises(ValueError, match="Unsupported pool hit policy"):
            fb.batch_exists_v2(ks, [blocks])
        r = th.batch_exists_v2(ks, [blocks])
        assert r.kv_hit_pages == 0 and not r.extra_pool_hit_pages
        assert "hit policy" in caplog.text and "block_groups" in caplog.text
        assert vitrify_backend(th).counters()["errors"] == 1
    finally:
        th.close()


# ---- the failure injector (0.5.23) -----------------------------------------------------------


def test_injected_failures_lose_and_corrupt_nothing(tmp_path, monkeypatch):
    """Half of the calls through 0.5.23's proxy fail before reaching the backend: a set that
    answered True is stored with its bytes, one that answered False stored nothing, and a get
    gives either nothing or the right bytes. On 0.5.17 the switches mean nothing: no proxy."""
    monkeypatch.setenv(FAILURE_ENV, "0.5")
    monkeypatch.setenv(DELAY_ENV, "0")
    _, host = mha_host("page_first", tokens=1024)
    fill_random(host, 5)
    b = attach(host, extra(tmp_path))
    v = _behind(b)
    try:
        stored, refused = {}, []
        for i in range(24):
            ks = keys(2, salt=1000 * i)
            idx = host.alloc(2 * PAGE)
            r = b.batch_set_v1(ks, idx)
            assert r in ([True, True], [False, False]), r
            if r[0]:
                stored.update(zip(ks, page_digests(host, idx, 2)))
                host.free(idx)
            else:
                refused += ks
                host.free(idx)
        if HAS_INJECTOR:
            assert stored and refused  # 24 batches at p = 0.5: both kinds
        else:
            assert not refused
        # the backend itself (no proxy) holds exactly the acknowledged pages
        assert [v.exists(k) for k in stored] == [True] * len(stored)
        assert [v.exists(k) for k in refused] == [False] * len(refused)
        host.kv_buffer.zero_()  # a get that reads nothing cannot pass for one that did
        wrong = 0
        for k, want in stored.items():
            dst = host.alloc(PAGE)
            ok = b.batch_get_v1([k], dst)
            if ok == [True]:
                wrong += page_digests(host, dst, 1) != [want]
            host.free(dst)
        assert wrong == 0
        assert v.counters()["errors"] == 0
    finally:
        b.close()


# ---- the identity of a page ------------------------------------------------------------------


def _published(monkeypatch, tiny_model, kv_cache_dtype="auto", declared=None):
    """Publish a real ServerArgs of this release, resolved as its scheduler receives it
    (``declared``: 0.5.23 only, a value resolution declares over the raw input, as SGLang's
    own steps do for DSA / DeepSeek V4 KV dtypes)."""
    sa = ServerArgs(model_path=tiny_model, device="cpu", skip_tokenizer_init=True,
                    kv_cache_dtype=kv_cache_dtype)
    if declared is not None:
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(sa, "test", kv_cache_dtype=declared)
    if hasattr(sa, "resolve_once"):
        sa.resolve_once()
    monkeypatch.setattr(get_context(), "_server_args", sa)
    return sa


def _stored_then_found(tmp_path, host, ks, idx):
    b = attach(host, extra(tmp_path, cold_start="load"))
    try:
        v = _behind(b)
        hits = b.batch_exists(ks)
        if hits == 0:
            assert b.batch_set_v1(ks, idx) == [True] * len(ks)
        return v.identity(), hits
    finally:
        b.close()


def test_the_kv_cache_dtype_as_the_release_resolves_it_is_part_of_the_identity(
        tmp_path, monkeypatch, tiny_model):
    _, host = mha_host("page_first")
    fill_random(host, 3)
    ks = keys(3)
    idx = host.alloc(3 * PAGE)
    _published(monkeypatch, tiny_model, "auto")
    auto, hits = _stored_then_found(tmp_path, host, ks, idx)
    assert hits == 0 and auto["model"]["kv_cache_dtype"] == "auto"
    assert _stored_then_found(tmp_path, host, ks, idx)[1] == 3    # same identity: a hit
    _published(monkeypatch, tiny_model, "fp8_e4m3")
    fp8, hits = _stored_then_found(tmp_path, host, ks, idx)
    assert hits == 0, "a page of another KV dtype was served"
    assert fp8["model"]["kv_cache_dtype"] == "fp8_e4m3" and fp8["store"] != auto["store"]
    assert fp8["pool"] == auto["pool"]  # the host pool is the same: only the model part differs
    if RELEASE != "0.5.17":
        # 0.5.23 keeps the raw input "auto" on the record; the resolved value is read
        sa = _published(monkeypatch, tiny_model, "auto", declared="fp8_e4m3")
        assert sa.kv_cache_dtype == "auto"
        declared, hits = _stored_then_found(tmp_path, host, ks, idx)
        assert declared["model"]["kv_cache_dtype"] == "fp8_e4m3"
        assert declared["store"] == fp8["store"] and hits == 3
    # the host pool's dtype changes the page's bytes too
    monkeypatch.setattr(get_context(), "_server_args", None)
    names = set()
    for dtype in (torch.bfloat16, torch.float16):
        _, h = mha_host("page_first", dtype=dtype)
        b = attach(h, extra(tmp_path / "dtype"))
        names.add(vitrify_backend(b).identity()["store"])
        b.close()
    assert len(names) == 2


# ---- refusals --------------------------------------------------------------------------------


def test_a_host_layout_vitrify_cannot_gather_is_refused_in_one_line(tmp_path):
    _, host = mha_host("page_head")
    with pytest.raises(ValueError, match=r"host layout 'page_head' is not supported") as e:
        attach(host, extra(tmp_path))
    assert "\n" not in str(e.value)


def test_decode_context_parallelism_is_refused_in_one_line(tmp_path):
    host = mla_host("page_first")
    if not hasattr(config({}), "dcp_size"):
        # 0.5.17's config has no DCP fields: nothing of DCP reaches the backend
        assert VER.hicache_refusal(config({})) is None
        return
    cfg = config(extra(tmp_path), tp_rank=1, tp_size=2, mla=True, dcp_size=2, dcp_rank=1,
                 logical_page_size=2 * PAGE)
    with pytest.raises(ValueError, match=r"decode context parallelism \(dcp_size=2") as e:
        StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert "\n" not in str(e.value)
    assert not any(tmp_path.iterdir())  # nothing created


def test_buffer_only_host_memory_is_refused_in_one_line(tmp_path, monkeypatch, tiny_model):
    _, host = mha_host("page_first")
    sa = _published(monkeypatch, tiny_model)
    if "hicache_host_memory_mode" not in VER.server_args_fields(ServerArgs):
        attach(host, extra(tmp_path)).close()  # 0.5.17 has no host-memory modes
        return
    from sglang.srt.arg_groups.overrides import declare_resolution

    sa = ServerArgs(model_path=tiny_model, device="cpu", skip_tokenizer_init=True)
    declare_resolution(sa, "test", hicache_host_memory_mode="buffer_only")
    monkeypatch.setattr(get_context(), "_server_args", sa)
    with pytest.raises(ValueError, match=r"--hicache-host-memory-mode buffer_only is not "
                                         r"supported") as e:
        attach(host, extra(tmp_path))
    assert "\n" not in str(e.value)
    # the default mode serves
    monkeypatch.setattr(get_context(), "_server_args", _published(monkeypatch, tiny_model))
    attach(host, extra(tmp_path)).close()


def test_a_dp_attention_group_other_than_0_names_its_own_slabs(tmp_path):
    """0.5.23: with DP attention ``tp_rank`` is local to the group; ``dp_rank`` tells the
    groups apart, so two groups never write one slab. Group 0 keeps the plain names."""
    if not hasattr(config({}), "dp_rank"):
        assert VER.hicache_rank_extra(config({})) == ""
        return
    names = []
    for dp in (0, 1):
        _, host = mha_host("page_first")
        b = attach(host, extra(tmp_path), dp_rank=dp)
        v = vitrify_backend(b)
        names.append((v.identity()["store"], v.slab_paths))
        b.close()
    assert names[0][0].endswith("-tp0of1-pp0of1-cp0of1")
    assert names[1][0].endswith("-tp0of1-pp0of1-cp0of1-dp1")
    assert not set(names[0][1]) & set(names[1][1])
