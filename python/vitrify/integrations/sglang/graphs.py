"""The SGLang plugin's decode-graph backend: record at SAVE, rebuild at LOAD (PLUGIN.md,
"FREEZE/THAW inside the scheduler", the block-placement plan).

Owns: the archive name of a captured shape (:func:`graph_name`), the KV pool config round trip
(:func:`pool_config_state`, :func:`pool_config_from_state`), graph outputs recorded as region
offsets and rebuilt as views (:func:`describe`, :func:`rebuild`, :func:`cuda_tensor_at`),
SGLang's full-graph backend with vitrify's capture and replay (:func:`graph_backend_class`), and
the routed pool's block map SAVE and LOAD compare (:func:`routed_blocks`, :func:`check_blocks`).
Imports only the standard library at import time (torch and SGLang inside the functions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import pkgutil
import re
import time
from collections.abc import Callable
from typing import Any

from . import state, versions


def graph_name(shape_key: Any) -> str:
    """The archive name of the decode graph of ``shape_key`` (SGLang's ``ShapeKey``: size,
    stream index, variant label, and since 0.5.23 the attention variant):
    ``decode_bs<size>[_s<stream>][_<label>][+attn-<attention variant>]``, file-name safe (the
    label and the variant keep only ``A-Za-z0-9_.-``, so no label reads as a variant): two
    shapes that differ only in their attention variant get two names."""
    size = getattr(shape_key, "size", shape_key)
    name = f"decode_bs{int(size)}"
    stream = getattr(shape_key, "stream_idx", None)
    if stream is not None:
        name += f"_s{int(stream)}"
    label = getattr(shape_key, "variant_label", None)
    if label:
        name += "_" + re.sub(r"[^A-Za-z0-9_.-]", "-", str(label))
    variant = getattr(shape_key, "attention_variant", None)
    if variant:
        name += "+attn-" + re.sub(r"[^A-Za-z0-9_.-]", "-", str(variant))
    return name


# ---------------------------------------------------------------------------------------------
# KV pool sizing: SAVE's, re-applied at LOAD
# ---------------------------------------------------------------------------------------------


def pool_config_state(config: Any) -> dict:
    """SGLang's ``MemoryPoolConfig`` (a dataclass) as plain JSON."""
    if not dataclasses.is_dataclass(config):
        raise state.FreezeRefused(f"the KV pool config is a {type(config).__name__}, not a "
                                  f"dataclass: this SGLang is not the one the plugin was "
                                  f"written for")
    out = dataclasses.asdict(config)
    json.dumps(out)  # plain values only (ints, floats, None)
    return out


def pool_config_from_state(cls: type, saved: dict) -> Any:
    """SAVE's pool config rebuilt as ``cls``; its fields must be exactly the class's (another
    SGLang's config is refused naming the difference)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if set(saved) != names:
        raise state.FreezeRefused(f"the archive's KV pool config has fields "
                                  f"{sorted(set(saved) - names)} this SGLang lacks and lacks "
                                  f"{sorted(names - set(saved))}")
    return cls(**saved)


def pool_config_class() -> type:
    """The release's ``MemoryPoolConfig``."""
    return pkgutil.resolve_name(versions.current().POOL_CONFIG)


# ---------------------------------------------------------------------------------------------
# graph outputs: region offsets at SAVE, views at LOAD
# ---------------------------------------------------------------------------------------------


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr") and \
        hasattr(value, "stride")


