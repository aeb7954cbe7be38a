"""FREEZE and THAW of an engine: one procedure over engine adapters (no torch here).

An engine is frozen once, after it has been built, loaded, warmed up and captured, and thawed in
a fresh process in seconds. The procedure is the same for every engine; what differs lives in an
:class:`EngineAdapter` (the toy demo, transformers, SGLang). Design and invariants:
``docs/session.md``.

FREEZE (:class:`FreezeSession`)::

    record kernel binaries (before CUDA is initialised)
    reserve the region
    adapter.build(region)          checkpoint "built"     the engine's objects, weights unset
    adapter.load_weights()         checkpoint "weights"
    adapter.alloc_state()          checkpoint "state"     KV cache: mapped at THAW, never dumped
    adapter.warmup()               checkpoint "warmup"
    adapter.capture(graphs)        checkpoint "captured"
    dump spans: weights [0, weights), warmup [state, warmup), graphs [warmup, captured)
    save graphs, adapter.state(), the session record; commit the archive atomically

THAW (:class:`ThawSession`)::

    open the archive, check it against this machine and the adapter's fingerprint, and the
    session state against the manifest (:func:`read_state`: every span and graph it records
    is listed, P13)
    reserve the region at the frozen base (another base when it is taken and relocation is
    allowed; graphs FREEZE could not prove relocatable are refused there)
    load kernel modules and rebuild graphs in the background
    adapter.build(region)          compare "built"
    claim up to "weights", restore the weights span, compare "weights"
    adapter.alloc_state()          compare "state"
    restore the warmup span (or re-run adapter.warmup(): VITRIFY_WARMUP_RESTORE=0, or an archive
    without it), compare "warmup"
    claim up to "captured", restore the graphs span, wait for the graphs
    adapter.restore_state(state, graphs)  -> serving

Every phase runs inside ``adapter.route(region, phase)`` so the engine's allocations land in the
region; FREEZE and THAW walk the same cursor trajectory because the adapter builds the same
objects in the same order. A drift is a :class:`CheckpointDrift` naming the phase and both offsets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from . import _check, config
from . import archive as _archive
from . import snapshot as _snapshot

log = logging.getLogger("vitrify.session")

SESSION_FORMAT = 1
PHASES = ("built", "weights", "state", "warmup", "captured")
# Spans: name -> (first checkpoint, last checkpoint); "" is offset 0.
SPANS = {"weights": ("", "weights"), "warmup": ("state", "warmup"),
         "graphs": ("warmup", "captured")}
RANK = 0


#: A rank's ``state.json`` as a session writes it: ``session`` (what THAW needs of the
#: procedure: format, phases, each span's range, which spans FREEZE dumped, how many graphs)
#: and ``engine`` (the adapter's ``state()``, plain JSON, passed on unread). Checked once when
#: THAW (or ``vitrify verify``) reads it, by :func:`read_state`.
STATE_SCHEMA = _check.Obj({
    "session": _check.Obj({
        "format": _check.Int(0, _check.U32_MAX),
        "phases": _check.List(_check.Str(max_len=64), max_len=64),
        "spans": _check.Map(_check.Str(max_len=64),
                            _check.List(_check.Int(0, _check.U64_MAX), length=2), max_len=64),
        "graphs": _check.Int(0, _check.U32_MAX),
        "record_kernels": _check.Bool(),
    }, optional={"dumped": _check.List(_check.Str(choices=sorted(SPANS)), unique=True)}),
    "engine": _check.Obj({}, extra=True),
})


class SessionError(RuntimeError):
    """The session cannot go on: what failed and what to do."""


class CheckpointDrift(_archive.ArchiveMismatch):
    """THAW's region cursor after a phase differs from FREEZE's: the engine did not build the same
    objects in the same order (another config, another library version, a nondeterministic
    allocation). Both offsets are named."""

    def __init__(self, path: str, phase: str, frozen: int, here: int):
        _archive.ArchiveError.__init__(
            self, f"archive {path}: the region cursor after phase {phase!r} is {here} bytes "
                  f"(0x{here:x}) here but was {frozen} bytes (0x{frozen:x}) at FREEZE "
                  f"({here - frozen:+d}): the engine did not allocate the same objects in the "
                  f"same order; rebuild the archive with this engine")
        self.path, self.field, self.expected, self.found = path, f"checkpoint.{phase}", here, frozen
        self.phase = phase


def _span_range(cps: dict, name: str) -> tuple[int, int]:
    """The offsets ``[lo, hi)`` of span ``name`` given the region's checkpoints."""
    lo, hi = SPANS[name]
    return (cps[lo] if lo else 0, cps[hi])


