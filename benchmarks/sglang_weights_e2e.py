#!/usr/bin/env python3
"""vitrify's weight update into a real SGLang 0.5.17 server thawed by vitrify, end to end:
``python3 -m vitrify.bench.sglang.weights_e2e`` (its --help, and the module's docstring, say
what it runs and checks) from a checkout.

    python3 benchmarks/sglang_weights_e2e.py --bundle .whl/sglang-site.tar.xz --out DIR

When the vitrify this python imports is not this checkout's, this tree is installed first and
the script starts again (``checkout.py`` beside it).
"""

import sys

from checkout import run  # benchmarks/checkout.py: Python puts this script's folder on sys.path

if __name__ == "__main__":
    sys.exit(run("vitrify.bench.sglang.weights_e2e"))
