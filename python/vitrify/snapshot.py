"""Span snapshots: the bytes of a span of the region (the *warmup gap*), dumped at freeze and
restored at thaw.

Engines lazily create persistent buffers during warmup (compiled code paths, Triton workspaces,
MoE/Mamba state). vitrify dumps the bytes of that span at freeze and restores them at thaw instead
of re-running warmup.

.. important::
   At freeze, dump the span **before** the engine empties its caching allocator
   (``torch.cuda.empty_cache()``). After that, blocks the allocator freed are unmapped, holes
   appear in the span, and their bytes are gone. :func:`dump` tolerates holes (it keeps the
   mapped parts) but cannot bring back what was released.

Spans and intervals are *offsets* from the region's ``base`` (half-open ``(begin, end)``
tuples), so a snapshot restores at another base unchanged. ``target`` selects how device memory
is reached: a device ordinal (the CUDA driver) or a :class:`HostBackend` (host memory posing as
a device, with unmapped holes — for CPU-only tests).

The span-file format and the invariants are in ``csrc/src/snapshot/DESIGN.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Union

from . import _check, _native, config
from ._units import GiB, MiB, TiB

log = logging.getLogger("vitrify.snapshot")

Snapshot = _native.Snapshot
SpanFileError = _native.SpanFileError

Target = Union[int, "_native.HostBackend"]
Interval = tuple[int, int]

DEFAULT_GRANULARITY = 2 * MiB
DEFAULT_CHUNK_BYTES = 64 * MiB
WARMUP_SPAN = "warmup"
WEIGHTS_SPAN = "weights"


# ---- interval arithmetic ---------------------------------------------------------------------

def _intervals(intervals: Iterable[Interval]) -> list[Interval]:
    out = []
    for i, iv in enumerate(_check.sequence("intervals", intervals)):
        if isinstance(iv, (str, bytes)) or not isinstance(iv, (tuple, list)) or len(iv) != 2:
            raise _check.ArgumentTypeError(f"intervals[{i}] must be a (begin, end) pair of ints, got "
                            f"{_check.got(iv)}")
        b = _check.integer(f"intervals[{i}] begin", iv[0], 0, _check.U64_MAX)
        e = _check.integer(f"intervals[{i}] end", iv[1], 0, _check.U64_MAX)
        out.append((b, e))
    return out


class HostBackend(_native.HostBackend):
    """Host memory posing as device memory (for CPU-only tests): ``size`` bytes at ``base``, the
    ``holes`` (``(begin, end)`` offsets) unmapped, aligned to ``alignment``."""

    def __init__(self, size: int, holes: Iterable[Interval] = (),
                 alignment: int = DEFAULT_GRANULARITY) -> None:
        size = _check.integer("size", size, 1, TiB)
        alignment = _check.integer("alignment", alignment, 1, GiB)
        if alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        super().__init__(size, _intervals(holes), alignment)


class ScratchSpan(_native.ScratchSpan):
    """A VMM reservation of ``size`` bytes on ``device`` near ``base_hint`` with the granules
    flagged in ``mapped`` (one bool per granule) backed by memory (GPU tests, benchmarks)."""

    def __init__(self, device: int, size: int, base_hint: int, mapped: Iterable[bool]) -> None:
        device = _check.integer("device", device, 0, (1 << 31) - 1)
        size = _check.integer("size", size, 1, 1 << 46)
        base_hint = _check.integer("base_hint", base_hint, 0, _check.U64_MAX)
        flags = _check.sequence("mapped", mapped)
        for i, f in enumerate(flags):
            if not isinstance(f, (bool, int)) or f not in (0, 1):
                raise _check.ArgumentTypeError(f"mapped[{i}] must be True or False, got "
                                               f"{_check.got(f)}")
        super().__init__(device, size, base_hint, [bool(f) for f in flags])

    def write(self, offset: int, data: bytes) -> None:
        """Copy ``data`` to ``base + offset``."""
        if not isinstance(data, bytes):
            _check.buffer("data", data)
            data = memoryview(data).tobytes()
        super().write(_check.integer("offset", offset, 0, _check.U64_MAX), data)

    def read(self, offset: int, nbytes: int) -> bytes:
        """Copy ``nbytes`` from ``base + offset``."""
        return super().read(_check.integer("offset", offset, 0, _check.U64_MAX),
                            _check.integer("nbytes", nbytes, 0, _check.I64_MAX))


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sort, drop empty intervals, merge overlapping and touching ones."""
    return list(_native.span_merge(_intervals(intervals)))


def clamp(intervals: Iterable[Interval], ceiling: int) -> list[Interval]:
    """Cut every interval to ``[0, ceiling)``; what lies at or above ``ceiling`` is dropped."""
    return list(_native.span_clamp(_intervals(intervals),
                                   _check.integer("ceiling", ceiling, 0, _check.U64_MAX)))


