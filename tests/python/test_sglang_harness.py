"""The SGLang end-to-end harness (python/vitrify/bench/sglang/) without a GPU: the checkpoint
writer against what transformers builds for each config, its values, files and reuse; the server
command lines through SGLang's own parser; the comparisons and the deterministic-inference rule;
the oracle's power (pairs, planted faults: a real vitrify HiCache backend reads another page's
bytes after the swap); the process-group stop; the entry scripts' dry runs and their check of
which vitrify is installed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vitrify.bench.sglang import checkpoint, harness, models, oracle  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# a small config of each family (the real shapes are checked for names and shapes only)
SMALL = {
    "qwen3": {**models.model_config("tiny"), "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "max_window_layers": 2},
    "llama": {**models.model_config("llama-1b"), "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16},
    "qwen3_moe": {**models.model_config("moe"), "vocab_size": 512, "hidden_size": 64,
                  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "max_window_layers": 2,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}


def _fused_experts(shapes: dict) -> dict:
    """The Hub's per-expert matrices folded the way transformers 5 holds an MoE block in memory
    (``experts.gate_up_proj`` of (experts, 2 x width, hidden), ``experts.down_proj`` of
    (experts, hidden, width)); every other name as it is."""
    import re

    out, experts = {}, {}
    for name, shape in shapes.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m is None:
            out[name] = shape
        else:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), []).append(shape)
    for prefix, kinds in experts.items():
        (width, hidden), n = kinds["gate_proj"][0], len(kinds["gate_proj"])
        assert all(len(v) == n and set(v) == {v[0]} for v in kinds.values())
        assert kinds["up_proj"][0] == (width, hidden) and kinds["down_proj"][0] == (hidden, width)
        out[prefix + ".gate_up_proj"] = (n, 2 * width, hidden)
        out[prefix + ".down_proj"] = (n, hidden, width)
    return out


def _hf_shapes(cfg: dict) -> dict:
    """Parameter names and shapes of transformers' model of ``cfg`` (built on the meta device),
    without the tied LM head (a HF checkpoint leaves it out)."""
    transformers = pytest.importorskip("transformers")
    c = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                             if k not in ("architectures",)})
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(c)
    sd = m.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight")
    return {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.parametrize("shape", sorted(models.SHAPES))
def test_checkpoint_names_and_shapes_are_what_transformers_builds(shape):
    cfg = models.model_config(shape)
    assert _fused_experts(models.parameter_shapes(cfg)) == _hf_shapes(cfg)


def test_the_moe_shape_is_qwen3_30b_a3bs_layer_and_sglang_loads_every_expert():
    """Qwen3-30B-A3B's layer (128 experts of 768, top 8, 4 KV heads of 128), 6 layers, each an
    MoE block with its router; every expert matrix a name SGLang's Qwen3-MoE loader maps onto
    its fused experts (FusedMoE.make_expert_params_mapping, as qwen3_moe.load_weights calls it),
    none left over."""
    cfg = models.model_config("moe")
    shapes = models.parameter_shapes(cfg)
    n = sum(torch.Size(v).numel() for v in shapes.values())
    assert n == 4_361_055_744 and models.kv_bytes_per_token(cfg) == 2 * 6 * 4 * 128 * 2
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == \
        (128, 8, 768)
    for i in range(cfg["num_hidden_layers"]):
        assert shapes[f"model.layers.{i}.mlp.gate.weight"] == (128, 2048)
        assert f"model.layers.{i}.mlp.gate_proj.weight" not in shapes  # no dense MLP
    fused = pytest.importorskip("sglang.srt.layers.moe.fused_moe_triton.layer").FusedMoE
    mapping = fused.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj",
                                               ckpt_down_proj_name="down_proj",
                                               ckpt_up_proj_name="up_proj",
                                               num_experts=cfg["num_experts"])
    experts = [k for k in shapes if ".mlp.experts." in k]
    assert len(experts) == 6 * 128 * 3
    for name in experts:
        hits = [m for m in mapping if m[1] in name]
        assert len(hits) == 1, name
    assert not models.moe_layer({**cfg, "mlp_only_layers": [2]}, 2)
    assert models.moe_layer(cfg, 5) and not models.moe_layer({**cfg, "decoder_sparse_step": 2}, 0)


def test_the_llama_shape_is_llama_3_2_1b():
    cfg = models.model_config("llama-1b")
    n = sum(torch.Size(s).numel() for s in models.parameter_shapes(cfg).values())
    assert n == 1_235_814_400 and "lm_head.weight" not in models.parameter_shapes(cfg)
    assert models.kv_bytes_per_token(cfg) == 32768
    assert models.page_tokens_for(cfg, 2 << 20) == 64
    with pytest.raises(ValueError, match="unknown shape 'huge'"):
        models.model_config("huge")
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        models.family({"model_type": "gpt2"})


@pytest.mark.parametrize("family", sorted(SMALL))
def test_checkpoint_values_norms_and_file(tmp_path, family):
    """N(0, 0.02) by its moments (a normal's kurtosis, not the uniform's 1.8), norms exactly one,
    every tensor in the file with its HF name, shape and bf16."""
    from safetensors.torch import load_file

    cfg = SMALL[family]
    man = checkpoint.write(str(tmp_path), cfg, seed=3, device="cpu")
    assert man["reused"] is False and list(man["files"]) == ["model.safetensors"]
    got = load_file(str(tmp_path / "model.safetensors"))
    shapes = models.parameter_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in got.items()} == shapes
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    mats = torch.cat([v.float().reshape(-1) for k, v in got.items() if not models.is_norm(k)])
    assert abs(mats.mean().item()) < 1e-3
    assert mats.std().item() == pytest.approx(0.02, rel=0.02)
    kurt = ((mats - mats.mean()) ** 4).mean() / mats.var() ** 2
    assert 2.85 < kurt.item() < 3.15
    norms = [v for k, v in got.items() if models.is_norm(k)]
    assert norms and all(bool((v == 1).all()) for v in norms)
    assert man["bytes"] == sum(v.numel() * 2 for v in got.values())


def test_checkpoint_is_a_function_of_its_seed_and_each_tensor_can_be_drawn_alone(tmp_path):
    from safetensors.torch import load_file

    cfg = SMALL["qwen3"]
    checkpoint.write(str(tmp_path / "a"), cfg, seed=5, device="cpu")
    checkpoint.write(str(tmp_path / "b"), cfg, seed=5, device="cpu")
    checkpoint.write(str(tmp_path / "c"), cfg, seed=6, device="cpu")
    a, b, c = (tmp_path / d / "model.safetensors" for d in "abc")
    assert a.read_bytes() == b.read_bytes() and a.read_bytes() != c.read_bytes()
    got = load_file(str(a))
    name = "model.layers.1.mlp.down_proj.weight"
    alone = checkpoint.make_tensor(name, got[name].shape, 5, "cpu")
    assert torch.equal(alone, got[name])
    assert torch.equal(checkpoint.tensors(cfg, seed=5, device="cpu")[name], got[name])
    assert not torch.equal(got[name], got["model.layers.0.mlp.down_proj.weight"])


def test_the_stdlib_writer_writes_what_safetensors_reads(tmp_path):
    from safetensors.torch import load_file

    named = {"b.weight": torch.randn(3, 5).to(torch.bfloat16), "a": torch.arange(7),
             "z": torch.ones(4, dtype=torch.float32), "empty": torch.zeros(0, 3)}
    assert checkpoint.write_safetensors(str(tmp_path / "s.safetensors"), named,
                                        {"format": "pt"}, writer="stdlib") == "stdlib"
    back = load_file(str(tmp_path / "s.safetensors"))
    assert set(back) == set(named) and all(torch.equal(back[k], named[k]) for k in named)
    head = checkpoint.read_header(str(tmp_path / "s.safetensors"))
    assert head["__metadata__"] == {"format": "pt"}
    assert head["b.weight"] == {"dtype": "BF16", "shape": [3, 5], "data_offsets": [0, 30]}
    n = int.from_bytes((tmp_path / "s.safetensors").read_bytes()[:8], "little")
    assert n % 8 == 0
    # the package's file, read by the stdlib parser
    assert checkpoint.write_safetensors(str(tmp_path / "p.safetensors"), named, {"format": "pt"}
                                        ).startswith("safetensors ")
    assert checkpoint.read_header(str(tmp_path / "p.safetensors"))["a"]["dtype"] == "I64"
    with pytest.raises(ValueError, match="writer must be 'auto', 'package' or 'stdlib'"):
        checkpoint.write_safetensors(str(tmp_path / "x"), named, writer="rust")
    (tmp_path / "bad").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ValueError, match="runs past the file"):
        checkpoint.read_header(str(tmp_path / "bad"))


def test_a_large_model_is_sharded_with_an_index_and_reused_or_rewritten(tmp_path):
    from safetensors.torch import load_file

    cfg = SMALL["qwen3"]
    d = str(tmp_path)
    man = checkpoint.write(d, cfg, seed=1, device="cpu", shard_bytes=40_000, writer="stdlib")
    files = sorted(man["files"])
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / checkpoint.INDEX).read_text())
    assert set(index["weight_map"]) == set(models.parameter_shapes(cfg))
    assert index["metadata"]["total_size"] == man["bytes"]
    loaded = {}
    for f in files:
        part = load_file(str(tmp_path / f))
        assert all(index["weight_map"][k] == f for k in part)
        loaded.update(part)
    assert set(loaded) == set(models.parameter_shapes(cfg))
    assert checkpoint.write(d, cfg, seed=1, device="cpu", shard_bytes=40_000)["reused"] is True
    # another seed, one file: the shards and the index go
    man2 = checkpoint.write(d, cfg, seed=2, device="cpu")
    assert man2["reused"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors",
                                                          checkpoint.MANIFEST]
    # a damaged file is written again
    with open(tmp_path / "model.safetensors", "ab") as f:
        f.write(b"x")
    assert checkpoint.write(d, cfg, seed=2, device="cpu")["reused"] is False


def test_write_model_says_what_the_weights_are(tmp_path):
    cfg = SMALL["llama"]
    rec = harness.write_model(str(tmp_path), cfg, harness.Weights(seed=4), device="cpu")
    assert rec["kind"] == "checkpoint" and rec["seed"] == 4 and rec["load_format"] == "auto"
    assert rec["norms"] == "ones" and rec["std"] == 0.02 and rec["reused"] is False
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    with pytest.raises(ValueError, match="dummy weights need a reason"):
        harness.Weights(kind="dummy")
    with pytest.raises(ValueError, match="weights must be 'checkpoint' or 'dummy'"):
        harness.Weights(kind="random")
    dummy = harness.write_model(str(tmp_path), cfg, harness.Weights("dummy", why="a test"))
    assert dummy == {"kind": "dummy", "model_dir": str(tmp_path), "load_format": "dummy",
                     "why": "a test"}
    assert not list(tmp_path.glob("*.safetensors"))  # SGLang must not load a checkpoint


def _parse(cmd):
    import argparse

    from sglang.srt.server_args import ServerArgs

    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p.parse_args(cmd[3:])


@pytest.mark.sglang
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_server_command_through_sglangs_parser(deterministic):
    cmd = harness.server_command("py", "/m", 30100, weights=harness.Weights(),
                                 deterministic=deterministic, extra=["--page-size", "16"])
    a = _parse(cmd)
    assert a.enable_deterministic_inference is deterministic
    assert harness.is_deterministic(cmd) is deterministic
    assert a.load_format == "auto" and a.model_path == "/m" and a.port == 30100
    assert a.skip_tokenizer_init and a.attention_backend == "triton" and a.page_size == 16
    dummy = harness.server_command("py", "/m", 1, weights=harness.Weights("dummy", why="t"),
                                   deterministic=False)
    assert _parse(dummy).load_format == "dummy"


def _res(ids, lp=None, storage=0, plen=200):
    return {"output_ids": ids, "logprobs": lp if lp is not None else [-1.0] * len(ids),
            "cached_tokens": storage, "details": {"storage": storage} if storage else {},
            "prompt_tokens": plen, "ttft_s": 0.01, "latency_s": 0.02}


def test_a_comparison_across_cache_paths_is_a_check_only_when_both_launches_are_deterministic():
    a = [_res([1, 2], [-0.5, -0.25])]
    b = [_res([1, 2], [-0.5, -0.125])]
    c = harness.compare("x.l3_vs_miss", a, b, launches=("x", "x"), deterministic=(True, True),
                        crosses=True)
    assert c["is_check"] and c["identical"] is False and c["logprob_max_abs_diff"] == 0.125
    assert harness.compare("x.t", a, b, launches=("x", "x"), deterministic=(True, True),
                           crosses=True, logprobs=False)["identical"] is True
    off = harness.compare("x.c", a, a, launches=("x", "y"), deterministic=(True, False),
                          crosses=True)
    assert off["identical"] and not off["is_check"] and "deterministic" in off["why_not_a_check"]
    within = harness.compare("x.w", a, a, launches=("load", "save"),
                             deterministic=(False, False), crosses=False)
    assert within["is_check"]
    assert harness.fold([c, off, within], {}) == {"x.l3_vs_miss": False, "x.w": True}
    # nothing to compare proves nothing
    assert harness.logprob_diff([], []) is None and harness.logprob_diff(a, a + a) is None
    assert not harness.tokens_identical([_res([])], [_res([])])


def test_the_last_token_pair():
    a, b = oracle.last_token_pair(7, 300)
    assert len(a) == len(b) == 300 and a[-1] == b[-1]
    assert all(x != y for x, y in zip(a[:-1], b[:-1]))
    assert all(3 <= t < 32000 for t in a + b)
    assert oracle.last_token_pair(7, 300) == (a, b) and oracle.last_token_pair(8, 300) != (a, b)
    with pytest.raises(ValueError, match="length >= 2"):
        oracle.last_token_pair(1, 1)


def test_oracle_power_a_blind_pair_or_an_uncaught_fault_fails_the_run():
    same = oracle.pair_power(_res([5, 6], [-1.0, -2.0]), _res([5, 6], [-1.0, -2.0]), "plain")
    assert same["distinct"] is False and "do not depend on the context" in same["why"]
    differ = oracle.pair_power(_res([5, 6], [-1.0, -2.0]), _res([5, 6], [-1.0, -2.5]), "plain")
    assert differ["distinct"] is True and differ["tokens_differ"] is False
    assert oracle.pair_power(_res([5], [-1.0]), _res([7], [-1.0]))["distinct"] is True
    none = oracle.pair_power(_res([5], []), _res([5], []))
    assert none["distinct"] is None
    caught = {"fault": "f", "caught": True}
    assert oracle.power([differ], caught)["ok"] is True
    blind = oracle.power([differ, same], caught)
    assert blind["ok"] is False and any("plain" in w for w in blind["why"])
    assert oracle.power([differ], {"fault": "f", "caught": False})["ok"] is False
    assert oracle.power([differ], {"fault": "f", "caught": None, "why": "x"})["ok"] is False
    assert oracle.power([differ], None)["ok"] is False
    assert oracle.power([none], caught)["ok"] is False
    assert oracle.power([], caught)["ok"] is False
    # the result's verdict: the run's and the oracle's
    res = harness.result("t-run", ok=True, oracle_power=oracle.power([same], caught))
    assert res["ok"] is False and res["oracle_power"]["ok"] is False
    for k in ("date", "git_sha", "goals", "goal_direction", "ratios"):
        assert k in res
    assert harness.result("t-run", ok=True, oracle_power=oracle.power([differ], caught))["ok"]
    assert not harness.result("t-run", ok=False, oracle_power=oracle.power([differ], caught))["ok"]


def test_the_result_is_written_once_and_the_partial_record_goes(tmp_path):
    harness.write_partial(str(tmp_path), "t-run", {"scenarios": {"plain": {"ok": True}}})
    assert json.loads(Path(harness.partial_path(str(tmp_path), "t-run")).read_text())
    res = harness.result("t-run", ok=True, oracle_power={"ok": True})
    p1, p2 = harness.write(res, str(tmp_path)), harness.write(res, str(tmp_path))
    assert p1 != p2 and p1.name.startswith(f"t-run-{res['date'][:10]}-")
    assert p2.name.endswith("-2.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p1.name, p2.name])


def test_ulp_up_moves_one_element_one_ulp():
    t = torch.tensor([1.0, -1.0, 0.02, 3.0], dtype=torch.bfloat16)
    up = oracle.ulp_up(t, 0)
    assert up[0].item() == 1.0078125 and torch.equal(up[1:], t[1:]) and t[0].item() == 1.0
    assert oracle.ulp_up(t, 1)[1].item() == -1.0078125
    small = oracle.ulp_up(t, 2)[2].item()
    assert small > t[2].item() and small - t[2].item() == pytest.approx(2 ** -13)
    with pytest.raises(ValueError, match="bfloat16"):
        oracle.ulp_up(torch.ones(2), 0)


class _Model:
    """A stand-in server for the weight fault: the answers are a function of the prompt and of
    the weight's bytes (``sensitive``) or of the prompt only (a blind oracle)."""

    def __init__(self, sensitive=True, fail_update=False, sticky=False):
        self.w = torch.ones(8, dtype=torch.bfloat16)
        self.sensitive, self.fail_update, self.sticky = sensitive, fail_update, sticky
        self.updates = []

    def update(self, named):
        self.updates.append(named[0][0])
        if self.fail_update:
            return False, "refused"
        if not (self.sticky and len(self.updates) > 1):  # sticky: the restore does nothing
            self.w = named[0][1].clone()
        return True, "ok"

    def answer(self, p):
        shift = float(self.w.float().sum() - 8) if self.sensitive else 0.0
        return _res([p, p + 1], [-0.5 - shift, -0.75])

    def rerun(self):
        return [self.answer(p) for p in (3, 4)]


