#!/usr/bin/env python3
"""Start a real SGLang server from the offline bundle on a GPU machine, query it, stop it:
``python3 -m vitrify.bench.sglang.serve`` (its --help says more) from a checkout.

    python3 scripts/sglang-bundle/serve.py [--bundle .whl/sglang-site.tar.xz] [--shape tiny|8b]
                                           [--weights checkpoint|dummy] [--out DIR]
                                           [-- EXTRA SERVER ARGS]

Run it from the repository root on the GPU machine (no internet needed; the machine's python must
have torch 2.11). When the vitrify this python imports is not this checkout's, this tree is
installed first (pip, no index, no dependencies) and the script starts again.
"""

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _this_tree_is_installed() -> bool:
    """Whether ``import vitrify`` finds this checkout's .py files (an editable install, or a
    regular one of the same sources), without importing it."""
    spec = importlib.util.find_spec("vitrify")
    if spec is None or not spec.submodule_search_locations:
        return False
    where = [Path(p) for p in spec.submodule_search_locations]
    src = REPO / "python" / "vitrify"
    for f in src.rglob("*.py"):
        rel = f.relative_to(src)
        want = hashlib.sha256(f.read_bytes()).digest()
        if not any((w / rel).is_file() and hashlib.sha256((w / rel).read_bytes()).digest() == want
                   for w in where):
            return False
    return True


def _ensure_installed() -> None:
    """Install this tree (pip, no index, no dependencies) when the vitrify this python imports
    is another, then start again."""
    if _this_tree_is_installed():
        return
    if os.environ.get("VITRIFY_E2E_INSTALLED") == "1":
        sys.exit(f"{Path(__file__).name}: vitrify was installed from {REPO} but {sys.executable} "
                 f"still imports another copy; check PYTHONPATH")
    print(f"{Path(__file__).name}: installing vitrify from {REPO} (pip, no index)", file=sys.stderr)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation",
                        "--no-deps", "--no-index", "-q", str(REPO)])
    if r.returncode != 0:
        sys.exit(f"{Path(__file__).name}: pip install of {REPO} failed (exit {r.returncode})")
    os.environ["VITRIFY_E2E_INSTALLED"] = "1"
    os.execv(sys.executable, [sys.executable, *sys.argv])


if __name__ == "__main__":
    _ensure_installed()
    from vitrify.bench.sglang.serve import main

    sys.exit(main())
