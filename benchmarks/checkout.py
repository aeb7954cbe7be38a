"""Run a module of the vitrify package from this checkout: the entry scripts beside this file
(``sglang_*_e2e.py``) call :func:`run`. When the vitrify this python imports is not this
checkout's (not installed, or other sources), this tree is installed first (pip, no index, no
dependencies) and the script starts again. Only the standard library: it runs before vitrify
can be imported."""

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


SCRIPT = Path(sys.argv[0]).name  # the entry script that runs, for its messages


def _ensure_installed() -> None:
    """Install this tree (pip, no index, no dependencies) when the vitrify this python imports
    is another, then start again."""
    if _this_tree_is_installed():
        return
    if os.environ.get("VITRIFY_E2E_INSTALLED") == "1":
        sys.exit(f"{SCRIPT}: vitrify was installed from {REPO} but {sys.executable} "
                 f"still imports another copy; check PYTHONPATH")
    print(f"{SCRIPT}: installing vitrify from {REPO} (pip, no index)", file=sys.stderr)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation",
                        "--no-deps", "--no-index", "-q", str(REPO)])
    if r.returncode != 0:
        sys.exit(f"{SCRIPT}: pip install of {REPO} failed (exit {r.returncode})")
    os.environ["VITRIFY_E2E_INSTALLED"] = "1"
    os.execv(sys.executable, [sys.executable, *sys.argv])



def run(module: str) -> int:
    """``module``'s ``main()`` from this checkout's vitrify (installed first when needed)."""
    _ensure_installed()
    return importlib.import_module(module).main()
