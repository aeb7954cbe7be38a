"""vitrify's HiCache L3 backend in a REAL SGLang 0.5.17 server on a GPU machine, end to end.

    python3 -m vitrify.bench.sglang.hicache_e2e [--bundle .whl/sglang-site.tar.xz] [--out DIR]
    python3 -m vitrify.bench.sglang.hicache_e2e --dry-run   # the server command lines only

(``benchmarks/sglang_hicache_e2e.py`` runs the same from a checkout.) The GPU machine has no
internet: SGLang comes from a carried bundle (``scripts/sglang-bundle/build.sh``), unpacked once
to ``--site``. The model is the shape's config with a seeded checkpoint of N(0, 0.02) matrices
and unit norms (:mod:`.checkpoint`, written on the GPU in seconds and kept for later runs), so
the outputs depend on the whole context; requests send ``input_ids`` (``--skip-tokenizer-init``).

Every launch runs with ``--enable-deterministic-inference`` (``--no-deterministic`` turns it
off): the run compares L3 hits with misses, and a restarted server with the first one, and SGLang
0.5.17 is deterministic across those cache paths only so (without it, those comparisons are
recorded, not checks; :func:`.harness.compare`).

Scenarios, each one server launch (own process group, always stopped), radix cache on,
hierarchical cache on (``write_through``, prefetch policy ``wait_complete`` so an L3 hit is
waited for instead of recomputed), ``--page-size 64`` (16 KiB of KV per token -> 1 MiB pages):

  vitrify       vitrify backend (``dynamic``, ``interface_v1``), ``cold_start="clear"``. Passes:
                ``miss`` (fresh), the oracle's pair (two prompts sharing only their last token),
                wait until the backend has written every prompt page (its ``set_pages``
                counter, read from the JSON file it keeps at the extra config's
                ``stats_path``), ``device_hit`` (same prompts again: prefix on the GPU),
                ``/flush_cache`` (drops the radix tree and the host pool but not the L3 storage,
                read in 0.5.17's HiRadixCache.reset), drop the page cache of the L3 files, one
                untimed L3 warm-up request, then ``l3_hit`` (prefix must come from L3). A
                warm-up prompt before ``miss`` takes the JIT/Triton compiles.
  (between)     the planted fault: with the server stopped, this process opens its store through
                vitrify's store API and puts page B's bytes (the pair's second prompt, middle
                page) under page A's key (the pair's first prompt, same page): a valid checksum,
                the wrong context.
  vitrify_restart  a second launch, ``cold_start="load"`` on the same slabs: ``l3_restart`` (the
                FIRST request of the new process must hit L3), the pair from L3 (the faulty
                prompt must differ from its miss, the untouched one must not),
                ``l3_restart_again`` (the same pass once more after a flush: the restarted
                process with its one-time costs paid, ``l3_restart_again_over_l3_hit``), then
                flush + clear the storage (``/hicache/storage-backend/clear``) and
                ``miss_after_clear``: a fresh miss that must equal the first launch's ``miss``
                (cross-launch determinism); then fillers (1.1 x the device pool of other prompts)
                push the prompts off the GPU into SGLang's host pool, and ``l2_hit`` loads them
                from there: every storage hit passes through that pool, so its TTFT is the floor
                of an L3 hit in SGLang (``l2_hit_over_device_hit``, ``l3_restart_over_l2_hit``).
  file          SGLang's own ``file`` backend, same prompts and flow as ``vitrify``: the same-run
                baseline for L3-hit latency (dropped, and said so, when time runs short).

Checks (JSON ``checks``; each pass comparison also in ``comparisons`` with its launches, whether
they were deterministic and whether it crosses a cache path): per scenario, output tokens and
logprobs of the L3 pass equal the miss pass; the logprobs of the L3 pass equal the
``device_hit`` pass bit for bit; every L3 request reports cached tokens from storage
(``meta_info.cached_tokens_details.storage``); the vitrify backend's ``errors`` counter (its
stats file) is 0 (``no_backend_errors``). ``oracle_power``: the pair's answers differ, and the
planted page was caught (the restart's L3 hit of the faulty prompt differs from its miss while
the untouched prompt's equals its own); a blind oracle fails the run. Writes one
``sglang-hicache-e2e-<date>-<commit>.json`` (:mod:`vitrify.bench.resultlib`) and every server log
into ``--out``; prints a table. Exit status 0 only when every check of every scenario run passed
and the oracle has power.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .. import resultlib
from . import harness, oracle
from .harness import (Weights, compare, flush_cache, generate, http_call, logprob_diff,
                      make_prompts, prefix_pages, ratio, run_pass, tokens_identical)
from .models import MiB, SHAPES, kv_bytes_per_token, model_config, page_tokens_for

NAME = "sglang-hicache-e2e"
PAIR_MAX_LEN = 1024

# Model shapes (--shape): the run's settings for each (the configs are in models.py).
SHAPE_SETTINGS: dict[str, dict[str, Any]] = {
    "tiny": {},
    # 64-token pages of 9 MiB; an L3 budget for every prompt's pages; 16 GB of weights
    "8b": {"page_bytes": 9 * MiB, "vitrify_budget_bytes": 8 << 30, "mem_fraction": 0.5,
           "first_ready_s": 300.0, "ready_s": 240.0, "budget_s": 570.0},
    # 64-token pages of 1.125 MiB
    "8b-mqa": {"page_bytes": 64 * 18432, "vitrify_budget_bytes": 2 << 30, "mem_fraction": 0.5,
               "first_ready_s": 300.0, "ready_s": 240.0, "budget_s": 570.0},
    # 64-token pages of 2 MiB (32 KiB of KV per token)
    "llama-1b": {"page_bytes": 2 * MiB, "vitrify_budget_bytes": 2 << 30},
}


# ---- configuration -----------------------------------------------------------------------------


@dataclass
class Settings:
    shape: str = "tiny"                      # a key of SHAPES (for_shape() sets the rest)
    bundle: str = ".whl/sglang-site.tar.xz"
    site: str = "/tmp/sgsite"
    models_root: str = "/tmp/vitrify-models"  # <shape>-seed<seed>: config and checkpoint, kept
    model_dir: str = ""                      # default: models_root/<shape>-seed<seed>
    weights: Weights = Weights()
    deterministic: bool = True               # --enable-deterministic-inference on every launch
    work: str = "/tmp/vitrify-sglang-e2e"       # L3 directories (vitrify slabs, file backend files)
    out: str = "build/sglang-hicache-e2e"
    log_dir: str = ""                        # server logs (default: out)
    port: int = 30021
    python: str = sys.executable
    prompts: int = 6
    min_len: int = 2000
    max_len: int = 4000
    seed: int = 8
    max_new_tokens: int = 16
    budget_s: float = 530.0                  # whole script, unpack included
    first_ready_s: float = 240.0            # fresh machine: JIT + Triton compiles
    ready_s: float = 180.0
    max_total_tokens: int = 65536            # device pool (tokens): every prompt stays on it
    hicache_ratio: float = 2.0               # host pool = 2 x device pool (~2.1 GB pinned)
    io_backend: str = "kernel"
    mem_layout: str = "page_first"
    vitrify_budget_bytes: int = 1 << 30
    skip_file: bool = False
    skip_restart: bool = False
    second_server: bool = False              # a reader server beside the restarted one
    host_bytes: int = 0                      # vitrify's host tier in /dev/shm (0: disk only)
    host_dir: str = "/dev/shm/vitrify-e2e-host"
    page_bytes: int = MiB
    mem_fraction: float = 0.3

    def __post_init__(self) -> None:
        if not self.model_dir:
            self.model_dir = os.path.join(self.models_root,
                                          f"{self.shape}-seed{self.weights.seed}")

    @classmethod
    def for_shape(cls, shape: str, **kw: Any) -> "Settings":
        """The settings of ``shape`` (SHAPE_SETTINGS), then ``kw``."""
        model_config(shape)  # a known shape
        return cls(**{"shape": shape, **SHAPE_SETTINGS[shape], **kw})

    @property
    def model_config(self) -> dict:
        cfg = model_config(self.shape)
        # room for the longest prompt and its new tokens (a power of two, as configs have it)
        need = self.max_len + self.max_new_tokens
        if need > cfg["max_position_embeddings"]:
            cfg["max_position_embeddings"] = 1 << (need - 1).bit_length()
        return cfg

    @property
    def page_tokens(self) -> int:
        return page_tokens_for(self.model_config, self.page_bytes)

    @property
    def vitrify_dir(self) -> str:
        return os.path.join(self.work, "vitrify")

    @property
    def file_dir(self) -> str:
        return os.path.join(self.work, "file")

    @property
    def pair_len(self) -> int:
        """The oracle pair's prompt length: up to 1,024 tokens (enough context; the device pool
        holds them beside the prompts), at least three pages and one token."""
        return max(min(self.min_len, PAIR_MAX_LEN), 3 * self.page_tokens + 1)


def stats_path_of(s: Settings, scenario: str) -> str:
    """The file a vitrify scenario's backend keeps its counters in (extra config ``stats_path``)."""
    return os.path.join(s.work, f"vitrify-stats-{scenario}.json")


