#!/usr/bin/env python3
"""Start a real SGLang server from the offline bundle on a GPU machine, query it, stop it:
``python3 -m vitrify.bench.sglang.serve`` (its --help says more) from a checkout.

    python3 scripts/sglang-bundle/serve.py [--bundle .whl/sglang-site.tar.xz] [--shape tiny|8b]
                                           [--weights checkpoint|dummy] [--out DIR]
                                           [-- EXTRA SERVER ARGS]

Run it from the repository root on the GPU machine (no internet needed; the machine's python must
have torch 2.11). When the vitrify this python imports is not this checkout's, this tree is
installed first and the script starts again (``benchmarks/checkout.py``, which the SGLang
end-to-end scripts use too).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from checkout import run  # noqa: E402  (only the standard library: vitrify may be absent)

    sys.exit(run("vitrify.bench.sglang.serve"))
