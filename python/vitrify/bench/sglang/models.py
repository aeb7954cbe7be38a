"""The model shapes the SGLang end-to-end runs serve: Hugging Face configs and parameter lists.

Owns: the configs (``config.json`` contents) of each shape, the Hugging Face parameter names and
shapes a checkpoint of that config holds (what ``transformers`` builds for it, tied weights
left out as HF checkpoints leave them out), and the KV geometry the HiCache run pages by.

========  ==============  ===========================================================
shape     family          what
========  ==============  ===========================================================
tiny      Qwen3           8 layers, hidden 1024, 8 KV heads of 64 (16 KiB KV/token)
8b        Qwen3           Qwen3-8B: 36 layers, hidden 4096, 8 KV heads of 128
8b-mqa    Qwen3           the 8b shape with one KV head (an eighth of the KV bytes)
llama-1b  Llama           Llama-3.2-1B: 16 layers, hidden 2048, 8 KV heads of 64, tied
                          embeddings, llama3 RoPE scaling
moe       Qwen3-MoE       Qwen3-30B-A3B's layer: hidden 2048, 4 KV heads of 128, 128
                          experts of width 768, 8 routed per token; 6 of its 48 layers
                          (4.4 B parameters, 8.7 GB: every MoE kernel of the full model,
                          an archive the GPU machine's disk holds)
========  ==============  ===========================================================
"""

from __future__ import annotations

from typing import Any

MiB = 1 << 20

# A tiny Qwen3 (8 layers, 8 KV heads of 64, bf16).
QWEN3_TINY: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 32000,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
    "use_cache": True, "tie_word_embeddings": False, "rope_theta": 1000000.0,
    "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 8, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16", "dtype": "bfloat16",
}

# Llama-3.2-1B's published config (1.24 B parameters; the LM head is the embedding, tied).
LLAMA_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-05,
    "use_cache": True, "tie_word_embeddings": True, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}

_QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
             "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "max_window_layers": 36}

# Qwen3-30B-A3B's published config, but 6 of its 48 layers (every layer is an MoE block: SGLang's
# Qwen3-MoE has no dense layers; the router's scores are softmaxed, the top 8 renormalised)
QWEN3_MOE: dict[str, Any] = {
    **QWEN3_TINY, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "max_window_layers": 6, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "output_router_logits": False, "router_aux_loss_coef": 0.001,
}

# shape -> (base config, overrides)
SHAPES: dict[str, tuple[dict, dict]] = {
    "tiny": (QWEN3_TINY, {}),
    # Qwen3-8B's shape: 147,456 B of KV per token
    "8b": (QWEN3_TINY, _QWEN3_8B),
    # one KV head (multi-query attention: 32 query heads share it): the same prefill work per
    # token for an eighth of the KV bytes (18,432 B per token)
    "8b-mqa": (QWEN3_TINY, {**_QWEN3_8B, "num_key_value_heads": 1}),
    "llama-1b": (LLAMA_1B, {}),
    "moe": (QWEN3_MOE, {}),
}


def model_config(shape: str) -> dict:
    """The ``config.json`` contents of ``shape`` (a fresh dict); ValueError for an unknown one."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {sorted(SHAPES)}")
    base, over = SHAPES[shape]
    cfg = {**base, **over}
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg.items()}


def family(cfg: dict) -> str:
    """``"qwen3"`` or ``"llama"``: the parameter naming of the config's architecture."""
    mt = cfg.get("model_type")
    if mt in FAMILIES:
        return mt
    raise ValueError(f"model_type {mt!r} is not one of the families the runs write checkpoints "
                     f"for: {', '.join(FAMILIES)}")


FAMILIES = ("qwen3", "llama", "qwen3_moe")


def moe_layer(cfg: dict, i: int) -> bool:
    """Whether layer ``i`` of a Qwen3-MoE config is an MoE block (``decoder_sparse_step``,
    ``mlp_only_layers``: Hugging Face's rule; the shapes here make every layer one)."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    return i not in (cfg.get("mlp_only_layers") or []) and cfg.get("num_experts", 0) > 0 and \
        (i + 1) % step == 0


def parameter_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of ``cfg``'s checkpoint, in the order transformers
    lists them. A tied LM head (``tie_word_embeddings``) is not in the checkpoint."""
    fam = family(cfg)
    h, hd, n_layers = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    heads, kv, ffn, vocab = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                             cfg["intermediate_size"], cfg["vocab_size"])
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (heads * hd, h)
        out[p + "self_attn.k_proj.weight"] = (kv * hd, h)
        out[p + "self_attn.v_proj.weight"] = (kv * hd, h)
        out[p + "self_attn.o_proj.weight"] = (h, heads * hd)
        if fam in ("qwen3", "qwen3_moe"):  # per-head RMSNorm of q and k
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        if fam == "qwen3_moe" and moe_layer(cfg, i):
            # the router (N(0, 0.02) like every matrix: which experts run depends on the
            # input), then each expert's SwiGLU as its own three matrices (the Hub's layout)
            width = cfg["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = (cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                out[q + "gate_proj.weight"] = (width, h)
                out[q + "up_proj.weight"] = (width, h)
                out[q + "down_proj.weight"] = (h, width)
        else:
            out[p + "mlp.gate_proj.weight"] = (ffn, h)
            out[p + "mlp.up_proj.weight"] = (ffn, h)
            out[p + "mlp.down_proj.weight"] = (h, ffn)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (vocab, h)
    return out


def is_norm(name: str) -> bool:
    """An RMSNorm scale (initialised to ones), not a matrix."""
    return name.endswith("norm.weight")


def kv_bytes_per_token(cfg: dict) -> int:
    """K and V of every layer for one token (bf16)."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2


def page_tokens_for(cfg: dict, page_bytes: int = MiB) -> int:
    """Tokens per page so one page of KV is ``page_bytes`` (must divide exactly)."""
    per = kv_bytes_per_token(cfg)
    if page_bytes % per:
        raise ValueError(f"page_bytes={page_bytes} is not a multiple of {per} B of KV per token")
    return page_bytes // per
