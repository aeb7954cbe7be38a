#!/usr/bin/env python3
"""The direct weight update's kernel (``vitrify.weights.kernels.PieceTable``) at the 8B shape's
size, by tile and warps, against torch's own copy and read of the same bytes (GPU).

A direct update copies and sums every piece (the trainer: one read, one write) and the engine
sums them again (one read). This times both passes over 16 GiB cut into 1,083 pieces of the
sizes an 8B update has (the engine's parameter rows), for each (tile, warps), with the torch
baselines measured in the same run; every variant's sums are checked equal (the tile and warps
change the speed only). Writes ``weights-kernel-probe-<date>.json``.

    python benchmarks/weights_kernel_probe.py --out DIR [--gib 16]
"""

from __future__ import annotations

import argparse
import os
import sys


VARIANTS = [(t, w) for t in (1024, 2048, 4096, 8192) for w in (4, 8, 16)]


def pieces_of(total: int, n: int, base_src: int, base_dst: int) -> list[tuple[int, int, int]]:
    """``n`` pieces covering ``total`` bytes (sizes varying 1:8 like an update's rows), each on
    a 256-byte boundary."""
    weights = [1 + (i * 7919) % 8 for i in range(n)]
    unit = total // sum(weights) // 256 * 256
    out, at = [], 0
    for w in weights:
        out.append((base_src + at, base_dst + at, w * unit))
        at += w * unit
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "build/weights-kernel-probe")
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--pieces", type=int, default=1083)
    a = ap.parse_args(argv)
    import torch

    from vitrify.bench import resultlib
    from vitrify.bench.weights import best_seconds
    from vitrify.weights import kernels

    def best_of(fn):
        return best_seconds(fn, reps=5)

    nbytes = a.gib << 30
    src = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    ps = pieces_of(nbytes, a.pieces, src.data_ptr(), dst.data_ptr())
    moved = sum(p[2] for p in ps)
    rows = [{"case": "torch copy", "seconds": best_of(lambda: dst.copy_(src))},
            {"case": "torch read (int32 sum)", "seconds": best_of(lambda: src.sum())}]
    want = None
    for tile, warps in VARIANTS:
        for copy in (True, False):
            t = kernels.PieceTable(ps, src.device, copy=copy, tile=tile, warps=warps)
            sums = t.sums()
            if want is None:
                want = sums
            if sums != want:
                raise RuntimeError(f"tile {tile}, warps {warps}: the sums differ")
            rows.append({"case": f"{'copy+sum' if copy else 'sum'} tile={tile} warps={warps}",
                         "tile": tile, "warps": warps, "copy": copy,
                         "seconds": best_of(t.sums)})
    for r in rows:
        r["GB/s"] = moved / r["seconds"] / 1e9
    best = {c: min((r for r in rows if r.get("copy") is c), key=lambda r: r["seconds"])
            for c in (True, False)}
    ratios = {"best_copy_sum_over_torch_copy": rows[0]["seconds"] / best[True]["seconds"],
              "best_sum_over_torch_read": rows[1]["seconds"] / best[False]["seconds"],
              "default_copy_sum_over_torch_copy": rows[0]["seconds"] / next(
                  r["seconds"] for r in rows if r.get("copy") is True
                  and (r["tile"], r["warps"]) == (kernels.PIECE_TILE, kernels.PIECE_WARPS))}
    resultlib.print_table(rows, ["case", "seconds", "GB/s"])
    print(ratios)
    path = resultlib.write(resultlib.result(
        "weights-kernel-probe", rows=rows, ratios=ratios, bytes=moved, pieces=len(ps),
        best_copy={k: best[True][k] for k in ("tile", "warps")},
        best_sum={k: best[False][k] for k in ("tile", "warps")}), a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
