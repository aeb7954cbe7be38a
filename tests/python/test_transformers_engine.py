"""The transformers engine's own forward (vitrify.integrations.transformers: eager prefill into a
static cache row, batched decode steps against the static cache) against the model's own
transformers forward, on CPU in float32, for Llama- and Qwen2-shaped models; and its config's
validation. The freeze/thaw of the engine itself is a GPU test (test_transformers_engine_gpu.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vitrify.integrations import transformers as vtt  # noqa: E402


def _model(arch: str):
    cfg = vtt.EngineConfig(arch=arch, vocab=96, hidden=64, ffn=128, layers=3, heads=8,
                           kv_heads=2, max_len=40, batch_sizes=(1, 2, 4), init_std=0.2)
    eng = vtt.CausalLMEngine(cfg)
    torch.manual_seed(0)
    model = eng.hf_model("cpu").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # peaked logits, biases not zero
            p.normal_(0.0, 0.2 if "embed" not in name else 1.0)
    rot = model.model.rotary_emb
    weights = dict(model.named_parameters()) | {"model.rotary_emb.inv_freq": rot.inv_freq}
    return cfg, model, weights, vtt.Dims.of(cfg, float(rot.attention_scaling))


def _reference_next_logits(model, seq: list[int]):
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_and_batched_decode_match_the_models_own_forward(arch):
    cfg, model, W, dims = _model(arch)
    hd = cfg.hidden // cfg.heads
    shape = (cfg.max_batch, cfg.max_len, cfg.kv_heads, hd)
    k_cache = [torch.zeros(shape) for _ in range(cfg.layers)]
    v_cache = [torch.zeros(shape) for _ in range(cfg.layers)]
    prompts = vtt.prompts(3, seed=5, vocab=cfg.vocab, min_len=3, max_len=11)
    seqs = []
    with torch.no_grad():
        for row, p in enumerate(prompts):
            logits = vtt.prefill_forward(W, dims, k_cache, v_cache, row, torch.tensor(p))
            torch.testing.assert_close(logits, _reference_next_logits(model, p), rtol=1e-4,
                                       atol=1e-4)
            seqs.append(p + [int(logits.argmax())])
        # Decode the three rows together (plus a padding row of batch size 4) for 5 steps.
        bs = 4
        key_index = torch.arange(cfg.max_len)
        rows = torch.arange(bs)
        tokens = torch.tensor([s[-1] for s in seqs] + [0])
        positions = torch.tensor([len(s) - 1 for s in seqs] + [0])
        for _ in range(5):
            logits, nxt = vtt.decode_forward(W, dims, k_cache, v_cache, key_index, tokens,
                                             positions, rows)
            for r, s in enumerate(seqs):
                torch.testing.assert_close(logits[r], _reference_next_logits(model, s),
                                           rtol=1e-4, atol=1e-4)
                s.append(int(nxt[r]))
            tokens = nxt.clone()
            positions = positions + 1


def test_a_right_padded_batch_prefill_gives_each_prompt_its_own_forward():
    """The engine's prefill: prompts of different lengths in one right-padded batch give each
    prompt's own logits and the cache rows its own keys/values (padding beyond, unread)."""
    cfg, model, W, dims = _model("llama")
    hd = cfg.hidden // cfg.heads
    shape = (cfg.max_batch, cfg.max_len, cfg.kv_heads, hd)
    k_cache = [torch.zeros(shape) for _ in range(cfg.layers)]
    v_cache = [torch.zeros(shape) for _ in range(cfg.layers)]
    k_one = [torch.zeros(shape) for _ in range(cfg.layers)]
    v_one = [torch.zeros(shape) for _ in range(cfg.layers)]
    prompts = vtt.prompts(3, seed=7, vocab=cfg.vocab, min_len=2, max_len=11)
    assert len({len(p) for p in prompts}) > 1  # the batch really is padded
    n = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (n - len(p)) for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        logits = vtt.prefill_batch_forward(W, dims, k_cache, v_cache, 1, ids, lengths)
        for b, p in enumerate(prompts):
            torch.testing.assert_close(logits[b], _reference_next_logits(model, p), rtol=1e-4,
                                       atol=1e-4)
            vtt.prefill_forward(W, dims, k_one, v_one, 1 + b, torch.tensor(p))
            for i in range(cfg.layers):
                torch.testing.assert_close(k_cache[i][1 + b, :len(p)], k_one[i][1 + b, :len(p)])
                torch.testing.assert_close(v_cache[i][1 + b, :len(p)], v_one[i][1 + b, :len(p)])
        assert not k_cache[0][0].any() and not v_cache[0][0].any()  # the row before, untouched
        # decode after the padded prefill (rows 1..3, plus an idle row 0): the padding's keys and
        # values beyond each prompt are masked, then overwritten
        seqs = [p + [int(logits[b].argmax())] for b, p in enumerate(prompts)]
        key_index = torch.arange(cfg.max_len)
        rows = torch.arange(4)
        tokens = torch.tensor([0] + [s[-1] for s in seqs])
        positions = torch.tensor([0] + [len(s) - 1 for s in seqs])
        for _ in range(4):
            out, nxt = vtt.decode_forward(W, dims, k_cache, v_cache, key_index, tokens,
                                          positions, rows)
            for b, s in enumerate(seqs):
                torch.testing.assert_close(out[1 + b], _reference_next_logits(model, s),
                                           rtol=1e-4, atol=1e-4)
                s.append(int(nxt[1 + b]))
            tokens, positions = nxt.clone(), positions + 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_param_specs_are_exactly_the_transformers_models_tensors(arch):
    """What THAW allocates without transformers is what transformers builds at FREEZE."""
    cfg = vtt.EngineConfig(arch=arch, vocab=96, hidden=64, ffn=128, layers=3, heads=8,
                           kv_heads=2, max_len=40, batch_sizes=(1, 2, 4))
    eng = vtt.CausalLMEngine(cfg)
    meta = eng.hf_model("meta")
    eng.check_specs(meta)  # raises on any difference
    names = [n for n, _, _ in vtt.param_specs(cfg)]
    assert len(names) == len(set(names))
    assert set(names) - {"model.rotary_emb.inv_freq"} == {n for n, _ in meta.named_parameters()}
    with pytest.raises(RuntimeError, match="transformers builds another"):
        vtt.CausalLMEngine(vtt.EngineConfig(arch=arch, vocab=96, hidden=64, ffn=256, layers=3,
                                            heads=8, kv_heads=2, max_len=40,
                                            batch_sizes=(1,))).check_specs(meta)


