"""GPU tests of span snapshots through the Python API (marker `gpu`; skipped without a GPU).
Each test maps its own VMM span (vitrify.snapshot.ScratchSpan) with holes where it wants them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vitrify import _native, snapshot
from vitrify._units import MiB
from vitrify.snapshot import ScratchSpan

pytestmark = pytest.mark.gpu


def _span(mapped, base_hint=0):
    g = 2 * MiB
    s = ScratchSpan(0, len(mapped) * g, base_hint, list(mapped))
    assert s.granularity == g, f"tests assume 2 MiB granularity, the device has {s.granularity}"
    return s


def _fill(s, mapped, seed):
    g = s.granularity
    data = bytearray(os.urandom(len(mapped) * g)) if seed is None else bytearray(
        (bytes([seed]) * 16) * (len(mapped) * g // 16))
    for i, m in enumerate(mapped):
        if m:
            s.write(i * g, bytes(data[i * g:(i + 1) * g]))
    return bytes(data)


def _healthy(s, granule):
    """The context still works after trial copies over holes: a sync, a read, an alloc."""
    assert len(s.read(granule * s.granularity, 4096)) == 4096
    b = _native.DeviceBuffer(1 * MiB, 0)
    b.write(b"\x5a" * 4096)
    assert b.read(4096) == b"\x5a" * 4096
    b.fill(1)


def test_fully_mapped_span_is_one_interval_and_round_trips():
    mapped = [True] * 8
    s = _span(mapped)
    data = _fill(s, mapped, None)
    snap = snapshot.dump(s.base, 0, s.size, target=0, pin=True)
    assert snap.intervals == [(0, s.size)] and snap.pinned
    assert snap.tobytes() == data
    _fill(s, mapped, 7)
    r = snapshot.restore(snap, s.base, s.size, target=0)
    assert r["bytes_written"] == s.size and r["bytes_dropped"] == 0
    assert s.read(0, s.size) == data


def test_span_with_holes_keeps_mapped_runs_and_the_context_is_healthy():
    mapped = [False, True, True, False, False, True, True, True, True, False]
    s = _span(mapped)
    g = s.granularity
    data = _fill(s, mapped, None)
    snap = snapshot.dump(s.base, 0, s.size, target=0)
    assert snap.intervals == [(g, 3 * g), (5 * g, 9 * g)]
    assert snap.tobytes() == data[g:3 * g] + data[5 * g:9 * g]
    _healthy(s, 1)
    with pytest.raises(Exception) as e:  # a whole-span read over holes fails cleanly
        s.read(0, s.size)
    assert "CUDA_ERROR_INVALID_VALUE" in str(e.value)
    _healthy(s, 5)


def test_restore_clamped_below_the_ceiling():
    mapped = [True] * 6
    s = _span(mapped)
    a = _fill(s, mapped, None)
    snap = snapshot.dump(s.base, 0, s.size, target=0, pin=True)
    b = _fill(s, mapped, 9)
    ceiling = 3 * s.granularity + 4097
    r = snapshot.restore(snap, s.base, ceiling, target=0)
    assert r["bytes_written"] == ceiling and r["bytes_dropped"] == s.size - ceiling
    got = s.read(0, s.size)
    assert got[:ceiling] == a[:ceiling], "below the ceiling: the snapshot's bytes"
    assert got[ceiling:] == b[ceiling:], "at/above the ceiling: untouched"


def test_restore_never_touches_an_unmapped_tail():
    """The ceiling is the last mapped offset: restoring a longer snapshot into a span whose tail
    is unmapped succeeds when clamped."""
    s1 = _span([True] * 4)
    data = _fill(s1, [True] * 4, None)
    snap = snapshot.dump(s1.base, 0, s1.size, target=0, pin=True)
    s2 = _span([True, True, False, False])
    r = snapshot.restore(snap, s2.base, 2 * s2.granularity, target=0)
    assert r["bytes_written"] == 2 * s2.granularity
    assert s2.read(0, 2 * s2.granularity) == data[:2 * s2.granularity]
    _healthy(s2, 0)


_PROC = textwrap.dedent("""
    import hashlib, json, os, sys
    from vitrify import snapshot
    mode, path, hint = sys.argv[1], sys.argv[2], int(sys.argv[3])
    g = 2 << 20
    mapped = [True, True, True, False, True, True, True, True]
    s = snapshot.ScratchSpan(0, len(mapped) * g, hint, mapped)
    if mode == "freeze":
        for i, m in enumerate(mapped):
            if m:
                s.write(i * g, hashlib.sha256(b"%d" % i).digest() * (g // 32))
        out = snapshot.dump_to_file(path, s.base, 0, s.size, target=0, chunk_bytes=4 * g)
    else:
        for i, m in enumerate(mapped):
            if m:
                s.write(i * g, b"\\0" * g)
        out = snapshot.restore_from_file(path, s.base, s.size, target=0)
    digest = hashlib.sha256(b"".join(s.read(i * g, g) for i, m in enumerate(mapped) if m))
    print(json.dumps({"base": s.base, "intervals": out["intervals"], "sha": digest.hexdigest()}))
""")


def test_fresh_process_restores_identical_bytes_at_the_same_addresses(tmp_path):
    path = str(tmp_path / "gap.span")
    hint = 0x7E0000000000

    def run(mode, h):
        p = subprocess.run([sys.executable, "-c", _PROC, mode, path, str(h)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"{mode} process failed:\n{p.stderr}"
        import json

        return json.loads(p.stdout.strip().splitlines()[-1])

    frozen = run("freeze", hint)
    thawed = run("thaw", frozen["base"])
    assert thawed["base"] == frozen["base"], (
        f"the driver did not give the second process the same base: "
        f"{thawed['base']:#x} vs {frozen['base']:#x}")
    g = 2 << 20
    assert [tuple(i) for i in frozen["intervals"]] == [(0, 3 * g), (4 * g, 8 * g)]
    assert thawed["intervals"] == frozen["intervals"]
    assert thawed["sha"] == frozen["sha"]
