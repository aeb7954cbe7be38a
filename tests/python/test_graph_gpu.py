"""GPU tests of graph persistence (marker gpu): FREEZE in one fresh process, THAW in another
(tests/python/graph_worker.py), outputs compared byte for byte; relocation to another base;
FREEZE errors for a missing binary and an unsupported copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from artifacts import write_artifact

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("graph_worker.py")
# 2 GiB into a 4 GiB window, like every default region base (region DESIGN R2, R13).
BASE_A = 0x7E0080000000
BASE_B = 0x7D0080000000


def run_worker(*args: str, timeout: int = 400) -> dict:
    p = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True,
                       timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"worker {args} printed no result (rc {p.returncode})\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}"
    r = json.loads(lines[-1])
    assert r["ok"], f"worker {args} failed: {r['error']}\n{r.get('traceback', '')}\nstderr:\n{p.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    d = tmp_path_factory.mktemp("graphs")
    return d, run_worker("freeze", "main", str(d), hex(BASE_A))


@pytest.fixture(scope="module")
def thawed_same_base(frozen):
    d, _ = frozen
    return run_worker("thaw", "main", str(d), hex(BASE_A))


@pytest.fixture(scope="module")
def thawed_other_base(frozen):
    d, _ = frozen
    return run_worker("thaw", "main", str(d), hex(BASE_B))


def check(result: dict, prefix: str) -> list[str]:
    names = [n for n in result["equal"] if n.startswith(prefix)]
    assert names, f"no graphs named {prefix}*: skipped {result['skipped']}"
    for n in names:
        assert result["equal"][n], (f"{n}: THAW output differs from FREEZE output at byte "
                                    f"{result['first_diff'].get(n)}; info {result['info'][n]}")
        assert result["equal_after_back_to_back"][n], f"{n}: wrong after back-to-back replays"
    return names


def test_mlp_with_cublas_round_trips_in_a_fresh_process(thawed_same_base):
    names = check(thawed_same_base, "mlp_")
    assert len(names) == 4


def test_batch_sizes_share_one_template(thawed_same_base):
    check(thawed_same_base, "ew_")
    t = thawed_same_base["templates"]
    assert t["ew_bs64"] == t["ew_bs128"] == t["ew_bs256"], (
        f"templates {t}; topologies " +
        str({n: thawed_same_base["info"][n]["topology"][:12] for n in t if n.startswith("ew_")}))
    stats = thawed_same_base["stats"]
    assert stats["templates"] < stats["graphs"], stats
    assert stats["parameter_switches"] >= 2, stats


def test_two_stream_event_graph_round_trips(thawed_same_base):
    if "events" in thawed_same_base["skipped"]:
        pytest.skip(thawed_same_base["skipped"]["events"])
    check(thawed_same_base, "events")
    kinds = thawed_same_base["info"]["events"]["kinds"]
    assert kinds.get("event_record") == 1 and kinds.get("event_wait") == 1, kinds


def test_torch_compile_triton_kernels_round_trip(thawed_same_base):
    if "compiled" in thawed_same_base["skipped"]:
        pytest.skip(thawed_same_base["skipped"]["compiled"])
    check(thawed_same_base, "compiled")


def test_relocation_to_another_base_gives_identical_outputs(frozen):
    """Each graph thawed alone at another base (one process per graph, so a fault in one graph,
    e.g. an address the relocation scan missed, names that graph instead of hiding the rest)."""
    d, fz = frozen
    failures = {}
    for name in fz["outputs"]:
        p = subprocess.run([sys.executable, str(WORKER), "thaw", "main", str(d), hex(BASE_B), name],
                           capture_output=True, text=True, timeout=300)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            failures[name] = f"no result, rc {p.returncode}: {p.stderr[-1500:]}"
            continue
        r = json.loads(lines[-1])
        if not r["ok"]:
            failures[name] = r["error"]
        elif name in r["refused"]:
            failures[name] = f"refused as non-relocatable: {r['refused'][name]}"
        elif not (r["equal"][name] and r["equal_after_back_to_back"][name]):
            failures[name] = f"output differs from FREEZE at byte {r['first_diff'].get(name)}"
        else:
            assert r["base"] == BASE_B != r["freeze_base"]
            assert r["info"][name]["relocations"] > 0
    assert not failures, "relocated THAW failed for: " + json.dumps(failures, indent=1)


def test_relocation_all_graphs_in_one_process(thawed_other_base):
    r = thawed_other_base
    assert not r["refused"], f"graphs refused as non-relocatable: {r['refused']}"
    for n in r["equal"]:
        assert r["equal"][n], f"{n} differs after relocation (first byte {r['first_diff'].get(n)})"


def test_missing_binary_fails_at_freeze(tmp_path):
    r = run_worker("freeze", "missing", str(tmp_path), hex(BASE_A))
    assert r["freeze_error"] is not None, "capture without module recording did not fail"
    assert "was not recorded" in r["freeze_error"] and "kernel '" in r["freeze_error"]
    assert "'bad'" in r["freeze_error"]


def test_unsupported_copy_fails_at_freeze(tmp_path):
    r = run_worker("freeze", "unsupported", str(tmp_path), hex(BASE_A))
    if r.get("capture_error"):
        pytest.skip(f"torch refused to capture a pinned-host copy: {r['capture_error']} "
                    "(the C++ GPU test covers an unsupported child-graph node)")
    assert r["freeze_error"] is not None, "a pinned-host copy in the graph did not fail"
    assert "host memory" in r["freeze_error"], r["freeze_error"]


# ------------------------------------------------------------------ relocation safety
# Real cuBLAS, attention, norm and softmax kernels whose dimensions equal the upper half of the
# region base (base >> 32), so that pairs of 32-bit integers (x, dim) read as addresses in the
# base's 4 GiB window. The region's live allocations tell what may hold a pointer.
# At the default phase (2 GiB into a window: 0x600180000000, dim 24577) such words lie below
# the region or on a window guard (region R13), so every graph is relocatable and, thawed
# relocated by several shifts in fresh processes, every output byte is identical.
# At a 4 GiB-aligned base (0x600000000000, dim 24576) the window starts at the region's first
# allocation: words (x < 1 MiB, 24576) that point into it are unclassified, the graphs holding
# them are refused at another base, and every graph that is thawed gives identical bytes.
BASE_DIMS = 0x600180000000
BASE_DIMS_ALIGNED = 0x600000000000
DIM_SHIFTS = {"plus_2MiB": 2 << 20, "plus_1GiB": 1 << 30, "plus_64GiB": 64 << 30,
              "minus_1TiB": -(1 << 40)}


@pytest.fixture(scope="module")
def frozen_dims(tmp_path_factory):
    d = tmp_path_factory.mktemp("graphs_dims")
    return d, run_worker("freeze", "dims", str(d), hex(BASE_DIMS))


def test_dimension_cases_are_relocatable(frozen_dims):
    _, r = frozen_dims
    assert len(r["info"]) >= 7, r["skipped"]
    fixed = {n: i["unclassified"] for n, i in r["info"].items() if not i["relocatable"]}
    assert not fixed, f"graphs FREEZE left non-relocatable: {fixed}"


@pytest.mark.parametrize("shift", list(DIM_SHIFTS))
def test_kernels_at_dimensions_equal_to_the_base_upper_half_survive_relocation(frozen_dims, shift):
    d, fz = frozen_dims
    r = run_worker("thaw", "dims", str(d), hex(BASE_DIMS + DIM_SHIFTS[shift]))
    assert r["base"] == BASE_DIMS + DIM_SHIFTS[shift]
    assert not r["refused"], r["refused"]
    assert set(r["equal"]) == set(fz["outputs"])
    for name, ok in r["equal"].items():
        assert ok, (f"{name} relocated by {shift}: output differs at byte {r['first_diff'][name]}; "
                    f"relocations {r['info'][name]['relocations_by_kind']}")
        assert r["equal_after_back_to_back"][name], name


def test_at_a_window_aligned_base_ambiguous_graphs_are_refused_never_wrong(tmp_path):
    fz = run_worker("freeze", "dims", str(tmp_path), hex(BASE_DIMS_ALIGNED))
    r = run_worker("thaw", "dims", str(tmp_path), hex(BASE_DIMS_ALIGNED + DIM_SHIFTS["plus_64GiB"]))
    non_relocatable = {n for n, i in fz["info"].items() if not i["relocatable"]}
    assert set(r["refused"]) == non_relocatable
    for name in r["refused"]:
        assert fz["info"][name]["unclassified"]["count"] > 0, fz["info"][name]
    assert set(r["equal"]) == set(fz["outputs"]) - non_relocatable
    for name, ok in r["equal"].items():
        assert ok and r["equal_after_back_to_back"][name], (
            f"{name} thawed relocated with different bytes (first at {r['first_diff'].get(name)})")


# ------------------------------------------------ kernels of one name in several binaries
@pytest.fixture(scope="module")
def frozen_samename(tmp_path_factory):
    d = tmp_path_factory.mktemp("samename")
    fz = run_worker("freeze", "samename", str(d), hex(BASE_A), timeout=600)
    write_artifact("graph-same-name-freeze", {k: fz.get(k) for k in (
        "kernels", "recorder", "skipped", "capture_seconds")}, ok=not fz.get("skipped"))
    return d, fz


def _distinct_modules(fz: dict, graph: str) -> set[str]:
    return {module for _, module in fz["kernels"][graph]}


def test_same_named_kernels_are_resolved_to_the_binary_each_node_launched(frozen_samename):
    """Triton constexpr specialisations, torch.compile at five batch sizes, the library API
    (lazy) and the module API: every graph freezes (no 'defined by 2 different recorded
    binaries' error), and the same-named nodes of one graph name different binaries."""
    _, fz = frozen_samename
    assert not fz["skipped"], f"cases skipped on a GPU machine: {fz['skipped']}"
    for graph in ("triton_both_in_one_graph", "library_both_in_one_graph",
                  "module_both_in_one_graph"):
        names = {name for name, _ in fz["kernels"][graph]}
        assert len(names) == 1 and len(fz["kernels"][graph]) == 2, fz["kernels"][graph]
        assert len(_distinct_modules(fz, graph)) == 2, f"{graph}: {fz['kernels'][graph]}"
    assert len(_distinct_modules(fz, "library_and_module_mixed")) == 4
    # The single-variant graphs point at one of the two-variant graph's binaries.
    assert _distinct_modules(fz, "triton_a2") | _distinct_modules(fz, "triton_a3") == \
        _distinct_modules(fz, "triton_both_in_one_graph")
    assert _distinct_modules(fz, "library_second") < _distinct_modules(fz, "library_both_in_one_graph")
    # torch.compile: the five batch sizes share kernel names but not binaries.
    compiled = [g for g in fz["kernels"] if g.startswith("compiled_bs")]
    assert len(compiled) >= 4
    by_name: dict[str, set[str]] = {}
    for g in compiled:
        for name, module in fz["kernels"][g]:
            if name.startswith("triton_"):
                by_name.setdefault(name, set()).add(module)
    assert any(len(m) >= 2 for m in by_name.values()), by_name
    rec = fz["recorder"]
    assert rec["bound_exact"] + rec["bound_handles"] > 0, rec


def test_same_named_kernels_thaw_with_identical_outputs(frozen_samename):
    d, _ = frozen_samename
    thaws = {hex(base): run_worker("thaw", "samename", str(d), hex(base))
             for base in (BASE_A, BASE_B)}
    write_artifact("graph-same-name-thaw", {"thaws": {b: {k: r.get(k) for k in (
        "equal", "equal_after_back_to_back", "refused", "stats", "rebuild_seconds")}
        for b, r in thaws.items()}}, ok=all(
            not r["refused"] and all(r["equal"].values())
            and all(r["equal_after_back_to_back"].values()) for r in thaws.values()))
    for r in thaws.values():
        assert not r["refused"], r["refused"]
        for prefix in ("triton_", "compiled_bs", "library_", "module_"):
            check(r, prefix)
