"""Weight update throughput on one GPU, two processes (GPU): a trainer process writes a model's
weights (Megatron-style layout) into an engine process's tensors (in a vitrify region created
exportable) directly, and streams them through vitrify's staging buffer, against baselines
measured in the same run:

- one device-to-device copy of the same bytes in one process (the HBM limit), and two copies
  (the limit of any design that stages: every byte crosses memory twice), and two copies plus
  two reads (a staged update verified on both sides: its ceiling on this GPU);
- the legacy per-tensor CUDA IPC path: the trainer exports every tensor with CUDA IPC handles
  (torch.multiprocessing's reductions), the engine opens each handle and copies, per update;
- a delta update where 1 % of the tensors changed (bytes moved over the model's);
- the direct update's own limit with both sides verifying: one copy plus one read of the bytes
  (the trainer sums what it writes in the copy's pass; the engine reads everything once).

Every vitrify update is run once before it is timed (Triton compiles its kernels on the first).

SGLang's own update-from-tensor path needs a running server (the SGLang plugin): not measured
here, said in the result.

    vitrify bench weights [--shape 1b|8b] [--chunk-mib 256] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import subprocess
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import resultlib
from .cli import positive_int

DIRECT_REPEATS = 5  # timed full direct updates (steady state)
SHAPES = {  # EngineConfig overrides: a 1.1 B Llama (the engine's default) and Qwen3-8B's shape
    "1b": {},
    "8b": {"vocab": 151936, "hidden": 4096, "ffn": 12288, "layers": 36, "heads": 32,
           "kv_heads": 8},
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                    help="model shape: 8b (Qwen3-8B's, 16 GB of bf16; default) or 1b")
    ap.add_argument("--chunk-mib", type=positive_int, default=256,
                    help="staging buffer, MiB (the bound on the update's extra memory)")
    ap.add_argument("--quick", action="store_true", help="the 1b shape and one repetition")


def unavailable(args: argparse.Namespace) -> str | None:
    return resultlib.needs_gpu("torch")


def _config(shape: str):
    from ..integrations.transformers import EngineConfig

    return EngineConfig(**SHAPES[shape], batch_sizes=(1,))


# ---- the engine process -------------------------------------------------------------------------


def _engine(path: str, shape: str) -> int:
    """``python -m vitrify.bench.weights _engine SOCKET SHAPE``: the engine's weights (zeros,
    bf16, on the GPU), serving vitrify updates and per-tensor IPC updates until told to stop."""
    import torch

    from ..integrations.transformers import param_specs, update_mapping
    from ..weights import mapping as wm
    from ..weights import transport as wt

    from ..region import Region

    cfg = _config(shape)
    specs = list(param_specs(cfg))
    sizes = [math.prod(s) * getattr(torch, d).itemsize for _, s, d in specs]
    # the engine's weights in an exportable region, as a thawed engine's are (exportable=True)
    region = Region(sum(-(-n // (2 << 20)) * (2 << 20) for n in sizes) + (1 << 30),
                    exportable=True)
    region.preallocate(region.size)
    engine = {}
    for (n, s, d), nbytes in zip(specs, sizes):
        engine[n] = wt._device_tensor(region.allocate(nbytes), nbytes, 0).view(
            getattr(torch, d)).view(s)
        engine[n].zero_()
    mapping = update_mapping(cfg)
    rx = wt.Receiver(engine, mapping, synchronize=torch.cuda.synchronize,
                     exporter=wt.region_exporter(region))
    with wt.listen(path) as srv:
        print(json.dumps({"listening": path}), flush=True)
        while True:
            conn, _ = srv.accept()
            with conn:
                msg, _ = wt._recv(conn)
                if msg["type"] == "stop":
                    return 0
                if msg["type"] == "vitrify":
                    wt._send(conn, {"type": "go"})
                    summary = rx.serve_one(conn)
                    print(json.dumps({"vitrify": summary}), flush=True)
                elif msg["type"] == "ipc":  # the legacy path: one CUDA IPC handle per tensor
                    t0 = time.perf_counter()
                    handles = pickle.loads(bytes.fromhex(msg["tensors"]))
                    src = {n: fn(*args) for n, (fn, args) in handles.items()}
                    plan = mapping.plan({n: (tuple(t.shape), str(t.dtype)[6:])
                                         for n, t in src.items()},
                                        {n: (tuple(t.shape), str(t.dtype)[6:])
                                         for n, t in engine.items()})
                    for n, t in src.items():
                        for c in plan.for_source(n):
                            wm.copy(c, t, engine[c.dst])
                    torch.cuda.synchronize()
                    del src
                    seconds = time.perf_counter() - t0
                    wt._send(conn, {"type": "done", "seconds": seconds})
                    print(json.dumps({"ipc": seconds}), flush=True)


# ---- the trainer (this process) -----------------------------------------------------------------


def _call(path: str, msg: dict, then: Callable[[Any], Any] | None = None) -> Any:
    import socket

    from ..weights import transport as wt

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(600)
        wt._connect(s, path, 120.0)
        wt._send(s, msg)
        return then(s) if then else None


def _update(sock: Any, tx: Any, src: dict, versions: dict | None = None) -> dict:
    import torch

    from ..weights import transport as wt

    wt._expect(sock, "go")
    return tx.update_over(sock, src, synchronize=torch.cuda.synchronize, versions=versions)


def _timed(path: str, tx: Any, src: dict, versions: dict | None = None) -> tuple[dict, float]:
    """One vitrify update and the trainer's wall time of it (connect to finished)."""
    t0 = time.perf_counter()
    fin = _call(path, {"type": "vitrify"}, lambda s: _update(s, tx, src, versions))
    return fin, time.perf_counter() - t0


