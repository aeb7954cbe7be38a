"""The SGLang plugin's process state, the run, the fatal error and the refusal: the floor below
every other module of the plugin (PLUGIN.md, "Modules").

Owns: :class:`PluginFatal` / :func:`fatal` (the one-line ``SystemExit``, P3),
:class:`FreezeRefused` (what cannot be frozen, one line), :class:`PluginState` and :data:`STATE`
(what this process's plugin knows: its config, SGLang's version and version module, the
fingerprint, the JIT directories, the read-ahead, the scheduler's start before the GPU, the run),
:class:`Run` (one scheduler's FREEZE or THAW), the archive this process opened (:func:`archive`:
opened once per process, every user of it shares it) and what a weight update asks of the run
(:func:`exportable_region`, :func:`thawed_graphs`).

Imports only the standard library (the archive module when :func:`archive` is first called);
every other module of the plugin reads ``state.STATE`` through this module, never a copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

CONFIG_ENV = "VITRIFY_SGLANG_CONFIG"
PREFIX = "vitrify SGLang plugin: "
STATE_FORMAT = 1  # the engine state SAVE writes into the archive (Run.engine_state)


class PluginFatal(SystemExit):
    """A fatal plugin error: SystemExit so that SGLang's ``except Exception`` lets it through.

    Its ``code`` (what ``str()`` gives and what Python prints at exit) is the one-line message."""

    def __init__(self, message: str):
        super().__init__(PREFIX + " ".join(str(message).split()))


def fatal(message: str) -> PluginFatal:
    """The exception to raise for ``message`` (callers write ``raise fatal(...)``)."""
    return PluginFatal(message)


class FreezeRefused(RuntimeError):
    """What this SGLang server does cannot be frozen (yet): one line naming it."""


@dataclasses.dataclass
class Before:
    """A scheduler's start before it touches the GPU (freeze.before_gpu): the fingerprint of its
    arguments, its GPU, whether a standby's wait is over, and whether it starts cold."""

    fingerprint: dict
    device: int
    standby_done: bool = False
    cold: bool = False


@dataclasses.dataclass
class Run:
    """One scheduler process's FREEZE (mode "save") or THAW (mode "load")."""

    mode: str
    session: Any
    region: Any
    device: int
    graphs: dict = dataclasses.field(default_factory=dict)  # name -> {"window", "outputs"}
    pool_config: dict | None = None
    routed: list | None = None  # the routed pool's blocks at "captured" (graphs.routed_blocks)
    loaded: Any = None  # LOAD: the rebuilt graphs (vitrify.graph.LoadedGraphs)
    pending_finish: bool = False  # SAVE: captured; the archive is written at the first idle
    summary: dict | None = None
    model_modules: list | None = None  # SAVE: what the model registry needs (model_modules)
    requests: int = 0  # SAVE: generate requests seen before the archive was written
    request_lengths: list = dataclasses.field(default_factory=list)  # SAVE: their prompt lengths
    sweep_pending: bool = False  # SAVE: the launcher's shape sweep (sweep.py) has not ended yet
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


@dataclasses.dataclass
class PluginState:
    """What this process's plugin knows; later hooks read it.

    ``fingerprint`` is set where SGLang resolves ``ServerArgs`` (the launcher). Schedulers
    receive the resolved record pickled and compute the same fingerprint from it
    (``server_args.at_scheduler``), a pure function of the resolved arguments (P8)."""

    config: Any = None  # PluginConfig once register() accepted the file
    sglang_version: str | None = None
    version: Any = None  # the versions.v0_5_* module of that SGLang
    role: str | None = None  # "launcher" | "scheduler" | "detokenizer" | "dp_controller"
    registered: bool = False  # hooks handed to SGLang (never twice per process)
    fingerprint: dict | None = None  # engine-shaping ServerArgs, JSON-able
    prefill_graphs_were: str | None = None  # the prefill backend before it was forced off
    jit_dirs: dict | None = None  # JIT cache -> directory (SAVE: redirected; LOAD: unpacked)
    read_ahead: Any = None  # LOAD, launcher: the weights span's read (startup.SpanPrefetch)
    before: Before | None = None  # a scheduler's start before the GPU (freeze.before_gpu)
    run: Run | None = None  # this scheduler's FREEZE/THAW
    opened: dict = dataclasses.field(default_factory=dict)  # archive path -> Archive


STATE = PluginState()


def archive(path: str | None = None) -> Any:
    """The archive at ``path`` (default: the config's), opened once per process: the launcher's
    JIT unpack, model registry, read-ahead and warm-up, and a scheduler's standby and JIT watch
    share it. Raises what ``vitrify.archive.open_archive`` raises (nothing is cached then)."""
    from ... import archive as _archive

    if path is None:
        path = STATE.config.archive
    opened = STATE.opened.get(path)
    if opened is None:
        opened = STATE.opened[path] = _archive.open_archive(path)
    return opened


def archive_engine_state(path: str | None = None) -> dict:
    """The engine state SAVE wrote into the archive (rank 0's), for the launcher's uses of it
    before any session opens the archive."""
    return archive(path).state(0).get("engine") or {}


def exportable_region() -> Any:
    """The region of this scheduler's LOAD when it was created exportable (``weight_updates``):
    a trainer can then write the weights in place. None otherwise."""
    region = getattr(STATE.run, "region", None)
    return region if getattr(region, "exportable", False) else None


def thawed_graphs() -> dict | None:
    """This scheduler's decode graphs as LOAD rebuilt them from the archive (their count, the
    graph set's counters: builds, templates, parameter switches, and the captures this
    process's backend ran), or None outside a LOAD. Equal before and after a weight update:
    nothing was captured or rebuilt."""
    run = STATE.run
    if run is None or run.mode != "load" or getattr(run, "loaded", None) is None:
        return None
    # captures: decode graphs captured or claimed in this process (SGLang capturing again would
    # count here: the capture goes through this backend)
    return {**run.loaded.stats(), "graphs": len(run.loaded), "names": sorted(run.loaded.names),
            "captures": run.timings.get("shapes", 0)}


__all__ = ["Before", "CONFIG_ENV", "FreezeRefused", "PREFIX", "PluginFatal", "PluginState",
           "Run", "STATE", "STATE_FORMAT", "archive", "archive_engine_state",
           "exportable_region", "fatal", "thawed_graphs"]
