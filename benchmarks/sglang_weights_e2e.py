#!/usr/bin/env python3
"""vitrify's weight update into a real SGLang 0.5.17 server, through SGLang's own
``/update_weights_from_tensor`` route (GPU machine, the carried bundle; issue: colocated weight
update, its SGLang part).

A server starts with dummy weights W0 and vitrify's plugin (``weight_updates = true``). This
process is the trainer: it holds W1 (random, seeded) in the Megatron-style layout on the GPU and
updates the server with ``load_format="vitrify"`` (its sender's staging buffer, verified on both
sides), then once more with one tensor changed and once with it changed back (delta updates by
content digests), then with SGLang's own path (``load_format=None``, CUDA IPC tensors under
SGLang's names) for the baseline time. A second server loads W1 from a safetensors checkpoint.
Checks: the updated server's tokens and logprobs equal the W1 server's for every prompt, differ
from W0's, the deltas moved only the changed tensor, SGLang's own update leaves the same tokens.

    python benchmarks/sglang_weights_e2e.py --bundle .whl/sglang-site.tar.xz --out DIR

Writes DIR/sglang-weights-e2e-<date>.json and the servers' logs. Roughly 3 minutes on a warm
machine (two server launches of the tiny Qwen3).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import importlib.util
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sglang_hicache_e2e",
                                               REPO / "benchmarks" / "sglang_hicache_e2e.py")
e2e = importlib.util.module_from_spec(_spec)
sys.modules["sglang_hicache_e2e"] = e2e
_spec.loader.exec_module(e2e)

NAME = "sglang-weights-e2e"
PLUGIN_TOML = 'mode = "off"\nweight_updates = true\n'


def hf_weights(cfg: dict, seed: int, device: str = "cpu") -> dict:
    """Random weights of a Qwen3 config under Hugging Face names (bf16; matrices of std 0.02,
    norms near 1): a checkpoint a server can load, and what the trainer holds."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    h, hd, L = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    heads, kv, ffn, vocab = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                             cfg["intermediate_size"], cfg["vocab_size"])

    def mat(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16).to(device)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).to(device)

    w = {"model.embed_tokens.weight": mat(vocab, h), "lm_head.weight": mat(vocab, h),
         "model.norm.weight": norm(h)}
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = mat(heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = mat(kv * hd, h)
        w[p + "self_attn.v_proj.weight"] = mat(kv * hd, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, heads * hd)
        w[p + "self_attn.q_norm.weight"] = norm(hd)
        w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "mlp.gate_proj.weight"] = mat(ffn, h)
        w[p + "mlp.up_proj.weight"] = mat(ffn, h)
        w[p + "mlp.down_proj.weight"] = mat(h, ffn)
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
    return w


