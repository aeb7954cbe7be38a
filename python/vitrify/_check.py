"""Argument checks shared by the public API: one-line errors that name the argument, what was
received and what is valid, raised before anything reaches ``vitrify._native``.

A value of the right type outside its range is a ``ValueError``. A wrong type is an
:class:`ArgumentTypeError`, which is both a ``TypeError`` (Python's convention) and a
``ValueError`` (vitrify's contract: every bad argument is a ``ValueError``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

#: The largest value a native size or offset (uint64) holds; Python ints above it are refused.
U64_MAX = (1 << 64) - 1
#: The largest value a native signed 64-bit count holds.
I64_MAX = (1 << 63) - 1
#: The largest unsigned 32-bit value (thread counts, device ordinals, indices stored as unsigned).
U32_MAX = (1 << 32) - 1


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a TypeError, and a ValueError like every bad argument."""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.replace("\n", " ")


def got(value: Any) -> str:
    """``'str 'abc''``-style description of a received value, for messages."""
    return f"{type(value).__name__} {_short(value)}"


def _range_text(lo: int | float | None, hi: int | float | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    if lo is not None:
        return f">= {lo}"
    if hi is not None:
        return f"<= {hi}"
    return ""


def integer(name: str, value: Any, lo: int | None = 0, hi: int | None = U64_MAX) -> int:
    """``value`` as an int in ``[lo, hi]``: TypeError for a non-int (bool included), ValueError
    outside the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy integers and the like convert exactly through __index__
        index = getattr(type(value), "__index__", None)
        if index is None or isinstance(value, bool):
            raise ArgumentTypeError(f"{name} must be an int {_range_text(lo, hi)}, got {got(value)}")
        value = index(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an int {_range_text(lo, hi)}, got {value}")
    return int(value)


def optional_integer(name: str, value: Any, lo: int | None = 0, hi: int | None = U64_MAX) -> int | None:
    return None if value is None else integer(name, value, lo, hi)


def number(name: str, value: Any, lo: float | None = None, hi: float | None = None, *,
           lo_open: bool = False, hi_open: bool = False) -> float:
    """``value`` as a finite float within the bounds (open bounds exclude the end)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number, got {got(value)}")
    v = float(value)
    lo_bad = lo is not None and (v <= lo if lo_open else v < lo)
    hi_bad = hi is not None and (v >= hi if hi_open else v > hi)
    if not math.isfinite(v) or lo_bad or hi_bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        rng = f"in {left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
        raise ValueError(f"{name} must be a finite number {rng}, got {value!r}")
    return v


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {got(value)}")
    return value


def choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be one of {', '.join(map(repr, choices))}, got {got(value)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def string(name: str, value: Any, *, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a str, got {got(value)}")
    if not empty and not value:
        raise ValueError(f"{name} must be a non-empty str, got ''")
    if "\0" in value:
        raise ValueError(f"{name} must not contain a NUL character, got {value!r}")
    return value


def path(name: str, value: Any) -> str:
    """A filesystem path (str or os.PathLike of str) as a str; never empty, no NUL."""
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"{name} must be a path (str or os.PathLike), got {got(value)}")
    p = os.fspath(value)
    if not isinstance(p, str):
        raise ArgumentTypeError(f"{name} must be a path (str or os.PathLike), got {got(value)}")
    if not p:
        raise ValueError(f"{name} must be a non-empty path, got ''")
    if "\0" in p:
        raise ValueError(f"{name} must not contain a NUL character, got {p!r}")
    return p


def existing_file(name: str, value: Any) -> str:
    """A path that names an existing regular file (FileNotFoundError / IsADirectoryError)."""
    p = path(name, value)
    if not os.path.exists(p):
        raise FileNotFoundError(2, f"{name}: no such file", p)
    if os.path.isdir(p):
        raise IsADirectoryError(21, f"{name}: is a directory, a file is needed", p)
    return p


def directory_to_create(name: str, value: Any) -> str:
    """A directory that exists or can be created: creates it; one-line OSError naming it."""
    p = path(name, value)
    try:
        os.makedirs(p, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(20, f"{name}: exists and is not a directory", p) from None
    except OSError as e:
        raise type(e)(e.errno, f"{name}: cannot create directory ({e.strerror})", p) from None
    if not os.path.isdir(p):
        raise NotADirectoryError(20, f"{name}: not a directory", p)
    return p


def sequence(name: str, value: Any) -> list:
    """A list from an iterable that is not a str/bytes (one of those is almost always a single
    item passed where a list was meant; iterating it would silently split it up)."""
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Iterable):
        raise ArgumentTypeError(f"{name} must be a list (or other sequence), got {got(value)}")
    return list(value)


def callable_or_none(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise ArgumentTypeError(f"{name} must be callable or None, got {got(value)}")
    return value


def buffer(name: str, value: Any, *, writable: bool = False) -> memoryview | Any:
    """Check that ``value`` is a C-contiguous CPU buffer (buffer protocol, or a CPU torch
    tensor / other DLPack CPU array); returns it unchanged (a memoryview for buffer-protocol
    objects). A str is refused: its bytes depend on an encoding."""
    if isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a bytes-like buffer (bytes, bytearray, numpy array, CPU "
                        f"tensor), got str {_short(value)} (encode it first)")
    if hasattr(value, "data_ptr") and hasattr(value, "is_contiguous"):  # torch.Tensor
        if value.device.type != "cpu":
            raise ValueError(f"{name} is a torch tensor on {value.device}; a CPU buffer is needed")
        if not value.is_contiguous():
            raise ValueError(f"{name} is a non-contiguous torch tensor; pass .contiguous()")
        return value
    try:
        mv = memoryview(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be a bytes-like buffer (bytes, bytearray, numpy array, CPU "
                        f"tensor), got {got(value)}") from None
    if not mv.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous")
    if writable and mv.readonly:
        raise ValueError(f"{name} is read-only; a writable buffer is needed, got {type(value).__name__}")
    return value


__all__ = ["ArgumentTypeError", "I64_MAX", "U32_MAX", "U64_MAX", "boolean", "buffer", "callable_or_none", "choice",
           "directory_to_create", "existing_file", "got", "integer", "number", "optional_integer",
           "path", "sequence", "string"]
