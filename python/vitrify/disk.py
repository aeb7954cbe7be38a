"""The O_DIRECT disk tier: content-addressed pages in preallocated slab files.

API summary
-----------
``DiskStore(dirs, budget_bytes, kinds, *, name="vitrify", cold_start="clear", direct_io=None,
write_threads=2, read_threads=2, queue_capacity=64, max_batch=32, gc_high=0.90, gc_low=0.85,
load_threads=0, mode="write", tier="disk", engine="auto", queue_depth=64)`` (``tier="host"``:
the host tier, see :mod:`vitrify.tier`)

==========================================  ===================================================
``put(key, data, kind=None) -> bool``        store one page (True: stored or already present)
``batch_put(keys, datas, kind=None)``        -> list[bool], one acknowledgement per page
``put_async(keys, datas, kind=None)``        -> :class:`PutTicket` (``wait()``, ``done()``)
``get(key, kind=None)``                      -> bytes, or None on a miss
``batch_get(keys, kind=None)``               -> list[bytes | None]
``get_into(key, out, kind=None)``            read into a writable buffer -> length | None
``batch_get_into(keys, outs, kind=None)``    -> list[int | None]
``exists / batch_exists / size_of``          index look-ups, no I/O
``delete(key) / batch_delete(keys)``         -> bool / list[bool]
``mark_clean(keys) / dirty_keys()``          host tier: write-back pages (``dirty=True`` puts)
``buffer(kind=None)``                        a :class:`SlotBuffer` (zero-copy staging)
``put_buffers(keys, bufs, sizes, kind)``     write slot buffers as they are (no copy)
``put_buffers_async(...)``                   -> :class:`PutTicket`
``get_buffers(keys, bufs, kind=None)``       read straight into slot buffers -> list[int|None]
``get_buffers_async(...)``                   -> :class:`GetTicket`
``PageMover(store, chunk, kind=None)``       host KV pages <-> the store, one native call a batch
``stats()``                                  occupancy, spills, reloads, GC, errors, queues
``prometheus_collector()``                   a prometheus_client collector (if installed)
``clear()``                                  drop every page (files and threads stay open)
``refresh(min_interval=0.0)``                a reader picks up the writer's later pages
``close()`` / ``with DiskStore(...) as s``   drain the I/O threads and close the files
``engine``                                   the slot-transfer engine in use (read-only)
==========================================  ===================================================

I/O engines (DESIGN.md D25): ``engine="auto"`` (default) moves slot bytes with io_uring where
the kernel grants it, else Linux native AIO, else synchronous ``pread``/``pwrite`` ("psync"),
probed when the store opens (a container's seccomp filter often refuses io_uring; the fallback
is logged at DEBUG on the ``vitrify.disk`` logger). ``"io_uring"``, ``"aio"`` or ``"psync"``
asks for one engine: a kernel that refuses it raises :class:`EngineUnavailableError` (an
``OSError`` with the kernel's errno), one line naming the engine and the errno. With io_uring
or aio each I/O thread has a whole batch in flight at once (a write thread its group-commit
batch, a read thread up to ``queue_depth`` queued reads). Every engine writes and reads the
same bytes: slot images, checksums and files are identical. Test hook: the environment
variable ``VITRIFY_DISK_ENGINE_DENY`` (comma-separated engine names) makes the named engines
refuse with ``EPERM`` as a seccomp filter would.

Keys are ``str`` or bytes-like; :func:`make_key` maps each to 32 bytes as
``SHA-256(b"vitrify-disk-key\\0" + key)`` (a ``str`` is UTF-8 encoded first, so ``"ab"`` and
``b"ab"`` are the same key). Distinct keys never share a slot: the full 256-bit key is stored in
each slot header and compared on every read. Data is any C-contiguous buffer (bytes, bytearray,
memoryview, numpy array, CPU torch tensor); its raw bytes are stored.

Every call that does I/O releases the GIL. Reads verify the slot (header CRC, slab id, slot
index, key, length, payload CRC32C); anything that does not verify is a miss (None), never an
exception and never wrong bytes. A put is acknowledged only after its slot was written and
fdatasync'd and the index entry exists. When a kind is 90 % full the write thread evicts the
least recently used pages down to 85 %; a put into a pool that is still full returns False and
is counted in ``stats()["put_failures"]``.

Zero-copy: ``buf = store.buffer(kind)`` is a 4 KiB-aligned slot image; gather the page into
``buf.view()`` (a writable memoryview of ``buf.capacity`` bytes) and ``put_buffers`` writes it
with one O_DIRECT transfer; ``get_buffers`` reads a slot straight into it. A buffer passed to
``put_buffers_async`` must not be modified until its ticket is done.

Files: ``<dir>/<name>.kind<i>.slab``, one per payload kind and directory ("drive"); the budget is
split across kinds by their shares and evenly across drives. ``cold_start="load"`` rebuilds the
index from the slab headers this store wrote; a slab of another store or geometry (kinds, page
size, budget, drives) is refused with ``ValueError`` naming the on-disk and the requested values,
its pages untouched. Only ``"clear"`` wipes: it starts empty and leaves old bytes inert.

One owner per slab file: an open store holds an exclusive lock on each of its slab files (an OFD
lock, ``fcntl(F_OFD_SETLK)``; ``flock`` where the kernel has no OFD locks) from before it reads
or writes them until ``close()``. Opening a store whose slab file another open store holds — in
this process or another — raises :class:`SlabLockedError` (an ``OSError``, errno ``EBUSY``)
naming the file and the holder's process id and host, read from ``<slab>.owner`` (the record the
holder writes after taking the lock), and leaves nothing locked. The kernel drops the lock when
the holder's files close, so a holder that died (even by SIGKILL) never blocks a restart: open
it again with ``cold_start="load"`` to find every page whose put was acknowledged.

Readers (``mode="read"``): any number of stores may open the slab files another open store (the
one writer, in this process or another) writes, read-only: ``O_RDONLY``, no lock, nothing ever
written, truncated, formatted or reclaimed. The slabs must exist and carry this store's header
(same name, kinds, budget and directories as the writer's), otherwise ``FileNotFoundError`` /
``ValueError``. A reader indexes what the slab headers held when it opened; ``refresh()`` scans
them again, so pages the writer committed later become visible and pages it evicted or cleared
disappear (DESIGN.md D14): a page deleted before a refresh starts (``delete`` zeroes its slot
before it returns), or evicted by a batch of puts acknowledged before it starts, is not found.
Between refreshes the reader's index may still name such a page; reading it is then a miss. A
page the writer overwrites while a reader reads it is a miss, never wrong bytes. Puts, deletes and ``clear()`` on a reader raise ``OSError`` (errno ``EROFS``).
"""

