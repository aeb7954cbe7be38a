"""The CPU pieces of the HiCache end-to-end run (``vitrify.bench.sglang.hicache_e2e``,
``benchmarks/sglang_hicache_e2e.py``; the real-server run needs a GPU).

The server command lines go through SGLang's own CLI parser (``ServerArgs.add_cli_args``), the
vitrify extra config through HiRadixCache's own extra-config parser and the ``dynamic`` backend
factory into a ``VitrifyStorage`` attached to a real ``MHATokenToKVPoolHost`` of the script's model
geometry; the write observable reads the stats file the backend really writes (its
``stats_path``); the client parses a stream in the format of SGLang's ``/generate`` (``data: <json>`` chunks, ``data: [DONE]``); a whole run against a stand-in server, its planted
fault included.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from vitrify.bench.sglang import hicache_e2e as e2e  # noqa: E402
from vitrify.bench.sglang import models, oracle  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _settings(tmp_path, **kw):
    return e2e.Settings(work=str(tmp_path / "work"), out=str(tmp_path / "out"),
                        site=str(tmp_path / "site"), **kw)


def _parse(cmd):
    import argparse

    from sglang.srt.server_args import ServerArgs

    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p.parse_args(cmd[3:])


def test_the_8b_shape_has_9_mib_pages_and_its_own_launch_settings(tmp_path):
    s = e2e.Settings.for_shape("8b", work=str(tmp_path / "w"), out=str(tmp_path / "o"))
    assert e2e.kv_bytes_per_token(s.model_config) == 147456  # 36 x 2 x 8 x 128 x 2
    assert s.page_tokens == 64 and s.page_bytes == 9 << 20
    assert s.model_config["num_hidden_layers"] == 36 and s.model_dir != e2e.Settings().model_dir
    a = _parse(e2e.server_args(s, "vitrify"))
    assert a.mem_fraction_static == 0.5 and a.page_size == 64
    assert json.loads(a.hicache_storage_backend_extra_config)["budget_bytes"] == 8 << 30
    assert e2e.Settings.for_shape("8b", budget_s=100.0).budget_s == 100.0  # explicit wins
    with pytest.raises(ValueError, match="unknown shape 'huge'"):
        e2e.Settings.for_shape("huge")
    s2, _ = e2e.parse_args(["--shape", "8b", "--work", str(tmp_path)])
    assert s2.shape == "8b" and s2.budget_s == 570.0


def test_break_even_bandwidth_and_the_drive_floor():
    def row(name, prompt_tokens, cached, storage, ttft_ms, prompts=2):
        return {"scenario": "vitrify", "pass": name, "prompts": prompts,
                "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                "cached_storage": storage, "ttft_ms_mean": ttft_ms}

    cfg = e2e.model_config("8b")
    # 2 prompts of 3,250 tokens in 100 ms each: 32,500 tokens/s x 147,456 B = 4.79 GB/s.
    rows = [row("miss", 6500, 0, 0, 100.0), row("l3_hit", 6500, 6400, 6400, 330.0)]
    be = e2e.break_even(rows, cfg, 1.5e9)
    assert be["prefill_tokens_per_s"] == pytest.approx(32500)
    assert be["break_even_read_bytes_per_s"] == pytest.approx(32500 * 147456)
    assert be["l3_pays"] is False and "loses to" in be["verdict"]
    # floor per request: 3,200 stored tokens' KV at 1.5 GB/s + 50 uncached tokens' prefill
    floor = (3200 * 147456 / 1.5e9 + 50 / 32500) * 1e3
    assert be["l3_hit_floor_ms"] == pytest.approx(floor)
    assert be["l3_hit_ttft_over_floor"] == pytest.approx(330.0 / floor)
    assert e2e.break_even(rows, cfg, 8e9)["l3_pays"] is True
    assert "drive_read_bytes_per_s" not in e2e.break_even(rows, cfg, None)
    assert "error" in e2e.break_even([], cfg, 1e9)


def test_page_is_one_mib_for_the_model():
    assert e2e.kv_bytes_per_token(models.QWEN3_TINY) == 16384
    assert e2e.page_tokens_for(models.QWEN3_TINY) == 64
    with pytest.raises(ValueError, match="1000"):
        e2e.page_tokens_for(models.QWEN3_TINY, 1000)


@pytest.mark.parametrize("scenario", e2e.SCENARIOS)
def test_server_args_parse_with_sglangs_parser(tmp_path, scenario):
    s = _settings(tmp_path)
    a = _parse(e2e.server_args(s, scenario))
    assert a.enable_hierarchical_cache and not a.disable_radix_cache
    assert a.page_size == 64 and a.hicache_write_policy == "write_through"
    assert a.hicache_storage_prefetch_policy == "wait_complete"
    assert a.hicache_mem_layout == "page_first" and a.hicache_io_backend == "kernel"
    assert a.load_format == "auto" and a.skip_tokenizer_init   # the seeded checkpoint
    assert a.model_path == s.model_dir and a.enable_deterministic_inference
    assert a.attention_backend == "triton" and a.sampling_backend == "pytorch"
    assert a.max_total_tokens == 65536 and a.hicache_ratio == 2.0
    assert a.cuda_graph_backend_decode == "disabled"
    assert a.cuda_graph_backend_prefill == "disabled"
    if scenario == "file":
        assert a.hicache_storage_backend == "file"
        assert a.hicache_storage_backend_extra_config is None
    else:
        assert a.hicache_storage_backend == "dynamic"
        extra = json.loads(a.hicache_storage_backend_extra_config)
        assert extra["cold_start"] == ("clear" if scenario == "vitrify" else "load")
        assert extra.get("role", "writer") == ("reader" if scenario == "vitrify_second"
                                               else "writer")
    with pytest.raises(ValueError, match="nope"):
        e2e.server_args(s, "nope")


@pytest.mark.parametrize("scenario", ["vitrify", "vitrify_restart"])
def test_extra_config_reaches_vitrify_through_sglang(tmp_path, scenario):
    """HiRadixCache's parser -> HiCacheStorageConfig -> the dynamic factory -> VitrifyStorage,
    attached to a host pool of the script's model: 1 MiB pages in the configured directory."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from vitrify.integrations.sglang.hicache import VitrifyStorage

    s = _settings(tmp_path)
    a = _parse(e2e.server_args(s, scenario))
    extra, threshold, _, pass_prefix = HiRadixCache._parse_storage_backend_extra_config(
        None, a.hicache_storage_backend_extra_config)
    assert threshold == 256 and pass_prefix is False   # SGLang's defaults: 4 pages of 64
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=False,
                               enable_storage_metrics=False, is_page_first_layout=True,
                               model_name=s.model_dir, extra_config=extra)
    b = StorageBackendFactory.create_backend(a.hicache_storage_backend, cfg, None)
    try:
        assert isinstance(b, VitrifyStorage) and b.interface_v1
        assert b.settings.dirs == (s.vitrify_dir,)
        assert b.settings.budget_bytes == s.vitrify_budget_bytes
        assert b.settings.cold_start == extra["cold_start"]
        assert b.settings.stats_path == e2e.stats_path_of(s, scenario)
        m = models.QWEN3_TINY
        dev = MHATokenToKVPool(size=256, page_size=a.page_size, dtype=torch.bfloat16,
                               head_num=m["num_key_value_heads"], head_dim=m["head_dim"],
                               layer_num=m["num_hidden_layers"], device="cpu",
                               enable_memory_saver=False, enable_alt_stream=False)
        host = MHATokenToKVPoolHost(dev, a.hicache_ratio, 0, a.page_size, a.hicache_mem_layout,
                                    pin_memory=False, device="cpu")
        os.makedirs(s.vitrify_dir)
        b.register_mem_pool_host(host)
        assert b.vitrify_stats()["page_bytes"] == 1 << 20
        assert all(p.startswith(s.vitrify_dir + "/") and os.path.exists(p) for p in b.slab_paths)
    finally:
        b.close()


