"""CPU tests of span snapshots (vitrify.snapshot) over the host-memory backend, and properties of
the interval arithmetic (hypothesis)."""

from __future__ import annotations

import logging
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitrify import config, snapshot
from vitrify.snapshot import HostBackend, SpanFileError

G = 64 << 10  # granule used by these tests

intervals_st = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), max_size=12)


def points(iv):
    return {x for a, b in iv for x in range(a, b)}


@given(intervals_st)
def test_merge_is_normalized_and_keeps_the_same_points(iv):
    m = snapshot.merge(iv)
    assert points(m) == points(iv)
    assert all(a < b for a, b in m)
    assert all(m[i][1] < m[i + 1][0] for i in range(len(m) - 1)), "neither overlap nor touch"
    assert snapshot.merge(m) == m
    assert snapshot.total_bytes(m) == len(points(iv))


@given(intervals_st, st.integers(0, 220))
def test_clamp_keeps_exactly_the_points_below_the_ceiling(iv, ceiling):
    m = snapshot.merge(iv)
    c = snapshot.clamp(m, ceiling)
    assert points(c) == {x for x in points(m) if x < ceiling}
    assert all(b <= ceiling for _, b in c)


@given(intervals_st, st.integers(0, 220), st.integers(0, 220))
def test_intersect(iv, lo, hi):
    m = snapshot.merge(iv)
    assert points(snapshot.intersect(m, lo, hi)) == {x for x in points(m) if lo <= x < hi}


@given(st.integers(0, 1000), st.integers(0, 300), st.integers(0, 300),
       st.sampled_from([1, 2, 8, 64]))
def test_split_aligned_tiles_the_span_within_granules(base, a, b, g):
    start, end = min(a, b), max(a, b)
    pieces = snapshot.split_aligned(base, start, end, g)
    assert [x for p in pieces for x in range(*p)] == list(range(start, end))
    for p0, p1 in pieces:
        assert p0 < p1
        assert (base + p0) // g == (base + p1 - 1) // g, "a piece never crosses a granule"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=12), st.integers(0, G - 1),
       st.integers(0, G - 1))
def test_dump_keeps_exactly_the_mapped_granules(mapped, head, tail):
    n = len(mapped)
    holes = [(i * G, (i + 1) * G) for i, m in enumerate(mapped) if not m]
    be = HostBackend(n * G, holes)
    data = os.urandom(n * G)
    be.write(0, data)
    start, end = min(head, n * G), max(head, n * G - tail)
    s = snapshot.dump(be.base, start, end, target=be, granularity=G, pin=False)
    want = snapshot.merge(snapshot.intersect(
        [(i * G, (i + 1) * G) for i, m in enumerate(mapped) if m], start, end))
    assert s.intervals == want
    assert s.tobytes() == b"".join(data[a:b] for a, b in want)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=10), st.integers(1, 4),
       st.integers(0, 12))
def test_span_file_round_trip_property(tmp_path_factory, mapped, chunk_granules, ceiling_g):
    """Any hole pattern, chunk size and ceiling: the file restores exactly the mapped bytes
    below the ceiling and nothing else."""
    n = len(mapped)
    holes = [(i * G, (i + 1) * G) for i, m in enumerate(mapped) if not m]
    src = HostBackend(n * G, holes)
    data = os.urandom(n * G)
    src.write(0, data)
    path = tmp_path_factory.mktemp("prop") / "p.span"
    out = snapshot.dump_to_file(path, src.base, 0, n * G, target=src,
                                chunk_bytes=chunk_granules * G, granularity=G, direct_io="off",
                                progress=lambda d, t: None)
    want = snapshot.merge([(i * G, (i + 1) * G) for i, m in enumerate(mapped) if m])
    assert out["intervals"] == want
    ceiling = min(ceiling_g, n) * G
    dst = HostBackend(n * G)
    dst.write(0, b"\xab" * (n * G))
    r = snapshot.restore_from_file(path, dst.base, ceiling, target=dst, direct_io="off",
                                   progress=lambda d, t: None)
    kept = snapshot.clamp(want, ceiling)
    assert r["intervals"] == kept
    assert r["bytes_written"] + r["bytes_dropped"] == snapshot.total_bytes(want)
    got = dst.read(0, n * G)
    expect = bytearray(b"\xab" * (n * G))
    for a, b in kept:
        expect[a:b] = data[a:b]
    assert got == bytes(expect)


