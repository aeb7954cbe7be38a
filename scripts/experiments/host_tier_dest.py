"""Host-tier get (PageMover from a HostStore in /dev/shm) into different destinations: numpy
memory (as `vitrify bench host` uses) at several distances modulo 4096, torch pageable memory,
and torch pinned memory (as SGLang's host KV pool is) where a GPU is present; 9 MiB pages of
Qwen3-8B's KV, page_first; and the copier's thread count. Prints one line per case (GB/s, best of 3). A probe: the in-server
host-tier gets ran at ~13 GB/s while the benchmark read 45 GB/s on the same machine.

    python3 scripts/experiments/host_tier_dest.py [PAGES]
"""
import shutil
import sys
import time

import numpy as np
import torch

from vitrify import disk, host, tier

L, P, H, D = 36, 64, 8, 128
pages = int(sys.argv[1]) if len(sys.argv) > 1 else 48
comp = pages * L * P * H * D * 2
d = "/dev/shm/vitrify-probe-dest"
shutil.rmtree(d, ignore_errors=True)


def layout(k, v):
    return host.PageLayout.page_first([k, v], layers=L, pages=pages, page_tokens=P, heads=H,
                                      head_dim=D, item_bytes=2)


src = [np.random.randint(0, 255, comp, dtype=np.uint8) for _ in range(2)]
lsrc = layout(src[0].ctypes.data, src[1].ctypes.data)
blob = lsrc.blob_bytes
store = tier.HostStore((pages * 5 // 4 + 1) * (blob + 8192) + (64 << 20), {"kv": blob}, dir=d,
                       name="probe")
keys = [f"k{i}" for i in range(pages)]
disk.PageMover(store, 4, "kv").put_pages(keys, lsrc, list(range(pages)))
dests = {"numpy": [np.zeros(comp, np.uint8) for _ in range(2)],
         "torch pageable": [torch.zeros(comp, dtype=torch.uint8) for _ in range(2)]}
for off in (64, 128, 2048):  # the destination's distance modulo 4096 from the slot payloads
    dests[f"numpy at +{off}"] = [np.zeros(comp + 8192, np.uint8)[off:off + comp]
                                 for _ in range(2)]
if torch.cuda.is_available():
    dests["torch pinned"] = [torch.zeros(comp, dtype=torch.uint8, pin_memory=True)
                             for _ in range(2)]


def addr(b):
    return b.ctypes.data if isinstance(b, np.ndarray) else b.data_ptr()


for threads in (16, 8):
    copier = host.Copier(threads)
    for name, bufs in dests.items():
        lay = layout(addr(bufs[0]), addr(bufs[1]))
        mover = disk.PageMover(store, 4, "kv", copier=copier)
        best = 1e9
        for _ in range(3):
            t = time.perf_counter()
            hits, _ = mover.get_pages(keys, lay, list(range(pages)))
            best = min(best, time.perf_counter() - t)
            assert all(hits)
        print(f"{name:15s} (dst % 4096 = {addr(bufs[0]) % 4096:4d}) copier {threads:2d} "
              f"threads: {pages * blob / best / 1e9:6.2f} GB/s", flush=True)
store.close()
shutil.rmtree(d, ignore_errors=True)
