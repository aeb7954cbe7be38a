"""Which cuMemAddressReserve hints does the driver honour? (H200 experiment, 2026-11-29)

For each (size, alignment, hint) reserve in a fresh process, record the address returned, free
it. Run once without torch and once after torch initialised CUDA. Prints one JSON object.
"""
import ctypes
import json
import sys

GiB = 1 << 30
MiB = 1 << 20


def main(with_torch: bool) -> dict:
    if with_torch:
        import torch
        torch.cuda.init()
        torch.zeros(1, device="cuda")
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    dev = ctypes.c_int()
    assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    reserve = cu.cuMemAddressReserve
    reserve.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_size_t,
                        ctypes.c_uint64, ctypes.c_ulonglong]
    free = cu.cuMemAddressFree
    free.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    rows = []
    hints = [0x100000000000, 0x200000000000, 0x400000000000, 0x600000000000, 0x7e0000000000,
             0x7f0000000000, 0x7f8000000000]
    sizes = [2 * MiB, 64 * MiB, 512 * MiB, GiB, 2 * GiB, 4 * GiB, 16 * GiB, 64 * GiB, 256 * GiB]
    for size in sizes:
        for align in (0, 2 * MiB, GiB):
            for hint in hints:
                p = ctypes.c_uint64(0)
                r = reserve(ctypes.byref(p), size, align, hint, 0)
                rows.append({"size": size, "align": align, "hint": hex(hint), "result": r,
                             "got": hex(p.value), "exact": r == 0 and p.value == hint})
                if r == 0:
                    free(p.value, size)
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            if b - a >= GiB:
                maps.append(line.strip())
    return {"with_torch": with_torch, "rows": rows, "big_maps": maps}


if __name__ == "__main__":
    print(json.dumps(main(len(sys.argv) > 1 and sys.argv[1] == "torch")))
