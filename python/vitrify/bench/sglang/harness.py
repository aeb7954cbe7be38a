"""One harness for every SGLang end-to-end run (freeze, HiCache, weights) on a GPU machine.

Owns: the offline bundle (:func:`unpack_bundle`: unpacked once, compiled to bytecode), the check
that the server's python imports vitrify with its SGLang plugin entry point
(:func:`vitrify_origin`), the model directory (:func:`write_model`: ``config.json`` and the
seeded checkpoint of :mod:`.checkpoint`, or dummy weights where a run says why), the server's
command line (:func:`server_command`: the flags every run shares, deterministic inference per
launch) and environment (:func:`server_env`), the server process (:class:`Server`: its own
process group, ``/health``, its log streamed to a file, always stopped by its group id), the log
lines of SGLang and of vitrify's plugin (:class:`LogWatch`, :func:`timeline`), the HTTP calls
(streamed ``/generate``, ``/flush_cache``, ``/get_server_info``, ``/update_weights_from_tensor``),
prompts, the comparison of two passes (:func:`compare`) and the one dated result file
(:func:`result`, :func:`write`, through :mod:`vitrify.bench.resultlib`; :func:`write_partial`
keeps what a run knows so far).

Deterministic inference (issue 34): SGLang 0.5.17 is not deterministic across cache paths with
weights whose outputs depend on the context (a device prefix hit and an L3 hit differ from a
miss), unless the server runs with ``--enable-deterministic-inference``. So every launch says
whether it ran with it (``deterministic``), every comparison says whether it crosses a cache
path (an L3 hit against a miss, a restart against the first launch, a thawed server against a
plain one), and :func:`compare` makes a crossing comparison a check only when both launches were
deterministic; otherwise it is recorded with the reason. Comparisons within one path (LOAD
against SAVE) are checks under SGLang's defaults.
"""

from __future__ import annotations

import datetime as _dt
import glob
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .. import resultlib
from . import checkpoint

MiB = 1 << 20
# what SGLang logs and takes differs by release: the version modules of the plugin hold both
# (the harness's lines match every supported release's; the bundle's release picks the flags)
BUNDLE_RELEASE = "0.5.17"  # scripts/sglang-bundle/ packs this one (the GPU machine's torch)


def release_module(version: str = BUNDLE_RELEASE):
    """The plugin's version module of ``version`` (its ``LOG_LINES`` and ``CLI_FLAGS``)."""
    import importlib

    return importlib.import_module("vitrify.integrations.sglang.versions.v" +
                                   version.replace(".", "_"))


def flag(what: str, version: str = BUNDLE_RELEASE) -> str:
    """The command-line flag of ``what`` (``CLI_FLAGS``: decode_max_bs, prefill_backend, ...) on
    SGLang ``version``."""
    return release_module(version).CLI_FLAGS[what]


def log_line(what: str) -> re.Pattern:
    """A pattern matching SGLang's log line ``what`` (``LOG_LINES``) as any supported release
    writes it."""
    from vitrify.integrations.sglang import versions

    texts = sorted({release_module(v).LOG_LINES[what] for v in versions.SUPPORTED})
    return re.compile("|".join(re.escape(t) for t in texts))


DETERMINISTIC_FLAG = flag("deterministic")
INSTALL_HINT = ("install this tree into it first: python3 -m pip install --no-build-isolation "
                "--no-deps --no-index . (from the repository root)")


# ---- the bundle and vitrify -------------------------------------------------------------------


