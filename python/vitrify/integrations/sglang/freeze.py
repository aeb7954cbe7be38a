"""FREEZE/THAW inside SGLang's scheduler process (PLUGIN.md, "FREEZE/THAW inside the scheduler").

SGLang's ``Scheduler.init_model_worker`` runs the session's phases itself, one call each, so the
hooks here drive an engine-driven session (``docs/session.md`` P12):

====================================================  ============================================
hook (AROUND unless said)                              session
====================================================  ============================================
``Scheduler.init_model_worker``                        ``start()``; the whole call routed into the
                                                       region; LOAD: ``finish()`` at its end
``ModelRunner.load_model``                             ``reached("built")``, ``reached("weights")``
``KVCacheConfigurator._resolve_memory_pool_config``    SAVE records the pool config, LOAD returns it
``ModelRunner.alloc_memory_pool``                      ``reached("state")``
``cuda_graph_setup.capture_decode_graph``              ``reached("warmup")`` before,
                                                       ``reached("captured")`` after
``runner_backend.utils.resolve_decode_backend``        SGLang's full-graph backend wrapped
                                                       (:func:`graph_backend_class`)
``decode_cuda_graph_runner.freeze_gc``                 the capture's collections without SGLang's
                                                       final unfreeze (:func:`around_freeze_gc`)
``Scheduler.handle_generate_request`` (AFTER)          SAVE counts the generate requests (health
                                                       checks not counted)
``Scheduler.on_idle`` (AFTER)                          SAVE: ``finish()`` at the first idle moment
                                                       after ``save_after_requests`` requests; both
                                                       modes: JIT compiles after the archive's
                                                       caches were packed are logged
====================================================  ============================================

The block-placement hazard (PLUGIN.md) is met the way the plan says: captures allocate from a
torch pool of their own over the region (:func:`vitrify.integrations.torch.capture_pool`), the
two warm-up forwards of each shape run on both sides, each capture's region segments are
recorded (:func:`vitrify.region.record_window`) and claimed at LOAD where the capture would have
run (:func:`vitrify.region.replay_window`), and each graph's outputs are recorded as region
offsets and rebuilt as views (:func:`describe`, :func:`rebuild`).

LOAD imports only the model module SAVE's model came from (:func:`narrow_model_registry`).
Only the triton attention backend and SGLang's full decode graphs are
accepted; anything else is refused at SAVE naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import os
import pkgutil
import re
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vitrify.sglang")

ENGINE = "sglang"
STATE_FORMAT = 1
ATTENTION_BACKENDS = ("triton", "flashinfer")
_ATTN = "sglang.srt.layers.attention"
# The attention backend classes whose decode graphs are frozen (exactly these: a subclass such as
# TRT-LLM's over FlashInfer's plans differently and was not read), by the name SGLang uses.
FROZEN_ATTENTION = {f"{_ATTN}.triton_backend.TritonAttnBackend": "triton",
                    f"{_ATTN}.flashinfer_backend.FlashInferAttnBackend": "flashinfer"}
# Backends that only route to others (SGLang 0.5.17): the attributes holding those others.
ATTENTION_WRAPPERS = {
    f"{_ATTN}.hybrid_attn_backend.HybridAttnBackend": ("prefill_backend", "decode_backend"),
    f"{_ATTN}.hybrid_linear_attn_backend.HybridLinearAttnBackend": ("full_attn_backend",
                                                                   "linear_attn_backend"),
    f"{_ATTN}.tbo_backend.TboAttnBackend": ("primary", "children"),
}
LEGACY_METADATA = ("init_forward_metadata_capture_cuda_graph",
                   "init_forward_metadata_replay_cuda_graph")
MODELS_PACKAGE = "sglang.srt.models"
DISABLED_ARCHS_ENV = "SGLANG_DISABLED_MODEL_ARCHS"
BEFORE_NARROWING_ENV = "VITRIFY_SGLANG_DISABLED_ARCHS_BEFORE"  # JSON: the user's value or null
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants.HEALTH_CHECK_RID_PREFIX (0.5.17)
STANDBY_SINCE_ENV = "VITRIFY_SGLANG_STANDBY_SINCE"  # the launch's time (seconds since the epoch)
STANDBY_POLL_S = 0.01  # how often a standby scheduler looks for its file
MAX_LENGTHS = 256  # SAVE records at most this many prompt lengths
WARMUP_BUDGET_S = 120.0  # LOAD's warm-up requests, all of them
JIT_WATCH_S = 30.0  # how often an idle scheduler looks for JIT compiles after the pack/thaw


class FreezeRefused(RuntimeError):
    """What this SGLang server does cannot be frozen (yet): one line naming it."""


# ---------------------------------------------------------------------------------------------
# the session adapter
# ---------------------------------------------------------------------------------------------


class Engine:
    """The session's adapter for an SGLang server (engine-driven: SGLang runs its own phases, so
    only the fingerprint is needed). ``model`` carries the model path and a digest of every
    engine-shaping server argument (plugin P8), so an archive of other arguments is refused."""

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


def graph_name(shape_key: Any) -> str:
    """The archive name of the decode graph of ``shape_key`` (SGLang's ``ShapeKey``: size,
    stream index, variant label): ``decode_bs<size>[_s<stream>][_<label>]``, file-name safe."""
    size = getattr(shape_key, "size", shape_key)
    name = f"decode_bs{int(size)}"
    stream = getattr(shape_key, "stream_idx", None)
    if stream is not None:
        name += f"_s{int(stream)}"
    label = getattr(shape_key, "variant_label", None)
    if label:
        name += "_" + re.sub(r"[^A-Za-z0-9_.-]", "-", str(label))
    return name


# ---------------------------------------------------------------------------------------------
# KV pool sizing: SAVE's, re-applied at LOAD
# ---------------------------------------------------------------------------------------------


def pool_config_state(config: Any) -> dict:
    """SGLang's ``MemoryPoolConfig`` (a dataclass) as plain JSON."""
    if not dataclasses.is_dataclass(config):
        raise FreezeRefused(f"the KV pool config is a {type(config).__name__}, not a dataclass: "
                            f"this SGLang is not the one the plugin was written for")
    state = dataclasses.asdict(config)
    json.dumps(state)  # plain values only (ints, floats, None)
    return state


