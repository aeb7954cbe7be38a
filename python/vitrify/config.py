"""Configuration from the environment, read once and validated.

| variable | values | default | meaning |
|---|---|---|---|
| ``VITRIFY_LOG_LEVEL`` | DEBUG, INFO, WARNING, ERROR, number | unset (quiet) | stderr logging level |
| ``VITRIFY_LIBCUDA_PATH`` | path | ``libcuda.so.1`` | CUDA driver library to dlopen |
| ``VITRIFY_DIRECT_IO`` | auto, on, off | auto | O_DIRECT for disk slabs and archives |
| ``VITRIFY_MAX_SLAB_GB`` | number > 0 | 480 | ceiling of one pinned-host registration |
| ``VITRIFY_WARMUP_RESTORE`` | 1, 0 | 1 | restore the warmup gap (0: re-run warmup) |
| ``VITRIFY_SGLANG_CONFIG`` | path | unset | SGLang freeze/thaw hook configuration |

A bad value is a ``ValueError`` naming the variable. Tests use :func:`override`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping

from ._logging import parse_level


@dataclasses.dataclass(frozen=True)
class Settings:
    log_level: int | None = None
    libcuda_path: str = "libcuda.so.1"
    direct_io: str = "auto"
    max_slab_gb: float = 480.0
    warmup_restore: bool = True
    sglang_config: str | None = None


_BOOL = {"1": True, "true": True, "yes": True, "on": True,
         "0": False, "false": False, "no": False, "off": False}


def _parse_bool(name: str, text: str) -> bool:
    try:
        return _BOOL[text.strip().lower()]
    except KeyError:
        raise ValueError(f"{name}={text!r}: expected 1 or 0") from None


def from_environ(env: Mapping[str, str]) -> Settings:
    """Build :class:`Settings` from ``env``; raise ValueError naming the first bad variable."""
    kw: dict = {}
    if "VITRIFY_LOG_LEVEL" in env:
        kw["log_level"] = parse_level(env["VITRIFY_LOG_LEVEL"])
    if env.get("VITRIFY_LIBCUDA_PATH"):
        kw["libcuda_path"] = env["VITRIFY_LIBCUDA_PATH"]
    if "VITRIFY_DIRECT_IO" in env:
        v = env["VITRIFY_DIRECT_IO"].strip().lower()
        if v not in ("auto", "on", "off"):
            raise ValueError(f"VITRIFY_DIRECT_IO={env['VITRIFY_DIRECT_IO']!r}: expected auto, on or off")
        kw["direct_io"] = v
    if "VITRIFY_MAX_SLAB_GB" in env:
        text = env["VITRIFY_MAX_SLAB_GB"]
        try:
            v = float(text)
        except ValueError:
            raise ValueError(f"VITRIFY_MAX_SLAB_GB={text!r}: expected a number of GiB") from None
        if not v > 0 or v != v or v == float("inf"):
            raise ValueError(f"VITRIFY_MAX_SLAB_GB={text!r}: must be a finite number > 0")
        kw["max_slab_gb"] = v
    if "VITRIFY_WARMUP_RESTORE" in env:
        kw["warmup_restore"] = _parse_bool("VITRIFY_WARMUP_RESTORE", env["VITRIFY_WARMUP_RESTORE"])
    if env.get("VITRIFY_SGLANG_CONFIG"):
        kw["sglang_config"] = env["VITRIFY_SGLANG_CONFIG"]
    return Settings(**kw)


_current: Settings | None = None


def settings() -> Settings:
    """The process's settings, read from ``os.environ`` on first use."""
    global _current
    if _current is None:
        _current = from_environ(os.environ)
    return _current


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Temporarily replace fields of :func:`settings` (for tests)."""
    global _current
    before = settings()
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before


def as_dict() -> dict:
    return dataclasses.asdict(settings())
