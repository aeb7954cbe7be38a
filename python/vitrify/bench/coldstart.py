"""Cold start vs thaw of the transformers engine (GPU): process start -> first token.

Every run is a fresh process (``python -m vitrify.integrations.transformers``) serving 16 new
prompts. ``cold`` builds the engine the ordinary way (imports, build, weights, warmup and, for the
compiled variant, ``torch.compile``, capture of the decode-graph ladder); ``thaw`` restores it from
an archive frozen once at the start. Measured in the same run:

- the floor every process pays before any engine work: ``import torch`` plus a CUDA context (a
  process that does only that), and the pinned host -> device copy rate;
- the drive's read rate for the archive's weights span after each thaw run (the best of ``dd``
  and fio's O_DIRECT reads at depth, page cache dropped when this process may; medians; on the
  GPU machine fio comes from the carried bundle: ``. scripts/use-fio-bundle.sh``);
- ``--runs`` cold and thaw runs (medians), the thaw's breakdown (open and verify, reserve, build
  and imports, weights, warmup gap, graph pools, kernel modules and graph rebuild, first token)
  and the graph ladder's rebuild (once more after serving, alone) against the cold runs' capture
  of it (torch's own path), with the loader's background time inside THAW beside it.

Ratios (goals from the issue, compiled variant): thaw above the floor, excluding the weights'
bytes, over cold above the floor (<= 0.05) and in seconds (<= 2); weight restore over
min(disk read, PCIe) (>= 0.9); ladder rebuild alone over the cold capture (<= 0.5). Every run's
tokens and logits must equal the frozen process's (a mismatch fails the benchmark).

    vitrify bench coldstart [--variant compiled|eager] [--runs 3] [--small | --shape 1b|8b] [--dir DIR]
                            [--caches cold|warm]

Cold runs compile from nothing by default (``--caches cold``: Inductor's caches off, an empty
Triton cache directory per run), as a server on a fresh machine does.

``--plot`` also draws the breakdown (cold vs thaw, stacked) as ``coldstart-DATE-breakdown.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


from . import resultlib
from .cli import existing_dir, positive_int

# The floor process: import torch, make a CUDA context; then (not counted) the pinned H2D rate.
FLOOR_CODE = r"""
import json, sys, time
t0 = float(sys.argv[1])
import torch
torch.cuda.init()
torch.empty(1, device="cuda")
torch.cuda.synchronize()
floor = time.time() - t0
src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(4):
    dst.copy_(src, non_blocking=True)