def pool_config_from_state(cls: type, state: dict) -> Any:
    """SAVE's pool config rebuilt as ``cls``; its fields must be exactly the class's (another
    SGLang's config is refused naming the difference)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if set(state) != names:
        raise FreezeRefused(f"the archive's KV pool config has fields {sorted(set(state) - names)} "
                            f"this SGLang lacks and lacks {sorted(names - set(state))}")
    return cls(**state)


# ---------------------------------------------------------------------------------------------
# graph outputs: region offsets at SAVE, views at LOAD
# ---------------------------------------------------------------------------------------------


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr") and \
        hasattr(value, "stride")


def describe(value: Any, region: Any, path: str = "output") -> Any:
    """A captured graph's output as plain JSON: tensors as region offset, dtype, shape and
    stride (a tensor outside the region is refused: it would not exist at LOAD), dataclasses by
    qualified name and fields, lists, tuples, dicts with string keys, and plain values."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    if _is_tensor(value):
        ptr = int(value.data_ptr())
        if value.numel() and not (region.base <= ptr < region.base + region.size):
            raise FreezeRefused(f"{path}: a tensor at 0x{ptr:x} outside the region "
                                f"[0x{region.base:x}, +{region.size}): it would not exist at LOAD")
        return {"t": {"offset": ptr - region.base if value.numel() else 0,
                      "dtype": str(value.dtype).rpartition(".")[2],
                      "shape": list(value.shape), "stride": list(value.stride()),
                      "device": int(value.device.index or 0)}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {"dc": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: describe(getattr(value, f.name), region, f"{path}.{f.name}")
                           for f in dataclasses.fields(value)}}
    if isinstance(value, (list, tuple)):
        return {"seq": type(value).__name__,
                "items": [describe(v, region, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: describe(v, region, f"{path}[{k!r}]") for k, v in value.items()}}
    raise FreezeRefused(f"{path}: a {type(value).__module__}.{type(value).__qualname__} in a "
                        f"graph's output cannot be recorded")


def _sglang_class(spec: str) -> type:
    module, _, qualname = spec.partition(":")
    if not (module == "sglang" or module.startswith("sglang.")):
        raise FreezeRefused(f"the archive names output class {spec!r}; only SGLang's are rebuilt")
    obj = pkgutil.resolve_name(f"{module}:{qualname}")
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise FreezeRefused(f"the archive's output class {spec!r} is not a dataclass here")
    return obj


def rebuild(desc: Any, region: Any, tensor_at: Callable[..., Any],
            resolve_class: Callable[[str], type] = _sglang_class) -> Any:
    """The value :func:`describe` recorded, tensors made by ``tensor_at(address, dtype, shape,
    stride, device)`` over the region's memory."""
    if not isinstance(desc, dict) or len(desc) not in (1, 2):
        raise FreezeRefused(f"not a recorded output: {desc!r:.100}")
    if "v" in desc:
        return desc["v"]
    if "t" in desc:
        t = desc["t"]
        return tensor_at(region.base + int(t["offset"]), t["dtype"], tuple(t["shape"]),
                         tuple(t["stride"]), int(t.get("device", 0)))
    if "dc" in desc:
        cls = resolve_class(desc["dc"])
        return cls(**{k: rebuild(v, region, tensor_at, resolve_class)
                      for k, v in desc["fields"].items()})
    if "seq" in desc:
        items = [rebuild(v, region, tensor_at, resolve_class) for v in desc["items"]]
        return tuple(items) if desc["seq"] == "tuple" else items
    if "dict" in desc:
        return {k: rebuild(v, region, tensor_at, resolve_class) for k, v in desc["dict"].items()}
    raise FreezeRefused(f"not a recorded output: {desc!r:.100}")


# ---------------------------------------------------------------------------------------------
# the process's FREEZE/THAW
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One scheduler process's FREEZE (mode "save") or THAW (mode "load")."""

    mode: str
    session: Any
    region: Any
    device: int
    graphs: dict = dataclasses.field(default_factory=dict)  # name -> {"window", "outputs"}
    pool_config: dict | None = None
    routed: list | None = None  # the routed pool's blocks at "captured" (routed_blocks)
    loaded: Any = None  # LOAD: the rebuilt graphs (vitrify.graph.LoadedGraphs)
    pending_finish: bool = False  # SAVE: captured; the archive is written at the first idle
    summary: dict | None = None
    model_modules: list | None = None  # SAVE: what the model registry needs (model_modules)
    requests: int = 0  # SAVE: generate requests seen before the archive was written
    request_lengths: list = dataclasses.field(default_factory=list)  # SAVE: their prompt lengths
    jit_index: dict | None = None  # the archive's JIT index once packed (SAVE) / thawed (LOAD)
    jit_dirs: dict | None = None
    jit_seen: set = dataclasses.field(default_factory=set)  # JIT files reported already
    jit_checked: float = 0.0
    timings: dict = dataclasses.field(default_factory=dict)  # decode-graph loop, seconds

    def engine_state(self) -> dict:
        return {"format": STATE_FORMAT, "pool_config": self.pool_config, "graphs": self.graphs,
                "routed_blocks": self.routed, "model_modules": self.model_modules,
                "request_lengths": self.request_lengths}

    def load_engine_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise FreezeRefused(f"the archive's SGLang state has format "
                                f"{(state or {}).get('format')!r}, this vitrify reads "
                                f"{STATE_FORMAT}")
        self.pool_config = state.get("pool_config")
        self.graphs = dict(state.get("graphs") or {})
        self.routed = state.get("routed_blocks")
        if not isinstance(self.routed, list):
            raise FreezeRefused("the archive's SGLang state has no routed block map")


RUN: Run | None = None


def _plugin():
    from . import plugin

    return plugin


def _fatal(message: str) -> BaseException:
    return _plugin().fatal(message)


# (field, why) refused when set (truthy): each breaks "the same objects in the same order" or
# changes the weights after the span SAVE dumps is restored at LOAD
_UNSUPPORTED = (
    ("enable_hierarchical_cache", "its host pool threads allocate outside the region"),
    ("enable_torch_compile", "what a JIT allocates depends on its caches (session P11)"),
    ("torchao_config", "it transforms the weights after loading, and LOAD restores them "
                       "transformed"),
    ("enable_lora", "adapters change the weights after loading"),
    ("enable_profile_cuda_graph", "the torch profiler is a second CUPTI subscriber"),
    ("enable_two_batch_overlap", "not read for the plan yet"),
    ("enable_pdmux", "not read for the plan yet"),
)
DECODE_BACKENDS = ("full", "disabled")


def _decode_backend(args: Any) -> str:
    cfg = getattr(args, "cuda_graph_config", None)
    if isinstance(cfg, dict):  # unresolved: --cuda-graph-config as SGLang's parser reads it
        decode = cfg.get("decode")
        value = decode.get("backend") if isinstance(decode, dict) else None
    else:
        value = getattr(getattr(cfg, "decode", None), "backend", None)
    if value is None:
        value = getattr(args, "cuda_graph_backend_decode", None) or "full"
    return str(getattr(value, "value", value))


def check_supported(args: Any) -> None:
    """SAVE and LOAD accept the triton and FlashInfer attention backends (P17) and full (or no)
    decode graphs only (what the block-placement plan was read for); anything else is refused,
    all named at once, before the region exists (:func:`unsupported`)."""
    problems = unsupported(args)
    if problems:
        raise FreezeRefused("; ".join(problems))


def unsupported(args: Any) -> list[str]:
    """What :func:`check_supported` refuses in ``args`` (a ``ServerArgs``, or the
    ``argparse.Namespace`` of SGLang's own parser: ``vitrify sglang check`` asks too), one
    line each."""
    problems = []
    for field in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
        value = getattr(args, field, None)
        if value is not None and value not in ATTENTION_BACKENDS:
            problems.append(f"{field}={value!r} (only {list(ATTENTION_BACKENDS)} are frozen yet)")
    if getattr(args, "attention_backend", None) is None:
        problems.append("attention_backend unset (pass --attention-backend triton or flashinfer)")
    backend = _decode_backend(args)
    if backend not in DECODE_BACKENDS:
        problems.append(f"decode graph backend {backend!r} (only {list(DECODE_BACKENDS)})")
    for field, why in _UNSUPPORTED:
        if getattr(args, field, None):
            problems.append(f"{field}={getattr(args, field)!r} ({why})")
    return problems


def _class_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def attention_leaves(backend: Any, path: str = "attn_backend") -> list[tuple[str, Any]]:
    """The attention backends that run attention under ``backend``, with where each sits: a
    routing backend (``ATTENTION_WRAPPERS``: prefill/decode split, hybrid linear attention,
    two-batch overlap) is looked through, nested ones too; the same object reached twice is
    listed once."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def walk(obj: Any, where: str) -> None:
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        fields = ATTENTION_WRAPPERS.get(_class_name(obj))
        if fields is None:
            out.append((where, obj))
            return
        for field in fields:
            child = getattr(obj, field, None)
            if isinstance(child, (list, tuple)):
                for i, c in enumerate(child):
                    walk(c, f"{where}.{field}[{i}]")
            else:
                walk(child, f"{where}.{field}")

    walk(backend, path)
    return out


def metadata_api(backend: Any) -> str:
    """Which graph-metadata interface ``backend``'s class implements: "current" (its own
    ``init_forward_metadata_out_graph``, what SGLang 0.5.17's runner calls at capture and
    replay), "legacy" (only ``init_forward_metadata_capture_cuda_graph`` /
    ``..._replay_cuda_graph``, which that runner no longer calls), or "none"."""
    own = [k for k in type(backend).__mro__ if k.__name__ != "AttentionBackend"
           and k is not object]
    if any("init_forward_metadata_out_graph" in vars(k) for k in own):
        return "current"
    if any(name in vars(k) for k in own for name in LEGACY_METADATA):
        return "legacy"
    return "none"


def check_attention(backend: Any) -> list[str]:
    """The kinds (``FROZEN_ATTENTION``'s values) of the attention backends under ``backend``,
    after checking each is one whose graphs are frozen and prepares its graph metadata the way
    the graph runner asks; anything else is a :class:`FreezeRefused` naming every one."""
    problems, kinds = [], []
    leaves = attention_leaves(backend)
    if not leaves:
        raise FreezeRefused("attention backend: the model runner has none (attn_backend unset)")
    for where, leaf in leaves:
        kind = FROZEN_ATTENTION.get(_class_name(leaf))
        if kind is None:
            problems.append(f"{where} is {type(leaf).__name__} (frozen: "
                            f"{', '.join(n.rsplit('.', 1)[1] for n in FROZEN_ATTENTION)})")
        elif (api := metadata_api(leaf)) != "current":
            problems.append(f"{where} ({type(leaf).__name__}) prepares graph metadata through "
                            f"{'the legacy ' + ' / '.join(LEGACY_METADATA) if api == 'legacy' else 'no method'}"
                            f", which SGLang's graph runner does not call (it calls "
                            f"init_forward_metadata_out_graph)")
        else:
            kinds.append(kind)
    if problems:
        raise FreezeRefused("attention backend: " + "; ".join(problems))
    return kinds


def around_init_model_worker(original: Callable, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Open the session, route the whole start-up into its region, and at LOAD finish it."""
    global RUN
    p = _plugin()
    cfg = p.STATE.config
    if cfg is None or not cfg.active:
        return original(scheduler, *args, **kwargs)
    from ... import archive as _archive
    from ... import session as _session
    from .. import torch as vt

    sargs = scheduler.server_args
    try:
        fp = p.apply_server_args(sargs, cfg.mode)
        check_supported(sargs)
    except FreezeRefused as e:
        raise _fatal(f"mode {cfg.mode!r}: {e}") from None
    device = scheduler_gpu(scheduler)
    engine = Engine(fp, p.STATE.sglang_version or "unknown")
    standby = cfg.mode == "load" and bool(cfg.standby_file)
    if cfg.mode == "save":
        # LOAD re-runs warmup and maps the graphs span without restoring it (below), so SAVE
        # writes neither span: the archive holds the weights span
        sess = _session.FreezeSession(engine, cfg.archive, region_bytes=cfg.region_bytes,
                                      device=device, dump_warmup=False, dump_graph_span=False)
    else:
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
        sess = _session.ThawSession(engine, cfg.archive, device=device, warmup_restore=False,
                                    restore_graph_span=False,
                                    direct_io=read_ahead_direct_io(cfg.archive),
                                    exportable=exportable)
    try:
        if standby:  # an archive that cannot thaw here is refused before the wait, not after
            archive = _archive.open_archive(cfg.archive, expect=_session._fingerprint(engine,
                                                                                     device))
            # what can be done before the go is done before it: the full collection, Triton's
            # cache key, the spans the thaw restores read into the page cache (until the go)
            freeze_import_heap(collect=True)
            warm_triton_key(background=False)
            reading = SpanPrefetch(archive)
            try:
                wait_for_file(cfg.standby_file, since=standby_since())
            finally:
                reading.finish()
        else:
            freeze_import_heap(collect=False)
            warm_triton_key(background=True)  # hashes Triton's library while the engine builds
        region = sess.start()
    except _archive.ArchiveMismatch as e:
        if cfg.on_mismatch == "cold-start":
            log.warning("vitrify: the archive does not match this server (%s); starting cold "
                        "(on_mismatch = \"cold-start\")", e)
            widen_model_registry()  # the registry must know whatever model this server names
            if standby and not os.path.lexists(cfg.standby_file):  # cold needs the GPU too
                wait_for_file(cfg.standby_file, since=standby_since())
            return original(scheduler, *args, **kwargs)
        raise _fatal(f"the archive does not match this server: {e} (on_mismatch = "
                     f"\"cold-start\" starts it cold instead)") from None
    except (_archive.ArchiveError, _session.SessionError, OSError, MemoryError,
            RuntimeError, ValueError) as e:
        raise _fatal(f"mode {cfg.mode!r}: opening the session failed: {type(e).__name__}: "
                     f"{e}") from None
    RUN = run = Run(cfg.mode, sess, region, device)
    try:
        if cfg.mode == "load":
            run.load_engine_state(sess.frozen_state)
        with vt.region_allocations(region), _profiled(f"init_model_worker-{cfg.mode}"):
            result = original(scheduler, *args, **kwargs)
        if "captured" not in region.checkpoints:
            raise FreezeRefused("the scheduler's start-up ended before its decode graphs were "
                                "set up (the capture hook never ran)")
        if cfg.mode == "load":
            _, run.loaded = sess.finish()
            run.summary = sess.summary
            run.jit_checked = time.monotonic()
            log.info("vitrify: thawed %s in %.2f s (%d graphs)", cfg.archive,
                     sess.summary["timings"].get("total", 0.0), sess.summary["graphs"])
        else:
            run.pending_finish = True
        return result
    except BaseException as e:
        sess.abort()
        RUN = None
        if isinstance(e, (FreezeRefused, _archive.ArchiveError, _session.SessionError)):
            raise _fatal(f"mode {cfg.mode!r}: {e}") from None
        if isinstance(e, own_errors()):  # a damaged span file, a graph or region refused, ...
            raise _fatal(f"mode {cfg.mode!r}: {type(e).__name__}: {e}"
                         + (f" (vitrify verify {cfg.archive} checks every file of the archive)"
                            if cfg.mode == "load" else "")) from None
        raise


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


def warm_triton_key(background: bool) -> Any:
    """Compute Triton's cache key (``triton.runtime.cache.triton_key``: a SHA-256 of Triton's
    sources and its ~0.5 GB native library, 0.35 s on the H200's host, cached per process) now,
    not inside the first kernel launch, where a thawed start met it in its capture step.
    ``background``: on a thread (the hashing releases the GIL) that overlaps the engine's
    build; returns the thread, or None (done, or no Triton)."""
    try:
        from triton.runtime.cache import triton_key
    except Exception:  # noqa: BLE001 - no Triton (or another one): nothing to warm
        return None

    def run() -> None:
        t0 = time.perf_counter()
        try:
            triton_key()
        except Exception as e:  # noqa: BLE001 - the first launch computes it then
            log.debug("vitrify: Triton's cache key not computed ahead: %s", e)
            return
        log.debug("vitrify: Triton's cache key computed in %.2f s", time.perf_counter() - t0)

    if not background:
        run()
        return None
    import pkgutil
    import threading

    # triton_key walks Triton's subpackages, importing the ones not imported yet: that walk
    # runs here, so the thread below only finds them imported (no import beside the engine's)
    try:
        import triton

        root = os.path.dirname(os.path.abspath(triton.__file__))
        for sub in ("compiler", "backends", "language"):
            for _ in pkgutil.walk_packages([os.path.join(root, sub)], prefix=f"triton.{sub}."):
                pass
    except Exception as e:  # noqa: BLE001 - the key is then computed at the first launch
        log.debug("vitrify: Triton's packages not walked ahead: %s", e)
        return None

    t = threading.Thread(target=run, name="vitrify-triton-key", daemon=True)
    t.start()
    return t


class SpanPrefetch:
    """A read of the spans a thaw restores (the weights span) through the page cache, on a
    thread: a standby's until :meth:`finish` (its go), the launcher's (P18) to the end. The
    restore then reads from memory instead of the drive. A read that fails is logged; the thaw
    reads the file itself then. ``who`` starts the log lines."""

    def __init__(self, archive: Any, rank: int | None = None, who: str = "standby"):
        import threading

        from ... import session as _session
        from ... import snapshot

        spans = archive.spans(_session.RANK if rank is None else rank)
        self.paths = [archive.file_path(spans[n]) for n in (snapshot.WEIGHTS_SPAN,) if n in spans]
        self.sizes = {}
        for path in self.paths:
            try:
                self.sizes[path] = os.path.getsize(path)
            except OSError:
                self.sizes[path] = 0
        self.who = who
        self.results: dict[str, dict] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"vitrify-{who}-read", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from ... import snapshot

        for path in self.paths:
            if self.stop.is_set():
                break
            try:
                self.results[path] = snapshot.prefetch(path, self.stop)
            except OSError as e:
                self.results[path] = {"error": f"{type(e).__name__}: {e}"}
        if self.paths and all(r.get("complete") for r in self.results.values()) and \
                len(self.results) == len(self.paths):
            log.info("vitrify: %s: the spans the thaw restores are in the page cache "
                     "(%.2f GiB in %.1f s)%s", self.who,
                     sum(r["bytes"] for r in self.results.values()) / 2**30,
                     sum(r["seconds"] for r in self.results.values()),
                     "; a go now thaws without the drive" if self.who == "standby" else "")
        else:
            errors = [f"{os.path.basename(p)}: {r['error']}" for p, r in self.results.items()
                      if "error" in r]
            if errors and self.who != "standby":  # a standby logs it at its go
                log.warning("vitrify: %s: not read: %s", self.who, "; ".join(errors))

    def finish(self) -> dict:
        """Stop reading (at the next piece), wait for the thread, log what was read."""
        self.stop.set()
        self.thread.join()
        done = sum(r.get("bytes", 0) for r in self.results.values())
        size = sum(self.sizes.values())
        errors = [f"{os.path.basename(p)}: {r['error']}" for p, r in self.results.items()
                  if "error" in r]
        secs = sum(r.get("seconds", 0.0) for r in self.results.values())
        log.info("vitrify: %s: %.2f of %.2f GiB of the spans the thaw restores read into "
                 "the page cache in %.1f s%s", self.who, done / 2**30, size / 2**30, secs,
                 f"; not read: {'; '.join(errors)}" if errors else "")
        return {"bytes": done, "size": size, "seconds": secs, "errors": errors}


READ_AHEAD_ENV = "VITRIFY_SGLANG_READ_AHEAD"  # the span file the launcher reads ahead
READ_AHEAD_SHARE = 0.5  # read ahead only spans that fit in this share of the available memory


def memory_available() -> int | None:
    """Bytes of memory the kernel counts as available (``MemAvailable``), or None."""
    from ... import doctor

    try:
        return doctor._read_meminfo().get("MemAvailable")
    except OSError:
        return None


def start_read_ahead(archive_path: str, env: Any = None) -> SpanPrefetch | None:
    """P18, in the launcher: read the weights span through the page cache on a thread while the
    scheduler starts (its imports take tens of seconds; the read, the drive's time), and tell
    the scheduler so (``VITRIFY_SGLANG_READ_AHEAD`` names the file: its thaw reads it through
    the cache, where pages this read has not reached yet come from the drive as it reads them
    too). Nothing is read when the span is already
    cached, or would take more than half the available memory (it would push itself out:
    read twice). Returns the read, or None."""
    from ... import archive as _archive
    from ... import session as _session
    from ... import snapshot

    env = os.environ if env is None else env
    try:
        archive = _archive.open_archive(archive_path)
        rel = archive.spans(_session.RANK).get(snapshot.WEIGHTS_SPAN)
        if rel is None:
            log.info("vitrify: read-ahead: the archive has no weights span to read")
            return None
        path = archive.file_path(rel)
        size = os.path.getsize(path)
    except (_archive.ArchiveError, OSError) as e:  # the thaw reports it, fatally
        log.info("vitrify: read-ahead: not started: %s", e)
        return None
    share = snapshot.page_cache_share(path)
    if share is not None and share >= snapshot.CACHED_SHARE:
        log.info("vitrify: read-ahead: the weights span is in the page cache already")
        return None
    room = memory_available()
    if room is not None and size > READ_AHEAD_SHARE * room:
        log.info("vitrify: read-ahead: off: the weights span (%.2f GiB) is more than half the "
                 "memory available (%.2f GiB); the thaw reads it from the drive",
                 size / 2**30, room / 2**30)
        return None
    env[READ_AHEAD_ENV] = f"{os.getpid()}:{path}"
    log.info("vitrify: read-ahead: reading the weights span (%.2f GiB) through the page cache "
             "while the scheduler starts", size / 2**30)
    return SpanPrefetch(archive, who="read-ahead")


def read_ahead_direct_io(archive_path: str, env: Any = None,
                         launcher_pid: int | None = None) -> str | None:
    """The thaw's ``direct_io`` for this archive: "off" (through the page cache) when this
    process's launcher (``launcher_pid``, default the parent process) is reading its weights
    span ahead (:func:`start_read_ahead`: ``<pid>:<path>``), else None (the setting, which
    decides by what the cache holds). A value another launcher left in the environment (an
    engine started inside a process that launched one before) does not count."""
    env = os.environ if env is None else env
    pid, _, ahead = (env.get(READ_AHEAD_ENV) or "").partition(":")
    if not ahead:
        return None
    if launcher_pid is None:
        import multiprocessing

        parent = multiprocessing.parent_process()
        launcher_pid = parent.pid if parent is not None else os.getppid()
    if pid != str(launcher_pid):
        return None
    root = os.path.abspath(archive_path)
    return "off" if os.path.commonpath([os.path.abspath(ahead), root]) == root else None


def freeze_import_heap(collect: bool) -> int:
    """Move every object the collector tracks now (what the imports built: SGLang, torch,
    transformers; hundreds of thousands of objects) to its permanent generation (PLUGIN.md P16),
    so later collections walk only what the start-up builds. ``collect``: a full collection
    first (a standby pays it before its go); without it the imports' few cyclic leftovers stay.
    Returns the objects moved."""
    t0 = time.perf_counter()
    freed = gc.collect() if collect else 0
    before = gc.get_freeze_count()
    gc.freeze()
    moved = gc.get_freeze_count() - before
    # every generation is empty now: this walks nothing and zeroes the collector's counters, so
    # the start-up's automatic collections come at the same points with or without ``collect``
    gc.collect()
    log.info("vitrify: %d objects of the imports moved to the collector's permanent generation "
             "in %.2f s%s", moved, time.perf_counter() - t0,
             f" (a full collection first freed {freed})" if collect else "")
    return moved


@contextlib.contextmanager
def capture_collections(enable_cudagraph_gc: bool):
    """SGLang's ``freeze_gc`` for the decode capture (a collection; unless
    ``enable_cudagraph_gc``, a freeze, the capture and a collection) without its
    ``gc.unfreeze()``: that would put the import heap :func:`freeze_import_heap` froze back
    into the oldest generation, and its last collection would walk all of it again (~0.5 s per
    full collection on the H200's host). What the start-up built before the capture stays frozen, as SGLang's own
    ``/freeze_gc`` leaves a served process."""
    gc.collect()
    if not enable_cudagraph_gc:
        gc.freeze()
    try:
        yield
    finally:
        if not enable_cudagraph_gc:
            gc.collect()


def around_freeze_gc(original: Callable, enable_cudagraph_gc: bool, *args: Any,
                     **kwargs: Any) -> Any:
    """AROUND ``decode_cuda_graph_runner.freeze_gc`` (the name its ``capture`` looks up;
    SGLang's registry rebinds the other modules that imported the function too): in a freezing
    or thawing scheduler, :func:`capture_collections` instead (both modes, so the collections
    free the same objects at the same points); elsewhere SGLang's own."""
    if RUN is None:
        return original(enable_cudagraph_gc, *args, **kwargs)
    return capture_collections(enable_cudagraph_gc)


@contextlib.contextmanager
def _profiled(what: str):
    """With ``VITRIFY_SGLANG_PROFILE`` (``config.settings().sglang_profile``) naming a
    directory: the block runs under cProfile and its 60 costliest calls (cumulative time) are
    written there as ``<what>-<pid>.txt``, for finding where a start-up's seconds go; a
    diagnostic (it slows the block down)."""
    from ... import config

    out = config.settings().sglang_profile
    if not out:
        yield
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        try:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
            path = os.path.join(out, f"{what}-{os.getpid()}.txt")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text.getvalue())
            log.info("vitrify: profile of %s written to %s", what, path)
        except OSError as e:
            log.warning("vitrify: profile of %s not written: %s", what, e)


