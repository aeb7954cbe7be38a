"""vitrify.weights.stream on CPU with torch: a Megatron-style checkpoint streamed through a staging
buffer far smaller than the model (tensors grouped by dtype, cut between rows, chunks bounded and
aligned), applied in place to a bf16 engine through the planned mapping, gives the engine's
tensors bit for bit; a corrupted chunk is refused before anything is copied."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_weight_mapping import engine_tensors, megatron_reference, specs  # noqa: E402
from vitrify.weights import mapping as wm  # noqa: E402
from vitrify.weights import stream as ws  # noqa: E402
from vitrify.weights.mapping import MappingError, Move, Rows, Rule  # noqa: E402


def stream(src, engine, mapping, chunk_bytes, corrupt=None):
    """Sender and receiver in one process: one staging buffer of ``chunk_bytes``."""
    plan = mapping.plan(specs(src), specs(engine))
    chunks = ws.plan_chunks(specs(src), chunk_bytes)
    staging = torch.zeros(chunk_bytes, dtype=torch.uint8)
    copies = 0
    for ch in chunks:
        sent = ws.fill(ch, src, staging)
        if corrupt is not None and ch.index == corrupt:
            staging[ch.nbytes // 2] ^= 1
        copies += ws.apply(ch, plan, staging, engine, sent)
    return chunks, copies


def test_plan_chunks_bounds_aligns_groups_by_dtype_and_covers_every_row_once():
    src = {"a": ((10, 3), "float32"), "b": ((5,), "bfloat16"), "c": ((7, 4), "float32"),
           "d": ((2, 2), "bfloat16")}
    chunks = ws.plan_chunks(src, chunk_bytes=512, align=64)
    seen: dict[str, list[tuple[int, int]]] = {}
    for ch in chunks:
        assert ch.nbytes <= 512
        ends = 0
        for e in ch.entries:
            assert e.offset % 64 == 0 and e.offset >= ends
            ends = e.offset + e.nbytes
            seen.setdefault(e.name, []).append((e.row0, e.row1))
        assert len({e.dtype for e in ch.entries}) <= 2
    order = [e.name for ch in chunks for e in ch.entries]
    assert order.index("c") < order.index("b")  # float32 tensors first, then bfloat16
    for name, (shape, _) in src.items():
        spans = sorted(seen[name])
        assert spans[0][0] == 0 and spans[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    with pytest.raises(MappingError, match="one row of 'wide'.*does not fit chunk_bytes=512"):
        ws.plan_chunks({"wide": ((2, 200), "float32")}, 512)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 24 << 10, 4096])
def test_streamed_update_equals_the_reference_bit_for_bit(chunk_bytes):
    ref = engine_tensors(bias=True)
    src = megatron_reference(ref, 2, 8, 2, bias=True)  # float32, as a trainer holds them
    engine = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in ref.items()}
    m = wm.megatron_llama(heads=8, kv_heads=2, head_dim=8, qkv_bias=True)
    chunks, copies = stream(src, engine, m, chunk_bytes)
    total = sum(math.prod(s) * 4 for s, _ in specs(src).values())
    assert len(chunks) >= total // chunk_bytes
    cut = [n for n in src if sum(e.name == n for ch in chunks for e in ch.entries) > 1]
    if chunk_bytes == 4096:  # linear_qkv (96 x 64 floats) and the embeddings are cut
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in cut
    for name, t in ref.items():
        if not name.endswith("inv_freq"):
            assert torch.equal(engine[name], t.to(torch.bfloat16)), name
    assert copies >= len(m.plan(specs(src), specs(engine)).copies)


def test_a_move_along_another_dimension_survives_a_cut_between_rows():
    a = torch.arange(6 * 64, dtype=torch.float32).view(6, 64)  # 256-byte rows
    w = torch.zeros(6, 4)
    # columns 0-1 and 32-33 of each row (two groups of 32 columns, the first two of each)
    move = Move("w", Rows(dim=1, groups=2, length=2), Rows(dim=1, groups=2))
    m = wm.Mapping((Rule("a", (move,), partial=True),))  # the other columns are dropped
    chunks, _ = stream({"a": a}, {"w": w}, m, chunk_bytes=512)
    assert len(chunks) == 3
    assert torch.equal(w, torch.cat([a[:, 0:2], a[:, 32:34]], dim=1))


def test_a_corrupted_chunk_is_refused_before_anything_is_copied():
    ref = engine_tensors()
    src = megatron_reference(ref, 2, 8, 2)
    engine = {n: torch.zeros_like(t) for n, t in ref.items()}
    m = wm.megatron_llama(heads=8, kv_heads=2, head_dim=8)
    chunks = ws.plan_chunks(specs(src), 4096)
    first = {e.name for e in chunks[1].entries}
    with pytest.raises(ws.ChunkCorrupt, match="chunk 1: the staged .* bytes have checksum"):
        stream(src, engine, m, 4096, corrupt=1)
    plan = m.plan(specs(src), specs(engine))
    for name in first:  # chunk 1's tensors: nothing copied from it
        for c in plan.for_source(name):
            if all(e.name != name for e in chunks[0].entries):
                assert not engine[c.dst].any(), c.dst


def test_fill_checks_the_tensor_against_the_plan():
    chunks = ws.plan_chunks({"a": ((4, 4), "float32")}, 1024)
    with pytest.raises(MappingError, match=r"'a' is \[4, 5\] torch.float32, the plan has \[4, 4\]"):
        ws.fill(chunks[0], {"a": torch.zeros(4, 5)}, torch.zeros(1024, dtype=torch.uint8))


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=1, max_size=300), i=st.integers(0, 299), j=st.integers(0, 299))
def test_checksum_sees_flipped_and_swapped_bytes(data, i, j):
    buf = torch.tensor(list(data), dtype=torch.uint8)
    c = ws.checksum(buf)
    assert c == ws.checksum(buf.clone())
    i, j = i % len(data), j % len(data)
    flipped = buf.clone()
    flipped[i] ^= 0x10
    assert ws.checksum(flipped) != c
    # two 4-byte words swapped (when they differ)
    words = len(data) // 4
    if words >= 2:
        a, b = (i % words) * 4, (j % words) * 4
        if a != b and not torch.equal(buf[a:a + 4], buf[b:b + 4]):
            sw = buf.clone()
            sw[a:a + 4], sw[b:b + 4] = buf[b:b + 4].clone(), buf[a:a + 4].clone()
            assert ws.checksum(sw) != c


def test_checksum_of_a_prefix_and_across_pieces(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    buf = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=gen)
    whole = ws.checksum(buf, 9_998)
    monkeypatch.setattr(ws, "_PIECE", 1024)  # many pieces: the same value
    assert ws.checksum(buf, 9_998) == whole
    assert ws.checksum(buf[:9_998].clone()) == whole
    with pytest.raises(ValueError, match="exceeds"):
        ws.checksum(buf, 10_001)
