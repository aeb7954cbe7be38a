#!/usr/bin/env python3
"""vitrify's weight update into a real SGLang 0.5.17 server thawed by vitrify, through SGLang's own
``/update_weights_from_tensor`` route (GPU machine, the carried bundle; issue: colocated weight
update, its SGLang part).

A server with dummy weights W0 is frozen (plugin mode "save", as ``sglang_freeze_e2e.py`` does)
and thawed in a fresh process (mode "load", ``weight_updates = true``: the region's memory is
created exportable). This process is the trainer: it holds W1 (random, seeded) in the
Megatron-style layout on the GPU and updates the thawed server with ``load_format="vitrify"``:

  direct   the trainer writes W1 into the server's parameters in place (no staging buffer),
           both sides checksum every piece on the GPU; then again (a trainer's next step: the
           plan and tables reused, the steady time); a delta (one tensor's version tag moved)
           and its revert
  staged   a new sender streams everything through its ``--chunk-mib`` staging buffer
  sglang   SGLang's own path for the same bytes (``load_format=None``, CUDA IPC tensors under
           SGLang's names): the baseline time

Each vitrify update's answer carries the engine's report: a digest of the parameters'
addresses as SGLang holds them (and whether they are the tensors the receiver wrote) and the
thawed decode graphs' counters (count, captures, builds, templates), before and after; the run
compares every update's with the first's, so "written in place, graphs neither re-captured nor
rebuilt" is checked, not assumed. A third server (tiny shape) loads W1
from a safetensors checkpoint cold: the updated server's tokens and logprobs must equal it.

    python benchmarks/sglang_weights_e2e.py --bundle .whl/sglang-site.tar.xz --out DIR

Writes DIR/sglang-weights-e2e-<date>.json and the servers' logs. About 4 minutes on a fresh
machine at the tiny shape (three launches). ``--shape 8b`` (Qwen3-8B's shape, 16 GB) skips the
W1 checkpoint server (16 GB written and read back) and checks the vitrify-updated tokens against
SGLang's own update of the same W1 instead.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sglang_freeze_e2e as fe  # noqa: E402  (SAVE, the LOAD launch's settings)

e2e = fe.e2e  # bundle, model, environment, server, requests

NAME = "sglang-weights-e2e"


def hf_weights(cfg: dict, seed: int, device: str = "cpu") -> dict:
    """Random weights of a Qwen3 config under Hugging Face names (bf16; matrices of std 0.02,
    norms near 1), drawn on ``device``: a checkpoint a server can load, and what the trainer
    holds."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h, hd, L = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    heads, kv, ffn, vocab = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                             cfg["intermediate_size"], cfg["vocab_size"])

    def mat(*shape):
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g, device=device)).to(torch.bfloat16)

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


def run_prompts(port: int, prompts: list, max_new: int) -> list[dict]:
    return [e2e.generate(port, ids, max_new) for ids in prompts]


def same(a: list[dict], b: list[dict], key: str) -> int:
    return sum(x[key] == y[key] for x, y in zip(a, b))


def settings(a: argparse.Namespace) -> fe.Settings:
    """The freeze script's settings for this shape (SAVE and LOAD launch as it launches them)."""
    return replace(fe.Settings(**fe.SHAPE_SETTINGS[a.shape]), shape=a.shape,
                   bundle=os.path.abspath(a.bundle), out=os.path.abspath(a.out), work=a.work,
                   port=a.port, prompts=a.prompts, scenarios=fe.CORE)


def load_env(s: fe.Settings) -> dict:
    """LOAD's environment with the plugin's weight updates on (the region made exportable)."""
    env = fe.server_env(s, "load")
    toml = Path(env["VITRIFY_SGLANG_CONFIG"])
    toml.write_text(toml.read_text() + "weight_updates = true\n")
    return env


def w1_server_args(s: fe.Settings, w1_dir: str) -> list[str]:
    """The plain launch's arguments with W1's checkpoint instead of dummy weights."""
    args = fe.server_args(s, "plain")
    args[args.index("--model-path") + 1] = w1_dir
    args[args.index("--load-format") + 1] = "auto"
    return args


def timed(call: Any, tx: Any, src: dict, sock: str, **kw: Any) -> tuple[dict, float]:
    from vitrify.integrations.sglang import weights as sw

    t0 = time.perf_counter()
    fin = sw.update(call, tx, src, sock, **kw)
    return fin, time.perf_counter() - t0