from __future__ import annotations

import atexit
import errno as _errno
import hashlib
import logging
import math
import os
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import _check, _native, config
from . import host as _host

_log = logging.getLogger("vitrify.disk")

KEY_BYTES: int = _native.DISK_KEY_BYTES
SLOT_HEADER_BYTES: int = _native.DISK_SLOT_HEADER_BYTES
_FILE_HEADER_BYTES: int = _native.DISK_FILE_HEADER_BYTES

_KEY_PREFIX = b"vitrify-disk-key\0"
#: The largest page (payload) size of one kind (a slot's length field is 32-bit).
_MAX_PAGE_BYTES = (1 << 32) - 4096
_STORED, _DUPLICATE = 0, 1

#: Raised by :class:`DiskStore` when another open store holds one of its slab files. An
#: ``OSError`` (errno ``EBUSY``) with attributes ``path`` (the slab file), ``holder_pid`` and
#: ``holder_host`` (None when the holder left no owner record, or its record still names a
#: process of this host that has exited: the holder is alive but has not written its own yet).
SlabLockedError = _native.SlabLockedError
#: Raised by a host-tier store (:class:`vitrify.tier.HostStore`) whose directory has too little
#: free memory for its slabs: an ``OSError`` (errno ``ENOSPC``), one line naming the mount, the
#: bytes needed and free, with attributes ``mount``, ``needed_bytes`` and ``free_bytes``. Nothing
#: was grown and nothing the open created is left, so a caller may go on without the host tier
#: (or open a smaller one: at most ``free_bytes`` more).
HostSpaceError = _native.HostSpaceError
#: The values of ``DiskStore(engine=...)``; :attr:`DiskStore.engine` reports which one runs.
ENGINES = ("auto", "io_uring", "aio", "psync")
PUT_RESULTS = {0: "stored", 1: "duplicate", 2: "full", 3: "error", 4: "cancelled"}


class EngineUnavailableError(OSError):
    """The kernel refused the I/O engine a :class:`DiskStore` asked for (``engine=...``): an
    ``OSError`` with the kernel's errno (``EPERM``, ``ENOSYS``, ``ENOMEM``, ``EAGAIN``) and
    attribute ``engine``; the message is one line naming the engine, the call and the errno.
    ``engine="auto"`` never raises it: it takes the next engine."""

    def __init__(self, err: int | None, message: str, engine: str) -> None:
        super().__init__(err if err is not None else _errno.EPERM, message)
        self.engine = engine


def make_key(key: str | bytes | bytearray | memoryview, what: str = "key") -> bytes:
    """The 32-byte store key of ``key``: SHA-256 over a fixed prefix and the key's bytes."""
    if isinstance(key, str):
        data = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        data = bytes(key)
    else:
        raise _check.ArgumentTypeError(f"{what} must be a str or bytes-like, got {_check.got(key)}")
    return hashlib.sha256(_KEY_PREFIX + data).digest()


def slot_bytes_for(page_bytes: int) -> int:
    """Bytes one slot of ``page_bytes`` payload takes on disk (header + payload, 4 KiB rounded)."""
    return _native.disk_slot_bytes_for(_check.integer("page_bytes", page_bytes, 0, _MAX_PAGE_BYTES))


class SlotBuffer:
    """A 4 KiB-aligned slot image for one payload kind, for zero-copy puts and gets.

    ``view()`` is a writable memoryview of ``capacity`` payload bytes (wrap it with
    ``numpy.frombuffer(buf.view(), dtype=numpy.uint8)`` to gather into it). ``address`` is the
    payload's address for native copy routines.
    """

    __slots__ = ("_b", "kind_name")

    def __init__(self, native: Any, kind_name: str) -> None:
        self._b = native
        self.kind_name = kind_name

    @property
    def capacity(self) -> int:
        return self._b.capacity

    @property
    def address(self) -> int:
        return self._b.address

    def view(self) -> memoryview:
        return self._b.view()


class PutTicket:
    """Acknowledgements of one submitted batch of puts: ``wait()`` -> list[bool]."""

    __slots__ = ("_t", "_keep", "_results")

    def __init__(self, ticket: Any, keep: Any = None) -> None:
        self._t = ticket
        self._keep = keep  # Python objects whose memory the batch uses
        self._results: list[int] | None = None

    def done(self) -> bool:
        return self._t.done()

    def wait_results(self) -> list[str]:
        """Per-page outcome names: stored, duplicate, full, error, cancelled."""
        if self._results is None:
            self._results = list(self._t.wait())
            self._keep = None
        return [PUT_RESULTS[r] for r in self._results]

    def wait(self) -> list[bool]:
        """Block until every page is acknowledged; True where the page is in the store."""
        return [r in ("stored", "duplicate") for r in self.wait_results()]


class GetTicket:
    """Completion of one submitted batch of reads: ``wait()`` -> list[int | None] (lengths)."""

    __slots__ = ("_t", "_keep", "_results")

    def __init__(self, ticket: Any, keep: Any = None) -> None:
        self._t = ticket
        self._keep = keep
        self._results: list[int | None] | None = None

    def done(self) -> bool:
        return self._t.done()

    def wait(self) -> list[int | None]:
        if self._results is None:
            self._results = [n if n >= 0 else None for n in self._t.wait()]
            self._keep = None
        return self._results


