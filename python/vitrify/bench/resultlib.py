"""vitrify's result-file convention (benchmarks/README.md in the repository), shared by every
benchmark, every end-to-end run and the GPU suite.

A result is one JSON object that always carries ``name``, ``date``, ``git_sha``, ``machine``,
``ok``, ``goals``, ``goal_direction`` and ``ratios`` (plus ``tests`` and/or ``rows`` and whatever
the run adds). ``goal_direction`` names, for every goal, whether its ratio must be ``">="`` (the
default) or ``"<="`` the goal. ``ok`` is the caller's verdict when it gives one, else: every
test passed (``tests["failed"] == 0``) and every goal is met by a finite ratio.

Results are records: :func:`write` names each ``<name>-<YYYY-MM-DD>-<commit>.json`` (the first
7 hex digits of ``git_sha``) and never replaces a file; a second result of the same name, day and
commit gets ``-2``, ``-3``, ... before ``.json``.

This module imports vitrify only inside :func:`machine`, so ``scripts/summarize_suite.py`` can
load it by path where the package failed to build."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1]  # .../vitrify


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=PACKAGE, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_sha() -> str:
    """The commit that ran: VITRIFY_GIT_SHA when set (the GPU machine's copy of the tree may have
    no usable .git), else HEAD of the vitrify checkout this package lives in (a source tree, an
    editable install, or a virtual environment inside the checkout), with ``-dirty`` after it
    when tracked files differ from that commit; "unknown" otherwise (an installed wheel:
    ``machine["vitrify"]`` names the version)."""
    try:  # by path, before the package is installed (the SGLang scripts), there is none yet
        from vitrify import config
    except ImportError:
        config = None
    env = config.get("git_sha") if config is not None else ""
    if env:
        return env
    top = _git("rev-parse", "--show-toplevel")
    if not top or not (Path(top) / "python" / "vitrify" / "__init__.py").is_file():
        return "unknown"  # not inside a vitrify checkout (some other repository, or none)
    out = _git("rev-parse", "HEAD")
    if len(out) != 40 or not all(c in "0123456789abcdef" for c in out):
        return "unknown"
    # tracked files changed since HEAD: what ran is not that commit, and the record says so
    return out + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(directory: str | None = None) -> dict[str, Any]:
    """GPU name, driver, CUDA, torch, CPU (and the filesystem of `directory`)."""
    m: dict[str, Any] = {"cpu": _cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        import vitrify
        from vitrify import _native

        m["vitrify"] = vitrify.__version__
        if vitrify.cuda_available():
            info = _native.device_info(0)
            m["gpu"] = info["name"]
            m["sm"] = info["sm"]
            m["driver"] = _native.driver_version()
        else:
            m["gpu"] = None
            m["gpu_reason"] = vitrify.cuda_unavailable_reason()
        if directory:
            p = _native.probe_direct_io(directory)
            m["filesystem"] = {"path": directory, "type": p["fs_type"], "o_direct": p["supported"]}
    except Exception as e:  # a result file is still worth writing
        m["vitrify_error"] = f"{type(e).__name__}: {e}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if smi.returncode == 0:
            m["nvidia_driver"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import importlib.metadata as md

        m["torch"] = md.version("torch")
    except Exception:
        m["torch"] = None
    return m


GOAL_DIRECTIONS = (">=", "<=")


def goal_met(ratios: dict[str, Any], goals: dict[str, Any], direction: dict[str, str],
             key: str) -> bool | None:
    """Whether ratio ``key`` meets its goal: None when there is no goal, False when the ratio is
    missing or not a finite number."""
    goal = goals.get(key)
    if not finite(goal):
        return None
    value = ratios.get(key)
    if not finite(value):
        return False
    return value <= goal if direction.get(key) == "<=" else value >= goal


def finite(v: Any) -> bool:
    """A real number (not a bool) that is neither infinite nor NaN."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def result(name: str, *, rows: list[dict] | None = None, ratios: dict[str, float] | None = None,
           goals: dict[str, float] | None = None, goal_direction: dict[str, str] | None = None,
           tests: dict | None = None, ok: bool | None = None, directory: str | None = None,
           **extra: Any) -> dict[str, Any]:
    """One result object (see the module docstring). ``goal_direction`` defaults to ``">="`` for
    every goal; a direction for a key that is not a goal, or one other than ``">="``/``"<="``, is
    a ValueError."""
    ratios = dict(ratios or {})
    goals = dict(goals or {})
    given = dict(goal_direction or {})
    bad = {k: v for k, v in given.items() if v not in GOAL_DIRECTIONS}
    if bad:
        raise ValueError(f"goal_direction values must be one of {GOAL_DIRECTIONS}, got {bad}")
    stray = sorted(set(given) - set(goals))
    if stray:
        raise ValueError(f"goal_direction names keys that are not goals: {stray}")
    direction = {k: given.get(k, ">=") for k in goals}
    if ok is None:
        tests_ok = tests is None or not tests.get("failed")
        ok = tests_ok and all(goal_met(ratios, goals, direction, k) for k in goals)
    out: dict[str, Any] = {
        "name": name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "machine": machine(directory),
        "ok": bool(ok),
        "goals": goals,
        "goal_direction": direction,
        "ratios": ratios,
    }
    if tests is not None:
        out["tests"] = tests
    if rows is not None:
        out["rows"] = rows
    out.update(extra)
    return out


