"""The weight update's sums in one pass each, as Triton kernels: :func:`checksum` and
:func:`keyed_sums` give exactly the integers of :func:`vitrify.weights.stream.checksum` and
:func:`vitrify.weights.stream.keyed_sums` (their torch form, kept as the reference and for CPU
tensors) with one read of the bytes and one device synchronisation per call, instead of a
dozen int64 passes and four synchronisations per piece. :func:`checksum` is
:func:`piece_sums` of one piece: the kernel the direct update copies and sums with.

Keyed sums: each program sums ``span`` consecutive 32-bit words (the bytes as little-endian
words; the last zero-padded word of a length that is not a multiple of 4 is added on the host).
A word's 16-bit halves are below ``2**16`` and the keyed weights below ``2**24``, so keyed
products are below ``2**40`` and a program's keyed sum (``span <= 2**16``) below ``2**57``,
combined on the host. Everything else is Python integers modulo ``2**61 - 1``.

:func:`usable` says whether a tensor can take this path (a CUDA tensor, Triton importable, not
turned off with ``VITRIFY_WEIGHTS_TRITON=0``); tests force it on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

PRIME = (1 << 61) - 1
SPAN = 1 << 16  # words per program (keyed sums)
TILE = 2048  # words per step inside a program


def usable(t: Any) -> bool:
    """Whether ``t`` takes the Triton path: a CUDA tensor, Triton importable, and
    ``VITRIFY_WEIGHTS_TRITON`` not ``0``."""
    from .. import config

    if not config.get("weights_triton"):
        return False
    return bool(getattr(t, "is_cuda", False)) and _have_triton()


def takes(buf: Any) -> bool:
    """Whether the sums of ``buf`` run as kernels: :func:`usable`, and a contiguous 1-D uint8
    tensor starting on a 4-byte boundary (else the torch reference computes them)."""
    import torch

    return (usable(buf) and buf.dtype == torch.uint8 and buf.dim() == 1
            and buf.is_contiguous() and buf.data_ptr() % 4 == 0)


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _check_shape(span: int, tile: int) -> None:
    """The bounds the module docstring relies on (span and tile are tuning knobs)."""
    if not (0 < tile <= span <= SPAN and span % tile == 0 and tile & (tile - 1) == 0):
        raise ValueError(f"span={span}, tile={tile}: need a power-of-two tile dividing "
                         f"span <= {SPAN}")


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    from . import _triton_sums  # imports triton: only where a kernel runs

    return _triton_sums.keyed_blocks, _triton_sums.piece_sums


def _split(buf: Any, n: int) -> tuple[Any, int, int]:
    """``buf[:n]`` (uint8, contiguous, 4-byte aligned) as int32 words, their count, and the
    trailing 0..3 bytes as one zero-padded little-endian word (an int)."""
    import torch

    if not buf.is_contiguous() or buf.dtype != torch.uint8:
        raise ValueError("the sums need a contiguous uint8 tensor")
    if buf.data_ptr() % 4:
        raise ValueError("the sums need 4-byte aligned bytes")
    full = n // 4
    words = buf[:full * 4].view(torch.int32)
    rest = buf[full * 4:n].tolist() if n % 4 else []
    return words, full, int.from_bytes(bytes(rest) + bytes(4 - len(rest)), "little") if rest else 0


def _weight(pos: int, k1: int, k2: int) -> int:
    """stream._weights for one position (Python integers)."""
    x = (pos & 0x7FFFFFFF) * k1
    x ^= x >> 29
    x = (x & 0x7FFFFFFF) * k2
    x ^= x >> 31
    return x & 0xFFFFFF


def checksum(buf: Any, nbytes: int | None = None, *, span: int | None = None,
             tile: int | None = None) -> int:
    """:func:`vitrify.weights.stream.checksum` of ``buf[:nbytes]`` in one pass (Triton):
    :func:`piece_sums` of one piece (``span``: words per program, at most ``2**15``;
    ``tile``: lanes)."""
    span = PIECE_BLOCK if span is None else span
    tile = PIECE_TILE if tile is None else tile
    _check_shape(span, tile)
    n = buf.numel() if nbytes is None else int(nbytes)
    if n > buf.numel():
        raise ValueError(f"nbytes={n} exceeds the buffer's {buf.numel()} bytes")
    _split(buf, 0)  # a contiguous uint8 tensor on a 4-byte boundary, else ValueError
    return piece_sums([(buf.data_ptr(), buf.data_ptr(), n)], buf.device, block=span,
                      tile=tile)[0]


def _on(buf: Any) -> Any:
    """The buffer's device current while a kernel is launched (Triton launches on the current
    device and stream; the sums after it run on the buffer's)."""
    import contextlib

    import torch

    return torch.cuda.device(buf.device) if buf.is_cuda else contextlib.nullcontext()


