"""Region behaviour cases shared by the CPU suite (each run in a fresh process on the fake
driver, tests/cpp/fake_cuda/) and the GPU suite (run in-process on the real driver).
R<n> = invariant n in csrc/src/region/DESIGN.md. Every case closes the regions it makes."""

from __future__ import annotations

import ctypes
import json
import os

import pytest

import vitrify
from vitrify import _native
from vitrify._units import GiB, MiB
from vitrify.region import Region, RegionAddressError, candidate_bases


def rng(lo: int, hi: int) -> str:
    return f"[{lo:#x}, {hi:#x})"


def case_exact_base_or_clear_error():  # R2
    size = 4 * GiB
    base = candidate_bases(size)[1]
    try:
        r = Region(size, base=base)
    except RegionAddressError as e:  # refused: the message must name the range asked for
        assert rng(base, base + size) in str(e), str(e)
        return
    with r:
        assert r.base == base, f"asked for {base:#x}, got {r.base:#x} without an error"
        # An overlapping range cannot be granted in the same process: a clear error, no leak.
        with pytest.raises(RegionAddressError) as e:
            Region(size, base=base + GiB)
        assert rng(base + GiB, base + GiB + size) in str(e.value), str(e.value)
        assert r.allocate(MiB) == base


def case_free_then_alloc_never_reuses():  # R1, R6
    with Region(4 * GiB) as r:
        a = r.allocate(8 * MiB)
        b = r.allocate(3 * MiB)  # rounded to 4 MiB
        assert (a, b) == (r.base, r.base + 8 * MiB)
        mapped = r.stats()["mapped"]
        r.free(a)
        assert r.stats()["mapped"] == mapped - 8 * MiB, "the freed chunk was not released"
        seen = {a, b}
        for _ in range(20):
            p = r.allocate(8 * MiB)
            assert p not in seen and not (a <= p < a + 8 * MiB), f"{p:#x} reused"
            seen.add(p)
            r.free(p)
        assert r.offset == 12 * MiB + 20 * 8 * MiB
        with pytest.raises(ValueError, match="no live allocation"):
            r.read(a, 1)
        with pytest.raises(ValueError, match="not the start of a live region allocation"):
            r.free(a)


def case_data_roundtrip():
    with Region(GiB) as r:
        p = r.allocate(6 * MiB + 5)
        data = os.urandom(6 * MiB + 5)
        r.write(p, data)
        assert r.read(p, len(data)) == data
        r.write(p + 100, b"vtrf")
        assert r.read(p + 98, 8) == data[98:100] + b"vtrf" + data[104:106]
        with pytest.raises(ValueError, match="runs past the end"):
            r.read(p + 8 * MiB - 1, 2)


def case_stop_resume():  # R8
    with Region(GiB) as r:
        a = r.allocate(MiB)
        with r.paused():
            assert r.stopped
            q = r.allocate(3 * MiB)
            assert not r.contains(q) and r.owns(q)
            assert r.offset == 2 * MiB, "the cursor moved while stopped"
            r.write(q, b"x" * 100)
            assert r.read(q, 100) == b"x" * 100
        assert not r.stopped
        b = r.allocate(MiB)
        assert b == a + 2 * MiB
        assert r.stats()["fallback_live"] == 1
        r.free(q)
        assert r.stats()["fallback_live"] == 0
        assert r.stop() is False and r.stop() is True
        assert r.resume() is True and r.resume() is False


def case_set_offset():  # R4
    with Region(GiB) as r:
        r.allocate(MiB)
        r.set_offset(64 * MiB)
        assert r.offset == 64 * MiB
        assert r.allocate(MiB) == r.base + 64 * MiB
        with pytest.raises(ValueError, match="backwards"):
            r.set_offset(32 * MiB)
        with pytest.raises(ValueError, match="granularity"):
            r.set_offset(100 * MiB + 1)
        with pytest.raises(ValueError, match="beyond the region size"):
            r.set_offset(2 * GiB)
        assert r.offset == 66 * MiB


def case_window_guards_and_thaw_claims():  # R13, R2
    with Region(8 * GiB) as r:
        # Default bases lie 2 GiB into a 4 GiB address window: window starts are at offset 2 GiB.
        assert (r.base + 2 * GiB) % (4 * GiB) == 0, f"{r.base:#x}"
        r.set_offset(2 * GiB - 2 * MiB)
        p = r.allocate(4 * MiB)  # would cover the window start: placed past its 2 MiB guard
        assert p == r.base + 2 * GiB + 2 * MiB, f"{p - r.base:#x}"
        assert all(not (o <= 2 * GiB < o + n) for o, n in r.live_allocations())
    with Region(8 * GiB) as r:
        # THAW claims a frozen range where it was, guard or not.
        r.set_offset(2 * GiB - 4 * MiB)
        assert r.claim(2 * GiB + 4 * MiB) == r.base + 2 * GiB - 4 * MiB
        assert r.live_allocations() == [(2 * GiB - 4 * MiB, 8 * MiB)]
        assert r.allocate_at(3 * GiB, 3 * MiB) == r.base + 3 * GiB
        assert r.offset == 3 * GiB + 4 * MiB
        with pytest.raises(ValueError, match="below the cursor"):
            r.allocate_at(GiB, MiB)
        with pytest.raises(ValueError, match="not above the cursor"):
            r.claim(r.offset)


