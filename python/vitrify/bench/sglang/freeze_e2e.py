"""SGLang FREEZE/THAW through vitrify's plugin in a REAL SGLang 0.5.17 server, end to end.

    python3 -m vitrify.bench.sglang.freeze_e2e --bundle .whl/sglang-site.tar.xz --shape tiny|8b
    python3 -m vitrify.bench.sglang.freeze_e2e --deterministic ...   # the cross-path proof
    python3 -m vitrify.bench.sglang.freeze_e2e --dry-run     # the server command lines only

(``benchmarks/sglang_freeze_e2e.py`` runs the same from a checkout.) Launches of the same server
(the shape's config with a seeded checkpoint of N(0, 0.02) matrices and unit norms,
:mod:`.checkpoint`; ``--skip-tokenizer-init``, triton attention, decode CUDA graphs, prefill
graphs off), each in its own process group, always stopped:

  plain   no plugin: the reference tokens and SGLang's own start-up figures (on a fresh
          machine: every Triton and tvm-ffi kernel compiles here)
  save    ``VITRIFY_SGLANG_CONFIG`` mode "save": the plugin freezes the engine into the
          archive once the server has served its warm-up request (the log says
          "SAVE complete"); then the prompts again
  load    mode "load" from that archive, in a fresh process: the prompts again, then the
          oracle's planted fault (below)

LOAD's launcher reads the weights span ahead while the scheduler imports (plugin P18); every
LOAD but ``load-cached`` starts with the archive dropped from the page cache. More launches run
when the budget leaves room: ``load-drive`` (LOAD with ``read_ahead = false``: the thaw reads
the drive itself), ``load-standby`` (LOAD waiting for a file after its imports: the go -> ready
time), ``plain-warm`` (SGLang again, its JIT caches warm from ``plain``) and ``load-cached``
(LOAD again after the archive was read once: from the page cache, the thaw without the drive).
SAVE first serves ``warm_prompts`` other prompts and freezes at the next idle moment
(``save_after_requests``), so kernels only real traffic compiles are archived.

Deterministic inference: LOAD against SAVE is a comparison within one cache path and is a check
under SGLang's defaults (the default run: the real configuration, and the start-up goals). SAVE
and LOAD against plain (and plain-warm against plain) cross from one process's kernels to
another's: they are checks only with ``--deterministic`` (every launch then runs with
``--enable-deterministic-inference``), otherwise recorded in ``comparisons`` with the reason.

For every launch: launch -> ready (``/health`` after SGLang's own warm-up request), the import
floor (launch -> the scheduler's first engine log line, "Init torch distributed begin"),
SGLang's start-up figures (``/get_server_info`` ``startup_time``: ``scheduler_e2e``,
``load_weight``, ``cuda_graph``), the first request's and the steady requests' time to first
token, the prompts' output tokens and logprobs (greedy, one request at a time) and the oracle's
pair (two prompts sharing only their last token: their answers must differ). For LOAD also the
files the JIT caches gained after the thaw, counted before the oracle's requests
(``vitrify.jit.compiled_since``: 0 means no compile after LOAD) and the plugin's own "thawed ...
in" line.

The planted fault (``oracle_power``): in the ``load`` launch, after its prompts, one element of
``model.layers.0.input_layernorm.weight`` is moved one ulp up through SGLang's own
``/update_weights_from_tensor``; the four longest prompts run again and their comparison with
SAVE must turn false; the weight goes back and the prompts must equal SAVE again.

Checks: the archive exists and verifies; no JIT after LOAD; LOAD's logprobs equal SAVE's bit for
bit; save's and load's tokens (and, deterministic, logprobs) equal the plain launch's. A run
whose oracle is blind fails. Writes one ``sglang-freeze-e2e-<date>-<commit>.json``
(:mod:`vitrify.bench.resultlib`; a ``.partial`` record while it runs) and the server logs into
``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from .. import resultlib
from . import harness, oracle
from .harness import (IMPORT_FLOOR_LINE, PLUGIN_LINE, SAVE_FAILED_LINE, SAVE_LINE,
                      STANDBY_LINE, STANDBY_READ_DONE_LINE, THAWED_LINE, LogWatch, Weights,
                      compare, flush_cache, generate, http_call, logprob_diff, make_prompts,
                      timeline)
from .models import model_config

NAME = "sglang-freeze-e2e"
# the first three are the proof; the others run when the budget leaves room: LOAD in standby
# (imports done before the go: the go -> ready time is the restart's critical path), a second
# plain launch with the JIT caches the first one compiled (SGLang's warm-cache start), LOAD
# again with the archive in the page cache (a restart soon after the archive was read: the
# thaw without the drive; vitrify.snapshot reads a cached span file through the cache)
SCENARIOS = ("plain", "save", "load", "load-standby", "plain-warm", "load-cached", "load-drive")
CORE = SCENARIOS[:3]
LOADS = ("load", "load-drive", "load-standby", "load-cached")
GOALS = {"load_scheduler_e2e_s": 3.0, "load_ready_over_import_floor_s": 5.0,
         "load_first_ttft_over_steady": 1.5}
GOAL_DIRECTION = {k: "<=" for k in GOALS}
# the weight the planted fault moves: an RMSNorm scale (ones in the checkpoint) at the model's
# input, so every token of every later layer sees it
FAULT_PARAM = "model.layers.0.input_layernorm.weight"
FAULT_PROMPTS = 4


@dataclass
class Settings:
    shape: str = "tiny"
    bundle: str = ".whl/sglang-site.tar.xz"
    site: str = "/tmp/sgsite"
    out: str = "build/sglang-freeze-e2e"
    work: str = "/tmp/vitrify-freeze-e2e"
    models_root: str = "/tmp/vitrify-models"  # <shape>-seed<seed>: config and checkpoint, kept
    weights: Weights = Weights()
    deterministic: bool = False  # --enable-deterministic-inference on every launch
    python: str = sys.executable
    port: int = 30041
    prompts: int = 16
    # SAVE serves these (other prompts, the same lengths) after SGLang's warm-up request and
    # freezes at the next idle moment (save_after_requests): kernels only real traffic compiles
    # are then in the archive; the measured prompts are new to every launch
    warm_prompts: int = 16
    min_len: int = 64
    max_len: int = 512
    max_new_tokens: int = 16
    seed: int = 11
    max_total_tokens: int = 32768
    cuda_graph_max_bs: int = 16
    # the held-out run of issue 34: pages of 16 tokens (SGLang's paged allocator: its kernels
    # are specialised on the batch size's power of two), up to 64 requests at once
    page_size: int = 16
    max_running: int = 64
    heldout: bool = True  # the held-out shape sweep in plain and load (heldout_sweep)
    shape_sweep: bool = True  # SAVE's own sweep (the plugin's shape_sweep)
    mem_fraction: float = 0.3
    region_gb: int = 24
    ready_s: float = 400.0
    save_s: float = 90.0   # SAVE normally ends before /health answers (the scheduler is busy)
    budget_s: float = 560.0  # the whole run: a device call has 600 s
    scenarios: tuple = SCENARIOS
    extra_launch_s: float = 150.0  # budget an optional launch needs to start
    standby_settle_s: float = 5.0  # a standby server idles this long before its go
    standby_read_s: float = 60.0  # ... and until its archive's spans are read, at most this long
    profile: Optional[str] = None  # a scenario whose scheduler start-up is profiled (cProfile)
    oracle: bool = True  # the pair in every launch, the planted fault in "load"
    extra_plugin_toml: dict = field(default_factory=dict)  # scenario -> more TOML lines

    @property
    def model_dir(self) -> str:
        return os.path.join(self.models_root, f"{self.shape}-seed{self.weights.seed}")

    @property
    def model_config(self) -> dict:
        return model_config(self.shape)

    @property
    def standby_file(self) -> str:
        return os.path.join(self.work, "standby-go")

    @property
    def archive(self) -> str:
        return os.path.join(self.work, f"{self.shape}.vitrify")

    @property
    def pair_len(self) -> int:
        return (self.min_len + self.max_len) // 2


SHAPE_SETTINGS = {"tiny": {"extra_launch_s": 90.0},
                  "8b": {"region_gb": 48, "mem_fraction": 0.5, "ready_s": 300.0},
                  "llama-1b": {"extra_launch_s": 90.0},
                  # 8.7 GB of weights (128 experts a layer): the fused-MoE kernels of every
                  # token-count class compile at plain and SAVE (issue 37)
                  "moe": {"region_gb": 32, "mem_fraction": 0.4, "ready_s": 400.0}}


def mode_of(scenario: str) -> str:
    return scenario.split("-")[0]


def plugin_config(s: Settings, scenario: str) -> str:
    """The plugin's TOML for ``scenario`` (written into the work directory)."""
    path = os.path.join(s.work, f"vitrify-{scenario}.toml")
    Path(path).write_text(f'mode = "{mode_of(scenario)}"\narchive = "{s.archive}"\n'
                          f'region_bytes = "{s.region_gb}GiB"\n'
                          f'jit_dir = "{os.path.join(s.work, "jit-" + scenario)}"\n'
                          f'save_after_requests = {1 + s.warm_prompts}\n'
                          f'shape_sweep = {"true" if s.shape_sweep else "false"}\n' +
                          (f'standby_file = "{s.standby_file}"\n' if scenario == "load-standby"
                           else "") +
                          ("read_ahead = false\n" if scenario == "load-drive" else "") +
                          s.extra_plugin_toml.get(scenario, ""))
    return path