def test_file_backend_directory_reaches_sglang(tmp_path, monkeypatch):
    from sglang.srt.environ import envs

    s = _settings(tmp_path)
    env = e2e.server_env(s, "file", base={"PATH": "/usr/bin", "VITRIFY_LOG_LEVEL": "DEBUG"},
                         probe=False)
    assert env["PYTHONPATH"] == s.site and env["HF_HUB_OFFLINE"] == "1"
    assert env["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    assert "VITRIFY_LOG_LEVEL" not in env   # vitrify's INFO lines must go through SGLang's logger
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
                       env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"])
    assert envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.get() == s.file_dir
    vitrify_env = e2e.server_env(s, "vitrify", base={"PYTHONPATH": "/x"}, probe=False)
    assert vitrify_env["PYTHONPATH"] == s.site + os.pathsep + "/x"
    assert "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR" not in vitrify_env


def test_write_observable_reads_the_backends_stats_file(tmp_path):
    """The counter the script waits on is set_pages from the file the real backend keeps at its
    stats_path (through SGLang's factory), not a log line."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    page = 16
    dev = MHATokenToKVPool(size=256, page_size=page, dtype=torch.bfloat16, head_num=2,
                           head_dim=64, layer_num=2, device="cpu", enable_memory_saver=False,
                           enable_alt_stream=False)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, page, "page_first", pin_memory=False,
                                device="cpu")
    stats = str(tmp_path / "stats.json")
    assert e2e.vitrify_pages_written(stats) == 0 and e2e.backend_stats(stats) == {}
    extra = {"backend_name": "vitrify", "module_path": "vitrify.integrations.sglang.hicache",
             "class_name": "VitrifyStorage", "interface_v1": 1, "dirs": [str(tmp_path / "d")],
             "budget_bytes": 8 << 20, "cold_start": "clear", "stats_path": stats}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=True, model_name="m", extra_config=extra)
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    b.register_mem_pool_host(host)
    try:
        st = e2e.backend_stats(stats)
        assert st["store"]["cold_start"] == "clear"
        assert st["store"]["page_bytes"] == b.vitrify_stats()["page_bytes"]
        assert e2e.vitrify_pages_written(stats) == 0
        keys = get_hash_str(list(range(5 * page)), None, page_size=page)
        idx = host.alloc(5 * page)
        assert all(b.batch_set_v1(keys[:3], idx[:3 * page]))
        assert e2e.vitrify_pages_written(stats) == 3
        assert all(b.batch_set_v1(keys, idx))        # 3 already stored, 2 new
        assert all(b.batch_get_v1(keys, idx))
        assert e2e.vitrify_pages_written(stats) == 5
        st = e2e.backend_stats(stats)
        assert st["counters"] == b.counters()
        assert st["counters"]["get_pages"] == 5 and st["counters"]["errors"] == 0
    finally:
        b.close()
    assert e2e.backend_stats(stats)["closed"] is True
    (tmp_path / "half.json").write_text('{"counters": {"set_pa')
    assert e2e.backend_stats(str(tmp_path / "half.json")) == {}
    assert e2e.vitrify_pages_written(str(tmp_path / "half.json")) == 0


def test_file_observable_counts_final_files_only(tmp_path):
    (tmp_path / "a_m_0_1.bin").write_bytes(b"x")
    (tmp_path / "b_m_0_1.bin.tmp.1.2.abc").write_bytes(b"x")
    assert e2e.file_pages_written(str(tmp_path)) == 1
    assert e2e.file_pages_written(str(tmp_path / "none")) == 0


def test_wait_written_needs_count_and_settle():
    seq = iter([1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3])
    n, _ = e2e.wait_written(lambda: next(seq), 3, timeout=10, settle=0.5)
    assert n == 3
    with pytest.raises(RuntimeError, match="only 1 of 9"):
        e2e.wait_written(lambda: 1, 9, timeout=0.3, settle=0.1)


class _FakeSGLang(http.server.BaseHTTPRequestHandler):
    """Streams like SGLang's /generate for input_ids requests (cumulative output_ids)."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        out = []
        for i in range(n):
            out.append(100 + i)
            chunk = {"output_ids": list(out), "meta_info": {
                "prompt_tokens": len(body["input_ids"]), "cached_tokens": 128,
                "cached_tokens_details": {"device": 0, "host": 0, "storage": 128,
                                          "storage_backend": "VitrifyStorage"},
                "output_token_logprobs": [[-0.5 * (j + 1), 100 + j, None]
                                          for j in range(i + 1)]}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *a):
        pass


def test_generate_parses_the_stream():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        r = e2e.generate(srv.server_address[1], list(range(200)), 4)
    finally:
        srv.shutdown()
    assert r["output_ids"] == [100, 101, 102, 103]
    assert r["logprobs"] == [-0.5, -1.0, -1.5, -2.0]
    assert r["cached_tokens"] == 128 and r["details"]["storage"] == 128
    assert r["prompt_tokens"] == 200 and 0 < r["ttft_s"] <= r["latency_s"]


def _res(ids, cached=0, storage=0, plen=200, ttft=0.01, lp=None):
    """One request's result as generate() returns it."""
    det = {"device": cached - storage, "host": 0, "storage": storage} if cached else {}
    return {"output_ids": ids, "logprobs": lp if lp is not None else [-1.0] * len(ids),
            "cached_tokens": cached, "details": det, "prompt_tokens": plen, "ttft_s": ttft,
            "latency_s": 2 * ttft}


def test_comparisons():
    a = [_res([1, 2]), _res([3, 4])]
    assert e2e.tokens_identical(a, [_res([1, 2]), _res([3, 4])])
    assert not e2e.tokens_identical(a, [_res([1, 2]), _res([3, 5])])
    assert not e2e.tokens_identical(a, a[:1])
    assert not e2e.tokens_identical([_res([])], [_res([])])      # empty outputs prove nothing
    assert e2e.logprob_diff(a, a) == 0.0
    assert e2e.logprob_diff(a, [_res([1, 2], lp=[-1.0, -1.25]), a[1]]) == 0.25
    assert e2e.logprob_diff(a, [_res([1, 2], lp=[-1.0]), a[1]]) is None
    # 200-token prompts, 64-token pages: 3 reusable pages (199 tokens matchable)
    assert e2e.prefix_pages(200, 64) == 3 and e2e.prefix_pages(193, 64) == 3
    assert e2e.prefix_pages(192, 64) == 2
    assert e2e.all_from_storage([_res([1], 192, 192)], 64)
    assert not e2e.all_from_storage([_res([1], 192, 128)], 64)   # part recomputed
    assert not e2e.all_from_storage([_res([1], 192, 0)], 64)     # from device, not L3
    assert not e2e.all_from_storage([], 64)


def test_assemble_rows_ratios_checks_and_write(tmp_path):
    s = _settings(tmp_path)
    rows, res = [], {}

    def add(sc, name, rr, ref=None):
        res[(sc, name)] = rr
        rows.append(e2e.summarize(sc, "vitrify" if sc != "file" else "file", name, rr, 64,
                                  res.get(ref), ref and "/".join(ref)))

    add("vitrify", "miss", [_res([1, 2], ttft=0.040)])
    add("vitrify", "l3_hit", [_res([1, 2], 192, 192, ttft=0.010)], ("vitrify", "miss"))
    add("file", "miss", [_res([1, 2], ttft=0.040)], ("vitrify", "miss"))
    add("file", "l3_hit", [_res([1, 2], 192, 192, ttft=0.030)], ("file", "miss"))
    l3 = rows[1]
    assert l3["tokens_identical"] is True and l3["cached_storage"] == 192
    assert l3["reusable_tokens"] == 192 and l3["storage_tokens_per_request"] == [192]
    checks = {"vitrify.tokens_identical": True, "file.tokens_identical": True}
    scen = {"vitrify": {"ok": True}, "file": {"ok": True}}
    power = oracle.power([{"distinct": True}], {"fault": "f", "caught": True})
    out = e2e.assemble(s, rows, checks, scen, {"vitrify_restart": "time"}, {"total_s": 1.0},
                       power)
    assert out["name"] == "sglang-hicache-e2e" and out["ok"] is True
    assert out["oracle_power"]["ok"] is True
    assert out["ratios"]["l3_hit_ttft_file_over_vitrify"] == pytest.approx(3.0)
    assert out["ratios"]["vitrify_ttft_miss_over_l3_hit"] == pytest.approx(4.0)
    assert out["goals"] == e2e.GOALS
    assert out["goal_direction"] == {**{k: ">=" for k in e2e.GOALS}, **e2e.GOAL_DIRECTION}
    assert out["settings"]["page_bytes"] == 1 << 20
    assert out["skipped"] == {"vitrify_restart": "time"}
    bad = e2e.assemble(s, rows, {**checks, "file.tokens_identical": False}, scen, {}, {}, power)
    assert bad["ok"] is False
    assert e2e.assemble(s, [], {}, {}, {}, {}, power)["ok"] is False    # nothing ran: not ok
    # every check true, but a blind oracle: the run failed
    blind = oracle.power([{"distinct": False, "why": "same"}], {"fault": "f", "caught": True})
    assert e2e.assemble(s, rows, checks, scen, {}, {}, blind)["ok"] is False
    assert e2e.assemble(s, rows, checks, scen, {}, {})["ok"] is False  # no oracle at all
    p = e2e.resultlib.write(out, tmp_path / "o")
    assert p.name.startswith("sglang-hicache-e2e-") and json.loads(p.read_text())["ok"]


def test_dry_run_prints_every_command(capsys):
    assert e2e.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for sc in e2e.SCENARIOS:
        assert f"# {sc}\n" in out
    assert out.count("-m sglang.launch_server") == 4
    assert "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=" in out
    assert '"cold_start":"load"' in out and '"cold_start":"clear"' in out
    assert out.count("--enable-deterministic-inference") == 4


def test_dry_run_runs_as_a_script():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sglang_hicache_e2e.py"),
                        "--dry-run"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--hicache-storage-backend dynamic" in r.stdout


# ---- the whole orchestration against a stand-in server ----------------------------------------

_FAKE_LAUNCH_SERVER = r'''
"""Stand-in for `python -m sglang.launch_server` (test only): the same CLI, the HTTP endpoints
the e2e script uses, a radix cache ("device", LRU, --max-total-tokens; what it evicts stays in
"host", which holds every page inserted since the last flush, like write_through), an L3 store that persists like the backend under
test (vitrify: a JSON file in dirs[0], cold_start clear/load; file: one .bin per page), and, for
vitrify, the counters file the real backend keeps at the extra config's stats_path. Pages are
keyed as SGLang keys them (a SHA-256 chain over the pages' token ids); a restarted vitrify store
reads dirs[0]/poison.json, the keys whose pages the test's planted fault replaced: a request
served from storage through one of them answers other tokens (a wrong page of KV)."""
import argparse, hashlib, json, os, struct, sys, threading, time, http.server

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int)
ap.add_argument("--page-size", type=int)
ap.add_argument("--max-total-tokens", type=int)
ap.add_argument("--hicache-storage-backend")
ap.add_argument("--hicache-storage-backend-extra-config")
a, _ = ap.parse_known_args()
page = a.page_size
backend = a.hicache_storage_backend
if backend == "dynamic":
    extra = json.loads(a.hicache_storage_backend_extra_config)
    db = os.path.join(extra["dirs"][0], "fake.json")
    stored = set()
    poison = set()
    if extra["cold_start"] == "load" and os.path.exists(db):
        with open(db) as f:
            stored = set(json.load(f))
        pf = os.path.join(extra["dirs"][0], "poison.json")
        if os.path.exists(pf):
            with open(pf) as f:
                poison = set(json.load(f))
else:
    fdir = os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"]
    os.makedirs(fdir, exist_ok=True)
    stored = {n[:-4] for n in os.listdir(fdir) if n.endswith(".bin")}
    poison = set()
from collections import OrderedDict
device = OrderedDict()
host = set()
total = [0]

def to_device(ks):
    for k in ks:
        device[k] = None
        device.move_to_end(k)
        host.add(k)
    while len(device) > a.max_total_tokens // page:
        device.popitem(last=False)

def publish():  # like the backend: the whole file, renamed into place
    if backend != "dynamic":
        return
    doc = {"pid": os.getpid(), "time": time.time(), "closed": False,
           "store": {"name": "hicache-fake", "page_bytes": 1 << 20, "page_tokens": page,
                     "o_direct": True, "cold_start": extra["cold_start"]},
           "counters": {"set_pages": total[0], "errors": 0}}
    with open(extra["stats_path"] + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(extra["stats_path"] + ".tmp", extra["stats_path"])

publish()

save_lock = threading.RLock()  # handlers run on threads (ThreadingHTTPServer)

def save():  # atomic: the e2e script may stop this server at any moment
    with save_lock:
        with open(db + ".tmp", "w") as f:
            json.dump(sorted(stored), f)
        os.replace(db + ".tmp", db)

def keys(ids):
    out, prior = [], b""
    for i in range((len(ids) - 1) // page):
        d = hashlib.sha256(prior + struct.pack(f"<{page}I", *ids[i * page:(i + 1) * page]))
        prior = d.digest()
        out.append(d.hexdigest())
    return out

def store(ks):
    with save_lock:
        _store(ks)

def _store(ks):
    new = [k for k in ks if k not in stored]
    stored.update(new)
    total[0] += len(new)
    if backend == "dynamic":
        save()
        publish()
    else:
        for k in new:
            open(os.path.join(fdir, k + "_m_0_1.bin"), "wb").close()

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *x): pass
    def _send(self, code, text=""):
        self.send_response(code); self.end_headers(); self.wfile.write(text.encode())
    def do_GET(self):
        if self.path == "/get_server_info":
            return self._send(200, json.dumps({"max_total_num_tokens": a.max_total_tokens}))
        self._send(200 if self.path == "/health" else 404)
    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else {}
        if self.path == "/flush_cache":
            device.clear(); host.clear(); return self._send(200)
        if self.path == "/hicache/storage-backend/clear":
            with save_lock:
                stored.clear()
                if backend == "dynamic":
                    save()
            return self._send(200)
        ids = body["input_ids"]; ks = keys(ids)
        suffix = "_m_0_1" if backend == "file" else ""
        if ks and all(k in device for k in ks):
            det = {"device": len(ks) * page, "host": 0, "storage": 0}
        elif ks and all(k in device or k in host for k in ks):
            on = sum(k in device for k in ks)
            det = {"device": on * page, "host": (len(ks) - on) * page, "storage": 0}
        elif ks and all(k + suffix in stored for k in ks):
            det = {"device": 0, "host": 0, "storage": len(ks) * page}
        else:
            det = {}
        cached = sum(v for v in det.values())
        if det:
            det["storage_backend"] = "VitrifyStorage" if backend == "dynamic" else "HiCacheFile"
        seed = int(hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:8], 16)
        out = [(seed >> i) % 1000 + 3 for i in range(body["sampling_params"]["max_new_tokens"])]
        if det.get("storage") and poison & set(ks):  # a page of another context
            out = [t + 1 for t in out]
        self.send_response(200); self.end_headers()
        for i in range(len(out)):
            chunk = {"output_ids": out[:i + 1], "meta_info": {
                "prompt_tokens": len(ids), "cached_tokens": cached, "cached_tokens_details": det or None,
                "output_token_logprobs": [[-0.01 * t, t, None] for t in out[:i + 1]]}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        # in the caches before the client hears [DONE] (a flush that follows clears them)
        to_device(ks)
        store([k + suffix for k in ks])
        self.wfile.write(b"data: [DONE]\n\n")

print("fake sglang up", flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", a.port), H).serve_forever()
'''


def _free_port_base():
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


@pytest.mark.parametrize("second,plant", [(False, True), (True, True), (False, False)],
                         ids=["three-launches", "second-server", "fault-not-caught"])
def test_whole_run_against_a_stand_in_server(tmp_path, second, plant):
    """Run.run end to end (bundle unpack, three launches, passes, waits on the real observables,
    flush, restart, clear, the oracle's pair and planted fault, JSON) with
    `sglang.launch_server` replaced by a stand-in; with ``second``, a reader server beside the
    restarted one; without ``plant``, the planted page changes nothing the server reads (as a
    fault the checks cannot see): every check passes and the run fails on its oracle."""
    import tarfile

    fake = tmp_path / "fakesite"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "launch_server.py").write_text(_FAKE_LAUNCH_SERVER)
    bundle = tmp_path / "bundle.tar.xz"
    with tarfile.open(bundle, "w:xz") as t:
        t.add(fake, arcname=".")
    s = e2e.Settings(bundle=str(bundle), site=str(tmp_path / "site"), work=str(tmp_path / "w"),
                     out=str(tmp_path / "out"), model_dir=str(tmp_path / "model"),
                     weights=e2e.Weights("dummy", why="the stand-in server loads no weights"),
                     port=_free_port_base(), prompts=2, min_len=300, max_len=400,
                     budget_s=300, first_ready_s=30, ready_s=30, second_server=second,
                     max_total_tokens=4096)
    planted = []

    def planter(store, dirs, key_a, key_b, **kw):  # the stand-in's store: a list of bad keys
        planted.append((store["name"], dirs, key_a, key_b, kw))
        if plant:
            Path(dirs[0], "poison.json").write_text(json.dumps([key_a]))
        return {"planted": True, "key_a": key_a, "key_b": key_b}

    run = e2e.Run(s)
    run.planter = planter
    res = run.run()
    assert planted and planted[0][:2] == ("hicache-fake", [s.vitrify_dir])
    k, key_a, key_b = oracle.fault_page(run.pair[0], run.pair[1], s.page_tokens)
    assert planted[0][2:4] == (key_a, key_b)
    op = res["oracle_power"]
    assert [p["distinct"] for p in op["last_token_pairs"]] == [True]
    if not plant:
        assert all(v for v in res["checks"].values() if isinstance(v, bool))
        assert res["ok"] is False and op["ok"] is False
        assert op["planted_fault"]["caught"] is False
        assert "equalled the miss" in " ".join(op["why"])
        return
    assert op["ok"] is True and op["planted_fault"]["caught"] is True, op
    assert op["planted_fault"]["faulty_identical_to_miss"] is False
    assert op["planted_fault"]["control_identical_to_miss"] is True
    if second:
        assert res["ok"] is True, json.dumps(res.get("scenarios"), indent=1)[:4000]
        assert res["scenarios"]["vitrify_second"]["ok"] is True
        assert res["checks"]["vitrify_second.tokens_identical"] is True
        assert [r["pass"] for r in res["rows"] if r["scenario"] == "vitrify_second"] == \
            ["l3_second_server"]
        return
    assert res["bundle"].startswith("unpacked") and res["weights"]["kind"] == "dummy"
    assert all(info["deterministic"] for info in res["scenarios"].values())
    assert {c["name"] for c in res["comparisons"] if c["crosses_cache_path"]} >= {
        "vitrify.logprobs_identical_vs_miss",
        "vitrify_restart.logprobs_identical_vs_first_launch_miss"}
    assert res["checks"]["vitrify.logprobs_identical_vs_miss"] is True
    assert res["ok"] is True, json.dumps({k: res.get(k) for k in ("checks", "scenarios")},
                                         indent=1)[:4000]
    assert set(res["scenarios"]) == {"vitrify", "vitrify_restart", "file"} and not res["skipped"]
    passes = [(r["scenario"], r["pass"]) for r in res["rows"]]
    assert passes == [("vitrify", "miss"), ("vitrify", "device_hit"),
                      ("vitrify", "l3_first_hit"), ("vitrify", "l3_hit"),
                      ("vitrify", "l3_hit_cached"),
                      ("vitrify_restart", "restart_first_request"),
                      ("vitrify_restart", "l3_restart"), ("vitrify_restart", "l3_restart_again"),
                      ("vitrify_restart", "miss_after_clear"),
                      ("vitrify_restart", "l2_hit"),
                      ("file", "miss"), ("file", "device_hit"), ("file", "l3_first_hit"),
                      ("file", "l3_hit"), ("file", "l3_hit_cached")]
    assert res["checks"]["vitrify.cached_pass_from_storage"] is True
    assert "file_cached_over_vitrify_restart" in res["ratios"]
    assert "restart_first_request_over_first_l3_hit" in res["ratios"]
    assert {"l3_restart_again_over_l3_hit", "file_cached_over_vitrify_restart_again"} <= \
        set(res["ratios"])
    assert res["checks"]["vitrify_restart.again_from_storage"] is True
    assert res["checks"]["vitrify_restart.again_tokens_identical"] is True
    restart = res["scenarios"]["vitrify_restart"]
    assert restart["l2_all_from_host"] is True, restart
    assert restart["l2_device_tokens"] == 4096  # read from the server, not the setting
    assert restart["l2_fillers"]["tokens"] >= 1.1 * 4096 and "write_wait_s" in restart["l2_fillers"]
    assert res["checks"]["vitrify_restart.l2_tokens_identical"] is True
    assert {"l2_hit_over_device_hit", "l3_restart_over_l2_hit", "miss_over_l3_restart"} <= \
        set(res["ratios"])
    assert res["scenarios"]["vitrify_restart"]["first_request_storage_tokens"] > 0
    assert res["checks"]["vitrify_restart.first_request_from_storage"] is True
    assert res["scenarios"]["vitrify"]["pages_written"] >= res["scenarios"]["vitrify"]["pages_needed"]
    for sc in ("vitrify", "vitrify_restart"):   # read from the stats file, not the log
        info = res["scenarios"][sc]
        assert info["backend_errors"] == 0 and res["checks"][f"{sc}.no_backend_errors"] is True
        assert info["store"]["name"] == "hicache-fake"
        assert info["store"]["cold_start"] == ("clear" if sc == "vitrify" else "load")
    assert res["scenarios"]["vitrify"]["backend_counters"]["set_pages"] == \
        res["scenarios"]["vitrify"]["pages_written"]
    assert "l3_hit_ttft_file_over_vitrify" in res["ratios"]
    for sc in ("vitrify", "vitrify_restart", "file"):  # no --second-server
        assert (Path(s.out) / f"sglang-{sc}.log").read_text().startswith("fake sglang up")
    assert e2e.harness.unpack_bundle(s.bundle, s.site) == "already unpacked"