def _parse_kinds(kinds: int | Mapping[str, Any]) -> tuple[list[str], list[int], list[float]]:
    if isinstance(kinds, bool) or not isinstance(kinds, (int, Mapping)):
        raise _check.ArgumentTypeError(f"kinds must be a page size in bytes (int) or a mapping name -> page "
                        f"size, got {_check.got(kinds)}")
    if isinstance(kinds, int):
        kinds = {"default": _check.integer("kinds (page size)", kinds, 1, _MAX_PAGE_BYTES)}
    if not kinds:
        raise ValueError("kinds must be a positive page size or a non-empty mapping, got {}")
    names, pages, shares = [], [], []
    for name, spec in kinds.items():
        if not isinstance(name, str) or not name:
            raise _check.ArgumentTypeError(f"kinds: kind names must be non-empty str, got {_check.got(name)}")
        if isinstance(spec, (tuple, list)):
            if len(spec) != 2:
                raise ValueError(f"kinds[{name!r}]: expected (page_bytes, share), got {spec!r}")
            page, share = spec
        else:
            page, share = spec, 1.0
        page = _check.integer(f"kinds[{name!r}] page_bytes", page, 1, _MAX_PAGE_BYTES)
        share = _check.number(f"kinds[{name!r}] share", share, 0.0, None, lo_open=True)
        names.append(name)
        pages.append(page)
        shares.append(share)
    return names, pages, shares


def _slot_buffers(keys: list, buffers: Sequence[SlotBuffer], kind_name: str) -> tuple[list, list]:
    """``keys`` and ``buffers`` as lists, checked to pair up one SlotBuffer of the kind per key."""
    buffers = _check.sequence("buffers", buffers)
    if len(keys) != len(buffers):
        raise ValueError(f"keys and buffers differ in length: {len(keys)} keys, "
                         f"{len(buffers)} buffers")
    for i, b in enumerate(buffers):
        if not isinstance(b, SlotBuffer):
            raise _check.ArgumentTypeError(f"buffers[{i}] must be a SlotBuffer, got {_check.got(b)}")
        if b.kind_name != kind_name:
            raise ValueError(f"buffers[{i}] is a buffer of kind {b.kind_name!r}, not of kind "
                             f"{kind_name!r}")
    return keys, buffers


#: The most slots one slab file holds (a slot header's index field is 32-bit).
_MAX_SLOTS_PER_SLAB = 0xFFFFFFFF


def budget_range(drives: int, pages: Sequence[int], shares: Sequence[float]) -> tuple[int, int]:
    """The valid ``budget_bytes`` of a store with these kinds (page sizes and shares) on
    ``drives`` directories: every kind must get at least one slot plus its file header per
    drive, and at most ``2**32 - 1`` slots (what one slab file indexes). The split is the
    native one (``budget * share / sum(shares) / drives``, in doubles)."""
    total = sum(shares)
    lo, hi = 1, _check.I64_MAX
    for page, share in zip(pages, shares):
        slot = slot_bytes_for(page)
        scale = drives * total / share
        lo = max(lo, math.ceil((_FILE_HEADER_BYTES + slot) * scale))
        hi = min(hi, math.ceil((_FILE_HEADER_BYTES + (_MAX_SLOTS_PER_SLAB + 1) * slot) * scale) - 1)
    return lo, hi


def _check_budget(budget_bytes: int, drives: int, names: list[str], pages: list[int],
                  shares: list[float]) -> None:
    """Every kind must get at least one slot (plus its file header), and at most 2**32 - 1
    slots, on every drive: one line naming budget_bytes, its value and the valid range."""
    total = sum(shares)
    lo, hi = budget_range(drives, pages, shares)
    where = (f"budget_bytes must be in [{lo}, {hi}] for these kinds and {drives} "
             f"{'drive' if drives == 1 else 'drives'}")
    for name, page, share in zip(names, pages, shares):
        per_drive = int(budget_bytes * share / total / drives)
        slot = slot_bytes_for(page)
        if per_drive < _FILE_HEADER_BYTES + slot:
            raise ValueError(f"budget_bytes={budget_bytes} leaves kind {name!r} {per_drive} bytes "
                             f"per drive, less than one {slot}-byte slot plus a "
                             f"{_FILE_HEADER_BYTES}-byte header: {where}")
        slots = (per_drive - _FILE_HEADER_BYTES) // slot
        if slots > _MAX_SLOTS_PER_SLAB:
            raise ValueError(f"budget_bytes={budget_bytes} gives kind {name!r} {slots} slots of "
                             f"{slot} bytes per drive, more than the {_MAX_SLOTS_PER_SLAB} one "
                             f"slab file holds: {where}")


#: Every DiskStore (and HostStore) not closed yet: the atexit hook below closes them (queued
#: writes drained, slab locks released) while the interpreter and the native stores still live,
#: instead of leaving the native objects to the interpreter's teardown.
_open_stores: weakref.WeakSet[DiskStore] = weakref.WeakSet()


@atexit.register
def _close_stores_at_exit() -> None:
    for s in list(_open_stores):
        try:
            s.close()
        except Exception:  # never an exception out of an atexit hook
            pass


def _missing_dirs(path: str) -> list[str]:
    """The directories ``os.makedirs(path)`` would create, outermost first."""
    out = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        out.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return out[::-1]


def _remove_empty_dirs(made: Sequence[str]) -> None:
    """Undo the directories a failed open made (innermost first), where they are still empty."""
    for p in reversed(made):
        try:
            os.rmdir(p)
        except OSError:
            return


def _nbytes(data: Any) -> int:
    if hasattr(data, "data_ptr") and hasattr(data, "element_size"):  # a torch tensor
        return data.numel() * data.element_size()
    return memoryview(data).nbytes


