"""A ~1.1 B-parameter transformers engine (Llama shape, bf16, static KV cache, 36 decode graphs
for batch sizes 1..256) frozen through vitrify.session and thawed in fresh processes with torch:
16 new prompts (prefill eager, decode through the thawed graphs) give the same tokens as a cold
engine, 16/16, and every decode step's logits are bit-identical to the frozen process's — at the
frozen base, relocated (the frozen range taken), with warmup re-run; eager and torch.compile'd.
Marker gpu; the results go into the GPU suite's JSON (VITRIFY_TEST_ARTIFACTS)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from artifacts import write_artifact

pytestmark = pytest.mark.gpu

PROMPTS, STEPS = 16, 32


def config(variant: str) -> dict:
    from vitrify.integrations.transformers import EngineConfig

    return EngineConfig(variant=variant).to_dict()


def run(mode: str, archive: Path, variant: str, timeout: int = 560, **opts) -> dict:
    opts["t0"] = time.time()
    p = subprocess.run([sys.executable, "-m", "vitrify.integrations.transformers", mode,
                        str(archive), json.dumps(config(variant)), json.dumps(opts)],
                       capture_output=True, text=True, timeout=timeout)
    from vitrify.integrations.transformers import result_of

    return result_of(mode, p.stdout, p.stderr, p.returncode)


def _summary(r: dict) -> dict:
    s = r["session"]
    return {k: r.get(k) for k in ("ready_s", "first_token_s", "serve_s", "process_s",
                                  "batch_size")} | {
        "timings": s.get("timings"), "base": s.get("base"), "relocated": s.get("relocated"),
        "warmup": s.get("warmup"), "graphs": s.get("graphs"),
        "graph_stats": s.get("graph_stats"), "checkpoints": s.get("checkpoints"),
        "background": s.get("background"), "rebuild_alone": r.get("rebuild_alone")}


def _compare(ref: dict, got: dict) -> dict:
    same_tokens = sum(a == b for a, b in zip(ref["tokens"], got["tokens"]))
    same_logits = sum(a == b for a, b in zip(ref["logits_sha256"], got["logits_sha256"]))
    return {"prompts_identical": same_tokens, "prompts": len(ref["tokens"]),
            "logit_steps_identical": same_logits, "logit_steps": len(ref["logits_sha256"])}


@pytest.fixture(scope="module", params=["eager", "compiled"])
def engine_runs(request, tmp_path_factory):
    variant = request.param
    d = tmp_path_factory.mktemp(f"engine-{variant}")
    archive = d / "engine.vitrify"
    runs = {"freeze": run("freeze", archive, variant)}
    runs["thaw"] = run("thaw", archive, variant, rebuild_again=[8, 1, 2, 4, 16])
    runs["thaw_relocated"] = run("thaw", archive, variant, occupy=True)
    runs["thaw_warmup_rerun"] = run("thaw", archive, variant, warmup_restore=False)
    if variant == "eager":  # the compiled cold start is `vitrify bench coldstart`'s
        runs["cold"] = run("cold", Path("-"), variant)
    ref = runs["freeze"]
    comparison = {k: _compare(ref, v) for k, v in runs.items() if k != "freeze"}
    write_artifact(f"transformers-engine-{variant}", {
        "config": config(variant), "prompts": PROMPTS, "steps": STEPS,
        "runs": {k: _summary(v) for k, v in runs.items()}, "comparison": comparison},
        ok=all(c["prompts_identical"] == PROMPTS and c["logit_steps_identical"] == STEPS
               for c in comparison.values()))
    return variant, runs


def test_thawed_engine_serves_new_prompts_identically(engine_runs):
    variant, runs = engine_runs
    ref = runs["freeze"]
    assert len(ref["tokens"]) == PROMPTS and ref["batch_size"] == 16
    assert ref["session"]["graphs"] >= 32
    for name, r in runs.items():
        if name == "freeze":
            continue
        c = _compare(ref, r)
        assert c["prompts_identical"] == PROMPTS, (name, c)
        assert c["logit_steps_identical"] == STEPS, (name, c)


def test_thaw_walks_the_frozen_checkpoints(engine_runs):
    _, runs = engine_runs
    frozen = runs["freeze"]["session"]["checkpoints"]
    for name in ("thaw", "thaw_relocated", "thaw_warmup_rerun"):
        assert runs[name]["session"]["checkpoints"] == frozen, name


def test_relocated_and_warmup_rerun_thaws_did_what_they_say(engine_runs):
    variant, runs = engine_runs
    assert runs["thaw"]["session"]["relocated"] is False
    assert runs["thaw"]["session"]["warmup"] == "restore"
    alone = runs["thaw"]["rebuild_alone"]  # the ladder rebuilt once more, alone
    assert alone["stats"]["ready_graphs"] == runs["freeze"]["session"]["graphs"]
    rel = runs["thaw_relocated"]["session"]
    assert rel["relocated"] is True and rel["base"] != rel["frozen_base"]
    assert runs["thaw_warmup_rerun"]["session"]["warmup"] == "rerun-warmup"
