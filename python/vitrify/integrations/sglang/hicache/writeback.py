"""Write-back of host-tier pages to the disk store (``host_write = "back"``).

A v1 set that lands whole in the host tier is acknowledged from there; its keys join a queue,
and one background thread copies them from the host tier to the disk store (``batch_get`` from
the host store, ``batch_put`` into the disk store, which syncs before it answers). The queue holds
at most a quarter of the host tier's slots: GC keeps the newest 85 % of them (D8), so a queued
page is evicted before its disk write only if reads touch more than 60 % of the host tier in
the meantime; such a page is counted as lost (a later miss, never wrong bytes). A set that does
not fit the queue is written through. ``clear`` and a weight-version switch drop the queue (its
pages belong to a store that is going away), holding the backend's state lock exclusively so no
set queues more meanwhile; ``close`` first refuses new keys (later sets are written through),
then waits until the queue is written.

The thread takes the backend's state lock shared for each batch, like any transfer call, so it
never runs while the stores are swapped; the callers below never hold that lock while they wait
for the thread.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from .settings import _KIND, logger

_BATCH = 16  # pages per disk batch (one fdatasync per slab per batch in the store)


class WriteBack:
    """The queue and its thread (one per backend, started with the first write-back host tier)."""

    def __init__(self, backend: Any, capacity: int) -> None:
        self._b = backend
        self.capacity = max(1, capacity)
        self._q: collections.deque = collections.deque()
        self._busy = 0
        self._stop = False
        self._refusing = False
        self._cv = threading.Condition()
        self.counts = {"writeback_queued": 0, "writeback_written": 0, "writeback_lost": 0,
                       "writeback_dropped": 0, "writeback_failed": 0}
        self._thread = threading.Thread(target=self._run, name="vitrify-hicache-writeback",
                                        daemon=True)
        self._thread.start()

    def refuse(self) -> None:
        """Take no more keys (the backend is closing: later sets are written through)."""
        with self._cv:
            self._refusing = True

    def offer(self, keys: list) -> bool:
        """Queue ``keys`` for the disk, all or none: False when they do not fit, or once
        :meth:`refuse` was called."""
        with self._cv:
            if self._refusing or len(self._q) + self._busy + len(keys) > self.capacity:
                return False
            self._q.extend(keys)
            self.counts["writeback_queued"] += len(keys)
            self._cv.notify_all()
            return True

    def depth(self) -> int:
        with self._cv:
            return len(self._q) + self._busy

    def drop(self) -> int:
        """Forget the queued keys (the batch being written finishes); how many were dropped."""
        with self._cv:
            n = len(self._q)
            self._q.clear()
            self.counts["writeback_dropped"] += n
            return n

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued page was written (or lost); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._q or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stop(self) -> None:
        """Take no more keys, write what is queued, then end the thread."""
        self.refuse()
        self.flush()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    def _take(self) -> list | None:
        with self._cv:
            while not self._q and not self._stop:
                self._cv.wait()
            if not self._q:
                return None
            batch = [self._q.popleft() for _ in range(min(_BATCH, len(self._q)))]
            self._busy = len(batch)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            written = lost = failed = 0
            try:
                with self._b._state.shared():
                    host, store = self._b._host_store, self._b._store
                    if host is None or store is None:
                        lost = len(batch)
                    else:
                        datas = host.batch_get(batch, _KIND)
                        have = [(k, d) for k, d in zip(batch, datas) if d is not None]
                        lost = len(batch) - len(have)
                        if have:
                            res = store.batch_put([k for k, _ in have], [d for _, d in have],
                                                  _KIND)
                            written = sum(1 for r in res if r)
                            failed = len(res) - written
            except Exception as e:  # never end the thread: count, log, go on
                failed = len(batch) - written - lost
                self._b._error("host write-back", e)
            finally:
                with self._cv:
                    self.counts["writeback_written"] += written
                    self.counts["writeback_lost"] += lost
                    self.counts["writeback_failed"] += failed
                    self._busy = 0
                    self._cv.notify_all()
            if lost:
                logger.warning("vitrify HiCache backend: %d host-tier pages left the host tier "
                               "before their disk write (misses from now on)", lost)
