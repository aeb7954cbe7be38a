"""The VMM region allocator: device memory at deterministic addresses.

A :class:`Region` reserves one virtual address range ``[base, base + size)`` on a device and maps
physical memory into it at a monotonic cursor. The same sequence of allocations therefore gets
the same addresses in every process that reserves the same base — what FREEZE and THAW rely on.
Freed ranges are unmapped and released; their addresses are never handed out again.

Invariants (numbered) are in ``csrc/src/region/DESIGN.md``. Importing this module never touches
the driver; constructing a Region does.

Example::

    with vitrify.Region(8 << 30) as r:          # base=None: the deterministic base search
        p = r.allocate(1 << 20)               # at r.base
        r.checkpoint("weights")
        with r.paused():                      # ordinary cudaMalloc-like memory, cursor kept
            q = r.allocate(1 << 20)
        r.free(p)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import _check, _native

RegionAddressError = _native.RegionAddressError
RegionAddressError.__doc__ = (
    "The driver would not reserve the exact range asked for (part of it is in use, or it picked "
    "another address). The message names the range and what came back. A RuntimeError."
)

#: The first candidate base of the search (96 TiB + 6 GiB: 2 GiB into a 4 GiB address window, so
#: window starts fall on the window guards, region DESIGN R13) and the end of the search window (127 TiB).
SEARCH_FIRST: int = _native.REGION_SEARCH_FIRST
SEARCH_LIMIT: int = _native.REGION_SEARCH_LIMIT
#: Default chunk size of :meth:`Region.preallocate` (1 GiB: one cuMemMap per GiB).
DEFAULT_PREALLOC_CHUNK: int = _native.REGION_DEFAULT_PREALLOC_CHUNK


def _int(name: str, value: object, *, minimum: int = 0, maximum: int = _check.U64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _check.ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def candidate_bases(size: int) -> list[int]:
    """The bases ``Region(size, base=None)`` tries, in order (pure; no driver needed).

    Candidates are ``SEARCH_FIRST + k * round_up(size, 1 TiB)`` for k = 0, 1, ... (at most 16),
    each range ending at or below ``SEARCH_LIMIT``; the first one the driver reserves exactly wins.
    Empty when ``size`` is larger than the search window.
    """
    return list(_native.region_candidate_bases(_int("size", size, minimum=1)))


class Region:
    """One reserved device address range with physical memory mapped at a monotonic cursor.

    Args:
        size: bytes to reserve; rounded up to the allocation granularity (2 MiB on H200).
        base: the exact start address (a multiple of the granularity), or None for the
            deterministic search over :func:`candidate_bases`. If the driver hands back any other
            address the stray reservation is freed and :class:`RegionAddressError` is raised.
        device: CUDA device ordinal.
        exportable: create every physical chunk exportable as a POSIX file descriptor, so that
            :meth:`export` can hand a span to another process (a trainer writing weights in
            place), which maps it with ``vitrify._native.SharedBuffer.import_fds``. Raises when
            the device or the driver cannot export such memory (R15 in
            ``csrc/src/region/DESIGN.md``).

    Allocation sizes are rounded up to the granularity. Out of space inside the region raises
    ``MemoryError`` with the numbers — never a silent fallback to ordinary memory. Thread-safe.
    Call :meth:`close` (or use ``with``) to unmap and release everything deterministically.
    """

    def __init__(self, size: int, base: int | None = None, device: int = 0,
                 exportable: bool = False):
        _int("size", size, minimum=1)
        if base is not None:
            _int("base", base, minimum=1)
        _int("device", device, maximum=(1 << 31) - 1)
        if not isinstance(exportable, bool):
            raise _check.ArgumentTypeError(
                f"exportable must be a bool, got {type(exportable).__name__} {exportable!r}")
        self._r = _native.Region(base, size, device, exportable=exportable)

    # --- facts --------------------------------------------------------------------------------
    @property
    def base(self) -> int:
        """First address of the reserved range."""
        return self._r.base

    @property
    def size(self) -> int:
        """Reserved bytes (the requested size rounded up to the granularity)."""
        return self._r.size

    @property
    def end(self) -> int:
        """One past the last reserved address."""
        return self._r.base + self._r.size

    @property
    def device(self) -> int:
        """The CUDA device ordinal."""
        return self._r.device

    @property
    def granularity(self) -> int:
        """The driver's allocation granularity (bytes) that sizes and offsets are rounded to."""
        return self._r.granularity

    @property
    def exportable(self) -> bool:
        """True when the region was created with ``exportable=True`` (:meth:`export` works)."""
        return self._r.exportable

    def export(self, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
        """Export the mapped chunks covering ``[offset, offset + nbytes)`` (offsets from ``base``)
        as POSIX file descriptors, for another process to map the span in place.

        Returns ``(offset, size, fd)`` for each whole chunk, ascending; together they cover the
        range (the first may start before ``offset``, the last end after it). Each fd is new and
        close-on-exec: **the caller owns the fds and closes them** (after sending them, e.g. with
        ``socket.send_fds``). The peer maps them as one contiguous range with
        ``vitrify._native.SharedBuffer.import_fds([(fd, size), ...], device)``: chunk i lands at
        the sum of the previous sizes. The region keeps owning its memory; the peer must release
        its import before the region frees or closes the span.

        Raises RuntimeError when the region was created without ``exportable=True`` (or is
        closed), ValueError for ``nbytes`` 0, a range outside the region or a range not wholly
        mapped (naming the first unmapped offset). A failing export closes the fds it made.
        """
        return [(int(o), int(n), int(fd)) for o, n, fd in
                self._r.export_range(_int("offset", offset), _int("nbytes", nbytes, minimum=1))]

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._r.closed

    def contains(self, ptr: int) -> bool:
        """True when ``ptr`` lies in ``[base, end)``."""
        return self.base <= ptr < self.end

    def owns(self, ptr: int) -> bool:
        """True when ``ptr`` is the start of a live allocation of this region (or of an ordinary
        allocation it made while stopped)."""
        return self._r.owns(_int("ptr", ptr))

    # --- allocation ---------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (rounded up to the granularity) at the cursor; returns the address.

        While stopped (:meth:`stop`) the memory comes from the ordinary allocator instead and the
        cursor does not move. Raises ``MemoryError`` when the region has no room left.
        """
        return self._r.allocate(_int("nbytes", nbytes, minimum=1))

    def claim(self, upto: int) -> int:
        """THAW: one allocation covering exactly ``[offset, upto)`` (``upto`` rounded up to the
        granularity), at the cursor even where a window guard lies inside it (a frozen layout
        restored as one block), so restored bytes stay mapped. Returns its address."""
        upto = _int("upto", upto, minimum=1)
        if upto <= self.offset:
            raise ValueError(f"upto {upto} is not above the cursor {self.offset}")
        return self._r.allocate(upto - self.offset, True)

    def allocate_at(self, offset: int, nbytes: int) -> int:
        """THAW: reproduce a frozen allocation at ``offset`` (a multiple of the granularity, at
        or above the cursor): the cursor moves there (releasing idle chunks it skips, like
        :meth:`set_offset`) and ``nbytes`` are allocated exactly there. Returns the address."""
        offset = _int("offset", offset)
        nbytes = _int("nbytes", nbytes, minimum=1)
        if offset < self.offset:
            raise ValueError(f"offset {offset} is below the cursor {self.offset} (the cursor only "
                             f"moves forward)")
        if offset > self.offset:
            self.set_offset(offset)
        return self._r.allocate(nbytes, True)

    def free(self, ptr: int) -> None:
        """Free the allocation starting at ``ptr``. Its physical memory is released once every
        allocation sharing its chunk is freed; its addresses are never reused."""
        self._r.free(_int("ptr", ptr))

    def stop(self) -> bool:
        """Route later allocations to the ordinary allocator (cursor untouched); returns whether
        the region was already stopped."""
        return self._r.stop()

    def resume(self) -> bool:
        """Allocate from the region again; returns whether it was stopped."""
        return self._r.resume()

    @property
    def stopped(self) -> bool:
        """True between :meth:`stop` and :meth:`resume`."""
        return self._r.stopped

    # --- physical memory given back and taken again (R17) ------------------------------------
    def release_memory(self, offset: int, nbytes: int, keep: bool = False) -> int:
        """Give the physical memory behind the chunks of ``[offset, offset + nbytes)`` (region
        offsets) back to the driver and keep their addresses: the reservation, the cursor, the
        live allocations and the checkpoints stay, so a graph captured against them replays
        once :meth:`restore_memory` has mapped memory there again. The range covers whole
        chunks (``ValueError`` naming a chunk it cuts); chunks released already are skipped.
        ``keep``: each chunk's bytes are first copied to pinned host memory, for the restore (a
        failing copy leaves everything mapped). Nothing may read or write the range meanwhile
        (:meth:`read`/:meth:`write` refuse; a GPU kernel would fault). Returns the bytes
        released."""
        offset = _int("offset", offset)
        nbytes = _int("nbytes", nbytes, minimum=1)
        return self._r.release_memory(offset, nbytes, _check.boolean("keep", keep))

    def restore_memory(self, offset: int, nbytes: int) -> int:
        """Map new physical memory at the same addresses for every released chunk of
        ``[offset, offset + nbytes)`` and copy back what :meth:`release_memory` kept (zeros
        where it kept nothing); all or nothing. Returns the bytes restored."""
        return self._r.restore_memory(_int("offset", offset), _int("nbytes", nbytes, minimum=1))

    def released(self) -> list[tuple[int, int, bool]]:
        """``(offset, size, kept)`` of each chunk released now, ascending."""
        return [tuple(c) for c in self._r.released()]

    @contextlib.contextmanager
    def paused(self) -> Iterator[Region]:
        """Context manager: stopped inside, the previous state restored on exit."""
        was = self._r.stop()
        try:
            yield self
        finally:
            if not was and not self._r.closed:
                self._r.resume()

    # --- cursor -------------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        """The cursor: the offset from ``base`` of the next region allocation."""
        return self._r.offset

    def set_offset(self, offset: int) -> None:
        """Move the cursor forward to ``offset`` (a multiple of the granularity, at most
        ``size``). Moving it backwards is a ``ValueError``. Idle chunks skipped over are
        released — including preallocated ones, with whatever was written into them. To keep
        bytes restored into ``[cursor, offset)`` (THAW), claim the range with
        :meth:`claim` instead."""
        self._r.set_offset(_int("offset", offset))

    def preallocate(self, upto: int, chunk_bytes: int = DEFAULT_PREALLOC_CHUNK) -> int:
        """Map physical memory for ``[offset, upto)`` now, in chunks of ``chunk_bytes`` (all or
        nothing), so later allocations below ``upto`` are a pointer bump. Returns the bytes newly
        mapped (0 when already mapped)."""
        return self._r.preallocate(_int("upto", upto), _int("chunk_bytes", chunk_bytes, minimum=1))

    def checkpoint(self, name: str) -> int:
        """Record the cursor under ``name`` (unique per region) and return it, so FREEZE and THAW
        can compare their trajectories."""
        _check.string("checkpoint name", name)
        return self._r.checkpoint(name)

    @property
    def checkpoints(self) -> dict[str, int]:
        """Recorded checkpoints, name -> offset, in recording order."""
        return dict(self._r.checkpoints())

    def live_allocations(self) -> list[tuple[int, int]]:
        """The live allocations of the region as ``(offset, size)`` pairs, ascending offsets
        (ordinary allocations made while stopped are not in the region and not listed). Graph
        capture uses them to tell pointers from integers (``vitrify.graph.GraphStore``)."""
        return [(int(o), int(n)) for o, n in self._r.live_allocations()]

    def read_allocations(self) -> list[tuple[int, bytes]]:
        """``(offset, bytes)`` of every live allocation, ascending: a region's contents for tests
        and benchmarks (engines dump spans with :mod:`vitrify.snapshot`, which streams and
        checksums). :meth:`restore_allocations` puts them back, at this base or another."""
        return [(o, self.read(self.base + o, n)) for o, n in self.live_allocations()]

    def restore_allocations(self, parts: list[tuple[int, bytes]]) -> None:
        """Allocate each ``(offset, data)`` of :meth:`read_allocations` where it was
        (:meth:`allocate_at`: ascending offsets, at or above the cursor) and write its bytes."""
        for offset, data in _check.sequence("parts", parts):
            ptr = self.allocate_at(offset, len(data))
            self.write(ptr, data)

    def stats(self) -> dict:
        """``reserved``, ``mapped``, ``cursor``, ``frontier``, ``chunks``, ``live_allocations``,
        ``live_bytes``, totals (``allocations_total``, ``frees_total``, ``chunks_created``,
        ``chunks_released``), ``fallback_live``/``fallback_bytes`` (ordinary allocations made
        while stopped), ``released_chunks``/``released_bytes``/``kept_bytes`` (chunks whose
        memory :meth:`release_memory` gave back; ``mapped`` leaves them out), ``stopped``,
        ``base``, ``device``, ``granularity``."""
        return dict(self._r.stats())

    # --- data ---------------------------------------------------------------------------------
    def write(self, ptr: int, data: bytes) -> None:
        """Copy ``data`` to ``ptr`` (synchronous); the range must lie in one live allocation."""
        ptr = _int("ptr", ptr)
        if isinstance(data, str):
            raise _check.ArgumentTypeError(f"data must be bytes-like, got {_check.got(data)} "
                                           f"(encode it first)")
        try:
            raw = data if isinstance(data, bytes) else memoryview(data).tobytes()
        except TypeError:
            raise _check.ArgumentTypeError(f"data must be bytes-like, got {_check.got(data)}") \
                from None
        self._r.write(ptr, raw)

    def read(self, ptr: int, nbytes: int) -> bytes:
        """Copy ``nbytes`` from ``ptr`` (synchronous); the range must lie in one live allocation."""
        return self._r.read(_int("ptr", ptr), _int("nbytes", nbytes, minimum=1))

    # --- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap and release all memory and the reservation (idempotent). Anything still
        pointing into the region (tensors included) becomes invalid.

        The torch ``MemPool`` objects of :mod:`vitrify.integrations.torch` for this region (the
        routed pool and the capture pool, if any) are dropped first, so torch hands their cached
        segments back before the unmapping."""
        for key in ("_vitrify_torch_pool", "_vitrify_capture_pool"):
            pool = self.__dict__.pop(key, None)
            del pool  # torch's MemPool destructor empties its cache through vitrify_region_free
        r = getattr(self, "_r", None)
        if r is not None:
            r.close()

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a fallback only; call close()
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if getattr(self, "_r", None) is None:
            return "Region(<not constructed>)"
        state = "closed" if self.closed else f"offset={self.offset:#x}"
        return f"Region({self._r.describe()}, {state})"


