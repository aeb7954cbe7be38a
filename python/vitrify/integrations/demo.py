"""The freeze -> thaw demo engine: a toy decoder that decodes greedily with CUDA graphs.

The engine is small on purpose (an embedding, residual RMSNorm + MLP blocks, a tied LM head;
random weights made peaked so argmax has no near-ties) but it goes through every step a real
server's freeze and thaw take:

FREEZE (``python -m vitrify.integrations.demo freeze ARCHIVE``, needs torch and a GPU)
  record kernel binaries (CUPTI) -> reserve the region -> weights into the region (checkpoint
  ``weights``) -> warmup forwards in the region -> capture one decode graph per batch size with
  the graphs' pool in the region (checkpoint ``captured``) -> dump the weights span and the
  warmup gap -> save the graphs -> decode STEPS tokens per batch size by replaying the graphs
  (the reference tokens) -> commit the archive.

THAW (``python -m vitrify.integrations.demo thaw ARCHIVE``, a fresh process; torch is never
imported) open the archive and check its fingerprint against this machine -> reserve the region
at the same base -> map and claim up to the final offset -> restore both spans (CRC-checked) ->
load the
graphs (one executable per topology template) -> decode the same STEPS tokens and compare them
with the reference, token for token.

Each mode prints one JSON line last. :func:`run_demo` runs both in fresh processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ENGINE = "vitrify-demo"
CONFIG = {"vocab": 8192, "hidden": 1024, "ffn": 4096, "layers": 4, "batch_sizes": [1, 2, 4, 8],
          "steps": 32, "region_bytes": 4 << 30, "seed": 1234}
WEIGHTS_SPAN, WARMUP_SPAN = "weights", "warmup"


def _model_id(cfg: dict) -> str:
    return "toy-decoder-" + "-".join(f"{k}{cfg[k]}" for k in ("vocab", "hidden", "ffn", "layers"))


def _fingerprint(cfg: dict):
    import vitrify
    from vitrify import archive as ar

    return ar.Fingerprint.current(engine=ENGINE, engine_version=vitrify.__version__,
                                  model=_model_id(cfg))


def freeze(path: str, cfg: dict = CONFIG) -> dict:
    """Warm up, capture and freeze the demo engine into the archive at ``path``."""
    import vitrify.graphs as tg

    tg.record_modules()  # before torch initialises CUDA, so every kernel binary is recorded
    t_start = time.perf_counter()
    import torch

    from vitrify import Region
    from vitrify import archive as ar
    from vitrify.integrations import torch as tt

    region = Region(cfg["region_bytes"])
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    with tt.region_allocations(region):
        g = torch.Generator(device="cuda").manual_seed(cfg["seed"])
        h, f, v = cfg["hidden"], cfg["ffn"], cfg["vocab"]

        def rand(*shape, scale):
            return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

        emb = rand(v, h, scale=1.0)
        layers = [(rand(h, scale=0.0) + 1.0, rand(h, f, scale=h ** -0.5),
                   rand(f, h, scale=f ** -0.5)) for _ in range(cfg["layers"])]
        ids = {bs: torch.randint(0, v, (bs,), device="cuda", generator=g)
               for bs in cfg["batch_sizes"]}
        starts = {bs: ids[bs].clone() for bs in cfg["batch_sizes"]}
    torch.cuda.synchronize()
    region.checkpoint("weights")
    timings["weights_s"] = time.perf_counter() - t0

    def step(x_ids):
        x = emb.index_select(0, x_ids)
        for norm_w, w_up, w_down in layers:
            y = x.float()
            y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * norm_w
            x = x + torch.nn.functional.gelu(y @ w_up) @ w_down
        logits = x @ emb.t()
        x_ids.copy_(logits.argmax(-1))

    t0 = time.perf_counter()
    with tt.region_allocations(region):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bs in cfg["batch_sizes"]:
                for _ in range(3):
                    step(ids[bs])
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    timings["warmup_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    store = tg.GraphStore(region=region)
    graphs = {}
    with tt.activated(region):
        for bs in cfg["batch_sizes"]:
            with store.capture(f"decode_bs{bs}", pool=tt.pool_id(region)) as cap:
                step(ids[bs])
            graphs[bs] = cap.graph
    torch.cuda.synchronize()
    region.checkpoint("captured")
    timings["capture_s"] = time.perf_counter() - t0

    for bs in cfg["batch_sizes"]:  # the state every decode starts from
        ids[bs].copy_(starts[bs])
    torch.cuda.synchronize()
    final = region.offset
    weights_end = region.checkpoints["weights"]
    fp = _fingerprint(cfg)
    reg = ar.Region(base=region.base, size=region.size, granularity=region.granularity,
                    checkpoints=dict(region.checkpoints))
    t0 = time.perf_counter()
    with ar.ArchiveWriter(path, fp, reg, overwrite=True) as w:
        w.dump_span(0, WEIGHTS_SPAN, region.base, 0, weights_end)
        w.dump_span(0, WARMUP_SPAN, region.base, weights_end, final)
        index = store.save_to_archive(w, rank=0)
        # Reference tokens: replay each graph STEPS times (after the dump, which holds the start).
        tokens = {}
        for bs in cfg["batch_sizes"]:
            seq = []
            for _ in range(cfg["steps"]):
                graphs[bs].replay()
                seq.append(ids[bs].tolist())
            tokens[str(bs)] = seq
        w.write_state(0, {
            "config": cfg,
            "final_offset": final,
            "ids": {str(bs): {"offset": ids[bs].data_ptr() - region.base, "bytes": bs * 8}
                    for bs in cfg["batch_sizes"]},
            "tokens": tokens,
        })
    timings["archive_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    return {"mode": "freeze", "archive": os.path.abspath(path), "base": region.base,
            "final_offset": final, "graphs": len(index["graphs"]),
            "templates": len(index["templates"]), "timings": timings}


def thaw(path: str) -> dict:
    """Thaw the demo engine from ``path`` in this (fresh) process and compare its tokens."""
    t_start = time.perf_counter()
    import vitrify.graphs as tg
    from vitrify import Region
    from vitrify import archive as ar

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    probe = ar.open_archive(path)
    cfg = probe.state(0)["config"]
    archive = ar.open_archive(path, expect=_fingerprint(cfg))
    state = archive.state(0)
    reg = archive.manifest["region"]
    timings["open_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    region = Region(reg["size"], base=reg["base"])
    final = state["final_offset"]
    region.preallocate(final)  # 1 GiB cuMemMaps instead of one per 2 MiB
    # Claim [0, final) as one live allocation: the cursor lands where FREEZE's ended and the
    # chunks stay mapped (set_offset would release chunks it skips that hold no allocation, R4).
    if region.claim(final) != region.base:
        raise RuntimeError("the thawed region did not start at its base")
    for name in (WEIGHTS_SPAN, WARMUP_SPAN):
        archive.restore_span(0, name, region.base, final)
    timings["region_restore_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    graphs = tg.load_from_archive(archive, 0, region_base=region.base)
    graphs.wait_all()
    timings["graphs_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tokens, mismatches = {}, []
    for bs_s, want in state["tokens"].items():
        loc = state["ids"][bs_s]
        seq = []
        for t in range(len(want)):
            graphs.replay(f"decode_bs{bs_s}", stream=0)
            graphs.synchronize()
            raw = region.read(region.base + loc["offset"], loc["bytes"])
            seq.append([int.from_bytes(raw[i:i + 8], "little", signed=True)
                        for i in range(0, len(raw), 8)])
            if seq[-1] != want[t]:
                mismatches.append({"batch_size": int(bs_s), "step": t, "want": want[t],
                                   "got": seq[-1]})
        tokens[bs_s] = seq
    timings["decode_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    n = sum(len(s) * len(s[0]) for s in tokens.values())
    return {"mode": "thaw", "archive": os.path.abspath(path), "base": region.base,
            "tokens_compared": n, "identical": not mismatches, "mismatches": mismatches[:5],
            "graph_stats": graphs.stats(), "timings": timings}


def run_demo(directory: str, out=sys.stdout) -> dict:
    """FREEZE then THAW in two fresh processes; print a summary; return both results."""
    archive = str(Path(directory) / "demo.vitrify")
    results = {}
    for mode in ("freeze", "thaw"):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "vitrify.integrations.demo", mode, archive],
                           capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"demo {mode} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["process_wall_s"] = wall
        results[mode] = r
        print(f"  {mode:6s}: {wall:6.2f} s wall for the whole process "
              f"({', '.join(f'{k} {v:.2f}' for k, v in r['timings'].items())})", file=out)
    th = results["thaw"]
    print(f"  tokens : {th['tokens_compared']} greedy tokens over "
          f"{results['freeze']['graphs']} graphs ({results['freeze']['templates']} templates): "
          f"{'identical to FREEZE' if th['identical'] else 'DIFFERENT: ' + str(th['mismatches'])}",
          file=out)
    if not th["identical"]:
        raise RuntimeError("thawed engine produced different tokens than the frozen one")
    return results


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("freeze", "thaw"):
        print("usage: python -m vitrify.integrations.demo freeze|thaw ARCHIVE", file=sys.stderr)
        return 2
    r = freeze(args[1]) if args[0] == "freeze" else thaw(args[1])
    print(json.dumps(r))
    return 0 if r.get("identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