REQUIRED_KEYS = ("date", "git_sha", "ok", "goals", "goal_direction", "ratios")


def result_path(res: dict[str, Any], out_dir: str | os.PathLike) -> Path:
    """<out_dir>/<name>-<YYYY-MM-DD>-<commit>.json: the first name :func:`write` tries for
    `res` (``unknown`` stands for the commit where it is not known; ``<sha7>-dirty`` for a tree
    whose tracked files differed from it)."""
    sha = str(res.get("git_sha") or "unknown")
    short = sha[:7] if sha != "unknown" else sha
    if sha.endswith("-dirty") and sha != "unknown":  # a tree that was not its commit
        short += "-dirty"
    return Path(out_dir) / f"{res['name']}-{res['date'][:10]}-{short}.json"


def write(res: dict[str, Any], out_dir: str | os.PathLike) -> Path:
    """Write `res` under a name no file has yet (:func:`result_path`, then ``-2``, ``-3``, ...)
    and return the path. A result lacking one of :data:`REQUIRED_KEYS` is a ValueError: build
    it with :func:`result`."""
    missing = [k for k in REQUIRED_KEYS if k not in res]
    if missing:
        raise ValueError(f"result {res.get('name')!r} lacks {missing}: build it with "
                         f"resultlib.result()")
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    first = result_path(res, d)
    tmp = d / f".{first.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)  # a stale one, or a link put there: removed, never followed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "w") as f:
        f.write(json.dumps(res, indent=2, sort_keys=True) + "\n")
    try:
        for n in range(1, 10_000):
            path = first if n == 1 else first.with_name(f"{first.stem}-{n}.json")
            try:
                os.link(tmp, path)  # fails if the name exists: a record is never replaced
            except FileExistsError:
                continue
            return path
        raise FileExistsError(f"{first}: 9,999 results of that name already exist")
    finally:
        tmp.unlink(missing_ok=True)


def print_table(rows: list[dict], columns: list[str] | None = None) -> None:
    """Print `rows` as an aligned text table of `columns` (default: the first row's keys); a
    missing or None value prints as "-"."""
    if not rows:
        print("(no rows)")
        return
    cols = columns or list(rows[0])
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    widths = {c: max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    print("  ".join("-" * widths[c] for c in cols))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(widths[c]) for c in cols))


def drop_page_cache(paths) -> int:
    """Write everything back (``os.sync``) and drop ``paths`` from the page cache with
    ``posix_fadvise(DONTNEED)``, so the next reads come from the drive. Paths that cannot be
    opened are skipped; returns how many files were dropped."""
    os.sync()
    n = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def needs_gpu(*modules: str) -> str | None:
    """A GPU benchmark's ``unavailable()``: why it cannot run here (no CUDA GPU, or one of
    ``modules`` not installed), else None."""
    import importlib.util

    import vitrify

    if not vitrify.cuda_available():
        return f"needs a CUDA GPU: {vitrify.cuda_unavailable_reason()}"
    for mod in modules:
        if importlib.util.find_spec(mod) is None:
            return f"needs {mod} (pip install {mod})"
    return None
