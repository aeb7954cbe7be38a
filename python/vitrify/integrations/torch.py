"""Route torch CUDA allocations into a vitrify :class:`~vitrify.region.Region` — no LD_PRELOAD.

torch is imported lazily (vitrify works without it). Needs torch >= 2.5 (``torch.cuda.MemPool``).
The mechanism: ``vitrify._native`` exports a C allocate/free pair (``vitrify_region_malloc`` /
``vitrify_region_free``); torch loads it through ``torch.cuda.memory.CUDAPluggableAllocator`` and
uses it as the backing allocator of one ``torch.cuda.MemPool`` per region. Inside
:func:`region_allocations` the pool is torch's current pool, so tensors created there come from
the region; outside, torch's own caching allocator serves as usual. The C allocator routes to
the *active* region of the device (set for the duration of the context) and frees by address,
so tensors freed after the context still return their memory to the right region.

Example::

    import vitrify
    from vitrify.integrations import torch as vitrify_torch

    region = vitrify.Region(16 << 30)
    with vitrify_torch.region_allocations(region):
        w = torch.randn(4096, 4096, device="cuda")       # inside [region.base, region.end)
    g = torch.cuda.CUDAGraph()
    with vitrify_torch.graph_capture(region, g):
        y = w @ x                                         # capture allocations in the region
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from .. import _check, _native
from ..region import Region

MALLOC_SYMBOL = "vitrify_region_malloc"
FREE_SYMBOL = "vitrify_region_free"

_lock = threading.Lock()
_allocator: Any = None
_active: dict[int, list[Region]] = {}  # device -> stack of activated regions


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("vitrify.integrations.torch needs torch (pip install torch)") from e
    if not hasattr(torch.cuda, "MemPool"):
        raise ImportError(f"vitrify.integrations.torch needs torch >= 2.5 (torch.cuda.MemPool); "
                          f"this is torch {torch.__version__}")
    return torch


def _region(region: Any) -> Region:
    """``region`` checked: an open :class:`vitrify.Region` (before torch or the driver is used)."""
    if not isinstance(region, Region):
        raise _check.ArgumentTypeError(f"region must be a vitrify.Region, got "
                                       f"{_check.got(region)}")
    if region.closed:
        raise ValueError("region is closed")
    return region


def library_path() -> str:
    """The shared object that exports the C allocator (the ``vitrify._native`` extension)."""
    return _native.__file__


def pluggable_allocator():
    """The process-wide ``CUDAPluggableAllocator`` over vitrify's C allocate/free pair."""
    global _allocator
    torch = _torch()
    with _lock:
        if _allocator is None:
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(
                library_path(), MALLOC_SYMBOL, FREE_SYMBOL)
        return _allocator


def _region_pool(region: Region, attr: str):
    """The ``torch.cuda.MemPool`` over ``region`` kept as ``region.<attr>`` (made once)."""
    _region(region)
    torch = _torch()
    pool = getattr(region, attr, None)
    if pool is None:
        pool = torch.cuda.MemPool(pluggable_allocator().allocator())
        setattr(region, attr, pool)
    return pool


def mem_pool(region: Region):
    """The ``torch.cuda.MemPool`` backed by ``region`` (one per region, kept as long as it)."""
    return _region_pool(region, "_vitrify_torch_pool")


def capture_pool(region: Region):
    """A second ``torch.cuda.MemPool`` over ``region``, for graph captures only: the capture's
    blocks never share torch's free lists with :func:`region_allocations`' pool, so skipping a
    capture at THAW leaves every other tensor's place inside the region's segments as it was
    (the SGLang plugin's FREEZE/THAW plan). One per region, kept as long as it."""
    return _region_pool(region, "_vitrify_capture_pool")