def test_rotary_equals_transformers_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    half = torch.randn(2, 5, 8)
    cos, sin = half.cos(), half.sin()
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    want_q, want_k = apply_rotary_pos_emb(q, k, full_cos, full_sin)
    assert torch.equal(vtt.rotary(q, cos[:, None], sin[:, None]), want_q)
    assert torch.equal(vtt.rotary(k, cos[:, None], sin[:, None]), want_k)


def test_config_validation_is_one_line_errors():
    with pytest.raises(ValueError, match="variant"):
        vtt.EngineConfig(variant="fast")
    with pytest.raises(ValueError, match="must divide"):
        vtt.EngineConfig(hidden=100, heads=32)
    with pytest.raises(ValueError, match="ascending and unique"):
        vtt.EngineConfig(batch_sizes=(4, 2))
    cfg = vtt.EngineConfig()
    assert len(cfg.batch_sizes) >= 32 and cfg.max_batch == 256
    assert vtt.EngineConfig.from_dict(cfg.to_dict()) == cfg
    assert "compiled" in vtt.EngineConfig(variant="compiled").model_id()
    with pytest.raises(TypeError, match="EngineConfig"):
        vtt.CausalLMEngine({"hidden": 64})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_trainer_layout_maps_back_onto_the_engines_weights(arch):
    """megatron_tensors (what a trainer streams) agrees with the independent reference of
    test_weight_mapping, and update_mapping brings it back onto the engine's names bit for bit."""
    from test_weight_mapping import megatron_reference, specs

    from vitrify.weights import mapping as wm

    cfg = vtt.EngineConfig(arch=arch, vocab=50, hidden=64, ffn=96, layers=2, heads=8,
                           kv_heads=2, max_len=32, batch_sizes=(1, 2))
    g = torch.Generator().manual_seed(5)
    w = {n: torch.randn(shape, generator=g).to(getattr(torch, dt))
         for n, shape, dt in vtt.param_specs(cfg)}
    src = vtt.megatron_tensors(w, cfg)
    ref = megatron_reference(w, cfg.layers, cfg.heads, cfg.kv_heads, bias=arch == "qwen2")
    assert set(src) == set(ref)
    for n in ref:
        assert torch.equal(src[n], ref[n]), n
    back = {n: torch.zeros_like(t) for n, t in w.items()}
    plan = vtt.update_mapping(cfg).plan(specs(src), specs(back))
    for n, t in src.items():
        for c in plan.for_source(n):
            wm.copy(c, t, back[c.dst])
    for n, t in w.items():
        if not n.endswith("inv_freq"):
            assert torch.equal(back[n], t), n