@pytest.mark.parametrize("case,caught", [("sensitive", True), ("blind", False),
                                         ("sticky", False), ("refused", None)])
def test_the_weight_fault_is_caught_only_when_the_answers_move_and_come_back(case, caught):
    m = _Model(sensitive=case != "blind", fail_update=case == "refused", sticky=case == "sticky")
    ref = m.rerun()
    rec = oracle.weight_ulp_fault(m.update, m.rerun, ref, name="n.weight", clean=m.w.clone())
    assert rec["caught"] is caught
    assert rec["from"] == 1.0 and rec["to"] == 1.0078125 and rec["param"] == "n.weight"
    if case == "refused":
        assert rec["planted"] is False and "the update failed: refused" in rec["why"]
        return
    assert m.updates == ["n.weight", "n.weight"]  # the fault, then the restore
    assert rec["restored_identical"] is (case != "sticky")
    if case == "blind":
        assert "equalled the reference" in rec["why"]
    if case == "sticky":
        assert "cannot be told from the fault" in rec["why"]


def test_the_page_fault_verdict_needs_the_control_and_the_storage_path():
    page = 64
    full = 3 * page  # 200-token prompts: 3 reusable pages
    ref_f, ref_c = _res([1, 2], [-1.0, -2.0]), _res([3, 4], [-1.0, -2.0])
    good_c = _res([3, 4], [-1.0, -2.0], storage=full)
    bad_f = _res([1, 2], [-1.0, -2.5], storage=full)
    assert oracle.judge_page_fault(bad_f, good_c, ref_f, ref_c, page)["caught"] is True
    blind = oracle.judge_page_fault(_res([1, 2], [-1.0, -2.0], storage=full), good_c, ref_f,
                                    ref_c, page)
    assert blind["caught"] is False and "equalled the miss" in blind["why"]
    noisy = oracle.judge_page_fault(bad_f, _res([3, 4], [-1.0, -2.1], storage=full), ref_f,
                                    ref_c, page)
    assert noisy["caught"] is False and "untouched prompt differed" in noisy["why"]
    recomputed = oracle.judge_page_fault(_res([1, 2], [-1.0, -2.5], storage=page), good_c,
                                         ref_f, ref_c, page)
    assert recomputed["caught"] is None and "not read whole from L3" in recomputed["why"]