def unpack_bundle(bundle: str, site: str, python: str = sys.executable) -> str:
    """Unpack the SGLang bundle (``scripts/sglang-bundle/``) into ``site`` once and compile it to
    bytecode; what was done, in words. FileNotFoundError without the bundle."""
    marker = os.path.join(site, ".vitrify-unpacked")
    if not os.path.isfile(bundle):
        raise FileNotFoundError(f"bundle {bundle} not found (carry the .whl folder; "
                                f"scripts/sglang-bundle/build.sh makes it)")
    if os.path.exists(marker) and Path(marker).read_text().strip() == \
            str(os.path.getsize(bundle)):
        return "already unpacked"
    t0 = time.monotonic()
    tmp = site + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    subprocess.run(["tar", "-xJf", os.path.abspath(bundle), "-C", tmp], check=True)
    shutil.rmtree(site, ignore_errors=True)
    os.rename(tmp, site)
    t1 = time.monotonic()
    # the bundle ships sources only (its size); pip compiles what it installs, and so does
    # this, once, in place (the bytecode names its source's path): every server launch would
    # otherwise compile the modules it imports (a file that does not compile is named and
    # left to Python, which compiles it on import)
    r = subprocess.run([python, "-m", "compileall", "-q", "-j", "0", site],
                       capture_output=True, text=True)
    Path(marker).write_text(str(os.path.getsize(bundle)))
    note = "" if r.returncode == 0 else \
        f" (compileall exited {r.returncode}: {(r.stdout + r.stderr).strip()[-300:]})"
    return f"unpacked in {t1 - t0:.1f} s, compiled to bytecode in " \
        f"{time.monotonic() - t1:.1f} s{note}"


def vitrify_origin(python: str = sys.executable) -> str:
    """Where ``python`` imports vitrify from, with the native parts and its SGLang plugin entry
    point (a vitrify found through PYTHONPATH has none, and SGLang would start without the
    plugin); RuntimeError naming what is missing otherwise."""
    probe = [python, "-c", "import importlib.metadata as md, vitrify, vitrify.host, vitrify.disk; "
             "assert any(e.name == 'vitrify' for e in md.entry_points(group='sglang.srt.plugins'"
             ")), 'no sglang.srt.plugins entry point'; print(vitrify.__file__)"]
    r = subprocess.run(probe, capture_output=True, text=True, cwd="/tmp")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{python} does not import vitrify with its SGLang plugin ({last}): "
                           f"{INSTALL_HINT}")
    return f"vitrify importable: {r.stdout.strip()}"


# ---- the model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Weights:
    """What the server's weights are: ``"checkpoint"`` (the seeded N(0, 0.02) checkpoint of
    :mod:`.checkpoint`, loaded by SGLang with ``--load-format auto``) or ``"dummy"`` (SGLang's
    uniform +-1e-3, ``--load-format dummy``: outputs blind to the context; ``why`` must say why a
    run accepts that)."""

    kind: str = "checkpoint"
    seed: int = 0
    why: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("checkpoint", "dummy"):
            raise ValueError(f"weights must be 'checkpoint' or 'dummy', got {self.kind!r}")
        if self.kind == "dummy" and not self.why.strip():
            raise ValueError("dummy weights need a reason (Weights(kind='dummy', why=...)): their "
                             "outputs do not depend on the context, so no check can see a wrong "
                             "KV cache")

    @property
    def load_format(self) -> str:
        return "auto" if self.kind == "checkpoint" else "dummy"


def write_model(model_dir: str, cfg: dict, weights: Weights,
                device: Optional[str] = None) -> dict:
    """``config.json`` of ``cfg`` in ``model_dir`` and, for checkpoint weights, the checkpoint
    (kept when an earlier run wrote the same one); the record the result carries."""
    os.makedirs(model_dir, exist_ok=True)
    tmp = Path(model_dir, "config.json.tmp")
    tmp.write_text(json.dumps(cfg, indent=1))
    os.replace(tmp, Path(model_dir, "config.json"))
    rec: dict[str, Any] = {"kind": weights.kind, "model_dir": model_dir,
                           "load_format": weights.load_format}
    if weights.kind == "dummy":
        for p in Path(model_dir).glob("*.safetensors"):  # SGLang must not find a checkpoint
            p.unlink()
        Path(model_dir, checkpoint.MANIFEST).unlink(missing_ok=True)
        return {**rec, "why": weights.why}
    man = checkpoint.write(model_dir, cfg, seed=weights.seed, device=device)
    return {**rec, "seed": weights.seed, "std": man["std"], "norms": man["norms"],
            "device_kind": man["device_kind"], "bytes": man["bytes"], "files": len(man["files"]),
            "safetensors_writer": man["safetensors_writer"], "reused": man["reused"],
            "write_s": 0.0 if man["reused"] else man["seconds"]}


