"""The O_DIRECT disk tier: content-addressed pages in preallocated slab files.

API summary
-----------
``DiskStore(dirs, budget_bytes, kinds, *, name="vitrify", cold_start="clear", direct_io=None,
write_threads=2, read_threads=2, queue_capacity=64, max_batch=32, gc_high=0.90, gc_low=0.85,
load_threads=0)``

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
``buffer(kind=None)``                        a :class:`SlotBuffer` (zero-copy staging)
``put_buffers(keys, bufs, sizes, kind)``     write slot buffers as they are (no copy)
``put_buffers_async(...)``                   -> :class:`PutTicket`
``get_buffers(keys, bufs, kind=None)``       read straight into slot buffers -> list[int|None]
``get_buffers_async(...)``                   -> :class:`GetTicket`
``stats()``                                  occupancy, spills, reloads, GC, errors, queues
``prometheus_collector()``                   a prometheus_client collector (if installed)
``clear()``                                  drop every page (files and threads stay open)
``close()`` / ``with DiskStore(...) as s``   drain the I/O threads and close the files
==========================================  ===================================================

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
index from the slab headers this store wrote (a slab from another store, or with another
geometry, starts empty); ``"clear"`` starts empty and leaves old bytes inert.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import _native, config

KEY_BYTES: int = _native.DISK_KEY_BYTES
SLOT_HEADER_BYTES: int = _native.DISK_SLOT_HEADER_BYTES

_KEY_PREFIX = b"vitrify-disk-key\0"
_STORED, _DUPLICATE = 0, 1
PUT_RESULTS = {0: "stored", 1: "duplicate", 2: "full", 3: "error", 4: "cancelled"}


def make_key(key: str | bytes | bytearray | memoryview) -> bytes:
    """The 32-byte store key of ``key``: SHA-256 over a fixed prefix and the key's bytes."""
    if isinstance(key, str):
        data = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        data = bytes(key)
    else:
        raise TypeError(f"disk keys are str or bytes-like, got {type(key).__name__}")
    return hashlib.sha256(_KEY_PREFIX + data).digest()


def slot_bytes_for(page_bytes: int) -> int:
    """Bytes one slot of ``page_bytes`` payload takes on disk (header + payload, 4 KiB rounded)."""
    return _native.disk_slot_bytes_for(page_bytes)


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
    if isinstance(kinds, bool):
        raise TypeError("kinds must be a page size in bytes or a mapping name -> page size")
    if isinstance(kinds, int):
        kinds = {"default": kinds}
    if not isinstance(kinds, Mapping) or not kinds:
        raise ValueError(f"kinds must be a positive page size or a non-empty mapping, got {kinds!r}")
    names, pages, shares = [], [], []
    for name, spec in kinds.items():
        if isinstance(spec, (tuple, list)):
            if len(spec) != 2:
                raise ValueError(f"kind {name!r}: expected (page_bytes, share), got {spec!r}")
            page, share = spec
        else:
            page, share = spec, 1.0
        if isinstance(page, bool) or not isinstance(page, int) or page <= 0:
            raise ValueError(f"kind {name!r}: page_bytes must be a positive int, got {page!r}")
        share = float(share)
        if not share > 0 or share != share or share == float("inf"):
            raise ValueError(f"kind {name!r}: share must be a finite number > 0, got {share!r}")
        names.append(str(name))
        pages.append(page)
        shares.append(share)
    return names, pages, shares


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return v


def _slot_buffers(keys: Sequence[Any], buffers: Sequence[SlotBuffer]) -> tuple[list, list]:
    """``keys`` and ``buffers`` as lists, checked to pair up one SlotBuffer per key."""
    keys, buffers = list(keys), list(buffers)
    if len(keys) != len(buffers):
        raise ValueError(f"got {len(keys)} keys and {len(buffers)} buffers")
    for i, b in enumerate(buffers):
        if not isinstance(b, SlotBuffer):
            raise TypeError(f"buffer {i} is a {type(b).__name__}, not a SlotBuffer")
    return keys, buffers