@pytest.mark.sglang
def test_page_keys_are_sglangs():
    from sglang.srt.mem_cache.utils import get_hash_str

    toks = oracle.last_token_pair(3, 5 * 16 + 7)[0]
    assert oracle.page_keys(toks, 16) == get_hash_str(toks, None, page_size=16)[:5]
    k, ka, kb = oracle.fault_page(*oracle.last_token_pair(3, 5 * 16 + 7), 16)
    assert k == 2 and ka != kb
    with pytest.raises(ValueError, match="at least 2 reusable pages"):
        oracle.fault_page([1] * 20, [2] * 20, 16)


@pytest.mark.sglang
@pytest.mark.parametrize("host", [False, True], ids=["disk", "host-tier"])
def test_a_swapped_page_is_served_by_a_real_backend_after_a_restart(tmp_path, host):
    """The planted KV fault end to end on vitrify's real HiCache backend (through SGLang's
    factory and host pool, on the CPU): two prompts' pages stored under SGLang's keys, the
    backend closed, page B's bytes put under page A's key through the store API, a new backend
    (cold_start="load") reads B's bytes for A; every other page is as it was."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    page = 16
    dev = MHATokenToKVPool(size=512, page_size=page, dtype=torch.bfloat16, head_num=2,
                           head_dim=64, layer_num=2, device="cpu", enable_memory_saver=False,
                           enable_alt_stream=False)
    hostpool = MHATokenToKVPoolHost(dev, 2.0, 0, page, "page_first", pin_memory=False,
                                    device="cpu")
    stats = str(tmp_path / "stats.json")
    extra = {"backend_name": "vitrify", "module_path": "vitrify.integrations.sglang.hicache",
             "class_name": "VitrifyStorage", "interface_v1": 1, "dirs": [str(tmp_path / "d")],
             "budget_bytes": 8 << 20, "cold_start": "clear", "stats_path": stats,
             "direct_io": "auto"}
    if host:
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm for the host tier")
        shm = f"/dev/shm/vitrify-test-swap-{os.getpid()}"
        shutil.rmtree(shm, ignore_errors=True)
        extra.update(host_bytes=4 << 20, host_dir=shm)

    def backend(cold):
        cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                   attn_cp_size=1, is_mla_model=False,
                                   enable_storage_metrics=False, is_page_first_layout=True,
                                   model_name="m", extra_config={**extra, "cold_start": cold})
        b = StorageBackendFactory.create_backend("dynamic", cfg, hostpool)
        b.register_mem_pool_host(hostpool)
        return b

    try:
        _swap_and_read(backend, hostpool, page, stats, extra, host)
    finally:
        if host:
            shutil.rmtree(extra["host_dir"], ignore_errors=True)


def _swap_and_read(backend, hostpool, page, stats, extra, host):
    a_ids, b_ids = oracle.last_token_pair(9, 4 * page + 1)
    keys = oracle.page_keys(a_ids, page) + oracle.page_keys(b_ids, page)
    idx = hostpool.alloc(len(keys) * page)
    starts = {key: int(idx[i * page]) for i, key in enumerate(keys)}
    g = torch.Generator().manual_seed(1)
    hostpool.kv_buffer.copy_(torch.randn(hostpool.kv_buffer.shape, generator=g))
    stored = {key: hostpool.get_data_page(st, flat=True).clone() for key, st in starts.items()}
    b = backend("clear")
    try:
        assert all(b.batch_set_v1(keys, idx))
    finally:
        b.close()
    store = json.loads(Path(stats).read_text())["store"]
    k, key_a, key_b = oracle.fault_page(a_ids, b_ids, page)
    assert key_a in stored and key_b in stored
    rec = oracle.plant_page_swap(store, extra["dirs"], key_a, key_b,
                                 host_bytes=extra.get("host_bytes", 0),
                                 host_dir=extra.get("host_dir"))
    assert rec["planted"] is True and rec["disk"]["planted"] is True, rec
    if host:
        assert rec["host"]["planted"] is True
    hostpool.kv_buffer.zero_()
    b2 = backend("load")
    try:
        assert all(b2.batch_get_v1(keys, idx))  # every page verifies: a valid checksum
    finally:
        b2.close()
    for key, st in starts.items():
        got = hostpool.get_data_page(st, flat=True)
        assert torch.equal(got, stored[key_b if key == key_a else key]), key
    assert not torch.equal(stored[key_a], stored[key_b])


def test_stop_ends_the_whole_process_group_also_on_an_exception(tmp_path):
    """A child that ignores SIGTERM is gone after the block, which raised (SIGKILL to the
    group)."""
    script = "trap '' TERM; sleep 60 & echo $! > %s; wait" % (tmp_path / "child")
    srv = harness.Server(["sh", "-c", script], dict(os.environ), str(tmp_path / "s.log"))
    with pytest.raises(KeyError, match="boom"):
        with srv:
            for _ in range(200):
                if (tmp_path / "child").exists() and (tmp_path / "child").read_text().strip():
                    break
                time.sleep(0.02)
            child = int((tmp_path / "child").read_text())
            assert os.getpgid(child) == srv.proc.pid != os.getpgid(0)
            raise KeyError("boom")
    assert srv.proc.poll() is not None
    for _ in range(200):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the group's child survived stop()")


def test_wait_ready_reports_a_dead_server(tmp_path):
    srv = harness.Server(["sh", "-c", "echo started; exit 3"], dict(os.environ),
                         str(tmp_path / "s.log"))
    with srv:
        with pytest.raises(RuntimeError, match="exited with 3"):
            srv.wait_ready(1, timeout=10)
    assert (tmp_path / "s.log").read_text() == "started\n"  # the log streamed to its file


def test_the_timeline_reads_what_sglang_says_it_ran_with(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("[2026-12-02 02:41:20] server_args=ServerArgs(model_path='/m', "
                   "enable_deterministic_inference=True, page_size=64)\n"
                   "[2026-12-02 02:41:46] Init torch distributed begin.\n")
    import datetime as dt

    t0 = dt.datetime(2026, 12, 2, 2, 41, 18).timestamp()
    tl = harness.timeline(str(log), t0)
    assert tl["deterministic_inference"] is True and tl["at_s"]["torch_distributed"] == 28.0


@pytest.mark.sglang
@pytest.mark.parametrize("module,det", [("hicache_e2e", True), ("freeze_e2e", False),
                                        ("weights_e2e", True)])
def test_dry_runs_say_which_launches_are_deterministic(tmp_path, module, det):
    base = [sys.executable, "-m", f"vitrify.bench.sglang.{module}", "--dry-run"]
    if module != "hicache_e2e":
        base += ["--work", str(tmp_path)]
    for flag, want in (([], det), (["--deterministic"], True)):
        r = subprocess.run(base + flag, capture_output=True, text=True, timeout=120, cwd="/tmp")
        assert r.returncode == 0, r.stderr
        cmds = [ln for ln in r.stdout.splitlines() if "-m sglang.launch_server" in ln]
        assert cmds and all((harness.DETERMINISTIC_FLAG in c) is want for c in cmds)
        assert all("--load-format auto" in c for c in cmds)  # the seeded checkpoint
    if module != "freeze_e2e":
        r = subprocess.run(base + ["--no-deterministic"], capture_output=True, text=True,
                           timeout=120, cwd="/tmp")
        assert r.returncode == 0 and harness.DETERMINISTIC_FLAG not in r.stdout


@pytest.mark.sglang
@pytest.mark.parametrize("script", ["benchmarks/sglang_hicache_e2e.py",
                                    "benchmarks/sglang_freeze_e2e.py",
                                    "benchmarks/sglang_weights_e2e.py"])
def test_the_entry_scripts_run_the_package(tmp_path, script):
    r = subprocess.run([sys.executable, str(REPO / script), "--dry-run", *(
        ["--work", str(tmp_path)] if "hicache" not in script else [])],
        capture_output=True, text=True, timeout=120, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    assert "installing" not in r.stderr and "-m sglang.launch_server" in r.stdout


def test_an_entry_script_notices_another_vitrify_is_installed(tmp_path):
    """A checkout whose sources differ from the vitrify this python imports: the script would
    install it (pip); told it already did, it stops with one line instead of running old
    code."""
    fake = tmp_path / "repo"
    (fake / "benchmarks").mkdir(parents=True)
    for name in ("sglang_freeze_e2e.py", "checkout.py"):
        shutil.copy(REPO / "benchmarks" / name, fake / "benchmarks")
    (fake / "python" / "vitrify").mkdir(parents=True)
    (fake / "python" / "vitrify" / "__init__.py").write_text("# another version\n")
    env = {**os.environ, "VITRIFY_E2E_INSTALLED": "1"}
    r = subprocess.run([sys.executable, str(fake / "benchmarks" / "sglang_freeze_e2e.py"),
                        "--dry-run"], capture_output=True, text=True, timeout=60, env=env,
                       cwd="/tmp")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"sglang_freeze_e2e.py: vitrify was installed from {fake} but {sys.executable} still "
        f"imports another copy; check PYTHONPATH"]


def test_an_entry_script_refuses_a_vitrify_pythonpath_puts_first(tmp_path):
    """A copy of vitrify first on PYTHONPATH: installing this checkout into the environment
    would not change what runs (and would replace the environment's own vitrify): one line, no
    pip."""
    shadow = tmp_path / "shadow"
    (shadow / "vitrify").mkdir(parents=True)
    (shadow / "vitrify" / "__init__.py").write_text("# a stale copy\n")
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    env.pop("VITRIFY_E2E_INSTALLED", None)
    which = subprocess.run([sys.executable, "-c", "import vitrify; print(vitrify.__file__)"],
                           capture_output=True, text=True, timeout=60, env=env, cwd="/tmp")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sglang_freeze_e2e.py"),
                        "--dry-run"], capture_output=True, text=True, timeout=60, env=env,
                       cwd="/tmp")
    assert "installing" not in r.stderr
    if not which.stdout.strip().startswith(str(shadow)):  # an editable install's finder wins
        assert r.returncode == 0, r.stderr  # over PYTHONPATH: this checkout runs
        return
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"sglang_freeze_e2e.py: vitrify is imported from {shadow / 'vitrify'}, which PYTHONPATH "
        f"puts first; this checkout ({REPO}) is not what runs: unset PYTHONPATH or point it here"]


@pytest.mark.parametrize("max_input,max_batch,page", [(4086, 64, 16), (100, 5, 1), (3, 1, 16)])
def test_the_heldout_shapes_are_past_the_plugins_sweep(max_input, max_batch, page):
    """The held-out sweep of the freeze run: every batch-size class, sizes and prompt lengths the
    plugin's own sweep does not send (where the class has room), page-unaligned lengths spread
    over the context, prefix hits of earlier batches."""
    from vitrify.integrations.sglang import sweep

    shapes = harness.heldout_shapes(5, max_input, max_batch, page)
    assert shapes == harness.heldout_shapes(5, max_input, max_batch, page)
    pow2 = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
    sizes = [len(b) for b in shapes]
    assert {pow2(n) for n in sizes} == {pow2(n) for n in range(1, max_batch + 1)}
    assert all(1 <= len(p) <= max_input for b in shapes for p in b)
    theirs = set(sweep.batch_sizes(max_batch))
    for c in (1 << k for k in range(1, 8)):
        free = set(range(c // 2 + 1, min(c, max_batch) + 1)) - theirs
        if free and c // 2 < max_batch:  # a size of its own in each class that has one
            assert any(pow2(n) == c and n not in theirs for n in sizes)
    if max_input > 1000:
        lengths = [len(p) for b in shapes for p in b]
        assert all(n % page for n in lengths if n not in sweep.prompt_lengths(max_input, page)) \
            or page == 1
        assert max(lengths) > max_input * 5 // 6 and min(lengths) < 3 * page + 8
        singles = [b[0] for b in shapes if len(b) == 1]
        assert len(singles) >= 6
        # a prefix hit: a later batch whose prompts extend an earlier batch's
        firsts = {tuple(p) for b in shapes for p in b}
        assert any(tuple(q[:n]) in firsts for b in shapes for q in b
                   for n in range(1, len(q)) if len(b) > 1)