def test_the_mqa_shape_has_an_eighth_of_the_kv_and_l3_pays_on_a_slow_drive(tmp_path):
    s = e2e.Settings.for_shape("8b-mqa", work=str(tmp_path / "w"))
    cfg = s.model_config
    assert cfg["num_key_value_heads"] == 1 and cfg["num_attention_heads"] == 32
    assert e2e.kv_bytes_per_token(cfg) == 18432 == e2e.kv_bytes_per_token(
        e2e.model_config("8b")) // 8
    assert s.page_tokens == 64
    a = _parse(e2e.server_args(s, "vitrify"))
    assert a.page_size == 64 and a.model_path == "/tmp/vitrify-models/8b-mqa-seed0"
    # the 8b shape's measured prefill rate: recompute equals reading 0.6 GB/s here
    rows = [{"scenario": "vitrify", "pass": "miss", "prompts": 1, "prompt_tokens": 32500,
             "cached_tokens": 0, "cached_storage": 0, "ttft_ms_mean": 1000.0}]
    be = e2e.break_even(rows, cfg, 1.0e9)
    assert be["break_even_read_bytes_per_s"] == pytest.approx(32500 * 18432)
    assert be["l3_pays"] is True and "beats" in be["verdict"]


def test_skip_flags_and_goals(tmp_path):
    s, _ = e2e.parse_args(["--skip-restart", "--skip-file", "--work", str(tmp_path)])
    assert s.skip_restart and s.skip_file
    assert e2e.GOALS["l3_hit_ttft_file_over_vitrify"] == 2.5
    assert e2e.GOAL_DIRECTION["l3_restart_over_l3_hit"] == "<="
    assert e2e.goals_for(s) == (e2e.GOALS, e2e.GOAL_DIRECTION)   # no host tier
    host, _ = e2e.parse_args(["--host-gb", "4", "--work", str(tmp_path)])
    goals, direction = e2e.goals_for(host)
    assert goals["l3_restart_over_device_hit"] == 1.3 and direction["l3_restart_over_device_hit"] == "<="
    assert goals["file_cached_over_vitrify_restart"] == 4.0 and "miss_over_l3_restart" not in goals
    long, _ = e2e.parse_args(["--host-gb", "4", "--prompt-len", "12000:16000", "--prompts", "4",
                              "--max-total-tokens", "90000", "--work", str(tmp_path)])
    assert e2e.goals_for(long)[0]["miss_over_l3_restart"] == 2.0


