"""Start a real SGLang server from the offline bundle on a GPU machine, query it, stop it.

    python3 scripts/sglang-bundle/serve.py [--bundle .whl/sglang-site.tar.xz] [--shape tiny|8b]
                                           [--out DIR] [-- EXTRA SERVER ARGS]

Run it from the repository root on the GPU machine (no internet needed; the machine's python must
have torch 2.11). It unpacks the bundle once to ``--site`` (kept for later runs and for other
scripts: put it on PYTHONPATH with the environment printed below), writes a config-only Qwen3
(``--load-format dummy`` gives random weights, ``--skip-tokenizer-init`` means requests send
token ids): ``tiny`` is 8 layers of hidden 1024, ``8b`` the Qwen3-8B shape. It then checks that the
bundle imports in that python, launches ``sglang.launch_server`` in its own process group, waits
for ``/health``, sends greedy ``/generate`` requests (16 new tokens; then prefill-only requests of
1024 and 3500 tokens), prints time to ready, request latencies and the server's start-up lines,
and stops the whole process group. Exit status 0 only when the server became ready and every
request returned what it asked for. The server log is written to ``--out``.

Unpacking, the environment (offline Hugging Face, NVLS off, the JIT toolchain SGLang's kernels
need: CUDA_HOME, ninja, an unversioned libcudart for the linker) and the server process are
shared with ``benchmarks/sglang_hicache_e2e.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
import sglang_hicache_e2e as e2e  # noqa: E402

SHAPES = e2e.SHAPES  # tiny: 8 layers, hidden 1024, 8 KV heads of 64; 8b: Qwen3-8B's
MEM_FRACTION = {"tiny": 0.3, "8b": 0.5}
STARTUP_LINES = re.compile(
    r"Load weight (begin|end)|KV Cache is allocated|max_total_num_tokens|Capture .*graph|"
    r"Init torch distributed|ready to roll|startup timings", re.IGNORECASE)

PREFLIGHT = """
import importlib, importlib.metadata as md, json
out = {}
for d in ("torch", "triton", "transformers", "sglang", "sglang-kernel", "xgrammar", "apache-tvm-ffi"):
    try:
        out[d] = md.version(d)
    except md.PackageNotFoundError:
        out[d] = None
import torch
out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
for m in ("sgl_kernel", "tvm_ffi", "xgrammar", "zmq", "orjson", "msgspec", "sglang.srt.server_args"):
    try:
        importlib.import_module(m)
        out["import " + m] = "ok"
    except BaseException as e:
        out["import " + m] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
print(json.dumps(out))
"""


def write_model(model_dir: str, shape: str) -> dict:
    cfg = e2e.model_config(shape)
    os.makedirs(model_dir, exist_ok=True)
    Path(model_dir, "config.json").write_text(json.dumps(cfg, indent=1))
    return cfg


def server_command(python: str, model_dir: str, shape: str, port: int,
                   extra: list[str]) -> list[str]:
    return [python, "-m", "sglang.launch_server", "--model-path", model_dir,
            "--load-format", "dummy", "--skip-tokenizer-init",
            "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--disable-radix-cache", "--mem-fraction-static", str(MEM_FRACTION[shape]),
            "--cuda-graph-max-bs", "32", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "info", *extra]


def requests(port: int, vocab: int) -> list[str]:
    """Greedy requests against a ready server; one line each. Raises on a wrong answer."""
    lines = []
    for what in ("first", "again"):
        r = e2e.generate(port, list(range(1, 9)), max_new_tokens=16)
        if len(r["output_ids"]) != 16:
            raise RuntimeError(f"/generate asked for 16 tokens, got {len(r['output_ids'])}")
        lines.append(f"/generate ({what}): 16 tokens in {r['latency_s'] * 1e3:.0f} ms "
                     f"(first token {r['ttft_s'] * 1e3:.0f} ms)")
    for n in (1024, 3500):
        ids = [(i * 7919) % (vocab - 3) + 3 for i in range(n)]
        ts = []
        for _ in range(3):
            r = e2e.generate(port, ids, max_new_tokens=1)
            if len(r["output_ids"]) != 1:
                raise RuntimeError(f"prefill of {n} tokens returned {len(r['output_ids'])} ids")
            ts.append(r["ttft_s"])
        lines.append(f"prefill {n} tokens: " + ", ".join(f"{t * 1e3:.0f} ms" for t in ts))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=".whl/sglang-site.tar.xz")
    ap.add_argument("--site", default="/tmp/sgsite", help="where the bundle is unpacked (kept)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--port", type=int, default=30011)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--python", default=sys.executable, help="the python that runs the server")
    ap.add_argument("--out", default="build/sglang-serve", help="where the server log goes")
    ap.add_argument("extra", nargs="*", help="extra sglang.launch_server arguments (after --)")
    a = ap.parse_args(argv)

    s = replace(e2e.Settings(), bundle=a.bundle, site=a.site, python=a.python)
    if not os.path.isfile(s.bundle):
        print(f"serve: no bundle at {s.bundle}; build it where PyPI is reachable with "
              "`bash scripts/sglang-bundle/build.sh` and carry the .whl folder", file=sys.stderr)
        return 2
    print(f"== bundle {s.bundle}: {e2e.unpack_bundle(s)} -> {s.site}")
    model_dir = f"/tmp/qwen3-{a.shape}-serve"
    cfg = write_model(model_dir, a.shape)
    print(f"== model {model_dir}: Qwen3 {a.shape}, {cfg['num_hidden_layers']} layers, hidden "
          f"{cfg['hidden_size']}, {cfg['num_key_value_heads']} KV heads x {cfg['head_dim']}")
    env = e2e.server_env(s, "vitrify")
    print("== environment: " + " ".join(f"{k}={v}" for k, v in sorted(e2e.env_diff(env).items())))

    t0 = time.monotonic()
    pre = subprocess.run([s.python, "-c", PREFLIGHT], env=env, capture_output=True, text=True,
                         cwd="/tmp", timeout=300)
    if pre.returncode != 0:
        print(f"serve: the bundle does not import in {s.python}:\n{pre.stderr[-3000:]}",
              file=sys.stderr)
        return 3
    info = json.loads(pre.stdout.strip().splitlines()[-1])
    print(f"== preflight ({time.monotonic() - t0:.1f} s): "
          + ", ".join(f"{k} {v}" for k, v in info.items()))
    broken = [k for k, v in info.items() if k.startswith("import ") and v != "ok"]
    if broken or not info.get("gpu"):
        print(f"serve: cannot start a server here: {broken or 'torch sees no GPU'}",
              file=sys.stderr)
        return 3

    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, f"sglang-{a.shape}.log")
    cmd = server_command(s.python, model_dir, a.shape, a.port, a.extra)
    print("== launch: " + " ".join(cmd))
    rc = 0
    with e2e.Server(cmd, env, log) as srv:
        try:
            ready = srv.wait_ready(a.port, a.ready_timeout)
            print(f"== ready after {ready:.1f} s (launch -> /health 200)")
            for line in requests(a.port, cfg["vocab_size"]):
                print(f"== {line}")
        except RuntimeError as e:
            rc = 1
            print(f"serve: FAILED: {e}; the last lines of {log}:", file=sys.stderr)
            print("\n".join(e2e.log_tail(log, 40)), file=sys.stderr)
        finally:
            srv.stop()
    print("== start-up lines of the server log:")
    for line in Path(log).read_text(errors="replace").splitlines():
        if STARTUP_LINES.search(line):
            print("   " + line[:240])
    print(f"== {'ok' if rc == 0 else 'failed'}; server stopped; log {log}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