def _read(archive: Any, rank: int) -> tuple[dict, dict | None]:
    """:func:`read_state`, and the graph index when the state records graphs (else None)."""
    path, rel = archive.path, f"rank{rank}/state.json"
    if rel not in archive.files:
        raise _archive.ArchiveCorrupt(path, rel, "not in the manifest: the archive holds no "
                                                 "session state (not frozen by a vitrify "
                                                 "session, or its manifest lost the file)")
    st = archive.state(rank)
    sess = st.get("session")
    fmt = sess.get("format") if type(sess) is dict else None
    if type(fmt) is int and fmt != SESSION_FORMAT:
        raise _archive.ArchiveMismatch(path, "state.session.format", SESSION_FORMAT, fmt)
    try:
        _check.validate(STATE_SCHEMA, st)
    except _check.SchemaError as e:
        raise _archive.ArchiveCorrupt(path, rel, str(e)) from None
    sess = st["session"]

    def refuse(where: str, field: str, reason: str) -> None:
        raise _archive.ArchiveCorrupt(path, where, f"{field}: {reason}")

    if sess["phases"] != list(PHASES):
        refuse(rel, "session.phases", f"{sess['phases']} are not this build's {list(PHASES)}")
    cps = archive.region.checkpoints
    missing = [p for p in PHASES if p not in cps]
    if missing:
        refuse(_archive.MANIFEST, "region.checkpoints", f"lacks {missing}, which a session "
                                                        f"records")
    for before, after in zip(PHASES, PHASES[1:]):
        if cps[after] < cps[before]:
            refuse(_archive.MANIFEST, f"region.checkpoints[{after!r}]",
                   f"{cps[after]} is before {before!r} at {cps[before]}")
    if set(sess["spans"]) != set(SPANS):
        refuse(rel, "session.spans", f"names {sorted(sess['spans'])}; a session records "
                                     f"{sorted(SPANS)}")
    for name in SPANS:
        if sess["spans"][name] != list(_span_range(cps, name)):
            refuse(rel, f"session.spans.{name}", f"{sess['spans'][name]}, but the manifest's "
                                                 f"checkpoints give {list(_span_range(cps, name))}")
    # Every span FREEZE dumped is listed (archives of before "dumped": at least the weights,
    # which FREEZE always dumps), and none other is.
    dumped = sess.get("dumped")
    for name in SPANS:
        lo, hi = _span_range(cps, name)
        span_rel = _snapshot.span_relpath(rank, name)
        listed = span_rel in archive.files
        if dumped is None:
            needed = name == _snapshot.WEIGHTS_SPAN and hi > lo
        else:
            needed = name in dumped
            if needed and hi <= lo:
                refuse(rel, "session.dumped", f"lists {name!r}, whose range [{lo}, {hi}) is empty")
            if name == _snapshot.WEIGHTS_SPAN and hi > lo and not needed:
                refuse(rel, "session.dumped", "lacks 'weights' (FREEZE always dumps the weights "
                                              "span)")
            if listed and not needed:
                raise _archive.ArchiveCorrupt(path, span_rel, "listed in the manifest, but the "
                                                              "session state says FREEZE did not "
                                                              "dump this span")
        if needed and not listed:
            raise _archive.ArchiveCorrupt(path, span_rel, f"not in the manifest, but the session "
                                                          f"state records the {name} span "
                                                          f"[{lo:#x}, {hi:#x}) as dumped")
    index = None
    index_rel = f"rank{rank}/{_graph_module().INDEX_FILE}"
    if not sess["graphs"] and index_rel in archive.files:
        # a state edited to 0 would thaw without the graphs FREEZE saved: never silently
        refuse(rel, "session.graphs", f"0, but the manifest lists {index_rel}")
    if sess["graphs"]:
        if index_rel not in archive.files:
            raise _archive.ArchiveCorrupt(path, index_rel, f"not in the manifest, but the session "
                                                           f"state records {sess['graphs']} "
                                                           f"graphs")
        index = _graph_module().archive_index(archive, rank)
        if len(index["graphs"]) != sess["graphs"]:
            refuse(rel, "session.graphs", f"{sess['graphs']}, but {index_rel} lists "
                                          f"{len(index['graphs'])} graphs")
    return st, index


def read_state(archive: Any, rank: int = RANK) -> dict:
    """The session state of ``rank`` in an opened :class:`vitrify.archive.Archive`, checked
    once: its schema (:data:`STATE_SCHEMA`), its format, and that it agrees with the manifest:
    every phase's checkpoint is there and in order, each span's range is the one the checkpoints
    give, every span FREEZE dumped is listed (and no other), and the graph index it counts is
    listed and lists that many graphs. A problem is an :class:`vitrify.archive.ArchiveCorrupt`
    naming the archive, the file and the field (another session format: an ArchiveMismatch)."""
    _check.integer("rank", rank, 0, 999999)
    return _read(archive, rank)[0]


