"""vitrify.weights.mapping on CPU with torch: a Megatron-style checkpoint (fused, GQA-interleaved
``linear_qkv``, fused ``linear_fc1``, norms inside the fused linears) built from an engine's
tensors by a reference written with ``torch.cat``, mapped back through the planned copies, gives
the engine's tensors bit for bit (separate names, SGLang's fused names, a cast, Qwen2's biases);
and every misfit is refused before a byte moves, naming the tensor."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vitrify.weights import mapping as wm  # noqa: E402
from vitrify.weights.mapping import MappingError, Move, Rows, Rule  # noqa: E402


def engine_tensors(layers=2, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=100, bias=False,
                   dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32).to(dtype)  # noqa: E731
    t = {"model.embed_tokens.weight": r(vocab, hidden), "lm_head.weight": r(vocab, hidden),
         "model.norm.weight": r(hidden), "model.rotary_emb.inv_freq": r(hd // 2)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = r(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = r(kv_heads * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = r(kv_heads * hd, hidden)
        if bias:
            for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                t[p + f"self_attn.{x}_proj.bias"] = r(n * hd)
        t[p + "self_attn.o_proj.weight"] = r(hidden, heads * hd)
        t[p + "mlp.gate_proj.weight"] = r(ffn, hidden)
        t[p + "mlp.up_proj.weight"] = r(ffn, hidden)
        t[p + "mlp.down_proj.weight"] = r(hidden, ffn)
        t[p + "input_layernorm.weight"] = r(hidden)
        t[p + "post_attention_layernorm.weight"] = r(hidden)
    return t


def megatron_reference(t, layers, heads, kv_heads, bias=False):
    """The trainer's layout, written independently of the mapping: per KV group, its query heads,
    its key head, its value head; gate rows then up rows."""
    hd = t["model.layers.0.self_attn.k_proj.weight"].shape[0] // kv_heads
    per = heads // kv_heads
    out = {"embedding.word_embeddings.weight": t["model.embed_tokens.weight"],
           "output_layer.weight": t["lm_head.weight"],
           "decoder.final_layernorm.weight": t["model.norm.weight"]}
    for i in range(layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for suffix in ("weight", "bias") if bias else ("weight",):
            q, k, v = (t[p + f"self_attn.{x}_proj.{suffix}"] for x in "qkv")
            blocks = []
            for grp in range(kv_heads):
                blocks += [q[grp * per * hd:(grp + 1) * per * hd], k[grp * hd:(grp + 1) * hd],
                           v[grp * hd:(grp + 1) * hd]]
            out[m + f"self_attention.linear_qkv.{suffix}"] = torch.cat(blocks)
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = t[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_proj.weight"] = t[p + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([t[p + "mlp.gate_proj.weight"],
                                                     t[p + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc1.layer_norm_weight"] = t[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc2.weight"] = t[p + "mlp.down_proj.weight"]
    return out


def fused_engine(t, layers):
    """SGLang's names: qkv_proj = all q rows, all k rows, all v rows; gate_up_proj."""
    out = {k: v for k, v in t.items() if not any(
        s in k for s in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))}
    for i in range(layers):
        p = f"model.layers.{i}."
        for suffix in ("weight", "bias"):
            if p + f"self_attn.q_proj.{suffix}" in t:
                out[p + f"self_attn.qkv_proj.{suffix}"] = torch.cat(
                    [t[p + f"self_attn.{x}_proj.{suffix}"] for x in "qkv"])
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([t[p + "mlp.gate_proj.weight"],
                                                        t[p + "mlp.up_proj.weight"]])
    return out


def specs(tensors):
    return {n: (tuple(x.shape), str(x.dtype).removeprefix("torch.")) for n, x in tensors.items()}


def apply(m, src, want, dtype=None):
    """Plan against ``want``'s specs, copy into zeroed tensors, return them."""
    dst = {n: torch.zeros_like(x, dtype=dtype or x.dtype) for n, x in want.items()}
    plan = m.plan(specs(src), specs(dst))
    for name, x in src.items():
        for c in plan.for_source(name):
            wm.copy(c, x, dst[c.dst])
    return dst, plan


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_megatron_layout_maps_back_to_the_engine_bit_for_bit(bias):
    eng = engine_tensors(bias=bias)
    src = megatron_reference(eng, 2, 8, 2, bias=bias)
    m = wm.megatron_llama(heads=8, kv_heads=2, head_dim=8, qkv_bias=bias)
    got, plan = apply(m, src, eng)
    for name, x in eng.items():
        if name.endswith("inv_freq"):  # kept: no trainer holds it
            assert not got[name].any()
            continue
        assert torch.equal(got[name], x), name
    # linear_qkv makes three moves (q, k, v), linear_fc1 two (gate, up).
    assert len(plan.for_source("decoder.layers.1.self_attention.linear_qkv.weight")) == 3
    assert len(plan.for_source("decoder.layers.0.mlp.linear_fc1.weight")) == 2


