"""When an L3 (storage) hit pays: a model's break-even read bandwidth.

A prefix found in storage saves its prefill; reading it costs its KV bytes at the storage's read
rate. A model that prefills ``T`` tokens/s and keeps ``B`` bytes of KV per token recomputes a
prefix as fast as storage reading ``T x B`` bytes/s delivers it: above that rate an L3 hit beats
recomputing, below it loses. ``vitrify bench hicache --model CONFIG`` measures ``T`` (or takes
it) and puts ``T x B`` beside the drive's and vitrify's measured read rates;
``benchmarks/sglang_hicache_e2e.py`` does the same with a real server's miss pass.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1}


def load_model_config(path: str) -> dict:
    """A Hugging Face ``config.json`` (the file, or a directory holding one) as a dict."""
    f = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(f) as fh:
            cfg = json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (a config.json or a directory "
                         f"holding one)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read {f}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: {f} is not a JSON object")
    return cfg


def _need(cfg: dict, key: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"model config: {key!r} must be a positive integer, got {v!r}")
    return v


def kv_geometry(cfg: dict) -> dict:
    """The KV cache one token occupies, from a model config: ``kind`` ("mha" for MHA/GQA/MQA,
    "mla" for DeepSeek-style latent attention), ``layers``, and ``kv_heads`` and ``head_dim``
    (mha) or ``kv_lora_rank`` and ``qk_rope_head_dim`` (mla), plus ``bytes_per_token`` in the
    model's dtype (bf16 unless the config says otherwise)."""
    layers = _need(cfg, "num_hidden_layers")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"model config: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    el = DTYPE_BYTES[dtype]
    if cfg.get("kv_lora_rank"):  # MLA: one latent vector and one rope key per token and layer
        rank, rope = _need(cfg, "kv_lora_rank"), _need(cfg, "qk_rope_head_dim")
        return {"kind": "mla", "layers": layers, "kv_lora_rank": rank, "qk_rope_head_dim": rope,
                "dtype": dtype, "bytes_per_token": layers * (rank + rope) * el}
    heads = _need(cfg, "num_attention_heads")
    # the KV head count under the names configs use for it (Llama/Qwen, Falcon, ChatGLM, and
    # Falcon-7B's multi_query flag); none of them: every query head has its own (MHA)
    if cfg.get("num_key_value_heads") is not None:
        kv_heads = _need(cfg, "num_key_value_heads")
    elif cfg.get("num_kv_heads") is not None:
        kv_heads = _need(cfg, "num_kv_heads")
    elif cfg.get("multi_query_attention") and cfg.get("multi_query_group_num") is not None:
        kv_heads = _need(cfg, "multi_query_group_num")
    elif cfg.get("multi_query"):
        kv_heads = 1
    else:
        kv_heads = heads
    if cfg.get("head_dim") is not None:
        head_dim = _need(cfg, "head_dim")
    else:
        head_dim = _need(cfg, "hidden_size") // heads
        if head_dim <= 0:
            raise ValueError(f"model config: hidden_size / num_attention_heads is {head_dim}")
    return {"kind": "mha", "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": dtype, "bytes_per_token": 2 * layers * kv_heads * head_dim * el}


def verdict(tokens_per_s: float, kv_bytes_per_token: int,
            rates: dict[str, float | None]) -> dict:
    """The break-even read rate and, for each measured ``rates[name]`` (bytes/s; None: not
    measured), whether an L3 hit read at that rate beats recomputing. ``l3_pays`` and the
    one-line ``verdict`` go by the first measured rate in ``rates``' order (callers put the
    store's own reads before the raw drive's, which is only its ceiling)."""
    be = tokens_per_s * kv_bytes_per_token
    out: dict[str, Any] = {"prefill_tokens_per_s": tokens_per_s,
                           "kv_bytes_per_token": kv_bytes_per_token,
                           "break_even_read_bytes_per_s": be}
    known = {k: v for k, v in rates.items() if v}
    for name, rate in known.items():
        out[f"{name}_read_bytes_per_s"] = rate
        out[f"l3_pays_at_{name}"] = rate > be
    if known:
        name, rate = next(iter(known.items()))
        out["l3_pays"] = rate > be
        out["l3_pays_by"] = name
        others = "".join(f", {k} {v / 1e9:.2f} GB/s" for k, v in known.items() if k != name)
        out["verdict"] = (
            f"an L3 hit {'beats' if rate > be else 'loses to'} recomputing the prefix here: "
            f"{name} reads {rate / 1e9:.2f} GB/s, recompute equals {be / 1e9:.2f} GB/s "
            f"({tokens_per_s:,.0f} tokens/s x {kv_bytes_per_token:,} B/token){others}")
    else:
        out["verdict"] = (f"break-even read rate {be / 1e9:.2f} GB/s ({tokens_per_s:,.0f} "
                          f"tokens/s x {kv_bytes_per_token:,} B/token); no read rate measured")
    return out


def measure_prefill(cfg: dict, tokens: int, device: str, reps: int = 3) -> dict:
    """Prefill tokens/s of a model built from ``cfg`` with random weights (transformers, the
    model's dtype, transformers' default attention): one forward of ``tokens`` random ids,
    after one untimed warm-up, best of ``reps``. Raises RuntimeError when torch, transformers
    or the device is missing; building or running the model may raise what they raise."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RuntimeError(f"needs torch and transformers ({e})") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU visible to torch")
    geo = kv_geometry(cfg)
    dtype = getattr(torch, geo["dtype"]) if geo["dtype"] in ("bfloat16", "float16",
                                                             "float32") else torch.bfloat16
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        raise RuntimeError("the model config names no 'model_type' (transformers needs it to "
                           "build the model)")
    try:
        conf = transformers.AutoConfig.for_model(
            model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
    except (ValueError, KeyError) as e:
        raise RuntimeError(f"transformers cannot build {model_type!r}: {e}") from None
    need = max(tokens + 1, getattr(conf, "max_position_embeddings", 0) or 0)
    conf.max_position_embeddings = need
    conf.use_cache = False
    t_build = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(conf, dtype=dtype)
    model.eval()
    build_s = time.perf_counter() - t_build
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, int(getattr(conf, "vocab_size", 32000)), (1, tokens),
                        generator=g).to(device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    times = []
    try:
        with torch.inference_mode():
            for i in range(reps + 1):
                sync()
                t0 = time.perf_counter()
                model(input_ids=ids, logits_to_keep=1)
                sync()
                if i:
                    times.append(time.perf_counter() - t0)
    finally:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    best = min(times)
    return {"prefill_tokens_per_s": tokens / best, "tokens": tokens, "best_s": best,
            "reps": reps, "device": device, "build_s": build_s,
            "how": f"transformers {transformers.__version__}, random weights, {geo['dtype']}, "
                   f"one forward of {tokens} tokens (last logits only), best of {reps} after "
                   "a warm-up"}
