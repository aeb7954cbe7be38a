"""The region allocator on any machine: pure functions and argument checks in-process, and the
shared behaviour cases (region_cases.py) each in a fresh process on the fake driver
(VITRIFY_TEST_FAKE_LIBCUDA, set by `make test`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import region_cases
import vitrify
from vitrify.region import SEARCH_FIRST, SEARCH_LIMIT, Region, candidate_bases

FAKE = os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA")
needs_fake = pytest.mark.skipif(not FAKE, reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
HERE = Path(__file__).resolve().parent
TiB = 1 << 40


def run_on_fake(code: str, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, VITRIFY_LIBCUDA_PATH=FAKE, FAKE_CUDA_DEVICES="1",
             PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=120, cwd=str(HERE))


@needs_fake
@pytest.mark.parametrize("case", region_cases.CASES)
def test_case_on_fake_driver(case):
    r = run_on_fake(f"import region_cases as c; c.case_{case}(); print('ok')")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


@needs_fake
def test_two_processes_same_sequence_same_addresses_on_fake():  # R1, R2
    outs = [run_on_fake("import region_cases as c; c.case_print_sequence()") for _ in range(2)]
    for o in outs:
        assert o.returncode == 0, o.stderr
    a, b = (json.loads(o.stdout) for o in outs)
    assert a == b
    assert a[0] == SEARCH_FIRST


@given(st.integers(min_value=1, max_value=40 * TiB))
def test_candidate_bases_are_deterministic_disjoint_and_in_the_window(size):  # R2
    c = candidate_bases(size)
    assert c == candidate_bases(size)
    if size > SEARCH_LIMIT - SEARCH_FIRST:
        assert c == []
        return
    assert 1 <= len(c) <= 16 and c[0] == SEARCH_FIRST
    step = -(-size // TiB) * TiB
    for i, b in enumerate(c):
        assert b == SEARCH_FIRST + i * step and b + size <= SEARCH_LIMIT
        assert b % (2 << 20) == 0


@pytest.mark.parametrize("kwargs, exc, text", [
    (dict(size=0), ValueError, "size must be >= 1"),
    (dict(size=1.5), TypeError, "size must be an int"),
    (dict(size=True), TypeError, "size must be an int"),
    (dict(size=1 << 30, base=-4096), ValueError, "base must be >= 1"),
    (dict(size=1 << 30, device=-1), ValueError, "device must be >= 0"),
])
def test_arguments_are_checked_before_the_driver(kwargs, exc, text):
    with pytest.raises(exc, match=text):
        Region(**kwargs)
    with pytest.raises(ValueError):
        candidate_bases(0)


@needs_fake
def test_driver_side_argument_errors_name_the_value():
    r = run_on_fake(
        "import vitrify\n"
        "for kw in (dict(base=0x600000001000), dict(device=3)):\n"
        "    try:\n        vitrify.Region(1 << 30, **kw)\n"
        "    except ValueError as e:\n        print(e)\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "region base 0x600000001000 is not a multiple of the allocation granularity 2097152" in lines[0]
    assert "device ordinal 3 out of range: this machine has 1 CUDA device(s)" in lines[1]


def test_region_without_driver_is_unavailable_error():
    r = subprocess.run([sys.executable, "-c",
                        "import vitrify\ntry:\n    vitrify.Region(1 << 30)\n"
                        "except vitrify.CudaUnavailableError as e:\n    print('unavailable')\n"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, VITRIFY_LIBCUDA_PATH="/nonexistent/libcuda.so.1"))
    assert r.stdout.strip() == "unavailable", r.stdout + r.stderr


def test_c_abi_is_exported_from_the_extension():
    import ctypes

    lib = ctypes.CDLL(vitrify._native.__file__)
    assert lib.vitrify_region_malloc and lib.vitrify_region_free


def test_torch_integration_imports_without_torch_and_says_what_is_missing():
    """In a process where torch cannot be imported (sys.modules blocks it, installed or not)."""
    code = ("import sys\nsys.modules['torch'] = None\n"
            "import vitrify\nfrom vitrify.integrations import torch as tt\n"
            "assert tt.library_path() == vitrify._native.__file__\n"
            "try:\n    tt.pluggable_allocator()\n"
            "except ImportError as e:\n    print('ImportError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ImportError:") and "needs torch" in r.stdout, r.stdout


@needs_fake
def test_benchmark_runs_on_the_fake_driver(tmp_path):
    """A smoke run of `vitrify bench region` (times on the fake mean nothing)."""
    r = run_on_fake(f"import sys; from vitrify.cli import main; "
                    f"sys.exit(main(['bench', 'region', '--quick', '--out', {str(tmp_path)!r}]))")
    assert r.returncode == 0, r.stdout + r.stderr
    (out,) = tmp_path.glob("region-*.json")
    res = json.loads(out.read_text())
    assert {"alloc_free_2MiB_on_demand_over_bump", "map_per_gib_2MiB_over_1GiB"} <= set(res["ratios"])
    assert set(res["ratios"]) <= set(res["goals"])
    assert res["rows"] and res["git_sha"]


@needs_fake
def test_torch_integration_wiring_with_a_stub_torch():
    """vitrify.integrations.torch against tests/python/stubs/torch (the names it uses, no more): the
    pluggable allocator is vitrify's C pair, allocations inside the context come from the region,
    a full region is MemoryError with the region's reason, capture uses the region's pool."""
    code = f"""
import sys, types
sys.path.insert(0, {str(HERE / 'stubs')!r})
import torch, vitrify
from vitrify.integrations import torch as tt
assert torch.__version__.endswith('stub'), torch.__file__
with vitrify.Region(64 << 20) as r:
    assert tt.pluggable_allocator().args == (vitrify._native.__file__, 'vitrify_region_malloc', 'vitrify_region_free')
    pool = tt.mem_pool(r)
    assert tt.mem_pool(r) is pool and tt.pool_id(r) == pool.id
    with tt.region_allocations(r):
        assert tt.active_base(0) == r.base
        p = torch.empty(8 << 20)
    assert torch.log[-1] == ('use_mem_pool', pool, 0) and tt.active_base(0) is None
    assert p == r.base
    try:
        with tt.region_allocations(r):
            torch.empty(128 << 20)
        raise AssertionError('no error')
    except MemoryError as e:
        assert 'region full' in str(e) and str(128 << 20) in str(e), str(e)
    g = types.SimpleNamespace()
    with tt.graph_capture(r, g) as got:
        assert got is g and torch.log[-1][:3] == ('graph', g, pool.id)
        q = torch.empty(2 << 20)
    assert q == r.base + (8 << 20)
    torch.free(pool, p, 8 << 20)  # after the context: found by address
    assert r.stats()['live_allocations'] == 1
    with r.paused(), tt.region_allocations(r):
        s = torch.empty(2 << 20)
    assert not r.contains(s) and r.owns(s)
print('ok')
"""
    r = run_on_fake(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
