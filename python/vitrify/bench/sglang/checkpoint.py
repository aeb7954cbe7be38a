"""A seeded checkpoint for the SGLang end-to-end runs: N(0, 0.02) matrices, unit norms, Hugging
Face names, safetensors files.

Owns: drawing the tensors (:func:`make_tensor`, :func:`tensors`: each from its own generator,
seeded by the run's seed and the tensor's name, so any one tensor can be drawn again alone, in any
order), writing them as safetensors (:func:`write_safetensors`: the ``safetensors`` package when
it is importable, else the format written here with the standard library), sharding a large model
the way Hugging Face does (``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json``), and the manifest that lets a later run reuse what an earlier
one wrote (:func:`write`).

Why not SGLang's ``--load-format dummy``: its uniform +-1e-3 weights put attention's
contribution below bf16 resolution, so two prompts that share only their last token get
bit-identical logprobs and no end-to-end check can see a wrong KV cache. With N(0, 0.02)
matrices and unit norms the outputs depend on the whole context.

The values depend on the device kind that draws them (torch's CUDA and CPU generators differ):
the manifest records it, and a checkpoint drawn on another kind is written again.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from .models import is_norm, parameter_shapes

WRITER = "vitrify.bench.sglang.checkpoint/1"
MANIFEST = "vitrify-checkpoint.json"
INDEX = "model.safetensors.index.json"
STD = 0.02
SHARD_BYTES = 4 << 30  # Hugging Face shards at 5 GB; 8B's 16 GB is four files

# torch dtype name -> safetensors dtype tag
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
           "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
           "bool": "BOOL"}


def default_device() -> str:
    """``"cuda"`` where torch sees a GPU (seconds for 8B), else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` in the checkpoint of ``seed`` (63 bits)."""
    d = hashlib.sha256(f"{int(seed)}\0{name}".encode()).digest()
    return int.from_bytes(d[:8], "little") & ((1 << 63) - 1)


def make_tensor(name: str, shape: Iterable[int], seed: int, device: str, std: float = STD):
    """Tensor ``name`` (bf16 on ``device``): ones for an RMSNorm scale, else N(0, ``std``) drawn
    from its own generator (:func:`tensor_seed`)."""
    import torch

    shape = tuple(int(n) for n in shape)
    if is_norm(name):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device)
    g.manual_seed(tensor_seed(seed, name))
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    return t.mul_(std).to(torch.bfloat16)


def tensors(cfg: dict, seed: int, device: Optional[str] = None, std: float = STD) -> dict:
    """Every tensor of ``cfg``'s checkpoint (HF names, bf16, on ``device``): what :func:`write`
    writes for the same arguments, bit for bit."""
    device = device or default_device()
    return {n: make_tensor(n, s, seed, device, std) for n, s in parameter_shapes(cfg).items()}


def plan_shards(shapes: dict, shard_bytes: int = SHARD_BYTES, itemsize: int = 2) -> list[list[str]]:
    """The names in each file, in order: a new file when the next tensor would take the current
    one past ``shard_bytes`` (a tensor larger than that gets a file of its own)."""
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = itemsize
        for d in shape:
            n *= d
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _shapes_digest(shapes: dict) -> str:
    return hashlib.sha256(json.dumps({k: list(v) for k, v in shapes.items()}).encode()).hexdigest()


def manifest_of(model_dir: str) -> dict:
    """The manifest :func:`write` left in ``model_dir``, or {}."""
    try:
        d = json.loads(Path(model_dir, MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _current(model_dir: str, want: dict) -> Optional[dict]:
    """The manifest when the checkpoint in ``model_dir`` is the one ``want`` describes (same
    writer, seed, std, device kind, names and shapes) and every file has its recorded size."""
    have = manifest_of(model_dir)
    if not have or any(have.get(k) != v for k, v in want.items()):
        return None
    for name, size in (have.get("files") or {}).items():
        p = Path(model_dir, name)
        if not p.is_file() or p.stat().st_size != size:
            return None
    return have if have.get("files") else None


def write(model_dir: str, cfg: dict, *, seed: int = 0, std: float = STD,
          device: Optional[str] = None, shard_bytes: int = SHARD_BYTES,
          writer: str = "auto") -> dict:
    """Write ``cfg``'s checkpoint of ``seed`` into ``model_dir`` (created) and return its
    manifest; a checkpoint an earlier call wrote with the same arguments is kept (the manifest
    says ``"reused": true``). Tensors are drawn on ``device`` (default :func:`default_device`)
    one file at a time, moved to memory and written (``writer``: see
    :func:`write_safetensors`). ``config.json`` is not written here."""
    import torch

    device = device or default_device()
    kind = torch.device(device).type
    shapes = parameter_shapes(cfg)
    want = {"writer": WRITER, "seed": int(seed), "std": float(std), "device_kind": kind,
            "shapes_sha256": _shapes_digest(shapes)}
    os.makedirs(model_dir, exist_ok=True)
    have = _current(model_dir, want)
    if have is not None:
        return {**have, "reused": True}
    Path(model_dir, MANIFEST).unlink(missing_ok=True)  # gone until the new files are complete
    shards = plan_shards(shapes, shard_bytes)
    names = shard_names(len(shards))
    for p in Path(model_dir).iterdir():  # another plan's files must not be loaded beside these
        stale = (p.name.endswith(".safetensors") and p.name not in names) or p.name == INDEX \
            or p.name.endswith(".safetensors.tmp")
        if stale:
            p.unlink()
    t0 = time.monotonic()
    files: dict[str, int] = {}
    weight_map: dict[str, str] = {}
    used = ""
    total = 0
    for fname, members in zip(names, shards):
        part = {n: make_tensor(n, shapes[n], seed, device, std).cpu() for n in members}
        path = os.path.join(model_dir, fname)
        used = write_safetensors(path + ".tmp", part, {"format": "pt"}, writer=writer)
        os.replace(path + ".tmp", path)
        files[fname] = os.path.getsize(path)
        total += sum(t.numel() * t.element_size() for t in part.values())
        weight_map.update({n: fname for n in members})
        del part
    if kind == "cuda":  # the servers this process launches size their pools from free memory
        torch.cuda.empty_cache()
    if len(names) > 1:
        Path(model_dir, INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    out = {**want, "norms": "ones", "dtype": "bfloat16", "files": files, "bytes": total,
           "parameters": total // 2, "safetensors_writer": used,
           "seconds": round(time.monotonic() - t0, 2)}
    tmp = Path(model_dir, MANIFEST + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, Path(model_dir, MANIFEST))
    return {**out, "reused": False}


def write_safetensors(path: str, named: dict, metadata: Optional[dict] = None, *,
                      writer: str = "auto") -> str:
    """Write CPU tensors ``named`` to ``path`` as safetensors; which writer wrote it:
    ``"safetensors <version>"`` (the package; ``writer="auto"`` when it is importable, or
    ``"package"``) or ``"stdlib"`` (``writer="stdlib"``, or ``"auto"`` without the package)."""
    if writer not in ("auto", "package", "stdlib"):
        raise ValueError(f"writer must be 'auto', 'package' or 'stdlib', got {writer!r}")
    if writer != "stdlib":
        try:
            import safetensors
            from safetensors.torch import save_file
        except ImportError:
            if writer == "package":
                raise
        else:
            save_file({n: t.contiguous() for n, t in named.items()}, path, metadata=metadata)
            return f"safetensors {safetensors.__version__}"
    _write_stdlib(path, named, metadata)
    return "stdlib"


def _dtype_tag(t: Any) -> str:
    name = str(t.dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"no safetensors dtype for {t.dtype}")
    return _DTYPES[name]


def _write_stdlib(path: str, named: dict, metadata: Optional[dict]) -> None:
    """The safetensors format: an 8-byte little-endian header length, a JSON header (each
    tensor's dtype, shape and ``data_offsets`` into the data, ``__metadata__``: str -> str),
    padded with spaces to a multiple of 8, then the tensors' raw bytes back to back."""
    parts = []
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in named.items():
        if t.device.type != "cpu":
            raise ValueError(f"tensor {name!r} is on {t.device}; move it to the CPU first")
        t = t.contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _dtype_tag(t), "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        parts.append((t, n))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t, n in parts:
            if n:
                f.write(memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())))


def read_header(path: str) -> dict:
    """The JSON header of a safetensors file (``__metadata__`` included), read with the standard
    library; ValueError when the file is not one."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: shorter than a safetensors header length")
        n = int.from_bytes(raw, "little")
        size = os.fstat(f.fileno()).st_size
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} runs past the file's {size} bytes")
        try:
            return json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: the header is not JSON ({e})") from None