def trainer_tensors(w: dict, cfg: dict) -> dict:
    """W in the Megatron-style layout (what vitrify's sender streams)."""
    from vitrify.weights.mapping import megatron_layout

    return {n: t.contiguous() for n, t in megatron_layout(
        w, layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"], qk_norm=True).items()}


def serialize(named_tensors: list) -> str:
    """What SGLang's MultiprocessingSerializer.serialize(..., output_str=True) makes: the
    ForkingPickler dump (torch's reductions: CUDA tensors travel as IPC handles), base64."""
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions)
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode()


def post_update(port: int, named_tensors: list, load_format: str | None,
                timeout: float = 600.0) -> tuple[bool, str]:
    body = json.dumps({"serialized_named_tensors": [serialize(named_tensors)],
                       "load_format": load_format, "flush_cache": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/update_weights_from_tensor", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
    finally:
        conn.close()
    try:
        out = json.loads(text)
    except ValueError:
        return False, f"HTTP {resp.status}: {text[:300]}"
    return bool(out.get("success")), str(out.get("message"))


def server_cmd(s: Any, model_dir: str, port: int, dummy: bool) -> list[str]:
    return [s.python, "-m", "sglang.launch_server", "--model-path", model_dir,
            "--load-format", "dummy" if dummy else "auto", "--skip-tokenizer-init",
            "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--cuda-graph-backend-prefill", "disabled", "--mem-fraction-static", "0.3",
            "--random-seed", "0", "--port", str(port), "--host", "127.0.0.1",
            "--log-level", "info"]


def run_prompts(port: int, prompts: list, max_new: int) -> list[dict]:
    return [e2e.generate(port, ids, max_new) for ids in prompts]


def same(a: list[dict], b: list[dict], key: str) -> int:
    return sum(x[key] == y[key] for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=".whl/sglang-site.tar.xz")
    ap.add_argument("--out", default=os.environ.get("OUT") or "build/sglang-weights-e2e")
    ap.add_argument("--work", default="/tmp/vitrify-sglang-weights")
    ap.add_argument("--port", type=int, default=30031)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--chunk-mib", type=int, default=64)
    a = ap.parse_args(argv)
    import torch

    from vitrify.integrations.sglang import weights as sw
    from vitrify.weights import transport as wt

    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    s = e2e.Settings.for_shape("tiny", bundle=os.path.abspath(a.bundle), work=a.work, out=out,
                               model_dir=os.path.join(a.work, "w0"))
    cfg = s.model_config
    res: dict[str, Any] = {"checks": {}, "rows": [], "settings": vars(a)}
    res["bundle"] = e2e.unpack_bundle(s)
    res["vitrify"] = e2e.ensure_vitrify(s)
    e2e.write_model(s)
    w1_dir = os.path.join(a.work, "w1")
    os.makedirs(w1_dir, exist_ok=True)
    Path(w1_dir, "config.json").write_text(json.dumps(cfg, indent=1))
    w1 = hf_weights(cfg, seed=1)
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in w1.items()}, os.path.join(w1_dir, "model.safetensors"))
    toml = os.path.join(a.work, "vitrify-plugin.toml")
    Path(toml).write_text(PLUGIN_TOML)
    env = e2e.server_env(s, "vitrify")
    env["VITRIFY_SGLANG_CONFIG"] = toml
    prompts = e2e.make_prompts(s.seed, a.prompts, 64, 256, vocab=cfg["vocab_size"])
    sock = os.path.join(a.work, "trainer.sock")

    with e2e.Server(server_cmd(s, s.model_dir, a.port, dummy=True), env,
                    os.path.join(out, "sglang-updated.log")) as srv:
        res["ready_s_updated"] = round(srv.wait_ready(a.port, 300), 1)
        before = run_prompts(a.port, prompts, a.max_new_tokens)
        gpu = {n: t.to("cuda") for n, t in w1.items()}
        src = trainer_tensors(gpu, cfg)
        total = sum(t.numel() * t.element_size() for t in src.values())
        torch.cuda.synchronize()
        tx = wt.Sender(a.chunk_mib << 20, device=0)
        call = lambda nt, lf: post_update(a.port, nt, lf)  # noqa: E731
        try:
            t0 = time.perf_counter()
            full = sw.update(call, tx, src, sock, weight_version="w1")
            full_s = time.perf_counter() - t0
            name = "decoder.layers.3.mlp.linear_fc2.weight"
            keep = src[name].clone()
            src[name].add_(1)
            t0 = time.perf_counter()
            delta = sw.update(call, tx, src, sock)
            delta_s = time.perf_counter() - t0
            src[name].copy_(keep)
            back = sw.update(call, tx, src, sock)
        finally:
            tx.close()
        after = run_prompts(a.port, prompts, a.max_new_tokens)
        # SGLang's own path for the same bytes: CUDA IPC tensors under its checkpoint names
        named = list(gpu.items())
        t0 = time.perf_counter()
        ok_own, msg_own = post_update(a.port, named, None)
        own_s = time.perf_counter() - t0
        after_own = run_prompts(a.port, prompts, a.max_new_tokens)
    with e2e.Server(server_cmd(s, w1_dir, a.port + 1, dummy=False), e2e.server_env(s, "x"),
                    os.path.join(out, "sglang-w1.log")) as srv:
        res["ready_s_w1"] = round(srv.wait_ready(a.port + 1, 300), 1)
        ref = run_prompts(a.port + 1, prompts, a.max_new_tokens)

    changed = src[name].numel() * src[name].element_size()
    n = len(prompts)
    res["checks"] = {
        "tokens_equal_w1_server": same(after, ref, "output_ids") == n,
        "logprobs_equal_w1_server": same(after, ref, "logprobs") == n,
        "update_changed_tokens": same(before, after, "output_ids") < n,
        "delta_moved_one_tensor": delta["tensors"] == 1 and delta["bytes_moved"] == changed,
        "revert_moved_one_tensor": back["tensors"] == 1,
        "sglang_own_update_ok": ok_own,
        "sglang_own_update_same_tokens": same(after_own, ref, "output_ids") == n,
    }
    res["prompts"] = n
    res["tokens_equal"] = same(after, ref, "output_ids")
    res["logprobs_equal"] = same(after, ref, "logprobs")
    res["full"], res["delta"], res["revert"] = full, delta, back
    res["sglang_own_message"] = msg_own
    res["rows"] = [
        {"case": "vitrify update via /update_weights_from_tensor", "seconds": full_s,
         "GB/s": total / full_s / 1e9},
        {"case": "vitrify delta (one tensor)", "seconds": delta_s,
         "GB/s": delta["bytes_moved"] / delta_s / 1e9},
        {"case": "SGLang's own update_weights_from_tensor (CUDA IPC)", "seconds": own_s,
         "GB/s": total / own_s / 1e9},
    ]
    res["ratios"] = {"vitrify_over_sglang_own": own_s / full_s,
                     "delta_bytes_fraction": delta["bytes_moved"] / delta["bytes_total"]}
    res["bytes"] = total
    res["ok"] = all(res["checks"].values())
    out_res = e2e.resultlib.result(NAME, **res)
    path = e2e.resultlib.write(out_res, out)
    e2e.resultlib.print_table(res["rows"], ["case", "seconds", "GB/s"])
    print(json.dumps(res["checks"], indent=1))
    print(f"ok={res['ok']}\nwrote {path}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