def server_args(s: Settings, scenario: str) -> list[str]:
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; one of {SCENARIOS}")
    return harness.server_command(
        s.python, s.model_dir, s.port, weights=s.weights, deterministic=s.deterministic,
        extra=[harness.flag("prefill_backend"), "disabled",
               harness.flag("decode_max_bs"), str(s.cuda_graph_max_bs),
               "--page-size", str(s.page_size), "--max-running-requests", str(s.max_running),
               "--mem-fraction-static", str(s.mem_fraction),
               "--max-total-tokens", str(s.max_total_tokens), "--random-seed", "1"])


def server_env(s: Settings, scenario: str, probe: bool = True) -> dict:
    env = harness.server_env(s.site, probe=probe)
    env.pop("TVM_FFI_CACHE_DIR", None)  # each launch's own (the plugin's, or SGLang's default)
    env.pop("VITRIFY_LOG_LEVEL", None)
    if mode_of(scenario) == "plain":
        env.pop("VITRIFY_SGLANG_CONFIG", None)
    else:
        env["VITRIFY_SGLANG_CONFIG"] = plugin_config(s, scenario)
    env.pop("VITRIFY_SGLANG_JIT_ROOT", None)
    env.pop("VITRIFY_SGLANG_READ_AHEAD", None)
    if mode_of(scenario) != "plain":  # the plugin's lines (register runs before SGLang's logging)
        env["VITRIFY_LOG_LEVEL"] = "INFO"
    env.pop("VITRIFY_SGLANG_PROFILE", None)
    if scenario == s.profile:  # its timings are then slower than the others'
        env["VITRIFY_SGLANG_PROFILE"] = s.out
        os.makedirs(s.out, exist_ok=True)
    return env