def test_restore_is_clamped_and_never_writes_above_the_ceiling():
    src = HostBackend(8 * G, [(2 * G, 3 * G)])
    payload = os.urandom(8 * G)
    src.write(0, payload)
    s = snapshot.dump(src.base, 0, 8 * G, target=src, granularity=G)
    dst = HostBackend(8 * G)
    dst.write(0, b"\xee" * (8 * G))
    ceiling = 5 * G + 17
    r = snapshot.restore(s, dst.base, ceiling, target=dst)
    assert r["bytes_written"] == 2 * G + ceiling - 3 * G
    assert r["bytes_dropped"] == 8 * G - ceiling
    got = dst.read(0, 8 * G)
    assert got[:2 * G] == payload[:2 * G]
    assert got[2 * G:3 * G] == b"\xee" * G
    assert got[3 * G:ceiling] == payload[3 * G:ceiling]
    assert got[ceiling:] == b"\xee" * (8 * G - ceiling)


def test_bad_arguments_are_value_errors():
    be = HostBackend(G)
    with pytest.raises(ValueError, match="past its end"):
        snapshot.dump(be.base, 10, 5, target=be)
    with pytest.raises(ValueError, match=r"base must be an int in \[0, .*got -1"):
        snapshot.dump(-1, 0, 5, target=be)
    with pytest.raises(ValueError, match="target must be"):
        snapshot.dump(be.base, 0, 5, target="gpu0")
    with pytest.raises(ValueError, match="direct_io"):
        snapshot.dump_to_file("/tmp/x.span", be.base, 0, G, target=be, direct_io="sometimes")


def _span(tmp_path, holes=(), n=10, chunk=3 * G):
    be = HostBackend(n * G, list(holes))
    data = os.urandom(n * G)
    be.write(0, data)
    path = tmp_path / "s.span"
    out = snapshot.dump_to_file(path, be.base, 0, n * G, target=be, chunk_bytes=chunk,
                                granularity=G, direct_io="off")
    return be, data, path, out


def test_span_file_round_trip_with_holes_at_both_edges(tmp_path):
    holes = [(0, G), (4 * G, 5 * G), (9 * G, 10 * G)]
    be, data, path, out = _span(tmp_path, holes)
    want = [(G, 4 * G), (5 * G, 9 * G)]
    assert out["intervals"] == want and out["bytes"] == 7 * G
    info = snapshot.file_info(path)
    assert info["intervals"] == want and info["chunks"] == 3 and info["version"] == 1
    assert os.path.getsize(path) == info["file_bytes"]
    snapshot.verify_file(path, direct_io="off")
    dst = HostBackend(10 * G)
    r = snapshot.restore_from_file(path, dst.base, 10 * G, target=dst, direct_io="off")
    assert r["bytes_written"] == 7 * G and r["intervals"] == want
    for a, b in want:
        assert dst.read(a, b - a) == data[a:b]


@pytest.mark.parametrize("where", ["chunk0", "chunk2", "table", "header"])
def test_span_file_corruption_is_detected_and_the_bad_chunk_never_written(tmp_path, where):
    be, data, path, out = _span(tmp_path)
    info = snapshot.file_info(path)
    off = {"chunk0": 4096 + 5, "chunk2": 4096 + 2 * 3 * G + 100,
           "table": info["file_bytes"] - 4096 + 3, "header": 40}[where]
    raw = bytearray(path.read_bytes())
    raw[off] ^= 0x01
    path.write_bytes(bytes(raw))
    dst = HostBackend(10 * G)
    dst.write(0, b"\0" * (10 * G))
    with pytest.raises(SpanFileError) as e:
        snapshot.restore_from_file(path, dst.base, 10 * G, target=dst, direct_io="off")
    if where.startswith("chunk"):
        k = int(where[-1])
        assert f"chunk {k} of 4" in str(e.value)
        assert dst.read(k * 3 * G, 3 * G) == b"\0" * (3 * G), "the corrupt chunk was written"
    with pytest.raises(SpanFileError):
        snapshot.verify_file(path, direct_io="off")


def test_truncated_span_file(tmp_path):
    be, data, path, out = _span(tmp_path)
    os.truncate(path, os.path.getsize(path) - 8192)
    with pytest.raises(SpanFileError, match="truncated"):
        snapshot.file_info(path)


@pytest.mark.odirect
def test_span_file_with_o_direct(tmp_path):
    be = HostBackend(6 * G, [(G, 2 * G)])
    data = os.urandom(6 * G)
    be.write(0, data)
    path = tmp_path / "d.span"
    out = snapshot.dump_to_file(path, be.base, 0, 6 * G, target=be, chunk_bytes=4 * G,
                                granularity=G, direct_io="on")
    assert out["direct_io"]
    dst = HostBackend(6 * G)
    r = snapshot.restore_from_file(path, dst.base, 6 * G, target=dst, direct_io="on")
    assert r["direct_io"] and dst.read(2 * G, 4 * G) == data[2 * G:]


