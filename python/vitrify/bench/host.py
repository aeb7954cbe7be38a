"""Benchmark of the host tier (vitrify.host), every figure against a baseline from the same run.

  registration  cuMemHostRegister s/GiB of a multi-slab pool: serial vs parallel threads
                (and hugetlbfs-backed when /dev/hugepages has free huge pages)
  transfer      H2D / D2H page copies (scattered pages, batch API and loop) vs the pinned-copy
                limit: one large cuMemcpyHtoD / cuMemcpyDtoH of a registered buffer
  gather        gather/scatter GB/s (multi-threaded) vs single-threaded memcpy of the same bytes
  tier          host KV tier (vitrify.tier.HostStore + disk.PageMover) get and put GB/s of
                Qwen3-8B pages (9 MiB, page_first and layer_first) vs the best multi-threaded
                memcpy of the same bytes out of a mapped file in the same host directory

GPU sections are skipped, with the reason, on machines without a GPU; gather and tier always run
(the result is then named ``host-cpu``; tier is skipped, with the reason, when the host
directory cannot hold a store). Needs numpy.

  vitrify bench host [--out DIR] [--quick] [--note TEXT]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import vitrify
from vitrify import _native, disk, host, tier
from vitrify._units import GiB, MiB

from . import resultlib


def best_of(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def row(section: str, case: str, value: float, unit: str, **extra) -> dict:
    r = {"section": section, "case": case, "value": round(value, 4), "unit": unit}
    r.update(extra)
    return r


# ---- registration -----------------------------------------------------------------------------


def hugetlbfs_mount() -> tuple[str | None, str]:
    for mount in ("/dev/hugepages", "/mnt/huge", "/hugepages"):
        try:
            st = os.statvfs(mount)
        except OSError:
            continue
        with open("/proc/mounts") as f:
            if not any(line.split()[1] == mount and line.split()[2] == "hugetlbfs" for line in f):
                continue
        return mount, f"{st.f_bavail} free huge pages of {st.f_bsize >> 10} KiB"
    return None, "no hugetlbfs mount (/dev/hugepages, /mnt/huge)"


def bench_registration(total: int, slabs: int, rows: list, ratios: dict, skipped: dict) -> None:
    ceiling = total // slabs
    secs = {}
    for mode, parallel, prefault in (("serial", False, False), ("parallel", True, False),
                                     ("parallel+prefault", True, True)):
        pool = host.HostPool(total, 2 * MiB, max_slab_bytes=ceiling, register=True,
                             parallel=parallel, prefault=prefault)
        r = pool.registration()
        t0 = time.perf_counter()
        pool.close()
        release = time.perf_counter() - t0
        wall = r["seconds"] + r["prefault_seconds"]
        secs[mode] = wall
        rows.append(row("registration", f"{mode} {total / GiB:.0f} GiB in {pool_slabs(r)} slabs",
                        wall / (total / GiB), "s/GiB", seconds=round(wall, 3),
                        prefault_seconds=round(r["prefault_seconds"], 3),
                        threads=r["threads"], release_seconds=round(release, 3),
                        slowest_slab_seconds=round(max(r["slab_seconds"]), 3)))
    speedup = secs["serial"] / secs["parallel+prefault"]
    ratios["registration_parallel_speedup"] = round(speedup, 3)
    ratios["registration_parallel_without_prefault_speedup"] = round(
        secs["serial"] / secs["parallel"], 3)
    plain = ratios["registration_parallel_without_prefault_speedup"]
    if plain < 1.3:
        skipped["finding_registration"] = (
            f"parallel cuMemHostRegister alone is only {plain:.2f}x serial with {slabs} slabs: "
            f"the kernel serialises faulting+pinning for one process; with a parallel prefault "
            f"first the whole is {speedup:.2f}x serial")
    mount, why = hugetlbfs_mount()
    if mount is None:
        skipped["registration_hugetlbfs"] = why
        return
    try:
        pool = host.HostPool(total, 2 * MiB, max_slab_bytes=ceiling, register=True,
                             hugetlbfs_mount=mount)
    except (MemoryError, OSError, ValueError) as e:
        skipped["registration_hugetlbfs"] = f"{mount}: {why}: {e}"
        return
    r = pool.registration()
    pool.close()
    rows.append(row("registration", f"parallel hugetlbfs {total / GiB:.0f} GiB",
                    r["seconds"] / (total / GiB), "s/GiB", seconds=round(r["seconds"], 3)))
    ratios["registration_hugetlbfs_vs_serial"] = round(secs["serial"] / r["seconds"], 3)


def pool_slabs(r: dict) -> int:
    return len(r["slab_seconds"])


# ---- transfers --------------------------------------------------------------------------------


def bench_transfers(pool_bytes: int, move_bytes: int, reps: int, rows: list, ratios: dict) -> None:
    # A pool of 256 KiB pages in 4 slabs, so scattered pages come from every registration.
    # 2 MiB "pages" are runs of 8 consecutive pool pages (a slab holds a multiple of 8).
    import numpy as np

    unit = 256 * 1024
    pool = host.HostPool(pool_bytes, unit, max_slab_bytes=pool_bytes // 4, register=True)
    assert pool.registered and pool.num_slabs == 4
    dev = _native.DeviceBuffer(move_bytes, 0)
    stream = host.Stream(0)
    # The limit: one large synchronous copy of registered memory (slab 0), both directions.
    base = pool.slab_address(0)
    limit = {}
    for d in ("h2d", "d2h"):
        _native.host_memcpy_sync(d, 0, dev.ptr, base, move_bytes)  # warm
        t = best_of(lambda: _native.host_memcpy_sync(d, 0, dev.ptr, base, move_bytes), reps)
        limit[d] = move_bytes / t / 1e9
        rows.append(row("transfer", f"{d} limit: one {move_bytes >> 20} MiB copy", limit[d],
                        "GB/s"))
    rng = np.random.default_rng(0)
    paths = ["batch", "loop"] if host.batch_copy_available() else ["loop"]
    for page_bytes in (unit, 8 * unit):
        per = page_bytes // unit
        count = move_bytes // page_bytes
        groups = rng.choice(pool.num_pages // per, size=count, replace=False)
        runs = [(int(g) * per, per, dev.ptr + i * page_bytes) for i, g in enumerate(groups)]
        for d in ("h2d", "d2h"):
            for path in paths:
                # The native call with the runs as given (the list conversion is timed too).
                def once():
                    st = pool._pool.transfer(d, runs, stream.handle, path)
                    stream.synchronize()
                    return st
                st = once()
                assert st["path"] == path and st["copies"] == count, st
                t = best_of(once, reps)
                gbs = move_bytes / t / 1e9
                key = f"{d}_{path}_{page_bytes >> 10}KiB"
                rows.append(row("transfer", f"{d} {path} {count} scattered pages of "
                                f"{page_bytes >> 10} KiB", gbs, "GB/s",
                                vs_limit=round(gbs / limit[d], 3),
                                driver_calls=st["driver_calls"]))
                ratios[f"transfer_{key}_vs_limit"] = round(gbs / limit[d], 3)
    pool.close()


# ---- gather / scatter -------------------------------------------------------------------------


def bench_gather(pages: int, reps: int, rows: list, ratios: dict) -> None:
    import numpy as np

    cases = [
        # key, name, layers, page_tokens, heads, head_dim, item, components
        ("llama8b", "llama-8b-like layer_first 64 tok", 32, 64, 8, 128, 2, 2),
        ("llama8b_16tok", "llama-8b-like layer_first 16 tok", 32, 16, 8, 128, 2, 2),
    ]
    for key, name, layers, tokens, heads, dim, item, comps in cases:
        slice_bytes = tokens * heads * dim * item
        per_comp = layers * pages * slice_bytes
        mems = [np.ones(per_comp, dtype=np.uint8) for _ in range(comps)]
        lay = host.PageLayout.layer_first([m.ctypes.data for m in mems], layers=layers,
                                          pages=pages, page_tokens=tokens, heads=heads,
                                          head_dim=dim, item_bytes=item)
        slot = (lay.blob_bytes + 64 + 4095) // 4096 * 4096  # disk slots: header + blob + pad
        dst = np.ones(pages * slot, dtype=np.uint8)
        total = pages * lay.blob_bytes
        src_flat = np.ones(total, dtype=np.uint8)
        flat_dst = np.empty(total, dtype=np.uint8)
        flat_dst[:] = 0
        all_pages = list(range(pages))
        one = host.Copier(threads=1)
        many = host.Copier()
        plain = host.Copier(streaming=False)  # same threads, ordinary stores
        t_memcpy = best_of(lambda: np.copyto(flat_dst, src_flat), reps)
        base_gbs = total / t_memcpy / 1e9
        rows.append(row("gather", f"{name}: single-threaded memcpy of {total >> 20} MiB",
                        base_gbs, "GB/s"))
        for label, c in (("1 thread", one), (f"{many.threads} threads", many),
                         (f"{plain.threads} threads, no streaming stores", plain)):
            tg = best_of(lambda: c.gather_pages(lay, all_pages, dst.ctypes.data + 64, stride=slot,
                                                capacity=dst.size - 64), reps)
            ts = best_of(lambda: c.scatter_pages(dst.ctypes.data + 64, lay, all_pages,
                                                 stride=slot, nbytes=dst.size - 64), reps)
            for op, t in (("gather", tg), ("scatter", ts)):
                gbs = total / t / 1e9
                rows.append(row("gather", f"{name}: {op} {pages} pages of "
                                f"{lay.blob_bytes >> 10} KiB ({label})", gbs, "GB/s",
                                vs_memcpy=round(gbs / base_gbs, 3), slice_kib=slice_bytes >> 10))
                if c is many:
                    ratios[f"{op}_{key}_vs_memcpy_1t"] = round(gbs / base_gbs, 3)
        # Per-page latency of the path a disk write takes: one page into one slot buffer.
        t1 = best_of(lambda: many.gather(lay, 0, dst.ctypes.data + 64, lay.blob_bytes), reps * 5)
        rows.append(row("gather", f"{name}: one page ({lay.blob_bytes >> 10} KiB) latency",
                        t1 * 1e6, "us"))
        del mems, dst, src_flat, flat_dst


# ---- host tier --------------------------------------------------------------------------------


def bench_tier(pages: int, reps: int, rows: list, ratios: dict, skipped: dict) -> None:
    """HostStore get/put through a PageMover vs the best T-thread memcpy of the same bytes."""
    # Qwen3-8B as SGLang's host pool holds it: 36 layers, 8 KV heads x 128, bf16, 64-token pages.
    geom = dict(layers=36, pages=pages, page_tokens=64, heads=8, head_dim=128, item_bytes=2)
    per_comp = 36 * pages * 64 * 8 * 128 * 2
    total = 2 * per_comp
    cpus = os.cpu_count() or 1
    base = tier.default_dir()
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        work = tempfile.mkdtemp(prefix="bench-tier-", dir=base)
    except OSError as e:
        skipped["tier"] = f"host directory {base}: {e}"
        return
    try:
        get_gbs = tier_sweep(geom, per_comp, work, cpus, reps, rows, skipped)
        if get_gbs is None:
            return
        shutil.rmtree(os.path.join(work, "store"))
        try:
            memcpy = memcpy_sweep(os.path.join(work, "memcpy.src"), total, cpus, reps, rows)
        except OSError as e:
            skipped["tier"] = f"memcpy baseline: a mapped file in {work}: {e}"
            return
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        if r["section"] == "tier" and r["case"].startswith(("get", "put")):
            r["vs_memcpy"] = round(r["value"] / memcpy, 3)
    ratios["tier_get_vs_memcpy"] = round(get_gbs["page_first"] / memcpy, 3)
    ratios["tier_get_layer_first_vs_memcpy"] = round(get_gbs["layer_first"] / memcpy, 3)


def tier_sweep(geom: dict, per_comp: int, work: str, cpus: int, reps: int, rows: list,
               skipped: dict) -> dict | None:
    """Put then get every page, per read-thread count and layout; the best get GB/s per layout
    (None, with skipped["tier"] set, when the directory cannot hold the store)."""
    import numpy as np

    pages = geom["pages"]
    src = [np.empty(per_comp, dtype=np.uint8) for _ in range(2)]
    for c, a in enumerate(src):  # distinct 8-byte words, so a misplaced slice cannot compare equal
        a.view(np.uint64)[:] = np.arange(per_comp // 8, dtype=np.uint64) * 2 + c
    dst = [np.zeros(per_comp, dtype=np.uint8) for _ in range(2)]
    layouts = {name: (make([a.ctypes.data for a in src], **geom),
                      make([a.ctypes.data for a in dst], **geom))
               for name, make in (("page_first", host.PageLayout.page_first),
                                  ("layer_first", host.PageLayout.layer_first))}
    blob = layouts["page_first"][0].blob_bytes
    # The store's GC starts at 90 % occupancy: a quarter more slots than pages keeps every page.
    budget = (pages * 5 // 4 + 1) * (blob + 8192) + 64 * MiB
    copier = host.Copier()
    keys = [f"bench-tier-{i}" for i in range(pages)]
    idx = list(range(pages))
    moved = pages * blob
    best = {name: 0.0 for name in layouts}
    put = (float("inf"), 0)
    for threads in sorted({min(t, cpus) for t in (4, 8, 16)}):
        try:
            store = tier.HostStore(budget, {"kv": blob}, dir=os.path.join(work, "store"),
                                   name="bench-tier", read_threads=threads, write_threads=threads)
        except (OSError, ValueError) as e:
            skipped["tier"] = f"host tier store of {budget >> 20} MiB in {work}: {e}"
            return None
        try:
            chunk = max(1, 256 * MiB // (2 * store.slot_bytes("kv")))  # SGLang backend's staging
            mover = disk.PageMover(store, chunk, "kv", copier=copier)
            for name, (lay, out) in layouts.items():
                store.clear()
                t0 = time.perf_counter()
                ok, present = mover.put_pages(keys, lay, idx)
                t_put = time.perf_counter() - t0
                if not all(ok) or present:
                    raise RuntimeError(f"tier {name}: put stored {sum(ok)} of {pages} pages "
                                       f"({present} were present before)")
                if name == "page_first" and t_put < put[0]:
                    put = (t_put, threads)
                t_get = float("inf")
                for _ in range(reps):
                    for a in dst:
                        a.fill(0)
                    t0 = time.perf_counter()
                    hits, dropped = mover.get_pages(keys, out, idx)
                    t_get = min(t_get, time.perf_counter() - t0)
                    if not all(hits) or dropped:
                        raise RuntimeError(f"tier {name}: get hit {sum(hits)} of {pages} pages, "
                                           f"dropped for their length: {dropped}")
                    if not all(np.array_equal(a, b) for a, b in zip(src, dst)):
                        raise RuntimeError(f"tier {name}: get returned wrong bytes "
                                           f"({threads} read threads)")
                best[name] = max(best[name], moved / t_get / 1e9)
                rows.append(row("tier", f"get {pages} pages of {blob >> 20} MiB {name}, "
                                f"{threads} read threads", moved / t_get / 1e9, "GB/s",
                                chunk=chunk, copy_threads=copier.threads))
        finally:
            store.close()
    rows.append(row("tier", f"put {pages} pages of {blob >> 20} MiB page_first, {put[1]} write "
                    f"threads (best single put)", moved / put[0] / 1e9, "GB/s"))
    return best


def memcpy_sweep(path: str, total: int, cpus: int, reps: int, rows: list) -> float:
    """T threads each np.copyto one contiguous T-th of a mapped file into a buffer; best GB/s."""
    import numpy as np

    src = np.memmap(path, dtype=np.uint8, mode="w+", shape=(total,))
    src[:] = 1
    dst = np.empty(total, dtype=np.uint8)
    dst[:] = 0
    best = 0.0
    try:
        for threads in sorted({min(t, cpus) for t in (1, 2, 4, 8, 16)}):
            cut = [total * i // threads for i in range(threads + 1)]
            def part(i):
                np.copyto(dst[cut[i]:cut[i + 1]], src[cut[i]:cut[i + 1]])
            with concurrent.futures.ThreadPoolExecutor(threads) as ex:
                def once():
                    list(ex.map(part, range(threads)))
                once()
                t = best_of(once, reps)
            v = total / t / 1e9
            best = max(best, v)
            rows.append(row("tier", f"memcpy baseline: {total >> 20} MiB from a mapped file in "
                            f"the host dir, {threads} thread{'s' * (threads > 1)}", v, "GB/s"))
    finally:
        os.unlink(path)  # the tmpfs pages go with the mapping, at return
    return best


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="smaller sizes (CI / smoke)")
    ap.add_argument("--note", default="", help="free text stored in the result (machine load...)")


def unavailable(args: argparse.Namespace) -> str | None:
    if importlib.util.find_spec("numpy") is None:
        return "needs numpy, which is not installed (pip install numpy)"
    return None  # without a GPU gather and tier run and the GPU sections say why not


def run(a: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    gpu = vitrify.cuda_available()
    rows: list[dict] = []
    ratios: dict[str, float] = {}
    skipped: dict[str, str] = {}
    reps = 2 if a.quick else 5
    t0 = time.perf_counter()
    if gpu:
        progress("registration: serial vs parallel cuMemHostRegister")
        bench_registration((4 if a.quick else 8) * GiB, 8, rows, ratios, skipped)
        progress("transfer: scattered page copies vs one large copy")
        bench_transfers((2 if a.quick else 4) * GiB, (512 * MiB if a.quick else GiB), reps, rows,
                        ratios)
    else:
        why = f"no CUDA GPU: {vitrify.cuda_unavailable_reason()}"
        skipped["registration"] = why
        skipped["transfer"] = why
        progress("registration, transfer: skipped, no CUDA GPU (the reason follows the table)")
    progress("gather/scatter vs single-threaded memcpy")
    bench_gather(16 if a.quick else 64, reps, rows, ratios)
    progress("tier: host-tier get/put of 9 MiB pages vs multi-threaded memcpy")
    bench_tier(16 if a.quick else 64, reps, rows, ratios, skipped)
    goals = {
        "registration_parallel_speedup": 2.0,
        "transfer_h2d_batch_2048KiB_vs_limit": 0.9,
        "transfer_d2h_batch_2048KiB_vs_limit": 0.9,
        "transfer_h2d_batch_256KiB_vs_limit": 0.9,
        "transfer_d2h_batch_256KiB_vs_limit": 0.9,
        "gather_llama8b_vs_memcpy_1t": 2.0,
        "scatter_llama8b_vs_memcpy_1t": 2.0,
        "tier_get_vs_memcpy": 0.8,
    }
    res = resultlib.result("host" if gpu else "host-cpu", rows=rows, ratios=ratios, goals=goals,
                           skipped=skipped, quick=a.quick, note=a.note,
                           seconds=round(time.perf_counter() - t0, 1),
                           copy_threads=host.Copier().threads)
    resultlib.print_table(rows, ["section", "case", "value", "unit", "vs_limit", "vs_memcpy"])
    for k, v in sorted(ratios.items()):
        g = goals.get(k)
        print(f"{k:45s} {v:8.3f}" + (f"  goal >= {g} {'met' if v >= g else 'NOT met'}" if g else ""))
    for k, v in skipped.items():
        print(f"{'note' if k.startswith('finding') else 'skipped'} {k}: {v}")
    return res
