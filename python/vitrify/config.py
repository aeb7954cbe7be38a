"""Configuration from the environment: every ``VITRIFY_*`` variable the package reads, read once
and validated here.

:data:`VARIABLES` is the one table (name, values, default, meaning, parser); docs/REFERENCE.md's
Configuration section shows the same rows (``tests/python/test_foundation.py`` checks). The native
core reads no variable itself: :func:`configure_native` hands it the driver library, the log
level and the libcupti path when ``vitrify`` is imported, before anything loads the driver.

A bad value is a ``ValueError`` naming the variable, raised by :func:`settings` (and
:func:`from_environ`). A bad ``VITRIFY_LOG_LEVEL`` never breaks ``import vitrify``: the import
writes that one line to stderr and logging stays quiet. Tests use :func:`override`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import _native


@dataclasses.dataclass(frozen=True)
class Settings:
    log_level: int | None = None
    libcuda_path: str = "libcuda.so.1"
    direct_io: str = "auto"
    max_slab_gb: float = 480.0
    warmup_restore: bool = True
    sglang_config: str | None = None
    cupti_path: str | None = None
    bench_dir: str | None = None
    git_sha: str | None = None
    test_dir: str | None = None
    weights_triton: bool = True
    host_dir: str = "/dev/shm"
    sglang_profile: str | None = None
    disk_engine_deny: str | None = None


LOG_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "WARN": 30, "ERROR": 40, "CRITICAL": 50}


def _bad(name: str, text: str, expected: str) -> ValueError:
    return ValueError(f"{name}={text!r}: {expected}")


def _level(name: str, text: str) -> int | None:
    t = text.strip().upper()
    if t == "":
        return None
    if t in LOG_LEVELS:
        return LOG_LEVELS[t]
    if t.isdecimal():
        return int(t)
    raise _bad(name, text, f"expected one of {', '.join(sorted(LOG_LEVELS))} or a number")


def _path(name: str, text: str) -> str | None:
    return text or None  # empty: the default


def _text(name: str, text: str) -> str | None:
    return text.strip() or None


def _direct_io(name: str, text: str) -> str:
    try:  # the one direct-I/O mode enum's parser: any case -> "auto" / "on" / "off"
        return _native.parse_direct_io(text.strip())
    except ValueError:
        raise _bad(name, text, "expected auto, on or off") from None


def _positive_gib(name: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise _bad(name, text, "expected a number of GiB") from None
    if not v > 0 or v == float("inf"):  # also rejects nan
        raise _bad(name, text, "must be a finite number > 0")
    return v


_BOOL = {"1": True, "true": True, "yes": True, "on": True,
         "0": False, "false": False, "no": False, "off": False}


def _bool(name: str, text: str) -> bool:
    try:
        return _BOOL[text.strip().lower()]
    except KeyError:
        raise _bad(name, text, "expected 1 or 0") from None


@dataclasses.dataclass(frozen=True)
class Variable:
    """One row of the table. ``values`` and ``default`` are docs/REFERENCE.md's cells, word for
    word; the parser returns None for "not set" (the :class:`Settings` default stays) and raises a
    ``ValueError`` naming the variable."""

    name: str
    field: str
    values: str
    default: str
    meaning: str
    parse: Callable[[str, str], Any]


VARIABLES: tuple[Variable, ...] = (
    Variable("VITRIFY_LOG_LEVEL", "log_level",
             "`DEBUG`, `INFO`, `WARNING`, `ERROR`, or a number", "unset (quiet)",
             "attach a stderr handler to the `vitrify` logger at this level", _level),
    Variable("VITRIFY_LIBCUDA_PATH", "libcuda_path", "path", "`libcuda.so.1`",
             "the CUDA driver library to `dlopen`", _path),
    Variable("VITRIFY_DIRECT_IO", "direct_io", "`auto`, `on`, `off`", "`auto`",
             "O_DIRECT for disk slabs and archives", _direct_io),
    Variable("VITRIFY_HOST_DIR", "host_dir", "path", "`/dev/shm`",
             "where host-tier KV slabs live (tmpfs or hugetlbfs)", _path),
    Variable("VITRIFY_MAX_SLAB_GB", "max_slab_gb", "number > 0", "`480`",
             "the largest single pinned-host registration", _positive_gib),
    Variable("VITRIFY_WARMUP_RESTORE", "warmup_restore", "`1`, `0`", "`1`",
             "restore the warmup gap at thaw (`0`: re-run warmup)", _bool),
    Variable("VITRIFY_SGLANG_CONFIG", "sglang_config", "path", "unset",
             "SGLang freeze/thaw hook configuration", _path),
    Variable("VITRIFY_SGLANG_PROFILE", "sglang_profile", "path", "unset",
             "a directory: the SGLang plugin profiles each scheduler's `init_model_worker` "
             "(cProfile, its 60 costliest calls) into it", _path),
    Variable("VITRIFY_WEIGHTS_TRITON", "weights_triton", "`1`, `0`", "`1`",
             "weight-update checksums on a GPU by Triton kernels (`0`: by torch ops)", _bool),
    Variable("VITRIFY_CUPTI_PATH", "cupti_path", "path",
             "unset (`libcupti.so.13`, then CUDA's `lib64`)",
             "the libcupti that `vitrify.graph.record_modules()` loads", _path),
    Variable("VITRIFY_DISK_ENGINE_DENY", "disk_engine_deny", "engine names", "unset",
             "a test hook: the named disk engines (comma-separated: `io_uring`, `aio`) refuse "
             "as a kernel that forbids them would (EPERM), each time a `DiskStore` opens",
             _text),
    Variable("VITRIFY_BENCH_DIR", "bench_dir", "path", "the system temp directory",
             "where the disk benchmarks measure when `--dir` is not given", _path),
    Variable("VITRIFY_GIT_SHA", "git_sha", "commit", "HEAD of the checkout",
             "the commit benchmark results name", _text),
    Variable("VITRIFY_TEST_DIR", "test_dir", "path", "the system temp directory",
             "where the disk tests write (and `vitrify bench hicache` without "
             "`VITRIFY_BENCH_DIR`)", _path),
)


def _read(env: Mapping[str, str]) -> tuple[Settings, dict[str, str]]:
    """Every variable of ``env`` parsed once: the settings (a bad value leaves its default) and
    the error message of each bad variable, in table order."""
    kw: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for var in VARIABLES:
        text = env.get(var.name)
        if text is None:
            continue
        try:
            value = var.parse(var.name, text)
        except ValueError as e:
            errors[var.name] = str(e)
            continue
        if value is not None:
            kw[var.field] = value
    return Settings(**kw), errors


def from_environ(env: Mapping[str, str]) -> Settings:
    """Build :class:`Settings` from ``env``; raise ValueError naming the first bad variable."""
    s, errors = _read(env)
    if errors:
        raise ValueError(next(iter(errors.values())))
    return s


_environment: tuple[Settings, dict[str, str]] | None = None  # os.environ, read once
_current: Settings | None = None  # an override() in force
_reported: str | None = None  # the bad VITRIFY_LOG_LEVEL line the import printed


def _from_os_environ() -> tuple[Settings, dict[str, str]]:
    global _environment
    if _environment is None:
        _environment = _read(os.environ)
    return _environment


def settings() -> Settings:
    """The process's settings (``os.environ`` as first read); ValueError naming the first bad
    variable."""
    if _current is not None:
        return _current
    s, errors = _from_os_environ()
    if errors:
        raise ValueError(next(iter(errors.values())))
    return s


def get(field: str) -> Any:
    """One setting, for code that runs before :func:`settings` is checked (argparse defaults
    are computed when the parser is built): the override or environment value, or the default
    while its variable is bad (:func:`settings` raises for it later)."""
    if _current is not None:
        return getattr(_current, field)
    return getattr(_from_os_environ()[0], field)


def reported_at_import() -> str | None:
    """The message of a bad ``VITRIFY_LOG_LEVEL`` that ``import vitrify`` already printed."""
    return _reported


def configure_native(native) -> None:
    """At import: set up logging and hand the core its settings (driver library, stderr log
    level, libcupti). Never raises for a bad value: a bad ``VITRIFY_LOG_LEVEL`` is one line on
    stderr (logging stays quiet); other bad values surface from :func:`settings`."""
    global _reported
    from . import _logging

    s, errors = _from_os_environ()
    bad_level = errors.get("VITRIFY_LOG_LEVEL")
    if bad_level is not None and bad_level != _reported:
        _reported = bad_level
        sys.stderr.write(f"vitrify: {bad_level} (logging stays quiet)\n")
    _logging.configure(s.log_level)
    level = None if s.log_level is None else min(s.log_level, 2**31 - 1)  # a C int
    native.configure(libcuda_path=s.libcuda_path, log_level=level, cupti_path=s.cupti_path or "")
    _logging.install_native_sink(native)


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Temporarily replace fields of :func:`settings` (for tests and benchmarks)."""
    global _current
    before = _current
    _current = dataclasses.replace(settings(), **changes)
    try:
        yield _current
    finally:
        _current = before


def as_dict() -> dict:
    return dataclasses.asdict(settings())
