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
from .mapping import MappingError, Plan, _view, copy

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


def kernels_on() -> tuple[bool, bool]:
    """The settings that decide which pieces the kernels take (part of the transport's keys for
    a kept :class:`Writer` / :class:`Verifier`: turning the kernels off takes effect)."""
    from .. import config

    return FORCE_KERNELS, bool(config.get("weights_triton"))


def _reference(view: Any) -> int:
    """The torch reference checksum of a view's bytes (contiguous, 4-byte aligned copy)."""
    import torch

    flat = view.contiguous().view(-1)
    return stream.checksum(flat.clone().view(torch.uint8))


def send(plan: Plan, ps: list[Piece], sources: MappingABC[str, Any],
         targets: MappingABC[str, Any]) -> list[int]:
    """Trainer: run every piece (``sources``: the trainer's tensors by source name; ``targets``:
    the engine's tensors as mapped in this process, by destination name) and return each
    piece's checksum of the bytes written (:class:`Writer`, built for one use)."""
    return Writer(plan, ps, sources, targets).run(sources, targets)


def verify(plan: Plan, ps: list[Piece], targets: MappingABC[str, Any]) -> list[int]:
    """Engine: the checksum of every piece's bytes in its own tensors (one read of each;
    :class:`Verifier`, built for one use)."""
    return Verifier(plan, ps, targets).run(targets)


class Writer:
    """The trainer's side of the pieces, sorted once: which pieces one Triton launch copies and
    sums (their tables built on the device, :class:`~vitrify.weights.kernels.PieceTable`),
    which torch copies, which the torch reference sums. A trainer sends the same pieces from
    the same tensors every step, so the transport keeps its writer; only the address the
    engine's memory is mapped at moves (``base``: where ``targets`` lie now; :meth:`run` with
    another base shifts the tables' destinations).

    Kernel copies, torch copies and sums are queued on the current stream; the sums'
    synchronisation waits for all of them."""

    def __init__(self, plan: Plan, ps: list[Piece], sources: MappingABC[str, Any],
                 targets: MappingABC[str, Any], base: int = 0):
        self.plan, self.ps, self.base = plan, ps, base
        fused: list[tuple[int, Any, tuple[int, int, int]]] = []  # copied and summed by one kernel
        after: list[tuple[int, Any, tuple[int, int, int]]] = []  # torch-copied, summed by a kernel
        self.torch_copies: list[int] = []  # rows pieces torch copies (then summed either way)
        self.views: list[int] = []  # view pieces: torch copies, the reference sums
        self.reference: list[int] = []  # rows pieces the reference sums
        for i, p in enumerate(ps):
            src, dst = sources[p.src], targets[p.dst]
            if p.kind == "view":
                self.views.append(i)
                continue
            if not dst.is_contiguous():
                raise MappingError(f"{p.dst!r}: the engine's tensor is not contiguous")
            d_addr, d_bytes = _span(dst, p.dst_row, p.rows)
            kern = _kernels_for(dst)
            # the fused kernel reads the source where the destination is (not host or another
            # GPU)
            if (kern and src.device == dst.device and src.is_contiguous()
                    and src.dtype == dst.dtype and _row_bytes(src) == _row_bytes(dst)):
                s_addr, _ = _span(src, p.src_row, p.rows)
                if s_addr % 4 == 0 and d_addr % 4 == 0:
                    fused.append((i, dst.device, (s_addr, d_addr, d_bytes)))
                    continue
            self.torch_copies.append(i)
            if kern and d_addr % 4 == 0:
                after.append((i, dst.device, (d_addr, d_addr, d_bytes)))
            else:
                self.reference.append(i)
        self._fused = _tables(fused, copy=True)
        self._after = _tables(after)

    def run(self, sources: MappingABC[str, Any], targets: MappingABC[str, Any],
            base: int | None = None) -> list[int]:
        """Write every piece and return their checksums. ``targets`` is read only for the
        pieces torch copies or sums (it may build its views on demand); ``base``: where the
        engine's memory is mapped now (default: where it was when this writer was built)."""
        shift = 0 if base is None else base - self.base
        plan, ps = self.plan, self.ps
        sums: list[int | None] = [None] * len(ps)
        for i in self.views:
            p = ps[i]
            copy(plan.copies[p.copy], sources[p.src], targets[p.dst])
        for i in self.torch_copies:
            p = ps[i]
            _rows_of(targets[p.dst], p.dst_row, p.rows).copy_(
                _rows_of(sources[p.src], p.src_row, p.rows))
        _run_tables(sums, self._fused, dst_shift=shift)
        _run_tables(sums, self._after, src_shift=shift, dst_shift=shift)
        for i in self.views:
            p = ps[i]
            c = plan.copies[p.copy]
            sums[i] = _reference(_view(targets[p.dst], c.dst_dim, c.dst_rows))
        for i in self.reference:
            p = ps[i]
            sums[i] = _reference(_rows_of(targets[p.dst], p.dst_row, p.rows))
        return [int(s) for s in sums]  # type: ignore[arg-type]


class Verifier:
    """The engine's side: the checksum of every piece's bytes in its own tensors, sorted once
    like :class:`Writer` (the engine's tensors do not move: the tables hold their addresses)."""

    def __init__(self, plan: Plan, ps: list[Piece], targets: MappingABC[str, Any]):
        self.plan, self.ps = plan, ps
        summed: list[tuple[int, Any, tuple[int, int, int]]] = []
        self.reference: list[int] = []
        for i, p in enumerate(ps):
            dst = targets[p.dst]
            if p.kind == "rows":
                d_addr, d_bytes = _span(dst, p.dst_row, p.rows)
                if _kernels_for(dst) and dst.is_contiguous() and d_addr % 4 == 0:
                    summed.append((i, dst.device, (d_addr, d_addr, d_bytes)))
                    continue
            self.reference.append(i)
        self._tables = _tables(summed)

    def run(self, targets: MappingABC[str, Any]) -> list[int]:
        sums: list[int | None] = [None] * len(self.ps)
        _run_tables(sums, self._tables)
        for i in self.reference:
            p = self.ps[i]
            dst = targets[p.dst]
            if p.kind == "view":
                c = self.plan.copies[p.copy]
                sums[i] = _reference(_view(dst, c.dst_dim, c.dst_rows))
            else:
                sums[i] = _reference(_rows_of(dst, p.dst_row, p.rows))
        return [int(s) for s in sums]  # type: ignore[arg-type]


def _tables(items: list, *, copy: bool = False) -> list[tuple[list[int], Any]]:
    """One :class:`~vitrify.weights.kernels.PieceTable` per device over ``items`` (piece index,
    device, (source, destination, bytes)), with the piece indices in its order."""
    devices: dict[Any, list] = {}
    for it in items:
        devices.setdefault(it[1], []).append(it)
    return [([i for i, _, _ in group],
             kernels.PieceTable([p for _, _, p in group], dev, copy=copy))
            for dev, group in devices.items()]


def _run_tables(sums: list, tables: list, **shifts: int) -> None:
    for idx, table in tables:
        for i, s in zip(idx, table.sums(**shifts)):
            sums[i] = s


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
