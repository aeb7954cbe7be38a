"""The CPU pieces of the freeze run (``vitrify.bench.sglang.freeze_e2e``,
``benchmarks/sglang_freeze_e2e.py``; the real-server run needs a GPU): the server command lines
through SGLang's own CLI parser, the plugin configs it writes through the plugin's own config
loader, the log watch, the arguments, the dry run, the comparisons and which of them are checks
with and without deterministic inference, and launches against a stand-in server, the oracle's
pair and planted weight fault included."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from vitrify.bench.sglang import freeze_e2e as fz  # noqa: E402
from vitrify.bench.sglang import harness, oracle  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _parse(cmd):
    import argparse

    from sglang.srt.server_args import ServerArgs

    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p.parse_args(cmd[3:])


@pytest.mark.parametrize("scenario", fz.SCENARIOS)
def test_every_launch_is_the_same_server_the_plugin_accepts(tmp_path, scenario):
    s = fz.Settings(work=str(tmp_path), out=str(tmp_path / "out"))
    a = _parse(fz.server_args(s, scenario))
    # what freeze.check_supported accepts, and what the plugin would otherwise force
    assert a.attention_backend == "triton" and a.cuda_graph_backend_prefill == "disabled"
    assert a.load_format == "auto" and a.skip_tokenizer_init and a.random_seed == 1
    assert a.model_path == s.model_dir and not a.enable_deterministic_inference
    assert not a.enable_hierarchical_cache and a.tp_size == 1
    det = _parse(fz.server_args(fz.Settings(work=str(tmp_path), deterministic=True), scenario))
    assert det.enable_deterministic_inference
    env = fz.server_env(s, scenario, probe=False)
    assert "TVM_FFI_CACHE_DIR" not in env and "VITRIFY_SGLANG_JIT_ROOT" not in env
    if fz.mode_of(scenario) == "plain":
        assert "VITRIFY_SGLANG_CONFIG" not in env and "VITRIFY_LOG_LEVEL" not in env
        return
    assert env["VITRIFY_LOG_LEVEL"] == "INFO"  # the plugin's lines reach the server log
    from vitrify.integrations.sglang import config

    if fz.mode_of(scenario) == "load":
        os.makedirs(s.archive)  # LOAD's config needs the archive SAVE wrote
    cfg = config.load(env["VITRIFY_SGLANG_CONFIG"])
    assert cfg.mode == fz.mode_of(scenario) and cfg.archive == s.archive
    assert cfg.region_bytes == 24 << 30 and cfg.save_after_requests == 1 + s.warm_prompts
    assert cfg.jit_caches and cfg.jit_dir == os.path.join(str(tmp_path), f"jit-{scenario}")
    assert cfg.standby_file == (s.standby_file if scenario == "load-standby" else None)


def test_the_8b_shape_gets_a_region_for_its_weights(tmp_path):
    s, _ = fz.parse_args(["--shape", "8b", "--work", str(tmp_path)])
    assert s.region_gb >= 40 and s.model_config["num_hidden_layers"] == 36
    assert s.model_dir == "/tmp/vitrify-models/8b-seed0" and not s.deterministic
    d, _ = fz.parse_args(["--shape", "llama-1b", "--deterministic", "--weights-seed", "3"])
    assert d.deterministic and d.model_dir.endswith("llama-1b-seed3")
    assert d.model_config["model_type"] == "llama"
    with pytest.raises(SystemExit):
        fz.parse_args(["--prompts", "1"])


def test_the_log_watch_notes_each_line_once(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("[TP0] Init torch distributed begin.\n")
    w = fz.LogWatch(str(log), {"floor": fz.IMPORT_FLOOR_LINE, "thawed": fz.THAWED_LINE})
    w.poll()
    assert "floor" in w.seen and "thawed" not in w.seen
    first = w.seen["floor"]
    with open(log, "a") as f:
        f.write("x vitrify: thawed /a/tiny.vitrify in 1.25 s (12 graphs)\n"
                "[TP0] Init torch distributed begin.\n")
    w.poll()
    assert w.seen["floor"] == first and w.matches["thawed"].group(2) == "1.25"
    # a line written in two pieces is seen once it ends, whole
    w2 = fz.LogWatch(str(tmp_path / "b.log"), {"saved": fz.SAVE_LINE, "plugin": fz.PLUGIN_LINE})
    (tmp_path / "b.log").write_text("x vitrify: SAVE comp")
    w2.poll()
    assert "saved" not in w2.seen
    with open(tmp_path / "b.log", "a") as f:
        f.write("lete: /a (3 graphs)\nvitrify SGLang plugin: mode 'save', archive /a\n")
    w2.poll()
    assert {"saved", "plugin"} <= set(w2.seen)
    assert fz.SAVE_FAILED_LINE.search("[x] vitrify: SAVE failed, no archive was written (E: x)")


def test_dry_run_prints_the_three_launches(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sglang_freeze_e2e.py"),
                        "--dry-run", "--work", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert [ln.split(":")[0] for ln in r.stdout.splitlines() if ln.startswith("#")] == \
        ["# model", "# plain", "# save", "# load", "# load-standby", "# plain-warm",
         "# load-cached", "# load-drive"]
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sglang_freeze_e2e.py"),
                        "--dry-run", "--work", str(tmp_path), "--scenarios", "plain,save"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--scenarios must name plain,save,load" in r.stderr


def test_the_timeline_places_each_milestone_after_the_launch(tmp_path):
    import datetime as dt

    t0 = dt.datetime(2026, 12, 2, 2, 41, 18).timestamp()
    log = tmp_path / "load.log"
    log.write_text(
        "2026-12-02 02:41:22,267 vitrify.sglang INFO: vitrify SGLang plugin: mode 'load', "
        "archive /a, weight updates off, 1 hook(s) registered (SGLang 0.5.17)\n"
        "2026-12-02 02:41:22,300 vitrify.sglang INFO: vitrify SGLang plugin: the model registry "
        "imports qwen3 only (230 other model modules in SGLANG_DISABLED_MODEL_ARCHS)\n"
        "2026-12-02 02:41:46,134 vitrify.sglang INFO: vitrify SGLang plugin: mode 'load', "
        "archive /a, weight updates off, 9 hook(s) registered (SGLang 0.5.17)\n"
        "[2026-12-02 02:41:46] Init torch distributed begin.\n"
        "2026-12-02 02:41:46,200 vitrify.sglang INFO: vitrify: 716136 objects of the imports "
        "moved to the collector's permanent generation in 0.06 s\n"
        "2026-12-02 02:41:46,300 vitrify.sglang INFO: vitrify: standby: 15.28 of 15.28 GiB of the "
        "spans the thaw restores read into the page cache in 10.9 s\n"
        "2026-12-02 02:41:40,000 vitrify.sglang INFO: vitrify: read-ahead: the spans the thaw "
        "restores are in the page cache (15.28 GiB in 10.7 s)\n"
        "2026-12-02 02:41:49,100 vitrify.snapshot INFO: restore /a/rank0/region/weights.span: 100% "
        "of it is in the page cache: read through it\n"
        "2026-12-02 02:41:49,440 vitrify.snapshot INFO: restored /a/rank0/region/weights.span: "
        "343932928 bytes written, 0 dropped above the ceiling 0x14800000, 0.27 s\n"
        "2026-12-02 02:41:49,448 vitrify.session INFO: restore_weights: 0.280 s\n"
        "2026-12-02 02:41:51,100 vitrify.sglang INFO: vitrify: decode graphs, 6 shapes: warm-up "
        "forwards 0.40 s, gc 0.51 s, claim 0.12 s\n"
        "2026-12-02 02:41:51,273 vitrify.session INFO: total: 4.880 s\n"
        "2026-12-02 02:41:51,274 vitrify.sglang INFO: vitrify: thawed /a in 4.88 s (6 graphs)\n"
        "[2026-12-02 02:41:52] The server is fired up and ready to roll!\n")
    tl = fz.timeline(str(log), t0)
    assert tl["at_s"] == {"plugin_launcher": 4.267, "plugin_scheduler": 28.134,
                          "torch_distributed": 28.0, "thawed": 33.274, "fired_up": 34.0}
    assert tl["session_steps_s"] == {"restore_weights": 0.28}
    assert tl["decode_graph_loop"] == {"shapes": 6, "warmup_forwards_s": 0.4, "gc_s": 0.51,
                                       "claim_s": 0.12}
    assert tl["model_registry_narrowed_to"] == "qwen3"
    assert tl["import_heap_frozen"] == {"objects": 716136, "seconds": 0.06}
    assert tl["standby_read"] == {"gib": 15.28, "of_gib": 15.28, "seconds": 10.9}
    assert tl["weights_in_page_cache_pct"] == 100
    assert tl["read_ahead"] == {"gib": 15.28, "seconds": 10.7, "done_at_s": 22.0}
    assert tl["weights_restore"] == {"bytes": 343932928, "seconds": 0.27}
    assert fz.timeline(str(tmp_path / "missing.log"), t0) == {"at_s": {}, "session_steps_s": {}}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stand_in(monkeypatch, tmp_path, **kw):
    """Settings whose launches start tests/python/fake_sglang_server.py (with the run's
    deterministic flag), CPU tensors for the planted fault and a plain pickle for them."""
    fake = Path(__file__).with_name("fake_sglang_server.py")
    s = fz.Settings(work=str(tmp_path / "w"), out=str(tmp_path / "out"), site=str(tmp_path / "site"),
                    warm_prompts=2, port=_free_port(), standby_settle_s=0.3, max_new_tokens=4,
                    ready_s=60.0, **kw)
    os.makedirs(s.work)
    os.makedirs(s.out)
    real_env = fz.server_env
    monkeypatch.setattr(fz, "server_env", lambda s_, sc, probe=True: real_env(s_, sc, probe=False))
    monkeypatch.setattr(fz, "server_args", lambda s_, sc: [sys.executable, str(fake), "--port",
                                                           str(s_.port)] + (
        [harness.DETERMINISTIC_FLAG] if s_.deterministic else []))
    monkeypatch.setattr(fz, "fault_tensor", lambda s_: (fz.FAULT_PARAM,
                                                         torch.ones(8, dtype=torch.bfloat16)))
    monkeypatch.setattr(harness, "serialize",
                        lambda nt: base64.b64encode(pickle.dumps(nt)).decode())
    return s


@pytest.mark.parametrize("scenario", ["save", "load-standby"])
def test_a_launch_against_a_stand_in_server(tmp_path, monkeypatch, scenario):
    """launch() end to end against tests/python/fake_sglang_server.py: ready, the floor, the
    plugin's lines, SAVE's wait after the warm prompts, the standby's go, the timeline, the
    prompts' tokens, the oracle's pair."""
    s = _stand_in(monkeypatch, tmp_path, deterministic=scenario == "save")
    if scenario != "save":
        os.makedirs(s.archive)  # LOAD's config needs the archive
    prompts = harness.make_prompts(1, 3, 8, 16)
    warm = harness.make_prompts(2, 2, 8, 16)
    info: dict = {}
    res = fz.launch(s, scenario, prompts, info, warm=warm if scenario == "save" else (),
                    more=harness.make_prompts(3, 2, 8, 16),
                    pair=list(oracle.last_token_pair(4, 12)))
    assert [r["output_ids"] for r in res] == [[(sum(p) + i) % 1000 for i in range(4)]
                                              for p in prompts]
    assert info["ready_s"] > 0 and info["import_floor_s"] <= info["ready_s"] + 1
    assert info["startup_time"] == {"scheduler_e2e": 1.5} and not info["traceback_in_log"]
    assert len(info["ttft_ms"]) == 3 and "second_sample_ttft_ms_median" in info
    assert info["pair"]["distinct"] is True and info["pair"]["launch"] == scenario
    assert info["deterministic"] is (scenario == "save")
    assert info["deterministic_inference_logged"] is (scenario == "save")
    at = info["timeline"]["at_s"]
    assert {"plugin_launcher", "plugin_scheduler", "torch_distributed", "fired_up"} <= set(at)
    if scenario == "save":
        assert info["saved"] and info["warm_prompts"] == 2 and "saved" in at
    else:
        assert info["go_to_ready_s"] < info["ready_s"] and "thawed" in at
        assert info["go_after_the_standby_read"] is True
        assert info["standby_waiting_at_s"] + s.standby_settle_s <= info["ready_s"]
        assert os.path.exists(s.standby_file)


def test_the_planted_weight_fault_in_a_load_launch(tmp_path, monkeypatch):
    """LOAD against the stand-in: one weight one ulp up through /update_weights_from_tensor
    moves the subset's logprobs away from the reference, the restore brings them back:
    caught."""
    s = _stand_in(monkeypatch, tmp_path)
    os.makedirs(s.archive)
    prompts = harness.make_prompts(1, 6, 8, 16)
    subset = fz.fault_subset(prompts)
    assert len(subset) == fz.FAULT_PROMPTS
    assert min(len(prompts[i]) for i in subset) >= max(
        len(p) for i, p in enumerate(prompts) if i not in subset)
    info: dict = {}

    def while_up(i):
        ref = [harness.generate(s.port, prompts[j], s.max_new_tokens) for j in subset]
        i["fault"] = fz.plant_weight_fault(s, [prompts[j] for j in subset], ref)

    fz.launch(s, "load", prompts, info, while_up=while_up)
    f = info["fault"]
    assert f["caught"] is True and f["planted"] is True and f["restored_identical"] is True, f
    assert f["param"] == "model.layers.0.input_layernorm.weight" and f["to"] == 1.0078125
    assert f["faulty_logprob_max_abs_diff"] == pytest.approx(0.0078125)
    # dummy weights: the weight's value is not known, no fault, the oracle has no power
    d = fz.plant_weight_fault(fz.Settings(weights=harness.Weights("dummy", why="t")), [], [])
    assert d["caught"] is None and "dummy weights" in d["why"]


def _r(ids, lp):
    return {"output_ids": ids, "logprobs": lp, "cached_tokens": 0, "details": {},
            "prompt_tokens": 9, "ttft_s": 0.01, "latency_s": 0.02}


@pytest.mark.parametrize("deterministic", [False, True])
def test_thawed_against_plain_is_a_check_only_with_deterministic_inference(deterministic):
    """LOAD against SAVE (one path) is a check under SGLang's defaults; SAVE and LOAD against
    plain (another process's kernels) only when every launch was deterministic."""
    s = fz.Settings(deterministic=deterministic)
    scen = {sc: {"deterministic": deterministic} for sc in ("plain", "save", "load")}
    res = {"plain": [_r([1, 2], [-1.0, -2.0])], "save": [_r([1, 2], [-1.0, -2.5])],
           "load": [_r([1, 2], [-1.0, -2.5])]}
    comps = fz.comparisons_of(s, scen, res)
    checks = harness.fold(comps, {})
    assert checks["load.logprobs_identical_vs_save"] is True
    if deterministic:
        assert checks["load.tokens_identical"] is True
        assert checks["load.logprobs_identical_vs_plain"] is False
        assert checks["save.logprobs_identical_vs_plain"] is False
    else:
        assert set(checks) == {"load.logprobs_identical_vs_save"}
        off = [c for c in comps if not c["is_check"]]
        assert {c["name"] for c in off} == {"save.tokens_identical", "load.tokens_identical",
                                            "save.logprobs_identical_vs_plain",
                                            "load.logprobs_identical_vs_plain"}
        assert all("deterministic" in c["why_not_a_check"] for c in off)


def test_the_drive_ceiling_is_read_from_the_weights_span_and_sets_the_ratios(tmp_path,
                                                                             monkeypatch):
    from vitrify.bench import snapshot as bench_snapshot

    s = fz.Settings(work=str(tmp_path / "w"))
    path = fz.weights_span(s)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.truncate(3 << 26)
    seen = []
    monkeypatch.setattr(bench_snapshot, "dd_read_rate",
                        lambda p, direct, count: seen.append((p, direct, count)) or (1.5e9, "dd"))
    monkeypatch.setattr(fz.shutil, "which", lambda name: None)
    drive = fz.drive_ceiling(s)
    assert seen == [(path, True, 3)] and drive["bytes_per_s"] == 1.5e9
    assert "not installed" in drive["fio"]["error"]
    scenarios = {"load": {"timeline": {"session_steps_s": {"restore_weights": 0.2}},
                          "startup_time": {"scheduler_e2e": 1.0}},
                 "load-standby": {"timeline": {"session_steps_s": {"restore_weights": 0.02}},
                                  "startup_time": {"scheduler_e2e": 9.0}}}
    w = fz.weights_figures(s, scenarios, drive["bytes_per_s"])
    size = 3 << 26
    assert w["weights_span_bytes"] == size and w["weights_span_at_ceiling_s"] == round(size / 1.5e9, 3)
    assert w["load"]["over_drive_ceiling"] == round(size / 0.2 / 1.5e9, 3)
    assert w["load"]["scheduler_e2e_without_the_drive_s"] == round(1.0 - size / 1.5e9, 3)
    # the standby's start-up includes its wait: no figure without the drive for it
    assert "scheduler_e2e_without_the_drive_s" not in w["load-standby"]
    # a LOAD that read ahead overlapped the drive with its imports: no "without the drive"
    scenarios["load"]["timeline"]["read_ahead"] = {"gib": 1.0, "seconds": 1.0, "done_at_s": 9.0}
    w = fz.weights_figures(s, scenarios, drive["bytes_per_s"])
    assert "over_drive_ceiling" in w["load"]
    assert "scheduler_e2e_without_the_drive_s" not in w["load"]
    # a restore the page cache served is no drive figure at all
    scenarios["load-cached"] = {"timeline": {"session_steps_s": {"restore_weights": 0.01},
                                             "weights_in_page_cache_pct": 100},
                                "startup_time": {"scheduler_e2e": 0.5}}
    w = fz.weights_figures(s, scenarios, drive["bytes_per_s"])
    assert w["load-cached"] == {"restore_s": 0.01, "bytes_per_s": size / 0.01,
                                "from_the_page_cache": True}
    assert fz.weights_figures(fz.Settings(work=str(tmp_path / "none")), scenarios, 1e9) == {}


def test_a_drive_launch_turns_the_read_ahead_off_and_the_archive_leaves_the_page_cache(tmp_path):
    from vitrify import snapshot

    s = fz.Settings(work=str(tmp_path / "w"))
    os.makedirs(s.work)
    os.makedirs(s.archive)
    assert "read_ahead = false" in Path(fz.plugin_config(s, "load-drive")).read_text()
    assert "read_ahead" not in Path(fz.plugin_config(s, "load")).read_text()
    path = fz.weights_span(s)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(os.urandom(4 << 20))
        f.flush()
        os.fsync(f.fileno())
    Path(path).read_bytes()
    if snapshot.page_cache_share(path) is None:
        pytest.skip("mincore cannot tell here")
    assert fz.drop_tree(s.archive) <= 0.25
    assert fz.drop_tree(str(tmp_path / "empty")) is None


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_whole_run_against_a_stand_in_server(tmp_path, monkeypatch, deterministic):
    """run(): plain -> save -> load against the stand-in (the archive's own checks left out: the
    stand-in writes none), every launch's pair, the planted fault in load, the comparisons and
    the verdict; a run whose LOAD ignores the fault has no oracle and fails."""
    import tarfile

    s = _stand_in(monkeypatch, tmp_path, deterministic=deterministic, scenarios=fz.CORE,
                  models_root=str(tmp_path / "models"), prompts=5)
    (tmp_path / "site").mkdir()
    with tarfile.open(tmp_path / "b.tar.xz", "w:xz") as t:
        t.add(tmp_path / "site", arcname=".")
    s.bundle = str(tmp_path / "b.tar.xz")
    jit = {"archived": {}, "compiled_after_load": {"triton": 0}}
    monkeypatch.setattr(fz, "jit_after_load", lambda s_, sc="load": dict(jit))
    res = fz.run(s)
    assert res["ok"] is True, {k: res.get(k) for k in ("checks", "scenarios", "oracle_power")}
    assert res["weights"]["kind"] == "checkpoint" and res["weights"]["seed"] == 0
    op = res["oracle_power"]
    assert op["ok"] and [p["launch"] for p in op["last_token_pairs"]] == list(fz.CORE)
    assert op["planted_fault"]["caught"] is True
    assert res["settings"]["deterministic"] is deterministic
    assert all(res["scenarios"][sc]["deterministic"] is deterministic for sc in fz.CORE)
    assert res["checks"]["load.logprobs_identical_vs_save"] is True
    assert ("load.logprobs_identical_vs_plain" in res["checks"]) is deterministic
    assert res["checks"]["load.no_jit_after_thaw"] is True
    # the held-out shapes reached plain and load, each batch one request
    for sc in ("plain", "load"):
        held = res["scenarios"][sc]["heldout"]
        assert held["requests"] == len(held["batch_sizes"]) and max(held["batch_sizes"]) > 16
        assert held["max_input"] == min(500, 512 - s.max_new_tokens - 2)
    assert "heldout" not in res["scenarios"]["save"]
    assert "plain_triton_files_compiled_by_the_heldout_sweep" in res["jit_check_power"]
    name = f"{fz.NAME}-{s.shape}"  # the shape in the name: tiny and 8b runs never collide
    assert res["name"] == name and Path(harness.partial_path(s.out, name)).exists()
    path = harness.write(res, s.out)
    assert path.name.startswith(f"sglang-freeze-e2e-{s.shape}-")
    assert not Path(harness.partial_path(s.out, name)).exists()
    # the same run whose fault does not reach the answers: every check true, the run fails
    monkeypatch.setattr(fz, "plant_weight_fault", lambda s_, p, r: {
        "fault": "f", "planted": True, "caught": False, "why": "stand-in: nothing moved"})
    res = fz.run(s)
    assert all(v for v in res["checks"].values() if isinstance(v, bool))
    assert res["ok"] is False and res["oracle_power"]["why"] == [
        "planted fault (f): stand-in: nothing moved"]
