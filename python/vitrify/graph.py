"""CUDA graph persistence: record kernel binaries, capture graphs, save, load, replay.

FREEZE (the process that warms up and captures)::

    import vitrify.graph as tg
    tg.record_modules()                 # before anything initialises CUDA (before torch.cuda)
    import torch
    store = tg.GraphStore(region_base=base, region_size=size)
    with store.capture("decode_bs8") as cap:   # like torch.cuda.graph(...)
        out = model(static_input)
    cap.graph.replay()                 # a normal torch CUDAGraph in this process
    store.save("ARCHIVE/rank0")        # rank0/modules/*.bin, rank0/graphs/*.tgraph + index.json

THAW (a fresh process, same addresses or a relocated region)::

    graphs = tg.load("ARCHIVE/rank0", region_base=new_base)   # builds start in the background
    graphs.replay("decode_bs8")        # waits for that graph only, then launches it

Graphs with the same topology share one executable; replaying another graph of the same
template applies its parameters first (no device synchronisation). Every failure to freeze (an
unsupported node kind, a kernel whose binary was not recorded) is a :class:`GraphFreezeError`
raised at capture time, naming the node and the kernel; never a failure at load time.
The on-disk layout is documented in ``csrc/src/graph/DESIGN.md``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

from . import _check, _native

_log = logging.getLogger("vitrify.graph")

GraphFreezeError = _native.GraphFreezeError
GraphFreezeError.__doc__ = (
    "A captured graph cannot be frozen (unsupported node kind, unrecorded or ambiguous kernel "
    "binary, host memory in a copy). A RuntimeError; the message names the node and kernel."
)


INDEX_FORMAT = "vitrify-graphs"
INDEX_VERSION = 1
MODULES_DIR = "modules"
GRAPHS_DIR = "graphs"
INDEX_FILE = "graphs/index.json"

__all__ = [
    "GraphNotRelocatable",
    "GraphCapture",
    "INDEX_SCHEMA",
    "GraphFreezeError",
    "GraphStore",
    "LoadedGraphs",
    "archive_index",
    "describe",
    "load",
    "load_from_archive",
    "record_modules",
    "recorder_info",
    "relocation_audit",
    "render_relocation_audit",
    "unrelocatable_graphs",
]


# ------------------------------------------------------------------------------- recording
def _cupti_candidates() -> list[str]:
    """libcupti copies shipped in pip wheels (nvidia-cuda-cupti) on sys.path."""
    out = []
    for entry in sys.path:
        for rel in ("nvidia/cu13/lib/libcupti.so.13", "nvidia/cuda_cupti/lib/libcupti.so.13"):
            p = os.path.join(entry or ".", rel)
            if os.path.exists(p):
                out.append(p)
    return out


def record_modules(extra_paths: list[str] | None = None) -> None:
    """Start recording every kernel binary the CUDA driver loads (CUPTI resource callbacks).

    Call it before CUDA is initialised in this process (before the first ``torch.cuda`` call):
    modules loaded earlier are never reported, and a graph using their kernels then fails to
    freeze, naming the kernel. libcupti is found through ``VITRIFY_CUPTI_PATH``, then
    ``libcupti.so.13`` / ``libcupti.so`` on the loader path, CUDA's ``lib64`` directories, the
    ``extra_paths`` and CUPTI from pip wheels. Idempotent. CUPTI allows one subscriber per
    process, so this cannot run together with torch's profiler or Nsight.
    """
    if extra_paths is not None:
        extra_paths = [_check.path(f"extra_paths[{i}]", p)
                       for i, p in enumerate(_check.sequence("extra_paths", extra_paths))]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and not recorder_info()["active"]:
        warnings.warn("vitrify.graph.record_modules(): CUDA is already initialised in this "
                      "process; kernel binaries loaded so far were not recorded, and graphs "
                      "using them will fail to freeze", RuntimeWarning, stacklevel=2)
    paths = [str(p) for p in (extra_paths or [])] + _cupti_candidates()
    try:
        _native.graph_record_modules(paths)
    except RuntimeError:
        # Without a GPU CUPTI fails in its own words ("CUPTI result 999"); say what every GPU
        # entry point says: there is no CUDA driver, and the loader's reason.
        if not _native.cuda_available():
            raise _native.CudaUnavailableError(
                f"cannot record kernel binaries: CUDA driver unavailable: "
                f"{_native.cuda_unavailable_reason()}") from None
        raise


def stop_recording() -> None:
    """Stop the CUPTI subscriber (what was recorded stays available)."""
    _native.graph_stop_recording()


def recorder_info() -> dict:
    """``active``, ``library`` (the libcupti loaded), ``modules``, ``bytes``, ``callbacks``, and
    how kernel identity was bound (csrc/src/graph/DESIGN.md, "Kernel identity"):
    ``loads_in_calls`` / ``loads_outside_calls`` (module loads inside / outside a traced driver
    call), ``ambiguous_calls`` (calls that loaded several modules), ``bound_exact`` (modules and
    libraries) and ``bound_handles`` (functions and kernels) held now."""
    return dict(_native.graph_recorder_info())


def describe(data: bytes) -> dict:
    """The description (nodes, edges, events, relocations) of a serialized graph."""
    _check.buffer("data", data)
    return dict(_native.graph_describe(bytes(data)))


# ----------------------------------------------------------------------------------- FREEZE
def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a graph name must be a non-empty string, got {name!r}")
    return name


class GraphCapture:
    """Context manager returned by :meth:`GraphStore.capture`: captures with
    ``torch.cuda.graph`` into a ``torch.cuda.CUDAGraph(keep_graph=True)`` and, on a clean exit,
    walks the captured graph into the store. ``graph`` is the torch graph (replayable here),
    ``info`` the summary of what was stored."""

    def __init__(self, store: GraphStore, name: str, pool=None, stream=None,
                 capture_error_mode: str = "global"):
        if not isinstance(store, GraphStore):
            raise _check.ArgumentTypeError(f"store must be a GraphStore, got {_check.got(store)}")
        _check.choice("capture_error_mode", capture_error_mode,
                      ("global", "thread_local", "relaxed"))
        self.store = store
        self.name = _check_name(name)
        self._pool = pool
        self._stream = stream
        self._mode = capture_error_mode
        self.graph = None
        self.info: dict | None = None
        self._ctx = None

    def __enter__(self) -> GraphCapture:
        import torch

        if self.name in self.store:
            raise ValueError(f"graph {self.name!r} is already in the store")
        self.graph = torch.cuda.CUDAGraph(keep_graph=True)
        self._ctx = torch.cuda.graph(self.graph, pool=self._pool, stream=self._stream,
                                     capture_error_mode=self._mode)
        self._ctx.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        suppressed = self._ctx.__exit__(exc_type, exc, tb)
        if exc_type is None:
            self.info = self.store.add_cuda_graph(self.name, self.graph.raw_cuda_graph())
        return bool(suppressed)


class GraphStore:
    """Serialized graphs of one device, ready to :meth:`save`.

    ``region``: the :class:`vitrify.Region` the engine allocates from (or any object with
    ``base``, ``size`` and ``live_allocations()``); or ``region_base``/``region_size`` with
    ``live`` (a list of ``(offset, size)`` live allocations, or a callable returning one, read at
    each capture). Kernel-parameter words and copy addresses inside ``[base, base+size)`` are
    stored as region offsets so :func:`load` can place the region elsewhere — but a kernel word
    only when the kernel's parameter layout and the live allocations prove it is a pointer
    (``csrc/src/graph/DESIGN.md``, "Relocation"); a word that may or may not be one makes its
    graph non-relocatable. Without ``region``/``live`` the whole range counts as live (weaker
    evidence; a warning is logged). ``size`` 0 records no relocations (same addresses at load).
    """

    def __init__(self, *, region: Any = None, region_base: int = 0, region_size: int = 0,
                 live: Any = None, device: int = 0):
        if region is not None and not (hasattr(region, "base") and hasattr(region, "size") and
                                       callable(getattr(region, "live_allocations", None))):
            raise _check.ArgumentTypeError(f"region must be a vitrify.Region (or have base, size "
                                           f"and live_allocations()), got {_check.got(region)}")
        if live is not None and not callable(live):
            _check.sequence("live", live)
        if region is not None:
            region_base, region_size = int(region.base), int(region.size)
            live = region.live_allocations
        _check.integer("region_base", region_base, 0, _check.U64_MAX)
        _check.integer("region_size", region_size, 0, _check.U64_MAX - region_base)
        _check.integer("device", device, 0, (1 << 31) - 1)
        if region_base < 0 or region_size < 0:
            raise ValueError(f"region base/size must be >= 0, got {region_base}, {region_size}")
        self.region_base = int(region_base)
        self.region_size = int(region_size)
        self.device = int(device)
        self._live = live
        if live is None and self.region_size > 0:
            _log.warning("GraphStore without region= or live=: every word in the %d-byte range "
                         "counts as pointing into a live allocation", self.region_size)
        self._evidence = _native.FieldEvidence()
        self._graphs: dict[str, bytes] = {}

    def _live_allocations(self) -> list[tuple[int, int]]:
        if self._live is None:
            return [(0, self.region_size)] if self.region_size > 0 else []
        live = self._live() if callable(self._live) else self._live
        return [(int(o), int(n)) for o, n in live]

    def capture(self, name: str, *, pool=None, stream=None,
                capture_error_mode: str = "global") -> GraphCapture:
        """A ``torch.cuda.graph``-like context manager that stores the graph as ``name``."""
        return GraphCapture(self, name, pool=pool, stream=stream,
                            capture_error_mode=capture_error_mode)

    def add_cuda_graph(self, name: str, handle: int) -> dict:
        """Walk a captured ``cudaGraph_t`` / ``CUgraph`` (an integer handle) into the store.
        Raises :class:`GraphFreezeError` naming the node when it cannot be frozen."""
        _check.integer("handle", handle, 0, _check.U64_MAX)
        _check_name(name)
        if name in self._graphs:
            raise ValueError(f"graph {name!r} is already in the store")
        if not handle:
            raise ValueError("the CUDA graph handle is null")
        try:
            data = _native.graph_capture(int(handle), self.region_base, self.region_size,
                                         self.device, self._live_allocations(), self._evidence)
        except GraphFreezeError as e:
            raise GraphFreezeError(f"cannot freeze graph {name!r}: {e}") from None
        self._graphs[name] = data
        return self.info(name)

    def add(self, name: str, data: bytes) -> None:
        """Add an already serialized graph (validated)."""
        _check.buffer("data", data)
        _check_name(name)
        if name in self._graphs:
            raise ValueError(f"graph {name!r} is already in the store")
        data = bytes(data)
        _native.graph_describe(data)  # validates
        self._graphs[name] = data

    def _require(self, name: Any) -> None:
        if name not in self._graphs:
            raise KeyError(f"no graph {name!r} in this store; it has {sorted(self._graphs)[:10]}")

    def __contains__(self, name: object) -> bool:
        return name in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def __iter__(self) -> Iterator[str]:
        return iter(self._graphs)

    @property
    def names(self) -> list[str]:
        return list(self._graphs)

    def data(self, name: str) -> bytes:
        """The serialized graph ``name``, with the integer evidence of every capture so far
        applied (a field that held a non-address in any launch is an integer everywhere)."""
        self._require(name)
        data, _ = _native.graph_apply_evidence(self._graphs[name], self._evidence)
        return data

    def info(self, name: str) -> dict:
        """Nodes, edges, relocations (count, by kind), relocatable, unclassified words, bytes,
        topology hash and modules of graph ``name``."""
        data = self.data(name)
        d = _native.graph_describe(data)
        kinds: dict[str, int] = {}
        for n in d["nodes"]:
            kinds[n["kind"]] = kinds.get(n["kind"], 0) + 1
        return {
            "name": name,
            "bytes": len(data),
            "nodes": len(d["nodes"]),
            "kinds": kinds,
            "edges": len(d["edges"]),
            **relocation_summary(d),
            "topology": _native.graph_topology(data),
            "modules": list(_native.graph_modules(data)),
        }

    def save(self, directory: str | os.PathLike) -> dict:
        """Write ``directory/modules/<sha256>.bin`` (only binaries the graphs use),
        ``directory/graphs/<n>.tgraph`` and ``directory/graphs/index.json``; returns the index.
        ``directory`` is one rank's directory of an archive (``ARCHIVE/rank<N>``)."""
        _check.directory_to_create("directory", directory)
        root = Path(directory)
        (root / MODULES_DIR).mkdir(parents=True, exist_ok=True)
        (root / GRAPHS_DIR).mkdir(parents=True, exist_ok=True)
        graphs, templates, modules = [], {}, {}
        for i, name in enumerate(self._graphs):
            data = self.data(name)
            info = self.info(name)
            rel = f"{GRAPHS_DIR}/{i:05d}.tgraph"
            _write_atomic(root / rel, data)
            t = templates.setdefault(info["topology"], {"topology": info["topology"], "graphs": []})
            t["graphs"].append(name)
            for h in info["modules"]:
                if h not in modules:
                    try:
                        m = _native.graph_recorded_module(h)
                    except ValueError:
                        raise ValueError(f"graph {name!r} uses module {h}, which this process "
                                         "did not record (see record_modules)") from None
                    mrel = f"{MODULES_DIR}/{h}.bin"
                    _write_atomic(root / mrel, m["bytes"])
                    modules[h] = {"file": mrel, "bytes": len(m["bytes"]), "kind": m["kind"],
                                  "kernels": len(m["kernels"])}
            graphs.append({"name": name, "file": rel, "bytes": len(data),
                           "sha256": _native.graph_sha256(data), "nodes": info["nodes"],
                           "relocations": info["relocations"],
                           "relocations_by_kind": info["relocations_by_kind"],
                           "relocatable": info["relocatable"],
                           "unclassified": info["unclassified"],
                           "integers_kept": info["integers_kept"],
                           "topology": info["topology"], "modules": info["modules"]})
        index = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "graph_format_version": _native.graph_format_version(),
            "device": self.device,
            "region": {"base": self.region_base, "size": self.region_size},
            "graphs": graphs,
            "templates": list(templates.values()),
            "modules": modules,
        }
        _write_atomic(root / INDEX_FILE, json.dumps(index, indent=1).encode())
        return index


    def save_to_archive(self, writer: Any, rank: int = 0) -> dict:
        """Save into ``rank<N>/`` of an archive being written (a
        :class:`vitrify.archive.ArchiveWriter` or :class:`vitrify.archive.RankWriter`): the same files
        as :meth:`save`, which the writer checksums into the manifest at commit."""
        if not callable(getattr(writer, "file_path", None)):
            raise _check.ArgumentTypeError(f"writer must be a vitrify.archive.ArchiveWriter or "
                                           f"RankWriter, got {_check.got(writer)}")
        _check.integer("rank", rank, 0, 999999)
        index_path = writer.file_path(f"rank{int(rank)}/{INDEX_FILE}")  # checks rank, makes dirs
        return self.save(Path(index_path).parent.parent)


