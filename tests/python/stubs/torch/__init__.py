"""A stand-in for the few torch names vitrify.integrations.torch uses, for CPU tests of its wiring
(test_region.py puts this directory on sys.path in a subprocess). `empty(n)` allocates through the
current pool's pluggable allocator the way torch's caching allocator asks it for a new segment;
nothing else of torch is imitated."""

import contextlib
import ctypes

__version__ = "0.0+vitrify-test-stub"
log: list = []
_pools: list = []


class OutOfMemoryError(RuntimeError):
    pass


class _PluggableAllocator:
    def __init__(self, path, malloc_name, free_name):
        self.args = (path, malloc_name, free_name)
        lib = ctypes.CDLL(path)
        self.malloc = getattr(lib, malloc_name)
        self.malloc.restype = ctypes.c_void_p
        self.malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.free = getattr(lib, free_name)
        self.free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

    def allocator(self):
        return self


class _MemPool:
    def __init__(self, allocator):
        self.allocator = allocator
        self.id = (0, len(log) + 1)


class _Memory:
    CUDAPluggableAllocator = _PluggableAllocator


class _Cuda:
    MemPool = _MemPool
    memory = _Memory

    @staticmethod
    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        log.append(("use_mem_pool", pool, device))
        _pools.append((pool, device or 0))
        try:
            yield
        finally:
            _pools.pop()

    @staticmethod
    @contextlib.contextmanager
    def graph(g, pool=None, **kwargs):
        log.append(("graph", g, pool, kwargs))
        _pools.append((pool_by_id[pool], 0))
        try:
            yield
        finally:
            _pools.pop()


pool_by_id: dict = {}
_orig_init = _MemPool.__init__


def _register(self, allocator):
    _orig_init(self, allocator)
    pool_by_id[self.id] = self


_MemPool.__init__ = _register
cuda = _Cuda


def empty(nbytes):
    """Returns the address of a new segment of `nbytes` from the current pool."""
    pool, device = _pools[-1]
    p = pool.allocator.malloc(nbytes, device, None)
    if not p:
        raise OutOfMemoryError(f"CUDA out of memory (stub): {nbytes} bytes")
    return p


def free(pool, p, nbytes):
    pool.allocator.free(p, nbytes, 0, None)