def fault_tensor(s: Settings) -> tuple[str, Any]:
    """The weight the planted fault moves and its value in the checkpoint (ones, on the GPU:
    SGLang's own update path takes CUDA IPC tensors)."""
    import torch

    return FAULT_PARAM, torch.ones(s.model_config["hidden_size"], dtype=torch.bfloat16,
                                   device="cuda")


def fault_subset(prompts: list[list[int]], n: int = FAULT_PROMPTS) -> list[int]:
    """The indices of the ``n`` longest prompts (the most context for the fault to reach)."""
    return sorted(sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))[:n])


def plant_weight_fault(s: Settings, prompts: list[list[int]], reference: list[dict]) -> dict:
    """The planted fault in a running LOAD server (:func:`.oracle.weight_ulp_fault`): the
    subset of the prompts, rerun after a flush (misses, as SAVE's were), against ``reference``
    (SAVE's answers to them)."""
    if s.weights.kind != "checkpoint":
        return {"fault": "one weight one ulp up after LOAD", "planted": False, "caught": None,
                "why": f"{s.weights.kind} weights: the weight's value is not known"}
    name, clean = fault_tensor(s)

    def rerun() -> list[dict]:
        flush_cache(s.port)
        return [generate(s.port, p, s.max_new_tokens) for p in prompts]

    return oracle.weight_ulp_fault(lambda nt: harness.post_update(s.port, nt, None), rerun,
                                   reference, name=name, clean=clean)


