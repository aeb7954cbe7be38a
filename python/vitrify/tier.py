"""The host tier: KV pages in named shared memory that outlives the process, in front of the disk.

``HostStore(budget_bytes, kinds, *, dir=None, name="vitrify", cold_start=None, mode="write")``
is a :class:`vitrify.disk.DiskStore` whose slab files live in memory (tmpfs such as
``/dev/shm``, or a hugetlbfs mount): same API, same page format (file header, slot headers with
the full key, per-page CRC32C, slab id), so a page moves between the tiers unchanged. The slabs
are mapped and pages copied with ``memcpy``; they survive the process (not a reboot), so a
restarted server (``cold_start="load"``) finds its pages at memory speed, and another process of
the same user and identity opens them read-only (``mode="read"``) and reads the same pages
while the one writer holds the slab lock (csrc/src/disk/DESIGN.md D13, D14, H1-H9).

``dir`` defaults to ``<VITRIFY_HOST_DIR>/vitrify-<uid>`` (``/dev/shm/vitrify-0`` for root), a
directory created ``0700``; slab files are created ``0600``. A slab of another user, or a
directory of another user that is not sticky (``/dev/shm`` itself is), is refused
(``PermissionError``); too little space on the mount is an ``OSError`` (``ENOSPC``)
naming the mount, the bytes needed and the bytes free (:class:`HostSpaceError`, with those
as attributes: a server can then run without the host tier, or with a smaller one).

``TieredStore(host, disk, *, write="back")`` puts every page into the host tier and writes it to
the disk store behind it (``"back"``: a background thread, the put is acknowledged once the page
is in host memory; ``"through"``: acknowledged once the disk acknowledged it too). A write-back
page is *dirty* in the host tier until the disk has it: the host tier's LRU eviction (the store's
GC) never drops a dirty page, a SIGKILL loses none of them (the host tier outlives the process),
and opening the tiers again writes every dirty page to the disk. When the host tier is full of
dirty pages, a put goes straight to the disk (acknowledged by it). ``get`` reads the host tier
first, then the disk; a disk hit is copied into the host tier (promotion). The tiers are
inclusive: every page reaches the disk, so what the host tier evicts (clean pages only) is on
disk — that is the demotion. The first write of a key wins in both tiers (see
:class:`TieredStore`). A store left open is flushed and closed at interpreter exit.

``list_slabs(dir=None)`` and ``remove_slabs(dir=None, force=False)`` are what ``vitrify tier ls``
and ``vitrify tier clear`` run.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import errno
import glob
import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from . import _check, _native, config
from . import disk as _disk
from .disk import DiskStore, HostSpaceError, make_key

WRITE_POLICIES = ("back", "through")
logger = logging.getLogger("vitrify.tier")


def default_dir() -> str:
    """``<VITRIFY_HOST_DIR>/vitrify-<euid>``: this user's host-tier directory."""
    return os.path.join(config.settings().host_dir, f"vitrify-{os.geteuid()}")


def _own_directory(path: str, create: bool) -> str:
    """``path`` as a directory of this user (created 0700 when ``create``); PermissionError
    naming it when it belongs to another user or is a symbolic link."""
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise type(e)(e.errno, f"host tier: cannot create directory ({e.strerror})",
                          path) from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "host tier: not a directory (or a link)", path)
    # A shared sticky directory (/dev/shm itself) is fine: nobody else can rename or remove
    # this user's files there, and every slab file is checked on its own (uid, O_NOFOLLOW).
    if st.st_uid != os.geteuid() and not st.st_mode & stat.S_ISVTX:
        raise PermissionError(errno.EACCES, f"host tier: directory of uid {st.st_uid}, not of "
                              f"this user (uid {os.geteuid()}), and not sticky; another user's "
                              f"slabs are never used", path)
    return path


