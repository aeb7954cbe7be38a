"""Subprocess worker for tests/python/test_sglang_freeze.py (and sglang_release_cases.py, under
each SGLang release): the scheduler-side hooks of the SGLang plugin (freeze.py) driven the way
SGLang's ``Scheduler.init_model_worker`` calls them, on any driver (the fake one on CPU),
without torch allocations or graph capture.

    python sglang_freeze_worker.py save|load TMPDIR [options as JSON]

The stand-in start-up: ``load_model`` allocates 3 "weight" blocks and fills them with bytes
seeded per process (so LOAD's own bytes differ from SAVE's until the weights span is
restored), ``_resolve_memory_pool_config`` "profiles" and returns a MemoryPoolConfig,
``alloc_memory_pool`` allocates a KV block of its size, ``capture_decode_graph`` allocates a
workspace (decode graphs off: nothing captured). Option ``drift``: LOAD's ``load_model``
allocates one block more. The last stdout line is JSON.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import sys
import time
import types

from worker_result import report

MiB = 1 << 20


def main() -> int:
    mode, tmp = sys.argv[1], sys.argv[2]
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}

    def run() -> dict:
        import vitrify.graph
        import vitrify.integrations.torch as vt
        from vitrify.integrations.sglang import freeze, graphs, startup, state, versions
        from vitrify.integrations.sglang import server_args as rules
        from vitrify.integrations.sglang.config import PluginConfig

        # what needs a GPU is replaced: CUPTI, torch routing, SGLang's argument handling
        vitrify.graph.record_modules = lambda *a, **k: None
        vt.region_allocations = lambda region: contextlib.nullcontext(region)
        rules.at_scheduler = lambda args, mode, ver=None: {"model_path": "/m/tiny",
                                                           "page_size": 64}
        # the routed pool's block map needs torch on a GPU: the stand-in's is the cursor
        graphs.routed_blocks = lambda region: [[0, region.offset, 1]]
        # every open of an archive in this process, counted (LOAD opens its archive once)
        import vitrify.archive as _arch

        opens, real_open = [], _arch.open_archive
        _arch.open_archive = lambda path, **k: opens.append(str(path)) or real_open(path, **k)
        # where the release keeps the scheduler's GPU (scheduler.ps, or the runtime context a
        # real scheduler publishes first): sglang_release_cases.py checks that on each release
        freeze.scheduler_gpu = lambda scheduler: 0
        archive = os.path.join(tmp, "engine.vitrify")
        cfg = PluginConfig(mode=mode, archive=archive, region_bytes=256 * MiB,
                           jit_dir=os.path.join(tmp, "jit-work") if mode == "save" else
                           os.path.join(tmp, "xdg", "vitrify", "jit", "x"),
                           save_after_requests=2,
                           standby_file=os.path.join(tmp, "go") if opts.get("standby") else None)
        state.STATE.config = cfg
        ver = versions.current()
        state.STATE.jit_dirs = startup.setup_jit(cfg)
        if mode == "save":  # a kernel the engine compiled
            os.makedirs(os.path.join(state.STATE.jit_dirs["triton"], "AB"))
            with open(os.path.join(state.STATE.jit_dirs["triton"], "AB", "k.cubin"), "wb") as f:
                f.write(b"cubin")
        from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

        out: dict = {"profiled": False}
        # the model's class, exported by a module of SGLang's model package (model_modules)
        model_module = types.ModuleType("sglang.srt.models.vitrify_test_model")
        model_module.EntryClass = type("TinyForCausalLM", (), {})
        sys.modules[model_module.__name__] = model_module
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        runner = types.SimpleNamespace(is_draft_worker=False, model=model_module.EntryClass(),
                                       attn_backend=object.__new__(TritonAttnBackend))
        weights: list[tuple[int, int]] = []

        def load_model(r):
            region = state.STATE.run.region
            for i in range(3):
                p = region.allocate(3 * MiB)
                region.write(p, hashlib.sha256(f"{os.getpid()}-{i}".encode()).digest() * 1000)
                weights.append((p, 32000))
            if opts.get("drift") and mode == "load":
                region.allocate(2 * MiB)

        def resolve(configurator, pre_model_load_memory):
            out["profiled"] = True  # LOAD's own profile differs: SAVE's must win
            return MemoryPoolConfig(max_total_num_tokens=4096 if mode == "save" else 2048,
                                    max_running_requests=8, mem_fraction_static=0.5)

        def alloc_memory_pool(r):
            pool = freeze.around_resolve_memory_pool_config(resolve, object(), 123)
            out["pool_config"] = [pool.max_total_num_tokens, pool.max_running_requests]
            state.STATE.run.region.allocate(pool.max_total_num_tokens * 1024)

        def capture_decode_graph(*, model_runner):
            # SGLang's capture enters the name its module binds, which the plugin hooks
            from sglang.srt.model_executor.runner.base_cuda_graph_runner import freeze_gc

            with freeze.around_freeze_gc(freeze_gc, False):
                state.STATE.run.region.allocate(2 * MiB)
            out["frozen_after_capture"] = gc.get_freeze_count()

        def init_model_worker(sched):
            freeze.around_load_model(load_model, runner)
            freeze.around_alloc_memory_pool(alloc_memory_pool, runner)
            freeze.around_capture_decode_graph(capture_decode_graph, model_runner=runner)

        # every field the rules read unset, but the attention backend (P17's check runs)
        sargs = {name: None for name in rules.fields_read(ver)}
        sched = types.SimpleNamespace(
            server_args=types.SimpleNamespace(**{**sargs, "attention_backend": "triton",
                                                 "skip_server_warmup": False}),
            ps=types.SimpleNamespace(gpu_id=0), forward_ct=0, is_fully_idle=lambda: True)
        if opts.get("standby"):  # the operator's go, 0.3 s after the scheduler starts waiting
            import threading

            threading.Timer(0.3, lambda: open(cfg.standby_file, "w").close()).start()
        out["frozen_before_init"] = gc.get_freeze_count()
        t0 = time.monotonic()
        try:
            freeze.around_init_model_worker(init_model_worker, sched)
            out["init_s"] = time.monotonic() - t0
        except SystemExit as e:
            return {"fatal": str(e), "run_cleared": state.STATE.run is None}
        run = state.STATE.run
        region = run.region
        out["weights"] = hashlib.sha256(b"".join(region.read(p, n) for p, n in weights)).hexdigest()
        if mode == "save":
            out["archive_after_init"] = os.path.exists(archive)
            freeze.after_on_idle(None, sched)  # idle, but no request yet
            out["idle_before_request_wrote"] = os.path.exists(archive)
            health = types.SimpleNamespace(rid="HEALTH_CHECK_0f")
            request = types.SimpleNamespace(rid="r1", input_ids=[1, 2, 3])
            swept = types.SimpleNamespace(rid="vitrify-sweep-ab-0-0", input_ids=[1] * 99)
            end = types.SimpleNamespace(rid="vitrify-sweep-end-ab", input_ids=[10])
            out["sweep_pending_at_capture"] = run.sweep_pending
            freeze.after_handle_generate_request(None, sched, health)  # not counted
            freeze.after_handle_generate_request(None, sched, swept)  # the plugin's own: neither
            freeze.after_handle_generate_request(None, sched, request)
            sched.forward_ct = 1
            freeze.after_on_idle(None, sched)
            out["idle_after_one_request_wrote"] = os.path.exists(archive)
            freeze.after_handle_generate_request(None, sched, request)
            freeze.after_on_idle(None, sched)  # enough requests, the launcher's sweep not over
            out["idle_before_the_sweep_end_wrote"] = os.path.exists(archive)
            freeze.after_handle_generate_request(None, sched, end)
            freeze.after_on_idle(None, sched)
            out["requests"] = run.requests
            out["model_modules"] = run.model_modules
            out["request_lengths"] = run.request_lengths
            out["summary"] = {k: run.summary[k] for k in ("graphs", "checkpoints")}
            from vitrify import archive as _archive

            a = _archive.open_archive(archive, checksums=True)
            out["span_files"] = sorted(rel for rel in a.files if rel.endswith(".span"))
            out["jit_files"] = sorted(rel[len("jit/"):] for rel in a.files
                                      if rel.startswith("jit/") and rel != "jit/index.json")
        else:
            out["checkpoints"] = region.checkpoints
            out["archive_opens"] = opens
            out["triton_cache"] = os.environ.get("TRITON_CACHE_DIR", "")
        return out

    return report(run)


if __name__ == "__main__":
    sys.exit(main())
