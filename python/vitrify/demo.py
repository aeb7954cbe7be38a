"""``vitrify demo``: run vitrify's main job on this machine, saying plainly what was skipped and why.

Each demo step declares whether it needs a GPU; on a machine without one, GPU steps are listed
as skipped with the driver's reason. Steps register themselves in :data:`STEPS`.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import vitrify


@dataclass(frozen=True)
class Step:
    name: str
    needs_gpu: bool
    run: Callable[[str], str] | None  # (scratch dir) -> one-line result; None: not built yet
    missing: str = ""  # why run is None


def _doctor(_: str) -> str:
    from . import doctor

    print(doctor.render(doctor.collect(".")))
    return "reported"


def _freeze_thaw(scratch: str) -> str:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise RuntimeError("the freeze side needs torch (pip install torch); vitrify does not")
    from .integrations import demo

    r = demo.run_demo(scratch)
    fz, th = r["freeze"], r["thaw"]
    return (f"{th['tokens_compared']} tokens identical; thaw {th['process_wall_s']:.1f} s "
            f"vs freeze {fz['process_wall_s']:.1f} s (whole processes)")


STEPS: list[Step] = [
    Step("doctor", False, _doctor),
    Step("freeze -> thaw of a CUDA-graph engine", True, _freeze_thaw),
]


def main(out=sys.stdout) -> int:
    gpu = vitrify.cuda_available()
    reason = "" if gpu else vitrify.cuda_unavailable_reason()
    failed = 0
    with tempfile.TemporaryDirectory(prefix="vitrify-demo-") as scratch:
        for s in STEPS:
            if s.needs_gpu and not gpu:
                print(f"[skipped] {s.name}: no GPU here ({reason})", file=out)
                continue
            if s.run is None:
                print(f"[skipped] {s.name}: {s.missing}", file=out)
                continue
            print(f"[run]     {s.name}", file=out)
            try:
                print(f"[ok]      {s.name}: {s.run(scratch)}", file=out)
            except Exception as e:
                failed += 1
                print(f"[failed]  {s.name}: {type(e).__name__}: {e}", file=out)
    return 1 if failed else 0
