"""The SGLang plugin's scheduler-side FREEZE/THAW (vitrify/integrations/sglang/freeze.py) on CPU:
the adapter's fingerprint, graph names, the KV pool config round trip with SGLang's own class,
graph outputs recorded as region offsets and rebuilt as views (SGLang's LogitsProcessorOutput
over CPU memory standing in for the region), the refusals, and the whole hook sequence of a
SAVE and a LOAD (sglang_freeze_worker.py, fresh processes on the fake driver: weights restored,
the pool sized as at SAVE without profiling, checkpoints equal, the archive written at the first
idle loop after a request, with the JIT caches)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="the pinned SGLang test environment is not installed")
torch = pytest.importorskip("torch")

from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig  # noqa: E402
from sglang.srt.model_executor.runner.shape_key import ShapeKey  # noqa: E402

from vitrify.integrations.sglang import attention, freeze, graphs, startup, state  # noqa: E402
from vitrify.integrations.sglang import server_args as rules  # noqa: E402
from vitrify.integrations.sglang import versions  # noqa: E402

FAKE = os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA")
WORKER = Path(__file__).with_name("sglang_freeze_worker.py")


def test_the_fingerprint_names_the_engine_and_every_shaping_argument():
    fp = {"model_path": "/m/qwen3-8b", "dtype": "bfloat16", "page_size": 64}
    a = freeze.Engine(fp, "0.5.17").fingerprint()
    assert a["engine"] == "sglang" and a["engine_version"].startswith("sglang-0.5.17/vitrify-")
    assert a["model"].startswith("/m/qwen3-8b#args-")
    assert freeze.Engine(dict(fp, page_size=32), "0.5.17").fingerprint()["model"] != a["model"]
    assert freeze.Engine(dict(fp), "0.5.17").fingerprint() == a


def test_graph_names_are_file_safe_and_distinct():
    assert graphs.graph_name(ShapeKey(8)) == "decode_bs8"
    assert graphs.graph_name(ShapeKey(8, stream_idx=1, variant_label="a/b c")) == "decode_bs8_s1_a-b-c"
    assert graphs.graph_name(16) == "decode_bs16"


def test_the_kv_pool_config_round_trips_through_json_with_sglangs_class():
    cfg = MemoryPoolConfig(max_total_num_tokens=65536, max_running_requests=48,
                           mem_fraction_static=0.5)
    saved = json.loads(json.dumps(graphs.pool_config_state(cfg)))
    assert graphs.pool_config_from_state(MemoryPoolConfig, saved) == cfg
    with pytest.raises(state.FreezeRefused, match=r"fields \['extra_pool'\] this SGLang lacks"):
        graphs.pool_config_from_state(MemoryPoolConfig, dict(saved, extra_pool=1))
    with pytest.raises(state.FreezeRefused, match="not a dataclass"):
        graphs.pool_config_state({"max_total_num_tokens": 1})


class _Region:
    """A CPU buffer standing in for the region (base, size; views by address)."""

    def __init__(self, nbytes: int):
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        self.base, self.size = self.buf.data_ptr(), nbytes

    def tensor(self, offset: int, dtype, shape):
        n = torch.empty((), dtype=dtype).element_size() * int(torch.tensor(shape).prod())
        return self.buf[offset:offset + n].view(dtype).view(*shape)

    def tensor_at(self, address, dtype, shape, stride, device):
        item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        span = (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * item
        off = address - self.base
        return self.buf[off:off + span].view(getattr(torch, dtype)).as_strided(shape, stride)


def test_graph_outputs_come_back_as_views_of_the_same_region_memory():
    r = _Region(1 << 16)
    logits = r.tensor(4096, torch.bfloat16, (8, 100))
    logits.copy_(torch.randn(8, 100))
    hidden = r.tensor(8192, torch.float32, (8, 16)).t()  # a strided view
    out = LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden,
                                customized_info={"k": [1, 2]})
    desc = json.loads(json.dumps(graphs.describe(out, r)))
    assert desc["fields"]["next_token_logits"]["t"] == {
        "offset": 4096, "dtype": "bfloat16", "shape": [8, 100], "stride": [100, 1], "device": 0}
    back = graphs.rebuild(desc, r, r.tensor_at)
    assert isinstance(back, LogitsProcessorOutput)
    assert back.next_token_logits.data_ptr() == logits.data_ptr()
    assert torch.equal(back.next_token_logits, logits)
    assert back.hidden_states.stride() == hidden.stride() and torch.equal(back.hidden_states, hidden)
    assert back.customized_info == {"k": [1, 2]} and back.next_token_logprobs is None


def test_outputs_that_cannot_come_back_are_refused_at_freeze_naming_the_field():
    r = _Region(1 << 12)
    outside = torch.zeros(4)
    with pytest.raises(state.FreezeRefused, match=r"output.next_token_logits: a tensor at .* "
                                                   r"outside the region"):
        graphs.describe(LogitsProcessorOutput(next_token_logits=outside), r)
    with pytest.raises(state.FreezeRefused, match=r"output\[0\]: a builtins.object"):
        graphs.describe([object()], r)
    with pytest.raises(state.FreezeRefused, match="only SGLang's are rebuilt"):
        graphs.rebuild({"dc": "os:PathLike", "fields": {}}, r, r.tensor_at)


def test_only_what_was_read_for_the_plan_is_accepted(tmp_path):
    from sglang.srt.server_args import ServerArgs

    def args(*extra):
        import argparse

        p = argparse.ArgumentParser()
        ServerArgs.add_cli_args(p)
        return p.parse_args(["--model-path", str(tmp_path), "--attention-backend", "triton",
                             *extra])

    rules.check_supported(args())
    # FlashInfer, alone or split with triton between prefill and decode
    rules.check_supported(args("--attention-backend", "flashinfer"))  # the later flag wins
    rules.check_supported(args("--decode-attention-backend", "flashinfer",
                                "--prefill-attention-backend", "triton"))
    with pytest.raises(state.FreezeRefused) as e:
        rules.check_supported(args("--decode-attention-backend", "fa3", "--enable-lora",
                                    "--enable-torch-compile", "--torchao-config", "int8wo",
                                    "--enable-hierarchical-cache",
                                    "--cuda-graph-backend-decode", "breakable"))
    msg = str(e.value)
    for words in ("decode_attention_backend='fa3'", "enable_lora=True", "enable_torch_compile",
                  "torchao_config='int8wo'", "enable_hierarchical_cache",
                  "decode graph backend 'breakable'"):
        assert words in msg, (words, msg)
    with pytest.raises(state.FreezeRefused, match="attention_backend unset"):
        rules.check_supported(args("--attention-backend", "triton"), get=lambda name: None)


def test_a_block_map_that_differs_from_saves_is_refused_naming_the_block():
    frozen = [[0, 512], [1024, 512], [2 << 20, 1024]]
    graphs.check_blocks(frozen, [list(b) for b in frozen])
    with pytest.raises(state.FreezeRefused, match=r"taken block 1 is \[1536, 512\] .* was "
                                                   r"\[1024, 512\] at SAVE"):
        graphs.check_blocks(frozen, [[0, 512], [1536, 512], [2 << 20, 1024]])
    with pytest.raises(state.FreezeRefused, match=r"block 3 is None .* \(3 vs 4 blocks\)"):
        graphs.check_blocks(frozen + [[4 << 20, 64]], frozen)


def test_the_routed_block_map_is_read_from_torchs_pool_snapshot(monkeypatch):
    from vitrify.integrations import torch as vt

    base = 0x7F0000000000
    snap = [{"address": base + (2 << 20), "total_size": 1 << 20, "blocks": [
                {"address": base + (2 << 20), "size": 512, "state": "active_allocated"},
                {"address": base + (2 << 20) + 512, "size": (1 << 20) - 512, "state": "inactive"}]},
            {"address": base, "total_size": 2 << 20, "blocks": [
                {"size": 4096, "state": "active_awaiting_free"},
                {"size": (2 << 20) - 4096, "state": "active_allocated"}]}]
    pool = types.SimpleNamespace(snapshot=lambda: snap, id=(1, 2))
    monkeypatch.setattr(vt, "mem_pool", lambda region: pool)
    region = types.SimpleNamespace(base=base, size=1 << 30)
    # taken blocks only (a block waiting to be freed is taken); free gaps left out
    assert graphs.routed_blocks(region) == [[0, 4096], [4096, (2 << 20) - 4096], [2 << 20, 512]]
    pool.snapshot = lambda: {"segments": snap}  # an older torch's shape
    assert len(graphs.routed_blocks(region)) == 3


def test_the_scheduler_gpu_is_read_where_sglang_keeps_it(monkeypatch):
    from vitrify.integrations.sglang.versions import v0_5_17

    monkeypatch.setattr(state, "STATE", state.PluginState(version=v0_5_17))
    assert freeze.scheduler_gpu(types.SimpleNamespace(ps=types.SimpleNamespace(gpu_id=3))) == 3
    with pytest.raises(state.FreezeRefused, match=r"no scheduler\.ps\.gpu_id\): this is not "
                                                  r"the SGLang 0\.5\.17"):
        freeze.scheduler_gpu(types.SimpleNamespace(gpu_id=3))


def _worker(mode: str, tmp_path: Path, **opts) -> dict:
    env = dict(os.environ, VITRIFY_LIBCUDA_PATH=FAKE or "", FAKE_CUDA_DEVICES="1",
               XDG_CACHE_HOME=str(tmp_path / "xdg"))
    p = subprocess.run([sys.executable, str(WORKER), mode, str(tmp_path), json.dumps(opts)],
                       capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"{mode} printed no result (rc {p.returncode}):\n{p.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.skipif(not FAKE, reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
def test_save_then_load_through_the_hooks(tmp_path):
    save = _worker("save", tmp_path)
    assert save["ok"], save.get("traceback")
    assert save["archive_after_init"] is False  # written at the first idle after a request
    assert save["idle_before_request_wrote"] is False
    # save_after_requests = 2: one request (a health check does not count) is not enough
    assert save["idle_after_one_request_wrote"] is False and save["requests"] == 2
    # and not before the launcher's shape sweep has ended (its requests are not counted)
    assert save["sweep_pending_at_capture"] is True
    assert save["idle_before_the_sweep_end_wrote"] is False
    assert save["model_modules"] == ["vitrify_test_model"] and save["request_lengths"] == [3, 3]
    assert save["summary"]["graphs"] == 0 and os.path.isdir(tmp_path / "engine.vitrify")
    assert save["jit_files"] == ["triton/AB/k.cubin"]
    # LOAD re-runs warmup and maps the graphs span unrestored: SAVE writes the weights span only
    assert save["span_files"] == ["rank0/region/weights.span"]
    # P16: the imports' objects are frozen before the start-up, and the capture's collections
    # never unfreeze them (SGLang's own freeze_gc would)
    assert save["frozen_before_init"] == 0 and save["frozen_after_capture"] > 10000
    load = _worker("load", tmp_path, standby=True)
    assert load["ok"], load.get("traceback")
    assert load["init_s"] >= 0.3  # it waited for its standby file
    assert load["weights"] == save["weights"]  # restored from the archive, not re-initialised
    # SAVE's size; SGLang's profiling still ran (its side effects are part of the trajectory)
    assert load["pool_config"] == save["pool_config"] and load["profiled"] is True
    assert load["checkpoints"] == save["summary"]["checkpoints"]
    # the standby's check, the JIT unpack and the thaw share one open of the archive
    assert load["archive_opens"] == [str(tmp_path / "engine.vitrify")]
    assert load["triton_cache"].startswith(str(tmp_path / "xdg"))
    assert load["frozen_before_init"] == 0 and load["frozen_after_capture"] > 10000
    drift = _worker("load", tmp_path, drift=True)
    assert drift["ok"], drift.get("traceback")
    assert "the region cursor after phase 'built'" in drift["fatal"]
    assert drift["fatal"].startswith("vitrify SGLang plugin:") and drift["run_cleared"]


@pytest.mark.skipif(not FAKE, reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
def test_a_damaged_weights_span_stops_load_with_the_plugins_one_line(tmp_path):
    """Issue 32: the restore's SpanFileError came out as a traceback through SGLang's start-up;
    it is the plugin's one-line fatal, and the run is cleared."""
    save = _worker("save", tmp_path)
    assert save["ok"], save.get("traceback")
    span = tmp_path / "engine.vitrify" / "rank0" / "region" / "weights.span"
    data = bytearray(span.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a byte inside a chunk's data: only its CRC32C can tell
    span.write_bytes(bytes(data))
    load = _worker("load", tmp_path)
    assert load["ok"], load.get("traceback")  # ended by the plugin's SystemExit, not an error
    fatal = load["fatal"]
    assert fatal.startswith("vitrify SGLang plugin: mode 'load': SpanFileError: ") and \
        "\n" not in fatal, fatal
    assert "CRC32C mismatch" in fatal and "weights.span" in fatal
    assert f"vitrify verify {tmp_path / 'engine.vitrify'}" in fatal
    assert load["run_cleared"]


def test_the_model_registry_is_narrowed_to_the_module_save_recorded():
    env = {versions.current().DISABLED_ARCHS_ENV: "deepseek_v2, mine"}
    n = startup.narrow_model_registry(["qwen3"], env)
    disabled = env[versions.current().DISABLED_ARCHS_ENV].split(",")
    assert n > 100 and "qwen3" not in disabled and {"deepseek_v2", "mine", "llama"} <= set(disabled)
    # nothing recorded, a bad record or a module this SGLang lacks: the registry is left whole
    for modules in (None, [], ["qwen3", 7], ["no_such_model_module"]):
        env = {}
        assert startup.narrow_model_registry(modules, env) == 0 and env == {}
    # SGLang's own registry then holds the recorded module's classes only
    code = ("import sys; from vitrify.integrations.sglang import startup; "
            "startup.narrow_model_registry(['qwen3']); "
            "from sglang.srt.models.registry import ModelRegistry; "
            "print(sorted(ModelRegistry.models))")
    env = {k: v for k, v in os.environ.items() if k != versions.current().DISABLED_ARCHS_ENV}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "['Qwen3ForCausalLM']"


def test_model_modules_names_the_modules_exporting_the_models_class():
    cls = type("Tiny", (), {})
    one = types.ModuleType("sglang.srt.models.vitrify_t1")
    one.EntryClass = cls
    many = types.ModuleType("sglang.srt.models.vitrify_t2")
    many.EntryClass = [type("Other", (), {}), cls]
    elsewhere = types.ModuleType("mypkg.models.vitrify_t3")
    elsewhere.EntryClass = cls
    mods = {m.__name__: m for m in (one, many, elsewhere)}
    sys.modules.update(mods)
    try:
        assert startup.model_modules(cls()) == ["vitrify_t1", "vitrify_t2"]
        assert startup.model_modules(object()) == [] and startup.model_modules(None) == []
    finally:
        for name in mods:
            sys.modules.pop(name, None)


def test_the_launcher_warm_up_hook_is_registered_in_the_launcher_at_load_only(tmp_path):
    from vitrify.integrations.sglang import plugin
    from vitrify.integrations.sglang.config import PluginConfig

    from vitrify.integrations.sglang.versions import v0_5_17 as ver

    def targets(mode, in_scheduler, warmups=8, sweep=True):
        cfg = PluginConfig(mode=mode, archive=str(tmp_path), region_bytes=1 << 30,
                           warmup_requests=warmups, shape_sweep=sweep)
        role = "scheduler" if in_scheduler else "launcher"
        return {target for target, _, _ in plugin.hooks_for(cfg, role, ver)}

    warmup = ver.HOOK_TARGETS["wait_and_warmup"]
    assert warmup == "sglang.srt.entrypoints.http_server._wait_and_warmup"
    assert warmup in targets("load", False)  # SGLang's _wait_and_warmup
    assert warmup not in targets("load", True)  # a scheduler never
    assert warmup in targets("save", False)  # SAVE's shape sweep (P19)
    assert warmup not in targets("save", False, sweep=False)
    assert warmup not in targets("load", False, warmups=0)
    assert f"{ver.SCHEDULER_MODULE}.Scheduler.handle_generate_request" in \
        targets("save", True)


def test_spread_picks_distinct_lengths_over_the_range():
    assert startup.spread([300, 64, 64, 512, 100], 8) == [64, 100, 300, 512]
    assert startup.spread(list(range(1, 101)), 3) == [1, 51, 100]
    assert startup.spread(list(range(1, 101)), 1) == [100]
    assert startup.spread([5, 0, -3, True, "7", 9], 4) == [5, 9]
    assert startup.spread(None, 4) == [] and startup.spread([64], 0) == []
    a, b = startup.warmup_ids(40, 0), startup.warmup_ids(40, 1)
    assert len(a) == 40 and a[0] != b[0] and all(10 <= t < 1000 for t in a + b)


class _Args:
    api_key = None
    dp_size = 1

    def __init__(self, port):
        self.port = port

    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def ssl_verify(self):
        return True


def _http_server(status=200, tm=None):
    import http.server
    import threading

    seen = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body["status_then"] = getattr(tm, "server_status", None)
            seen.append((self.path, body))
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


@pytest.mark.parametrize("status", [200, 500])
def test_load_warms_up_with_the_lengths_save_served(monkeypatch, tmp_path, caplog, status):
    pytest.importorskip("requests")
    from vitrify import archive as _archive
    from vitrify.integrations.sglang import plugin
    from vitrify.integrations.sglang.config import PluginConfig

    class _Arch:
        def state(self, rank):
            return {"engine": {"request_lengths": [3, 300, 64, 512, 64, 100]}}

    monkeypatch.setattr(_archive, "open_archive", lambda path, **k: _Arch())
    cfg = PluginConfig(mode="load", archive=str(tmp_path), region_bytes=1 << 30,
                       warmup_requests=3)
    monkeypatch.setattr(state, "STATE", state.PluginState(config=cfg))
    import enum

    Status = enum.Enum("ServerStatus", "Up Starting")
    tm = types.SimpleNamespace(server_status=Status.Up,
                               model_config=types.SimpleNamespace(vocab_size=500))
    monkeypatch.setattr(versions.current(), "launcher_status", lambda: (tm, Status))
    srv, seen = _http_server(status, tm)
    try:
        caplog.set_level("INFO", logger="vitrify.sglang")
        assert startup.warm_up(True, _Args(srv.server_address[1])) is True
    finally:
        srv.shutdown()
    if status != 200:  # a warning, and the server still starts (its status as it was)
        assert len(seen) == 1 and "LOAD's warm-up requests failed" in caplog.text
        assert tm.server_status.name == "Up"
        return
    assert [p for p, _ in seen] == ["/generate"] * 3
    assert [len(b["input_ids"]) for _, b in seen] == [3, 100, 512]
    assert all(b["sampling_params"] == {"temperature": 0, "max_new_tokens": 4} for _, b in seen)
    # each kind of answer a client asks for: streamed or whole, with logprobs or without
    assert [(b["stream"], b["return_logprob"]) for _, b in seen] == \
        [(True, True), (False, True), (True, False)]
    assert [(b["stream"], b["return_logprob"]) for b in
            (startup.warmup_body([1], i) for i in range(4, 8))] == \
        [(True, True), (False, True), (True, False), (False, False)]
    assert "LOAD warm-up: 3 request(s) of 3, 100, 512 tokens" in caplog.text
    # the server was "starting" while they ran (no user request beside them), "up" again after;
    # every token id below the model's vocabulary
    assert {b["status_then"].name for _, b in seen} == {"Starting"} and tm.server_status.name == "Up"
    assert max(max(b["input_ids"]) for _, b in seen) < 500
    # SGLang's own warm-up failed, or SAVE, or none asked for: nothing is sent
    seen.clear()
    assert startup.warm_up(False, _Args(1)) is False
    monkeypatch.setattr(state.STATE, "config", dataclasses.replace(cfg, warmup_requests=0))
    assert startup.warm_up(True, _Args(1)) is True and seen == []


def test_the_warm_up_wrapper_runs_after_the_warm_up_function_the_call_uses(monkeypatch):
    calls = []
    monkeypatch.setattr(startup, "warm_up",
                        lambda result, server_args: calls.append(("ours", result)) or result)

    def default_warmup(server_args):
        calls.append(("default", server_args))
        return True

    def wait_and_warmup(server_args, launch_callback=None, execute_warmup_func=default_warmup):
        return ("done", execute_warmup_func(server_args))

    # the default argument (where a hook on the module attribute never reaches)
    assert freeze.around_wait_and_warmup(wait_and_warmup, "args") == ("done", True)
    assert calls == [("default", "args"), ("ours", True)]
    calls.clear()
    passed = lambda sa: calls.append(("passed", sa)) or False  # noqa: E731
    assert freeze.around_wait_and_warmup(wait_and_warmup, "a", None, passed) == ("done", False)
    assert calls == [("passed", "a"), ("ours", False)]
    # a signature it does not know: SGLang's function runs untouched
    calls.clear()
    assert freeze.around_wait_and_warmup(lambda *a: "plain", 1, 2, 3, 4) == "plain" and not calls
    # SGLang's own function takes the wrapper (its warm-up failed: it returns before "ready")
    from sglang.srt.entrypoints.http_server import _wait_and_warmup

    sa = types.SimpleNamespace(checkpoint_engine_wait_weights_before_ready=False,
                               is_ep_scale_joiner=False, skip_server_warmup=False)
    assert freeze.around_wait_and_warmup(_wait_and_warmup, sa,
                                         execute_warmup_func=lambda s: False) is None
    assert calls == [("ours", False)]


def test_a_standby_load_waits_for_its_file(tmp_path, caplog):
    import threading
    import time

    caplog.set_level("INFO", logger="vitrify.sglang")
    go = tmp_path / "go"
    threading.Timer(0.3, go.touch).start()
    t = time.monotonic()
    waited = startup.wait_for_file(str(go))
    assert 0.25 <= waited <= time.monotonic() - t and go.exists()
    assert "waiting for" in caplog.text and "standby ended after" in caplog.text
    assert startup.wait_for_file(str(go)) == 0.0  # there already: no wait
    # a file older than this launch is a leftover: it counts once touched again
    os.utime(go, (1000.0, 1000.0))
    caplog.clear()
    threading.Timer(0.3, go.touch).start()
    assert startup.wait_for_file(str(go), since=time.time() - 5) >= 0.25
    assert "older than this launch" in caplog.text


def test_cold_start_widens_the_registry_to_the_users_own_setting():
    for before in ({}, {versions.current().DISABLED_ARCHS_ENV: "mine"}):
        env = dict(before)
        assert startup.narrow_model_registry(["qwen3"], env) > 100
        assert startup.narrow_model_registry(["qwen3"], env) > 100  # the scheduler's own call
        assert startup.widen_model_registry(env) is True and env == before
        assert startup.widen_model_registry(env) is False and env == before


def test_model_modules_include_the_submodules_classes():
    import sys as _sys

    inner = type("Tower", (), {})
    outer = type("Multi", (), {"modules": lambda self: iter([self, inner()])})
    a = types.ModuleType("sglang.srt.models.vitrify_outer")
    a.EntryClass = outer
    b = types.ModuleType("sglang.srt.models.vitrify_tower")
    b.EntryClass = [inner]
    _sys.modules.update({a.__name__: a, b.__name__: b})
    try:
        assert startup.model_modules(outer()) == ["vitrify_outer", "vitrify_tower"]
    finally:
        _sys.modules.pop(a.__name__)
        _sys.modules.pop(b.__name__)


def test_the_jit_watch_reports_new_files_once_and_never_raises(tmp_path, caplog):
    caplog.set_level("WARNING", logger="vitrify.sglang")
    cache = tmp_path / "triton"
    cache.mkdir()
    run = state.Run("save", None, None, 0)
    run.jit_dirs, run.jit_index = {"triton": str(cache)}, {"caches": {"triton": {"files": []}}}

    def look():
        run.jit_checked = 0.0
        caplog.clear()
        startup.jit_watch(run)
        return caplog.text

    (cache / "AB").mkdir()
    (cache / "AB" / "k.cubin").write_bytes(b"x")
    assert "1 JIT cache file(s) written after SAVE packed" in look()
    assert look() == ""  # reported already
    (cache / "AB" / "k.cubin").unlink()  # one gone, another new: still reported
    (cache / "AB" / "j.cubin").write_bytes(b"y")
    assert "2 JIT cache file(s)" in look()
    os.symlink("/etc/passwd", cache / "AB" / "evil")  # the cache listing refuses it
    assert "JIT watch off" in look() and run.jit_dirs == {}
    assert look() == ""


def test_the_start_up_profile_is_written_where_asked(tmp_path):
    from vitrify import config

    with config.override(sglang_profile=None), startup.profiled("nothing"):  # not asked
        sum(range(1000))
    assert not list(tmp_path.iterdir())
    with config.override(sglang_profile=str(tmp_path)), startup.profiled("init_model_worker-load"):
        sorted(range(100000), key=lambda x: -x)
    (path,) = tmp_path.glob("init_model_worker-load-*.txt")
    assert "cumulative" in path.read_text() and "sorted" in path.read_text()


def test_the_capture_collections_never_unfreeze_what_the_plugin_froze(monkeypatch):
    import gc

    from sglang.srt.model_executor.runner.base_cuda_graph_runner import freeze_gc

    if gc.get_freeze_count():
        pytest.skip("this process has frozen objects already")
    seen = []
    monkeypatch.setattr(state.STATE, "run", None)  # no freeze or thaw here: SGLang's own
    assert freeze.around_freeze_gc(lambda flag: seen.append(flag) or "sglang's", True) == "sglang's"
    assert seen == [True]
    try:
        moved = startup.freeze_import_heap(collect=False)
        assert moved > 1000 and gc.get_freeze_count() == moved
        monkeypatch.setattr(state.STATE, "run", object())
        with freeze.around_freeze_gc(freeze_gc, False):
            inside = gc.get_freeze_count()
        # nothing unfrozen (a frozen object freed by its reference count leaves the count)
        assert inside >= moved - 100 and gc.get_freeze_count() >= moved - 100
        with freeze_gc(False):  # SGLang's own would have put them all back
            pass
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_a_standby_reads_the_weights_span_until_its_go(tmp_path, caplog, monkeypatch):
    from vitrify import snapshot

    weights = tmp_path / "rank0" / "region" / "weights.span"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"w" * (3 << 20))
    (tmp_path / "rank0" / "region" / "warmup.span").write_bytes(b"x")  # not restored: not read

    class _Arch:
        def spans(self, rank):
            assert rank == 0
            return {"weights": "rank0/region/weights.span", "warmup": "rank0/region/warmup.span"}

        def file_path(self, rel):
            return str(tmp_path / rel)

    caplog.set_level("INFO", logger="vitrify.sglang")
    reading = startup.SpanPrefetch(_Arch())
    reading.thread.join()
    out = reading.finish()
    assert out["bytes"] == out["size"] == 3 << 20 and out["errors"] == []
    assert "read into the page cache" in caplog.text
    assert "a go now thaws without the drive" in caplog.text  # logged when the read completed
    # a read that fails is named; the thaw reads the file itself then
    weights.unlink()
    out = startup.SpanPrefetch(_Arch()).finish()
    assert out["bytes"] == 0 and "weights.span" in out["errors"][0]
    assert "not read: weights.span" in caplog.text
    # the go stops a read under way at its next piece
    calls = []
    monkeypatch.setattr(snapshot, "prefetch", lambda path, stop: calls.append(stop.wait(5)) or
                        {"bytes": 1, "size": 2, "seconds": 0.0, "complete": False})
    out = startup.SpanPrefetch(_Arch()).finish()
    assert calls == [True] and out["bytes"] == 1


