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
Each batch is one native call (:class:`vitrify.disk.PageMover`, GIL released for the whole call):
each page is gathered (:mod:`vitrify.host`, multi-threaded) from the host pool's layout straight
into a 4 KiB-aligned disk slot buffer and written with one O_DIRECT transfer into a preallocated
slab (:mod:`vitrify.disk`), the next chunk gathered while one is written; a get reads the slots,
verifies them (CRC32C, key, length) and scatters them back into the host pool while the next
chunk is read.

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
``stats_path``     a file the backend keeps its counters in, as JSON (default: none); with
                   more than one rank it must contain ``{rank}`` (replaced by the rank suffix
                   of the slab names, ``tp<r>of<n>-pp<r>of<n>-cp<r>of<n>``)
``revision``       the weights' revision (str); default: SGLang's ``--revision``
``weight_          the weights' version (str); default: SGLang's ``--weight-version``;
version``          after a weight update call :meth:`VitrifyStorage.set_weight_version`
``reader_          MLA with ``tp_size > 1``: ranks > 0 rescan the shared store at most this
refresh_s``        often, on an exists query that misses (seconds, default 2; 0: every miss)
``reader_open_     MLA with ``tp_size > 1``: how long ranks > 0 wait at attach for TP rank 0
timeout_s``        to create the shared store (seconds, default 300)
``host_bytes``     bytes of THIS rank's KV pages kept in the host tier (named shared memory
                   that outlives the server, :mod:`vitrify.tier`) in front of the disk slabs
                   (int, default 0: none); or ``host_gb`` (1e9 bytes). v1 sets write both
                   tiers (the disk's result is the answer), v1 gets read the host tier first
                   and copy disk hits into it; a restarted server maps the same slabs
``host_write``     ``"through"`` (default): a v1 set is acknowledged by the disk, as above;
                   ``"back"``: by the host tier when it took the whole batch, the disk
                   written behind by one thread (queue: a quarter of the host tier's slots;
                   a batch that does not fit is written through; ``close`` waits for it)
``host_dir``       the host tier's directory (tmpfs or hugetlbfs; default
                   ``$VITRIFY_HOST_DIR/vitrify-<uid>``); ``vitrify tier ls`` lists its slabs
``host_required``  ``false`` (default): when the host directory's mount has less free space
                   than ``host_bytes``, the server starts without the host tier and serves from
                   the disk, saying so in one warning line and in ``vitrify_stats()``
                   (``host_unavailable``); ``true``: that is an error and the server stops
``role``           ``"writer"`` (default) or ``"reader"``: a second server of the node with
                   the same storage identity maps the first one's host and disk slabs
                   read-only (waiting ``reader_open_timeout_s`` for them), serves their pages,
                   rescans on a miss (``reader_refresh_s``) and writes nothing
=================  =====================================================================

Slab files are per rank and per model: ``<dir>/<name>-<model>-<identity hash>-tp<r>of<n>-
pp<r>of<n>-cp<r>of<n>.kind0.slab``, so ranks never share a slab, and a key (SGLang's content
hash of the token ids) can only ever resolve to a page of the same identity: model name and
path, weights revision and version, quantization, KV cache dtype, and the pool's class, layout,
dtype, page size and shapes (:meth:`VitrifyStorage.identity` lists them).

MLA models under tensor parallelism (``tp_size > 1``): the TP ranks share one store, named
``...-tpsharedof<n>-pp<r>of<n>-cp<r>of<n>``. SGLang backs MLA pages up from TP rank 0 only; rank
0 opens the store read-write, the other ranks read-only (``DiskStore(mode="read")``): their sets
write nothing and succeed, their exists queries rescan the store on a miss (at most once per
``reader_refresh_s``) and their gets read rank 0's pages (see DESIGN.md, "MLA under tensor
parallelism").

Hybrid models (SGLang's v2 multi-pool API): SGLang's ``HybridCacheController`` registers its
``HostPoolGroup`` as the v1 host pool, then every entry of the group with
``register_mem_host_pool_v2`` (``kv``, and ``mamba`` / ``swa`` / ``indexer`` / ... pools). KV
transfers (pool name ``kv``) go through the KV slab store above (zero-copy ``batch_*_v1``), so v1
and v2 share one KV key space. Every other pool gets its own :class:`~vitrify.disk.DiskStore`:
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
logger and counted in :meth:`VitrifyStorage.counters` (and :meth:`VitrifyStorage.vitrify_stats`).
Configuration mistakes (a missing ``dirs``, a layout vitrify cannot gather) raise ``ValueError``
at start-up, naming the value.

Counters: :meth:`VitrifyStorage.counters` gives the running totals (pages and bytes written and
read, dedup hits, failures, misses, exists queries, errors, refused v2 transfers; the disk stores'
GC runs, evictions, verify failures, full and failed writes) and gauges (slots used and total,
occupancy, I/O queue depths) as a dict. With SGLang's ``enable_storage_metrics`` (or
:meth:`VitrifyStorage.export_prometheus`) the same numbers are Prometheus metrics
``vitrify_hicache_*`` (:mod:`.metrics`). A process outside the server reads them from
``stats_path``: once the store is open and after every v1 or v2 transfer batch, exists query,
error, clear, weight-version switch and close, the backend replaces that file (write, then
rename) with ``{"pid", "time", "closed", "store": {"name", "page_bytes", "page_tokens", "layout",
"slabs", "o_direct", "cold_start", "budget_bytes", "identity"}, "counters": counters()}``
(``store`` is null before :meth:`VitrifyStorage.register_mem_pool_host`). A file that cannot be
written is logged once and never fails a call.

Weight updates: SGLang records a new weight version where the backend cannot see it; call
:meth:`VitrifyStorage.set_weight_version` on every rank after an update so that later pages are
stored, and found, under the new version (the old version's slabs are deleted).

SGLang releases: 0.5.17 and 0.5.23, through the plugin's version seam (the "HiCache storage
backend" section of ``versions/v0_5_*.py``). On 0.5.23 decode context parallelism
(``dcp_size > 1``) and ``--hicache-host-memory-mode buffer_only`` are refused at construction in
one line; with DP attention a group ``r > 0`` names its slabs ``...-dp<r>``; ``batch_exists_v2``
answers ``restorable_prefix_pages`` as 0.5.23's ``HiCacheFile`` does. When SGLang's test
switches ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_{DELAY,FAILURE}`` wrap the backend in 0.5.23's
failure-injector proxy, :func:`vitrify_backend` finds this backend behind it. See DESIGN.md,
"SGLang releases".

The package, one job a module: :mod:`.settings` (the extra config), :mod:`.geometry` (host pool
page layouts and slab names), :mod:`.v1` (zero-copy KV transfers by host index), :mod:`.v2` (the
extra pools of hybrid models), :mod:`.metrics` (Prometheus), :mod:`.backend` (the class:
lifecycle, identity, v0 calls, counters).
"""

from .backend import VitrifyStorage, vitrify_backend
from .settings import VitrifyStorageSettings

__all__ = ["VitrifyStorage", "VitrifyStorageSettings", "vitrify_backend"]
