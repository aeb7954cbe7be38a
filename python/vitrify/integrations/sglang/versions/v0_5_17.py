"""SGLang 0.5.17: everything the plugin knows of this release's internals (PLUGIN.md, "One seam
per SGLang version"; read in the 0.5.17 wheel, research note ``/work/notes/sglang-0.5.23.md``
section 1).

Owns: the hook targets (:data:`HOOK_TARGETS`), the process roles (:func:`process_role`), how
``ServerArgs`` is read (materialised fields after ``__post_init__``: :func:`reader`) and changed
(``ServerArgs.override``: :func:`declare`), where the argument rules hook in (an AFTER hook on
``ServerArgs.__post_init__``: :func:`argument_hooks`), the field lists, the scheduler's GPU
(``scheduler.ps.gpu_id``), the tensor-parallel size, the names of SGLang's attention classes,
its graph backend, pool config, model package and health-check prefix, the launcher's warm-up
objects, the argument parser's ``--config`` merger and the log lines a harness parses.

Imports only the standard library at import time; SGLang inside the functions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from . import process_role_from

VERSION = "0.5.17"

REGISTRY = "sglang.srt.plugins.hook_registry.HookRegistry"
HOOK_TYPE = "sglang.srt.plugins.hook_registry.HookType"
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
_MR = "sglang.srt.model_executor.model_runner.ModelRunner"

# logical name -> the dotted target SGLang's HookRegistry patches (module path, one attribute)
HOOK_TARGETS = {
    "server_args_post_init": f"{SERVER_ARGS}.__post_init__",
    "update_weights_from_tensor": "sglang.srt.model_executor.model_runner_components."
                                  "weight_updater.WeightUpdater.update_weights_from_tensor",
    "add_request_to_queue": f"{SCHEDULER_MODULE}.Scheduler._add_request_to_queue",
    "init_model_worker": f"{SCHEDULER_MODULE}.Scheduler.init_model_worker",
    "load_model": f"{_MR}.load_model",
    "resolve_memory_pool_config": "sglang.srt.mem_cache.kv_cache_configurator."
                                  "KVCacheConfigurator._resolve_memory_pool_config",
    "alloc_memory_pool": f"{_MR}.alloc_memory_pool",
    "capture_decode_graph": "sglang.srt.model_executor.model_runner_components.cuda_graph_setup."
                            "capture_decode_graph",
    "resolve_decode_backend": "sglang.srt.model_executor.runner_backend.utils."
                              "resolve_decode_backend",
    "freeze_gc": "sglang.srt.model_executor.runner.decode_cuda_graph_runner.freeze_gc",
    "handle_generate_request": f"{SCHEDULER_MODULE}.Scheduler.handle_generate_request",
    "on_idle": f"{SCHEDULER_MODULE}.Scheduler.on_idle",
    "wait_and_warmup": "sglang.srt.entrypoints.http_server._wait_and_warmup",
}
# Resolved at registration besides the hook targets (what the argument rules call).
REQUIRED = (f"{SERVER_ARGS}.override",)
# Where a standby scheduler waits: before this call nothing of the engine touches the GPU
# (0.5.17 sets the device and builds the process groups inside ModelRunner.__init__).
STANDBY_TARGET = "init_model_worker"
# A scheduler re-applies the argument rules to its pickled record (override is allowed there,
# and Engine(server_args=...) built before load_plugins() never passed the hook).
SCHEDULER_REAPPLIES = True

# ServerArgs fields the plugin's rules name that this release lacks (none) or adds.
ABSENT_FIELDS: tuple[str, ...] = ()
EXTRA_REFUSED: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = ()
REFUSED_ENV: dict[str, str] = {}  # environment switches refused (none in this release)
# the resolution steps the argument rules wrap (0.5.17 has no resolution pipeline)
RESOLUTION_STEPS: tuple[tuple[str, str | None, str | None], ...] = ()

# the targets of the processes SGLang starts (module.qualname -> role); only schedulers load
# plugins in 0.5.17 besides the launcher
ROLE_TARGETS = {
    f"{SCHEDULER_MODULE}.run_scheduler_process": "scheduler",
    "sglang.srt.managers.detokenizer_manager.run_detokenizer_process": "detokenizer",
    "sglang.srt.managers.data_parallel_controller.run_data_parallel_controller_process":
        "dp_controller",
}

_ATTN = "sglang.srt.layers.attention"
# The attention backend classes whose decode graphs are frozen (exactly these: a subclass such as
# TRT-LLM's over FlashInfer's plans differently and was not read), by the name SGLang uses.
FROZEN_ATTENTION = {f"{_ATTN}.triton_backend.TritonAttnBackend": "triton",
                    f"{_ATTN}.flashinfer_backend.FlashInferAttnBackend": "flashinfer"}
# Backends that only route to others: the attributes holding those others.
ATTENTION_WRAPPERS = {
    f"{_ATTN}.hybrid_attn_backend.HybridAttnBackend": ("prefill_backend", "decode_backend"),
    f"{_ATTN}.hybrid_linear_attn_backend.HybridLinearAttnBackend": ("full_attn_backend",
                                                                   "linear_attn_backend"),
    f"{_ATTN}.tbo_backend.TboAttnBackend": ("primary", "children"),
}
# what the graph runner calls before each capture and replay, and the older pair it no longer
# calls
METADATA_API = "init_forward_metadata_out_graph"
LEGACY_METADATA = ("init_forward_metadata_capture_cuda_graph",
                   "init_forward_metadata_replay_cuda_graph")
FULL_GRAPH_BACKEND = ("sglang.srt.model_executor.runner_backend.full_cuda_graph_backend."
                      "FullCudaGraphBackend")
POOL_CONFIG = "sglang.srt.model_executor.pool_configurator.MemoryPoolConfig"
MODELS_PACKAGE = "sglang.srt.models"
DISABLED_ARCHS_ENV = "SGLANG_DISABLED_MODEL_ARCHS"
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants.HEALTH_CHECK_RID_PREFIX
HTTP_SERVER = "sglang.srt.entrypoints.http_server"
CONFIG_MERGER = "sglang.srt.server_args_config_parser.ConfigArgumentMerger"

# SGLang's log lines a harness reads (the text each line contains)
LOG_LINES = {
    "import_floor": "Init torch distributed begin",
    "load_weight_begin": "Load weight begin",
    "load_weight_end": "Load weight end",
    "kv_cache_allocated": "KV Cache is allocated",
    "capture_begin": "Capture target decode CUDA graph begin",
    "capture_end": "Capture target decode CUDA graph end",
    "ready": "The server is fired up",
}
# command-line flags valid on this release for what a harness asks
CLI_FLAGS = {"decode_max_bs": "--cuda-graph-max-bs-decode",
             "prefill_backend": "--cuda-graph-backend-prefill",
             "decode_backend": "--cuda-graph-backend-decode",
             "deterministic": "--enable-deterministic-inference"}


def process_role() -> str:
    """This process's part: "launcher" (the process that builds and resolves ``ServerArgs``),
    "scheduler", "detokenizer" or "dp_controller", from the function multiprocessing started it
    with (``ROLE_TARGETS``)."""
    return process_role_from(ROLE_TARGETS)


def server_args_fields(cls: type) -> frozenset:
    """The field names of ``ServerArgs`` (a dataclass in 0.5.17)."""
    import dataclasses

    return frozenset(f.name for f in dataclasses.fields(cls))


def reader(args: Any) -> Callable[[str], Any]:
    """The resolved value of a field: 0.5.17 materialises every declaration onto the fields at
    the end of ``__post_init__`` (an ``argparse.Namespace`` of SGLang's parser reads the same
    way, unresolved)."""
    return lambda name: getattr(args, name)


scheduler_reader = reader  # a scheduler's pickled record reads the same way


def _published(args: Any) -> Any:
    """The runtime context ``args`` was published to in this process, or None."""
    from sglang.srt.runtime_context import get_context

    try:
        ctx = get_context()
        return ctx if ctx.server_args is args else None
    except (ValueError, AttributeError):  # nothing published here
        return None


def declare(args: Any, fields: Mapping[str, Any]) -> None:
    """Write fields the way 0.5.17 allows after resolution: ``ServerArgs.override`` (its one
    post-resolution mutation point; bare assignment raises once the declarations are
    materialised), recorded with the source ``"vitrify"``. On a record already published to
    this process (a scheduler's, re-applied there) the runtime context's bags get the same
    values (``RuntimeContext.override``): parts of SGLang read the record, parts the bags.
    Plain objects get setattr."""
    override = getattr(args, "override", None)
    if not callable(override):
        for name, value in fields.items():
            setattr(args, name, value)
        return
    override("vitrify", **dict(fields))
    ctx = _published(args)
    if ctx is not None:
        ctx.override("vitrify", **dict(fields))


def argument_hooks(body: Callable[[str, Any, str], None]) -> tuple[tuple[str, str, Callable], ...]:
    """The HookRegistry hooks that apply the argument rules: ``body("all", server_args, where)``
    after every ``ServerArgs.__post_init__``."""

    def after_server_args_post_init(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
        body("all", self, "the ServerArgs.__post_init__ hook")
        return None

    return (("server_args_post_init", "AFTER", after_server_args_post_init),)


def resolution_steps(body: Callable[[str, Any, str], None]) -> tuple:
    """0.5.17 has no resolution pipeline: nothing (the rules run after ``__post_init__``)."""
    return ()


def step_registrar(step: str) -> Callable:
    raise ValueError(f"SGLang {VERSION} has no resolution step {step!r}")


def default_prefill_backend() -> str | None:
    """SGLang's prefill graph backend when nothing asks for one: decided while resolving
    (platform and model dependent), so not known before: None."""
    return None


def refused_env(env: Mapping[str, str]) -> list[str]:
    """Environment switches of this release vitrify refuses (:data:`REFUSED_ENV`): none."""
    return []


def published_graph_config() -> Any:
    """The resolved ``cuda_graph_config`` the runtime context published to this process."""
    from sglang.srt.runtime_context import get_exec

    return get_exec().graph.cuda_graph_config


# what the plugin's scheduler check reads, where this release's runtime reads it
def _published_prefill_backend() -> Any:
    return published_graph_config().prefill.backend


def _published_load_format() -> Any:
    from sglang.srt.runtime_context import get_model

    return get_model().load_format


PUBLISHED = {"cuda_graph_config.prefill.backend": _published_prefill_backend,
             "load_format": _published_load_format}


def arrived_in(args: Any, expect: Mapping[str, Any], record: bool) -> list[str]:
    """Which of the changes ``expect`` (a key of :data:`PUBLISHED` -> value) this process's
    runtime does not see in the published config bags and, with ``record``, in ``args``. One
    ``field: published X, vitrify's Y`` each."""
    problems = []
    get = reader(args)
    for name, want in expect.items():
        try:
            have = {"published": PUBLISHED[name]()}
            if record:
                value = get(name.partition(".")[0])
                for part in name.split(".")[1:]:
                    value = getattr(value, part)
                have["the record has"] = value
        except (ValueError, AttributeError) as e:
            problems.append(f"{name}: not readable here ({type(e).__name__}: {e})")
            continue
        problems += [f"{name}: {where} {value!r}, vitrify's {want!r}"
                     for where, value in have.items() if value != want]
    return problems


def arrived(args: Any, expect: Mapping[str, Any]) -> list[str]:
    """What of vitrify's changes this scheduler does not see after re-applying them: SGLang
    0.5.17 reads both the record (the model loader, the graph runners) and the published bags
    (parts of the runtime), so both are checked."""
    return arrived_in(args, expect, record=True)


def scheduler_gpu(scheduler: Any) -> int | None:
    """The GPU of a scheduler process: 0.5.17 keeps it in ``scheduler.ps.gpu_id``."""
    return getattr(getattr(scheduler, "ps", None), "gpu_id", None)


GPU_WHERE = "scheduler.ps.gpu_id"


def tp_size() -> int:
    """This process's tensor-parallel size (SGLang's runtime context; a ModelRunner has no
    ``tp_size`` attribute)."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_size)


def ssl_verify(server_args: Any) -> Any:
    """What SGLang's own warm-up passes as requests' ``verify=``."""
    return server_args.ssl_verify()


def api_key(server_args: Any) -> str | None:
    return getattr(server_args, "api_key", None)


def launcher_status() -> tuple[Any, Any]:
    """SGLang's tokenizer manager in this (launcher) process and its ``ServerStatus`` enum, or
    (None, None) where they are not found."""
    mod = importlib.import_module(HTTP_SERVER)
    tm = getattr(getattr(mod, "_global_state", None), "tokenizer_manager", None)
    status = getattr(mod, "ServerStatus", None)
    if tm is None or status is None or not hasattr(tm, "server_status"):
        return None, None
    return tm, status


__all__ = ["ABSENT_FIELDS", "ATTENTION_WRAPPERS", "CLI_FLAGS", "CONFIG_MERGER",
           "DISABLED_ARCHS_ENV", "EXTRA_REFUSED", "FROZEN_ATTENTION", "FULL_GRAPH_BACKEND",
           "GPU_WHERE", "HEALTH_CHECK_PREFIX", "HOOK_TARGETS", "HOOK_TYPE", "HTTP_SERVER",
           "LEGACY_METADATA", "LOG_LINES", "METADATA_API", "MODELS_PACKAGE", "POOL_CONFIG",
           "PUBLISHED", "REFUSED_ENV", "REGISTRY", "REQUIRED", "RESOLUTION_STEPS", "ROLE_TARGETS",
           "SCHEDULER_MODULE", "SCHEDULER_REAPPLIES", "SERVER_ARGS", "STANDBY_TARGET", "VERSION",
           "api_key", "argument_hooks", "arrived", "arrived_in", "declare",
           "default_prefill_backend", "launcher_status", "process_role", "published_graph_config",
           "reader", "refused_env", "resolution_steps", "scheduler_gpu", "scheduler_reader",
           "server_args_fields", "ssl_verify", "step_registrar", "tp_size"]


# ---- HiCache storage backend (hicache/; sglang/DESIGN.md, "SGLang releases") -------------------
# What vitrify's HiCache L3 backend knows of this release's storage interface
# (sglang/srt/mem_cache/hicache_storage.py): ``HiCacheStorageConfig`` has the TP/PP/attention-CP
# slice only, no host-memory modes, no failure-injector proxy, and ``batch_exists_v2`` answers the
# minimum of the pools' boundaries (``PoolTransferResult(final_pages, hit_count)``).

# the class SGLang's factory may wrap a backend in (None: this release wraps none)
HICACHE_PROXY: str | None = None


def hicache_published_args(reader: Callable[[Any], Callable[[str], Any]] | None = None
                           ) -> Callable[[str], Any] | None:
    """The scheduler's published ``ServerArgs`` as a field reader (``reader``, by default
    :func:`scheduler_reader`: 0.5.17 materialises the resolved values onto the fields; a field
    the record lacks reads None), or None where this process published none (tests, tools)."""
    try:
        from sglang.srt.runtime_context import get_context

        args = get_context().server_args
    except (ImportError, ValueError):
        return None
    if args is None:
        return None
    read = (reader or scheduler_reader)(args)

    def get(name: str) -> Any:
        try:
            return read(name)
        except AttributeError:  # a field this record lacks
            return None

    return get


def hicache_refusal(storage_config: Any) -> str | None:
    """Why vitrify's HiCache backend must not serve this storage config on 0.5.17, or None:
    nothing in 0.5.17's config is outside what the backend supports."""
    return None


