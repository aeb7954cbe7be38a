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


def _from_pythonpath() -> str:
    """Where ``import vitrify`` finds a copy through a PYTHONPATH entry ("" when it does not)."""
    spec = importlib.util.find_spec("vitrify")
    entries = [Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for loc in (spec.submodule_search_locations or []) if spec else []:
        where = Path(loc).resolve()
        if any(where.parent == e for e in entries) and where != (REPO / "python" / "vitrify"):
            return str(where)
    return ""


SCRIPT = Path(sys.argv[0]).name  # the entry script that runs, for its messages


def _ensure_installed() -> None:
    """Install this tree (pip, no index, no dependencies) when the vitrify this python imports
    is another, then start again."""
    if _this_tree_is_installed():
        return
    shadow = _from_pythonpath()
    if shadow:  # an install into this python would not change what it imports (and would
        # replace the environment's own vitrify, an editable one included)
        sys.exit(f"{SCRIPT}: vitrify is imported from {shadow}, which PYTHONPATH puts first; "
                 f"this checkout ({REPO}) is not what runs: unset PYTHONPATH or point it here")
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
