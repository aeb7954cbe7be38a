"""The backend class SGLang loads, :class:`VitrifyStorage`: construction, opening and closing the
KV slab store, clear, the v0 tensor calls, existence queries and the counters (live, in
:meth:`~VitrifyStorage.counters`, and as a JSON file at ``stats_path``); the v1 path and the v2
extra pools are mixed in from :mod:`.v1` and :mod:`.v2`."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from .... import host as _host
from .... import disk as _disk
from .... import tier as _tier
from .. import versions
from .geometry import (_host_geometry, _HostGeometry, _model_identity, _rank_suffix,
                       _shares_tp_store, _store_name)
from .metrics import PrometheusExport
from .settings import _KIND, VitrifyStorageSettings, identity_text, logger
from .v1 import _V1Path
from .writeback import WriteBack
from .v2 import _ExtraPools


class _SharedLock:
    """Many holders in ``shared()`` (the I/O calls) or one in ``exclusive()`` (store swap)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False

    class _Guard:
        def __init__(self, enter, leave):
            self._enter, self._leave = enter, leave

        def __enter__(self):
            self._enter()

        def __exit__(self, *exc):
            self._leave()

    def _r_enter(self):
        with self._cv:
            while self._writer:
                self._cv.wait()
            self._readers += 1

    def _r_leave(self):
        with self._cv:
            self._readers -= 1
            if self._readers == 0:
                self._cv.notify_all()

    def _w_enter(self):
        with self._cv:
            while self._writer:
                self._cv.wait()
            self._writer = True
            while self._readers:
                self._cv.wait()

    def _w_leave(self):
        with self._cv:
            self._writer = False
            self._cv.notify_all()

    def shared(self):
        return self._Guard(self._r_enter, self._r_leave)

    def exclusive(self):
        return self._Guard(self._w_enter, self._w_leave)


# the running totals of _Counters that counters() reports (the lists are get_stats()'s)
_COUNTER_NAMES = ("set_pages", "set_bytes", "set_dedup", "set_failed", "get_pages", "get_bytes",
                  "get_misses", "exists_queries", "errors", "v2_refused")
# running totals of the disk stores (KV and extra pools), closed stores included
_STORE_TOTALS = ("gc_runs", "gc_reclaims", "verify_failures", "put_failures", "write_errors")
# gauges of the open disk stores, summed over them (the slot counts over every kind)
_STORE_GAUGES = ("slots_used", "slots_total", "write_queue_depth", "read_queue_depth",
                 "in_flight_writes", "in_flight_reads")


@dataclass
class _Counters:
    set_pages: int = 0
    set_bytes: int = 0
    set_dedup: int = 0
    set_failed: int = 0
    get_pages: int = 0
    get_bytes: int = 0
    get_misses: int = 0
    exists_queries: int = 0
    errors: int = 0
    v2_refused: int = 0
    # drained by get_stats() (SGLang's StorageMetrics)
    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


# Every backend of this process, for whoever updates the weights here (set_weight_version on
# each: integrations/sglang/weights.py after a vitrify update).
_LIVE: "weakref.WeakSet[VitrifyStorage]" = weakref.WeakSet()


def _unlink_slabs(paths: list) -> None:
    """Delete slab files and their owner records (missing ones are fine)."""
    for p in paths:
        for f in (p, p + ".owner"):
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass


def live_backends() -> list:
    """The backends open in this process."""
    return list(_LIVE)


def vitrify_backend(storage_backend: Any) -> Optional["VitrifyStorage"]:
    """The :class:`VitrifyStorage` a cache controller's ``storage_backend`` is, or serves
    through (SGLang 0.5.23's factory wraps every backend in its failure-injector proxy when
    ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_{DELAY,FAILURE}`` is set, so an ``isinstance`` check
    sees the proxy); None when it is another backend. Use this, not ``isinstance``, to find
    vitrify's methods (``vitrify_stats``, ``set_weight_version``, ...) on a controller."""
    inner = versions.current().hicache_unwrap(storage_backend)
    return inner if isinstance(inner, VitrifyStorage) else None


