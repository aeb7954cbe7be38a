"""SGLang HiCache L3 storage backend on vitrify's tiers (unmodified SGLang).

Start SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{
        "backend_name": "vitrify",
        "module_path": "vitrify.integrations.sglang.hicache",
        "class_name": "VitrifyStorage",
        "interface_v1": 1,
        "dirs": ["/nvme0/vitrify", "/nvme1/vitrify"],
        "budget_bytes": 500000000000,
        "cold_start": "load",
        "direct_io": "auto"}'

``interface_v1: 1`` makes SGLang's cache controller call the zero-copy
:meth:`VitrifyStorage.batch_get_v1` / :meth:`VitrifyStorage.batch_set_v1` with host-pool page indices.
Each page is gathered natively (:mod:`vitrify.host`, multi-threaded, GIL released) from the host
pool's layout straight into a 4 KiB-aligned disk slot buffer and written with one O_DIRECT
transfer into a preallocated slab (:mod:`vitrify.tier`); a get reads the slot, verifies it
(CRC32C, key, length) and scatters it back into the host pool.

Extra-config keys (besides SGLang's ``backend_name``, ``module_path``, ``class_name``,
``interface_v1``):

=================  =====================================================================
``dirs``           one directory per drive (str or list); required
``budget_bytes``   disk bytes for THIS rank's slabs (int); or ``budget_gb`` (1e9 bytes)
``cold_start``     ``"load"`` (default: keep pages across restarts) or ``"clear"``
``direct_io``      ``"auto"`` / ``"on"`` / ``"off"``; default ``VITRIFY_DIRECT_IO``
``staging_bytes``  bytes of slot buffers per direction (default 256 MiB)
``read_threads``   I/O threads per drive for reads (default 8)
``write_threads``  I/O threads per drive for writes (default 2)
``name``           file-name prefix (default ``"hicache"``)
``extra_pool_      bytes of ``budget_bytes`` set aside for the v2 extra pools (int >= 0 and
budget_bytes``     < ``budget_bytes``); default: derived from page sizes, see below
=================  =====================================================================

Slab files are per rank and per model: ``<dir>/<name>-<model>-<geometry hash>-tp<r>of<n>-
pp<r>of<n>-cp<r>of<n>.kind0.slab``, so ranks never share a slab, and a key (SGLang's content
hash of the token ids) can only ever resolve to a page of the same model, layout and geometry.

Hybrid models (SGLang's v2 multi-pool API): SGLang's ``HybridCacheController`` registers its
``HostPoolGroup`` as the v1 host pool, then every entry of the group with
``register_mem_host_pool_v2`` (``kv``, and ``mamba`` / ``swa`` / ``indexer`` / ... pools). KV
transfers (pool name ``kv``) go through the KV slab store above (zero-copy ``batch_*_v1``), so v1
and v2 share one KV key space. Every other pool gets its own :class:`~vitrify.tier.DiskStore`:
slab files ``<dir>/<name>-<model>-<pool geometry hash>-<pool>-tp..-pp..-cp...kind0.slab`` in the
same directories, with the same rank suffixes, cold start and direct-I/O mode as the KV store,
its page size the byte size of the pool's flat data page. Pages are copied through the pool's
flat-data-page API (``get_data_page(i, flat=True)`` / ``set_from_flat_data_page``), exactly
the bytes SGLang's own file backend (``HiCacheFile``) stores, with the same per-key results and
the same ``batch_exists_v2`` hit policies (``all_pages``, ``trailing_pages``).

Budget split: ``budget_bytes`` is the whole of this rank's disk, never exceeded. The extra pools
together get ``E = extra_pool_budget_bytes`` when given; by default
``E = budget_bytes * min(1/2, P / (K + P))`` with ``K`` the KV page bytes and ``P`` the sum of
the extra pools' page bytes, i.e. room for as many pages of every extra pool as of KV pages (an
``all_pages`` pool such as SWA or a DSA indexer needs one page per KV page, so it never limits
the hit length before KV does; a ``trailing_pages`` pool such as Mamba needs fewer), capped at
half the disk so huge state pages (Mamba) cannot starve KV. The KV store gets
``budget_bytes - E``; pool ``i`` gets ``E * p_i / P``. The extra pools are the entries of the
host pool group registered with :meth:`VitrifyStorage.register_mem_pool_host`; a pool registered
through ``register_mem_host_pool_v2`` that is not among them gets no budget: its transfers are
refused (``False``, logged). Without extra pools (a plain host pool) the KV store gets all of
``budget_bytes`` as before and ``extra_pool_budget_bytes`` is unused.

Errors inside the backend never reach the scheduler: a failed read is a miss, a failed write
is ``False``, an exists query that fails is 0 hits; each is logged on the ``vitrify.sglang``
logger and counted in :meth:`VitrifyStorage.vitrify_stats`. Configuration mistakes (a missing
``dirs``, a layout vitrify cannot gather) raise ``ValueError`` at start-up, naming the value.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from ... import host as _host
from ... import tier as _tier

logger = logging.getLogger("vitrify.sglang.hicache")

# Keys SGLang itself reads from the extra config (they reach the backend too).
_SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "allocator",
    "tp_lcm_size", "prefetch_threshold", "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token", "prefetch_timeout_max",
    "hicache_storage_pass_prefix_keys",
})
_VITRIFY_KEYS = frozenset({
    "dirs", "budget_bytes", "budget_gb", "cold_start", "direct_io", "staging_bytes",
    "read_threads", "write_threads", "name", "extra_pool_budget_bytes",
})
_KIND = "kv"
_MiB = 1 << 20
_MAX_BUDGET = (1 << 63) - 1  # bytes: the disk tier's budget is a signed 64-bit count


# ---- configuration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class VitrifyStorageSettings:
    """The validated vitrify part of SGLang's extra config (see the module docstring)."""

    dirs: tuple
    budget_bytes: int
    cold_start: str = "load"
    direct_io: Optional[str] = None
    staging_bytes: int = 256 * _MiB
    read_threads: int = 8
    write_threads: int = 2
    name: str = "hicache"
    extra_pool_budget_bytes: Optional[int] = None

    @classmethod
    def from_extra_config(cls, extra: Optional[dict]) -> "VitrifyStorageSettings":
        """Parse and validate; ValueError names the offending key and value."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"vitrify HiCache backend: the extra config must be a JSON object "
                             f"(dict), got {type(extra).__name__} {extra!r:.60}")
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in _SGLANG_KEYS and k not in _VITRIFY_KEYS)
        if unknown:
            logger.warning("vitrify HiCache backend: ignoring unknown extra-config keys %s "
                           "(vitrify reads %s)", unknown, sorted(_VITRIFY_KEYS))
        dirs = extra.get("dirs")
        if isinstance(dirs, str):
            dirs = [dirs]
        if not isinstance(dirs, (list, tuple)) or not dirs or \
                not all(isinstance(d, str) and d for d in dirs):
            raise ValueError(f"vitrify HiCache backend: 'dirs' must be a directory or a non-empty "
                             f"list of directories (one per drive), got {extra.get('dirs')!r}")
        for d in dirs:
            problem = _dir_problem(d)
            if problem:
                raise ValueError(f"vitrify HiCache backend: 'dirs' entry {d!r} {problem}")
        has_b, has_g = "budget_bytes" in extra, "budget_gb" in extra
        if has_b == has_g:
            raise ValueError("vitrify HiCache backend: give exactly one of 'budget_bytes' (int) or "
                             f"'budget_gb' (number) for this rank's slabs, got "
                             f"budget_bytes={extra.get('budget_bytes')!r} "
                             f"budget_gb={extra.get('budget_gb')!r}")
        if has_b:
            budget = extra["budget_bytes"]
            if isinstance(budget, bool) or not isinstance(budget, int) or \
                    not 0 < budget <= _MAX_BUDGET:
                raise ValueError(f"vitrify HiCache backend: 'budget_bytes' must be an int in "
                                 f"[1, {_MAX_BUDGET}], got {budget!r}")
        else:
            gb = extra["budget_gb"]
            if isinstance(gb, bool) or not isinstance(gb, (int, float)) or \
                    not 0 < gb <= _MAX_BUDGET / 1e9:
                raise ValueError(f"vitrify HiCache backend: 'budget_gb' must be a number in "
                                 f"(0, {_MAX_BUDGET / 1e9:.0f}], got {gb!r}")
            budget = int(gb * 1e9)
        cold = extra.get("cold_start", "load")
        if cold not in ("load", "clear"):
            raise ValueError(f"vitrify HiCache backend: 'cold_start' must be 'load' or 'clear', "
                             f"got {cold!r}")
        dio = extra.get("direct_io")
        if dio is not None and dio not in ("auto", "on", "off"):
            raise ValueError(f"vitrify HiCache backend: 'direct_io' must be 'auto', 'on' or 'off', "
                             f"got {dio!r}")
        ints = {}
        for key, default, low, high in (("staging_bytes", 256 * _MiB, 1, 1 << 40),
                                        ("read_threads", 8, 1, 256), ("write_threads", 2, 1, 256)):
            v = extra.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ValueError(f"vitrify HiCache backend: '{key}' must be an int in "
                                 f"[{low}, {high}], got {v!r}")
            ints[key] = v
        name = extra.get("name", "hicache")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", name):
            raise ValueError(f"vitrify HiCache backend: 'name' must be 1-64 characters of "
                             f"[A-Za-z0-9._-], got {name!r}")
        extra_budget = extra.get("extra_pool_budget_bytes")
        if extra_budget is not None and (
                isinstance(extra_budget, bool) or not isinstance(extra_budget, int)
                or not 0 <= extra_budget < budget):
            raise ValueError(f"vitrify HiCache backend: 'extra_pool_budget_bytes' must be an int in "
                             f"[0, budget_bytes={budget}), got {extra_budget!r}")
        return cls(dirs=tuple(dirs), budget_bytes=budget, cold_start=cold, direct_io=dio,
                   name=name, extra_pool_budget_bytes=extra_budget, **ints)


def _dir_problem(d: str) -> str:
    """Why directory ``d`` cannot hold slab files ("" when it can, or can be created)."""
    if "\0" in d:
        return "contains a NUL character"
    p = os.path.abspath(d)
    if os.path.exists(p):
        return "" if os.path.isdir(p) else "exists and is not a directory"
    parent = p
    while not os.path.exists(parent):  # the nearest existing ancestor must be a directory
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return ""


def _slug(text: str, limit: int = 40) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"
    return s[:limit]


# ---- the host pool's page layout ---------------------------------------------------------------


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


# ---- v2 extra pools ------------------------------------------------------------------------------


_CONFLICT = object()  # a pool name registered twice with different pools


def _pool_key(name: Any) -> str:
    """A pool name as its plain string (SGLang passes ``PoolName`` members or strings)."""
    return str(getattr(name, "value", name))


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


@dataclass
class _ExtraPool:
    """One registered v2 pool other than ``kv`` and its own slab store."""

    name: str
    pool: Any
    page_tokens: int          # host indices per page (the pool's page_size)
    page_bytes: int           # bytes of one flat data page
    page_dtype: Any
    page_numel: int
    identity: str
    store: Optional[_tier.DiskStore] = None
    store_name: str = ""
    budget: int = 0
    refused: Optional[str] = None   # why its transfers are refused (None: usable)
    set_pages: int = 0
    set_dedup: int = 0
    set_failed: int = 0
    get_pages: int = 0
    get_misses: int = 0

    def stats(self) -> dict:
        return {"store": self.store.stats() if self.store is not None else None,
                "name": self.store_name, "page_bytes": self.page_bytes,
                "budget_bytes": self.budget, "refused": self.refused,
                "set_pages": self.set_pages, "set_dedup": self.set_dedup,
                "set_failed": self.set_failed, "get_pages": self.get_pages,
                "get_misses": self.get_misses}


# ---- the backend -------------------------------------------------------------------------------


class _SharedLock:
    """Many holders in ``shared()`` (the I/O calls) or one in ``exclusive()`` (store swap)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False

    class _Guard:
        def __init__(self, enter, leave):
            self._enter, self._leave = enter, leave

        def __enter__(self):
            self._enter()

        def __exit__(self, *exc):
            self._leave()

    def _r_enter(self):
        with self._cv:
            while self._writer:
                self._cv.wait()
            self._readers += 1

    def _r_leave(self):
        with self._cv:
            self._readers -= 1
            if self._readers == 0:
                self._cv.notify_all()

    def _w_enter(self):
        with self._cv:
            while self._writer:
                self._cv.wait()
            self._writer = True
            while self._readers:
                self._cv.wait()

    def _w_leave(self):
        with self._cv:
            self._writer = False
            self._cv.notify_all()

    def shared(self):
        return self._Guard(self._r_enter, self._r_leave)

    def exclusive(self):
        return self._Guard(self._w_enter, self._w_leave)



