"""Kernels of one name defined by several binaries, for graph_worker.py's ``samename`` case.

Inductor, Triton and every JIT compile one kernel name per specialisation, so a captured graph
routinely holds kernels whose names alone do not say which binary the process launched. Each case
here captures such kernels; FREEZE must resolve every node to the binary it really ran (by the
handle the driver loaded it through) and THAW must give byte-identical outputs:

- ``triton_*``: one ``@triton.jit`` kernel compiled with two constexpr values, both in one graph
  and each in a graph of its own (module API: Triton loads with ``cuModuleLoadData``);
- ``compiled_bs*``: a ``torch.compile``d step (``dynamic=False``) at five batch sizes, one compile
  and one set of same-named Inductor kernels per size;
- ``library_*`` / ``module_*``: two cubins built with nvcc from one source with different
  constants, loaded through the CUDA library API (``cuLibraryLoadData``, lazily loaded into the
  context at first launch) and through the module API, launched by ctypes on torch's stream.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

COMPILED_BATCH_SIZES = (1, 2, 4, 8, 16)

_CU_SOURCE = r"""
extern "C" __global__ void vitrify_same_name(float* y, const float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * VITRIFY_SCALE + VITRIFY_SHIFT;
}
"""


def _nvcc() -> str | None:
    for d in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if d and os.path.exists(os.path.join(d, "bin", "nvcc")):
            return os.path.join(d, "bin", "nvcc")
    return shutil.which("nvcc")


def _cubins(arch: str, variants: list[tuple[str, str]]) -> list[bytes]:
    nvcc = _nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (CUDA_HOME, /usr/local/cuda, PATH)")
    out = []
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "same_name.cu")
        with open(src, "w") as f:
            f.write(_CU_SOURCE)
        for i, (scale, shift) in enumerate(variants):
            dst = os.path.join(d, f"v{i}.cubin")
            subprocess.run([nvcc, "-cubin", f"-arch={arch}", f"-DVITRIFY_SCALE={scale}",
                            f"-DVITRIFY_SHIFT={shift}", "-o", dst, src], check=True,
                           capture_output=True, timeout=120)
            with open(dst, "rb") as f:
                out.append(f.read())
    return out


class _Driver:
    """The few driver calls the library/module cases make, through ctypes (as a JIT would)."""

    def __init__(self):
        c = ctypes.CDLL("libcuda.so.1")
        vp, u = ctypes.c_void_p, ctypes.c_uint
        c.cuLibraryLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, vp, vp, u, vp, vp, u]
        c.cuLibraryGetKernel.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        c.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        c.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        c.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), vp]
        self.c = c

    def _check(self, r: int, call: str) -> None:
        if r != 0:
            raise RuntimeError(f"{call} failed: CUresult {r}")

    def library_kernel(self, image: bytes, name: bytes) -> int:
        lib, k = ctypes.c_void_p(), ctypes.c_void_p()
        r = self.c.cuLibraryLoadData(ctypes.byref(lib), image, None, None, 0, None, None, 0)
        self._check(r, "cuLibraryLoadData")
        self._check(self.c.cuLibraryGetKernel(ctypes.byref(k), lib, name), "cuLibraryGetKernel")
        return k.value  # a CUkernel, launched as a CUfunction (context-independent)

    def module_function(self, image: bytes, name: bytes) -> int:
        mod, f = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.c.cuModuleLoadData(ctypes.byref(mod), image), "cuModuleLoadData")
        self._check(self.c.cuModuleGetFunction(ctypes.byref(f), mod, name), "cuModuleGetFunction")
        return f.value

    def launch(self, fn: int, y: int, x: int, n: int, stream: int) -> None:
        ay, ax, an = ctypes.c_uint64(y), ctypes.c_uint64(x), ctypes.c_int(n)
        args = (ctypes.c_void_p * 3)(ctypes.addressof(ay), ctypes.addressof(ax),
                                     ctypes.addressof(an))
        self._check(self.c.cuLaunchKernel(fn, (n + 255) // 256, 1, 1, 256, 1, 1, 0, stream, args,
                                          None), "cuLaunchKernel")


def cases(torch, out_skipped: dict) -> list:
    """(name, fn) pairs; every fn returns a contiguous tensor allocated in the region."""
    out = []
    torch.manual_seed(3)
    # --- Triton: one kernel name, two constexpr specialisations.
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def vitrify_axpb(x_ptr, y_ptr, n, A: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * A + B, mask=m)

        n = 1 << 16
        xt = torch.randn(n, device="cuda")

        def axpb(x, a, b):
            y = torch.empty_like(x)
            vitrify_axpb[(triton.cdiv(n, 1024),)](x, y, n, A=a, B=b, BLOCK=1024)
            return y

        out.append(("triton_both_in_one_graph", lambda: axpb(axpb(xt, 2.0, 1.0), 3.0, -1.0)))
        out.append(("triton_a2", lambda: axpb(xt, 2.0, 1.0)))
        out.append(("triton_a3", lambda: axpb(xt, 3.0, -1.0)))
    except Exception as e:  # no triton here
        out_skipped["triton"] = f"{type(e).__name__}: {e}"[:300]
    # --- torch.compile at several batch sizes: one compile, same-named kernels, per size.
    try:
        import torch._dynamo as dynamo

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 64)
        w = torch.randn(256, 256, device="cuda") * 0.05
        g = torch.randn(256, device="cuda")

        def step(x):
            h = torch.nn.functional.gelu(x @ w) * g
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) + x

        cstep = torch.compile(step, dynamic=False)
        for bs in COMPILED_BATCH_SIZES:
            xb = torch.randn(bs, 256, device="cuda")
            cstep(xb)  # compile now: a failure is a skip, not an error
            out.append((f"compiled_bs{bs}", lambda xb=xb: cstep(xb)))
    except Exception as e:
        out_skipped["compiled"] = f"torch.compile failed: {type(e).__name__}: {e}"[:300]
    # --- The CUDA library API (lazy loading) and the module API, through ctypes.
    try:
        major, minor = torch.cuda.get_device_capability()
        images = _cubins(f"sm_{major}{minor}", [("2.0f", "1.0f"), ("3.0f", "-1.0f"),
                                                ("5.0f", "0.5f"), ("7.0f", "-2.0f")])
        drv = _Driver()
        name = b"vitrify_same_name"
        lib_k = [drv.library_kernel(images[0], name), drv.library_kernel(images[1], name)]
        mod_f = [drv.module_function(images[2], name), drv.module_function(images[3], name)]
        n = 1 << 15
        x = torch.randn(n, device="cuda")

        def chain(fns):
            def run():
                stream = torch.cuda.current_stream().cuda_stream
                ys = [torch.empty_like(x) for _ in fns]
                src = x
                for fn, y in zip(fns, ys):
                    drv.launch(fn, y.data_ptr(), src.data_ptr(), n, stream)
                    src = y
                return ys[-1]
            return run

        out.append(("library_both_in_one_graph", chain(lib_k)))
        out.append(("library_second", chain(lib_k[1:])))
        out.append(("module_both_in_one_graph", chain(mod_f)))
        out.append(("library_and_module_mixed", chain([lib_k[1], mod_f[0], lib_k[0], mod_f[1]])))
    except Exception as e:
        out_skipped["library"] = f"{type(e).__name__}: {e}"[:300]
    return out