def standby_since() -> float:
    """When this server was launched (the launcher's plugin records it): a standby file older
    than that is a leftover of an earlier restart and does not end the standby."""
    try:
        return float(os.environ.get(STANDBY_SINCE_ENV, "0"))
    except ValueError:
        return 0.0


def _fresh(path: str, since: float) -> bool:
    try:
        return os.stat(path).st_mtime >= since
    except OSError:
        return False


def wait_for_file(path: str, since: float = 0.0, poll_s: float = STANDBY_POLL_S) -> float:
    """LOAD in standby: block until ``path`` exists with a modification time at or after
    ``since`` (the operator's go for this launch); seconds waited."""
    t0 = time.monotonic()
    if _fresh(path, since):
        log.info("vitrify: standby: %s exists already, thawing at once", path)
        return 0.0
    if os.path.lexists(path):
        log.warning("vitrify: standby: %s is older than this launch (a leftover): it counts once "
                    "created again or touched", path)
    log.info("vitrify: standby: imports done; waiting for %s before the thaw", path)
    while not _fresh(path, since):
        time.sleep(poll_s)
    waited = time.monotonic() - t0
    log.info("vitrify: standby ended after %.1f s (%s appeared); thawing", waited, path)
    return waited


def scheduler_gpu(scheduler: Any) -> int:
    """The GPU of a scheduler process: SGLang 0.5.17 keeps it in ``scheduler.ps.gpu_id``."""
    ps = getattr(scheduler, "ps", None)
    gpu = getattr(ps, "gpu_id", None)
    if gpu is None:
        raise FreezeRefused("cannot tell this scheduler's GPU (no scheduler.ps.gpu_id): this is "
                            "not the SGLang the plugin was written for")
    return int(gpu)


