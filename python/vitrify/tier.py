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
is in host memory) or with it (``"through"``: acknowledged once the disk acknowledged too).
``get`` reads the host tier first, then the disk; a disk hit is copied into the host tier
(promotion). The tiers are inclusive: every page reaches the disk, so when the host tier is full
its LRU eviction (the store's GC) drops pages the disk already holds or is about to hold — that
is the demotion. Pages still waiting for their disk write are served from the write-back queue.

``list_slabs(dir=None)`` and ``remove_slabs(dir=None, force=False)`` are what ``vitrify tier ls``
and ``vitrify tier clear`` run.
"""

from __future__ import annotations

import collections
import datetime
import errno
import glob
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from . import _check, _native, config
from . import disk as _disk
from .disk import DiskStore, HostSpaceError, make_key

WRITE_POLICIES = ("back", "through")


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


class TieredStore:
    """A host tier in front of a disk store (see the module docstring).

    Args:
        host: a :class:`HostStore` (``mode="write"``, or ``"read"`` for a read-only view).
        disk: a :class:`~vitrify.disk.DiskStore` with the same kind names and page sizes.
        write: ``"back"`` (default) or ``"through"``.
        queue_pages: write-back pages waiting for the disk before ``put`` waits (back-pressure).

    The ``TieredStore`` owns both stores from then on: :meth:`close` (or leaving a ``with``
    block) flushes the write-back queue and closes both; call it, since the write-back thread
    keeps the object alive until then. With two readers (``mode="read"``) it is read-only: ``get`` reads host
    then disk and promotes nothing; puts and deletes raise ``OSError`` (``EROFS``).
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
        self._mu = threading.Condition()
        # write-back: (kind index, store key) -> (caller's key, data), in put order; served to
        # gets until the disk acknowledged it
        self._pending: collections.OrderedDict[tuple[int, bytes], tuple[Any, bytes]] = \
            collections.OrderedDict()
        self._inflight: dict[tuple[int, bytes], tuple[Any, bytes]] = {}
        self._stop = False
        self._counts = collections.Counter()
        self._closed = False
        self._thread = None
        if self.write == "back" and not self.read_only:
            self._thread = threading.Thread(target=self._write_back, name="vitrify-tier-writeback",
                                            daemon=True)
            self._thread.start()

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def read_only(self) -> bool:
        return self.host.read_only

    def flush(self) -> None:
        """Wait until every page put so far has been acknowledged by the disk store."""
        with self._mu:
            self._mu.wait_for(lambda: (not self._pending and not self._inflight) or self._stop)

    def close(self) -> None:
        """Flush the write-back queue, stop its thread, close both stores (idempotent)."""
        if self._closed:
            return
        try:
            if self._thread is not None:
                self.flush()
                with self._mu:
                    self._stop = True
                    self._mu.notify_all()
                self._thread.join()
        finally:
            self._closed = True
            self.host.close()
            self.disk.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- helpers ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("I/O operation on a closed TieredStore")

    def _refuse_if_read_only(self, what: str) -> None:
        if self.read_only:
            raise OSError(errno.EROFS, f"TieredStore.{what}: the tiers are open read-only")

    def _kind(self, kind: str | int | None) -> int:
        return self.host._kind(kind)

    def _write_back(self) -> None:
        while True:
            with self._mu:
                self._mu.wait_for(lambda: self._pending or self._stop)
                if not self._pending:
                    return
                batch = []
                while self._pending and len(batch) < 64:
                    batch.append(self._pending.popitem(last=False))
                self._inflight.update(batch)
                self._mu.notify_all()  # room in the queue
            by_kind: dict[int, list] = collections.defaultdict(list)
            for (k, _), (key, data) in batch:
                by_kind[k].append((key, data))
            for k, items in by_kind.items():
                try:
                    ok = self.disk.batch_put([key for key, _ in items], [d for _, d in items],
                                             kind=k)
                except Exception:  # counted; the pages stay in the host tier
                    ok = [False] * len(items)
                self._counts["writebacks"] += sum(ok)
                self._counts["writeback_failures"] += len(ok) - sum(ok)
            with self._mu:
                for key, _ in batch:
                    self._inflight.pop(key, None)
                self._mu.notify_all()

    # -- puts ------------------------------------------------------------------------------
    def put(self, key: Any, data: Any, kind: str | int | None = None) -> bool:
        """Store one page (see :meth:`batch_put`)."""
        return self.batch_put([key], [data], kind)[0]

    def batch_put(self, keys: Sequence[Any], datas: Sequence[Any],
                  kind: str | int | None = None) -> list[bool]:
        """Store pages in the host tier and the disk behind it. Write-back: True once a page is
        in host memory (or, when the host tier is full, on disk); the disk write follows.
        Write-through: True once the disk acknowledged it (the host copy is a cache)."""
        self._check_open()
        self._refuse_if_read_only("put")
        k = self._kind(kind)
        keys = _check.sequence("keys", keys)
        datas = _check.sequence("datas", datas)
        if len(keys) != len(datas):
            raise ValueError(f"keys and datas differ in length: {len(keys)} and {len(datas)}")
        host_ok = self.host.batch_put(keys, datas, kind=k)
        self._counts["puts"] += len(keys)
        if self.write == "through":
            return self.disk.batch_put(keys, datas, kind=k)
        out = list(host_ok)
        missed = [i for i, ok in enumerate(host_ok) if not ok]
        if missed:  # host tier full: straight to disk, acknowledged by it
            disk_ok = self.disk.batch_put([keys[i] for i in missed], [datas[i] for i in missed],
                                          kind=k)
            for i, ok in zip(missed, disk_ok):
                out[i] = ok
        with self._mu:
            for i, ok in enumerate(host_ok):
                if not ok:
                    continue
                self._mu.wait_for(lambda: len(self._pending) < self._queue_pages or self._stop)
                self._pending[(k, make_key(keys[i]))] = (keys[i], _as_bytes(datas[i]))
            self._mu.notify_all()
        return out

    # -- gets ------------------------------------------------------------------------------
    def get(self, key: Any, kind: str | int | None = None) -> bytes | None:
        """One page (see :meth:`batch_get`)."""
        return self.batch_get([key], kind)[0]

    def batch_get(self, keys: Sequence[Any], kind: str | int | None = None) -> list[bytes | None]:
        """Pages from the host tier, else the write-back queue, else the disk (a disk hit is
        promoted into the host tier unless read-only); None for a miss."""
        self._check_open()
        k = self._kind(kind)
        keys = _check.sequence("keys", keys)
        out = self.host.batch_get(keys, kind=k)
        self._counts["host_hits"] += sum(v is not None for v in out)
        rest = [i for i, v in enumerate(out) if v is None]
        if rest and self._thread is not None:
            with self._mu:
                for i in list(rest):
                    hk = (k, make_key(keys[i]))
                    v = self._pending.get(hk, self._inflight.get(hk))
                    if v is not None:
                        out[i] = v[1]
                        self._counts["queue_hits"] += 1
            rest = [i for i in rest if out[i] is None]
        if not rest:
            return out
        got = self.disk.batch_get([keys[i] for i in rest], kind=k)
        promote_keys, promote_datas = [], []
        for i, v in zip(rest, got):
            if v is None:
                self._counts["misses"] += 1
                continue
            out[i] = v
            self._counts["disk_hits"] += 1
            promote_keys.append(keys[i])
            promote_datas.append(v)
        if promote_keys and not self.read_only:
            self._counts["promotions"] += sum(self.host.batch_put(promote_keys, promote_datas,
                                                                  kind=k))
        return out

    def exists(self, key: Any, kind: str | int | None = None) -> bool:
        """In either tier (or waiting for its disk write); no I/O."""
        self._check_open()
        k = self._kind(kind)
        if self.host.exists(key, kind=k) or self.disk.exists(key, kind=k):
            return True
        with self._mu:
            hk = (k, make_key(key))
            return hk in self._pending or hk in self._inflight

    def delete(self, key: Any, kind: str | int | None = None) -> bool:
        """Remove a page from both tiers (after its pending disk write, if any)."""
        self._check_open()
        self._refuse_if_read_only("delete")
        k = self._kind(kind)
        hk = (k, make_key(key))
        with self._mu:
            queued = self._pending.pop(hk, None) is not None
            self._mu.wait_for(lambda: hk not in self._inflight)
        a = self.host.delete(key, kind=k)
        b = self.disk.delete(key, kind=k)
        return a or b or queued

    def stats(self) -> dict[str, Any]:
        """Per tier the store's stats, and the tiering counters: puts, host_hits, queue_hits,
        disk_hits, misses, promotions, writebacks, writeback_failures, writeback_queue."""
        with self._mu:
            queue = len(self._pending) + len(self._inflight)
        out: dict[str, Any] = {n: self._counts[n] for n in (
            "puts", "host_hits", "queue_hits", "disk_hits", "misses", "promotions",
            "writebacks", "writeback_failures")}
        out["writeback_queue"] = queue
        out["write"] = self.write
        out["host"] = self.host.stats()
        out["disk"] = self.disk.stats()
        return out


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


def _as_bytes(data: Any) -> bytes:
    """A copy of a page's bytes (any buffer; a CPU torch tensor through numpy)."""
    if hasattr(data, "data_ptr") and hasattr(data, "numpy"):
        data = data.detach().contiguous().view(-1).numpy().view("uint8")
    return bytes(memoryview(data).cast("B"))


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
