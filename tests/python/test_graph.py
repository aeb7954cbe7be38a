"""CPU tests of graph persistence: format round trips and corruption (hypothesis), relocation,
topology templates, kernel names, and save/load of a store without a GPU."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vitrify
import vitrify.graph as tg
from vitrify import _native

BASE = 0x7F0000000000
SIZE = 1 << 30

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
pos = st.integers(1, 2**31)
hexhash = st.binary(min_size=32, max_size=32).map(bytes.hex)


@st.composite
def kernels(draw):
    nslots = draw(st.integers(0, 6))
    sizes = [draw(st.sampled_from([1, 2, 4, 8, 16, 24])) for _ in range(nslots)]
    slots, off = [], 0
    for s in sizes:
        off = (off + min(s, 8) - 1) // min(s, 8) * min(s, 8)
        slots.append((off, s))
        off += s
    return {
        "kind": "kernel",
        "module": draw(hexhash),
        "name": draw(st.text("abcdefgh_$0123456789", min_size=1, max_size=40)),
        "grid": (draw(pos), draw(st.integers(1, 65535)), draw(st.integers(1, 65535))),
        "block": (draw(st.integers(1, 1024)), draw(st.integers(1, 64)), 1),
        "shared_mem": draw(u32),
        "params": draw(st.binary(min_size=off, max_size=off)),
        "slots": slots,
        "attributes": draw(st.lists(st.tuples(u32, st.binary(max_size=64)), max_size=3)),
        "func_attributes": draw(st.lists(st.tuples(u32, st.integers(-2**31, 2**31 - 1)), max_size=3)),
    }


def memcpys():
    return st.fixed_dictionaries({
        "kind": st.just("memcpy"), "src_type": st.integers(0, 255), "dst_type": st.integers(0, 255),
        **{k: u64 for k in ("src", "dst", "src_x", "src_y", "src_z", "src_pitch", "src_height",
                            "dst_x", "dst_y", "dst_z", "dst_pitch", "dst_height", "width",
                            "height", "depth")}})


def memsets():
    return st.fixed_dictionaries({
        "kind": st.just("memset"), "dst": u64, "pitch": u64, "value": u32,
        "element_size": st.sampled_from([1, 2, 4]), "width": u64, "height": u64})


@st.composite
def graphs(draw):
    events = draw(st.integers(0, 3))
    node_st = [kernels(), memcpys(), memsets(), st.just({"kind": "empty"})]
    if events:
        node_st.append(st.fixed_dictionaries({
            "kind": st.sampled_from(["event_record", "event_wait"]),
            "event": st.integers(0, events - 1)}))
    nodes = draw(st.lists(st.one_of(node_st), max_size=12))
    edges = []
    if len(nodes) >= 2:
        pairs = st.tuples(st.integers(0, len(nodes) - 1), st.integers(0, len(nodes) - 1)).filter(
            lambda p: p[0] != p[1])
        for a, b in draw(st.lists(pairs, max_size=20)):
            edges.append((a, b, draw(st.integers(0, 2)), 0, draw(st.integers(0, 1))))
    return {"nodes": nodes, "edges": edges, "event_count": events}


def normalized(desc):
    """What graph_describe returns for a description built with defaults filled in."""
    return _native.graph_describe(_native.graph_build(desc))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_build_describe_round_trip(desc):
    data = _native.graph_build(desc)
    back = _native.graph_describe(data)
    assert len(back["nodes"]) == len(desc["nodes"])
    for want, got in zip(desc["nodes"], back["nodes"]):
        for k, v in want.items():
            got_v = got[k]
            if isinstance(v, list):
                got_v = [tuple(x) for x in got_v]
                v = [tuple(x) for x in v]
            assert got_v == v, (k, want, got)
    assert [tuple(e) for e in back["edges"]] == [tuple(e) for e in desc["edges"]]
    assert back["event_count"] == desc["event_count"]
    assert _native.graph_build(back) == data, "describe -> build reproduces the same bytes"


@settings(max_examples=60, deadline=None)
@given(graphs(), st.data())
def test_any_corruption_or_truncation_is_a_value_error(desc, data):
    good = _native.graph_build(desc)
    i = data.draw(st.integers(0, len(good) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(good)
    bad[i] ^= flip
    with pytest.raises(ValueError):
        _native.graph_describe(bytes(bad))
    cut = data.draw(st.integers(0, len(good) - 1))
    with pytest.raises(ValueError, match="truncated|magic|checksum"):
        _native.graph_describe(good[:cut])


def test_error_messages_name_the_problem():
    good = _native.graph_build({"nodes": [{"kind": "empty"}]})
    with pytest.raises(ValueError, match="bad magic"):
        _native.graph_describe(b"X" + good[1:])
    with pytest.raises(ValueError, match="body checksum"):
        _native.graph_describe(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ValueError, match="trailing"):
        _native.graph_describe(good + b"\0")
    with pytest.raises(ValueError, match="names a node"):
        _native.graph_build({"nodes": [{"kind": "empty"}], "edges": [(0, 3)]})
    with pytest.raises(ValueError, match="unknown node kind 'host'"):
        _native.graph_build({"nodes": [{"kind": "host"}]})


def pointer_kernel(words):
    params = b"".join(struct.pack("<Q", w) for w in words)
    return {"kind": "kernel", "module": "ab" * 32, "name": "k", "grid": (1, 1, 1),
            "block": (32, 1, 1), "params": params, "slots": [(8 * i, 8) for i in range(len(words))]}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.one_of(st.integers(BASE, BASE + SIZE - 1), st.integers(0, BASE - 1),
                                   st.integers(BASE + SIZE, 2**64 - 1)), min_size=1, max_size=6),
                min_size=1, max_size=5),
       st.integers(1, 2**20).map(lambda k: k << 21))
def test_relocation_moves_exactly_the_words_in_range(words, new_base):
    data = _native.graph_build({"nodes": [pointer_kernel(w) for w in words]})
    found = _native.graph_find_relocations(data, BASE, SIZE)
    moved = _native.graph_relocate(found, new_base)
    d = _native.graph_describe(moved)
    assert d["region_base"] == new_base and d["region_size"] == SIZE
    for node, ws in zip(d["nodes"], words):
        got = struct.unpack(f"<{len(ws)}Q", node["params"])
        want = tuple(w - BASE + new_base if BASE <= w < BASE + SIZE else w for w in ws)
        assert got == want
    back = _native.graph_relocate(moved, BASE)
    assert back == found, "relocating back restores the bytes"
    assert _native.graph_topology(moved) == _native.graph_topology(found)


def test_topology_groups_batch_sizes():
    def g(grid, ptr, block=256):
        k = pointer_kernel([ptr, 7])
        k["grid"] = (grid, 1, 1)
        k["block"] = (block, 1, 1)
        return _native.graph_build({"nodes": [k, {"kind": "empty"}], "edges": [(0, 1)]})
    files = [g(1, BASE), g(8, BASE + 64), g(1, BASE, block=128), g(64, BASE + 4096)]
    assert _native.graph_group_by_topology(files) == [[0, 1, 3], [2]]


def test_sha256_vectors():
    for msg in (b"", b"abc", b"a" * 1000, bytes(range(256)) * 3):
        assert _native.graph_sha256(msg) == hashlib.sha256(msg).hexdigest()


def test_kernel_names_from_a_cubin_compiled_here(tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists(
        "/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void alpha(float* p) { p[0] = 1; }\n'
                   '__device__ __noinline__ int helper(int x) { return x + 1; }\n'
                   '__global__ void beta(int* p) { p[0] = helper(p[0]); }\n')
    out = tmp_path / "k.cubin"
    subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-o", str(out), str(src)], check=True)
    data = out.read_bytes()
    assert _native.graph_binary_kind(data) == "elf"
    assert sorted(_native.graph_kernel_names(data)) == ["_Z4betaPi", "alpha"]


# ------------------------------------------------------------------------ store save / load
PTX = b"//\n.version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k(\n) { ret; }\n"


def make_store(n=3):
    mod = _native.graph_add_recorded_module(PTX)
    store = tg.GraphStore(region_base=BASE, region_size=SIZE)
    for i in range(n):
        k = pointer_kernel([BASE + 4096 * i, 5])
        k["module"] = mod
        k["grid"] = (1 + i, 1, 1)
        data = _native.graph_find_relocations(_native.graph_build({"nodes": [k]}), BASE, SIZE)
        store.add(f"bs{i}", data)
    return store, mod


def test_store_save_writes_index_graphs_and_only_used_modules(tmp_path):
    store, mod = make_store()
    index = store.save(tmp_path)
    assert index["format"] == "vitrify-graphs" and index["version"] == 1
    assert [g["name"] for g in index["graphs"]] == ["bs0", "bs1", "bs2"]
    assert len(index["templates"]) == 1 and index["templates"][0]["graphs"] == ["bs0", "bs1", "bs2"]
    assert list(index["modules"]) == [mod]
    assert (tmp_path / "modules" / f"{mod}.bin").read_bytes() == PTX
    assert json.loads((tmp_path / "graphs" / "index.json").read_text()) == index
    for g in index["graphs"]:
        assert g["relocations"] == 1
        assert (tmp_path / g["file"]).stat().st_size == g["bytes"]
    with pytest.raises(ValueError, match="already in the store"):
        store.add("bs0", store.data("bs0"))
    with pytest.raises(ValueError, match="non-empty string"):
        store.add("", store.data("bs0"))


def test_load_without_a_gpu_reports_the_driver_at_wait(tmp_path):
    store, _ = make_store()
    store.save(tmp_path)
    graphs = tg.load(tmp_path, region_base=BASE + (1 << 40))
    assert graphs.names == ["bs0", "bs1", "bs2"]
    assert graphs.template_of("bs0") == graphs.template_of("bs2")
    if vitrify.cuda_available():
        pytest.skip("a GPU is present; the build would run for real")
    with pytest.raises(vitrify.CudaUnavailableError):
        graphs.wait("bs1")
    with pytest.raises(vitrify.CudaUnavailableError):
        graphs.replay("bs0", stream=0)
    with pytest.raises(KeyError, match="no graph 'nope'"):
        graphs.wait("nope")
    graphs.close()


def test_load_rejects_corrupt_and_mismatched_files(tmp_path):
    store, mod = make_store()
    store.save(tmp_path)
    modfile = tmp_path / "modules" / f"{mod}.bin"
    modfile.write_bytes(PTX.replace(b"ret", b"RET"))
    with pytest.raises(ValueError, match="does not match its name"):
        tg.load(tmp_path)
    # checked=True says another checksum verified the bytes: it needs those bytes
    with pytest.raises(ValueError, match="checked=True needs files"):
        tg.load(tmp_path, checked=True)
    modfile.write_bytes(PTX)
    gfile = tmp_path / "graphs" / "00001.tgraph"
    raw = bytearray(gfile.read_bytes())
    raw[-2] ^= 0xFF
    gfile.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="SHA-256 differs"):
        tg.load(tmp_path)
    gfile.write_bytes(bytes(raw[:-1]))
    with pytest.raises(ValueError, match="truncated"):
        tg.load(tmp_path)
    idx = tmp_path / "graphs" / "index.json"
    d = json.loads(idx.read_text())
    d["version"] = 99
    idx.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="version 99"):
        tg.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        tg.load(tmp_path / "nowhere")


def test_load_subset_and_argument_checks(tmp_path):
    store, _ = make_store()
    store.save(tmp_path)
    g = tg.load(tmp_path, names=["bs2"])
    assert g.names == ["bs2"]
    with pytest.raises(KeyError, match="bs9"):
        tg.load(tmp_path, names=["bs9"])
    with pytest.raises(ValueError, match="threads"):
        tg.load(tmp_path, threads=0)
    with pytest.raises(ValueError, match=r"region_base must be an int in \[0, "):
        tg.GraphStore(region_base=-1)


def test_graphset_missing_module_names_the_kernel():
    gs = _native.GraphSet(0)
    data = _native.graph_build({"nodes": [pointer_kernel([1])]})
    with pytest.raises(ValueError, match="kernel 'k' needs module abab"):
        gs.add(data)


def test_save_names_a_graph_whose_module_was_not_recorded(tmp_path):
    store = tg.GraphStore()
    k = pointer_kernel([1])
    k["module"] = "cd" * 32
    store.add("orphan", _native.graph_build({"nodes": [k]}))
    with pytest.raises(ValueError, match="graph 'orphan' uses module cdcd.*did not record"):
        store.save(tmp_path)


def test_unrelocatable_graphs_are_named_before_any_driver_call():
    index = {"region": {"base": 0x600180000000}, "graphs": [
        {"name": "ok", "relocatable": True},
        {"name": "bad", "relocatable": False, "unclassified": {"count": 2, "words": [
            {"kernel": "k", "offset": 704, "value": "0x600000006000", "reason": "no layout"}]}},
    ]}
    assert tg.unrelocatable_graphs(index, None) == {}
    assert tg.unrelocatable_graphs(index, 0x600180000000) == {}
    skipped = tg.unrelocatable_graphs(index, 0x610180000000, unrelocatable="skip")
    assert list(skipped) == ["bad"] and "parameter byte 704" in skipped["bad"]
    assert tg.unrelocatable_graphs(index, 0x610180000000, names=["ok"]) == {}
    with pytest.raises(tg.GraphNotRelocatable, match="graph 'bad' is not relocatable from "
                                                     "0x600180000000 to 0x610180000000"):
        tg.unrelocatable_graphs(index, 0x610180000000)