def routed_blocks(region: Any) -> list[list[int]]:
    """The routed pool's taken blocks (region offset, size), ascending: where every live tensor
    of the routed pool sits, what FREEZE and THAW must agree on where a capture was skipped
    (the block-placement hazard; the region's own checkpoints see only segments). Free blocks
    are left out: they are the gaps between taken ones, and a wholly free segment holds no
    tensor. A block waiting to be freed counts as taken. Two tensors of one size that swapped
    places would not show here: the plan keeps the order of requests equal instead."""
    import torch

    from .. import torch as vt

    pool = vt.mem_pool(region)
    if hasattr(pool, "snapshot"):
        segments = pool.snapshot()
        if isinstance(segments, dict):
            segments = segments.get("segments", [])
    else:  # older torch: the process snapshot, this pool's segments
        segments = [seg for seg in torch.cuda.memory.memory_snapshot()
                    if tuple(seg.get("segment_pool_id", ())) == tuple(pool.id)]
    out = []
    for seg in sorted(segments, key=lambda sg: sg["address"]):
        addr = int(seg["address"])
        for b in seg["blocks"]:
            addr = int(b.get("address", addr))
            if b["state"] != "inactive":
                out.append([addr - region.base, int(b["size"])])
            addr += int(b["size"])
    return sorted(out)


