"""The data path of a weight update: a trainer's tensors packed chunk by chunk into one bounded
staging buffer, and each chunk applied in place to the engine's tensors through a planned
:class:`~vitrify.weights.mapping.Mapping`.

- :func:`plan_chunks` packs the source tensors, grouped by dtype (never by shape: one staging
  buffer serves every tensor), into chunks of at most ``chunk_bytes``; a tensor larger than the
  room left is cut between rows of its first dimension, so memory never exceeds ``chunk_bytes``
  whatever the model. Entries are aligned (``align`` bytes) so every view is aligned too.
- :func:`fill` (sender) copies a chunk's rows into the staging buffer and returns its checksum.
- :func:`apply` (receiver) checksums the staged bytes, then copies each entry's rows into the
  engine's tensors: the planned moves intersected with the rows the entry carries (``copy_``
  casts where the dtypes differ). A checksum that differs from the sender's is
  :class:`ChunkCorrupt` before anything is copied.
- :func:`checksum`: a position-dependent sum of the bytes as 32-bit words, computed on the
  buffer's device: on a GPU by one Triton kernel (:mod:`vitrify.weights.kernels`, one pass, one
  synchronisation), else by torch in bounded pieces (the reference the kernel equals).

Everything is torch on whatever device the tensors are on; nothing here knows about processes
or sockets (the transport carries the chunks' descriptions and the staging buffer is shared).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping as MappingABC
from typing import Any

from .. import _check
from . import kernels
from .mapping import Copy, MappingError, Plan, copy

_PIECE = 1 << 24  # checksum work per step: 16 MiB of the buffer (bounded temporaries)


class ChunkCorrupt(RuntimeError):
    """The staged bytes of a chunk differ from what the sender put there."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """Rows ``[row0, row1)`` (first dimension) of source tensor ``name`` at ``offset`` in the
    staging buffer (``nbytes`` bytes, ``dtype`` name, the tensor's full ``shape``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    row0: int
    row1: int
    offset: int
    nbytes: int

    @property
    def whole(self) -> bool:
        return self.row0 == 0 and self.row1 == _rows(self.shape)


@dataclasses.dataclass(frozen=True)
class Chunk:
    index: int
    entries: tuple[Entry, ...]
    nbytes: int  # staging bytes used (the last entry's end)


def _rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def _itemsize(dtype: str) -> int:
    import torch

    try:
        return getattr(torch, dtype).itemsize
    except AttributeError:
        raise MappingError(f"unknown dtype {dtype!r}") from None


def plan_chunks(specs: MappingABC[str, tuple[tuple[int, ...], str]], chunk_bytes: int,
                align: int = 256) -> list[Chunk]:
    """Pack the sources (name -> (shape, dtype)) into chunks of at most ``chunk_bytes``: dtype by
    dtype (in order of first appearance), tensors in their order, a tensor cut between rows of
    its first dimension where the room runs out. A single row larger than ``chunk_bytes`` is a
    :class:`MappingError` naming the tensor."""
    _check.integer("chunk_bytes", chunk_bytes, 1, _check.U64_MAX)
    _check.integer("align", align, 1, 1 << 20)
    if chunk_bytes < align:
        raise MappingError(f"chunk_bytes ({chunk_bytes}) is below the alignment ({align})")
    by_dtype: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, (shape, dtype) in specs.items():
        by_dtype.setdefault(str(dtype), []).append((name, tuple(int(d) for d in shape)))
    chunks: list[Chunk] = []
    entries: list[Entry] = []
    used = 0

    def close() -> None:
        nonlocal entries, used
        if entries:
            chunks.append(Chunk(len(chunks), tuple(entries), used))
        entries, used = [], 0

    for dtype, tensors in by_dtype.items():
        size = _itemsize(dtype)
        for name, shape in tensors:
            rows = _rows(shape)
            row_bytes = math.prod(shape[1:]) * size if shape else size
            if row_bytes > chunk_bytes:
                raise MappingError(f"one row of {name!r} ({row_bytes} bytes, shape "
                                   f"{list(shape)}) does not fit chunk_bytes={chunk_bytes}")
            row = 0
            while row < rows:
                start = -(-used // align) * align
                room = (chunk_bytes - start) // row_bytes if start < chunk_bytes else 0
                if room == 0:
                    close()
                    continue
                n = min(room, rows - row)
                entries.append(Entry(name, dtype, shape, row, row + n, start, n * row_bytes))
                used = start + n * row_bytes
                row += n
    close()
    return chunks


def _words(buf: Any, n: int, piece: int) -> Iterable[tuple[int, Any]]:
    """``buf[:n]`` (uint8) in pieces of ``piece`` bytes: (first byte, the piece's little-endian
    32-bit words as non-negative int64, the last one zero-padded)."""
    import torch

    for lo in range(0, n, piece):
        part = buf[lo:min(n, lo + piece)]
        pad = (-part.numel()) % 4
        if pad:
            part = torch.cat([part, part.new_zeros(pad)])
        yield lo, part.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def checksum(buf: Any, nbytes: int | None = None) -> int:
    """A checksum of ``buf[:nbytes]`` (a uint8 torch tensor): the bytes as little-endian 32-bit
    words (zero-padded), summed plainly and weighted by position, modulo 2**61 - 1, on the
    buffer's device in pieces of 16 MiB (int64 sums that cannot overflow: each word is summed as
    two 16-bit halves). A flipped, swapped or shifted byte changes it."""
    import torch

    n = buf.numel() if nbytes is None else int(nbytes)
    if n > buf.numel():
        raise ValueError(f"nbytes={n} exceeds the buffer's {buf.numel()} bytes")
    if kernels.takes(buf):
        return kernels.checksum(buf, n)  # the same integer in one pass
    prime = (1 << 61) - 1
    plain = weighted = 0
    for lo, words in _words(buf, n, _PIECE):
        pos = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64)
        halves = (words & 0xFFFF, words >> 16)  # < 2**16 each; x pos < 2**38; summed < 2**60
        s = [int(h.sum()) for h in halves]
        w = [int((h * pos).sum()) for h in halves]
        total = s[0] + (s[1] << 16)
        base = lo // 4  # words before this piece
        plain = (plain + total) % prime
        weighted = (weighted + w[0] + (w[1] << 16) + base * total) % prime
    return plain << 61 | weighted


_KEYED_PIECE = 1 << 22  # keyed sums per step: 4 MiB of the tensor (~64 MiB of temporaries)


def _weights(pos: Any, k1: int, k2: int) -> Any:
    """24-bit pseudo-random weights of word positions under key (k1, k2): multiply-xorshift
    rounds on 31-bit values, every product below 2**62 (no int64 overflow)."""
    x = (pos & 0x7FFFFFFF) * k1
    x = x ^ (x >> 29)
    x = (x & 0x7FFFFFFF) * k2
    x = x ^ (x >> 31)
    return x & 0xFFFFFF


def keyed_sums(buf: Any, key: tuple[int, int]) -> int:
    """Two sums of ``buf``'s bytes (uint8 tensor) as 32-bit words, each word's 16-bit halves
    weighted by pseudo-random 24-bit weights of its position under ``key`` (two 31-bit
    integers), modulo 2**61 - 1: unlike :func:`checksum` (linear in the position), a structured
    change (two words swapped, +1/-1 pairs) leaves them equal only by chance. Pieces of 4 MiB:
    each product < 2**40, each piece's sum < 2**62."""
    import torch

    k1, k2 = (int(k) for k in key)
    if not (0 < k1 < 1 << 31 and 0 < k2 < 1 << 31):
        raise ValueError(f"key must be two integers in 1..2**31-1, got {key!r}")
    if kernels.takes(buf):
        return kernels.keyed_sums(buf, (k1, k2))  # the same integer in one pass
    prime = (1 << 61) - 1
    a = b = 0
    for lo, words in _words(buf, buf.numel(), _KEYED_PIECE):
        pos = torch.arange(lo // 4, lo // 4 + words.numel(), device=words.device,
                           dtype=torch.int64)
        wa, wb = _weights(pos, k1, k2), _weights(pos, k2, k1)
        h0, h1 = words & 0xFFFF, words >> 16
        a = (a + int((h0 * wa).sum()) + int((h1 * wb).sum())) % prime
        b = (b + int((h0 * wb).sum()) + int((h1 * wa).sum())) % prime
    return a << 61 | b


def _entry_view(e: Entry, staging: Any) -> Any:
    import torch

    t = staging[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype))
    return t.view((e.row1 - e.row0, *e.shape[1:])) if e.shape else t.view(())


