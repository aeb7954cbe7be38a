"""MLA models under tensor parallelism: every TP rank a real process, against SGLang's HiCacheFile.

SGLang backs MLA pages up from TP rank 0 only (``HiCacheController.backup_skip``) and every rank
reads them. Each rank here is its own process holding a real ``MLATokenToKVPoolHost`` (over a
CPU ``MLATokenToKVPool``) and two backends built from SGLang's real ``HiCacheStorageConfig``
(``is_mla_model=True``, ``tp_size`` 2 or 4, this rank's ``tp_rank``): vitrify's (through
SGLang's backend factory, as at attach) and SGLang's ``HiCacheFile`` on one directory all ranks
share. Rank 0 opens vitrify's shared store read-write, the other ranks read-only
(python/vitrify/integrations/sglang/DESIGN.md, "MLA under tensor parallelism"; disk D14).

Checks: every rank gets rank 0's pages with rank 0's bytes (pages written before and after the
readers opened), vitrify and HiCacheFile give the same hit/miss prefix for the same key
sequences on every rank (the differential check), a set on a rank > 0 succeeds without writing
(HiCacheFile's non-owner ranks write nothing either once SGLang skips their backups), and the
ranks name one store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import hicache_cases

pytestmark = pytest.mark.sglang

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

# One TP rank: reads JSON commands on stdin, answers one "@@"-prefixed JSON line each.
_RANK = textwrap.dedent(r"""
    import hashlib, json, logging, os, sys
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    rank, size, extra, file_dir = (int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]),
                                   sys.argv[4])
    PAGE = 16
    dev = MLATokenToKVPool(size=512, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=64,
                           qk_rope_head_dim=16, layer_num=3, device="cpu",
                           enable_memory_saver=False)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, PAGE, "page_first", pin_memory=False,
                                device="cpu")
    if rank == 0:   # only rank 0's pool holds data; the readers' pools start zeroed
        g = torch.Generator().manual_seed(1234)
        flat = host.kv_buffer.view(-1)
        flat.copy_(torch.randn(flat.numel(), generator=g).to(flat.dtype))
    else:
        host.kv_buffer.zero_()

    def config(ex):
        return HiCacheStorageConfig(
            tp_rank=rank, tp_size=size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="deepseek-ai/tiny-mla", extra_config=dict(ex))

    vit = StorageBackendFactory.create_backend("dynamic", config(extra), host)
    vit.register_mem_pool_host(host)
    ref = HiCacheFile(config({}), file_path=file_dir)

    def keys(salt, n):
        return get_hash_str(list(range(salt, salt + n * PAGE)), None, page_size=PAGE)

    def digest(t):
        return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

    def page_digests(idx, n):
        return [digest(host.get_data_page(int(idx[i * PAGE]), flat=True)) for i in range(n)]

    def answer(obj):
        print("@@" + json.dumps(obj), flush=True)

    answer({"ready": True, "identity": vit.identity(), "paths": vit.slab_paths})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "set":          # what the controller's backup does on this rank
            ks = keys(cmd["salt"], cmd["n"])
            idx = host.alloc(cmd["n"] * PAGE)
            vr = vit.batch_set_v1(ks, idx)
            fr = ([ref.set(k, host.get_data_page(int(idx[i * PAGE]), flat=True))
                   for i, k in enumerate(ks)] if cmd.get("file", True) else None)
            answer({"vitrify": vr, "file": fr, "digests": page_digests(idx, cmd["n"])})
        elif op == "exists":     # each entry: (salt, n) page runs, concatenated
            ks = [k for salt, n in cmd["runs"] for k in keys(salt, n)]
            answer({"vitrify": vit.batch_exists(ks), "file": ref.batch_exists(ks)})
        elif op == "get":
            ks = keys(cmd["salt"], cmd["n"])
            idx = host.alloc(cmd["n"] * PAGE)
            vr = vit.batch_get_v1(ks, idx)
            vd = page_digests(idx, cmd["n"])
            fd = []
            for k in ks:
                t = ref.get(k, host.get_dummy_flat_data_page())
                fd.append(None if t is None else digest(t))
            answer({"vitrify": vr, "vitrify_digests": vd, "file_digests": fd})
        elif op == "counters":
            answer(vit.counters())
        else:
            raise SystemExit(f"unknown op {op}")
    vit.close()
    answer({"closed": True})
