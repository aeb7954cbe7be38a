"""The direct update's kernel on the GPU (marker gpu): piece_sums, compiled, gives the torch
reference's checksum of every piece (aligned to 16 bytes, to 4 bytes, lengths with 1-3 tail
bytes, several blocks, one empty), copies exactly the pieces' bytes with copy=True, and leaves
every other byte alone."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_piece_sums_compiled_equals_the_torch_reference():
    torch = pytest.importorskip("torch")
    from vitrify import config
    from vitrify.weights import kernels, stream

    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.zeros_like(src)
    spans = [(0, 0), (16, 5), (64, 1024), (2052, 4097), (8192, 70001),
             (100004, 3), (1 << 20, 4 * kernels.PIECE_BLOCK * 5 + 7), (40 << 20, 16 << 20)]
    pieces = [(src.data_ptr() + o, dst.data_ptr() + o, n) for o, n in spans]
    with config.override(weights_triton=False):
        want = [stream.checksum(src[o:o + n]) for o, n in spans]
    assert kernels.piece_sums(pieces, src.device) == want
    assert kernels.piece_sums(pieces, src.device, copy=True) == want
    torch.cuda.synchronize()
    mask = torch.zeros_like(src, dtype=torch.bool)
    for o, n in spans:
        mask[o:o + n] = True
        assert torch.equal(dst[o:o + n], src[o:o + n]), (o, n)
    assert int(dst[~mask].count_nonzero()) == 0
    full = torch.full((4 * kernels.PIECE_BLOCK * 3,), 255, dtype=torch.uint8, device="cuda")
    with config.override(weights_triton=False):
        top = stream.checksum(full)
    assert kernels.piece_sums([(full.data_ptr(), full.data_ptr(), full.numel())],
                              full.device) == [top]