def keyed_sums(buf: Any, key: tuple[int, int], *, span: int = SPAN, tile: int = TILE) -> int:
    """:func:`vitrify.weights.stream.keyed_sums` of ``buf`` (uint8) in one pass (Triton)."""
    k1, k2 = (int(k) for k in key)
    if not (0 < k1 < 1 << 31 and 0 < k2 < 1 << 31):
        raise ValueError(f"key must be two integers in 1..2**31-1, got {key!r}")
    _check_shape(span, tile)
    with _on(buf):
        return _keyed(buf, k1, k2, span, tile)


def _keyed(buf: Any, k1: int, k2: int, span: int, tile: int) -> int:
    import torch

    n = buf.numel()
    words, full, tail = _split(buf, n)
    a = b = 0
    if full:
        blocks = -(-full // span)
        out = torch.empty((blocks, 2), dtype=torch.int64, device=buf.device)
        _kernels()[0][(blocks,)](words, full, 0, k1, k2, out, SPAN=span, TILE=tile)
        pa, pb = out.t().tolist()  # one synchronisation; each below 2**57
        a, b = sum(pa), sum(pb)
    if n % 4:
        lo16, hi16 = tail & 0xFFFF, tail >> 16
        wa, wb = _weight(full, k1, k2), _weight(full, k2, k1)
        a += lo16 * wa + hi16 * wb
        b += lo16 * wb + hi16 * wa
    return (a % PRIME) << 61 | (b % PRIME)


# ---- many pieces in one launch (the direct weight update) ---------------------------------------

PIECE_BLOCK = 1 << 15  # words per program of piece_sums (128 KiB; W < 2**62 needs <= 2**15)
PIECE_TILE = 2048
PIECE_WARPS = 16  # tile and warps change the speed only, never the sums (16: the probe's best copy)
_MAX_PIECE_BLOCKS = 1 << 19  # the limbs' bounds (_triton_sums.piece_sums) hold up to here


def piece_sums(pieces: list[tuple[int, int, int]], device: Any, *, copy: bool = False,
               block: int = PIECE_BLOCK, tile: int = PIECE_TILE) -> list[int]:
    """:func:`vitrify.weights.stream.checksum` of each piece (source address, destination
    address, bytes) of device memory, every piece in one kernel launch (two: pieces on 16-byte
    boundaries take vector loads) and one synchronisation. ``copy``: the source bytes are copied
    to the destination while they are summed (one read and one write of each byte). Addresses
    must be 4-byte aligned (a ``ValueError`` names the first that is not); pieces must not
    overlap when copying. :class:`PieceTable` is the same, built once and run many times."""
    return PieceTable(pieces, device, copy=copy, block=block, tile=tile).sums()


class PieceTable:
    """:func:`piece_sums` of fixed pieces, its tables built on the device once: a weight update
    runs the same thousand pieces every step, and building their tables costs more than the
    kernel (host lists, two host-to-device copies, the block table). :meth:`sums` runs it, the
    addresses optionally shifted (the same pieces in memory mapped at another address)."""

    def __init__(self, pieces: list[tuple[int, int, int]], device: Any, *, copy: bool = False,
                 block: int = PIECE_BLOCK, tile: int = PIECE_TILE, warps: int = PIECE_WARPS):
        import torch

        _check_shape(block, tile)
        if block > 1 << 15:  # the weighted sum of a block of 32-bit words must stay below 2**62
            raise ValueError(f"block={block}: piece_sums needs block <= {1 << 15}")
        groups: dict[bool, list[int]] = {True: [], False: []}
        for i, (src, dst, n) in enumerate(pieces):
            if n < 0 or src % 4 or (copy and dst % 4):
                raise ValueError(f"piece {i}: {n} bytes from 0x{src:x} to 0x{dst:x}: the sums "
                                 f"need 4-byte aligned addresses and a length >= 0")
            if -(-n // (4 * block)) > _MAX_PIECE_BLOCKS:
                raise ValueError(f"piece {i}: {n} bytes exceed {_MAX_PIECE_BLOCKS} blocks of "
                                 f"{4 * block} bytes")
            groups[src % 16 == 0 and (not copy or dst % 16 == 0)].append(i)
        if warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"warps={warps}: a power of two up to 32")
        self.copy, self.block, self.tile, self.n = copy, block, tile, len(pieces)
        self.warps = warps
        self.device = device
        self.order = [i for idx in groups.values() for i in idx]
        self.words = [pieces[i][2] // 4 for i in self.order]
        self._groups = []  # (aligned, segs, blocks, piece_of, rows)
        with self._on():
            for aligned, idx in groups.items():
                if not idx:
                    continue
                # two small host-to-device copies; the block table is built on the device
                segs = torch.tensor([pieces[i] for i in idx], dtype=torch.int64).to(device)
                n_blocks = [max(1, -(-pieces[i][2] // (4 * block))) for i in idx]
                counts = torch.tensor(n_blocks, dtype=torch.int64).to(device)
                total = sum(n_blocks)
                piece_of = torch.repeat_interleave(
                    torch.arange(len(idx), dtype=torch.int64, device=device), counts,
                    output_size=total)
                first = torch.cumsum(counts, 0) - counts
                blocks = torch.stack([piece_of, torch.arange(total, dtype=torch.int64,
                                                             device=device)
                                      - first[piece_of]], 1).contiguous()
                self._groups.append((aligned, segs, blocks, piece_of, len(idx)))

    def _on(self) -> Any:
        import torch

        return torch.cuda.device(self.device) if torch.device(self.device).type == "cuda" \
            else _null()

    def sums(self, *, src_shift: int = 0, dst_shift: int = 0) -> list[int]:
        """Every piece's checksum (and copy), in the order given, with ``src_shift`` /
        ``dst_shift`` added to the source / destination addresses (multiples of 16: the
        vector-load variant's alignment holds)."""
        import torch

        if src_shift % 16 or dst_shift % 16:
            raise ValueError(f"shifts {src_shift}, {dst_shift}: need multiples of 16")
        outs = []
        kernel = _kernels()[1]
        with self._on():
            for aligned, segs, blocks, piece_of, rows in self._groups:
                if src_shift or dst_shift:
                    segs = segs.clone()
                    if src_shift:
                        segs[:, 0] += src_shift
                    if dst_shift:
                        segs[:, 1] += dst_shift
                limbs = torch.empty((blocks.shape[0], 7), dtype=torch.int64, device=self.device)
                _launch(kernel, segs, blocks, limbs, self.copy, aligned, self.block, self.tile,
                        self.warps)
                out = torch.zeros((rows, 7), dtype=torch.int64, device=self.device)
                out.index_add_(0, piece_of, limbs)  # < 2**61 each (the limbs' bounds)
                outs.append(out)
            rows = torch.cat(outs).tolist() if outs else []  # one synchronisation
        result = [0] * self.n
        block = self.block
        for i, words, (s_lo, s_hi, w_lo, w_hi, ks_lo, ks_hi, end) in zip(self.order, self.words,
                                                                         rows):
            plain = s_lo + (s_hi << 23) + end
            weighted = w_lo + (w_hi << 30) + block * (ks_lo + (ks_hi << 23)) + (words + 1) * end
            result[i] = (plain % PRIME) << 61 | (weighted % PRIME)
        return result


_UNALIGNED_ONLY = False  # set when the vector-load variant failed to compile here


def _launch(kernel: Any, segs: Any, blocks: Any, limbs: Any, copy: bool, aligned: bool,
            block: int, tile: int, warps: int = PIECE_WARPS) -> None:
    """Launch piece_sums; if the aligned variant (vector loads: pointer alignment hints) does
    not compile with this Triton, use the unhinted one from then on, with a log line."""
    global _UNALIGNED_ONLY
    grid = (blocks.shape[0],)
    if aligned and not _UNALIGNED_ONLY:
        try:
            kernel[grid](segs, blocks, limbs, COPY=copy, ALIGNED=True, BLOCK=block, TILE=tile,
                         num_warps=warps)
            return
        except Exception as e:  # a compile error: nothing was launched
            import logging

            logging.getLogger("vitrify.weights").warning(
                "piece_sums: the aligned variant did not compile (%s); using scalar loads",
                str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            _UNALIGNED_ONLY = True
    kernel[grid](segs, blocks, limbs, COPY=copy, ALIGNED=False, BLOCK=block, TILE=tile,
                 num_warps=warps)


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()