class HostStore(DiskStore):
    """A :class:`~vitrify.disk.DiskStore` in shared memory (see the module docstring).

    Args:
        budget_bytes: host memory for all slab files together.
        kinds: as for :class:`~vitrify.disk.DiskStore`.
        dir: the directory (tmpfs or hugetlbfs); None: :func:`default_dir`.
        name: the store's name and identity (file names; a slab of another name is never
            served: a writer starts it empty, a reader refuses it).
        cold_start: ``"clear"`` or ``"load"`` (the default for readers).
        mode: ``"write"`` (the one owner, holds the slab locks) or ``"read"``.
        **kw: the other :class:`~vitrify.disk.DiskStore` options (threads, GC thresholds).

    Raises:
        ValueError: the directory is not on tmpfs or hugetlbfs; a reader found a slab of
            another identity or geometry.
        PermissionError: the directory or a slab belongs to another user.
        HostSpaceError: (an ``OSError``, ``ENOSPC``) the mount has too little free space (one
            line: mount, bytes needed, bytes free; attributes ``mount``, ``needed_bytes``,
            ``free_bytes``); nothing grew and nothing this open created is left.
        OSError: :class:`~vitrify.disk.SlabLockedError` when another writer holds the slabs.
    """

    def __init__(self, budget_bytes: int, kinds: int | Mapping[str, Any], *,
                 dir: str | os.PathLike | None = None, name: str = "vitrify",
                 cold_start: str | None = None, mode: str = "write", **kw: Any) -> None:
        self._s = None
        d = default_dir() if dir is None else _check.path("dir", dir)
        mode = _check.choice("mode", mode, ("write", "read"))
        made = _disk._missing_dirs(d) if mode == "write" else []
        _own_directory(d, create=mode == "write")
        kw.setdefault("direct_io", "off")
        try:
            super().__init__(d, budget_bytes, kinds, name=name, cold_start=cold_start, mode=mode,
                             tier="host", **kw)
        except BaseException:
            _disk._remove_empty_dirs(made)  # a failed open leaves nothing it made (D22)
            raise

    def __repr__(self) -> str:
        state = "closed" if self._s is None else f"kinds={self.kind_names}"
        return f"HostStore(name={self.name!r}, dir={self.dirs[0]!r}, mode={self.mode!r}, {state})"


class _WriteBack:
    """The write-back queue of one :class:`TieredStore` and the thread that empties it.

    It holds the two stores but not the ``TieredStore``, so a store nobody references any more
    is collected (and closed) like any object, and one left open at exit is closed by the
    ``atexit`` hook. The queue holds store keys only: the pages themselves are dirty in the host
    tier (DESIGN.md D24) until the disk acknowledged them, then marked clean.
    """

    _BATCH = 64
    _RETRY_FIRST, _RETRY_MAX = 0.2, 5.0

    def __init__(self, host: DiskStore, disk: DiskStore, queue_pages: int) -> None:
        self.host, self.disk = host, disk
        self.queue_pages = queue_pages
        self.mu = threading.Condition()
        self.pending: collections.OrderedDict[tuple[int, bytes], None] = collections.OrderedDict()
        self.inflight: set[tuple[int, bytes]] = set()
        self.failed: dict[tuple[int, bytes], str] = {}  # retried after a pause
        self.retry_at = 0.0
        self.retry_pause = self._RETRY_FIRST
        self.last_error = ""
        self.counts: collections.Counter = collections.Counter()
        self.stop = False
        self.thread = threading.Thread(target=_write_back_loop, args=(self,),
                                       name="vitrify-tier-writeback", daemon=True)
        self.thread.start()

    def enqueue(self, items: Sequence[tuple[int, bytes]]) -> None:
        with self.mu:
            for it in items:
                self.failed.pop(it, None)
                self.pending[it] = None
            self.mu.notify_all()

    def backlog(self) -> int:
        return len(self.pending) + len(self.inflight)

    def queued(self, it: tuple[int, bytes]) -> bool:
        """Whether ``it`` waits for (or is in) its disk write."""
        with self.mu:
            return it in self.pending or it in self.inflight or it in self.failed

    def wait_for_room(self) -> None:
        """Back-pressure: return once at most ``queue_pages`` pages wait (the thread was woken
        by every enqueue, so it drains the queue meanwhile)."""
        with self.mu:
            self.mu.wait_for(lambda: self.backlog() <= self.queue_pages or self.stop
                             or not self.thread.is_alive())

    def forget(self, it: tuple[int, bytes]) -> None:
        """A delete: drop ``it`` from the queue, after its disk write if one is in flight."""
        with self.mu:
            self.pending.pop(it, None)
            self.failed.pop(it, None)
            self.mu.wait_for(lambda: it not in self.inflight)

    def flush(self) -> None:
        with self.mu:
            for attempt in range(2):
                if attempt and self.failed:  # one more try for the ones that failed
                    self.pending.update(dict.fromkeys(self.failed))
                    self.failed.clear()
                    self.mu.notify_all()
                self.mu.wait_for(lambda: not self.backlog() or not self.thread.is_alive())
                if not self.failed:
                    break
            if self.failed:
                raise OSError(errno.EIO, f"TieredStore.flush: {len(self.failed)} write-back "
                              f"pages could not be written to the disk store (last error: "
                              f"{self.last_error}); they stay in the host tier, dirty, and are "
                              f"written again later or when the tiers are opened again")
            if not self.thread.is_alive() and self.backlog():
                raise RuntimeError("TieredStore.flush: the write-back thread has stopped")

    def shutdown(self) -> None:
        with self.mu:
            self.stop = True
            self.mu.notify_all()
        self.thread.join()