def test_fillers_push_the_prompts_off_the_gpu_and_fit_in_the_host_pool(tmp_path):
    s = e2e.Settings(work=str(tmp_path), prompts=6, min_len=2000, max_len=4000)
    run = e2e.Run(s)
    fill = run.fillers()
    assert sum(map(len, fill)) >= 1.1 * s.max_total_tokens
    assert all(s.min_len <= len(p) <= s.max_len for p in fill)
    assert not set(map(tuple, fill)) & set(map(tuple, run.prompts))
    assert sum(map(len, fill)) + sum(map(len, run.prompts)) <= s.hicache_ratio * s.max_total_tokens
    # a host pool no larger than the device pool cannot hold both: no l2 pass
    assert e2e.Run(e2e.Settings(work=str(tmp_path), hicache_ratio=1.0)).fillers() is None


def test_drive_rate_without_fio_reads_only_the_written_part_of_a_slab(tmp_path, monkeypatch):
    import shutil as _sh

    monkeypatch.setattr(_sh, "which", lambda name, *a, **k: None)  # no fio
    slab = tmp_path / "x.slab"
    with open(slab, "wb") as f:
        f.write(b"\x01" * (1 << 20))
        f.truncate(1 << 30)  # the rest is a hole
    got = e2e.drive_read_rate(str(tmp_path))
    assert got.get("fio") == "fio not installed"
    assert "count=1" in got["command"] and got["bytes"] <= 1 << 26