def test_triton_s_cache_key_is_computed_before_the_first_launch(monkeypatch, tmp_path):
    import sys as _sys

    calls = []
    cache = types.ModuleType("triton.runtime.cache")
    cache.triton_key = lambda: calls.append(1)
    triton = types.ModuleType("triton")
    triton.__file__ = str(tmp_path / "triton" / "__init__.py")
    monkeypatch.setitem(_sys.modules, "triton", triton)
    monkeypatch.setitem(_sys.modules, "triton.runtime", types.ModuleType("triton.runtime"))
    monkeypatch.setitem(_sys.modules, "triton.runtime.cache", cache)
    assert startup.warm_triton_key(background=False) is None and calls == [1]
    startup.warm_triton_key(background=True).join()
    assert calls == [1, 1]
    cache.triton_key = lambda: 1 / 0  # a failure leaves it to the first launch
    assert startup.warm_triton_key(background=False) is None
    monkeypatch.setitem(_sys.modules, "triton.runtime.cache", None)  # no Triton
    assert startup.warm_triton_key(background=True) is None



def _attn_runner(**kw):
    return types.SimpleNamespace(kv_cache_dtype="bfloat16", token_to_kv_pool="kv",
                                 req_to_token_pool="req",
                                 server_args=types.SimpleNamespace(speculative_attention_mode="prefill"),
                                 model_config=types.SimpleNamespace(context_len=4096), **kw)


