"""The SGLang plugin's configuration: a TOML file named by ``VITRIFY_SGLANG_CONFIG``, parsed and
validated into :class:`PluginConfig` (PLUGIN.md invariant P5).

=================  ==============================  ===========================================
key                value                           meaning
=================  ==============================  ===========================================
``mode``           ``"save"`` | ``"load"`` |       SAVE freezes the engine into ``archive`` once
                   ``"off"`` (required)            it is built and captured; LOAD thaws it from
                                                   there; ``off`` registers no hook
``archive``        path (required unless off)      the archive directory. LOAD: it must exist.
                                                   SAVE: its parent must exist and be writable
                                                   (the archive is written beside it, then
                                                   renamed into place)
``region_bytes``   int > 0, or a string such as    size of the VMM region every engine
                   ``"64GiB"`` (required unless    allocation is routed into
                   off)
``on_mismatch``    ``"refuse"`` (default) |        what LOAD does when the archive does not
                   ``"cold-start"``                match this server: stop, or build cold
``prefill_graphs`` ``"disabled"`` (default, the    prefill CUDA graphs are not frozen yet, so
                   only accepted value)            the plugin turns them off
``weight_updates`` bool (default false)            ``update_weights_from_tensor(load_format=
                                                   "vitrify")`` runs vitrify's receiver
                                                   (``weights.py``); any mode, ``off`` included;
                                                   mode "load" thaws into an exportable region
                                                   (updates written in place)
``jit_caches``     bool (default true)             SAVE points the JIT caches (Triton, tvm-ffi)
                                                   at ``jit_dir`` so the archive gets what the
                                                   engine compiled; LOAD unpacks the archive's
                                                   caches there first (``vitrify.jit``)
``jit_dir``        path (default: SAVE             where; SAVE's must be empty, absent or an
                   ``<archive>.jit-work``; LOAD    earlier SAVE's; LOAD's parent must be this
                   ``$XDG_CACHE_HOME/vitrify/jit/  user's and writable by no one else
                   <hash of the archive path>``,
                   ``~/.cache`` without it)
``save_after_``    int >= 1 (default 1: SGLang's   SAVE writes the archive at the first idle
``requests``       own warm-up request)            moment after this many generate requests
                                                   (health checks not counted): kernels that
                                                   only real traffic compiles (a Triton
                                                   specialisation on a pointer's alignment)
                                                   are then in the archive; LOAD ignores it
``warmup_``        int 0..64 (default 8)           LOAD: after SGLang's warm-up request and
``requests``                                       before the server reports ready, this many
                                                   requests of the prompt lengths SAVE served
                                                   (spread over their range) load the kernels
                                                   a first request would; 0: none
``standby_file``   path (LOAD only; default none)  LOAD in standby: the server starts and
                                                   imports everything, then its scheduler waits
                                                   before the thaw (before touching GPU memory)
                                                   until this file exists — the imports leave
                                                   the restart's critical path (a replacement
                                                   server waits while the old one still serves)
``read_ahead``     bool (default true)             LOAD: the launcher reads the weights span
                                                   through the page cache while the scheduler
                                                   imports (when it fits in half the memory
                                                   available), so the thaw reads it from memory
``shape_sweep``    bool (default true)             SAVE: after SGLang's warm-up request and
                                                   before ready, requests of every batch-size
                                                   class, prompt length 1 … the longest, prefix
                                                   hits and kind of answer compile the kernel
                                                   variants later shapes need; the archive is
                                                   written after them (``sweep.py``, P19)
``sweep_max_``     int 1..4096 (default 256)       SAVE: the largest batch the sweep sends (the
``batch``                                          server's ``max_running_requests`` where lower)
=================  ==============================  ===========================================

Size strings are a whole number with an optional binary unit: ``B``, ``KiB``, ``MiB``, ``GiB``,
``TiB`` (case-insensitive, a space allowed before the unit). Every problem — unreadable file, bad
TOML, unknown key, wrong type, bad value — is one line raised as :class:`PluginConfigError`.
Only the standard library is imported here.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODES = ("save", "load", "off")
ON_MISMATCH = ("refuse", "cold-start")
PREFILL_GRAPHS = ("disabled",)

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")
_MAX_BYTES = (1 << 63) - 1  # the region size is a signed 64-bit count in the native core
_KEYS = ("mode", "archive", "region_bytes", "on_mismatch", "prefill_graphs", "weight_updates",
         "jit_caches", "jit_dir", "save_after_requests", "warmup_requests", "standby_file",
         "read_ahead", "shape_sweep", "sweep_max_batch")


class PluginConfigError(ValueError):
    """The plugin's configuration is unusable; the message is one line naming the key and value."""