def _check_blocks(frozen: list, here: list) -> None:
    if frozen == here:
        return
    first = next((i for i, (a, b) in enumerate(zip(frozen, here)) if a != b),
                 min(len(frozen), len(here)))
    f = frozen[first] if first < len(frozen) else None
    h = here[first] if first < len(here) else None
    raise FreezeRefused(f"the decode graphs' tensors are not where SAVE put them: the routed "
                        f"pool's taken block {first} is {h} (offset, size) here but was {f} at "
                        f"SAVE ({len(here)} vs {len(frozen)} blocks); refusing to replay graphs "
                        f"that would read other addresses")


def model_modules(model: Any) -> list[str]:
    """The modules of SGLang's model package whose ``EntryClass`` is the class of ``model`` or
    of one of its submodules (short names, as ``SGLANG_DISABLED_MODEL_ARCHS`` spells them): all
    SGLang's model registry needs to build this model. [] when none is found (a model from
    another package)."""
    import sys

    if model is None:
        return []
    # the model's class and its submodules' (a multimodal model resolves its language model and
    # vision tower through the registry while it is built)
    walk = getattr(model, "modules", None)
    classes = {type(m) for m in walk()} if callable(walk) else set()
    classes.add(type(model))
    found = set()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(MODELS_PACKAGE + "."):
            continue
        entry = getattr(module, "EntryClass", None)
        if any(e in classes for e in (entry if isinstance(entry, (list, tuple)) else [entry])
               if isinstance(e, type)):
            found.add(name.rpartition(".")[2])
    return sorted(found)