def fill(chunk: Chunk, tensors: MappingABC[str, Any], staging: Any) -> int:
    """Sender: copy ``chunk``'s rows of ``tensors`` into ``staging`` (uint8) and return the
    checksum of the bytes used."""
    if chunk.nbytes > staging.numel():
        raise MappingError(f"chunk {chunk.index} needs {chunk.nbytes} staging bytes, the buffer "
                           f"has {staging.numel()}")
    for e in chunk.entries:
        src = tensors[e.name]
        if tuple(src.shape) != e.shape or str(src.dtype).removeprefix("torch.") != e.dtype:
            raise MappingError(f"{e.name!r} is {list(src.shape)} {src.dtype}, the plan has "
                               f"{list(e.shape)} {e.dtype}")
        rows = src if not e.shape else src.narrow(0, e.row0, e.row1 - e.row0)
        _entry_view(e, staging).copy_(rows)
    return checksum(staging, chunk.nbytes)


def _segments(c: Copy, row0: int, row1: int) -> Iterable[tuple[int, int, int]]:
    """For a move along the source's first dimension: (source row, destination row, count) of
    each piece of it inside source rows [row0, row1)."""
    start, groups, stride, offset, length = c.src_rows
    dstart, _, dstride, doffset, _ = c.dst_rows
    for g in range(groups):
        lo = start + g * stride + offset
        a, b = max(lo, row0), min(lo + length, row1)
        if a < b:
            yield a, dstart + g * dstride + doffset + (a - lo), b - a