def relocation_summary(described: dict, limit: int = 8) -> dict:
    """From :func:`describe`'s dict: ``relocations`` (count), ``relocations_by_kind``,
    ``relocatable``, ``unclassified`` (count and the first ``limit`` words with their kernel:
    the words FREEZE could not prove to be pointers or integers) and ``integers_kept`` (region-
    like words kept as integers, by reason)."""
    by_kind: dict[str, int] = {}
    for r in described["relocations"]:
        by_kind[r[3]] = by_kind.get(r[3], 0) + 1
    nodes = described["nodes"]
    unclassified, kept = [], {}
    for w in described["notes"]:
        if w["unclassified"]:
            unclassified.append({"node": w["node"], "kernel": nodes[w["node"]].get("name", ""),
                                 "offset": w["offset"], "value": hex(w["value"]),
                                 "reason": w["reason"]})
        else:
            kept[w["reason"]] = kept.get(w["reason"], 0) + 1
    return {"relocations": len(described["relocations"]), "relocations_by_kind": by_kind,
            "relocatable": described["relocatable"],
            "unclassified": {"count": len(unclassified), "words": unclassified[:limit]},
            "integers_kept": kept}


def relocation_audit(directory: str | os.PathLike) -> dict:
    """Every region-like word of the graphs saved under ``directory`` (one rank of an archive):
    per graph the relocated words by kind (pointer parameter, struct word, memcpy/memset
    address, TMA descriptor), the integers kept (by reason) and every unclassified word with
    its kernel — what ``vitrify inspect --relocations`` prints."""
    root = Path(directory)
    index = read_index(root)
    return _audit(index, {g["file"]: _read_checked(root, g["file"], g["bytes"])
                          for g in index["graphs"]})