def run(s: fe.Settings, a: argparse.Namespace) -> dict:
    import shutil

    import torch

    from vitrify.weights import transport as wt

    res: dict[str, Any] = {"checks": {}, "rows": [], "settings": vars(a)}
    os.makedirs(s.out, exist_ok=True)
    shutil.rmtree(s.work, ignore_errors=True)
    os.makedirs(s.work, mode=0o700)
    os.chmod(s.work, 0o700)  # LOAD unpacks JIT caches below it
    h = s.hicache()
    res["bundle"] = e2e.unpack_bundle(h)
    res["vitrify"] = e2e.ensure_vitrify(h)
    e2e.write_model(h)
    cfg = h.model_config
    prompts = e2e.make_prompts(s.seed, s.prompts, s.min_len, s.max_len)
    warm = e2e.make_prompts(s.seed + 500, s.warm_prompts, s.min_len, s.max_len)
    res["save"] = {}
    saved = fe.launch(s, "save", prompts, res["save"], warm=warm)
    if not res["save"].get("saved"):
        raise RuntimeError(f"SAVE wrote no archive: {res['save'].get('save_failed', 'no line')}")

    w1 = hf_weights(cfg, seed=1, device="cuda")
    src = trainer_tensors(w1, cfg)
    total = sum(t.numel() * t.element_size() for t in src.values())
    torch.cuda.synchronize()
    sock = os.path.join(s.work, "trainer.sock")
    call = lambda nt, lf: post_update(s.port, nt, lf)  # noqa: E731
    reports: dict[str, Any] = {}
    load_log = os.path.join(s.out, "sglang-load-weights.log")
    with e2e.Server(fe.server_args(s, "load"), load_env(s), load_log) as srv:
        res["ready_s_load"] = round(srv.wait_ready(s.port, s.ready_s), 1)
        before = run_prompts(s.port, prompts, s.max_new_tokens)
        txd = wt.Sender(direct=True, device=0)
        try:
            base_mem = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            tags = {n: 1 for n in src}
            first, first_s = timed(call, txd, src, sock, versions=tags, weight_version="w1")
            res["direct_trainer_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base_mem
            steps = []  # a trainer's next steps: every tag moved, the same tensors
            for k in range(2, 2 + a.repeats):
                tags = {n: k for n in src}
                steps.append(timed(call, txd, src, sock, versions=tags))
            direct, direct_s = min(steps, key=lambda fs: fs[1])
            name = "decoder.layers.3.mlp.linear_fc2.weight"
            keep = src[name].clone()
            src[name].add_(1)
            delta, delta_s = timed(call, txd, src, sock, versions={**tags, name: "changed"})
            src[name].copy_(keep)
            back, _ = timed(call, txd, src, sock, versions={**tags, name: "back"})
        finally:
            txd.close()
        txs = wt.Sender(a.chunk_mib << 20, device=0)  # a new sender: every tensor again
        try:
            staging_bytes = int(txs.staging.buffer.size)  # what the driver allocated
            base_mem = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            staged, staged_s = timed(call, txs, src, sock)
            res["staged_trainer_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base_mem
        finally:
            txs.close()
        after = run_prompts(s.port, prompts, s.max_new_tokens)
        # SGLang's own path for the same bytes: CUDA IPC tensors under its checkpoint names
        t0 = time.perf_counter()
        ok_own, msg_own = post_update(s.port, list(w1.items()), None)
        own_s = time.perf_counter() - t0
        after_own = run_prompts(s.port, prompts, s.max_new_tokens)
    for key, fin in (("first", first), *((f"step{i}", f) for i, (f, _) in enumerate(steps)),
                     ("delta", delta), ("revert", back), ("staged", staged)):
        reports[key] = fin.get("engine_report") or {}
    res["load_log_thawed"] = bool(fe.THAWED_LINE.search(Path(load_log).read_text(errors="replace")))

    ref = None
    if s.shape == "tiny":  # a cold server of W1 from its checkpoint (at 8B: 16 GB each way)
        from safetensors.torch import save_file

        w1_dir = os.path.join(s.work, "w1")
        os.makedirs(w1_dir, exist_ok=True)
        Path(w1_dir, "config.json").write_text(json.dumps(cfg, indent=1))
        save_file({n: t.contiguous().cpu() for n, t in w1.items()},
                  os.path.join(w1_dir, "model.safetensors"))
        with e2e.Server(w1_server_args(s, w1_dir), fe.server_env(s, "plain"),
                        os.path.join(s.out, "sglang-w1.log")) as srv:
            res["ready_s_w1"] = round(srv.wait_ready(s.port, s.ready_s), 1)
            ref = run_prompts(s.port, prompts, s.max_new_tokens)

    n = len(prompts)
    direct_reports = [reports[k] for k in reports if k not in ("staged",)]
    # every update's before and after against the first update's before: the parameters (the
    # same tensors at the same addresses) and the thawed graphs (count, captures, builds)
    ids = [x for r in reports.values() for x in (r.get("identity_before"), r.get("identity_after"))]
    graphs = [g for r in reports.values() for g in (r.get("graphs_before"), r.get("graphs_after"))]
    chunk = a.chunk_mib << 20
    changed = src[name].numel() * src[name].element_size()
    checks = {
        "load_thawed": res["load_log_thawed"],
        "thawed_tokens_equal_save": e2e.tokens_identical(before, saved),
        "thawed_logprobs_equal_save": e2e.logprob_diff(before, saved) == 0.0,
        "update_changed_tokens": same(before, after, "output_ids") < n,
        "direct_written_in_place": all(r.get("direct") is True for r in direct_reports),
        "weights_addresses_unchanged": all(r.get("weights_in_place") is True
                                           for r in reports.values()) and
        all(i is not None and i["addresses"] == ids[0]["addresses"] for i in ids),
        "graphs_unchanged": all(g is not None and g.get("graphs", 0) > 0 and g == graphs[0]
                                for g in graphs),
        "steady_steps_reused_the_plan": all(f.get("trainer_reused_plan") for f, _ in steps),
        "delta_moved_one_tensor": delta["tensors"] == 1 and delta["bytes_moved"] == changed,
        "revert_moved_one_tensor": back["tensors"] == 1,
        "staged_update_complete": staged["tensors"] == staged["tensors_total"],
        "staging_within_chunk_bytes": staging_bytes <= chunk,
        # the direct path has no staging: the trainer's extra memory is its tables and sums
        "direct_trainer_memory_within_chunk_bytes":
            res["direct_trainer_peak_extra_bytes"] <= chunk,
        "sglang_own_update_ok": ok_own,
        "sglang_own_update_same_tokens": e2e.tokens_identical(after_own, after),
        "sglang_own_update_same_logprobs": e2e.logprob_diff(after_own, after) == 0.0,
    }
    if ref is not None:
        checks["tokens_equal_w1_server"] = e2e.tokens_identical(after, ref)
        checks["logprobs_equal_w1_server"] = e2e.logprob_diff(after, ref) == 0.0
        res["prompts_equal_w1_server"] = same(after, ref, "output_ids")
        res["logprob_max_abs_diff_vs_w1_server"] = e2e.logprob_diff(after, ref)
    res["checks"] = checks
    res["prompts"] = n
    res["reports"] = reports
    res["first"], res["direct"], res["delta"], res["revert"], res["staged"] = (
        first, direct, delta, back, staged)
    res["direct_steps_s"] = [sec for _, sec in steps]
    res["staging_bytes"] = staging_bytes
    res["sglang_own_message"] = msg_own
    gbs = lambda sec: total / sec / 1e9  # noqa: E731
    median_s = statistics.median(res["direct_steps_s"])
    res["rows"] = [
        {"case": "vitrify direct, first (Triton compiles, plans)", "seconds": first_s,
         "GB/s": gbs(first_s)},
        {"case": "vitrify direct, steady (best)", "seconds": direct_s, "GB/s": gbs(direct_s)},
        {"case": f"vitrify direct, steady (median of {len(steps)})", "seconds": median_s,
         "GB/s": gbs(median_s)},
        {"case": "vitrify direct delta (one tensor)", "seconds": delta_s,
         "GB/s": delta["bytes_moved"] / delta_s / 1e9},
        {"case": f"vitrify staged ({a.chunk_mib} MiB)", "seconds": staged_s,
         "GB/s": gbs(staged_s)},
        {"case": "SGLang's own update_weights_from_tensor (CUDA IPC)", "seconds": own_s,
         "GB/s": gbs(own_s)},
    ]
    res["ratios"] = {"sglang_own_over_direct": own_s / direct_s,
                     "sglang_own_over_staged": own_s / staged_s,
                     "delta_bytes_fraction": delta["bytes_moved"] / delta["bytes_total"]}
    res["bytes"] = total
    res["ok"] = all(checks.values())
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(fe.SHAPE_SETTINGS), default="tiny")
    ap.add_argument("--bundle", default=".whl/sglang-site.tar.xz")
    ap.add_argument("--out", default=os.environ.get("OUT") or "build/sglang-weights-e2e")
    ap.add_argument("--work", default="/tmp/vitrify-sglang-weights")
    ap.add_argument("--port", type=int, default=30031)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="steady direct updates timed")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.prompts < 1:
        ap.error("--repeats and --prompts must be >= 1")
    s = settings(a)
    try:
        res = run(s, a)
    except Exception as e:  # what is known is still written
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "settings": vars(a)}
    path = e2e.resultlib.write(e2e.resultlib.result(NAME, **res), s.out)
    if res.get("rows"):
        e2e.resultlib.print_table(res["rows"], ["case", "seconds", "GB/s"])
    print(json.dumps(res.get("checks", {}), indent=1))
    print(f"ok={res['ok']} {res.get('error', '')}\nwrote {path}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