def _write_back_loop(w: _WriteBack) -> None:
    """Writes queued dirty host pages to the disk and marks them clean once it acknowledged
    them; a page that fails stays dirty and is retried after a pause (doubling, at most 5 s)."""
    while True:
        with w.mu:
            while True:
                if w.failed and time.monotonic() >= w.retry_at:
                    w.pending.update(dict.fromkeys(w.failed))
                    w.failed.clear()
                if w.pending or w.stop:
                    break
                w.mu.wait(timeout=max(0.01, w.retry_at - time.monotonic()) if w.failed else None)
            if not w.pending:  # stopping, nothing left (failed pages stay dirty in the host)
                return
            batch = []
            while w.pending and len(batch) < w._BATCH:
                batch.append(w.pending.popitem(last=False)[0])
            w.inflight.update(batch)
        done, failed, lost, error = [], [], [], ""
        by_kind: dict[int, list[bytes]] = collections.defaultdict(list)
        for k, sk in batch:
            by_kind[k].append(sk)
        for k, sks in by_kind.items():
            try:
                datas = w.host._native().get_many(k, sks)
                have = [(sk, d) for sk, d in zip(sks, datas) if d is not None]
                # not in the host tier any more: deleted meanwhile, or a slot that failed
                # verification (its bytes are gone; counted, never written)
                lost += [(k, sk) for sk, d in zip(sks, datas) if d is None]
                if have:
                    res = w.disk._put_store_keys([sk for sk, _ in have], [d for _, d in have],
                                                 k).wait_results()
                    ok = [sk for (sk, _), r in zip(have, res) if r in ("stored", "duplicate")]
                    bad = [(sk, r) for (sk, _), r in zip(have, res)
                           if r not in ("stored", "duplicate")]
                    if ok:
                        w.host._mark_clean_store_keys(ok, k)
                    done += [(k, sk) for sk in ok]
                    failed += [(k, sk) for sk, _ in bad]
                    if bad:
                        error = f"the disk store answered {bad[0][1]!r}"
            except Exception as e:  # the disk (or host) store failed or was closed: retried
                failed += [(k, sk) for sk in sks if (k, sk) not in set(done) | set(lost)]
                error = _one_line(e)
        with w.mu:
            w.inflight.difference_update(batch)
            w.counts["writebacks"] += len(done)
            w.counts["writeback_failures"] += len(failed)
            w.counts["writeback_lost"] += len(lost)
            for it in failed:
                w.failed[it] = error
            if failed:
                w.last_error = error
                w.retry_at = time.monotonic() + w.retry_pause
                w.retry_pause = min(w._RETRY_MAX, w.retry_pause * 2)
            elif done:
                w.retry_pause = w._RETRY_FIRST
            w.mu.notify_all()
        if lost:
            logger.warning("vitrify.tier: %d write-back pages were gone from the host tier "
                           "before their disk write (a slot that failed verification)", len(lost))


