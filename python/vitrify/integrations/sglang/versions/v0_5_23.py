"""SGLang 0.5.23: everything the plugin knows of this release's internals (PLUGIN.md, "One seam
per SGLang version"; read in the 0.5.23 wheel, research note ``/work/notes/sglang-0.5.23.md``).

What changed since 0.5.17, and how the plugin meets it:

- ``ServerArgs`` is a msgspec Struct that keeps the operator's raw input; resolution runs later,
  in ``resolve_once()``, through named steps, and ``__post_init__`` resolves nothing (a hook on
  it never runs). The argument rules hook in with ``register_resolution_hook`` on three steps
  (:data:`RESOLUTION_STEPS`), read values through ``resolving_view`` (:func:`reader`) and change
  them with ``declare_resolution`` (:func:`declare`). Declarations travel with the pickled record
  to every scheduler, which only checks that they arrived (:func:`arrived`, read-only).
- The detokenizer and the DP controller load plugins too (:func:`process_role`).
- A scheduler sets its device and builds its process groups in ``Scheduler.__init__``
  (``bootstrap.init_parallel_runtime``), before ``init_model_worker``: a standby waits there
  (:data:`STANDBY_TARGET`).
- ``scheduler.ps`` and ``ServerArgs.ssl_verify()`` are gone; ``torchao_config`` is no longer a
  field; new are ``attn_dp_size`` and ``startup_weight_load_mode`` (refused: overlap loads the
  weights after the capture) and four environment switches that add graphs or allocations
  vitrify's backend does not own (:func:`refused_env`).

Imports only the standard library at import time; SGLang inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import process_role_from
from . import v0_5_17 as _previous

VERSION = "0.5.23"

REGISTRY = _previous.REGISTRY  # sglang/srt/plugins is unchanged (one reformatted line)
HOOK_TYPE = _previous.HOOK_TYPE
SERVER_ARGS = _previous.SERVER_ARGS
SCHEDULER_MODULE = _previous.SCHEDULER_MODULE

# every 0.5.17 target is where it was (signatures read: the new keyword-only arguments of
# alloc_memory_pool, handle_generate_request and _wait_and_warmup pass through the hooks);
# the post-init hook is replaced by the resolution steps, and the standby point is new
HOOK_TARGETS = {key: target for key, target in _previous.HOOK_TARGETS.items()
                if key != "server_args_post_init"}
HOOK_TARGETS["init_parallel_runtime"] = "sglang.srt.distributed.bootstrap.init_parallel_runtime"

_OVERRIDES = "sglang.srt.arg_groups.overrides"
REQUIRED = (f"{_OVERRIDES}.declare_resolution", f"{_OVERRIDES}.resolving_view",
            "sglang.srt.arg_groups.resolution_hooks.register_resolution_hook",
            "sglang.srt.arg_groups.arg_utils.record_fields",
            "sglang.srt.arg_groups.serving_hook.ssl_verify_of",
            "sglang.srt.runtime_context.get_exec", "sglang.srt.runtime_context.get_model",
            "sglang.srt.runtime_context.get_device", "sglang.srt.runtime_context.get_parallel",
            "sglang.srt.runtime_context.get_serving")
STANDBY_TARGET = "init_parallel_runtime"
SCHEDULER_REAPPLIES = False  # the pickled record is resolved and sealed: read only

ABSENT_FIELDS = ("torchao_config",)
EXTRA_REFUSED: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("attn_dp_size", "--attn-dp-size", lambda v: (v or 1) > 1, "only one GPU is supported for now"),
    ("startup_weight_load_mode", "--startup-weight-load-mode", lambda v: v == "overlap",
     "the weights arrive after the decode graphs are captured, while SAVE dumps and LOAD "
     "restores them right after loading"),
)
# SGLang's environment switches (all default off, read as booleans by envs.*.get()) that add
# graphs or allocations vitrify's graph backend does not own
REFUSED_ENV = {
    "SGLANG_ENABLE_METADATA_GLUE_GRAPH": "a second captured graph per decode shape",
    "SGLANG_ENABLE_GRAPH_POOL_PRECARVE": "the graph pool carved before the capture",
    "SGLANG_ENABLE_GRAPH_POOL_BORROW": "tensors borrowed from the graph pool",
    "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": "the KV pool resized after the capture",
}

ROLE_TARGETS = {
    **_previous.ROLE_TARGETS,
    # DP schedulers launched before the DP controller (engine.py prelaunch_dp_schedulers)
    "sglang.srt.managers.data_parallel_controller.run_scheduler_process_with_init_pipe":
        "scheduler",
}

# unchanged (read in 0.5.23: layers/attention/*, runner_backend/, pool_configurator.py,
# models/registry.py, constants.py)
FROZEN_ATTENTION = dict(_previous.FROZEN_ATTENTION)
ATTENTION_WRAPPERS = dict(_previous.ATTENTION_WRAPPERS)
METADATA_API = _previous.METADATA_API
LEGACY_METADATA = _previous.LEGACY_METADATA
FULL_GRAPH_BACKEND = _previous.FULL_GRAPH_BACKEND
POOL_CONFIG = _previous.POOL_CONFIG
MODELS_PACKAGE = _previous.MODELS_PACKAGE
DISABLED_ARCHS_ENV = _previous.DISABLED_ARCHS_ENV
HEALTH_CHECK_PREFIX = _previous.HEALTH_CHECK_PREFIX
HTTP_SERVER = _previous.HTTP_SERVER
CONFIG_MERGER = "sglang.srt.utils.server_args_config_parser.ConfigArgumentMerger"

LOG_LINES = {**_previous.LOG_LINES,
             # now in Scheduler.__init__ (bootstrap.init_parallel_runtime), earlier than before
             "import_floor": "Init parallel begin."}
CLI_FLAGS = dict(_previous.CLI_FLAGS)  # --cuda-graph-max-bs (0.5.17 only) is not used

# The resolution steps the argument rules wrap (resolution_hooks._OVERRIDABLE_HOOKS; pipeline.py
# calls them in this order): (step, phase before the step, phase after it). handle_cuda_graph_config
# parses the flags through resolving_view, so what is declared before it counts as the
# operator's flag (and is locked against SGLang's later cascade); after handle_load_format the
# load format is final; the last validation step sees the fully resolved record. model_path
# "dummy"/"none" returns after handle_hardware_runtime_validation: the rules run there for it.
RESOLUTION_STEPS = (
    ("handle_hardware_runtime_validation", None, "unresolved"),
    ("handle_cuda_graph_config", "prefill", "prefill_check"),
    ("handle_load_format", None, "load_format"),
    ("validate_deepep_v2_dispatch_token_budget", None, "final"),
)


def process_role() -> str:
    """This process's part: "launcher", "scheduler", "detokenizer" or "dp_controller" (in
    0.5.23 all of them load plugins), from the function multiprocessing started it with."""
    return process_role_from(ROLE_TARGETS)


def server_args_fields(cls: type) -> frozenset:
    """The field names of ``ServerArgs`` (a msgspec Struct: ``dataclasses.fields`` raises),
    through SGLang's own ``record_fields``."""
    from sglang.srt.arg_groups.arg_utils import record_fields

    return frozenset(f.name for f in record_fields(cls))


