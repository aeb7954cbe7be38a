"""Declarative mappings from a trainer's tensor layout to an engine's (weight update).

Training frameworks hold fused tensors under their own names: Megatron-style Llama/Qwen models
keep one ``linear_qkv`` whose rows are grouped per KV head (each group: that group's query heads,
then its key head, then its value head), one ``linear_fc1`` with the gate rows followed by the up
rows, and the input norms inside the fused linears. An engine holds separate tensors
(transformers: ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``) or other fusions
(SGLang: ``qkv_proj`` = all query rows, then all key rows, then all value rows; ``gate_up_proj``).

A :class:`Mapping` is a list of :class:`Rule`: a regular expression over source names and the
:class:`Move` s one matching tensor makes, each a strided block of rows (:class:`Rows`) of the
source copied into a strided block of rows of a destination. :meth:`Mapping.plan` resolves it
against both sides' (shape, dtype) specs and checks everything before a byte moves:

- every source tensor is matched by exactly one rule (or listed in ``ignore``);
- every move's row counts, group counts and the other dimensions agree, naming the tensor;
- every destination tensor is covered exactly once, row by row, and no destination is missing;
- every row of every mapped source goes somewhere (rows left over are a mis-split).

:func:`copy` runs one planned move with torch, on the tensors' device (a strided view of each
side; ``copy_`` casts where the dtypes differ). Nothing here allocates beyond torch's views.

:func:`megatron_llama` builds the mapping of a Megatron-style Llama/Qwen2 checkpoint onto the
transformers engine's names (``engine="separate"``) or SGLang's fused ones (``engine="fused"``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping as MappingABC
from typing import Any

from .. import _check

Spec = tuple[tuple[int, ...], str]  # (shape, dtype name)


class MappingError(ValueError):
    """A mapping does not fit the tensors it is applied to (names the tensor and both numbers)."""


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows of a tensor along ``dim``. The rows from ``start`` are cut into ``parts`` equal parts
    and part ``part`` is taken; in it, ``groups`` blocks of ``stride`` rows (None: the part
    divided equally) and, in each block, the ``length`` rows from ``offset`` (None: the rest of
    the block). ``Rows()`` is every row; ``Rows(part=1, parts=2)`` the second half;
    ``Rows(groups=8, stride=640, length=512)`` the first 512 rows of each of 8 blocks of 640."""

    dim: int = 0
    start: int = 0
    part: int = 0
    parts: int = 1
    groups: int = 1
    stride: int | None = None
    offset: int = 0
    length: int | None = None

    def resolve(self, rows: int, what: str) -> tuple[int, int, int, int, int]:
        """(first row, groups, stride, offset, length) for a tensor of ``rows`` rows along
        ``dim``; :class:`MappingError` naming ``what`` when they do not fit."""
        if (self.groups < 1 or self.parts < 1 or not 0 <= self.part < self.parts
                or self.start < 0 or self.offset < 0):
            raise MappingError(f"{what}: bad row selection {self}")
        if (rows - self.start) % self.parts:
            raise MappingError(f"{what}: {rows - self.start} rows do not cut into {self.parts} "
                               f"equal parts")
        size = (rows - self.start) // self.parts
        first = self.start + self.part * size
        stride = self.stride
        if stride is None:
            if size % self.groups:
                raise MappingError(f"{what}: {size} rows do not divide into {self.groups} groups")
            stride = size // self.groups
        length = stride - self.offset if self.length is None else self.length
        if length < 1 or self.offset + length > stride:
            raise MappingError(f"{what}: rows {self.offset}..{self.offset + length} of each "
                               f"group do not fit a group of {stride} rows")
        if self.groups * stride > size:
            raise MappingError(f"{what}: {self.groups} groups of {stride} rows need "
                               f"{self.groups * stride} rows from row {first}, there are {size}")
        return first, self.groups, stride, self.offset, length


@dataclasses.dataclass(frozen=True)
class Move:
    """Copy ``src`` rows of the matched tensor into ``dst`` rows of destination ``to`` (a name
    template: ``{name}`` fields come from the rule's named groups)."""

    to: str
    src: Rows = Rows()
    dst: Rows = Rows()


@dataclasses.dataclass(frozen=True)
class Rule:
    """Source tensors whose whole name matches ``pattern`` make ``moves``. ``partial``: the
    moves may leave rows of the source unused on purpose (a trainer's vocabulary padding, say);
    otherwise rows going nowhere are a mis-split and refused."""

    pattern: str
    moves: tuple[Move, ...]
    partial: bool = False

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise MappingError(f"rule pattern {self.pattern!r} is not a regular expression: "
                               f"{e}") from None
        if not self.moves:
            raise MappingError(f"rule {self.pattern!r} has no moves")