def archive_relocation_audit(archive: Any, rank: int = 0) -> dict:
    """:func:`relocation_audit` of rank ``rank`` of an opened :class:`vitrify.archive.Archive`,
    reading only what its manifest vouches for: the index through :func:`archive_index`, every
    graph file listed, checked (no link, a regular file, size, CRC32C) and read once."""
    index = archive_index(archive, rank)
    prefix = f"rank{int(rank)}/"
    data = archive.read_files([prefix + g["file"] for g in index["graphs"]], checksum=True)
    return _audit(index, {g["file"]: data[prefix + g["file"]] for g in index["graphs"]})


def _audit(index: dict, files: dict[str, bytes]) -> dict:
    out = []
    for g in index["graphs"]:
        summary = relocation_summary(describe(files[g["file"]]), limit=1 << 30)
        out.append({"name": g["name"], "nodes": g["nodes"], **summary})
    return {"region": index["region"], "graphs": out}


def render_relocation_audit(audits: dict[int, dict]) -> str:
    """The table ``vitrify inspect --relocations`` prints, rank -> :func:`relocation_audit`."""
    kinds = ["pointer parameter", "struct word", "memcpy/memset address", "TMA descriptor"]
    lines = []
    for rank, audit in audits.items():
        lines.append(f"rank {rank}: region base {int(audit['region']['base']):#x}, "
                     f"{len(audit['graphs'])} graphs")
        lines.append(f"  {'graph':<24} {'nodes':>6} {'param':>6} {'struct':>7} {'copy':>6} "
                     f"{'tma':>5} {'ints':>6} {'unclass':>8}  relocatable")
        for g in audit["graphs"]:
            k = g["relocations_by_kind"]
            ints = sum(g["integers_kept"].values())
            lines.append(f"  {g['name'][:24]:<24} {g['nodes']:>6} "
                         + " ".join(f"{k.get(x, 0):>{w}}" for x, w in zip(kinds, (6, 7, 6, 5)))
                         + f" {ints:>6} {g['unclassified']['count']:>8}  "
                         + ("yes" if g["relocatable"] else "NO"))
            for w in g["unclassified"]["words"]:
                lines.append(f"      node {w['node']} kernel {w['kernel']!r} byte {w['offset']}: "
                             f"{w['value']} ({w['reason']})")
    return "\n".join(lines)