class DiskStore:
    """Content-addressed pages in O_DIRECT slab files (see the module docstring for the API).

    Args:
        dirs: a directory or a list of directories, one per drive (created if missing).
        budget_bytes: disk bytes for all slab files together.
        kinds: a page size in bytes (one kind, "default"), or a mapping from kind name to page
            size or to ``(page_size, share)``; the budget is split by share.
        name: the store's name: file names and the identity checked by ``cold_start="load"``.
        cold_start: ``"clear"`` (start empty) or ``"load"`` (rebuild from the slab headers;
            ``ValueError`` naming both geometries when a slab was written with another one).
        direct_io: ``"auto"``, ``"on"`` or ``"off"``; None reads ``VITRIFY_DIRECT_IO``.
        write_threads, read_threads: I/O threads per drive.
        queue_capacity: jobs per drive queue before submitters wait.
        max_batch: writes per fdatasync on one write thread (group commit).
        gc_high, gc_low: GC starts at ``gc_high`` occupancy and evicts down to ``gc_low``.
        load_threads: threads scanning each slab's slot headers for ``cold_start="load"``
            and ``refresh()`` (0: the default, 8; 1: one header read after another).
        mode: ``"write"`` (the owner: locks the slabs) or ``"read"`` (a reader of the slabs an
            open writer owns; see the module docstring). A reader always loads (``cold_start``
            must be None or ``"load"``) and never creates a directory or file.
        tier: ``"disk"`` (slab files on drives, O_DIRECT as ``direct_io`` says) or ``"host"``
            (the host tier: ``dirs`` on tmpfs or hugetlbfs, slab files created ``0600`` and
            mapped, pages copied with memcpy, space checked first; see
            :class:`vitrify.tier.HostStore` and DESIGN.md H1-H9).
        register_device: host tier only: register the slab mappings with this CUDA device
            (``cuMemHostRegister``, in parallel ranges; :meth:`registration` reports the time),
            so a GPU can copy pages straight out of them (None: not registered).
        register_threads: threads registering the ranges.
        engine: how slot bytes move (module docstring, "I/O engines"): ``"auto"`` (io_uring,
            else aio, else psync, as the kernel grants), ``"io_uring"``, ``"aio"`` or
            ``"psync"``. The host tier copies in its mapping: ``"auto"`` or ``"psync"`` only.
        queue_depth: io_uring / aio: transfers in flight per I/O thread (1 to 4096).

    Raises:
        EngineUnavailableError: the kernel refused the ``engine`` asked for (an ``OSError``
            with its errno, e.g. ``EPERM`` from a seccomp filter, ``ENOSYS``); nothing was
            left behind.
        SlabLockedError: another open store (this process or another) holds one of the slab
            files ``<dir>/<name>.kind<i>.slab``; nothing was read, written or left locked.
        OSError: a symbolic link (``ELOOP``) or anything but a regular file (``EINVAL``) at a
            slab path, one line naming it (links are never followed: their targets stay
            untouched); any other failing system call, naming the call, the file and errno
            (``ENOSPC`` when the drive cannot hold the slabs). A failed open removes the slab
            files and directories it created and gives back the space it took (DESIGN.md D22).
        ValueError: ``budget_bytes`` out of range for the kinds and drives (one line naming
            the valid range, :func:`budget_range`).
    """

    def __init__(self, dirs: str | os.PathLike | Sequence[str | os.PathLike], budget_bytes: int,
                 kinds: int | Mapping[str, Any], *, name: str = "vitrify",
                 cold_start: str | None = None, direct_io: str | None = None,
                 write_threads: int = 2, read_threads: int = 2, queue_capacity: int = 64,
                 max_batch: int = 32, gc_high: float = 0.90, gc_low: float = 0.85,
                 load_threads: int = 0, mode: str = "write", tier: str = "disk",
                 register_device: int | None = None, register_threads: int = 8,
                 engine: str = "auto", queue_depth: int = 64) -> None:
        self._s = None
        self._last_refresh = 0.0
        if isinstance(dirs, (str, os.PathLike)):
            dirs = [dirs]
        dirs = [_check.path(f"dirs[{i}]", d) for i, d in enumerate(_check.sequence("dirs", dirs))]
        if not dirs:
            raise ValueError("dirs must name at least one directory, got an empty list")
        if len(set(os.path.realpath(d) for d in dirs)) != len(dirs):
            raise ValueError(f"dirs must be distinct directories, got {dirs!r}")
        budget_bytes = _check.integer("budget_bytes", budget_bytes, 1, _check.I64_MAX)
        mode = _check.choice("mode", mode, ("write", "read"))
        tier = _check.choice("tier", tier, ("disk", "host"))
        if cold_start is None:
            cold_start = "load" if mode == "read" else "clear"
        cold_start = _check.choice("cold_start", cold_start, ("clear", "load"))
        if mode == "read" and cold_start != "load":
            raise ValueError("a read-only store (mode=\"read\") always loads; cold_start must be "
                             f"None or \"load\", got {cold_start!r}")
        if direct_io is None:
            direct_io = config.settings().direct_io if tier == "disk" else "off"
        direct_io = _check.choice("direct_io", direct_io, _native.DIRECT_IO_MODES)
        if tier == "host" and direct_io == "on":
            raise ValueError("direct_io=\"on\" does not apply to the host tier (its slabs are "
                             "mapped); pass None, \"auto\" or \"off\"")
        name = _check.string("name", name)
        if "/" in name:
            raise ValueError(f"name must be a non-empty str without '/', got {name!r}")
        gc_high = _check.number("gc_high", gc_high, 0.0, 1.0, lo_open=True)
        gc_low = _check.number("gc_low", gc_low, 0.0, 1.0, lo_open=True)
        if not gc_low < gc_high:
            raise ValueError(f"gc_low must be below gc_high, got gc_low={gc_low!r} "
                             f"gc_high={gc_high!r}")
        load_threads = _check.integer("load_threads", load_threads, 0, 256)
        if register_device is not None:
            if tier != "host":
                raise ValueError("register_device applies to the host tier only (tier=\"host\"): "
                                 "a disk store's slabs are not in memory")
            register_device = _check.integer("register_device", register_device, 0, 1 << 16)
        register_threads = _check.integer("register_threads", register_threads, 1, 256)
        engine = _check.choice("engine", engine, ENGINES)
        if tier == "host" and engine not in ("auto", "psync"):
            raise ValueError(f"engine={engine!r} does not apply to the host tier (its slots are "
                             "copied in its mapping); pass \"auto\" or \"psync\"")
        queue_depth = _check.integer("queue_depth", queue_depth, 1, 4096)
        threads = {n: _check.integer(n, v, 1, hi) for n, v, hi in (
            ("write_threads", write_threads, 256), ("read_threads", read_threads, 256),
            ("queue_capacity", queue_capacity, 1 << 20), ("max_batch", max_batch, 1 << 16))}
        self.kind_names, pages, shares = _parse_kinds(kinds)
        _check_budget(budget_bytes, len(dirs), self.kind_names, pages, shares)
        self._kind_index = {n: i for i, n in enumerate(self.kind_names)}
        made: list[str] = []  # directories this open creates (removed again if it fails)
        if mode == "write":
            for i, d in enumerate(dirs):
                missing = _missing_dirs(d)
                _check.directory_to_create(f"dirs[{i}]", d)
                made += missing
        self.name = name
        self.dirs = dirs
        self.mode = mode
        self.tier = tier
        # the D25 test hook, from vitrify.config (the core reads no VITRIFY_* variable)
        _native.disk_set_denied_engines(config.settings().disk_engine_deny or "")
        try:
            self._s = _native.DiskStore(
                dirs, budget_bytes, pages, shares, name, cold_start, direct_io,
                threads["write_threads"], threads["read_threads"], threads["queue_capacity"],
                threads["max_batch"], gc_high, gc_low, load_threads, read_only=mode == "read",
                host=tier == "host",
                register_device=-1 if register_device is None else register_device,
                register_threads=register_threads, engine=engine, queue_depth=queue_depth)
        except OSError as e:
            _remove_empty_dirs(made)  # the native open removed the files it made (D22)
            if "disk engine" in str(e) and "is not available" in str(e):
                raise EngineUnavailableError(e.errno, e.strerror or str(e), engine) from None
            raise
        except BaseException:
            _remove_empty_dirs(made)  # the native open removed the files it made (D22)
            raise
        self._engine = self._s.engine()
        if engine == "auto" and tier == "disk":
            fallback = self._s.engine_fallback()
            if fallback:
                _log.debug("store %r: engine auto fell back to %s: %s", name, self._engine,
                           fallback)
            else:
                _log.debug("store %r uses the %s engine (auto; queue_depth %d)", name,
                           self._engine, queue_depth)
        self._last_refresh = time.monotonic()
        _open_stores.add(self)

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued I/O, stop the threads, release the slab locks (another store may open
        the files from then on) and close the slab files (idempotent)."""
        if self._s is not None:
            s, self._s = self._s, None
            _open_stores.discard(self)
            s.close()

    def clear(self) -> None:
        """Drop every page of every kind, keeping the files and threads open: writes and reads
        in progress finish first, queued puts are acknowledged as cancelled (False) and queued
        reads as misses, and every slab gets a new slab id (as ``cold_start="clear"`` does), so
        neither this store nor a later ``cold_start="load"`` sees the old pages. OSError when a
        slab header cannot be rewritten."""
        self._native().clear()

    def refresh(self, min_interval: float = 0.0) -> int | None:
        """Readers only: scan the slab headers again and replace the index (DESIGN.md D14), so
        pages the writer committed since the open or the last refresh are found and pages it
        evicted or cleared are not. Skipped (None) when the last scan (or the open) is less
        than ``min_interval`` seconds old; otherwise the number of pages now indexed. Reads in
        progress wait for the scan. ``OSError`` (``EROFS``) on a writable store."""
        s = self._native()
        now = time.monotonic()
        if min_interval > 0 and now - self._last_refresh < min_interval:
            return None
        n = s.refresh()
        self._last_refresh = time.monotonic()
        return n

    @property
    def read_only(self) -> bool:
        return self.mode == "read"

    @property
    def engine(self) -> str:
        """The engine the I/O threads use: ``"io_uring"``, ``"aio"``, ``"psync"``, or
        ``"mapped"`` for the host tier (read-only; chosen when the store opened)."""
        return self._engine

    @property
    def closed(self) -> bool:
        return self._s is None

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._s is None else f"kinds={self.kind_names}"
        return f"DiskStore(name={self.name!r}, dirs={self.dirs!r}, {state})"

    # -- helpers ---------------------------------------------------------------------------
    def _native(self) -> Any:
        if self._s is None:
            raise ValueError("I/O operation on a closed DiskStore")
        return self._s

    def _kind(self, kind: str | int | None) -> int:
        if kind is None:
            if len(self.kind_names) != 1:
                raise ValueError(f"kind must be given: this store has kinds {self.kind_names}")
            return 0
        if isinstance(kind, bool) or not isinstance(kind, (int, str)):
            raise _check.ArgumentTypeError(f"kind must be a kind name (str) or index (int), got "
                            f"{_check.got(kind)}; this store has {self.kind_names}")
        if isinstance(kind, int):
            if 0 <= kind < len(self.kind_names):
                return kind
        elif kind in self._kind_index:
            return self._kind_index[kind]
        raise ValueError(f"kind {kind!r} is not a kind of this store; it has {self.kind_names}")

    @staticmethod
    def _keys(keys: Iterable[Any]) -> list[bytes]:
        return [make_key(k, f"keys[{i}]") for i, k in enumerate(_check.sequence("keys", keys))]

    @staticmethod
    def _datas(datas: Any, what: str, writable: bool) -> list:
        """Checked buffers; buffer-protocol ones as flat byte views, so that any item format
        (a ctypes char array is '<c') reaches the native side as plain bytes."""
        out = []
        for i, d in enumerate(_check.sequence(what, datas)):
            d = _check.buffer(f"{what}[{i}]", d, writable=writable)
            out.append(d if hasattr(d, "data_ptr") else memoryview(d).cast("B"))  # torch: as is
        return out

    def registration(self) -> dict[str, Any]:
        """The CUDA registration of a host store's slab mappings (``register_device``):
        ``registered`` (False without a register_device, and after :meth:`close`), ``device``
        (-1: none), ``parallel``, ``threads``, ``seconds`` (wall time), ``ranges`` and
        ``range_seconds`` (each registration's time)."""
        return dict(self._native().registration())

    def page_bytes(self, kind: str | int | None = None) -> int:
        """Largest payload of ``kind`` in bytes."""
        return self._native().page_bytes(self._kind(kind))

    def slot_bytes(self, kind: str | int | None = None) -> int:
        return self._native().slot_bytes(self._kind(kind))

    def slab_path(self, kind: str | int | None = None, drive: int = 0) -> str:
        """Path of the slab file of ``kind`` on drive ``drive``."""
        return self._native().slab_path(self._kind(kind), self._drive(drive))

    def direct_io(self, kind: str | int | None = None, drive: int = 0) -> bool:
        """True when that slab file uses O_DIRECT (False: buffered + fdatasync fallback)."""
        return self._native().slab_direct(self._kind(kind), self._drive(drive))

    def _drive(self, drive: Any) -> int:
        return _check.integer("drive", drive, 0, len(self.dirs) - 1)

    # -- puts ------------------------------------------------------------------------------
    def put(self, key: Any, data: Any, kind: str | int | None = None) -> bool:
        """Store ``data`` under ``key``; True when the page is in the store after the call."""
        make_key(key, "key")
        _check.buffer("data", data)
        k = self._kind(kind)
        if _nbytes(data) > self.page_bytes(k):
            raise ValueError(f"data is {_nbytes(data)} bytes, more than the page size "
                             f"{self.page_bytes(k)} of kind {self.kind_names[k]!r}")
        return self.batch_put([key], [data], k)[0]

    def batch_put(self, keys: Sequence[Any], datas: Sequence[Any],
                  kind: str | int | None = None, *, dirty: bool = False) -> list[bool]:
        """Store several pages (written in parallel); one acknowledgement per page.

        ``dirty`` (host tier only, DESIGN.md D24): the pages are marked dirty — never evicted
        until :meth:`mark_clean` — for a write-back to the disk behind (a restart lists them
        with :meth:`dirty_keys`); a key already stored keeps its state."""
        return self.put_async(keys, datas, kind, dirty=dirty).wait()

    def put_async(self, keys: Sequence[Any], datas: Sequence[Any],
                  kind: str | int | None = None, *, dirty: bool = False) -> PutTicket:
        """Copy the pages into slot buffers and queue them; the data may be reused at return."""
        return self._put_store_keys(self._keys(keys), datas, kind, dirty)

    def _put_store_keys(self, keys: list[bytes], datas: Sequence[Any], kind: Any,
                        dirty: bool = False) -> PutTicket:
        """put_async of keys already made store keys (:func:`make_key`)."""
        datas = self._datas(datas, "datas", False)
        if dirty and self.tier != "host":
            raise ValueError("dirty puts are for the host tier (tier=\"host\"): they keep a "
                             "write-back page from eviction until the disk has it")
        if len(keys) != len(datas):
            raise ValueError(f"keys and datas differ in length: {len(keys)} keys, "
                             f"{len(datas)} payloads")
        k = self._kind(kind)
        limit = self.page_bytes(k)
        for i, d in enumerate(datas):
            n = _nbytes(d)
            if n > limit:
                raise ValueError(f"datas[{i}] is {n} bytes, more than the page size {limit} of "
                                 f"kind {self.kind_names[k]!r}")
        return PutTicket(self._native().put_async(k, keys, datas, dirty=bool(dirty)))

    def buffer(self, kind: str | int | None = None) -> SlotBuffer:
        """A fresh zero-copy slot buffer for ``kind``."""
        k = self._kind(kind)
        return SlotBuffer(self._native().buffer(k), self.kind_names[k])

    def put_buffers(self, keys: Sequence[Any], buffers: Sequence[SlotBuffer], sizes: Sequence[int],
                    kind: str | int | None = None) -> list[bool]:
        """Write each buffer's first ``size`` payload bytes under its key (no copy)."""
        return self.put_buffers_async(keys, buffers, sizes, kind).wait()

    def put_buffers_async(self, keys: Sequence[Any], buffers: Sequence[SlotBuffer],
                          sizes: Sequence[int], kind: str | int | None = None) -> PutTicket:
        """Queue slot buffers for writing; do not modify them until the ticket is done."""
        keys, buffers = self._keys(keys), _check.sequence("buffers", buffers)
        sizes = [_check.integer(f"sizes[{i}]", n, 0, _check.U64_MAX)
                 for i, n in enumerate(_check.sequence("sizes", sizes))]
        if not len(keys) == len(buffers) == len(sizes):
            raise ValueError(f"keys, buffers and sizes differ in length: {len(keys)} keys, "
                             f"{len(buffers)} buffers, {len(sizes)} sizes")
        k = self._kind(kind)
        for i, (b, n) in enumerate(zip(buffers, sizes)):
            if not isinstance(b, SlotBuffer):
                raise _check.ArgumentTypeError(f"buffers[{i}] must be a SlotBuffer, got {_check.got(b)}")
            if b.kind_name != self.kind_names[k]:
                raise ValueError(f"buffers[{i}] is a buffer of kind {b.kind_name!r}, not of "
                                 f"kind {self.kind_names[k]!r}")
            if not 0 <= n <= b.capacity:
                raise ValueError(f"sizes[{i}] must be in [0, {b.capacity}], got {n}")
        t = self._native().put_buffers_async(k, keys, [b._b for b in buffers], sizes)
        return PutTicket(t, buffers)

    # -- gets ------------------------------------------------------------------------------
    def get(self, key: Any, kind: str | int | None = None) -> bytes | None:
        """The bytes stored under ``key``, or None (absent, evicted, or failed verification)."""
        make_key(key, "key")
        return self.batch_get([key], kind)[0]

    def batch_get(self, keys: Sequence[Any], kind: str | int | None = None) -> list[bytes | None]:
        k = self._kind(kind)
        return list(self._native().get_many(k, self._keys(keys)))

    def get_into(self, key: Any, out: Any, kind: str | int | None = None) -> int | None:
        """Read the page into the writable buffer ``out``; its length, or None on a miss.

        ``out`` must hold at least the stored length (``size_of``); ValueError otherwise."""
        make_key(key, "key")
        _check.buffer("out", out, writable=True)
        n = self.size_of(key, kind)
        if n is not None and n > _nbytes(out):
            raise ValueError(f"out holds {_nbytes(out)} bytes, smaller than the {n} bytes stored "
                             f"under key {key!r:.60}")
        return self.batch_get_into([key], [out], kind)[0]

    def batch_get_into(self, keys: Sequence[Any], outs: Sequence[Any],
                       kind: str | int | None = None) -> list[int | None]:
        keys, outs = self._keys(keys), self._datas(outs, "outs", True)
        if len(keys) != len(outs):
            raise ValueError(f"keys and outs differ in length: {len(keys)} keys, {len(outs)} outputs")
        k = self._kind(kind)
        stored = self._native().lookup(k, keys)
        for i, (n, out) in enumerate(zip(stored, outs)):
            if n > _nbytes(out):
                raise ValueError(f"outs[{i}] holds {_nbytes(out)} bytes, smaller than the {n} "
                                 f"bytes stored under keys[{i}]")
        r = self._native().get_into(k, keys, outs)
        return [n if n >= 0 else None for n in r]

    def get_buffers(self, keys: Sequence[Any], buffers: Sequence[SlotBuffer],
                    kind: str | int | None = None) -> list[int | None]:
        """Read each page straight into its slot buffer; payload lengths, None on a miss."""
        k = self._kind(kind)
        keys, buffers = _slot_buffers(self._keys(keys), buffers, self.kind_names[k])
        r = self._native().get_buffers(k, keys, [b._b for b in buffers])
        return [n if n >= 0 else None for n in r]

    def get_buffers_async(self, keys: Sequence[Any], buffers: Sequence[SlotBuffer],
                          kind: str | int | None = None) -> GetTicket:
        """Queue reads straight into slot buffers; do not touch them until the ticket is done."""
        k = self._kind(kind)
        keys, buffers = _slot_buffers(self._keys(keys), buffers, self.kind_names[k])
        return GetTicket(self._native().get_buffers_async(k, keys, [b._b for b in buffers]),
                         buffers)

    # -- index -----------------------------------------------------------------------------
    def exists(self, key: Any, kind: str | int | None = None) -> bool:
        """True when ``key`` is indexed (no I/O; a later get may still miss if the slot rots)."""
        make_key(key, "key")
        return self.batch_exists([key], kind)[0]

    def batch_exists(self, keys: Sequence[Any], kind: str | int | None = None) -> list[bool]:
        return [n >= 0 for n in self._native().lookup(self._kind(kind), self._keys(keys))]

    def size_of(self, key: Any, kind: str | int | None = None) -> int | None:
        """Stored length of ``key`` in bytes, or None."""
        n = self._native().lookup(self._kind(kind), [make_key(key, "key")])[0]
        return n if n >= 0 else None

    def delete(self, key: Any, kind: str | int | None = None) -> bool:
        """Remove ``key`` (index entry first, then the slot); True when it was present."""
        make_key(key, "key")
        return self.batch_delete([key], kind)[0]

    def batch_delete(self, keys: Sequence[Any], kind: str | int | None = None) -> list[bool]:
        """Remove keys; a put of one still in flight is waited for, and each freed slot is
        zeroed before the call returns, so a reader's later :meth:`refresh` never finds them."""
        return list(self._native().remove(self._kind(kind), self._keys(keys)))

    # -- dirty pages (host tier write-back, DESIGN.md D24) ---------------------------------
    def mark_clean(self, keys: Sequence[Any], kind: str | int | None = None) -> list[bool]:
        """Host tier: the dirty pages among ``keys`` become clean (evictable again; the flag
        leaves their slot headers). Per key, True when it was dirty."""
        return self._mark_clean_store_keys(self._keys(keys), kind)

    def dirty_keys(self, kind: str | int | None = None) -> list[bytes]:
        """Host tier: the store keys (:func:`make_key` digests) of the dirty pages of ``kind``
        — after a restart, the write-back pages the disk never acknowledged."""
        return list(self._native().keys(self._kind(kind), True))

    def _mark_clean_store_keys(self, keys: list[bytes], kind: Any) -> list[bool]:
        if self.tier != "host":
            raise ValueError("mark_clean is for the host tier (tier=\"host\"); a disk store has "
                             "no dirty pages")
        return list(self._native().mark_clean(self._kind(kind), keys))

    # -- observability ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and gauges; ``kinds`` maps each kind name to its occupancy figures."""
        s = dict(self._native().stats())
        s["kinds"] = {n: dict(k) for n, k in zip(self.kind_names, s["kinds"])}
        return s

    def prometheus_collector(self) -> Any:
        """A ``prometheus_client`` collector of :meth:`stats` (``REGISTRY.register(c)``).

        Raises ImportError when prometheus_client is not installed."""
        try:
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        except ImportError as e:
            raise ImportError("prometheus_client is not installed: pip install "
                              "prometheus_client (or vitrify[prometheus])") from e
        store = self

        class _Collector:
            def collect(self):
                if store.closed:
                    return
                s = store.stats()
                lab = ["store"]
                for field in ("spills", "spill_bytes", "reloads", "reload_bytes", "misses",
                              "verify_failures", "dedup_hits", "gc_runs", "gc_reclaims",
                              "deletes", "write_errors", "put_failures", "clears"):
                    c = CounterMetricFamily(f"vitrify_disk_{field}", f"vitrify disk tier: {field}",
                                            labels=lab)
                    c.add_metric([store.name], s[field])
                    yield c
                for field in ("in_flight_writes", "in_flight_reads", "write_queue_depth",
                              "read_queue_depth"):
                    g = GaugeMetricFamily(f"vitrify_disk_{field}", f"vitrify disk tier: {field}",
                                          labels=lab)
                    g.add_metric([store.name], s[field])
                    yield g
                for field in ("occupancy", "slots_used", "slots_total", "entries"):
                    g = GaugeMetricFamily(f"vitrify_disk_{field}", f"vitrify disk tier: {field}",
                                          labels=["store", "kind"])
                    for kname, k in s["kinds"].items():
                        g.add_metric([store.name, kname], k[field])
                    yield g

        return _Collector()


class PageMover:
    """Host KV pages <-> one kind of a :class:`DiskStore`, one native call per batch.

    ``put_pages(keys, layout, pages)`` skips the keys the store already holds, gathers the other
    host pages ``pages[i]`` of ``layout`` (a :class:`vitrify.host.PageLayout`) into the mover's
    4 KiB-aligned slot buffers and writes them, ``chunk`` pages at a time, gathering chunk i+1
    while chunk i is written. ``get_pages(keys, layout, pages)`` keeps two chunks of reads in
    flight and scatters each verified page of exactly ``layout.blob_bytes`` into its host page
    while the next chunk is read; a stored page of another length is deleted (not on a reader)
    and missed. Both run in native code with the GIL released for the whole call, and return
    only when nothing they submitted is in flight any more, exceptions included.

    The mover allocates its staging once: two sets of ``chunk`` slots per direction. Calls of
    one direction run one after another (they share that direction's slots); a put and a get
    may run at the same time. The mover is sized for ``store``: make a new one for another
    store. ``copier``: the :class:`vitrify.host.Copier` that gathers and scatters (default: the
    shared one). See ``csrc/src/disk/DESIGN.md`` ("Page mover").
    """

    __slots__ = ("_store", "_k", "_copier", "_m")

    def __init__(self, store: DiskStore, chunk: int, kind: str | int | None = None,
                 copier: Any = None) -> None:
        if not isinstance(store, DiskStore):
            raise _check.ArgumentTypeError(f"store must be a DiskStore, got {_check.got(store)}")
        self._store = store
        self._k = store._kind(kind)
        chunk = _check.integer("chunk", chunk, 1, 1 << 20)
        if copier is None:
            copier = _host._copier()
        elif not isinstance(copier, _host.Copier):
            raise _check.ArgumentTypeError(f"copier must be a vitrify.host.Copier, got "
                                           f"{_check.got(copier)}")
        self._copier = copier
        self._m = _native.DiskPageMover(store.slot_bytes(self._k), chunk, copier._c)

    @property
    def chunk(self) -> int:
        """Pages per chunk (each direction stages two chunks)."""
        return self._m.chunk

    def _args(self, keys: Sequence[Any], layout: Any, pages: Sequence[int]) -> tuple:
        keys = self._store._keys(keys)
        lay = _host._layout(layout)
        pages = _host._pages("pages", pages, layout)
        if len(keys) != len(pages):
            raise ValueError(f"keys and pages differ in length: {len(keys)} keys, "
                             f"{len(pages)} pages")
        limit = self._store.page_bytes(self._k)
        if layout.blob_bytes > limit:
            raise ValueError(f"layout pages of {layout.blob_bytes} bytes do not fit kind "
                             f"{self._store.kind_names[self._k]!r} of {limit}-byte pages")
        return self._store._native(), self._k, keys, lay, pages, layout.blob_bytes

    def put_pages(self, keys: Sequence[Any], layout: Any, pages: Sequence[int], *,
                  dirty: bool = False) -> tuple[list[bool], int]:
        """Store host page ``pages[i]`` under ``keys[i]``. Returns one bool per key (True: the
        page is in the store after the call, written now or already there) and the number of
        keys the store held before the call (neither gathered nor written). ``dirty`` (a host
        store): the pages written now are write-back pages, never evicted until
        :meth:`DiskStore.mark_clean` (DESIGN.md D24); the keys already there keep their state."""
        if dirty and self._store.tier != "host":
            raise ValueError("dirty puts are for the host tier (tier=\"host\"): they keep a "
                             "write-back page from eviction until the disk has it")
        results, present = self._m.put_pages(*self._args(keys, layout, pages), dirty=bool(dirty))
        return [r in (_STORED, _DUPLICATE) for r in results], present

    def get_pages(self, keys: Sequence[Any], layout: Any,
                  pages: Sequence[int]) -> tuple[list[bool], list[tuple[int, int]]]:
        """Read ``keys[i]`` into host page ``pages[i]`` (distinct pages). Returns one bool per key
        (False: a miss, and that host page was not written) and ``(i, stored_bytes)`` for each
        key whose stored page was not ``layout.blob_bytes`` long (deleted and missed)."""
        args = self._args(keys, layout, pages)
        if len(set(args[4])) != len(args[4]):  # two reads into one page: the later would win
            seen: set[int] = set()
            twice = next(p for p in args[4] if p in seen or seen.add(p))
            raise ValueError(f"get_pages: host page {twice} is named twice (pages must be "
                             f"distinct)")
        hits, dropped = self._m.get_pages(*args)
        return list(hits), [tuple(d) for d in dropped]


__all__ = ["DiskStore", "GetTicket", "HostSpaceError", "KEY_BYTES", "PUT_RESULTS", "PageMover",
           "PutTicket",
           "SLOT_HEADER_BYTES", "SlabLockedError",
           "SlotBuffer", "make_key", "slot_bytes_for"]
