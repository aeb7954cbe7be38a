"""`vitrify bench coldstart`'s analysis on synthetic runs (the runs themselves need a GPU): medians,
the floor, the thaw's breakdown, the issue's ratios and the token check."""

from __future__ import annotations

import math

import pytest

from vitrify.bench import coldstart


def _run(first: float, ready: float, timings: dict, tokens=None, background=0.8) -> dict:
    return {"first_token_s": first, "ready_s": ready,
            "session": {"timings": timings, "background": {"graphs_background": background}},
            "tokens": tokens or [[1, 2]], "logits_sha256": ["a"]}


FREEZE = {"session": {"timings": {"capture": 2.0}}, "tokens": [[1, 2]], "logits_sha256": ["a"]}
COLD = {"reserve": 0.1, "build": 9.0, "load_weights": 0.1, "alloc_state": 0.0,
        "warmup": 100.0, "capture": 2.0}
THAW = {"open": 0.2, "reserve": 0.1, "build": 4.5, "alloc_state": 0.0, "restore_weights": 1.5,
        "restore_warmup": 0.1, "restore_graph_pools": 0.1, "graphs_start": 0.3,
        "graphs_wait": 0.2, "restore_state": 0.0}
FLOORS = [{"floor_s": 4.0, "h2d_bytes_per_s": 50e9}, {"floor_s": 3.5, "h2d_bytes_per_s": 55e9},
          {"floor_s": 4.5, "h2d_bytes_per_s": 52e9}]
DISK = {"bytes_per_s": 1.5e9}


def test_ratios_are_taken_above_the_floor_and_without_the_weights():
    colds = [_run(120.0, 118.0, COLD), _run(110.0, 108.0, COLD), _run(130.0, 128.0, COLD)]
    thaws = [_run(8.0, 7.0, THAW, background=0.9), _run(7.5, 6.5, THAW, background=0.7),
             _run(9.0, 8.0, THAW, background=1.1)]
    a = coldstart.analyse(FREEZE, colds, thaws, FLOORS, DISK, weights_bytes=2_100_000_000)
    r = a["ratios"]
    # floor 4.0 (median); thaw 8.0 - 4.0 - 1.5 s of weights = 2.5 s; cold 120 - 4 = 116 s.
    assert r["thaw_above_floor_excl_weights_s"] == pytest.approx(2.5)
    assert r["thaw_above_floor_excl_weights_over_cold_above_floor"] == pytest.approx(2.5 / 116)
    # 2.1 GB in 1.5 s = 1.4 GB/s against min(1.5 disk, 52 PCIe) GB/s.
    assert r["weight_restore_over_min_disk_pcie"] == pytest.approx(1.4 / 1.5)
    # Without a rebuild-alone measurement the ladder's rebuild is the background loader's wall
    # time (median 0.9 s), not the 0.5 s THAW waited for; the capture is the cold runs' (2.0 s).
    assert r["ladder_rebuild_over_capture"] == pytest.approx(0.9 / 2.0)
    rows = {row["metric"]: row["value"] for row in a["rows"]}
    assert rows["ladder rebuild THAW waited for"] == pytest.approx(0.5)
    assert rows["ladder rebuild (background, wall)"] == pytest.approx(0.9)
    assert r["cold_first_token_over_thaw_first_token"] == pytest.approx(120 / 8)
    assert a["mismatches"] == []
    thaw = a["breakdown"]["thaw"]
    assert list(thaw)[0] == "process start + imports" and list(thaw)[-1].startswith("first token")
    assert thaw["kernel modules + graph rebuild"] == pytest.approx(0.5)
    assert thaw["first token (prefill 16 prompts)"] == pytest.approx(1.0)
    # The parts before the first token add up to the time the engine was ready.
    assert sum(v for k, v in thaw.items() if not k.startswith("first")) == pytest.approx(7.0)
    assert a["goal_direction"]["ladder_rebuild_over_capture"] == "<="


def test_a_run_with_other_tokens_is_a_problem():
    colds = [_run(120.0, 118.0, COLD)]
    thaws = [_run(8.0, 7.0, THAW, tokens=[[1, 3]])]
    a = coldstart.analyse(FREEZE, colds, thaws, FLOORS[:1], DISK, weights_bytes=1)
    assert a["mismatches"] == ["thaw run 0"]
    assert "thaw run 0" in coldstart.problem({"mismatches": a["mismatches"]})
    assert coldstart.problem({"mismatches": []}) is None