def test_long_prompts_grow_the_context_and_need_a_pool_that_holds_them(tmp_path):
    s, _ = e2e.parse_args(["--shape", "8b-mqa", "--prompt-len", "12000:16000",
                           "--max-total-tokens", "131072", "--budget-bytes", str(4 << 30),
                           "--work", str(tmp_path)])
    assert (s.min_len, s.max_len, s.max_total_tokens) == (12000, 16000, 131072)
    assert s.vitrify_budget_bytes == 4 << 30
    assert s.model_config["max_position_embeddings"] == 16384
    assert e2e.Settings().model_config["max_position_embeddings"] == 4096  # unchanged default
    with pytest.raises(SystemExit):
        e2e.parse_args(["--prompt-len", "12000:16000", "--work", str(tmp_path)])  # pool 65536
    with pytest.raises(SystemExit):
        e2e.parse_args(["--prompt-len", "9:3"])


def test_the_host_tier_option_reaches_the_backends_config(tmp_path):
    s, _ = e2e.parse_args(["--host-gb", "4", "--work", str(tmp_path)])
    assert s.host_bytes == 4_000_000_000
    extra = e2e.vitrify_extra_config(s, "vitrify")
    assert extra["host_bytes"] == 4_000_000_000 and extra["host_dir"].startswith("/dev/shm/")
    assert "host_bytes" not in e2e.vitrify_extra_config(e2e.Settings(), "vitrify")
    with pytest.raises(SystemExit):
        e2e.parse_args(["--host-gb", "-1"])