# ---- the server's command line and environment --------------------------------------------------


def server_command(python: str, model_dir: str, port: int, *, weights: Weights,
                   deterministic: bool, extra: list[str] = ()) -> list[str]:
    """``python -m sglang.launch_server`` with what every run shares (token ids in, no tokenizer,
    triton attention, pytorch sampling, 127.0.0.1:``port``), the load format of ``weights``,
    ``--enable-deterministic-inference`` when ``deterministic``, then ``extra``."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_dir,
           "--load-format", weights.load_format, "--skip-tokenizer-init",
           "--attention-backend", "triton", "--sampling-backend", "pytorch"]
    if deterministic:
        cmd.append(DETERMINISTIC_FLAG)
    return cmd + list(extra) + ["--port", str(port), "--host", "127.0.0.1",
                                "--log-level", "info"]


def is_deterministic(cmd: list[str]) -> bool:
    return DETERMINISTIC_FLAG in cmd


def cuda_home() -> Optional[str]:
    """CUDA_HOME, else the toolkit of ``nvcc`` on PATH, else a usual place (with libcudart)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    cands = []
    if nvcc:
        cands.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    cands += ["/usr/local/cuda", "/usr/local/cuda-13.0", "/usr/local/cuda-13"]
    for c in cands:
        if os.access(os.path.join(c, "bin", "nvcc"), os.X_OK) and \
                glob.glob(os.path.join(c, "lib64", "libcudart.so*")):
            return c
    return None


def server_env(site: str, base: Optional[dict] = None, probe: bool = True) -> dict:
    """The environment the bundle needs: PYTHONPATH at ``site``, offline Hugging Face, no NVLink
    multicast, unbuffered output and, with ``probe``, SGLang's JIT toolchain found on this
    machine (CUDA_HOME, an unversioned libcudart for the linker, ninja on PATH). ``probe=False``
    (dry runs, tests) looks for nothing."""
    env = dict(os.environ if base is None else base)
    env.update({
        "PYTHONPATH": site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1",
    })
    if not probe:
        return env
    cuda = cuda_home()
    if cuda:
        env["CUDA_HOME"] = cuda
        if not os.path.exists(os.path.join(cuda, "lib64", "libcudart.so")):
            versioned = sorted(glob.glob(os.path.join(cuda, "lib64", "libcudart.so.*")))
            if versioned:  # the JIT links -lcudart: give it an unversioned name
                os.makedirs("/tmp/cudart-link", exist_ok=True)
                link = "/tmp/cudart-link/libcudart.so"
                if os.path.islink(link) or os.path.exists(link):
                    os.remove(link)
                os.symlink(versioned[0], link)
                env["LIBRARY_PATH"] = "/tmp/cudart-link" + (
                    os.pathsep + env["LIBRARY_PATH"] if env.get("LIBRARY_PATH") else "")
    if shutil.which("ninja", path=env.get("PATH")) is None:
        # tvm-ffi's JIT runs `ninja` from PATH: the pip package's binary, bundled or installed
        cands = [os.path.join(site, "ninja", "data", "bin")]
        try:
            import ninja  # type: ignore

            cands.append(getattr(ninja, "BIN_DIR", os.path.join(os.path.dirname(ninja.__file__),
                                                                "data", "bin")))
        except ImportError:
            pass
        for nb in cands:
            if os.access(os.path.join(nb, "ninja"), os.X_OK):
                env["PATH"] = env.get("PATH", "") + os.pathsep + nb
                break
    return env