def test_progress_is_reported_and_logged(tmp_path, caplog):
    be = HostBackend(8 * G)
    seen = []
    snapshot.dump_to_file(tmp_path / "p.span", be.base, 0, 8 * G, target=be, chunk_bytes=2 * G,
                          granularity=G, direct_io="off", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (8 * G, 8 * G) and len(seen) == 4
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    caplog.set_level(logging.INFO, logger="vitrify")
    dst = HostBackend(8 * G)
    snapshot.restore_from_file(tmp_path / "p.span", dst.base, 8 * G, target=dst, direct_io="off",
                               progress=snapshot.progress_logger("restore test", every_bytes=G))
    msgs = [r.getMessage() for r in caplog.records if r.name == "vitrify.snapshot"]
    assert any("restore test" in m and "100%" in m for m in msgs), msgs


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_raising_progress_callback_does_not_abort_the_dump(tmp_path):
    be = HostBackend(4 * G)

    def boom(done, total):
        raise RuntimeError("progress callback failure")

    out = snapshot.dump_to_file(tmp_path / "b.span", be.base, 0, 4 * G, target=be,
                                chunk_bytes=G, granularity=G, direct_io="off", progress=boom)
    assert out["bytes"] == 4 * G


class _FakeArchive:
    def __init__(self, files):
        self.path = "/archives/a"
        self.files = files

    def has_file(self, rel):
        return rel in self.files

    def file_path(self, rel):
        return f"{self.path}/{rel}"


def test_plan_restore(caplog):
    caplog.set_level(logging.INFO, logger="vitrify")
    with_dump = _FakeArchive({"rank1/region/warmup.span": {"bytes": 123, "checksum": "x"}})
    p = snapshot.plan_restore(with_dump, 1)
    assert p.action == "restore" and p.path.endswith("rank1/region/warmup.span")
    p = snapshot.plan_restore(with_dump, 0)
    assert p.action == "rerun-warmup" and "no warmup-gap dump for rank 0" in p.reason
    assert any("no warmup-gap dump" in r.getMessage() for r in caplog.records)
    with config.override(warmup_restore=False):
        p = snapshot.plan_restore(with_dump, 1)
        assert p.action == "rerun-warmup" and "VITRIFY_WARMUP_RESTORE=0" in p.reason


def test_warmup_restore_env_parsing():
    assert config.from_environ({"VITRIFY_WARMUP_RESTORE": "0"}).warmup_restore is False
    assert config.from_environ({}).warmup_restore is True
    with pytest.raises(ValueError, match="VITRIFY_WARMUP_RESTORE"):
        config.from_environ({"VITRIFY_WARMUP_RESTORE": "maybe"})


def test_page_cache_share_tells_a_cached_file_from_a_dropped_one(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(8 << 20))
    path.read_bytes()  # in the page cache now
    share = snapshot.page_cache_share(path)
    if share is None:
        pytest.skip("RWF_NOWAIT reads are not supported here")
    assert share == 1.0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
    finally:
        os.close(fd)
    assert snapshot.page_cache_share(path) <= 0.25
    (tmp_path / "empty").write_bytes(b"")
    assert snapshot.page_cache_share(tmp_path / "empty") == 1.0


def test_a_cached_span_file_is_restored_through_the_page_cache(tmp_path, caplog):
    be = snapshot.HostBackend(4 << 16, [])
    data = os.urandom(4 << 16)
    be.write(0, data)
    path = tmp_path / "s.span"
    snapshot.dump_to_file(path, be.base, 0, 4 << 16, target=be, chunk_bytes=1 << 16,
                          granularity=1 << 16, direct_io="off")
    path.read_bytes()
    if snapshot.page_cache_share(path) is None:
        pytest.skip("RWF_NOWAIT reads are not supported here")
    caplog.set_level("INFO", logger="vitrify.snapshot")
    dst = snapshot.HostBackend(4 << 16, [])
    out = snapshot.restore_from_file(path, dst.base, 4 << 16, target=dst, direct_io="auto")
    assert out["direct_io"] is False and "in the page cache: read through it" in caplog.text
    assert dst.read(0, 4 << 16) == data


def _drop(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_prefetch_reads_the_file_into_the_page_cache_and_stops_when_asked(tmp_path):
    import threading

    path = tmp_path / "w.span"
    path.write_bytes(os.urandom(3 * snapshot.PREFETCH_PIECE + 123))
    _drop(path)
    share = snapshot.page_cache_share(path)
    if share is None or share > 0.25:
        pytest.skip("this filesystem keeps dropped pages (or mincore cannot say)")
    out = snapshot.prefetch(path)
    assert out["complete"] and out["bytes"] == out["size"] == path.stat().st_size
    assert snapshot.page_cache_share(path) == 1.0
    stop = threading.Event()
    stop.set()  # the go came before the read began: nothing is read
    early = snapshot.prefetch(path, stop)
    assert early["bytes"] == 0 and early["complete"] is False and early["size"] > 0