def test_a_cold_start_below_the_floor_gives_no_ratio_rather_than_a_wrong_one():
    colds = [_run(3.0, 2.0, COLD)]
    thaws = [_run(3.0, 2.0, THAW)]
    a = coldstart.analyse(FREEZE, colds, thaws, FLOORS[:1], DISK, weights_bytes=1)
    assert math.isnan(a["ratios"]["thaw_above_floor_excl_weights_over_cold_above_floor"])


def test_small_config_is_a_valid_engine_config():
    pytest.importorskip("transformers")
    from vitrify.integrations.transformers import EngineConfig

    small = EngineConfig.from_dict(coldstart.config("eager", small=True))
    assert small.layers < EngineConfig().layers and small.variant == "eager"
    assert EngineConfig.from_dict(coldstart.config("compiled", small=False)) == \
        EngineConfig(variant="compiled")


def test_cold_runs_compile_from_nothing_unless_asked(tmp_path):
    env = coldstart.cold_env("cold", str(tmp_path))
    assert env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] == "1"
    assert env["TRITON_CACHE_DIR"].startswith(str(tmp_path))
    assert coldstart.cold_env("cold", str(tmp_path))["TRITON_CACHE_DIR"] != env["TRITON_CACHE_DIR"]
    assert coldstart.cold_env("warm", str(tmp_path)) == {}


def test_the_breakdown_plot_draws_a_result_read_back_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    colds = [_run(120.0, 118.0, COLD)]
    thaws = [_run(8.0, 7.0, THAW)]
    a = coldstart.analyse(FREEZE, colds, thaws, FLOORS[:1], DISK, weights_bytes=1)
    res = json.loads(json.dumps({"breakdown": a["breakdown"], "config": {"variant": "compiled"},
                                 "date": "2026-12-01T00:00:00", "git_sha": "abc"},
                                sort_keys=True))  # as written: keys sorted
    out = coldstart.plot_extra(res, tmp_path / "b.png")
    assert out.stat().st_size > 1000


def test_the_ladder_rebuild_alone_is_compared_with_the_cold_capture():
    colds = [_run(120.0, 118.0, dict(COLD, capture=c)) for c in (0.6, 0.7, 0.8)]
    thaws = [_run(8.0, 7.0, THAW, background=1.8) | {"rebuild_alone": {"seconds": s}}
             for s in (0.3, 0.2, 0.4)]
    freeze = {**FREEZE, "session": {"timings": {"capture": 1.7}}}
    a = coldstart.analyse(freeze, colds, thaws, FLOORS, DISK, weights_bytes=1)
    assert a["ratios"]["ladder_rebuild_over_capture"] == pytest.approx(0.3 / 0.7)
    rows = {row["metric"]: row["value"] for row in a["rows"]}
    assert rows["ladder rebuild alone"] == pytest.approx(0.3)
    assert rows["ladder rebuild inside THAW (background, wall)"] == pytest.approx(1.8)
    assert rows["ladder capture at FREEZE (recording)"] == pytest.approx(1.7)
    assert rows["ladder capture, cold (torch)"] == pytest.approx(0.7)


def test_the_drive_rate_is_the_median_of_the_measurements_beside_the_thaws():
    runs = [{"bytes": 8, "bytes_per_s": b, "dd_bytes_per_s": d, "command": "dd",
             "o_direct": True, "page_cache_dropped": True,
             "fio_bytes_per_s": {"libaio_4MiB_qd16": b, **({"psync_4MiB_qd4": d} if d > 1 else {})}}
            for b, d in ((3.0, 1.0), (1.0, 0.5), (2.0, 2.0))]
    s = coldstart._disk_summary(runs)
    assert s["bytes_per_s"] == 2.0 and s["dd_bytes_per_s"] == 1.0
    # a variant missing from a run (fio failed to fit the file) is the median of the others
    assert s["fio_bytes_per_s"] == {"libaio_4MiB_qd16": 2.0, "psync_4MiB_qd4": 2.0}
    assert s["measurements"] == 3 and s["runs"] == runs


def test_a_thaw_that_rebuilt_several_times_counts_the_median_at_its_thread_count():
    sweep = [{"threads": 4, "seconds": 0.5}, {"threads": 8, "seconds": 0.05},
             {"threads": 4, "seconds": 0.2}, {"threads": 8, "seconds": 0.06},
             {"threads": 4, "seconds": 0.3}]
    assert coldstart._rebuild_seconds(dict(sweep[0], sweep=sweep)) == pytest.approx(0.3)
    assert coldstart._rebuild_seconds({"threads": 4, "seconds": 0.4}) == pytest.approx(0.4)