@dataclass(frozen=True)
class PluginConfig:
    """The validated plugin configuration (see the module docstring for the keys)."""

    mode: str
    archive: str | None = None
    region_bytes: int | None = None
    on_mismatch: str = "refuse"
    prefill_graphs: str = "disabled"
    source: str | None = None  # the TOML file it came from, for messages
    weight_updates: bool = False
    jit_caches: bool = True
    jit_dir: str | None = None  # None when off or jit_caches is false
    save_after_requests: int = 1
    warmup_requests: int = 8
    standby_file: str | None = None
    read_ahead: bool = True
    shape_sweep: bool = True
    sweep_max_batch: int = 256

    @property
    def active(self) -> bool:
        """True for SAVE and LOAD: the plugin registers its FREEZE/THAW hooks."""
        return self.mode != "off"

    @property
    def registers_hooks(self) -> bool:
        """Whether the plugin registers any hook (FREEZE/THAW ones, weight-update ones)."""
        return self.active or self.weight_updates


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _type_error(key: str, expected: str, value: Any) -> PluginConfigError:
    return PluginConfigError(f"config key {key!r}: expected {expected}, got "
                             f"{type(value).__name__} {value!r:.80}")


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a size string (``"64GiB"``); the result is > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _type_error(key, "an int or a size string such as \"64GiB\"", value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise PluginConfigError(
                f"config key {key!r}: {value!r} is not a size (a whole number with an optional "
                f"unit B, KiB, MiB, GiB or TiB, e.g. \"64GiB\")")
        value = int(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise PluginConfigError(f"config key {key!r}: must be > 0 bytes, got {value}")
    if value > _MAX_BYTES:
        raise PluginConfigError(f"config key {key!r}: {value} bytes is more than 2**63-1")
    return value


def _choice(data: Mapping, key: str, choices: tuple, default: str | None) -> str:
    if key not in data:
        if default is None:
            raise PluginConfigError(f"config key {key!r} is required (one of {list(choices)})")
        return default
    value = data[key]
    if not isinstance(value, str):
        raise _type_error(key, f"a string, one of {list(choices)}", value)
    if value not in choices:
        raise PluginConfigError(f"config key {key!r}: {value!r} is not one of {list(choices)}")
    return value


def _archive_path(data: Mapping, mode: str) -> str | None:
    if "archive" not in data:
        if mode == "off":
            return None
        raise PluginConfigError(f"config key 'archive' is required when mode is {mode!r}")
    value = data["archive"]
    if not isinstance(value, str) or not value:
        raise _type_error("archive", "a non-empty path string", value)
    path = os.path.abspath(os.path.expanduser(value))
    if mode == "load" and not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise PluginConfigError(f"config key 'archive': {path!r} {what} (mode 'load' reads an "
                                f"archive directory written by mode 'save')")
    if mode == "save":
        if os.path.lexists(path):
            raise PluginConfigError(f"config key 'archive': {path!r} exists (mode 'save' writes "
                                    f"a new archive: remove it or choose another path)")
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise PluginConfigError(f"config key 'archive': the parent directory {parent!r} does "
                                    f"not exist (mode 'save' writes the archive there)")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PluginConfigError(f"config key 'archive': the parent directory {parent!r} is "
                                    f"not writable (mode 'save' writes the archive there)")
    return path


def from_mapping(data: Mapping, source: str | None = None) -> PluginConfig:
    """Validate an already-parsed TOML table (tests and :func:`load` use it)."""
    if not isinstance(data, Mapping):
        raise PluginConfigError(f"the configuration must be a table, got {type(data).__name__}")
    unknown = sorted(k for k in data if k not in _KEYS)
    if unknown:
        raise PluginConfigError(f"unknown config key(s) {unknown} (known: {list(_KEYS)})")
    mode = _choice(data, "mode", MODES, None)
    archive = _archive_path(data, mode)
    if "region_bytes" in data:
        region_bytes = parse_size("region_bytes", data["region_bytes"])
    elif mode == "off":
        region_bytes = None
    else:
        raise PluginConfigError(f"config key 'region_bytes' is required when mode is {mode!r}")
    on_mismatch = _choice(data, "on_mismatch", ON_MISMATCH, "refuse")
    if "prefill_graphs" in data and data["prefill_graphs"] not in PREFILL_GRAPHS:
        value = data["prefill_graphs"]
        if not isinstance(value, str):
            raise _type_error("prefill_graphs", "the string \"disabled\"", value)
        raise PluginConfigError(f"config key 'prefill_graphs': {value!r} is not supported: "
                                f"prefill CUDA graphs are not frozen yet, only \"disabled\" is")
    weight_updates = data.get("weight_updates", False)
    if not isinstance(weight_updates, bool):
        raise _type_error("weight_updates", "true or false", weight_updates)
    jit_caches = data.get("jit_caches", True)
    if not isinstance(jit_caches, bool):
        raise _type_error("jit_caches", "true or false", jit_caches)
    read_ahead = data.get("read_ahead", True)
    if not isinstance(read_ahead, bool):
        raise _type_error("read_ahead", "true or false", read_ahead)
    shape_sweep = data.get("shape_sweep", True)
    if not isinstance(shape_sweep, bool):
        raise _type_error("shape_sweep", "true or false", shape_sweep)
    sweep_max_batch = _int_in(data, "sweep_max_batch", 256, 1, 4096)
    after = _int_in(data, "save_after_requests", 1, 1, 1 << 31)
    warmups = _int_in(data, "warmup_requests", 8, 0, 64)
    return PluginConfig(mode=mode, archive=archive, region_bytes=region_bytes,
                        on_mismatch=on_mismatch, prefill_graphs="disabled", source=source,
                        weight_updates=weight_updates, jit_caches=jit_caches,
                        jit_dir=_jit_dir(data, mode, archive, jit_caches),
                        save_after_requests=after, warmup_requests=warmups,
                        standby_file=_standby_file(data, mode), read_ahead=read_ahead,
                        shape_sweep=shape_sweep, sweep_max_batch=sweep_max_batch)


def _standby_file(data: Mapping, mode: str) -> str | None:
    if "standby_file" not in data:
        return None
    value = data["standby_file"]
    if not isinstance(value, str) or not value:
        raise _type_error("standby_file", "a non-empty path string", value)
    if mode == "off":
        return None  # like every other key of a mode: kept in the file, unused
    if mode != "load":
        raise PluginConfigError(f"config key 'standby_file' is for mode 'load' (a thaw that "
                                f"waits), not {mode!r}")
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.isdir(os.path.dirname(path)):
        raise PluginConfigError(f"config key 'standby_file': the directory "
                                f"{os.path.dirname(path)!r} does not exist (the file that ends "
                                f"the standby is created there)")
    return path


def _int_in(data: Mapping, key: str, default: int, lo: int, hi: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(key, f"an int between {lo} and {hi}", value)
    if not lo <= value <= hi:
        raise PluginConfigError(f"config key {key!r}: must be between {lo} and {hi}, got {value}")
    return value


def _jit_dir(data: Mapping, mode: str, archive: str | None, enabled: bool) -> str | None:
    if "jit_dir" in data:
        value = data["jit_dir"]
        if not isinstance(value, str) or not value:
            raise _type_error("jit_dir", "a non-empty path string", value)
    if mode == "off" or not enabled or archive is None:
        return None
    if "jit_dir" in data:
        return os.path.abspath(os.path.expanduser(data["jit_dir"]))
    if mode == "save":
        return archive + ".jit-work"
    digest = hashlib.sha256(archive.encode()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "vitrify", "jit", digest)


def _toml_module():
    if sys.version_info >= (3, 11):
        import tomllib
        return tomllib
    try:
        import tomli
    except ImportError:
        raise PluginConfigError("reading the TOML config needs Python >= 3.11 or the 'tomli' "
                                "package on Python 3.10 (pip install tomli)") from None
    return tomli


def load(path: str) -> PluginConfig:
    """Read and validate the TOML file at ``path``."""
    toml = _toml_module()
    try:
        with open(path, "rb") as f:
            data = toml.load(f)
    except OSError as e:
        raise PluginConfigError(f"cannot read config file {path!r}: "
                                f"{_one_line(e.strerror or e)}") from None
    except toml.TOMLDecodeError as e:
        raise PluginConfigError(f"config file {path!r} is not valid TOML: {_one_line(e)}") from None
    except UnicodeDecodeError as e:  # tomllib decodes the bytes itself
        raise PluginConfigError(f"config file {path!r} is not UTF-8 text: {_one_line(e)}") from None
    try:
        return from_mapping(data, source=path)
    except PluginConfigError as e:
        raise PluginConfigError(f"{path}: {e}") from None