class GraphNotRelocatable(ValueError):
    """A graph holds a region-like word FREEZE could not prove to be a pointer or an integer,
    and THAW was asked to place the region at another base. The message names the graph, the
    kernel, the word and the reason."""


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------- THAW
_HEX64 = _check.Str(pattern="[0-9a-f]{64}")
_N = _check.Int(0, _check.U64_MAX)


def _index_rule(index: dict, field: str) -> None:
    """What spans fields: graph names unique, every file in its directory and named once (never
    the index itself), every module a graph uses listed, every graph in exactly one template of
    its own topology."""
    files = {INDEX_FILE}
    named = [(f"graphs[{i}]", g, GRAPHS_DIR) for i, g in enumerate(index["graphs"])] + \
        [(f"modules[{h[:12]}...]", m, MODULES_DIR) for h, m in index["modules"].items()]
    for where, entry, directory in named:
        f = entry["file"]
        if not f.startswith(directory + "/"):
            raise _check.SchemaError(f"{where}.file", f"{f!r} is not under {directory}/")
        if f in files:
            raise _check.SchemaError(f"{where}.file", f"{f!r} is the index itself" if
                                     f == INDEX_FILE else f"{f!r} is named twice")
        files.add(f)
    topology: dict[str, str] = {}
    for i, g in enumerate(index["graphs"]):
        if g["name"] in topology:
            raise _check.SchemaError(f"graphs[{i}].name", f"{g['name']!r} appears twice")
        topology[g["name"]] = g["topology"]
        for h in g["modules"]:
            if h not in index["modules"]:
                raise _check.SchemaError(f"graphs[{i}].modules", f"names module {h}, which "
                                                                 f"'modules' does not list")
    templated: set[str] = set()
    for i, t in enumerate(index["templates"]):
        for j, name in enumerate(t["graphs"]):
            where = f"templates[{i}].graphs[{j}]"
            if name not in topology:
                raise _check.SchemaError(where, f"{name!r} is not one of the graphs")
            if name in templated:
                raise _check.SchemaError(where, f"{name!r} is in two templates")
            if topology[name] != t["topology"]:
                raise _check.SchemaError(where, f"{name!r} has topology {topology[name]}, not "
                                                f"the template's {t['topology']}")
            templated.add(name)
    lone = sorted(set(topology) - templated)
    if lone:
        raise _check.SchemaError("templates", f"no template holds graph {lone[0]!r}")


