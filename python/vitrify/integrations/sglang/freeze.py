"""FREEZE/THAW inside SGLang's scheduler process: the SAVE/LOAD hook bodies and the session
adapter (PLUGIN.md, "FREEZE/THAW inside the scheduler").

Owns: :class:`Engine` (the session's adapter for an SGLang server, engine-driven:
``docs/session.md`` P12) and the hooks SGLang calls, nothing else — the argument rules are
``server_args.py``'s, the graph backend ``graphs.py``'s, the attention check
``attention.py``'s, the collector, registry, standby, read-ahead, JIT caches and warm-up
``startup.py``'s, the run ``state.py``'s, SAVE's shape sweep ``sweep.py``'s.

====================================================  ============================================
hook (AROUND unless said)                              session
====================================================  ============================================
``bootstrap.init_parallel_runtime`` (0.5.23, LOAD      a standby's wait (:func:`before_gpu`), before
in standby)                                            the scheduler sets its device
``Scheduler.init_model_worker``                        ``start()``; the whole call routed into the
                                                       region; LOAD: ``finish()`` at its end
``ModelRunner.load_model``                             ``reached("built")``, ``reached("weights")``
``KVCacheConfigurator._resolve_memory_pool_config``    SAVE records the pool config, LOAD returns it
``ModelRunner.alloc_memory_pool``                      ``reached("state")``
``cuda_graph_setup.capture_decode_graph``              ``reached("warmup")`` before,
                                                       ``reached("captured")`` after
``runner_backend.utils.resolve_decode_backend``        SGLang's full-graph backend wrapped
                                                       (``graphs.graph_backend_class``)
``decode_cuda_graph_runner.freeze_gc``                 the capture's collections without SGLang's
                                                       final unfreeze (:func:`around_freeze_gc`)
``Scheduler.handle_generate_request`` (AFTER)          SAVE counts the generate requests (health
                                                       checks and the shape sweep's not counted)
                                                       and sees the sweep's end (``sweep.py``)
``Scheduler.on_idle`` (AFTER)                          SAVE: ``finish()`` at the first idle moment
                                                       after ``save_after_requests`` requests and
                                                       the shape sweep's end; both
                                                       modes: JIT compiles after the archive's
                                                       caches were packed are logged
``http_server._wait_and_warmup`` (launcher)           SAVE: the shape sweep (``sweep.run``); LOAD:
                                                       the warm-up requests (``startup.warm_up``)
====================================================  ============================================

Imports only the standard library at import time.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from . import attention, graphs, startup, state, sweep, versions
from . import server_args as rules

log = logging.getLogger("vitrify.sglang")

ENGINE = "sglang"
MAX_LENGTHS = 256  # SAVE records at most this many prompt lengths


class Engine:
    """The session's adapter for an SGLang server (engine-driven: SGLang runs its own phases, so
    only the fingerprint is needed). ``model`` carries the model path and a digest of every
    engine-shaping server argument (P8), so an archive of other arguments is refused; the
    engine version names SGLang's release, so an archive of another release is refused naming
    both."""

    def __init__(self, args_fingerprint: dict, sglang_version: str):
        self.args_fingerprint = dict(args_fingerprint)
        self.sglang_version = sglang_version

    def fingerprint(self) -> dict:
        import vitrify

        digest = hashlib.sha256(json.dumps(self.args_fingerprint, sort_keys=True,
                                           default=str).encode()).hexdigest()[:16]
        model = str(self.args_fingerprint.get("model_path") or "unknown-model")
        return {"engine": ENGINE,
                "engine_version": f"sglang-{self.sglang_version}/vitrify-{vitrify.__version__}",
                "model": f"{model}#args-{digest}"}


def expected_fingerprint(engine: Engine, device: int) -> Any:
    """What an archive for ``engine`` on GPU ``device`` must match (``archive.Fingerprint``)."""
    from ... import archive as _archive

    return _archive.Fingerprint.current(device=device, **engine.fingerprint())


def exportable_here(device: int) -> str | None:
    """None when ``device`` and the driver can create an exportable region (a range reserved
    and freed: no memory is created), else why not, in one line."""
    from ... import region as _region

    try:
        _region.Region(2 << 20, device=device, exportable=True).close()
    except (RuntimeError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def own_errors() -> tuple[type, ...]:
    """The exceptions vitrify's own FREEZE/THAW steps raise inside SGLang's start-up (a
    damaged span file met by the restore, a graph that cannot be frozen or rebuilt, a region
    window or address the driver refused, a JIT cache, a CUDA call of vitrify's): each stops the
    scheduler with the plugin's one-line fatal, not a traceback through SGLang's code. SGLang's
    own exceptions pass through untouched."""
    from ... import _native, graph, jit, region, snapshot

    return (snapshot.SpanFileError, graph.GraphFreezeError, graph.GraphNotRelocatable,
            region.WindowDrift, region.RegionAddressError, jit.JitCacheError,
            _native.CudaError, _native.CudaUnavailableError)


def scheduler_gpu(scheduler: Any) -> int:
    """The GPU of this scheduler process, where the release keeps it (``GPU_WHERE``)."""
    ver = versions.current()
    gpu = ver.scheduler_gpu(scheduler)
    if gpu is None:
        raise state.FreezeRefused(f"cannot tell this scheduler's GPU (no {ver.GPU_WHERE}): "
                                  f"this is not the SGLang {ver.VERSION} the plugin was written "
                                  f"for")
    return int(gpu)


def before_gpu(server_args: Any, device: int) -> state.Before:
    """The scheduler's start before it touches the GPU, once: its arguments (refused, checked
    or re-applied: ``server_args.at_scheduler``), what it runs checked (P17), and at LOAD in
    standby (P15) the archive opened and compared, the full collection, Triton's key, the read
    of the weights span and the wait for the go. A mismatch with ``on_mismatch = "cold-start"``
    marks the start cold (the registry widened, the go waited for too)."""
    from ... import archive as _archive

    if state.STATE.before is not None:
        return state.STATE.before
    cfg = state.STATE.config
    ver = versions.current()
    try:
        fp = rules.at_scheduler(server_args, cfg.mode, ver)
        rules.check_supported(server_args, ver, ver.scheduler_reader(server_args))
    except state.FreezeRefused as e:
        raise state.fatal(f"mode {cfg.mode!r}: {e}") from None
    before = state.Before(fp, device)
    if cfg.mode == "load" and cfg.standby_file:
        engine = Engine(fp, state.STATE.sglang_version or ver.VERSION)
        try:
            # an archive that cannot thaw here is refused before the wait, not after
            archive = state.archive(cfg.archive)
            archive.check_fingerprint(expected_fingerprint(engine, device))
            # what can be done before the go is done before it: the full collection, Triton's
            # cache key, the spans the thaw restores read into the page cache (until the go)
            startup.freeze_import_heap(collect=True)
            startup.warm_triton_key(background=False)
            reading = startup.SpanPrefetch(archive)
            try:
                startup.wait_for_file(cfg.standby_file, since=startup.standby_since())
            finally:
                reading.finish()
        except _archive.ArchiveMismatch as e:
            if cfg.on_mismatch != "cold-start":
                raise state.fatal(f"the archive does not match this server: {e} (on_mismatch = "
                                  f"\"cold-start\" starts it cold instead)") from None
            _start_cold(cfg, e)
            before.cold = True
        except (_archive.ArchiveError, OSError) as e:
            raise state.fatal(f"mode {cfg.mode!r}: opening the session failed: "
                              f"{type(e).__name__}: {e}") from None
        before.standby_done = True
    state.STATE.before = before
    return before


def _start_cold(cfg: Any, why: BaseException) -> None:
    log.warning("vitrify: the archive does not match this server (%s); starting cold "
                "(on_mismatch = \"cold-start\")", why)
    startup.widen_model_registry()  # the registry must know whatever model this server names
    if cfg.standby_file and not os.path.lexists(cfg.standby_file):  # cold needs the GPU too
        startup.wait_for_file(cfg.standby_file, since=startup.standby_since())


def around_init_parallel_runtime(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """SGLang 0.5.23 sets a scheduler's device and builds its process groups here, before
    ``init_model_worker``: a standby waits before it (:func:`before_gpu`), not after."""
    cfg = state.STATE.config
    if cfg is not None and cfg.active and "server_args" in kwargs:
        try:
            before_gpu(kwargs["server_args"], scheduler_gpu(None))
        except state.FreezeRefused as e:
            raise state.fatal(f"mode {cfg.mode!r}: {e}") from None
    return original(*args, **kwargs)


def around_init_model_worker(original: Callable, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Open the session, route the whole start-up into its region, and at LOAD finish it."""
    cfg = state.STATE.config
    if cfg is None or not cfg.active:
        return original(scheduler, *args, **kwargs)
    from ... import archive as _archive
    from ... import session as _session
    from .. import torch as vt

    try:
        before = before_gpu(scheduler.server_args, scheduler_gpu(scheduler))
    except state.FreezeRefused as e:
        raise state.fatal(f"mode {cfg.mode!r}: {e}") from None
    if before.cold:
        return original(scheduler, *args, **kwargs)
    device = before.device
    engine = Engine(before.fingerprint, state.STATE.sglang_version or
                    versions.current().VERSION)

    def new_session() -> Any:
        """The session of this mode (inside the error handling below: opening the archive
        LOAD shares with the rest of this process can fail, or mismatch)."""
        if cfg.mode == "save":
            # LOAD re-runs warmup and maps the graphs span without restoring it (below), so SAVE
            # writes neither span: the archive holds the weights span
            return _session.FreezeSession(engine, cfg.archive, region_bytes=cfg.region_bytes,
                                          device=device, dump_warmup=False, dump_graph_span=False)
        # warmup re-runs (SGLang's warm-up also builds its objects); the graphs span is mapped,
        # not restored: the capture windows are scratch every replay writes before it reads,
        # and the rest of that range holds SGLang's own buffers, which LOAD's start-up has just
        # built (SAVE's span is dumped after serving: its contents are not start-up state)
        # with weight updates on, the region's memory is created exportable: a trainer then
        # writes the thawed weights in place (a direct update, no staging buffer); a GPU or
        # driver that cannot export it gets staged updates
        exportable = cfg.weight_updates
        if exportable and (why := exportable_here(device)) is not None:
            log.warning("vitrify: this GPU cannot export the thawed weights (%s): weight "
                        "updates go through the trainer's staging buffer", why)
            exportable = False
        # the archive this process opened already (a standby's check, the JIT unpack)
        return _session.ThawSession(engine, state.archive(cfg.archive), device=device,
                                    warmup_restore=False, restore_graph_span=False,
                                    direct_io=startup.read_ahead_direct_io(cfg.archive),
                                    exportable=exportable)

    try:
        sess = new_session()
        if not before.standby_done:
            startup.freeze_import_heap(collect=False)
            startup.warm_triton_key(background=True)  # hashes Triton's library meanwhile
        region = sess.start()
    except _archive.ArchiveMismatch as e:
        if cfg.on_mismatch == "cold-start":
            _start_cold(cfg, e)
            return original(scheduler, *args, **kwargs)
        raise state.fatal(f"the archive does not match this server: {e} (on_mismatch = "
                          f"\"cold-start\" starts it cold instead)") from None
    except (_archive.ArchiveError, _session.SessionError, OSError, MemoryError,
            RuntimeError, ValueError) as e:
        raise state.fatal(f"mode {cfg.mode!r}: opening the session failed: {type(e).__name__}: "
                          f"{e}") from None
    state.STATE.run = run = state.Run(cfg.mode, sess, region, device)
    try:
        if cfg.mode == "load":
            run.load_engine_state(sess.frozen_state)
        with vt.region_allocations(region), startup.profiled(f"init_model_worker-{cfg.mode}"):
            result = original(scheduler, *args, **kwargs)
        if "captured" not in region.checkpoints:
            raise state.FreezeRefused("the scheduler's start-up ended before its decode graphs "
                                      "were set up (the capture hook never ran)")
        if cfg.mode == "load":
            _, run.loaded = sess.finish()
            run.summary = sess.summary
            run.jit_checked = time.monotonic()
            log.info("vitrify: thawed %s in %.2f s (%d graphs)", cfg.archive,
                     sess.summary["timings"].get("total", 0.0), sess.summary["graphs"])
        else:
            run.pending_finish = True
            run.sweep_pending = sweep.expected(getattr(scheduler, "server_args", None))
        return result
    except BaseException as e:
        sess.abort()
        state.STATE.run = None
        if isinstance(e, (state.FreezeRefused, _archive.ArchiveError, _session.SessionError)):
            raise state.fatal(f"mode {cfg.mode!r}: {e}") from None
        if isinstance(e, own_errors()):  # a damaged span file, a graph or region refused, ...
            raise state.fatal(f"mode {cfg.mode!r}: {type(e).__name__}: {e}"
                              + (f" (vitrify verify {cfg.archive} checks every file of the "
                                 f"archive)" if cfg.mode == "load" else "")) from None
        raise


