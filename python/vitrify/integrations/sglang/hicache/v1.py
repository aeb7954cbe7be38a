"""The v1 path: zero-copy KV page transfers by host-pool index (SGLang's ``batch_set_v1`` /
``batch_get_v1`` with ``interface_v1``): pages are gathered natively from the host pool into the KV
store's aligned slot buffers and written, or read, verified and scattered back, double-buffered,
in one native call per batch (:class:`vitrify.disk.PageMover`, GIL released for the whole call)."""

from __future__ import annotations

import time
from typing import List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from .settings import _KIND, _MiB, logger


class _V1Path:
    """The v1 methods of :class:`~.backend.VitrifyStorage` (a mixin: it uses the backend's KV
    store, host geometry, page mover and counters)."""

    def _pages(self, n_keys: int, host_indices: torch.Tensor) -> List[int]:
        g = self._geom
        t = host_indices.reshape(-1)
        if t.numel() != n_keys * g.page_tokens:
            raise ValueError(f"{t.numel()} host indices for {n_keys} keys of "
                             f"{g.page_tokens} tokens")
        if n_keys == 0:
            return []
        t = t.to(device="cpu", dtype=torch.int64).view(n_keys, g.page_tokens)
        first = t[:, 0]
        if bool((first % g.page_tokens != 0).any()) or \
                bool((t[:, -1] - first != g.page_tokens - 1).any()):
            raise ValueError("host indices are not whole, aligned pages")
        return (first // g.page_tokens).tolist()

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Write the host-pool pages at ``host_indices`` under ``keys``; one bool per key
        (True: the page is on disk after the call, already there counts)."""
        n = len(keys)
        if n == 0:
            return []
        try:
            t0 = time.perf_counter()
            with self._state.shared():
                store, g = self._store, self._geom
                if store is None:
                    return [False] * n
                if self._reader:  # the writer (MLA TP rank 0, or the owning server) writes them
                    return [True] * n
                pages = self._pages(n, host_indices)
                behind = False
                if self._host_mover is not None:
                    # The host tier first (memory speed). Write-through: the disk follows in
                    # this call and its result is the acknowledgement (host failures, a full
                    # host tier, are counted). Write-back: a batch the host tier took whole is
                    # acknowledged now and queued for the disk, if the queue has room.
                    hres, hpresent = self._host_mover.put_pages(keys, g.layout, pages)
                    with self._clock:
                        self._host_c["host_set_failed"] += sum(1 for r in hres if not r)
                    wb = self._writeback
                    behind = wb is not None and all(hres) and wb.offer(list(keys))
                if behind:
                    results, present = hres, hpresent
                else:
                    # One native call: skip stored keys, gather chunk i+1 while chunk i is
                    # written.
                    results, present = self._mover.put_pages(keys, g.layout, pages)
                written = sum(results) - present
            dt = time.perf_counter() - t0
            with self._clock:
                c = self._c
                c.set_pages += written
                c.set_bytes += written * g.blob_bytes
                c.set_dedup += present
                c.set_failed += sum(1 for r in results if not r)
                c.backup_pgs.append(n)
                if written and dt > 0:
                    c.backup_bandwidth.append(written * g.blob_bytes / dt / 1e9)
                total_written, total_read = c.set_pages, c.get_pages
            # One summary line per batch (SGLang batches up to STORAGE_BATCH_SIZE pages).
            logger.info("vitrify HiCache backend: batch_set_v1 %d pages: %d written%s, %d "
                        "already stored, %d failed, %.1f MiB in %.1f ms; totals: %d pages "
                        "written, %d pages read", n, written,
                        " (host tier; disk behind)" if behind else "", present,
                        sum(1 for r in results if not r), written * g.blob_bytes / _MiB,
                        dt * 1e3, total_written, total_read)
            self._publish()
            return results
        except Exception as e:
            self._error("batch_set_v1", e)
            return [False] * n

    def _get_tiered(self, keys: List[str], g, pages: List[int]):
        """The host tier first, then the disk for its misses; disk hits are copied into the
        host tier (promotion). Caller holds the state lock shared."""
        if self._host_mover is None:
            # One native call: two chunks of reads in flight while one is scattered.
            return self._mover.get_pages(keys, g.layout, pages)
        results, dropped = self._host_mover.get_pages(keys, g.layout, pages)
        rest = [i for i, hit in enumerate(results) if not hit]
        host_hits = len(keys) - len(rest)
        promoted = 0
        if rest:
            dres, ddrop = self._mover.get_pages([keys[i] for i in rest], g.layout,
                                                [pages[i] for i in rest])
            dropped = list(dropped) + [(rest[j], ln) for j, ln in ddrop]
            hit = [rest[j] for j, ok in enumerate(dres) if ok]
            for i in hit:
                results[i] = True
            if hit and not self._reader:  # promotion: the pages just scattered, into host
                pres, _ = self._host_mover.put_pages([keys[i] for i in hit], g.layout,
                                                     [pages[i] for i in hit])
                promoted = sum(1 for r in pres if r)
        with self._clock:
            self._host_c["host_hits"] += host_hits
            self._host_c["host_promotions"] += promoted
        return results, dropped

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Read ``keys`` into the host-pool pages at ``host_indices``; one bool per key
        (False: absent, evicted, failed verification or any error — the page is untouched
        or must not be used, exactly as SGLang treats a miss)."""
        n = len(keys)
        if n == 0:
            return []
        try:
            t0 = time.perf_counter()
            with self._state.shared():
                store, g = self._store, self._geom
                if store is None:
                    return [False] * n
                pages = self._pages(n, host_indices)
                t1 = time.perf_counter()
                results, dropped = self._get_tiered(keys, g, pages)
                t_native = time.perf_counter() - t1
            for i, ln in dropped:
                logger.warning("vitrify HiCache backend: page %s has %d bytes, %d expected; "
                               "dropped", keys[i], ln, g.blob_bytes)
            hits = sum(results)
            dt = time.perf_counter() - t0
            with self._clock:
                c = self._c
                c.get_pages += hits
                c.get_bytes += hits * g.blob_bytes
                c.get_misses += n - hits
                c.prefetch_pgs.append(n)
                if hits and dt > 0:
                    c.prefetch_bandwidth.append(hits * g.blob_bytes / dt / 1e9)
                total_written, total_read = c.set_pages, c.get_pages
            # the native get's own time apart from the lock and the index conversion: where
            # a slow batch spends it
            logger.info("vitrify HiCache backend: batch_get_v1 %d pages: %d read, %d missed, "
                        "%.1f MiB in %.1f ms (%.1f ms in the native get); totals: %d pages "
                        "written, %d pages read",
                        n, hits, n - hits, hits * g.blob_bytes / _MiB, dt * 1e3,
                        t_native * 1e3, total_written, total_read)
            self._publish()
            return results
        except Exception as e:
            self._error("batch_get_v1", e)
            return [False] * n