def tensor_at(address: int, nbytes: int, device: int = 0):
    """A ``uint8`` CUDA tensor over ``nbytes`` at ``address`` (device memory it does not own,
    e.g. region memory that outlives it); ``.view(dtype)`` / ``.as_strided`` shape it."""
    torch = _torch()
    address = _check.integer("address", address, 1, _check.U64_MAX)
    nbytes = _check.integer("nbytes", nbytes, 1, _check.U64_MAX)

    class _Memory:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                    "data": (address, False), "version": 3}

    with torch.cuda.device(device):
        return torch.as_tensor(_Memory(), device=f"cuda:{device}")


@contextlib.contextmanager
def routing_paused(region: Region) -> Iterator[None]:
    """Inside :func:`region_allocations`: the thread's allocations stop going to the region's
    routed pool for the block and resume after it. torch matches a thread's active pools in the
    order they were entered, so a capture into another pool (:func:`capture_pool`) must pause
    the routed one first, or its allocations land in the routed pool."""
    torch = _torch()
    pool = mem_pool(region)
    dev = region.device
    torch._C._cuda_endAllocateToPool(dev, pool.id)
    try:
        yield
    finally:
        # begin counts a new use of the pool; region_allocations' exit releases one, so this
        # resume releases the extra count at once (the pool keeps exactly one)
        torch._C._cuda_beginAllocateCurrentThreadToPool(dev, pool.id)
        torch._C._cuda_releasePool(dev, pool.id)


def pool_id(region: Region):
    """The pool id to pass as ``torch.cuda.graph(g, pool=...)`` so a capture allocates from
    ``region`` (capture inside :func:`activated` or use :func:`graph_capture`)."""
    return mem_pool(region).id


def active_base(device: int = 0) -> int | None:
    """Base of the region vitrify's C allocator currently serves on ``device`` (None: none)."""
    return _native.region_active_base(_check.integer("device", device, 0, (1 << 31) - 1))


@contextlib.contextmanager
def activated(region: Region) -> Iterator[Region]:
    """Make ``region`` the target of vitrify's C allocator on its device for the block (nestable;
    the previous target comes back on exit). Does not change torch's current pool."""
    _region(region)
    dev = region.device
    with _lock:
        _native.region_set_active(region._r, dev)
        _active.setdefault(dev, []).append(region)
    try:
        yield region
    finally:
        with _lock:
            stack = _active[dev]
            stack.pop()
            prev = next((r for r in reversed(stack) if not r.closed), None)
            _native.region_set_active(prev._r if prev is not None else None, dev)


@contextlib.contextmanager
def _memory_error_from_region(torch) -> Iterator[None]:
    try:
        yield
    except torch.OutOfMemoryError as e:
        msg = _native.region_last_abi_error()
        if msg:  # the region said why: MemoryError with its numbers
            raise MemoryError(msg) from e
        raise


@contextlib.contextmanager
def region_allocations(region: Region) -> Iterator[Region]:
    """Inside the block, torch CUDA allocations on ``region.device`` come from ``region``.

    Outside it they come from torch's own allocator. A full region raises ``MemoryError``
    carrying the region's message (never a silent fallback). While ``region`` is stopped
    (:meth:`Region.paused`) the pool's new segments come from ordinary device memory.
    """
    _region(region)
    torch = _torch()
    pool = mem_pool(region)
    with activated(region), _memory_error_from_region(torch), \
            torch.cuda.use_mem_pool(pool, device=region.device):
        yield region


@contextlib.contextmanager
def graph_capture(region: Region, graph, **kwargs) -> Iterator[Any]:
    """``torch.cuda.graph(graph, pool=pool_id(region), **kwargs)`` with ``region`` active: the
    capture's allocations (and the graph's outputs) live in the region."""
    _region(region)
    torch = _torch()
    with activated(region), _memory_error_from_region(torch), \
            torch.cuda.graph(graph, pool=pool_id(region), **kwargs):
        yield graph


__all__ = ["FREE_SYMBOL", "MALLOC_SYMBOL", "activated", "active_base", "capture_pool",
           "graph_capture", "library_path", "mem_pool", "pluggable_allocator", "pool_id",
           "region_allocations", "routing_paused", "tensor_at"]