def case_allocation_window_replayed_where_work_is_skipped():  # R16
    from vitrify.region import AllocationWindow, WindowDrift, record_window, replay_window

    def freeze_like(r, skip, window=None):
        """Three allocations, then a 'capture' (two kept, one freed), then one more."""
        before = [r.allocate(n) for n in (3 * MiB, 2 * MiB)]
        if skip:
            replay_window(r, window, "decode graph bs=8")
        else:
            with record_window(r) as w:
                a = r.allocate(4 * MiB)
                t = r.allocate(2 * MiB)
                r.allocate(6 * MiB)
                r.free(t)
                del a
            window = w[0]
        after = r.allocate(5 * MiB)
        return [p - r.base for p in before + [after]], window

    with Region(4 * GiB) as r:
        frozen, window = freeze_like(r, skip=False)
        live_frozen, end_frozen = r.live_allocations(), r.offset
    assert window.end - window.start == 12 * MiB and len(window.live) == 2
    assert AllocationWindow.from_json(json.loads(json.dumps(window.to_json()))) == window
    with Region(4 * GiB) as r:
        thawed, _ = freeze_like(r, skip=True, window=window)
        # the allocation after the skipped work lands where it did; so do the window's own
        assert thawed == frozen
        assert r.live_allocations() == live_frozen and r.offset == end_frozen
    with Region(4 * GiB) as r:
        r.allocate(3 * MiB)  # one allocation fewer before the window: refused, not shifted
        with pytest.raises(WindowDrift, match=r"decode graph bs=8: .* at 4194304 bytes here but "
                                              r"was at 6291456 bytes at FREEZE \(-2097152\)"):
            replay_window(r, window, "decode graph bs=8")
    for bad in ({"start": 5, "end": 4, "live": []}, {"start": 0, "end": 8, "live": [[6, 4]]},
                {"start": 0}, {"start": 0, "end": 9, "live": [[4, 2], [0, 2]]}):
        with pytest.raises(ValueError):
            AllocationWindow.from_json(bad)


def case_release_and_restore_memory():  # R17
    """Physical memory given back and taken again at the same addresses: the kept chunk's bytes
    come back, the other's as zeros; the cursor, allocations and checkpoints never move."""
    with Region(4 * GiB) as r:
        assert r.preallocate(192 * MiB, chunk_bytes=64 * MiB) == 192 * MiB
        weights, kv, rest = (r.allocate(64 * MiB) for _ in range(3))
        r.checkpoint("captured")
        w, k = os.urandom(64 * MiB), os.urandom(64 * MiB)
        r.write(weights, w)
        r.write(kv, k)
        r.write(rest, b"rest")
        before = r.stats()
        assert r.release_memory(0, 64 * MiB, keep=True) == 64 * MiB
        assert r.release_memory(64 * MiB, 64 * MiB) == 64 * MiB
        assert r.release_memory(0, 128 * MiB, keep=True) == 0  # released already
        st = r.stats()
        assert (st["released_chunks"], st["released_bytes"], st["kept_bytes"]) == \
            (2, 128 * MiB, 64 * MiB)
        assert st["mapped"] == before["mapped"] - 128 * MiB
        assert (st["cursor"], st["live_allocations"]) == (before["cursor"],
                                                          before["live_allocations"])
        assert r.checkpoints == {"captured": 192 * MiB}
        assert r.released() == [(0, 64 * MiB, True), (64 * MiB, 64 * MiB, False)]
        with pytest.raises(ValueError, match="is released"):
            r.read(weights, 8)
        with pytest.raises(ValueError, match="cuts the chunk"):
            r.release_memory(128 * MiB, 32 * MiB)
        with pytest.raises(TypeError, match="keep must be True or False"):
            r.release_memory(128 * MiB, 64 * MiB, keep="yes")
        assert r.read(rest, 4) == b"rest"
        assert r.restore_memory(0, 192 * MiB) == 128 * MiB
        assert r.read(weights, len(w)) == w
        assert r.read(kv, 64 * MiB) == bytes(64 * MiB)
        assert r.stats()["mapped"] == before["mapped"] and r.released() == []