@dataclasses.dataclass(frozen=True)
class Copy:
    """One planned move: rows of ``src`` into rows of ``dst`` (resolved: start, groups, stride,
    offset, length along ``dim``)."""

    src: str
    dst: str
    src_dim: int
    src_rows: tuple[int, int, int, int, int]
    dst_dim: int
    dst_rows: tuple[int, int, int, int, int]

    @property
    def row_count(self) -> int:
        return self.src_rows[1] * self.src_rows[4]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every copy of an update, grouped by source tensor in the sources' order."""

    copies: tuple[Copy, ...]

    def for_source(self, name: str) -> list[Copy]:
        return [c for c in self.copies if c.src == name]


@dataclasses.dataclass(frozen=True)
class Mapping:
    """Rules from source names to destination names; ``ignore``: source patterns that have no
    destination (e.g. a trainer's extra state); ``keep``: destination patterns an update leaves
    as they are (buffers no trainer holds, e.g. rotary frequencies)."""

    rules: tuple[Rule, ...]
    ignore: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()

    def plan(self, src: MappingABC[str, Spec], dst: MappingABC[str, Spec]) -> Plan:
        """Resolve the rules against the sources' and destinations' (shape, dtype) and check
        them (see the module docstring). Raises :class:`MappingError` naming the tensor."""
        src = _specs("src", src)
        kept = [re.compile(p) for p in self.keep]
        dst = {n: spec for n, spec in _specs("dst", dst).items()
               if not any(rx.fullmatch(n) for rx in kept)}
        compiled = [(re.compile(r.pattern), r) for r in self.rules]
        ignored = [re.compile(p) for p in self.ignore]
        copies: list[Copy] = []
        partial: set[str] = set()
        for name, (shape, _dtype) in src.items():
            hits = [(m, r) for rx, r in compiled if (m := rx.fullmatch(name))]
            if not hits:
                if any(rx.fullmatch(name) for rx in ignored):
                    continue
                raise MappingError(f"source tensor {name!r} matches no rule of the mapping")
            if len(hits) > 1:
                raise MappingError(f"source tensor {name!r} matches {len(hits)} rules: "
                                   f"{[r.pattern for _, r in hits]}")
            m, rule = hits[0]
            if rule.partial:
                partial.add(name)
            for mv in rule.moves:
                copies.append(_resolve(name, shape, m.groupdict(), mv, dst))
        _check_coverage(copies, dst)
        _check_consumed([c for c in copies if c.src not in partial], src)
        return Plan(tuple(copies))


def _specs(what: str, specs: Any) -> dict[str, Spec]:
    """``specs`` (``src`` or ``dst`` of :meth:`Mapping.plan`) checked and normalised: a mapping
    of tensor name to ``(shape, dtype)``, the shape a sequence of ints in [0, 2**63 - 1] and the
    dtype a name (a str, or anything whose ``str()`` is one, e.g. ``torch.bfloat16``). Anything
    else is one line naming the argument, the tensor and what was received."""
    if not isinstance(specs, MappingABC):
        raise _check.ArgumentTypeError(
            f"{what} must be a mapping of tensor name to (shape, dtype), got {_check.got(specs)}")
    out: dict[str, Spec] = {}
    for name, spec in specs.items():
        if not isinstance(name, str):
            raise _check.ArgumentTypeError(f"{what}: tensor names must be str, got "
                                           f"{_check.got(name)}")
        where = f"{what}[{name!r}]"
        if isinstance(spec, (str, bytes)) or not isinstance(spec, (tuple, list)) \
                or len(spec) != 2:
            raise _check.ArgumentTypeError(f"{where} must be a pair (shape, dtype), got "
                                           f"{_check.got(spec)}")
        shape, dtype = spec
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
            raise _check.ArgumentTypeError(f"{where}: the shape must be a sequence of ints, got "
                                           f"{_check.got(shape)}")
        dims = tuple(_check.integer(f"{where}: a dimension", d, 0, _check.I64_MAX)
                     for d in shape)
        if dtype is None or (isinstance(dtype, str) and not dtype):
            raise _check.ArgumentTypeError(f"{where}: the dtype must be a name such as "
                                           f"'bfloat16', got {_check.got(dtype)}")
        out[name] = (dims, str(dtype))
    return out


