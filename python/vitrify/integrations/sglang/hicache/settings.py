"""The HiCache backend's configuration: SGLang's extra config parsed and validated into
:class:`VitrifyStorageSettings`, plus the logger and constants every part of the backend shares."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from .... import _native

logger = logging.getLogger("vitrify.sglang.hicache")

# Keys SGLang itself reads from the extra config (they reach the backend too).
_SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "allocator",
    "tp_lcm_size", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "prefetch_timeout_max",
    "hicache_storage_pass_prefix_keys",
})
_VITRIFY_KEYS = frozenset({
    "dirs", "budget_bytes", "budget_gb", "cold_start", "direct_io", "staging_bytes",
    "read_threads", "write_threads", "name", "extra_pool_budget_bytes", "stats_path",
    "revision", "weight_version", "reader_refresh_s", "reader_open_timeout_s",
    "host_bytes", "host_gb", "host_dir", "host_write", "host_required", "role",
})
_KIND = "kv"  # the one payload kind of every slab store of this backend
_MiB = 1 << 20
_MAX_BUDGET = (1 << 63) - 1  # bytes: the disk tier's budget is a signed 64-bit count


@dataclass(frozen=True)
class VitrifyStorageSettings:
    """The validated vitrify part of SGLang's extra config (see the package docstring)."""

    dirs: tuple
    budget_bytes: int
    cold_start: str = "load"
    direct_io: Optional[str] = None
    staging_bytes: int = 256 * _MiB
    read_threads: int = 8
    write_threads: int = 2
    name: str = "hicache"
    extra_pool_budget_bytes: Optional[int] = None
    stats_path: Optional[str] = None
    revision: Optional[str] = None
    weight_version: Optional[str] = None
    # MLA with tp_size > 1 (DESIGN.md "MLA under tensor parallelism"): ranks > 0 rescan the
    # shared store at most this often, on an exists query that misses ...
    reader_refresh_s: float = 2.0
    # ... and wait this long at open for TP rank 0 to create (format) the shared store.
    reader_open_timeout_s: float = 300.0
    # The host tier (vitrify.tier; DESIGN.md "Host tier"): bytes of this rank's pages kept in
    # named shared memory in front of the disk slabs (0: none), and its directory (None:
    # vitrify.tier.default_dir(), under VITRIFY_HOST_DIR).
    host_bytes: int = 0
    host_dir: Optional[str] = None
    # "through": a v1 set is acknowledged by the disk; "back": by the host tier, the disk
    # written behind it (writeback.py)
    host_write: str = "through"
    # False: a host tier whose mount has too little space is left out (one warning line, the
    # stats' host_unavailable says why) and the server serves from the disk; True: an error
    host_required: bool = False
    # "reader": another server of the node with the same storage identity owns the stores; this
    # one maps them read-only (host tier and disk), writes nothing and rescans on a miss.
    role: str = "writer"

    @classmethod
    def from_extra_config(cls, extra: Optional[dict]) -> "VitrifyStorageSettings":
        """Parse and validate; ValueError names the offending key and value."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"vitrify HiCache backend: the extra config must be a JSON object "
                             f"(dict), got {type(extra).__name__} {extra!r:.60}")
        extra = dict(extra or {})
        unknown = sorted(str(k) for k in extra
                         if k not in _SGLANG_KEYS and k not in _VITRIFY_KEYS)
        if unknown:  # a mistyped key would silently leave its setting at the default
            raise ValueError(f"vitrify HiCache backend: unknown extra-config key(s) {unknown} "
                             f"(vitrify reads {sorted(_VITRIFY_KEYS)}; SGLang reads "
                             f"{sorted(_SGLANG_KEYS)})")
        dirs = extra.get("dirs")
        if isinstance(dirs, str):
            dirs = [dirs]
        if not isinstance(dirs, (list, tuple)) or not dirs or \
                not all(isinstance(d, str) and d for d in dirs):
            raise ValueError(f"vitrify HiCache backend: 'dirs' must be a directory or a non-empty "
                             f"list of directories (one per drive), got {extra.get('dirs')!r}")
        for d in dirs:
            problem = _dir_problem(d)
            if problem:
                raise ValueError(f"vitrify HiCache backend: 'dirs' entry {d!r} {problem}")
        has_b, has_g = "budget_bytes" in extra, "budget_gb" in extra
        if has_b == has_g:
            raise ValueError("vitrify HiCache backend: give exactly one of 'budget_bytes' (int) or "
                             f"'budget_gb' (number) for this rank's slabs, got "
                             f"budget_bytes={extra.get('budget_bytes')!r} "
                             f"budget_gb={extra.get('budget_gb')!r}")
        if has_b:
            budget = extra["budget_bytes"]
            if isinstance(budget, bool) or not isinstance(budget, int) or \
                    not 0 < budget <= _MAX_BUDGET:
                raise ValueError(f"vitrify HiCache backend: 'budget_bytes' must be an int in "
                                 f"[1, {_MAX_BUDGET}], got {budget!r}")
        else:
            gb = extra["budget_gb"]
            if isinstance(gb, bool) or not isinstance(gb, (int, float)) or \
                    not 0 < gb <= _MAX_BUDGET / 1e9:
                raise ValueError(f"vitrify HiCache backend: 'budget_gb' must be a number in "
                                 f"(0, {_MAX_BUDGET / 1e9:.0f}], got {gb!r}")
            budget = int(gb * 1e9)
        cold = extra.get("cold_start", "load")
        if cold not in ("load", "clear"):
            raise ValueError(f"vitrify HiCache backend: 'cold_start' must be 'load' or 'clear', "
                             f"got {cold!r}")
        dio = extra.get("direct_io")
        if dio is not None and dio not in _native.DIRECT_IO_MODES:
            raise ValueError(f"vitrify HiCache backend: 'direct_io' must be 'auto', 'on' or 'off', "
                             f"got {dio!r}")
        ints = {}
        for key, default, low, high in (("staging_bytes", 256 * _MiB, 1, 1 << 40),
                                        ("read_threads", 8, 1, 256), ("write_threads", 2, 1, 256)):
            v = extra.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ValueError(f"vitrify HiCache backend: '{key}' must be an int in "
                                 f"[{low}, {high}], got {v!r}")
            ints[key] = v
        name = extra.get("name", "hicache")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", name):
            raise ValueError(f"vitrify HiCache backend: 'name' must be 1-64 characters of "
                             f"[A-Za-z0-9._-], got {name!r}")
        extra_budget = extra.get("extra_pool_budget_bytes")
        if extra_budget is not None and (
                isinstance(extra_budget, bool) or not isinstance(extra_budget, int)
                or not 0 <= extra_budget < budget):
            raise ValueError(f"vitrify HiCache backend: 'extra_pool_budget_bytes' must be an int in "
                             f"[0, budget_bytes={budget}), got {extra_budget!r}")
        stats_path = extra.get("stats_path")
        if stats_path is not None:
            if not isinstance(stats_path, str) or not stats_path or stats_path.endswith("/"):
                raise ValueError(f"vitrify HiCache backend: 'stats_path' must be a file path "
                                 f"(non-empty string), got {stats_path!r}")
            if "\0" in stats_path:
                problem = "contains a NUL character"
            elif os.path.isdir(stats_path):
                problem = "is a directory"
            else:
                problem = _dir_problem(os.path.dirname(os.path.abspath(stats_path)))
                problem = problem and f"is in a directory that {problem}"
            if problem:
                raise ValueError(f"vitrify HiCache backend: 'stats_path' {stats_path!r} "
                                 f"{problem}")
        floats = {}
        for key, default, high in (("reader_refresh_s", 2.0, 3600.0),
                                   ("reader_open_timeout_s", 300.0, 86400.0)):
            v = extra.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= high:
                raise ValueError(f"vitrify HiCache backend: '{key}' must be a number of seconds "
                                 f"in [0, {high:g}], got {v!r}")
            floats[key] = float(v)
        versions = {k: identity_text(k, extra[k]) if k in extra else None
                    for k in ("revision", "weight_version")}
        host_bytes = 0
        if "host_bytes" in extra and "host_gb" in extra:
            raise ValueError("vitrify HiCache backend: give at most one of 'host_bytes' and "
                             f"'host_gb', got host_bytes={extra['host_bytes']!r} "
                             f"host_gb={extra['host_gb']!r}")
        if "host_bytes" in extra:
            host_bytes = extra["host_bytes"]
            if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or \
                    not 0 <= host_bytes <= _MAX_BUDGET:
                raise ValueError(f"vitrify HiCache backend: 'host_bytes' must be an int in "
                                 f"[0, {_MAX_BUDGET}] (0: no host tier), got {host_bytes!r}")
        elif "host_gb" in extra:
            gb = extra["host_gb"]
            if isinstance(gb, bool) or not isinstance(gb, (int, float)) or \
                    not 0 <= gb <= _MAX_BUDGET / 1e9:
                raise ValueError(f"vitrify HiCache backend: 'host_gb' must be a number in "
                                 f"[0, {_MAX_BUDGET / 1e9:.0f}] (0: no host tier), got {gb!r}")
            host_bytes = int(gb * 1e9)
        host_dir = extra.get("host_dir")
        if host_dir is not None and (not isinstance(host_dir, str) or not host_dir
                                     or "\0" in host_dir):
            raise ValueError(f"vitrify HiCache backend: 'host_dir' must be a directory path "
                             f"(non-empty string), got {host_dir!r}")
        host_write = extra.get("host_write", "through")
        if host_write not in ("through", "back"):
            raise ValueError(f"vitrify HiCache backend: 'host_write' must be 'through' or "
                             f"'back', got {host_write!r}")
        host_required = extra.get("host_required", False)
        if not isinstance(host_required, bool):
            raise ValueError(f"vitrify HiCache backend: 'host_required' must be true or false, "
                             f"got {host_required!r}")
        role = extra.get("role", "writer")
        if role not in ("writer", "reader"):
            raise ValueError(f"vitrify HiCache backend: 'role' must be 'writer' or 'reader', "
                             f"got {role!r}")
        return cls(dirs=tuple(dirs), budget_bytes=budget, cold_start=cold, direct_io=dio,
                   name=name, extra_pool_budget_bytes=extra_budget, stats_path=stats_path,
                   host_bytes=host_bytes, host_dir=host_dir, host_write=host_write,
                   host_required=host_required, role=role, **versions, **ints,
                   **floats)


def identity_text(what: str, value: object) -> str:
    """``value`` checked as one field of the storage identity (a revision or weight version):
    a str of 1-256 printable characters. ValueError names ``what`` and the value."""
    if not isinstance(value, str) or not 0 < len(value) <= 256 or not value.isprintable():
        raise ValueError(f"vitrify HiCache backend: '{what}' must be a string of 1-256 printable "
                         f"characters, got {value!r:.80}")
    return value


def _dir_problem(d: str) -> str:
    """Why directory ``d`` cannot hold slab files ("" when it can, or can be created)."""
    if "\0" in d:
        return "contains a NUL character"
    p = os.path.abspath(d)
    if os.path.exists(p):
        return "" if os.path.isdir(p) else "exists and is not a directory"
    parent = p
    while not os.path.exists(parent):  # the nearest existing ancestor must be a directory
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return ""