def env_diff(env: dict) -> dict:
    """What ``env`` sets differently from this process's environment."""
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def jit_env(env: dict) -> dict:
    """The JIT toolchain ``env`` gives the server (for the result file)."""
    return {"CUDA_HOME": env.get("CUDA_HOME"), "LIBRARY_PATH": env.get("LIBRARY_PATH"),
            "ninja": shutil.which("ninja", path=env.get("PATH")),
            "c++": shutil.which("c++", path=env.get("PATH"))}


# ---- the server process ------------------------------------------------------------------------


class Server:
    """One server in its own process group, its output streamed to ``log_path``; stopped by its
    group id (SIGTERM, then SIGKILL, then every process left in the group) when the ``with``
    block ends, an exception included."""

    def __init__(self, cmd: list[str], env: dict, log_path: str, cwd: str = "/tmp"):
        self.cmd, self.env, self.log_path, self.cwd = cmd, env, log_path, cwd
        self.proc: Optional[subprocess.Popen] = None
        self.t_launch = 0.0
        self._log = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._log = open(self.log_path, "w")
        self.t_launch = time.monotonic()
        kw: dict = {"process_group": 0} if sys.version_info >= (3, 11) else \
            {"preexec_fn": os.setpgrp}
        try:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.cwd, **kw)
        except BaseException:
            self._log.close()
            self._log = None
            raise

    @property
    def deterministic(self) -> bool:
        return is_deterministic(self.cmd)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, port: int, timeout: float) -> float:
        """Seconds from launch to ``/health`` 200; RuntimeError when it dies or times out."""
        while time.monotonic() - self.t_launch < timeout:
            if not self.alive():
                raise RuntimeError(f"server exited with {self.proc.returncode} before ready")
            if http_call(port, "GET", "/health", timeout=5)[0] == 200:
                return time.monotonic() - self.t_launch
            time.sleep(1.0)
        raise RuntimeError(f"server not ready after {timeout:.0f} s")

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if p is not None:
            # children left in the group after the leader exited (the scheduler holds the
            # GPU memory the next launch sizes its pools from): gone within a bounded wait
            t0 = time.monotonic()
            while time.monotonic() - t0 < 10.0:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    break
                time.sleep(0.2)
        if self._log is not None:
            self._log.close()
            self._log = None


def log_tail(path: str, lines: int = 80) -> list[str]:
    try:
        return Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        return [f"<no log: {e}>"]


# ---- log lines (SGLang's and vitrify's plugin's) -----------------------------------------------

IMPORT_FLOOR_LINE = log_line("import_floor")  # the scheduler's first engine line
THAWED_LINE = re.compile(r"vitrify: thawed (\S+) in ([0-9.]+) s")
SAVE_LINE = re.compile(r"vitrify: SAVE complete")
STANDBY_LINE = re.compile(r"vitrify: standby: imports done")
STANDBY_READ_DONE_LINE = re.compile(r"vitrify: standby: the spans the thaw restores are in the "
                                    r"page cache")
SAVE_FAILED_LINE = re.compile(r"vitrify: SAVE failed|vitrify SGLang plugin:.*(fatal|failed)")
PLUGIN_LINE = re.compile(r"vitrify SGLang plugin: mode '(save|load)'")
# the start-up's milestones in a server log, for "where the seconds go" (first match each)
TIMELINE = {
    "torch_distributed": IMPORT_FLOOR_LINE,
    "load_weight_begin": log_line("load_weight_begin"),
    "load_weight_end": log_line("load_weight_end"),
    "kv_cache_allocated": log_line("kv_cache_allocated"),
    "decode_graphs_begin": log_line("capture_begin"),
    "decode_graphs_end": log_line("capture_end"),
    "thawed": THAWED_LINE,
    "saved": SAVE_LINE,
    "fired_up": log_line("ready"),
}
STAMP = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:,(\d{3}))?")
SESSION_STEP = re.compile(r"vitrify\.session INFO: (\w+): ([0-9.]+) s$")
GRAPH_LOOP = re.compile(r"decode graphs, (\d+) shapes: warm-up forwards ([0-9.]+) s, gc "
                        r"([0-9.]+) s, (capture|claim) ([0-9.]+) s(?: \(SGLang's whole capture "
                        r"step ([0-9.]+) s\))?")
