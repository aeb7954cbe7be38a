"""Disk tier throughput: vitrify's slab store vs fio (O_DIRECT) vs a naive one-file-per-page store.

For each page size and queue depth, in the same run and on the same directory:

* ``vitrify``: ``DiskStore`` with ``depth`` write and read threads (so at most ``depth`` I/Os in
  flight), zero-copy slot buffers (``put_buffers_async`` / ``get_buffers_async``, two
  submissions of max(32, 2*depth) pages in flight so group commit can fill its batches).
  Every put is acknowledged only after its slot write and an fdatasync (group commit of up to
  ``max_batch`` = 32 writes per thread); every read verifies header and payload CRC32C. After
  the read the store is cleared and the same pages written again (``vitrify_rewrite``): the
  steady state of a store in service, whose slots were written before, as the blocks of fio's
  second (synced) pass were.
* ``fio`` (the baseline with the goal): ``--direct=1 --ioengine=psync --numjobs=<depth>
  --bs=<page>``, each job writing then reading its own contiguous part of one file of the same
  total size, no fsync: the store's own I/O model (``depth`` threads of pread/pwrite) on the raw
  file. ``fio_libaio`` (``--ioengine=libaio --iodepth=<depth>``, one job) is reported alongside,
  and ``fio_sync`` (psync with ``--fdatasync=32``, the store's group commit) for writes. fio's
  read pass follows that synced rewrite, so fio and the store both read flushed data.
* ``naive``: one buffered file per page (open/write/fsync/close, as a durable file-per-page
  cache must), ``depth`` threads; reads open/read/close each file after dropping its pages from
  the page cache (``posix_fadvise(DONTNEED)``) so they come from the disk too.

A fourth column runs the vitrify measurement on /dev/shm (no disk) to show the store's own
software ceiling. Ratios: vitrify/fio (goal >= 0.90) and vitrify/naive (goal >= 3.0) per direction and configuration,
plus the geometric means.

Ceiling analysis, from the same run: ``drive_ceiling_MBps`` per (op, page size) is the best rate
any fio variant (psync, libaio, plain or with group-commit fdatasync) reached at any depth
measured; ``naive_headroom`` = ceiling / naive is the largest vitrify/naive ratio any store could
reach in that config on this drive (below 3 the 3x goal is out of reach here, whatever the
store does), and ``vs_ceiling`` = vitrify / ceiling. Every contender runs ``--repeat`` times per
config, interleaved; rates and ratios are best-of-N, with medians alongside. The goal ratio
``<op>_<page>MiB_best_vs_ceiling`` (>= 0.9) takes the store at its best depth (writes: the
steady state) over that ceiling; ``write_<page>MiB_first_fill_vs_first_pass`` puts the first
fill beside fio's first pass over a new file.

Engines (DESIGN.md D25): ``vitrify`` is the store on psync (``depth`` threads: the partner of
fio psync, with the goal above); ``vitrify_aio`` and ``vitrify_io_uring`` run the same
measurement on the store's asynchronous engines where the kernel grants them (``depth``
transfers in flight per direction: up to 2 I/O threads of ``queue_depth = depth / threads``),
and fio's ``io_uring`` engine (``--iodepth=<depth>``, one job) joins the contenders and the
ceiling where it runs. ``best_engine_configuration`` takes, per (op, page size), the store at
its best engine and depth (writes: the steady state) over the drive's ceiling:
``<op>_<page>MiB_store_best_over_drive_ceiling`` and their minimum
``store_best_over_drive_ceiling``, goal >= 0.9. What the kernel or fio refuses here is listed
in ``not_run``.

A ``load`` section times cold start ``load`` of ``--load-slots`` live entries with one header
reader (``load_threads=1``) vs the default parallel scan.

Without fio on the PATH the fio columns, the drive ceiling and the ratios built on them are left
out (a line says so) and the rest runs. Usage::

    vitrify bench disk [--dir /mnt/nvme] [--out DIR] [--sizes-mib 1,4] [--depths 1,4,16]
        [--total-mib 384] [--repeat 5] [--load-slots 20000]   (~3-4 min on the 2-core CI VM)
    vitrify bench disk --quick     (depth 4 only, 128 MiB per measurement)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

from vitrify import config, disk
from vitrify._units import MiB

from . import resultlib
from .cli import existing_dir, nonnegative_int, positive_int, positive_int_list

MAX_BATCH = 32  # DiskStore's default group commit: writes per fdatasync per write thread


def store_shape(engine: str, depth: int) -> dict:
    """The store's I/O threads for ``depth`` transfers in flight per direction: psync, ``depth``
    threads of one pread/pwrite each; io_uring and aio, up to 2 threads (so one's fdatasync
    overlaps the other's writes) with ``queue_depth`` transfers each, ``depth`` in all."""
    if engine == "psync":
        return {"write_threads": depth, "read_threads": depth}
    threads = min(depth, 2)
    return {"write_threads": threads, "read_threads": threads,
            "queue_depth": -(-depth // threads)}


def store_engines() -> list[str]:
    """The engines the kernel grants the store here (psync always; aio, io_uring when granted)."""
    out = ["psync"]
    root = tempfile.mkdtemp(prefix="vitrify-bench-engine-")
    try:
        for e in ("aio", "io_uring"):
            try:
                disk.DiskStore(os.path.join(root, e), 1 << 20, 4000, engine=e).close()
                out.append(e)
            except disk.EngineUnavailableError:
                pass
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def bench_vitrify(d: str, page: int, depth: int, total: int,
                  rewrite: bool = True, engine: str = "psync") -> tuple[float, float, dict]:
    n = max(4 * depth, total // page)
    budget = 4096 + int(n * 1.2 + 8 * depth) * disk.slot_bytes_for(page)
    with disk.DiskStore(d, budget, page, name="bench", engine=engine,
                        queue_capacity=max(64, 4 * depth), **store_shape(engine, depth)) as s:
        # pages per submission; two submissions in flight. The device queue depth is set by
        # the store's `depth` I/O threads; deeper submissions only let group commit fill up.
        per = max(MAX_BATCH, 2 * depth)
        sets = [[s.buffer() for _ in range(per)] for _ in range(2)]
        for bset in sets:
            for i, b in enumerate(bset):
                b.view()[:] = bytes([(i * 7 + 1) & 0xFF]) * page
        keys = [f"page-{i}" for i in range(n)]
        # first fill: every slot written for the first time (preallocated, never written)
        t0 = time.perf_counter()
        done = _put_all(s, keys, sets, per, page)
        tw = time.perf_counter() - t0
        if done != n:
            raise RuntimeError(f"vitrify store acknowledged {done} of {n} writes: {s.stats()}")
        # read
        t0 = time.perf_counter()
        pending = [None, None]
        hits = 0
        for start in range(0, n, per):
            slot = (start // per) % 2
            if pending[slot] is not None:
                hits += sum(1 for r in pending[slot].wait() if r == page)
            chunk = keys[start:start + per]
            pending[slot] = s.get_buffers_async(chunk, sets[slot][:len(chunk)])
        for p in pending:
            if p is not None:
                hits += sum(1 for r in p.wait() if r == page)
        tr = time.perf_counter() - t0
        if hits != n:
            raise RuntimeError(f"vitrify store read back {hits} of {n} pages")
        st = s.stats()
        if not rewrite:
            return n * page / tw, n * page / tr, {"pages": n, "direct_io": st["direct_io"],
                                                  "engine": s.engine}
        # steady state: a store in service writes into slots it wrote before (after GC or a
        # clear), as fio's second pass over its file does; `clear` frees every slot, lowest
        # first, so the same blocks are written again
        s.clear()
        t0 = time.perf_counter()
        done = _put_all(s, keys, sets, per, page)
        trw = time.perf_counter() - t0
        if done != n:
            raise RuntimeError(f"vitrify store acknowledged {done} of {n} rewrites: {s.stats()}")
    return n * page / tw, n * page / tr, {"pages": n, "direct_io": st["direct_io"],
                                          "rewrite": n * page / trw, "engine": engine}


def _put_all(s, keys: list[str], sets: list, per: int, page: int) -> int:
    """Put every key from the two buffer sets, two submissions in flight; acknowledged count."""
    pending: list = [None, None]
    done = 0
    for start in range(0, len(keys), per):
        slot = (start // per) % 2
        if pending[slot] is not None:
            done += sum(pending[slot].wait())
        chunk = keys[start:start + per]
        pending[slot] = s.put_buffers_async(chunk, sets[slot][:len(chunk)], [page] * len(chunk))
    for p in pending:
        if p is not None:
            done += sum(p.wait())
    return done


def fio_run(path: str, rw: str, page: int, depth: int, total: int, engine: str,
            fdatasync: int = 0) -> float:
    """Bytes/s of one fio job over ``path`` (O_DIRECT; reads of an existing file never write)."""
    cmd = ["fio", "--name=vitrify-bench", f"--filename={path}", f"--rw={rw}", f"--bs={page}",
           "--direct=1", f"--ioengine={engine}", "--output-format=json", "--end_fsync=0",
           "--invalidate=1", "--group_reporting", f"--fdatasync={fdatasync}"]
    if rw == "read":
        cmd.append("--readonly")
    if engine in ("libaio", "io_uring"):
        cmd += [f"--size={total}", f"--iodepth={depth}", "--numjobs=1"]
    else:  # psync: `depth` threads, each over its own contiguous part of the file
        part = total // depth // page * page
        cmd += [f"--size={part}", f"--offset_increment={part}", f"--numjobs={depth}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr.strip()[:500]}")
    text = out.stdout[out.stdout.index("{"):]
    job = json.loads(text)["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return side["io_bytes"] / (side["runtime"] / 1000.0)


def bench_fio(d: str, page: int, depth: int, total: int, engine: str) -> tuple[float, float, float]:
    """(write, read, synced write): the write is measured without any sync; the file is then
    rewritten with an fdatasync every MAX_BATCH writes per job — the store's group commit — so
    the read finds the data in the same flushed state as the store's read does (on this VM,
    reads of just-written, unflushed data were ~15 % faster)."""
    path = os.path.join(d, "fio.dat")
    w = fio_run(path, "write", page, depth, total, engine)
    ws = fio_run(path, "write", page, depth, total, engine, fdatasync=MAX_BATCH)
    r = fio_run(path, "read", page, depth, total, engine)
    os.unlink(path)
    return w, r, ws


def bench_naive(d: str, page: int, depth: int, total: int) -> tuple[float, float]:
    n = max(4 * depth, total // page)
    data = os.urandom(page)
    root = os.path.join(d, "naive")
    os.makedirs(root, exist_ok=True)
    paths = [os.path.join(root, f"{i:08x}.page") for i in range(n)]

    def write(p: str) -> None:
        with open(p, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def drop(p: str) -> None:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read(p: str) -> int:
        with open(p, "rb") as f:
            return len(f.read())

    with cf.ThreadPoolExecutor(depth) as ex:
        t0 = time.perf_counter()
        list(ex.map(write, paths))
        tw = time.perf_counter() - t0
        list(ex.map(drop, paths))
        t0 = time.perf_counter()
        got = sum(ex.map(read, paths))
        tr = time.perf_counter() - t0
    if got != n * page:
        raise RuntimeError("naive store read back the wrong amount")
    shutil.rmtree(root)
    return n * page / tw, n * page / tr


def bench_load(d: str, slots: int, page: int, repeat: int) -> dict:
    """Cold start ``load`` of a store holding ``slots`` live entries: ``load_threads=1`` (one
    header pread after the other) vs the default parallel scan, alternating, best and median of
    ``repeat``. Payloads are tiny (one 4 KiB write each) so filling is quick; ``page`` sets the
    slot size and thereby whether adjacent headers are batched into one read."""
    total_slots = int(slots / 0.8) + 1  # below gc_high, so nothing is evicted while filling
    budget = 4096 + total_slots * disk.slot_bytes_for(page)
    root = tempfile.mkdtemp(prefix="load-", dir=d)
    try:
        with disk.DiskStore(root, budget, page, name="load", write_threads=4,
                            queue_capacity=256) as s:
            keys = [f"load-{i}" for i in range(slots)]
            tickets = [s.put_async(keys[i:i + 1024], [b"x" * 16] * len(keys[i:i + 1024]))
                       for i in range(0, slots, 1024)]
            stored = sum(sum(t.wait()) for t in tickets)
            direct = s.direct_io()
            slot_bytes = s.slot_bytes()
        if stored != slots:
            raise RuntimeError(f"load bench stored {stored} of {slots} entries")
        times: dict[str, list[float]] = {"serial": [], "parallel": []}
        for rep in range(repeat):
            for who in (("serial", "parallel") if rep % 2 == 0 else ("parallel", "serial")):
                t0 = time.perf_counter()
                s = disk.DiskStore(root, budget, page, name="load", cold_start="load",
                                   load_threads=1 if who == "serial" else 0)
                dt = time.perf_counter() - t0
                got = s.stats()["loaded_entries"]
                s.close()
                if got != slots:
                    raise RuntimeError(f"load ({who}) rebuilt {got} of {slots} entries")
                times[who].append(dt)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ser, par = min(times["serial"]), min(times["parallel"])
    return {"slots": slots, "slot_bytes": slot_bytes, "direct_io": direct,
            "serial_s": ser, "parallel_s": par,
            "serial_median_s": statistics.median(times["serial"]),
            "parallel_median_s": statistics.median(times["parallel"]),
            "speedup": ser / par,
            "speedup_median": statistics.median(times["serial"]) / statistics.median(times["parallel"])}


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


CONTENDERS = ["vitrify", "psync", "libaio", "naive"]
WITHOUT_FIO = ["vitrify", "naive"]
#: The store on its asynchronous engines (contender "vitrify_<engine>"; "vitrify" is psync, the
#: like-for-like partner of fio psync), run where the kernel grants them.
ASYNC_ENGINES = ("aio", "io_uring")


def fio_io_uring_refusal(d: str) -> str | None:
    """None when fio's io_uring engine runs here (a 64 KiB O_DIRECT write in ``d``), else why
    not: fio built without it, or a kernel or container that refuses io_uring."""
    path = os.path.join(d, "fio-probe.dat")
    try:
        out = subprocess.run(["fio", "--name=probe", f"--filename={path}", "--rw=write",
                              "--bs=4k", "--size=64k", "--direct=1", "--ioengine=io_uring",
                              "--output-format=terse"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"fio could not run: {e}"
    finally:
        if os.path.exists(path):
            os.unlink(path)
    if out.returncode != 0:
        return "fio's io_uring engine does not run here: " + (
            out.stderr.strip().splitlines() or ["exit status %d" % out.returncode])[-1][:200]
    return None


def measure_config(work: str, page: int, depth: int, total: int, repeat: int,
                   contenders: list[str] = CONTENDERS) -> dict:
    """Every contender `repeat` times, interleaved: each repeat runs all of them, the order
    rotating so no contender always runs first (shared, noisy machine). Returns every sample."""
    samples: dict[str, dict[str, list[float]]] = {
        n: {"write": [], "read": []} for n in contenders}
    synced: list[float] = []
    info: dict = {}
    k = len(contenders)
    for rep in range(repeat):
        order = contenders[rep % k:] + contenders[:rep % k]
        for who in order:
            if who == "vitrify" or who.startswith("vitrify_"):
                engine = "psync" if who == "vitrify" else who[len("vitrify_"):]
                w, r, got = bench_vitrify(work, page, depth, total, engine=engine)
                if who == "vitrify":
                    info = got
                samples.setdefault(f"{who}_rewrite", {"write": [], "read": []})["write"].append(
                    got["rewrite"])
            elif who == "naive":
                w, r = bench_naive(work, page, depth, total)
            else:
                w, r, ws = bench_fio(work, page, depth, total, who)
                if who == "psync":
                    synced.append(ws)
                samples.setdefault(f"{who}_sync", {"write": [], "read": []})["write"].append(ws)
            samples[who]["write"].append(w)
            samples[who]["read"].append(r)
    return {"samples": samples, "psync_sync": synced, "info": info}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dir", type=existing_dir,
                    default=config.get("bench_dir") or tempfile.gettempdir(),
                    help="filesystem to measure, not tmpfs (default: $VITRIFY_BENCH_DIR, else "
                         "the system temp directory)")
    ap.add_argument("--sizes-mib", type=positive_int_list, default=[1, 4], metavar="LIST",
                    help="page sizes in MiB, comma-separated (default: 1,4)")
    ap.add_argument("--depths", type=positive_int_list, default=[1, 4, 16], metavar="LIST",
                    help="queue depths (I/O threads), comma-separated (default: 1,4,16)")
    ap.add_argument("--total-mib", type=positive_int, default=384, metavar="MIB",
                    help="MiB moved per measurement (default: 384)")
    ap.add_argument("--repeat", type=positive_int, default=5, metavar="N",
                    help="best (and median) of N per contender (default: 5)")
    ap.add_argument("--load-slots", type=nonnegative_int, default=20000, metavar="N",
                    help="live entries for the cold-start load section (0: skip it; default: "
                         "20000)")
    ap.add_argument("--quick", action="store_true",
                    help="depth 4 only and 128 MiB per measurement")


def unavailable(args: argparse.Namespace) -> str | None:
    return None  # CPU only; without fio the fio columns are left out (run() says so)


def run(a: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    sizes = [x * MiB for x in a.sizes_mib]
    depths = list(a.depths)
    total = a.total_mib * MiB
    if a.quick:
        depths, total = [4], 128 * MiB
    have_fio = shutil.which("fio") is not None
    contenders = list(CONTENDERS if have_fio else WITHOUT_FIO)
    skipped: dict[str, str] = {}
    if not have_fio:
        skipped["fio"] = ("fio is not installed (not on PATH): the fio baselines, the drive "
                          "ceiling and their ratios are left out; install fio for them")
        progress(f"note: {skipped['fio']}")
    # what the kernel or fio does not offer here is left out, and the result says so
    not_run: dict[str, str] = {}
    if have_fio:
        why = fio_io_uring_refusal(a.dir)
        if why is None:
            contenders.insert(contenders.index("libaio") + 1, "io_uring")
        else:
            not_run["fio_io_uring"] = why
    engines = store_engines()
    for e in ASYNC_ENGINES:
        if e in engines:
            last = max(i for i, c in enumerate(contenders) if c.startswith("vitrify"))
            contenders.insert(last + 1, f"vitrify_{e}")
        else:
            not_run[f"vitrify_{e}"] = f"the kernel refuses the store's {e} engine here"
    for k, v in not_run.items():
        progress(f"note: {k} not run: {v}")
    progress(f"note: contenders {', '.join(contenders)}")
    work = tempfile.mkdtemp(prefix="vitrify-bench-disk-", dir=a.dir)
    shm = tempfile.mkdtemp(prefix="vitrify-bench-disk-", dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    rows, ratios = [], {}
    measured: dict[tuple[int, int], dict] = {}
    tmpfs: dict[tuple[int, int], tuple[float, float]] = {}
    load: dict[str, dict] = {}
    t_start = time.perf_counter()
    try:
        for page in sizes:
            for depth in depths:
                progress(f"{page // MiB} MiB pages, depth {depth}: {len(contenders)} "
                         f"contenders x{a.repeat}")
                measured[page, depth] = measure_config(work, page, depth, total, a.repeat,
                                                       contenders)
                # the store's own ceiling (no disk): the same run on tmpfs, for diagnosis
                sw = sr = float("nan")
                if shm:
                    sw, sr, _ = bench_vitrify(shm, page, depth, min(total, 256 * MiB), rewrite=False)
                tmpfs[page, depth] = (sw, sr)
        if a.load_slots > 0:
            # 60 KiB pages: 64 KiB slots, one 4 KiB header read per slot (large-page stores);
            # 4 KiB slots: adjacent headers are batched into one read
            for label, page in (("64KiB_slots", 60 * 1024), ("4KiB_slots", 4096 - 64)):
                progress(f"cold start load of {a.load_slots} entries, {label}")
                load[label] = bench_load(work, a.load_slots, page, 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)

    def best(xs: list[float]) -> float:
        return max(xs) if xs else float("nan")

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    def mbps(x: float | None) -> float | None:
        return None if x is None else x / 1e6

    def over(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None else x / y

    # Drive ceiling per (op, page): the best rate any fio variant reached at any depth measured
    # (psync, libaio, and for writes psync with group-commit fdatasync). No store on this drive
    # can beat it by much, so ceiling / naive bounds the vs_naive ratio any store could reach.
    ceiling: dict[tuple[str, int], float] = {}
    for (page, depth), m in measured.items():
        for op in ("write", "read"):
            for who in CEILING_VARIANTS:
                xs = m["samples"].get(who, {}).get(op, [])
                if xs:
                    ceiling[op, page] = max(ceiling.get((op, page), 0.0), max(xs))
    for (page, depth), m in measured.items():
        smp, info = m["samples"], m["info"]
        tag = f"{page // MiB}MiB_qd{depth}"
        for op, sh in (("write", tmpfs[page, depth][0]), ("read", tmpfs[page, depth][1])):
            t, f, fa, nv = (best(smp[n][op]) if n in smp else None for n in CONTENDERS)
            tm, fm, fam, nvm = (med(smp[n][op]) if n in smp else None for n in CONTENDERS)
            c = ceiling.get((op, page))
            row = {"page_mib": page // MiB, "depth": depth, "op": op,
                   "vitrify_MBps": t / 1e6, "fio_MBps": mbps(f), "fio_libaio_MBps": mbps(fa),
                   "naive_MBps": nv / 1e6, "vitrify_median_MBps": tm / 1e6,
                   "fio_median_MBps": mbps(fm), "fio_libaio_median_MBps": mbps(fam),
                   "naive_median_MBps": nvm / 1e6, "vitrify_tmpfs_MBps": sh / 1e6,
                   "drive_ceiling_MBps": mbps(c),
                   "vs_fio": over(t, f), "vs_fio_libaio": over(t, fa), "vs_naive": t / nv,
                   "vs_fio_median": over(tm, fm), "vs_naive_median": tm / nvm,
                   "naive_headroom": over(c, nv), "vs_ceiling": over(t, c),
                   "pages": info["pages"], "direct_io": info["direct_io"]}
            if "io_uring" in smp:
                row["fio_io_uring_MBps"] = best(smp["io_uring"][op]) / 1e6
            for e in ASYNC_ENGINES:  # the store on its asynchronous engines, same depth
                if f"vitrify_{e}" in smp:
                    row[f"vitrify_{e}_MBps"] = best(smp[f"vitrify_{e}"][op]) / 1e6
                    if op == "write":
                        row[f"vitrify_{e}_rewrite_MBps"] = best(
                            smp[f"vitrify_{e}_rewrite"]["write"]) / 1e6
            if op == "write":
                rw = smp.get("vitrify_rewrite", {}).get("write", [])
                row["vitrify_rewrite_MBps"] = best(rw) / 1e6
                row["vitrify_rewrite_median_MBps"] = med(rw) / 1e6
                row["rewrite_vs_ceiling"] = over(best(rw), c)
            if op == "write" and have_fio:
                ws = best(m["psync_sync"])
                row["fio_sync_MBps"] = ws / 1e6
                row["vs_fio_sync"] = t / ws
                ratios[f"write_{tag}_vs_fio_sync"] = t / ws
            rows.append(row)
            for key in ("vs_fio", "vs_fio_libaio", "vs_naive", "naive_headroom", "vs_ceiling"):
                if row[key] is not None:
                    ratios[f"{op}_{tag}_{key}"] = row[key]
    for op in ("write", "read"):
        mine = [r for r in rows if r["op"] == op]
        for k in ("vs_fio", "vs_fio_libaio", "vs_naive", "naive_headroom", "vs_ceiling",
                  "vs_fio_median", "vs_naive_median"):
            xs = [r[k] for r in mine if r[k] is not None]
            if xs:
                ratios[f"{op}_geomean_{k}"] = geomean(xs)
    # goals on the like-for-like baselines (fio psync with `depth` threads, naive); the libaio,
    # ceiling and headroom ratios are reported alongside without a goal
    if have_fio:
        ratios["write_geomean_vs_fio_sync"] = geomean(
            [r["vs_fio_sync"] for r in rows if r["op"] == "write"])
    for label, l in load.items():
        ratios[f"load_{label}_parallel_speedup"] = l["speedup"]
    goals = {k: (0.90 if k.endswith("vs_fio") else 3.0) for k in ratios
             if k.endswith("vs_fio") or k.endswith("vs_naive")}
    best_rows = best_configuration(measured, ceiling)
    engine_rows = best_engine_configuration(measured, ceiling)
    for b in engine_rows:
        key = f"{b['op']}_{b['page_mib']}MiB_store_best_over_drive_ceiling"
        ratios[key] = b["store_best_over_drive_ceiling"]
        goals[key] = 0.90
    if engine_rows:
        # the goal over every direction and page size: the weakest of them
        ratios["store_best_over_drive_ceiling"] = min(
            b["store_best_over_drive_ceiling"] for b in engine_rows)
        goals["store_best_over_drive_ceiling"] = 0.90
    for b in best_rows:
        key = f"{b['op']}_{b['page_mib']}MiB_best_vs_ceiling"
        ratios[key] = b["best_vs_ceiling"]
        goals[key] = 0.90
        if b["median_vs_ceiling_median"] is not None:
            ratios[f"{b['op']}_{b['page_mib']}MiB_median_vs_ceiling_median"] = \
                b["median_vs_ceiling_median"]
        if b.get("first_fill_vs_first_pass") is not None:
            ratios[f"write_{b['page_mib']}MiB_first_fill_vs_first_pass"] = \
                b["first_fill_vs_first_pass"]
    resultlib.print_table(rows, ["page_mib", "depth", "op", "vitrify_MBps", "vitrify_median_MBps",
                                 "vitrify_rewrite_MBps",
                                 "fio_MBps", "fio_libaio_MBps", "naive_MBps",
                                 "drive_ceiling_MBps", "vs_fio", "vs_naive", "naive_headroom",
                                 "vs_ceiling", "vs_fio_libaio", "fio_sync_MBps",
                                 "vitrify_tmpfs_MBps", "vitrify_aio_MBps",
                                 "vitrify_aio_rewrite_MBps", "vitrify_io_uring_MBps",
                                 "vitrify_io_uring_rewrite_MBps", "fio_io_uring_MBps"])
    if best_rows:
        print("the store at its best configuration against the drive's ceiling:")
        resultlib.print_table(best_rows, list(best_rows[0]))
    if engine_rows:
        print("the store on its best engine and depth against the drive's ceiling:")
        resultlib.print_table(engine_rows, list(engine_rows[0]))
    for k in sorted(ratios):
        if ("geomean" in k or k.startswith("load_") or "_best_" in k or "median_vs_ceiling" in k
                or "first_fill" in k or k.startswith("store_best")):
            print(f"{k}: {ratios[k]:.3f} (goal {goals.get(k, '-')})")
    for label, l in load.items():
        print(f"load {label}: {l['slots']} slots of {l['slot_bytes']} B, serial {l['serial_s']:.2f} s "
              f"(median {l['serial_median_s']:.2f}), parallel {l['parallel_s']:.2f} s "
              f"(median {l['parallel_median_s']:.2f}), speedup {l['speedup']:.2f}x")
    for k, v in skipped.items():
        print(f"skipped {k}: {v}")
    for k, v in not_run.items():
        print(f"not run {k}: {v}")
    elapsed = time.perf_counter() - t_start
    print(f"total {elapsed:.0f} s")
    return resultlib.result(
        "disk", rows=rows, ratios=ratios, goals=goals, directory=a.dir, skipped=skipped,
        method=METHOD, total_bytes_per_measurement=total, repeat=a.repeat, elapsed_s=elapsed,
        load=load, best_configuration=best_rows, best_engine_configuration=engine_rows,
        store_engines=engines, not_run=not_run)


CEILING_VARIANTS = ("psync", "libaio", "io_uring", "psync_sync", "libaio_sync",
                    "io_uring_sync")  # every fio variant run
FIRST_PASS = ("psync", "libaio", "io_uring")  # fio writing its file for the first time (no sync)


def best_engine_configuration(measured: dict, ceiling: dict) -> list[dict]:
    """Per (op, page size): the store at its best engine and depth (writes: the steady state,
    slots written before) against the drive's ceiling (the best rate of any fio variant, engine
    and depth): ``store_best_over_drive_ceiling``, the goal (>= 0.9). Medians alongside."""
    out = []
    for op in ("write", "read"):
        for page in sorted({p for p, _ in measured}):
            c = ceiling.get((op, page))
            if not c:
                continue
            best_rate, best_at, store_med, fio_med = 0.0, (None, None), 0.0, 0.0
            for (p, depth), m in measured.items():
                if p != page:
                    continue
                for who, smp in m["samples"].items():
                    if not who.startswith("vitrify") or who.endswith("_rewrite") != (op == "write"):
                        continue
                    xs = smp.get(op, [])
                    engine = who.removeprefix("vitrify").removesuffix("_rewrite").lstrip("_")
                    if xs and max(xs) > best_rate:
                        best_rate, best_at = max(xs), (engine or "psync", depth)
                    if xs:
                        store_med = max(store_med, statistics.median(xs))
                for variant in CEILING_VARIANTS:
                    ys = m["samples"].get(variant, {}).get(op, [])
                    if ys:
                        fio_med = max(fio_med, statistics.median(ys))
            out.append({"op": op, "page_mib": page // MiB, "engine": best_at[0],
                        "depth": best_at[1], "store_MBps": best_rate / 1e6,
                        "ceiling_MBps": c / 1e6, "store_best_over_drive_ceiling": best_rate / c,
                        "store_median_MBps": store_med / 1e6,
                        "ceiling_median_MBps": fio_med / 1e6,
                        "median_over_ceiling_median": store_med / fio_med if fio_med else None})
    return out


def best_configuration(measured: dict, ceiling: dict) -> list[dict]:
    """Per (op, page size): the store at its best depth against the drive's ceiling (the best
    rate any fio variant reached at any depth). Writes compare the store's steady state (slots
    written before, as fio's synced second pass writes blocks it wrote before); the first
    fill is compared with fio's first pass, the same state of the file."""
    out = []
    for op in ("write", "read"):
        for page in sorted({p for p, _ in measured}):
            c = ceiling.get((op, page))
            if not c:
                continue
            who = "vitrify_rewrite" if op == "write" else "vitrify"
            best_rate, best_depth, store_med, fio_med = 0.0, None, 0.0, 0.0
            for (p, depth), m in measured.items():
                if p != page:
                    continue
                xs = m["samples"].get(who, {}).get(op, [])
                if xs and max(xs) > best_rate:
                    best_rate, best_depth = max(xs), depth
                if xs:
                    store_med = max(store_med, statistics.median(xs))
                for variant in CEILING_VARIANTS:
                    ys = m["samples"].get(variant, {}).get(op, [])
                    if ys:
                        fio_med = max(fio_med, statistics.median(ys))
            row = {"op": op, "page_mib": page // MiB, "store": who, "depth": best_depth,
                   "store_MBps": best_rate / 1e6, "ceiling_MBps": c / 1e6,
                   "best_vs_ceiling": best_rate / c,
                   # the same question on medians: one outlier of the drive's many fio samples
                   # (every variant and depth) does not set the bar
                   "store_median_MBps": store_med / 1e6, "ceiling_median_MBps": fio_med / 1e6,
                   "median_vs_ceiling_median": store_med / fio_med if fio_med else None}
            if op == "write":
                first = max((max(m["samples"]["vitrify"]["write"]) for (p, _), m in
                             measured.items() if p == page), default=0.0)
                fp = max((max(m["samples"].get(w, {}).get("write") or [0.0])
                          for (p, _), m in measured.items() if p == page for w in FIRST_PASS),
                         default=0.0)
                row["first_fill_MBps"] = first / 1e6
                row["fio_first_pass_MBps"] = fp / 1e6 if fp else None
                row["first_fill_vs_first_pass"] = first / fp if fp else None
            out.append(row)
    return out


METHOD = {
    "vitrify": "DiskStore, depth write/read threads, zero-copy slot buffers, "
               "fdatasync per batch of <= 32 writes per thread (max_batch default), CRC32C verify",
    "fio": "psync, direct=1, numjobs=depth threads each over its own "
           "contiguous 1/depth of the file (the store's I/O model: depth "
           "threads of synchronous pread/pwrite), sequential write then read, "
           "no fsync",
    "fio_libaio": "libaio, direct=1, iodepth=depth, one job, no fsync "
                  "(reported, no goal)",
    "fio_read_state": "fio reads follow a rewrite of the file with "
                      "fdatasync every 32 writes per job (the store's group "
                      "commit), so both read flushed data",
    "fio_sync": "psync write with fdatasync every 32 writes per job: the "
                "durability-equivalent write baseline (reported, no goal)",
    "naive": "one file per page, buffered write+fsync, depth threads; reads "
             "after posix_fadvise(DONTNEED)",
    "vitrify_tmpfs": "the vitrify measurement on /dev/shm: the store's own ceiling "
                     "without a disk (diagnostic, not a baseline)",
    "drive_ceiling_MBps": "per (op, page size): the best rate ANY fio variant "
                          "reached in this run at ANY depth measured (psync and "
                          "libaio, plain and with fdatasync every 32 writes) - "
                          "what this drive delivers to a good O_DIRECT client. "
                          "Write ceilings usually come from fio_sync, fio's "
                          "second pass over its file (blocks already written); "
                          "vitrify's measurement, like fio's first pass, writes "
                          "into a freshly preallocated file",
    "naive_headroom": "drive_ceiling / naive for the config: the largest "
                      "vs_naive ratio any store could reach on this drive. "
                      "Where it is < 3, the 3x vs_naive goal is unreachable "
                      "here because the naive store already runs near the "
                      "drive's rate, not because the store is slow",
    "vs_ceiling": "vitrify / drive_ceiling: the share of the drive's best "
                  "measured rate the store reaches in this config",
    "vitrify_rewrite": "the store's steady state: after the read, `clear` frees every slot "
                       "and the same pages are written again into the blocks the first fill "
                       "wrote (a store in service reuses slots GC or clear freed), with the "
                       "same fdatasync per batch",
    "best_configuration": "per (op, page size): the store at the depth where it was fastest "
                          "(writes: its steady state) over the drive's ceiling - the goal "
                          "(>= 0.9); the first fill beside fio's first pass (psync or libaio, "
                          "any depth), the same state of the file (fio's first pass does not sync, the "
                          "store's fill does); median_vs_ceiling_median: "
                          "the store's best median over depths against the best median of any "
                          "fio variant and depth (the drive's bursts set neither)",
    "vitrify_<engine>": "the vitrify measurement on the store's aio / io_uring engine: depth "
                        "transfers in flight per direction (min(depth, 2) I/O threads, "
                        "queue_depth = ceil(depth / threads)); write batches go out whole, read "
                        "threads take up to queue_depth queued reads at once",
    "fio_io_uring": "io_uring, direct=1, iodepth=depth, one job (in the ceiling where it runs)",
    "best_engine_configuration": "per (op, page size): the store at its best engine (psync, "
                                 "aio, io_uring) and depth, writes in the steady state, over "
                                 "the drive's ceiling: store_best_over_drive_ceiling, goal "
                                 ">= 0.9; the top-level ratio of that name is the minimum "
                                 "over ops and page sizes",
    "repeat": "each config: every contender measured `repeat` times, "
              "interleaved (all four per repeat, order rotated); *_MBps and "
              "vs_* are best-of-N, *_median_MBps and vs_*_median the medians",
    "load": "cold start load of `slots` live entries (tiny payloads) on the "
            "same filesystem: DiskStore(cold_start='load', load_threads=1) "
            "(one header read after another) vs the default parallel scan, "
            "alternating, best and median of 3; speedup = serial / parallel",
}