def narrow_model_registry(modules: Any, env: Any = None) -> int:
    """LOAD: SGLang's model registry imports every module of its model package (about 2 s,
    inside the scheduler's start-up) to find the one class SAVE's model came from. Every other
    module is added to ``SGLANG_DISABLED_MODEL_ARCHS`` (SGLang's own switch; entries already
    there are kept) so the registry imports only ``modules``. Returns how many were disabled;
    0 when not narrowed (nothing recorded, or a recorded module missing here)."""
    import importlib.util

    env = os.environ if env is None else env
    if not modules or not isinstance(modules, list) or \
            not all(isinstance(m, str) and m for m in modules):
        return 0
    try:
        spec = importlib.util.find_spec(MODELS_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return 0
    names = {m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)
             if not m.ispkg}
    if not set(modules) <= names:
        log.warning("vitrify: the archive's model module(s) %s are not in this SGLang's %s; "
                    "its model registry imports every module", sorted(set(modules) - names),
                    MODELS_PACKAGE)
        return 0
    if BEFORE_NARROWING_ENV not in env:  # the user's own setting, for widen_model_registry
        env[BEFORE_NARROWING_ENV] = json.dumps(env.get(DISABLED_ARCHS_ENV))
    have = [x.strip() for x in env.get(DISABLED_ARCHS_ENV, "").split(",") if x.strip()]
    disabled = names - set(modules)
    env[DISABLED_ARCHS_ENV] = ",".join(sorted(set(have) | disabled))
    return len(disabled)


def widen_model_registry(env: Any = None) -> bool:
    """Undo :func:`narrow_model_registry` (the user's own ``SGLANG_DISABLED_MODEL_ARCHS`` back):
    LOAD starting cold builds whatever model the server names. True when something was undone;
    it takes effect where SGLang's registry is not imported yet (the scheduler before
    ``load_model``)."""
    env = os.environ if env is None else env
    if BEFORE_NARROWING_ENV not in env:
        return False
    try:
        before = json.loads(env.pop(BEFORE_NARROWING_ENV))
    except ValueError:
        before = None
    if isinstance(before, str):
        env[DISABLED_ARCHS_ENV] = before
    else:
        env.pop(DISABLED_ARCHS_ENV, None)
    return True


def archive_engine_state(path: str) -> dict:
    """The engine state SAVE wrote into the archive at ``path`` (rank 0's), for the launcher's
    uses of it before any session opens the archive."""
    from ... import archive as _archive

    return _archive.open_archive(path).state(0).get("engine") or {}


def _jit_watch(run: Run) -> None:
    """Log JIT cache files written after the archive's caches were packed (SAVE) or thawed
    (LOAD): at most every ``JIT_WATCH_S`` seconds of idle time, once per new batch."""
    now = time.monotonic()
    if now - run.jit_checked < JIT_WATCH_S:
        return
    run.jit_checked = now
    from ... import archive as _archive
    from ... import jit

    try:  # a report only: nothing here may reach SGLang's scheduler loop
        if run.mode == "load" and run.jit_dirs is None:  # first look after the thaw
            run.jit_dirs = dict(_plugin().STATE.jit_dirs or {})
            run.jit_index = jit.read_index(_archive.open_archive(_plugin().STATE.config.archive))
        if not run.jit_dirs or run.jit_index is None:
            return
        new = jit.compiled_since(run.jit_dirs, run.jit_index)
    except Exception as e:
        log.warning("vitrify: JIT watch off: %s: %s", type(e).__name__, e)
        run.jit_dirs = {}
        return
    files = {f"{n}/{f}" for n, v in new.items() for f in v}
    if files <= run.jit_seen:
        return
    run.jit_seen |= files
    count = len(run.jit_seen)
    example = next((f"{n}/{v[0]}" for n, v in new.items() if v), "")
    if run.mode == "save":
        log.warning("vitrify: %d JIT cache file(s) written after SAVE packed its caches (e.g. "
                    "%s): they are not in the archive and LOAD compiles them again; "
                    "save_after_requests freezes after more traffic", count, example)
    else:
        log.warning("vitrify: %d JIT cache file(s) written since the thaw (e.g. %s): kernels "
                    "SAVE never compiled (save_after_requests at SAVE covers more traffic)",
                    count, example)


def after_handle_generate_request(result: Any, scheduler: Any, recv_req: Any = None,
                                  *args: Any, **kwargs: Any) -> Any:
    """SAVE: count the generate requests before the archive is written (health checks not)."""
    run = RUN
    if run is not None and run.mode == "save" and run.summary is None:
        rid = getattr(recv_req, "rid", None)
        if not (isinstance(rid, str) and rid.startswith(HEALTH_CHECK_PREFIX)):
            run.requests += 1
            ids = getattr(recv_req, "input_ids", None)
            if ids is not None and len(run.request_lengths) < MAX_LENGTHS:
                run.request_lengths.append(len(ids))
    return result


def spread(lengths: Any, k: int) -> list[int]:
    """Up to ``k`` of the distinct ``lengths`` (ints > 0), spread evenly over their sorted range
    (the shortest and the longest always among them)."""
    if not isinstance(lengths, list) or k <= 0:
        return []
    have = sorted({n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 0})
    if len(have) <= k:
        return have
    if k == 1:
        return [have[-1]]
    return sorted({have[round(i * (len(have) - 1) / (k - 1))] for i in range(k)})


def warmup_ids(length: int, index: int, vocab: int = 1000) -> list[int]:
    """A prompt of ``length`` token ids, its first token distinct per ``index`` (no two share a
    cached prefix), every id in [10, min(vocab, 1000)) (past the usual special tokens)."""
    top = max(11, min(int(vocab), 1000))
    return [10 + (index * 131 + i * 7) % (top - 10) for i in range(length)]


