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

from . import _check, _native
from . import config as _config
from ._units import GiB, TiB


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
    if isinstance(obj, bool) or isinstance(obj, str):
        raise _check.ArgumentTypeError(f"{what} must be a buffer or an integer address, got {_check.got(obj)}")
    if nbytes is not None:
        nbytes = _check.integer(f"{what} size (nbytes)", nbytes, 0, _check.I64_MAX)
    if isinstance(obj, int):
        if nbytes is None:
            raise ValueError(f"{what} is a raw address: pass its size in bytes too")
        _check.integer(f"{what} address", obj, 1, _check.U64_MAX)
        return obj, nbytes, None
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # a torch tensor
        if obj.device.type != "cpu":
            raise ValueError(f"{what} is a torch tensor on {obj.device}; host memory is needed")
        if not obj.is_contiguous():
            raise ValueError(f"{what} is a non-contiguous torch tensor; pass .contiguous()")
        size = obj.numel() * obj.element_size()
        return obj.data_ptr(), _clip(size, nbytes, what), obj
    try:
        mv = memoryview(obj)
    except TypeError:
        raise _check.ArgumentTypeError(f"{what} must be a buffer (bytes-like, numpy array, CPU tensor) or an "
                        f"integer address, got {_check.got(obj)}") from None
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
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _check.integer("stream", stream, 0, _check.U64_MAX)
    for attr in ("cuda_stream", "handle"):  # torch.cuda.Stream, vitrify.host.Stream
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    raise _check.ArgumentTypeError(f"stream must be an int CUstream, a torch.cuda.Stream or a vitrify Stream, "
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
    return list(_native.host_plan_slabs(
        _check.integer("total_bytes", total_bytes, 1, _check.I64_MAX),
        _check.integer("page_bytes", page_bytes, 1, _check.I64_MAX),
        _check.integer("max_slab_bytes", ceiling, 1, _check.I64_MAX),
        _check.integer("map_align", map_align, 1, TiB)))


def check_hugetlbfs_capacity(mount: str, needed: int, *, fs_magic: int, block_size: int,
                             free_blocks: int) -> None:
    """Raise if a filesystem with these statfs facts cannot hold ``needed`` bytes of slabs.

    ValueError when ``fs_magic`` is not hugetlbfs; MemoryError (needed vs free, the huge page
    size, and what to change) when the free huge pages are too few.
    """
    _native.host_check_hugetlbfs_capacity(
        _check.path("mount", mount), _check.integer("needed", needed, 0, _check.U64_MAX),
        _check.integer("fs_magic", fs_magic, 0, _check.U64_MAX),
        _check.integer("block_size", block_size, 0, _check.U64_MAX),
        _check.integer("free_blocks", free_blocks, 0, _check.U64_MAX))


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
        self._pool = None
        total_bytes = _check.integer("total_bytes", total_bytes, 1, _check.I64_MAX)
        page_bytes = _check.integer("page_bytes", page_bytes, 1, _check.I64_MAX)
        if total_bytes % page_bytes:
            raise ValueError(f"total_bytes must be a multiple of page_bytes={page_bytes} (a pool "
                             f"holds whole pages), got {total_bytes}")
        reg = {True: "on", False: "off"}.get(register, register) if isinstance(register, bool) \
            else register
        if not isinstance(reg, str) or reg not in ("auto", "on", "off"):
            raise ValueError(f"register must be 'auto', True or False, got {register!r}")
        registration_threads = _check.integer("registration_threads", registration_threads, 1,
                                              1024)
        device = _check.integer("device", device, 0, (1 << 31) - 1)
        for name, v in (("parallel", parallel), ("prefault", prefault)):
            if not isinstance(v, (bool, int)):
                raise _check.ArgumentTypeError(f"{name} must be True or False, got {_check.got(v)}")
        ceiling = default_max_slab_bytes() if max_slab_bytes is None else max_slab_bytes
        ceiling = _check.integer("max_slab_bytes", ceiling, 1, _check.I64_MAX)
        mount = "" if hugetlbfs_mount is None else _check.path("hugetlbfs_mount", hugetlbfs_mount)
        if mount and _fake_statfs is None and not os.path.isdir(mount):
            raise FileNotFoundError(2, "hugetlbfs_mount: no such directory", mount)
        self._pool = _native.HostPool(total_bytes, page_bytes, ceiling, mount,
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
    def _open(self) -> Any:
        if self._pool.closed:
            raise ValueError("the HostPool is closed")
        return self._pool

    def _slab(self, slab: Any) -> int:
        return _check.integer("slab", slab, 0, self._open().num_slabs - 1)

    def _page(self, page: Any, name: str = "page") -> int:
        return _check.integer(name, page, 0, self._open().num_pages - 1)

    def slab_address(self, slab: int) -> int:
        """Base address of slab ``slab``."""
        return self._pool.slab_address(self._slab(slab))

    def slab_of(self, page: int) -> int:
        """The slab holding ``page``."""
        return self._pool.slab_of(self._page(page))

    def page_address(self, page: int) -> int:
        """Address of page ``page`` (its ``page_bytes`` are contiguous)."""
        return self._pool.page_address(self._page(page))

    def segments(self, first_page: int, count: int = 1) -> list[Segment]:
        """Pages [first_page, first_page + count) as pieces that never straddle two slabs."""
        first_page = self._page(first_page, "first_page")
        count = _check.integer("count", count, 0, self.num_pages - first_page)
        return [Segment(*s) for s in self._pool.segments(first_page, count)]

    def slab_array(self, slab: int):
        """A numpy uint8 array over slab ``slab``'s pages, without copying."""
        return self._pool.slab_array(self._slab(slab))

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
        return self._open().transfer("h2d", _runs(runs), _stream_handle(stream), _path(path))

    def to_host(self, runs: Sequence[int] | Iterable[Sequence[int]], stream: Any = None, *,
                path: str = "auto") -> dict:
        """Enqueue copies of device memory into pool pages; the reverse of :meth:`to_device`."""
        return self._open().transfer("d2h", _runs(runs), _stream_handle(stream), _path(path))

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


def _path(path: Any) -> str:
    return _check.choice("path", path, ("auto", "batch", "loop"))


def _runs(runs) -> list[tuple[int, int, int]]:
    runs = _check.sequence("runs", runs)
    if runs and isinstance(runs[0], int):
        runs = [runs]
    out = []
    for i, r in enumerate(runs):
        if isinstance(r, (str, bytes)) or not isinstance(r, (tuple, list)) or len(r) != 3:
            raise ValueError(f"runs[{i}] must be (first_page, count, device_ptr), got {r!r}")
        out.append((_check.integer(f"runs[{i}] first_page", r[0], 0, _check.U64_MAX),
                    _check.integer(f"runs[{i}] count", r[1], 0, _check.U64_MAX),
                    _check.integer(f"runs[{i}] device_ptr", r[2], 0, _check.U64_MAX)))
    return out


class HostRegistration:
    """One ``cuMemHostRegister`` of caller memory, undone by :meth:`close`.

    Refuses (ValueError) a range above ``max_bytes`` (default: the ``VITRIFY_MAX_SLAB_GB``
    ceiling) before calling the driver. ``buffer`` is a writable buffer or an int address
    with ``nbytes``.
    """

    def __init__(self, buffer: Any, nbytes: int | None = None, *, device: int = 0,
                 max_bytes: int | None = None) -> None:
        addr, n, self._keep = _address(buffer, nbytes, True, "buffer")
        device = _check.integer("device", device, 0, (1 << 31) - 1)
        ceiling = default_max_slab_bytes() if max_bytes is None else max_bytes
        ceiling = _check.integer("max_bytes", ceiling, 1, _check.U64_MAX)
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
        self._s = _native.Stream(_check.integer("device", device, 0, (1 << 31) - 1))

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
    if not components:
        raise ValueError("components must name at least one base address, got an empty list")
    out = []
    for i, c in enumerate(components):
        if isinstance(c, int) and not isinstance(c, bool):
            out.append(_check.integer(f"components[{i}]", c, 1, _check.U64_MAX))
        elif hasattr(c, "data_ptr") and hasattr(c, "device"):
            if c.device.type != "cpu":
                raise ValueError(f"components[{i}] is a tensor on {c.device}; host memory is "
                                 f"needed")
            out.append(c.data_ptr())
        else:
            raise _check.ArgumentTypeError(f"components[{i}] must be an address (int) or a CPU tensor, got "
                            f"{_check.got(c)}")
    return out


def _model_numbers(**kw: Any) -> list[int]:
    """layers, pages, page_tokens, heads, head_dim, item_bytes: each an int >= 1."""
    return [_check.integer(name, v, 1, _check.I64_MAX) for name, v in kw.items()]


def _layout(layout: Any) -> Any:
    if not isinstance(layout, PageLayout):
        raise _check.ArgumentTypeError(f"layout must be a vitrify.host.PageLayout, got {_check.got(layout)}")
    return layout._l


def _pages(name: str, pages: Any, layout: PageLayout) -> list[int]:
    return [_check.integer(f"{name}[{i}]", p, 0, layout.pages - 1)
            for i, p in enumerate(_check.sequence(name, pages))]


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
        return cls(_native.PageLayout.layer_first(
            _component_addresses(components),
            *_model_numbers(layers=layers, pages=pages, page_tokens=page_tokens, heads=heads,
                            head_dim=head_dim, item_bytes=item_bytes)))

    @classmethod
    def page_first(cls, components: Any, *, layers: int, pages: int, page_tokens: int,
                   heads: int, head_dim: int, item_bytes: int) -> PageLayout:
        """``[page][layer][token][head][dim]`` per component."""
        return cls(_native.PageLayout.page_first(
            _component_addresses(components),
            *_model_numbers(layers=layers, pages=pages, page_tokens=page_tokens, heads=heads,
                            head_dim=head_dim, item_bytes=item_bytes)))

    @classmethod
    def strided(cls, components: Any, *, component_bytes: int, layers: int, pages: int,
                slice_bytes: int, layer_stride: int, page_stride: int) -> PageLayout:
        """Any layout: slice (layer, page) of a component is ``slice_bytes`` at
        ``base + layer * layer_stride + page * page_stride``, inside ``component_bytes``."""
        component_bytes, layers, pages, slice_bytes, layer_stride, page_stride = (
            _check.integer(name, v, 0, _check.I64_MAX) for name, v in (
                ("component_bytes", component_bytes), ("layers", layers), ("pages", pages),
                ("slice_bytes", slice_bytes), ("layer_stride", layer_stride),
                ("page_stride", page_stride)))
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
        if hasattr(tensor, "data_ptr") and hasattr(tensor, "element_size"):  # torch: elements
            if tensor.device.type != "cpu":
                raise ValueError(f"tensor is on {tensor.device}; a host tensor is needed")
            item = tensor.element_size()
            base, shape = tensor.data_ptr(), tuple(tensor.shape)
            strides = tuple(s * item for s in tensor.stride())
            nbytes = tensor.numel() * item
        elif hasattr(tensor, "ctypes") and hasattr(tensor, "strides"):  # numpy: strides in bytes
            item = tensor.itemsize
            base, shape, strides = tensor.ctypes.data, tuple(tensor.shape), tuple(tensor.strides)
            nbytes = tensor.nbytes
        else:
            raise _check.ArgumentTypeError(f"tensor must be a CPU torch tensor or a numpy array, got "
                            f"{_check.got(tensor)}")
        nd = len(shape)
        if nd == 0:
            raise ValueError("tensor must have at least one dimension (tokens), got a 0-d tensor")
        token_dim = _check.integer("token_dim", token_dim, 0, nd - 1)
        layer_dim = _check.optional_integer("layer_dim", layer_dim, 0, nd - 1)
        component_dim = _check.optional_integer("component_dim", component_dim, 0, nd - 1)
        page_tokens = _check.integer("page_tokens", page_tokens, 1, _check.I64_MAX)
        named = {"token_dim": token_dim}
        for name, d in (("layer_dim", layer_dim), ("component_dim", component_dim)):
            if d is None:
                continue
            if d >= token_dim:
                raise ValueError(f"{name}={d} must come before token_dim={token_dim}")
            for other, od in named.items():
                if od == d:
                    raise ValueError(f"{name}={d} is the same dimension as {other}={od}")
            named[name] = d
        # A dimension before token_dim that is not named would be read at index 0 only (the
        # others never gathered): refuse it unless it has size 1.
        for d in range(token_dim):
            if d not in named.values() and shape[d] != 1:
                raise ValueError(
                    f"dimension {d} of the {tuple(shape)} tensor (size {shape[d]}) is not named: "
                    f"pass it as layer_dim or component_dim (only dimensions of size 1 may be "
                    f"left out)")
        if shape[token_dim] % page_tokens:
            raise ValueError(f"page_tokens={page_tokens} must divide the {shape[token_dim]} "
                             f"tokens of dim {token_dim}")
        if shape[token_dim] == 0 or nbytes == 0:
            raise ValueError(f"tensor of shape {tuple(shape)} holds no tokens")
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
            t = _check.integer("threads", t, 1, 1024)
            if not isinstance(streaming, (bool, int)):
                raise _check.ArgumentTypeError(f"streaming must be True or False, got {_check.got(streaming)}")
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
        lay = _layout(layout)
        page = _check.integer("page", page, 0, layout.pages - 1)
        addr, cap, keep = _address(dst, capacity, True, "dst")
        self._c.gather(lay, page, addr, cap)
        del keep
        return layout.blob_bytes

    def scatter(self, src: Any, layout: PageLayout, page: int, nbytes: int | None = None) -> None:
        """Copy a blob from ``src`` back into page ``page``."""
        lay = _layout(layout)
        page = _check.integer("page", page, 0, layout.pages - 1)
        addr, n, keep = _address(src, nbytes, False, "src")
        self._c.scatter(addr, n, lay, page)
        del keep

    def gather_pages(self, layout: PageLayout, pages: Sequence[int], dst: Any,
                     stride: int | None = None, capacity: int | None = None) -> None:
        """Gather ``pages[i]`` to ``dst + i * stride`` (default stride: the blob size)."""
        lay = _layout(layout)
        pages = _pages("pages", pages, layout)
        stride = layout.blob_bytes if stride is None else _check.integer("stride", stride, 0,
                                                                          _check.I64_MAX)
        addr, cap, keep = _address(dst, capacity, True, "dst")
        self._c.gather_pages(lay, pages, addr, stride, cap)
        del keep

    def scatter_pages(self, src: Any, layout: PageLayout, pages: Sequence[int],
                      stride: int | None = None, nbytes: int | None = None) -> None:
        """Scatter blobs at ``src + i * stride`` into ``pages[i]`` (pages must be distinct)."""
        lay = _layout(layout)
        pages = _pages("pages", pages, layout)
        stride = layout.blob_bytes if stride is None else _check.integer("stride", stride, 0,
                                                                          _check.I64_MAX)
        addr, n, keep = _address(src, nbytes, False, "src")
        self._c.scatter_pages(addr, stride, n, lay, pages)
        del keep


    def gather_each(self, layout: PageLayout, pages: Sequence[int], dsts: Sequence[Any],
                    each_bytes: int | None = None) -> None:
        """Gather ``pages[i]`` into its own buffer ``dsts[i]`` (e.g. separate slot buffers,
        each an int address past its header with ``each_bytes`` given, or a writable buffer),
        all in one parallel copy."""
        lay = _layout(layout)
        pages = _pages("pages", pages, layout)
        addrs, keep = self._each(dsts, each_bytes, True, "dsts")
        if len(addrs) != len(pages):
            raise ValueError(f"pages and dsts differ in length: {len(pages)} pages, "
                             f"{len(addrs)} destinations")
        self._c.gather_each(lay, pages, [a for a, _ in addrs],
                            min(n for _, n in addrs) if addrs else 0)
        del keep

    def scatter_each(self, srcs: Sequence[Any], layout: PageLayout, pages: Sequence[int],
                     each_bytes: int | None = None) -> None:
        """Scatter the blob in ``srcs[i]`` into ``pages[i]`` (pages must be distinct)."""
        lay = _layout(layout)
        pages = _pages("pages", pages, layout)
        addrs, keep = self._each(srcs, each_bytes, False, "srcs")
        if len(addrs) != len(pages):
            raise ValueError(f"pages and srcs differ in length: {len(pages)} pages, "
                             f"{len(addrs)} sources")
        self._c.scatter_each([a for a, _ in addrs], min(n for _, n in addrs) if addrs else 0,
                             lay, pages)
        del keep

    @staticmethod
    def _each(bufs, each_bytes, writable, what):
        addrs, keep = [], []
        for i, b in enumerate(_check.sequence(what, bufs)):
            a, n, k = _address(b, each_bytes, writable, f"{what}[{i}]")
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
