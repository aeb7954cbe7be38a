"""vitrify's SGLang plugin: the ``sglang.srt.plugins`` entry point (PLUGIN.md).

Owns: :func:`register` — the config read, the SGLang version checked (one module per release,
``versions/``), every hook target resolved, and only then the hooks handed to SGLang, all or
nothing (P1-P5, P9) — and the hook table :data:`HOOKS` (which function of ``freeze.py`` /
``weights.py`` goes on which of the release's targets, in which processes).

SGLang calls :func:`register` (no arguments) early in every process that loads plugins — the
launcher (``sglang serve``, ``python -m sglang.launch_server``, ``Engine``), each scheduler,
and since 0.5.23 the detokenizer and the DP controller, which register nothing — and then
applies the hooks registered with its ``HookRegistry``. The argument rules go in through the
release's seam: an AFTER hook on ``ServerArgs.__post_init__`` (0.5.17), resolution hooks on
named steps (0.5.23). The plugin is inert unless ``VITRIFY_SGLANG_CONFIG`` names a TOML file
(``config.py``). SGLang only logs exceptions raised by a plugin, so every error here is fatal:
``state.PluginFatal``, a ``SystemExit`` with a one-line message. Importing this module imports
only the standard library (and the ``vitrify`` package).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pkgutil
import time
from collections.abc import Callable
from typing import Any

from . import freeze, startup, state, versions, weights
from . import server_args as rules

log = logging.getLogger("vitrify.sglang")


@dataclasses.dataclass(frozen=True)
class Hook:
    """One hook: the release's target (a key of its ``HOOK_TARGETS``), SGLang's HookType name,
    the function; ``feature``: "freeze" (modes save/load) or "weights" (``weight_updates``);
    ``roles``: the processes that register it (resolving a scheduler's targets imports the model
    executor, which a launcher must not pay for); ``when``: the configs and releases it is
    registered for (None: all)."""

    key: str
    kind: str  # "BEFORE" | "AFTER" | "AROUND" | "REPLACE"
    fn: Callable
    feature: str = "freeze"
    roles: tuple[str, ...] = ("scheduler",)
    when: Callable[[Any, Any], bool] | None = None


def _standby_before_init_model_worker(cfg: Any, ver: Any) -> bool:
    return cfg.mode == "load" and bool(cfg.standby_file) and \
        ver.STANDBY_TARGET == "init_parallel_runtime"


# Every hook register() hands to SGLang's HookRegistry besides the release's argument hooks, in
# the order the scheduler's start-up runs them (PLUGIN.md's hook table).
HOOKS: tuple[Hook, ...] = (
    Hook("update_weights_from_tensor", "AROUND", weights.around_update_weights_from_tensor,
         feature="weights"),
    Hook("add_request_to_queue", "AROUND", weights.around_add_request_to_queue,
         feature="weights"),
    Hook("init_parallel_runtime", "AROUND", freeze.around_init_parallel_runtime,
         when=_standby_before_init_model_worker),
    Hook("init_model_worker", "AROUND", freeze.around_init_model_worker),
    Hook("load_model", "AROUND", freeze.around_load_model),
    Hook("resolve_memory_pool_config", "AROUND", freeze.around_resolve_memory_pool_config),
    Hook("alloc_memory_pool", "AROUND", freeze.around_alloc_memory_pool),
    Hook("capture_decode_graph", "AROUND", freeze.around_capture_decode_graph),
    Hook("resolve_decode_backend", "AROUND", freeze.around_resolve_decode_backend),
    Hook("freeze_gc", "AROUND", freeze.around_freeze_gc),
    Hook("handle_generate_request", "AFTER", freeze.after_handle_generate_request),
    Hook("on_idle", "AFTER", freeze.after_on_idle),
    # the launcher's warm-up (the HTTP server's thread, before the server reports ready)
    Hook("wait_and_warmup", "AROUND", freeze.around_wait_and_warmup, roles=("launcher",),
         when=lambda cfg, ver: (cfg.mode == "load" and cfg.warmup_requests > 0) or
         (cfg.mode == "save" and cfg.shape_sweep)),
)


def hooks_for(cfg: Any, role: str, ver: Any) -> tuple[tuple[str, str, Callable], ...]:
    """``(target, kind, fn)`` of every HookRegistry hook process ``role`` registers for ``cfg``
    on release ``ver``: the release's argument hooks (launcher and schedulers, modes save and
    load) and :data:`HOOKS`. A key the release lacks is the plugin's fatal."""
    features = ({"freeze"} if cfg.active else set()) | ({"weights"} if cfg.weight_updates
                                                        else set())
    out: list[tuple[str, str, Callable]] = []
    if cfg.active and role in ("launcher", "scheduler"):
        out += [(_target(ver, key), kind, fn)
                for key, kind, fn in ver.argument_hooks(rules.run_phase)]
    out += [(_target(ver, h.key), h.kind, h.fn) for h in HOOKS
            if h.feature in features and role in h.roles and (h.when is None or h.when(cfg, ver))]
    return tuple(out)


