"""Relocation safety through the Python API (the relocation issue): kernel parameter layout,
live allocations and cross-launch evidence decide what moves; a graph holding a word that may or
may not be a pointer is non-relocatable — THAW at another base refuses it (or skips it when
asked), and ``vitrify inspect --relocations`` lists every such word. CPU only: graphs are built
from descriptions; the end-to-end part runs against the fake graph driver in a subprocess."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitrify import _native

BASE = 0x600000000000  # upper half 0x6000 = 24576 = 6 * 4096 = 24 * 1024
SIZE = 64 << 30
HI = BASE >> 32
FAKE = Path(os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA", "/nonexistent"))


def kernel(params: bytes, slots, name="k"):
    return {"kind": "kernel", "module": "cd" * 32, "name": name, "grid": (1, 1, 1),
            "block": (32, 1, 1), "params": params, "slots": slots}


# A by-value struct of 4-byte integer pairs and 8-byte pointers, as (kind, value) fields.
field = st.one_of(
    st.tuples(st.just("pair"), st.integers(0, 2**32 - 1), st.sampled_from([HI, HI + 1, HI + 15, 7])),
    st.tuples(st.just("ptr"), st.integers(0, 3), st.integers(0, (1 << 20) - 8)),
    st.tuples(st.just("i64"), st.integers(0, 2**40), st.just(0)),
)
LIVE = [((i << 30) + (4 << 20), 1 << 20) for i in range(4)]  # 1 MiB at 4 MiB past 0..3 GiB


@settings(max_examples=150, deadline=None)
@given(st.lists(field, min_size=2, max_size=24), st.sampled_from([2 << 20, 1 << 30, 64 << 30,
                                                                  -(1 << 40)]))
def test_relocation_keeps_every_integer_and_moves_every_pointer(fields, shift):
    raw, pointers = b"", []
    for kind, a, b in fields:
        if kind == "pair":
            raw += struct.pack("<II", a, b)
        elif kind == "ptr":
            pointers.append(len(raw))
            raw += struct.pack("<Q", BASE + LIVE[a][0] + b)
        else:
            raw += struct.pack("<Q", a)
    data = _native.graph_build({"nodes": [kernel(raw, [(0, len(raw))])]})
    found = _native.graph_find_relocations(data, BASE, SIZE, LIVE)
    d = _native.graph_describe(found)
    if not d["relocatable"]:
        # A pair that lands in a live allocation is indistinguishable from a pointer there
        # without evidence from other launches: only then may a graph be refused — and then
        # it must refuse to move rather than rewrite anything.
        with pytest.raises(ValueError, match="not relocatable"):
            _native.graph_relocate(found, BASE + shift)
        return
    moved = _native.graph_describe(_native.graph_relocate(found, BASE + shift))
    got = moved["nodes"][0]["params"]
    relocated = {r[1] for r in d["relocations"]}
    for off in range(0, len(raw), 8):
        (before,) = struct.unpack_from("<Q", raw, off)
        (after,) = struct.unpack_from("<Q", got, off)
        if off in pointers:
            assert after == before + shift, f"pointer at byte {off} not moved"
        elif off in relocated:
            # an integer pair that reads as an address inside a live allocation: the only
            # misreading possible without cross-launch evidence; its low half is preserved
            lo, hi = struct.unpack_from("<II", raw, off)
            assert BASE <= before < BASE + SIZE and any(o <= before - BASE < o + n for o, n in LIVE)
        else:
            assert after == before, f"integer at byte {off} changed"


def test_pairs_of_int32_parameters_never_move():
    ptr = BASE + LIVE[0][0] + 0x10
    raw = struct.pack("<IIIIQ", 7, HI, 0xFFFFFFFF, HI + 15, ptr)
    data = _native.graph_build({"nodes": [kernel(raw, [(0, 4), (4, 4), (8, 4), (12, 4), (16, 8)])]})
    found = _native.graph_find_relocations(data, BASE, SIZE, LIVE)
    d = _native.graph_describe(found)
    assert [r[1:] for r in d["relocations"]] == [(16, ptr - BASE, "pointer parameter")]
    assert d["notes"] == [] and d["relocatable"]
    moved = _native.graph_describe(_native.graph_relocate(found, BASE + (64 << 30)))
    assert moved["nodes"][0]["params"] == raw[:16] + struct.pack("<Q", ptr + (64 << 30))


SCRIPT = r'''
import json, struct, subprocess, sys
from pathlib import Path
import vitrify
import vitrify.graph as tg
from vitrify import _native, archive as ar

out = Path(sys.argv[1])
BASE, SIZE, HI = 0x600000000000, 64 << 30, 0x6000
IMAGE = b".version 8.0\n.entry gemm ( // params 0:32\n.entry offsets ( // params 0:8\n"
mod = _native.graph_add_recorded_module(IMAGE)
live = [(0, 1 << 30)]  # the weights: base + any 32-bit value is live

def gemm(m):  # struct { int32 m; int32 n = m * 4096 (the field); float* a; float* b; int64 k; }
    params = struct.pack("<IIQQQ", 4096, m * 4096, BASE + 0x200000, BASE + 0x400000, 4096)
    return {"kind": "kernel", "module": mod, "name": "gemm", "grid": (1, 1, 1),
            "block": (128, 1, 1), "params": params, "slots": [(0, 32)]}

store = tg.GraphStore(region_base=BASE, region_size=SIZE, live=lambda: live)
evidence = store._evidence
for m in (1, 6, 8):
    d = _native.graph_build({"nodes": [gemm(m)]})
    store.add(f"bs{m}", _native.graph_find_relocations(d, BASE, SIZE, live, evidence))
# An 8-byte parameter in the range but in no live allocation: a dangling pointer or an int64.
dangling = struct.pack("<Q", BASE + (8 << 30))
d = _native.graph_build({"nodes": [{"kind": "kernel", "module": mod, "name": "offsets",
                                     "grid": (1, 1, 1), "block": (32, 1, 1), "params": dangling,
                                     "slots": [(0, 8)]}]})
store.add("dangling", _native.graph_find_relocations(d, BASE, SIZE, live, evidence))
infos = {n: store.info(n) for n in store.names}
fp = ar.Fingerprint(gpu="fake", sm="9.0", driver=None, cuda="13.0", torch=None, engine="test",
                    engine_version="0", model="m")
with ar.ArchiveWriter(out / "a", fp, ar.Region(base=BASE, size=SIZE, granularity=2 << 20)) as w:
    store.save_to_archive(w, rank=0)
a = ar.open_archive(out / "a")
res = {"infos": infos}
try:
    tg.load_from_archive(a, 0, region_base=BASE + (64 << 30))
    res["refused"] = None
except tg.GraphNotRelocatable as e:
    res["refused"] = str(e)
g = tg.load_from_archive(a, 0, region_base=BASE + (64 << 30), unrelocatable="skip")
g.wait_all()
res["loaded_moved"] = sorted(g.names)
res["skipped"] = g.skipped
res["bs6_moved"] = _native.graph_describe(
    _native.graph_relocate(store.data("bs6"), BASE + (64 << 30)))["nodes"][0]["params"].hex()
same = tg.load_from_archive(a, 0, region_base=BASE)
same.wait_all()
res["loaded_same"] = sorted(same.names)
cli = lambda *args: subprocess.run([sys.executable, "-m", "vitrify", *args], capture_output=True,
                                   text=True)
r = cli("inspect", "--relocations", str(out / "a"))
res["audit_text"], res["audit_rc"] = r.stdout + r.stderr, r.returncode
r = cli("inspect", "--relocations", "--json", str(out / "a"))
res["audit_json"] = json.loads(r.stdout)
r = cli("inspect", str(out / "a"))
res["inspect_text"] = r.stdout
print(json.dumps(res))
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not FAKE.exists():
        pytest.skip(f"fake driver not built ({FAKE}); run through `make test`")
    d = tmp_path_factory.mktemp("reloc")
    env = dict(os.environ, VITRIFY_LIBCUDA_PATH=str(FAKE), FAKE_CUDA_DEVICES="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(d)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_evidence_from_the_ladder_keeps_the_dimension_an_integer(run):
    # bs6: (4096, 6 * 4096) reads as base + 4096, inside the weights; bs1 and bs8 hold
    # 0x1000_00001000 and 0x8000_00001000 in the same field, which are no device addresses.
    info = run["infos"]["bs6"]
    assert info["relocatable"]
    assert info["relocations_by_kind"] == {"struct word": 2}
    assert info["integers_kept"] == {"integer: the field held a non-address elsewhere": 1}
    moved = bytes.fromhex(run["bs6_moved"])
    assert struct.unpack_from("<II", moved, 0) == (4096, 6 * 4096)
    assert struct.unpack_from("<QQQ", moved, 8) == (0x600000000000 + (64 << 30) + 0x200000,
                                                    0x600000000000 + (64 << 30) + 0x400000, 4096)


def test_an_unprovable_graph_is_refused_at_another_base_and_skipped_when_asked(run):
    assert not run["infos"]["dangling"]["relocatable"]
    msg = run["refused"]
    assert "graph 'dangling'" in msg and "kernel 'offsets'" in msg and "byte 0" in msg
    assert run["loaded_moved"] == ["bs1", "bs6", "bs8"]
    assert list(run["skipped"]) == ["dangling"]
    assert run["loaded_same"] == ["bs1", "bs6", "bs8", "dangling"]


def test_inspect_relocations_lists_kinds_and_unclassified_words(run):
    assert run["audit_rc"] == 0
    text = run["audit_text"]
    assert "8-byte parameter in no allocation" in text and "dangling" in text and "NO" in text
    audit = run["audit_json"]["0"]
    by_name = {g["name"]: g for g in audit["graphs"]}
    assert by_name["dangling"]["unclassified"]["count"] == 1
    assert by_name["dangling"]["unclassified"]["words"][0]["offset"] == 0
    assert by_name["bs8"]["relocations_by_kind"] == {"struct word": 2}
    assert "3 of 4 graphs relocatable" in run["inspect_text"]
    assert "dangling" in run["inspect_text"]