""")


class Ranks:
    """``size`` rank processes, started together (the readers wait for rank 0's store)."""

    def __init__(self, size: int, tmp_path, **extra) -> None:
        self.dir = tmp_path / "vitrify"
        self.file_dir = tmp_path / "hicache-file"
        self.file_dir.mkdir()
        ex = hicache_cases.extra_config(self.dir, reader_refresh_s=0, cold_start="clear",
                                        reader_open_timeout_s=120, **extra)
        self.procs = [subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(size), json.dumps(ex), str(self.file_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(size)]
        self.hello = [self._read(p) for p in self.procs]

    @staticmethod
    def _read(p) -> dict:
        for line in p.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise AssertionError(f"rank process exited with {p.wait()}")

    def ask(self, rank: int, **cmd) -> dict:
        p = self.procs[rank]
        p.stdin.write(json.dumps(cmd) + "\n")
        p.stdin.flush()
        return self._read(p)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.stdin.close()
        for p in self.procs:
            rc = p.wait(timeout=120)
            p.stdout.close()
            assert rc == 0


@pytest.fixture
def ranks(tmp_path, request):
    rs = Ranks(request.param, tmp_path)
    try:
        yield rs
    finally:
        rs.close()


@pytest.mark.parametrize("ranks", [2, 4], indirect=True)
def test_rank0_writes_every_rank_reads_the_same_bytes_and_hits_like_hicache_file(ranks):
    size = len(ranks.procs)
    # one store for every TP rank: no TP rank in its name, the TP size and the rest still there
    names = {h["identity"]["store"] for h in ranks.hello}
    assert len(names) == 1 and f"tpsharedof{size}" in names.pop()
    assert [h["identity"]["role"] for h in ranks.hello] == ["writer"] + ["reader"] * (size - 1)
    assert len({tuple(h["paths"]) for h in ranks.hello}) == 1

    # rank 0 backs up 8 pages (SGLang skips the backup on the other ranks)
    a = ranks.ask(0, op="set", salt=0, n=8)
    assert a["vitrify"] == [True] * 8 and a["file"] == [True] * 8

    # page hashes chain from the first page, so (salt, n) is the n-page prefix of salt's run
    queries = [[(0, 8)], [(0, 4)], [(0, 4), (5000, 2)], [(5000, 3)], [(0, 8), (9000, 1)]]

    def same_hits_everywhere():
        want = None
        for r in range(size):
            hits = []
            for q in queries:
                got = ranks.ask(r, op="exists", runs=q)
                assert got["vitrify"] == got["file"], (r, q, got)
                hits.append(got["vitrify"])
            want = want or hits
            assert hits == want, (r, hits, want)
        return want

    assert same_hits_everywhere() == [8, 4, 4, 0, 8]
    for r in range(size):
        g = ranks.ask(r, op="get", salt=0, n=8)
        assert g["vitrify"] == [True] * 8, r
        assert g["vitrify_digests"] == a["digests"], r   # rank 0's bytes, on every rank
        assert g["file_digests"] == a["digests"], r

    # pages rank 0 writes after the readers opened: found (a rescan on the miss), same bytes
    b = ranks.ask(0, op="set", salt=5000, n=6)
    assert b["vitrify"] == [True] * 6
    queries.append([(0, 8), (5000, 6)])
    assert same_hits_everywhere() == [8, 4, 6, 3, 8, 14]
    for r in range(1, size):
        g = ranks.ask(r, op="get", salt=5000, n=6)
        assert g["vitrify"] == [True] * 6
        assert g["vitrify_digests"] == b["digests"] == g["file_digests"]

    # a set on a rank > 0 succeeds and writes nothing: no rank finds the pages
    c = ranks.ask(size - 1, op="set", salt=9000, n=3, file=False)
    assert c["vitrify"] == [True] * 3
    for r in range(size):
        assert ranks.ask(r, op="exists", runs=[(9000, 3)])["vitrify"] == 0
    counters = [ranks.ask(r, op="counters") for r in range(size)]
    assert counters[0]["set_pages"] == 14
    assert all(c["set_pages"] == 0 and c["errors"] == 0 for c in counters[1:])
    assert all(c["errors"] == 0 for c in counters)


# ---- in one process: the reader's rescan interval, its open timeout, the settings -------------

def _in_process(tmp_path, rank, **extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    dev = MLATokenToKVPool(size=256, page_size=16, dtype=torch.bfloat16, kv_lora_rank=64,
                           qk_rope_head_dim=16, layer_num=2, device="cpu",
                           enable_memory_saver=False)
    host = MLATokenToKVPoolHost(dev, 2.0, 0, 16, "page_first", pin_memory=False, device="cpu")
    cfg = HiCacheStorageConfig(
        tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="deepseek-ai/tiny-mla",
        extra_config=hicache_cases.extra_config(tmp_path, cold_start="clear", **extra))
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    b.register_mem_pool_host(host)
    return host, b


def test_reader_rescans_at_most_once_per_interval_and_times_out_without_a_writer(tmp_path):
    import time

    from sglang.srt.mem_cache.utils import get_hash_str

    with pytest.raises(RuntimeError, match="TP rank 0"):
        _in_process(tmp_path, 1, reader_open_timeout_s=0.2)
    assert not any(tmp_path.iterdir())               # the reader created nothing
    for bad in (-1, "2", True, 1e9):
        with pytest.raises(ValueError, match="reader_refresh_s"):
            _in_process(tmp_path, 0, reader_refresh_s=bad)

    host0, w = _in_process(tmp_path, 0)
    _, r = _in_process(tmp_path, 1, reader_refresh_s=1.0)
    keys = get_hash_str(list(range(8 * 16)), None, page_size=16)
    assert w.batch_set_v1(keys[:4], host0.alloc(4 * 16)) == [True] * 4
    # the reader opened after nothing was written: the first miss rescans only once the
    # interval since the open has passed
    time.sleep(1.1)
    assert r.batch_exists(keys) == 4                 # rescanned on the miss
    assert w.batch_set_v1(keys[4:], host0.alloc(4 * 16)) == [True] * 4
    assert r.batch_exists(keys) == 4                 # within the interval: no rescan
    time.sleep(1.1)
    assert r.batch_exists(keys) == 8
    assert r.clear() and r.batch_exists(keys) == 8   # a reader's clear is rank 0's business
    r.close()
    w.close()