@runtime_checkable
class EngineAdapter(Protocol):
    """What an engine provides to be frozen and thawed. The session calls, in order:
    ``fingerprint``; ``build``, ``load_weights`` (FREEZE only), ``alloc_state``, ``warmup``
    (FREEZE; at THAW only when the warmup span is not restored), ``capture`` (FREEZE only),
    ``state`` (FREEZE) / ``restore_state`` (THAW) — each phase inside ``route(region, phase)``."""

    def fingerprint(self) -> dict[str, str]:
        """``engine``, ``engine_version`` and ``model`` (str each): an archive of another engine,
        version or model is refused at THAW."""
        ...

    def route(self, region: Any, phase: str) -> contextlib.AbstractContextManager:
        """A context inside which the engine's device allocations in ``phase`` (``build``,
        ``load_weights``, ``alloc_state``, ``warmup``, ``capture``) come from ``region`` (a
        torch engine: ``vitrify.integrations.torch.region_allocations``, and for ``capture``
        ``activated`` with the graphs' pool in the region)."""
        ...

    def build(self, region: Any) -> None:
        """Create the engine's objects (parameters allocated, not initialised) in the region."""
        ...

    def load_weights(self) -> None:
        """FREEZE: fill the parameters (THAW restores their bytes instead)."""
        ...

    def alloc_state(self) -> None:
        """Allocate what holds no state worth saving (the KV cache): mapped, never dumped."""
        ...

    def warmup(self) -> None:
        """Run what initialises lazy state (workspaces, autotuning, compiled kernels)."""
        ...

    def capture(self, graphs: Any) -> None:
        """FREEZE: capture the CUDA graphs into ``graphs`` (a :class:`vitrify.graph.GraphStore`)."""
        ...

    def state(self) -> dict:
        """FREEZE: what THAW needs besides the region's bytes (plain JSON)."""
        ...

    def restore_state(self, state: dict, graphs: Any) -> None:
        """THAW: take the frozen state and the rebuilt graphs
        (:class:`vitrify.graph.LoadedGraphs`, or None when FREEZE captured none)."""
        ...

    # Optional: ``compile()`` — JIT work (torch.compile, Triton autotuning) whose allocations are
    # temporaries. The session calls it after ``alloc_state`` and before ``warmup`` (FREEZE, the
    # cold start, and THAW when warmup re-runs), outside the region (no ``route``): how much
    # a JIT allocates depends on its caches, so inside the region it would move the cursor
    # (P11). ``warmup`` then only runs the compiled code.
    #
    # Optional: an engine whose THAW needs none of its objects (it replays the graphs and reads
    # the region, no torch) sets ``thaw_without_objects = True`` and defines ``attach(region)``:
    # THAW then calls attach instead of build/alloc_state, maps each phase's range itself, and
    # must restore the warmup span (it cannot re-run warmup).


def _graph_module():
    from . import graph
    return graph


def _check_adapter(adapter: Any) -> Any:
    missing = [m for m in ("fingerprint", "route", "build", "load_weights", "alloc_state",
                           "warmup", "capture", "state", "restore_state")
               if not callable(getattr(adapter, m, None))]
    if missing:
        raise _check.ArgumentTypeError(f"adapter must implement vitrify.session.EngineAdapter; "
                                       f"{_check.got(adapter)} lacks {', '.join(missing)}")
    return adapter


def _check_fingerprinted(adapter: Any) -> Any:
    """What every session needs of its adapter up front: ``fingerprint``. An engine that runs its
    own phases (``start`` / ``reached`` / ``finish``) needs nothing else; ``run()`` checks the
    whole protocol."""
    if not callable(getattr(adapter, "fingerprint", None)):
        raise _check.ArgumentTypeError(f"adapter must implement vitrify.session.EngineAdapter; "
                                       f"{_check.got(adapter)} lacks fingerprint")
    return adapter


def _fingerprint(adapter: Any, device: int) -> _archive.Fingerprint:
    fp = adapter.fingerprint()
    if not isinstance(fp, dict) or set(fp) != {"engine", "engine_version", "model"} or \
            not all(isinstance(v, str) and v for v in fp.values()):
        raise _check.ArgumentTypeError(f"adapter.fingerprint() must return a dict of non-empty "
                                       f"str engine, engine_version, model; got {fp!r}")
    return _archive.Fingerprint.current(device=device, **fp)


@dataclasses.dataclass
class Timings:
    """Seconds per step, in order (``as_dict`` for JSON)."""

    steps: dict[str, float] = dataclasses.field(default_factory=dict)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        log.info("%s ...", name)
        try:
            yield
        finally:
            self.steps[name] = self.steps.get(name, 0.0) + time.perf_counter() - t0
            log.info("%s: %.3f s", name, self.steps[name])

    def as_dict(self) -> dict[str, float]:
        return dict(self.steps)


class _Background:
    """``fn()`` on a thread; :meth:`result` joins it and returns its value or raises its error."""

    def __init__(self, fn: Callable[[], Any]):
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn()
            except BaseException as e:  # handed to the caller of result()
                self._error = e

        self._thread = threading.Thread(target=run, name="vitrify-thaw-graphs", daemon=True)
        self._thread.start()

    def failed(self) -> bool:
        """True once fn() has raised (without waiting for it)."""
        return not self._thread.is_alive() and self._error is not None

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


# The phase (a Timings step) that ends at each checkpoint.
_PHASE_OF = {"built": "build", "weights": "load_weights", "state": "alloc_state",
             "warmup": "warmup", "captured": "capture"}


def _check_next(region: Any, checkpoint: str, side: str) -> None:
    """An engine-driven session's checkpoints come in PHASES order, each once."""
    if region is None or region.closed:
        raise SessionError(f"{side}: start() the session before reporting a checkpoint")
    if checkpoint not in PHASES:
        raise ValueError(f"checkpoint must be one of {list(PHASES)}, got {checkpoint!r}")
    expected = next((p for p in PHASES if p not in region.checkpoints), None)
    if checkpoint != expected:
        raise SessionError(f"{side}: the engine reported checkpoint {checkpoint!r} but the next "
                           f"one is {expected!r} (the phases run in the order {list(PHASES)})")


