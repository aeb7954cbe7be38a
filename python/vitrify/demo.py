"""``vitrify demo``: run vitrify's main jobs on this machine, saying plainly what was skipped and why.

Two parts run on any Linux machine (no GPU, no torch, no numpy):

tiers
    A stand-in KV cache (K and V, layer-first, random bytes) is spilled page by page into a
    :class:`vitrify.host.HostPool` (gathered with :func:`vitrify.host.gather_each`) and from
    there into the O_DIRECT disk slabs of a :class:`vitrify.tier.DiskStore`. The pool and the
    cache are then zeroed, the pages read back from disk and scattered into the cache, and the
    cache is compared with the original byte for byte. The store is closed, reopened with
    ``cold_start="load"`` (its index rebuilt from the slab headers) and the reload and the
    comparison are repeated. Without a GPU the pool is not pinned (pinning is
    ``cuMemHostRegister`` in the CUDA driver); everything else is the same code a GPU server runs.

archive
    Random bytes in a :class:`vitrify.snapshot.HostBackend` (host memory posing as a GPU region)
    are frozen into an archive (a span file with per-chunk CRC32C, engine state, a checksummed
    manifest, atomic commit), the archive is verified, the span is thawed into a second region at
    another base and compared byte for byte. Then one byte of the span file is flipped: both
    ``verify`` and the thaw must refuse, naming the file.

The GPU part (freeze -> thaw of a CUDA-graph engine, :mod:`vitrify.integrations.demo`) runs only
where the CUDA driver loads and torch is installed; elsewhere it is one line giving the driver
loader's reason. Every check raises :class:`DemoFailure` when it does not hold; the exit status is
1 when any step failed.
"""

from __future__ import annotations

import ctypes
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import vitrify
from vitrify._units import MiB


class DemoFailure(RuntimeError):
    """A demo check did not hold (bytes differ, a damaged archive was accepted, ...)."""


@dataclass(frozen=True)
class KVShape:
    """The stand-in KV cache: ``components`` x ``[layers][pages][page_tokens][heads][head_dim]``."""

    components: int = 2  # K and V
    layers: int = 8
    pages: int = 64
    page_tokens: int = 16
    heads: int = 8
    head_dim: int = 64
    item_bytes: int = 2  # bf16

    @property
    def component_bytes(self) -> int:
        return (self.layers * self.pages * self.page_tokens * self.heads * self.head_dim
                * self.item_bytes)

    @property
    def page_bytes(self) -> int:
        """One gathered page: every component and layer of ``page_tokens`` tokens."""
        return self.components * self.component_bytes // self.pages


class Printer:
    """Prints one aligned line per step, with its time."""

    def __init__(self, out) -> None:
        self.out = out

    def head(self, text: str) -> None:
        print(text, file=self.out)

    def step(self, status: str, name: str, detail: str, seconds: float | None = None) -> None:
        t = "" if seconds is None else f"  ({_ms(seconds)})"
        print(f"  [{status}] {name:<15} {detail}{t}", file=self.out)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _size(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n >> 10} KiB"