def vitrify_extra_config(s: Settings, scenario: str) -> dict:
    """The ``--hicache-storage-backend-extra-config`` of a vitrify scenario: a fresh store for
    ``vitrify``, the slabs it left for ``vitrify_restart``."""
    return {
        "backend_name": "vitrify",
        "module_path": "vitrify.integrations.sglang.hicache",
        "class_name": "VitrifyStorage",
        "interface_v1": 1,
        "dirs": [s.vitrify_dir],
        "budget_bytes": s.vitrify_budget_bytes,
        "cold_start": "clear" if scenario == "vitrify" else "load",
        **({"role": "reader"} if scenario == "vitrify_second" else {}),
        "direct_io": "auto",
        "staging_bytes": 64 * MiB,
        "stats_path": stats_path_of(s, scenario),
        **({"host_bytes": s.host_bytes, "host_dir": s.host_dir} if s.host_bytes else {}),
    }


SCENARIOS = ("vitrify", "vitrify_restart", "file", "vitrify_second")


def port_of(s: Settings, scenario: str) -> int:
    """One port per scenario, so a stopped server's socket never delays the next launch."""
    return s.port + SCENARIOS.index(scenario)


def server_args(s: Settings, scenario: str) -> list[str]:
    """The exact ``python -m sglang.launch_server`` command of one scenario."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; one of {SCENARIOS}")
    extra = [
        # CUDA graphs are not what this measures; capturing them costs ~45 s per fresh launch
        "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
        "--mem-fraction-static", str(s.mem_fraction), "--max-total-tokens", str(s.max_total_tokens),
        "--page-size", str(s.page_tokens),
        "--enable-hierarchical-cache", "--hicache-ratio", str(s.hicache_ratio),
        "--hicache-write-policy", "write_through",
        "--hicache-io-backend", s.io_backend, "--hicache-mem-layout", s.mem_layout,
        "--hicache-storage-prefetch-policy", "wait_complete",
    ]
    if scenario == "file":
        extra += ["--hicache-storage-backend", "file"]
    else:
        extra += ["--hicache-storage-backend", "dynamic",
                  "--hicache-storage-backend-extra-config",
                  json.dumps(vitrify_extra_config(s, scenario), separators=(",", ":"))]
    return harness.server_command(s.python, s.model_dir, port_of(s, scenario),
                                  weights=s.weights, deterministic=s.deterministic, extra=extra)


def server_env(s: Settings, scenario: str, base: Optional[dict] = None,
               probe: bool = True) -> dict:
    """The harness's environment, tvm-ffi's JIT cache in /tmp, the file backend's directory
    for ``file``; VITRIFY_LOG_LEVEL unset (the backend's INFO lines go through SGLang's root
    logger). ``probe=False`` (dry runs, tests) looks for no toolchain."""
    env = harness.server_env(s.site, base=base, probe=probe)
    env["TVM_FFI_CACHE_DIR"] = "/tmp/tvm-ffi-cache"
    env.pop("VITRIFY_LOG_LEVEL", None)
    if scenario == "file":
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = s.file_dir
    return env


# ---- observables: has the backend written every prompt page? ---------------------------------


def backend_stats(stats_path: str) -> dict:
    """What the vitrify backend last wrote to its ``stats_path`` (``store`` and ``counters``, see
    ``vitrify.integrations.sglang.hicache``); {} before its first write. The backend renames a
    complete file into place, so a read never sees half of one."""
    try:
        d = json.loads(Path(stats_path).read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def vitrify_pages_written(stats_path: str) -> int:
    """KV pages the backend has written so far (its ``set_pages`` counter)."""
    return int((backend_stats(stats_path).get("counters") or {}).get("set_pages", 0))


def file_pages_written(directory: str) -> int:
    """Pages of SGLang's file backend: one ``<key>_<model>_<rank>_<size>.bin`` per page
    (written to ``.bin.tmp.*`` first, then renamed)."""
    try:
        return sum(1 for n in os.listdir(directory) if n.endswith(".bin"))
    except OSError:
        return 0


def wait_written(observe: Callable[[], int], needed: int, timeout: float,
                 settle: float = 2.0) -> tuple[int, float]:
    """Wait until ``observe() >= needed`` and unchanged for ``settle`` s; (count, seconds)."""
    t0 = time.monotonic()
    last, since = -1, t0
    while True:
        n = observe()
        now = time.monotonic()
        if n != last:
            last, since = n, now
        if n >= needed and now - since >= settle:
            return n, now - t0
        if now - t0 > timeout:
            raise RuntimeError(f"only {n} of {needed} pages written after {timeout:.0f} s")
        time.sleep(0.25)


# ---- passes and results ------------------------------------------------------------------------


def summarize(scenario: str, backend: str, name: str, res: list[dict], page: int,
              reference: Optional[list[dict]] = None, ref_name: Optional[str] = None) -> dict:
    """One result row: sums over the prompts, TTFT/latency means, identity vs ``reference``."""
    det = [r["details"] for r in res]
    row: dict[str, Any] = {
        "scenario": scenario, "backend": backend, "pass": name, "prompts": len(res),
        "prompt_tokens": sum(r["prompt_tokens"] for r in res),
        "output_tokens": sum(len(r["output_ids"]) for r in res),
        "reusable_tokens": sum(prefix_pages(r["prompt_tokens"], page) * page for r in res),
        "cached_tokens": sum(r["cached_tokens"] for r in res),
        "cached_device": sum(int(d.get("device", 0)) for d in det),
        "cached_host": sum(int(d.get("host", 0)) for d in det),
        "cached_storage": sum(int(d.get("storage", 0)) for d in det),
        "cached_tokens_per_request": [r["cached_tokens"] for r in res],
        "storage_tokens_per_request": [int(d.get("storage", 0)) for d in det],
        "storage_backend": next((d["storage_backend"] for d in det if "storage_backend" in d),
                                None),
        "ttft_ms_mean": 1e3 * statistics.fmean(r["ttft_s"] for r in res),
        "ttft_ms_median": 1e3 * statistics.median(r["ttft_s"] for r in res),
        "ttft_ms_per_request": [round(1e3 * r["ttft_s"], 2) for r in res],
        "latency_ms_mean": 1e3 * statistics.fmean(r["latency_s"] for r in res),
        "latency_ms_median": 1e3 * statistics.median(r["latency_s"] for r in res),
    }
    if reference is not None:
        row["reference"] = ref_name
        row["tokens_identical"] = tokens_identical(res, reference)
    return row


def storage_pages(res: list[dict], page: int) -> int:
    """Pages the requests of a pass got from L3 storage."""
    return sum(int(r["details"].get("storage", 0)) for r in res) // page


def all_from_storage(res: list[dict], page: int) -> bool:
    """Every request got its whole reusable prefix from L3 storage."""
    return bool(res) and all(
        int(r["details"].get("storage", 0)) == prefix_pages(r["prompt_tokens"], page) * page
        and r["cached_tokens"] >= int(r["details"].get("storage", 0)) > 0 for r in res)


def all_from_host(res: list[dict], page: int) -> bool:
    """Every request got its whole reusable prefix from SGLang's host pool (L2), none of it
    from the GPU or from storage."""
    return bool(res) and all(
        int(r["details"].get("host", 0)) == prefix_pages(r["prompt_tokens"], page) * page > 0
        and int(r["details"].get("storage", 0)) == 0 for r in res)


def drive_read_rate(directory: str, nbytes: int = 2 << 30) -> dict:
    """The drive's cold read rate under ``directory``: fio's O_DIRECT read (queue depth 16) of
    a file it has just written there with its page cache dropped (``vitrify bench hicache``'s
    ceiling). Without fio: ``dd iflag=direct`` over the written part of the largest slab file
    the vitrify scenario left (a slab's unwritten slots are holes, which read without touching
    the drive: the whole file would overstate the rate)."""
    from vitrify.bench.hicache import fio_read_limit

    rate = fio_read_limit(directory, nbytes)
    if isinstance(rate, float):
        return {"bytes_per_s": rate, "bytes": nbytes, "command": "fio --rw=read --bs=1m "
                "--direct=1 --ioengine=libaio --iodepth=16 (a file fio wrote, cache dropped)"}
    slabs = sorted(Path(directory).glob("*.slab"), key=lambda p: p.stat().st_size)
    if not slabs:
        return {"error": f"fio: {rate}; and no slab file under {directory} to read"}
    used = slabs[-1].stat().st_blocks * 512  # allocated bytes, holes excluded
    try:
        from vitrify.bench.snapshot import dd_read_rate

        got, cmd = dd_read_rate(str(slabs[-1]), True, count=max(1, used >> 26))
    except Exception as e:  # reported in the JSON; the run's checks do not depend on it
        return {"error": f"fio: {rate}; dd: {type(e).__name__}: {e}"}
    return {"bytes_per_s": got, "bytes": min(used, max(1, used >> 26) << 26), "command": cmd,
            "fio": rate}


def break_even(rows: list[dict], cfg: dict, drive_bytes_per_s: Optional[float]) -> dict:
    """When an L3 hit pays: the model's prefill rate (the vitrify launch's miss pass: prompt
    tokens over summed TTFT) times its KV bytes per token is the storage read rate above which
    reading a prefix beats recomputing it. With the drive's rate, the L3 hit's floor per request
    (its stored prefix's KV bytes at the drive's rate plus the uncached tail's prefill) and the
    measured L3-hit TTFT over that floor."""
    def row(sc, name):
        return next((r for r in rows if r["scenario"] == sc and r["pass"] == name), None)

    miss, hit = row("vitrify", "miss"), row("vitrify", "l3_hit")
    if miss is None:
        return {"error": "no miss pass of the vitrify launch"}
    from vitrify.bench.breakeven import verdict

    kv = kv_bytes_per_token(cfg)
    tps = miss["prompt_tokens"] / (miss["ttft_ms_mean"] / 1e3 * miss["prompts"])
    out: dict[str, Any] = verdict(tps, kv, {"drive": drive_bytes_per_s})
    if drive_bytes_per_s:
        if hit is not None:
            floor = (hit["cached_storage"] * kv / drive_bytes_per_s
                     + (hit["prompt_tokens"] - hit["cached_tokens"]) / tps) / hit["prompts"]
            out["l3_hit_floor_ms"] = 1e3 * floor
            out["l3_hit_ttft_over_floor"] = hit["ttft_ms_mean"] / (1e3 * floor)
    out.update(_marginal_break_even(row("vitrify", "device_hit"), miss, kv, drive_bytes_per_s))
    return out


def _marginal_break_even(dev: Optional[dict], miss: dict, kv: int,
                         drive: Optional[float]) -> dict:
    """The same question with the request's fixed costs taken out: a hit skips only the prefix's
    compute, so reading its KV must take less than the miss TTFT minus the device-hit TTFT (the
    same prompts, the prefix already on the GPU). The storage rate above which an L3 hit beats
    recomputing is then (prefix KV bytes) / (miss - device hit), per request on average. A
    device hit no faster than the miss means no storage rate pays."""
    if dev is None or not dev.get("prompts"):
        return {}
    saved_s = (miss["ttft_ms_mean"] - dev["ttft_ms_mean"]) / 1e3
    prefix_bytes = dev["cached_tokens"] * kv / dev["prompts"]
    out: dict[str, Any] = {"recompute_saved_ms_per_request": 1e3 * saved_s,
                           "prefix_kv_bytes_per_request": prefix_bytes}
    if saved_s <= 0:
        out["marginal_break_even_read_bytes_per_s"] = None
        out["marginal_verdict"] = (
            f"no storage rate pays here: the device-hit pass ({dev['ttft_ms_mean']:.1f} ms) is "
            f"not faster than the miss ({miss['ttft_ms_mean']:.1f} ms)")
        return out
    rate = prefix_bytes / saved_s
    out["marginal_break_even_read_bytes_per_s"] = rate
    if drive:
        out["marginal_l3_pays"] = drive > rate
        out["marginal_verdict"] = (
            f"counting only the compute a hit saves ({1e3 * saved_s:.1f} ms per request for "
            f"{prefix_bytes / 1e6:.0f} MB of KV), an L3 hit "
            f"{'beats' if drive > rate else 'loses to'} recompute: it needs "
            f"{rate / 1e9:.2f} GB/s, the drive reads {drive / 1e9:.2f} GB/s")
    return out


# The KV-tier issue's goals: an L3 hit 2.5x the file backend's, within 1.1x of the drive's floor,
# and the first requests after a restart within 1.1x of a steady L3 hit.
GOALS = {"l3_hit_ttft_file_over_vitrify": 2.5, "l3_hit_ttft_over_drive_floor": 1.1,
         "l3_restart_over_l3_hit": 1.1}
GOAL_DIRECTION = {"l3_hit_ttft_over_drive_floor": "<=", "l3_restart_over_l3_hit": "<="}
# with a host tier (--host-gb): after a restart near a prefix on the GPU and well ahead of the
# file backend reading from the page cache; with long prompts (>= LONG_PROMPT tokens) a restart's
# hit at least twice as fast as recomputing the prefix
HOST_GOALS = {"l3_restart_over_device_hit": 1.3, "file_cached_over_vitrify_restart": 4.0}
LONG_PROMPT = 12000
LONG_GOALS = {"miss_over_l3_restart": 2.0}


# name, measure (ttft or latency, medians), numerator (scenario, pass), denominator
RATIOS: tuple[tuple[str, str, tuple[str, str], tuple[str, str]], ...] = (
    ("l3_hit_ttft_file_over_vitrify", "ttft", ("file", "l3_hit"), ("vitrify", "l3_hit")),
    ("l3_hit_latency_file_over_vitrify", "latency", ("file", "l3_hit"), ("vitrify", "l3_hit")),
    ("vitrify_ttft_miss_over_l3_hit", "ttft", ("vitrify", "miss"), ("vitrify", "l3_hit")),
    ("file_ttft_miss_over_l3_hit", "ttft", ("file", "miss"), ("file", "l3_hit")),
    ("l3_restart_over_l3_hit", "ttft", ("vitrify_restart", "l3_restart"), ("vitrify", "l3_hit")),
    # the restarted process's second L3 pass over the same prompts: its one-time costs paid
    ("l3_restart_again_over_l3_hit", "ttft", ("vitrify_restart", "l3_restart_again"),
     ("vitrify", "l3_hit")),
    ("l3_restart_again_over_device_hit", "ttft", ("vitrify_restart", "l3_restart_again"),
     ("vitrify", "device_hit")),
    ("file_cached_over_vitrify_restart_again", "ttft", ("file", "l3_hit_cached"),
     ("vitrify_restart", "l3_restart_again")),
    # the host tier's goals: after a restart near a prefix on the GPU, and well ahead of the
    # file backend reading from the page cache
    ("l3_restart_over_device_hit", "ttft", ("vitrify_restart", "l3_restart"),
     ("vitrify", "device_hit")),
    ("file_cached_over_vitrify_restart", "ttft", ("file", "l3_hit_cached"),
     ("vitrify_restart", "l3_restart")),
    # long prompts: a restart's hit against recomputing the prefix
    ("miss_over_l3_restart", "ttft", ("vitrify", "miss"), ("vitrify_restart", "l3_restart")),
    # the floor of any storage hit in SGLang: its own host pool -> GPU (the l2_hit pass), over a
    # prefix on the GPU; and what the host tier adds on top of it
    ("l2_hit_over_device_hit", "ttft", ("vitrify_restart", "l2_hit"), ("vitrify", "device_hit")),
    ("l3_restart_over_l2_hit", "ttft", ("vitrify_restart", "l3_restart"),
     ("vitrify_restart", "l2_hit")),
    # the same prompt as each process's first L3 hit: the restart's over the first launch's
    ("restart_first_request_over_first_l3_hit", "ttft",
     ("vitrify_restart", "restart_first_request"), ("vitrify", "l3_first_hit")),
)


def goals_for(s: Settings) -> tuple[dict, dict]:
    """The goals of a run with these settings, and the ones met from below (``<=``)."""
    goals, direction = dict(GOALS), dict(GOAL_DIRECTION)
    if s.host_bytes:
        goals.update(HOST_GOALS)
        direction["l3_restart_over_device_hit"] = "<="
        if s.min_len >= LONG_PROMPT:
            goals.update(LONG_GOALS)
    return goals, direction


def assemble(s: Settings, rows: list[dict], checks: dict, scenarios: dict,
             skipped: dict, extra: dict, oracle_power: Optional[dict] = None,
             comparisons: Optional[list] = None) -> dict:
    """The result object (resultlib convention): rows, ratios vs the same run, checks, the
    comparisons and the oracle's power (ok needs every check and the oracle's power)."""
    def row(sc, name):
        return next((r for r in rows if r["scenario"] == sc and r["pass"] == name), None)

    def val(sc, name, key):
        r = row(sc, name)
        return r[key] if r else None

    # medians over the prompts (one slow request does not decide a ratio)
    ratios = {name: ratio(val(*num, f"{key}_ms_median"), val(*den, f"{key}_ms_median"))
              for name, key, num, den in RATIOS}
    if not scenarios.get("vitrify_restart", {}).get("l2_all_from_host"):
        # the l2_hit pass did not come from the host pool alone: no floor to compare with
        ratios["l2_hit_over_device_hit"] = ratios["l3_restart_over_l2_hit"] = None
    be = break_even(rows, s.model_config, (extra.get("drive") or {}).get("bytes_per_s"))
    ratios["l3_hit_ttft_over_drive_floor"] = be.get("l3_hit_ttft_over_floor")
    ratios = {k: v for k, v in ratios.items() if v is not None}
    extra = {**extra, "break_even": be}
    ran = [sc for sc in SCENARIOS if sc in scenarios]
    ok = bool(ran) and all(scenarios[sc].get("ok") for sc in ran) and \
        all(v for v in checks.values() if isinstance(v, bool))
    goals, direction = goals_for(s)
    if oracle_power is None:
        oracle_power = oracle.power([], None)
    return harness.result(
        NAME, ok=ok, oracle_power=oracle_power, rows=rows, ratios=ratios, goals=goals,
        goal_direction=direction, directory=s.work if os.path.isdir(s.work) else None,
        checks=checks, comparisons=comparisons or [], scenarios=scenarios, skipped=skipped,
        settings={"prompts": s.prompts, "prompt_len": [s.min_len, s.max_len], "seed": s.seed,
                  "max_new_tokens": s.max_new_tokens, "page_tokens": s.page_tokens,
                  "page_bytes": s.page_tokens * kv_bytes_per_token(s.model_config),
                  "shape": s.shape, "model_config": s.model_config,
                  "deterministic": s.deterministic,
                  "max_total_tokens": s.max_total_tokens, "hicache_ratio": s.hicache_ratio,
                  "host_bytes": s.host_bytes,
                  "io_backend": s.io_backend, "mem_layout": s.mem_layout,
                  "prefetch_policy": "wait_complete", "write_policy": "write_through",
                  "vitrify_extra_config": vitrify_extra_config(s, "vitrify")},
        comparison=("L3-hit tokens and logprobs vs the same launch's miss pass (deterministic "
                    "inference); L3-hit logprobs vs the same launch's device_hit pass (same "
                    "cached prefix length); vitrify_restart vs the vitrify launch (the same "
                    "seeded checkpoint; miss_after_clear == miss checks cross-launch "
                    "determinism)"),
        **extra)


# ---- the run -----------------------------------------------------------------------------------


class Run:
    # the planted fault's writer (tests put a stand-in's here)
    planter = staticmethod(oracle.plant_page_swap)

    def __init__(self, s: Settings):
        self.s = s
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.checks: dict[str, Any] = {}
        self.comparisons: list[dict] = []
        self.scenarios: dict[str, dict] = {}
        self.skipped: dict[str, str] = {}
        self.results: dict[tuple, list[dict]] = {}
        self.launches = 0
        self.prompts = make_prompts(s.seed, s.prompts, s.min_len, s.max_len)
        # warms the prefill/extend kernels before the timed miss pass (JIT on a fresh machine)
        self.warmup = make_prompts(s.seed + 1000, 1, s.min_len, s.max_len)
        # the oracle: two prompts sharing only their last token; the first gets the fault
        self.pair = list(oracle.last_token_pair(s.seed + 3000, s.pair_len))
        self.pairs: list[dict] = []
        self.fault: Optional[dict] = None

    def left(self) -> float:
        return self.s.budget_s - (time.monotonic() - self.t0)

    def needed_pages(self, prompts) -> int:
        return sum(prefix_pages(len(p), self.s.page_tokens) for p in prompts)

    def fillers(self, device_tokens: Optional[int] = None) -> Optional[list[list[int]]]:
        """Prompts of the run's lengths, other tokens, 1.1 x the device pool in all: run after
        the prompts, they push every prompt's KV off the GPU (into SGLang's host pool, which
        write_through filled). ``device_tokens``: the pool the server really has (SGLang may
        size it below ``--max-total-tokens``). None when the prompts and fillers would not fit
        in the host pool (hicache_ratio x the device pool) with 10 % to spare."""
        s = self.s
        pool = device_tokens or s.max_total_tokens
        need = int(1.1 * pool)
        if sum(map(len, self.prompts)) + need + s.max_len > 0.9 * s.hicache_ratio * pool:
            return None
        # enough prompts of at least min_len tokens, then the shortest prefix that is enough
        pool_prompts = make_prompts(s.seed + 2000, -(-need // s.min_len), s.min_len, s.max_len)
        out: list[list[int]] = []
        for p in pool_prompts:
            if sum(map(len, out)) >= need:
                break
            out.append(p)
        return out

    def l2_pass(self, port: int, sc: str, info: dict, ck: dict) -> None:
        """``l2_hit``: the prompts (just computed, so on the GPU and in the host pool) after
        fillers pushed them off the GPU: SGLang loads them from its own host pool. Every L3 hit
        passes through that pool, so this is the floor of a storage hit's TTFT in SGLang. The
        fillers' pages reach storage before the pass is timed."""
        s = self.s
        device_tokens = None
        try:  # the pool SGLang really sized (min of --max-total-tokens and what memory allows)
            st, text = http_call(port, "GET", "/get_server_info")
            if st == 200:
                device_tokens = int(json.loads(text).get("max_total_num_tokens") or 0) or None
        except (OSError, ValueError, AttributeError, TypeError):
            pass
        info["l2_device_tokens"] = device_tokens
        fill = self.fillers(device_tokens)
        if fill is None:
            info["l2_skipped"] = "the prompts and fillers do not fit in the host pool"
            return
        observe = (lambda: vitrify_pages_written(stats_path_of(s, sc)))
        # the prompts' own pages (the pass before) settle first, so they do not count as fillers'
        before, _ = wait_written(observe, observe(), max(5.0, min(30.0, self.left() - 60)))
        t = time.monotonic()
        for p in fill:
            generate(port, p, 1)
        info["l2_fillers"] = {"prompts": len(fill), "tokens": sum(map(len, fill)),
                              "s": round(time.monotonic() - t, 2)}
        try:
            info["l2_fillers"]["pages_written"], wait = wait_written(
                observe, before + self.needed_pages(fill), max(5.0, min(60.0, self.left() - 40)))
            info["l2_fillers"]["write_wait_s"] = round(wait, 2)
        except RuntimeError as e:  # timed anyway; the JSON says the writes were still running
            info["l2_fillers"]["write_wait_error"] = str(e)
        l2 = run_pass(port, self.prompts, s.max_new_tokens)
        self._row(sc, "vitrify", "l2_hit", l2, ("vitrify", "miss"))
        # a measurement's precondition, not vitrify's behaviour: recorded, and the ratios
        # that use the pass are dropped when it does not hold
        info["l2_all_from_host"] = all_from_host(l2, s.page_tokens)
        self._compare(ck, sc, "l2_tokens_identical", l2, ("vitrify", "miss"), crosses=True,
                      logprobs=False)

    def _row(self, sc, backend, name, res, ref=None):
        ref_res = self.results.get(ref) if ref else None
        r = summarize(sc, backend, name, res, self.s.page_tokens, ref_res,
                      f"{ref[0]}/{ref[1]}" if ref else None)
        self.results[(sc, name)] = res
        self.rows.append(r)
        return r

    def _compare(self, ck: dict, sc: str, check: str, res: list[dict], ref: tuple[str, str],
                 *, crosses: bool, logprobs: bool = True) -> dict:
        """``res`` (of launch ``sc``) against the pass ``ref`` (launch, pass): recorded in the
        comparisons, and a check of ``sc`` named ``check`` where it may be one."""
        c = compare(f"{sc}.{check}", res, self.results.get(ref, []),
                    launches=(sc, ref[0]),
                    deterministic=(self._det(sc), self._det(ref[0])), crosses=crosses,
                    logprobs=logprobs)
        self.comparisons.append(c)
        if c["is_check"]:
            ck[check] = c["identical"]
        return c

    def _det(self, scenario: str) -> bool:
        return bool((self.scenarios.get(scenario) or {}).get("deterministic"))

    def _record_checks(self, scenario: str, info: dict, ck: dict) -> None:
        """A scenario's checks go into its info and the run's check list; ok = all passed."""
        info["checks"] = ck
        for k, v in ck.items():
            self.checks[f"{scenario}.{k}"] = v
        info["ok"] = all(ck.values())

    def _backend_counters(self, scenario: str, info: dict, ck: dict) -> None:
        """The backend's counters and store, from its stats file: errors must be 0."""
        st = backend_stats(stats_path_of(self.s, scenario))
        counters = st.get("counters") or {}
        info["backend_counters"] = counters
        info["backend_errors"] = counters.get("errors")
        if st.get("host") is not None:  # the host tier's hits and promotions
            info["host_counters"] = st["host"]
        store = st.get("store") or {}
        if store:
            info["store"] = {k: store.get(k) for k in ("name", "page_bytes", "o_direct",
                                                       "cold_start")}
        ck["no_backend_errors"] = info["backend_errors"] == 0

    def _launch(self, scenario: str) -> harness.Server:
        s = self.s
        if scenario != "file":  # counters of this launch only
            Path(stats_path_of(s, scenario)).unlink(missing_ok=True)
        log = os.path.join(s.log_dir or s.out, f"sglang-{scenario}.log")
        return harness.Server(server_args(s, scenario), server_env(s, scenario), log)

    def _serve(self, scenario: str, passes: Callable[[int, dict], None]) -> None:
        """Launch ``scenario``'s server, wait until it is ready, run ``passes(port, info)`` on
        it, stop it. Any error is recorded in the scenario's info (with the log's tail) instead
        of ending the run."""
        port = port_of(self.s, scenario)
        srv = self._launch(scenario)
        info: dict[str, Any] = {"ok": False, "deterministic": srv.deterministic}
        self.scenarios[scenario] = info
        info["log"] = os.path.basename(srv.log_path)
        t_wall = time.time()
        try:
            with srv:
                info["ready_s"] = round(srv.wait_ready(port, self._ready_timeout()), 1)
                self.launches += 1
                passes(port, info)
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"
        logged = harness.timeline(srv.log_path, t_wall).get("deterministic_inference")
        if logged is not None:  # what SGLang itself says it ran with
            info["deterministic_inference_logged"] = logged
        if not info["ok"]:
            info["log_tail"] = harness.log_tail(srv.log_path)
        harness.write_partial(self.s.out, NAME, {"scenarios": self.scenarios,
                                                 "checks": self.checks, "fault": self.fault})

    def _ready_timeout(self) -> float:
        t = self.s.first_ready_s if self.launches == 0 else self.s.ready_s
        return max(30.0, min(t, self.left() - 45.0))

    def l3_scenario(self, scenario: str) -> None:
        """vitrify or file: miss, (vitrify: the oracle's pair), device_hit, written, flush,
        l3_hit."""
        s, page = self.s, self.s.page_tokens
        backend = "file" if scenario == "file" else "vitrify"
        store = s.file_dir if backend == "file" else s.vitrify_dir
        shutil.rmtree(store, ignore_errors=True)
        if backend == "vitrify" and s.host_bytes:
            shutil.rmtree(s.host_dir, ignore_errors=True)  # a fresh host tier too
        os.makedirs(store, exist_ok=True)

        def passes(port: int, info: dict) -> None:
            t = time.monotonic()
            run_pass(port, self.warmup, s.max_new_tokens,
                     timeout=max(60.0, self.left() - 60))
            info["warmup_s"] = round(time.monotonic() - t, 2)
            miss = run_pass(port, self.prompts, s.max_new_tokens)
            r_miss = self._row(scenario, backend, "miss", miss,
                               ("vitrify", "miss") if scenario == "file" else None)
            written = self.prompts + self.warmup
            if scenario == "vitrify":  # the oracle's pair, a miss like the pass before
                pr = run_pass(port, self.pair, s.max_new_tokens)
                self.results[(scenario, "pair")] = pr
                self.pairs.append(oracle.pair_power(pr[0], pr[1], scenario))
                written = written + self.pair
            # the miss pass's pages reach storage before the device-hit pass, so that pass is
            # timed in a quiet process, as the restart's L3 pass is (its goal's denominator)
            needed = self.needed_pages(written)
            observe = (lambda: file_pages_written(store)) if backend == "file" else \
                (lambda: vitrify_pages_written(stats_path_of(s, scenario)))
            info["pages_needed"] = needed
            info["pages_written"], wait = wait_written(
                observe, needed, max(5.0, min(60.0, self.left() - 40)))
            info["write_wait_s"] = round(wait, 2)
            dev = run_pass(port, self.prompts, s.max_new_tokens)
            self._row(scenario, backend, "device_hit", dev, (scenario, "miss"))
            flush_cache(port)
            files = glob.glob(os.path.join(store, "*"))
            info["page_cache_dropped_files"] = resultlib.drop_page_cache(files)
            # untimed: the first L3 hit of a process pays one-time costs (host->device
            # transfer kernels); the warmup prompt's pages are in L3 too
            w = run_pass(port, self.warmup, s.max_new_tokens)
            info["warmup_l3_storage_tokens"] = int(w[0]["details"].get("storage", 0))
            # the process's first L3 hit (the warmup prompt), kept apart from the steady pass
            self._row(scenario, backend, "l3_first_hit", w)
            l3 = run_pass(port, self.prompts, s.max_new_tokens)
            self._row(scenario, backend, "l3_hit", l3, (scenario, "miss"))
            # again with the files' page cache as the last pass left it (a realistic
            # restart: the file backend then reads from memory)
            flush_cache(port)
            cached = run_pass(port, self.prompts, s.max_new_tokens)
            self._row(scenario, backend, "l3_hit_cached", cached, (scenario, "miss"))
            ck = {
                "miss_was_miss": all(r["cached_tokens"] == 0 for r in miss),
                "device_hit_from_device": all(
                    r["cached_tokens"] == prefix_pages(r["prompt_tokens"], page) * page
                    for r in dev),
                "l3_all_from_storage": all_from_storage(l3, page),
                "cached_pass_from_storage": all_from_storage(cached, page),
            }
            self._compare(ck, scenario, "tokens_identical", l3, (scenario, "miss"),
                          crosses=True, logprobs=False)
            self._compare(ck, scenario, "logprobs_identical_vs_miss", l3, (scenario, "miss"),
                          crosses=True)
            # both compute the same tail on the same cached prefix length: one path
            self._compare(ck, scenario, "logprobs_identical_vs_device_hit", l3,
                          (scenario, "device_hit"), crosses=False)
            self._compare(ck, scenario, "cached_pass_tokens_identical", cached,
                          (scenario, "miss"), crosses=True, logprobs=False)
            info["l3_logprob_max_abs_diff_vs_device_hit"] = logprob_diff(l3, dev)
            info["l3_logprob_max_abs_diff_vs_miss"] = logprob_diff(l3, miss)
            if scenario == "file":
                info["miss_tokens_equal_vitrify_launch"] = r_miss.get("tokens_identical")
            if backend == "vitrify":
                self._backend_counters(scenario, info, ck)
            self._record_checks(scenario, info, ck)

        self._serve(scenario, passes)

    def plant_fault(self) -> None:
        """Between the launches: page A of the pair's first prompt (its middle page) gets page
        B's bytes (the second prompt's page at the same positions) under a valid checksum,
        written through vitrify's store API while no server holds the store."""
        s = self.s
        desc = ("one KV page with a valid checksum but another page's bytes (the pair's second "
                "prompt's page under the first prompt's key, same positions), written through "
                "vitrify's store API into the L3 store between the launches")
        self.fault = {"fault": desc, "planted": False}
        if ("vitrify", "pair") not in self.results:
            self.fault["why"] = "the pair did not run in the vitrify launch"
            return
        store = backend_stats(stats_path_of(s, "vitrify")).get("store") or {}
        if not store.get("name"):
            self.fault["why"] = "the vitrify launch left no store description in its stats file"
            return
        try:
            k, key_a, key_b = oracle.fault_page(self.pair[0], self.pair[1], s.page_tokens)
            self.fault["page_index"] = k
            self.fault.update(self.planter(store, [s.vitrify_dir], key_a, key_b,
                                           host_bytes=s.host_bytes, host_dir=s.host_dir))
        except Exception as e:  # recorded; the oracle then has no power and the run fails
            self.fault["why"] = f"{type(e).__name__}: {e}"

    def fault_pass(self, port: int) -> None:
        """The pair from L3 in the restarted server: the faulty prompt against its miss, the
        untouched one as the control (:func:`.oracle.judge_page_fault`)."""
        if not (self.fault or {}).get("planted"):
            self.fault.setdefault("why", "not planted")
            self.fault["caught"] = None
            return
        got = run_pass(port, self.pair, self.s.max_new_tokens)
        ref = self.results[("vitrify", "pair")]
        self.fault["deterministic"] = [self._det("vitrify_restart"), self._det("vitrify")]
        self.fault.update(oracle.judge_page_fault(got[0], got[1], ref[0], ref[1],
                                                  self.s.page_tokens))

    def restart_scenario(self) -> None:
        """vitrify_restart: cold_start=load on the first launch's slabs; the first request hits."""
        s, page, sc = self.s, self.s.page_tokens, "vitrify_restart"

        def passes(port: int, info: dict) -> None:
            # the literal first request after the restart (the warmup prompt, stored by the
            # first launch), then the prompts: one-time costs of the process apart from the
            # storage path's steady state
            first = run_pass(port, self.warmup, s.max_new_tokens)
            self._row(sc, "vitrify", "restart_first_request", first)
            info["first_request_storage_tokens"] = int(first[0]["details"].get("storage", 0))
            l3 = run_pass(port, self.prompts, s.max_new_tokens)
            self._row(sc, "vitrify", "l3_restart", l3, ("vitrify", "miss"))
            if s.second_server:  # while this server owns the stores
                self.second_scenario()
            self.fault_pass(port)
            # the same L3 pass again in the restarted process: what is left of l3_restart's
            # excess over the first launch's l3_hit once the process has served these prompts
            # once (one-time costs of a new process: kernels first run at these shapes)
            flush_cache(port)
            again = run_pass(port, self.prompts, s.max_new_tokens)
            self._row(sc, "vitrify", "l3_restart_again", again, ("vitrify", "miss"))
            flush_cache(port)
            st, text = http_call(port, "POST", "/hicache/storage-backend/clear")
            info["clear_http"] = [st, text.strip()[:200]]
            flush_cache(port)
            fresh = run_pass(port, self.prompts, s.max_new_tokens)
            self._row(sc, "vitrify", "miss_after_clear", fresh, ("vitrify", "miss"))
            ck = {
                "first_request_from_storage": int(l3[0]["details"].get("storage", 0)) > 0,
                "again_from_storage": all_from_storage(again, page),
                "l3_all_from_storage": all_from_storage(l3, page),
                "clear_then_miss": st == 200 and all(r["cached_tokens"] == 0
                                                     for r in fresh),
            }
            self._compare(ck, sc, "again_tokens_identical", again, ("vitrify", "miss"),
                          crosses=True, logprobs=False)
            self._compare(ck, sc, "tokens_identical", l3, ("vitrify", "miss"), crosses=True,
                          logprobs=False)
            self._compare(ck, sc, "logprobs_identical_vs_first_launch_miss", l3,
                          ("vitrify", "miss"), crosses=True)
            self._compare(ck, sc, "cross_launch_deterministic", fresh, ("vitrify", "miss"),
                          crosses=True, logprobs=False)
            info["l3_logprob_max_abs_diff_vs_first_launch_device_hit"] = \
                logprob_diff(l3, self.results.get(("vitrify", "device_hit"), []))
            if self.left() > 90:
                try:  # a measurement of SGLang's floor: its failure costs the pass, not the checks
                    self.l2_pass(port, sc, info, ck)
                except Exception as e:
                    info["l2_error"] = f"{type(e).__name__}: {e}"
            else:
                info["l2_skipped"] = f"time: {self.left():.0f} s left"
            self._backend_counters(sc, info, ck)
            self._host_tier_check(info, ck, storage_pages(first, page) + storage_pages(l3, page)
                                  + storage_pages(again, page))
            self._record_checks(sc, info, ck)

        self._serve(sc, passes)

    def _host_tier_check(self, info: dict, ck: dict, pages: int) -> None:
        """With a host tier, the pages read from L3 by a launch that started with it in place
        (a restart, a second server) came from the host tier, not the drive."""
        if self.s.host_bytes:
            hits = int((info.get("host_counters") or {}).get("host_hits", 0))
            info["host_hits_needed"] = pages
            ck["l3_from_host_tier"] = hits >= pages

    def second_scenario(self) -> None:
        """vitrify_second: another server of the node (role "reader") beside the restarted
        one, with the same storage identity: it maps the owner's slabs read-only and serves
        the prompts from them (tokens as the first launch's miss pass, every page stored)."""
        s, page, sc = self.s, self.s.page_tokens, "vitrify_second"

        def passes(port: int, info: dict) -> None:
            l3 = run_pass(port, self.prompts, s.max_new_tokens)
            self._row(sc, "vitrify", "l3_second_server", l3, ("vitrify", "miss"))
            ck = {"l3_all_from_storage": all_from_storage(l3, page)}
            self._compare(ck, sc, "tokens_identical", l3, ("vitrify", "miss"), crosses=True,
                          logprobs=False)
            # another process on the same GPU, same kernels, the same cached prefix length
            c = self._compare(ck, sc, "logprobs_identical_vs_first_launch_device_hit", l3,
                              ("vitrify", "device_hit"), crosses=True)
            info["l3_logprob_max_abs_diff_vs_first_launch_device_hit"] = \
                c["logprob_max_abs_diff"]
            self._backend_counters(sc, info, ck)
            self._host_tier_check(info, ck, storage_pages(l3, page))
            self._record_checks(sc, info, ck)

        self._serve(sc, passes)

    def run(self) -> dict:
        s = self.s
        extra: dict[str, Any] = {}
        os.makedirs(s.out, exist_ok=True)
        os.makedirs(s.log_dir or s.out, exist_ok=True)
        os.makedirs(s.work, exist_ok=True)
        try:
            extra["bundle"] = harness.unpack_bundle(s.bundle, s.site, s.python)
            extra["vitrify"] = harness.vitrify_origin(s.python)
            extra["weights"] = harness.write_model(s.model_dir, s.model_config, s.weights)
        except Exception as e:
            extra["setup_error"] = f"{type(e).__name__}: {e}"
            return self.assemble(extra)
        extra["fio"] = shutil.which("fio") or "not installed (not needed)"
        extra["jit_env"] = harness.jit_env(server_env(s, "vitrify"))
        self.l3_scenario("vitrify")
        extra["drive"] = drive_read_rate(s.vitrify_dir)
        if s.skip_restart:
            self.skipped["vitrify_restart"] = "--skip-restart"
        elif not self.scenarios["vitrify"].get("ok") and ("vitrify", "miss") not in self.results:
            self.skipped["vitrify_restart"] = "the vitrify launch produced no pages to restart from"
        elif self.left() < 110:
            self.skipped["vitrify_restart"] = f"time: {self.left():.0f} s left"
        else:
            self.plant_fault()
            self.restart_scenario()
        if self.fault is None:
            self.fault = {"fault": "one KV page with another page's bytes", "planted": False,
                          "caught": None, "why": "not run: the restart launch was skipped "
                          f"({self.skipped.get('vitrify_restart')})"}
        if s.skip_file:
            self.skipped["file"] = "--skip-file"
        elif self.left() < 130:
            self.skipped["file"] = f"time: {self.left():.0f} s left (budget {s.budget_s:.0f} s)"
        else:
            self.l3_scenario("file")
        extra["total_s"] = round(time.monotonic() - self.t0, 1)
        return self.assemble(extra)

    def assemble(self, extra: dict) -> dict:
        return assemble(self.s, self.rows, self.checks, self.scenarios, self.skipped, extra,
                        oracle.power(self.pairs, self.fault, extra.get("weights")),
                        self.comparisons)