def _target(ver: Any, key: str) -> str:
    try:
        return ver.HOOK_TARGETS[key]
    except KeyError:
        raise state.fatal(f"the plugin has no hook target {key!r} for SGLang "
                          f"{ver.VERSION}") from None


def resolve(target: str, version: str) -> Any:
    """The object ``target`` names, resolved as SGLang's registry does (module path, then one
    attribute); fatal naming the target and the SGLang version if it is missing."""
    obj_path, _, attr = target.rpartition(".")
    try:
        if not obj_path:
            raise ValueError("need a module path and an attribute")
        owner = pkgutil.resolve_name(obj_path)
        return getattr(owner, attr)
    except Exception as e:
        raise state.fatal(f"hook target {target!r} is missing in SGLang {version}: "
                          f"{type(e).__name__}: {e}") from None


def _check_server_args(ver: Any, version: str) -> None:
    """What the argument rules use: the release's ``REQUIRED`` functions and every
    ``ServerArgs`` field the rules read."""
    for name in ver.REQUIRED:
        resolve(name, version)
    fields = ver.server_args_fields(resolve(ver.SERVER_ARGS, version))
    missing = [name for name in rules.fields_read(ver) if name not in fields]
    if missing:
        raise state.fatal(f"ServerArgs of SGLang {version} lacks the field(s) {missing} the "
                          f"plugin reads")


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Inert without ``VITRIFY_SGLANG_CONFIG`` (P1);
    otherwise config, version, every target, then registration (P2-P5); once per process (P9).
    Any error is fatal (P3): SGLang only logs what a plugin raises, so an unexpected exception
    is turned into ``state.PluginFatal`` too."""
    path = os.environ.get(state.CONFIG_ENV)
    if not path:
        return
    try:
        _register(path)
    except SystemExit:
        raise
    except Exception as e:
        raise state.fatal(f"registering the hooks failed: {type(e).__name__}: {e}") from e


def _register(path: str) -> None:
    st = state.STATE
    if st.registered:
        log.debug("vitrify SGLang plugin already registered in this process")
        return
    from . import config as _config

    try:
        cfg = _config.load(path)
    except _config.PluginConfigError as e:
        raise state.fatal(f"{state.CONFIG_ENV}: {e}") from None
    if not cfg.registers_hooks:
        st.config, st.registered = cfg, True
        log.info("vitrify SGLang plugin: mode 'off' in %s, no hooks registered", path)
        return
    version, ver = versions.installed()
    st.sglang_version, st.version = version, ver
    role = ver.process_role()
    if role not in ("launcher", "scheduler"):  # 0.5.23's detokenizer and DP controller
        st.config, st.role, st.registered = cfg, role, True
        log.info("vitrify SGLang plugin: the %s registers no hook (SGLang %s)", role, version)
        return
    registry = resolve(ver.REGISTRY, version)
    hook_type = resolve(ver.HOOK_TYPE, version)
    if cfg.mode == "save" and role == "scheduler":
        startup.record_kernels()  # first: resolving the targets imports the model runner
    hooks = hooks_for(cfg, role, ver)
    for target, kind, fn in hooks:
        resolve(target, version)
        if kind not in hook_type.__members__:
            raise state.fatal(f"hook kind {kind!r} for {target!r} is not a HookType of "
                              f"SGLang {version}")
        if isinstance(fn, type) and kind != "REPLACE":  # the registry would raise
            raise state.fatal(f"hook {fn.__name__} on {target!r} is a class; SGLang takes "
                              f"classes only as REPLACE hooks")
    steps = []
    if cfg.active and role == "launcher":  # SGLang resolves the arguments in the launcher
        for step, fn in ver.resolution_steps(rules.run_phase):
            try:
                steps.append((ver.step_registrar(step), fn))
            except Exception as e:
                raise state.fatal(f"resolution step {step!r} is missing in SGLang {version}: "
                                  f"{type(e).__name__}: {e}") from None
    if cfg.active:
        _check_server_args(ver, version)
        if cfg.jit_caches:
            st.jit_dirs = startup.setup_jit(cfg)
        if cfg.mode == "load":
            startup.narrow_models(cfg)
            st.read_ahead = startup.launcher_read_ahead(cfg, role)
            if cfg.standby_file:  # the launch's time, for the schedulers (startup.standby_since)
                os.environ.setdefault(startup.STANDBY_SINCE_ENV, repr(time.time()))
    # Everything resolved: from here on nothing can fail half-way (P2).
    st.config, st.role = cfg, role
    for target, kind, fn in hooks:
        registry.register(target, fn, hook_type[kind])
    for registrar, fn in steps:
        registrar(fn)
    st.registered = True
    log.info("vitrify SGLang plugin: mode %r, archive %s, weight updates %s, %d hook(s) and %d "
             "resolution step(s) registered in the %s (SGLang %s)", cfg.mode, cfg.archive,
             "on" if cfg.weight_updates else "off", len(hooks), len(steps), role, version)


__all__ = ["HOOKS", "Hook", "hooks_for", "register", "resolve"]
