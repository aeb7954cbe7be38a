"""benchmarks/weights_protocol_cpu.py runs on a CPU: two processes, a first direct update that
plans and a second that reuses the plan (its figures are the script's output, not checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "weights_protocol_cpu.py"


def test_the_protocol_script_plans_once_then_reuses():
    p = subprocess.run([sys.executable, str(SCRIPT), "--updates", "2"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("update ")]
    assert len(lines) == 2, p.stdout
    assert "1083 pieces, reused False" in lines[0] and "1083 pieces, reused True" in lines[1]