#: ``graphs/index.json`` as :meth:`GraphStore.save` writes it; checked on every read
#: (:func:`read_index`, :func:`archive_index`) before anything uses it.
INDEX_SCHEMA = _check.Obj({
    "format": _check.Str(max_len=64),
    "version": _check.Int(0, _check.U32_MAX),
    "graph_format_version": _check.Int(0, _check.U32_MAX),
    "device": _check.Int(0, (1 << 31) - 1),
    "region": _check.Obj({"base": _N, "size": _N}),
    "graphs": _check.List(_check.Obj({
        "name": _check.Str(max_len=1024),
        "file": _check.RelPath(),
        "bytes": _check.Int(0, _check.I64_MAX),
        "sha256": _HEX64,
        "nodes": _N,
        "relocations": _N,
        "relocations_by_kind": _check.Map(_check.Str(max_len=64), _N, max_len=64),
        "relocatable": _check.Bool(),
        "unclassified": _check.Obj({
            "count": _N,
            "words": _check.List(_check.Obj({
                "node": _N, "kernel": _check.Str(max_len=1 << 16, empty=True), "offset": _N,
                "value": _check.Str(max_len=64), "reason": _check.Str(max_len=4096, empty=True),
            })),
        }),
        "integers_kept": _check.Map(_check.Str(max_len=256), _N, max_len=256),
        "topology": _check.Str(max_len=256),
        "modules": _check.List(_HEX64, unique=True),
    })),
    "templates": _check.List(_check.Obj({"topology": _check.Str(max_len=256),
                                         "graphs": _check.List(_check.Str(max_len=1024))})),
    "modules": _check.Map(_HEX64, _check.Obj({
        "file": _check.RelPath(), "bytes": _check.Int(0, _check.I64_MAX),
        "kind": _check.Str(max_len=64), "kernels": _N,
    })),
}, rule=_index_rule)


def _index_problem(index: Any) -> _check.SchemaError | None:
    """Why ``index`` (parsed JSON) is not a graph index this build reads, or None."""
    if type(index) is not dict:
        return _check.SchemaError("", f"must hold a JSON object, got {_check.got(index)}")
    fmt, version = index.get("format"), index.get("version")
    if fmt != INDEX_FORMAT or type(fmt) is not str:
        return _check.SchemaError("format", f"{_check.short(fmt)}: not a vitrify graph index")
    if type(version) is not int or version != INDEX_VERSION:
        return _check.SchemaError("version", f"graph index version {_check.short(version)} is "
                                             f"not supported (this build reads {INDEX_VERSION})")
    try:
        _check.validate(INDEX_SCHEMA, index)
    except _check.SchemaError as e:
        return e
    return None


