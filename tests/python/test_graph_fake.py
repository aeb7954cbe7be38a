"""The Python graph API end to end on CPU, against the fake driver with graph entry points
(tests/cpp/fake_cuda/graph.cpp in VITRIFY_TEST_FAKE_LIBCUDA, built by `make test`):
GraphStore.add -> save -> load at another base -> replay (the fake logs each launch) ->
add_cuda_graph of the rebuilt graph. Runs in a subprocess: the driver is chosen once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FAKE = Path(os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA", "/nonexistent"))

SCRIPT = r'''
import ctypes, json, struct, sys
from pathlib import Path
import vitrify
import vitrify.graph as tg
from vitrify import _native

fake = ctypes.CDLL(sys.argv[1])
fake.fake_graph_launch.restype = ctypes.c_char_p
fake.fake_graph_launches.restype = ctypes.c_size_t
fake.fake_graph_last.restype = ctypes.c_void_p
out = Path(sys.argv[2])
BASE, BASE2, SIZE = 0x7E0000000000, 0x7D0000000000, 1 << 30
IMAGE = b".version 8.0\n.entry scale ( // params 0:8 8:4\n"
assert vitrify.cuda_available(), vitrify.cuda_unavailable_reason()
mod = _native.graph_add_recorded_module(IMAGE)

def graph(n, value):
    params = struct.pack("<QI", BASE + 0x1000, n)
    d = {"nodes": [
        {"kind": "memset", "dst": BASE + 0x1000, "value": value, "element_size": 4, "width": 64},
        {"kind": "kernel", "module": mod, "name": "scale", "grid": ((n + 127) // 128, 1, 1),
         "block": (128, 1, 1), "params": params, "slots": [(0, 8), (8, 4)]}],
        "edges": [(0, 1)]}
    return _native.graph_find_relocations(_native.graph_build(d), BASE, SIZE)

store = tg.GraphStore(region_base=BASE, region_size=SIZE)
store.add("small", graph(100, 1))
store.add("large", graph(5000, 2))
index = store.save(out)
graphs = tg.load(out, region_base=BASE2)
graphs.wait_all()
first = fake.fake_graph_launches()
graphs.replay("large")
graphs.replay("small", stream=0)
graphs.replay("large", stream=0)
log = [fake.fake_graph_launch(first + i).decode() for i in range(3)]
walked = tg.GraphStore(region_base=BASE2, region_size=SIZE)
info = walked.add_cuda_graph("walked", fake.fake_graph_last())
print(json.dumps({"log": log, "stats": graphs.stats(), "index": index, "info": info,
                  "walked": _native.graph_describe(walked.data("walked"))}, default=str))
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not FAKE.exists():
        pytest.skip(f"fake driver not built ({FAKE}); run through `make test`")
    d = tmp_path_factory.mktemp("fakegraphs")
    env = dict(os.environ, VITRIFY_LIBCUDA_PATH=str(FAKE), FAKE_CUDA_DEVICES="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(FAKE), str(d)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_replay_launches_each_graph_with_its_relocated_parameters(run):
    base2 = 0x7D0000000000
    ptr = (base2 + 0x1000).to_bytes(8, "little").hex()
    large, small, large2 = run["log"]
    assert large == f"S {base2 + 0x1000} v=2 w=64;K scale g=40,1,1 b=128,1,1 s=0 p={ptr}" + \
        (5000).to_bytes(4, "little").hex() + ";"
    assert small == f"S {base2 + 0x1000} v=1 w=64;K scale g=1,1,1 b=128,1,1 s=0 p={ptr}" + \
        (100).to_bytes(4, "little").hex() + ";"
    assert large2 == large
    st = run["stats"]
    assert st["templates"] == 1 and st["graphs"] == 2
    assert st["parameter_switches"] == 3  # small was built first: large, small, large


def test_index_and_walk_of_the_rebuilt_graph(run):
    assert [t["graphs"] for t in run["index"]["templates"]] == [["small", "large"]]
    assert run["info"]["kinds"] == {"memset": 1, "kernel": 1}
    assert run["info"]["relocations"] == 2  # memset dst + the kernel's pointer
    walked = run["walked"]
    assert walked["nodes"][1]["name"] == "scale"
    assert [tuple(e) for e in walked["edges"]] == [(0, 1, 0, 0, 0)]


ARCHIVE_SCRIPT = r'''
import json, struct, sys
from pathlib import Path
import vitrify.graph as tg
from vitrify import _native, archive as ar

out = Path(sys.argv[1])
BASE, SIZE = 0x7E0000000000, 1 << 30
IMAGE = b".version 8.0\n.entry scale ( // params 0:8 8:4\n"
mod = _native.graph_add_recorded_module(IMAGE)
params = struct.pack("<QI", BASE + 0x1000, 7)
d = {"nodes": [{"kind": "kernel", "module": mod, "name": "scale", "grid": (1, 1, 1),
                "block": (32, 1, 1), "params": params, "slots": [(0, 8), (8, 4)]}], "edges": []}
store = tg.GraphStore(region_base=BASE, region_size=SIZE)
store.add("g", _native.graph_find_relocations(_native.graph_build(d), BASE, SIZE))
fp = ar.Fingerprint(gpu="fake", sm="9.0", driver=None, cuda="13.0", torch=None, engine="test",
                    engine_version="0", model="m")
with ar.ArchiveWriter(out / "a", fp, ar.Region(base=BASE, size=SIZE, granularity=2 << 20)) as w:
    store.save_to_archive(w, rank=0)
a = ar.open_archive(out / "a")
g = tg.load_from_archive(a, 0)
g.wait_all()
g.replay("g")
files = sorted(r for r in a.files if r.startswith("rank0/"))
mod_rel = [r for r in files if r.startswith("rank0/modules/")][0]
p = Path(a.path) / mod_rel
raw = bytearray(p.read_bytes()); raw[-1] ^= 1; p.write_bytes(bytes(raw))
try:
    tg.load_from_archive(ar.open_archive(out / "a"), 0)
    err = None
except ar.ArchiveCorrupt as e:
    err = str(e)
try:
    tg.load_from_archive(ar.open_archive(out / "a"), 1)
    missing = None
except KeyError as e:
    missing = str(e)
print(json.dumps({"files": files, "stats": g.stats(), "corrupt": err, "missing": missing,
                  "verify": ar.verify(out / "a")}))
'''


def test_graphs_round_trip_through_an_archive(tmp_path):
    """save_to_archive puts the graphs and binaries under rank0/ and into the manifest;
    load_from_archive verifies them first: a flipped byte in a module is ArchiveCorrupt naming
    the file, before any driver call; a rank without graphs is a KeyError."""
    if not FAKE.exists():
        pytest.skip(f"fake driver not built ({FAKE}); run through `make test`")
    env = dict(os.environ, VITRIFY_LIBCUDA_PATH=str(FAKE), FAKE_CUDA_DEVICES="1")
    p = subprocess.run([sys.executable, "-c", ARCHIVE_SCRIPT, str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert "rank0/graphs/index.json" in r["files"]
    assert any(f.startswith("rank0/graphs/") and f.endswith(".tgraph") for f in r["files"])
    assert any(f.startswith("rank0/modules/") and f.endswith(".bin") for f in r["files"])
    assert r["stats"]["ready_graphs"] == 1
    assert r["corrupt"] and "rank0/modules/" in r["corrupt"] and "checksum" in r["corrupt"]
    assert r["missing"] and "rank 1" in r["missing"]
    assert any("rank0/modules/" in line for line in r["verify"])