def _active_run(runner: Any = None) -> state.Run | None:
    run = state.STATE.run
    if run is None or run.pending_finish or run.summary is not None:
        return None
    if runner is not None and getattr(runner, "is_draft_worker", False):
        return None
    return run


def around_load_model(original: Callable, runner: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(runner, *args, **kwargs)
    run = _active_run(runner)
    if run is not None:
        if run.mode == "save":
            run.model_modules = startup.model_modules(getattr(runner, "model", None))
        run.session.reached("built")  # LOAD: the weights span is restored here
        run.session.reached("weights")
    return result


def around_resolve_memory_pool_config(original: Callable, configurator: Any, *args: Any,
                                      **kwargs: Any) -> Any:
    run = _active_run()
    if run is None:
        return original(configurator, *args, **kwargs)
    if run.mode == "save":
        config = original(configurator, *args, **kwargs)
        run.pool_config = graphs.pool_config_state(config)
        return config
    if run.pool_config is None:
        raise state.fatal("the archive holds no KV pool config")
    config = graphs.pool_config_from_state(graphs.pool_config_class(), run.pool_config)
    # SGLang's profiling runs as at SAVE for its side effects (it empties torch's cache, which
    # decides where later tensors go); its answer is replaced by SAVE's
    try:
        profiled = original(configurator, *args, **kwargs)
        here = getattr(profiled, "max_total_num_tokens", None)
    except Exception as e:  # e.g. less free memory here: SAVE's size is what counts
        here = f"not computed ({type(e).__name__}: {e})"
    log.info("vitrify: KV pool sized as at SAVE (%d tokens; this GPU's profile gives %s)",
             config.max_total_num_tokens, here)
    return config


def around_alloc_memory_pool(original: Callable, runner: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(runner, *args, **kwargs)
    run = _active_run(runner)
    if run is not None:
        run.session.reached("state")
    return result


def around_capture_decode_graph(original: Callable, *args: Any, **kwargs: Any) -> Any:
    runner = kwargs.get("model_runner")
    run = _active_run(runner)
    if run is None:
        return original(*args, **kwargs)
    try:
        kinds = attention.check_attention(getattr(runner, "attn_backend", None))
    except state.FreezeRefused as e:
        raise state.fatal(f"mode {run.mode!r}: {e}") from None
    if "flashinfer" in kinds and run.mode == "save":
        log.warning("vitrify: freezing FlashInfer decode graphs: SGLang plans them at LOAD as at "
                    "SAVE, the way triton's are frozen; checked on CPU against SGLang's source, "
                    "not yet run on a GPU under vitrify")
    run.session.reached("warmup")
    # Python's collector frees routed tensors held in cycles at moments that depend on how much
    # Python ran; SAVE (capturing) runs more than LOAD, so it is off for the loop on both sides
    # and runs at the same points (each shape's start, in capture_one) instead.
    was = gc.isenabled()
    gc.disable()
    t0 = time.perf_counter()
    try:
        result = original(*args, **kwargs)
    finally:
        if was:
            gc.enable()
    run.timings["total_s"] = time.perf_counter() - t0
    try:
        blocks = graphs.routed_blocks(run.region)
        if run.mode == "save":
            run.routed = blocks
        else:
            graphs.check_blocks(run.routed, blocks)
    except state.FreezeRefused as e:
        raise state.fatal(str(e)) from None
    run.session.reached("captured")  # LOAD: graph pools restored, graphs waited for
    tm = run.timings
    log.info("vitrify: decode graphs, %d shapes: warm-up forwards %.2f s, gc %.2f s, %s %.2f s "
             "(SGLang's whole capture step %.2f s)", tm.get("shapes", 0),
             tm.get("warmup_forwards_s", 0.0), tm.get("gc_s", 0.0),
             "capture" if run.mode == "save" else "claim",
             tm.get("capture_s" if run.mode == "save" else "claim_s", 0.0), tm["total_s"])
    return result


def around_resolve_decode_backend(original: Callable, cuda_graph_runner: Any, *args: Any,
                                  **kwargs: Any) -> Any:
    backend = original(cuda_graph_runner, *args, **kwargs)
    run = _active_run(getattr(cuda_graph_runner, "model_runner", None))
    if run is None:
        return backend
    if type(backend) is not graphs.full_graph_backend():
        raise state.fatal(f"the decode graph backend is {type(backend).__name__}; only SGLang's "
                          f"FullCudaGraphBackend (--cuda-graph-backend-decode full) is frozen "
                          f"yet")
    return graphs.graph_backend_class()(cuda_graph_runner, enable_memory_saver=False)


def around_freeze_gc(original: Callable, enable_cudagraph_gc: bool, *args: Any,
                     **kwargs: Any) -> Any:
    """AROUND ``decode_cuda_graph_runner.freeze_gc`` (the name its ``capture`` looks up;
    SGLang's registry rebinds the other modules that imported the function too): in a freezing
    or thawing scheduler, ``startup.capture_collections`` instead (both modes, so the
    collections free the same objects at the same points); elsewhere SGLang's own."""
    if state.STATE.run is None:
        return original(enable_cudagraph_gc, *args, **kwargs)
    return startup.capture_collections(enable_cudagraph_gc)


def after_handle_generate_request(result: Any, scheduler: Any, recv_req: Any = None,
                                  *args: Any, **kwargs: Any) -> Any:
    """SAVE: count the generate requests before the archive is written (health checks not)."""
    run = state.STATE.run
    if run is not None and run.mode == "save" and run.summary is None:
        rid = getattr(recv_req, "rid", None)
        if isinstance(rid, str) and rid.startswith(sweep.RID_PREFIX):  # the plugin's own
            if rid.startswith(sweep.END_RID_PREFIX):
                run.sweep_pending = False
            return result
        if not (isinstance(rid, str) and rid.startswith(versions.current().HEALTH_CHECK_PREFIX)):
            run.requests += 1
            ids = getattr(recv_req, "input_ids", None)
            if ids is not None and len(run.request_lengths) < MAX_LENGTHS:
                run.request_lengths.append(len(ids))
    return result


def after_on_idle(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """SAVE: at the first idle moment after ``save_after_requests`` generate requests (SGLang's
    own warm-up request is the first), write and commit the archive with the JIT caches. Both
    modes, afterwards: report JIT compiles the archive's caches miss (``startup.jit_watch``)."""
    run = state.STATE.run
    if run is None:
        return result
    if not run.pending_finish:
        if run.summary is not None and "error" not in run.summary:
            startup.jit_watch(run)
        return result
    if run.requests < state.STATE.config.save_after_requests or run.sweep_pending or \
            getattr(scheduler, "forward_ct", 0) <= 0:
        return result
    idle = getattr(scheduler, "is_fully_idle", None)
    if idle is not None and not idle():
        return result  # requests still queued or running: the next idle loop
    dirs = state.STATE.jit_dirs or {}
    run.pending_finish = False

    def jit_files(writer: Any) -> None:
        if dirs:
            from ... import jit

            run.jit_index, run.jit_dirs = jit.pack(writer, dirs), dict(dirs)

    try:
        run.summary = run.session.finish(run.engine_state(), write_extra=jit_files)
    except Exception as e:
        # the engine is built and serving from the region: it keeps serving, without an archive
        log.error("vitrify: SAVE failed, no archive was written (%s: %s); the server keeps "
                  "serving", type(e).__name__, e)
        run.summary = {"error": f"{type(e).__name__}: {e}"}
        return result
    run.jit_checked = time.monotonic()
    log.info("vitrify: SAVE complete: %s (%d graphs, region %d bytes, %.1f s to write, after "
             "%d request(s))", run.summary["archive"], run.summary["graphs"],
             run.summary["checkpoints"]["captured"],
             sum(v for k, v in run.summary["timings"].items() if k in ("dump_spans",
                                                                      "save_graphs", "commit")),
             run.requests)
    return result


def around_wait_and_warmup(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """LOAD, launcher: SGLang's ``_wait_and_warmup`` runs its warm-up through a function bound as
    a default argument (a hook on that function's module attribute never runs), so the call's
    warm-up function is wrapped here: it runs, then ``startup.warm_up``."""
    import inspect

    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)  # not the signature this hook knows: SGLang's own
    bound.apply_defaults()
    inner = bound.arguments.get("execute_warmup_func")
    if not callable(inner):
        return original(*args, **kwargs)

    def execute_warmup(server_args: Any, *a: Any, **k: Any) -> Any:
        cfg = state.STATE.config
        if cfg is not None and cfg.mode == "save":  # the shape sweep, then the archive (P19)
            return sweep.run(inner(server_args, *a, **k), server_args)
        return startup.warm_up(inner(server_args, *a, **k), server_args)

    bound.arguments["execute_warmup_func"] = execute_warmup
    return original(*bound.args, **bound.kwargs)


__all__ = ["ENGINE", "Engine", "MAX_LENGTHS", "after_handle_generate_request", "after_on_idle",
           "around_alloc_memory_pool", "around_capture_decode_graph", "around_freeze_gc",
           "around_init_model_worker", "around_init_parallel_runtime", "around_load_model",
           "around_resolve_decode_backend", "around_resolve_memory_pool_config",
           "around_wait_and_warmup", "before_gpu", "expected_fingerprint",
           "exportable_here", "own_errors", "scheduler_gpu"]