class VitrifyStorage(_V1Path, _ExtraPools, HiCacheStorage):
    """SGLang ``HiCacheStorage`` on vitrify's O_DIRECT slab store (see the package docstring).

    SGLang's factory calls ``VitrifyStorage(storage_config, kwargs)``, then the cache controller
    calls :meth:`register_mem_pool_host`, which opens this rank's slab files (their page size
    comes from the host pool). Thread-safe: SGLang's prefetch and backup threads call in
    concurrently.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        why = versions.current().hicache_refusal(storage_config)
        if why is not None:  # the release's features vitrify does not store correctly
            raise ValueError(f"vitrify HiCache backend: {why}")
        _LIVE.add(self)
        self.storage_config = storage_config
        self.settings = VitrifyStorageSettings.from_extra_config(storage_config.extra_config)
        extra = storage_config.extra_config or {}
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self._model = _model_identity(storage_config, self.settings.revision,
                                      self.settings.weight_version)
        # MLA under tensor parallelism (DESIGN.md): SGLang backs pages up from TP rank 0 only
        # and every rank reads them, so the TP ranks share one store: rank 0 opens it as its
        # writer, the other ranks as readers (no writes, a rescan on misses).
        self._reader = (_shares_tp_store(storage_config) and storage_config.tp_rank != 0) or \
            self.settings.role == "reader"
        self._last_refresh = 0.0
        stats_path = self.settings.stats_path
        if stats_path is not None:
            cfg = storage_config
            ranks = cfg.tp_size * cfg.pp_size * cfg.attn_cp_size
            if ranks > 1 and "{rank}" not in stats_path:
                raise ValueError(f"vitrify HiCache backend: 'stats_path' must contain {{rank}} "
                                 f"when there is more than one rank (tp_size={cfg.tp_size}, "
                                 f"pp_size={cfg.pp_size}, attn_cp_size={cfg.attn_cp_size}), "
                                 f"got {stats_path!r}")
            stats_path = stats_path.replace("{rank}", _rank_suffix(cfg))
        self._stats_path: Optional[str] = stats_path
        self._stats_lock = threading.Lock()  # one writer of the stats file at a time
        self._stats_failed = False
        self._metrics_failed = False
        self._store_info: Optional[dict] = None
        self.mem_pool_host = None
        self._geom: Optional[_HostGeometry] = None
        self._store: Optional[_disk.DiskStore] = None
        self._store_name: Optional[str] = None
        self._copier = _host.Copier()
        self._state = _SharedLock()         # store swap (clear/close) vs. everything else
        # The KV store's page mover (v1): its staging slots, one mutex per direction.
        self._mover: Optional[_disk.PageMover] = None
        self._chunk = 1
        # The host tier (settings.host_bytes > 0, writers only): a HostStore of the same name in
        # front of the KV store, with its own page mover; host_hits / host_promotions count
        # v1 gets served from it and disk hits copied into it.
        self._host_store: Optional[_tier.HostStore] = None
        self._host_mover: Optional[_disk.PageMover] = None
        self._host_c = {"host_hits": 0, "host_promotions": 0, "host_set_failed": 0}
        self._host_unavailable: Optional[str] = None  # why host_bytes > 0 has no host tier
        self._writeback: Optional[WriteBack] = None  # host_write="back": the disk behind
        self._c = _Counters()
        self._retired = {k: 0 for k in _STORE_TOTALS}  # totals of the stores closed so far
        self._clock = threading.Lock()
        self._closed = False
        # v2 extra pools (see the package docstring): name -> _ExtraPool, the planned page bytes
        # of the host pool group's extra entries, the KV store's share of the budget.
        self._extra: dict = {}
        self._plan: Optional[dict] = None
        self._extra_budget = 0
        self._kv_budget = self.settings.budget_bytes
        self._kv_v2_pool: Any = None
        self._metrics: list = []  # PrometheusExport, one per registry exported to
        if storage_config.enable_storage_metrics:
            try:
                self.export_prometheus()
            except ImportError as e:
                logger.warning("vitrify HiCache backend: no Prometheus metrics (%s); counters "
                               "stay readable through counters()", e)

    # -- lifecycle ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's layout and open this rank's slab files (SGLang calls this once,
        right after construction). ValueError for pools vitrify cannot gather."""
        super().register_mem_pool_host(mem_pool_host)
        geom = _host_geometry(mem_pool_host)
        cfg = self.storage_config
        name = _store_name(self.settings.name, cfg, geom.identity, self._model)
        plan, extra_budget = self._plan_extra_pools(mem_pool_host, geom.blob_bytes)
        with self._state.exclusive():
            if self._store is not None:
                self._retire(self._store)
                self._drop_host()
            self._geom = geom
            self._store_name = name
            self._plan, self._extra_budget = plan, extra_budget
            self._kv_budget = self.settings.budget_bytes - extra_budget
            self._store = self._open(self.settings.cold_start)
            for ep in self._extra.values():  # pools registered before the KV pool
                if ep.store is None and ep.refused is None:
                    self._open_extra(ep)
            self._store_info = self._describe_store()
            slabs = self._store_info["slabs"]
        logger.info("vitrify HiCache backend: %s, page %d B (%d tokens, %s), slabs %s, "
                    "O_DIRECT=%s, cold_start=%s, staging %d pages x 2", name, geom.blob_bytes,
                    geom.page_tokens, mem_pool_host.layout, slabs, self._store_info["o_direct"],
                    self.settings.cold_start, self._chunk)
        self._publish()

    def on_host_pools_registered(self) -> None:
        """SGLang 0.5.23's end of the host-pool registration burst (the v1 pool, then every
        entry of a host pool group through ``register_mem_host_pool_v2``; 0.5.17 never calls
        it). Logs the pools stored and an entry of the group that was not registered (its
        transfers are refused until it is); raises only when no host pool was registered, which
        fails SGLang's attach."""
        with self._state.shared():
            if self._store is None:
                raise ValueError("vitrify HiCache backend: host pools registered without "
                                 "register_mem_pool_host (no KV store is open)")
            planned = set(self._plan or {})
            stored = {k: ep.store_name for k, ep in self._extra.items() if ep.store is not None}
            missing = sorted(planned - set(self._extra))
        if missing:
            logger.error("vitrify HiCache backend: pool(s) %s of the host pool group were not "
                         "registered with register_mem_host_pool_v2; their transfers are "
                         "refused", missing)
        logger.info("vitrify HiCache backend: host pools registered: kv in %s%s",
                    self._store_name, "".join(f", {k} in {v}" for k, v in sorted(stored.items())))
        self._publish()

    def _describe_store(self) -> dict:
        """The open KV store as the stats file shows it (caller holds the state lock)."""
        return {"name": self._store_name, "page_bytes": self._geom.blob_bytes,
                "page_tokens": self._geom.page_tokens, "layout": self.mem_pool_host.layout,
                "slabs": [self._store.slab_path(_KIND, d) for d in range(len(self.settings.dirs))],
                "o_direct": self._store.direct_io(_KIND), "cold_start": self.settings.cold_start,
                "mode": self._store.mode,
                "budget_bytes": self._kv_budget, "identity": self._identity_locked(),
                "host_slabs": ([self._host_store.slab_path(_KIND)] if self._host_store
                               else []),
                "host_bytes": self.settings.host_bytes if self._host_store else 0,
                "host_unavailable": self._host_unavailable}

    def _open_store(self, budget: int, page_bytes: int, name: str,
                    cold_start: str) -> _disk.DiskStore:
        """Open one slab store of this rank: read-write, or on an MLA rank > 0 read-only, waiting
        up to ``reader_open_timeout_s`` for TP rank 0 to create and format it."""
        s = self.settings
        args = dict(name=name, direct_io=s.direct_io, read_threads=s.read_threads)
        if not self._reader:
            return _disk.DiskStore(list(s.dirs), budget, {_KIND: page_bytes},
                                   cold_start=cold_start, write_threads=s.write_threads, **args)
        return self._wait_for(lambda: _disk.DiskStore(list(s.dirs), budget, {_KIND: page_bytes},
                                                      mode="read", **args), f"store {name!r}")

    def _wait_for(self, open_store: Callable[[], Any], what: str) -> Any:
        """A reader's open: retried until the writer (TP rank 0 of an MLA model, or the server
        whose stores this one reads) has created and formatted it, for up to
        ``reader_open_timeout_s``."""
        s = self.settings
        deadline = time.monotonic() + s.reader_open_timeout_s
        while True:
            try:
                return open_store()
            except (FileNotFoundError, ValueError) as e:  # not created / formatted yet
                if time.monotonic() >= deadline:
                    writer = ("the server that owns it" if s.role == "reader"
                              else "TP rank 0")
                    raise RuntimeError(
                        f"vitrify HiCache backend: TP rank {self.storage_config.tp_rank} found "
                        f"no {what} written by {writer} within "
                        f"reader_open_timeout_s={s.reader_open_timeout_s:g} s ({e})") from e
                time.sleep(0.05)

    def _open_host(self, cold_start: str) -> None:
        """The host tier of the KV store (caller holds the state lock exclusively): a HostStore
        named like the KV store (same identity), cold start as configured, so a restarted
        server maps the pages it left in shared memory."""
        s = self.settings
        if s.host_bytes <= 0:
            return
        if self._reader and s.role != "reader":
            return  # MLA TP ranks > 0 read the shared disk store only
        if self._reader:  # another server's host tier, mapped read-only once it exists
            host = self._wait_for(lambda: _tier.HostStore(
                s.host_bytes, {_KIND: self._geom.blob_bytes}, dir=s.host_dir,
                name=self._store_name, mode="read", read_threads=s.read_threads),
                f"host tier {self._store_name!r}")
        else:
            try:
                host = _tier.HostStore(s.host_bytes, {_KIND: self._geom.blob_bytes},
                                       dir=s.host_dir, name=self._store_name,
                                       cold_start=cold_start, read_threads=s.read_threads,
                                       write_threads=s.write_threads)
            except _disk.HostSpaceError as e:
                if s.host_required:
                    raise
                # The server starts and serves from the disk tier; the stats say why.
                self._host_unavailable = str(e)
                logger.warning("vitrify HiCache backend: running without the host tier: %s "
                               "(host_required = true makes this an error)", e)
                return
        self._host_unavailable = None
        try:
            chunk = max(1, min(STORAGE_BATCH_SIZE // 4,
                               s.staging_bytes // (2 * host.slot_bytes(_KIND))))
            self._host_mover = _disk.PageMover(host, chunk, _KIND, copier=self._copier)
        except BaseException:
            host.close()
            raise
        self._host_store = host
        if s.host_write == "back" and not self._reader:
            # a quarter of the host tier's slots may wait for the disk (writeback.py)
            cap = host.stats()["kinds"][_KIND]["slots_total"] // 4
            if self._writeback is None:
                self._writeback = WriteBack(self, cap)
            else:
                self._writeback.capacity = max(1, cap)

    def _host_counters(self) -> Optional[dict]:
        """The host tier's counters (None without one); caller holds the counter lock."""
        if self._host_store is None:
            return None
        d = dict(self._host_c)
        if self._writeback is not None:
            d.update(self._writeback.counts, writeback_depth=self._writeback.depth())
        return d

    def _drop_host(self, delete: bool = False) -> None:
        """Close the host tier (caller holds the state lock exclusively); ``delete``: remove
        its slab files too (their pages belong to an identity no longer served)."""
        host, self._host_store = self._host_store, None
        self._host_mover = None
        if host is None:
            return
        paths = [host.slab_path(_KIND)]
        host.close()
        if delete:
            _unlink_slabs(paths)

    def _open(self, cold_start: str) -> _disk.DiskStore:
        store = self._open_store(self._kv_budget, self._geom.blob_bytes, self._store_name,
                                 cold_start)
        try:
            self._open_host(cold_start)
        except BaseException:
            store.close()
            raise
        self._last_refresh = time.monotonic()
        # The page mover (and its staging slots) belongs to a store; a new one with every
        # (re)open. Each direction stages two chunks: writes gather one chunk while the previous
        # one is written, reads scatter one chunk while the next one is read.
        # A quarter of SGLang's batch per chunk, so a full batch overlaps copies with I/O.
        self._chunk = max(1, min(STORAGE_BATCH_SIZE // 4,
                                 self.settings.staging_bytes // (2 * store.slot_bytes(_KIND))))
        self._mover = _disk.PageMover(store, self._chunk, _KIND, copier=self._copier)
        return store

    def close(self) -> None:
        """Finish queued writes (the host tier's write-back queue first) and close the slab
        files (idempotent)."""
        wb = self._writeback
        if wb is not None:  # sets from now on are written through; the queue reaches the disk
            wb.refuse()
            wb.flush()
        with self._state.exclusive():
            self._closed = True
            if self._store is not None:
                store, self._store = self._store, None
                self._mover = None
                self._retire(store)
            self._drop_host()
            for ep in self._extra.values():
                if ep.store is not None:
                    ep_store, ep.store = ep.store, None
                    self._retire(ep_store)
        if wb is not None:
            wb.stop()
        self._publish()

    def clear(self) -> bool:
        """Drop every page of this rank (SGLang's ``/clear_hicache_storage``): the store drops
        its index and gives every slab a new slab id (files, threads and staging buffers stay),
        so neither this process nor a later ``cold_start=load`` sees them."""
        try:
            with self._state.exclusive():
                if self._writeback is not None:  # its pages are about to go
                    self._writeback.drop()
                if self._store is None:
                    return not self._closed
                if self._reader:  # TP rank 0 clears the shared store; nothing to do here
                    return True
                self._store.clear()
                if self._host_store is not None:
                    self._host_store.clear()
                for ep in self._extra.values():
                    if ep.store is not None:
                        ep.store.clear()
            logger.info("vitrify HiCache backend: cleared %s (and %d extra pools)",
                        self._store_name, sum(1 for e in self._extra.values() if e.store))
            self._publish()
            return True
        except Exception as e:  # never raise into the scheduler
            self._error("clear", e)
            return False

    # -- identity ----------------------------------------------------------------------------

    def identity(self) -> dict:
        """Everything this rank's pages are stored under (a stored page is found only under
        the same values): ``model`` (SGLang's model name, ``--model-path``, ``--revision``,
        ``--weight-version``, ``--quantization``, ``--kv-cache-dtype``; None where SGLang did
        not publish them), ``pool`` (the host KV pool's class, layout, dtype, layers, heads,
        head dim, page tokens and page bytes; None before :meth:`register_mem_pool_host`),
        ``rank`` (TP/PP/CP rank and size) and ``store`` (the KV store's name, their hash)."""
        with self._state.shared():
            return self._identity_locked()

    def _identity_locked(self) -> dict:
        return {"model": dataclasses.asdict(self._model),
                "pool": self._geom.identity if self._geom is not None else None,
                "rank": _rank_suffix(self.storage_config), "store": self._store_name,
                "role": "reader" if self._reader else "writer"}

    def set_weight_version(self, version: str) -> Optional[str]:
        """Store and find pages under weight version ``version`` from now on; the name of the
        KV store now open (None before :meth:`register_mem_pool_host`).

        SGLang's weight updates (``update_weights_from_disk`` / ``_from_tensor`` /
        ``_from_distributed``) record the new ``weight_version`` in the tokenizer process only,
        so the backend cannot see them: whoever updates the weights calls this on every rank.
        The KV store and every extra pool's store are closed, their slab files deleted (their
        pages were computed by weights no longer served, and the disk budget holds one store
        per pool) and new ones opened under the new identity (``cold_start`` as configured).
        Calls in flight finish first. ValueError for a bad version or a closed backend."""
        version = identity_text("weight_version", version)
        with self._state.exclusive():
            if self._writeback is not None:  # pages of the weights no longer served
                self._writeback.drop()
            if self._closed:
                raise ValueError(f"vitrify HiCache backend: set_weight_version({version!r}) "
                                 f"on a closed backend")
            old = self._model.weight_version
            if version == old:
                return self._store_name
            self._model = dataclasses.replace(self._model, weight_version=version)
            if self._store is None:
                return None
            store, self._store = self._store, None   # no store if the new one cannot open
            self._mover = None
            self._retire(store, delete=True)
            self._drop_host(delete=True)
            self._store_name = _store_name(self.settings.name, self.storage_config,
                                           self._geom.identity, self._model)
            self._store = self._open(self.settings.cold_start)
            for ep in self._extra.values():
                if ep.store is not None:
                    ep_store, ep.store = ep.store, None
                    self._retire(ep_store, delete=True)
                    self._open_extra(ep)
            self._store_info = self._describe_store()
            name = self._store_name
        logger.info("vitrify HiCache backend: weight version %r -> %r: pages now in %s",
                    old, version, name)
        self._publish()
        return name

    def _retire(self, store: _disk.DiskStore, delete: bool = False) -> None:
        """Close ``store``, keeping its running totals in :meth:`counters`; ``delete``: remove
        its slab files too (caller holds the state lock exclusively)."""
        paths = [store.slab_path(k, d) for k in store.kind_names for d in range(len(store.dirs))]
        totals = store.stats()
        store.close()
        with self._clock:
            for k in _STORE_TOTALS:
                self._retired[k] += totals[k]
        if delete and not self._reader:  # a reader never deletes the writer's files
            _unlink_slabs(paths)

    # -- helpers -----------------------------------------------------------------------------

    def _error(self, op: str, exc: BaseException) -> None:
        with self._clock:
            self._c.errors += 1
            n = self._c.errors
        if n <= 10 or n % 1000 == 0:
            logger.error("vitrify HiCache backend: %s failed (%s: %s); treated as a miss "
                         "[error #%d]", op, type(exc).__name__, exc, n,
                         exc_info=n <= 3)
        self._publish()

    def _publish(self) -> None:
        """Bring the Prometheus metrics up to date and write :meth:`counters`, the KV store's
        identity and the host tier's counters (``host``: None without one) as JSON to
        ``stats_path`` (written to a temporary file, then renamed over it;
        no file without ``stats_path``). Called once the store is open and after every v1/v2
        transfer batch, exists query, error, clear, weight-version switch and close. Never raises: a failure
        is logged once."""
        path = self._stats_path
        if path is None and not self._metrics:
            return
        try:
            counters = self.counters()
            for m in self._metrics:
                m.update(counters)
        except Exception as e:
            if not self._metrics_failed:
                self._metrics_failed = True
                logger.warning("vitrify HiCache backend: cannot update the metrics (%s: %s); "
                               "counters() still answers", type(e).__name__, e)
            return
        if path is None:
            return
        with self._stats_lock:
            with self._clock:
                host = self._host_counters()
            doc = {"pid": os.getpid(), "time": time.time(), "closed": self._closed,
                   "store": self._store_info, "counters": counters, "host": host}
            tmp = f"{path}.tmp{os.getpid()}"
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                try:  # a stale temporary file (or a link put there) goes; none is followed
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644)
                with open(fd, "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, path)
            except (OSError, TypeError, ValueError) as e:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                if not self._stats_failed:
                    self._stats_failed = True
                    logger.warning("vitrify HiCache backend: cannot write 'stats_path' %s "
                                   "(%s: %s); counters stay readable through counters()",
                                   path, type(e).__name__, e)

    # -- existence ---------------------------------------------------------------------------

    def _refresh_readers(self) -> bool:
        """MLA ranks > 0: rescan the shared stores (KV and extra pools) for pages TP rank 0
        wrote since the last scan, at most once per ``reader_refresh_s`` (caller holds the
        state lock shared and just saw a miss). True when it rescanned."""
        if not self._reader:
            return False
        with self._clock:
            now = time.monotonic()
            if now - self._last_refresh < self.settings.reader_refresh_s:
                return False
            self._last_refresh = now
        for st in [self._store, self._host_store] + [ep.store for ep in self._extra.values()]:
            if st is not None:
                st.refresh()
        return True

    def exists(self, key: str) -> bool:
        """True when ``key`` is in this rank's index (no disk I/O)."""
        try:
            with self._state.shared():
                if self._store is None:
                    return False
                return bool(self._store.exists(key, _KIND))
        except Exception as e:
            self._error("exists", e)
            return False

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many of ``keys``, from the first, are stored (SGLang's prefix query)."""
        try:
            with self._state.shared():
                if self._store is None or not keys:
                    return 0
                found = self._store.batch_exists(keys, _KIND)
                if not all(found) and self._host_store is not None:
                    found = [a or b for a, b in
                             zip(found, self._host_store.batch_exists(keys, _KIND))]
                if not all(found) and self._refresh_readers():
                    found = self._store.batch_exists(keys, _KIND)
            with self._clock:
                self._c.exists_queries += 1
            self._publish()
            for i, f in enumerate(found):
                if not f:
                    return i
            return len(keys)
        except Exception as e:
            self._error("batch_exists", e)
            return 0

    # -- v0: tensors (SGLang's generic path and the draft-pool piggyback) --------------------
    # A flat page of SGLang's MHA/MLA host pools has the same bytes as vitrify's gathered page
    # (component-major, then layer), so both paths share one key space.

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """Read ``key`` into the CPU tensor ``target_location``; it, or None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        n = len(keys)
        targets = list(target_locations) if target_locations is not None else [None] * n
        out: List[Optional[torch.Tensor]] = [None] * n
        try:
            with self._state.shared():
                if self._store is None:
                    return out
                for i, (k, t) in enumerate(zip(keys, targets)):
                    if t is None or not t.is_contiguous() or t.device.type != "cpu":
                        raise ValueError(f"target for {k!r} must be a contiguous CPU tensor")
                    view = t.view(torch.uint8).reshape(-1).numpy()
                    size = self._store.size_of(k, _KIND)
                    if size is None or size != view.nbytes:
                        continue
                    if self._store.get_into(k, view, _KIND) == view.nbytes:
                        out[i] = t
            return out
        except Exception as e:
            self._error("batch_get", e)
            return [None] * n

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store the bytes of the CPU tensor ``value`` under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store tensors; True when every one is on disk after the call."""
        try:
            if values is None or len(values) != len(keys):
                raise ValueError("batch_set needs one tensor per key")
            with self._state.shared():
                if self._store is None:
                    return False
                if self._reader:  # TP rank 0 writes the shared pages (SGLang's MLA backup)
                    return True
                datas = [v.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()
                         for v in values]
                return all(self._store.batch_put(keys, datas, _KIND))
        except Exception as e:
            self._error("batch_set", e)
            return False

    # -- observability -----------------------------------------------------------------------

    def get_stats(self):
        """SGLang's storage-metrics hook: pages and GB/s per batch since the previous call."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._clock:
            c = self._c
            m.prefetch_pgs.extend(c.prefetch_pgs)
            m.backup_pgs.extend(c.backup_pgs)
            m.prefetch_bandwidth.extend(c.prefetch_bandwidth)
            m.backup_bandwidth.extend(c.backup_bandwidth)
            c.prefetch_pgs, c.backup_pgs = [], []
            c.prefetch_bandwidth, c.backup_bandwidth = [], []
        return m

    def counters(self) -> dict:
        """The backend's running totals since start-up, one int each: ``set_pages`` /
        ``set_bytes`` (KV pages written), ``set_dedup`` (already stored), ``set_failed``,
        ``get_pages`` / ``get_bytes`` (KV pages read: hits), ``get_misses``,
        ``exists_queries``, ``errors`` (failed calls, each logged), ``v2_refused`` (refused v2
        transfers); the disk stores' totals (KV and extra pools, stores closed by
        :meth:`set_weight_version` or :meth:`close` included): ``gc_runs``, ``gc_reclaims``
        (pages evicted), ``verify_failures`` (slots that did not verify: misses),
        ``put_failures`` (puts refused, store full), ``write_errors``; and gauges of the open
        stores: ``slots_used`` / ``slots_total`` (``occupancy``, a float in [0, 1], is their
        ratio), ``write_queue_depth`` / ``read_queue_depth`` (queued I/O jobs) and
        ``in_flight_writes`` / ``in_flight_reads``. The same numbers reach Prometheus (see
        :mod:`.metrics`)."""
        with self._state.shared():
            stores = [self._store] + [ep.store for ep in self._extra.values()]
            stats = [st.stats() for st in stores if st is not None]
            with self._clock:
                d = {k: getattr(self._c, k) for k in _COUNTER_NAMES}
                d.update({k: self._retired[k] + sum(x[k] for x in stats) for k in _STORE_TOTALS})
        for k in _STORE_GAUGES:
            if k.startswith("slots_"):
                d[k] = sum(kd[k] for x in stats for kd in x["kinds"].values())
            else:
                d[k] = sum(x[k] for x in stats)
        d["occupancy"] = d["slots_used"] / d["slots_total"] if d["slots_total"] else 0.0
        return d

    def export_prometheus(self, registry: Any = None) -> None:
        """Export :meth:`counters` as Prometheus metrics on ``registry`` (None: the default
        ``prometheus_client.REGISTRY``, which SGLang serves; done at construction when SGLang's
        ``enable_storage_metrics`` is set), kept up to date from then on (see :mod:`.metrics`).
        ImportError when prometheus_client is not installed."""
        export = PrometheusExport(self.storage_config.model_name,
                                  _rank_suffix(self.storage_config),
                                  _COUNTER_NAMES + _STORE_TOTALS, registry)
        self._metrics = self._metrics + [export]
        export.update(self.counters())

    def vitrify_stats(self) -> dict:
        """:meth:`counters` plus the disk store's (occupancy, spills, reloads, GC, errors), and
        ``host``: None without a host tier, else ``host_hits``, ``host_promotions``,
        ``host_set_failed``, the host store's stats (``store``) and its slab file (``slab``);
        ``host_unavailable``: None, or why a configured host tier is not there (its mount had
        too little space and ``host_required`` is false)."""
        d = self.counters()
        with self._state.shared():
            d["store"] = self._store.stats() if self._store is not None else None
            d["name"] = self._store_name
            d["page_bytes"] = self._geom.blob_bytes if self._geom else None
            d["budget_bytes"] = self._kv_budget
            d["host_unavailable"] = self._host_unavailable
            hs = self._host_store
            host = None if hs is None else {"store": hs.stats(), "slab": hs.slab_path(_KIND)}
            with self._clock:
                d["extra_pools"] = {k: ep.stats() for k, ep in self._extra.items()}
                d["host"] = None if host is None else dict(self._host_counters(), **host)
        return d

    @property
    def slab_paths(self) -> List[str]:
        """This rank's slab files, one per drive."""
        with self._state.shared():
            if self._store is None:
                return []
            return [self._store.slab_path(_KIND, d) for d in range(len(self.settings.dirs))]


__all__ = ["VitrifyStorage", "live_backends", "vitrify_backend"]
