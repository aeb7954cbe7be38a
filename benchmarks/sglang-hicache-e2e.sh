#!/usr/bin/env bash
# vitrify's HiCache L3 backend in a real SGLang server on the GPU machine (benchmarks/sglang_hicache_e2e.py).
cd "$(dirname "$0")/.." && exec python3 benchmarks/sglang_hicache_e2e.py --bundle .whl/sglang-site.tar.xz --out "${OUT:-build/sglang-hicache-e2e}" "$@"