class TieredStore:
    """A host tier in front of a disk store (see the module docstring).

    Args:
        host: a :class:`HostStore` (``mode="write"``, or ``"read"`` for a read-only view).
        disk: a :class:`~vitrify.disk.DiskStore` with the same kind names and page sizes.
        write: ``"back"`` (default) or ``"through"``.
        queue_pages: write-back pages waiting for the disk before ``put`` waits (back-pressure).

    Promises (write-back): a put acknowledged True is in the host tier, *dirty*, until the disk
    acknowledged it: the host tier's GC never evicts a dirty page (DESIGN.md D24), so a SIGKILL
    loses none of them (the host tier outlives the process, H3), and opening the tiers again
    (a writer, any ``cold_start`` of the host tier that keeps its pages: ``"load"``) queues every
    dirty page for the disk once more. When the host tier is full of dirty pages, a put goes
    straight to the disk and is acknowledged by it. A put that cannot become durable (a store
    closed under the ``TieredStore``) raises instead of acknowledging.

    Duplicate keys: **the first write wins, in both tiers.** Keys name content; a later put of a
    key either tier already holds stores nothing new and returns True (so host and disk never
    disagree); the first bytes stay. A put of a key the host tier does not hold but the disk
    does keeps the disk's bytes (the host copy of the new put is dropped; a get promotes the
    disk's). Within one batch, the first occurrence of a key wins.

    The ``TieredStore`` owns both stores from then on: :meth:`close` (or leaving a ``with``
    block) flushes the write-back queue and closes both. One not closed is closed when it is
    collected, or at interpreter exit (its queue flushed; pages that cannot be written stay
    dirty in the host tier, said in one warning line). With two readers (``mode="read"``) it is
    read-only: ``get`` reads host then disk and promotes nothing; puts and deletes raise
    ``OSError`` (``EROFS``).
    """

    def __init__(self, host: DiskStore, disk: DiskStore, *, write: str = "back",
                 queue_pages: int = 1024) -> None:
        self._closed = True
        if not isinstance(host, DiskStore) or getattr(host, "tier", None) != "host":
            raise _check.ArgumentTypeError(f"host must be a HostStore, got {_check.got(host)}")
        if not isinstance(disk, DiskStore) or disk.tier != "disk":
            raise _check.ArgumentTypeError(f"disk must be a disk-tier DiskStore, got "
                                           f"{_check.got(disk)}")
        self.write = _check.choice("write", write, WRITE_POLICIES)
        self._queue_pages = _check.integer("queue_pages", queue_pages, 1, 1 << 24)
        if host.kind_names != disk.kind_names or any(
                host.page_bytes(k) != disk.page_bytes(k) for k in host.kind_names):
            raise ValueError(
                "host and disk stores must have the same kinds and page sizes, got "
                f"{[(k, host.page_bytes(k)) for k in host.kind_names]} and "
                f"{[(k, disk.page_bytes(k)) for k in disk.kind_names]}")
        if host.read_only != disk.read_only:
            raise ValueError("host and disk stores must both be writers or both be readers")
        self.host, self.disk = host, disk
        self.kind_names = host.kind_names
        self._counts: collections.Counter = collections.Counter()
        self._count_mu = threading.Lock()
        self._keys_mu = threading.Condition()  # one put or delete per key at a time
        self._busy: set[tuple[int, bytes]] = set()
        self._wb: _WriteBack | None = None
        if not self.read_only:
            self._wb = _WriteBack(host, disk, self._queue_pages)
            try:
                self._requeue_dirty()
            except BaseException:
                self._wb.shutdown()
                raise
        self._closed = False
        _open_tiered.add(self)

    def _requeue_dirty(self) -> None:
        """Every dirty page of the host tier (a write-back page the disk never acknowledged
        before the last writer stopped) is queued for the disk again. One the disk holds too was
        being written back when the writer stopped (at most a batch): when the disk's copy reads
        back as the host's it is only marked clean; one that does not verify (torn by the stop)
        is removed there and written anew; one with other bytes keeps the disk's (the first
        write) and the host copy goes."""
        items = []
        for k in range(len(self.kind_names)):
            dirty = self.host.dirty_keys(k)
            if not dirty:
                continue
            both = [sk for sk, n in zip(dirty, self.disk._native().lookup(k, dirty)) if n >= 0]
            settled: set[bytes] = set()
            if both:
                mine = self.host._native().get_many(k, both)
                theirs = self.disk._native().get_many(k, both)
                same = [sk for sk, a, b in zip(both, mine, theirs) if b is not None and a == b]
                other = [sk for sk, a, b in zip(both, mine, theirs)
                         if b is not None and a is not None and a != b]
                torn = [sk for sk, b in zip(both, theirs) if b is None]
                if same:
                    self.host._mark_clean_store_keys(same, k)
                if other:
                    self.host._native().remove(k, other)
                if torn:
                    self.disk._native().remove(k, torn)
                settled = set(same) | set(other)
            items += [(k, sk) for sk in dirty if sk not in settled]
        if items:
            self._count("requeued", len(items))
            logger.info("vitrify.tier: %d dirty pages of the host tier queued for the disk again",
                        len(items))
            self._wb.enqueue(items)

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def read_only(self) -> bool:
        return self.host.read_only

    def flush(self) -> None:
        """Wait until every page put so far has been acknowledged by the disk store. OSError
        (EIO) when some could not be written (they stay dirty in the host tier and are retried)."""
        if self._wb is not None:
            self._wb.flush()

    def close(self) -> None:
        """Flush the write-back queue, stop its thread, close both stores (idempotent). Pages
        the disk refuses stay dirty in the host tier (one warning line), written again when the
        tiers are opened again."""
        self._close(at_exit=False)

    def _close(self, at_exit: bool) -> None:
        if self._closed:
            return
        self._closed = True
        _open_tiered.discard(self)
        try:
            if self._wb is not None:
                queued = self._wb.backlog()
                try:
                    self._wb.flush()
                    if at_exit:
                        logger.info("vitrify.tier: a TieredStore left open was closed at exit, "
                                    "%d queued pages written to the disk", queued)
                except (OSError, RuntimeError) as e:
                    logger.warning("vitrify.tier: %s%s", "at exit: " if at_exit else "",
                                   _one_line(e))
                self._wb.shutdown()
        finally:
            self.host.close()
            self.disk.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._close(at_exit=False)
        except Exception:
            pass

    # -- helpers ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("I/O operation on a closed TieredStore")

    def _refuse_if_read_only(self, what: str) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, f"TieredStore.{what}: the tiers are open read-only")

    def _refuse_if_not_durable(self, what: str) -> None:
        """A put that could not become durable raises rather than being acknowledged."""
        for name, store in (("host", self.host), ("disk", self.disk)):
            if store.closed:
                raise ValueError(f"TieredStore.{what}: its {name} store is closed, so a page put "
                                 f"now could never reach the disk; close the TieredStore (it "
                                 f"closes both stores) instead of one of them")
        if self._wb is not None and not self._wb.thread.is_alive():
            raise RuntimeError(f"TieredStore.{what}: the write-back thread has stopped")

    def _kind(self, kind: str | int | None) -> int:
        return self.host._kind(kind)

    def _count(self, name: str, n: int = 1) -> None:
        with self._count_mu:
            self._counts[name] += n

    def _claim(self, items: Sequence[tuple[int, bytes]]) -> None:
        with self._keys_mu:
            self._keys_mu.wait_for(lambda: not any(it in self._busy for it in items))
            self._busy.update(items)

    def _try_claim(self, items: Sequence[tuple[int, bytes]]) -> list[bool]:
        with self._keys_mu:
            got = [it not in self._busy for it in items]
            self._busy.update(it for it, g in zip(items, got) if g)
            return got

    def _release(self, items: Sequence[tuple[int, bytes]]) -> None:
        with self._keys_mu:
            self._busy.difference_update(items)
            self._keys_mu.notify_all()

    # -- puts ------------------------------------------------------------------------------
    def put(self, key: Any, data: Any, kind: str | int | None = None) -> bool:
        """Store one page (see :meth:`batch_put`)."""
        return self.batch_put([key], [data], kind)[0]

    def batch_put(self, keys: Sequence[Any], datas: Sequence[Any],
                  kind: str | int | None = None) -> list[bool]:
        """Store pages in the host tier and the disk behind it. Write-back: True once a page is
        in host memory, dirty until the disk has it (or, when the host tier is full of dirty
        pages, once it is on disk); the disk write follows. Write-through: True once the disk
        acknowledged it (the host copy is a cache). A key already stored keeps its first bytes
        (True). ValueError when a store was closed under the TieredStore."""
        self._check_open()
        self._refuse_if_read_only("put")
        k = self._kind(kind)
        keys = _check.sequence("keys", keys)
        datas = _check.sequence("datas", datas)
        if len(keys) != len(datas):
            raise ValueError(f"keys and datas differ in length: {len(keys)} and {len(datas)}")
        skeys = [make_key(key, f"keys[{i}]") for i, key in enumerate(keys)]
        first: dict[bytes, int] = {}
        for i, sk in enumerate(skeys):
            first.setdefault(sk, i)  # within a batch, the first occurrence wins
        uniq = sorted(first.values())
        self._refuse_if_not_durable("put")
        items = [(k, skeys[i]) for i in uniq]
        self._claim(items)
        try:
            put = self._put_back if self.write == "back" else self._put_through
            got = put(k, [skeys[i] for i in uniq], [datas[i] for i in uniq])
        finally:
            self._release(items)
        self._count("puts", len(keys))
        if self._wb is not None and self.write == "back":
            self._wb.wait_for_room()
        by_key = {skeys[i]: ok for i, ok in zip(uniq, got)}
        return [by_key[sk] for sk in skeys]

    def _put_back(self, k: int, sks: list[bytes], datas: list[Any]) -> list[bool]:
        out = [False] * len(sks)
        # A key the disk holds already keeps the disk's bytes (the first write; the host tier
        # evicted its copy, or still holds the same): nothing new goes anywhere.
        on_disk = self.disk._native().lookup(k, sks)
        fresh = [i for i in range(len(sks)) if on_disk[i] < 0]
        for i in range(len(sks)):
            out[i] = on_disk[i] >= 0
        if not fresh:
            return out
        res = self.host._put_store_keys([sks[i] for i in fresh], [datas[i] for i in fresh], k,
                                        dirty=True).wait_results()
        queued, direct, resend = [], [], []
        for i, r in zip(fresh, res):
            if r == "stored":
                out[i] = True
                queued.append(i)
            elif r == "duplicate":
                out[i] = True  # the host tier holds the first bytes (dirty: queued ...
                if not self._wb.queued((k, sks[i])):
                    resend.append(i)  # ... or clean, and the disk lost them: they go again)
            else:  # full of dirty pages (or in flight): straight to the disk
                direct.append(i)
        if resend:
            firsts = self.host._native().get_many(k, [sks[i] for i in resend])
            have = [(i, f) for i, f in zip(resend, firsts) if f is not None]
            direct += [i for i, f in zip(resend, firsts) if f is None]  # evicted meanwhile
            if have:
                acks = self.disk._put_store_keys([sks[i] for i, _ in have], [f for _, f in have],
                                                 k).wait()
                for (i, _), ok in zip(have, acks):
                    out[i] = ok
        if direct:
            self._refuse_if_not_durable("put")
            acks = self.disk._put_store_keys([sks[i] for i in direct], [datas[i] for i in direct],
                                             k).wait()
            for i, ok in zip(direct, acks):
                out[i] = ok
            self._count("straight_to_disk", sum(acks))
        if queued:
            self._wb.enqueue([(k, sks[i]) for i in queued])
        return out

    def _put_through(self, k: int, sks: list[bytes], datas: list[Any]) -> list[bool]:
        out = [False] * len(sks)
        on_disk = self.disk._native().lookup(k, sks)  # held there: the first bytes, acknowledged
        fresh = [i for i in range(len(sks)) if on_disk[i] < 0]
        for i in range(len(sks)):
            out[i] = on_disk[i] >= 0
        if not fresh:
            return out
        res = self.host._put_store_keys([sks[i] for i in fresh], [datas[i] for i in fresh],
                                        k).wait_results()
        disk_datas = [datas[i] for i in fresh]
        for j, (i, r) in enumerate(zip(fresh, res)):
            if r == "duplicate":
                # the host tier holds the first bytes and the disk lost them: those go to disk
                first_bytes = self.host._native().get_many(k, [sks[i]])[0]
                if first_bytes is not None:
                    disk_datas[j] = first_bytes
        dres = self.disk._put_store_keys([sks[i] for i in fresh], disk_datas, k).wait_results()
        drop = []
        for i, r, dr in zip(fresh, res, dres):
            out[i] = dr in ("stored", "duplicate")
            # a host copy that is not what the disk holds goes: the disk refused it (the put is
            # not acknowledged), or got the key meanwhile
            if r == "stored" and dr != "stored":
                drop.append(sks[i])
        if drop:
            self.host._native().remove(k, drop)
        return out

    # -- gets ------------------------------------------------------------------------------
    def get(self, key: Any, kind: str | int | None = None) -> bytes | None:
        """One page (see :meth:`batch_get`)."""
        return self.batch_get([key], kind)[0]

    def batch_get(self, keys: Sequence[Any], kind: str | int | None = None) -> list[bytes | None]:
        """Pages from the host tier, else the disk (a disk hit is promoted into the host tier
        unless read-only); None for a miss."""
        self._check_open()
        k = self._kind(kind)
        keys = _check.sequence("keys", keys)
        skeys = [make_key(key, f"keys[{i}]") for i, key in enumerate(keys)]
        out = self.host._native().get_many(k, skeys)
        self._count("host_hits", sum(v is not None for v in out))
        rest = [i for i, v in enumerate(out) if v is None]
        if not rest:
            return out
        got = self.disk._native().get_many(k, [skeys[i] for i in rest])
        promote = []
        for i, v in zip(rest, got):
            if v is None:
                self._count("misses")
                continue
            out[i] = v
            self._count("disk_hits")
            promote.append(i)
        if promote and not self.read_only:
            self._promote(k, [skeys[i] for i in promote], [out[i] for i in promote])
        return out

    def _promote(self, k: int, sks: list[bytes], datas: list[bytes]) -> None:
        """Disk hits into the host tier (clean: the disk has them), except keys a put or delete
        is working on right now (that one decides what the host tier holds)."""
        items = [(k, sk) for sk in dict.fromkeys(sks)]
        got = self._try_claim(items)
        mine = {it[1] for it, g in zip(items, got) if g}
        try:
            pick = [(sk, d) for sk, d in zip(sks, datas) if sk in mine]
            if pick:
                ok = self.host._put_store_keys([sk for sk, _ in pick], [d for _, d in pick],
                                               k).wait()
                self._count("promotions", sum(ok))
        finally:
            self._release([it for it, g in zip(items, got) if g])

    def exists(self, key: Any, kind: str | int | None = None) -> bool:
        """In either tier; no I/O."""
        self._check_open()
        k = self._kind(kind)
        return self.host.exists(key, kind=k) or self.disk.exists(key, kind=k)

    def delete(self, key: Any, kind: str | int | None = None) -> bool:
        """Remove a page from both tiers (after its disk write in flight, if any); once it
        returns, neither tier nor a reader's later refresh finds it."""
        self._check_open()
        self._refuse_if_read_only("delete")
        k = self._kind(kind)
        it = (k, make_key(key))
        self._claim([it])
        try:
            if self._wb is not None:
                self._wb.forget(it)
            a = self.host._native().remove(k, [it[1]])[0]
            b = self.disk._native().remove(k, [it[1]])[0]
        finally:
            self._release([it])
        return a or b

    def stats(self) -> dict[str, Any]:
        """Per tier the store's stats, and the tiering counters: puts, host_hits, disk_hits,
        misses, promotions, straight_to_disk (write-back puts the full host tier sent to the
        disk), writebacks, writeback_failures (attempts, retried), writeback_lost (gone from
        the host tier before their write), requeued (dirty pages queued again on open),
        writeback_queue (pages waiting) and dirty (dirty pages in the host tier)."""
        with self._count_mu:
            out: dict[str, Any] = {n: self._counts[n] for n in (
                "puts", "host_hits", "disk_hits", "misses", "promotions", "straight_to_disk",
                "requeued")}
        wb = self._wb
        if wb is not None:
            with wb.mu:
                out.update({n: wb.counts[n] for n in ("writebacks", "writeback_failures",
                                                      "writeback_lost")})
                out["writeback_queue"] = wb.backlog() + len(wb.failed)
        else:
            out.update(writebacks=0, writeback_failures=0, writeback_lost=0, writeback_queue=0)
        out["write"] = self.write
        out["host"] = self.host.stats()
        out["disk"] = self.disk.stats()
        out["dirty"] = sum(kd["dirty"] for kd in out["host"]["kinds"].values())
        return out


