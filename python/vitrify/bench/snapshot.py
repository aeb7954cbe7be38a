"""Restore throughput of span snapshots on a GPU, against limits measured in the same run.

Rows: pinned host->GPU limit (one big cuMemcpyHtoD), restore from a pinned in-memory snapshot,
dump to a span file, the disk's O_DIRECT read rate (dd iflag=direct of that same file, written
just before), restore file->GPU (O_DIRECT, double-buffered, CRC-checked); then the file read
once through the page cache (dd, buffered), the page cache's read rate (dd again) and restore
file->GPU with ``direct_io`` auto, which reads a cached file through the cache (a restart soon
after the archive was read).
Goals: restore host->GPU >= 0.90 of the pinned limit; restore file->GPU >= 0.90 of
min(pinned limit, disk read rate). The cached restore's ratio to min(pinned limit, page-cache
read rate) is reported without a goal yet.

    vitrify bench snapshot [--out DIR] [--size-gib 4] [--dir PATH] [--quick]

Needs a CUDA GPU, --size-gib of GPU memory and of free space in --dir.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable

from vitrify import _native, config, snapshot
from vitrify._units import GiB, MiB

from . import resultlib
from .cli import existing_dir, positive_float


def dd_read_rate(path: str, direct: bool, count: int | None = None) -> tuple[float, str]:
    """Bytes/s of `dd if=path of=/dev/null bs=64M [iflag=direct] [count=N]`, parsed from its
    summary (``count``: the first N blocks of 64 MiB only)."""
    cmd = (["dd", f"if={path}", "of=/dev/null", "bs=64M"] + (["iflag=direct"] if direct else [])
           + ([f"count={int(count)}"] if count is not None else []))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    m = re.search(r"^(\d+) bytes .* copied, ([0-9.]+) s", p.stderr, re.M)
    if m:
        return int(m.group(1)) / float(m.group(2)), " ".join(cmd)
    return os.path.getsize(path) / dt, " ".join(cmd)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--size-gib", type=positive_float, default=4.0,
                    help="bytes restored, in GiB (default: 4; rounded down to 2 MiB)")
    ap.add_argument("--dir", type=existing_dir, default=None,
                    help="directory for the span file, on the drive to measure (default: "
                         "$VITRIFY_BENCH_DIR, else the system temp directory)")
    ap.add_argument("--quick", action="store_true", help="2 GiB instead of --size-gib")


def unavailable(args: argparse.Namespace) -> str | None:
    return resultlib.needs_gpu()


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    size = int((2.0 if args.quick else args.size_gib) * GiB) // (2 * MiB) * (2 * MiB)
    if size <= 0:
        raise ValueError(f"--size-gib {args.size_gib}: below the 2 MiB granularity")
    root = args.dir or config.settings().bench_dir or tempfile.gettempdir()
    work = tempfile.mkdtemp(prefix="bench-snapshot-", dir=root)
    probe = _native.probe_direct_io(work)
    direct = "on" if probe["supported"] else "off"
    rows: list[dict] = []
    try:
        t0 = time.perf_counter()
        span = snapshot.ScratchSpan(0, size, 0, [True] * (size // (2 * MiB)))

        progress(f"pinned H2D limit: one {size >> 20} MiB copy")
        # limit 1: one big pinned H2D copy (it overwrites the span, so it runs before the fill)
        t_lim = _native.measure_pinned_h2d(0, span.base, size, 3)
        h2d_limit = size / t_lim
        rows.append({"path": "pinned H2D limit (one copy)", "GB/s": h2d_limit / 1e9,
                     "seconds": t_lim})

        block = os.urandom(64 * MiB)
        for off in range(0, size, len(block)):
            span.write(off, block[: min(len(block), size - off)])

        progress("restore host->GPU from a pinned snapshot")
        snap = snapshot.dump(span.base, 0, size, target=0, pin=True)
        best = 1e30
        for _ in range(3):
            t = time.perf_counter()
            snapshot.restore(snap, span.base, size, target=0)
            best = min(best, time.perf_counter() - t)
        host_rate = size / best
        rows.append({"path": "restore host->GPU (pinned snapshot)", "GB/s": host_rate / 1e9,
                     "seconds": best})
        del snap

        progress(f"dump GPU->file, disk read limit (dd), restore file->GPU in {work}")
        path = os.path.join(work, "span.span")
        d = snapshot.dump_to_file(path, span.base, 0, size, target=0, direct_io=direct)
        rows.append({"path": f"dump GPU->file (O_DIRECT {direct})", "GB/s": size / d["seconds"] / 1e9,
                     "seconds": d["seconds"]})

        disk_rate, dd_cmd = dd_read_rate(path, probe["supported"])
        rows.append({"path": "disk read limit (" + dd_cmd.split(" ", 1)[0] + " iflag=direct)"
                     if probe["supported"] else "disk read limit (dd, buffered)",
                     "GB/s": disk_rate / 1e9, "seconds": os.path.getsize(path) / disk_rate})

        span.write(0, b"\0" * (64 * MiB))  # make a wrong restore visible
        best_file = None
        for _ in range(2):
            r = snapshot.restore_from_file(path, span.base, size, target=0, direct_io=direct)
            if best_file is None or r["seconds"] < best_file["seconds"]:
                best_file = r
        file_rate = size / best_file["seconds"]
        rows.append({"path": f"restore file->GPU (O_DIRECT {direct})", "GB/s": file_rate / 1e9,
                     "seconds": best_file["seconds"]})
        assert span.read(0, 64 * MiB) == block, "file restore produced wrong bytes"
        disk_rate2, _ = dd_read_rate(path, probe["supported"])
        rows.append({"path": "disk read limit, again after restore", "GB/s": disk_rate2 / 1e9,
                     "seconds": os.path.getsize(path) / disk_rate2})
        file_limit = min(h2d_limit, max(disk_rate, disk_rate2))

        progress("the page cache: read the file once, its read rate, restore file->GPU (auto)")
        first, _ = dd_read_rate(path, False)
        rows.append({"path": "page cache fill (dd, buffered)", "GB/s": first / 1e9,
                     "seconds": os.path.getsize(path) / first})
        cache_rate, _ = dd_read_rate(path, False)
        rows.append({"path": "page cache read limit (dd, buffered, cached)",
                     "GB/s": cache_rate / 1e9, "seconds": os.path.getsize(path) / cache_rate})
        share = snapshot.page_cache_share(path)
        span.write(0, b"\0" * (64 * MiB))
        best_cached = None
        for _ in range(2):
            r = snapshot.restore_from_file(path, span.base, size, target=0, direct_io="auto")
            if best_cached is None or r["seconds"] < best_cached["seconds"]:
                best_cached = r
        cached_rate = size / best_cached["seconds"]
        rows.append({"path": "restore file->GPU (auto: "
                             + ("O_DIRECT" if best_cached["direct_io"] else "page cache") + ")",
                     "GB/s": cached_rate / 1e9, "seconds": best_cached["seconds"]})
        assert span.read(0, 64 * MiB) == block, "cached restore produced wrong bytes"
        span.close()
        ratios = {"restore_host_vs_pinned_h2d": host_rate / h2d_limit,
                  "restore_file_vs_min_limit": file_rate / file_limit,
                  "restore_cached_vs_min_limit": cached_rate / min(h2d_limit, cache_rate)}
        goals = {"restore_host_vs_pinned_h2d": 0.90, "restore_file_vs_min_limit": 0.90}
        res = resultlib.result("snapshot", rows=rows, ratios=ratios, goals=goals, directory=work,
                               size_bytes=size, direct_io=direct, o_direct_probe=dict(probe),
                               page_cache_share=share,
                               wall_seconds=time.perf_counter() - t0)
        resultlib.print_table(rows, ["path", "GB/s", "seconds"])
        for k, v in ratios.items():
            print(f"{k}: {v:.3f}" + (f" (goal >= {goals[k]:.2f}) "
                                     f"{'MET' if v >= goals[k] else 'MISSED'}" if k in goals
                                     else " (no goal)"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res