def _is_record(args: Any) -> bool:
    return hasattr(type(args), "__struct_fields__")  # a ServerArgs (msgspec Struct)


def reader(args: Any) -> Callable[[str], Any]:
    """The value resolution has decided so far for a field (``resolving_view``: the last
    declaration, else the raw input), valid during resolution, on the launcher's resolved
    record and on a scheduler's pickled copy. An ``argparse.Namespace`` of SGLang's parser (or
    any other object) is read as it is."""
    if not _is_record(args):
        return lambda name: getattr(args, name)
    from sglang.srt.arg_groups.overrides import resolving_view

    view = resolving_view(args)
    return lambda name: getattr(view, name)


def scheduler_reader(args: Any) -> Callable[[str], Any]:
    """A scheduler's view: the record's resolved values, except the CUDA graph config, which is
    read where the runtime reads it (the published ``exec.graph`` bag). Any other object is
    read as it is."""
    get = reader(args)
    if not _is_record(args):
        return get

    def read(name: str) -> Any:
        if name == "cuda_graph_config":
            return published_graph_config()
        return get(name)

    return read


def declare(args: Any, fields: Mapping[str, Any]) -> None:
    """Change fields the way 0.5.23 allows: ``declare_resolution(args, "vitrify", ...)`` on a
    record (inside resolution; the raw input stays), setattr on any other object."""
    if not _is_record(args):
        for name, value in fields.items():
            setattr(args, name, value)
        return
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(args, "vitrify", **dict(fields))


def argument_hooks(body: Callable[[str, Any, str], None]) -> tuple:
    """No HookRegistry hook applies the argument rules in 0.5.23 (see :func:`resolution_steps`)."""
    return ()