def intersect(intervals: Iterable[Interval], lo: int, hi: int) -> list[Interval]:
    """Intersect every interval with ``[lo, hi)``; empty results are dropped."""
    return list(_native.span_intersect(_intervals(intervals),
                                       _check.integer("lo", lo, 0, _check.U64_MAX),
                                       _check.integer("hi", hi, 0, _check.U64_MAX)))


def total_bytes(intervals: Iterable[Interval]) -> int:
    """Sum of the interval sizes (empty intervals count 0)."""
    return _native.span_total(_intervals(intervals))


def split_aligned(base: int, start: int, end: int, granularity: int) -> list[Interval]:
    """``[start, end)`` split where ``base + offset`` crosses a multiple of ``granularity``."""
    _check_span(base, start, end)
    return list(_native.span_split_aligned(
        base, start, end, _check.integer("granularity", granularity, 1, _check.U64_MAX)))


# ---- validation ------------------------------------------------------------------------------

def _check_span(base: int, start: int, end: int, end_name: str = "end") -> None:
    for name, v in (("base", base), ("start", start), (end_name, end)):
        _check.integer(name, v, 0, _check.U64_MAX)
    if start > end:
        raise ValueError(f"span start {start:#x} is past its {end_name} {end:#x}")
    if base + end > _check.U64_MAX:
        raise ValueError(f"base {base:#x} + {end_name} {end:#x} is past the 64-bit address space")


def _target(target: Target) -> Target:
    if isinstance(target, HostBackend):
        return target
    if isinstance(target, bool) or not isinstance(target, int):
        raise _check.ArgumentTypeError(f"target must be a device ordinal (int) or a HostBackend, got "
                        f"{_check.got(target)}")
    return _check.integer("target", target, 0, (1 << 31) - 1)


def _snapshot(snapshot: Snapshot) -> Snapshot:
    if not isinstance(snapshot, Snapshot):
        raise _check.ArgumentTypeError(f"snapshot must be a vitrify.snapshot.Snapshot (from dump), got "
                        f"{_check.got(snapshot)}")
    return snapshot


def _direct_io(direct_io: str | None) -> str:
    v = config.settings().direct_io if direct_io is None else direct_io
    return _check.choice("direct_io", v, _native.DIRECT_IO_MODES)


