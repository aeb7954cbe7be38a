"""The region allocator on a real GPU (marker `gpu`: skipped without a driver, with the reason).
The native behaviour cases are the same ones the CPU suite runs on the fake driver
(region_cases.py); the torch cases skip cleanly when torch is not importable.
R<n> = invariant n in csrc/src/region/DESIGN.md."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import region_cases
from vitrify._units import GiB, MiB
from vitrify.region import Region

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not importable")


def test_exact_base_honoured_or_clear_error():
    region_cases.case_exact_base_or_clear_error()


def test_free_then_alloc_never_reuses():
    region_cases.case_free_then_alloc_never_reuses()


def test_data_roundtrip():
    region_cases.case_data_roundtrip()


def test_stop_resume():
    region_cases.case_stop_resume()


def test_set_offset():
    region_cases.case_set_offset()


def test_preallocate_fast_path():
    region_cases.case_preallocate_fast_path()


def test_oom_inside_region_is_memory_error():
    region_cases.case_oom_is_memory_error()


def test_checkpoints():
    region_cases.case_checkpoints()


def test_close_releases():
    region_cases.case_close_releases()


def test_c_abi():
    region_cases.case_c_abi()


def test_two_fresh_processes_same_sequence_same_addresses():  # R1, R2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    outs = [subprocess.run([sys.executable, "-c", "import region_cases as c; c.case_print_sequence()"],
                           capture_output=True, text=True, env=env, timeout=120, cwd=str(HERE))
            for _ in range(2)]
    for o in outs:
        assert o.returncode == 0, o.stdout + o.stderr
    a, b = (json.loads(o.stdout) for o in outs)
    assert a == b, f"process 1 {a[:5]}... vs process 2 {b[:5]}..."


# --- torch ---------------------------------------------------------------------------------------

@pytest.fixture
def torch_region():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    torch.cuda.init()
    r = Region(4 * GiB)
    yield torch, r
    torch.cuda.synchronize()
    r._vitrify_torch_pool = None  # drop the pool (its segments go back) before the region goes
    gc.collect()
    torch.cuda.empty_cache()
    r.close()


def _inside(r: Region, t) -> bool:
    return r.base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= r.end


@needs_torch
def test_torch_tensors_inside_context_live_in_region(torch_region):
    torch, r = torch_region
    from vitrify.integrations.torch import region_allocations

    before = torch.empty(1 << 20, device="cuda")
    with region_allocations(r):
        small = torch.empty(1000, device="cuda")
        big = torch.empty(64 * MiB // 4, device="cuda")
    after = torch.empty(1 << 20, device="cuda")
    assert _inside(r, small), f"{small.data_ptr():#x} not in {r}"
    assert _inside(r, big), f"{big.data_ptr():#x} not in {r}"
    assert not r.contains(before.data_ptr()), f"{before.data_ptr():#x} outside the context is in {r}"
    assert not r.contains(after.data_ptr()), f"{after.data_ptr():#x} outside the context is in {r}"
    assert r.stats()["live_allocations"] >= 1


@needs_torch
def test_torch_matmul_on_region_tensors_is_correct(torch_region):
    torch, r = torch_region
    from vitrify.integrations.torch import region_allocations

    g = torch.Generator().manual_seed(0)
    a_cpu = torch.randn(512, 384, generator=g, dtype=torch.float64)
    b_cpu = torch.randn(384, 256, generator=g, dtype=torch.float64)
    with region_allocations(r):
        a = a_cpu.to("cuda")
        b = b_cpu.to("cuda")
        c = a @ b
    assert _inside(r, a) and _inside(r, b) and _inside(r, c)
    torch.testing.assert_close(c.cpu(), a_cpu @ b_cpu, rtol=1e-10, atol=1e-10)


@needs_torch
def test_torch_cuda_graph_with_pool_in_region_replays(torch_region):
    torch, r = torch_region
    from vitrify.integrations.torch import graph_capture, region_allocations

    g = torch.Generator().manual_seed(1)
    with region_allocations(r):
        x = torch.randn(256, 256, generator=g).to("cuda")
        w = torch.randn(256, 256, generator=g).to("cuda")
    s = torch.cuda.Stream()  # warm up (cuBLAS handles, workspaces) outside the capture
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.relu(x @ w) + 1
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(r, graph):
        y = torch.relu(x @ w) + 1
    assert _inside(r, y), f"graph output {y.data_ptr():#x} not in {r}"
    for seed in (2, 3):
        x.copy_(torch.randn(256, 256, generator=torch.Generator().manual_seed(seed)).to("cuda"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, torch.relu(x @ w) + 1, rtol=1e-4, atol=1e-4)


@needs_torch
def test_torch_oom_inside_region_is_memory_error(torch_region):
    torch, _ = torch_region
    from vitrify.integrations.torch import region_allocations

    with Region(64 * MiB) as small:
        with pytest.raises(MemoryError, match="region full"):
            with region_allocations(small):
                torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
        small._vitrify_torch_pool = None
        gc.collect()