def resolution_steps(body: Callable[[str, Any, str], None]) -> tuple[tuple[str, Callable], ...]:
    """``(step, fn(server_args, previous))`` for each of :data:`RESOLUTION_STEPS`: ``body`` runs
    the rule phase named before and after SGLang's own step."""
    out = []
    for step, before, after in RESOLUTION_STEPS:
        where = f"the resolution hook on {step}"

        def wrapped(server_args: Any, previous: Callable[[Any], None], before=before,
                    after=after, where=where) -> None:
            if before is not None:
                body(before, server_args, where)
            previous(server_args)
            if after is not None:
                body(after, server_args, where)

        wrapped.__name__ = wrapped.__qualname__ = f"vitrify_{step}"
        out.append((step, wrapped))
    return tuple(out)


def step_registrar(step: str) -> Callable:
    """SGLang's registration decorator for ``step``; an unknown step raises ValueError here,
    before anything is registered (``register_resolution_hook`` validates the name first and
    registers only when the decorator is applied)."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    return register_resolution_hook(step)


def default_prefill_backend() -> str | None:
    """SGLang's prefill graph backend when no flag asks for one (breakable on CUDA, disabled
    elsewhere; later resolution steps may still turn it off for a model)."""
    from sglang.srt.model_executor.cuda_graph_config import default_prefill_backend as default

    return str(default())


def _env_true(value: str) -> bool:
    # SGLang's EnvBool: true/1/yes/y (any case) is on; anything else it refuses or reads off
    return value.strip().lower() in ("true", "1", "yes", "y")


def refused_env(env: Mapping[str, str]) -> list[str]:
    """The :data:`REFUSED_ENV` switches set in ``env``, one ``NAME=value: reason`` each."""
    return [f"{name}={env[name]!r} ({why}: vitrify's decode graph backend does not own it)"
            for name, why in REFUSED_ENV.items() if name in env and _env_true(env[name])]


def published_graph_config() -> Any:
    """The resolved ``cuda_graph_config`` the runtime context published to this process (what
    ``resolve_decode_backend`` and the model runner read)."""
    from sglang.srt.runtime_context import get_exec

    return get_exec().graph.cuda_graph_config


def arrived(args: Any, expect: Mapping[str, Any]) -> list[str]:
    """Which of the launcher's changes ``expect`` (field -> value) this scheduler's runtime does
    not see, in the published config bags (what 0.5.23's runtime reads; the record is sealed
    and read only)."""
    return _previous.arrived_in(args, expect, record=False)


def scheduler_gpu(scheduler: Any) -> int | None:
    """The GPU of this scheduler process: ``runtime_context.get_device().gpu_id`` (published
    from ``SpawnRanks`` before the scheduler is built; ``scheduler.ps`` is gone)."""
    from sglang.srt.runtime_context import get_device

    try:
        return get_device().gpu_id
    except ValueError:  # not published
        return None


GPU_WHERE = "runtime_context.get_device().gpu_id"


def tp_size() -> int:
    """This process's tensor-parallel size (``get_parallel().tp_size``)."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_size)


def ssl_verify(server_args: Any) -> Any:
    """What SGLang's own warm-up passes as requests' ``verify=`` (``ssl_verify_of``)."""
    from sglang.srt.arg_groups.serving_hook import ssl_verify_of

    return ssl_verify_of(server_args)


def api_key(server_args: Any) -> str | None:
    return reader(server_args)("api_key")


launcher_status = _previous.launcher_status


__all__ = ["ABSENT_FIELDS", "ATTENTION_WRAPPERS", "CLI_FLAGS", "CONFIG_MERGER",
           "DISABLED_ARCHS_ENV", "EXTRA_REFUSED", "FROZEN_ATTENTION", "FULL_GRAPH_BACKEND",
           "GPU_WHERE", "HEALTH_CHECK_PREFIX", "HOOK_TARGETS", "HOOK_TYPE", "HTTP_SERVER",
           "LEGACY_METADATA", "LOG_LINES", "METADATA_API", "MODELS_PACKAGE", "POOL_CONFIG",
           "REFUSED_ENV", "REGISTRY", "REQUIRED", "RESOLUTION_STEPS", "ROLE_TARGETS",
           "SCHEDULER_MODULE", "SCHEDULER_REAPPLIES", "SERVER_ARGS", "STANDBY_TARGET", "VERSION",
           "api_key", "argument_hooks", "arrived", "declare", "default_prefill_backend",
           "launcher_status", "process_role", "published_graph_config", "reader", "refused_env",
           "resolution_steps", "scheduler_gpu", "scheduler_reader", "server_args_fields",
           "ssl_verify", "step_registrar", "tp_size"]