WARMUP_LINE = re.compile(r"LOAD warm-up: (\d+) request\(s\) of ([0-9, ]+) tokens in ([0-9.]+) s")
REGISTRY_LINE = re.compile(r"the model registry imports (.*) only")
STANDBY_READ_LINE = re.compile(r"standby: ([0-9.]+) of ([0-9.]+) GiB of the spans the thaw "
                               r"restores read into the page cache in ([0-9.]+) s")
READ_AHEAD_LINE = re.compile(r"read-ahead: the spans the thaw restores are in the page cache "
                             r"\(([0-9.]+) GiB in ([0-9.]+) s\)")
RESTORE_LINE = re.compile(r"restored \S+/weights\.span: (\d+) bytes written.* ([0-9.]+) s$")
CACHED_LINE = re.compile(r"weights\.span: (\d+)% of it is in the page cache")
HEAP_LINE = re.compile(r"(\d+) objects of the imports moved to the collector's permanent "
                       r"generation in ([0-9.]+) s")
DETERMINISTIC_LINE = re.compile(r"enable_deterministic_inference=(True|False)")


class LogWatch:
    """Follows a server log and notes when (monotonic) each pattern first appears."""

    def __init__(self, path: str, patterns: dict[str, re.Pattern]):
        self.path, self.patterns, self.seen, self._pos = path, patterns, {}, 0
        self.matches: dict[str, re.Match] = {}
        self._tail = ""  # a line not yet ended

    def poll(self) -> None:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self._pos)
                text = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return
        now = time.monotonic()
        text = self._tail + text
        lines = text.split("\n")
        self._tail = lines.pop()  # "" after a final newline
        for line in lines:
            for k, pat in self.patterns.items():
                if k not in self.seen:
                    m = pat.search(line)
                    if m:
                        self.seen[k], self.matches[k] = now, m


def timeline(log: str, t_launch: float) -> dict:
    """Seconds from launch (``t_launch``: wall clock) to each ``TIMELINE`` milestone in the
    log (vitrify's lines carry milliseconds, SGLang's whole seconds), the session's step
    times, the decode-graph loop's split and the plugin's other figures."""
    out: dict[str, Any] = {"at_s": {}, "session_steps_s": {}}
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return out
    plugin_lines = 0
    for line in lines:
        if (d := DETERMINISTIC_LINE.search(line)) and "deterministic_inference" not in out:
            out["deterministic_inference"] = d.group(1) == "True"  # SGLang's server_args line
        m = STAMP.match(line)
        if m is None:
            continue
        t = _dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + \
            (int(m.group(2)) / 1e3 if m.group(2) else 0.0)
        if PLUGIN_LINE.search(line) and m.group(2):  # the launcher's, then the scheduler's
            key = ("plugin_launcher", "plugin_scheduler")[min(plugin_lines, 1)]
            out["at_s"].setdefault(key, round(t - t_launch, 3))
            plugin_lines += 1
        for k, pat in TIMELINE.items():
            if k not in out["at_s"] and pat.search(line):
                out["at_s"][k] = round(t - t_launch, 3)
        if (st := SESSION_STEP.search(line)) and st.group(1) != "total":
            out["session_steps_s"][st.group(1)] = float(st.group(2))
        if g := GRAPH_LOOP.search(line):
            out["decode_graph_loop"] = {"shapes": int(g.group(1)),
                                        "warmup_forwards_s": float(g.group(2)),
                                        "gc_s": float(g.group(3)),
                                        g.group(4) + "_s": float(g.group(5))}
            if g.group(6):
                out["decode_graph_loop"]["sglang_capture_step_s"] = float(g.group(6))
        if w := WARMUP_LINE.search(line):
            out["load_warmup"] = {"requests": int(w.group(1)), "seconds": float(w.group(3)),
                                  "lengths": [int(x) for x in w.group(2).split(",")]}
        if r := REGISTRY_LINE.search(line):
            out["model_registry_narrowed_to"] = r.group(1)
        if r := STANDBY_READ_LINE.search(line):
            out["standby_read"] = {"gib": float(r.group(1)), "of_gib": float(r.group(2)),
                                   "seconds": float(r.group(3))}
        if r := READ_AHEAD_LINE.search(line):
            out["read_ahead"] = {"gib": float(r.group(1)), "seconds": float(r.group(2)),
                                 "done_at_s": round(t - t_launch, 3)}
        if r := CACHED_LINE.search(line):
            out["weights_in_page_cache_pct"] = int(r.group(1))
        if r := RESTORE_LINE.search(line):
            out["weights_restore"] = {"bytes": int(r.group(1)), "seconds": float(r.group(2))}
        if r := HEAP_LINE.search(line):
            out["import_heap_frozen"] = {"objects": int(r.group(1)),
                                         "seconds": float(r.group(2))}
    return out


