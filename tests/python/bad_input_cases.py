"""The bad-input table: one case per wrong argument of a public class or function.

Each case is a function of a fresh temporary directory ``t`` that makes one call which must fail.
:func:`main` runs every case of a group in this process and prints one JSON line per case (the
exception's class hierarchy and message), announcing each case on stderr first, so a crash or a
hang in the subprocess that test_bad_input.py starts names the case that caused it.

Groups: ``cpu`` (no driver at all: validation happens before any driver call), ``fake`` (the
fake CUDA driver with one device, for objects that need a device: Region), ``host`` (the same
fake driver and device: pinned HostPool registration), ``sglang`` (the HiCache backend's settings; needs SGLang).
``nonroot`` cases rely on permissions, which do not stop root; they are skipped as root.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vitrify._units import KiB, MiB

HUGE = 1 << 70  # past every native integer


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    fn: Callable[[Path], object]
    exc: str                      # the exception class name that must be in the raised type's MRO
    needles: tuple[str, ...]      # must all appear in the message ("{t}": the case's directory)
    group: str = "cpu"
    nonroot: bool = False


CASES: dict[str, Case] = {}


def case(exc: type[BaseException], *needles: str, group: str = "cpu", nonroot: bool = False):
    def deco(fn):
        CASES[fn.__name__] = Case(fn.__name__, fn, exc.__name__, needles, group, nonroot)
        return fn
    return deco


def a_file(t: Path) -> Path:
    """A regular file: paths under it can never be created, not even by root."""
    p = t / "file"
    p.write_bytes(b"x")
    return p


def read_only_dir(t: Path) -> Path:
    p = t / "ro"
    p.mkdir()
    p.chmod(0o500)
    return p


# ---- vitrify.disk.DiskStore ------------------------------------------------------------------

def store(t: Path, **kw):
    from vitrify.disk import DiskStore

    kw.setdefault("direct_io", "off")
    return DiskStore(t / "s", 64 * KiB, kw.pop("kinds", 4096), write_threads=1, read_threads=1,
                     **kw)


def with_store(fn):
    def run(t: Path):
        with store(t) as s:
            return fn(s, t)
    run.__name__ = fn.__name__
    return run


def closed_store(t: Path):
    s = store(t)
    s.close()
    return s


@case(TypeError, "data", "str 'hello'")
@with_store
def ds_put_str_data(s, t):
    s.put("k", "hello")


@case(TypeError, "data", "int 5")
@with_store
def ds_put_int_data(s, t):
    s.put("k", 5)


@case(TypeError, "key", "int 5")
@with_store
def ds_put_int_key(s, t):
    s.put(5, b"x")


@case(ValueError, "data", "5000 bytes", "4096")
@with_store
def ds_put_too_big(s, t):
    s.put("k", b"x" * 5000)


@case(TypeError, "keys", "str 'ab'")
@with_store
def ds_batch_put_keys_as_str(s, t):
    s.batch_put("ab", [b"1", b"2"])


@case(ValueError, "keys", "datas", "1 keys", "2 payloads")
@with_store
def ds_batch_put_lengths_differ(s, t):
    s.batch_put(["a"], [b"1", b"2"])


@case(TypeError, "datas", "NoneType")
@with_store
def ds_batch_put_datas_none(s, t):
    s.batch_put(["a"], None)


@case(ValueError, "datas[1]", "not C-contiguous")
@with_store
def ds_batch_put_noncontiguous(s, t):
    s.batch_put(["a", "b"], [b"1", np.zeros((4, 4), np.uint8)[:, ::2]])


@case(ValueError, "out", "read-only")
@with_store
def ds_get_into_read_only(s, t):
    s.get_into("k", b"abc")


@case(TypeError, "out", "str")
@with_store
def ds_get_into_str(s, t):
    s.get_into("k", "abc")


@case(ValueError, "out", "10 bytes", "smaller", "4096 bytes")
@with_store
def ds_get_into_too_small(s, t):
    assert s.put("k", b"x" * 4096)
    s.get_into("k", bytearray(10))


@case(ValueError, "outs[1]", "10 bytes", "smaller", "4096 bytes")
@with_store
def ds_batch_get_into_too_small(s, t):
    assert s.put("k", b"x" * 4096)
    s.batch_get_into(["absent", "k"], [bytearray(10), bytearray(10)])


@case(ValueError, "budget_bytes=65536", "kind 'b'", "slot")
def ds_budget_starves_a_kind(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 64 * KiB, {"a": (4096, 100.0), "b": (4096, 1.0)}, direct_io="off")


@case(TypeError, "kind", "float 1.5")
@with_store
def ds_kind_float(s, t):
    s.get("k", kind=1.5)


@case(ValueError, "kind", "'nope'", "['default']")
@with_store
def ds_kind_unknown(s, t):
    s.get("k", kind="nope")


@case(ValueError, "kind", "3")
@with_store
def ds_kind_index_out_of_range(s, t):
    s.exists("k", kind=3)


@case(ValueError, "drive", "-1", "[0, 0]")
@with_store
def ds_slab_path_negative_drive(s, t):
    s.slab_path(drive=-1)


@case(TypeError, "buffers[0]", "SlotBuffer", "bytearray")
@with_store
def ds_put_buffers_not_slot_buffers(s, t):
    s.put_buffers(["a"], [bytearray(10)], [1])


@case(ValueError, "sizes[0]", "1000000")
@with_store
def ds_put_buffers_size_past_capacity(s, t):
    s.put_buffers(["a"], [s.buffer()], [10 ** 6])


@case(ValueError, "sizes[0]", "-1")
@with_store
def ds_put_buffers_negative_size(s, t):
    s.put_buffers(["a"], [s.buffer()], [-1])


@case(TypeError, "buffers", "int")
@with_store
def ds_get_buffers_not_a_list(s, t):
    s.get_buffers(["a"], 7)


@case(TypeError, "budget_bytes", "str '1'")
def ds_budget_str(t):
    from vitrify.disk import DiskStore
    DiskStore(t, "1", 4096)


@case(ValueError, "budget_bytes", "-1")
def ds_budget_negative(t):
    from vitrify.disk import DiskStore
    DiskStore(t, -1, 4096)


@case(ValueError, "budget_bytes", "got 0")
def ds_budget_zero(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 0, 4096)


@case(ValueError, "budget_bytes", str(HUGE))
def ds_budget_huge(t):
    from vitrify.disk import DiskStore
    DiskStore(t, HUGE, 4096)


@case(ValueError, "budget", "slot")
def ds_budget_below_one_slot(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1, 4096, direct_io="off")


@case(ValueError, "kinds", str(HUGE))
def ds_page_size_huge(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, HUGE)


@case(ValueError, "kinds", "got 0")
def ds_page_size_zero(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, 0)


@case(TypeError, "kinds", "str '4096'")
def ds_kinds_str(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, "4096")


@case(ValueError, "kinds['a'] share", "nan")
def ds_kind_share_nan(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, {"a": (4096, float("nan"))})


@case(ValueError, "kinds['a'] page_bytes", "-4096")
def ds_kind_page_negative(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, {"a": -4096})


@case(TypeError, "dirs", "int 5")
def ds_dirs_int(t):
    from vitrify.disk import DiskStore
    DiskStore(5, 1 << 24, 4096)


@case(ValueError, "dirs", "empty")
def ds_dirs_empty(t):
    from vitrify.disk import DiskStore
    DiskStore([], 1 << 24, 4096)


@case(TypeError, "dirs[0]", "bytes")
def ds_dirs_bytes(t):
    from vitrify.disk import DiskStore
    DiskStore([b"/tmp"], 1 << 24, 4096)


@case(NotADirectoryError, "dirs[0]", "{t}/file/store")
def ds_dir_under_a_file(t):
    from vitrify.disk import DiskStore
    DiskStore(a_file(t) / "store", 1 << 24, 4096)


@case(PermissionError, "dirs[0]", "{t}/ro/store", nonroot=True)
def ds_dir_in_read_only_dir(t):
    from vitrify.disk import DiskStore
    DiskStore(read_only_dir(t) / "store", 1 << 24, 4096)


@case(ValueError, "write_threads", "got 0")
def ds_write_threads_zero(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, 4096, write_threads=0)


@case(ValueError, "read_threads", str(1 << 40))
def ds_read_threads_huge(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, 4096, read_threads=1 << 40)


@case(TypeError, "queue_capacity", "float")
def ds_queue_capacity_float(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, 4096, queue_capacity=2.5)


@case(TypeError, "gc_high", "str 'a'")
def ds_gc_high_str(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, 4096, gc_high="a")


@case(ValueError, "gc_low", "gc_high")
def ds_gc_low_above_high(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, 4096, gc_low=0.95)


@case(ValueError, "cold_start", "'warm'")
def ds_cold_start(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, 4096, cold_start="warm")


@case(TypeError, "direct_io", "int 1")
def ds_direct_io_int(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, 4096, direct_io=1)


@case(ValueError, "name", "'a/b'")
def ds_name_with_slash(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, 4096, name="a/b")


@case(ValueError, "load_threads", "257")
def ds_load_threads(t):
    from vitrify.disk import DiskStore
    DiskStore(t, 1 << 24, 4096, load_threads=257)


@case(ValueError, "closed DiskStore")
def ds_closed_put(t):
    closed_store(t).put("k", b"x")


@case(ValueError, "closed DiskStore")
def ds_closed_get(t):
    closed_store(t).get("k")


@case(ValueError, "closed DiskStore")
def ds_closed_stats(t):
    closed_store(t).stats()


@case(ValueError, "closed DiskStore")
def ds_closed_clear(t):
    closed_store(t).clear()


@case(ValueError, "closed DiskStore")
def ds_closed_buffer(t):
    closed_store(t).buffer()


@case(ValueError, "page_bytes", "-1")
def ds_slot_bytes_for_negative(t):
    from vitrify.disk import slot_bytes_for
    slot_bytes_for(-1)


@case(TypeError, "key", "float")
def ds_make_key_float(t):
    from vitrify.disk import make_key
    make_key(1.0)


# ---- vitrify.disk.PageMover ------------------------------------------------------------------

def mover_layout(blob_pages: int = 1):
    """A layer_first layout over 4 pages of numpy memory whose gathered page is 2 KiB times
    ``blob_pages`` (the memory rides on the layout object so it outlives the call)."""
    from vitrify.host import PageLayout
    mem = np.zeros(2 * 4 * 1024 * blob_pages, np.uint8)
    lay = PageLayout.layer_first([mem.ctypes.data], layers=2, pages=4, page_tokens=1, heads=1,
                                 head_dim=1024 * blob_pages, item_bytes=1)
    return lay, mem


@case(ValueError, "chunk", "0")
@with_store
def pm_chunk_zero(s, t):
    from vitrify.disk import PageMover
    PageMover(s, 0)


@case(TypeError, "store", "str")
def pm_store_not_a_store(t):
    from vitrify.disk import PageMover
    PageMover("store", 2)


@case(TypeError, "copier", "int")
@with_store
def pm_copier_int(s, t):
    from vitrify.disk import PageMover
    PageMover(s, 2, copier=3)


@case(TypeError, "layout", "str")
@with_store
def pm_layout_str(s, t):
    from vitrify.disk import PageMover
    PageMover(s, 2).put_pages(["a"], "layout", [0])


@case(ValueError, "pages[1]", "4")
@with_store
def pm_page_out_of_range(s, t):
    from vitrify.disk import PageMover
    lay, _mem = mover_layout()
    PageMover(s, 2).put_pages(["a", "b"], lay, [0, 4])


@case(ValueError, "keys and pages differ", "2 keys", "1 pages")
@with_store
def pm_keys_pages_differ(s, t):
    from vitrify.disk import PageMover
    lay, _mem = mover_layout()
    PageMover(s, 2).get_pages(["a", "b"], lay, [0])


@case(ValueError, "layout pages of 8192 bytes", "4096-byte pages")
@with_store
def pm_layout_page_too_big(s, t):
    from vitrify.disk import PageMover
    lay, _mem = mover_layout(blob_pages=4)
    PageMover(s, 2).put_pages(["a"], lay, [0])


@case(ValueError, "closed DiskStore")
def pm_closed_store(t):
    from vitrify.disk import PageMover
    s = store(t)
    m = PageMover(s, 2)
    s.close()
    lay, _mem = mover_layout()
    m.get_pages(["a"], lay, [0])


# ---- vitrify.host: HostPool, layouts, gather/scatter -----------------------------------------

def pool(**kw):
    from vitrify.host import HostPool

    kw.setdefault("register", False)
    return HostPool(8 * KiB, 4 * KiB, **kw)


def closed_pool():
    p = pool()
    p.close()
    return p


@case(ValueError, "total_bytes", "-4096")
def hp_total_negative(t):
    from vitrify.host import HostPool
    HostPool(-4096, 4096)


@case(TypeError, "total_bytes", "str 'a'")
def hp_total_str(t):
    from vitrify.host import HostPool
    HostPool("a", 4096)


@case(ValueError, "total_bytes", "got 0")
def hp_total_zero(t):
    from vitrify.host import HostPool
    HostPool(0, 4096)


@case(ValueError, "total_bytes", str(HUGE))
def hp_total_huge(t):
    from vitrify.host import HostPool
    HostPool(HUGE, 4096)


@case(ValueError, "page_bytes", "got 0")
def hp_page_zero(t):
    from vitrify.host import HostPool
    HostPool(4096, 0)


@case(ValueError, "total_bytes", "page_bytes=4096", "5000")
def hp_not_whole_pages(t):
    from vitrify.host import HostPool
    HostPool(5000, 4096, register=False)


@case(ValueError, "register", "'maybe'")
def hp_register(t):
    pool(register="maybe")


@case(ValueError, "registration_threads", "got 0")
def hp_registration_threads_zero(t):
    pool(registration_threads=0)


@case(TypeError, "registration_threads", "str")
def hp_registration_threads_str(t):
    pool(registration_threads="8")


@case(ValueError, "device", "-1")
def hp_device_negative(t):
    pool(device=-1)


@case(ValueError, "max_slab_bytes", "got 0")
def hp_max_slab_zero(t):
    pool(max_slab_bytes=0)


@case(TypeError, "parallel", "str")
def hp_parallel_str(t):
    pool(parallel="yes")


@case(FileNotFoundError, "hugetlbfs_mount", "{t}/missing")
def hp_hugetlbfs_missing(t):
    pool(hugetlbfs_mount=t / "missing")


@case(ValueError, "hugetlbfs_mount", "{t}", "not a hugetlbfs mount")
def hp_hugetlbfs_not_hugetlbfs(t):
    from vitrify.host import HostPool
    HostPool(2 * MiB, 2 * MiB, hugetlbfs_mount=t, register=False)


@case(ValueError, "page", "100", "[0, 1]")
def hp_page_address_past_end(t):
    with pool() as p:
        p.page_address(100)


@case(ValueError, "page", "-1")
def hp_page_address_negative(t):
    with pool() as p:
        p.page_address(-1)


@case(ValueError, "count", "-1")
def hp_segments_negative_count(t):
    with pool() as p:
        p.segments(0, -1)


@case(ValueError, "slab", "9")
def hp_slab_array_past_end(t):
    with pool() as p:
        p.slab_array(9)


@case(TypeError, "runs", "str")
def hp_to_device_runs_str(t):
    with pool() as p:
        p.to_device("abc")


@case(ValueError, "runs[0]", "(first_page, count, device_ptr)")
def hp_to_device_run_of_two(t):
    with pool() as p:
        p.to_device([(0, 1)])


@case(ValueError, "runs[0] count", "-1")
def hp_to_device_negative_count(t):
    with pool() as p:
        p.to_device([(0, -1, 4096)])


@case(ValueError, "path", "'fast'")
def hp_to_device_path(t):
    with pool() as p:
        p.to_device((0, 1, 4096), path="fast")


@case(TypeError, "stream", "str")
def hp_to_device_stream_str(t):
    with pool() as p:
        p.to_device((0, 1, 4096), stream="s")


@case(ValueError, "HostPool is closed")
def hp_closed_page_address(t):
    closed_pool().page_address(0)


@case(ValueError, "HostPool is closed")
def hp_closed_slabs(t):
    closed_pool().slabs()


@case(ValueError, "HostPool is closed")
def hp_closed_slab_array(t):
    closed_pool().slab_array(0)


@case(ValueError, "HostPool is closed")
def hp_closed_to_host(t):
    closed_pool().to_host((0, 1, 4096))


@case(ValueError, "total_bytes", "-1")
def hp_plan_slabs_negative(t):
    from vitrify.host import plan_slabs
    plan_slabs(-1, 4096)


@case(ValueError, "map_align", "got 0")
def hp_plan_slabs_map_align_zero(t):
    from vitrify.host import plan_slabs
    plan_slabs(8192, 4096, 1 << 20, 0)


@case(ValueError, "needed", "-1")
def hp_check_hugetlbfs_negative(t):
    from vitrify.host import check_hugetlbfs_capacity
    check_hugetlbfs_capacity("/x", -1, fs_magic=0, block_size=0, free_blocks=0)


@case(TypeError, "buffer", "str 'abc'")
def hr_buffer_str(t):
    from vitrify.host import HostRegistration
    HostRegistration("abc")


@case(ValueError, "buffer", "size")
def hr_address_without_size(t):
    from vitrify.host import HostRegistration
    HostRegistration(0x1000)


@case(ValueError, "buffer", "read-only")
def hr_read_only_buffer(t):
    from vitrify.host import HostRegistration
    HostRegistration(bytes(4096))


@case(ValueError, "nbytes", "-1")
def hr_negative_nbytes(t):
    from vitrify.host import HostRegistration
    HostRegistration(bytearray(4096), -1)


@case(TypeError, "device", "str 'a'")
def st_device_str(t):
    from vitrify.host import Stream
    Stream("a")


@case(ValueError, "threads", "got 0")
def cp_threads_zero(t):
    from vitrify.host import Copier
    Copier(0)


@case(TypeError, "threads", "str")
def cp_threads_str(t):
    from vitrify.host import Copier
    Copier("4")


KV = (2, 3, 16, 2, 8)  # K/V, layers, tokens, heads, dim


@case(ValueError, "dimension 1", "size 3", "layer_dim")
def pl_unnamed_dimension_numpy(t):
    from vitrify.host import PageLayout
    PageLayout.from_tensor(np.zeros(KV, np.float32), component_dim=0, token_dim=2, page_tokens=4)


@case(ValueError, "dimension 1", "size 3")
def pl_unnamed_dimension_torch(t):
    import torch

    from vitrify.host import PageLayout
    PageLayout.from_tensor(torch.zeros(KV), component_dim=0, token_dim=2, page_tokens=4)


@case(ValueError, "dimension 0", "size 2", "component_dim")
def pl_unnamed_component_dimension(t):
    from vitrify.host import PageLayout
    PageLayout.from_tensor(np.zeros(KV, np.float32), layer_dim=1, token_dim=2, page_tokens=4)


@case(ValueError, "layer_dim=0", "component_dim=0")
def pl_same_dimension_twice(t):
    from vitrify.host import PageLayout
    PageLayout.from_tensor(np.zeros(KV, np.float32), component_dim=0, layer_dim=0, token_dim=2,
                           page_tokens=4)


@case(TypeError, "tensor", "str")
def pl_from_tensor_str(t):
    from vitrify.host import PageLayout
    PageLayout.from_tensor("abc", token_dim=0, page_tokens=1)


@case(ValueError, "token_dim", "9")
def pl_token_dim_past_end(t):
    from vitrify.host import PageLayout
    PageLayout.from_tensor(np.zeros(KV, np.float32), component_dim=0, layer_dim=1, token_dim=9,
                           page_tokens=4)


@case(ValueError, "page_tokens", "got 0")
def pl_page_tokens_zero(t):
    from vitrify.host import PageLayout
    PageLayout.from_tensor(np.zeros(KV, np.float32), component_dim=0, layer_dim=1, token_dim=2,
                           page_tokens=0)


@case(ValueError, "page_tokens=5", "16")
def pl_page_tokens_not_dividing(t):
    from vitrify.host import PageLayout
    PageLayout.from_tensor(np.zeros(KV, np.float32), component_dim=0, layer_dim=1, token_dim=2,
                           page_tokens=5)


LAYER_FIRST = dict(layers=2, pages=4, page_tokens=1, heads=1, head_dim=64, item_bytes=1)


@case(ValueError, "components", "empty")
def pl_no_components(t):
    from vitrify.host import PageLayout
    PageLayout.layer_first([], **LAYER_FIRST)


@case(TypeError, "components[0]", "str")
def pl_component_str(t):
    from vitrify.host import PageLayout
    PageLayout.layer_first(["a"], **LAYER_FIRST)


@case(ValueError, "components[0]", "got 0")
def pl_component_null(t):
    from vitrify.host import PageLayout
    PageLayout.layer_first([0], **LAYER_FIRST)


@case(ValueError, "layers", "got 0")
def pl_layers_zero(t):
    from vitrify.host import PageLayout
    PageLayout.layer_first([4096], **dict(LAYER_FIRST, layers=0))


@case(ValueError, "heads", "-1")
def pl_heads_negative(t):
    from vitrify.host import PageLayout
    PageLayout.layer_first([4096], **dict(LAYER_FIRST, heads=-1))


@case(ValueError, "item_bytes", str(HUGE))
def pl_item_bytes_huge(t):
    from vitrify.host import PageLayout
    PageLayout.page_first([4096], **dict(LAYER_FIRST, item_bytes=HUGE))


@case(TypeError, "component_bytes", "str 'a'")
def pl_strided_str(t):
    from vitrify.host import PageLayout
    PageLayout.strided([4096], component_bytes="a", layers=1, pages=1, slice_bytes=1,
                       layer_stride=0, page_stride=1)


def layout():
    from vitrify.host import PageLayout

    mem = np.zeros(2 * 4 * 64, np.uint8)
    return PageLayout.layer_first(mem.ctypes.data, **LAYER_FIRST), mem


@case(ValueError, "page", "99", "[0, 3]")
def ga_page_past_end(t):
    from vitrify import host
    lay, mem = layout()
    host.gather(lay, 99, bytearray(lay.blob_bytes))


@case(TypeError, "dst", "str 'abc'")
def ga_dst_str(t):
    from vitrify import host
    lay, mem = layout()
    host.gather(lay, 0, "abc")


@case(ValueError, "dst", "read-only")
def ga_dst_read_only(t):
    from vitrify import host
    lay, mem = layout()
    host.gather(lay, 0, bytes(lay.blob_bytes))


@case(TypeError, "layout", "str")
def ga_layout_str(t):
    from vitrify import host
    host.gather("layout", 0, bytearray(128))


@case(TypeError, "pages", "str")
def ga_pages_str(t):
    from vitrify import host
    lay, mem = layout()
    host.gather_pages(lay, "01", bytearray(4 * lay.blob_bytes))


@case(ValueError, "pages", "dsts", "2 pages", "1 destinations")
def ga_each_lengths_differ(t):
    from vitrify import host
    lay, mem = layout()
    host.gather_each(lay, [0, 1], [bytearray(lay.blob_bytes)])


@case(ValueError, "src", "size")
def sc_src_address_without_size(t):
    from vitrify import host
    lay, mem = layout()
    host.scatter(0x1000, lay, 0)


@case(ValueError, "stride", "-1")
def sc_negative_stride(t):
    from vitrify import host
    lay, mem = layout()
    host.scatter_pages(bytes(lay.blob_bytes), lay, [0], stride=-1)


# ---- vitrify.snapshot ------------------------------------------------------------------------

def backend():
    from vitrify.snapshot import HostBackend

    return HostBackend(4 * MiB)


@case(TypeError, "intervals", "str")
def sn_merge_str(t):
    from vitrify import snapshot
    snapshot.merge("ab")


@case(ValueError, "intervals[0] begin", "-1")
def sn_merge_negative(t):
    from vitrify import snapshot
    snapshot.merge([(-1, 5)])


@case(TypeError, "intervals[0]", "(begin, end)")
def sn_merge_triple(t):
    from vitrify import snapshot
    snapshot.merge([(1, 2, 3)])


@case(ValueError, "intervals[0] end", str(HUGE))
def sn_total_bytes_huge(t):
    from vitrify import snapshot
    snapshot.total_bytes([(0, HUGE)])


@case(ValueError, "ceiling", "-1")
def sn_clamp_negative(t):
    from vitrify import snapshot
    snapshot.clamp([(0, 1)], -1)


@case(ValueError, "granularity", "got 0")
def sn_split_aligned_zero(t):
    from vitrify import snapshot
    snapshot.split_aligned(0, 0, 10, 0)


@case(TypeError, "base", "str 'a'")
def sn_dump_base_str(t):
    from vitrify import snapshot
    snapshot.dump("a", 0, 1, target=backend())


@case(ValueError, "start", "end")
def sn_dump_start_past_end(t):
    from vitrify import snapshot
    b = backend()
    snapshot.dump(b.base, 10, 5, target=b)


@case(TypeError, "target", "str 'gpu0'")
def sn_dump_target_str(t):
    from vitrify import snapshot
    snapshot.dump(4096, 0, 5, target="gpu0")


@case(ValueError, "target", "-1")
def sn_dump_target_negative(t):
    from vitrify import snapshot
    snapshot.dump(4096, 0, 5, target=-1)


@case(ValueError, "granularity", "got 0")
def sn_dump_granularity_zero(t):
    from vitrify import snapshot
    b = backend()
    snapshot.dump(b.base, 0, 5, target=b, granularity=0)


@case(TypeError, "snapshot", "str 'x'")
def sn_restore_not_a_snapshot(t):
    from vitrify import snapshot
    snapshot.restore("x", 0, 10)


@case(ValueError, "ceiling", "-1")
def sn_restore_negative_ceiling(t):
    from vitrify import snapshot
    b = backend()
    snapshot.restore(snapshot.dump(b.base, 0, 4096, target=b), b.base, -1, target=b)


@case(FileNotFoundError, "path", "{t}/missing")
def sn_dump_to_file_missing_dir(t):
    from vitrify import snapshot
    b = backend()
    snapshot.dump_to_file(t / "missing" / "x.span", b.base, 0, 4096, target=b, direct_io="off")


@case(NotADirectoryError, "path", "{t}/file")
def sn_dump_to_file_under_a_file(t):
    from vitrify import snapshot
    b = backend()
    snapshot.dump_to_file(a_file(t) / "x.span", b.base, 0, 4096, target=b, direct_io="off")


@case(PermissionError, "{t}/ro/x.span", nonroot=True)
def sn_dump_to_file_read_only_dir(t):
    from vitrify import snapshot
    b = backend()
    snapshot.dump_to_file(read_only_dir(t) / "x.span", b.base, 0, 4096, target=b,
                          direct_io="off")


@case(ValueError, "chunk_bytes", "got 0")
def sn_dump_to_file_chunk_zero(t):
    from vitrify import snapshot
    b = backend()
    snapshot.dump_to_file(t / "x.span", b.base, 0, 4096, target=b, chunk_bytes=0)


@case(TypeError, "progress", "int")
def sn_dump_to_file_progress_not_callable(t):
    from vitrify import snapshot
    b = backend()
    snapshot.dump_to_file(t / "x.span", b.base, 0, 4096, target=b, progress=5)


@case(ValueError, "direct_io", "'sometimes'")
def sn_dump_to_file_direct_io(t):
    from vitrify import snapshot
    b = backend()
    snapshot.dump_to_file(t / "x.span", b.base, 0, 4096, target=b, direct_io="sometimes")


@case(FileNotFoundError, "path", "{t}/none.span")
def sn_restore_from_missing_file(t):
    from vitrify import snapshot
    b = backend()
    snapshot.restore_from_file(t / "none.span", b.base, 4096, target=b)


@case(TypeError, "path", "int 5")
def sn_file_info_int(t):
    from vitrify import snapshot
    snapshot.file_info(5)


@case(IsADirectoryError, "path", "{t}")
def sn_file_info_directory(t):
    from vitrify import snapshot
    snapshot.file_info(t)


@case(FileNotFoundError, "path", "{t}/none.span")
def sn_verify_missing_file(t):
    from vitrify import snapshot
    snapshot.verify_file(t / "none.span")


@case(ValueError, "size", "got 0")
def sn_host_backend_zero(t):
    from vitrify.snapshot import HostBackend
    HostBackend(0)


@case(TypeError, "archive", "str")
def sn_plan_restore_not_an_archive(t):
    from vitrify import snapshot
    snapshot.plan_restore(str(t), 0)


@case(ValueError, "size", "got 0")
def sn_scratch_span_size_zero(t):
    from vitrify.snapshot import ScratchSpan
    ScratchSpan(0, 0, 0, [])


@case(TypeError, "mapped", "str")
def sn_scratch_span_mapped_str(t):
    from vitrify.snapshot import ScratchSpan
    ScratchSpan(0, 2 * MiB, 0, "1")


@case(ValueError, "rank", "-1")
def sn_span_relpath_negative_rank(t):
    from vitrify import snapshot
    snapshot.span_relpath(-1)


# ---- vitrify.archive -------------------------------------------------------------------------

def writer(t: Path, name: str = "a", **kw):
    from vitrify import archive

    return archive.ArchiveWriter(t / name, archive.Fingerprint(model="m"),
                                 archive.Region(0, 0, 1), **kw)


def an_archive(t: Path):
    from vitrify import archive

    w = writer(t)
    w.write_state(0, {"x": 1})
    return archive.open_archive(w.commit())


@case(FileNotFoundError, "no archive directory", "{t}/none")
def ar_open_missing(t):
    from vitrify import archive
    archive.open_archive(t / "none")


@case(TypeError, "path", "int 5")
def ar_open_int(t):
    from vitrify import archive
    archive.open_archive(5)


@case(TypeError, "checksums", "str")
def ar_open_checksums_str(t):
    from vitrify import archive
    archive.open_archive(t, checksums="yes")


@case(TypeError, "expect", "int 5")
def ar_open_expect_int(t):
    from vitrify import archive
    archive.open_archive(an_archive(t).path, expect=5)


@case(TypeError, "expect", "int 5")
def ar_open_or_cold_expect_int(t):
    from vitrify import archive
    archive.open_or_cold(t / "none", expect=5)


@case(TypeError, "path", "NoneType")
def ar_verify_none(t):
    from vitrify import archive
    archive.verify(None)


@case(FileNotFoundError, "path", "{t}/none")
def ar_file_checksum_missing(t):
    from vitrify import archive
    archive.file_checksum(t / "none")


@case(FileNotFoundError, "path", "{t}/none")
def ar_writer_parent_missing(t):
    writer(t / "none")


@case(NotADirectoryError, "path", "{t}/file")
def ar_writer_under_a_file(t):
    writer(a_file(t))


@case(PermissionError, "path", "{t}/ro", nonroot=True)
def ar_writer_read_only_parent(t):
    writer(read_only_dir(t))


@case(FileExistsError, "path", "overwrite=True", "{t}/a")
def ar_writer_exists(t):
    an_archive(t)
    writer(t)


@case(TypeError, "fingerprint", "dict")
def ar_writer_fingerprint_dict(t):
    from vitrify import archive
    archive.ArchiveWriter(t / "a", {"model": "m"}, archive.Region(0, 0, 1))


@case(TypeError, "region", "tuple")
def ar_writer_region_tuple(t):
    from vitrify import archive
    archive.ArchiveWriter(t / "a", archive.Fingerprint(), (0, 0, 1))


@case(ValueError, "region.base", "-1")
def ar_writer_region_negative(t):
    from vitrify import archive
    archive.ArchiveWriter(t / "a", archive.Fingerprint(), archive.Region(-1, 0, 1))


@case(TypeError, "overwrite", "str")
def ar_writer_overwrite_str(t):
    writer(t, overwrite="yes")


@case(ValueError, "already committed or aborted")
def ar_writer_closed(t):
    w = writer(t)
    w.commit()
    w.write_bytes("rank0/x", b"1")


@case(TypeError, "rank", "str 'a'")
def ar_write_state_rank_str(t):
    with writer(t) as w:
        w.write_state("a", {})


@case(TypeError, "state", "not plain JSON")
def ar_write_state_not_json(t):
    with writer(t) as w:
        w.write_state(0, {"x": object()})


@case(TypeError, "data", "str")
def ar_write_bytes_str(t):
    with writer(t) as w:
        w.write_bytes("rank0/x", "text")


@case(ValueError, "'../x'")
def ar_file_path_escapes(t):
    with writer(t) as w:
        w.file_path("../x")


@case(ValueError, "span name", "5")
def ar_dump_span_name_int(t):
    with writer(t) as w:
        w.dump_span(0, 5, 4096, 0, 4096)


@case(ValueError, "rank", "-1")
def ar_rank_writer_negative(t):
    from vitrify import archive
    w = writer(t)
    try:
        archive.RankWriter(w.temp_path, -1)
    finally:
        w.abort()


@case(TypeError, "rank", "str 'a'")
def ar_state_rank_str(t):
    an_archive(t).state("a")


@case(ValueError, "offset", "-1")
def ar_check_checkpoint_negative(t):
    an_archive(t).check_checkpoint("weights", -1)


@case(ValueError, "device", "-1")
def ar_fingerprint_device_negative(t):
    from vitrify import archive
    archive.Fingerprint.current(device=-1)


# ---- vitrify.graph (argument validation) ----------------------------------------------------

@case(ValueError, "region_base", "-1")
def gr_store_base_negative(t):
    from vitrify import graph
    graph.GraphStore(region_base=-1)


@case(TypeError, "region_base", "str")
def gr_store_base_str(t):
    from vitrify import graph
    graph.GraphStore(region_base="a")


@case(ValueError, "region_size", str(HUGE))
def gr_store_size_huge(t):
    from vitrify import graph
    graph.GraphStore(region_size=HUGE)


@case(ValueError, "device", "-1")
def gr_store_device_negative(t):
    from vitrify import graph
    graph.GraphStore(device=-1)


@case(TypeError, "data", "str")
def gr_add_str(t):
    from vitrify import graph
    graph.GraphStore().add("g", "not bytes")


@case(ValueError, "graph name", "''")
def gr_add_empty_name(t):
    from vitrify import graph
    graph.GraphStore().add("", b"x")


@case(ValueError, "handle", "-1")
def gr_add_cuda_graph_negative_handle(t):
    from vitrify import graph
    graph.GraphStore().add_cuda_graph("g", -1)


@case(KeyError, "no graph 'nope'")
def gr_info_unknown(t):
    from vitrify import graph
    graph.GraphStore().info("nope")


@case(ValueError, "capture_error_mode", "'loud'")
def gr_capture_mode(t):
    from vitrify import graph
    graph.GraphStore().capture("g", capture_error_mode="loud")


@case(TypeError, "data", "str")
def gr_describe_str(t):
    from vitrify import graph
    graph.describe("abc")


@case(TypeError, "extra_paths", "str")
def gr_record_modules_str(t):
    from vitrify import graph
    graph.record_modules("/usr/lib")


@case(FileNotFoundError, "no graph index", "{t}/none")
def gr_load_missing(t):
    from vitrify import graph
    graph.load(t / "none")


@case(ValueError, "threads", "got 0")
def gr_load_threads_zero(t):
    from vitrify import graph
    graph.load(t, threads=0)


@case(TypeError, "names", "str")
def gr_load_names_str(t):
    from vitrify import graph
    graph.load(t, names="g")


@case(ValueError, "device", "-1")
def gr_load_device_negative(t):
    from vitrify import graph
    graph.load(t, device=-1)


@case(TypeError, "directory", "int 5")
def gr_read_index_int(t):
    from vitrify import graph
    graph.read_index(5)


@case(NotADirectoryError, "directory", "{t}/file")
def gr_save_under_a_file(t):
    from vitrify import graph
    graph.GraphStore().save(a_file(t) / "rank0")


@case(TypeError, "writer", "str")
def gr_save_to_archive_bad_writer(t):
    from vitrify import graph
    graph.GraphStore().save_to_archive("writer")


@case(TypeError, "archive", "str")
def gr_load_from_archive_bad_archive(t):
    from vitrify import graph
    graph.load_from_archive(str(t))


def closed_graphs():
    from vitrify import graph

    g = graph.LoadedGraphs({}, object(), {"g": 0})
    g.close()
    return g


@case(ValueError, "closed")
def gr_closed_wait_all(t):
    closed_graphs().wait_all()


@case(ValueError, "closed")
def gr_closed_replay(t):
    closed_graphs().replay("g")


@case(ValueError, "closed")
def gr_closed_stats(t):
    closed_graphs().stats()


# ---- vitrify.Region --------------------------------------------------------------------------

@case(TypeError, "size", "str 'a'")
def rg_size_str(t):
    import vitrify
    vitrify.Region("a")


@case(ValueError, "size", "got 0")
def rg_size_zero(t):
    import vitrify
    vitrify.Region(0)


@case(ValueError, "size", str(HUGE))
def rg_size_huge(t):
    import vitrify
    vitrify.Region(HUGE)


@case(ValueError, "base", "-4096")
def rg_base_negative(t):
    import vitrify
    vitrify.Region(1 << 30, base=-4096)


@case(ValueError, "device", str(1 << 40))
def rg_device_huge(t):
    import vitrify
    vitrify.Region(1 << 30, device=1 << 40)


@case(ValueError, "size", "got 0")
def rg_candidate_bases_zero(t):
    from vitrify.region import candidate_bases
    candidate_bases(0)


def region():
    import vitrify

    return vitrify.Region(1 << 30)


def closed_region():
    r = region()
    r.close()
    return r


@case(TypeError, "nbytes", "str 'a'", group="fake")
def rg_allocate_str(t):
    with region() as r:
        r.allocate("a")


@case(ValueError, "nbytes", "got 0", group="fake")
def rg_allocate_zero(t):
    with region() as r:
        r.allocate(0)


@case(ValueError, "nbytes", str(HUGE), group="fake")
def rg_allocate_huge(t):
    with region() as r:
        r.allocate(HUGE)


@case(MemoryError, "region full", group="fake")
def rg_allocate_more_than_the_region(t):
    with region() as r:
        r.allocate(1 << 40)


@case(ValueError, "ptr", "-1", group="fake")
def rg_free_negative(t):
    with region() as r:
        r.free(-1)


@case(TypeError, "data", "str 'abc'", group="fake")
def rg_write_str(t):
    with region() as r:
        r.write(r.allocate(4096), "abc")


@case(TypeError, "data", "int 5", group="fake")
def rg_write_int(t):
    with region() as r:
        r.write(r.allocate(4096), 5)


@case(ValueError, "nbytes", "got 0", group="fake")
def rg_read_zero(t):
    with region() as r:
        r.read(r.allocate(4096), 0)


@case(TypeError, "checkpoint name", "int 5", group="fake")
def rg_checkpoint_int(t):
    with region() as r:
        r.checkpoint(5)


@case(ValueError, "offset", "-1", group="fake")
def rg_set_offset_negative(t):
    with region() as r:
        r.set_offset(-1)


@case(ValueError, "chunk_bytes", "got 0", group="fake")
def rg_preallocate_chunk_zero(t):
    with region() as r:
        r.preallocate(1 << 21, chunk_bytes=0)


@case(ValueError, "device", "5", group="fake")
def rg_device_not_present(t):
    import vitrify
    vitrify.Region(1 << 30, device=5)


@case(RuntimeError, "closed", group="fake")
def rg_closed_allocate(t):
    closed_region().allocate(4096)


@case(RuntimeError, "closed", group="fake")
def rg_closed_checkpoint(t):
    closed_region().checkpoint("x")


@case(RuntimeError, "closed", group="fake")
def rg_closed_read(t):
    closed_region().read(1 << 40, 1)


@case(TypeError, "region", "str")
def ti_activated_str(t):
    from vitrify.integrations import torch as vt
    with vt.activated("region"):
        pass


@case(ValueError, "region is closed", group="fake")
def ti_activated_closed(t):
    from vitrify.integrations import torch as vt
    with vt.activated(closed_region()):
        pass


@case(ValueError, "device", "-1")
def ti_active_base_negative(t):
    from vitrify.integrations import torch as vt
    vt.active_base(-1)


# ---- pinned HostPool registration (host-emulating fake driver) -------------------------------

@case(ValueError, "HostPool is closed", group="host")
def hp_registered_closed_to_device(t):
    from vitrify.host import HostPool
    p = HostPool(8 * KiB, 4 * KiB, register=True)
    assert p.registered
    p.close()
    p.to_device((0, 1, 1 << 30))


@case(ValueError, "registration_threads", "got 0", group="host")
def hp_registered_threads_zero(t):
    from vitrify.host import HostPool
    HostPool(8 * KiB, 4 * KiB, register=True, registration_threads=0)


@case(ValueError, "max_bytes", "got 0", group="host")
def hr_max_bytes_zero(t):
    from vitrify.host import HostRegistration
    HostRegistration(bytearray(4096), max_bytes=0)


# ---- the HiCache backend's settings (SGLang extra config) ------------------------------------

def settings(extra):
    from vitrify.integrations.sglang.hicache import VitrifyStorageSettings

    return VitrifyStorageSettings.from_extra_config(extra)


def hc(t: Path, **kw):
    e = {"dirs": [str(t / "d")], "budget_bytes": 16 << 20}
    e.update(kw)
    return settings({k: v for k, v in e.items() if v is not None})


@case(ValueError, "extra config", "str")
def hc_extra_not_a_mapping(t):
    settings("dirs=/tmp")


@case(ValueError, "'dirs'", "None")
def hc_dirs_missing(t):
    hc(t, dirs=None)


@case(ValueError, "'dirs'", "5")
def hc_dirs_int(t):
    hc(t, dirs=5)


@case(ValueError, "'dirs'", "[]")
def hc_dirs_empty(t):
    hc(t, dirs=[])


@case(ValueError, "'dirs'", "{t}/file", "not a directory")
def hc_dirs_under_a_file(t):
    hc(t, dirs=[str(a_file(t) / "d")])


@case(ValueError, "'dirs'", "{t}/file", "exists and is not a directory")
def hc_dirs_is_a_file(t):
    hc(t, dirs=str(a_file(t)))


@case(ValueError, "'dirs'", "{t}/ro", "not writable", nonroot=True)
def hc_dirs_in_read_only_dir(t):
    hc(t, dirs=[str(read_only_dir(t) / "d")])


@case(ValueError, "budget_bytes", "budget_gb")
def hc_budget_both(t):
    hc(t, budget_gb=1)


@case(ValueError, "budget_bytes", "budget_gb")
def hc_budget_neither(t):
    hc(t, budget_bytes=None)


@case(ValueError, "'budget_bytes'", "-1")
def hc_budget_negative(t):
    hc(t, budget_bytes=-1)


@case(ValueError, "'budget_bytes'", "'16'")
def hc_budget_str(t):
    hc(t, budget_bytes="16")


@case(ValueError, "'budget_bytes'", str(HUGE))
def hc_budget_huge(t):
    hc(t, budget_bytes=HUGE)


@case(ValueError, "'budget_gb'", "inf")
def hc_budget_gb_inf(t):
    hc(t, budget_bytes=None, budget_gb=float("inf"))


@case(ValueError, "'budget_gb'", "nan")
def hc_budget_gb_nan(t):
    hc(t, budget_bytes=None, budget_gb=float("nan"))


@case(ValueError, "'budget_gb'", "True")
def hc_budget_gb_bool(t):
    hc(t, budget_bytes=None, budget_gb=True)


@case(ValueError, "'cold_start'", "'warm'")
def hc_cold_start(t):
    hc(t, cold_start="warm")


@case(ValueError, "'direct_io'", "'sometimes'")
def hc_direct_io(t):
    hc(t, direct_io="sometimes")


@case(ValueError, "'staging_bytes'", "got 0")
def hc_staging_zero(t):
    hc(t, staging_bytes=0)


@case(ValueError, "'staging_bytes'", str(HUGE))
def hc_staging_huge(t):
    hc(t, staging_bytes=HUGE)


@case(ValueError, "'read_threads'", "100000")
def hc_read_threads_huge(t):
    hc(t, read_threads=100000)


@case(ValueError, "'write_threads'", "'2'")
def hc_write_threads_str(t):
    hc(t, write_threads="2")


@case(ValueError, "'name'", "'a/b'")
def hc_name(t):
    hc(t, name="a/b")


@case(ValueError, "'extra_pool_budget_bytes'", "-1")
def hc_extra_budget_negative(t):
    hc(t, extra_pool_budget_bytes=-1)


@case(ValueError, "'extra_pool_budget_bytes'", str(16 << 20))
def hc_extra_budget_whole_budget(t):
    hc(t, extra_pool_budget_bytes=16 << 20)


@case(ValueError, "'stats_path'", "5")
def hc_stats_path_int(t):
    hc(t, stats_path=5)


@case(ValueError, "'stats_path'", "''")
def hc_stats_path_empty(t):
    hc(t, stats_path="")


@case(ValueError, "'stats_path'", "{t}", "is a directory")
def hc_stats_path_is_a_directory(t):
    hc(t, stats_path=str(t))


@case(ValueError, "'stats_path'", "{t}/file", "not a directory")
def hc_stats_path_under_a_file(t):
    hc(t, stats_path=str(a_file(t) / "stats.json"))


for _c in [c for c in CASES.values() if c.id.startswith("hc_")]:
    CASES[_c.id] = dataclasses.replace(_c, group="sglang")


# ---- the runner ------------------------------------------------------------------------------

def main(group: str) -> None:
    """Run every case of ``group``: one JSON line per case on stdout."""
    import faulthandler

    faulthandler.enable()
    root = Path(tempfile.mkdtemp(prefix="vitrify-bad-input-"))
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    try:
        for c in CASES.values():
            if c.group != group or (c.nonroot and is_root):
                continue
            t = root / c.id
            t.mkdir()
            print(f"case {c.id}", file=sys.stderr, flush=True)
            out: dict = {"id": c.id}
            try:
                c.fn(t)
                out.update(types=None, message=None)
            except BaseException as e:  # noqa: BLE001 - every outcome is reported
                out.update(types=[k.__name__ for k in type(e).__mro__], message=str(e))
            for p in t.rglob("*"):
                if p.is_dir():
                    p.chmod(0o700)
            print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"done": group}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