def _digests_seconds(src: dict) -> float:
    """Seconds to compute the content digest (keyed sums) of every tensor: what a delta update
    without the trainer's version tags reads before anything moves."""
    import torch

    from ..weights import transport as wt

    key = (12345, 67891)
    wt.digest(next(iter(src.values())), key)  # compiled
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in src.values():
        wt.digest(t, key)
    return time.perf_counter() - t0


def _d2d(src: dict, copies: int) -> float:
    """Seconds to copy every tensor's bytes into one scratch buffer, ``copies`` times over."""
    import torch

    total = sum(t.numel() * t.element_size() for t in src.values())
    scratch = torch.empty(total, dtype=torch.uint8, device="cuda")
    flat = [t.view(-1).view(torch.uint8) for t in src.values()]
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(copies):
            at = 0
            for f in flat:
                scratch[at:at + f.numel()].copy_(f)
                at += f.numel()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del scratch
    return best


def best_seconds(fn: Callable[[], Any], reps: int = 3) -> float:
    """The best of ``reps`` timings of ``fn`` on the GPU (run once before: compiles, warms)."""
    import torch

    fn()
    out = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out = min(out, time.perf_counter() - t0)
    return out


def _sums(nbytes: int) -> dict[str, float]:
    """Seconds (best of 3) of the chunk checksum over ``nbytes`` of device memory: the one-pass
    Triton kernel, the torch reference, and a plain read of the same bytes (the HBM floor)."""
    import torch

    from ..weights import kernels, stream

    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")

    from .. import config

    with config.override(weights_triton=False):  # the torch reference
        ref = best_seconds(lambda: stream.checksum(buf))
        want = stream.checksum(buf)
    one = best_seconds(lambda: kernels.checksum(buf))
    if kernels.checksum(buf) != want:
        raise RuntimeError("the Triton checksum differs from the torch reference on the GPU")
    read = best_seconds(lambda: buf.view(torch.int32).sum())
    return {"triton": one, "torch": ref, "read": read}