def test_the_second_server_option(tmp_path):
    s, _ = e2e.parse_args(["--second-server", "--work", str(tmp_path)])
    assert s.second_server and not e2e.Settings().second_server
    assert e2e.port_of(s, "vitrify_second") == s.port + 3
    assert e2e.vitrify_extra_config(s, "vitrify_second")["role"] == "reader"


def test_the_marginal_break_even_takes_the_fixed_costs_out():
    def row(name, prompt_tokens, cached, ttft_ms, prompts=2):
        return {"scenario": "vitrify", "pass": name, "prompts": prompts,
                "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                "cached_storage": 0, "ttft_ms_mean": ttft_ms}

    cfg = e2e.model_config("8b-mqa")  # 18,432 B of KV per token
    # the miss saves 26 ms per request over the device hit, for 2,464 tokens of prefix
    rows = [row("miss", 2 * 2500, 0, 79.0), row("device_hit", 2 * 2500, 2 * 2464, 53.0)]
    be = e2e.break_even(rows, cfg, 1.0e9)
    want = 2464 * 18432 / 0.026
    assert be["marginal_break_even_read_bytes_per_s"] == pytest.approx(want)
    assert be["marginal_l3_pays"] is False and "loses to" in be["marginal_verdict"]
    assert e2e.break_even(rows, cfg, 2.0e9)["marginal_l3_pays"] is True
    # the 8b-mqa run: a device hit no faster than the miss
    flat = [row("miss", 5000, 0, 80.0), row("device_hit", 5000, 4928, 83.0)]
    be = e2e.break_even(flat, cfg, 1.0e9)
    assert be["marginal_break_even_read_bytes_per_s"] is None
    assert "no storage rate pays" in be["marginal_verdict"]


def test_host_tier_check_counts_the_pages_a_launch_read_from_storage(tmp_path):
    """With a host tier, a restart's and a second server's L3 pages must be host-tier hits."""
    page = 64
    res = [{"details": {"storage": 3 * page}}, {"details": {"storage": 2 * page}}, {"details": {}}]
    assert e2e.storage_pages(res, page) == 5
    run = e2e.Run.__new__(e2e.Run)
    run.s = _settings(tmp_path, host_bytes=1 << 30)
    for hits, ok in ((5, True), (4, False)):
        info, ck = {"host_counters": {"host_hits": hits}}, {}
        run._host_tier_check(info, ck, 5)
        assert ck == {"l3_from_host_tier": ok} and info["host_hits_needed"] == 5
    info, ck = {}, {}
    run.s = _settings(tmp_path)  # no host tier: no check
    run._host_tier_check(info, ck, 5)
    assert ck == {} and info == {}
