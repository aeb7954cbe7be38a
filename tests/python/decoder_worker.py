"""FREEZE / THAW of a Llama-3-8B-shaped transformers decoder with a decode CUDA-graph ladder, in
fresh processes (tests/python/test_decoder_relocation_gpu.py; the relocation issue's proof).

    python decoder_worker.py freeze ARCHIVE CONFIG_JSON   # torch + transformers, writes ARCHIVE
    python decoder_worker.py thaw ARCHIVE BASE            # no torch: region at BASE, replay, compare

FREEZE: record kernel binaries -> region at ``base`` (null: the Region's default 0x600180000000;
the issue's 0x600000000000 makes every address's upper half 0x6000 = 24576 = 6 x 4096 =
24 x 1024, the value that broke relocated thaws) ->
``LlamaForCausalLM`` built in the region with random bf16 weights (checkpoint ``weights``) -> one
static KV cache, token buffer, position and logits buffer per batch size -> warmup -> one decode
graph per batch size (the pool in the region) -> reset the decode state -> dump the weights span
and the warmup gap, save the graphs -> replay every graph ``steps`` times: the reference tokens
and the SHA-256 of every step's logits bytes -> commit.

THAW (torch is never imported): region at BASE (the frozen base, or another one: relocation) ->
restore both spans -> load the graphs (relocated when BASE differs; graphs FREEZE marked
non-relocatable are refused and reported, never run) -> replay the same steps and compare tokens
and logits hashes, bit for bit. The last stdout line is JSON.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

from worker_result import report

ENGINE = "decoder-worker"
DEFAULT = {
    "base": None,
    "region_bytes": 24 << 30,
    "vocab": 128256, "hidden": 4096, "ffn": 14336, "layers": 32, "heads": 32, "kv_heads": 8,
    "batch_sizes": [1, 2, 4, 6, 8, 16, 24, 32],
    "max_len": 64, "steps": 8, "seed": 1234,
}
SPANS = ("weights", "warmup")


def _model_id(cfg: dict) -> str:
    return "llama-" + "-".join(f"{k}{cfg[k]}" for k in ("vocab", "hidden", "ffn", "layers",
                                                         "heads", "kv_heads"))


def _fingerprint(cfg: dict):
    from vitrify import archive as ar

    return ar.Fingerprint.current(engine=ENGINE, engine_version="1", model=_model_id(cfg))


def freeze(path: str, cfg: dict) -> dict:
    import vitrify.graph as tg

    tg.record_modules()  # before torch initialises CUDA
    t_start = time.perf_counter()
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    from vitrify import Region
    from vitrify import archive as ar
    from vitrify.integrations import torch as tt

    timings: dict[str, float] = {}
    region = Region(cfg["region_bytes"], base=cfg["base"])
    conf = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"],
                       intermediate_size=cfg["ffn"], num_hidden_layers=cfg["layers"],
                       num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                       max_position_embeddings=cfg["max_len"], rms_norm_eps=1e-5,
                       rope_theta=500000.0, tie_word_embeddings=False, initializer_range=0.02)
    conf._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    torch.manual_seed(cfg["seed"])
    torch.set_default_dtype(torch.bfloat16)
    with tt.region_allocations(region):
        with torch.device("cuda"):
            model = LlamaForCausalLM(conf)
        model.eval()
    torch.cuda.synchronize()
    weights_end = region.checkpoint("weights")
    timings["build_weights_s"] = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())

    bss = cfg["batch_sizes"]
    with tt.region_allocations(region):
        gen = torch.Generator(device="cuda").manual_seed(cfg["seed"] + 1)
        ids = {bs: torch.randint(0, cfg["vocab"], (bs, 1), device="cuda", generator=gen)
               for bs in bss}
        starts = {bs: ids[bs].clone() for bs in bss}
        pos = {bs: torch.zeros(1, dtype=torch.long, device="cuda") for bs in bss}
        logits = {bs: torch.zeros(bs, cfg["vocab"], dtype=torch.float32, device="cuda")
                  for bs in bss}
        caches = {bs: StaticCache(config=conf, max_cache_len=cfg["max_len"]) for bs in bss}

    @torch.no_grad()
    def step(bs):
        out = model(input_ids=ids[bs], past_key_values=caches[bs], cache_position=pos[bs],
                    use_cache=True)
        lg = out.logits[:, -1, :]
        logits[bs].copy_(lg)
        ids[bs].copy_(lg.argmax(-1, keepdim=True))
        pos[bs].add_(1)

    @torch.no_grad()
    def reset():
        for bs in bss:
            caches[bs].reset()
            pos[bs].zero_()
            ids[bs].copy_(starts[bs])
            logits[bs].zero_()

    t0 = time.perf_counter()
    with tt.region_allocations(region):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bs in bss:
                for _ in range(2):
                    step(bs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        reset()
        torch.cuda.synchronize()
    timings["warmup_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    store = tg.GraphStore(region=region)
    graphs = {}
    with tt.activated(region):
        for bs in bss:
            with store.capture(f"decode_bs{bs}", pool=tt.pool_id(region)) as cap:
                step(bs)
            graphs[bs] = cap.graph
    torch.cuda.synchronize()
    region.checkpoint("captured")
    timings["capture_s"] = time.perf_counter() - t0
    reset()
    torch.cuda.synchronize()
    final = region.offset

    reg = ar.Region(base=region.base, size=region.size, granularity=region.granularity,
                    checkpoints=dict(region.checkpoints))
    t0 = time.perf_counter()
    with ar.ArchiveWriter(path, _fingerprint(cfg), reg, overwrite=True) as w:
        w.dump_span(0, SPANS[0], region.base, 0, weights_end)
        w.dump_span(0, SPANS[1], region.base, weights_end, final)
        index = store.save_to_archive(w, rank=0)
        timings["dump_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        reference = {}
        for bs in bss:
            toks, hashes = [], []
            for _ in range(cfg["steps"]):
                graphs[bs].replay()
                torch.cuda.synchronize()
                toks.append([int(t) for t in ids[bs].flatten().tolist()])
                hashes.append(hashlib.sha256(
                    logits[bs].cpu().contiguous().numpy().tobytes()).hexdigest())
            reference[str(bs)] = {"tokens": toks, "logits_sha256": hashes}
        timings["reference_s"] = time.perf_counter() - t1
        w.write_state(0, {
            "config": cfg,
            "final_offset": final,
            "buffers": {str(bs): {"ids": [ids[bs].data_ptr() - region.base, bs * 8],
                                  "logits": [logits[bs].data_ptr() - region.base,
                                             bs * cfg["vocab"] * 4]} for bs in bss},
            "reference": reference,
        })
    timings["archive_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    return {"mode": "freeze", "archive": path, "base": region.base, "final_offset": final,
            "weights_bytes": weights_end, "params": n_params,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "graphs": [{k: g[k] for k in ("name", "nodes", "relocations", "relocations_by_kind",
                                          "relocatable", "unclassified", "integers_kept")}
                       for g in index["graphs"]],
            "templates": len(index["templates"]), "timings": timings}


def thaw(path: str, base: int) -> dict:
    t_start = time.perf_counter()
    import vitrify.graph as tg
    from vitrify import Region
    from vitrify import archive as ar

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    cfg = ar.open_archive(path).state(0)["config"]
    archive = ar.open_archive(path, expect=_fingerprint(cfg))
    state = archive.state(0)
    size = archive.manifest["region"]["size"]
    timings["open_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    region = Region(size, base=base)
    final = state["final_offset"]
    region.preallocate(final)
    if region.claim(final) != region.base:
        raise RuntimeError("the thawed region did not start at its base")
    for name in SPANS:
        archive.restore_span(0, name, region.base, final)
    timings["restore_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    graphs = tg.load_from_archive(archive, 0, region_base=region.base, unrelocatable="skip")
    graphs.wait_all()
    timings["graphs_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    mismatches, compared, logits_compared = [], 0, 0
    for bs_s, ref in state["reference"].items():
        if f"decode_bs{bs_s}" in graphs.skipped:
            continue
        b = state["buffers"][bs_s]
        for t in range(len(ref["tokens"])):
            graphs.replay(f"decode_bs{bs_s}", stream=0)
            graphs.synchronize()
            raw = region.read(region.base + b["ids"][0], b["ids"][1])
            toks = [int.from_bytes(raw[i:i + 8], "little", signed=True)
                    for i in range(0, len(raw), 8)]
            digest = hashlib.sha256(region.read(region.base + b["logits"][0],
                                                b["logits"][1])).hexdigest()
            compared += len(toks)
            logits_compared += 1
            if toks != ref["tokens"][t] or digest != ref["logits_sha256"][t]:
                mismatches.append({"batch_size": int(bs_s), "step": t,
                                   "tokens_equal": toks == ref["tokens"][t],
                                   "logits_equal": digest == ref["logits_sha256"][t]})
    timings["decode_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start
    bad = sorted({m["batch_size"] for m in mismatches})
    return {"mode": "thaw", "base": region.base, "frozen_base": archive.manifest["region"]["base"],
            "tokens_compared": compared, "logit_steps_compared": logits_compared,
            "identical": not mismatches, "batch_sizes_wrong": bad, "mismatches": mismatches[:8],
            "refused": graphs.skipped, "graph_stats": graphs.stats(), "timings": timings}


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]

    def run() -> dict:
        if mode == "freeze":
            cfg = dict(DEFAULT)
            if len(sys.argv) > 3:
                cfg.update(json.loads(sys.argv[3]))
            return freeze(path, cfg)
        return thaw(path, int(sys.argv[3], 0))

    return report(run)

if __name__ == "__main__":
    sys.exit(main())
