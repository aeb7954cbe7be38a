"""What the SGLang plugin does for a server's start-up around the freeze and thaw themselves
(PLUGIN.md P10, P12-P16, P18).

Owns: the collector (:func:`freeze_import_heap`, :func:`capture_collections`, P16), the model
registry's narrowing (:func:`model_modules`, :func:`narrow_model_registry`,
:func:`widen_model_registry`, P13), Triton's cache key (:func:`warm_triton_key`), standby
(:func:`standby_since`, :func:`wait_for_file`, P15), reading the weights ahead
(:class:`SpanPrefetch`, :func:`start_read_ahead`, :func:`read_ahead_direct_io`, P18), the JIT
caches (:func:`setup_jit`, :func:`jit_watch`, P10/P12), SAVE's kernel recording
(:func:`record_kernels`), LOAD's warm-up requests before "ready" (:func:`warm_up`, P14) and the
start-up profile (:func:`profiled`). Imports only the standard library at import time.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import pkgutil
import time
from typing import Any

from . import state, versions

log = logging.getLogger("vitrify.sglang")

JIT_ROOT_ENV = "VITRIFY_SGLANG_JIT_ROOT"  # the JIT caches are set up (SAVE redirects, LOAD unpacks)
READ_AHEAD_ENV = "VITRIFY_SGLANG_READ_AHEAD"  # "<launcher pid>:<span file the launcher reads>"
STANDBY_SINCE_ENV = "VITRIFY_SGLANG_STANDBY_SINCE"  # the launch's time (seconds since the epoch)
BEFORE_NARROWING_ENV = "VITRIFY_SGLANG_DISABLED_ARCHS_BEFORE"  # JSON: the user's value or null
STANDBY_POLL_S = 0.01  # how often a standby scheduler looks for its file
READ_AHEAD_SHARE = 0.5  # read ahead only spans that fit in this share of the available memory
WARMUP_BUDGET_S = 120.0  # LOAD's warm-up requests, all of them
JIT_WATCH_S = 30.0  # how often an idle scheduler looks for JIT compiles after the pack/thaw


# ---------------------------------------------------------------------------------------------
# the collector (P16)
# ---------------------------------------------------------------------------------------------


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
    full collection on the H200's host). What the start-up built before the capture stays
    frozen, as SGLang's own ``/freeze_gc`` leaves a served process."""
    gc.collect()
    if not enable_cudagraph_gc:
        gc.freeze()
    try:
        yield
    finally:
        if not enable_cudagraph_gc:
            gc.collect()


# ---------------------------------------------------------------------------------------------
# the model registry (P13)
# ---------------------------------------------------------------------------------------------


def model_modules(model: Any) -> list[str]:
    """The modules of SGLang's model package whose ``EntryClass`` is the class of ``model`` or
    of one of its submodules (short names, as ``SGLANG_DISABLED_MODEL_ARCHS`` spells them): all
    SGLang's model registry needs to build this model. [] when none is found (a model from
    another package)."""
    import sys

    if model is None:
        return []
    package = versions.current().MODELS_PACKAGE
    # the model's class and its submodules' (a multimodal model resolves its language model and
    # vision tower through the registry while it is built)
    walk = getattr(model, "modules", None)
    classes = {type(m) for m in walk()} if callable(walk) else set()
    classes.add(type(model))
    found = set()
    for name, module in list(sys.modules.items()):  # SGLang's model modules imported so far
        if module is None or not name.startswith(package + "."):
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

    ver = versions.current()
    env = os.environ if env is None else env
    if not modules or not isinstance(modules, list) or \
            not all(isinstance(m, str) and m for m in modules):
        return 0
    try:
        spec = importlib.util.find_spec(ver.MODELS_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return 0
    names = {m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)
             if not m.ispkg}
    if not set(modules) <= names:
        log.warning("vitrify: the archive's model module(s) %s are not in this SGLang's %s; "
                    "its model registry imports every module", sorted(set(modules) - names),
                    ver.MODELS_PACKAGE)
        return 0
    if BEFORE_NARROWING_ENV not in env:  # the user's own setting, for widen_model_registry
        env[BEFORE_NARROWING_ENV] = json.dumps(env.get(ver.DISABLED_ARCHS_ENV))
    have = [x.strip() for x in env.get(ver.DISABLED_ARCHS_ENV, "").split(",") if x.strip()]
    disabled = names - set(modules)
    env[ver.DISABLED_ARCHS_ENV] = ",".join(sorted(set(have) | disabled))
    return len(disabled)


def widen_model_registry(env: Any = None) -> bool:
    """Undo :func:`narrow_model_registry` (the user's own ``SGLANG_DISABLED_MODEL_ARCHS`` back):
    LOAD starting cold builds whatever model the server names. True when something was undone;
    it takes effect where SGLang's registry is not imported yet (the scheduler before
    ``load_model``)."""
    env = os.environ if env is None else env
    archs = versions.current().DISABLED_ARCHS_ENV
    if BEFORE_NARROWING_ENV not in env:
        return False
    try:
        before = json.loads(env.pop(BEFORE_NARROWING_ENV))
    except ValueError:
        before = None
    if isinstance(before, str):
        env[archs] = before
    else:
        env.pop(archs, None)
    return True