def launch(s: Settings, scenario: str, prompts: list[list[int]], info: dict,
           left: Callable[[], float] = lambda: float("inf"),
           warm: list[list[int]] = (), more: list[list[int]] = (),
           pair: Optional[list[list[int]]] = None,
           while_up: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """One launch: ready, start-up figures, (SAVE: the ``warm`` prompts, then the archive),
    the prompts, then ``more`` (a second steady sample), (LOAD: the JIT files compiled since
    the thaw), the oracle's ``pair`` and ``while_up(info)`` (the planted fault); stops the
    server. ``left()``: seconds of the run's budget left (the waits never outlast it)."""
    log = os.path.join(s.out, f"sglang-{scenario}.log")
    srv = harness.Server(server_args(s, scenario), server_env(s, scenario), log)
    info["deterministic"] = srv.deterministic
    t_wall = time.time()
    watch = LogWatch(log, {"floor": IMPORT_FLOOR_LINE, "thawed": THAWED_LINE,
                           "saved": SAVE_LINE, "save_failed": SAVE_FAILED_LINE,
                           "plugin": PLUGIN_LINE, "standby": STANDBY_LINE,
                           "standby_read": STANDBY_READ_DONE_LINE})
    if scenario == "load-standby" and os.path.lexists(s.standby_file):
        os.unlink(s.standby_file)
    t_go = None
    with srv:
        t0 = time.monotonic()
        # an optional launch leaves the final archive check its time
        reserve = 20 + (verify_reserve_s(s) if scenario not in CORE else 0)
        deadline = t0 + min(s.ready_s, max(30.0, left() - reserve))
        budget_limited = s.ready_s > left() - reserve
        while True:
            watch.poll()
            # the operator's go: the standby has waited a while and read its archive (a
            # replacement started while the old server serves), or the read takes too long
            if scenario == "load-standby" and t_go is None and "standby" in watch.seen and \
                    time.monotonic() - watch.seen["standby"] >= s.standby_settle_s and \
                    ("standby_read" in watch.seen or
                     time.monotonic() - watch.seen["standby"] >= s.standby_read_s):
                Path(s.standby_file).touch()  # the operator's go
                t_go = time.monotonic()
                info["standby_waiting_at_s"] = round(watch.seen["standby"] - t0, 2)
            st, _ = http_call(s.port, "GET", "/health", timeout=2.0) if srv.alive() else (0, "")
            if st == 200:
                break
            if not srv.alive():
                raise RuntimeError(f"the {scenario} server exited before it was ready")
            if time.monotonic() > deadline:
                if scenario == "load-standby" and "standby" not in watch.seen:
                    raise RuntimeError(f"the {scenario} server never logged that it waits "
                                       f"(no 'vitrify: standby: imports done' line)")
                info["budget_limited"] = budget_limited
                raise RuntimeError(f"the {scenario} server was not ready after "
                                   f"{time.monotonic() - t0:.0f} s")
            time.sleep(0.2)
        info["ready_s"] = round(time.monotonic() - t0, 2)
        if t_go is not None:
            info["go_to_ready_s"] = round(time.monotonic() - t_go, 2)
            info["go_after_the_standby_read"] = "standby_read" in watch.seen and \
                watch.seen["standby_read"] <= t_go
        watch.poll()
        if mode_of(scenario) != "plain" and "plugin" not in watch.seen:
            raise RuntimeError(f"the {scenario} server started without vitrify's plugin (no "
                               f"'vitrify SGLang plugin: mode' line): is the entry point "
                               f"installed?")
        if "floor" in watch.seen:
            info["import_floor_s"] = round(watch.seen["floor"] - t0, 2)
        st = harness.server_info(s.port).get("startup_time") or {}
        info["startup_time"] = st
        if scenario == "save":  # the archive is written at the first idle moment after them
            info["warm_prompts"] = len(warm)
            for p in warm:
                generate(s.port, p, s.max_new_tokens)
            t = time.monotonic()
            while "saved" not in watch.seen and "save_failed" not in watch.seen and \
                    time.monotonic() - t < min(s.save_s, max(5.0, left() - 60)):
                watch.poll()
                time.sleep(0.5)
            info["save_wait_s"] = round(time.monotonic() - t, 2)
            info["saved"] = "saved" in watch.seen
            if "save_failed" in watch.matches:
                info["save_failed"] = watch.matches["save_failed"].string.strip()[-400:]
        if "thawed" in watch.matches:
            info["thaw_s"] = float(watch.matches["thawed"].group(2))
        res = [generate(s.port, p, s.max_new_tokens) for p in prompts]
        extra = [generate(s.port, p, s.max_new_tokens) for p in more]
        info["first_ttft_ms"] = round(1e3 * res[0]["ttft_s"], 2)
        info["steady_ttft_ms_median"] = round(
            1e3 * statistics.median(r["ttft_s"] for r in res[1:]), 2)
        info["ttft_ms"] = [round(1e3 * r["ttft_s"], 2) for r in res]
        if extra:
            info["second_sample_ttft_ms_median"] = round(
                1e3 * statistics.median(r["ttft_s"] for r in extra), 2)
        if s.heldout and scenario in ("plain", "load"):
            info["heldout"] = heldout_sweep(s)
        if mode_of(scenario) == "load":
            # before the oracle's requests: their shapes are not the prompts'
            try:
                info["jit"] = jit_after_load(s, scenario)
            except Exception as e:  # the run counts them after the launch instead
                info["jit_error"] = f"{type(e).__name__}: {e}"
        if pair:
            pr = [generate(s.port, p, s.max_new_tokens) for p in pair]
            info["pair"] = oracle.pair_power(pr[0], pr[1], scenario)
        if while_up is not None:
            while_up(info)
    # recorded, not a check: SGLang also logs tracebacks it caught and recovered from
    info["traceback_in_log"] = "Traceback" in Path(log).read_text(errors="replace")
    info["timeline"] = timeline(log, t_wall)
    if info["timeline"].get("deterministic_inference") is not None:
        info["deterministic_inference_logged"] = info["timeline"]["deterministic_inference"]
    return res


def triton_cache_files() -> int:
    """Files in the Triton cache a plain launch uses (``TRITON_CACHE_DIR``, else Triton's
    default ``~/.triton/cache``)."""
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return sum(len(f) for _, _, f in os.walk(cache))


def heldout_sweep(s: Settings) -> dict:
    """Request shapes past every warm-up (:func:`.harness.heldout_shapes`: batch sizes the
    plugin's sweep does not send, off the decode-graph ladder above its top, page-unaligned
    prompt lengths spread over the context, prefix hits), each batch one request. In LOAD the
    JIT count after them is the check (no compile after the thaw); in plain the Triton files
    they compiled are what the check would catch without the archive's caches (recorded: a
    plain launch on a machine whose cache is warm compiles none)."""
    info = harness.server_info(s.port)
    ctx = int(info.get("context_length") or s.model_config["max_position_embeddings"])
    longest = info.get("max_req_input_len")
    max_input = min(int(longest) if isinstance(longest, int) else ctx,
                    ctx - s.max_new_tokens - 2)
    shapes = harness.heldout_shapes(s.seed + 1300, max_input, s.max_running, s.page_size,
                                    s.model_config["vocab_size"])
    before = triton_cache_files()
    t = time.monotonic()
    for batch in shapes:
        harness.generate_batch(s.port, batch, 4)
    return {"requests": len(shapes), "batch_sizes": [len(b) for b in shapes],
            "prompt_lengths": sorted({len(p) for b in shapes for p in b}),
            "max_input": max_input, "seconds": round(time.monotonic() - t, 2),
            "default_triton_cache_files_gained": triton_cache_files() - before}


def drop_tree(path: str) -> Optional[float]:
    """Drop every file under ``path`` from the page cache (``POSIX_FADV_DONTNEED``: the clean
    pages go), so the next launch reads from the drive; the share of the weights span still
    cached afterwards (None where it cannot be told)."""
    from vitrify import snapshot

    resultlib.drop_page_cache(f for f in sorted(Path(path).rglob("*")) if f.is_file())
    w = weights_span_path(path)
    return snapshot.page_cache_share(w) if os.path.isfile(w) else None


def weights_span_path(archive: str) -> str:
    return os.path.join(archive, "rank0", "region", "weights.span")


def read_tree(path: str) -> float:
    """Read every file under ``path`` once (buffered, 8 MiB at a time); seconds taken."""
    t = time.monotonic()
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.read(8 << 20):
                    pass
    return round(time.monotonic() - t, 2)


def tree_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) \
        if os.path.isdir(path) else 0