# ---- prompts and requests ----------------------------------------------------------------------


def make_prompts(seed: int, n: int, lo: int, hi: int, vocab: int = 32000) -> list[list[int]]:
    """``n`` prompts of random token ids (3..vocab-1: no BOS/EOS ids), lengths in [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def prefix_pages(prompt_len: int, page: int) -> int:
    """Pages SGLang can reuse for a prompt: it matches at most len-1 tokens, page-aligned."""
    return max(prompt_len - 1, 0) // page


def generate(port: int, ids: list[int], max_new_tokens: int, timeout: float = 120.0) -> dict:
    """One streamed greedy ``/generate``: output ids, logprobs, meta_info, TTFT and latency."""
    body = json.dumps({
        "input_ids": ids, "stream": True, "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                            "ignore_eos": True},
    })
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    ttft = None
    last: Optional[dict] = None
    try:
        conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/generate -> HTTP {resp.status}: {resp.read()[:500]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"/generate error: {chunk['error']}")
            if ttft is None and chunk.get("output_ids"):
                ttft = time.perf_counter() - t0
            last = chunk
    finally:
        conn.close()
    latency = time.perf_counter() - t0
    if last is None:
        raise RuntimeError("/generate returned no chunk")
    meta = last.get("meta_info", {})
    logprobs = [lp[0] if isinstance(lp, (list, tuple)) else lp
                for lp in meta.get("output_token_logprobs") or []]
    return {"output_ids": list(last.get("output_ids") or []), "logprobs": logprobs,
            "cached_tokens": int(meta.get("cached_tokens") or 0),
            "details": meta.get("cached_tokens_details") or {},
            "prompt_tokens": int(meta.get("prompt_tokens") or len(ids)),
            "ttft_s": ttft if ttft is not None else latency, "latency_s": latency}


def generate_batch(port: int, prompts: list[list[int]], max_new_tokens: int,
                   timeout: float = 300.0) -> list[dict]:
    """One greedy ``/generate`` of several prompts (SGLang schedules them as one batch when they
    fit): each answer's output ids and logprobs."""
    body = json.dumps({"input_ids": prompts, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                           "ignore_eos": True}}).encode()
    st, text = http_call(port, "POST", "/generate", timeout=timeout, body=body)
    if st != 200:
        raise RuntimeError(f"/generate of {len(prompts)} prompt(s) -> HTTP {st}: {text[:300]}")
    out = json.loads(text)
    out = out if isinstance(out, list) else [out]
    if len(out) != len(prompts) or any("error" in a for a in out if isinstance(a, dict)):
        raise RuntimeError(f"/generate of {len(prompts)} prompt(s): {text[:300]}")
    return [{"output_ids": list(a.get("output_ids") or []),
             "logprobs": [lp[0] for lp in (a.get("meta_info") or {}).get(
                 "output_token_logprobs") or []]} for a in out]


