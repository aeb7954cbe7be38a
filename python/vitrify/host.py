"""The pinned host tier: a multi-slab page pool, KV page gather/scatter, host⇄GPU page copies.

A :class:`HostPool` holds ``total_bytes`` of memory in pages of ``page_bytes``, split into slabs
of whole pages; each slab is one mmap and (with a GPU) one ``cuMemHostRegister``, never larger
than the single-registration ceiling (``VITRIFY_MAX_SLAB_GB``, default 480). Slabs are registered
in parallel threads. :meth:`HostPool.segments` splits any page range into pieces that never
straddle two slabs, and every host⇄GPU copy (:meth:`HostPool.to_device`,
:meth:`HostPool.to_host`) goes through it. Without a GPU the pool is unregistered but fully
usable, so everything but the copies runs on any machine.

:class:`PageLayout` describes where a KV page lives in any host memory (a pool slab, a torch
tensor, raw pointers): for each component (K, V, or one fused buffer) and each layer, a slice of
``slice_bytes`` at ``component + layer * layer_stride + page * page_stride``.
:func:`gather` packs one page into a contiguous blob (slice (c, l) at offset
``(c * layers + l) * slice_bytes``), :func:`scatter` unpacks it; both run on a pool of copy
threads with the GIL released, and can write straight into a disk-slot buffer after its header.

Buffers (``dst``, ``src``) may be an integer address (then give the byte count), a numpy array,
a CPU torch tensor, or anything with the buffer protocol; they must be C-contiguous.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from . import _native
from . import config as _config

GiB = 1 << 30

__all__ = [
    "Copier",
    "HostPool",
    "HostRegistration",
    "PageLayout",
    "Segment",
    "Stream",
    "batch_copy_available",
    "check_hugetlbfs_capacity",
    "default_max_slab_bytes",
    "gather",
    "gather_each",
    "gather_pages",
    "plan_slabs",
    "scatter",
    "scatter_each",
    "scatter_pages",
]


# ---- helpers --------------------------------------------------------------------------------


def default_max_slab_bytes() -> int:
    """The single-registration ceiling in bytes: ``VITRIFY_MAX_SLAB_GB`` (default 480) GiB."""
    return int(_config.settings().max_slab_gb * GiB)


def _address(obj: Any, nbytes: int | None, writable: bool, what: str) -> tuple[int, int, Any]:
    """(address, usable bytes, object to keep alive) of a host buffer."""
    if isinstance(obj, bool):
        raise TypeError(f"{what}: expected a buffer or an integer address, got a bool")
    if isinstance(obj, int):
        if nbytes is None:
            raise ValueError(f"{what} is a raw address: pass its size in bytes too")
        if obj <= 0 or nbytes < 0:
            raise ValueError(f"{what}: invalid address {obj:#x} / size {nbytes}")
        return obj, nbytes, None
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # a torch tensor
        if obj.device.type != "cpu":
            raise ValueError(f"{what} is a torch tensor on {obj.device}; host memory is needed")
        if not obj.is_contiguous():
            raise ValueError(f"{what} is a non-contiguous torch tensor; pass .contiguous()")
        size = obj.numel() * obj.element_size()
        return obj.data_ptr(), _clip(size, nbytes, what), obj
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous")
    if writable and mv.readonly:
        raise ValueError(f"{what} is read-only")
    size = mv.nbytes
    if size == 0:
        raise ValueError(f"{what} is empty")
    if not mv.readonly:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mv.cast("B")))
        return addr, _clip(size, nbytes, what), mv
    if isinstance(obj, bytes):
        addr = ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value
        return addr, _clip(size, nbytes, what), obj
    import numpy as np  # read-only buffers other than bytes

    arr = np.frombuffer(mv, dtype=np.uint8)
    return arr.ctypes.data, _clip(size, nbytes, what), arr


def _clip(size: int, nbytes: int | None, what: str) -> int:
    if nbytes is None:
        return size
    if nbytes < 0 or nbytes > size:
        raise ValueError(f"{what}: nbytes {nbytes} exceeds the buffer's {size} bytes")
    return nbytes


def _stream_handle(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "handle"):  # torch.cuda.Stream, vitrify.host.Stream
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    raise TypeError(f"stream must be an int CUstream, a torch.cuda.Stream or a vitrify Stream, "
                    f"got {type(stream).__name__}")


def plan_slabs(total_bytes: int, page_bytes: int, max_slab_bytes: int | None = None,
               map_align: int = 4096) -> list[dict]:
    """How a pool of ``total_bytes`` in pages of ``page_bytes`` splits into slabs.

    Each slab holds whole pages and maps ``map_bytes`` (its bytes rounded up to ``map_align``,
    the OS or huge page size) that never exceed ``max_slab_bytes``. Returns one dict per slab:
    ``index``, ``first_page``, ``pages``, ``bytes``, ``map_bytes``. Raises ValueError for sizes
    that cannot be planned (naming them).
    """
    ceiling = default_max_slab_bytes() if max_slab_bytes is None else max_slab_bytes
    return list(_native.host_plan_slabs(total_bytes, page_bytes, ceiling, map_align))


def check_hugetlbfs_capacity(mount: str, needed: int, *, fs_magic: int, block_size: int,
                             free_blocks: int) -> None:
    """Raise if a filesystem with these statfs facts cannot hold ``needed`` bytes of slabs.

    ValueError when ``fs_magic`` is not hugetlbfs; MemoryError (needed vs free, the huge page
    size, and what to change) when the free huge pages are too few.
    """
    _native.host_check_hugetlbfs_capacity(mount, needed, fs_magic, block_size, free_blocks)


def batch_copy_available() -> bool:
    """True when the driver has ``cuMemcpyBatchAsync`` (CUDA 12.8+); False without a driver."""
    return _native.host_batch_copy_available()


# ---- the pool -------------------------------------------------------------------------------


class Segment(NamedTuple):
    """A piece of a page range inside one slab: pages [first_page, first_page + pages)."""

    slab: int
    first_page: int
    pages: int
    address: int
    nbytes: int


class HostPool:
    """A pool of ``total_bytes`` host memory in pages of ``page_bytes``, split into slabs.

    Args:
        total_bytes: pool size, a positive multiple of ``page_bytes``.
        page_bytes: the page size (any positive number of bytes).
        max_slab_bytes: the single-registration ceiling; default ``VITRIFY_MAX_SLAB_GB`` GiB.
        hugetlbfs_mount: back slabs by files on this hugetlbfs mount (after a capacity check
            that fails with MemoryError naming needed vs free); default anonymous memory.
        register: ``"auto"`` (register when a GPU is present), ``True``/``"on"`` (require it),
            ``False``/``"off"`` (never).
        parallel: register slabs in parallel threads (else one after another).
        registration_threads: the most threads used for parallel registration (and prefault).
        prefault: before registering, fault every page in with parallel threads; pinning then
            only pins (registration alone serialises on the kernel's memory-map lock).
        device: the CUDA device whose primary context registers and copies.

    Use as a context manager or call :meth:`close`; numpy/torch views of a slab keep its
    memory alive until they are gone.
    """

    def __init__(self, total_bytes: int, page_bytes: int, *, max_slab_bytes: int | None = None,
                 hugetlbfs_mount: str | os.PathLike | None = None,
                 register: bool | str = "auto",
                 parallel: bool = True, registration_threads: int = 16, prefault: bool = True,
                 device: int = 0,
                 _fake_statfs: tuple[int, int, int] | None = None) -> None:
        reg = {True: "on", False: "off"}.get(register, register) if isinstance(register, bool) \
            else register
        if reg not in ("auto", "on", "off"):
            raise ValueError(f"register must be 'auto', True or False, got {register!r}")
        if registration_threads < 1:
            raise ValueError(f"registration_threads must be >= 1, got {registration_threads}")
        ceiling = default_max_slab_bytes() if max_slab_bytes is None else max_slab_bytes
        self._pool = _native.HostPool(total_bytes, page_bytes, ceiling,
                                      os.fspath(hugetlbfs_mount) if hugetlbfs_mount else "",
                                      reg, bool(parallel), registration_threads, bool(prefault),
                                      device,
                                      _fake_statfs)

    # -- facts
    @property
    def total_bytes(self) -> int:
        """Bytes of all pages."""
        return self._pool.total_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes per page."""
        return self._pool.page_bytes

    @property
    def num_pages(self) -> int:
        """Number of pages."""
        return self._pool.num_pages

    @property
    def num_slabs(self) -> int:
        """Number of slabs (mmaps / registrations)."""
        return self._pool.num_slabs

    @property
    def pages_per_slab(self) -> int:
        """Pages in every slab but possibly the last."""
        return self._pool.pages_per_slab

    @property
    def max_slab_bytes(self) -> int:
        """The single-registration ceiling the pool was planned under."""
        return self._pool.max_slab_bytes

    @property
    def device(self) -> int:
        """CUDA device used for registration and copies."""
        return self._pool.device

    @property
    def registered(self) -> bool:
        """True when every slab is registered with the CUDA driver (pinned)."""
        return self._pool.registered

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._pool.closed

    def slabs(self) -> list[dict]:
        """The slab plan: ``index``, ``first_page``, ``pages``, ``bytes``, ``map_bytes`` each."""
        return list(self._pool.slabs())

    def registration(self) -> dict:
        """How registration went: ``registered``, ``parallel``, ``threads``, ``seconds`` (wall
        time for all slabs), ``slab_seconds`` (each slab's cuMemHostRegister) and
        ``prefault_seconds`` (the parallel prefault before it; 0 when off)."""
        return dict(self._pool.registration())

    # -- addresses
    def slab_address(self, slab: int) -> int:
        """Base address of slab ``slab``."""
        return self._pool.slab_address(slab)

    def slab_of(self, page: int) -> int:
        """The slab holding ``page``."""
        return self._pool.slab_of(page)

    def page_address(self, page: int) -> int:
        """Address of page ``page`` (its ``page_bytes`` are contiguous)."""
        return self._pool.page_address(page)

    def segments(self, first_page: int, count: int = 1) -> list[Segment]:
        """Pages [first_page, first_page + count) as pieces that never straddle two slabs."""
        return [Segment(*s) for s in self._pool.segments(first_page, count)]

    def slab_array(self, slab: int):
        """A numpy uint8 array over slab ``slab``'s pages, without copying."""
        return self._pool.slab_array(slab)

    def slab_tensor(self, slab: int):
        """A CPU torch uint8 tensor over slab ``slab``'s pages, without copying (needs torch)."""
        import torch

        return torch.from_numpy(self.slab_array(slab))

    # -- host <-> GPU
    def to_device(self, runs: Sequence[int] | Iterable[Sequence[int]], stream: Any = None, *,
                  path: str = "auto") -> dict:
        """Enqueue copies of pool pages to device memory on ``stream``; no synchronization.

        ``runs`` is one ``(first_page, count, device_ptr)`` or a list of them; the pages of a
        run land contiguously at ``device_ptr``. ``stream`` is an int CUstream, a
        ``torch.cuda.Stream`` or a :class:`Stream` (None: the legacy default stream, which the
        batch API refuses, so the loop path is used). ``path``: ``"auto"`` (cuMemcpyBatchAsync
        where the driver has it), ``"batch"`` (require it) or ``"loop"`` (one async copy per
        segment). Returns ``path``, ``copies``, ``driver_calls``, ``bytes``.
        """
        return self._pool.transfer("h2d", _runs(runs), _stream_handle(stream), path)

    def to_host(self, runs: Sequence[int] | Iterable[Sequence[int]], stream: Any = None, *,
                path: str = "auto") -> dict:
        """Enqueue copies of device memory into pool pages; the reverse of :meth:`to_device`."""
        return self._pool.transfer("d2h", _runs(runs), _stream_handle(stream), path)

    # -- lifetime
    def close(self) -> None:
        """Unregister and unmap the slabs (deferred while numpy/torch views are alive)."""
        self._pool.close()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "HostPool(closed)"
        return (f"HostPool(pages={self.num_pages} x {self.page_bytes} B, slabs={self.num_slabs}, "
                f"registered={self.registered})")


def _runs(runs) -> list[tuple[int, int, int]]:
    runs = list(runs)
    if runs and isinstance(runs[0], int):
        runs = [runs]
    out = []
    for r in runs:
        if len(r) != 3:
            raise ValueError(f"a page run is (first_page, count, device_ptr), got {r!r}")
        out.append((int(r[0]), int(r[1]), int(r[2])))
    return out


class HostRegistration:
    """One ``cuMemHostRegister`` of caller memory, undone by :meth:`close`.

    Refuses (ValueError) a range above ``max_bytes`` (default: the ``VITRIFY_MAX_SLAB_GB``
    ceiling) before calling the driver. ``buffer`` is a writable buffer or an int address
    with ``nbytes``.
    """

    def __init__(self, buffer: Any, nbytes: int | None = None, *, device: int = 0,
                 max_bytes: int | None = None) -> None:
        addr, n, self._keep = _address(buffer, nbytes, True, "registration buffer")
        ceiling = default_max_slab_bytes() if max_bytes is None else max_bytes
        self._reg = _native.HostRegistration(addr, n, device, ceiling)

    @property
    def address(self) -> int:
        """The registered address (0 after close)."""
        return self._reg.ptr

    @property
    def nbytes(self) -> int:
        """The registered length (0 after close)."""
        return self._reg.nbytes

    def close(self) -> None:
        """Unregister (idempotent)."""
        self._reg.close()

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream:
    """A non-blocking CUstream on ``device``'s primary context (``.handle`` is the CUstream)."""

    def __init__(self, device: int = 0) -> None:
        self._s = _native.Stream(device)

    @property
    def handle(self) -> int:
        """The CUstream as an integer."""
        return self._s.handle

    def synchronize(self) -> None:
        """Wait for everything enqueued on the stream."""
        self._s.synchronize()


# ---- layouts and gather/scatter -------------------------------------------------------------


def _component_addresses(components: Any) -> list[int]:
    if isinstance(components, (int, str, bytes)) or not isinstance(components, (list, tuple)):
        components = [components]
    out = []
    for c in components:
        if isinstance(c, int):
            out.append(c)
        elif hasattr(c, "data_ptr"):
            if c.device.type != "cpu":
                raise ValueError(f"layout component is a tensor on {c.device}; host memory needed")
            out.append(c.data_ptr())
        else:
            raise TypeError(f"layout components are addresses (int) or CPU tensors, got "
                            f"{type(c).__name__}")
    return out


class PageLayout:
    """Where each KV page lives: a validated strided layout over host memory.

    Build one with :meth:`layer_first`, :meth:`page_first` (from model numbers) or
    :meth:`strided` (from raw strides, e.g. a torch tensor's). ``components`` is one base
    address (or CPU tensor) per component — ``[k, v]`` or a single fused buffer. Impossible
    shapes (zero sizes, overflow, overlapping slices or components, a slice past
    ``component_bytes``) raise ValueError naming the values.
    """

    def __init__(self, native: Any) -> None:
        self._l = native

    @classmethod
    def layer_first(cls, components: Any, *, layers: int, pages: int, page_tokens: int,
                    heads: int, head_dim: int, item_bytes: int) -> PageLayout:
        """``[layer][page][token][head][dim]`` per component (SGLang's host ``layer_first``)."""
        return cls(_native.PageLayout.layer_first(_component_addresses(components), layers, pages,
                                                  page_tokens, heads, head_dim, item_bytes))

    @classmethod
    def page_first(cls, components: Any, *, layers: int, pages: int, page_tokens: int,
                   heads: int, head_dim: int, item_bytes: int) -> PageLayout:
        """``[page][layer][token][head][dim]`` per component."""
        return cls(_native.PageLayout.page_first(_component_addresses(components), layers, pages,
                                                 page_tokens, heads, head_dim, item_bytes))

    @classmethod
    def strided(cls, components: Any, *, component_bytes: int, layers: int, pages: int,
                slice_bytes: int, layer_stride: int, page_stride: int) -> PageLayout:
        """Any layout: slice (layer, page) of a component is ``slice_bytes`` at
        ``base + layer * layer_stride + page * page_stride``, inside ``component_bytes``."""
        for name, v in (("component_bytes", component_bytes), ("layers", layers),
                        ("pages", pages), ("slice_bytes", slice_bytes),
                        ("layer_stride", layer_stride), ("page_stride", page_stride)):
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        native = _native.PageLayout(_component_addresses(components), component_bytes, layers,
                                    pages, slice_bytes, layer_stride, page_stride)
        native.validate()
        return cls(native)

    @classmethod
    def from_tensor(cls, tensor: Any, *, token_dim: int, page_tokens: int,
                    layer_dim: int | None = None,
                    component_dim: int | None = None) -> PageLayout:
        """The layout of a KV buffer given as a CPU torch tensor or a numpy array.

        ``token_dim`` indexes tokens (``page_tokens`` per page); ``layer_dim`` and
        ``component_dim`` (K/V), when given, must come before it; the dims after ``token_dim``
        must be dense, so one page of one layer is one contiguous slice. Examples (SGLang host
        pools): ``layer_first`` ``[2, layers, tokens, heads, dim]`` → ``component_dim=0,
        layer_dim=1, token_dim=2``; ``page_first`` ``[2, tokens, layers, heads, dim]`` →
        ``component_dim=0, token_dim=1`` (each page is one slice holding all layers).
        """
        if hasattr(tensor, "data_ptr"):  # torch: strides in elements
            if tensor.device.type != "cpu":
                raise ValueError(f"tensor is on {tensor.device}; a host tensor is needed")
            item = tensor.element_size()
            base, shape = tensor.data_ptr(), tuple(tensor.shape)
            strides = tuple(s * item for s in tensor.stride())
            nbytes = tensor.numel() * item
        else:  # numpy: strides in bytes
            item = tensor.itemsize
            base, shape, strides = tensor.ctypes.data, tuple(tensor.shape), tuple(tensor.strides)
            nbytes = tensor.nbytes
        nd = len(shape)
        for name, d in (("token_dim", token_dim), ("layer_dim", layer_dim),
                        ("component_dim", component_dim)):
            if d is not None and not 0 <= d < nd:
                raise ValueError(f"{name}={d} is not a dimension of a {nd}-d tensor")
            if d is not None and d != token_dim and d > token_dim:
                raise ValueError(f"{name}={d} must come before token_dim={token_dim}")
        if page_tokens < 1 or shape[token_dim] % page_tokens:
            raise ValueError(f"page_tokens={page_tokens} must divide the {shape[token_dim]} "
                             f"tokens of dim {token_dim}")
        dense = item
        for d in range(nd - 1, token_dim, -1):
            if strides[d] != dense:
                raise ValueError(f"dim {d} (stride {strides[d]} bytes) is not dense: the dims "
                                 f"after token_dim must be contiguous")
            dense *= shape[d]
        if strides[token_dim] != dense:
            raise ValueError(f"token_dim {token_dim} has stride {strides[token_dim]} bytes, "
                             f"{dense} needed for contiguous page slices")
        ncomp = 1 if component_dim is None else shape[component_dim]
        comps = [base + c * (0 if component_dim is None else strides[component_dim])
                 for c in range(ncomp)]
        return cls.strided(comps, component_bytes=base + nbytes - comps[-1],
                           layers=1 if layer_dim is None else shape[layer_dim],
                           pages=shape[token_dim] // page_tokens,
                           slice_bytes=page_tokens * dense,
                           layer_stride=0 if layer_dim is None else strides[layer_dim],
                           page_stride=page_tokens * strides[token_dim])

    @property
    def blob_bytes(self) -> int:
        """Bytes of one gathered page: components * layers * slice_bytes."""
        return self._l.blob_bytes

    components = property(lambda self: list(self._l.components), doc="Component base addresses.")
    component_bytes = property(lambda self: self._l.component_bytes, doc="Bytes per component.")
    layers = property(lambda self: self._l.layers, doc="Layers (slices per component).")
    pages = property(lambda self: self._l.pages, doc="Pages in the layout.")
    slice_bytes = property(lambda self: self._l.slice_bytes, doc="Bytes per (layer, page).")
    layer_stride = property(lambda self: self._l.layer_stride, doc="Bytes between layers.")
    page_stride = property(lambda self: self._l.page_stride, doc="Bytes between pages.")

    def __repr__(self) -> str:
        return (f"PageLayout(components={len(self.components)}, layers={self.layers}, "
                f"pages={self.pages}, slice_bytes={self.slice_bytes}, "
                f"layer_stride={self.layer_stride}, page_stride={self.page_stride})")


class Copier:
    """Gather/scatter on a fixed pool of ``threads`` copy threads (default: up to 16).

    ``streaming`` (default True) writes copies of 8 MiB or more with non-temporal stores,
    which skip reading each destination line first; turn it off when the destination is read
    by this CPU right after the copy.
    """

    def __init__(self, threads: int | None = None, *, streaming: bool = True,
                 _native_copier: Any = None) -> None:
        if _native_copier is not None:
            self._c = _native_copier
        else:
            t = _native.host_default_threads() if threads is None else threads
            if t < 1:
                raise ValueError(f"threads must be >= 1, got {t}")
            self._c = _native.Copier(t, bool(streaming))

    @property
    def threads(self) -> int:
        """Threads that copy (the calling thread included)."""
        return self._c.threads

    @property
    def streaming(self) -> bool:
        """Whether copies of >= 8 MiB in total use non-temporal stores (x86-64)."""
        return self._c.streaming

    def gather(self, layout: PageLayout, page: int, dst: Any, capacity: int | None = None) -> int:
        """Copy page ``page`` into ``dst`` (contiguous blob); returns the blob size.

        ``dst`` may be an int address (then ``capacity`` is required), e.g. a disk slot
        buffer's address plus its 64-byte header.
        """
        addr, cap, keep = _address(dst, capacity, True, "gather destination")
        self._c.gather(layout._l, page, addr, cap)
        del keep
        return layout.blob_bytes

    def scatter(self, src: Any, layout: PageLayout, page: int, nbytes: int | None = None) -> None:
        """Copy a blob from ``src`` back into page ``page``."""
        addr, n, keep = _address(src, nbytes, False, "scatter source")
        self._c.scatter(addr, n, layout._l, page)
        del keep

    def gather_pages(self, layout: PageLayout, pages: Sequence[int], dst: Any,
                     stride: int | None = None, capacity: int | None = None) -> None:
        """Gather ``pages[i]`` to ``dst + i * stride`` (default stride: the blob size)."""
        addr, cap, keep = _address(dst, capacity, True, "gather destination")
        self._c.gather_pages(layout._l, list(pages), addr,
                             layout.blob_bytes if stride is None else stride, cap)
        del keep

    def scatter_pages(self, src: Any, layout: PageLayout, pages: Sequence[int],
                      stride: int | None = None, nbytes: int | None = None) -> None:
        """Scatter blobs at ``src + i * stride`` into ``pages[i]`` (pages must be distinct)."""
        addr, n, keep = _address(src, nbytes, False, "scatter source")
        self._c.scatter_pages(addr, layout.blob_bytes if stride is None else stride, n,
                              layout._l, list(pages))
        del keep


    def gather_each(self, layout: PageLayout, pages: Sequence[int], dsts: Sequence[Any],
                    each_bytes: int | None = None) -> None:
        """Gather ``pages[i]`` into its own buffer ``dsts[i]`` (e.g. separate slot buffers,
        each an int address past its header with ``each_bytes`` given, or a writable buffer),
        all in one parallel copy."""
        addrs, keep = self._each(dsts, each_bytes, True, "gather_each destination")
        self._c.gather_each(layout._l, list(pages), [a for a, _ in addrs],
                            min(n for _, n in addrs) if addrs else 0)
        del keep

    def scatter_each(self, srcs: Sequence[Any], layout: PageLayout, pages: Sequence[int],
                     each_bytes: int | None = None) -> None:
        """Scatter the blob in ``srcs[i]`` into ``pages[i]`` (pages must be distinct)."""
        addrs, keep = self._each(srcs, each_bytes, False, "scatter_each source")
        self._c.scatter_each([a for a, _ in addrs], min(n for _, n in addrs) if addrs else 0,
                             layout._l, list(pages))
        del keep

    @staticmethod
    def _each(bufs, each_bytes, writable, what):
        addrs, keep = [], []
        for i, b in enumerate(bufs):
            a, n, k = _address(b, each_bytes, writable, f"{what} {i}")
            addrs.append((a, n))
            keep.append(k)
        return addrs, keep


_default: Copier | None = None


def _copier() -> Copier:
    global _default
    if _default is None:
        _default = Copier(_native_copier=_native.host_default_copier())
    return _default


def gather(layout: PageLayout, page: int, dst: Any, capacity: int | None = None) -> int:
    """:meth:`Copier.gather` on the shared copier."""
    return _copier().gather(layout, page, dst, capacity)


def scatter(src: Any, layout: PageLayout, page: int, nbytes: int | None = None) -> None:
    """:meth:`Copier.scatter` on the shared copier."""
    _copier().scatter(src, layout, page, nbytes)


def gather_pages(layout: PageLayout, pages: Sequence[int], dst: Any, stride: int | None = None,
                 capacity: int | None = None) -> None:
    """:meth:`Copier.gather_pages` on the shared copier."""
    _copier().gather_pages(layout, pages, dst, stride, capacity)


def scatter_pages(src: Any, layout: PageLayout, pages: Sequence[int], stride: int | None = None,
                  nbytes: int | None = None) -> None:
    """:meth:`Copier.scatter_pages` on the shared copier."""
    _copier().scatter_pages(src, layout, pages, stride, nbytes)


def gather_each(layout: PageLayout, pages: Sequence[int], dsts: Sequence[Any],
                each_bytes: int | None = None) -> None:
    """:meth:`Copier.gather_each` on the shared copier."""
    _copier().gather_each(layout, pages, dsts, each_bytes)


def scatter_each(srcs: Sequence[Any], layout: PageLayout, pages: Sequence[int],
                 each_bytes: int | None = None) -> None:
    """:meth:`Copier.scatter_each` on the shared copier."""
    _copier().scatter_each(srcs, layout, pages, each_bytes)