def _parent_dir(name: str, path: str) -> None:
    """The directory a new file at ``path`` goes into must exist (one-line OSError naming it)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise FileNotFoundError(2, f"{name}: the directory does not exist", parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(20, f"{name}: not a directory", parent)


def progress_logger(what: str, every_bytes: int = GiB) -> Callable[[int, int], None]:
    """A progress callback that logs ``what`` through the ``vitrify`` logger about every
    ``every_bytes`` (and at the end), with the rate so far."""
    _check.integer("every_bytes", every_bytes, 1, _check.U64_MAX)
    t0 = time.monotonic()
    state = {"next": every_bytes}

    def report(done: int, total: int) -> None:
        if done < state["next"] and done < total:
            return
        state["next"] = done + every_bytes
        dt = max(time.monotonic() - t0, 1e-9)
        log.info("%s: %.2f / %.2f GiB (%.0f%%, %.2f GB/s)", what, done / GiB, total / GiB,
                 100.0 * done / total if total else 100.0, done / dt / 1e9)

    return report


# ---- in memory -------------------------------------------------------------------------------

def dump(base: int, start: int, end: int, *, target: Target = 0,
         granularity: int = DEFAULT_GRANULARITY, pin: bool = True) -> Snapshot:
    """Copy the mapped parts of ``[base+start, base+end)`` to host memory.

    One contiguous device-to-host copy when the span is fully mapped (one interval); otherwise
    per-``granularity`` trial copies keep the runs that copied cleanly (a copy over an unmapped
    page fails at once with CUDA_ERROR_INVALID_VALUE and leaves the context healthy).
    ``pin=True`` registers the host buffer so :func:`restore` runs at DMA speed.
    Call it BEFORE the engine empties its caching allocator.
    """
    _check_span(base, start, end)
    target = _target(target)
    granularity = _check.integer("granularity", granularity, 1, TiB)
    if not isinstance(pin, (bool, int)):
        raise _check.ArgumentTypeError(f"pin must be True or False, got {_check.got(pin)}")
    return _native.span_dump(target, base, start, end, granularity, bool(pin))


def restore(snapshot: Snapshot, base: int, ceiling: int, *, target: Target = 0) -> dict:
    """Copy each interval of ``snapshot`` to ``base + offset``, clamped to ``[0, ceiling)``.

    ``ceiling`` is the region's final mapped offset: bytes at or above it are dropped, never
    written. The target range must be mapped and stay so: with a :class:`vitrify.Region`, claim
    ``[0, ceiling)`` with ``region.claim(ceiling)`` before restoring (``set_offset`` would
    release the idle chunks it skips, restored bytes included). Returns ``bytes_written``,
    ``bytes_dropped`` and ``intervals_written``.
    """
    _snapshot(snapshot)
    _check_span(base, 0, ceiling, "ceiling")
    return dict(_native.span_restore(_target(target), snapshot, base, ceiling))


# ---- span files ------------------------------------------------------------------------------

def dump_to_file(path: str | os.PathLike, base: int, start: int, end: int, *, target: Target = 0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, granularity: int = DEFAULT_GRANULARITY,
                 direct_io: str | None = None,
                 progress: Callable[[int, int], None] | None = None) -> dict:
    """Dump the mapped parts of a span into a span file (durable when this returns).

    Pipelined through two pinned staging buffers of ``chunk_bytes``; each chunk's CRC32C is
    stored. ``direct_io`` defaults to ``VITRIFY_DIRECT_IO`` (auto: O_DIRECT when the filesystem
    accepts it). ``progress(done, total)`` is called per chunk; by default large spans are logged
    on the ``vitrify.snapshot`` logger. Returns ``bytes``, ``intervals``, ``direct_io``,
    ``seconds``, and ``file_bytes`` / ``file_crc32c``: the written file's size and whole-file
    CRC32C (what :func:`vitrify.archive.file_checksum` would read back), computed on the way.
    """
    path = _check.path("path", path)
    _check_span(base, start, end)
    target = _target(target)
    chunk_bytes = _check.integer("chunk_bytes", chunk_bytes, 4096, 1 << 34)
    granularity = _check.integer("granularity", granularity, 1, TiB)
    direct_io = _direct_io(direct_io)
    _check.callable_or_none("progress", progress)
    _parent_dir("path", path)
    if progress is None:
        progress = progress_logger(f"dump {path}")
    out = dict(_native.span_dump_file(target, path, base, start, end, chunk_bytes,
                                      granularity, direct_io, progress))
    log.info("dumped span [%#x, %#x) to %s: %d bytes in %d intervals, %.2f s (O_DIRECT %s)",
             start, end, os.fspath(path), out["bytes"], len(out["intervals"]), out["seconds"],
             "on" if out["direct_io"] else "off")
    return out


def page_cache_share(path: str | os.PathLike, samples: int = 64) -> float | None:
    """About what share of ``path`` the page cache holds: ``mincore`` on ``samples`` pages
    spread over a mapping of the file that is never touched, so nothing is read or read ahead
    (a read with ``RWF_NOWAIT`` that misses still starts readahead, and on a fast drive the
    next samples then hit). None where the C library or the mapping cannot say."""
    import ctypes
    import mmap

    samples = _check.integer("samples", samples, 1, 1 << 20)
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 1.0
        page = mmap.PAGESIZE
        # a private copy-on-write mapping: writable for ctypes' address, never written
        with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mm:
            view = ctypes.c_char.from_buffer(mm)
            try:
                base = ctypes.addressof(view)
                vec = ctypes.c_ubyte()
                hit = 0
                for i in range(samples):
                    off = (size - 1) * i // max(1, samples - 1) // page * page
                    if mincore(base + off, page, ctypes.byref(vec)) != 0:
                        return None
                    hit += vec.value & 1
                return hit / samples
            finally:
                del view  # the mapping closes only without exports
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


CACHED_SHARE = 0.9  # restore_from_file reads through the page cache above this share
PREFETCH_PIECE = 8 << 20  # prefetch reads this much at a time


def prefetch(path: str | os.PathLike, stop: Any = None) -> dict:
    """Read ``path`` once through the page cache, in order, so that a restore soon after reads it
    from memory (:func:`restore_from_file` then goes through the cache): what a standby process
    does with its archive while it waits. ``stop``: a ``threading.Event``; once set, the read
    ends at the next piece. Returns ``bytes`` (read), ``size``, ``seconds``, ``complete``."""
    t0 = time.monotonic()
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
    done = 0
    try:
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf = bytearray(PREFETCH_PIECE)
        view = memoryview(buf)
        while done < size and not (stop is not None and stop.is_set()):
            n = os.preadv(fd, [view], done)
            if n <= 0:
                break
            done += n
    finally:
        os.close(fd)
    return {"bytes": done, "size": size, "seconds": time.monotonic() - t0,
            "complete": done >= size}


def restore_from_file(path: str | os.PathLike, base: int, ceiling: int, *, target: Target = 0,
                      direct_io: str | None = None,
                      progress: Callable[[int, int], None] | None = None) -> dict:
    """Restore a span file to ``base + offset``, clamped to ``[0, ceiling)``.

    Every chunk's CRC32C is verified before its bytes are copied; a mismatch raises
    :class:`SpanFileError` naming the chunk (that chunk is never written; earlier ones were, so
    fall back to re-running warmup). With ``direct_io`` "auto" a file the page cache holds
    (:func:`page_cache_share` at least ``CACHED_SHARE``: a restart soon after the last read)
    is read through it rather than from the drive. Returns ``bytes``, ``bytes_written``,
    ``bytes_dropped``, ``intervals``, ``direct_io``, ``seconds``.
    """
    path = _check.existing_file("path", path)
    _check_span(base, 0, ceiling, "ceiling")
    target = _target(target)
    direct_io = _direct_io(direct_io)
    if direct_io == "auto":
        share = page_cache_share(path)
        if share is not None and share >= CACHED_SHARE:
            log.info("restore %s: %.0f%% of it is in the page cache: read through it",
                     os.fspath(path), 100 * share)
            direct_io = "off"
    elif direct_io == "off" and log.isEnabledFor(logging.INFO):
        share = page_cache_share(path)  # what a read-ahead left (the harness reports it)
        if share is not None:
            log.info("restore %s: %.0f%% of it is in the page cache as the read begins, read "
                     "through it as asked", os.fspath(path), 100 * share)
    _check.callable_or_none("progress", progress)
    if progress is None:
        progress = progress_logger(f"restore {path}")
    out = dict(_native.span_restore_file(target, path, base, ceiling, direct_io, progress))
    log.info("restored %s: %d bytes written, %d dropped above the ceiling %#x, %.2f s",
             os.fspath(path), out["bytes_written"], out["bytes_dropped"], ceiling, out["seconds"])
    return out


def file_info(path: str | os.PathLike) -> dict:
    """Header and tables of a span file (validated; raises :class:`SpanFileError`)."""
    return dict(_native.span_file_info(_check.existing_file("path", path)))


def verify_file(path: str | os.PathLike, *, direct_io: str | None = None) -> None:
    """Read a span file and check every chunk CRC32C; raises :class:`SpanFileError`."""
    _native.span_verify_file(_check.existing_file("path", path), _direct_io(direct_io))


# ---- restore or re-run warmup ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What THAW does about the warmup gap: ``action`` is ``"restore"`` or ``"rerun-warmup"``."""

    action: str
    reason: str
    path: str | None = None  # the span file to restore (action == "restore")