def narrow_models(cfg: Any) -> None:
    """LOAD: SGLang's model registry imports only the model module(s) SAVE recorded
    (:func:`narrow_model_registry`); the processes started later inherit the setting."""
    from ... import archive as _archive

    try:
        modules = state.archive_engine_state(cfg.archive).get("model_modules")
    except (_archive.ArchiveError, OSError) as e:  # the session's start reports it, fatally
        log.debug("vitrify SGLang plugin: model registry not narrowed: %s", e)
        return
    n = narrow_model_registry(modules)
    if n:
        log.info("vitrify SGLang plugin: the model registry imports %s only (%d other model "
                 "modules in %s)", ", ".join(modules), n, versions.current().DISABLED_ARCHS_ENV)
    else:
        log.info("vitrify SGLang plugin: the model registry imports every model module (the "
                 "archive names none this SGLang has: %s)", modules)


# ---------------------------------------------------------------------------------------------
# Triton's cache key
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# standby (P15)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# reading the weights ahead (P15, P18)
# ---------------------------------------------------------------------------------------------


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


def memory_available(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of memory the kernel counts as available (``MemAvailable``), or None."""
    try:
        with open(meminfo, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if key == "MemAvailable" and parts and parts[0].isdigit():
                    return int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        return None
    return None


def start_read_ahead(archive: Any, env: Any = None) -> SpanPrefetch | None:
    """P18, in the launcher: read the weights span of ``archive`` (opened) through the page
    cache on a thread while the scheduler starts (its imports take tens of seconds; the read,
    the drive's time), and tell the scheduler so (``VITRIFY_SGLANG_READ_AHEAD`` names the file:
    its thaw reads it through the cache, where pages this read has not reached yet come from the
    drive as it reads them too). Nothing is read when the span is already cached, or would take
    more than half the available memory (it would push itself out: read twice). Returns the
    read, or None."""
    from ... import session as _session
    from ... import snapshot

    env = os.environ if env is None else env
    rel = archive.spans(_session.RANK).get(snapshot.WEIGHTS_SPAN)
    if rel is None:
        log.info("vitrify: read-ahead: the archive has no weights span to read")
        return None
    path = archive.file_path(rel)
    try:
        size = os.path.getsize(path)
    except OSError as e:  # the thaw reports it, fatally
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


def launcher_read_ahead(cfg: Any, role: str) -> SpanPrefetch | None:
    """P18: LOAD's launcher (``read_ahead`` on, not a scheduler) reads the weights span ahead
    (:func:`start_read_ahead`), unless this launch reads it already. A failure is a warning: a
    speed-up never stops a server."""
    from ... import archive as _archive

    if cfg.mode != "load" or not cfg.read_ahead or role != "launcher" or \
            os.environ.get(READ_AHEAD_ENV, "").startswith(f"{os.getpid()}:"):
        return None
    try:
        return start_read_ahead(state.archive(cfg.archive))
    except (_archive.ArchiveError, OSError) as e:  # the thaw reports it, fatally
        log.info("vitrify: read-ahead: not started: %s", e)
        return None
    except Exception as e:  # noqa: BLE001 - a speed-up: it never stops a server
        log.warning("vitrify SGLang plugin: reading the weights ahead failed (%s: %s); the thaw "
                    "reads them itself", type(e).__name__, e)
        return None


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


# ---------------------------------------------------------------------------------------------
# JIT caches (P10, P12) and SAVE's kernels
# ---------------------------------------------------------------------------------------------


def setup_jit(cfg: Any) -> dict:
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
            dirs = jit.unpack(state.archive(cfg.archive), cfg.jit_dir)
    except (jit.JitCacheError, _archive.ArchiveError, OSError) as e:
        what = "redirecting the JIT caches" if cfg.mode == "save" else \
            "unpacking the archive's JIT caches"
        if cfg.mode == "load" and cfg.on_mismatch == "cold-start":
            log.warning("vitrify SGLang plugin: %s failed (%s); on_mismatch = \"cold-start\": "
                        "the engine compiles as usual", what, e)
            return {}
        raise state.fatal(f"{what} ({cfg.jit_dir}): {e} (jit_caches = false turns this "
                          f"off)") from None
    os.environ[JIT_ROOT_ENV] = cfg.jit_dir
    log.info("vitrify SGLang plugin: JIT caches %s %s", "redirected to" if cfg.mode == "save"
             else "unpacked at", cfg.jit_dir)
    return dirs


def jit_watch(run: Any) -> None:
    """Log JIT cache files written after the archive's caches were packed (SAVE) or thawed
    (LOAD): at most every ``JIT_WATCH_S`` seconds of idle time, once per new batch."""
    now = time.monotonic()
    if now - run.jit_checked < JIT_WATCH_S:
        return
    run.jit_checked = now
    from ... import jit

    try:  # a report only: nothing here may reach SGLang's scheduler loop
        if run.mode == "load" and run.jit_dirs is None:  # first look after the thaw
            run.jit_dirs = dict(state.STATE.jit_dirs or {})
            run.jit_index = jit.read_index(state.archive())
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


def record_kernels() -> None:
    """SAVE, scheduler process: record kernel binaries from here on (CUPTI), as early as the
    plugin runs there — before the model runner initialises CUDA — so the decode graphs'
    kernels can be frozen (session P6)."""
    from ... import graph

    try:
        graph.record_modules()
    except Exception as e:
        raise state.fatal(f"mode 'save' records the kernel binaries of the decode graphs, and "
                          f"CUPTI could not start: {type(e).__name__}: {e}") from None


@contextlib.contextmanager
def profiled(what: str):
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


# ---------------------------------------------------------------------------------------------
# LOAD's warm-up requests (P14)
# ---------------------------------------------------------------------------------------------


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


@contextlib.contextmanager
def starting(tm: Any, status: Any):
    """The block runs with SGLang's server marked "starting" again (``/health`` answers 503, so
    no user's request runs beside the plugin's own); the status it had comes back after.
    ``tm``/``status``: the version module's ``launcher_status()`` (None, None: nothing to mark)."""
    was = tm.server_status if tm is not None else None
    if tm is not None:
        tm.server_status = status.Starting
    try:
        yield
    finally:
        if tm is not None:
            tm.server_status = was