@dataclass
class _Counters:
    set_pages: int = 0
    set_bytes: int = 0
    set_dedup: int = 0
    set_failed: int = 0
    get_pages: int = 0
    get_bytes: int = 0
    get_misses: int = 0
    exists_queries: int = 0
    errors: int = 0
    v2_refused: int = 0
    # drained by get_stats() (SGLang's StorageMetrics)
    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


class VitrifyStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` on vitrify's O_DIRECT slab store (see the module docstring).

    SGLang's factory calls ``VitrifyStorage(storage_config, kwargs)``, then the cache controller
    calls :meth:`register_mem_pool_host`, which opens this rank's slab files (their page size
    comes from the host pool). Thread-safe: SGLang's prefetch and backup threads call in
    concurrently.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.settings = VitrifyStorageSettings.from_extra_config(storage_config.extra_config)
        extra = storage_config.extra_config or {}
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        if storage_config.is_mla_model and storage_config.tp_size > 1:
            # SGLang backs MLA pages up from TP rank 0 only and expects every rank to read them;
            # vitrify's slabs are private to one rank.
            raise ValueError(
                f"vitrify HiCache backend: MLA models with tp_size={storage_config.tp_size} > 1 "
                f"are not supported (SGLang writes MLA pages from TP rank 0 only and vitrify "
                f"slabs are per rank)")
        self.mem_pool_host = None
        self._geom: Optional[_HostGeometry] = None
        self._store: Optional[_tier.DiskStore] = None
        self._store_name: Optional[str] = None
        self._copier = _host.Copier()
        self._set_lock = threading.Lock()   # owns the set staging buffers
        self._get_lock = threading.Lock()   # owns the get staging buffers
        self._state = _SharedLock()         # store swap (clear/close) vs. everything else
        self._set_bufs: list = []
        self._get_bufs: list = []
        self._chunk = 1
        self._c = _Counters()
        self._clock = threading.Lock()
        self._closed = False
        # v2 extra pools (see the module docstring): name -> _ExtraPool, the planned page bytes
        # of the host pool group's extra entries, the KV store's share of the budget.
        self._extra: dict = {}
        self._plan: Optional[dict] = None
        self._extra_budget = 0
        self._kv_budget = self.settings.budget_bytes
        self._kv_v2_pool: Any = None

    # -- lifecycle ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's layout and open this rank's slab files (SGLang calls this once,
        right after construction). ValueError for pools vitrify cannot gather."""
        super().register_mem_pool_host(mem_pool_host)
        geom = _host_geometry(mem_pool_host)
        cfg = self.storage_config
        digest = hashlib.sha256(f"{cfg.model_name}|{geom.identity}".encode()).hexdigest()[:12]
        name = (f"{self.settings.name}-{_slug(cfg.model_name or 'model')}-{digest}"
                f"-tp{cfg.tp_rank}of{cfg.tp_size}-pp{cfg.pp_rank}of{cfg.pp_size}"
                f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
        plan, extra_budget = self._plan_extra_pools(mem_pool_host, geom.blob_bytes)
        with self._state.exclusive():
            if self._store is not None:
                self._store.close()
            self._geom = geom
            self._store_name = name
            self._plan, self._extra_budget = plan, extra_budget
            self._kv_budget = self.settings.budget_bytes - extra_budget
            self._store = self._open(self.settings.cold_start)
            for ep in self._extra.values():  # pools registered before the KV pool
                if ep.store is None and ep.refused is None:
                    self._open_extra(ep)
        logger.info("vitrify HiCache backend: %s, page %d B (%d tokens, %s), slabs %s, "
                    "O_DIRECT=%s, cold_start=%s, staging %d pages x 2", name, geom.blob_bytes,
                    geom.page_tokens, mem_pool_host.layout,
                    [self._store.slab_path(_KIND, d) for d in range(len(self.settings.dirs))],
                    self._store.direct_io(_KIND), self.settings.cold_start, self._chunk)

    def _open(self, cold_start: str) -> _tier.DiskStore:
        s = self.settings
        store = _tier.DiskStore(list(s.dirs), self._kv_budget, {_KIND: self._geom.blob_bytes},
                                name=self._store_name, cold_start=cold_start,
                                direct_io=s.direct_io, read_threads=s.read_threads,
                                write_threads=s.write_threads)
        # Staging buffers belong to a store; new ones with every (re)open. Writes use two sets
        # (gather one chunk while the previous one is written), and so do reads (scatter one
        # chunk while the next one is read).
        # A quarter of SGLang's batch per chunk, so a full batch overlaps copies with I/O.
        self._chunk = max(1, min(STORAGE_BATCH_SIZE // 4,
                                 self.settings.staging_bytes // (2 * store.slot_bytes(_KIND))))
        self._set_bufs = [[store.buffer(_KIND) for _ in range(self._chunk)] for _ in range(2)]
        self._get_bufs = [[store.buffer(_KIND) for _ in range(self._chunk)] for _ in range(2)]
        return store

    def close(self) -> None:
        """Finish queued writes and close the slab files (idempotent)."""
        with self._state.exclusive():
            self._closed = True
            if self._store is not None:
                store, self._store = self._store, None
                self._set_bufs, self._get_bufs = [], []
                store.close()
            for ep in self._extra.values():
                if ep.store is not None:
                    ep_store, ep.store = ep.store, None
                    ep_store.close()

    def clear(self) -> bool:
        """Drop every page of this rank (SGLang's ``/clear_hicache_storage``): the store drops
        its index and gives every slab a new slab id (files, threads and staging buffers stay),
        so neither this process nor a later ``cold_start=load`` sees them."""
        try:
            with self._state.exclusive():
                if self._store is None:
                    return not self._closed
                self._store.clear()
                for ep in self._extra.values():
                    if ep.store is not None:
                        ep.store.clear()
            logger.info("vitrify HiCache backend: cleared %s (and %d extra pools)",
                        self._store_name, sum(1 for e in self._extra.values() if e.store))
            return True
        except Exception as e:  # never raise into the scheduler
            self._error("clear", e)
            return False

    # -- helpers -----------------------------------------------------------------------------

    def _error(self, op: str, exc: BaseException) -> None:
        with self._clock:
            self._c.errors += 1
            n = self._c.errors
        if n <= 10 or n % 1000 == 0:
            logger.error("vitrify HiCache backend: %s failed (%s: %s); treated as a miss "
                         "[error #%d]", op, type(exc).__name__, exc, n,
                         exc_info=n <= 3)

    def _pages(self, n_keys: int, host_indices: torch.Tensor) -> List[int]:
        g = self._geom
        t = host_indices.reshape(-1)
        if t.numel() != n_keys * g.page_tokens:
            raise ValueError(f"{t.numel()} host indices for {n_keys} keys of "
                             f"{g.page_tokens} tokens")
        if n_keys == 0:
            return []
        t = t.to(device="cpu", dtype=torch.int64).view(n_keys, g.page_tokens)
        first = t[:, 0]
        if bool((first % g.page_tokens != 0).any()) or \
                bool((t[:, -1] - first != g.page_tokens - 1).any()):
            raise ValueError("host indices are not whole, aligned pages")
        return (first // g.page_tokens).tolist()

    # -- v1: zero-copy on host-pool pages ----------------------------------------------------

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Write the host-pool pages at ``host_indices`` under ``keys``; one bool per key
        (True: the page is on disk after the call, already there counts)."""
        n = len(keys)
        if n == 0:
            return []
        try:
            t0 = time.perf_counter()
            with self._state.shared():
                store, g = self._store, self._geom
                if store is None:
                    return [False] * n
                pages = self._pages(n, host_indices)
                results = [bool(x) for x in store.batch_exists(keys, _KIND)]
                todo = [i for i in range(n) if not results[i]]
                written = 0
                with self._set_lock:
                    tickets: list = [None, None]
                    try:
                        for ci, start in enumerate(range(0, len(todo), self._chunk)):
                            part = todo[start:start + self._chunk]
                            side = ci % 2
                            if tickets[side] is not None:  # its buffers are being written
                                tk, tickets[side] = tickets[side], None
                                self._collect(tk, results)
                            bufs = self._set_bufs[side][:len(part)]
                            self._copier.gather_each(g.layout, [pages[i] for i in part],
                                                     [b.address for b in bufs], g.blob_bytes)
                            tickets[side] = (part, store.put_buffers_async(
                                [keys[i] for i in part], bufs, [g.blob_bytes] * len(part),
                                _KIND))
                    finally:
                        # Never leave a buffer in flight: the next call gathers into it.
                        for tk in tickets:
                            if tk is not None:
                                self._collect(tk, results)
                    written = sum(1 for i in todo if results[i])
            dt = time.perf_counter() - t0
            with self._clock:
                c = self._c
                c.set_pages += written
                c.set_bytes += written * g.blob_bytes
                c.set_dedup += n - len(todo)
                c.set_failed += sum(1 for r in results if not r)
                c.backup_pgs.append(n)
                if written and dt > 0:
                    c.backup_bandwidth.append(written * g.blob_bytes / dt / 1e9)
                total_written, total_read = c.set_pages, c.get_pages
            # One summary line per batch (SGLang batches up to STORAGE_BATCH_SIZE pages).
            logger.info("vitrify HiCache backend: batch_set_v1 %d pages: %d written, %d already "
                        "stored, %d failed, %.1f MiB in %.1f ms; totals: %d pages written, "
                        "%d pages read", n, written, n - len(todo),
                        sum(1 for r in results if not r), written * g.blob_bytes / _MiB,
                        dt * 1e3, total_written, total_read)
            return results
        except Exception as e:
            self._error("batch_set_v1", e)
            return [False] * n

    @staticmethod
    def _collect(ticket: tuple, results: List[bool]) -> None:
        part, tk = ticket
        for i, ok in zip(part, tk.wait()):
            results[i] = bool(ok)

    def _read_scatter(self, store, g, keys, pages, results) -> None:
        """Chunks i+1 (and i+2) are read by the store's I/O threads while i is scattered."""
        n, step = len(keys), self._chunk
        chunks = [list(range(s, min(n, s + step))) for s in range(0, n, step)]

        def read(ci):
            part = chunks[ci]
            return store.get_buffers_async([keys[i] for i in part],
                                           self._get_bufs[ci % 2][:len(part)], _KIND)

        # Two chunks in flight: chunk i+1 is queued before chunk i is waited on, so the I/O
        # threads never drain while chunk i is scattered; chunk i+2 reuses chunk i's buffers.
        pending: dict = {}
        try:
            for ci in range(min(2, len(chunks))):
                pending[ci] = read(ci)
            for ci, part in enumerate(chunks):
                lens = pending.pop(ci).wait()
                hits = []
                for b, i, ln in zip(self._get_bufs[ci % 2], part, lens):
                    if ln is None:
                        continue
                    if ln != g.blob_bytes:
                        logger.warning("vitrify HiCache backend: page %s has %d bytes, %d "
                                       "expected; dropped", keys[i], ln, g.blob_bytes)
                        store.delete(keys[i], _KIND)
                        continue
                    hits.append((b, i))
                if hits:
                    self._copier.scatter_each([b.address for b, _ in hits], g.layout,
                                              [pages[i] for _, i in hits], g.blob_bytes)
                    for _, i in hits:
                        results[i] = True
                if ci + 2 < len(chunks):
                    pending[ci + 2] = read(ci + 2)
        finally:
            for t in pending.values():  # on an error: the buffers are free again once done
                t.wait()

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Read ``keys`` into the host-pool pages at ``host_indices``; one bool per key
        (False: absent, evicted, failed verification or any error — the page is untouched
        or must not be used, exactly as SGLang treats a miss)."""
        n = len(keys)
        if n == 0:
            return []
        try:
            t0 = time.perf_counter()
            results = [False] * n
            with self._state.shared():
                store, g = self._store, self._geom
                if store is None:
                    return results
                pages = self._pages(n, host_indices)
                with self._get_lock:
                    self._read_scatter(store, g, keys, pages, results)
            hits = sum(results)
            dt = time.perf_counter() - t0
            with self._clock:
                c = self._c
                c.get_pages += hits
                c.get_bytes += hits * g.blob_bytes
                c.get_misses += n - hits
                c.prefetch_pgs.append(n)
                if hits and dt > 0:
                    c.prefetch_bandwidth.append(hits * g.blob_bytes / dt / 1e9)
                total_written, total_read = c.set_pages, c.get_pages
            logger.info("vitrify HiCache backend: batch_get_v1 %d pages: %d read, %d missed, "
                        "%.1f MiB in %.1f ms; totals: %d pages written, %d pages read",
                        n, hits, n - hits, hits * g.blob_bytes / _MiB, dt * 1e3,
                        total_written, total_read)
            return results
        except Exception as e:
            self._error("batch_get_v1", e)
            return [False] * n

    # -- existence ---------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """True when ``key`` is in this rank's index (no disk I/O)."""
        try:
            with self._state.shared():
                if self._store is None:
                    return False
                return bool(self._store.exists(key, _KIND))
        except Exception as e:
            self._error("exists", e)
            return False

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many of ``keys``, from the first, are stored (SGLang's prefix query)."""
        try:
            with self._state.shared():
                if self._store is None or not keys:
                    return 0
                found = self._store.batch_exists(keys, _KIND)
            with self._clock:
                self._c.exists_queries += 1
            for i, f in enumerate(found):
                if not f:
                    return i
            return len(keys)
        except Exception as e:
            self._error("batch_exists", e)
            return 0

    # -- v2: multi-pool transfers (hybrid / Mamba / SWA / DSA indexer pools) ----------------

    def _plan_extra_pools(self, mem_pool_host: Any, kv_page_bytes: int) -> tuple:
        """The extra pools of SGLang's host pool group (name -> page bytes) and their budget."""
        plan: dict = {}
        for entry in getattr(mem_pool_host, "entries", None) or []:
            key = _pool_key(entry.name)
            if key == _KIND:
                continue
            try:
                plan[key] = _flat_page(entry.host_pool)[2]
            except Exception as e:
                logger.error("vitrify HiCache backend: extra pool %r has no usable flat data page "
                             "(%s: %s); it gets no disk budget", key, type(e).__name__, e)
        if not plan:
            return plan, 0
        given = self.settings.extra_pool_budget_bytes
        if given is not None:
            return plan, given
        total = sum(plan.values())
        share = min(0.5, total / (kv_page_bytes + total))
        return plan, int(self.settings.budget_bytes * share)

    def _open_extra(self, ep: "_ExtraPool") -> None:
        """Open ``ep``'s slab files (caller holds the state lock exclusively)."""
        cfg, s = self.storage_config, self.settings
        if ep.name not in (self._plan or {}):
            ep.refused = ("not an entry of the host pool group registered with "
                          "register_mem_pool_host, so it has no disk budget")
            logger.error("vitrify HiCache backend: extra pool %r %s; its pages are not stored",
                         ep.name, ep.refused)
            return
        total = sum(self._plan.values())
        ep.budget = self._extra_budget * self._plan[ep.name] // total
        digest = hashlib.sha256(f"{cfg.model_name}|{ep.identity}".encode()).hexdigest()[:12]
        ep.store_name = (f"{s.name}-{_slug(cfg.model_name or 'model')}-{digest}-"
                         f"{_slug(ep.name, 24)}-tp{cfg.tp_rank}of{cfg.tp_size}"
                         f"-pp{cfg.pp_rank}of{cfg.pp_size}"
                         f"-cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
        try:
            if ep.budget <= 0:
                raise ValueError(f"budget {ep.budget} B")
            ep.store = _tier.DiskStore(list(s.dirs), ep.budget, {_KIND: ep.page_bytes},
                                       name=ep.store_name, cold_start=s.cold_start,
                                       direct_io=s.direct_io, read_threads=s.read_threads,
                                       write_threads=s.write_threads)
        except Exception as e:
            ep.refused = f"its slab store could not be opened ({type(e).__name__}: {e})"
            logger.error("vitrify HiCache backend: extra pool %r: %s; its pages are not stored",
                         ep.name, ep.refused)
            return
        logger.info("vitrify HiCache backend: extra pool %r: %s, page %d B, budget %d B "
                    "(%d slots), slabs %s", ep.name, ep.store_name, ep.page_bytes, ep.budget,
                    ep.store.stats()["kinds"][_KIND]["slots_total"],
                    [ep.store.slab_path(_KIND, d) for d in range(len(s.dirs))])

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register one pool of SGLang's host pool group (HybridCacheController calls this for
        every entry after :meth:`register_mem_pool_host`). ``kv`` is the KV pool already known
        from the v1 registration; any other pool gets its own slab store. Never raises: a pool
        that cannot be stored is logged and its transfers answer ``False``."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        key = _pool_key(host_pool_name)
        with self._state.exclusive():
            if key == _KIND:
                if self._kv_v2_pool is not None and self._kv_v2_pool is not host_pool:
                    logger.error("vitrify HiCache backend: pool 'kv' registered twice with "
                                 "different pools; v2 KV transfers are refused")
                    self._kv_v2_pool = _CONFLICT
                elif self._kv_v2_pool is None:
                    self._kv_v2_pool = host_pool
                return
            old = self._extra.get(key)
            if old is not None:
                if old.pool is host_pool:
                    logger.info("vitrify HiCache backend: extra pool %r registered again (same "
                                "pool); unchanged", key)
                    return
                old.refused = "registered twice with different pools"
                logger.error("vitrify HiCache backend: extra pool %r %s; its transfers are "
                             "refused", key, old.refused)
                return
            try:
                dtype, numel, page_bytes = _flat_page(host_pool)
                page_tokens = int(getattr(host_pool, "page_size", 1) or 1)
                ep = _ExtraPool(key, host_pool, page_tokens, page_bytes, dtype, numel,
                                _pool_identity(host_pool, page_bytes))
            except Exception as e:
                ep = _ExtraPool(key, host_pool, 1, 0, torch.uint8, 0, "")
                ep.refused = f"has no usable flat data page ({type(e).__name__}: {e})"
                logger.error("vitrify HiCache backend: extra pool %r %s; its pages are not "
                             "stored", key, ep.refused)
            self._extra[key] = ep
            if ep.refused is None and self._geom is not None and not self._closed:
                self._open_extra(ep)

    def _refuse(self, op: str, name: str, why: str) -> None:
        with self._clock:
            self._c.v2_refused += 1
            n = self._c.v2_refused
        if n <= 10 or n % 1000 == 0:
            logger.error("vitrify HiCache backend: %s for pool %r refused: %s [#%d]",
                         op, name, why, n)

    def _extra_for(self, op: str, name: str) -> Optional["_ExtraPool"]:
        """The usable extra pool ``name`` (caller holds the state lock), or None (logged)."""
        ep = self._extra.get(name)
        if ep is None:
            self._refuse(op, name, f"no such pool registered (registered: "
                                   f"{sorted(self._extra)})")
            return None
        if ep.refused is not None or ep.store is None:
            self._refuse(op, name, ep.refused or "the backend is closed")
            return None
        return ep

    def _kv_v2_ok(self, op: str) -> bool:
        """KV transfers go through the v1 store; the v2 'kv' pool must be the v1 pool's KV."""
        p = self._kv_v2_pool
        if p is None:
            return True
        if p is _CONFLICT:
            self._refuse(op, _KIND, "registered twice with different pools")
            return False
        mine = getattr(self.mem_pool_host, "kv_buffer", None)
        theirs = getattr(p, "kv_buffer", None)
        if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
                and mine.data_ptr() == theirs.data_ptr() and mine.shape == theirs.shape):
            self._refuse(op, _KIND, "the v2 'kv' pool is not the KV buffer of the host pool "
                                    "registered with register_mem_pool_host")
            return False
        return True

    def _host_pages(self, op: str, name: str, t: Any, page_tokens: int) -> Optional[list]:
        """First host index of each page of transfer ``t`` (HiCacheFile's check), or None."""
        n = len(t.keys or [])
        idx = t.host_indices
        if idx is None or idx.numel() != n * page_tokens:
            logger.error("vitrify HiCache backend: %s indices length mismatch for %s: expected "
                         "%d, got %d", op, name, n * page_tokens,
                         idx.numel() if idx is not None else 0)
            return None
        return idx.reshape(-1)[::page_tokens].to("cpu").tolist()

    def _set_extra(self, ep: "_ExtraPool", keys: List[str], pages: list) -> List[bool]:
        store = ep.store
        results = [bool(x) for x in store.batch_exists(keys, _KIND)]
        todo = [i for i in range(len(keys)) if not results[i]]
        if todo:
            datas = []
            for i in todo:
                d = ep.pool.get_data_page(pages[i], flat=True).detach()
                d = d.to("cpu").contiguous().view(torch.uint8).reshape(-1)
                if d.numel() != ep.page_bytes:
                    raise ValueError(f"page {pages[i]} of pool {ep.name!r} has {d.numel()} "
                                     f"bytes, {ep.page_bytes} expected")
                datas.append(d.numpy())
            for i, ok in zip(todo, store.batch_put([keys[i] for i in todo], datas, _KIND)):
                results[i] = bool(ok)
        with self._clock:
            written = sum(1 for i in todo if results[i])
            ep.set_pages += written
            ep.set_dedup += len(keys) - len(todo)
            ep.set_failed += sum(1 for r in results if not r)
        return results

    def _get_extra(self, ep: "_ExtraPool", keys: List[str], pages: list) -> List[bool]:
        store, n = ep.store, len(keys)
        results = [False] * n
        if n == 0:
            return results
        # One typed flat page per key (set_from_flat_data_page reshapes it in the pool's
        # dtype); the store reads the raw bytes straight into each row.
        rows = torch.empty((n, ep.page_numel), dtype=ep.page_dtype)
        outs = [rows[i].view(torch.uint8).numpy() for i in range(n)]
        for i, ln in enumerate(store.batch_get_into(keys, outs, _KIND)):
            if ln is None:
                continue
            if ln != ep.page_bytes:
                logger.warning("vitrify HiCache backend: pool %r page %s has %d bytes, %d "
                               "expected; dropped", ep.name, keys[i], ln, ep.page_bytes)
                store.delete(keys[i], _KIND)
                continue
            ep.pool.set_from_flat_data_page(pages[i], rows[i])
            results[i] = True
        with self._clock:
            hits = sum(results)
            ep.get_pages += hits
            ep.get_misses += n - hits
        return results

    def _batch_v2(self, op: str, transfers: list) -> dict:
        t0 = time.perf_counter()
        results: dict = {}
        moved = nbytes = 0
        for t in transfers or []:
            keys = list(t.keys or [])
            name = _pool_key(t.name)
            try:
                if name == _KIND:
                    if not self._kv_v2_ok(op):
                        results[t.name] = [False] * len(keys)
                        continue
                    if t.host_indices is None:
                        raise ValueError("a 'kv' transfer without host_indices")
                    fn = self.batch_set_v1 if op == "batch_set_v2" else self.batch_get_v1
                    results[t.name] = fn(keys, t.host_indices)
                    continue
                with self._state.shared():
                    ep = self._extra_for(op, name)
                    pages = None if ep is None else self._host_pages(op, name, t, ep.page_tokens)
                    if pages is None:
                        results[t.name] = [False] * len(keys)
                        continue
                    fn = self._set_extra if op == "batch_set_v2" else self._get_extra
                    r = fn(ep, keys, pages)
                results[t.name] = r
                moved += sum(r)
                nbytes += sum(r) * ep.page_bytes
            except Exception as e:
                self._error(f"{op}[{name}]", e)
                results[t.name] = [False] * len(keys)
        dt = time.perf_counter() - t0
        if moved:
            with self._clock:
                c = self._c
                pgs, bw = ((c.backup_pgs, c.backup_bandwidth) if op == "batch_set_v2"
                           else (c.prefetch_pgs, c.prefetch_bandwidth))
                pgs.append(moved)
                if dt > 0:
                    bw.append(nbytes / dt / 1e9)
        return results

    def batch_set_v2(self, transfers: list,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        """Write each transfer's pages (``host_indices`` of its pool, one page per key): pool
        name -> one bool per key (True: on disk after the call, already there counts). ``kv``
        goes through :meth:`batch_set_v1`; an unknown or refused pool, or a length mismatch,
        is all ``False`` (logged); errors never raise."""
        return self._batch_v2("batch_set_v2", transfers)

    def batch_get_v2(self, transfers: list,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        """Read each transfer's pages into its pool at ``host_indices``: pool name -> one bool
        per key (False: absent, failed verification, refused pool or any error)."""
        return self._batch_v2("batch_get_v2", transfers)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[list] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None):
        """The usable prefix over the KV pages and every transfer's pool, with HiCacheFile's
        hit policies: ``all_pages`` needs every page of the KV prefix, ``trailing_pages`` the
        last ``len(transfer.keys)`` pages of a (possibly shorter) prefix. Index look-ups only."""
        from sglang.srt.mem_cache.hicache_storage import (PoolHitPolicy, PoolName,
                                                          PoolTransferResult)

        try:
            with self._state.shared():
                if self._store is None:
                    return PoolTransferResult(0, {})
                kv_found = self._store.batch_exists(keys, _KIND) if keys else []
                kv_pages = next((i for i, f in enumerate(kv_found) if not f), len(keys))
                hit_count: dict = {PoolName.KV: kv_pages} if kv_pages else {}
                final = kv_pages
                for t in pool_transfers or []:
                    if final == 0:
                        break
                    name = _pool_key(t.name)
                    if name == _KIND:
                        have = kv_found[:kv_pages]
                    else:
                        ep = self._extra.get(name)
                        usable = ep is not None and ep.refused is None and ep.store is not None
                        have = (ep.store.batch_exists(keys[:kv_pages], _KIND) if usable
                                else [False] * kv_pages)
                    if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                        boundary = next((i for i in range(kv_pages) if not have[i]), kv_pages)
                    else:
                        trailing = max(1, len(t.keys) if t.keys else 1)
                        boundary = next((n for n in range(kv_pages, 0, -1)
                                         if all(have[max(0, n - trailing):n])), 0)
                    if boundary:
                        hit_count[t.name] = boundary
                    final = min(final, boundary)
            with self._clock:
                self._c.exists_queries += 1
            return PoolTransferResult(final, hit_count)
        except Exception as e:
            self._error("batch_exists_v2", e)
            return PoolTransferResult(0, {})

    # -- v0: tensors (SGLang's generic path and the draft-pool piggyback) --------------------
    # A flat page of SGLang's MHA/MLA host pools has the same bytes as vitrify's gathered page
    # (component-major, then layer), so both paths share one key space.

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """Read ``key`` into the CPU tensor ``target_location``; it, or None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        n = len(keys)
        targets = list(target_locations) if target_locations is not None else [None] * n
        out: List[Optional[torch.Tensor]] = [None] * n
        try:
            with self._state.shared():
                if self._store is None:
                    return out
                for i, (k, t) in enumerate(zip(keys, targets)):
                    if t is None or not t.is_contiguous() or t.device.type != "cpu":
                        raise ValueError(f"target for {k!r} must be a contiguous CPU tensor")
                    view = t.view(torch.uint8).reshape(-1).numpy()
                    size = self._store.size_of(k, _KIND)
                    if size is None or size != view.nbytes:
                        continue
                    if self._store.get_into(k, view, _KIND) == view.nbytes:
                        out[i] = t
            return out
        except Exception as e:
            self._error("batch_get", e)
            return [None] * n

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store the bytes of the CPU tensor ``value`` under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store tensors; True when every one is on disk after the call."""
        try:
            if values is None or len(values) != len(keys):
                raise ValueError("batch_set needs one tensor per key")
            with self._state.shared():
                if self._store is None:
                    return False
                datas = [v.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()
                         for v in values]
                return all(self._store.batch_put(keys, datas, _KIND))
        except Exception as e:
            self._error("batch_set", e)
            return False

    # -- observability -----------------------------------------------------------------------

    def get_stats(self):
        """SGLang's storage-metrics hook: pages and GB/s per batch since the previous call."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._clock:
            c = self._c
            m.prefetch_pgs.extend(c.prefetch_pgs)
            m.backup_pgs.extend(c.backup_pgs)
            m.prefetch_bandwidth.extend(c.prefetch_bandwidth)
            m.backup_bandwidth.extend(c.backup_bandwidth)
            c.prefetch_pgs, c.backup_pgs = [], []
            c.prefetch_bandwidth, c.backup_bandwidth = [], []
        return m

    def vitrify_stats(self) -> dict:
        """Backend counters plus the disk store's (occupancy, spills, reloads, GC, errors)."""
        with self._clock:
            c = self._c
            d = {k: getattr(c, k) for k in ("set_pages", "set_bytes", "set_dedup", "set_failed",
                                            "get_pages", "get_bytes", "get_misses",
                                            "exists_queries", "errors", "v2_refused")}
        with self._state.shared():
            d["store"] = self._store.stats() if self._store is not None else None
            d["name"] = self._store_name
            d["page_bytes"] = self._geom.blob_bytes if self._geom else None
            d["budget_bytes"] = self._kv_budget
            with self._clock:
                d["extra_pools"] = {k: ep.stats() for k, ep in self._extra.items()}
        return d

    @property
    def slab_paths(self) -> List[str]:
        """This rank's slab files, one per drive."""
        with self._state.shared():
            if self._store is None:
                return []
            return [self._store.slab_path(_KIND, d) for d in range(len(self.settings.dirs))]


__all__ = ["VitrifyStorage", "VitrifyStorageSettings"]
