"""vitrify's weight update into a real SGLang 0.5.17 server thawed by vitrify, through SGLang's own
``/update_weights_from_tensor`` route (GPU machine, the carried bundle; issue: colocated weight
update, its SGLang part).

    python3 -m vitrify.bench.sglang.weights_e2e --bundle .whl/sglang-site.tar.xz --out DIR

(``benchmarks/sglang_weights_e2e.py`` runs the same from a checkout.) A server with weights W0
(the seeded checkpoint of :mod:`.checkpoint`, seed 0) is frozen (plugin mode "save", as
:mod:`.freeze_e2e` does) and thawed in a fresh process (mode "load", ``weight_updates = true``:
the region's memory is created exportable). This process is the trainer: it holds W1 (the same
writer's tensors of seed 1) in the Megatron-style layout on the GPU and updates the thawed
server with ``load_format="vitrify"``:

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
rebuilt" is checked, not assumed. A third server (tiny shape) loads W1 from its checkpoint cold:
the updated server's tokens and logprobs must equal it.

Every launch runs with ``--enable-deterministic-inference`` by default (``--no-deterministic``):
the updated thawed server against a cold one crosses from one process's kernels to another's.
``oracle_power``: the pair (two prompts sharing only their last token) must give different
answers in SAVE and in the updated server, and one weight moved one ulp (SGLang's own update
route, after W1 is in) must change the four longest prompts' answers against the updated
server's own, and restoring it must bring them back.

Writes DIR/sglang-weights-e2e-<date>-<commit>.json and the servers' logs. About 4 minutes on a
fresh machine at the tiny shape (three launches). ``--shape 8b`` (Qwen3-8B's shape, 16 GB) skips
the W1 checkpoint server (16 GB written and read back) and checks the vitrify-updated tokens
against SGLang's own update of the same W1 instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import resultlib
from . import checkpoint, freeze_e2e as fe, harness, oracle
from .harness import Weights, compare, flush_cache, generate

NAME = "sglang-weights-e2e"
SHAPES = ("tiny", "8b")  # Qwen3: the trainer's layout has q_norm / k_norm


def trainer_tensors(w: dict, cfg: dict) -> dict:
    """W in the Megatron-style layout (what vitrify's sender streams)."""
    from vitrify.weights.mapping import megatron_layout

    return {n: t.contiguous() for n, t in megatron_layout(
        w, layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"], qk_norm=True).items()}


def run_prompts(port: int, prompts: list, max_new: int) -> list[dict]:
    return [generate(port, ids, max_new) for ids in prompts]


def same(a: list[dict], b: list[dict], key: str) -> int:
    return sum(x[key] == y[key] for x, y in zip(a, b))


def settings(a: argparse.Namespace) -> fe.Settings:
    """The freeze run's settings for this shape (SAVE and LOAD launch as it launches them), LOAD
    with the plugin's weight updates on (the region made exportable)."""
    return replace(fe.Settings(**fe.SHAPE_SETTINGS[a.shape]), shape=a.shape,
                   bundle=os.path.abspath(a.bundle), out=os.path.abspath(a.out), work=a.work,
                   port=a.port, prompts=a.prompts, scenarios=fe.CORE,
                   deterministic=getattr(a, "deterministic", True),
                   models_root=getattr(a, "models_root", fe.Settings.models_root),
                   extra_plugin_toml={"load": "weight_updates = true\n"})


def w1_settings(s: fe.Settings) -> fe.Settings:
    """The reference server: the plain launch's settings with W1's checkpoint (seed 1)."""
    return replace(s, weights=Weights(seed=1))


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
    res["bundle"] = harness.unpack_bundle(s.bundle, s.site, s.python)
    res["vitrify"] = harness.vitrify_origin(s.python)
    cfg = s.model_config
    res["weights"] = harness.write_model(s.model_dir, cfg, s.weights)
    prompts = harness.make_prompts(s.seed, s.prompts, s.min_len, s.max_len)
    warm = harness.make_prompts(s.seed + 500, s.warm_prompts, s.min_len, s.max_len)
    pair = list(oracle.last_token_pair(s.seed + 900, s.pair_len))
    res["save"] = {}
    saved = fe.launch(s, "save", prompts, res["save"], warm=warm, pair=pair)
    if not res["save"].get("saved"):
        raise RuntimeError(f"SAVE wrote no archive: {res['save'].get('save_failed', 'no line')}")
    pairs = [res["save"]["pair"]]

    w1 = checkpoint.tensors(cfg, seed=1, device="cuda")
    src = trainer_tensors(w1, cfg)
    total = sum(t.numel() * t.element_size() for t in src.values())
    torch.cuda.synchronize()
    sock = os.path.join(s.work, "trainer.sock")
    call = lambda nt, lf: harness.post_update(s.port, nt, lf)  # noqa: E731
    reports: dict[str, Any] = {}
    load_log = os.path.join(s.out, "sglang-load-weights.log")
    subset = fe.fault_subset(prompts)
    with harness.Server(fe.server_args(s, "load"), fe.server_env(s, "load"), load_log) as srv:
        res["ready_s_load"] = round(srv.wait_ready(s.port, s.ready_s), 1)
        res["deterministic_load"] = srv.deterministic
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
        flush_cache(s.port)
        after = run_prompts(s.port, prompts, s.max_new_tokens)
        pr = run_prompts(s.port, pair, s.max_new_tokens)
        pairs.append(oracle.pair_power(pr[0], pr[1], "load (W1 by vitrify)"))

        def rerun() -> list[dict]:
            flush_cache(s.port)
            return run_prompts(s.port, [prompts[i] for i in subset], s.max_new_tokens)

        fname, clean = fe.fault_tensor(s)
        fault = oracle.weight_ulp_fault(lambda nt: harness.post_update(s.port, nt, None), rerun,
                                        [after[i] for i in subset], name=fname, clean=clean,
                                        where="after vitrify's update")
        # SGLang's own path for the same bytes: CUDA IPC tensors under its checkpoint names
        t0 = time.perf_counter()
        ok_own, msg_own = harness.post_update(s.port, list(w1.items()), None)
        own_s = time.perf_counter() - t0
        flush_cache(s.port)
        after_own = run_prompts(s.port, prompts, s.max_new_tokens)
    for key, fin in (("first", first), *((f"step{i}", f) for i, (f, _) in enumerate(steps)),
                     ("delta", delta), ("revert", back), ("staged", staged)):
        reports[key] = fin.get("engine_report") or {}
    res["load_log_thawed"] = bool(harness.THAWED_LINE.search(
        Path(load_log).read_text(errors="replace")))

    ref = None
    det_ref = None
    if s.shape == "tiny":  # a cold server of W1 from its checkpoint (at 8B: 16 GB each way)
        w1s = w1_settings(s)
        res["w1_weights"] = harness.write_model(w1s.model_dir, cfg, w1s.weights)
        with harness.Server(fe.server_args(w1s, "plain"), fe.server_env(w1s, "plain"),
                            os.path.join(s.out, "sglang-w1.log")) as srv:
            res["ready_s_w1"] = round(srv.wait_ready(s.port, s.ready_s), 1)
            det_ref = srv.deterministic
            ref = run_prompts(s.port, prompts, s.max_new_tokens)

    n = len(prompts)
    direct_reports = [reports[k] for k in reports if k not in ("staged",)]
    # every update's before and after against the first update's before: the parameters (the
    # same tensors at the same addresses) and the thawed graphs (count, captures, builds)
    ids = [x for r in reports.values() for x in (r.get("identity_before"), r.get("identity_after"))]
    graphs = [g for r in reports.values() for g in (r.get("graphs_before"), r.get("graphs_after"))]
    chunk = a.chunk_mib << 20
    changed = src[name].numel() * src[name].element_size()
    det_save, det_load = bool(res["save"].get("deterministic")), bool(res["deterministic_load"])
    comparisons = [
        compare("thawed_tokens_equal_save", before, saved, launches=("load", "save"),
                deterministic=(det_load, det_save), crosses=False, logprobs=False),
        compare("thawed_logprobs_equal_save", before, saved, launches=("load", "save"),
                deterministic=(det_load, det_save), crosses=False),
        compare("sglang_own_update_same_tokens", after_own, after, launches=("load", "load"),
                deterministic=(det_load, det_load), crosses=False, logprobs=False),
        compare("sglang_own_update_same_logprobs", after_own, after, launches=("load", "load"),
                deterministic=(det_load, det_load), crosses=False),
    ]
    if ref is not None:
        comparisons += [
            compare("tokens_equal_w1_server", after, ref, launches=("load", "w1"),
                    deterministic=(det_load, det_ref), crosses=True, logprobs=False),
            compare("logprobs_equal_w1_server", after, ref, launches=("load", "w1"),
                    deterministic=(det_load, det_ref), crosses=True)]
    checks = {
        "load_thawed": res["load_log_thawed"],
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
    }
    harness.fold(comparisons, checks)
    if ref is not None:
        res["prompts_equal_w1_server"] = same(after, ref, "output_ids")
        res["logprob_max_abs_diff_vs_w1_server"] = harness.logprob_diff(after, ref)
    res["checks"] = checks
    res["comparisons"] = comparisons
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
    res["ok"] = all(v for v in checks.values() if isinstance(v, bool))
    res["oracle_power"] = oracle.power(pairs, fault, res["weights"])
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m vitrify.bench.sglang.weights_e2e",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="tiny")
    ap.add_argument("--bundle", default=".whl/sglang-site.tar.xz")
    ap.add_argument("--out", default=os.environ.get("OUT") or "build/sglang-weights-e2e")
    ap.add_argument("--work", default="/tmp/vitrify-sglang-weights")
    ap.add_argument("--models-root", default=fe.Settings.models_root,
                    help="where <shape>-seed<seed> (config and checkpoint) is written and kept")
    ap.add_argument("--port", type=int, default=30031)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="steady direct updates timed")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                    help="--enable-deterministic-inference on every launch (default on: the "
                         "updated server is compared with a cold one)")
    ap.add_argument("--dry-run", action="store_true", help="print the server command lines")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.prompts < 2:
        ap.error("--repeats must be >= 1 and --prompts >= 2")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    s = settings(a)
    if a.dry_run:
        os.makedirs(s.work, exist_ok=True)
        for sc, ss in (("save", s), ("load", s), ("w1", w1_settings(s))):
            env = fe.server_env(ss, "plain" if sc == "w1" else sc, probe=False)
            print(f"# {sc}: VITRIFY_SGLANG_CONFIG={env.get('VITRIFY_SGLANG_CONFIG', '')}")
            print(" ".join(fe.server_args(ss, "plain" if sc == "w1" else sc)))
        return 0
    try:
        res = run(s, a)
    except Exception as e:  # what is known is still written
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "settings": vars(a),
               "oracle_power": oracle.power([], None)}
    ok, op = res.pop("ok"), res.pop("oracle_power")
    out = harness.result(NAME, ok=ok, oracle_power=op, **res)
    path = harness.write(out, s.out)
    if out.get("rows"):
        resultlib.print_table(out["rows"], ["case", "seconds", "GB/s"])
    print(json.dumps(out.get("checks", {}), indent=1))
    print(f"  oracle_power: ok={op.get('ok')} {'; '.join(op.get('why', []))}")
    print(f"ok={out['ok']} {out.get('error', '')}\nwrote {path}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