def check_answer(lines: Any) -> None:
    """Raise on an error inside a ``/generate`` answer of status 200: SGLang streams a failure
    as a ``data: {"error": ...}`` event, and a whole answer may carry an ``error`` too. ``lines``:
    the answer's lines (streamed) or its one body."""
    for raw in lines:
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        line = line.strip()
        if line.startswith("data:"):
            line = line[5:].strip()
        if not line or line == "[DONE]":
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        items = obj if isinstance(obj, list) else [obj]
        for item in items:
            if isinstance(item, dict) and item.get("error"):
                raise RuntimeError(f"the answer carries an error: {str(item['error'])[:200]}")


def warmup_body(ids: Any, index: int) -> dict:
    """The ``/generate`` body of LOAD's warm-up request ``index``: the four kinds of answer a
    client asks for in turn (streamed with logprobs, whole with logprobs, streamed, whole; with
    fewer than four requests the last kinds are left out), a few decode steps each. SGLang's own
    warm-up asks for neither: on the H200 the first request with logprobs after it took
    3.8-4.1x a steady one, plain SGLang and LOAD alike, while SAVE, warmed by such requests,
    showed no slow first one."""
    return {"input_ids": ids, "stream": index % 2 == 0, "return_logprob": index % 4 < 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4}}


def _launcher_status() -> tuple[Any, Any]:
    """SGLang's tokenizer manager in this (launcher) process and its ``ServerStatus`` enum, or
    (None, None) where they are not found."""
    import sys

    mod = sys.modules.get("sglang.srt.entrypoints.http_server")
    tm = getattr(getattr(mod, "_global_state", None), "tokenizer_manager", None)
    status = getattr(mod, "ServerStatus", None)
    if tm is None or status is None or not hasattr(tm, "server_status"):
        return None, None
    return tm, status