def read_index(directory: str | os.PathLike, data: bytes | None = None) -> dict:
    """The validated ``graphs/index.json`` of a saved store (``data``: its bytes, already read);
    a ValueError naming the file and the field otherwise (:data:`INDEX_SCHEMA`). An archive's
    index is read with :func:`archive_index`."""
    _check.path("directory", directory)
    path = Path(directory) / INDEX_FILE
    try:
        index = _check.load_json(path.read_bytes() if data is None else bytes(data))
    except FileNotFoundError:
        raise FileNotFoundError(f"no graph index at {path}") from None
    except ValueError as e:
        raise ValueError(f"graph index {path}: {e}") from None
    problem = _index_problem(index)
    if problem is not None:
        raise ValueError(f"graph index {path}: {problem}")
    return index


def archive_index(archive: Any, rank: int = 0) -> dict:
    """Rank ``rank``'s graph index in an opened :class:`vitrify.archive.Archive`, read after the
    manifest vouched for it (listed, a regular file reached through no link, its size and
    CRC32C) and checked: its schema, and every graph and module file it names listed in the
    manifest with the size it records. A problem is an :class:`vitrify.archive.ArchiveCorrupt`
    naming the archive, the index and the field; no index is a KeyError."""
    from . import archive as _archive

    _check.integer("rank", rank, 0, 999999)
    prefix = f"rank{int(rank)}/"
    rel = prefix + INDEX_FILE
    if rel not in archive.files:
        raise KeyError(f"archive {archive.path} has no graphs for rank {rank} "
                       f"({rel} is not in its manifest)")
    index = archive.read_json(rel)
    problem = _index_problem(index)
    if problem is not None:
        cls = _archive.UnsafePath if isinstance(problem, _check.PathSchemaError) \
            else _archive.ArchiveCorrupt
        raise cls(archive.path, rel, str(problem))
    named = [(f"graphs[{i}].file", g["file"], g["bytes"]) for i, g in enumerate(index["graphs"])]
    named += [(f"modules[{h[:12]}...].file", m["file"], m["bytes"])
              for h, m in index["modules"].items()]
    for field, f, size in named:
        listed = archive.files.get(prefix + f)
        if listed is None:
            raise _archive.ArchiveCorrupt(archive.path, rel, f"{field}: names {prefix + f}, which "
                                                             f"the manifest does not list")
        if listed["bytes"] != size:
            raise _archive.ArchiveCorrupt(archive.path, rel, f"{field}: {prefix + f} is "
                                                             f"{listed['bytes']} bytes in the "
                                                             f"manifest, the index says {size}")
    # and the index accounts for every graph and module file the manifest lists
    named_files = {prefix + f for _, f, _ in named} | {rel}
    for other in archive.files:
        if other.startswith((prefix + GRAPHS_DIR + "/", prefix + MODULES_DIR + "/")) and \
                other not in named_files:
            raise _archive.ArchiveCorrupt(archive.path, rel, f"names no {other}, which the "
                                                             f"manifest lists")
    return index


class _FileProblem(ValueError):
    """A file of a saved store (``rel``, relative to its directory) is not what its index says;
    :func:`load_from_archive` names it as the archive's file."""

    def __init__(self, root: Path, rel: str, reason: str):
        self.rel, self.reason = rel, reason
        super().__init__(f"{root / rel}: {reason}")


def _read_checked(root: Path, rel: str, size: int,
                  files: Mapping[str, bytes] | None = None) -> bytes:
    problem = _check.relpath_problem(rel)
    if problem:
        raise _FileProblem(root, INDEX_FILE, f"names the path {_check.short(rel)}, which "
                                             f"{problem}")
    if files is not None and rel not in files:
        raise _FileProblem(root, rel, "named by the graph index, but not among the files read")
    data = (root / rel).read_bytes() if files is None else files[rel]
    if len(data) != size:
        raise _FileProblem(root, rel, f"{len(data)} bytes, the index says {size} (truncated "
                                      f"file?)")
    return data