def test_megatron_layout_maps_onto_sglangs_fused_names():
    eng = engine_tensors(bias=True)
    want = fused_engine(eng, 2)
    src = megatron_reference(eng, 2, 8, 2, bias=True)
    got, _ = apply(wm.megatron_llama(heads=8, kv_heads=2, head_dim=8, qkv_bias=True,
                                     engine="fused"), src, want)
    for name, x in want.items():
        if not name.endswith("inv_freq"):
            assert torch.equal(got[name], x), name


def test_the_copy_casts_to_the_engines_dtype():
    eng = engine_tensors()
    src = megatron_reference(eng, 2, 8, 2)
    got, _ = apply(wm.megatron_llama(heads=8, kv_heads=2, head_dim=8), src, eng,
                   dtype=torch.bfloat16)
    q = got["model.layers.1.self_attn.q_proj.weight"]
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, eng["model.layers.1.self_attn.q_proj.weight"].to(torch.bfloat16))


@settings(max_examples=25, deadline=None)
@given(kv_heads=st.integers(1, 4), per=st.integers(1, 4), hd=st.sampled_from([2, 4, 6]),
       fused=st.booleans())
def test_any_gqa_shape_round_trips(kv_heads, per, hd, fused):
    heads = kv_heads * per
    eng = engine_tensors(layers=1, hidden=heads * hd, heads=heads, kv_heads=kv_heads, ffn=10,
                         vocab=7, bias=True, seed=kv_heads * 100 + per * 10 + hd)
    want = fused_engine(eng, 1) if fused else eng
    src = megatron_reference(eng, 1, heads, kv_heads, bias=True)
    got, _ = apply(wm.megatron_llama(heads=heads, kv_heads=kv_heads, head_dim=hd, qkv_bias=True,
                                     engine="fused" if fused else "separate"), src, want)
    for name, x in want.items():
        if not name.endswith("inv_freq"):
            assert torch.equal(got[name], x), name


def test_a_wrong_group_count_is_refused_naming_the_tensor_and_the_rows():
    eng = engine_tensors()  # 2 KV heads
    src = megatron_reference(eng, 2, 8, 2)
    m = wm.megatron_llama(heads=8, kv_heads=4, head_dim=8)  # the trainer says 4
    with pytest.raises(MappingError, match=r"linear_qkv\.weight.*4 groups of 32 rows need 128 "
                                           r"rows from row 0, there are 96"):
        m.plan(specs(src), specs(eng))


def test_a_trainer_with_more_kv_heads_is_a_mis_split_not_a_partial_copy():
    # 8 heads in 4 KV groups on the trainer, 2 in the engine: the engine's rows would all be
    # covered from the first 96 of 128 rows of linear_qkv; the rest going nowhere is refused.
    src = megatron_reference(engine_tensors(kv_heads=4), 2, 8, 4)
    m = wm.megatron_llama(heads=8, kv_heads=2, head_dim=8)
    with pytest.raises(MappingError, match=r"linear_qkv\.weight': rows 96\.\. of 128 go nowhere"):
        m.plan(specs(src), specs(engine_tensors()))
    # rows dropped on purpose (a padded vocabulary) need a partial rule
    pad = wm.Mapping((Rule("emb", (Move("e", Rows(length=5, stride=8)),), partial=True),))
    pad.plan({"emb": ((8, 2), "float32")}, {"e": ((5, 2), "float32")})
    with pytest.raises(MappingError, match="'emb': rows 5.. of 8 go nowhere"):
        wm.Mapping((Rule("emb", (Move("e", Rows(length=5, stride=8)),)),)).plan(
            {"emb": ((8, 2), "float32")}, {"e": ((5, 2), "float32")})
    # a source copied to two destinations (tied embeddings) is fine
    tied = wm.Mapping((Rule("e", (Move("a"), Move("b"))),))
    tied.plan({"e": ((4, 2), "float32")}, {"a": ((4, 2), "float32"), "b": ((4, 2), "float32")})