class DiskStore:
    """Content-addressed pages in O_DIRECT slab files (see the module docstring for the API).

    Args:
        dirs: a directory or a list of directories, one per drive (created if missing).
        budget_bytes: disk bytes for all slab files together.
        kinds: a page size in bytes (one kind, "default"), or a mapping from kind name to page
            size or to ``(page_size, share)``; the budget is split by share.
        name: the store's name: file names and the identity checked by ``cold_start="load"``.
        cold_start: ``"clear"`` (start empty) or ``"load"`` (rebuild from the slab headers).
        direct_io: ``"auto"``, ``"on"`` or ``"off"``; None reads ``VITRIFY_DIRECT_IO``.
        write_threads, read_threads: I/O threads per drive.
        queue_capacity: jobs per drive queue before submitters wait.
        max_batch: writes per fdatasync on one write thread (group commit).
        gc_high, gc_low: GC starts at ``gc_high`` occupancy and evicts down to ``gc_low``.
        load_threads: threads scanning each slab's slot headers for ``cold_start="load"``
            (0: the default, 8; 1: one header read after another).
    """

    def __init__(self, dirs: str | os.PathLike | Sequence[str | os.PathLike], budget_bytes: int,
                 kinds: int | Mapping[str, Any], *, name: str = "vitrify",
                 cold_start: str = "clear", direct_io: str | None = None,
                 write_threads: int = 2, read_threads: int = 2, queue_capacity: int = 64,
                 max_batch: int = 32, gc_high: float = 0.90, gc_low: float = 0.85,
                 load_threads: int = 0) -> None:
        self._s = None
        if isinstance(dirs, (str, os.PathLike)):
            dirs = [dirs]
        dirs = [os.fspath(d) for d in dirs]
        if not dirs:
            raise ValueError("DiskStore needs at least one directory")
        if len(set(os.path.realpath(d) for d in dirs)) != len(dirs):
            raise ValueError(f"DiskStore directories must be distinct, got {dirs!r}")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        if cold_start not in ("clear", "load"):
            raise ValueError(f"cold_start must be 'clear' or 'load', got {cold_start!r}")
        if direct_io is None:
            direct_io = config.settings().direct_io
        if direct_io not in ("auto", "on", "off"):
            raise ValueError(f"direct_io must be 'auto', 'on' or 'off', got {direct_io!r}")
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a non-empty str without '/', got {name!r}")
        if not (0 < gc_low < gc_high <= 1):
            raise ValueError(f"need 0 < gc_low < gc_high <= 1, got gc_low={gc_low!r} gc_high={gc_high!r}")
        if (isinstance(load_threads, bool) or not isinstance(load_threads, int)
                or not 0 <= load_threads <= 256):
            raise ValueError(f"load_threads must be an int in [0, 256], got {load_threads!r}")
        self.kind_names, pages, shares = _parse_kinds(kinds)
        self._kind_index = {n: i for i, n in enumerate(self.kind_names)}
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        self.name = name
        self.dirs = dirs
        self._s = _native.DiskStore(
            dirs, budget_bytes, pages, shares, name, cold_start, direct_io,
            _positive_int("write_threads", write_threads), _positive_int("read_threads", read_threads),
            _positive_int("queue_capacity", queue_capacity), _positive_int("max_batch", max_batch),
            float(gc_high), float(gc_low), load_threads)

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued I/O, stop the threads and close the slab files (idempotent)."""
        if self._s is not None:
            s, self._s = self._s, None
            s.close()

    def clear(self) -> None:
        """Drop every page of every kind, keeping the files and threads open: writes and reads
        in progress finish first, queued puts are acknowledged as cancelled (False) and queued
        reads as misses, and every slab gets a new slab id (as ``cold_start="clear"`` does), so
        neither this store nor a later ``cold_start="load"`` sees the old pages. OSError when a
        slab header cannot be rewritten."""
        self._native().clear()

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
                raise ValueError(f"this store has kinds {self.kind_names}: name one")
            return 0
        if isinstance(kind, int) and not isinstance(kind, bool):
            if 0 <= kind < len(self.kind_names):
                return kind
        elif kind in self._kind_index:
            return self._kind_index[kind]
        raise ValueError(f"unknown payload kind {kind!r}; this store has {self.kind_names}")

    @staticmethod
    def _keys(keys: Iterable[Any]) -> list[bytes]:
        return [make_key(k) for k in keys]

    def page_bytes(self, kind: str | int | None = None) -> int:
        """Largest payload of ``kind`` in bytes."""
        return self._native().page_bytes(self._kind(kind))

    def slot_bytes(self, kind: str | int | None = None) -> int:
        return self._native().slot_bytes(self._kind(kind))

    def slab_path(self, kind: str | int | None = None, drive: int = 0) -> str:
        """Path of the slab file of ``kind`` on drive ``drive``."""
        return self._native().slab_path(self._kind(kind), drive)

    def direct_io(self, kind: str | int | None = None, drive: int = 0) -> bool:
        """True when that slab file uses O_DIRECT (False: buffered + fdatasync fallback)."""
        return self._native().slab_direct(self._kind(kind), drive)

    # -- puts ------------------------------------------------------------------------------
    def put(self, key: Any, data: Any, kind: str | int | None = None) -> bool:
        """Store ``data`` under ``key``; True when the page is in the store after the call."""
        return self.batch_put([key], [data], kind)[0]

    def batch_put(self, keys: Sequence[Any], datas: Sequence[Any],
                  kind: str | int | None = None) -> list[bool]:
        """Store several pages (written in parallel); one acknowledgement per page."""
        return self.put_async(keys, datas, kind).wait()

    def put_async(self, keys: Sequence[Any], datas: Sequence[Any],
                  kind: str | int | None = None) -> PutTicket:
        """Copy the pages into slot buffers and queue them; the data may be reused at return."""
        keys, datas = list(keys), list(datas)
        if len(keys) != len(datas):
            raise ValueError(f"got {len(keys)} keys and {len(datas)} payloads")
        k = self._kind(kind)
        return PutTicket(self._native().put_async(k, self._keys(keys), datas))

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
        keys, buffers, sizes = list(keys), list(buffers), [int(n) for n in sizes]
        if not len(keys) == len(buffers) == len(sizes):
            raise ValueError(f"got {len(keys)} keys, {len(buffers)} buffers, {len(sizes)} sizes")
        for i, (b, n) in enumerate(zip(buffers, sizes)):
            if not isinstance(b, SlotBuffer):
                raise TypeError(f"buffer {i} is a {type(b).__name__}, not a SlotBuffer")
            if not 0 <= n <= b.capacity:
                raise ValueError(f"size {n} of buffer {i} is outside [0, {b.capacity}]")
        k = self._kind(kind)
        t = self._native().put_buffers_async(k, self._keys(keys), [b._b for b in buffers], sizes)
        return PutTicket(t, buffers)

    # -- gets ------------------------------------------------------------------------------
    def get(self, key: Any, kind: str | int | None = None) -> bytes | None:
        """The bytes stored under ``key``, or None (absent, evicted, or failed verification)."""
        return self.batch_get([key], kind)[0]

    def batch_get(self, keys: Sequence[Any], kind: str | int | None = None) -> list[bytes | None]:
        k = self._kind(kind)
        return list(self._native().get_many(k, self._keys(keys)))

    def get_into(self, key: Any, out: Any, kind: str | int | None = None) -> int | None:
        """Read the page into the writable buffer ``out``; its length, or None on a miss.

        ``out`` must hold at least the stored length (``size_of``); ValueError otherwise."""
        return self.batch_get_into([key], [out], kind)[0]

    def batch_get_into(self, keys: Sequence[Any], outs: Sequence[Any],
                       kind: str | int | None = None) -> list[int | None]:
        keys, outs = list(keys), list(outs)
        if len(keys) != len(outs):
            raise ValueError(f"got {len(keys)} keys and {len(outs)} outputs")
        k = self._kind(kind)
        r = self._native().get_into(k, self._keys(keys), outs)
        return [n if n >= 0 else None for n in r]

    def get_buffers(self, keys: Sequence[Any], buffers: Sequence[SlotBuffer],
                    kind: str | int | None = None) -> list[int | None]:
        """Read each page straight into its slot buffer; payload lengths, None on a miss."""
        keys, buffers = _slot_buffers(keys, buffers)
        k = self._kind(kind)
        r = self._native().get_buffers(k, self._keys(keys), [b._b for b in buffers])
        return [n if n >= 0 else None for n in r]

    def get_buffers_async(self, keys: Sequence[Any], buffers: Sequence[SlotBuffer],
                          kind: str | int | None = None) -> GetTicket:
        """Queue reads straight into slot buffers; do not touch them until the ticket is done."""
        keys, buffers = _slot_buffers(keys, buffers)
        k = self._kind(kind)
        return GetTicket(self._native().get_buffers_async(k, self._keys(keys), [b._b for b in buffers]),
                         buffers)

    # -- index -----------------------------------------------------------------------------
    def exists(self, key: Any, kind: str | int | None = None) -> bool:
        """True when ``key`` is indexed (no I/O; a later get may still miss if the slot rots)."""
        return self.batch_exists([key], kind)[0]

    def batch_exists(self, keys: Sequence[Any], kind: str | int | None = None) -> list[bool]:
        return [n >= 0 for n in self._native().lookup(self._kind(kind), self._keys(keys))]

    def size_of(self, key: Any, kind: str | int | None = None) -> int | None:
        """Stored length of ``key`` in bytes, or None."""
        n = self._native().lookup(self._kind(kind), [make_key(key)])[0]
        return n if n >= 0 else None

    def delete(self, key: Any, kind: str | int | None = None) -> bool:
        """Remove ``key`` (index entry first, then the slot); True when it was present."""
        return self.batch_delete([key], kind)[0]

    def batch_delete(self, keys: Sequence[Any], kind: str | int | None = None) -> list[bool]:
        return list(self._native().remove(self._kind(kind), self._keys(keys)))

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


__all__ = ["DiskStore", "GetTicket", "KEY_BYTES", "PUT_RESULTS", "PutTicket", "SLOT_HEADER_BYTES",
           "SlotBuffer", "make_key", "slot_bytes_for"]
