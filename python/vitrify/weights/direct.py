"""The direct weight update: the trainer writes straight into the engine's tensors.

The engine exports the memory its weights live in (on a GPU: the region's chunks, created
exportable, as POSIX file descriptors; on the host: a memfd), the trainer maps it at an address
of its own, and every planned move copies the trainer's rows into the engine's rows there: no
staging buffer, each byte read once and written once. Both sides checksum every moved piece on
the device and the engine compares before it leaves ``updating`` (W13-W15 in docs/weights.md).

Pieces (:func:`pieces`): both sides enumerate them alike from the plan and the needed sources.
A move along the first dimension is one piece per group (contiguous rows on both sides: a byte
range of the destination); any other move is one ``view`` piece (its destination view, made
contiguous). A piece's checksum is :func:`vitrify.weights.stream.checksum` of those bytes.

On a GPU every aligned piece of the same dtype is copied and summed by one Triton launch
(:func:`vitrify.weights.kernels.piece_sums`, ``copy=True``); a piece that casts, or whose source
is not contiguous, is copied by torch and summed by a second launch; the engine sums its pieces
by one launch. Pieces whose bytes are not 4-byte aligned (a bias of odd length cut mid-row) and
``view`` pieces use the torch reference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping as MappingABC
from typing import Any

from . import kernels, stream
from .mapping import Copy, MappingError, Plan, _view, copy

# Tests set this to run the Triton path on CPU tensors under Triton's interpreter.
FORCE_KERNELS = False


@dataclasses.dataclass(frozen=True)
class Piece:
    """One checksummed unit of a direct update: ``rows`` destination rows from ``dst_row`` (first
    dimension) receiving source rows from ``src_row`` (``kind == "rows"``), or the whole
    destination view of ``copy`` (``kind == "view"``)."""

    kind: str
    copy: int  # index in Plan.copies
    src: str
    dst: str
    src_row: int = 0
    dst_row: int = 0
    rows: int = 0


def pieces(plan: Plan, need: Iterable[str], limit: int | None = None) -> list[Piece]:
    """The pieces of the moves of every needed source, in the plan's order of sources and
    moves (the same list on both sides). ``limit``: at most this many pieces (a plan from a
    peer: its group counts are not trusted), else :class:`MappingError`."""
    want = set(need)
    out: list[Piece] = []
    for i, c in enumerate(plan.copies):
        if c.src not in want:
            continue
        if c.src_dim == 0 and c.dst_dim == 0:
            start, groups, stride, offset, length = c.src_rows
            dstart, _, dstride, doffset, _ = c.dst_rows
            if limit is not None and len(out) + groups > limit:
                raise MappingError(f"the moves of {c.src!r} make more pieces than the "
                                   f"destinations have rows ({limit})")
            for g in range(groups):
                out.append(Piece("rows", i, c.src, c.dst, start + g * stride + offset,
                                 dstart + g * dstride + doffset, length))
        else:
            out.append(Piece("view", i, c.src, c.dst))
    return out


def _row_bytes(t: Any) -> int:
    return math.prod(t.shape[1:]) * t.element_size() if t.dim() else t.element_size()


def _rows_of(t: Any, row: int, n: int) -> Any:
    return t.narrow(0, row, n) if t.dim() else t


def _span(t: Any, row: int, n: int) -> tuple[int, int]:
    """(address, bytes) of rows [row, row+n) of a contiguous tensor."""
    rb = _row_bytes(t)
    return t.data_ptr() + row * rb, n * rb


def _kernels_for(t: Any) -> bool:
    return FORCE_KERNELS or kernels.usable(t)


def _reference(view: Any) -> int:
    """The torch reference checksum of a view's bytes (contiguous, 4-byte aligned copy)."""
    import torch

    flat = view.contiguous().view(-1)
    return stream.checksum(flat.clone().view(torch.uint8))


