"""Triton kernels of :mod:`vitrify.weights.kernels` (imported only where one runs: it imports
triton). Each program sums ``SPAN`` consecutive 32-bit words in steps of ``TILE`` lanes; the
bounds that keep the int64 sums exact are in that module's docstring."""

import triton
import triton.language as tl

# Lengths, offsets and keys are never specialised on (a key of 1 would otherwise become a
# compile-time constant, and every new length a new compilation).
@triton.jit(do_not_specialize=["n_words"])
def checksum_blocks(words, n_words, out, SPAN: tl.constexpr, TILE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    start = pid * SPAN
    s0 = tl.zeros([TILE], dtype=tl.int64)
    s1 = tl.zeros([TILE], dtype=tl.int64)
    w0 = tl.zeros([TILE], dtype=tl.int64)
    w1 = tl.zeros([TILE], dtype=tl.int64)
    lane = tl.arange(0, TILE).to(tl.int64)
    for step in range(0, SPAN, TILE):
        offs = start + step + lane
        w = tl.load(words + offs, mask=offs < n_words, other=0).to(tl.int64)
        lo = w & 0xFFFF
        hi = (w >> 16) & 0xFFFF
        j = step + lane + 1  # the word's position inside the span, from 1
        s0 += lo
        s1 += hi
        w0 += lo * j
        w1 += hi * j
    tl.store(out + pid * 4 + 0, tl.sum(s0, axis=0))
    tl.store(out + pid * 4 + 1, tl.sum(s1, axis=0))
    tl.store(out + pid * 4 + 2, tl.sum(w0, axis=0))
    tl.store(out + pid * 4 + 3, tl.sum(w1, axis=0))

@triton.jit
def mix(pos, k1, k2):  # stream._weights, on int64 lanes
    x = (pos & 0x7FFFFFFF) * k1
    x = x ^ (x >> 29)
    x = (x & 0x7FFFFFFF) * k2
    x = x ^ (x >> 31)
    return x & 0xFFFFFF

@triton.jit(do_not_specialize=["n_words", "base", "k1", "k2"])
def keyed_blocks(words, n_words, base, k1, k2, out, SPAN: tl.constexpr,
                 TILE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    start = pid * SPAN
    a = tl.zeros([TILE], dtype=tl.int64)
    b = tl.zeros([TILE], dtype=tl.int64)
    lane = tl.arange(0, TILE).to(tl.int64)
    k1 = k1.to(tl.int64)
    k2 = k2.to(tl.int64)
    for step in range(0, SPAN, TILE):
        offs = start + step + lane
        w = tl.load(words + offs, mask=offs < n_words, other=0).to(tl.int64)
        lo = w & 0xFFFF
        hi = (w >> 16) & 0xFFFF
        pos = base + offs
        wa = mix(pos, k1, k2)
        wb = mix(pos, k2, k1)
        a += lo * wa + hi * wb
        b += lo * wb + hi * wa
    tl.store(out + pid * 2 + 0, tl.sum(a, axis=0))
    tl.store(out + pid * 2 + 1, tl.sum(b, axis=0))
