"""The relocation issue's end-to-end proof (marker gpu): a Llama-3-8B-shaped transformers decoder
(hidden 4096, 8 KV heads x 128, 32 layers, bf16, random weights) with a decode-graph ladder that
contains batch sizes 6 and 24 (6 x 4096 = 24 x 1024 = 0x6000), thawed in fresh processes at the
frozen base, 64 GiB above it and 1 TiB below it (tests/python/decoder_worker.py).

- Frozen at the Region's default base (0x600180000000): every graph relocatable, every token and
  every logit bit-identical at every base.
- Frozen at the issue's base 0x600000000000 (upper half 0x6000, and the window starts at the
  first allocation, where region R13 sets no guard): every graph thawed gives identical tokens
  and logits; a graph FREEZE could not prove is refused at another base, never run.

Writes decoder-relocation-<case>.json (freeze summary with each graph's relocation audit, the
`vitrify inspect --relocations` table, every thaw) into VITRIFY_TEST_ARTIFACTS when that is set
(scripts/gpu-suite.sh sets it)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from artifacts import write_artifact

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("decoder_worker.py")
BASES = {"default_base": None, "aligned_base": 0x600000000000}
DEFAULT_BASE = 0x600180000000  # region.hpp kSearchFirst
STEPS = 8
SHIFTS = {"same base": 0, "+64 GiB": 64 << 30, "-1 TiB": -(1 << 40)}


def run(*args: str, timeout: int = 600) -> dict:
    """The worker's JSON result; on failure ``ok`` is False and ``error`` says why."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True,
                       timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    r = json.loads(lines[-1]) if lines else {
        "ok": False, "error": f"printed no result (rc {p.returncode})"}
    if not r["ok"]:
        r["stderr_tail"] = p.stderr[-3000:]
    r["process_wall_s"] = time.perf_counter() - t0
    return r


@pytest.fixture(scope="module")
def scratch():
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("the FREEZE side needs torch and transformers")
    # The archive holds 16 GB of weights: /dev/shm (host memory) when it has room, so the test
    # measures relocation, not the drive.
    parent = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > (40 << 30) \
        else tempfile.gettempdir()
    d = tempfile.mkdtemp(prefix="vitrify-decoder-", dir=parent)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("case", list(BASES))
def test_llama_8b_shape_thaws_relocated_with_identical_tokens_and_logits(scratch, case):
    archive = str(scratch / f"decoder-{case}.vitrify")
    frozen = run("freeze", archive, json.dumps({"steps": STEPS, "base": BASES[case]}))
    assert frozen["ok"], f"freeze failed: {frozen['error']}\n{frozen.get('traceback', '')}" \
        f"\n{frozen.get('stderr_tail', '')}"
    base = frozen["base"]
    if BASES[case] is not None:
        assert base == BASES[case]
    not_movable = [g["name"] for g in frozen["graphs"] if not g["relocatable"]]
    thaws = {label: run("thaw", archive, hex(base + shift)) for label, shift in SHIFTS.items()}
    audit = subprocess.run([sys.executable, "-m", "vitrify", "inspect", "--relocations", archive],
                           capture_output=True, text=True, timeout=300)
    result = {"case": case, "freeze": frozen, "thaw": thaws, "audit": audit.stdout,
              "non_relocatable": not_movable}
    write_artifact(f"decoder-relocation-{case}", result,
                   ok=audit.returncode == 0 and all(t.get("ok") and t.get("identical")
                                                   for t in thaws.values()))
    shutil.rmtree(archive, ignore_errors=True)  # 16 GB: the next case needs the room
    assert audit.returncode == 0, audit.stderr
    if BASES[case] is None:
        assert base == DEFAULT_BASE
        assert not not_movable, f"graphs FREEZE could not make relocatable: {not_movable}\n{audit.stdout}"
    ladder = [int(g["name"].removeprefix("decode_bs")) for g in frozen["graphs"]]
    assert 6 in ladder and 24 in ladder
    for label, t in thaws.items():
        assert t["ok"], f"thaw at {label} failed: {t['error']}\n{t.get('traceback', '')}"
        refused = sorted(t["refused"])
        assert refused == ([] if SHIFTS[label] == 0 else sorted(not_movable)), (label, refused)
        assert t["identical"], (f"thaw at {label}: batch sizes {t['batch_sizes_wrong']} differ "
                                f"from FREEZE: {t['mismatches']}")
        run_bs = [b for b in ladder if f"decode_bs{b}" not in t["refused"]]
        assert t["logit_steps_compared"] == len(run_bs) * STEPS
        assert t["tokens_compared"] == sum(run_bs) * STEPS
