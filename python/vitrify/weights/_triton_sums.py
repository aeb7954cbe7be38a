"""Triton kernels of :mod:`vitrify.weights.kernels` (imported only where one runs: it imports
triton): the keyed sums, and the pieces' copy and checksum. Each program sums a block of 32-bit
words in steps of ``TILE`` lanes; the bounds that keep the int64 sums exact are in the
docstrings (here and in that module)."""

import triton
import triton.language as tl

# Lengths, offsets and keys are never specialised on (a key of 1 would otherwise become a
# compile-time constant, and every new length a new compilation).
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


@triton.jit
def _end_bytes(src_addr, dst_addr, n_words, nbytes, COPY: tl.constexpr):
    """The last 0..3 bytes of a piece (copied when COPY) as one zero-padded little-endian word."""
    i = tl.arange(0, 4)
    m = i < nbytes - n_words * 4
    b = tl.load(src_addr.to(tl.pointer_type(tl.uint8)) + n_words * 4 + i, mask=m, other=0)
    if COPY:
        tl.store(dst_addr.to(tl.pointer_type(tl.uint8)) + n_words * 4 + i, b, mask=m)
    return tl.sum(b.to(tl.int64) << (8 * i).to(tl.int64), axis=0)


@triton.jit
def piece_sums(segs, blocks, out, COPY: tl.constexpr, ALIGNED: tl.constexpr,
               BLOCK: tl.constexpr, TILE: tl.constexpr):
    """One block of BLOCK words of one piece per program. ``segs[p]`` = (source address,
    destination address, bytes) of piece p; ``blocks[b]`` = (piece, block index in it). With COPY
    the words are copied to the destination as they are summed (one read, one write). Each
    program writes seven limbs into ``out[b]``: the block's plain sum S (< 2**47 for BLOCK <=
    2**15) split at bit 23, its position-weighted sum W (positions 1..BLOCK, < 2**62) split at
    bit 30, k * S split like S, and the piece's last 0..3 bytes as a word (0 elsewhere); kernels.piece_sums adds
    each piece's rows and combines them.
    ALIGNED: both addresses are multiples of 16 (vector loads and stores)."""
    pid = tl.program_id(0).to(tl.int64)
    p = tl.load(blocks + pid * 2)
    k = tl.load(blocks + pid * 2 + 1)
    src_addr = tl.load(segs + p * 3)
    dst_addr = tl.load(segs + p * 3 + 1)
    nbytes = tl.load(segs + p * 3 + 2)
    src = src_addr.to(tl.pointer_type(tl.int32))
    dst = dst_addr.to(tl.pointer_type(tl.int32))
    if ALIGNED:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    n_words = nbytes // 4
    start = k * BLOCK
    lane = tl.arange(0, TILE)
    # Per lane, over the block's T = BLOCK // TILE steps: acc_s = the lane's words' sum and
    # acc_r = the sum of its running sums, which is sum_t w_t * (T - t); no multiply per word.
    acc_s = tl.zeros([TILE], dtype=tl.int64)
    acc_r = tl.zeros([TILE], dtype=tl.int64)
    if start + BLOCK <= n_words:  # a full block: no masks, so loads and stores vectorise
        for step in range(0, BLOCK, TILE):
            offs = start + step + lane
            w = tl.load(src + offs)
            if COPY:
                tl.store(dst + offs, w)
            acc_s += w.to(tl.uint32, bitcast=True).to(tl.int64)
            acc_r += acc_s
    else:
        for step in range(0, BLOCK, TILE):
            offs = start + step + lane
            m = offs < n_words
            w = tl.load(src + offs, mask=m, other=0)
            if COPY:
                tl.store(dst + offs, w, mask=m)
            acc_s += w.to(tl.uint32, bitcast=True).to(tl.int64)
            acc_r += acc_s
    # word (t, lane) sits at position t * TILE + lane + 1 of the block, so
    # W = TILE * sum_lane (T * S_lane - R_lane) + sum_lane (lane + 1) * S_lane
    steps = BLOCK // TILE
    s = tl.sum(acc_s, axis=0)
    w = tl.sum(TILE * (steps * acc_s - acc_r) + (lane + 1).to(tl.int64) * acc_s, axis=0)
    row = out + pid * 7  # this program's limbs; the host adds each piece's rows
    s_lo = s & 0x7FFFFF
    s_hi = s >> 23
    tl.store(row + 0, s_lo)
    tl.store(row + 1, s_hi)
    tl.store(row + 2, w & 0x3FFFFFFF)
    tl.store(row + 3, w >> 30)
    tl.store(row + 4, k * s_lo)
    tl.store(row + 5, k * s_hi)
    end = tl.zeros([], dtype=tl.int64)
    if (start <= n_words) & (n_words < start + BLOCK) & (nbytes > n_words * 4):
        end = _end_bytes(src_addr, dst_addr, n_words, nbytes, COPY)
    tl.store(row + 6, end)
