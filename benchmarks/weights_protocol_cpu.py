#!/usr/bin/env python3
"""The direct weight update's cost outside the GPU kernels, on any machine (CPU only).

An engine process (a memfd-backed engine of the Qwen3-8B shape's tensor *count* and piece
count: 36 layers, 32 heads, 8 KV heads; small tensors) and this process as the trainer run
``--updates`` direct updates, with the checksum tables' ``sums`` replaced by zeros on both sides
(so the bytes are not checked and nothing but the protocol, the planning and the Python around
the kernels is timed). The first update plans and builds the tables; the later ones are a
trainer's next steps (every version tag moved), which reuse them (W17 in docs/weights.md).

    python benchmarks/weights_protocol_cpu.py [--updates 8]

Prints each update's wall time and the trainer's steps; nothing is written.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

PATH = "/tmp/vitrify-weights-protocol.sock"


def _setup():
    import torch

    from vitrify.integrations.transformers import EngineConfig, megatron_tensors, param_specs
    from vitrify.integrations.transformers import update_mapping
    from vitrify.weights import direct, kernels
    from vitrify.weights import transport as wt

    cfg = EngineConfig(vocab=1024, hidden=256, ffn=512, layers=36, heads=32, kv_heads=8,
                       batch_sizes=(1,))
    like = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, s, d in param_specs(cfg)}
    engine = wt.HostWeights(like)
    direct.FORCE_KERNELS = True  # every aligned piece takes the table path ...
    kernels.PieceTable.sums = lambda self, **_: [0] * self.n  # ... whose sums are stubbed
    src = {n: t.contiguous() for n, t in megatron_tensors(engine.tensors, cfg).items()}
    return engine, update_mapping(cfg), src


def engine(updates: int) -> int:
    from vitrify.weights import transport as wt

    weights, mapping, _ = _setup()
    rx = wt.Receiver(weights.tensors, mapping, exporter=weights.export)
    with wt.listen(PATH) as srv:
        print("listening", flush=True)
        for _ in range(updates):
            conn, _ = srv.accept()
            with conn:
                rx.serve_one(conn)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.updates < 2:
        ap.error("--updates must be >= 2 (the first plans)")
    if a.engine:
        return engine(a.updates)
    from vitrify.weights import transport as wt

    _, _, src = _setup()
    eng = subprocess.Popen([sys.executable, __file__, "--engine", "--updates", str(a.updates)],
                           stdout=subprocess.PIPE, text=True)
    try:
        if eng.stdout.readline().strip() != "listening":
            raise RuntimeError("the engine process did not start")
        tx = wt.Sender(direct=True)
        for i in range(a.updates):
            t0 = time.perf_counter()
            fin = tx.update(PATH, src, versions={n: i for n in src}, connect_timeout=10)
            ms = 1e3 * (time.perf_counter() - t0)
            steps = " ".join(f"{k[:-2]} {1e3 * v:.2f}" for k, v in fin["trainer_times"].items())
            print(f"update {i}: {ms:7.2f} ms, {fin['pieces']} pieces, reused "
                  f"{fin['trainer_reused_plan']}; trainer ms: {steps}; engine verify "
                  f"{1e3 * fin['verify_seconds']:.2f} ms")
        tx.close()
    finally:
        eng.wait(timeout=60)
    return eng.returncode


if __name__ == "__main__":
    sys.exit(main())
