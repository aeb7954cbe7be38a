"""The relocation issue's end-to-end proof (marker gpu): a Llama-3-8B-shaped transformers decoder
(hidden 4096, 8 KV heads x 128, 32 layers, bf16, random weights) with a decode-graph ladder that
contains batch sizes 6 and 24 (6 x 4096 = 24 x 1024 = 0x6000, the upper half of the region base),
frozen at 0x600000000000 and thawed in fresh processes at the same base, 64 GiB above it and
1 TiB below it: every token and every logit bit-identical (tests/python/decoder_worker.py).

Writes decoder-relocation.json (freeze summary with each graph's relocation audit, every thaw)
into VITRIFY_TEST_ARTIFACTS when that is set (scripts/gpu-suite.sh sets it)."""

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

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("decoder_worker.py")
BASE = 0x600000000000
STEPS = 8
SHIFTS = {"same base": 0, "+64 GiB": 64 << 30, "-1 TiB": -(1 << 40)}


def run(*args: str, timeout: int = 600) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True,
                       timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"{args[0]} printed no result (rc {p.returncode}):\n{p.stderr[-5000:]}"
    r = json.loads(lines[-1])
    assert r["ok"], f"{args[0]} failed: {r['error']}\n{r.get('traceback', '')}\n{p.stderr[-3000:]}"
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


def test_llama_8b_shape_thaws_relocated_with_identical_tokens_and_logits(scratch):
    archive = str(scratch / "decoder.vitrify")
    frozen = run("freeze", archive, json.dumps({"steps": STEPS}))
    assert frozen["base"] == BASE
    not_movable = [g["name"] for g in frozen["graphs"] if not g["relocatable"]]
    thaws = {}
    for label, shift in SHIFTS.items():
        thaws[label] = run("thaw", archive, hex(BASE + shift))
    audit = subprocess.run([sys.executable, "-m", "vitrify", "inspect", "--relocations", archive],
                           capture_output=True, text=True, timeout=300)
    result = {"freeze": frozen, "thaw": thaws, "audit": audit.stdout,
              "non_relocatable": not_movable}
    art = os.environ.get("VITRIFY_TEST_ARTIFACTS")
    if art:
        Path(art).mkdir(parents=True, exist_ok=True)
        (Path(art) / "decoder-relocation.json").write_text(json.dumps(result, indent=1))
    assert audit.returncode == 0, audit.stderr
    assert not not_movable, f"graphs FREEZE could not make relocatable: {not_movable}\n{audit.stdout}"
    ladder = [int(g["name"].removeprefix("decode_bs")) for g in frozen["graphs"]]
    assert 6 in ladder and 24 in ladder
    for label, t in thaws.items():
        assert t["identical"], (f"thaw at {label}: batch sizes {t['batch_sizes_wrong']} differ "
                                f"from FREEZE: {t['mismatches']}")
        assert t["logit_steps_compared"] == len(ladder) * STEPS
        assert t["tokens_compared"] == sum(ladder) * STEPS