def _resolve(name: str, shape: tuple[int, ...], fields: dict, mv: Move,
             dst: dict[str, Spec]) -> Copy:
    try:
        to = mv.to.format(**fields)
    except KeyError as e:
        raise MappingError(f"move {mv.to!r} for {name!r} names {e}, which the rule's pattern "
                           f"does not capture") from None
    if to not in dst:
        raise MappingError(f"source tensor {name!r} maps to {to!r}, which the engine does not "
                           f"have")
    dshape = dst[to][0]
    for side, rows, shp, n in (("source", mv.src, shape, name),
                               ("destination", mv.dst, dshape, to)):
        if not 0 <= rows.dim < len(shp):
            raise MappingError(f"{side} {n!r} has {len(shp)} dimensions; rows along dim "
                               f"{rows.dim} do not exist")
    if mv.src.dim != mv.dst.dim:
        raise MappingError(f"{name!r} -> {to!r}: rows are taken along dimension {mv.src.dim} "
                           f"and written along {mv.dst.dim}; a move keeps its dimension")
    s = mv.src.resolve(shape[mv.src.dim], f"source {name!r}")
    d = mv.dst.resolve(dshape[mv.dst.dim], f"destination {to!r} (from {name!r})")
    if s[1] != d[1] or s[4] != d[4]:
        raise MappingError(f"{name!r} -> {to!r}: the source gives {s[1]} group(s) of {s[4]} "
                           f"rows, the destination takes {d[1]} group(s) of {d[4]} rows")
    rest_s = shape[:mv.src.dim] + shape[mv.src.dim + 1:]
    rest_d = dshape[:mv.dst.dim] + dshape[mv.dst.dim + 1:]
    if rest_s != rest_d:
        raise MappingError(f"{name!r} {list(shape)} -> {to!r} {list(dshape)}: the dimensions "
                           f"other than the rows differ ({list(rest_s)} vs {list(rest_d)})")
    return Copy(name, to, mv.src.dim, s, mv.dst.dim, d)


def _intervals(rows: tuple[int, int, int, int, int]) -> Iterable[tuple[int, int]]:
    start, groups, stride, offset, length = rows
    for g in range(groups):
        lo = start + g * stride + offset
        yield lo, lo + length


