"""The v2 extra pools: every pool of a hybrid model's host pool group other than ``kv`` (Mamba,
SWA, DSA indexer, ...) gets its own slab store and a share of the disk budget; SGLang's
``batch_{set,get,exists}_v2`` move their flat data pages, and route ``kv`` through the v1 path."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from .... import disk as _disk
from .. import versions
from .geometry import _flat_page, _pool_identity, _store_name
from .settings import _KIND, logger

_CONFLICT = object()  # a pool name registered twice with different pools


def _pool_key(name: Any) -> str:
    """A pool name as its plain string (SGLang passes ``PoolName`` members or strings)."""
    return str(getattr(name, "value", name))


@dataclass
class _ExtraPool:
    """One registered v2 pool other than ``kv`` and its own slab store."""

    name: str
    pool: Any
    page_tokens: int          # host indices per page (the pool's page_size)
    page_bytes: int           # bytes of one flat data page
    page_dtype: Any
    page_numel: int
    identity: str
    store: Optional[_disk.DiskStore] = None
    store_name: str = ""
    budget: int = 0
    refused: Optional[str] = None   # why its transfers are refused (None: usable)
    set_pages: int = 0
    set_dedup: int = 0
    set_failed: int = 0
    get_pages: int = 0
    get_misses: int = 0

    def stats(self) -> dict:
        return {"store": self.store.stats() if self.store is not None else None,
                "name": self.store_name, "page_bytes": self.page_bytes,
                "budget_bytes": self.budget, "refused": self.refused,
                "set_pages": self.set_pages, "set_dedup": self.set_dedup,
                "set_failed": self.set_failed, "get_pages": self.get_pages,
                "get_misses": self.get_misses}


class _ExtraPools:
    """The v2 methods of :class:`~.backend.VitrifyStorage` (a mixin: it uses the backend's
    settings, KV store, locks and counters; the extra pools live in ``self._extra``)."""

    def _plan_extra_pools(self, mem_pool_host: Any, kv_page_bytes: int) -> tuple:
        """The extra pools of SGLang's host pool group (name -> page bytes) and their budget."""
        plan: dict = {}
        for entry in getattr(mem_pool_host, "entries", None) or []:
            key = _pool_key(entry.name)
            if key == _KIND:
                continue
            try:
                plan[key] = _flat_page(entry.host_pool)[2]
            except Exception as e:
                logger.error("vitrify HiCache backend: extra pool %r has no usable flat data page "
                             "(%s: %s); it gets no disk budget", key, type(e).__name__, e)
        if not plan:
            return plan, 0
        given = self.settings.extra_pool_budget_bytes
        if given is not None:
            return plan, given
        total = sum(plan.values())
        share = min(0.5, total / (kv_page_bytes + total))
        return plan, int(self.settings.budget_bytes * share)

    def _open_extra(self, ep: "_ExtraPool") -> None:
        """Open ``ep``'s slab files (caller holds the state lock exclusively)."""
        cfg, s = self.storage_config, self.settings
        if ep.name not in (self._plan or {}):
            ep.refused = ("not an entry of the host pool group registered with "
                          "register_mem_pool_host, so it has no disk budget")
            logger.error("vitrify HiCache backend: extra pool %r %s; its pages are not stored",
                         ep.name, ep.refused)
            return
        total = sum(self._plan.values())
        ep.budget = self._extra_budget * self._plan[ep.name] // total
        ep.store_name = _store_name(s.name, cfg, ep.identity, self._model, ep.name)
        try:
            if ep.budget <= 0:
                raise ValueError(f"budget {ep.budget} B")
            ep.store = self._open_store(ep.budget, ep.page_bytes, ep.store_name, s.cold_start)
        except Exception as e:
            ep.refused = f"its slab store could not be opened ({type(e).__name__}: {e})"
            logger.error("vitrify HiCache backend: extra pool %r: %s; its pages are not stored",
                         ep.name, ep.refused)
            return
        logger.info("vitrify HiCache backend: extra pool %r: %s, page %d B, budget %d B "
                    "(%d slots), slabs %s", ep.name, ep.store_name, ep.page_bytes, ep.budget,
                    ep.store.stats()["kinds"][_KIND]["slots_total"],
                    [ep.store.slab_path(_KIND, d) for d in range(len(s.dirs))])

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register one pool of SGLang's host pool group (HybridCacheController calls this for
        every entry after :meth:`register_mem_pool_host`). ``kv`` is the KV pool already known
        from the v1 registration; any other pool gets its own slab store. Never raises: a pool
        that cannot be stored is logged and its transfers answer ``False``."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        key = _pool_key(host_pool_name)
        with self._state.exclusive():
            if key == _KIND:
                if self._kv_v2_pool is not None and self._kv_v2_pool is not host_pool:
                    logger.error("vitrify HiCache backend: pool 'kv' registered twice with "
                                 "different pools; v2 KV transfers are refused")
                    self._kv_v2_pool = _CONFLICT
                elif self._kv_v2_pool is None:
                    self._kv_v2_pool = host_pool
                return
            old = self._extra.get(key)
            if old is not None:
                if old.pool is host_pool:
                    logger.info("vitrify HiCache backend: extra pool %r registered again (same "
                                "pool); unchanged", key)
                    return
                old.refused = "registered twice with different pools"
                logger.error("vitrify HiCache backend: extra pool %r %s; its transfers are "
                             "refused", key, old.refused)
                return
            try:
                dtype, numel, page_bytes = _flat_page(host_pool)
                page_tokens = int(getattr(host_pool, "page_size", 1) or 1)
                ep = _ExtraPool(key, host_pool, page_tokens, page_bytes, dtype, numel,
                                _pool_identity(host_pool, page_bytes))
            except Exception as e:
                ep = _ExtraPool(key, host_pool, 1, 0, torch.uint8, 0, "")
                ep.refused = f"has no usable flat data page ({type(e).__name__}: {e})"
                logger.error("vitrify HiCache backend: extra pool %r %s; its pages are not "
                             "stored", key, ep.refused)
            self._extra[key] = ep
            if ep.refused is None and self._geom is not None and not self._closed:
                self._open_extra(ep)

    def _refuse(self, op: str, name: str, why: str) -> None:
        with self._clock:
            self._c.v2_refused += 1
            n = self._c.v2_refused
        if n <= 10 or n % 1000 == 0:
            logger.error("vitrify HiCache backend: %s for pool %r refused: %s [#%d]",
                         op, name, why, n)

    def _extra_for(self, op: str, name: str) -> Optional["_ExtraPool"]:
        """The usable extra pool ``name`` (caller holds the state lock), or None (logged)."""
        ep = self._extra.get(name)
        if ep is None:
            self._refuse(op, name, f"no such pool registered (registered: "
                                   f"{sorted(self._extra)})")
            return None
        if ep.refused is not None or ep.store is None:
            self._refuse(op, name, ep.refused or "the backend is closed")
            return None
        return ep

    def _kv_v2_ok(self, op: str) -> bool:
        """KV transfers go through the v1 store; the v2 'kv' pool must be the v1 pool's KV."""
        p = self._kv_v2_pool
        if p is None:
            return True
        if p is _CONFLICT:
            self._refuse(op, _KIND, "registered twice with different pools")
            return False
        mine = getattr(self.mem_pool_host, "kv_buffer", None)
        theirs = getattr(p, "kv_buffer", None)
        if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
                and mine.data_ptr() == theirs.data_ptr() and mine.shape == theirs.shape):
            self._refuse(op, _KIND, "the v2 'kv' pool is not the KV buffer of the host pool "
                                    "registered with register_mem_pool_host")
            return False
        return True

    def _host_pages(self, op: str, name: str, t: Any, page_tokens: int) -> Optional[list]:
        """First host index of each page of transfer ``t`` (HiCacheFile's check), or None."""
        n = len(t.keys or [])
        idx = t.host_indices
        if idx is None or idx.numel() != n * page_tokens:
            logger.error("vitrify HiCache backend: %s indices length mismatch for %s: expected "
                         "%d, got %d", op, name, n * page_tokens,
                         idx.numel() if idx is not None else 0)
            return None
        return idx.reshape(-1)[::page_tokens].to("cpu").tolist()

    def _set_extra(self, ep: "_ExtraPool", keys: List[str], pages: list) -> List[bool]:
        if self._reader:  # MLA, TP rank > 0: rank 0 writes the shared pages
            return [True] * len(keys)
        store = ep.store
        results = [bool(x) for x in store.batch_exists(keys, _KIND)]
        todo = [i for i in range(len(keys)) if not results[i]]
        if todo:
            datas = []
            for i in todo:
                d = ep.pool.get_data_page(pages[i], flat=True).detach()
                d = d.to("cpu").contiguous().view(torch.uint8).reshape(-1)
                if d.numel() != ep.page_bytes:
                    raise ValueError(f"page {pages[i]} of pool {ep.name!r} has {d.numel()} "
                                     f"bytes, {ep.page_bytes} expected")
                datas.append(d.numpy())
            for i, ok in zip(todo, store.batch_put([keys[i] for i in todo], datas, _KIND)):
                results[i] = bool(ok)
        with self._clock:
            written = sum(1 for i in todo if results[i])
            ep.set_pages += written
            ep.set_dedup += len(keys) - len(todo)
            ep.set_failed += sum(1 for r in results if not r)
        return results

    def _get_extra(self, ep: "_ExtraPool", keys: List[str], pages: list) -> List[bool]:
        store, n = ep.store, len(keys)
        results = [False] * n
        if n == 0:
            return results
        # One typed flat page per key (set_from_flat_data_page reshapes it in the pool's
        # dtype); the store reads the raw bytes straight into each row.
        rows = torch.empty((n, ep.page_numel), dtype=ep.page_dtype)
        outs = [rows[i].view(torch.uint8).numpy() for i in range(n)]
        for i, ln in enumerate(store.batch_get_into(keys, outs, _KIND)):
            if ln is None:
                continue
            if ln != ep.page_bytes:
                logger.warning("vitrify HiCache backend: pool %r page %s has %d bytes, %d "
                               "expected; dropped", ep.name, keys[i], ln, ep.page_bytes)
                store.delete(keys[i], _KIND)
                continue
            ep.pool.set_from_flat_data_page(pages[i], rows[i])
            results[i] = True
        with self._clock:
            hits = sum(results)
            ep.get_pages += hits
            ep.get_misses += n - hits
        return results

    def _batch_v2(self, op: str, transfers: list) -> dict:
        t0 = time.perf_counter()
        results: dict = {}
        moved = nbytes = 0
        for t in transfers or []:
            keys = list(t.keys or [])
            name = _pool_key(t.name)
            try:
                if name == _KIND:
                    if not self._kv_v2_ok(op):
                        results[t.name] = [False] * len(keys)
                        continue
                    if t.host_indices is None:
                        raise ValueError("a 'kv' transfer without host_indices")
                    fn = self.batch_set_v1 if op == "batch_set_v2" else self.batch_get_v1
                    results[t.name] = fn(keys, t.host_indices)
                    continue
                with self._state.shared():
                    ep = self._extra_for(op, name)
                    pages = None if ep is None else self._host_pages(op, name, t, ep.page_tokens)
                    if pages is None:
                        results[t.name] = [False] * len(keys)
                        continue
                    fn = self._set_extra if op == "batch_set_v2" else self._get_extra
                    r = fn(ep, keys, pages)
                results[t.name] = r
                moved += sum(r)
                nbytes += sum(r) * ep.page_bytes
            except Exception as e:
                self._error(f"{op}[{name}]", e)
                results[t.name] = [False] * len(keys)
        dt = time.perf_counter() - t0
        if moved:
            with self._clock:
                c = self._c
                pgs, bw = ((c.backup_pgs, c.backup_bandwidth) if op == "batch_set_v2"
                           else (c.prefetch_pgs, c.prefetch_bandwidth))
                pgs.append(moved)
                if dt > 0:
                    bw.append(nbytes / dt / 1e9)
        self._publish()
        return results

    def batch_set_v2(self, transfers: list,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        """Write each transfer's pages (``host_indices`` of its pool, one page per key): pool
        name -> one bool per key (True: on disk after the call, already there counts). ``kv``
        goes through :meth:`batch_set_v1`; an unknown or refused pool, or a length mismatch,
        is all ``False`` (logged); errors never raise."""
        return self._batch_v2("batch_set_v2", transfers)

    def batch_get_v2(self, transfers: list,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        """Read each transfer's pages into its pool at ``host_indices``: pool name -> one bool
        per key (False: absent, failed verification, refused pool or any error)."""
        return self._batch_v2("batch_get_v2", transfers)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[list] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None):
        """The usable prefix over the KV pages and every transfer's pool, with HiCacheFile's
        hit policies: ``all_pages`` needs every page of the KV prefix, ``trailing_pages`` the
        last ``len(transfer.keys)`` pages of a (possibly shorter) prefix; the pools are folded
        as the release's HiCacheFile folds them (0.5.17: the minimum of their boundaries;
        0.5.23: the prefix lengths every pool restores, ``restorable_prefix_pages``, and the
        longest of them). Any other policy is 0 hits (logged). Index look-ups only."""
        from sglang.srt.mem_cache.hicache_storage import (PoolHitPolicy, PoolName,
                                                          PoolTransferResult)

        try:
            with self._state.shared():
                if self._store is None:
                    return PoolTransferResult(0, {})
                kv_found = self._store.batch_exists(keys, _KIND) if keys else []
                if not all(kv_found) and self._refresh_readers():
                    kv_found = self._store.batch_exists(keys, _KIND)
                kv_pages = next((i for i, f in enumerate(kv_found) if not f), len(keys))
                hit_count: dict = {PoolName.KV: kv_pages} if kv_pages else {}
                # every pool's boundary and the prefix lengths it can restore; the release's
                # HiCacheFile folds them (0.5.17: the minimum; 0.5.23: the intersection)
                pools = []
                for t in (pool_transfers or []) if kv_pages else []:
                    name = _pool_key(t.name)
                    if name == _KIND:
                        have = kv_found[:kv_pages]
                    else:
                        ep = self._extra.get(name)
                        usable = ep is not None and ep.refused is None and ep.store is not None
                        have = (ep.store.batch_exists(keys[:kv_pages], _KIND) if usable
                                else [False] * kv_pages)
                    if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                        boundary = next((i for i in range(kv_pages) if not have[i]), kv_pages)
                        can = frozenset(range(1, boundary + 1))
                    elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                        trailing = max(1, len(t.keys) if t.keys else 1)
                        can = frozenset(n for n in range(1, kv_pages + 1)
                                        if all(have[max(0, n - trailing):n]))
                        boundary = max(can, default=0)
                    else:  # e.g. 0.5.23's block_groups: never guessed (0 hits, logged)
                        raise ValueError(f"hit policy {t.hit_policy!r} of pool {name!r} is not "
                                         f"supported (all_pages, trailing_pages)")
                    pools.append((t.name, boundary, can))
                result = versions.current().hicache_exists_result(
                    PoolTransferResult, kv_pages, hit_count, pools)
            with self._clock:
                self._c.exists_queries += 1
            self._publish()
            return result
        except Exception as e:
            self._error("batch_exists_v2", e)
            return PoolTransferResult(0, {})
