"""CUDA graph persistence benchmark (GPU): capture vs rebuild.

FREEZE (this process): record kernel binaries, capture one decode-like MLP graph per batch size
(cuBLAS GEMMs + elementwise) into a vitrify Region, walk each into a GraphStore, save.
THAW (a fresh subprocess, no torch): restore the region's allocations, load + rebuild every graph with
topology templates and, as the baseline, with one executable per graph; replay all graphs
round-robin (parameter switches) and compare outputs with FREEZE's byte for byte.

Rows: graphs rebuilt per second (templates vs none), bytes per graph on disk, capture time vs
rebuild time per graph, replay cost per launch (vitrify with switches vs torch's own replay).

    vitrify bench graphs [--out DIR] [--quick] [--graphs N] [--dir WORKDIR]

Needs a CUDA GPU and torch (FREEZE side). THAW runs as ``python -m vitrify.bench.graphs --thaw
WORKDIR`` and prints its measurements as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vitrify._units import GiB

from . import resultlib
from .cli import existing_dir, positive_int

BASE = 0x7E0080000000  # 2 GiB into a 4 GiB window, like the default bases
ARENA = 2 * GiB  # every torch.cuda.graph() entry empties the cache; the region never reuses
HIDDEN = 512
LAYERS = 4


def freeze(work: Path, n_graphs: int) -> dict:
    import vitrify.graph as tg

    tg.record_modules()
    import torch

    from ..integrations import torch as vt
    from ..region import Region, save_allocations

    region = Region(ARENA, base=BASE)
    pool = vt.mem_pool(region)
    store = tg.GraphStore(region=region)
    with vt.region_allocations(region):
        torch.manual_seed(0)
        ws = [torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.half) * 0.05
              for _ in range(LAYERS)]
        bs_ = [torch.randn(HIDDEN, device="cuda", dtype=torch.half) for _ in range(LAYERS)]
        batch_sizes = list(range(1, n_graphs + 1))
        xs = {bs: torch.randn(bs, HIDDEN, device="cuda", dtype=torch.half) for bs in batch_sizes}
    torch.cuda.synchronize()

    def step(x):
        for w, b in zip(ws, bs_):
            x = torch.nn.functional.gelu(x @ w + b)
        return x

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), vt.region_allocations(region):
        for bs in batch_sizes:
            step(xs[bs])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    capture_s = instantiate_s = walk_s = 0.0
    graphs, outs = {}, {}
    for bs in batch_sizes:
        g = torch.cuda.CUDAGraph(keep_graph=True)
        t0 = time.perf_counter()
        with vt.graph_capture(region, g):
            outs[bs] = step(xs[bs])
        t1 = time.perf_counter()
        g.instantiate()
        t2 = time.perf_counter()
        store.add_cuda_graph(f"bs{bs}", g.raw_cuda_graph())
        t3 = time.perf_counter()
        capture_s += t1 - t0
        instantiate_s += t2 - t1
        walk_s += t3 - t2
        graphs[bs] = g
    torch.cuda.synchronize()
    image_bytes = save_allocations(region, work)  # weights, inputs, the graphs' pool; before replay
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    # torch's own replay, round-robin over all graphs: the baseline for THAW's switching replay.
    rounds = 5
    t0 = time.perf_counter()
    for _ in range(rounds):
        for g in graphs.values():
            g.replay()
    torch.cuda.synchronize()
    torch_replay_s = (time.perf_counter() - t0) / (rounds * len(graphs))
    expected = {f"bs{bs}": {"offset": o.data_ptr() - region.base, "nbytes": o.numel() * o.element_size()}
                for bs, o in outs.items()}
    (work / "expected").mkdir(parents=True, exist_ok=True)
    for name, e in expected.items():
        (work / "expected" / f"{name}.bin").write_bytes(region.read(region.base + e["offset"],
                                                                    e["nbytes"]))

    t0 = time.perf_counter()
    index = store.save(work / "rank0")
    save_s = time.perf_counter() - t0
    sizes = [g["bytes"] for g in index["graphs"]]
    meta = {"graphs": len(graphs), "capture_s": capture_s, "instantiate_s": instantiate_s,
            "walk_s": walk_s, "save_s": save_s, "torch_replay_s": torch_replay_s,
            "graph_bytes": sizes, "templates": len(index["templates"]),
            "module_bytes": sum(m["bytes"] for m in index["modules"].values()),
            "modules": len(index["modules"]), "nodes": index["graphs"][-1]["nodes"],
            "expected": expected, "size": region.size,
            "image_bytes": image_bytes, "region_cursor": region.offset}
    (work / "meta.json").write_text(json.dumps(meta))
    return meta


def thaw(work: Path) -> dict:
    import vitrify.graph as tg

    from ..region import Region, load_allocations

    meta = json.loads((work / "meta.json").read_text())
    region = Region(meta["size"], base=BASE)
    load_allocations(region, work)
    out = {}
    for label, share in (("none", False), ("templates", True)):
        t0 = time.perf_counter()
        graphs = tg.load(work / "rank0", share_templates=share, threads=4)
        graphs.wait_all()
        out[f"rebuild_s_{label}"] = time.perf_counter() - t0
        out[f"stats_{label}"] = graphs.stats()
        graphs.close()
    graphs = tg.load(work / "rank0", threads=4)
    graphs.wait_all()
    names = graphs.names
    for n in names:  # first launch of each (applies parameters), then check outputs
        graphs.replay(n, stream=0)
        graphs.synchronize()
        e = meta["expected"][n]
        if region.read(region.base + e["offset"], e["nbytes"]) != \
                (work / "expected" / f"{n}.bin").read_bytes():
            out.setdefault("mismatch", []).append(n)
    rounds = 5
    t0 = time.perf_counter()
    for _ in range(rounds):
        for n in names:
            graphs.replay(n, stream=0)
    graphs.synchronize()
    out["replay_s"] = (time.perf_counter() - t0) / (rounds * len(names))
    out["stats_replay"] = graphs.stats()
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="fewer graphs (64)")
    ap.add_argument("--graphs", type=positive_int, default=None, help="graphs to capture (default 256, the size of the best published comparison)")
    ap.add_argument("--dir", type=existing_dir, default=None,
                    help="where FREEZE saves and THAW loads (default: the system temp directory)")


def unavailable(args: argparse.Namespace) -> str | None:
    return resultlib.needs_gpu("torch")  # torch captures the graphs


def problem(res: dict) -> str | None:
    mismatch = res.get("thaw", {}).get("mismatch")
    return f"MISMATCH: {mismatch}" if mismatch else None


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    n = args.graphs or (64 if args.quick else 256)
    with tempfile.TemporaryDirectory(prefix="vitrify-bench-graphs-", dir=args.dir) as tmp:
        work = Path(tmp)
        progress(f"FREEZE: capture {n} graphs, walk and save them")
        fz = freeze(work, n)
        progress("THAW in a fresh process: rebuild (templates vs none), replay, compare")
        p = subprocess.run([sys.executable, "-m", __name__, "--thaw", str(work)],
                           capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            print(p.stdout[-3000:], p.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"THAW subprocess failed (rc {p.returncode})")
        th = json.loads(p.stdout.strip().splitlines()[-1])
    g = fz["graphs"]
    per_graph_capture = (fz["capture_s"] + fz["instantiate_s"]) / g
    rows = [
        {"metric": "graphs", "value": g, "unit": "count"},
        {"metric": "nodes per graph (largest)", "value": fz["nodes"], "unit": "count"},
        {"metric": "templates", "value": th["stats_templates"]["templates"], "unit": "count"},
        {"metric": "bytes per graph (mean)", "value": sum(fz["graph_bytes"]) / g, "unit": "B"},
        {"metric": "kernel binaries saved", "value": fz["module_bytes"], "unit": "B"},
        {"metric": "torch capture+instantiate per graph", "value": per_graph_capture * 1e3, "unit": "ms"},
        {"metric": "walk+serialize per graph (FREEZE)", "value": fz["walk_s"] / g * 1e3, "unit": "ms"},
        {"metric": "rebuild per graph, templates", "value": th["rebuild_s_templates"] / g * 1e3, "unit": "ms"},
        {"metric": "rebuild per graph, no templates", "value": th["rebuild_s_none"] / g * 1e3, "unit": "ms"},
        {"metric": "graphs rebuilt/s, templates", "value": g / th["rebuild_s_templates"], "unit": "1/s"},
        {"metric": "graphs rebuilt/s, no templates", "value": g / th["rebuild_s_none"], "unit": "1/s"},
        {"metric": "replay round-robin (vitrify, switching)", "value": th["replay_s"] * 1e6, "unit": "us"},
        {"metric": "replay round-robin (torch)", "value": fz["torch_replay_s"] * 1e6, "unit": "us"},
        {"metric": "outputs equal to FREEZE", "value": g - len(th.get("mismatch", [])), "unit": "graphs"},
    ]
    ratios = {
        "rebuild_speedup_templates_vs_none": th["rebuild_s_none"] / th["rebuild_s_templates"],
        "capture_time_over_rebuild_time": (fz["capture_s"] + fz["instantiate_s"]) / th["rebuild_s_templates"],
        "replay_vitrify_over_torch": th["replay_s"] / fz["torch_replay_s"],
        "graphs_rebuilt_per_s_templates": g / th["rebuild_s_templates"],
    }
    goals = {"graphs_rebuilt_per_s_templates": 1000.0, "capture_time_over_rebuild_time": 1.0,
             "rebuild_speedup_templates_vs_none": 1.0}
    resultlib.print_table(rows, ["metric", "value", "unit"])
    res = resultlib.result("graphs", rows=rows, ratios=ratios, goals=goals,
                           freeze=fz | {"expected": None}, thaw=th)
    return res


def _thaw_main() -> int:
    ap = argparse.ArgumentParser(description="THAW side of `vitrify bench graphs` (internal)")
    ap.add_argument("--thaw", required=True, help="FREEZE's work directory")
    args = ap.parse_args()
    print(json.dumps(thaw(Path(args.thaw))))
    return 0


if __name__ == "__main__":
    sys.exit(_thaw_main())
