"""Where a THAW's time goes, function by function (GPU): freeze the transformers engine once, then
thaw it in a fresh process under cProfile and write the main thread's profile.

    python benchmarks/profile_thaw.py OUTDIR [--variant eager|compiled] [--small]

Writes OUTDIR/thaw-profile-<variant>.txt (the top functions by cumulative and by own time) and
OUTDIR/thaw-profile-<variant>.json (the thaw's own result line: timings, tokens). The profile is
of the main thread only: the background graph loader shows up where the main thread waits for it.
"""

from __future__ import annotations

import argparse
import io
import json
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--variant", choices=("eager", "compiled"), default="eager")
    ap.add_argument("--small", action="store_true", help="the demo's small engine shape")
    a = ap.parse_args()
    from vitrify.bench.coldstart import config
    from vitrify.integrations.transformers import run_process

    cfg = config(a.variant, a.small)
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vitrify-profile-") as d:
        archive = str(Path(d) / "engine.vitrify")
        frozen = run_process("freeze", archive, cfg)
        if not frozen.get("ok"):
            print(f"freeze failed: {frozen.get('error')}", file=sys.stderr)
            return 1
        prof = Path(d) / "thaw.prof"
        opts = {"t0": time.time()}
        p = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m",
                            "vitrify.integrations.transformers", "thaw", archive,
                            json.dumps(cfg), json.dumps(opts)],
                           capture_output=True, text=True, timeout=600)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines or not prof.exists():
            print(f"thaw failed (rc {p.returncode}):\n{p.stderr[-3000:]}", file=sys.stderr)
            return 1
        result = json.loads(lines[-1])
        for key in ("tokens", "logits_sha256"):
            result.pop(key, None)
        buf = io.StringIO()
        stats = pstats.Stats(str(prof), stream=buf)
        stats.sort_stats("cumulative").print_stats(70)
        stats.sort_stats("tottime").print_stats(40)
    (a.out / f"thaw-profile-{a.variant}.txt").write_text(buf.getvalue())
    (a.out / f"thaw-profile-{a.variant}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in ("ready_s", "first_token_s", "process_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