# ------------------------------------------------------------------------------------- FREEZE
def run_compile(adapter: Any, region: Any, timings: Timings) -> None:
    """The adapter's optional ``compile`` phase, outside the region (P11): it must not move the
    region's cursor, else :class:`SessionError` naming both offsets."""
    compile_ = getattr(adapter, "compile", None)
    if compile_ is None:
        return
    if not callable(compile_):
        raise _check.ArgumentTypeError(f"adapter.compile must be callable, got "
                                       f"{_check.got(compile_)}")
    before = region.offset
    with timings.step("compile"):
        compile_()
    if region.offset != before:
        raise SessionError(f"the engine's compile phase moved the region's cursor from {before} "
                           f"to {region.offset} bytes: JIT work must allocate outside the region "
                           f"(its allocations depend on the JIT's caches)")


def run_phases(adapter: Any, region: Any, graphs: Any, timings: Timings) -> None:
    """FREEZE's phases in order, each inside ``adapter.route(region, phase)`` and timed, with a
    region checkpoint after each (``PHASES``); the optional ``compile`` phase runs outside the
    region before warmup (P11); ``graphs`` goes to ``adapter.capture``. Also the cold start an
    engine compares a thaw with (no recording, no archive)."""
    a = adapter
    for phase, call, checkpoint in (("build", lambda: a.build(region), "built"),
                                    ("load_weights", a.load_weights, "weights"),
                                    ("alloc_state", a.alloc_state, "state"),
                                    ("warmup", a.warmup, "warmup"),
                                    ("capture", lambda: a.capture(graphs), "captured")):
        if phase == "warmup":
            run_compile(a, region, timings)
        with timings.step(phase), a.route(region, phase):
            call()
        region.checkpoint(checkpoint)