# ---- HiCache storage backend (hicache/; sglang/DESIGN.md, "SGLang releases") -------------------
# What changed in the storage interface since 0.5.17 (hicache_storage.py, storage/backend_factory.py,
# managers/cache_controller.py) and how vitrify's HiCache backend meets it:
# - ``HiCacheStorageConfig`` gains ``dp_rank`` (with DP attention ``tp_rank`` is local to the
#   attention group: the slab name adds ``-dp<r>``), ``dcp_size`` / ``dcp_rank`` /
#   ``logical_page_size`` (decode context parallel: refused) and a validator.
# - ``--hicache-host-memory-mode buffer_only`` (host memory a staging buffer, L3 the only cache):
#   refused (not proven with vitrify's store: eviction under SGLang's existence cache).
# - the factory wraps the backend in ``HiCacheStorageFailureInjector`` when
#   ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_{DELAY,FAILURE}`` is set: :func:`hicache_unwrap`.
# - ``PoolTransferResult.restorable_prefix_pages``: the prefix lengths every pool can restore
#   (their intersection; the longest is the answer): :func:`hicache_exists_result`.
# - ``ServerArgs`` keeps the raw input: resolved values through :func:`scheduler_reader`.

HICACHE_PROXY = "sglang.srt.mem_cache.hicache_storage.HiCacheStorageFailureInjector"


def hicache_published_args() -> Callable[[str], Any] | None:
    """The scheduler's published ``ServerArgs`` as a field reader of its RESOLVED values
    (:func:`scheduler_reader`: the raw fields keep the operator's input, e.g. ``kv_cache_dtype``
    "auto" where resolution declared fp8), or None where this process published none. A field
    the record lacks reads None."""
    return _previous.hicache_published_args(scheduler_reader)


def _host_memory_mode() -> str | None:
    """``--hicache-host-memory-mode`` as this process's runtime reads it (the published memory
    bag), else as the published record resolves it; None where neither is published."""
    try:
        from sglang.srt.runtime_context import get_memory

        return getattr(get_memory(), "hicache_host_memory_mode", None)
    except (ImportError, ValueError):
        pass
    get = hicache_published_args()
    return None if get is None else get("hicache_host_memory_mode")


def hicache_refusal(storage_config: Any) -> str | None:
    """Why vitrify's HiCache backend must not serve on 0.5.23, in one line, or None: decode
    context parallelism (``dcp_size > 1``: pages are shards of a logical page, stored under a
    DCP identity vitrify does not keep) and ``--hicache-host-memory-mode buffer_only``."""
    dcp = int(getattr(storage_config, "dcp_size", 1) or 1)
    if dcp != 1:
        return (f"decode context parallelism (dcp_size={dcp}, dcp_rank="
                f"{getattr(storage_config, 'dcp_rank', '?')}) is not supported; use SGLang's "
                f"file or Mooncake backend, or run without --dcp-size")
    mode = _host_memory_mode()
    if mode == "buffer_only":
        return ("--hicache-host-memory-mode buffer_only is not supported (the host pool only "
                "stages pages and L3 is the only cache); use the default mode 'cache'")
    return None


def hicache_rank_extra(storage_config: Any) -> str:
    """What a slab name adds to ``tp..-pp..-cp..``: ``-dp<r>`` for a DP-attention rank of DP
    group ``r > 0`` (its ``tp_rank`` is local to the group, so two groups would otherwise name
    one slab); nothing for group 0, so a server without DP attention keeps its names."""
    dp = int(getattr(storage_config, "dp_rank", 0) or 0)
    return f"-dp{dp}" if dp else ""


def hicache_unwrap(backend: Any) -> Any:
    """The backend SGLang's factory built, behind the failure-injector proxy the factory puts
    around it when SGLANG_TEST_HICACHE_BACKEND_RANDOM_{DELAY,FAILURE} is set."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    seen = 0
    while isinstance(backend, HiCacheStorageFailureInjector) and seen < 8:
        backend = backend._backend
        seen += 1
    return backend


def hicache_exists_result(result_cls: type, kv_pages: int, hit_count: dict,
                          pools: list[tuple[Any, int, frozenset]]) -> Any:
    """``batch_exists_v2``'s answer as 0.5.23's ``HiCacheFile`` folds the pools: ``pools`` is
    one ``(transfer name, boundary, restorable prefix lengths)`` per transfer, in order; the
    prefix lengths every pool can restore are intersected (stopping once none is left: a
    trailing-page pool may restore 5 pages while 4 and 3 are not restorable), the longest is
    the answer and the list is ``restorable_prefix_pages``."""
    restorable = list(range(1, kv_pages + 1))
    for name, boundary, can in pools:
        if not restorable:
            break
        if boundary:
            hit_count[name] = boundary
        restorable = [n for n in restorable if n in can]
    return result_cls(restorable[-1] if restorable else 0, hit_count, restorable)


__all__ += ["HICACHE_PROXY", "hicache_exists_result", "hicache_published_args",
            "hicache_rank_extra", "hicache_refusal", "hicache_unwrap"]