def _changed(names: list[str]) -> list[str]:
    """1 % of the tensors (at least one), spread evenly over the transformer layers' tensors:
    what a partial update touches. The embedding and output matrices (7.6 % of an 8 B model's
    bytes each) are left out, so the bytes measure the mechanism, not which tensor was drawn."""
    layers = [n for n in names if ".layers." in n] or names
    k = max(1, round(len(names) / 100))
    step = max(1, len(layers) // k)
    return layers[step // 2::step][:k]


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    from ..integrations.transformers import fill_weights, megatron_tensors, param_specs
    from ..weights import transport as wt

    shape = "1b" if args.quick else args.shape
    cfg = _config(shape)
    chunk = args.chunk_mib << 20
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="vitrify-bench-weights-") as d:
        path = os.path.join(d, "engine.sock")
        eng = subprocess.Popen([sys.executable, "-m", "vitrify.bench.weights", "_engine", path,
                                shape], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        try:
            line = eng.stdout.readline()
            if not line:
                raise RuntimeError(f"the engine process failed: {eng.stderr.read()[-3000:]}")
            progress(f"trainer: {shape} weights in the Megatron layout")
            weights = {n: torch.empty(s, dtype=getattr(torch, dt), device="cuda")
                       for n, s, dt in param_specs(cfg)}
            fill_weights(weights, cfg)
            src = megatron_tensors(weights, cfg)
            del weights
            total = sum(t.numel() * t.element_size() for t in src.values())
            progress(f"direct update, {total / 1e9:.1f} GB written in place (first: compiles)")
            tags = {n: 0 for n in src}
            txd = wt.Sender(direct=True, device=0)
            try:
                first, first_s = _timed(path, txd, src, tags)
                # a trainer's steps: every tensor new each time (full updates), the sender's
                # plan and tables reused after the first; the best and the median are reported
                steps = []
                for k in range(1, 1 + (1 if args.quick else DIRECT_REPEATS)):
                    tags = {n: k for n in src}
                    steps.append(_timed(path, txd, src, tags))
                direct, direct_s = min(steps, key=lambda fs: fs[1])
                direct_median_s = statistics.median(s for _, s in steps)
                progress("direct delta update: 1 % of the tensors changed")
                changed = _changed(list(src))
                changed_bytes = sum(src[n].numel() * src[n].element_size() for n in changed)
                for n in changed:
                    src[n].add_(1)
                    tags[n] = len(steps) + 1
                ddelta, ddelta_s = _timed(path, txd, src, tags)
            finally:
                txd.close()
            progress(f"staged update, {total / 1e9:.1f} GB through {args.chunk_mib} MiB")
            tx = wt.Sender(chunk, device=0)
            try:
                _timed(path, tx, src)  # compiles
            finally:
                tx.close()
            tx = wt.Sender(chunk, device=0)  # a new key: every tensor again
            try:
                full, full_s = _timed(path, tx, src)
                progress("staged delta update: 1 % of the tensors changed")
                for n in changed:
                    src[n].add_(1)
                delta, delta_s = _timed(path, tx, src)
            finally:
                tx.close()
            progress("content digests of every tensor")
            digests_s = _digests_seconds(src)
            progress("per-tensor CUDA IPC (the legacy path)")
            t0 = time.perf_counter()
            handles = {n: reduce_tensor(t) for n, t in src.items()}
            ipc = _call(path, {"type": "ipc", "tensors": pickle.dumps(handles).hex()},
                        lambda s: wt._expect(s, "done")[0])
            ipc_s = time.perf_counter() - t0
            progress("device-to-device copies of the same bytes; the chunk checksum's cost")
            d2d_s, d2d2_s = _d2d(src, 1), _d2d(src, 2)
            sums = _sums(chunk)
            _call(path, {"type": "stop"})
            eng.wait(timeout=60)
        finally:
            if eng.poll() is None:
                eng.kill()
            eng.communicate()
    gbs = lambda s: total / s / 1e9  # noqa: E731
    # HBM traffic in units of the bytes: one copy reads and writes them (2 units); the engine's
    # verification reads them (1 unit), at the copy's measured rate per unit
    read_s = d2d_s / 2
    direct_limit = d2d_s + read_s  # the trainer's copy (summed in its pass) + the engine's read
    staged_limit = d2d2_s + 2 * read_s
    rows += [
        {"case": "direct update (trainer's wall time, best)", "seconds": direct_s,
         "GB/s": gbs(direct_s)},
        {"case": f"direct update (trainer's wall time, median of {len(steps)})",
         "seconds": direct_median_s, "GB/s": gbs(direct_median_s)},
        {"case": "direct: the trainer's copy and sums", "seconds":
         direct["trainer_write_seconds"], "GB/s": gbs(direct["trainer_write_seconds"])},
        {"case": "direct: the engine's verification", "seconds": direct["verify_seconds"],
         "GB/s": gbs(direct["verify_seconds"])},
        *({"case": f"direct: the trainer's {k[:-2]} step", "seconds": v,
           "GB/s": gbs(v) if v > 0 else None}
          for k, v in direct.get("trainer_times", {}).items()),
        {"case": "direct: the engine's export", "seconds": direct.get("export_seconds", 0.0),
         "GB/s": None},
        {"case": "direct update, first (Triton compiles; the plan and tables are built)",
         "seconds": first_s,
         "GB/s": gbs(first_s)},
        {"case": "direct delta update, 1 % of tensors", "seconds": ddelta_s,
         "GB/s": ddelta["bytes_moved"] / ddelta_s / 1e9},
        {"case": "staged update (trainer's wall time)", "seconds": full_s, "GB/s": gbs(full_s)},
        {"case": "staged update (engine's copy loop)", "seconds": full["seconds"],
         "GB/s": gbs(full["seconds"])},
        {"case": "staged delta update, 1 % of tensors", "seconds": delta_s,
         "GB/s": delta["bytes_moved"] / delta_s / 1e9},
        {"case": "content digests of every tensor", "seconds": digests_s,
         "GB/s": gbs(digests_s)},
        {"case": "per-tensor CUDA IPC", "seconds": ipc_s, "GB/s": gbs(ipc_s)},
        {"case": "one D2D copy (HBM limit)", "seconds": d2d_s, "GB/s": gbs(d2d_s)},
        {"case": "direct and verified limit (1 copy + 1 read)", "seconds": direct_limit,
         "GB/s": gbs(direct_limit)},
        {"case": "two D2D copies (staged limit)", "seconds": d2d2_s, "GB/s": gbs(d2d2_s)},
        # a verified staged update moves every byte twice and checksums it on both sides: two
        # copies plus two reads of the bytes (computed from the rows measured here)
        {"case": "staged and verified limit (2 copies + 2 reads)", "seconds": staged_limit,
         "GB/s": gbs(staged_limit)},
        {"case": "chunk checksum, one pass (Triton)", "seconds": sums["triton"],
         "GB/s": chunk / sums["triton"] / 1e9},
        {"case": "chunk checksum, torch reference", "seconds": sums["torch"],
         "GB/s": chunk / sums["torch"] / 1e9},
        {"case": "chunk read (torch int32 sum)", "seconds": sums["read"],
         "GB/s": chunk / sums["read"] / 1e9},
    ]
    ratios = {"update_throughput_over_d2d": d2d_s / direct_s,
              "update_throughput_over_d2d_median": d2d_s / direct_median_s,
              "update_throughput_over_direct_verified_limit": direct_limit / direct_s,
              "direct_verified_limit_over_d2d": d2d_s / direct_limit,
              "direct_write_over_d2d": d2d_s / direct["trainer_write_seconds"],
              "staged_update_throughput_over_d2d": d2d_s / full_s,
              "staged_update_throughput_over_staged_verified_limit": staged_limit / full_s,
              "update_throughput_over_ipc": ipc_s / direct_s,
              "delta_bytes_fraction": ddelta["bytes_moved"] / ddelta["bytes_total"],
              "staged_delta_bytes_fraction": delta["bytes_moved"] / delta["bytes_total"],
              "checksum_triton_over_torch": sums["torch"] / sums["triton"],
              "checksum_over_read": sums["read"] / sums["triton"]}
    for name, fin in (("direct", ddelta), ("staged", delta)):
        if fin["bytes_moved"] != changed_bytes:
            raise RuntimeError(f"the {name} delta update moved {fin['bytes_moved']} bytes, the "
                               f"changed tensors hold {changed_bytes}")
    resultlib.print_table(rows, ["case", "seconds", "GB/s"])
    for k, v in ratios.items():
        print(f"{k:40s} {v:8.3f}")
    return resultlib.result(
        "weights", rows=rows, ratios=ratios,
        goals={"update_throughput_over_d2d": 0.8, "delta_bytes_fraction": 0.02},
        goal_direction={"delta_bytes_fraction": "<="}, shape=shape, config=cfg.to_dict(),
        bytes=total, chunk_bytes=chunk, direct=direct, direct_first=first, direct_delta=ddelta,
        direct_steps=[{"seconds": sec, "trainer_times": f.get("trainer_times"),
                       "verify_seconds": f.get("verify_seconds"),
                       "trainer_reused_plan": f.get("trainer_reused_plan")} for f, sec in steps],
        full=full, delta=delta, ipc_engine_seconds=ipc["seconds"],
        changed_tensors=len(changed), changed_names=changed, changed_bytes=changed_bytes,
        tensors=len(src),
        not_measured={"sglang_update_from_tensor": "needs an SGLang server with vitrify's "
                                                   "plugin (issue 16)"},
        note="the direct update writes each byte once and the engine reads it once to verify: "
             "its limit is one copy plus one read (about 2/3 of one copy's throughput); a "
             "staged update moves every byte twice (into the staging buffer, out of it) and "
             "both sides read it: its limit is two copies plus two reads")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_engine":
        sys.exit(_engine(sys.argv[2], sys.argv[3]))
    print("usage: vitrify bench weights (the _engine mode is internal)", file=sys.stderr)
    sys.exit(2)