class LoadedGraphs:
    """Graphs rebuilt in this process (see :func:`load`). ``replay(name)`` waits for that
    graph's build only; ``wait_all()`` for every build; ``stats()`` counts builds, templates,
    parameter switches. Close (or leave the ``with`` block) to release executables and
    modules."""

    def __init__(self, index: dict, gset, ids: dict[str, int]):
        self.index = index
        self._set = gset
        self._ids = ids
        self.skipped: dict[str, str] = {}  # graphs left out (non-relocatable), name -> reason

    def _open(self) -> None:
        if self._set is None:
            raise ValueError("these graphs were closed")

    @property
    def names(self) -> list[str]:
        return list(self._ids)

    def __contains__(self, name: object) -> bool:
        return name in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def _id(self, name: str) -> int:
        if self._set is None:
            raise ValueError("these graphs were closed")
        try:
            return self._ids[name]
        except KeyError:
            raise KeyError(f"no graph {name!r}; have {sorted(self._ids)[:10]}") from None

    def wait(self, name: str) -> None:
        """Block until graph ``name`` is built (re-raises its build error)."""
        self._open()
        self._set.wait(self._id(name))

    def wait_all(self) -> None:
        """Block until every graph is built."""
        self._open()
        self._set.wait_all()

    def template_of(self, name: str) -> int:
        """The index of the executable (topology template) graph ``name`` shares."""
        self._open()
        return self._set.template_of(self._id(name))

    def replay(self, name: str, stream: Any = None) -> None:
        """Launch graph ``name`` on ``stream`` (a ``torch.cuda.Stream``, an integer
        ``cudaStream_t``, or None: torch's current stream when torch is imported, else the
        legacy default stream). Asynchronous, like ``CUDAGraph.replay``."""
        self._open()
        if isinstance(stream, (int, bool)):
            _check.integer("stream", stream, 0, _check.U64_MAX)
        gid = self._id(name)
        self._set.launch(gid, _stream_handle(stream))

    def synchronize(self) -> None:
        """Wait until all work on the device has finished (``cuCtxSynchronize``)."""
        if self._set is None:
            raise ValueError("these graphs were closed")
        self._set.synchronize()

    def stats(self) -> dict:
        """Counts: graphs, templates, built_templates, ready_graphs, modules_loaded,
        parameter_switches, nodes_updated, build_seconds (summed over build threads)."""
        self._open()
        return dict(self._set.stats())

    def close(self) -> None:
        """Release every executable, graph and module (after pending work finished)."""
        self._set = None

    def __enter__(self) -> LoadedGraphs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stream_handle(stream: Any) -> int:
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_stream().cuda_stream)
        return 0
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        raise ValueError(f"stream must be an int handle or have .cuda_stream, got {stream!r}")
    return int(handle)


def load_from_archive(archive: Any, rank: int = 0, *, verify: bool = True,
                      **kw: Any) -> LoadedGraphs:
    """Load rank ``rank``'s graphs from an opened :class:`vitrify.archive.Archive`.

    The index is read as :func:`archive_index` reads it (checksummed and checked, whatever
    ``verify`` says); every graph and module file it names is checked against the manifest
    (listed, inside the archive, no symlinks, size, and with ``verify`` its CRC32C): damage is
    a :class:`vitrify.archive.ArchiveCorrupt` naming the file, raised before any driver call.
    ``verify=False`` checks no other content (neither CRC32C nor the modules' SHA-256 names).
    ``kw`` goes to :func:`load` (device, region_base, threads, names, share_templates).
    """
    if not (hasattr(archive, "files") and hasattr(archive, "path")
            and callable(getattr(archive, "check_file", None))):
        raise _check.ArgumentTypeError(f"archive must be an opened vitrify.archive.Archive, got "
                                       f"{_check.got(archive)}")
    _check.integer("rank", rank, 0, 999999)
    _check.boolean("verify", verify)
    prefix = f"rank{int(rank)}/"
    index = archive_index(archive, rank)  # every file it names is listed, with its size
    rels = [prefix + INDEX_FILE] + [prefix + g["file"] for g in index["graphs"]] + \
        [prefix + m["file"] for m in index["modules"].values()]
    # Read and verified in one native call (no GIL hand-over per file: P7's loader runs beside
    # a main thread busy importing torch).
    data = archive.read_files(rels, checksum=verify)
    # The SHA-256 names are not recomputed (G2 of csrc/src/graph/DESIGN.md; hashing ~100 modules
    # cost a THAW ~1 s): with ``verify`` the CRC32C checked every byte; without it the caller
    # chose not to check the archive's bytes at all.
    from . import archive as _archive

    try:
        return load(Path(archive.path) / f"rank{int(rank)}",
                    files={rel[len(prefix):]: b for rel, b in data.items()}, checked=True, **kw)
    except _FileProblem as e:
        raise _archive.ArchiveCorrupt(archive.path, prefix + e.rel, e.reason) from None


