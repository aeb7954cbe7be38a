"""The weights run's pieces that need no GPU (``vitrify.bench.sglang.weights_e2e``,
``benchmarks/sglang_weights_e2e.py``): W1 (the checkpoint writer's tensors) in the trainer's
Megatron layout planned onto SGLang's fused Qwen3 parameters, the payload's serialization, the
servers' settings (deterministic inference on every launch by default)."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_weight_mapping import fused_engine  # noqa: E402

from vitrify.bench.sglang import checkpoint, harness, models  # noqa: E402
from vitrify.bench.sglang import weights_e2e as we  # noqa: E402

CFG = {**models.model_config("tiny"), "hidden_size": 64, "head_dim": 8, "num_hidden_layers": 2,
       "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 96,
       "vocab_size": 100}


def test_the_trainer_layout_plans_onto_sglangs_qwen3_names_bit_for_bit():
    from vitrify.integrations.sglang import weights as sw
    from vitrify.weights import mapping as wm

    w = {n: t.float() for n, t in checkpoint.tensors(CFG, seed=1, device="cpu").items()}
    src = we.trainer_tensors(w, CFG)
    engine = fused_engine(w, 2)  # q_norm / k_norm keep their names in SGLang's Qwen3
    assert "model.layers.1.self_attn.q_norm.weight" in engine

    class Model:
        config = type("C", (), {"num_attention_heads": 8, "num_key_value_heads": 2,
                                "head_dim": 8})()

        def named_parameters(self):
            return iter(engine.items())

    m = sw.mapping_for(Model())
    specs = lambda ts: {n: (tuple(t.shape), str(t.dtype)[6:]) for n, t in ts.items()}  # noqa
    plan = m.plan(specs(src), specs(engine))
    dst = {n: torch.zeros_like(t) for n, t in engine.items()}
    for name, t in src.items():
        for c in plan.for_source(name):
            wm.copy(c, t, dst[c.dst])
    assert all(torch.equal(dst[n], engine[n]) for n in engine)


def test_the_payload_serializes_without_tensors():
    from vitrify.integrations.sglang import weights as sw

    nt = sw.payload("/tmp/x.sock", weight_version="w1")
    back = pickle.loads(base64.b64decode(harness.serialize(nt)))
    assert back == nt and back[0][1] is None and '"weight_version":"w1"' in back[0][0]


def test_the_thawed_server_is_the_freeze_scripts_load_with_weight_updates(tmp_path):
    import argparse

    a = argparse.Namespace(shape="tiny", bundle="b.tar.xz", out=str(tmp_path / "out"),
                           work=str(tmp_path / "work"), port=30099, prompts=4,
                           deterministic=True, models_root=str(tmp_path / "models"))
    s = we.settings(a)
    assert s.port == 30099 and s.scenarios == we.fe.CORE and s.work == str(tmp_path / "work")
    assert s.deterministic and we.parse_args([]).deterministic
    assert not we.parse_args(["--no-deterministic"]).deterministic
    (tmp_path / "work").mkdir()
    env = we.fe.server_env(s, "load", probe=False)
    toml = Path(env["VITRIFY_SGLANG_CONFIG"]).read_text()
    assert 'mode = "load"' in toml and toml.rstrip().endswith("weight_updates = true")
    from vitrify.integrations.sglang import config

    os.makedirs(s.archive)  # SAVE's, in the run
    parsed = config.from_mapping(config._toml_module().loads(toml))
    assert parsed.mode == "load" and parsed.weight_updates
    assert "weight_updates" not in Path(we.fe.plugin_config(s, "save")).read_text()
    # the reference server: the same arguments, W1's checkpoint (seed 1) instead of W0's
    plain, w1 = we.fe.server_args(s, "plain"), we.fe.server_args(we.w1_settings(s), "plain")
    assert w1[w1.index("--model-path") + 1] == str(tmp_path / "models" / "tiny-seed1")
    assert plain[plain.index("--model-path") + 1] == str(tmp_path / "models" / "tiny-seed0")
    assert w1[w1.index("--load-format") + 1] == "auto" and harness.is_deterministic(w1)
    diff = [(x, y) for x, y in zip(plain, w1) if x != y]
    assert len(plain) == len(w1) and len(diff) == 1