def test_unmapped_sources_and_uncovered_engine_tensors_are_named():
    eng = engine_tensors()
    src = megatron_reference(eng, 2, 8, 2)
    m = wm.megatron_llama(heads=8, kv_heads=2, head_dim=8)
    extra = dict(src, **{"decoder.layers.0.self_attention.core.extra_state": torch.zeros(3)})
    with pytest.raises(MappingError, match="extra_state.*matches no rule"):
        m.plan(specs(extra), specs(eng))
    ignoring = wm.Mapping(m.rules, ignore=(r".*\._extra_state|.*extra_state",), keep=m.keep)
    ignoring.plan(specs(extra), specs(eng))  # listed in ignore: fine
    more = dict(eng, **{"model.layers.0.self_attn.q_norm.weight": torch.zeros(8)})
    with pytest.raises(MappingError, match="q_norm.weight"):
        m.plan(specs(src), specs(more))
    less = {k: v for k, v in src.items() if k != "decoder.layers.1.mlp.linear_fc2.weight"}
    with pytest.raises(MappingError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        m.plan(specs(less), specs(eng))


def test_overlaps_gaps_and_other_dimensions_are_refused():
    dst = {"w": ((6, 4), "float32")}
    twice = wm.Mapping((Rule("a", (Move("w", Rows(), Rows(part=0, parts=2)),)),
                        Rule("b", (Move("w", Rows(), Rows(start=2, length=3, stride=3)),))))
    with pytest.raises(MappingError, match="'w': rows 2..5 from 'b' overlap"):
        twice.plan({"a": ((3, 4), "float32"), "b": ((3, 4), "float32")}, dst)
    gap = wm.Mapping((Rule("a", (Move("w", Rows(), Rows(part=0, parts=2)),)),))
    with pytest.raises(MappingError, match="'w': rows 3..6 get nothing"):
        gap.plan({"a": ((3, 4), "float32")}, dst)
    with pytest.raises(MappingError,
                       match=r"dimensions other than the rows differ \(\[5\] vs \[4\]\)"):
        gap.plan({"a": ((3, 5), "float32")}, dst)
    with pytest.raises(MappingError, match="do not cut into 2 equal parts"):
        wm.Mapping((Rule("a", (Move("w", Rows(part=1, parts=2)),)),)).plan(
            {"a": ((5, 4), "float32")}, {"w": ((2, 4), "float32")})
    with pytest.raises(MappingError, match="names 'i'"):
        wm.Mapping((Rule("a", (Move("w{i}"),)),)).plan({"a": ((6, 4), "float32")}, dst)
    with pytest.raises(MappingError, match="not a regular expression"):
        Rule("(", (Move("w"),))
    with pytest.raises(MappingError, match="multiple of kv_heads"):
        wm.megatron_llama(heads=6, kv_heads=4, head_dim=8)


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_megatron_layout_is_the_independent_reference(bias):
    t = engine_tensors(bias=bias, seed=9)
    want = megatron_reference(t, 2, 8, 2, bias=bias)
    got = wm.megatron_layout(t, layers=2, heads=8, kv_heads=2, qkv_bias=bias)
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_qwen3_qk_norms_map_both_ways():
    t = engine_tensors(seed=10)
    for i in range(2):
        t[f"model.layers.{i}.self_attn.q_norm.weight"] = torch.randn(8)
        t[f"model.layers.{i}.self_attn.k_norm.weight"] = torch.randn(8)
    src = wm.megatron_layout(t, layers=2, heads=8, kv_heads=2, qk_norm=True)
    m = wm.megatron_llama(heads=8, kv_heads=2, head_dim=8, qk_norm=True, engine="fused")
    dst, _ = apply(m, src, fused_engine(t, 2))
    want = fused_engine(t, 2)
    assert all(torch.equal(dst[n], want[n]) for n in want if not n.endswith("inv_freq"))


@pytest.mark.parametrize("src, message", [
    ({"a": (4,)}, r"src\['a'\] must be a pair \(shape, dtype\), got tuple \(4,\)"),
    ({"a": 5}, r"src\['a'\] must be a pair \(shape, dtype\), got int 5"),
    ({"a": None}, r"src\['a'\] must be a pair \(shape, dtype\), got NoneType None"),
    ({"a": ("4x4", "bf16")}, r"src\['a'\]: the shape must be a sequence of ints, got str"),
    ({"a": ((4, -1), "bf16")}, r"src\['a'\]: a dimension must be an int in \[0, \d+\], got -1"),
    ({"a": ((4, 2.0), "bf16")}, r"src\['a'\]: a dimension must be an int .*got float 2.0"),
    ({"a": ((4,), None)}, r"src\['a'\]: the dtype must be a name such as 'bfloat16'"),
    ({3: ((4,), "bf16")}, r"src: tensor names must be str, got int 3"),
    ([("a", ((4,), "bf16"))], r"src must be a mapping of tensor name to \(shape, dtype\), got list"),
])
def test_a_malformed_spec_is_one_line_naming_the_argument(src, message):
    """issue 32: "too many values to unpack" / AttributeError became one line naming the
    argument, the tensor and what was received."""
    m = wm.Mapping((Rule("a", (Move("b"),)),))
    with pytest.raises(ValueError, match=message) as e:
        m.plan(src, {"b": ((4,), "bf16")})
    assert "\n" not in str(e.value)


def test_a_malformed_destination_spec_names_dst():
    m = wm.Mapping((Rule("a", (Move("b"),)),))
    with pytest.raises(ValueError, match=r"dst\['b'\] must be a pair"):
        m.plan({"a": ((4,), "bf16")}, {"b": "oops"})