def span_relpath(rank: int, name: str = WARMUP_SPAN) -> str:
    """Where an archive keeps span ``name`` of ``rank``: ``rank<N>/region/<name>.span``."""
    rank = _check.integer("rank", rank, 0, 999999)
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise ValueError(f"name must be a span name (no '/', not starting with '.'), got {name!r}")
    return f"rank{rank}/region/{name}.span"


def plan_restore(archive, rank: int) -> RestorePlan:
    """Decide whether THAW restores the warmup gap of ``rank`` from ``archive`` (an
    :class:`vitrify.archive.Archive`) or re-runs warmup, and log why.

    ``VITRIFY_WARMUP_RESTORE=0`` forces re-running warmup; an archive without the rank's warmup
    dump falls back to it automatically.
    """
    rank = _check.integer("rank", rank, 0, 999999)
    if not (callable(getattr(archive, "has_file", None)) and hasattr(archive, "files")):
        raise _check.ArgumentTypeError(f"archive must be an opened vitrify.archive.Archive, got "
                                       f"{_check.got(archive)}")
    if not config.settings().warmup_restore:
        plan = RestorePlan("rerun-warmup", "warmup restore is off (VITRIFY_WARMUP_RESTORE=0 or "
                                           "the caller's warmup_restore=False): re-running warmup")
        log.info("rank %d: %s", rank, plan.reason)
        return plan
    rel = span_relpath(rank)
    if not archive.has_file(rel):
        plan = RestorePlan("rerun-warmup",
                           f"archive {archive.path} has no warmup-gap dump for rank {rank} "
                           f"({rel}); re-running warmup instead")
        log.warning("%s", plan.reason)
        return plan
    entry = archive.files[rel]
    plan = RestorePlan("restore", f"archive holds the warmup-gap dump {rel} "
                                  f"({entry['bytes']} bytes)", path=archive.file_path(rel))
    log.info("rank %d: %s", rank, plan.reason)
    return plan


__all__ = [
    "DEFAULT_CHUNK_BYTES", "DEFAULT_GRANULARITY", "HostBackend", "RestorePlan", "ScratchSpan",
    "Snapshot", "SpanFileError", "WARMUP_SPAN", "WEIGHTS_SPAN", "clamp", "dump", "dump_to_file",
    "file_info", "intersect", "merge", "page_cache_share", "plan_restore", "prefetch",
    "progress_logger", "restore",
    "restore_from_file", "span_relpath", "split_aligned", "total_bytes", "verify_file",
]
