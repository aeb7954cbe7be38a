"""The HiCache backend's Prometheus metrics, exported the way SGLang exports its own: metric
objects of ``prometheus_client`` (``Counter``, ``Gauge``) on a registry, labelled, updated by
the process that owns them. In a server started with ``--enable-metrics`` SGLang points
``prometheus_client`` at its multiprocess directory, so these values reach SGLang's ``/metrics``
endpoint next to ``sglang:*`` from the scheduler processes; a custom collector (such as
:meth:`vitrify.disk.DiskStore.prometheus_collector`) would not, as multiprocess mode reads the
metric files only.

One metric per key of :meth:`~.backend.VitrifyStorage.counters`, labels ``model_name`` and
``rank`` (the slab names' rank suffix):

=================================  ================================================================
``vitrify_hicache_<total>_total``  Counter, for every running total: ``set_pages`` (puts
                                   written), ``set_dedup``, ``set_failed``, ``get_pages`` (hits),
                                   ``get_misses`` (misses), ``set_bytes``, ``get_bytes``,
                                   ``exists_queries``, ``errors``, ``v2_refused``, ``gc_runs``,
                                   ``gc_reclaims``, ``verify_failures``, ``put_failures``,
                                   ``write_errors``
``vitrify_hicache_<gauge>``        Gauge: ``occupancy``, ``slots_used``, ``slots_total``,
                                   ``write_queue_depth``, ``read_queue_depth``,
                                   ``in_flight_writes``, ``in_flight_reads``
=================================  ================================================================

Values are brought up to date after every transfer batch, exists query, error, clear,
weight-version switch and close (where the backend also writes its ``stats_path`` file).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

_PREFIX = "vitrify_hicache_"
_LABELS = ("model_name", "rank")
GAUGES = ("occupancy", "slots_used", "slots_total", "write_queue_depth", "read_queue_depth",
          "in_flight_writes", "in_flight_reads")

# A registry takes each metric name once: the metric objects of one registry, shared by every
# backend of the process that exports to it (their label values tell them apart).
_families: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


def _metric_objects(registry: Any, totals: tuple) -> dict:
    from prometheus_client import Counter, Gauge

    with _families_lock:
        fams = _families.get(registry)
        if fams is None:
            fams = {k: Counter(_PREFIX + k, f"vitrify HiCache backend: {k} (running total)",
                               _LABELS, registry=registry) for k in totals}
            fams.update({k: Gauge(_PREFIX + k, f"vitrify HiCache backend: {k}", _LABELS,
                                  registry=registry) for k in GAUGES})
            _families[registry] = fams
        return fams


class PrometheusExport:
    """The metrics of one backend on ``registry`` (None: ``prometheus_client.REGISTRY``, the one
    SGLang uses). ImportError when prometheus_client is not installed."""

    def __init__(self, model_name: Optional[str], rank: str, totals: tuple,
                 registry: Any = None) -> None:
        try:
            import prometheus_client
        except ImportError as e:
            raise ImportError("prometheus_client is not installed: pip install "
                              "prometheus_client (or vitrify[prometheus])") from e
        reg = prometheus_client.REGISTRY if registry is None else registry
        fams = _metric_objects(reg, totals)
        labels = {"model_name": model_name or "", "rank": rank}
        self._children = {k: f.labels(**labels) for k, f in fams.items()}
        self._last = {k: 0 for k in totals}
        self._lock = threading.Lock()  # one update at a time: deltas must not be counted twice

    def update(self, counters: dict) -> None:
        """Counters grow by what ``counters`` (a :meth:`counters` snapshot) adds to the last
        update; gauges take its values."""
        with self._lock:
            for k, last in self._last.items():
                delta = counters[k] - last
                if delta > 0:
                    self._children[k].inc(delta)
                    self._last[k] = counters[k]
            for k in GAUGES:
                self._children[k].set(counters[k])
