"""Fold JUnit XML files (ctest, pytest), benchmark result JSONs and `vitrify doctor --json` into
the GPU suite's one summary JSON (benchmarks/README.md describes the convention)."""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# The result-file convention, loaded from this tree by path: the summary is still written when
# the package failed to build or install (resultlib imports vitrify only to describe the machine).
_RESULTLIB = Path(__file__).resolve().parents[1] / "python" / "vitrify" / "bench" / "resultlib.py"
_spec = importlib.util.spec_from_file_location("vitrify_suite_resultlib", _RESULTLIB)
resultlib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(resultlib)


def junit_outcomes(path: str, prefix: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        out[f"{prefix}::<junit>"] = f"error: {e}"
        return out
    for case in root.iter("testcase"):
        cls = case.get("classname") or ""
        name = case.get("name") or "?"
        tid = f"{prefix}::{cls}::{name}" if cls and cls != name else f"{prefix}::{name}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        if case.get("status") in ("notrun", "disabled"):
            outcome = "skipped"
        out[tid] = outcome
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--junit", nargs="*", default=[], help="PREFIX=PATH pairs")
    ap.add_argument("--bench-dir", default=None)
    ap.add_argument("--doctor", default=None)
    ap.add_argument("--steps", default=None, help="JSON file of build/run step results")
    args = ap.parse_args()

    outcomes: dict[str, str] = {}
    for spec in args.junit:
        prefix, _, path = spec.partition("=")
        if Path(path).exists():
            outcomes.update(junit_outcomes(path, prefix))
        else:
            outcomes[f"{prefix}::<missing junit>"] = "failed"
    counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "skipped")}
    benches = {}
    if args.bench_dir:
        for p in sorted(glob.glob(str(Path(args.bench_dir) / "*.json"))):
            try:
                b = json.loads(Path(p).read_text())
                benches[b.get("name", Path(p).stem)] = b
            except (OSError, json.JSONDecodeError) as e:
                benches[Path(p).stem] = {"error": str(e)}
    doctor = None
    if args.doctor and Path(args.doctor).exists():
        try:
            doctor = json.loads(Path(args.doctor).read_text())
        except json.JSONDecodeError as e:
            doctor = {"error": str(e)}
    steps = json.loads(Path(args.steps).read_text()) if args.steps and Path(args.steps).exists() else {}
    failed_steps = [k for k, v in steps.items() if v != 0]
    res = resultlib.result("gpu-suite", tests={**counts, "outcomes": outcomes},
                           ok=not counts["failed"] and not failed_steps,
                           benchmarks=benches, doctor=doctor, steps=steps)
    path = resultlib.write(res, args.out)
    print(f"summary: {path}: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped; {len(benches)} benchmark(s)")
    return 1 if counts["failed"] or failed_steps else 0


if __name__ == "__main__":
    sys.exit(main())