def unrelocatable_graphs(index: dict, region_base: int | None, names: list[str] | None = None,
                         unrelocatable: str = "error") -> dict[str, str]:
    """The graphs of ``index`` (:func:`read_index`) that FREEZE marked non-relocatable, when the
    region lives at ``region_base`` instead of the frozen base: name -> reason (empty at the
    frozen base). With ``unrelocatable="error"`` the first one raises :class:`GraphNotRelocatable`
    instead. No driver call: THAW can refuse before restoring anything."""
    frozen_base = int(index["region"]["base"])
    skipped: dict[str, str] = {}
    if region_base is None or int(region_base) == frozen_base:
        return skipped
    for g in index["graphs"] if names is None else [g for g in index["graphs"]
                                                    if g["name"] in set(names)]:
        if g.get("relocatable", False):
            continue
        words = g.get("unclassified", {}).get("words", [])
        first = (f"kernel {words[0]['kernel']!r} parameter byte {words[0]['offset']} holds "
                 f"{words[0]['value']} ({words[0]['reason']})") if words else "no audit"
        reason = (f"graph {g['name']!r} is not relocatable from {hex(frozen_base)} to "
                  f"{hex(int(region_base))}: {first}; "
                  f"{g.get('unclassified', {}).get('count', '?')} word(s) may or may not be "
                  f"pointers (vitrify inspect --relocations shows them)")
        if unrelocatable == "error":
            raise GraphNotRelocatable(reason)
        skipped[g["name"]] = reason
    return skipped


def load(directory: str | os.PathLike, *, device: int = 0, region_base: int | None = None,
         threads: int = 2, names: list[str] | None = None,
         share_templates: bool = True, unrelocatable: str = "error",
         files: Mapping[str, bytes] | None = None, checked: bool = False) -> LoadedGraphs:
    """Load the graphs saved under ``directory`` and start rebuilding them in the background.

    ``region_base``: where the region lives in this process (None: where it was at FREEZE);
    relocated words are rewritten to ``region_base + offset``. ``names``: only these graphs.
    ``share_templates=False`` instantiates every graph separately (a benchmark baseline).
    A graph FREEZE marked non-relocatable (it holds a word that may or may not be a pointer) is
    never run at another base: with ``unrelocatable="error"`` loading raises
    :class:`GraphNotRelocatable` naming the graph and kernel before any driver call; with
    ``"skip"`` such graphs are left out and listed in ``LoadedGraphs.skipped`` (name -> reason),
    so the caller captures them cold. ``files``: the store's files already read (path relative
    to ``directory`` -> bytes; :func:`load_from_archive` passes the archive's verified ones).
    Every module file is checked against its SHA-256 name and every graph file against its
    checksums before any driver call; a mismatch is a ValueError naming the file.
    ``checked=True`` (only with ``files``): another checksum already verified these bytes (the
    archive's CRC32C), so the SHA-256 names are trusted instead of recomputed.
    """
    _check.path("directory", directory)
    _check.integer("device", device, 0, (1 << 31) - 1)
    _check.optional_integer("region_base", region_base, 0, _check.U64_MAX)
    _check.integer("threads", threads, 1, 256)
    if names is not None:
        for i, n in enumerate(_check.sequence("names", names)):
            _check.string(f"names[{i}]", n)
    _check.boolean("share_templates", share_templates)
    _check.boolean("checked", checked)
    if checked and files is None:
        raise ValueError("checked=True needs files (bytes another checksum verified)")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if unrelocatable not in ("error", "skip"):
        raise ValueError(f"unrelocatable must be 'error' or 'skip', got {unrelocatable!r}")
    root = Path(directory)
    if files is not None and INDEX_FILE not in files:
        raise ValueError(f"files lacks the graph index {INDEX_FILE}")
    index = read_index(root, None if files is None else files[INDEX_FILE])
    entries = index["graphs"]
    skipped = unrelocatable_graphs(index, region_base, names, unrelocatable)
    if skipped:
        if names is None:
            entries = [g for g in entries if g["name"] not in skipped]
        else:
            names = [n for n in names if n not in skipped]
    if names is not None:
        wanted = set(names)
        missing = wanted - {g["name"] for g in entries}
        if missing:
            raise KeyError(f"graphs not in {root}: {sorted(missing)}")
        entries = [g for g in entries if g["name"] in wanted]
    datas = {g["name"]: _read_checked(root, g["file"], g["bytes"], files) for g in entries}
    gset = _native.GraphSet(device, share_templates)
    needed = sorted({h for g in entries for h in g["modules"]})
    modules = []
    for h in needed:
        m = index["modules"].get(h)
        if m is None:
            raise _FileProblem(root, INDEX_FILE, f"lists no file for module {h}")
        modules.append((_read_checked(root, m["file"], m["bytes"], files), h))
    gset.add_modules(modules, not checked)  # SHA-256 names checked; the GIL released once
    ids = {}
    relocate_to = None if region_base is None else int(region_base)
    for g in entries:  # (a graph needing a module its entry omits is refused here too)
        try:
            ids[g["name"]] = gset.add(datas[g["name"]], relocate_to, g["sha256"], not checked)
        except ValueError as e:
            reason = (f"SHA-256 differs from the index (graph {g['name']!r})" if "SHA-256" in str(e)
                      else f"not a valid graph file: {e}")
            raise _FileProblem(root, g["file"], reason) from None
    gset.start(threads)
    loaded = LoadedGraphs(index, gset, ids)
    loaded.skipped = skipped
    return loaded
