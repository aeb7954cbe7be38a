"""The v1 path: zero-copy KV page transfers by host-pool index (SGLang's ``batch_set_v1`` /
``batch_get_v1`` with ``interface_v1``): pages are gathered natively from the host pool into the KV
store's aligned slot buffers and written, or read, verified and scattered back, double-buffered."""

from __future__ import annotations

import time
from typing import List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from .settings import _KIND, _MiB, logger


class _V1Path:
    """The v1 methods of :class:`~.backend.VitrifyStorage` (a mixin: it uses the backend's KV
    store, host geometry, staging buffers, copier, locks and counters)."""

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
                if self._reader:  # MLA, TP rank > 0: rank 0 writes the shared pages
                    return [True] * n
                pages = self._pages(n, host_indices)
                results = [bool(x) for x in store.batch_exists(keys, _KIND)]
                todo = [i for i in range(n) if not results[i]]
                written = 0
                with self._set_lock:
                    tickets: list = [None, None]
                    try:
                        for ci, start in enumerate(range(0, len(todo), self._chunk)):
                            part = todo[start:start + self._chunk]
                            side = ci % 2
                            if tickets[side] is not None:  # its buffers are being written
                                tk, tickets[side] = tickets[side], None
                                self._collect(tk, results)
                            bufs = self._set_bufs[side][:len(part)]
                            self._copier.gather_each(g.layout, [pages[i] for i in part],
                                                     [b.address for b in bufs], g.blob_bytes)
                            tickets[side] = (part, store.put_buffers_async(
                                [keys[i] for i in part], bufs, [g.blob_bytes] * len(part),
                                _KIND))
                    finally:
                        # Never leave a buffer in flight: the next call gathers into it.
                        for tk in tickets:
                            if tk is not None:
                                self._collect(tk, results)
                    written = sum(1 for i in todo if results[i])
            dt = time.perf_counter() - t0
            with self._clock:
                c = self._c
                c.set_pages += written
                c.set_bytes += written * g.blob_bytes
                c.set_dedup += n - len(todo)
                c.set_failed += sum(1 for r in results if not r)
                c.backup_pgs.append(n)
                if written and dt > 0:
                    c.backup_bandwidth.append(written * g.blob_bytes / dt / 1e9)
                total_written, total_read = c.set_pages, c.get_pages
            # One summary line per batch (SGLang batches up to STORAGE_BATCH_SIZE pages).
            logger.info("vitrify HiCache backend: batch_set_v1 %d pages: %d written, %d already "
                        "stored, %d failed, %.1f MiB in %.1f ms; totals: %d pages written, "
                        "%d pages read", n, written, n - len(todo),
                        sum(1 for r in results if not r), written * g.blob_bytes / _MiB,
                        dt * 1e3, total_written, total_read)
            self._publish()
            return results
        except Exception as e:
            self._error("batch_set_v1", e)
            return [False] * n

    @staticmethod
    def _collect(ticket: tuple, results: List[bool]) -> None:
        part, tk = ticket
        for i, ok in zip(part, tk.wait()):
            results[i] = bool(ok)

    def _read_scatter(self, store, g, keys, pages, results) -> None:
        """Chunks i+1 (and i+2) are read by the store's I/O threads while i is scattered."""
        n, step = len(keys), self._chunk
        chunks = [list(range(s, min(n, s + step))) for s in range(0, n, step)]

        def read(ci):
            part = chunks[ci]
            return store.get_buffers_async([keys[i] for i in part],
                                           self._get_bufs[ci % 2][:len(part)], _KIND)

        # Two chunks in flight: chunk i+1 is queued before chunk i is waited on, so the I/O
        # threads never drain while chunk i is scattered; chunk i+2 reuses chunk i's buffers.
        pending: dict = {}
        try:
            for ci in range(min(2, len(chunks))):
                pending[ci] = read(ci)
            for ci, part in enumerate(chunks):
                lens = pending.pop(ci).wait()
                hits = []
                for b, i, ln in zip(self._get_bufs[ci % 2], part, lens):
                    if ln is None:
                        continue
                    if ln != g.blob_bytes:
                        logger.warning("vitrify HiCache backend: page %s has %d bytes, %d "
                                       "expected; dropped", keys[i], ln, g.blob_bytes)
                        store.delete(keys[i], _KIND)
                        continue
                    hits.append((b, i))
                if hits:
                    self._copier.scatter_each([b.address for b, _ in hits], g.layout,
                                              [pages[i] for _, i in hits], g.blob_bytes)
                    for _, i in hits:
                        results[i] = True
                if ci + 2 < len(chunks):
                    pending[ci + 2] = read(ci + 2)
        finally:
            for t in pending.values():  # on an error: the buffers are free again once done
                t.wait()

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
            results = [False] * n
            with self._state.shared():
                store, g = self._store, self._geom
                if store is None:
                    return results
                pages = self._pages(n, host_indices)
                with self._get_lock:
                    self._read_scatter(store, g, keys, pages, results)
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
            logger.info("vitrify HiCache backend: batch_get_v1 %d pages: %d read, %d missed, "
                        "%.1f MiB in %.1f ms; totals: %d pages written, %d pages read",
                        n, hits, n - hits, hits * g.blob_bytes / _MiB, dt * 1e3,
                        total_written, total_read)
            self._publish()
            return results
        except Exception as e:
            self._error("batch_get_v1", e)
            return [False] * n
