#!/usr/bin/env python3
"""SGLang FREEZE/THAW through vitrify's plugin in a real SGLang 0.5.17 server, end to end:
``python3 -m vitrify.bench.sglang.freeze_e2e`` (its --help, and the module's docstring, say what
it runs and checks) from a checkout.

    python3 benchmarks/sglang_freeze_e2e.py --bundle .whl/sglang-site.tar.xz --shape tiny|8b
    python3 benchmarks/sglang_freeze_e2e.py --deterministic ...  # thawed vs plain, bit for bit
    python3 benchmarks/sglang_freeze_e2e.py --dry-run        # the server command lines only

When the vitrify this python imports is not this checkout's, this tree is installed first and
the script starts again (``checkout.py`` beside it).
"""

import sys

from checkout import run  # benchmarks/checkout.py: Python puts this script's folder on sys.path

if __name__ == "__main__":
    sys.exit(run("vitrify.bench.sglang.freeze_e2e"))