def case_preallocate_fast_path():  # R7
    with Region(4 * GiB) as r:
        assert r.preallocate(256 * MiB, chunk_bytes=64 * MiB) == 256 * MiB
        st = r.stats()
        assert (st["chunks"], st["mapped"]) == (4, 256 * MiB)
        ptrs = [r.allocate(2 * MiB) for _ in range(128)]
        st2 = r.stats()
        assert st2["chunks_created"] == st["chunks_created"], "a preallocated allocation mapped"
        assert ptrs == [r.base + i * 2 * MiB for i in range(128)]
        r.write(ptrs[-1] + 2 * MiB - 4, b"tail")
        assert r.read(ptrs[-1] + 2 * MiB - 4, 4) == b"tail"
        r.allocate(2 * MiB)  # beyond the frontier: exactly one new chunk
        assert r.stats()["chunks_created"] == st["chunks_created"] + 1
        assert r.preallocate(100 * MiB) == 0  # already mapped
        # A chunk is released only when all its allocations are freed (and the cursor passed).
        for p in ptrs[:31]:
            r.free(p)
        assert r.stats()["chunks"] == 5
        r.free(ptrs[31])
        assert r.stats()["chunks"] == 4


def case_oom_is_memory_error():  # R5
    with Region(64 * MiB) as r:
        r.allocate(48 * MiB)
        with pytest.raises(MemoryError) as e:
            r.allocate(32 * MiB)
        assert not isinstance(e.value, vitrify.CudaError), "a region-full error is not a driver OOM"
        msg = str(e.value)
        assert "region full" in msg and str(32 * MiB) in msg and str(16 * MiB) in msg, msg
        assert r.offset == 48 * MiB
        assert r.stats()["fallback_live"] == 0, "fell back to ordinary memory"
        r.allocate(16 * MiB)  # exactly full is fine


def case_checkpoints():  # R10
    with Region(GiB) as r:
        assert r.checkpoint("start") == 0
        r.allocate(10 * MiB)
        assert r.checkpoint("weights") == 10 * MiB
        with pytest.raises(ValueError, match="already recorded"):
            r.checkpoint("weights")
        with pytest.raises(ValueError):
            r.checkpoint("")
        assert list(r.checkpoints.items()) == [("start", 0), ("weights", 10 * MiB)]


def case_close_releases():
    r = Region(GiB)
    r.allocate(4 * MiB)
    r.preallocate(64 * MiB)
    r.close()
    r.close()
    assert r.closed and r.stats()["mapped"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        r.allocate(MiB)
    # The range is free again: the same base can be reserved at once.
    with Region(GiB, base=r.base) as again:
        assert again.base == r.base


def case_c_abi():  # R11, through the exported symbols like torch calls them
    from vitrify.integrations.torch import activated, active_base

    lib = ctypes.CDLL(_native.__file__)
    lib.vitrify_region_malloc.restype = ctypes.c_void_p
    lib.vitrify_region_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.vitrify_region_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    assert lib.vitrify_region_malloc(MiB, 0, None) is None
    assert "no active region for device 0" in _native.region_last_abi_error()
    with Region(GiB) as r, Region(GiB) as r2:
        with activated(r):
            assert active_base(0) == r.base
            p = lib.vitrify_region_malloc(MiB, 0, None)
            with activated(r2):
                q = lib.vitrify_region_malloc(MiB, 0, None)
            assert active_base(0) == r.base
        assert active_base(0) is None
        assert (p, q) == (r.base, r2.base)
        lib.vitrify_region_free(p, MiB, 0, None)  # found by address after the context
        lib.vitrify_region_free(q, MiB, 0, None)
        assert r.stats()["live_allocations"] == 0 and r2.stats()["live_allocations"] == 0
        with activated(r):
            assert lib.vitrify_region_malloc(2 * GiB, 0, None) is None
            assert "region full" in _native.region_last_abi_error()


def sequence() -> list[int]:
    """A fixed allocation sequence; returns every address (two processes must agree)."""
    out = []
    with Region(4 * GiB) as r:
        out.append(r.base)
        for i in range(1, 40):
            p = r.allocate(i * 777_777)
            out.append(p)
            if i % 3 == 0:
                r.free(p)
            if i == 10:
                r.preallocate(r.offset + 256 * MiB, chunk_bytes=64 * MiB)
            if i == 20:
                with r.paused():
                    r.allocate(MiB)  # ordinary memory: not part of the trajectory
            if i == 30:
                r.set_offset(r.offset + 8 * MiB)
        out.append(r.checkpoint("end"))
    return out


def case_print_sequence():
    print(json.dumps(sequence()))


CASES = sorted(n[len("case_"):] for n in globals() if n.startswith("case_") and n != "case_print_sequence")