def weights_span(s: Settings) -> str:
    return weights_span_path(s.archive)


def drive_ceiling(s: Settings, max_bytes: int = 4 << 30) -> dict:
    """The drive's cold read rate, measured in this run: ``dd iflag=direct bs=64M`` over the
    first ``max_bytes`` of the weights span file LOAD reads (the same file on the same drive;
    O_DIRECT is never served from the page cache), and fio's O_DIRECT read (queue depth 16) of
    a file it writes under the work directory, where fio is installed (``. scripts/use-fio-
    bundle.sh``). The ceiling is the faster of the two."""
    from vitrify.bench.hicache import fio_read_limit
    from vitrify.bench.snapshot import dd_read_rate

    out: dict[str, Any] = {}
    path = weights_span(s)
    if os.path.isfile(path):
        count = max(1, min(os.path.getsize(path), max_bytes) >> 26)
        try:
            rate, cmd = dd_read_rate(path, True, count=count)
            out["dd"] = {"bytes_per_s": rate, "bytes": count << 26, "command": cmd}
        except Exception as e:  # reported; the run's checks do not depend on it
            out["dd"] = {"error": f"{type(e).__name__}: {e}"}
    if shutil.which("fio"):
        rate = fio_read_limit(s.work, 2 << 30)
        out["fio"] = {"bytes_per_s": rate, "bytes": 2 << 30, "command": "fio --rw=read "
                      "--bs=1m --direct=1 --ioengine=libaio --iodepth=16"} \
            if isinstance(rate, float) else {"error": str(rate)}
    else:
        out["fio"] = {"error": "fio not installed (. scripts/use-fio-bundle.sh)"}
    rates = [v["bytes_per_s"] for v in out.values() if "bytes_per_s" in v]
    out["bytes_per_s"] = max(rates) if rates else None
    return out


def weights_figures(s: Settings, scenarios: dict, ceiling: Optional[float]) -> dict:
    """Each LOAD's weights span restore against the drive: its rate, that rate over the
    drive's ceiling, and the scheduler start-up without the span's read at the ceiling (what
    a drive of any speed cannot take away)."""
    path = weights_span(s)
    if not os.path.isfile(path):
        return {}
    size = os.path.getsize(path)
    out: dict[str, Any] = {"weights_span_bytes": size}
    if ceiling:
        out["weights_span_at_ceiling_s"] = round(size / ceiling, 3)
    for sc in LOADS:
        info = scenarios.get(sc) or {}
        took = ((info.get("timeline") or {}).get("session_steps_s") or {}).get("restore_weights")
        if not took:
            continue
        row = {"restore_s": took, "bytes_per_s": size / took}
        cached = ((info.get("timeline") or {}).get("weights_in_page_cache_pct") or 0) >= 90
        if cached:  # read from memory: the drive's figures do not apply
            row["from_the_page_cache"] = True
        elif ceiling:
            row["over_drive_ceiling"] = round(size / took / ceiling, 3)
            e2e_s = (info.get("startup_time") or {}).get("scheduler_e2e")
            # a read-ahead overlapped part of the drive's read with the imports: no such figure
            if e2e_s is not None and sc != "load-standby" and \
                    "read_ahead" not in (info.get("timeline") or {}):
                row["scheduler_e2e_without_the_drive_s"] = round(e2e_s - size / ceiling, 3)
        out[sc] = row
    return out