class WindowDrift(ValueError):
    """THAW: the region's cursor is not where FREEZE's was when a recorded window began (the
    allocations before it differed), so the window cannot be reproduced; names both offsets."""


@dataclasses.dataclass(frozen=True)
class AllocationWindow:
    """What a stretch of FREEZE allocated in a region: the cursor before and after, and the
    allocations made in it still live at its end (``(offset, size)``, ascending). THAW
    reproduces it with :func:`replay_window` where the work that allocated it is skipped (an
    engine's graph capture), so everything allocated afterwards lands where it did at FREEZE."""

    start: int
    end: int
    live: tuple[tuple[int, int], ...]

    def to_json(self) -> dict:
        return {"start": self.start, "end": self.end, "live": [list(a) for a in self.live]}

    @classmethod
    def from_json(cls, d: Any) -> AllocationWindow:
        try:
            start, end = int(d["start"]), int(d["end"])
            live = tuple((int(o), int(n)) for o, n in d["live"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an allocation window: {d!r:.200} ({e})") from None
        if not 0 <= start <= end or any(not (start <= o and n > 0 and o + n <= end)
                                        for o, n in live) or list(live) != sorted(live):
            raise ValueError(f"allocation window [{start}, {end}) with allocations {live!r:.200} "
                             f"is inconsistent")
        return cls(start, end, live)


@contextlib.contextmanager
def record_window(region: Region) -> Iterator[list[AllocationWindow]]:
    """FREEZE: record what the block allocates in ``region``; the yielded list holds the
    :class:`AllocationWindow` once the block has finished (nothing when it raised)."""
    start = region.offset
    out: list[AllocationWindow] = []
    yield out
    end = region.offset
    out.append(AllocationWindow(start, end, tuple((o, n) for o, n in region.live_allocations()
                                                   if o >= start)))


def replay_window(region: Region, window: AllocationWindow, what: str = "window") -> list[int]:
    """THAW: allocate what ``window`` held at FREEZE, at the same offsets, without running the
    work that allocated it; returns the addresses. The cursor must be at ``window.start``
    (:class:`WindowDrift` naming ``what`` and both offsets otherwise) and ends at ``window.end``."""
    if region.offset != window.start:
        raise WindowDrift(f"{what}: the region's cursor is at {region.offset} bytes here but was "
                          f"at {window.start} bytes at FREEZE ({region.offset - window.start:+d}): "
                          f"the allocations before it differ, so it cannot be reproduced")
    addrs = [region.allocate_at(o, n) for o, n in window.live]
    if region.offset < window.end:
        region.set_offset(window.end)
    if region.offset != window.end:
        raise WindowDrift(f"{what}: reproduced, the cursor is at {region.offset} bytes but was at "
                          f"{window.end} bytes at FREEZE (a granularity or guard difference)")
    return addrs


def save_allocations(region: Region, directory: str | os.PathLike) -> int:
    """Write every live allocation of ``region`` into ``directory`` (``allocations.json``: the
    offsets and sizes, ``allocations.bin``: the bytes); returns the bytes written. For tests and
    benchmarks: engines dump spans with :mod:`vitrify.snapshot`."""
    d = Path(directory)
    parts = region.read_allocations()
    (d / "allocations.json").write_text(json.dumps([[o, len(b)] for o, b in parts]))
    (d / "allocations.bin").write_bytes(b"".join(b for _, b in parts))
    return sum(len(b) for _, b in parts)


def load_allocations(region: Region, directory: str | os.PathLike) -> None:
    """Put what :func:`save_allocations` wrote back into ``region`` where it was
    (:meth:`Region.restore_allocations`), at its base or another."""
    d = Path(directory)
    raw, pos, parts = (d / "allocations.bin").read_bytes(), 0, []
    for o, n in json.loads((d / "allocations.json").read_text()):
        parts.append((o, raw[pos:pos + n]))
        pos += n
    if pos != len(raw):
        raise ValueError(f"{d / 'allocations.bin'} holds {len(raw)} bytes, the index {pos}")
    region.restore_allocations(parts)


__all__ = ["AllocationWindow", "DEFAULT_PREALLOC_CHUNK", "Region", "RegionAddressError",
           "SEARCH_FIRST", "SEARCH_LIMIT", "WindowDrift", "candidate_bases", "load_allocations",
           "record_window", "replay_window", "save_allocations"]
