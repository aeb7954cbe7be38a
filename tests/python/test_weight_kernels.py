"""The weight update's one-pass sums (vitrify.weights.kernels, Triton) give exactly the integers
of their torch reference (vitrify.weights.stream), run here on CPU tensors under Triton's
interpreter: lengths that are not multiples of 4, several programs, several device-side groups,
the largest words, and a key. On a GPU the same kernels run compiled (tests/python/
test_weight_update_gpu.py, and `vitrify bench weights` compares both paths' times)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None
                                or importlib.util.find_spec("torch") is None,
                                reason="needs torch and triton (pip install torch)")

SCRIPT = r'''
import json, torch
from vitrify.weights import kernels as K, stream as S
g = torch.Generator().manual_seed(0)
checked = []
def same(buf, n, **kw):
    assert K.checksum(buf, n, **kw) == S.checksum(buf, n), ("checksum", n, kw)
    t = buf[:n]
    assert K.keyed_sums(t, (12345, 987654321), **kw) == S.keyed_sums(t, (12345, 987654321)), \
        ("keyed", n, kw)
    checked.append(n)
for n in (0, 1, 2, 3, 4, 5, 7, 1000, 4096 * 3 + 2, 70001):
    buf = torch.randint(0, 256, (n + 8,), dtype=torch.uint8, generator=g)
    for span, tile in ((256, 64), (1024, 256)):
        same(buf, n, span=span, tile=tile)
# the largest words at the real spans and tiles (the int64 bounds), over several programs
full = torch.full((4 * K.SPAN * 2 + 6,), 255, dtype=torch.uint8)
same(full, full.numel())
# a changed byte changes both
buf = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g)
c0, k0 = K.checksum(buf, 5000, span=256, tile=64), K.keyed_sums(buf, (3, 5), span=256, tile=64)
buf[4097] ^= 1
assert K.checksum(buf, 5000, span=256, tile=64) != c0
assert K.keyed_sums(buf, (3, 5), span=256, tile=64) != k0
# many pieces in one launch: sums equal the reference, copies exact, bytes outside untouched
src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
dst = torch.zeros_like(src)
spans = [(0, 0), (16, 5), (64, 1024), (2048, 4097), (8192, 70001), (100004, 3), (120000, 4096 * 9 + 7)]
pieces = [(src.data_ptr() + o, dst.data_ptr() + o, n) for o, n in spans]
want = [S.checksum(src[o:o + n].clone()) for o, n in spans]
assert K.piece_sums(pieces, "cpu", block=256, tile=64) == want
assert K.piece_sums(pieces, "cpu", copy=True, block=256, tile=64) == want
assert all(torch.equal(dst[o:o + n], src[o:o + n]) for o, n in spans)
assert int(dst[5:16].sum()) == 0 and int(dst[100007:120000].sum()) == 0
# the largest words over several blocks of the real size (the limbs' bounds)
big = torch.full((4 * K.PIECE_BLOCK * 3 + 2,), 255, dtype=torch.uint8)
assert K.piece_sums([(big.data_ptr(), big.data_ptr(), big.numel())], "cpu") == \
    [S.checksum(big)]
try:
    K.piece_sums([(src.data_ptr() + 2, 0, 8)], "cpu")
    raise AssertionError("an unaligned piece was summed")
except ValueError as e:
    assert "4-byte aligned" in str(e)
checked.append("pieces")
# a table built once and run again with the destinations moved (a trainer's next mapping of the
# engine's memory): the same sums, the bytes copied to the new place
dst2 = torch.zeros_like(src)
table = K.PieceTable(pieces, "cpu", copy=True, block=256, tile=64)
assert table.sums(dst_shift=dst2.data_ptr() - dst.data_ptr()) == want
assert all(torch.equal(dst2[o:o + n], src[o:o + n]) for o, n in spans)
assert K.PieceTable(pieces, "cpu", block=256, tile=64).sums() == want
# a table of sums only (pieces torch copied), both addresses moved to the new place
shift = dst2.data_ptr() - dst.data_ptr()
at_dst = [(d, d, n) for _, d, n in pieces]
assert K.PieceTable(at_dst, "cpu", block=256, tile=64, warps=4).sums(
    src_shift=shift, dst_shift=shift) == want
try:
    table.sums(dst_shift=4)
    raise AssertionError("a shift off the vector loads' alignment was taken")
except ValueError as e:
    assert "multiples of 16" in str(e)
checked.append("table")
print(json.dumps({"checked": checked}))
'''


def test_the_one_pass_sums_equal_their_torch_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    checked = json.loads(p.stdout.strip().splitlines()[-1])["checked"]
    assert len(checked) == 23 and checked[-2:] == ["pieces", "table"]


def test_only_cuda_tensors_take_the_kernel_path():
    import torch

    from vitrify import config
    from vitrify.weights import kernels

    assert not kernels.usable(torch.zeros(4, dtype=torch.uint8))  # a CPU tensor: torch's path

    class FakeCuda:
        is_cuda = True

    assert kernels.usable(FakeCuda())
    with config.override(weights_triton=False):  # VITRIFY_WEIGHTS_TRITON=0
        assert not kernels.usable(FakeCuda())
    assert config.from_environ({"VITRIFY_WEIGHTS_TRITON": "0"}).weights_triton is False


def test_the_sums_refuse_what_they_cannot_read_as_words():
    import torch

    from vitrify.weights import kernels

    with pytest.raises(ValueError, match="contiguous uint8"):
        kernels.checksum(torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="4-byte aligned"):
        kernels.checksum(torch.zeros(16, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="exceeds"):
        kernels.checksum(torch.zeros(8, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="key must be"):
        kernels.keyed_sums(torch.zeros(8, dtype=torch.uint8), (0, 1))
    for bad in ({"span": 96, "tile": 64}, {"span": 1 << 17}, {"tile": 48, "span": 96}):
        with pytest.raises(ValueError, match="power-of-two tile"):
            kernels.checksum(torch.zeros(8, dtype=torch.uint8), **bad)
    with pytest.raises(ValueError, match="block <= 32768"):  # the weighted sum's bound
        kernels.checksum(torch.zeros(8, dtype=torch.uint8), span=1 << 16)
    assert not kernels.takes(torch.zeros(8, dtype=torch.int32))  # only uint8 bytes