def around_wait_and_warmup(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """LOAD, launcher: SGLang's ``_wait_and_warmup`` runs its warm-up through a function bound as
    a default argument (a hook on that function's module attribute never runs), so the call's
    warm-up function is wrapped here: it runs, then :func:`after_execute_server_warmup`."""
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
        return after_execute_server_warmup(inner(server_args, *a, **k), server_args)

    bound.arguments["execute_warmup_func"] = execute_warmup
    return original(*bound.args, **bound.kwargs)


def after_execute_server_warmup(result: Any, server_args: Any = None, *args: Any,
                                **kwargs: Any) -> Any:
    """LOAD, launcher: after SGLang's own warm-up request (three tokens) and before the server
    reports ready, ``warmup_requests`` requests of the prompt lengths SAVE served, of every kind
    of answer (:func:`warmup_body`). They load what the first real request would otherwise load
    on its way (kernel modules, cuBLAS's choices for the prefill's shapes, the extend kernels'
    variants, the logprob and streaming paths): the archive made them compiled, not loaded. A
    failure is a warning: the server still starts."""
    p = _plugin()
    cfg = p.STATE.config
    if result is False or cfg is None or cfg.mode != "load" or not cfg.warmup_requests or \
            server_args is None:
        return result
    try:
        lengths = spread(archive_engine_state(cfg.archive).get("request_lengths"),
                         cfg.warmup_requests)
        if not lengths:
            return result
        import requests

        headers = {"Authorization": f"Bearer {server_args.api_key}"} if server_args.api_key \
            else {}
        dp = max(1, int(getattr(server_args, "dp_size", 1) or 1))
        tm, status = _launcher_status()
        vocab = getattr(getattr(tm, "model_config", None), "vocab_size", None) or 1000
        t = time.perf_counter()
        # SGLang's warm-up has marked the server up: it is "starting" again until these are
        # done (/health answers 503), so no request of a user runs beside them
        was = tm.server_status if tm is not None else None
        if tm is not None:
            tm.server_status = status.Starting
        try:
            for i, n in enumerate(lengths):
                left = WARMUP_BUDGET_S - (time.perf_counter() - t)
                if left <= 0:
                    raise TimeoutError(f"{WARMUP_BUDGET_S:.0f} s spent, {len(lengths) - i} "
                                       f"request(s) not sent")
                ids = [warmup_ids(n, i * dp + j, vocab) for j in range(dp)]
                body = warmup_body(ids[0] if dp == 1 else ids, i)
                with requests.post(server_args.url() + "/generate", json=body, headers=headers,
                                   timeout=left, verify=server_args.ssl_verify(),
                                   stream=body["stream"]) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                    check_answer(r.iter_lines() if body["stream"] else [r.content])
        finally:
            if tm is not None:
                tm.server_status = was
    except Exception as e:
        log.warning("vitrify: LOAD's warm-up requests failed (%s: %s); the first requests may "
                    "be slower", type(e).__name__, e)
        return result
    log.info("vitrify: LOAD warm-up: %d request(s) of %s tokens in %.2f s", len(lengths),
             ", ".join(map(str, lengths)), time.perf_counter() - t)
    return result


def thawed_graphs() -> dict | None:
    """This scheduler's decode graphs as LOAD rebuilt them from the archive (their count, the
    graph set's counters: builds, templates, parameter switches, and the captures this
    process's backend ran), or None outside a LOAD. Equal before and after a weight update:
    nothing was captured or rebuilt."""
    run = RUN
    if run is None or run.mode != "load" or getattr(run, "loaded", None) is None:
        return None
    # captures: decode graphs captured or claimed in this process (SGLang capturing again would
    # count here: the capture goes through this backend)
    return {**run.loaded.stats(), "graphs": len(run.loaded), "names": sorted(run.loaded.names),
            "captures": run.timings.get("shapes", 0)}


def exportable_here(device: int) -> str | None:
    """None when ``device`` and the driver can create an exportable region (a range reserved
    and freed: no memory is created), else why not, in one line."""
    from ... import region as _region

    try:
        _region.Region(2 << 20, device=device, exportable=True).close()
    except (RuntimeError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def exportable_region() -> Any:
    """The region of this scheduler's LOAD when it was created exportable (``weight_updates``):
    a trainer can then write the weights in place. None otherwise."""
    run = RUN
    region = getattr(run, "region", None)
    return region if getattr(region, "exportable", False) else None


def _active_run(runner: Any = None) -> Run | None:
    run = RUN
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
            run.model_modules = model_modules(getattr(runner, "model", None))
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
        run.pool_config = pool_config_state(config)
        return config
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

    if run.pool_config is None:
        raise _fatal("the archive holds no KV pool config")
    config = pool_config_from_state(MemoryPoolConfig, run.pool_config)
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
        kinds = check_attention(getattr(runner, "attn_backend", None))
    except FreezeRefused as e:
        raise _fatal(f"mode {run.mode!r}: {e}") from None
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
        blocks = routed_blocks(run.region)
        if run.mode == "save":
            run.routed = blocks
        else:
            _check_blocks(run.routed, blocks)
    except FreezeRefused as e:
        raise _fatal(str(e)) from None
    run.session.reached("captured")  # LOAD: graph pools restored, graphs waited for
    tm = run.timings
    log.info("vitrify: decode graphs, %d shapes: warm-up forwards %.2f s, gc %.2f s, %s %.2f s "
             "(SGLang's whole capture step %.2f s)", tm.get("shapes", 0),
             tm.get("warmup_forwards_s", 0.0), tm.get("gc_s", 0.0),
             "capture" if run.mode == "save" else "claim",
             tm.get("capture_s" if run.mode == "save" else "claim_s", 0.0), tm["total_s"])
    return result


def _add_time(run: Run, key: str, seconds: float) -> None:
    run.timings[key] = run.timings.get(key, 0.0) + seconds


def around_resolve_decode_backend(original: Callable, cuda_graph_runner: Any, *args: Any,
                                  **kwargs: Any) -> Any:
    backend = original(cuda_graph_runner, *args, **kwargs)
    run = _active_run(getattr(cuda_graph_runner, "model_runner", None))
    if run is None:
        return backend
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
        FullCudaGraphBackend,
    )

    if type(backend) is not FullCudaGraphBackend:
        raise _fatal(f"the decode graph backend is {type(backend).__name__}; only SGLang's "
                     f"FullCudaGraphBackend (--cuda-graph-backend-decode full) is frozen yet")
    return graph_backend_class()(cuda_graph_runner, enable_memory_saver=False)


def after_on_idle(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """SAVE: at the first idle moment after ``save_after_requests`` generate requests (SGLang's
    own warm-up request is the first), write and commit the archive with the JIT caches. Both
    modes, afterwards: report JIT compiles the archive's caches miss (:func:`_jit_watch`)."""
    run = RUN
    if run is None:
        return result
    if not run.pending_finish:
        if run.summary is not None and "error" not in run.summary:
            _jit_watch(run)
        return result
    p = _plugin()
    if run.requests < p.STATE.config.save_after_requests or \
            getattr(scheduler, "forward_ct", 0) <= 0:
        return result
    idle = getattr(scheduler, "is_fully_idle", None)
    if idle is not None and not idle():
        return result  # requests still queued or running: the next idle loop
    dirs = p.STATE.jit_dirs or {}
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


# ---------------------------------------------------------------------------------------------
# the decode graph backend
# ---------------------------------------------------------------------------------------------

_BACKEND_CLASS: type | None = None


def cuda_tensor_at(address: int, dtype: str, shape: tuple, stride: tuple, device: int) -> Any:
    """A torch tensor viewing ``address`` (region memory that outlives it)."""
    import torch

    from .. import torch as vt

    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    if any(s == 0 for s in shape):
        return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{device}")
    span = (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * item
    raw = vt.tensor_at(address, span, device)
    return raw.view(getattr(torch, dtype)).as_strided(shape, stride)


def graph_backend_class() -> type:
    """SGLang's ``FullCudaGraphBackend`` with vitrify's capture (SAVE) and replay (LOAD)."""
    global _BACKEND_CLASS
    if _BACKEND_CLASS is not None:
        return _BACKEND_CLASS
    import torch
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
        FullCudaGraphBackend,
    )

    from ... import region as _region
    from .. import torch as vt

    class VitrifyGraphBackend(FullCudaGraphBackend):
        """Captures into vitrify's graph store and the region's capture pool (SAVE), or claims
        each capture's segments and replays the archive's graphs (LOAD)."""

        @contextlib.contextmanager
        def capture_session(self, stream):
            run = RUN
            self._pool = vt.capture_pool(run.region).id  # never the routed pool (the plan, 1.)
            with super().capture_session(stream):
                yield

        def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
            run = RUN
            t0 = time.perf_counter()
            # the two warm-up forwards run on both sides: the routed pool sees the same requests
            for _ in range(2):
                self._device_module.synchronize()
                self._tp_group.barrier()
                forward_fn()
                if post_warmup_hook is not None:
                    post_warmup_hook()
            self._device_module.synchronize()
            t1 = time.perf_counter()
            _add_time(run, "warmup_forwards_s", t1 - t0)
            gc.collect()  # the same point on both sides (the loop runs with gc off)
            t2 = time.perf_counter()
            _add_time(run, "gc_s", t2 - t1)
            name = graph_name(shape_key)
            try:  # SGLang's capture rewrites a RuntimeError into advice that does not apply
                self._capture_or_claim(run, shape_key, name, forward_fn)
            except SystemExit:
                raise
            except Exception as e:
                raise _fatal(f"decode graph {name}: {type(e).__name__}: {e}") from None
            _add_time(run, "capture_s" if run.mode == "save" else "claim_s",
                      time.perf_counter() - t2)
            run.timings["shapes"] = run.timings.get("shapes", 0) + 1

        def _capture_or_claim(self, run, shape_key, name, forward_fn):
            if run.mode == "save":
                # The routed pool is paused (torch matches a thread's pools in the order they
                # were entered, so the capture pool would never win), and the capture goes to
                # the region's capture pool (the plan, 1.). torch.cuda.graph's own entry
                # (synchronize, empty_cache) then runs with no pool active; LOAD does the same
                # at the same point. Non-capture allocations of the capture (torch registers the
                # RNG state of a process's first graph) go to torch's default pool, outside
                # the region and the routed pool; decode graphs use no RNG.
                with vt.routing_paused(run.region), \
                        _region.record_window(run.region) as window:
                    with run.session.graphs.capture(name, pool=self._pool,
                                                    stream=self._capture_stream) as cap:
                        out = forward_fn()
                self._graphs[shape_key] = cap.graph
                self._outputs[shape_key] = out
                run.graphs[name] = {"window": window[0].to_json(),
                                    "outputs": describe(out, run.region, name)}
                return
            meta = run.graphs.get(name)
            if meta is None:
                raise FreezeRefused(f"the archive has no decode graph {name}; SAVE captured "
                                    f"{sorted(run.graphs)[:8]}: the batch sizes differ")
            with vt.routing_paused(run.region):
                torch.cuda.synchronize()  # what torch.cuda.graph's entry did at SAVE
                torch.cuda.empty_cache()
                _region.replay_window(run.region,
                                      _region.AllocationWindow.from_json(meta["window"]),
                                      f"decode graph {name}")
            self._graphs[shape_key] = name
            self._outputs[shape_key] = rebuild(meta["outputs"], run.region, cuda_tensor_at)

        def replay(self, shape_key, static_forward_batch, **kwargs):
            run = RUN
            if run is not None and run.mode == "load":
                run.loaded.replay(self._graphs[shape_key], stream=torch.cuda.current_stream())
                return self._outputs[shape_key]
            return super().replay(shape_key, static_forward_batch, **kwargs)

    _BACKEND_CLASS = VitrifyGraphBackend
    return VitrifyGraphBackend


__all__ = ["ATTENTION_BACKENDS", "ATTENTION_WRAPPERS", "Engine", "FROZEN_ATTENTION",
           "FreezeRefused", "Run", "SpanPrefetch", "after_on_idle", "around_alloc_memory_pool",
           "around_capture_decode_graph", "around_freeze_gc", "around_init_model_worker",
           "around_load_model", "around_resolve_decode_backend",
           "around_resolve_memory_pool_config", "attention_leaves", "capture_collections",
           "check_answer", "check_attention", "check_supported", "cuda_tensor_at", "describe",
           "exportable_here", "exportable_region", "freeze_import_heap", "graph_backend_class",
           "graph_name", "memory_available", "metadata_api", "own_errors",
           "pool_config_from_state", "pool_config_state", "read_ahead_direct_io", "rebuild",
           "start_read_ahead", "thawed_graphs", "unsupported", "warm_triton_key", "warmup_body"]