class FreezeSession:
    """Build, warm up, capture and freeze ``adapter`` into the archive at ``path``.

    Construct it before anything initialises CUDA in this process: it starts recording kernel
    binaries (``record_kernels=False`` skips that, for engines that capture no graphs).
    ``dump_warmup=False`` leaves the warmup span out (a smaller archive; THAW re-runs warmup);
    ``dump_graph_span=False`` leaves the graphs span out (for an engine whose THAW maps it
    without restoring it: ``ThawSession(restore_graph_span=False)``).
    ``region_bytes``: the region to reserve (the engine's whole footprint: weights, KV cache,
    workspaces, graph pools); ``base``: its address (None: the default search). ``progress``:
    called as ``progress(done_bytes, total_bytes)`` while spans are written.
    """

    def __init__(self, adapter: Any, path: str | os.PathLike, *, region_bytes: int,
                 base: int | None = None, device: int = 0, overwrite: bool = False,
                 record_kernels: bool = True, dump_warmup: bool = True,
                 dump_graph_span: bool = True,
                 progress: Callable[[int, int], None] | None = None):
        self.adapter = _check_fingerprinted(adapter)
        self.dump_warmup = _check.boolean("dump_warmup", dump_warmup)
        self.dump_graph_span = _check.boolean("dump_graph_span", dump_graph_span)
        self.path = os.path.abspath(_check.path("path", path))
        self.region_bytes = _check.integer("region_bytes", region_bytes, 1, _check.U64_MAX)
        self.base = _check.optional_integer("base", base, 1, _check.U64_MAX)
        self.device = _check.integer("device", device, 0, (1 << 31) - 1)
        self.overwrite = _check.boolean("overwrite", overwrite)
        self.record_kernels = _check.boolean("record_kernels", record_kernels)
        if progress is not None and not callable(progress):
            raise _check.ArgumentTypeError(f"progress must be callable, got {_check.got(progress)}")
        self.progress = progress
        if os.path.exists(self.path) and not self.overwrite:
            raise FileExistsError(f"{self.path} exists (pass overwrite=True to replace it)")
        if self.record_kernels:
            _graph_module().record_modules()
        self.region = None
        self.graphs = None
        self.timings = Timings()
        self._finished = False

    # -- engine-driven FREEZE (P12): start(), reached(checkpoint) after each phase, finish(state)

    def start(self) -> Any:
        """Reserve the region (and the graph store, :attr:`graphs`) for an engine that runs its
        own phases; returns the region. Then call :meth:`reached` after each phase and
        :meth:`finish` at the end; any error there closes the region and leaves no archive."""
        if self.region is not None:
            raise SessionError("this FREEZE session was started already")
        return self._guard(self._start)

    def _not_finished(self) -> None:
        # After finish() the engine serves from the region: a late call is refused without
        # touching it (only abort() closes it).
        if self._finished:
            raise SessionError("this FREEZE session has finished; the region is the engine's")

    def _start(self) -> Any:
        from .region import Region

        self._fp = _fingerprint(self.adapter, self.device)
        self._t_start = time.perf_counter()
        with self.timings.step("reserve"):
            self.region = Region(self.region_bytes, base=self.base, device=self.device)
        self._t_last = time.perf_counter()
        self.graphs = None
        if self.record_kernels:
            self.graphs = _graph_module().GraphStore(region=self.region, device=self.device)
        return self.region

    def reached(self, checkpoint: str) -> None:
        """The engine finished the phase that ends at ``checkpoint`` (``PHASES``, in order): the
        region's cursor is recorded. The time since the previous call is the phase's step."""
        self._not_finished()
        self._guard(lambda: self._reached(checkpoint))

    def _reached(self, checkpoint: str) -> None:
        _check_next(self.region, checkpoint, "FREEZE")
        now = time.perf_counter()
        self.timings.steps[_PHASE_OF[checkpoint]] = now - self._t_last
        self._t_last = now
        self.region.checkpoint(checkpoint)

    def finish(self, engine_state: dict,
               write_extra: Callable[[Any], None] | None = None) -> dict:
        """Dump the spans, save the graphs and ``engine_state`` (plain JSON, region offsets
        instead of addresses), commit the archive; returns the summary (JSON).
        ``write_extra(writer)`` may add files of its own (e.g. :func:`vitrify.jit.pack`) before
        the commit. The region stays the engine's (only :meth:`abort` closes it), also when
        writing fails: the archive is then not written (P8) and the engine, already built from
        the region, may go on serving."""
        self._not_finished()
        summary = self._finish(engine_state, write_extra)
        self._finished = True
        return summary

    def abort(self) -> None:
        """Close the region without writing an archive (idempotent; never raises)."""
        if self.region is not None and not self.region.closed:
            try:
                self.region.close()
            except Exception as e:  # the first error is the one that propagates
                log.debug("closing the region after a FREEZE error: %s", e)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except BaseException:
            self.abort()
            raise

    def run(self) -> dict:
        """Run every phase and commit the archive; returns a summary (JSON). On an error no
        archive is left (P8) and the region is closed before the error propagates."""
        _check_adapter(self.adapter)
        if self.region is not None:
            raise SessionError("this FREEZE session was started already")

        def pull() -> dict:
            region = self._start()
            run_phases(self.adapter, region, self.graphs, self.timings)
            with self.timings.step("state"):
                engine_state = self.adapter.state()
            return self._finish(engine_state)

        return self._guard(pull)

    def _finish(self, engine_state: Any,
                write_extra: Callable[[Any], None] | None = None) -> dict:
        region, t, store = self.region, self.timings, self.graphs
        if region is None:
            raise SessionError("start() the FREEZE session first")
        missing = [p for p in PHASES if p not in region.checkpoints]
        if missing:
            raise SessionError(f"FREEZE cannot finish: the engine has not reached {missing}")
        if not isinstance(engine_state, dict):
            raise _check.ArgumentTypeError(f"adapter.state() must return a dict, got "
                                           f"{_check.got(engine_state)}")
        cps = region.checkpoints
        reg = _archive.Region(base=region.base, size=region.size,
                              granularity=region.granularity, checkpoints=cps)
        spans = {}
        with _archive.ArchiveWriter(self.path, self._fp, reg, overwrite=self.overwrite) as w:
            with t.step("dump_spans"):
                for name, (lo, hi) in SPANS.items():
                    start, end = cps[lo] if lo else 0, cps[hi]
                    if (name == "warmup" and not self.dump_warmup) or \
                            (name == "graphs" and not self.dump_graph_span):
                        continue
                    if end > start:
                        spans[name] = w.dump_span(RANK, name, region.base, start, end,
                                                  target=self.device, progress=self.progress)
            graphs = {}
            if store is not None and len(store):
                with t.step("save_graphs"):
                    graphs = store.save_to_archive(w, rank=RANK)
            w.write_state(RANK, {"session": {
                "format": SESSION_FORMAT, "phases": list(PHASES),
                "spans": {n: [cps[lo] if lo else 0, cps[hi]] for n, (lo, hi) in SPANS.items()},
                "graphs": len(store) if store is not None else 0,
                "record_kernels": self.record_kernels,
                "dumped": list(spans),
            }, "engine": engine_state})
            if write_extra is not None:
                with t.step("write_extra"):
                    write_extra(w)
            with t.step("commit"):
                w.commit()
        t.steps["total"] = time.perf_counter() - self._t_start
        log.info("frozen into %s: %d graphs, region %d bytes at 0x%x", self.path,
                 len(graphs.get("graphs", {})), cps["captured"], region.base)
        return {"archive": self.path, "base": region.base, "checkpoints": cps,
                "span_bytes": {n: int(s.get("bytes", 0)) for n, s in spans.items()},
                "graphs": len(store) if store is not None else 0,
                "templates": len(graphs.get("templates", [])),
                "timings": t.as_dict()}