def verify_reserve_s(s: Settings, read_rate: float = 1.0e9) -> float:
    """Seconds the final archive check needs: every byte read back (CRC32C) at a cold read
    rate below this machine's drive (~1.5 GB/s), plus the JIT walks."""
    return 20.0 + tree_bytes(s.archive) / read_rate  # + the drive's ceiling (drive_ceiling)


def jit_after_load(s: Settings, scenario: str = "load") -> dict:
    """What the LOAD launch's JIT caches gained beyond the archive's (a compile after thaw), and
    what SAVE's own caches gained after it packed them (kernels its prompts compiled after the
    warm-up request: missing from the archive, not compiled because of the thaw)."""
    from vitrify import archive as _archive
    from vitrify import jit

    a = _archive.open_archive(s.archive)
    index = jit.read_index(a)

    def gained(root: str) -> dict:
        dirs = {n: os.path.join(root, n) for n in jit.CACHES
                if os.path.isdir(os.path.join(root, n))}
        return jit.compiled_since(dirs, index)

    new = gained(os.path.join(s.work, "jit-" + scenario))
    after_pack = gained(os.path.join(s.work, "jit-save"))
    return {"archived": {n: len(c["files"]) for n, c in ((index or {}).get("caches") or {}).items()},
            "compiled_after_load": {n: len(v) for n, v in new.items()},
            "compiled_at_save_after_the_pack": {n: len(v) for n, v in after_pack.items()},
            "examples": {n: v[:5] for n, v in new.items() if v}}


def comparisons_of(s: Settings, scenarios: dict, results: dict) -> list[dict]:
    """Every pass comparison of the run (:func:`.harness.compare`): each launch's tokens and
    logprobs against plain (crossing from one process's kernels to another's), each LOAD's
    logprobs against SAVE's (one path)."""
    out = []
    plain = results.get("plain")

    def det(sc: str) -> bool:
        return bool((scenarios.get(sc) or {}).get("deterministic"))

    for sc in SCENARIOS[1:]:
        if sc in results and plain:
            for what, lp in (("tokens_identical", False), ("logprobs_identical_vs_plain", True)):
                out.append(compare(f"{sc}.{what}", results[sc], plain, launches=(sc, "plain"),
                                   deterministic=(det(sc), det("plain")), crosses=True,
                                   logprobs=lp))
    for sc in LOADS:
        if "save" in results and sc in results:
            out.append(compare(f"{sc}.logprobs_identical_vs_save", results[sc], results["save"],
                               launches=(sc, "save"), deterministic=(det(sc), det("save")),
                               crosses=False))
    return out


