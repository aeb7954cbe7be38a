"""The argument rules of the SGLang plugin (PLUGIN.md P6-P8, P11, P17).

Owns: what vitrify refuses in SGLang's server arguments (:data:`REFUSED_ARGS`,
:func:`refusals`; :data:`UNSUPPORTED`, :func:`unsupported`, :func:`check_supported`), what it
changes (prefill CUDA graphs off, P7; the dummy loader at LOAD, P11), the fingerprint (P8,
:func:`fingerprint`: the same function of the resolved arguments on every SGLang release), the
rule phases the version seams call while SGLang resolves the arguments (:func:`run_phase`) and
the scheduler's side (:func:`at_scheduler`). The same functions read an ``argparse.Namespace``
of SGLang's own parser (``vitrify sglang check``), the launcher's record and a scheduler's
pickled copy: how a value is read or changed is the version module's (``reader``,
``declare``). Imports only the standard library at import time.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from . import state, versions

log = logging.getLogger("vitrify.sglang")

DISABLED = "disabled"  # SGLang's cuda_graph_config Backend.DISABLED

# (field, flag, refused when, why). vitrify freezes one process on one GPU, allocating
# everything through its region; each of these breaks that. A release adds its own rows
# (versions.*.EXTRA_REFUSED).
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
    # deterministic inference picks other kernels (attention split, sampling): graphs captured
    # without it are not the server a deterministic launch asks for, and the reverse
    "enable_deterministic_inference", "sampling_backend",
)
# Fields read for the CUDA graph settings (the resolved cuda_graph_config, or the flags while it
# is unresolved: model_path "dummy"/"none" return before resolving it).
GRAPH_ARGS = (
    "cuda_graph_config", "cuda_graph_backend_decode", "cuda_graph_backend_prefill",
    "cuda_graph_max_bs_decode", "cuda_graph_bs_decode", "disable_prefill_cuda_graph",
    "disable_decode_cuda_graph", "disable_cuda_graph",
)
LOAD_ARGS = ("load_format", "quantization", "kv_cache_dtype", "model_loader_extra_config")

# (field, why) refused when set (truthy): each breaks "the same objects in the same order" or
# changes the weights after the span SAVE dumps is restored at LOAD (P17)
UNSUPPORTED = (
    ("enable_hierarchical_cache", "its host pool threads allocate outside the region"),
    ("enable_torch_compile", "what a JIT allocates depends on its caches (session P11)"),
    ("torchao_config", "it transforms the weights after loading, and LOAD restores them "
                       "transformed"),
    ("enable_lora", "adapters change the weights after loading"),
    ("enable_profile_cuda_graph", "the torch profiler is a second CUPTI subscriber"),
    ("enable_two_batch_overlap", "not read for the plan yet"),
    ("enable_pdmux", "not read for the plan yet"),
)
ATTENTION_BACKENDS = ("triton", "flashinfer")
DECODE_BACKENDS = ("full", "disabled")
# P11: the loaders and settings for which SGLang's dummy loader builds the same parameters in
# the same order and nothing derives values from the weights while loading
PLAIN_LOAD_FORMATS = ("auto", "safetensors", "pt", "npcache")


def _release(ver: Any) -> Any:
    return versions.current() if ver is None else ver


def refused_table(ver: Any = None) -> tuple:
    """:data:`REFUSED_ARGS` as release ``ver`` has them (its own rows added)."""
    ver = _release(ver)
    return tuple(r for r in REFUSED_ARGS if r[0] not in ver.ABSENT_FIELDS) + ver.EXTRA_REFUSED


def unsupported_table(ver: Any = None) -> tuple:
    ver = _release(ver)
    return tuple(r for r in UNSUPPORTED if r[0] not in ver.ABSENT_FIELDS)


def fields_read(ver: Any = None) -> tuple[str, ...]:
    """Every ``ServerArgs`` field the rules read on release ``ver`` (checked at registration,
    P2)."""
    ver = _release(ver)
    names = [r[0] for r in refused_table(ver)] + list(FINGERPRINT_ARGS) + list(GRAPH_ARGS) + \
        list(LOAD_ARGS) + [f for f, _ in unsupported_table(ver)]
    return tuple(dict.fromkeys(names))


def _plain(value: Any) -> Any:
    """A JSON-able copy (the fingerprint is compared with an archive's recorded one)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def refusals(args: Any, ver: Any = None, env: Mapping[str, str] | None = None) -> list[str]:
    """What of ``args`` (a ``ServerArgs``, or the ``argparse.Namespace`` SGLang's own parser
    makes) the rules refuse, one ``field=value (--flag): reason`` each, and with ``env`` the
    release's refused environment switches: the plugin stops the server on them,
    ``vitrify sglang check`` reports them."""
    ver = _release(ver)
    get = ver.reader(args)
    out = [f"{field}={get(field)!r} ({flag}): {why}"
           for field, flag, refused, why in refused_table(ver) if refused(get(field))]
    return out + (ver.refused_env(env) if env is not None else [])


def decode_backend(get: Callable[[str], Any]) -> str:
    """The decode graph backend: the resolved ``cuda_graph_config``'s, or (unresolved: the
    ``--cuda-graph-config`` JSON as SGLang's parser reads it, a dict) the flags'."""
    cfg = get("cuda_graph_config")
    if isinstance(cfg, dict):
        decode = cfg.get("decode")
        value = decode.get("backend") if isinstance(decode, dict) else None
    else:
        value = getattr(getattr(cfg, "decode", None), "backend", None)
    if value is None:
        value = get("cuda_graph_backend_decode") or "full"
    return str(getattr(value, "value", value))


def unsupported(args: Any, ver: Any = None, get: Callable[[str], Any] | None = None) -> list[str]:
    """What :func:`check_supported` refuses in ``args`` (a ``ServerArgs``, or the
    ``argparse.Namespace`` of SGLang's own parser: ``vitrify sglang check`` asks too), one
    line each. ``get``: how to read a field (default: the release's ``reader``)."""
    ver = _release(ver)
    get = ver.reader(args) if get is None else get
    problems = []
    for field in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
        value = get(field)
        if value is not None and value not in ATTENTION_BACKENDS:
            problems.append(f"{field}={value!r} (only {list(ATTENTION_BACKENDS)} are frozen yet)")
    if get("attention_backend") is None:
        problems.append("attention_backend unset (pass --attention-backend triton or flashinfer)")
    backend = decode_backend(get)
    if backend not in DECODE_BACKENDS:
        problems.append(f"decode graph backend {backend!r} (only {list(DECODE_BACKENDS)})")
    for field, why in unsupported_table(ver):
        if get(field):
            problems.append(f"{field}={get(field)!r} ({why})")
    return problems


def check_supported(args: Any, ver: Any = None, get: Callable[[str], Any] | None = None) -> None:
    """SAVE and LOAD accept the triton and FlashInfer attention backends (P17) and full (or no)
    decode graphs only (what the block-placement plan was read for); anything else is refused,
    all named at once, before the region exists (:func:`unsupported`)."""
    problems = unsupported(args, ver, get)
    if problems:
        raise state.FreezeRefused("; ".join(problems))


def prefill_asked(get: Callable[[str], Any], ver: Any) -> str:
    """The prefill graph backend before vitrify: the resolved ``cuda_graph_config``'s, else
    what the flags say in SGLang's precedence order, else SGLang's default."""
    cg = get("cuda_graph_config")
    before = None
    if isinstance(cg, dict):
        before = (cg.get("prefill") or {}).get("backend")
    elif cg is not None:
        before = cg.prefill.backend
    if before is None:
        if get("cuda_graph_backend_prefill") is not None:
            before = get("cuda_graph_backend_prefill")
        elif get("disable_prefill_cuda_graph") or get("disable_cuda_graph"):
            before = DISABLED
        else:
            before = ver.default_prefill_backend() or "SGLang's default"
    return str(getattr(before, "value", before))


def prefill_off_fields(get: Callable[[str], Any]) -> dict:
    """The fields that turn prefill CUDA graphs off: the flags
    ``cuda_graph_backend_prefill = "disabled"`` and ``disable_prefill_cuda_graph = True``, and
    ``cuda_graph_config`` (resolved: what the runtime publishes to the model runner; or the raw
    JSON, which outranks the flags) as a copy whose prefill backend is disabled."""
    fields: dict[str, Any] = {"cuda_graph_backend_prefill": DISABLED,
                              "disable_prefill_cuda_graph": True}
    cg = get("cuda_graph_config")
    if isinstance(cg, dict):
        cg = copy.deepcopy(cg)
        if not isinstance(cg.get("prefill"), dict):
            cg["prefill"] = {}
        cg["prefill"]["backend"] = DISABLED
        fields["cuda_graph_config"] = cg
    elif cg is not None:
        cg = copy.deepcopy(cg)
        cg.prefill.backend = DISABLED
        fields["cuda_graph_config"] = cg
    return fields


def load_format_change(get: Callable[[str], Any], mode: str) -> tuple[dict, str | None]:
    """P11: LOAD restores the weights from the archive, so the dummy loader runs when it is
    provably the same build (``{"load_format": "dummy"}`` and what to log); otherwise the
    configured loader runs and reads the checkpoint ({} and why)."""
    was = get("load_format")
    if mode != "load" or was == "dummy":
        return {}, None
    why = []
    if was not in PLAIN_LOAD_FORMATS:
        why.append(f"load_format={was!r}")
    if get("quantization"):
        why.append(f"quantization={get('quantization')!r}")
    if get("kv_cache_dtype") not in (None, "auto"):
        why.append(f"kv_cache_dtype={get('kv_cache_dtype')!r} (scales come from the weights)")
    if get("model_loader_extra_config") not in (None, "", "{}", {}):
        why.append("model_loader_extra_config set")
    if why:
        return {}, (f"vitrify (mode load): the configured loader reads the checkpoint "
                    f"({', '.join(why)}); the archive's weights then replace what it loaded")
    return {"load_format": "dummy"}, (f"vitrify (mode load): the weights come from the archive, "
                                      f"the checkpoint is not read (load_format was {was})")


def graph_settings(get: Callable[[str], Any]) -> dict:
    """The CUDA graph part of the fingerprint: decode backend, max batch size and sizes, prefill
    backend, from the resolved ``cuda_graph_config`` (or the flags while it is unresolved)."""
    cg = get("cuda_graph_config")
    if cg is not None and not isinstance(cg, dict):
        return {"cuda_graph_decode_backend": _plain(cg.decode.backend),
                "cuda_graph_decode_max_bs": cg.decode.max_bs,
                "cuda_graph_decode_bs": _plain(cg.decode.bs),
                "cuda_graph_prefill_backend": _plain(cg.prefill.backend)}
    decode = (cg or {}).get("decode", {})
    backend = decode.get("backend", get("cuda_graph_backend_decode"))
    if backend is None and (get("disable_decode_cuda_graph") or get("disable_cuda_graph")):
        backend = DISABLED
    return {"cuda_graph_decode_backend": backend,
            "cuda_graph_decode_max_bs": decode.get("max_bs", get("cuda_graph_max_bs_decode")),
            "cuda_graph_decode_bs": _plain(decode.get("bs", get("cuda_graph_bs_decode"))),
            "cuda_graph_prefill_backend": DISABLED}


def fingerprint(args: Any, ver: Any = None) -> dict:
    """The engine-shaping server arguments as a JSON-able dict (``FINGERPRINT_ARGS`` plus the
    CUDA graph backends and batch sizes), from the resolved values (P8)."""
    get = _release(ver).reader(args)
    fp = {name: _plain(get(name)) for name in FINGERPRINT_ARGS}
    fp.update(graph_settings(get))
    return fp


def _refuse(args: Any, ver: Any, mode: str, env: Mapping[str, str] | None) -> None:
    refused = refusals(args, ver, env)
    if refused:
        raise state.fatal(f"mode {mode!r} cannot freeze these server arguments yet: "
                          + "; ".join(refused))


def _prefill_off(args: Any, ver: Any, mode: str) -> None:
    """P7: prefill CUDA graphs off (one INFO line saying what they were)."""
    get = ver.reader(args)
    before = prefill_asked(get, ver)
    ver.declare(args, prefill_off_fields(get))
    if state.STATE.prefill_graphs_were is None:  # the first record's: later ones see "disabled"
        state.STATE.prefill_graphs_were = before
    if before == DISABLED:
        log.info("vitrify (mode %s): prefill CUDA graphs are off (vitrify does not freeze them "
                 "yet)", mode)
    else:
        log.info("vitrify (mode %s): prefill CUDA graphs forced off (backend was %s; vitrify does "
                 "not freeze them yet; pass --cuda-graph-backend-prefill disabled to size memory "
                 "without them)", mode, before)


def _keep_prefill_off(args: Any, ver: Any) -> None:
    """After SGLang resolved the graph config: still disabled (a later step that turned prefill
    graphs back on is overruled, with a warning)."""
    get = ver.reader(args)
    cg = get("cuda_graph_config")
    if cg is None or isinstance(cg, dict) or cg.prefill.backend == DISABLED:
        return
    log.warning("vitrify: SGLang resolved the prefill CUDA graph backend to %s after vitrify "
                "disabled it; disabled again", cg.prefill.backend)
    ver.declare(args, {"cuda_graph_config": prefill_off_fields(get)["cuda_graph_config"]})


def _load_format(args: Any, ver: Any, mode: str) -> None:
    fields, said = load_format_change(ver.reader(args), mode)
    if fields:
        ver.declare(args, fields)
    if said:
        log.info("%s", said)


def apply_server_args(args: Any, mode: str, ver: Any = None,
                      env: Mapping[str, str] | None = None) -> dict:
    """Refuse, change, fingerprint (P6-P8, P11), all at once: what 0.5.17's hook after
    ``ServerArgs.__post_init__`` does, and what ``vitrify sglang check`` shows on SGLang's
    parsed arguments. Raises :class:`~.state.PluginFatal` naming every refused argument;
    otherwise turns prefill CUDA graphs off (one log line), at LOAD picks the dummy loader where
    P11 allows, and returns the fingerprint. Calling it again on the same arguments leaves every
    value as it was and returns the same fingerprint."""
    ver = _release(ver)
    _refuse(args, ver, mode, env)
    _prefill_off(args, ver, mode)
    _load_format(args, ver, mode)
    return fingerprint(args, ver)


def run_phase(phase: str, args: Any, where: str) -> None:
    """A rule phase, called by the release's seam while SGLang resolves ``args`` (P6-P8, P11):

    - ``all``: :func:`apply_server_args` (0.5.17, after ``__post_init__``);
    - ``unresolved``: the same, for model_path "dummy"/"none" only (0.5.23 stops resolving
      those early);
    - ``prefill`` / ``prefill_check``: prefill graphs off before SGLang parses its graph flags,
      still off after;
    - ``load_format``: P11 once the load format is final;
    - ``final``: the refusals, prefill graphs still off, the fingerprint (the last step).

    Inert unless the plugin is active; any failure is the plugin's fatal (P3), ``where`` naming
    the hook."""
    cfg = state.STATE.config
    if cfg is None or not cfg.active:
        return
    try:
        ver = versions.current()
        if phase == "unresolved":
            if str(ver.reader(args)("model_path")).lower() not in ("none", "dummy"):
                return
            phase = "all"
        if phase == "all":
            state.STATE.fingerprint = apply_server_args(args, cfg.mode, ver, os.environ)
        elif phase == "prefill":
            _prefill_off(args, ver, cfg.mode)
        elif phase == "prefill_check":
            _keep_prefill_off(args, ver)
        elif phase == "load_format":
            _load_format(args, ver, cfg.mode)
        elif phase == "final":
            _refuse(args, ver, cfg.mode, os.environ)
            _keep_prefill_off(args, ver)
            state.STATE.fingerprint = fingerprint(args, ver)
        else:
            raise ValueError(f"no rule phase {phase!r}")
    except SystemExit:
        raise
    except Exception as e:
        raise state.fatal(f"{where} failed: {type(e).__name__}: {e}") from e


def at_scheduler(args: Any, mode: str, ver: Any = None) -> dict:
    """The scheduler's side of the rules, on its pickled record; returns the fingerprint.

    Where the release lets a scheduler change its record (0.5.17) the rules are applied again
    (:func:`apply_server_args`: an ``Engine(server_args=...)`` built before the plugin loaded
    never passed the launcher's hook; the published bags get the changes too). Otherwise
    (0.5.23: resolved and sealed) they are checked, read only. Either way what vitrify changes
    must have reached what this process's runtime reads (prefill graphs off in the published
    graph config; at LOAD the load format P11 decides), or the plugin's fatal names what is
    missing."""
    ver = _release(ver)
    if ver.SCHEDULER_REAPPLIES:
        fp = apply_server_args(args, mode, ver, os.environ)
    else:
        _refuse(args, ver, mode, os.environ)
        fp = fingerprint(args, ver)
    get = ver.reader(args)
    missing = []
    expect: dict[str, Any] = {"cuda_graph_config.prefill.backend": DISABLED}
    if mode == "load":
        fields, _ = load_format_change(get, mode)
        if fields:
            missing.append(f"load_format: {get('load_format')!r}, where vitrify's rule makes it "
                           f"'dummy'")
        expect["load_format"] = get("load_format")
    missing += ver.arrived(args, expect)
    if missing:
        how = ("the changes did not reach what SGLang reads" if ver.SCHEDULER_REAPPLIES else
               "SGLang resolved them without the plugin's resolution hooks (was "
               "ServerArgs.resolve_once() called before load_plugins()?)")
        raise state.fatal(f"mode {mode!r}: this scheduler's server arguments lack what vitrify "
                          f"changes ({'; '.join(missing)}): {how}")
    return fp


__all__ = ["ATTENTION_BACKENDS", "DECODE_BACKENDS", "DISABLED", "FINGERPRINT_ARGS", "GRAPH_ARGS",
           "LOAD_ARGS", "PLAIN_LOAD_FORMATS", "REFUSED_ARGS", "UNSUPPORTED", "apply_server_args",
           "at_scheduler", "check_supported", "decode_backend", "fields_read", "fingerprint",
           "graph_settings", "load_format_change", "prefill_asked", "prefill_off_fields",
           "refusals", "refused_table", "run_phase", "unsupported", "unsupported_table"]