def describe(value: Any, region: Any, path: str = "output") -> Any:
    """A captured graph's output as plain JSON: tensors as region offset, dtype, shape and
    stride (a tensor outside the region is refused: it would not exist at LOAD), dataclasses by
    qualified name and fields, lists, tuples, dicts with string keys, and plain values."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    if _is_tensor(value):
        ptr = int(value.data_ptr())
        if value.numel() and not (region.base <= ptr < region.base + region.size):
            raise state.FreezeRefused(f"{path}: a tensor at 0x{ptr:x} outside the region "
                                      f"[0x{region.base:x}, +{region.size}): it would not exist "
                                      f"at LOAD")
        return {"t": {"offset": ptr - region.base if value.numel() else 0,
                      "dtype": str(value.dtype).rpartition(".")[2],
                      "shape": list(value.shape), "stride": list(value.stride()),
                      "device": int(value.device.index or 0)}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {"dc": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: describe(getattr(value, f.name), region, f"{path}.{f.name}")
                           for f in dataclasses.fields(value)}}
    if isinstance(value, (list, tuple)):
        return {"seq": type(value).__name__,
                "items": [describe(v, region, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: describe(v, region, f"{path}[{k!r}]") for k, v in value.items()}}
    raise state.FreezeRefused(f"{path}: a {type(value).__module__}.{type(value).__qualname__} "
                              f"in a graph's output cannot be recorded")


def sglang_class(spec: str) -> type:
    """The SGLang dataclass ``module:qualname`` names (a recorded output's class); anything
    outside SGLang, or not a dataclass, is refused."""
    module, _, qualname = spec.partition(":")
    if not (module == "sglang" or module.startswith("sglang.")):
        raise state.FreezeRefused(f"the archive names output class {spec!r}; only SGLang's are "
                                  f"rebuilt")
    obj = pkgutil.resolve_name(f"{module}:{qualname}")
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise state.FreezeRefused(f"the archive's output class {spec!r} is not a dataclass here")
    return obj


def rebuild(desc: Any, region: Any, tensor_at: Callable[..., Any],
            resolve_class: Callable[[str], type] = sglang_class) -> Any:
    """The value :func:`describe` recorded, tensors made by ``tensor_at(address, dtype, shape,
    stride, device)`` over the region's memory."""
    if not isinstance(desc, dict) or len(desc) not in (1, 2):
        raise state.FreezeRefused(f"not a recorded output: {desc!r:.100}")
    if "v" in desc:
        return desc["v"]
    if "t" in desc:
        t = desc["t"]
        return tensor_at(region.base + int(t["offset"]), t["dtype"], tuple(t["shape"]),
                         tuple(t["stride"]), int(t.get("device", 0)))
    if "dc" in desc:
        cls = resolve_class(desc["dc"])
        return cls(**{k: rebuild(v, region, tensor_at, resolve_class)
                      for k, v in desc["fields"].items()})
    if "seq" in desc:
        items = [rebuild(v, region, tensor_at, resolve_class) for v in desc["items"]]
        return tuple(items) if desc["seq"] == "tuple" else items
    if "dict" in desc:
        return {k: rebuild(v, region, tensor_at, resolve_class) for k, v in desc["dict"].items()}
    raise state.FreezeRefused(f"not a recorded output: {desc!r:.100}")


def cuda_tensor_at(address: int, dtype: str, shape: tuple, stride: tuple, device: int) -> Any:
    """A torch tensor viewing ``address`` (region memory that outlives it)."""
    import torch

    from .. import torch as vt

    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    if any(s == 0 for s in shape):
        return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{device}")
    span = (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * item
    raw = vt.tensor_at(address, span, device)
    return raw.view(getattr(torch, dtype)).as_strided(shape, stride)


# ---------------------------------------------------------------------------------------------
# the routed pool's block map
# ---------------------------------------------------------------------------------------------


def routed_blocks(region: Any) -> list[list[int]]:
    """The routed pool's taken blocks (region offset, size), ascending: where every live tensor
    of the routed pool sits, what FREEZE and THAW must agree on where a capture was skipped
    (the block-placement hazard; the region's own checkpoints see only segments). Free blocks
    are left out: they are the gaps between taken ones, and a wholly free segment holds no
    tensor. A block waiting to be freed counts as taken. Two tensors of one size that swapped
    places would not show here: the plan keeps the order of requests equal instead."""
    import torch

    from .. import torch as vt

    pool = vt.mem_pool(region)
    if hasattr(pool, "snapshot"):
        segments = pool.snapshot()
        if isinstance(segments, dict):
            segments = segments.get("segments", [])
    else:  # older torch: the process snapshot, this pool's segments
        segments = [seg for seg in torch.cuda.memory.memory_snapshot()
                    if tuple(seg.get("segment_pool_id", ())) == tuple(pool.id)]
    out = []
    for seg in sorted(segments, key=lambda sg: sg["address"]):
        addr = int(seg["address"])
        for b in seg["blocks"]:
            addr = int(b.get("address", addr))
            if b["state"] != "inactive":
                out.append([addr - region.base, int(b["size"])])
            addr += int(b["size"])
    return sorted(out)


def check_blocks(frozen: list, here: list) -> None:
    """LOAD's routed block map must be SAVE's; the first difference is refused, named."""
    if frozen == here:
        return
    first = next((i for i, (a, b) in enumerate(zip(frozen, here)) if a != b),
                 min(len(frozen), len(here)))
    f = frozen[first] if first < len(frozen) else None
    h = here[first] if first < len(here) else None
    raise state.FreezeRefused(f"the decode graphs' tensors are not where SAVE put them: the "
                              f"routed pool's taken block {first} is {h} (offset, size) here but "
                              f"was {f} at SAVE ({len(here)} vs {len(frozen)} blocks); refusing "
                              f"to replay graphs that would read other addresses")


# ---------------------------------------------------------------------------------------------
# the decode graph backend
# ---------------------------------------------------------------------------------------------

_BACKEND_CLASS: type | None = None


def add_time(run: Any, key: str, seconds: float) -> None:
    run.timings[key] = run.timings.get(key, 0.0) + seconds


def full_graph_backend() -> type:
    """SGLang's ``FullCudaGraphBackend`` of this release."""
    return pkgutil.resolve_name(versions.current().FULL_GRAPH_BACKEND)


def graph_backend_class() -> type:
    """SGLang's ``FullCudaGraphBackend`` with vitrify's capture (SAVE) and replay (LOAD)."""
    global _BACKEND_CLASS
    if _BACKEND_CLASS is not None:
        return _BACKEND_CLASS
    import torch

    from ... import region as _region
    from .. import torch as vt

    class VitrifyGraphBackend(full_graph_backend()):
        """Captures into vitrify's graph store and the region's capture pool (SAVE), or claims
        each capture's segments and replays the archive's graphs (LOAD)."""

        @contextlib.contextmanager
        def capture_session(self, stream):
            run = state.STATE.run
            self._pool = vt.capture_pool(run.region).id  # never the routed pool (the plan, 1.)
            with super().capture_session(stream):
                yield

        def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
            run = state.STATE.run
            t0 = time.perf_counter()
            # the two warm-up forwards run on both sides: the routed pool sees the same requests
            for _ in range(2):
                self._device_module.synchronize()
                self._tp_group.barrier()
                forward_fn()
                if post_warmup_hook is not None:
                    post_warmup_hook()
            self._device_module.synchronize()
            t1 = time.perf_counter()
            add_time(run, "warmup_forwards_s", t1 - t0)
            gc.collect()  # the same point on both sides (the loop runs with gc off)
            t2 = time.perf_counter()
            add_time(run, "gc_s", t2 - t1)
            name = graph_name(shape_key)
            try:  # SGLang's capture rewrites a RuntimeError into advice that does not apply
                self._capture_or_claim(run, shape_key, name, forward_fn)
            except SystemExit:
                raise
            except Exception as e:
                raise state.fatal(f"decode graph {name}: {type(e).__name__}: {e}") from None
            add_time(run, "capture_s" if run.mode == "save" else "claim_s",
                     time.perf_counter() - t2)
            run.timings["shapes"] = run.timings.get("shapes", 0) + 1

        def _capture_or_claim(self, run, shape_key, name, forward_fn):
            if run.mode == "save":
                # The routed pool is paused (torch matches a thread's pools in the order they
                # were entered, so the capture pool would never win), and the capture goes to
                # the region's capture pool (the plan, 1.). torch.cuda.graph's own entry
                # (synchronize, empty_cache) then runs with no pool active; LOAD does the same
                # at the same point. Non-capture allocations of the capture (torch registers the
                # RNG state of a process's first graph) go to torch's default pool, outside
                # the region and the routed pool; decode graphs use no RNG.
                with vt.routing_paused(run.region), \
                        _region.record_window(run.region) as window:
                    with run.session.graphs.capture(name, pool=self._pool,
                                                    stream=self._capture_stream) as cap:
                        out = forward_fn()
                self._graphs[shape_key] = cap.graph
                self._outputs[shape_key] = out
                run.graphs[name] = {"window": window[0].to_json(),
                                    "outputs": describe(out, run.region, name)}
                return
            meta = run.graphs.get(name)
            if meta is None:
                raise state.FreezeRefused(f"the archive has no decode graph {name}; SAVE "
                                          f"captured {sorted(run.graphs)[:8]}: the batch sizes "
                                          f"differ")
            with vt.routing_paused(run.region):
                torch.cuda.synchronize()  # what torch.cuda.graph's entry did at SAVE
                torch.cuda.empty_cache()
                _region.replay_window(run.region,
                                      _region.AllocationWindow.from_json(meta["window"]),
                                      f"decode graph {name}")
            self._graphs[shape_key] = name
            self._outputs[shape_key] = rebuild(meta["outputs"], run.region, cuda_tensor_at)

        def replay(self, shape_key, static_forward_batch, **kwargs):
            run = state.STATE.run
            if run is not None and run.mode == "load":
                run.loaded.replay(self._graphs[shape_key], stream=torch.cuda.current_stream())
                return self._outputs[shape_key]
            return super().replay(shape_key, static_forward_batch, **kwargs)

        def cleanup(self):
            """Forget every shape. SGLang 0.5.23's own cleanup resets each stored graph, but
            here LOAD stores archive names (the graphs are the thaw's) and SAVE's graphs
            belong to vitrify's graph store, which writes them into the archive: none is
            reset here."""
            self._graphs.clear()
            self._outputs.clear()
            self._pool = None
            if hasattr(self, "_output_buffer"):  # 0.5.23
                self._output_buffer = None

    _BACKEND_CLASS = VitrifyGraphBackend
    return VitrifyGraphBackend


__all__ = ["add_time", "check_blocks", "cuda_tensor_at", "describe", "full_graph_backend",
           "graph_backend_class", "graph_name", "pool_config_class", "pool_config_from_state",
           "pool_config_state", "rebuild", "routed_blocks", "sglang_class"]
