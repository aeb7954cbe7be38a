#!/usr/bin/env bash
# vitrify's HiCache L3 backend in a real SGLang server on the GPU machine
# (benchmarks/sglang_hicache_e2e.py = python3 -m vitrify.bench.sglang.hicache_e2e); more options
# after the script's name, e.g. --shape 8b.
cd "$(dirname "$0")/.." && exec python3 benchmarks/sglang_hicache_e2e.py --bundle .whl/sglang-site.tar.xz --out "${OUT:-build/sglang-hicache-e2e}" "$@"
