"""Why does cuGraphAddMemcpyNode refuse the demo's captured D2D copy at THAW? (H200, 2026-11-29)

Freezes the demo engine in a subprocess, then in this process (no torch) restores its region,
prints the recorded memcpy nodes and tries cuGraphAddMemcpyNode with variants of the params."""
import ctypes as C
import json
import subprocess
import sys
import tempfile
from pathlib import Path

tmp = Path(tempfile.mkdtemp())
arch = str(tmp / "a.vitrify")
p = subprocess.run([sys.executable, "-m", "vitrify.demo", "freeze", arch],
                   capture_output=True, text=True)
assert p.returncode == 0, p.stderr[-3000:]

import vitrify  # noqa: E402
import vitrify.graph as tg  # noqa: E402
from vitrify import Region, _native  # noqa: E402
from vitrify import archive as ar  # noqa: E402

a = ar.open_archive(arch)
st, reg = a.state(0), a.manifest["region"]
r = Region(reg["size"], base=reg["base"])
r.preallocate(st["final_offset"])
for n in ("weights", "warmup"):
    a.restore_span(0, n, r.base, st["final_offset"])
idx = tg.read_index(Path(arch) / "rank0")
g0 = idx["graphs"][0]
data = (Path(arch) / "rank0" / g0["file"]).read_bytes()
d = _native.graph_describe(data)
mem = [(i, n) for i, n in enumerate(d["nodes"]) if n["kind"] == "memcpy"]
out = {"graph": g0["name"], "memcpy_nodes": mem, "region": [hex(r.base), st["final_offset"]]}

cu = C.CDLL("libcuda.so.1")


class M3(C.Structure):
    _fields_ = [("srcXInBytes", C.c_size_t), ("srcY", C.c_size_t), ("srcZ", C.c_size_t),
                ("srcLOD", C.c_size_t), ("srcMemoryType", C.c_int), ("srcHost", C.c_void_p),
                ("srcDevice", C.c_uint64), ("srcArray", C.c_void_p), ("reserved0", C.c_void_p),
                ("srcPitch", C.c_size_t), ("srcHeight", C.c_size_t),
                ("dstXInBytes", C.c_size_t), ("dstY", C.c_size_t), ("dstZ", C.c_size_t),
                ("dstLOD", C.c_size_t), ("dstMemoryType", C.c_int), ("dstHost", C.c_void_p),
                ("dstDevice", C.c_uint64), ("dstArray", C.c_void_p), ("reserved1", C.c_void_p),
                ("dstPitch", C.c_size_t), ("dstHeight", C.c_size_t),
                ("WidthInBytes", C.c_size_t), ("Height", C.c_size_t), ("Depth", C.c_size_t)]


ctx = C.c_void_p()
cu.cuCtxGetCurrent(C.byref(ctx))
out["ctx"] = ctx.value
res = []
for i, n in mem:
    def mk(**over):
        m = M3()
        m.srcMemoryType, m.dstMemoryType = n["src_type"], n["dst_type"]
        m.srcDevice, m.dstDevice = n["src"], n["dst"]
        m.srcXInBytes, m.srcY, m.srcZ = n["src_x"], n["src_y"], n["src_z"]
        m.dstXInBytes, m.dstY, m.dstZ = n["dst_x"], n["dst_y"], n["dst_z"]
        m.srcPitch, m.srcHeight = n["src_pitch"], n["src_height"]
        m.dstPitch, m.dstHeight = n["dst_pitch"], n["dst_height"]
        m.WidthInBytes, m.Height, m.Depth = n["width"], n["height"], n["depth"]
        for k, v in over.items():
            setattr(m, k, v)
        return m
    w = n["width"]
    variants = {
        "as_recorded": {},
        "types_device": {"srcMemoryType": 2, "dstMemoryType": 2},
        "pitch_width_h1": {"srcPitch": w, "dstPitch": w, "srcHeight": 1, "dstHeight": 1},
        "both": {"srcMemoryType": 2, "dstMemoryType": 2, "srcPitch": w, "dstPitch": w,
                 "srcHeight": 1, "dstHeight": 1},
        "no_xyz": {"srcXInBytes": 0, "srcY": 0, "srcZ": 0, "dstXInBytes": 0, "dstY": 0, "dstZ": 0},
    }
    for name, over in variants.items():
        g = C.c_void_p()
        assert cu.cuGraphCreate(C.byref(g), 0) == 0
        node = C.c_void_p()
        m = mk(**over)
        rc = cu.cuGraphAddMemcpyNode(C.byref(node), g, None, C.c_size_t(0), C.byref(m), ctx)
        res.append({"node": i, "variant": name, "rc": rc})
        cu.cuGraphDestroy(g)
    rc = cu.cuMemcpyDtoD_v2(C.c_uint64(n["dst"]), C.c_uint64(n["src"]), C.c_size_t(w))
    res.append({"node": i, "variant": "cuMemcpyDtoD", "rc": rc})
    for which in ("src", "dst"):
        t = C.c_uint()
        rc = cu.cuPointerGetAttribute(C.byref(t), 2, C.c_uint64(n[which]))  # MEMORY_TYPE
        res.append({"node": i, "variant": f"ptr_type_{which}", "rc": rc, "type": t.value,
                    "addr": hex(n[which]), "in_region": r.base <= n[which] < r.base + r.size})
# The same node with an explicit context: the primary context, not current / current.
prim = C.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(C.byref(prim), 0) == 0
for i, n in mem:
    for label, cur in (("primary_not_current", False), ("primary_current", True)):
        if cur:
            cu.cuCtxSetCurrent(prim)
        for pass_ctx in ("primary", "null"):
            g = C.c_void_p()
            assert cu.cuGraphCreate(C.byref(g), 0) == 0
            node = C.c_void_p()
            m = M3()
            m.srcMemoryType = m.dstMemoryType = 2
            m.srcDevice, m.dstDevice = n["src"], n["dst"]
            m.WidthInBytes, m.Height, m.Depth = n["width"], 1, 1
            rc = cu.cuGraphAddMemcpyNode(C.byref(node), g, None, C.c_size_t(0), C.byref(m),
                                         prim if pass_ctx == "primary" else None)
            res.append({"node": i, "variant": f"{label}, ctx={pass_ctx}", "rc": rc})
            cu.cuGraphDestroy(g)
out["tries"] = res
# The native rebuild of the same graphs: one build thread, then two.
loads = {}
for threads in (1, 2):
    for names in (["decode_bs1"], None):
        key = f"threads={threads} names={names}"
        try:
            gs = tg.load_from_archive(a, 0, region_base=r.base, threads=threads, names=names)
            gs.wait_all()
            loads[key] = "ok"
            gs.close()
        except Exception as e:
            loads[key] = f"{type(e).__name__}: {e}"[:300]
out["loads"] = loads
print(json.dumps(out))
