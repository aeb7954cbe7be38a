"""Argument checks shared by the public API: one-line errors that name the argument, what was
received and what is valid, raised before anything reaches ``vitrify._native``.

A value of the right type outside its range is a ``ValueError``. A wrong type is an
:class:`ArgumentTypeError`, which is both a ``TypeError`` (Python's convention) and a
``ValueError`` (vitrify's contract: every bad argument is a ``ValueError``).
"""

from __future__ import annotations

import json
import math
import os
import unicodedata
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
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


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters, for messages about values read from files."""
    return _short(value, limit)


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


# ---- files vitrify reads back: JSON parsed with bounds, checked against a schema ------------
#
# A file an archive holds (its manifest, a rank's state, the graph and JIT indexes) is untrusted
# input: it is parsed by :func:`load_json` (bounded nesting and numbers, no duplicate keys, no
# NaN) and checked against one declarative schema per file (:class:`Obj`, :class:`Map`,
# :class:`List`, :class:`Int`, :class:`Str`, ...). A value that does not fit is a
# :class:`SchemaError` naming the field (``files['rank0/state.json'].bytes``) and why; the
# reader turns it into its own error naming the file.

#: Longest path component and path (bytes) a file a vitrify archive lists may have (Linux
#: NAME_MAX and PATH_MAX less the terminating NUL).
NAME_MAX = 255
PATH_MAX = 4095


class SchemaError(ValueError):
    """A value read from a file does not fit its schema: ``field`` names where, ``reason`` why."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}" if field else reason)


class PathSchemaError(SchemaError):
    """A path read from a file is not a safe relative path (see :func:`relpath_problem`)."""


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be shown on one line of a terminal or log (a control character, a
    lone surrogate), or None."""
    for c in value:
        o = ord(c)
        if o < 0x20 or 0x7F <= o < 0xA0:
            return f"contains the control character {c!r}"
        if 0xD800 <= o < 0xE000:
            return f"contains the lone surrogate {c!r} (not UTF-8 text)"
        if o >= 0xA0 and unicodedata.category(c) in ("Zl", "Zp", "Cf"):
            # U+2028/U+2029 break a line; U+202E and the like reorder what a terminal shows
            return f"contains the format or separator character {c!r}"
    return None


def relpath_problem(rel: Any) -> str | None:
    """Why ``rel`` is not a safe relative path inside a directory vitrify reads, or None: a
    non-empty str of ``/``-separated components, none empty, ``.`` or ``..``, not absolute, no
    backslash, no control character or NUL, each component at most :data:`NAME_MAX` bytes and
    the whole at most :data:`PATH_MAX`."""
    if not isinstance(rel, str) or not rel:
        return f"must be a non-empty str, got {got(rel)}"
    if "\x00" in rel or "\\" in rel:
        return "contains NUL or a backslash"
    bad = text_problem(rel)
    if bad:
        return bad
    if rel.startswith("/"):
        return "is absolute"
    if len(rel.encode()) > PATH_MAX:
        return f"is longer than {PATH_MAX} bytes"
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            return "has an empty, '.' or '..' component"
        if len(part.encode()) > NAME_MAX:
            return f"has a component longer than {NAME_MAX} bytes"
    return None


def shown(text: str) -> str:
    """``text`` as it can be printed on one line: itself, or its repr when it holds a control
    character (a newline in a file name must not start a new line of output)."""
    return text if text_problem(text) is None else repr(text)


def _int_hook(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > 20:  # 2**64 has 20 digits; larger never fits any field
        raise ValueError(f"an integer of {len(digits)} digits")
    return int(text)


def _float_hook(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is not finite")
    return v


def _constant_hook(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {_short(k)} appears twice in one object")
        out[k] = v
    return out


def load_json(raw: bytes) -> Any:
    """Parse untrusted JSON ``raw`` (UTF-8): a ValueError with a one-line reason for text that is
    not UTF-8 or not JSON, an object with a key twice, NaN or Infinity, an integer of more than
    20 digits, or nesting too deep for the parser."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text: {e}") from None
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook, parse_int=_int_hook,
                          parse_float=_float_hook, parse_constant=_constant_hook)
    except RecursionError:
        raise ValueError("not valid JSON: nested too deeply") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None


