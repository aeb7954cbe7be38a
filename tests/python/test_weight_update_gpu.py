"""A weight update into a thawed engine on the GPU, two processes: the 1.1 B transformers engine
frozen with seed 0 and thawed; a trainer process builds the weights of seed 1 in the Megatron
layout and streams them through a 256 MiB VMM staging buffer exported once (``staged``), or,
into an engine thawed with an exportable region, writes them straight into its weights
(``direct``: no staging); the thawed engine then serves 16 new prompts with the same tokens and
bit-identical decode logits as a cold engine of seed 1 — its weights updated in place, its 36
graphs neither re-captured nor moved. Marker gpu; results into the GPU suite's JSON
(VITRIFY_TEST_ARTIFACTS)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from artifacts import write_artifact

pytestmark = pytest.mark.gpu

CHUNK = 256 << 20


def _cfg(seed: int) -> dict:
    from vitrify.integrations.transformers import EngineConfig

    return EngineConfig(variant="eager", seed=seed).to_dict()


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    from vitrify.integrations.transformers import run_process

    d = tmp_path_factory.mktemp("weight-update")
    archive = str(d / "engine.vitrify")
    run_process("freeze", archive, _cfg(0), {}, timeout=560)
    cold = run_process("cold", "-", _cfg(1), {}, timeout=560)
    return d, archive, cold


@pytest.fixture(scope="module", params=["staged", "direct"])
def updated(request, frozen):
    from vitrify.integrations.transformers import result_of, run_process

    mode = request.param
    d, archive, cold = frozen
    sock = str(d / f"engine-{mode}.sock")
    direct = mode == "direct"
    thaw = subprocess.Popen(
        [sys.executable, "-m", "vitrify.integrations.transformers", "thaw", archive,
         json.dumps(_cfg(0)), json.dumps({"t0": time.time(), "update_socket": sock,
                                          "exportable": direct})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        trainer = run_process("trainer", sock, _cfg(1),
                              {"direct": True} if direct else {"chunk_bytes": CHUNK},
                              timeout=560)
        out, err = thaw.communicate(timeout=560)
    finally:
        if thaw.poll() is None:
            thaw.kill()
    thawed = result_of(f"thaw with a {mode} update", out, err, thaw.returncode)
    same = sum(a == b for a, b in zip(cold["tokens"], thawed["tokens"]))
    same_logits = sum(a == b for a, b in zip(cold["logits_sha256"], thawed["logits_sha256"]))
    write_artifact(f"weight-update-{mode}", {
        "config": _cfg(0), "chunk_bytes": 0 if direct else CHUNK,
        "update": thawed["update"], "trainer": {k: v for k, v in trainer.items()
                                                if k not in ("tokens",)},
        "prompts_identical": same, "prompts": len(cold["tokens"]),
        "logit_steps_identical": same_logits, "logit_steps": len(cold["logits_sha256"])},
        ok=same == len(cold["tokens"]) and same_logits == len(cold["logits_sha256"]))
    return mode, cold, thawed, trainer


def test_the_updated_engine_serves_as_a_cold_engine_of_the_new_weights(updated):
    _, cold, thawed, _ = updated
    assert thawed["update"]["state"] == "ready"
    assert thawed["tokens"] == cold["tokens"]  # 16/16 prompts
    assert thawed["logits_sha256"] == cold["logits_sha256"]  # every decode step, bit for bit


def test_the_update_moved_nothing_and_stayed_within_its_staging(updated):
    mode, _, thawed, trainer = updated
    u = thawed["update"]
    assert u["weights_in_place"] and u["graphs_unchanged"] and u["graphs"] == 36
    assert u["bytes_moved"] == u["bytes_total"] and u["tensors"] == u["tensors_total"]
    if mode == "direct":  # no staging at all; the trainer's temporaries are small tables
        assert u["direct"] and trainer["staging_bytes"] == 0
        assert trainer["torch_bytes_during_update"] <= 64 << 20
        return
    assert trainer["staging_bytes"] == CHUNK
    # what the trainer's torch allocated while streaming (digests' temporaries), besides
    # the staging buffer: bounded by the chunk too
    assert trainer["torch_bytes_during_update"] <= CHUNK