COLUMNS = ["scenario", "pass", "prompts", "prompt_tokens", "cached_tokens", "cached_storage",
           "ttft_ms_median", "latency_ms_median", "tokens_identical"]


def report(res: dict) -> None:
    resultlib.print_table(res.get("rows", []), COLUMNS)
    for k, v in sorted(res.get("ratios", {}).items()):
        print(f"  {k}: {v:.3f}")
    for sc, info in res.get("scenarios", {}).items():
        print(f"  {sc}: ok={info.get('ok')} ready={info.get('ready_s')} s "
              f"deterministic={info.get('deterministic')} {info.get('error', '')}")
    for sc, why in res.get("skipped", {}).items():
        print(f"  {sc}: skipped ({why})")
    for key in ("verdict", "marginal_verdict"):
        if res.get("break_even", {}).get(key):
            print(f"  {res['break_even'][key]}")
    op = res.get("oracle_power", {})
    print(f"  oracle_power: ok={op.get('ok')} {'; '.join(op.get('why', []))}")
    print(f"ok={res.get('ok')}")


def _length_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO:HI (e.g. 12000:16000)") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return lo, hi


def parse_args(argv=None) -> tuple[Settings, argparse.Namespace]:
    d = Settings()
    ap = argparse.ArgumentParser(prog="python3 -m vitrify.bench.sglang.hicache_e2e",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                    help="model shape: tiny (8 layers, hidden 1024), 8b (Qwen3-8B's), 8b-mqa, "
                         "llama-1b (Llama-3.2-1B's)")
    ap.add_argument("--bundle", default=d.bundle)
    ap.add_argument("--site", default=d.site)
    ap.add_argument("--models-root", default=d.models_root,
                    help="where <shape>-seed<seed> (config and checkpoint) is written and kept")
    ap.add_argument("--weights-seed", type=int, default=0, help="the checkpoint's seed")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                    help="--enable-deterministic-inference on every launch (default on: the "
                         "run compares across cache paths)")
    ap.add_argument("--work", default=d.work, help="L3 directories (vitrify slabs, file backend)")
    ap.add_argument("--out", default=os.environ.get("OUT") or d.out,
                    help="result JSON and server logs (default $OUT)")
    ap.add_argument("--log-dir", default="", help="server logs (default: --out)")
    ap.add_argument("--port", type=int, default=d.port)
    ap.add_argument("--prompts", type=int, default=d.prompts)
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"seconds for the whole run (default: the shape's; tiny {d.budget_s:.0f})")
    ap.add_argument("--io-backend", default=d.io_backend, choices=["kernel", "direct"])
    ap.add_argument("--mem-layout", default=d.mem_layout,
                    choices=["page_first", "layer_first", "page_first_direct"])
    ap.add_argument("--prompt-len", type=_length_range, default=(d.min_len, d.max_len),
                    metavar="LO:HI", help=f"prompt lengths in tokens (default "
                    f"{d.min_len}:{d.max_len}); the model's context grows to fit")
    ap.add_argument("--max-total-tokens", type=int, default=None, metavar="N",
                    help=f"the device KV pool in tokens (default {d.max_total_tokens}: every "
                    f"prompt stays on the device; raise it with long prompts)")
    ap.add_argument("--budget-bytes", type=int, default=None, metavar="BYTES",
                    help="the vitrify store's L3 budget (default: the shape's)")
    ap.add_argument("--host-gb", type=float, default=0.0, metavar="GB",
                    help="vitrify's host tier in /dev/shm of this many GB in front of its disk "
                    "slabs (default 0: disk only)")
    ap.add_argument("--second-server", action="store_true",
                    help="launch a second server (role reader) beside the restarted one: it "
                    "must serve the prompts from the first server's slabs")
    ap.add_argument("--skip-file", action="store_true", help="no file-backend launch")
    ap.add_argument("--skip-restart", action="store_true",
                    help="no restart launch (and so no planted fault: the run fails its oracle)")
    ap.add_argument("--dry-run", action="store_true", help="print the server command lines")
    a = ap.parse_args(argv)
    if a.prompts < 1:
        ap.error(f"--prompts must be >= 1, got {a.prompts}")
    explicit: dict[str, Any] = {"budget_s": a.budget_s} if a.budget_s is not None else {}
    if a.max_total_tokens is not None:
        explicit["max_total_tokens"] = a.max_total_tokens
    if a.budget_bytes is not None:
        explicit["vitrify_budget_bytes"] = a.budget_bytes
    if a.host_gb < 0:
        ap.error(f"--host-gb must be >= 0, got {a.host_gb}")
    if a.host_gb:
        explicit["host_bytes"] = int(a.host_gb * 1e9)
    lo, hi = a.prompt_len
    # the device-hit pass keeps every prompt (and the oracle's pair) on the device
    need = a.prompts * (hi + d.max_new_tokens) + hi + 2 * (min(lo, PAIR_MAX_LEN) +
                                                          d.max_new_tokens)
    if need > explicit.get("max_total_tokens", d.max_total_tokens):
        ap.error(f"{a.prompts} prompts of up to {hi} tokens need a device pool of {need} "
                 f"tokens (the device-hit pass): pass --max-total-tokens {need} or more")
    s = Settings.for_shape(a.shape, bundle=a.bundle, site=a.site, work=a.work, out=a.out,
                           models_root=a.models_root, weights=Weights(seed=a.weights_seed),
                           deterministic=a.deterministic,
                           log_dir=a.log_dir, port=a.port, prompts=a.prompts,
                           io_backend=a.io_backend, mem_layout=a.mem_layout,
                           skip_file=a.skip_file, skip_restart=a.skip_restart,
                           second_server=a.second_server, min_len=lo,
                           max_len=hi, **explicit)
    try:
        s.page_tokens
    except ValueError as e:
        ap.error(str(e))
    return s, a


def main(argv=None) -> int:
    s, a = parse_args(argv)
    if a.dry_run:
        print(f"# model: {s.model_dir} ({s.shape}, weights {s.weights.kind} seed "
              f"{s.weights.seed}, deterministic inference {'on' if s.deterministic else 'off'})")
        for sc in SCENARIOS:
            env = harness.env_diff(server_env(s, sc, probe=False))
            print(f"# {sc}")
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())) + " \\\n  "
                  + shlex.join(server_args(s, sc)))
        return 0
    s.out = os.path.abspath(s.out)
    s.log_dir = os.path.abspath(s.log_dir or s.out)
    s.bundle = os.path.abspath(s.bundle)
    res = Run(s).run()
    path = harness.write(res, s.out)
    report(res)
    print(f"wrote {path}")
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