def hicache_rank_extra(storage_config: Any) -> str:
    """What a slab name adds to ``tp..-pp..-cp..`` for this rank: nothing (0.5.17's config has
    no DP rank; with DP attention its ``tp_rank`` is the global TP rank)."""
    return ""


def hicache_unwrap(backend: Any) -> Any:
    """The backend SGLang's factory built, behind any proxy: 0.5.17 wraps none."""
    return backend


def hicache_exists_result(result_cls: type, kv_pages: int, hit_count: dict,
                          pools: list[tuple[Any, int, frozenset]]) -> Any:
    """``batch_exists_v2``'s answer as 0.5.17's ``HiCacheFile`` folds the pools: ``pools`` is
    one ``(transfer name, boundary, restorable prefix lengths)`` per transfer, in order; the
    answer is the minimum of the boundaries (stopping at 0), each nonzero boundary in
    ``hit_count`` (the restorable sets are 0.5.23's and not part of this release's result)."""
    final = kv_pages
    for name, boundary, _ in pools:
        if final == 0:
            break
        if boundary:
            hit_count[name] = boundary
        final = min(final, boundary)
    return result_cls(final, hit_count)


__all__ += ["HICACHE_PROXY", "hicache_exists_result", "hicache_published_args",
            "hicache_rank_extra", "hicache_refusal", "hicache_unwrap"]