def _check_coverage(copies: list[Copy], dst: dict[str, Spec]) -> None:
    """Every destination covered exactly once along one dimension, none left out."""
    by_dst: dict[str, list[tuple[int, int, str]]] = {}
    dims: dict[str, int] = {}
    for c in copies:
        if dims.setdefault(c.dst, c.dst_dim) != c.dst_dim:
            raise MappingError(f"destination {c.dst!r} is written along dimensions "
                               f"{dims[c.dst]} and {c.dst_dim}")
        by_dst.setdefault(c.dst, []).extend((lo, hi, c.src) for lo, hi in _intervals(c.dst_rows))
    missing = sorted(set(dst) - set(by_dst))
    if missing:
        raise MappingError(f"{len(missing)} engine tensor(s) get nothing from the source: "
                           f"{missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for name, spans in by_dst.items():
        rows = dst[name][0][dims[name]]
        bad = first_misfit([(lo, hi) for lo, hi, _ in spans], rows)
        if bad is not None:
            kind, lo, hi = bad
            if kind == "overlap":
                src = next(s for a, b, s in sorted(spans) if a == lo)
                raise MappingError(f"engine tensor {name!r}: rows {lo}..{hi} from {src!r} "
                                   f"overlap rows written by another source")
            raise MappingError(f"engine tensor {name!r}: rows {lo}..{hi} get nothing from the "
                               f"source")


def first_misfit(spans: Iterable[tuple[int, int]], rows: int) -> tuple[str, int, int] | None:
    """How row spans fail to cover ``[0, rows)`` exactly once: ("overlap", lo, hi) for the
    first span starting inside another, ("gap", lo, hi) for the first rows none covers, or
    None when they tile it."""
    at = 0
    for lo, hi in sorted(spans):
        if lo < at:
            return "overlap", lo, hi
        if lo > at:
            return "gap", at, lo
        at = hi
    return None if at == rows else ("gap", at, rows)


def _check_consumed(copies: list[Copy], src: MappingABC[str, Spec]) -> None:
    """Every row of every mapped source goes somewhere (a row may go to several destinations,
    e.g. tied embeddings): a source with rows left over is a mis-split — say a trainer with
    more KV heads than the engine — and is refused."""
    by_src: dict[str, list[Copy]] = {}
    for c in copies:
        by_src.setdefault(c.src, []).append(c)
    for name, cs in by_src.items():
        dims = {c.src_dim for c in cs}
        if len(dims) > 1:
            raise MappingError(f"source tensor {name!r} is moved along dimensions {sorted(dims)}; "
                               f"a source's moves share one dimension")
        rows = int(tuple(src[name][0])[cs[0].src_dim])
        at = 0
        for lo, hi in sorted(iv for c in cs for iv in _intervals(c.src_rows)):
            if lo > at:
                break
            at = max(at, hi)
        if at < rows:
            used = sum(c.row_count for c in cs)
            raise MappingError(f"source tensor {name!r}: rows {at}.. of {rows} go nowhere "
                               f"({used} rows mapped): the mapping does not fit this layout")


def _view(t: Any, dim: int, rows: tuple[int, int, int, int, int]) -> Any:
    start, groups, stride, offset, length = rows
    v = t.narrow(dim, start, groups * stride).unflatten(dim, (groups, stride))
    return v.narrow(dim + 1, offset, length)


def copy(c: Copy, src: Any, dst: Any) -> None:
    """Run one planned move: ``dst``'s rows receive ``src``'s (torch tensors; cast by ``copy_``
    when the dtypes differ; asynchronous on a GPU like any ``copy_``)."""
    dst_view = _view(dst, c.dst_dim, c.dst_rows)
    src_view = _view(src, c.src_dim, c.src_rows)
    if tuple(dst_view.shape) != tuple(src_view.shape):  # plan() checked: a different tensor came
        raise MappingError(f"{c.src!r} -> {c.dst!r}: got tensors of shapes {list(src.shape)} "
                           f"and {list(dst.shape)}, not the planned ones")
    dst_view.copy_(src_view)


# ---- Megatron-style Llama / Qwen2 --------------------------------------------------------------


def megatron_llama(*, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool = False,
                   engine: str = "separate", qk_norm: bool = False) -> Mapping:
    """A Megatron-style (Megatron-Core, TransformerEngine fused norms) Llama / Qwen2 layout onto
    the engine's names: ``engine="separate"`` for transformers' names (the transformers engine),
    ``"fused"`` for SGLang's ``qkv_proj`` / ``gate_up_proj``.

    Source names: ``embedding.word_embeddings.weight``, ``output_layer.weight``,
    ``decoder.final_layernorm.weight``, and per layer ``decoder.layers.<i>.``
    ``self_attention.linear_qkv.weight`` (``.bias`` with ``qkv_bias``; rows grouped per KV head:
    ``heads // kv_heads`` query heads, one key head, one value head, ``head_dim`` rows each),
    ``self_attention.linear_qkv.layer_norm_weight`` (the input norm),
    ``self_attention.linear_proj.weight``, ``mlp.linear_fc1.weight`` (gate rows, then up rows),
    ``mlp.linear_fc1.layer_norm_weight`` (the post-attention norm), ``mlp.linear_fc2.weight``;
    with ``qk_norm`` (Qwen3) ``self_attention.q_layernorm.weight`` and ``k_layernorm.weight``.
    """
    _check.integer("heads", heads, 1, 1 << 20)
    _check.integer("kv_heads", kv_heads, 1, 1 << 20)
    _check.integer("head_dim", head_dim, 1, 1 << 20)
    if heads % kv_heads:
        raise MappingError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if engine not in ("separate", "fused"):
        raise MappingError(f"engine must be 'separate' or 'fused', got {engine!r}")
    per = heads // kv_heads  # query heads per KV group
    group = (per + 2) * head_dim  # rows of one KV group in linear_qkv
    q_rows, kv_rows = per * head_dim, head_dim
    L = r"decoder\.layers\.(?P<i>\d+)\."
    E = "model.layers.{i}."

    def qkv(suffix: str) -> list[Move]:
        src_q = Rows(groups=kv_heads, stride=group, offset=0, length=q_rows)
        src_k = Rows(groups=kv_heads, stride=group, offset=q_rows, length=kv_rows)
        src_v = Rows(groups=kv_heads, stride=group, offset=q_rows + kv_rows, length=kv_rows)
        if engine == "separate":
            return [Move(f"{E}self_attn.q_proj.{suffix}", src_q, Rows(groups=kv_heads)),
                    Move(f"{E}self_attn.k_proj.{suffix}", src_k, Rows(groups=kv_heads)),
                    Move(f"{E}self_attn.v_proj.{suffix}", src_v, Rows(groups=kv_heads))]
        fused = f"{E}self_attn.qkv_proj.{suffix}"
        q_all, kv_all = heads * head_dim, kv_heads * head_dim
        return [Move(fused, src_q, Rows(start=0, groups=kv_heads, stride=q_rows)),
                Move(fused, src_k, Rows(start=q_all, groups=kv_heads, stride=kv_rows)),
                Move(fused, src_v, Rows(start=q_all + kv_all, groups=kv_heads, stride=kv_rows))]

    rules = [
        Rule(r"embedding\.word_embeddings\.weight", (Move("model.embed_tokens.weight"),)),
        Rule(r"output_layer\.weight", (Move("lm_head.weight"),)),
        Rule(r"decoder\.final_layernorm\.weight", (Move("model.norm.weight"),)),
        Rule(L + r"self_attention\.linear_qkv\.weight", tuple(qkv("weight"))),
        Rule(L + r"self_attention\.linear_qkv\.layer_norm_weight",
             (Move(E + "input_layernorm.weight"),)),
        Rule(L + r"self_attention\.linear_proj\.weight", (Move(E + "self_attn.o_proj.weight"),)),
        Rule(L + r"mlp\.linear_fc1\.layer_norm_weight",
             (Move(E + "post_attention_layernorm.weight"),)),
        Rule(L + r"mlp\.linear_fc2\.weight", (Move(E + "mlp.down_proj.weight"),)),
    ]
    if engine == "separate":  # linear_fc1: the gate's rows, then the up projection's
        rules.append(Rule(L + r"mlp\.linear_fc1\.weight", (
            Move(E + "mlp.gate_proj.weight", Rows(part=0, parts=2)),
            Move(E + "mlp.up_proj.weight", Rows(part=1, parts=2)))))
    else:  # SGLang's gate_up_proj has the same order
        rules.append(Rule(L + r"mlp\.linear_fc1\.weight", (Move(E + "mlp.gate_up_proj.weight"),)))
    if qkv_bias:
        rules.append(Rule(L + r"self_attention\.linear_qkv\.bias", tuple(qkv("bias"))))
    if qk_norm:  # Qwen3: RMS norms of the query and key heads
        rules += [Rule(L + r"self_attention\.q_layernorm\.weight",
                       (Move(E + "self_attn.q_norm.weight"),)),
                  Rule(L + r"self_attention\.k_layernorm\.weight",
                       (Move(E + "self_attn.k_norm.weight"),))]
    return Mapping(tuple(rules), keep=(r"model\.rotary_emb\.inv_freq",))


def megatron_layout(weights: MappingABC[str, Any], *, layers: int, heads: int, kv_heads: int,
                    qkv_bias: bool = False, qk_norm: bool = False) -> dict[str, Any]:
    """Tensors under Hugging Face / transformers Llama-Qwen names (``model.layers.<i>.
    self_attn.q_proj.weight`` ...) in the Megatron-style layout :func:`megatron_llama` maps
    from: what a trainer holds. ``linear_qkv`` has each KV group's query heads, key head and
    value head together; ``linear_fc1`` is gate then up; the norms sit in the fused linears
    (``qk_norm``: Qwen3's q/k norms as ``q_layernorm`` / ``k_layernorm``). Views and
    concatenations of the given tensors (torch)."""
    import torch

    per = heads // kv_heads
    out = {"embedding.word_embeddings.weight": weights["model.embed_tokens.weight"],
           "output_layer.weight": weights["lm_head.weight"],
           "decoder.final_layernorm.weight": weights["model.norm.weight"]}
    for i in range(layers):
        e, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        hd = weights[f"{e}self_attn.k_proj.weight"].shape[0] // kv_heads
        for suffix in ("weight", "bias") if qkv_bias else ("weight",):
            q, k, v = (weights[f"{e}self_attn.{x}_proj.{suffix}"] for x in "qkv")
            rest = q.shape[1:]
            out[f"{m}self_attention.linear_qkv.{suffix}"] = torch.cat(
                [q.reshape(kv_heads, per * hd, *rest), k.reshape(kv_heads, hd, *rest),
                 v.reshape(kv_heads, hd, *rest)], dim=1).reshape(-1, *rest)
        out[f"{m}self_attention.linear_qkv.layer_norm_weight"] = weights[
            f"{e}input_layernorm.weight"]
        out[f"{m}self_attention.linear_proj.weight"] = weights[f"{e}self_attn.o_proj.weight"]
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat([weights[f"{e}mlp.gate_proj.weight"],
                                                     weights[f"{e}mlp.up_proj.weight"]])
        out[f"{m}mlp.linear_fc1.layer_norm_weight"] = weights[
            f"{e}post_attention_layernorm.weight"]
        out[f"{m}mlp.linear_fc2.weight"] = weights[f"{e}mlp.down_proj.weight"]
        if qk_norm:
            out[f"{m}self_attention.q_layernorm.weight"] = weights[f"{e}self_attn.q_norm.weight"]
            out[f"{m}self_attention.k_layernorm.weight"] = weights[f"{e}self_attn.k_norm.weight"]
    return out