def post_generate(server_args: Any, body: dict, timeout: float) -> None:
    """One ``/generate`` request of the plugin's own to this server (its API key, its TLS
    setting), its whole answer read; raises on an HTTP error or an error inside the answer."""
    import requests

    ver = versions.current()
    key = ver.api_key(server_args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    stream = bool(body.get("stream"))
    with requests.post(server_args.url() + "/generate", json=body, headers=headers,
                       timeout=timeout, verify=ver.ssl_verify(server_args), stream=stream) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        check_answer(r.iter_lines() if stream else [r.content])


def warm_up(result: Any, server_args: Any = None, *args: Any, **kwargs: Any) -> Any:
    """LOAD, launcher: after SGLang's own warm-up request (three tokens) and before the server
    reports ready, ``warmup_requests`` requests of the prompt lengths SAVE served, of every kind
    of answer (:func:`warmup_body`). They load what the first real request would otherwise load
    on its way (kernel modules, cuBLAS's choices for the prefill's shapes, the extend kernels'
    variants, the logprob and streaming paths): the archive made them compiled, not loaded. A
    failure is a warning: the server still starts."""
    cfg = state.STATE.config
    if result is False or cfg is None or cfg.mode != "load" or not cfg.warmup_requests or \
            server_args is None:
        return result
    try:
        lengths = spread(state.archive_engine_state(cfg.archive).get("request_lengths"),
                         cfg.warmup_requests)
        if not lengths:
            return result
        ver = versions.current()
        dp = max(1, int(ver.reader(server_args)("dp_size") or 1))
        tm, status = ver.launcher_status()
        vocab = getattr(getattr(tm, "model_config", None), "vocab_size", None) or 1000
        t = time.perf_counter()
        with starting(tm, status):
            for i, n in enumerate(lengths):
                left = WARMUP_BUDGET_S - (time.perf_counter() - t)
                if left <= 0:
                    raise TimeoutError(f"{WARMUP_BUDGET_S:.0f} s spent, {len(lengths) - i} "
                                       f"request(s) not sent")
                ids = [warmup_ids(n, i * dp + j, vocab) for j in range(dp)]
                post_generate(server_args, warmup_body(ids[0] if dp == 1 else ids, i), left)
    except Exception as e:
        log.warning("vitrify: LOAD's warm-up requests failed (%s: %s); the first requests may "
                    "be slower", type(e).__name__, e)
        return result
    log.info("vitrify: LOAD warm-up: %d request(s) of %s tokens in %.2f s", len(lengths),
             ", ".join(map(str, lengths)), time.perf_counter() - t)
    return result


__all__ = ["BEFORE_NARROWING_ENV", "JIT_ROOT_ENV", "JIT_WATCH_S", "READ_AHEAD_ENV",
           "READ_AHEAD_SHARE", "STANDBY_POLL_S", "STANDBY_SINCE_ENV", "SpanPrefetch",
           "WARMUP_BUDGET_S", "capture_collections", "check_answer", "freeze_import_heap",
           "jit_watch", "launcher_read_ahead", "memory_available", "model_modules",
           "narrow_model_registry", "narrow_models", "post_generate", "profiled",
           "read_ahead_direct_io", "record_kernels", "setup_jit", "spread", "standby_since",
           "start_read_ahead", "starting", "wait_for_file", "warm_triton_key", "warm_up", "warmup_body", "warmup_ids",
           "widen_model_registry"]