def send(plan: Plan, ps: list[Piece], sources: MappingABC[str, Any],
         targets: MappingABC[str, Any]) -> list[int]:
    """Trainer: run every piece (``sources``: the trainer's tensors by source name; ``targets``:
    the engine's tensors as mapped in this process, by destination name) and return each
    piece's checksum of the bytes written. Kernel copies, torch copies and sums are queued on
    the current stream; the sums' synchronisation waits for all of them."""
    sums: list[int | None] = [None] * len(ps)
    fused: list[tuple[int, Any, tuple[int, int, int]]] = []  # copied and summed by one kernel
    after: list[tuple[int, Any, tuple[int, int, int]]] = []  # torch-copied, summed by a kernel
    reference: list[tuple[int, Any]] = []  # torch-copied, summed by the torch reference
    for i, p in enumerate(ps):
        c: Copy = plan.copies[p.copy]
        src, dst = sources[p.src], targets[p.dst]
        if p.kind == "view":
            copy(c, src, dst)
            reference.append((i, _view(dst, c.dst_dim, c.dst_rows)))
            continue
        if not dst.is_contiguous():
            raise MappingError(f"{p.dst!r}: the engine's tensor is not contiguous")
        d_addr, d_bytes = _span(dst, p.dst_row, p.rows)
        kern = _kernels_for(dst)
        # the fused kernel reads the source where the destination is (not host or another GPU)
        if (kern and src.device == dst.device and src.is_contiguous()
                and src.dtype == dst.dtype and _row_bytes(src) == _row_bytes(dst)):
            s_addr, _ = _span(src, p.src_row, p.rows)
            if s_addr % 4 == 0 and d_addr % 4 == 0:
                fused.append((i, dst.device, (s_addr, d_addr, d_bytes)))
                continue
        _rows_of(dst, p.dst_row, p.rows).copy_(_rows_of(src, p.src_row, p.rows))
        if kern and d_addr % 4 == 0:
            after.append((i, dst.device, (d_addr, d_addr, d_bytes)))
        else:
            reference.append((i, _rows_of(dst, p.dst_row, p.rows)))
    _by_kernel(sums, fused, copy=True)
    _sum_into(sums, after, reference)
    return [int(s) for s in sums]  # type: ignore[arg-type]


def verify(plan: Plan, ps: list[Piece], targets: MappingABC[str, Any]) -> list[int]:
    """Engine: the checksum of every piece's bytes in its own tensors (one read of each)."""
    sums: list[int | None] = [None] * len(ps)
    summed: list[tuple[int, Any, tuple[int, int, int]]] = []
    reference: list[tuple[int, Any]] = []
    for i, p in enumerate(ps):
        dst = targets[p.dst]
        if p.kind == "view":
            c = plan.copies[p.copy]
            reference.append((i, _view(dst, c.dst_dim, c.dst_rows)))
            continue
        d_addr, d_bytes = _span(dst, p.dst_row, p.rows)
        if _kernels_for(dst) and dst.is_contiguous() and d_addr % 4 == 0:
            summed.append((i, dst.device, (d_addr, d_addr, d_bytes)))
        else:
            reference.append((i, _rows_of(dst, p.dst_row, p.rows)))
    _sum_into(sums, summed, reference)
    return [int(s) for s in sums]  # type: ignore[arg-type]


def _by_kernel(sums: list, items: list, *, copy: bool = False) -> None:
    """piece_sums over ``items`` (index, device, piece), one launch group per device."""
    devices: dict[Any, list] = {}
    for it in items:
        devices.setdefault(it[1], []).append(it)
    for dev, group in devices.items():
        for (i, _, _), s in zip(group, kernels.piece_sums([p for _, _, p in group], dev,
                                                           copy=copy)):
            sums[i] = s


def _sum_into(sums: list, by_kernel: list, reference: list) -> None:
    _by_kernel(sums, by_kernel)
    for i, view in reference:
        sums[i] = _reference(view)


def first_difference(ps: list[Piece], got: list[int], want: list[int]) -> str | None:
    """A one-line description of the first piece whose checksums differ, or None."""
    if len(got) != len(want):
        return f"{len(want)} piece checksums expected, {len(got)} received"
    for p, g, w in zip(ps, got, want):
        if g != w:
            where = (f"rows {p.dst_row}..{p.dst_row + p.rows}" if p.kind == "rows"
                     else "its planned view")
            return (f"{p.dst!r} {where} (from {p.src!r}): the engine reads checksum {w:#x}, "
                    f"the trainer wrote {g:#x}")
    return None