def _sub(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


class Schema:
    """One node of a schema: :meth:`check` raises :class:`SchemaError` naming ``field``."""

    what = "a value"

    def check(self, value: Any, field: str) -> None:
        raise NotImplementedError

    def _fail(self, value: Any, field: str) -> None:
        raise SchemaError(field, f"must be {self.what}, got {got(value)}")


class AnyJson(Schema):
    """Any JSON value (engine-specific data vitrify passes on without reading)."""

    def check(self, value: Any, field: str) -> None:
        pass


class Bool(Schema):
    what = "true or false"

    def check(self, value: Any, field: str) -> None:
        if type(value) is not bool:
            self._fail(value, field)


class Int(Schema):
    """An integer (never a bool or a float) in ``[lo, hi]``."""

    def __init__(self, lo: int = 0, hi: int = U64_MAX):
        self.lo, self.hi = lo, hi
        self.what = f"an int in [{lo}, {hi}]"

    def check(self, value: Any, field: str) -> None:
        if type(value) is not int or not self.lo <= value <= self.hi:
            self._fail(value, field)


class Str(Schema):
    """A str of at most ``max_len`` characters, printable on one line (:func:`text_problem`);
    ``pattern``: a full match it must make; ``choices``: the values it may take."""

    def __init__(self, *, max_len: int = 4096, empty: bool = False, pattern: str | None = None,
                 choices: Sequence[str] | None = None):
        self.max_len, self.empty = max_len, empty
        self.pattern = re.compile(pattern) if pattern else None
        self.choices = tuple(choices) if choices is not None else None
        self.what = (f"one of {', '.join(map(repr, self.choices))}" if self.choices
                     else f"a str matching {pattern}" if pattern else "a str")

    def check(self, value: Any, field: str) -> None:
        if type(value) is not str:
            self._fail(value, field)
        if not value and not self.empty:
            raise SchemaError(field, "must be a non-empty str")
        if len(value) > self.max_len:
            raise SchemaError(field, f"is {len(value)} characters long, more than {self.max_len}")
        bad = text_problem(value)
        if bad:
            raise SchemaError(field, f"{_short(value)} {bad}")
        if (self.pattern and not self.pattern.fullmatch(value)) or \
                (self.choices is not None and value not in self.choices):
            self._fail(value, field)


class RelPath(Schema):
    """A safe relative path (:func:`relpath_problem`); a :class:`PathSchemaError` otherwise."""

    what = "a relative path"

    def check(self, value: Any, field: str) -> None:
        bad = relpath_problem(value)
        if bad:
            raise PathSchemaError(field, f"path {_short(value)} {bad}")


class Nullable(Schema):
    """``None`` or what ``inner`` accepts."""

    def __init__(self, inner: Schema):
        self.inner = inner

    def check(self, value: Any, field: str) -> None:
        if value is not None:
            self.inner.check(value, field)


class List(Schema):
    """A list of ``item``s: at most ``max_len``, exactly ``length`` when given, no two equal
    with ``unique``."""

    def __init__(self, item: Schema, *, max_len: int = 1 << 20, length: int | None = None,
                 unique: bool = False):
        self.item, self.max_len, self.length, self.unique = item, max_len, length, unique
        self.what = f"a list of {length}" if length is not None else "a list"

    def check(self, value: Any, field: str) -> None:
        if type(value) is not list or (self.length is not None and len(value) != self.length):
            self._fail(value, field)
        if len(value) > self.max_len:
            raise SchemaError(field, f"has {len(value)} entries, more than {self.max_len}")
        for i, v in enumerate(value):
            self.item.check(v, f"{field}[{i}]")
        if self.unique:
            seen = set()
            for i, v in enumerate(value):
                key = json.dumps(v, sort_keys=True)
                if key in seen:
                    raise SchemaError(f"{field}[{i}]", f"{_short(v)} appears twice")
                seen.add(key)


class Map(Schema):
    """An object with keys of ``key`` (a :class:`Str` or :class:`RelPath`) and values of
    ``value``, at most ``max_len`` of them."""

    what = "an object"

    def __init__(self, key: Schema, value: Schema, *, max_len: int = 1 << 20):
        self.key, self.value, self.max_len = key, value, max_len

    def check(self, value: Any, field: str) -> None:
        if type(value) is not dict:
            self._fail(value, field)
        if len(value) > self.max_len:
            raise SchemaError(field, f"has {len(value)} entries, more than {self.max_len}")
        for k, v in value.items():
            name = f"{field}[{_short(k)}]"
            self.key.check(k, name)
            self.value.check(v, name)


class Obj(Schema):
    """An object with exactly the keys of ``fields`` (each of its schema), any of ``optional``,
    and others only with ``extra``; ``rule(value, field)`` then checks what spans fields."""

    what = "an object"

    def __init__(self, fields: Mapping[str, Schema], optional: Mapping[str, Schema] | None = None,
                 *, extra: bool = False, rule: Callable[[dict, str], None] | None = None):
        self.fields, self.optional = dict(fields), dict(optional or {})
        self.extra, self.rule = extra, rule

    def check(self, value: Any, field: str) -> None:
        if type(value) is not dict:
            self._fail(value, field)
        for k in self.fields:
            if k not in value:
                raise SchemaError(_sub(field, k), "missing")
        if not self.extra:
            unknown = [k for k in value if k not in self.fields and k not in self.optional]
            if unknown:
                raise SchemaError(field or "(top level)",
                                  f"unknown key {_short(unknown[0])}; the keys are "
                                  f"{sorted(self.fields) + sorted(self.optional)}")
        for k, v in value.items():
            schema = self.fields.get(k) or self.optional.get(k)
            if schema is not None:
                schema.check(v, _sub(field, k))
        if self.rule is not None:
            self.rule(value, field)


def validate(schema: Schema, value: Any) -> Any:
    """``value`` if it fits ``schema``, else :class:`SchemaError` naming the field."""
    schema.check(value, "")
    return value


__all__ = ["AnyJson", "ArgumentTypeError", "Bool", "I64_MAX", "Int", "List", "Map", "NAME_MAX",
           "Nullable", "Obj", "PATH_MAX", "PathSchemaError", "RelPath", "Schema", "SchemaError", "Str",
           "U32_MAX", "U64_MAX", "boolean", "buffer", "callable_or_none", "choice",
           "directory_to_create", "existing_file", "got", "integer", "load_json", "number",
           "optional_integer", "path", "relpath_problem", "sequence", "short", "shown", "string",
           "text_problem", "validate"]