# --------------------------------------------------------------------------------------- THAW
class ThawSession:
    """Thaw ``adapter`` from the archive at ``path`` in this (fresh) process.

    ``base``: where to put the region (None: the frozen base). When that range is taken and
    ``relocate`` is True the region goes to the default search's base and the graphs are
    relocated; a graph FREEZE marked non-relocatable is then refused (:class:`GraphNotRelocatable`
    naming it) — never run at an address it cannot follow. ``warmup_restore``: restore the warmup
    span (None: the ``VITRIFY_WARMUP_RESTORE`` setting; an archive without the span re-runs
    warmup either way). ``verify``: check every file's CRC32C before use (spans are checked
    chunk by chunk as they are restored, whatever this says). ``exportable``: the region's
    memory is created exportable (``Region(exportable=True)``), so a trainer can write the
    weights in place (``vitrify.weights.transport.region_exporter``). ``direct_io``: how the
    spans are read (None: ``VITRIFY_DIRECT_IO``; "off": through the page cache, for a span
    another thread or process is reading ahead, see :func:`vitrify.snapshot.restore_from_file`).
    """

    def __init__(self, adapter: Any, path: str | os.PathLike, *, base: int | None = None,
                 relocate: bool = True, device: int = 0, warmup_restore: bool | None = None,
                 verify: bool = True, graph_threads: int = 4,
                 progress: Callable[[int, int], None] | None = None,
                 exportable: bool = False, restore_graph_span: bool = True,
                 direct_io: str | None = None):
        self.adapter = _check_fingerprinted(adapter)
        # an archive its caller opened already (one open per process): its fingerprint is
        # checked against the adapter's at start() as an opened path's would be
        self._opened = path if isinstance(path, _archive.Archive) else None
        self.path = self._opened.path if self._opened is not None else \
            os.path.abspath(_check.path("path", path))
        # False: the graphs span is mapped at "captured" but not restored (an engine whose
        # capture memory is scratch every replay rewrites, and whose other objects in that range
        # it rebuilt itself: SGLang's, see freeze.py)
        self.restore_graph_span = _check.boolean("restore_graph_span", restore_graph_span)
        # exportable: the region's memory can be exported as file descriptors, so a trainer
        # can write the thawed engine's weights in place (a direct weight update)
        self.exportable = _check.boolean("exportable", exportable)
        self.base = _check.optional_integer("base", base, 1, _check.U64_MAX)
        self.relocate = _check.boolean("relocate", relocate)
        self.device = _check.integer("device", device, 0, (1 << 31) - 1)
        if warmup_restore is not None:
            _check.boolean("warmup_restore", warmup_restore)
        self.warmup_restore = warmup_restore
        self.verify = _check.boolean("verify", verify)
        self.graph_threads = _check.integer("graph_threads", graph_threads, 1, 256)
        if progress is not None and not callable(progress):
            raise _check.ArgumentTypeError(f"progress must be callable, got {_check.got(progress)}")
        self.progress = progress
        self.direct_io = None if direct_io is None else _snapshot._direct_io(direct_io)
        self.region = None
        self.graphs = None
        self.timings = Timings()
        self.warmup_action = ""
        self.summary: dict | None = None
        self._loader: _Background | None = None
        self._graphs_background = 0.0
        self._engine_driven = True  # run() says otherwise
        self._started = False
        self._finished = False
        self._archive: Any = None
        self._state: dict = {}
        self._cps: dict = {}
        self._spans: dict = {}
        self._t_start = self._t_last = 0.0

    def _reserve(self, frozen: _archive.Region):
        from .region import Region, RegionAddressError

        want = self.base if self.base is not None else frozen.base
        if want != frozen.base and not self.relocate:
            raise SessionError(f"base 0x{want:x} is not the frozen base 0x{frozen.base:x} and "
                               f"relocate=False; pass relocate=True to thaw at another base")
        try:
            return Region(frozen.size, base=want, device=self.device,
                          exportable=self.exportable)
        except RegionAddressError as e:
            if not self.relocate:
                raise SessionError(f"the frozen region's range 0x{want:x}+{frozen.size} is not "
                                   f"free in this process ({e}); pass relocate=True to thaw at "
                                   f"another base") from None
            log.warning("region base 0x%x is taken (%s); relocating", want, e)
            return Region(frozen.size, device=self.device, exportable=self.exportable)

    def _compare(self, archive: Any, phase: str, region: Any) -> None:
        frozen = archive.region.checkpoints.get(phase)
        if frozen is None:
            raise _archive.ArchiveCorrupt(archive.path, "manifest.json",
                                          f"the region has no checkpoint {phase!r}")
        if region.offset != frozen:
            raise CheckpointDrift(archive.path, phase, frozen, region.offset)
        region.checkpoint(phase)

    @staticmethod
    def _claim(region: Any, upto: int) -> None:
        if upto > region.offset:
            region.claim(upto)

    def _restore(self, archive: Any, region: Any, spans: dict, name: str, end: int) -> None:
        """Map the region up to ``end`` (P2) and restore span ``name`` (when FREEZE wrote it)."""
        self._claim(region, end)
        if name in spans:  # a span file never writes outside its own range (P13)
            archive.restore_span(RANK, name, region.base, end,
                                 within=_span_range(self._cps, name), target=self.device,
                                 progress=self.progress, direct_io=self.direct_io)

    def run(self) -> dict:
        """Thaw; returns a summary (JSON). The engine serves once this returns. On any error the
        background graph build is joined and released and the region is closed before the error
        propagates (a caller may cold-start in this process)."""
        _check_adapter(self.adapter)
        self._once()
        return self._guard(self._run)

    # -- engine-driven THAW (P12): start(), reached(checkpoint) after each phase the engine
    #    runs, finish() -> (engine state, graphs)

    def start(self) -> Any:
        """Open and check the archive, reserve the region, start rebuilding the graphs; returns
        the region. The engine then builds its objects and reports each checkpoint with
        :meth:`reached`: ``built`` (the weights span is then restored: the engine loads no
        weights), ``weights``, ``state``, ``warmup`` (after re-running warmup when
        :attr:`warmup_action` is ``"rerun"``; when it is ``"restore"`` the engine skips warmup and
        the span is restored) and ``captured`` (the engine captured nothing: the graph pools are
        restored and the graphs waited for). :meth:`finish` hands over the frozen engine state
        and the graphs. Any error closes the region (P10)."""
        self._once()
        return self._guard(lambda: self._start(objectless=False))

    def _once(self) -> None:
        if self._started:
            raise SessionError("this THAW session was started already (one session, one THAW)")
        self._started = True

    def reached(self, checkpoint: str) -> None:
        """The engine finished the phase that ends at ``checkpoint`` (``PHASES``, in order):
        compared with FREEZE's cursor, then what THAW does there (restore a span, wait for the
        graphs)."""
        if self._finished:
            raise SessionError("this THAW session has finished; the region is the engine's")
        self._guard(lambda: self._reached(checkpoint))

    @property
    def frozen_state(self) -> dict:
        """After :meth:`start`: the engine state FREEZE wrote (``state()`` / ``finish(state)``),
        for an engine that needs it while it builds (e.g. sizes to re-apply)."""
        if self._archive is None:
            raise SessionError("start() the THAW session first")
        return self._state.get("engine", {})

    def finish(self) -> tuple[dict, Any]:
        """After ``captured``: the frozen engine state (``state()`` at FREEZE) and the rebuilt
        graphs (:class:`vitrify.graph.LoadedGraphs`, or None), now the caller's to close; the
        summary is :attr:`summary`."""
        if self._finished:
            raise SessionError("this THAW session has finished already")

        def done() -> tuple[dict, Any]:
            self.summary = self._finish()
            self._loader = None  # the graphs are the caller's now
            return self._state.get("engine", {}), self.graphs
        result = self._guard(done)
        self._finished = True
        return result

    def abort(self) -> None:
        """Release the background graph build and close the region (idempotent; never raises)."""
        try:
            self._release()
        except Exception as e:
            log.debug("releasing a THAW session: %s", e)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        loader, self._loader = self._loader, None
        if loader is not None:
            try:
                graphs = loader.result()
                graphs.close()
            except BaseException as e:  # the first error is the one that propagates
                log.debug("background graph load after a THAW error: %s", e)
        if self.region is not None and not self.region.closed:
            self.region.close()
        self.region = None

    def _check_loader(self) -> None:
        """A failed background load (a damaged module or graph file) stops THAW at once."""
        if self._loader is not None and self._loader.failed():
            self._loader.result()  # raises its error

    def _start(self, objectless: bool) -> Any:
        self._t_start = time.perf_counter()
        a, t = self.adapter, self.timings
        with t.step("open"):
            if self._opened is not None:
                archive = self._opened
                archive.check_fingerprint(_fingerprint(a, self.device))
            else:
                archive = _archive.open_archive(self.path, expect=_fingerprint(a, self.device),
                                                checksums=False)
            # The state is checked against the manifest: every span and graph it records is
            # listed (P13), read only after the manifest vouched for it.
            st, index = _read(archive, RANK)
            cps = archive.region.checkpoints
            self._spans = archive.spans(RANK)
            graphs_lo, graphs_hi = _span_range(cps, "graphs")
            graphs_rel = _snapshot.span_relpath(RANK, "graphs")
            if self.restore_graph_span and graphs_hi > graphs_lo and "graphs" not in self._spans:
                raise _archive.ArchiveCorrupt(archive.path, graphs_rel, f"not in the manifest, "
                                              f"but THAW restores the graphs span [{graphs_lo:#x}, "
                                              f"{graphs_hi:#x}): thaw with "
                                              f"restore_graph_span=False (FREEZE ran with "
                                              f"dump_graph_span=False?)")
            # Decided before anything is reserved: what happens to warmup (P5, P9).
            plan = self._warmup_plan(archive, cps)
            if objectless and plan.action != "restore":
                raise SessionError(f"{plan.reason}; but this engine keeps no objects at THAW "
                                   f"(thaw_without_objects), so it cannot re-run warmup: freeze "
                                   f"it with its warmup span")
            self.warmup_action = plan.action
        self._archive, self._state, self._cps = archive, st, cps
        with t.step("reserve"):
            self.region = region = self._reserve(archive.region)
            region.preallocate(cps["captured"])
        if index is not None:
            with t.step("graphs_start"):
                # Refused before anything is restored (P4); then the files are verified, the
                # modules loaded and the graphs built on background threads while the region
                # fills (P7).
                g = _graph_module()
                g.unrelocatable_graphs(index, region.base)
                self._loader = _Background(lambda: self._load_graphs(g, archive, region))
        self._t_last = time.perf_counter()
        return region

    def _reached(self, checkpoint: str) -> None:
        """Compare ``checkpoint``, then THAW's own work after it (the steps of run())."""
        archive, region, cps, t = self._archive, self.region, self._cps, self.timings
        if archive is None:
            raise SessionError("THAW: start() the session before reporting a checkpoint")
        if checkpoint == "weights" and region is not None and "weights" in region.checkpoints \
                and "state" not in region.checkpoints:
            # THAW restored the weights when the engine reached "built"; the engine saying so
            # too only re-checks that it allocated nothing since
            if region.offset != cps["weights"]:
                raise CheckpointDrift(archive.path, "weights", cps["weights"], region.offset)
            return
        _check_next(region, checkpoint, "THAW")
        if self._engine_driven and checkpoint in _PHASE_OF:  # the engine's time in the phase
            now = time.perf_counter()
            step = _PHASE_OF[checkpoint]
            t.steps[step] = t.steps.get(step, 0.0) + now - self._t_last
        if checkpoint == "warmup" and self.warmup_action == "restore":
            with t.step("restore_warmup"):
                self._restore(archive, region, self._spans, "warmup", cps["warmup"])
        elif checkpoint == "captured":
            with t.step("restore_graph_pools"):
                spans = self._spans if self.restore_graph_span else {}
                self._restore(archive, region, spans, "graphs", cps["captured"])
        self._compare(archive, checkpoint, region)
        if checkpoint == "built":
            self._check_loader()
            with t.step("restore_weights"):
                self._restore(archive, region, self._spans, "weights", cps["weights"])
            self._compare(archive, "weights", region)
        elif checkpoint == "state":
            self._check_loader()
        elif checkpoint == "captured" and self._loader is not None:
            with t.step("graphs_wait"):
                graphs = self._loader.result()
                graphs.wait_all()
            self.graphs = graphs
        self._t_last = time.perf_counter()

    def _finish(self) -> dict:
        region = self.region
        if region is None or "captured" not in region.checkpoints:
            raise SessionError("THAW cannot finish before the engine reached 'captured'")
        self.timings.steps["total"] = time.perf_counter() - self._t_start
        graphs, archive = self.graphs, self._archive
        background = {"graphs_background": self._graphs_background} if graphs is not None else {}
        return {"archive": archive.path, "base": region.base,
                "frozen_base": archive.region.base, "relocated": region.base != archive.region.base,
                "checkpoints": region.checkpoints, "warmup": self.warmup_action,
                "graphs": len(graphs) if graphs is not None else 0,
                "graph_stats": graphs.stats() if graphs is not None else {},
                "timings": self.timings.as_dict(), "background": background}

    def _run(self) -> dict:
        """The pull-driven THAW: the session calls the adapter's phases (see the module doc)."""
        a, t = self.adapter, self.timings
        objectless = bool(getattr(a, "thaw_without_objects", False))
        self._engine_driven = False
        region = self._start(objectless)
        cps = self._cps
        # An adapter whose THAW needs none of its objects (it only replays graphs and reads
        # the region) is attached to the region; the session maps each phase's range itself.
        with t.step("build"):
            if objectless:
                self._claim(region, cps["built"])
                a.attach(region)
            else:
                with a.route(region, "build"):
                    a.build(region)
        self._reached("built")  # and the weights span restored
        self._reached("weights")
        with t.step("alloc_state"):
            if objectless:
                self._claim(region, cps["state"])
            else:
                with a.route(region, "alloc_state"):
                    a.alloc_state()
        self._reached("state")
        if self.warmup_action != "restore":
            run_compile(a, region, t)
            with t.step("warmup"), a.route(region, "warmup"):
                a.warmup()
        self._reached("warmup")
        self._reached("captured")
        with t.step("restore_state"):
            a.restore_state(self._state.get("engine", {}), self.graphs)
        self._loader = None  # handed to the adapter
        return self._finish()

    def _load_graphs(self, g: Any, archive: Any, region: Any) -> Any:
        """The background loader (P7): verify, load modules, build every graph; its wall time
        (reported as ``graphs_background``) runs beside the main thread's phases."""
        t0 = time.perf_counter()
        loaded = g.load_from_archive(archive, RANK, verify=self.verify, device=self.device,
                                     region_base=region.base, threads=self.graph_threads)
        try:
            loaded.wait_all()
        except BaseException:
            loaded.close()  # nobody else holds it: release the builds and modules now
            raise
        self._graphs_background = time.perf_counter() - t0
        return loaded

    def _warmup_plan(self, archive: Any, cps: dict):
        if cps["warmup"] <= cps["state"]:  # warmup allocated nothing in the region: no span
            return _snapshot.RestorePlan("restore", "warmup allocated nothing in the region; "
                                                    "nothing to restore")
        if self.warmup_restore is None:
            return _snapshot.plan_restore(archive, RANK)
        with config.override(warmup_restore=self.warmup_restore):
            return _snapshot.plan_restore(archive, RANK)


__all__ = ["CheckpointDrift", "EngineAdapter", "FreezeSession", "PHASES", "SESSION_FORMAT",
           "SPANS", "STATE_SCHEMA", "SessionError", "ThawSession", "Timings", "read_state",
           "run_compile", "run_phases"]