def _buffer_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of memory at ``address`` (format ``B``)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _address_of(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def compare(expected: bytes | bytearray, found: bytes | bytearray, what: str) -> None:
    """Raise :class:`DemoFailure` naming the first differing byte unless both are identical."""
    if len(expected) != len(found):
        raise DemoFailure(f"{what}: {len(found)} bytes, {len(expected)} expected")
    if expected != found:
        first = next(i for i, (a, b) in enumerate(zip(expected, found)) if a != b)
        raise DemoFailure(f"{what}: bytes differ, first at byte {first} "
                          f"({found[first]:#04x}, {expected[first]:#04x} expected)")


def _timed(fn: Callable, *args, **kw):
    t0 = time.perf_counter()
    r = fn(*args, **kw)
    return r, time.perf_counter() - t0


# ---- tiers: host pool + disk slabs -----------------------------------------------------------


def demo_tiers(scratch: str, p: Printer, shape: KVShape = KVShape(), seed: int = 7) -> None:
    from . import host, tier

    rng = random.Random(seed)
    kv = [bytearray(rng.randbytes(shape.component_bytes)) for _ in range(shape.components)]
    original = [bytes(c) for c in kv]
    layout = host.PageLayout.layer_first(
        [_address_of(c) for c in kv], layers=shape.layers, pages=shape.pages,
        page_tokens=shape.page_tokens, heads=shape.heads, head_dim=shape.head_dim,
        item_bytes=shape.item_bytes)
    page = layout.blob_bytes
    pages = list(range(shape.pages))
    keys = [f"demo-page-{i}" for i in pages]
    total = page * shape.pages
    p.head(f"tiers: a KV cache of {shape.pages} pages x {_size(page)} ({shape.components} x "
           f"{shape.layers} layers x {shape.page_tokens} tokens x {shape.heads} heads x "
           f"{shape.head_dim} x {8 * shape.item_bytes}-bit), {_size(total)}, in {scratch}")

    store_dir = os.path.join(scratch, "slabs")
    budget = 3 * tier.slot_bytes_for(page) * shape.pages

    def open_store(cold_start: str):
        return tier.DiskStore(store_dir, budget, {"kv": page}, name="demo", cold_start=cold_start)

    with host.HostPool(total, page) as pool:
        slots = [_buffer_at(pool.page_address(i), page) for i in pages]
        _, dt = _timed(host.gather_each, layout, pages, slots)
        pinned = ("pinned" if pool.registered else
                  "not pinned: pinning (cuMemHostRegister) needs the CUDA driver")
        slabs = "1 slab" if pool.num_slabs == 1 else f"{pool.num_slabs} slabs"
        p.step("ok", "spill -> host", f"{shape.pages} pages gathered into the host pool "
               f"({slabs}), {pinned}", dt)

        def drop() -> None:
            """Forget the pages: zero every pool page and the KV cache."""
            zeros = bytes(page)
            for v in slots:
                v[:] = zeros
            for c in kv:
                c[:] = bytes(len(c))

        def reload(s) -> None:
            """Disk -> pool pages -> KV cache, then compare with the original bytes."""
            got = s.batch_get_into(keys, slots)
            missing = [k for k, n in zip(keys, got) if n != page]
            if missing:
                raise DemoFailure(f"{len(missing)} of {len(keys)} pages not read back "
                                  f"from disk (first: {missing[0]})")
            host.scatter_each(slots, layout, pages)
            for i, (c, o) in enumerate(zip(kv, original)):
                compare(o, c, f"KV component {i} after reload")

        store = open_store("clear")
        try:
            acks, dt = _timed(store.batch_put, keys, slots)
            if not all(acks):
                raise DemoFailure(f"disk store took {sum(acks)} of {len(acks)} pages")
            odirect = "O_DIRECT" if store.direct_io() else "buffered I/O (O_DIRECT refused here)"
            p.step("ok", "spill -> disk", f"{len(acks)} pages written and fdatasync'd to "
                   f"{os.path.basename(store.slab_path())}, {odirect}", dt)

            _, dt = _timed(drop)
            if any(bytes(c) == o for c, o in zip(kv, original)):
                raise DemoFailure("dropping the pages left the KV cache unchanged")
            p.step("ok", "drop", "host pool pages and KV cache zeroed", dt)

            _, dt = _timed(reload, store)
            p.step("ok", "reload", f"{shape.pages} pages disk -> host pool -> KV cache: "
                   f"{_size(total)} identical byte for byte", dt)
        finally:
            store.close()

        drop()
        store, dt = _timed(open_store, "load")
        try:
            found = sum(store.batch_exists(keys))
            if found != len(keys):
                raise DemoFailure(f"cold_start='load' found {found} of {len(keys)} pages")
            p.step("ok", "restart", f"store closed and reopened with cold_start=\"load\": "
                   f"{found} of {len(keys)} pages indexed from the slab headers", dt)
            _, dt = _timed(reload, store)
            p.step("ok", "reload", f"after the restart: {_size(total)} identical byte for byte",
                   dt)
        finally:
            store.close()


# ---- archive: freeze, verify, thaw, damage ---------------------------------------------------


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def demo_archive(scratch: str, p: Printer, span_bytes: int = 8 * MiB, seed: int = 11) -> None:
    from . import archive, snapshot

    gran = 2 * MiB
    src = snapshot.HostBackend(span_bytes, alignment=gran)
    data = random.Random(seed).randbytes(span_bytes)
    src.write(0, data)
    path = os.path.join(scratch, "demo.vitrify")
    p.head(f"archive: freeze a region span of {_size(span_bytes)} plus engine state into {path}")

    def freeze() -> int:
        fp = archive.Fingerprint.current(engine="vitrify-demo", engine_version=vitrify.__version__,
                                         model="random-bytes")
        region = archive.Region(base=src.base, size=span_bytes, granularity=gran,
                                checkpoints={"warmup_end": span_bytes})
        with archive.ArchiveWriter(path, fp, region) as w:
            w.dump_span(0, snapshot.WARMUP_SPAN, src.base, 0, span_bytes, target=src,
                        chunk_bytes=2 * MiB, progress=lambda done, total: None)
            w.write_state(0, {"demo": True, "span_bytes": span_bytes})
            w.commit()
        return len(archive.open_archive(path).files)

    nfiles, dt = _timed(freeze)
    p.step("ok", "freeze", f"{nfiles} files + a checksummed manifest, committed by one rename", dt)

    problems, dt = _timed(archive.verify, path)
    if problems:
        raise DemoFailure(f"verify found problems in a fresh archive: {problems[0]}")
    p.step("ok", "verify", "intact: every file's size and CRC32C match the manifest", dt)

    def thaw(dst) -> None:
        a = archive.open_archive(path)
        a.restore_span(0, snapshot.WARMUP_SPAN, dst.base, span_bytes, target=dst,
                       progress=lambda done, total: None)

    dst = snapshot.HostBackend(span_bytes, alignment=gran)
    _, dt = _timed(thaw, dst)
    compare(data, dst.read(0, span_bytes), "thawed span")
    p.step("ok", "thaw", f"span restored into a second region at another base: "
           f"{_size(span_bytes)} identical byte for byte", dt)

    rel = snapshot.span_relpath(0, snapshot.WARMUP_SPAN)
    span_file = os.path.join(path, rel)
    offset = os.path.getsize(span_file) // 2
    _flip_byte(span_file, offset)
    p.step("ok", "damage", f"flipped one byte of {rel} at offset {offset}")

    problems, dt = _timed(archive.verify, path)
    named = [q for q in problems if rel in q]
    if not named:
        raise DemoFailure(f"verify did not refuse the damaged {rel}"
                          + (f" (it reported: {problems[0]})" if problems else ""))
    p.step("ok", "verify refuses", named[0].replace(f"archive {path}: ", "", 1), dt)

    dst2 = snapshot.HostBackend(span_bytes, alignment=gran)
    t0 = time.perf_counter()
    try:
        thaw(dst2)
    except (archive.ArchiveError, snapshot.SpanFileError) as e:
        refusal, dt = f"{type(e).__name__}: {e}", time.perf_counter() - t0
    else:
        raise DemoFailure(f"the thaw accepted the damaged {rel}")
    if rel not in refusal and os.path.basename(rel) not in refusal:
        raise DemoFailure(f"the thaw refused without naming {rel}: {refusal}")
    p.step("ok", "thaw refuses", refusal, dt)


# ---- GPU: freeze -> thaw of a CUDA-graph engine ----------------------------------------------

GPU_STEP = ("freeze -> thaw of a CUDA-graph engine (weights, warmup and 4 decode graphs frozen; "
            "thawed in a fresh process without torch; greedy tokens compared)")


def demo_gpu(scratch: str, p: Printer) -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise DemoFailure("the freeze side needs torch (pip install torch); vitrify does not")
    from .integrations import demo

    r = demo.run_demo(scratch)
    fz, th = r["freeze"], r["thaw"]
    p.step("ok", "freeze -> thaw", f"{th['tokens_compared']} tokens identical; thaw "
           f"{th['process_wall_s']:.1f} s vs freeze {fz['process_wall_s']:.1f} s "
           "(whole processes)")


@dataclass(frozen=True)
class Part:
    name: str
    needs_gpu: bool
    run: Callable[[str, Printer], None]


PARTS: list[Part] = [
    Part("tiers", False, demo_tiers),
    Part("archive", False, demo_archive),
    Part("gpu", True, demo_gpu),
]


def main(out=sys.stdout) -> int:
    """Run every part; return 0 when all that ran succeeded, 1 otherwise."""
    p = Printer(out)
    gpu = vitrify.cuda_available()
    failed = 0
    t_all = time.perf_counter()
    for part in PARTS:
        if part.needs_gpu and not gpu:
            p.head(f"gpu: [skipped] {GPU_STEP}: no GPU here ({vitrify.cuda_unavailable_reason()})")
            continue
        if part.needs_gpu:
            p.head(f"gpu: {GPU_STEP}")
        with tempfile.TemporaryDirectory(prefix=f"vitrify-demo-{part.name}-") as scratch:
            try:
                part.run(scratch, p)
            except Exception as e:  # a failed part is reported and the next one still runs
                failed += 1
                p.step("failed", part.name, f"{type(e).__name__}: {e}")
        out.flush()
    verdict = "every step passed" if not failed else f"{failed} part(s) failed"
    p.head(f"demo: {verdict} in {_ms(time.perf_counter() - t_all)}; "
           "`vitrify doctor` reports what this machine offers")
    return 1 if failed else 0
