"""Page geometry of SGLang's host pools: the :class:`~vitrify.host.PageLayout` of the host KV pool
(cross-checked against SGLang's own page metadata), the flat data page of every other pool, what
identifies each, the model's part of a page's identity (path, revision, weight version,
quantization, KV cache dtype), and the per-rank slab-store names derived from them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .... import host as _host
from .. import versions


@dataclass(frozen=True)
class _HostGeometry:
    layout: _host.PageLayout
    page_tokens: int
    blob_bytes: int
    identity: str  # what must match for a stored page to be valid for this pool


def _host_geometry(pool: Any) -> _HostGeometry:
    """The vitrify :class:`~vitrify.host.PageLayout` of an SGLang host KV pool (MHA or MLA).

    Supported: ``layer_first``, ``page_first`` and ``page_first_direct`` layouts of a pool with
    one ``kv_buffer`` tensor (SGLang's MHA and MLA host pools). The layout is cross-checked
    against the pool's own page-buffer metadata (``get_page_buffer_meta``) for the first and
    the last page; any disagreement is a ValueError, never a silent misread.
    """
    layout_name = getattr(pool, "layout", None)
    buf = getattr(pool, "kv_buffer", None)
    page_tokens = int(getattr(pool, "page_size", 0) or 0)
    kind = type(pool).__name__
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"vitrify HiCache backend: host pool {kind} has no single kv_buffer "
                         f"tensor (separate K/V buffers are not supported)")
    if buf.device.type != "cpu":
        raise ValueError(f"vitrify HiCache backend: host pool buffer is on {buf.device}")
    if int(getattr(pool, "dcp_size", 1) or 1) != 1:
        raise ValueError("vitrify HiCache backend: decode-context-parallel host pools "
                         f"(dcp_size={pool.dcp_size}) are not supported")
    if page_tokens < 1:
        raise ValueError(f"vitrify HiCache backend: host pool page_size={page_tokens!r}")
    # MHA buffers lead with a K/V dimension of 2; MLA buffers hold one fused latent per token.
    mha = not hasattr(pool, "kv_lora_rank")
    if mha and buf.shape[0] != 2:
        raise ValueError(f"vitrify HiCache backend: {kind} kv_buffer has shape {tuple(buf.shape)}; "
                         f"a leading K/V dimension of 2 is expected")
    if layout_name == "layer_first":
        lay = _host.PageLayout.from_tensor(buf, component_dim=0 if mha else None,
                                           layer_dim=1 if mha else 0,
                                           token_dim=2 if mha else 1, page_tokens=page_tokens)
    elif layout_name == "page_first":
        lay = _host.PageLayout.from_tensor(buf, component_dim=0 if mha else None,
                                           token_dim=1 if mha else 0, page_tokens=page_tokens)
    elif layout_name == "page_first_direct":
        lay = _host.PageLayout.from_tensor(buf, component_dim=0 if mha else None,
                                           token_dim=1 if mha else 0, page_tokens=1)
    else:
        raise ValueError(f"vitrify HiCache backend: host layout {layout_name!r} is not supported "
                         f"(use layer_first, page_first or page_first_direct)")
    expected_pages = int(pool.size) // page_tokens
    if lay.pages != expected_pages:
        raise ValueError(f"vitrify HiCache backend: layout of {kind} has {lay.pages} pages, the "
                         f"pool {expected_pages} (size {pool.size}, page_size {page_tokens})")
    _check_against_meta(pool, lay, page_tokens, 0)
    _check_against_meta(pool, lay, page_tokens, lay.pages - 1)
    ident = "|".join(str(x) for x in (
        "v1", kind, layout_name, buf.dtype, getattr(pool, "layer_num", "?"),
        getattr(pool, "start_layer", "?"), getattr(pool, "head_num", "?"),
        getattr(pool, "head_dim", "?"), getattr(pool, "kv_cache_dim", "?"), page_tokens,
        lay.blob_bytes, len(lay.components),
        lay.layers, lay.slice_bytes))
    # SGLang 0.5.23's MHA pools have a V head width of their own; one that differs from the K
    # width changes the page's bytes (a pool without it, or with the same width, keeps the
    # identity text of 0.5.17, so its stored pages stay valid across the upgrade)
    v_dim = getattr(pool, "v_head_dim", None)
    if v_dim is not None and v_dim != getattr(pool, "head_dim", None):
        ident += f"|v_head_dim={v_dim}"
    return _HostGeometry(lay, page_tokens, lay.blob_bytes, ident)


def _check_against_meta(pool: Any, lay: _host.PageLayout, page_tokens: int, page: int) -> None:
    meta = getattr(pool, "get_page_buffer_meta", None)
    if meta is None:
        return
    idx = torch.arange(page * page_tokens, (page + 1) * page_tokens, dtype=torch.int64)
    ptrs, sizes = meta(idx)
    theirs = sorted(zip((int(p) for p in ptrs), (int(s) for s in sizes)))
    ours = sorted((c + l * lay.layer_stride + page * lay.page_stride, lay.slice_bytes)
                  for c in lay.components for l in range(lay.layers))
    # SGLang describes a page either per (component, layer) slice or as one piece per
    # component covering all layers: compare the byte ranges they cover.
    if _ranges(theirs) != _ranges(ours):
        raise ValueError(f"vitrify HiCache backend: page {page} of {type(pool).__name__} "
                         f"({pool.layout}) is {theirs[:4]}... by get_page_buffer_meta but "
                         f"{ours[:4]}... by vitrify's layout")


def _ranges(pieces: list) -> list:
    out: list = []
    for a, n in sorted(pieces):
        if out and out[-1][1] == a:
            out[-1][1] = a + n
        else:
            out.append([a, a + n])
    return out


def _flat_page(pool: Any) -> tuple:
    """(dtype, elements, bytes) of the pool's flat data page (what SGLang stores per key)."""
    page = pool.get_dummy_flat_data_page()
    if not isinstance(page, torch.Tensor) or page.numel() == 0:
        raise ValueError(f"get_dummy_flat_data_page() gave {type(page).__name__} "
                         f"of {getattr(page, 'numel', lambda: '?')()} elements")
    return page.dtype, int(page.numel()), int(page.numel() * page.element_size())


def _pool_identity(pool: Any, page_bytes: int) -> str:
    """What must match for a stored page to be valid for this pool (goes into the file name)."""
    parts = ["v2", type(pool).__name__, str(getattr(pool, "layout", "?")),
             str(getattr(pool, "page_size", "?")), str(page_bytes)]
    for attr in ("dtype", "layer_num", "start_layer", "head_num", "head_dim", "kv_cache_dim",
                 "kv_lora_rank", "num_mamba_layers", "conv_state_shapes",
                 "temporal_state_shape", "conv_dtype", "temporal_dtype"):
        if hasattr(pool, attr):
            parts.append(f"{attr}={getattr(pool, attr)}")
    return "|".join(parts)


# ---- slab-store names --------------------------------------------------------------------------


def _slug(text: str, limit: int = 40) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"
    return s[:limit]


def _rank_suffix(cfg: Any) -> str:
    """This rank's place in SGLang's parallelism (``tp<r>of<n>-pp<r>of<n>-cp<r>of<n>``, and
    what the release adds: ``-dp<r>`` for a DP-attention group ``r > 0`` on 0.5.23)."""
    return (f"tp{cfg.tp_rank}of{cfg.tp_size}-pp{cfg.pp_rank}of{cfg.pp_size}"
            f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
            f"{versions.current().hicache_rank_extra(cfg)}")


def _shares_tp_store(cfg: Any) -> bool:
    """MLA under tensor parallelism: every TP rank holds the same KV pages, so SGLang backs them
    up from TP rank 0 only and every rank reads them; the ranks share one store."""
    return bool(cfg.is_mla_model) and cfg.tp_size > 1


def _store_suffix(cfg: Any) -> str:
    """The parallel slice in a store name: :func:`_rank_suffix`, except that the TP ranks of an
    MLA model share one store (``tpsharedof<n>``: the TP size stays, the TP rank goes)."""
    if _shares_tp_store(cfg):
        return (f"tpsharedof{cfg.tp_size}-pp{cfg.pp_rank}of{cfg.pp_size}"
                f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
                f"{versions.current().hicache_rank_extra(cfg)}")
    return _rank_suffix(cfg)


def _store_name(prefix: str, cfg: Any, identity: str, model: "_ModelIdentity",
                pool: Optional[str] = None) -> str:
    """``<prefix>-<model>-<hash of model identity and pool identity>[-<pool>]-<rank suffix>``:
    the slab-file name of one store, so a key only ever resolves to a page of the same model
    (name, path, revision, weight version, quantization, KV cache dtype), layout, geometry and
    rank (``pool``: an extra pool's name; None for the KV store). MLA under tensor parallelism
    names no TP rank: the TP ranks share the store (:func:`_store_suffix`)."""
    digest = hashlib.sha256(f"{model.text()}|{identity}".encode()).hexdigest()[:12]
    part = f"-{_slug(pool, 24)}" if pool is not None else ""
    return f"{prefix}-{_slug(cfg.model_name or 'model')}-{digest}{part}-{_store_suffix(cfg)}"


# ---- the model's part of a page's identity -------------------------------------------------------

# ServerArgs fields that change the bytes of a KV page without changing the host pool's geometry.
_SERVER_ARGS_FIELDS = ("model_path", "revision", "weight_version", "quantization",
                       "kv_cache_dtype")


@dataclass(frozen=True)
class _ModelIdentity:
    """What, besides the pool's geometry (:class:`_HostGeometry` / :func:`_pool_identity`),
    decides the bytes of a page. Learned at construction: ``model_name`` from SGLang's
    ``HiCacheStorageConfig``, the rest from the scheduler's published ``ServerArgs``
    (``--model-path``, ``--revision``, ``--weight-version``, ``--quantization``,
    ``--kv-cache-dtype``; None where the process published none), ``revision`` and
    ``weight_version`` from the extra config when it names them. A later weight update bumps
    SGLang's weight version in the tokenizer process only; the scheduler, and so this backend,
    never sees it: :meth:`~.backend.VitrifyStorage.set_weight_version` tells the backend."""

    model_name: Optional[str]
    model_path: Optional[str] = None
    revision: Optional[str] = None
    weight_version: Optional[str] = None
    quantization: Optional[str] = None
    kv_cache_dtype: Optional[str] = None

    def text(self) -> str:
        """The canonical text hashed into the slab names (every field, named)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)


def _model_identity(cfg: Any, revision: Optional[str],
                    weight_version: Optional[str]) -> _ModelIdentity:
    """The model identity of this rank: ``revision`` / ``weight_version`` (the extra config's,
    None: not given) win over the published server args, which are read as the release
    resolved them (``hicache_published_args`` of the version module: 0.5.17's fields hold the
    resolved values, 0.5.23's the operator's raw input, resolved through ``resolving_view``)."""
    read = versions.current().hicache_published_args()
    found = {f: (None if read is None else read(f)) for f in _SERVER_ARGS_FIELDS}
    found = {f: (None if v is None else str(v)) for f, v in found.items()}
    if revision is not None:
        found["revision"] = revision
    if weight_version is not None:
        found["weight_version"] = weight_version
    return _ModelIdentity(model_name=cfg.model_name, **found)