def heldout_shapes(seed: int, max_input: int, max_batch: int, page: int,
                   vocab: int = 32000) -> list[list[list[int]]]:
    """Request shapes no warm-up of the plugin sends (a held-out sweep: the check that the
    archive's JIT caches cover shapes past SAVE's): in every power-of-two class of batch size a
    size the plugin's sweep does not send where the class has one, prompt lengths off every page
    boundary and off the plugin's lengths, spread over 1 ... ``max_input``, and the first two
    batches again grown by a few tokens (prefix hits). Each item is one request's prompts."""
    from vitrify.integrations.sglang import sweep

    rng = random.Random(seed)
    taken_sizes = set(sweep.batch_sizes(max_batch))
    taken_lengths = set(sweep.prompt_lengths(max_input, page))

    def length(lo: int, hi: int) -> int:
        for _ in range(100):
            n = rng.randint(lo, hi)
            if (page == 1 or n % page) and n not in taken_lengths:
                return n
        return rng.randint(lo, hi)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    out: list[list[list[int]]] = []
    c = 1
    while c // 2 < max_batch:
        free = [b for b in range(c // 2 + 1, min(c, max_batch) + 1) if b not in taken_sizes]
        b = rng.choice(free or [min(c, max_batch)])
        out.append([prompt(length(1, max(1, min(3 * page + 7, max_input)))) for _ in range(b)])
        c *= 2
    grown = [[p + prompt(rng.randint(1, 2 * page + 1)) for p in batch if
              len(p) + 2 * page + 1 <= max_input] for batch in out[1:3]]
    out += [g for g in grown if g]
    bounds = [1] + [max_input * k // 6 for k in range(1, 7)]
    out += [[prompt(length(max(1, lo), max(1, hi)))] for lo, hi in zip(bounds, bounds[1:])]
    return out


def run_pass(port: int, prompts: list[list[int]], max_new: int,
             timeout: float = 120.0) -> list[dict]:
    """The prompts one at a time (prefetch admission is rate-limited by SGLang's host pool, and
    the times stay comparable)."""
    return [generate(port, p, max_new, timeout) for p in prompts]


def http_call(port: int, method: str, path: str, timeout: float = 30.0,
              body: Optional[bytes] = None) -> tuple[int, str]:
    """(status, text) of one request; (-1, the error) when the connection fails."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        return -1, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def flush_cache(port: int, timeout: float = 20.0) -> None:
    """``/flush_cache`` (refused while requests run: retried until it succeeds)."""
    t0 = time.monotonic()
    while True:
        st, text = http_call(port, "POST", "/flush_cache")
        if st == 200:
            return
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"/flush_cache kept failing: {st} {text[:200]}")
        time.sleep(0.5)


def server_info(port: int) -> dict:
    st, text = http_call(port, "GET", "/get_server_info", timeout=30.0)
    if st != 200:
        raise RuntimeError(f"/get_server_info: HTTP {st}: {text[:200]}")
    return json.loads(text)


def serialize(named_tensors: list) -> str:
    """What SGLang's MultiprocessingSerializer.serialize(..., output_str=True) makes: the
    ForkingPickler dump (torch's reductions: CUDA tensors travel as IPC handles), base64."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode()


def post_update(port: int, named_tensors: list, load_format: Optional[str],
                timeout: float = 600.0) -> tuple[bool, str]:
    """``/update_weights_from_tensor`` (the radix cache flushed after it): SGLang's
    ``(success, message)``. ``load_format=None`` is SGLang's own path (HF names, CUDA IPC
    tensors); ``"vitrify"`` is the plugin's receiver."""
    body = json.dumps({"serialized_named_tensors": [serialize(named_tensors)],
                       "load_format": load_format, "flush_cache": True}).encode()
    st, text = http_call(port, "POST", "/update_weights_from_tensor", timeout=timeout, body=body)
    try:
        out = json.loads(text)
    except ValueError:
        return False, f"HTTP {st}: {text[:300]}"
    return bool(out.get("success")), str(out.get("message"))


# ---- comparisons -------------------------------------------------------------------------------


def tokens_identical(a: list[dict], b: list[dict]) -> bool:
    """Same number of requests, each with the same non-empty output ids."""
    return len(a) == len(b) and all(x["output_ids"] == y["output_ids"] and x["output_ids"]
                                    for x, y in zip(a, b))


def logprob_diff(a: list[dict], b: list[dict]) -> Optional[float]:
    """Largest |difference| of the output-token logprobs (None when not comparable)."""
    if len(a) != len(b) or not a:
        return None
    worst = 0.0
    for x, y in zip(a, b):
        if len(x["logprobs"]) != len(y["logprobs"]) or not x["logprobs"]:
            return None
        for p, q in zip(x["logprobs"], y["logprobs"]):
            if p is None or q is None:
                return None
            worst = max(worst, abs(float(p) - float(q)))
    return worst


def compare(name: str, a: list[dict], b: list[dict], *, launches: tuple[str, str],
            deterministic: tuple[bool, bool], crosses: bool, logprobs: bool = True) -> dict:
    """Pass ``a`` against pass ``b`` (of ``launches``, each run with or without deterministic
    inference): ``identical`` is tokens (and, with ``logprobs``, logprobs bit for bit) equal;
    ``is_check`` says whether that may be a check: always for a comparison within one cache
    path, for one that ``crosses`` a cache path only when both launches were deterministic."""
    tok = tokens_identical(a, b)
    diff = logprob_diff(a, b)
    rec: dict[str, Any] = {
        "name": name, "launches": list(launches), "deterministic": list(deterministic),
        "crosses_cache_path": crosses, "what": "tokens and logprobs" if logprobs else "tokens",
        "tokens_identical": tok, "logprob_max_abs_diff": diff,
        "identical": tok and (diff == 0.0 if logprobs else True),
        "is_check": (not crosses) or all(deterministic)}
    if not rec["is_check"]:
        rec["why_not_a_check"] = ("crosses a cache path, and not both launches ran with "
                                  "--enable-deterministic-inference: SGLang's kernels may then "
                                  "differ between the paths")
    return rec


def fold(comparisons: list[dict], checks: dict) -> dict:
    """``checks`` with every comparison that is a check (its ``identical``) under its name."""
    for c in comparisons:
        if c["is_check"]:
            checks[c["name"]] = c["identical"]
    return checks


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return num / den if num and den else None


# ---- results -----------------------------------------------------------------------------------


def partial_path(out: str, name: str) -> str:
    """Where a run keeps what it knows so far (replaced as it goes; not a result file)."""
    return os.path.join(out, f"{name}.partial")


def write_partial(out: str, name: str, obj: dict) -> None:
    """Replace ``out/<name>.partial`` with ``obj`` (JSON): what survives a run killed at the
    device call's limit. The one dated result is :func:`write`'s."""
    os.makedirs(out, exist_ok=True)
    path = partial_path(out, name)
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def result(name: str, *, ok: bool, oracle_power: dict, **fields: Any) -> dict:
    """The run's result object (``resultlib.result``: date, git_sha, machine, ok, goals,
    goal_direction, ratios; plus ``oracle_power`` and ``fields``). ``ok`` is the run's verdict
    and the oracle's: a run whose oracle is blind (``oracle_power["ok"]`` false) fails."""
    return resultlib.result(name, ok=bool(ok) and bool(oracle_power.get("ok")),
                            oracle_power=oracle_power, **fields)


def write(res: dict, out: str) -> Path:
    """Write the one dated result (``resultlib.write``: ``<name>-<date>-<commit>.json``, never
    replacing a file) and remove the run's partial record."""
    path = resultlib.write(res, out)
    Path(partial_path(out, res["name"])).unlink(missing_ok=True)
    return path