def run(s: Settings) -> dict:
    t_start = time.monotonic()

    def left() -> float:  # seconds of the run's budget still left
        return s.budget_s - (time.monotonic() - t_start)

    extra: dict[str, Any] = {}
    os.makedirs(s.out, exist_ok=True)
    shutil.rmtree(s.work, ignore_errors=True)
    os.makedirs(s.work, mode=0o700)
    os.chmod(s.work, 0o700)  # LOAD unpacks JIT caches below it: no one else may write there
    extra["bundle"] = harness.unpack_bundle(s.bundle, s.site, s.python)
    extra["vitrify"] = harness.vitrify_origin(s.python)
    extra["weights"] = harness.write_model(s.model_dir, s.model_config, s.weights)
    prompts = make_prompts(s.seed, s.prompts, s.min_len, s.max_len)
    warm = make_prompts(s.seed + 500, s.warm_prompts, s.min_len, s.max_len)
    more = make_prompts(s.seed + 700, s.prompts, s.min_len, s.max_len)
    pair = list(oracle.last_token_pair(s.seed + 900, s.pair_len)) if s.oracle else None
    subset = fault_subset(prompts)
    scenarios: dict[str, dict] = {}
    results: dict[str, list[dict]] = {}
    for sc in s.scenarios:
        info: dict[str, Any] = {}
        scenarios[sc] = info
        # an optional launch also leaves room for the final archive check (read back at the
        # drive's rate)
        need = 60 if sc in CORE else s.extra_launch_s + verify_reserve_s(s)
        if left() < need:
            info["ok"], info["error"] = False, f"skipped: {left():.0f} s of the budget left"
            info["skipped"] = True
            continue
        while_up = None
        if sc == "load" and s.oracle and "save" in results:
            ref = [results["save"][i] for i in subset]

            def while_up(i: dict, ref=ref) -> None:
                i["fault"] = plant_weight_fault(s, [prompts[j] for j in subset], ref)
        try:
            if sc == "load-cached":  # read once: the page cache holds the archive
                info["page_cache_warm_s"] = read_tree(s.archive)
            elif mode_of(sc) == "load":  # the others thaw from the drive (or read it ahead)
                info["weights_cached_share_at_launch"] = drop_tree(s.archive)
            if mode_of(sc) == "plain":  # cold (a fresh machine) or warm: what its cache held
                cache = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
                info["triton_cache_files_before"] = sum(len(f) for _, _, f in os.walk(cache))
            results[sc] = launch(s, sc, prompts, info, left, warm=warm if sc == "save" else (),
                                 more=more, pair=pair, while_up=while_up)
            info["ok"] = (sc != "save" or bool(info.get("saved"))) and \
                (sc != "load-standby" or info.get("go_to_ready_s") is not None)
        except Exception as e:
            info["ok"], info["error"] = False, f"{type(e).__name__}: {e}"
            info["log_tail"] = harness.log_tail(os.path.join(s.out, f"sglang-{sc}.log"))
            if sc not in CORE and info.get("budget_limited"):  # the budget, not a failure
                info["skipped"] = True
        # what is known so far survives a run killed at the device call's limit
        harness.write_partial(s.out, f"{NAME}-{s.shape}", {"scenarios": scenarios, **extra})
        if sc == "save" and not info["ok"]:
            break  # nothing to load
    checks: dict[str, Any] = {}
    plain = results.get("plain")
    for sc in SCENARIOS[1:]:
        if sc in results and plain:
            checks[f"{sc}.prompts_identical"] = sum(
                a["output_ids"] == b["output_ids"] for a, b in zip(results[sc], plain))
    comparisons = comparisons_of(s, scenarios, results)
    harness.fold(comparisons, checks)
    for sc in LOADS:
        if "save" in results and sc in results:
            extra[f"{sc}_logprob_max_abs_diff_vs_save"] = logprob_diff(results[sc],
                                                                       results["save"])
    if os.path.isdir(s.archive):
        from vitrify import archive as _archive

        problems = _archive.open_archive(s.archive, checksums=True).verify()
        checks["archive_verifies"] = not problems
        extra["archive_bytes"] = tree_bytes(s.archive)
        extra["drive"] = drive_ceiling(s)
        extra["weights_restore"] = weights_figures(s, scenarios, extra["drive"]["bytes_per_s"])
    ratios = {}
    for sc in LOADS:
        ld, key = scenarios.get(sc, {}), sc.replace("-", "_")
        if not ld.get("ok"):
            continue
        jit_key = "jit" if sc == "load" else f"jit_{key}"
        extra[jit_key] = ld.get("jit") or jit_after_load(s, sc)
        if ld.get("jit") is not None:  # what the oracle's requests compiled on top
            now = jit_after_load(s, sc)["compiled_after_load"]
            extra[jit_key]["compiled_by_the_oracle_requests"] = {
                n: now.get(n, 0) - ld["jit"]["compiled_after_load"].get(n, 0) for n in now}
        checks[f"{sc}.no_jit_after_thaw"] = not any(extra[jit_key]["compiled_after_load"].values())
        if sc != "load-standby":  # its scheduler start-up and ready include the standby
            ratios[f"{key}_scheduler_e2e_s"] = (ld.get("startup_time") or {}).get("scheduler_e2e")
        if ld.get("import_floor_s") is not None and sc != "load-standby":
            ratios[f"{key}_ready_over_import_floor_s"] = ld["ready_s"] - ld["import_floor_s"]
        ratios[f"{key}_first_ttft_over_steady"] = harness.ratio(ld.get("first_ttft_ms"),
                                                                ld.get("steady_ttft_ms_median"))
        if ld.get("go_to_ready_s") is not None:
            ratios[f"{key}_go_to_ready_s"] = ld["go_to_ready_s"]
    ratios = {k: v for k, v in ratios.items() if v is not None}
    rows = [{"scenario": sc, **{k: v for k, v in info.items()
                                if k in ("ready_s", "import_floor_s", "first_ttft_ms",
                                         "steady_ttft_ms_median", "thaw_s", "save_wait_s",
                                         "go_to_ready_s", "deterministic")},
             "scheduler_e2e_s": (info.get("startup_time") or {}).get("scheduler_e2e")}
            for sc, info in scenarios.items()]
    ok = all(scenarios.get(sc, {}).get("ok") for sc in CORE) and \
        all(info.get("ok") or info.get("skipped") for info in scenarios.values()) and \
        all(v for v in checks.values() if isinstance(v, bool))
    pairs = [info["pair"] for info in scenarios.values() if "pair" in info]
    fault = (scenarios.get("load") or {}).get("fault")
    if fault is None:
        fault = {"fault": "one weight one ulp up after LOAD", "planted": False, "caught": None,
                 "why": "not run: " + ("the oracle is off" if not s.oracle else
                                       (scenarios.get("load") or {}).get("error",
                                                                          "no load launch"))}
    plain_gained = ((scenarios.get("plain") or {}).get("heldout") or {}).get(
        "default_triton_cache_files_gained")
    extra["jit_check_power"] = {
        "plain_triton_files_compiled_by_the_heldout_sweep": plain_gained,
        "why": "the held-out shapes compile kernels a server that served only the prompts has "
               "not compiled (0 where this machine's Triton cache was warm from an earlier run)"}
    return harness.result(
        f"{NAME}-{s.shape}", ok=ok, oracle_power=oracle.power(pairs, fault, extra.get("weights")), rows=rows,
        ratios=ratios, goals=GOALS, goal_direction=GOAL_DIRECTION, checks=checks,
        comparisons=comparisons, scenarios=scenarios,
        settings={**{k: getattr(s, k) for k in (
            "shape", "prompts", "min_len", "max_len", "max_new_tokens", "max_total_tokens",
            "cuda_graph_max_bs", "page_size", "max_running", "heldout", "shape_sweep",
            "region_gb", "deterministic")},
            "fault_prompts": subset, "fault_param": FAULT_PARAM},
        **extra)


