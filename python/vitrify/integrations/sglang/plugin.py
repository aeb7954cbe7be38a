"""vitrify's SGLang plugin: the ``sglang.srt.plugins`` entry point and its hooks (PLUGIN.md).

SGLang calls :func:`register` (no arguments) early in every server process — the launcher,
``Engine``, each scheduler — and then applies the hooks registered with its ``HookRegistry``.
The plugin is inert unless ``VITRIFY_SGLANG_CONFIG`` names a TOML file (``config.py``); with one,
it validates the file, checks the SGLang version, resolves every hook target and every
``ServerArgs`` field its hooks read, and only then registers the hooks (invariants P1–P5).

SGLang only logs exceptions raised by a plugin and by hook application, so every error here is
fatal: :class:`PluginFatal`, a ``SystemExit`` with a one-line message starting
``vitrify SGLang plugin:`` (SGLang's loader catches ``Exception``, which ``SystemExit`` is not).

Hooks implemented now: an AFTER hook on ``ServerArgs.__post_init__``
(:func:`after_server_args_post_init`) that refuses the arguments vitrify cannot freeze yet,
turns prefill CUDA graphs off and records the engine-shaping arguments in :data:`STATE`.
Importing this module imports only the standard library (and the ``vitrify`` package).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pkgutil
import sys
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vitrify.sglang")

CONFIG_ENV = "VITRIFY_SGLANG_CONFIG"
SUPPORTED_SGLANG_VERSIONS = ("0.5.17",)
_PREFIX = "vitrify SGLang plugin: "
_DISABLED = "disabled"  # SGLang's cuda_graph_config Backend.DISABLED (cuda_graph_config.py)


class PluginFatal(SystemExit):
    """A fatal plugin error: SystemExit so that SGLang's ``except Exception`` lets it through.

    Its ``code`` (what ``str()`` gives and what Python prints at exit) is the one-line message."""

    def __init__(self, message: str):
        super().__init__(_PREFIX + " ".join(str(message).split()))


def fatal(message: str) -> PluginFatal:
    """The exception to raise for ``message`` (callers write ``raise fatal(...)``)."""
    return PluginFatal(message)


@dataclasses.dataclass
class PluginState:
    """What this process's plugin knows; later hooks read it.

    ``fingerprint`` is set in the process that builds ``ServerArgs`` (the launcher). Other
    processes receive ``ServerArgs`` pickled, without ``__post_init__``; hooks there recompute it
    with :func:`apply_server_args`, a pure function of the arguments (invariant P8)."""

    config: Any = None  # PluginConfig once register() accepted the file
    sglang_version: str | None = None
    registered: bool = False  # hooks handed to HookRegistry (never twice per process)
    fingerprint: dict | None = None  # engine-shaping ServerArgs, JSON-able
    prefill_graphs_were: str | None = None  # the prefill backend before it was forced off
    jit_dirs: dict | None = None  # JIT cache -> directory (SAVE: redirected; LOAD: unpacked)
    read_ahead: Any = None  # LOAD, launcher: the weights span's read (freeze.SpanPrefetch)


STATE = PluginState()


# ---------------------------------------------------------------------------------------------
# ServerArgs.__post_init__ (AFTER)
# ---------------------------------------------------------------------------------------------

SERVER_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.__post_init__"
SERVER_ARGS_OVERRIDE = "sglang.srt.server_args.ServerArgs.override"

# (field, flag, refused when, why). vitrify freezes one process on one GPU, allocating
# everything through its region; each of these breaks that.
REFUSED_ARGS: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("enable_memory_saver", "--enable-memory-saver", bool,
     "the memory saver's allocator bypasses vitrify's region"),
    ("speculative_algorithm", "--speculative-algorithm", lambda v: v not in (None, ""),
     "speculative decoding is not frozen yet"),
    ("tp_size", "--tp-size", lambda v: v > 1, "only one GPU is supported for now"),
    ("pp_size", "--pp-size", lambda v: v > 1, "only one GPU is supported for now"),
    ("dp_size", "--dp-size", lambda v: v > 1, "only one GPU is supported for now"),
    ("ep_size", "--ep-size", lambda v: v > 1, "only one GPU is supported for now"),
    ("dcp_size", "--dcp-size", lambda v: v > 1, "only one GPU is supported for now"),
    ("attn_cp_size", "--attn-cp-size", lambda v: v > 1, "only one GPU is supported for now"),
    ("nnodes", "--nnodes", lambda v: v > 1, "only one GPU is supported for now"),
    ("enable_dp_attention", "--enable-dp-attention", bool, "only one GPU is supported for now"),
    ("weight_cache_mode", "--weight-cache-mode", lambda v: v not in (None, "", "off"),
     "weights held by another process's GPU memory bypass vitrify's region"),
    ("disaggregation_mode", "--disaggregation-mode", lambda v: v not in (None, "", "null"),
     "prefill/decode disaggregation is not frozen yet"),
)

# ServerArgs fields that shape the engine vitrify freezes (copied into the fingerprint as is).
FINGERPRINT_ARGS = (
    "model_path", "revision", "dtype", "kv_cache_dtype", "quantization", "context_length",
    "max_running_requests", "attention_backend", "prefill_attention_backend",
    "decode_attention_backend", "page_size", "chunked_prefill_size", "random_seed", "tp_size",
)
# Fields read for the CUDA graph settings (the resolved cuda_graph_config, or the flags while it
# is unresolved: model_path "dummy"/"none" return from __post_init__ before resolving it).
_GRAPH_ARGS = (
    "cuda_graph_config", "cuda_graph_backend_decode", "cuda_graph_backend_prefill",
    "cuda_graph_max_bs_decode", "cuda_graph_bs_decode", "disable_prefill_cuda_graph",
    "disable_decode_cuda_graph", "disable_cuda_graph",
)
SERVER_ARGS_FIELDS = tuple(dict.fromkeys(
    [name for name, *_ in REFUSED_ARGS] + list(FINGERPRINT_ARGS) + list(_GRAPH_ARGS)
    + ["load_format", "quantization", "kv_cache_dtype", "model_loader_extra_config"]))


def _plain(value: Any) -> Any:
    """A JSON-able copy (the fingerprint is compared with an archive's recorded one)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def refusals(args: Any) -> list[str]:
    """What of ``args`` (a ``ServerArgs``, or the ``argparse.Namespace`` SGLang's own parser
    makes) ``REFUSED_ARGS`` refuses, one ``field=value (--flag): reason`` each: the
    ``__post_init__`` hook raises on them, ``vitrify sglang check`` reports them."""
    return [f"{field}={getattr(args, field)!r} ({flag}): {why}"
            for field, flag, refused, why in REFUSED_ARGS if refused(getattr(args, field))]


def _set_fields(args: Any, fields: dict) -> None:
    """Write server arguments the way 0.5.17 allows after resolution: ``ServerArgs.override``
    (its one post-resolution mutation point; bare assignment raises once the declarations are
    materialized), recorded with the source ``"vitrify"``. Plain objects get setattr."""
    override = getattr(args, "override", None)
    if callable(override):
        override("vitrify", **fields)
    else:
        for name, value in fields.items():
            setattr(args, name, value)


def _force_prefill_graphs_off(args: Any) -> str:
    """Turn prefill CUDA graphs off everywhere 0.5.17 keeps the setting; return the backend that
    was in effect.

    After ``__post_init__`` the decision lives in the resolved ``cuda_graph_config.prefill``
    (what the runtime context publishes to the model runner); the flags
    ``cuda_graph_backend_prefill`` / ``disable_prefill_cuda_graph`` are set as well, so that a
    config rebuilt from the flags agrees. With model_path "dummy"/"none" ``__post_init__``
    returns before resolving, so ``cuda_graph_config`` may still be None or the raw JSON dict."""
    cg = args.cuda_graph_config
    before = None
    if isinstance(cg, dict):
        cg = copy.deepcopy(cg)
        prefill = cg.setdefault("prefill", {})
        before = prefill.get("backend")
        prefill["backend"] = _DISABLED
    elif cg is not None:
        cg = copy.deepcopy(cg)
        before = cg.prefill.backend
        cg.prefill.backend = _DISABLED
    if before is None:  # unresolved: the flags in SGLang's precedence order
        if args.cuda_graph_backend_prefill is not None:
            before = args.cuda_graph_backend_prefill
        elif args.disable_prefill_cuda_graph or args.disable_cuda_graph:
            before = _DISABLED
        else:
            before = "SGLang's default"
    fields = {"cuda_graph_backend_prefill": _DISABLED, "disable_prefill_cuda_graph": True}
    if cg is not None:
        fields["cuda_graph_config"] = cg
    _set_fields(args, fields)
    return str(before)


def _graph_fingerprint(args: Any) -> dict:
    cg = args.cuda_graph_config
    if cg is not None and not isinstance(cg, dict):
        return {"cuda_graph_decode_backend": cg.decode.backend,
                "cuda_graph_decode_max_bs": cg.decode.max_bs,
                "cuda_graph_decode_bs": _plain(cg.decode.bs),
                "cuda_graph_prefill_backend": cg.prefill.backend}
    decode = (cg or {}).get("decode", {})
    backend = decode.get("backend", args.cuda_graph_backend_decode)
    if backend is None and (args.disable_decode_cuda_graph or args.disable_cuda_graph):
        backend = _DISABLED
    return {"cuda_graph_decode_backend": backend,
            "cuda_graph_decode_max_bs": decode.get("max_bs", args.cuda_graph_max_bs_decode),
            "cuda_graph_decode_bs": _plain(decode.get("bs", args.cuda_graph_bs_decode)),
            "cuda_graph_prefill_backend": _DISABLED}


def fingerprint(args: Any) -> dict:
    """The engine-shaping server arguments as a JSON-able dict (``FINGERPRINT_ARGS`` plus the
    CUDA graph backends and batch sizes)."""
    fp = {name: _plain(getattr(args, name)) for name in FINGERPRINT_ARGS}
    fp.update(_graph_fingerprint(args))
    return fp


def apply_server_args(args: Any, mode: str) -> dict:
    """Refuse, force, fingerprint (P6–P8): what the ``__post_init__`` hook does to ``args``.

    Raises :class:`PluginFatal` naming every refused argument; otherwise turns prefill CUDA graphs
    off (one log line) and returns the fingerprint. Calling it again on the same arguments
    leaves every value as it was and returns the same fingerprint."""
    refused = refusals(args)
    if refused:
        raise fatal(f"mode {mode!r} cannot freeze these server arguments yet: "
                    + "; ".join(refused))
    before = _force_prefill_graphs_off(args)
    if STATE.prefill_graphs_were is None:  # the first ServerArgs' setting: later ones see "disabled"
        STATE.prefill_graphs_were = before
    if before == _DISABLED:
        log.info("vitrify (mode %s): prefill CUDA graphs are off (vitrify does not freeze them "
                 "yet)", mode)
    else:
        log.info("vitrify (mode %s): prefill CUDA graphs forced off (backend was %s; vitrify does "
                 "not freeze them yet; pass --cuda-graph-backend-prefill disabled to size memory "
                 "without them)", mode, before)
    if mode == "load" and args.load_format != "dummy":
        _dummy_loader_at_load(args)
    return fingerprint(args)


# P11: the loaders and settings for which SGLang's dummy loader builds the same parameters in
# the same order and nothing derives values from the weights while loading
_PLAIN_LOAD_FORMATS = ("auto", "safetensors", "pt", "npcache")


def _dummy_loader_at_load(args: Any) -> None:
    """LOAD restores the weights from the archive: the dummy loader, when it is provably the
    same build; otherwise the configured loader runs (and reads the checkpoint)."""
    why = []
    if args.load_format not in _PLAIN_LOAD_FORMATS:
        why.append(f"load_format={args.load_format!r}")
    if getattr(args, "quantization", None):
        why.append(f"quantization={args.quantization!r}")
    if getattr(args, "kv_cache_dtype", "auto") not in (None, "auto"):
        why.append(f"kv_cache_dtype={args.kv_cache_dtype!r} (scales come from the weights)")
    if getattr(args, "model_loader_extra_config", None) not in (None, "", "{}", {}):
        why.append("model_loader_extra_config set")
    if why:
        log.info("vitrify (mode load): the configured loader reads the checkpoint (%s); the "
                 "archive's weights then replace what it loaded", ", ".join(why))
        return
    was = args.load_format
    _set_fields(args, {"load_format": "dummy"})
    log.info("vitrify (mode load): the weights come from the archive, the checkpoint is not "
             "read (load_format was %s)", was)


def after_server_args_post_init(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``ServerArgs.__post_init__``: :func:`apply_server_args`, then store the
    fingerprint in :data:`STATE`. Any failure is fatal (P3)."""
    cfg = STATE.config
    if cfg is None or not cfg.active:
        return None
    try:
        STATE.fingerprint = apply_server_args(self, cfg.mode)
    except SystemExit:
        raise
    except Exception as e:
        raise fatal(f"the ServerArgs.__post_init__ hook failed: {type(e).__name__}: {e}") from e
    return None


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hook:
    """One hook: SGLang target (dotted path ending in one attribute), HookType name, function;
    ``feature``: "freeze" (modes save/load) or "weights" (``weight_updates``); ``scheduler``:
    registered only in scheduler processes (resolving its target imports the scheduler, which a
    launcher must not pay for)."""

    target: str
    kind: str  # "BEFORE" | "AFTER" | "AROUND" | "REPLACE"
    fn: Callable
    feature: str = "freeze"
    scheduler: bool = False
    launcher: bool = False  # registered only in the launcher (the process that is no scheduler)
    when: Callable[[Any], bool] | None = None  # the configs it is registered for (None: all)


def _lazy_hook(module: str, name: str) -> Callable:
    """Hook function ``name`` of this package's ``module`` (``weights``: imports torch;
    ``freeze``), looked up when the hook runs, so registering imports neither."""
    def hook(*args: Any, **kwargs: Any) -> Any:
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(*args, **kwargs)
    hook.__name__ = hook.__qualname__ = name
    return hook


def _weights_hook(name: str) -> Callable:
    return _lazy_hook("weights", name)


UPDATE_TARGET = ("sglang.srt.model_executor.model_runner_components.weight_updater."
                 "WeightUpdater.update_weights_from_tensor")
QUEUE_TARGET = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
# the launcher's warm-up (the HTTP server's thread, before the server reports ready)
WARMUP_TARGET = "sglang.srt.entrypoints.http_server._wait_and_warmup"


_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
# The scheduler-side FREEZE/THAW (freeze.py's table), in the order they run.
FREEZE_HOOKS: tuple[tuple[str, str, str], ...] = (
    (f"{SCHEDULER_MODULE}.Scheduler.init_model_worker", "AROUND", "around_init_model_worker"),
    (f"{_MR}.load_model", "AROUND", "around_load_model"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
     "_resolve_memory_pool_config", "AROUND", "around_resolve_memory_pool_config"),
    (f"{_MR}.alloc_memory_pool", "AROUND", "around_alloc_memory_pool"),
    ("sglang.srt.model_executor.model_runner_components.cuda_graph_setup.capture_decode_graph",
     "AROUND", "around_capture_decode_graph"),
    ("sglang.srt.model_executor.runner_backend.utils.resolve_decode_backend", "AROUND",
     "around_resolve_decode_backend"),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.freeze_gc", "AROUND",
     "around_freeze_gc"),
    (f"{SCHEDULER_MODULE}.Scheduler.handle_generate_request", "AFTER",
     "after_handle_generate_request"),
    (f"{SCHEDULER_MODULE}.Scheduler.on_idle", "AFTER", "after_on_idle"),
)

# Every hook register() hands to SGLang (PLUGIN.md's table lists the ones still to come).
HOOKS: tuple[Hook, ...] = (
    Hook(SERVER_ARGS_TARGET, "AFTER", after_server_args_post_init),
    Hook(UPDATE_TARGET, "AROUND", _weights_hook("around_update_weights_from_tensor"),
         feature="weights", scheduler=True),
    Hook(QUEUE_TARGET, "AROUND", _weights_hook("around_add_request_to_queue"),
         feature="weights", scheduler=True),
) + tuple(Hook(target, kind, _lazy_hook("freeze", fn), scheduler=True)
          for target, kind, fn in FREEZE_HOOKS) + (
    Hook(WARMUP_TARGET, "AROUND", _lazy_hook("freeze", "around_wait_and_warmup"),
         launcher=True, when=lambda cfg: cfg.mode == "load" and cfg.warmup_requests > 0),)


def hooks_for(cfg: Any, in_scheduler: bool) -> tuple[Hook, ...]:
    """The hooks this process registers for ``cfg``."""
    features = ({"freeze"} if cfg.active else set()) | ({"weights"} if cfg.weight_updates
                                                        else set())
    return tuple(h for h in HOOKS if h.feature in features and (h.when is None or h.when(cfg))
                 and (in_scheduler or not h.scheduler) and not (in_scheduler and h.launcher))
_REGISTRY_TARGET = "sglang.srt.plugins.hook_registry.HookRegistry"
_HOOK_TYPE_TARGET = "sglang.srt.plugins.hook_registry.HookType"


def _sglang_version() -> str:
    try:
        import sglang
    except Exception as e:
        raise fatal(f"cannot import sglang: {type(e).__name__}: {e}") from None
    version = str(getattr(sglang, "__version__", "unknown"))
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise fatal(f"SGLang {version} is not supported; this vitrify supports SGLang "
                    f"{', '.join(SUPPORTED_SGLANG_VERSIONS)}")
    return version


def _resolve(target: str, version: str) -> Any:
    """The object ``target`` names, resolved as SGLang's registry does (module path, then one
    attribute); fatal naming the target and the SGLang version if it is missing."""
    obj_path, _, attr = target.rpartition(".")
    try:
        if not obj_path:
            raise ValueError("need a module path and an attribute")
        owner = pkgutil.resolve_name(obj_path)
        return getattr(owner, attr)
    except Exception as e:
        raise fatal(f"hook target {target!r} is missing in SGLang {version}: "
                    f"{type(e).__name__}: {e}") from None


def _check_server_args_fields(version: str) -> None:
    """The ServerArgs fields and the ``override`` method the ``__post_init__`` hook uses."""
    cls = _resolve(SERVER_ARGS_TARGET.rsplit(".", 1)[0], version)
    _resolve(SERVER_ARGS_OVERRIDE, version)
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = [name for name in SERVER_ARGS_FIELDS if name not in fields]
    if missing:
        raise fatal(f"ServerArgs of SGLang {version} lacks the field(s) {missing} the plugin "
                    f"reads")


def _in_scheduler() -> bool:
    """Whether this process is one of SGLang's scheduler processes: a child process (the
    launcher is the parent; the detokenizer and the DP controller never load plugins) that has
    imported the scheduler module. The module alone is not enough: ``sglang.Engine`` imports it
    in the launcher too."""
    import multiprocessing

    return SCHEDULER_MODULE in sys.modules and multiprocessing.parent_process() is not None


def _record_kernels() -> None:
    """SAVE, scheduler process: record kernel binaries from here on (CUPTI), as early as the
    plugin runs there — before the model runner initialises CUDA — so the decode graphs'
    kernels can be frozen (session P6)."""
    from ... import graph

    try:
        graph.record_modules()
    except Exception as e:
        raise fatal(f"mode 'save' records the kernel binaries of the decode graphs, and CUPTI "
                    f"could not start: {type(e).__name__}: {e}") from None


JIT_ROOT_ENV = "VITRIFY_SGLANG_JIT_ROOT"
_READ_AHEAD_ENV = "VITRIFY_SGLANG_READ_AHEAD"  # freeze.READ_AHEAD_ENV (freeze imports later)


def _setup_jit(cfg: Any) -> dict:
    """P10: SAVE points the JIT caches at empty directories under ``jit_dir``; LOAD unpacks the
    archive's caches there (verified) and points them there. Done once, in the first process
    that registers (the launcher); the processes it starts inherit the environment, which says
    so (``VITRIFY_SGLANG_JIT_ROOT``)."""
    from ... import archive as _archive
    from ... import jit

    if not cfg.jit_caches or cfg.jit_dir is None:
        return {}
    if os.environ.get(JIT_ROOT_ENV) == cfg.jit_dir:
        return {n: os.environ[v] for n, v in jit.CACHES.items() if v in os.environ}
    try:
        if cfg.mode == "save":
            dirs = jit.redirect(cfg.jit_dir)
        else:
            dirs = jit.unpack(_archive.open_archive(cfg.archive), cfg.jit_dir)
    except (jit.JitCacheError, _archive.ArchiveError, OSError) as e:
        what = "redirecting the JIT caches" if cfg.mode == "save" else \
            "unpacking the archive's JIT caches"
        if cfg.mode == "load" and cfg.on_mismatch == "cold-start":
            log.warning("vitrify SGLang plugin: %s failed (%s); on_mismatch = \"cold-start\": "
                        "the engine compiles as usual", what, e)
            return {}
        raise fatal(f"{what} ({cfg.jit_dir}): {e} (jit_caches = false turns this off)") from None
    os.environ[JIT_ROOT_ENV] = cfg.jit_dir
    log.info("vitrify SGLang plugin: JIT caches %s %s", "redirected to" if cfg.mode == "save"
             else "unpacked at", cfg.jit_dir)
    return dirs


def _start_read_ahead(cfg: Any, in_scheduler: bool) -> Any:
    """P18: LOAD's launcher (the first process, not a scheduler; ``read_ahead`` on) reads the
    weights span ahead while the scheduler starts (``freeze.start_read_ahead``)."""
    if cfg.mode != "load" or not cfg.read_ahead or in_scheduler or \
            os.environ.get(_READ_AHEAD_ENV, "").startswith(f"{os.getpid()}:"):
        return None
    from . import freeze

    try:
        return freeze.start_read_ahead(cfg.archive)
    except Exception as e:  # noqa: BLE001 - a speed-up: it never stops a server
        log.warning("vitrify SGLang plugin: reading the weights ahead failed (%s: %s); the thaw "
                    "reads them itself", type(e).__name__, e)
        return None


def _narrow_models(cfg: Any) -> None:
    """LOAD: SGLang's model registry imports only the model module(s) SAVE recorded
    (``freeze.narrow_model_registry``); the processes started later inherit the setting."""
    from ... import archive as _archive
    from . import freeze

    try:
        modules = freeze.archive_engine_state(cfg.archive).get("model_modules")
    except (_archive.ArchiveError, OSError) as e:  # the session's start reports it, fatally
        log.debug("vitrify SGLang plugin: model registry not narrowed: %s", e)
        return
    n = freeze.narrow_model_registry(modules)
    if n:
        log.info("vitrify SGLang plugin: the model registry imports %s only (%d other model "
                 "modules in %s)", ", ".join(modules), n, freeze.DISABLED_ARCHS_ENV)
    else:
        log.info("vitrify SGLang plugin: the model registry imports every model module (the "
                 "archive names none this SGLang has: %s)", modules)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Inert without ``VITRIFY_SGLANG_CONFIG`` (P1);
    otherwise config, version, every target, then registration (P2–P5); once per process (P9).
    Any error is fatal (P3): SGLang only logs what a plugin raises, so an unexpected exception
    is turned into :class:`PluginFatal` too."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        return
    try:
        _register(path)
    except SystemExit:
        raise
    except Exception as e:
        raise fatal(f"registering the hooks failed: {type(e).__name__}: {e}") from e


def _register(path: str) -> None:
    if STATE.registered:
        log.debug("vitrify SGLang plugin already registered in this process")
        return
    from . import config as _config

    try:
        cfg = _config.load(path)
    except _config.PluginConfigError as e:
        raise fatal(f"{CONFIG_ENV}: {e}") from None
    if not cfg.registers_hooks:
        STATE.config, STATE.registered = cfg, True
        log.info("vitrify SGLang plugin: mode 'off' in %s, no hooks registered", path)
        return
    version = _sglang_version()
    registry = _resolve(_REGISTRY_TARGET, version)
    hook_type = _resolve(_HOOK_TYPE_TARGET, version)
    in_scheduler = _in_scheduler()
    if cfg.mode == "save" and in_scheduler:
        _record_kernels()  # first: resolving the targets imports the model runner
    hooks = hooks_for(cfg, in_scheduler)
    for hook in hooks:
        _resolve(hook.target, version)
        if hook.kind not in hook_type.__members__:
            raise fatal(f"hook kind {hook.kind!r} for {hook.target!r} is not a HookType of "
                        f"SGLang {version}")
        if isinstance(hook.fn, type) and hook.kind != "REPLACE":  # the registry would raise
            raise fatal(f"hook {hook.fn.__name__} on {hook.target!r} is a class; SGLang takes "
                        f"classes only as REPLACE hooks")
    if cfg.active:
        _check_server_args_fields(version)
        if cfg.jit_caches:
            STATE.jit_dirs = _setup_jit(cfg)
        if cfg.mode == "load":
            _narrow_models(cfg)
            STATE.read_ahead = _start_read_ahead(cfg, in_scheduler)
            if cfg.standby_file:  # the launch's time, for the schedulers (freeze.standby_since)
                from . import freeze

                os.environ.setdefault(freeze.STANDBY_SINCE_ENV, repr(time.time()))
    # Everything resolved: from here on nothing can fail half-way (P2).
    STATE.config, STATE.sglang_version = cfg, version
    for hook in hooks:
        registry.register(hook.target, hook.fn, hook_type[hook.kind])
    STATE.registered = True
    log.info("vitrify SGLang plugin: mode %r, archive %s, weight updates %s, %d hook(s) "
             "registered (SGLang %s)", cfg.mode, cfg.archive,
             "on" if cfg.weight_updates else "off", len(hooks), version)