torch.cuda.synchronize()
print(json.dumps({"floor_s": floor, "h2d_bytes_per_s": 4 * (1 << 30) / (time.perf_counter() - t)}))
"""
# Thaw steps in the breakdown, in order (session timing keys, summed where several).
THAW_PARTS = {
    "open and verify": ("open",),
    "reserve": ("reserve",),
    "build (imports, objects)": ("build", "alloc_state"),
    "weights": ("restore_weights",),
    "warmup gap": ("restore_warmup", "compile", "warmup"),
    "graph pools": ("restore_graph_pools",),
    "kernel modules + graph rebuild": ("graphs_start", "graphs_wait"),
    "engine state": ("restore_state",),
}
COLD_PARTS = {
    "reserve": ("reserve",), "build (imports, objects)": ("build", "alloc_state"),
    "weights": ("load_weights",), "compile + warmup": ("compile", "warmup"),
    "capture": ("capture",),
}


def config(variant: str, small: bool, shape: str = "1b") -> dict:
    from ..integrations.transformers import EngineConfig
    from .weights import SHAPES

    if small:  # the demo's size: a minute for everything
        cfg = EngineConfig(variant=variant, vocab=8192, hidden=1024, ffn=2816, layers=8, heads=16,
                           kv_heads=4, max_len=256, batch_sizes=(1, 2, 4, 8, 16, 32))
    else:  # 1b: the engine's default (1.1 B Llama); 8b: Qwen3-8B's shape, 16 GB of bf16
        cfg = EngineConfig(variant=variant, **SHAPES[shape])
    return cfg.to_dict()


def cold_env(caches: str, scratch: str) -> dict[str, str]:
    """The environment of a cold run: with ``caches="cold"`` Inductor's caches are off and Triton
    compiles into an empty directory of its own, as on a fresh machine; ``"warm"`` leaves both as
    they are (a restart on the same machine)."""
    if caches == "warm":
        return {}
    path = os.path.join(scratch, f"triton-{time.time_ns()}")
    os.makedirs(path)
    return {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TRITON_CACHE_DIR": path}


def _floor() -> dict:
    p = subprocess.run([sys.executable, "-c", FLOOR_CODE, repr(time.time())],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"the floor process failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# fio reads of the weights span file at depth: (engine, block, depth). The drive's read rate is
# the best of them and dd (a good O_DIRECT client's rate, the ceiling the restore is held to).
FIO_READS = (("libaio", 4 << 20, 16), ("psync", 4 << 20, 4), ("psync", 64 << 20, 1))


def _disk_read_rate(path: str) -> dict:
    """The drive's read rate for ``path``: ``dd`` with O_DIRECT where the filesystem has it
    (``vitrify bench snapshot``'s measurement) and, with fio on the PATH, fio's O_DIRECT reads at
    depth (:data:`FIO_READS`); the page cache dropped first when allowed. ``bytes_per_s`` is the
    best of them."""
    import shutil

    from vitrify import _native

    from .disk import fio_run
    from .snapshot import dd_read_rate

    dropped = resultlib.drop_page_cache([path])
    direct = bool(_native.probe_direct_io(os.path.dirname(path))["supported"])
    rate, cmd = dd_read_rate(path, direct)
    size = os.path.getsize(path)
    fio = {}
    if direct and shutil.which("fio"):
        for engine, block, depth in FIO_READS:
            total = size // (block * depth) * (block * depth)
            if total > 0:
                fio[f"{engine}_{block >> 20}MiB_qd{depth}"] = fio_run(path, "read", block, depth,
                                                                       total, engine)
    best = max([rate, *fio.values()])
    return {"bytes": size, "bytes_per_s": best, "dd_bytes_per_s": rate, "command": cmd,
            "fio_bytes_per_s": fio, "page_cache_dropped": bool(dropped), "o_direct": direct}


# After serving, each thaw rebuilds the ladder alone at THAW's thread count (4) three times and at
# 8 twice, alternating: the median at 4 is the result, the sweep shows the thread count's effect.
REBUILDS = [4, 8, 4, 8, 4]


def _disk_summary(runs: list[dict]) -> dict:
    """Medians over the drive measurements taken beside the thaw runs (the drive's rate drifts
    between minutes on a cloud machine): the best rate, dd's and each fio variant's."""
    med = statistics.median
    variants = sorted({k for r in runs for k in r.get("fio_bytes_per_s", {})})
    return {"bytes": runs[0]["bytes"], "bytes_per_s": med(r["bytes_per_s"] for r in runs),
            "dd_bytes_per_s": med(r["dd_bytes_per_s"] for r in runs),
            "fio_bytes_per_s": {v: med(r["fio_bytes_per_s"][v] for r in runs
                                       if v in r.get("fio_bytes_per_s", {})) for v in variants},
            "command": runs[0]["command"], "o_direct": runs[0]["o_direct"],
            "page_cache_dropped": all(r["page_cache_dropped"] for r in runs),
            "measurements": len(runs), "runs": runs}


def _rebuild_seconds(alone: dict) -> float:
    """One thaw's ladder rebuild alone: the median of its rebuilds at THAW's thread count (the
    first one's), where it rebuilt several times (a sweep over thread counts)."""
    runs = [s for s in alone.get("sweep", [alone]) if s.get("threads") == alone.get("threads")]
    return statistics.median(float(s["seconds"]) for s in runs)


def _sum(timings: dict, keys: tuple[str, ...]) -> float:
    return sum(float(timings.get(k, 0.0)) for k in keys)


def analyse(freeze: dict, colds: list[dict], thaws: list[dict], floors: list[dict],
            disk: dict, weights_bytes: int) -> dict:
    """Medians, the breakdowns, the ratios and the token check (pure: CPU-tested)."""
    med = statistics.median
    floor = med(f["floor_s"] for f in floors)
    h2d = med(f["h2d_bytes_per_s"] for f in floors)
    cold_first = med(r["first_token_s"] for r in colds)
    thaw_first = med(r["first_token_s"] for r in thaws)
    weights_s = med(float(r["session"]["timings"].get("restore_weights", 0.0)) for r in thaws)
    thaw_above_excl = thaw_first - floor - weights_s
    ceiling = min(disk["bytes_per_s"], h2d)
    weight_rate = weights_bytes / weights_s if weights_s > 0 else 0.0
    # The ladder's rebuild alone (verify and read the files, load the modules, build every graph;
    # measured after serving, nothing else running) against capturing it the way a server
    # without vitrify does (the cold runs' torch capture); beside it the background loader's wall
    # time inside THAW (beside the main thread's imports and restores) and what THAW waited for.
    alone = [_rebuild_seconds(r["rebuild_alone"]) for r in thaws if "rebuild_alone" in r]
    background = med(float(r["session"].get("background", {}).get("graphs_background", 0.0))
                     for r in thaws)
    rebuild = med(alone) if alone else background
    waited = med(_sum(r["session"]["timings"], ("graphs_start", "graphs_wait")) for r in thaws)
    cold_captures = [float(r["session"]["timings"]["capture"]) for r in colds
                     if "capture" in r["session"]["timings"]]
    capture = (med(cold_captures) if cold_captures
               else float(freeze["session"]["timings"].get("capture", 0.0)))
    freeze_capture = float(freeze["session"]["timings"].get("capture", 0.0))
    breakdown = {
        "thaw": {k: med(_sum(r["session"]["timings"], v) for r in thaws)
                 for k, v in THAW_PARTS.items()},
        "cold": {k: med(_sum(r["session"]["timings"], v) for r in colds)
                 for k, v in COLD_PARTS.items()},
    }
    for name, runs in (("thaw", thaws), ("cold", colds)):
        engine_s = sum(breakdown[name].values())
        ready = med(r["ready_s"] for r in runs)
        # Before the session's first step: interpreter start and imports of the entry point.
        breakdown[name] = {"process start + imports": max(0.0, ready - engine_s),
                           **breakdown[name],
                           "first token (prefill 16 prompts)":
                               med(r["first_token_s"] - r["ready_s"] for r in runs)}
    ref_tokens, ref_logits = freeze["tokens"], freeze["logits_sha256"]
    mismatches = [f"{kind} run {i}" for kind, runs in (("cold", colds), ("thaw", thaws))
                  for i, r in enumerate(runs)
                  if r["tokens"] != ref_tokens or r["logits_sha256"] != ref_logits]
    ratios = {
        "thaw_above_floor_excl_weights_over_cold_above_floor":
            thaw_above_excl / (cold_first - floor) if cold_first > floor else float("nan"),
        "thaw_above_floor_excl_weights_s": thaw_above_excl,
        "weight_restore_over_min_disk_pcie": weight_rate / ceiling if ceiling > 0 else 0.0,
        "ladder_rebuild_over_capture": rebuild / capture if capture > 0 else float("nan"),
        "cold_first_token_over_thaw_first_token": cold_first / thaw_first,
    }
    rows = [
        {"metric": "floor: import torch + CUDA context", "value": floor, "unit": "s"},
        {"metric": "cold: process start -> first token", "value": cold_first, "unit": "s"},
        {"metric": "thaw: process start -> first token", "value": thaw_first, "unit": "s"},
        {"metric": "cold above the floor", "value": cold_first - floor, "unit": "s"},
        {"metric": "thaw above the floor", "value": thaw_first - floor, "unit": "s"},
        {"metric": "thaw above the floor, excluding weights", "value": thaw_above_excl,
         "unit": "s"},
        {"metric": "weights restored", "value": weight_rate / 1e9, "unit": "GB/s"},
        {"metric": "disk read (best of dd and fio at depth)", "value": disk["bytes_per_s"] / 1e9,
         "unit": "GB/s"},
        {"metric": "pinned H2D", "value": h2d / 1e9, "unit": "GB/s"},
        {"metric": "ladder capture, cold (torch)", "value": capture, "unit": "s"},
        {"metric": "ladder capture at FREEZE (recording)", "value": freeze_capture, "unit": "s"},
        {"metric": "ladder rebuild alone" if alone else "ladder rebuild (background, wall)",
         "value": rebuild, "unit": "s"},
        {"metric": "ladder rebuild inside THAW (background, wall)", "value": background,
         "unit": "s"},
        {"metric": "ladder rebuild THAW waited for", "value": waited, "unit": "s"},
        {"metric": "runs with tokens/logits != FREEZE", "value": len(mismatches),
         "unit": "runs"},
    ]
    return {"rows": rows, "ratios": ratios, "breakdown": breakdown, "mismatches": mismatches,
            "goals": {"thaw_above_floor_excl_weights_over_cold_above_floor": 0.05,
                      "thaw_above_floor_excl_weights_s": 2.0,
                      "weight_restore_over_min_disk_pcie": 0.9,
                      "ladder_rebuild_over_capture": 0.5},
            "goal_direction": {"thaw_above_floor_excl_weights_over_cold_above_floor": "<=",
                               "thaw_above_floor_excl_weights_s": "<=",
                               "ladder_rebuild_over_capture": "<="}}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--variant", choices=("compiled", "eager"), default="compiled",
                    help="the engine's decode step: torch.compile'd (default) or eager")
    ap.add_argument("--runs", type=positive_int, default=3, help="cold and thaw runs (median)")
    ap.add_argument("--small", action="store_true",
                    help="the demo's small engine (8 layers, hidden 1024) instead of 1.1 B")
    ap.add_argument("--shape", choices=("1b", "8b"), default="1b",
                    help="the engine's shape: 1.1 B Llama (default) or Qwen3-8B's (16 GB)")
    ap.add_argument("--dir", type=existing_dir, default=None,
                    help="where the archive goes (default: the system temp directory)")
    ap.add_argument("--caches", choices=("cold", "warm"), default="cold",
                    help="compile caches of the cold runs: off, as on a fresh machine (default), "
                         "or as this machine has them")


def unavailable(args: argparse.Namespace) -> str | None:
    return resultlib.needs_gpu("torch", "transformers")


def problem(res: dict) -> str | None:
    bad = res.get("mismatches")
    return f"tokens or logits differ from FREEZE in {', '.join(bad)}" if bad else None


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from ..integrations.transformers import run_process

    shape = getattr(args, "shape", "1b")
    if args.small and shape != "1b":
        raise ValueError(f"--small and --shape {shape} choose two engines: give one")
    cfg = config(args.variant, args.small, shape)
    with tempfile.TemporaryDirectory(prefix="vitrify-bench-coldstart-", dir=args.dir) as tmp:
        archive = str(Path(tmp) / "engine.vitrify")
        progress(f"FREEZE the {args.variant} engine once")
        # the region: 12 GiB holds the 1.1 B engine (the default); the 8 B one needs 16 GB of
        # weights and 19 GB of KV cache at 256 x 512 tokens
        sized = {"region_bytes": 64 << 30} if shape == "8b" else {}
        fz = run_process("freeze", archive, cfg, sized)
        span = Path(archive) / "rank0" / "region" / "weights.span"
        colds, thaws, disks, floors = [], [], [], []
        for i in range(args.runs):
            # the floor beside each thaw: it drifts by a second between minutes on that machine
            progress(f"floor process {i + 1}/{args.runs} (import torch + CUDA context)")
            floors.append(_floor())
            progress(f"cold run {i + 1}/{args.runs} ({args.caches} compile caches)")
            colds.append(run_process("cold", "-", cfg, sized, env=cold_env(args.caches, tmp)))
            progress(f"thaw run {i + 1}/{args.runs}")
            resultlib.drop_page_cache([str(span)])
            thaws.append(run_process("thaw", archive, cfg, {"rebuild_again": REBUILDS}))
            progress(f"the drive's read rate for the weights span {i + 1}/{args.runs}")
            disks.append(_disk_read_rate(str(span)))
        disk = _disk_summary(disks)
        weights_bytes = int(fz["session"]["span_bytes"].get("weights", 0))
    a = analyse(fz, colds, thaws, floors, disk, weights_bytes)
    resultlib.print_table(a["rows"], ["metric", "value", "unit"])
    for side in ("cold", "thaw"):
        print(f"{side} breakdown (median s): " +
              ", ".join(f"{k} {v:.2f}" for k, v in a["breakdown"][side].items()))
    res = resultlib.result("coldstart", rows=a["rows"], ratios=a["ratios"], goals=a["goals"],
                           goal_direction=a["goal_direction"], breakdown=a["breakdown"],
                           mismatches=a["mismatches"], config=cfg, runs=args.runs, disk=disk,
                           compile_caches=args.caches,
                           floors=floors, weights_bytes=weights_bytes,
                           freeze_timings=fz["session"]["timings"],
                           cold=[_brief(r) for r in colds], thaw=[_brief(r) for r in thaws])
    return res


def _brief(r: dict) -> dict:
    return {k: r.get(k) for k in ("ready_s", "first_token_s", "process_s", "serve_s",
                                  "rebuild_alone")} | {
        "timings": r["session"].get("timings"), "graph_stats": r["session"].get("graph_stats")}


def plot_extra(res: dict, path: str | Path) -> Path:
    """Cold vs thaw as two stacked horizontal bars of their medians' parts (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    # The parts in time order (a result read back from JSON has its keys sorted), one colour each.
    parts = list(dict.fromkeys(["process start + imports", *COLD_PARTS, *THAW_PARTS,
                                *res["breakdown"]["cold"], *res["breakdown"]["thaw"]]))
    order = {p: i for i, p in enumerate(p for p in parts if not p.startswith("first token"))}
    order.update({p: len(parts) for p in parts if p.startswith("first token")})
    color = {p: plt.cm.tab20(i % 20) for i, p in enumerate(parts)}
    fig, ax = plt.subplots(figsize=(11, 3.8))
    try:
        for y, side in enumerate(("thaw", "cold")):
            left = 0.0
            for part, sec in sorted(res["breakdown"][side].items(), key=lambda kv: order[kv[0]]):
                ax.barh(y, sec, left=left, color=color[part], edgecolor="white",
                        label=part if y == 1 or part not in res["breakdown"]["cold"] else None)
                if sec > 0.04 * sum(res["breakdown"]["cold"].values()):
                    ax.text(left + sec / 2, y, f"{part}\n{sec:.1f}s", ha="center",
                            va="center", fontsize=6)
                left += sec
        ax.legend(fontsize=6, ncol=4, loc="upper right")
        ax.set_yticks([0, 1])
        ax.set_yticklabels(["thaw", "cold"])
        ax.set_xlabel("seconds from process start to the first token (median)")
        ax.set_title(f"vitrify bench coldstart: {res['config']['variant']} engine, "
                     f"{res['date'][:10]} {str(res.get('git_sha', ''))[:12]}", fontsize="medium")
        fig.tight_layout()
        fig.savefig(path, dpi=130)
    finally:
        plt.close(fig)
    return path


plot_extra.suffix = "breakdown"  # type: ignore[attr-defined]

__all__ = ["COLD_PARTS", "THAW_PARTS", "add_arguments", "analyse", "config", "plot_extra",
           "problem", "run", "unavailable"]
