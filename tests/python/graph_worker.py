"""Subprocess worker for tests/python/test_graph_gpu.py and benchmarks: FREEZE and THAW of CUDA
graphs in separate, fresh processes.

    python graph_worker.py freeze main DIR BASE     # capture the cases, save DIR/archive + image
    python graph_worker.py thaw   main DIR BASE [NAME]  # no torch: rebuild at BASE, replay, compare
    python graph_worker.py freeze dims DIR BASE     # cuBLAS / attention at dims = BASE >> 32
    python graph_worker.py freeze samename DIR BASE  # same-named kernels (samename_cases.py)
    python graph_worker.py freeze missing DIR BASE  # no module recording -> GraphFreezeError
    python graph_worker.py freeze unsupported DIR BASE  # pinned H2D copy -> GraphFreezeError

Memory: one vitrify Region of ARENA bytes at BASE backs every torch allocation
(``vitrify.integrations.torch``: a MemPool over the region's C allocator), so FREEZE saves every
live allocation (offsets and bytes) and THAW puts them back where they were (``Region.
restore_allocations``) at BASE or at another base (relocation). The last stdout line is JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from worker_result import report

ARENA = 2 << 30  # torch.cuda.graph() empties the cache at each capture; the region never reuses



def _cases(torch, out_skipped):
    """(name, fn) pairs; every fn reads tensors allocated here and returns a new tensor."""
    cases = []
    torch.manual_seed(0)
    # An MLP: cuBLAS GEMMs + elementwise, at several batch sizes, fp32 and fp16.
    w1 = torch.randn(256, 512, device="cuda") * 0.05
    b1 = torch.randn(512, device="cuda")
    w2 = torch.randn(512, 128, device="cuda") * 0.05
    for bs in (8, 16, 32):
        x = torch.randn(bs, 256, device="cuda")
        cases.append((f"mlp_bs{bs}", lambda x=x: torch.relu(x @ w1 + b1) @ w2))
    h1, hb, h2 = w1.half(), b1.half(), w2.half()
    xh = torch.randn(64, 256, device="cuda", dtype=torch.half)
    cases.append(("mlp_half_bs64", lambda: torch.relu(xh @ h1 + hb) @ h2))
    # Elementwise only, three batch sizes: same kernels, other grids -> one template.
    for bs in (64, 128, 256):
        x = torch.randn(bs, 1024, device="cuda")
        cases.append((f"ew_bs{bs}", lambda x=x: torch.relu(x * 2.0 + 1.0)))
    # Two streams joined by an external event: event record + event wait nodes.
    try:
        ext = torch.cuda.Event(external=True)
    except TypeError as e:
        out_skipped["events"] = f"torch.cuda.Event has no `external` argument: {e}"
    else:
        xe = torch.randn(4096, device="cuda")
        side = torch.cuda.Stream()

        def two_streams():
            main = torch.cuda.current_stream()
            a = xe * 2.0
            side.wait_stream(main)
            with torch.cuda.stream(side):
                b = a + 1.0
                ext.record(side)
            main.wait_stream(side)  # the join orders b before c (an edge) ...
            ext.wait(main)  # ... so this external wait node never races its record node
            return b * 3.0

        cases.append(("events", two_streams))
    # torch.compile (Triton JIT kernels).
    try:
        wc = torch.randn(1024, device="cuda")
        xc = torch.randn(64, 1024, device="cuda")
        cf = torch.compile(lambda a, b: torch.tanh(a * b + 1.0).sum(dim=-1) + a.mean())
        cf(xc, wc)  # compile now, so a failure is a skip rather than an error
        cases.append(("compiled", lambda: cf(xc, wc)))
    except Exception as e:  # no triton / no compiler on this machine
        out_skipped["compiled"] = f"torch.compile failed: {type(e).__name__}: {e}"[:500]
    return cases


def _dim_cases(torch, out_skipped, base):
    """Real cuBLAS and attention kernels at shapes whose dimensions equal the upper half of the
    region base (base >> 32: 24576 = 6 x 4096 = 24 x 1024 at 0x600000000000, 24577 at the default
    0x600180000000): the integers that a relocation by value alone corrupted."""
    dim = base >> 32
    torch.manual_seed(1)
    bf = torch.bfloat16
    cases = []
    w = torch.randn(4096, dim, device="cuda", dtype=bf) * 0.02
    x6 = torch.randn(6, 4096, device="cuda", dtype=bf)
    cases.append(("gemm_6x4096_by_4096x24576", lambda: x6 @ w))
    wh = w.half()
    x6h = x6.half()
    cases.append(("gemm_half_6x4096_by_4096x24576", lambda: x6h @ wh))
    w2 = torch.randn(1024, 4096, device="cuda", dtype=bf) * 0.03
    x24 = torch.randn(24, 1024, device="cuda", dtype=bf)
    cases.append(("gemm_24x1024_by_1024x4096", lambda: x24 @ w2))
    w3 = torch.randn(128, 256, device="cuda", dtype=bf) * 0.1
    xt = torch.randn(dim, 128, device="cuda", dtype=bf)
    cases.append(("gemm_24576x128_by_128x256", lambda: xt @ w3))
    xf = torch.randn(6, 4096, device="cuda")
    wf = torch.randn(4096, dim, device="cuda") * 0.02
    cases.append(("gemm_fp32_6x4096_by_4096x24576", lambda: xf @ wf))
    # Prefill attention over 24576 tokens, and decode attention at batch 24 with GQA.
    q = torch.randn(1, 8, dim, 128, device="cuda", dtype=bf)
    k = torch.randn(1, 8, dim, 128, device="cuda", dtype=bf)
    v = torch.randn(1, 8, dim, 128, device="cuda", dtype=bf)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cases.append(("sdpa_causal_seq24576", lambda: sdpa(q, k, v, is_causal=True)))
    qd = torch.randn(24, 32, 1, 128, device="cuda", dtype=bf)
    kd = torch.randn(24, 8, 1024, 128, device="cuda", dtype=bf)
    vd = torch.randn(24, 8, 1024, 128, device="cuda", dtype=bf)
    try:
        sdpa(qd, kd, vd, enable_gqa=True)
        cases.append(("sdpa_decode_bs24_gqa", lambda: sdpa(qd, kd, vd, enable_gqa=True)))
    except TypeError as e:
        out_skipped["sdpa_decode_bs24_gqa"] = f"no enable_gqa: {e}"
    # Norm and softmax over a 24576-wide row at batch 6.
    xn = torch.randn(6, dim, device="cuda", dtype=bf)
    gn = torch.randn(dim, device="cuda", dtype=bf)
    cases.append(("rmsnorm_softmax_6x24576", lambda: torch.softmax(
        torch.nn.functional.rms_norm(xn, (dim,), gn, 1e-5).float(), dim=-1)))
    return cases


def freeze(case: str, out: Path, base: int) -> dict:
    import vitrify.graph as tg

    if case != "missing":
        tg.record_modules()
    import torch

    from vitrify import Region
    from vitrify.integrations import torch as vt

    region = Region(6 << 30 if case == "dims" else ARENA, base=base)
    pool = vt.mem_pool(region)
    store = tg.GraphStore(region=region)
    result: dict = {"base": region.base, "size": region.size, "skipped": {}, "outputs": {},
                    "info": {}, "capture_seconds": {}}
    if case in ("missing", "unsupported"):
        with vt.region_allocations(region):
            x = torch.randn(1024, device="cuda")
            pinned = torch.randn(1024).pin_memory()
            x * 2.0  # warm up
        torch.cuda.synchronize()
        y = None
        try:
            with vt.activated(region), store.capture("bad", pool=pool.id):
                if case == "missing":
                    y = x * 2.0
                else:
                    x.copy_(pinned, non_blocking=True)
                    y = x + 1.0
            result["freeze_error"] = None
        except tg.GraphFreezeError as e:
            result["freeze_error"] = str(e)
        except Exception as e:  # torch itself refused the capture (reported, not hidden)
            if case == "missing":
                raise
            result["freeze_error"] = None
            result["capture_error"] = f"{type(e).__name__}: {e}"
        del y
        return result
    with vt.region_allocations(region):
        if case == "samename":
            import samename_cases

            cases = samename_cases.cases(torch, result["skipped"])
        else:
            cases = (_dim_cases(torch, result["skipped"], base) if case == "dims"
                     else _cases(torch, result["skipped"]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), vt.region_allocations(region):
        for _, fn in cases:
            for _ in range(3):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    caps = {}
    for name, fn in cases:
        t0 = time.perf_counter()
        with vt.activated(region), store.capture(name, pool=pool.id) as cap:
            o = fn()
        result["capture_seconds"][name] = time.perf_counter() - t0
        caps[name] = (cap, o)
        result["info"][name] = cap.info
    torch.cuda.synchronize()
    # Which binary each kernel node was resolved to, and how the recorder bound them.
    result["kernels"] = {name: [[n["name"], n["module"]] for n in tg.describe(store.data(name))
                                ["nodes"] if n["kind"] == "kernel"] for name in caps}
    result["recorder"] = tg.recorder_info()
    from vitrify.region import save_allocations

    result["image_bytes"] = save_allocations(region, out)  # inputs and weights, before any replay
    for name, (cap, o) in caps.items():
        cap.graph.replay()
    torch.cuda.synchronize()
    expected = out / "expected"
    expected.mkdir(parents=True, exist_ok=True)
    for name, (cap, o) in caps.items():
        if not o.is_contiguous() or not region.contains(o.data_ptr()):
            raise RuntimeError(f"output of {name} is not a contiguous tensor in the region")
        off, n = o.data_ptr() - region.base, o.numel() * o.element_size()
        (expected / f"{name}.bin").write_bytes(region.read(o.data_ptr(), n))
        result["outputs"][name] = {"offset": off, "nbytes": n}
    t0 = time.perf_counter()
    from vitrify import archive as ar

    fp = ar.Fingerprint.current(engine="graph_worker", engine_version="1", model=case)
    with ar.ArchiveWriter(out / "archive", fp, ar.Region(base=region.base, size=region.size,
                                                         granularity=region.granularity),
                          overwrite=True) as w:
        result["index"] = store.save_to_archive(w, rank=0)
    result["save_seconds"] = time.perf_counter() - t0
    (out / "freeze.json").write_text(json.dumps(result))
    return result


def thaw(case: str, out: Path, base: int, only: str | None = None) -> dict:
    import vitrify.graph as tg

    meta = json.loads((out / "freeze.json").read_text())
    if only is not None:  # one graph alone (a fault in one graph cannot hide the others)
        meta["outputs"] = {only: meta["outputs"][only]}
    t0 = time.perf_counter()
    from vitrify.region import Region, load_allocations

    region = Region(meta["size"], base=base)
    load_allocations(region, out)
    t1 = time.perf_counter()
    from vitrify import archive as ar

    # The archive must match this machine (GPU, driver, CUDA, torch) and be intact.
    archive = ar.open_archive(out / "archive", expect=ar.Fingerprint.current(
        engine="graph_worker", engine_version="1", model=case))
    # Graphs FREEZE marked non-relocatable are refused at another base: left out and reported
    # (the callers assert which), never run.
    graphs = tg.load_from_archive(archive, 0, region_base=region.base,
                                  names=None if only is None else [only], unrelocatable="skip")
    graphs.wait_all()
    for name in graphs.skipped:
        meta["outputs"].pop(name, None)
    t2 = time.perf_counter()
    equal, first_diff = {}, {}
    for name, o in meta["outputs"].items():
        graphs.replay(name, stream=0)
        graphs.synchronize()
        got = region.read(region.base + o["offset"], o["nbytes"])
        want = (out / "expected" / f"{name}.bin").read_bytes()
        equal[name] = got == want
        if got != want:
            first_diff[name] = next(i for i in range(len(got)) if got[i] != want[i])
    # Replay every graph again, back to back without synchronising, then check once more.
    for name in meta["outputs"]:
        graphs.replay(name, stream=0)
    graphs.synchronize()
    again = {name: region.read(region.base + o["offset"], o["nbytes"]) ==
             (out / "expected" / f"{name}.bin").read_bytes()
             for name, o in meta["outputs"].items()}
    return {"equal": equal, "equal_after_back_to_back": again, "first_diff": first_diff,
            "templates": {n: graphs.template_of(n) for n in graphs.names},
            "stats": graphs.stats(), "restore_seconds": t1 - t0, "rebuild_seconds": t2 - t1,
            "skipped": meta["skipped"], "info": meta["info"], "freeze_base": meta["base"],
            "base": region.base, "refused": graphs.skipped}


def main() -> int:
    mode, case, out, base = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4], 0)
    out.mkdir(parents=True, exist_ok=True)
    only = sys.argv[5] if len(sys.argv) > 5 else None
    return report(lambda: freeze(case, out, base) if mode == "freeze"
                  else thaw(case, out, base, only))

if __name__ == "__main__":
    sys.exit(main())
