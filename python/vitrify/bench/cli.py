"""``vitrify bench NAME``: the driver shared by every benchmark (see :mod:`vitrify.bench`).

It parses the options common to all (``--out``, ``--plot``, ``--strict``) and the benchmark's own,
checks them, says why a benchmark cannot run on this machine, runs it with a progress callback,
writes the JSON result and, with ``--plot``, the PNG of its ratios.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from typing import NoReturn

from . import BENCHMARKS

log = logging.getLogger("vitrify.bench")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_SKIPPED_STRICT = 3


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``PROG: error: MESSAGE``), without usage."""

    def error(self, message: str) -> NoReturn:
        _usage_error(self.prog, message)

    def parse_known_args(self, args=None, namespace=None):
        # As a subcommand, leftovers would reach the top parser and be reported there, with its
        # usage; report them here, naming the benchmark that does not take them.
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _usage_error(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


# ---- argument types (argparse turns their ArgumentTypeError into "argument --x: message") ----


def _int_at_least(text: str, low: int, expected: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. ``1,4,16``."""
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers (e.g. 1,4), got {text!r}")
    return vals


def existing_dir(text: str) -> str:
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: not a directory")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    return text


def out_dir(text: str) -> str:
    """A directory for results: existing and writable, or creatable (its nearest existing parent
    is a writable directory)."""
    if os.path.exists(text):
        return existing_dir(text)
    parent = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot be created ({parent} is not a "
                                         f"writable directory)")
    return text


# ---- progress -------------------------------------------------------------------------------


class Progress:
    """``progress("step")`` prints ``[NAME +SECONDS s] step`` on stderr, flushed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{self.name} +{time.perf_counter() - self.t0:.1f} s] {message}", file=sys.stderr,
              flush=True)


# ---- the parser -----------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` with one subcommand per benchmark to the ``vitrify`` command's subparsers."""
    b = subparsers.add_parser(
        "bench", help="run a benchmark: table, JSON result (and PNG with --plot)",
        description="Run one of vitrify's benchmarks: a progress line per step, the table, the "
                    "JSON result in --out (and a PNG of the ratios with --plot). Each compares "
                    "against a baseline measured in the same run and reports ratios.",
        epilog="`vitrify bench NAME --help` lists NAME's options. Exit status: 0 ran (or cannot "
               "run here: the line says why), 1 failed, 2 bad arguments, 3 skipped with --strict.")
    # the bench level's own errors (no or an unknown benchmark name) are one line too
    b.error = lambda message: _usage_error(b.prog, message)  # type: ignore[method-assign]
    names = b.add_subparsers(dest="benchmark", required=True, metavar="NAME",
                             parser_class=OneLineParser)
    for name, help_line in BENCHMARKS.items():
        mod = importlib.import_module(f"{__package__}.{name}")
        # argparse %-formats help texts: a literal "%" ("a 1 % delta") must reach it as "%%"
        p = names.add_parser(name, help=help_line.replace("%", "%%"),
                             description=(mod.__doc__ or "").strip(),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        common = p.add_argument_group("common options")
        common.add_argument("--out", type=out_dir, default=".", metavar="DIR",
                            help="directory for the JSON result (default: the current one)")
        common.add_argument("--plot", action="store_true",
                            help="also write a PNG of the ratios next to the JSON (matplotlib)")
        common.add_argument("--strict", action="store_true",
                            help="exit 3 instead of 0 when the benchmark cannot run here")
    b.set_defaults(func=main_from_args)
    return b


# ---- running ----------------------------------------------------------------------------------


def _matplotlib_missing() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return str(e) or "not importable"
    return None


def main_from_args(args: argparse.Namespace) -> int:
    name = args.benchmark
    prog = f"vitrify bench {name}"
    if args.plot:
        why = _matplotlib_missing()
        if why:
            print(f"{prog}: error: --plot needs matplotlib, which is not importable here ({why}); "
                  f"install it (pip install matplotlib) or leave out --plot", file=sys.stderr)
            return EXIT_USAGE
    mod = importlib.import_module(f"{__package__}.{name}")
    wrong = mod.check(args) if hasattr(mod, "check") else None  # options that clash
    if wrong:
        print(f"{prog}: error: {wrong}", file=sys.stderr)
        return EXIT_USAGE
    reason = mod.unavailable(args)
    if reason:
        print(f"{prog}: skipped: {reason}")
        return EXIT_SKIPPED_STRICT if args.strict else 0
    from . import resultlib

    progress = Progress(name)
    try:
        res = mod.run(args, progress)
    except Exception as e:  # one line for the user; the traceback through logging
        log.error("%s failed", prog, exc_info=True)
        print(f"{prog}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    path = resultlib.write(res, args.out)
    print(f"wrote {path}")
    if args.plot:
        from .plot import plot_ratios

        print(f"wrote {plot_ratios(res, path.with_suffix('.png'))}")
        extra = getattr(mod, "plot_extra", None)  # a benchmark's own figure, beside the ratios
        if extra is not None:
            print(f"wrote {extra(res, path.with_name(path.stem + '-' + extra.suffix + '.png'))}")
    problem = getattr(mod, "problem", None)
    msg = problem(res) if problem else None
    if msg:
        print(f"{prog}: {msg}", file=sys.stderr)
        return EXIT_FAILED
    return 0