def parse_args(argv=None) -> tuple[Settings, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python3 -m vitrify.bench.sglang.freeze_e2e",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPE_SETTINGS), default="tiny")
    ap.add_argument("--bundle", default=Settings.bundle)
    ap.add_argument("--out", default=os.environ.get("OUT") or Settings.out)
    ap.add_argument("--work", default=Settings.work)
    ap.add_argument("--models-root", default=Settings.models_root,
                    help="where <shape>-seed<seed> (config and checkpoint) is written and kept")
    ap.add_argument("--weights-seed", type=int, default=0, help="the checkpoint's seed")
    ap.add_argument("--deterministic", action="store_true",
                    help="--enable-deterministic-inference on every launch: SAVE's and LOAD's "
                         "tokens and logprobs against plain become checks (default: SGLang's "
                         "defaults; LOAD against SAVE is the check)")
    ap.add_argument("--prompts", type=int, default=Settings.prompts)
    ap.add_argument("--page-size", type=int, default=Settings.page_size)
    ap.add_argument("--no-heldout", dest="heldout", action="store_false",
                    help="no held-out shape sweep in plain and load")
    ap.add_argument("--no-shape-sweep", dest="shape_sweep", action="store_false",
                    help="SAVE without the plugin's shape sweep (the JIT check's power: LOAD "
                         "then compiles under the held-out sweep)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated, in this order: {','.join(SCENARIOS)} (the first "
                         f"three are required)")
    ap.add_argument("--budget-s", type=float, default=Settings.budget_s)
    ap.add_argument("--profile", choices=[sc for sc in SCENARIOS if sc.startswith(("save", "load"))],
                    help="profile this launch's scheduler start-up (cProfile, written to --out; "
                         "its timings are then not comparable)")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.prompts < 2:
        ap.error("--prompts must be >= 2 (the first request is timed apart)")
    chosen = tuple(x.strip() for x in a.scenarios.split(",") if x.strip())
    if not set(CORE) <= set(chosen) or not set(chosen) <= set(SCENARIOS):
        ap.error(f"--scenarios must name {','.join(CORE)} and only these: {','.join(SCENARIOS)}")
    s = replace(Settings(**SHAPE_SETTINGS[a.shape]), shape=a.shape, bundle=a.bundle, out=a.out,
                work=a.work, models_root=a.models_root, weights=Weights(seed=a.weights_seed),
                deterministic=a.deterministic, prompts=a.prompts, budget_s=a.budget_s,
                page_size=a.page_size, heldout=a.heldout, shape_sweep=a.shape_sweep,
                profile=a.profile, scenarios=tuple(sc for sc in SCENARIOS if sc in chosen))
    return s, a


def main(argv=None) -> int:
    s, a = parse_args(argv)
    if a.dry_run:
        os.makedirs(s.work, exist_ok=True)
        print(f"# model: {s.model_dir} ({s.shape}, weights {s.weights.kind} seed "
              f"{s.weights.seed}, deterministic inference {'on' if s.deterministic else 'off'})")
        for sc in s.scenarios:
            env = server_env(s, sc, probe=False)
            print(f"# {sc}: VITRIFY_SGLANG_CONFIG={env.get('VITRIFY_SGLANG_CONFIG', '')}")
            print(" ".join(server_args(s, sc)))
        return 0
    s.out, s.bundle = os.path.abspath(s.out), os.path.abspath(s.bundle)
    res = run(s)
    path = harness.write(res, s.out)
    resultlib.print_table(res["rows"], ["scenario", "ready_s", "import_floor_s",
                                        "scheduler_e2e_s", "thaw_s", "go_to_ready_s",
                                        "first_ttft_ms", "steady_ttft_ms_median"])
    for k, v in sorted(res.get("checks", {}).items()):
        print(f"  {k}: {v}")
    for k, v in sorted(res.get("ratios", {}).items()):
        print(f"  {k}: {v:.3f}")
    for sc, info in res.get("scenarios", {}).items():
        print(f"  {sc}: ok={info.get('ok')} {info.get('error', '')}")
    op = res["oracle_power"]
    print(f"  oracle_power: ok={op.get('ok')} {'; '.join(op.get('why', []))}")
    print(f"ok={res.get('ok')}\nwrote {path}")
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