def _apply_copy(c: Copy, e: Entry, rows: Any, dst: Any) -> None:
    if e.whole:
        copy(c, rows, dst)
    elif c.src_dim == 0:  # the move cuts the first dimension: its pieces inside these rows
        for s_row, d_row, n in _segments(c, e.row0, e.row1):
            dst.narrow(0, d_row, n).copy_(rows.narrow(0, s_row - e.row0, n))
    else:  # the move cuts another dimension: the first one is the same on both sides
        copy(c, rows, dst.narrow(0, e.row0, e.row1 - e.row0))


def check_chunk(chunk: Chunk, specs: MappingABC[str, tuple[tuple[int, ...], str]],
                limit: int) -> None:
    """A received chunk's description against the manifest: every entry of a known tensor with
    its shape and dtype, rows inside it, bytes matching the rows, inside ``limit`` staging
    bytes. A :class:`MappingError` naming the entry otherwise (nothing is read past it)."""
    if not 0 <= chunk.nbytes <= limit:
        raise MappingError(f"chunk {chunk.index} claims {chunk.nbytes} bytes of a {limit}-byte "
                           f"slot")
    for e in chunk.entries:
        if e.name not in specs:
            raise MappingError(f"chunk {chunk.index} carries {e.name!r}, not in the manifest")
        shape, dtype = specs[e.name]
        if tuple(shape) != e.shape or dtype != e.dtype:
            raise MappingError(f"chunk {chunk.index}: {e.name!r} is {list(e.shape)} {e.dtype} "
                               f"there, {list(shape)} {dtype} in the manifest")
        row_bytes = math.prod(e.shape[1:]) * _itemsize(e.dtype) if e.shape else _itemsize(e.dtype)
        if not (0 <= e.row0 < e.row1 <= _rows(e.shape) and e.offset >= 0
                and e.nbytes == (e.row1 - e.row0) * row_bytes
                and e.offset + e.nbytes <= chunk.nbytes):
            raise MappingError(f"chunk {chunk.index}: entry {e.name!r} rows {e.row0}..{e.row1} at "
                               f"{e.offset} (+{e.nbytes}) does not fit the tensor or the chunk")


def apply(chunk: Chunk, plan: Plan, staging: Any, engine: MappingABC[str, Any],
          expect: int) -> int:
    """Receiver: check the staged bytes against the sender's checksum ``expect``
    (:class:`ChunkCorrupt` when they differ, before anything is copied), then copy every entry
    into the engine's tensors in place through ``plan``. Returns the number of copies made."""
    got = checksum(staging, chunk.nbytes)
    if got != expect:
        raise ChunkCorrupt(f"chunk {chunk.index}: the staged {chunk.nbytes} bytes have checksum "
                           f"{got:#x}, the sender's is {expect:#x}")
    made = 0
    for e in chunk.entries:
        rows = _entry_view(e, staging)
        for c in plan.for_source(e.name):
            _apply_copy(c, e, rows, engine[c.dst])
            made += 1
    return made
