"""VitrifyStorage's metrics (DESIGN.md invariant 13): counters() and the Prometheus metrics on a
prometheus_client registry carry the same numbers (puts, gets, hits, misses, bytes, GC runs,
verify failures, occupancy, queue depths), counters never go down across a store switch, and
SGLang's ``enable_storage_metrics`` exports to the default registry SGLang serves."""

from __future__ import annotations

import pytest

import hicache_cases

pytestmark = pytest.mark.sglang

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")
prometheus_client = pytest.importorskip("prometheus_client")

from vitrify import disk  # noqa: E402
from vitrify.integrations.sglang.hicache import metrics  # noqa: E402

from test_sglang_hicache import (BLOB, PAGE, _backend, _fill_random, _keys, _mha_host,  # noqa: E402
                                 _slot_of)

_extra = hicache_cases.extra_config
RANK = "tp0of1-pp0of1-cp0of1"


def _sample(reg, name, model="org/tiny-model"):
    return reg.get_sample_value(name, {"model_name": model, "rank": RANK})


def _same_numbers(reg, b, model="org/tiny-model"):
    """Every counters() key has its metric with the same value."""
    c = b.counters()
    for k, v in c.items():
        name = f"vitrify_hicache_{k}" + ("" if k in metrics.GAUGES else "_total")
        assert _sample(reg, name, model) == pytest.approx(v), k
    return c


def test_counters_and_prometheus_follow_puts_gets_hits_misses_and_bytes(tmp_path):
    reg = prometheus_client.CollectorRegistry()
    _, host = _mha_host("page_first")
    _fill_random(host, 31)
    b = _backend(host, _extra(tmp_path))
    b.export_prometheus(reg)
    try:
        c = _same_numbers(reg, b)
        assert c["set_pages"] == 0 and c["slots_used"] == 0 and c["occupancy"] == 0.0
        assert c["slots_total"] == b.vitrify_stats()["store"]["kinds"]["kv"]["slots_total"] > 0
        _, keys = _keys(4)
        idx = host.alloc(4 * PAGE)
        assert b.batch_set_v1(keys[:3], idx[:3 * PAGE]) == [True] * 3
        assert b.batch_set_v1(keys[:1], idx[:PAGE]) == [True]             # dedup
        assert b.batch_get_v1(keys, host.alloc(4 * PAGE)) == [True] * 3 + [False]
        assert b.batch_exists(keys) == 3
        c = _same_numbers(reg, b)
        assert (c["set_pages"], c["set_dedup"], c["get_pages"], c["get_misses"]) == (3, 1, 3, 1)
        assert c["set_bytes"] == c["get_bytes"] == 3 * BLOB
        assert c["slots_used"] == 3 and c["occupancy"] == pytest.approx(3 / c["slots_total"])
        assert c["write_queue_depth"] == c["read_queue_depth"] == 0   # nothing queued at rest
        assert c["in_flight_writes"] == c["in_flight_reads"] == 0
    finally:
        b.close()
    c = _same_numbers(reg, b)   # after close: totals kept, no open store
    assert c["set_pages"] == 3 and c["slots_total"] == 0 and c["occupancy"] == 0.0


def test_gc_runs_and_verify_failures_reach_counters_and_prometheus(tmp_path):
    reg = prometheus_client.CollectorRegistry()
    _, host = _mha_host("layer_first", tokens=1024)
    _fill_random(host, 32)
    slot = disk.slot_bytes_for(BLOB)
    extra = _extra(tmp_path, budget_bytes=4096 + 8 * slot)        # 8 slots
    b = _backend(host, extra)
    _, keys = _keys(20)
    idx = host.alloc(20 * PAGE)
    for i in range(20):
        assert b.batch_set_v1(keys[i:i + 1], idx[i * PAGE:(i + 1) * PAGE]) == [True]
    path = b.slab_paths[0]
    b.export_prometheus(reg)
    c = _same_numbers(reg, b)
    assert c["gc_runs"] > 0 and c["gc_reclaims"] > 0 and c["slots_used"] <= 8
    b.close()
    survivor = keys[-1]
    off = _slot_of(path, survivor, slot) + disk.SLOT_HEADER_BYTES + 100
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x5A]))

    reg2 = prometheus_client.CollectorRegistry()
    b2 = _backend(host, extra)
    b2.export_prometheus(reg2)
    try:
        assert b2.batch_get_v1([survivor], host.alloc(PAGE)) == [False]
        c = _same_numbers(reg2, b2)
        assert c["verify_failures"] == 1 and c["get_misses"] == 1
        b2.set_weight_version("w-next")      # a store switch keeps the totals
        c2 = _same_numbers(reg2, b2)
        assert c2["verify_failures"] == 1 and c2["slots_used"] == 0
    finally:
        b2.close()


def test_enable_storage_metrics_exports_to_sglangs_default_registry(tmp_path):
    _, host = _mha_host("page_first")
    _fill_random(host, 33)
    model = "org/metrics-default-registry"
    b = _backend(host, _extra(tmp_path), model=model)   # enable_storage_metrics=True
    try:
        _, keys = _keys(2)
        assert b.batch_set_v1(keys, host.alloc(2 * PAGE)) == [True, True]
        _same_numbers(prometheus_client.REGISTRY, b, model)
        assert _sample(prometheus_client.REGISTRY, "vitrify_hicache_set_pages_total",
                       model) == 2
    finally:
        b.close()


def test_two_backends_share_a_registry_by_their_labels(tmp_path):
    reg = prometheus_client.CollectorRegistry()
    _, host = _mha_host("page_first")
    _fill_random(host, 34)
    a = _backend(host, _extra(tmp_path / "a"), model="org/a")
    b = _backend(host, _extra(tmp_path / "b"), model="org/b")
    try:
        a.export_prometheus(reg)
        b.export_prometheus(reg)   # the same registry: no duplicate-name error
        _, keys = _keys(3)
        assert a.batch_set_v1(keys, host.alloc(3 * PAGE)) == [True] * 3
        assert b.batch_set_v1(keys[:1], host.alloc(PAGE)) == [True]
        assert _sample(reg, "vitrify_hicache_set_pages_total", "org/a") == 3
        assert _sample(reg, "vitrify_hicache_set_pages_total", "org/b") == 1
    finally:
        a.close()
        b.close()
