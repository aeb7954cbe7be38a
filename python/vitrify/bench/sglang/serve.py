"""Start a real SGLang server from the offline bundle on a GPU machine, query it, stop it.

    python3 -m vitrify.bench.sglang.serve [--bundle .whl/sglang-site.tar.xz] [--shape tiny|8b]
                                          [--weights checkpoint|dummy] [--out DIR]
                                          [-- EXTRA SERVER ARGS]

(``scripts/sglang-bundle/serve.py`` runs the same from a checkout.) It unpacks the bundle once to
``--site`` (kept for later runs and for other programs: put it on PYTHONPATH with the environment
printed below), writes the shape's model (config and, by default, the seeded N(0, 0.02)
checkpoint; ``--weights dummy`` for a config-only model when only the server's start matters),
checks that the bundle imports in this python, launches ``sglang.launch_server`` in its own
process group, waits for ``/health``, sends greedy ``/generate`` requests (16 new tokens; then
prefill-only requests of 1024 and 3500 tokens), prints time to ready, request latencies and the
server's start-up lines, and stops the whole process group. Exit status 0 only when the server
became ready and every request returned what it asked for. The server log goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from . import harness
from .harness import Weights
from .models import SHAPES, model_config

MEM_FRACTION = {"8b": 0.5, "8b-mqa": 0.5}
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


def server_command(python: str, model_dir: str, shape: str, port: int, weights: Weights,
                   extra: list[str]) -> list[str]:
    return harness.server_command(
        python, model_dir, port, weights=weights, deterministic=False,
        extra=["--disable-radix-cache", "--mem-fraction-static",
               str(MEM_FRACTION.get(shape, 0.3)), harness.flag("decode_max_bs"), "32", *extra])


def requests(port: int, vocab: int) -> list[str]:
    """Greedy requests against a ready server; one line each. Raises on a wrong answer."""
    lines = []
    for what in ("first", "again"):
        r = harness.generate(port, list(range(1, 9)), max_new_tokens=16)
        if len(r["output_ids"]) != 16:
            raise RuntimeError(f"/generate asked for 16 tokens, got {len(r['output_ids'])}")
        lines.append(f"/generate ({what}): 16 tokens in {r['latency_s'] * 1e3:.0f} ms "
                     f"(first token {r['ttft_s'] * 1e3:.0f} ms)")
    for n in (1024, 3500):
        ids = [(i * 7919) % (vocab - 3) + 3 for i in range(n)]
        ts = []
        for _ in range(3):
            r = harness.generate(port, ids, max_new_tokens=1)
            if len(r["output_ids"]) != 1:
                raise RuntimeError(f"prefill of {n} tokens returned {len(r['output_ids'])} ids")
            ts.append(r["ttft_s"])
        lines.append(f"prefill {n} tokens: " + ", ".join(f"{t * 1e3:.0f} ms" for t in ts))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m vitrify.bench.sglang.serve",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=".whl/sglang-site.tar.xz")
    ap.add_argument("--site", default="/tmp/sgsite", help="where the bundle is unpacked (kept)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--weights", choices=["checkpoint", "dummy"], default="checkpoint",
                    help="the seeded checkpoint (default) or SGLang's dummy weights")
    ap.add_argument("--models-root", default="/tmp/vitrify-models")
    ap.add_argument("--port", type=int, default=30011)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--python", default=sys.executable, help="the python that runs the server")
    ap.add_argument("--out", default="build/sglang-serve", help="where the server log goes")
    ap.add_argument("extra", nargs="*", help="extra sglang.launch_server arguments (after --)")
    a = ap.parse_args(argv)

    if not os.path.isfile(a.bundle):
        print(f"serve: no bundle at {a.bundle}; build it where PyPI is reachable with "
              "`bash scripts/sglang-bundle/build.sh` and carry the .whl folder", file=sys.stderr)
        return 2
    print(f"== bundle {a.bundle}: {harness.unpack_bundle(a.bundle, a.site, a.python)} -> {a.site}")
    weights = Weights(a.weights, why="serve.py --weights dummy: the server's start only") \
        if a.weights == "dummy" else Weights()
    model_dir = os.path.join(a.models_root, f"{a.shape}-seed{weights.seed}") \
        if a.weights == "checkpoint" else f"/tmp/{a.shape}-serve-dummy"
    cfg = model_config(a.shape)
    rec = harness.write_model(model_dir, cfg, weights)
    print(f"== model {model_dir}: {cfg['model_type']} {a.shape}, {cfg['num_hidden_layers']} "
          f"layers, hidden {cfg['hidden_size']}, {cfg['num_key_value_heads']} KV heads x "
          f"{cfg['head_dim']}; weights: {json.dumps(rec)}")
    env = harness.server_env(a.site)
    print("== environment: " + " ".join(f"{k}={v}" for k, v in
                                        sorted(harness.env_diff(env).items())))

    t0 = time.monotonic()
    pre = subprocess.run([a.python, "-c", PREFLIGHT], env=env, capture_output=True, text=True,
                         cwd="/tmp", timeout=300)
    if pre.returncode != 0:
        print(f"serve: the bundle does not import in {a.python}:\n{pre.stderr[-3000:]}",
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
    cmd = server_command(a.python, model_dir, a.shape, a.port, weights, a.extra)
    print("== launch: " + " ".join(cmd))
    rc = 0
    with harness.Server(cmd, env, log) as srv:
        try:
            ready = srv.wait_ready(a.port, a.ready_timeout)
            print(f"== ready after {ready:.1f} s (launch -> /health 200)")
            for line in requests(a.port, cfg["vocab_size"]):
                print(f"== {line}")
        except RuntimeError as e:
            rc = 1
            print(f"serve: FAILED: {e}; the last lines of {log}:", file=sys.stderr)
            print("\n".join(harness.log_tail(log, 40)), file=sys.stderr)
    print("== start-up lines of the server log:")
    for line in Path(log).read_text(errors="replace").splitlines():
        if STARTUP_LINES.search(line):
            print("   " + line[:240])
    print(f"== {'ok' if rc == 0 else 'failed'}; server stopped; log {log}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
