"""vitrify's benchmarks, run with ``vitrify bench NAME`` (``vitrify bench --help`` lists them).

Every benchmark measures its baseline in the same run (fio, a naive implementation, torch's own
path, the hardware limit) and reports ratios against it. It prints a short progress line per step
(on stderr) and its table (on stdout), writes one JSON result file ``<name>-<YYYY-MM-DD>.json``
into ``--out`` (default: the current directory; the convention is in ``benchmarks/README.md`` of
the repository and in :mod:`vitrify.bench.resultlib`), and with ``--plot`` also a PNG of its
ratios next to it (needs matplotlib).

========  =====================================================================  ==============
name      what it compares                                                       needs
========  =====================================================================  ==============
disk      ``DiskStore`` vs fio (O_DIRECT) vs a naive file-per-page store         fio for the fio
                                                                                 and ceiling
                                                                                 columns
host      pool registration, page copies vs the pinned-copy limit, gather vs     numpy; a GPU
          memcpy                                                                 for all but
                                                                                 gather
region    on-demand vs preallocated region allocations, map chunk sizes, torch   a GPU
snapshot  span restore vs the pinned H2D limit and the disk's read rate          a GPU
graphs    CUDA graph rebuild in a fresh process vs capture, replay vs torch      a GPU, torch
hicache   vitrify's HiCache L3 backend vs SGLang's file backend                  SGLang
coldstart process start -> first token: cold engine vs thaw, above the            a GPU, torch,
          import-torch + CUDA-context floor; weight restore vs disk and PCIe     transformers
weights   weight update (two processes, staged) vs D2D copies and per-tensor     a GPU, torch
          CUDA IPC; bytes moved by a 1 % delta
========  =====================================================================  ==============

Exit status of ``vitrify bench``: 0 when the benchmark ran and wrote its result, or when it cannot
run on this machine (one line ``vitrify bench NAME: skipped: <why>``; ``--strict`` makes that 3);
1 when it failed (one line naming the error; ``VITRIFY_LOG_LEVEL=ERROR`` adds the traceback) or a
check of its results failed; 2 for bad arguments (one line naming the argument), including
``--plot`` without matplotlib.

Each benchmark module provides ``add_arguments(parser)``, ``unavailable(args) -> str | None`` (why
it cannot run here), ``run(args, progress) -> dict`` (measures, prints its table, returns the
result object) and optionally ``problem(result) -> str | None`` (a failed check).
"""

from __future__ import annotations

# name -> one line for `vitrify bench --help`; the module vitrify.bench.<name> implements it
BENCHMARKS: dict[str, str] = {
    "disk": "disk tier: DiskStore vs fio (O_DIRECT) vs a naive file-per-page store",
    "host": "host tier: registration, page copies vs the pinned limit, gather vs memcpy",
    "region": "region: on-demand vs preallocated allocations, map chunk sizes, torch routing",
    "snapshot": "span snapshots: restore vs the pinned H2D limit and the disk read rate (GPU)",
    "graphs": "CUDA graphs: rebuild in a fresh process vs capture, replay vs torch (GPU)",
    "hicache": "SGLang HiCache L3: vitrify's backend vs SGLang's file backend (needs SGLang)",
    "coldstart": "engine start: cold vs thaw to the first token, above the import/context floor "
                 "(GPU)",
    "weights": "weight update between two processes vs one and two D2D copies and per-tensor "
               "CUDA IPC; a 1 % delta (GPU)",
}

__all__ = ["BENCHMARKS"]
