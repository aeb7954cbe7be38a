"""The break-even read bandwidth (vitrify.bench.breakeven) and `vitrify bench hicache --model`."""

from __future__ import annotations

import importlib.util
import json

import pytest

from vitrify.bench import breakeven

QWEN3_8B = {"model_type": "qwen3", "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
            "torch_dtype": "bfloat16"}
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 256, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}


def test_kv_bytes_per_token_of_real_shapes():
    assert breakeven.kv_geometry(QWEN3_8B)["bytes_per_token"] == 147456  # 2 x 36 x 8 x 128 x 2
    mqa = {**QWEN3_8B, "num_key_value_heads": 1}
    assert breakeven.kv_geometry(mqa)["bytes_per_token"] == 18432
    # no head_dim and no num_key_value_heads (Llama-2 style): hidden / heads, MHA
    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}
    g = breakeven.kv_geometry(llama)
    assert (g["kv_heads"], g["head_dim"], g["bytes_per_token"]) == (32, 128, 2 * 32 * 32 * 128 * 2)
    # MLA (DeepSeek-V3): one 512-wide latent and a 64-wide rope key per token and layer
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
    g = breakeven.kv_geometry(mla)
    assert g["kind"] == "mla" and g["bytes_per_token"] == 61 * (512 + 64) * 2
    assert breakeven.kv_geometry({**QWEN3_8B, "torch_dtype": "float32"})["bytes_per_token"] == \
        2 * 147456
    # the other names of the KV head count: Falcon-7B's multi_query flag (one KV head),
    # Falcon-40B's num_kv_heads, ChatGLM's multi_query_group_num
    falcon7 = {"num_hidden_layers": 32, "num_attention_heads": 71, "hidden_size": 4544,
               "multi_query": True}
    assert breakeven.kv_geometry(falcon7)["bytes_per_token"] == 2 * 32 * 1 * 64 * 2
    falcon40 = {"num_hidden_layers": 60, "num_attention_heads": 128, "hidden_size": 8192,
                "num_kv_heads": 8}
    assert breakeven.kv_geometry(falcon40)["kv_heads"] == 8
    glm = {"num_layers": 28, "num_hidden_layers": 28, "num_attention_heads": 32,
           "hidden_size": 4096, "multi_query_attention": True, "multi_query_group_num": 2}
    assert breakeven.kv_geometry(glm)["kv_heads"] == 2
    # an explicit null is "not given", as transformers writes it
    assert breakeven.kv_geometry({**QWEN3_8B, "num_key_value_heads": None, "head_dim": None}
                                 )["bytes_per_token"] == 2 * 36 * 32 * 128 * 2


@pytest.mark.parametrize("bad, words", [
    ({"num_attention_heads": 32}, "'num_hidden_layers' must be a positive integer, got None"),
    ({**QWEN3_8B, "num_hidden_layers": 0}, "got 0"),
    ({**QWEN3_8B, "torch_dtype": "int3"}, "dtype 'int3'"),
    ({"num_hidden_layers": 2, "kv_lora_rank": 512}, "'qk_rope_head_dim'"),
    ({**QWEN3_8B, "num_key_value_heads": 0}, "'num_key_value_heads' must be a positive"),
    ({**QWEN3_8B, "head_dim": -1}, "'head_dim' must be a positive"),
])
def test_a_config_without_what_kv_needs_is_one_clear_error(bad, words):
    with pytest.raises(ValueError, match="model config: ") as e:
        breakeven.kv_geometry(bad)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_load_model_config_file_or_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    assert breakeven.load_model_config(str(tmp_path)) == QWEN3_8B
    assert breakeven.load_model_config(str(tmp_path / "config.json")) == QWEN3_8B
    with pytest.raises(ValueError, match="no such file"):
        breakeven.load_model_config(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        breakeven.load_model_config(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        breakeven.load_model_config(str(tmp_path / "list.json"))


def test_verdict_is_the_prefill_rate_times_the_kv_bytes():
    # the 8B shape measured on the H200: 32.5 k tokens/s x 147,456 B = 4.79 GB/s
    v = breakeven.verdict(32500, 147456, {"vitrify_get": 1.4e9, "drive": 1.5e9})
    assert v["break_even_read_bytes_per_s"] == pytest.approx(32500 * 147456)
    assert v["l3_pays"] is False and v["l3_pays_at_drive"] is False
    assert v["verdict"].startswith("an L3 hit loses to recomputing the prefix here: vitrify_get "
                                   "reads 1.40 GB/s, recompute equals 4.79 GB/s")
    assert v["verdict"].endswith(", drive 1.50 GB/s") and "\n" not in v["verdict"]
    # the MQA shape on the same drive: 0.6 GB/s needed, the drive reads 1.5
    v = breakeven.verdict(32500, 18432, {"vitrify_get": None, "drive": 1.5e9})
    assert v["l3_pays"] is True and v["l3_pays_by"] == "drive"
    assert "vitrify_get_read_bytes_per_s" not in v
    # the verdict goes by the first measured rate (the store's own reads), not the fastest:
    # the raw drive is only the ceiling of what a store could read
    v = breakeven.verdict(1000, 1000, {"vitrify_get": 0.5e6, "drive": 2e6})
    assert v["l3_pays"] is False and v["l3_pays_by"] == "vitrify_get"
    assert v["l3_pays_at_drive"] is True
    v = breakeven.verdict(1000, 1000, {"drive": None})
    assert "l3_pays" not in v and "no read rate measured" in v["verdict"]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or
                    importlib.util.find_spec("torch") is None,
                    reason="needs torch and transformers")
def test_measure_prefill_runs_a_real_forward_on_the_cpu():
    m = breakeven.measure_prefill(TINY, 128, "cpu", reps=2)
    assert m["prefill_tokens_per_s"] == pytest.approx(128 / m["best_s"])
    assert m["device"] == "cpu" and m["reps"] == 2 and "transformers" in m["how"]
    with pytest.raises(RuntimeError, match="model_type"):
        breakeven.measure_prefill({k: v for k, v in TINY.items() if k != "model_type"}, 16,
                                  "cpu")