#: Every TieredStore not closed yet: closed by the atexit hook below (flushing its queue) while
#: the interpreter, its threads and the native stores are all still alive.
_open_tiered: weakref.WeakSet[TieredStore] = weakref.WeakSet()


@atexit.register
def _close_tiered_at_exit() -> None:
    for t in list(_open_tiered):
        try:
            t._close(at_exit=True)
        except Exception as e:  # never an exception out of an atexit hook
            logger.warning("vitrify.tier: closing a TieredStore at exit: %s", _one_line(e))


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


# ---------------------------------------------------------------------------------- ops
def list_slabs(dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The slab files of a host-tier directory (:func:`default_dir` when None), one dict each:
    ``path``, ``bytes`` (memory taken), ``size`` (file size), ``uid``, ``mode``, ``name`` (the
    store name: the identity), ``kind``, ``identity_ok`` (the header's store tag matches the
    name), ``slot_bytes``, ``slot_count``, ``slab_id``, ``created`` and ``last_use`` (UTC,
    ISO 8601; last use is the writer's last open or close), ``locked`` (an open writer holds
    it), ``holder`` (``{"pid", "host", "since"}`` from its owner record, or None)."""
    d = default_dir() if dir is None else os.fspath(dir)
    if not os.path.isdir(d):
        return []
    out = []
    for path in sorted(glob.glob(os.path.join(glob.escape(d), "*.kind*.slab"))):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        base = os.path.basename(path)[:-len(".slab")]
        name, _, kind_text = base.rpartition(".kind")
        header = _native.disk_slab_header(path)
        owner = _native.disk_slab_owner(path)
        locked = _native.disk_slab_lock_held(path)
        out.append({
            "path": path, "bytes": st.st_blocks * 512, "size": st.st_size, "uid": st.st_uid,
            "mode": f"{stat.S_IMODE(st.st_mode):04o}", "name": name,
            "kind": int(kind_text) if kind_text.isdigit() else None,
            "identity_ok": header is not None and header["store_tag"] == _native.disk_store_tag(name),
            "slot_bytes": header["slot_bytes"] if header else None,
            "slot_count": header["slot_count"] if header else None,
            "slab_id": header["slab_id"] if header else None,
            "created": _iso(header["created_ns"] / 1e9) if header else None,
            "last_use": _iso(st.st_mtime),
            "locked": locked,
            "holder": ({"pid": owner[0], "host": owner[1], "since": owner[2]}
                       if owner is not None and locked else None),
        })
    return out


def remove_slabs(dir: str | os.PathLike | None = None, *, name: str | None = None,
                 force: bool = False) -> tuple[list[str], list[str]]:
    """Remove the host slabs (and their owner records) of a directory, or only those of store
    ``name``. A slab an open writer holds (its lock is held, so its process is alive) is kept
    and reported unless ``force``: then it is unlinked anyway — the holder and any reader keep
    their mappings until they close, but a restart finds nothing. Readers hold no lock and are
    not protected. Returns ``(removed, kept)`` paths."""
    removed, kept = [], []
    for s in list_slabs(dir):
        if name is not None and s["name"] != name:
            continue
        if s["uid"] != os.geteuid():
            kept.append(s["path"])
            continue
        if s["locked"] and not force:
            kept.append(s["path"])
            continue
        for p in (s["path"], s["path"] + ".owner"):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        removed.append(s["path"])
    return removed, kept


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
