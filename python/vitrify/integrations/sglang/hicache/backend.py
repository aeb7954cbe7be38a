"""The backend class SGLang loads, :class:`VitrifyStorage`: construction, opening and closing the
KV slab store, clear, the v0 tensor calls, existence queries and the counters (live, in
:meth:`~VitrifyStorage.counters`, and as a JSON file at ``stats_path``); the v1 path and the v2
extra pools are mixed in from :mod:`.v1` and :mod:`.v2`."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from .... import host as _host
from .... import disk as _disk
from .geometry import _host_geometry, _HostGeometry, _rank_suffix, _store_name
from .settings import _KIND, VitrifyStorageSettings, logger
from .v1 import _V1Path
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


class VitrifyStorage(_V1Path, _ExtraPools, HiCacheStorage):
    """SGLang ``HiCacheStorage`` on vitrify's O_DIRECT slab store (see the package docstring).

    SGLang's factory calls ``VitrifyStorage(storage_config, kwargs)``, then the cache controller
    calls :meth:`register_mem_pool_host`, which opens this rank's slab files (their page size
    comes from the host pool). Thread-safe: SGLang's prefetch and backup threads call in
    concurrently.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.settings = VitrifyStorageSettings.from_extra_config(storage_config.extra_config)
        extra = storage_config.extra_config or {}
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        if storage_config.is_mla_model and storage_config.tp_size > 1:
            # SGLang backs MLA pages up from TP rank 0 only and expects every rank to read them;
            # vitrify's slabs are private to one rank.
            raise ValueError(
                f"vitrify HiCache backend: MLA models with tp_size={storage_config.tp_size} > 1 "
                f"are not supported (SGLang writes MLA pages from TP rank 0 only and vitrify "
                f"slabs are per rank)")
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
        self._store_info: Optional[dict] = None
        self.mem_pool_host = None
        self._geom: Optional[_HostGeometry] = None
        self._store: Optional[_disk.DiskStore] = None
        self._store_name: Optional[str] = None
        self._copier = _host.Copier()
        self._set_lock = threading.Lock()   # owns the set staging buffers
        self._get_lock = threading.Lock()   # owns the get staging buffers
        self._state = _SharedLock()         # store swap (clear/close) vs. everything else
        self._set_bufs: list = []
        self._get_bufs: list = []
        self._chunk = 1
        self._c = _Counters()
        self._clock = threading.Lock()
        self._closed = False
        # v2 extra pools (see the package docstring): name -> _ExtraPool, the planned page bytes
        # of the host pool group's extra entries, the KV store's share of the budget.
        self._extra: dict = {}
        self._plan: Optional[dict] = None
        self._extra_budget = 0
        self._kv_budget = self.settings.budget_bytes
        self._kv_v2_pool: Any = None

    # -- lifecycle ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's layout and open this rank's slab files (SGLang calls this once,
        right after construction). ValueError for pools vitrify cannot gather."""
        super().register_mem_pool_host(mem_pool_host)
        geom = _host_geometry(mem_pool_host)
        cfg = self.storage_config
        name = _store_name(self.settings.name, cfg, geom.identity)
        plan, extra_budget = self._plan_extra_pools(mem_pool_host, geom.blob_bytes)
        with self._state.exclusive():
            if self._store is not None:
                self._store.close()
            self._geom = geom
            self._store_name = name
            self._plan, self._extra_budget = plan, extra_budget
            self._kv_budget = self.settings.budget_bytes - extra_budget
            self._store = self._open(self.settings.cold_start)
            for ep in self._extra.values():  # pools registered before the KV pool
                if ep.store is None and ep.refused is None:
                    self._open_extra(ep)
            slabs = [self._store.slab_path(_KIND, d) for d in range(len(self.settings.dirs))]
            self._store_info = {"name": name, "page_bytes": geom.blob_bytes,
                                "page_tokens": geom.page_tokens, "layout": mem_pool_host.layout,
                                "slabs": slabs, "o_direct": self._store.direct_io(_KIND),
                                "cold_start": self.settings.cold_start,
                                "budget_bytes": self._kv_budget}
        logger.info("vitrify HiCache backend: %s, page %d B (%d tokens, %s), slabs %s, "
                    "O_DIRECT=%s, cold_start=%s, staging %d pages x 2", name, geom.blob_bytes,
                    geom.page_tokens, mem_pool_host.layout, slabs, self._store_info["o_direct"],
                    self.settings.cold_start, self._chunk)
        self._publish()

    def _open(self, cold_start: str) -> _disk.DiskStore:
        s = self.settings
        store = _disk.DiskStore(list(s.dirs), self._kv_budget, {_KIND: self._geom.blob_bytes},
                                name=self._store_name, cold_start=cold_start,
                                direct_io=s.direct_io, read_threads=s.read_threads,
                                write_threads=s.write_threads)
        # Staging buffers belong to a store; new ones with every (re)open. Writes use two sets
        # (gather one chunk while the previous one is written), and so do reads (scatter one
        # chunk while the next one is read).
        # A quarter of SGLang's batch per chunk, so a full batch overlaps copies with I/O.
        self._chunk = max(1, min(STORAGE_BATCH_SIZE // 4,
                                 self.settings.staging_bytes // (2 * store.slot_bytes(_KIND))))
        self._set_bufs = [[store.buffer(_KIND) for _ in range(self._chunk)] for _ in range(2)]
        self._get_bufs = [[store.buffer(_KIND) for _ in range(self._chunk)] for _ in range(2)]
        return store

    def close(self) -> None:
        """Finish queued writes and close the slab files (idempotent)."""
        with self._state.exclusive():
            self._closed = True
            if self._store is not None:
                store, self._store = self._store, None
                self._set_bufs, self._get_bufs = [], []
                store.close()
            for ep in self._extra.values():
                if ep.store is not None:
                    ep_store, ep.store = ep.store, None
                    ep_store.close()
        self._publish()

    def clear(self) -> bool:
        """Drop every page of this rank (SGLang's ``/clear_hicache_storage``): the store drops
        its index and gives every slab a new slab id (files, threads and staging buffers stay),
        so neither this process nor a later ``cold_start=load`` sees them."""
        try:
            with self._state.exclusive():
                if self._store is None:
                    return not self._closed
                self._store.clear()
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
        """Write :meth:`counters` and the KV store's identity as JSON to ``stats_path`` (written
        to a temporary file, then renamed over it); a no-op without ``stats_path``. Called once
        the store is open and after every v1/v2 transfer batch, error, clear and close. Never
        raises: a failure is logged once."""
        path = self._stats_path
        if path is None:
            return
        with self._stats_lock:
            doc = {"pid": os.getpid(), "time": time.time(), "closed": self._closed,
                   "store": self._store_info, "counters": self.counters()}
            tmp = f"{path}.tmp{os.getpid()}"
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                with open(tmp, "w") as f:
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
            with self._clock:
                self._c.exists_queries += 1
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
        ``get_pages`` / ``get_bytes`` (KV pages read), ``get_misses``, ``exists_queries``,
        ``errors`` (failed calls, each logged) and ``v2_refused`` (refused v2 transfers)."""
        with self._clock:
            return {k: getattr(self._c, k) for k in _COUNTER_NAMES}

    def vitrify_stats(self) -> dict:
        """:meth:`counters` plus the disk store's (occupancy, spills, reloads, GC, errors)."""
        d = self.counters()
        with self._state.shared():
            d["store"] = self._store.stats() if self._store is not None else None
            d["name"] = self._store_name
            d["page_bytes"] = self._geom.blob_bytes if self._geom else None
            d["budget_bytes"] = self._kv_budget
            with self._clock:
                d["extra_pools"] = {k: ep.stats() for k, ep in self._extra.items()}
        return d

    @property
    def slab_paths(self) -> List[str]:
        """This rank's slab files, one per drive."""
        with self._state.shared():
            if self._store is None:
                return []
            return [self._store.slab_path(_KIND, d) for d in range(len(self.settings.dirs))]


__all__ = ["VitrifyStorage"]