def _leaf(cls):
    b = object.__new__(cls)
    b.needs_cpu_seq_lens, b.token_to_kv_pool, b.req_to_token_pool = True, "kv", "req"
    return b


def test_attention_backends_are_found_inside_sglangs_routing_backends():
    """The unwrapping, against SGLang 0.5.17's own classes built by their own constructors:
    a prefill/decode split, hybrid linear attention, two-batch overlap, nested."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import (
        HybridLinearAttnBackend,
        Mamba2AttnBackend,
    )
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.attention.trtllm_mha_backend import TRTLLMHAAttnBackend

    tri, fi = _leaf(TritonAttnBackend), _leaf(FlashInferAttnBackend)
    assert attention.attention_leaves(fi) == [("attn_backend", fi)]
    assert attention.check_attention(fi) == ["flashinfer"] and attention.metadata_api(fi) == "current"
    split = HybridAttnBackend(_attn_runner(), prefill_backend=tri, decode_backend=fi)
    assert attention.attention_leaves(split) == [("attn_backend.prefill_backend", tri),
                                              ("attn_backend.decode_backend", fi)]
    assert attention.check_attention(split) == ["triton", "flashinfer"]
    same = HybridAttnBackend(_attn_runner(), prefill_backend=fi, decode_backend=fi)
    assert attention.check_attention(same) == ["flashinfer"]  # one object, listed once
    tbo = TboAttnBackend(primary=split, children=[_leaf(FlashInferAttnBackend),
                                                  _leaf(FlashInferAttnBackend)])
    where = [w for w, _ in attention.attention_leaves(tbo)]
    assert where == ["attn_backend.primary.prefill_backend", "attn_backend.primary.decode_backend",
                     "attn_backend.children[0]", "attn_backend.children[1]"]
    # a hybrid linear-attention model's Mamba state is not frozen: refused, named where it sits
    linear = HybridLinearAttnBackend(fi, _leaf(Mamba2AttnBackend), full_attn_layers=[0])
    with pytest.raises(state.FreezeRefused) as e:
        attention.check_attention(linear)
    assert "attn_backend.linear_attn_backend is Mamba2AttnBackend" in str(e.value)
    assert "full_attn_backend" not in str(e.value)
    # a subclass plans differently: only the exact classes are accepted
    with pytest.raises(state.FreezeRefused, match="attn_backend is TRTLLMHAAttnBackend"):
        attention.check_attention(_leaf(TRTLLMHAAttnBackend))
    with pytest.raises(state.FreezeRefused, match="has none"):
        attention.check_attention(None)


def test_a_backend_with_only_the_legacy_graph_metadata_api_is_refused(monkeypatch):
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    class Legacy(AttentionBackend):
        def init_forward_metadata_capture_cuda_graph(self, *a):
            pass

        def init_forward_metadata_replay_cuda_graph(self, *a):
            pass

    class Neither(AttentionBackend):
        pass

    assert attention.metadata_api(object.__new__(Legacy)) == "legacy"
    assert attention.metadata_api(object.__new__(Neither)) == "none"
    monkeypatch.setitem(versions.current().FROZEN_ATTENTION, f"{__name__}.{Legacy.__qualname__}",
                        "legacy")
    with pytest.raises(state.FreezeRefused) as e:
        attention.check_attention(object.__new__(Legacy))
    assert "through the legacy init_forward_metadata_capture_cuda_graph" in str(e.value)
    assert "calls init_forward_metadata_out_graph" in str(e.value)


def test_an_error_inside_an_answer_of_status_200_is_found():
    startup.check_answer([b'data: {"text": "a", "meta_info": {}}', b"", b"data: [DONE]"])
    startup.check_answer([b'{"text": "a"}'])
    startup.check_answer([b'[{"text": "a"}, {"text": "b"}]'])  # a batch
    with pytest.raises(RuntimeError, match="carries an error: boom"):
        startup.check_answer([b'data: {"text": "a"}', b'data: {"error": "boom"}'])
    with pytest.raises(RuntimeError, match="carries an error"):
        startup.check_answer([b'{"error": "out of memory"}'])


def test_the_launcher_reads_the_weights_span_ahead_when_it_fits(tmp_path, caplog, monkeypatch):
    from vitrify import snapshot

    arch = tmp_path / "engine.vitrify"
    weights = arch / "rank0" / "region" / "weights.span"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(os.urandom(3 << 20))

    class _Arch:
        def __init__(self, spans):
            self._spans = spans

        def spans(self, rank):
            return self._spans

        def file_path(self, rel):
            return str(arch / rel)

    spans = {"weights": "rank0/region/weights.span"}
    caplog.set_level("INFO", logger="vitrify.sglang")
    monkeypatch.setattr(snapshot, "page_cache_share", lambda path: 0.0)  # a cold drive
    real_memory_available = startup.memory_available
    env = {}
    reading = startup.start_read_ahead(_Arch(spans), env)
    reading.thread.join()
    assert env == {startup.READ_AHEAD_ENV: f"{os.getpid()}:{weights}"}
    assert reading.results[str(weights)]["complete"]
    assert "reading the weights span" in caplog.text and "are in the page cache" in caplog.text
    # the scheduler's thaw of that archive reads through the page cache; of another, as set
    me = os.getpid()
    assert startup.read_ahead_direct_io(str(arch), env, me) == "off"
    assert startup.read_ahead_direct_io(str(arch) + "/", env, me) == "off"
    assert startup.read_ahead_direct_io(os.path.relpath(arch), env, me) == "off"
    assert startup.read_ahead_direct_io(str(tmp_path / "other.vitrify"), env, me) is None
    assert startup.read_ahead_direct_io(str(arch) + "2", env, me) is None  # a sibling's prefix
    assert startup.read_ahead_direct_io(str(arch), {}, me) is None
    # a value another launcher left in the environment does not count
    assert startup.read_ahead_direct_io(str(arch), env, me + 1) is None
    # cached already, too large for the memory, or no weights span: nothing read, nothing said
    for share, room, sp, words in ((1.0, None, spans, "in the page cache already"),
                                   (1.0, 5 << 20, spans, "in the page cache already"),
                                   (0.0, 5 << 20, spans, "more than half the memory"),
                                   (0.0, None, {}, "no weights span")):
        monkeypatch.setattr(snapshot, "page_cache_share", lambda path, v=share: v)
        monkeypatch.setattr(startup, "memory_available", lambda v=room: v)
        caplog.clear()
        env = {}
        assert startup.start_read_ahead(_Arch(sp), env) is None and env == {}
        assert words in caplog.text
    if os.path.exists("/proc/meminfo"):
        assert real_memory_available() > 0
    # MemAvailable as the kernel writes it (kB), read without another module's private helper
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16384 kB\nMemAvailable:    8192 kB\nHugePages_Total: 0\n")
    assert real_memory_available(str(info)) == 8192 * 1024
    info.write_text("MemTotal:       16384 kB\n")
    assert real_memory_available(str(info)) is None
    assert real_memory_available(str(tmp_path / "none")) is None
