"""``vitrify demo``: run vitrify's main jobs on this machine, saying plainly what was skipped and
why.

Four parts; the first two run on any Linux machine (no GPU, no torch, no numpy):

tiers
    A stand-in KV cache (K and V, layer-first, random bytes) is spilled page by page into a
    :class:`vitrify.host.HostPool` (gathered with :func:`vitrify.host.gather_each`) and from
    there into the O_DIRECT disk slabs of a :class:`vitrify.disk.DiskStore`. The pool and the
    cache are then zeroed, the pages read back from disk and scattered into the cache, and the
    cache is compared with the original byte for byte. The store is closed, reopened with
    ``cold_start="load"`` (its index rebuilt from the slab headers) and the reload and the
    comparison are repeated. Without a GPU the pool is not pinned (pinning is
    ``cuMemHostRegister`` in the CUDA driver); everything else is the same code a GPU server runs.

archive
    Random bytes in a :class:`vitrify.snapshot.HostBackend` (host memory posing as a GPU region)
    are frozen into an archive (a span file with per-chunk CRC32C, engine state, a checksummed
    manifest, atomic commit), the archive is verified, and the CLI's ``vitrify inspect`` and
    ``vitrify verify`` run on it with their output shown (``vitrify demo --keep DIR`` leaves a
    copy of the intact archive in DIR to try them on). The span is thawed into a second region
    at another base and compared byte for byte. Then one byte of the span file is flipped: both
    ``vitrify verify`` and the thaw must refuse, naming the file.

gpu
    A toy decoder engine (an embedding, residual RMSNorm + MLP blocks, a tied LM head; random
    weights made peaked so argmax has no near-ties) decodes greedily with CUDA graphs. It is small
    on purpose, but goes through every step a real server's freeze and thaw take, each side in a
    fresh process (``python -m vitrify.demo freeze|thaw ARCHIVE``):

    The engine is a :class:`vitrify.session.EngineAdapter` (:class:`ToyDecoder`), frozen and
    thawed by :mod:`vitrify.session`. FREEZE (needs torch and a GPU): record kernel binaries
    (CUPTI) -> reserve the region -> build the weights and decode inputs in the region, fill them
    (checkpoints ``built``, ``weights``) -> warmup forwards (``warmup``) -> capture one decode graph
    per batch size, the graphs' pool in the region (``captured``) -> the reference tokens (each
    graph replayed STEPS times) -> dump the spans, save the graphs, commit the archive.

    THAW (torch is never imported): open the archive and check its fingerprint against this
    machine -> reserve the region at the same base -> map each phase's range and compare its
    checkpoint -> restore the spans (CRC-checked) -> rebuild the graphs (one executable per
    topology template) -> decode the same STEPS tokens and compare them, token for token.

    This part runs only where the CUDA driver loads and torch is installed; elsewhere it is one
    line giving the driver loader's reason.

engine
    The transformers engine of :mod:`vitrify.integrations.transformers` at a small size (8 layers,
    hidden 1024, 6 decode graphs): frozen once, then started cold and thawed, each in a fresh
    process serving 4 new prompts; the tokens and logits of both must equal the frozen
    process's, and the time from process start to the first token is printed for each (GPU,
    torch and transformers; `vitrify bench coldstart` measures the full-size engine).

Every check raises :class:`DemoFailure` when it does not hold; the exit status is 1 when any step
failed. ``python -m vitrify.demo`` with no arguments is ``vitrify demo``.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import vitrify
from vitrify._units import MiB

ENGINE = "vitrify-demo"  # the engine name in the fingerprint of every archive the demo writes


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
    from . import disk, host

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
    budget = 3 * disk.slot_bytes_for(page) * shape.pages

    def open_store(cold_start: str):
        return disk.DiskStore(store_dir, budget, {"kv": page}, name="demo", cold_start=cold_start)

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


def _run_cli(p: Printer, argv: list[str], expect_rc: int) -> None:
    """Run ``vitrify ARGV`` as a user would type it (the CLI's own code, in this process) and
    print what it printed, indented under one step; its exit status must be ``expect_rc``."""
    from . import cli

    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    dt = time.perf_counter() - t0
    shown = " ".join(os.path.basename(a) if os.sep in a else a for a in argv)
    if rc != expect_rc:
        raise DemoFailure(f"`vitrify {shown}` exited {rc}, {expect_rc} expected: "
                          f"{(err.getvalue() or out.getvalue()).strip()[:200]}")
    p.step("ok", f"vitrify {argv[0]}", f"`vitrify {shown}` exited {rc}; it printed:", dt)
    for line in (out.getvalue() + err.getvalue()).rstrip().splitlines():
        p.head(f"      | {line}")


def demo_archive(scratch: str, p: Printer, span_bytes: int = 8 * MiB, seed: int = 11,
                 keep: str | None = None) -> None:
    from . import archive, snapshot

    gran = 2 * MiB
    src = snapshot.HostBackend(span_bytes, alignment=gran)
    data = random.Random(seed).randbytes(span_bytes)
    src.write(0, data)
    path = os.path.join(scratch, "demo.vitrify")
    p.head(f"archive: freeze a region span of {_size(span_bytes)} plus engine state into {path}")

    def freeze() -> int:
        fp = archive.Fingerprint.current(engine=ENGINE, engine_version=vitrify.__version__,
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
    for command in (["inspect", path], ["verify", path]):
        _run_cli(p, command, expect_rc=0)
    if keep is not None:
        kept = os.path.join(keep, "demo.vitrify")
        shutil.copytree(path, kept)
        p.step("ok", "kept", f"a copy of the intact archive in {kept}: try `vitrify inspect "
               f"{kept}` and `vitrify verify {kept}`")

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
    _run_cli(p, ["verify", path], expect_rc=1)

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

ENGINE_CONFIG = {"vocab": 8192, "hidden": 1024, "ffn": 4096, "layers": 4,
                 "batch_sizes": [1, 2, 4, 8], "steps": 32, "region_bytes": 4 << 30, "seed": 1234}


def _model_id(cfg: dict) -> str:
    return "toy-decoder-" + "-".join(f"{k}{cfg[k]}" for k in ("vocab", "hidden", "ffn", "layers"))


class ToyDecoder:
    """The demo engine as a :class:`vitrify.session.EngineAdapter`. FREEZE needs torch; THAW
    does not: the engine's objects are not rebuilt (``thaw_without_objects``), the session maps
    each phase's range and restores the spans, and :meth:`decode` replays the thawed graphs and
    reads the tokens straight from the region."""

    thaw_without_objects = True

    def __init__(self, cfg: dict = ENGINE_CONFIG):
        self.cfg = dict(cfg)
        self.region = None
        self.graphs = None
        self.state_in: dict = {}

    def fingerprint(self) -> dict:
        return {"engine": ENGINE, "engine_version": vitrify.__version__,
                "model": _model_id(self.cfg)}

    def route(self, region, phase: str):
        from vitrify.integrations import torch as tt

        return tt.activated(region) if phase == "capture" else tt.region_allocations(region)

    def build(self, region) -> None:
        import torch

        self.region = region
        h, f, v, bf = self.cfg["hidden"], self.cfg["ffn"], self.cfg["vocab"], torch.bfloat16
        self.emb = torch.empty(v, h, dtype=bf, device="cuda")
        self.layers = [(torch.empty(h, dtype=bf, device="cuda"),
                        torch.empty(h, f, dtype=bf, device="cuda"),
                        torch.empty(f, h, dtype=bf, device="cuda"))
                       for _ in range(self.cfg["layers"])]
        # The decode inputs: where every decode starts (dumped with the weights).
        self.ids = {bs: torch.empty(bs, dtype=torch.long, device="cuda")
                    for bs in self.cfg["batch_sizes"]}
        self.starts = {bs: torch.empty(bs, dtype=torch.long, device="cuda")
                       for bs in self.cfg["batch_sizes"]}

    def load_weights(self) -> None:
        import torch

        g = torch.Generator(device="cuda").manual_seed(self.cfg["seed"])
        h, f, v = self.cfg["hidden"], self.cfg["ffn"], self.cfg["vocab"]

        def fill(t, scale):  # random weights made peaked: argmax has no near-ties
            t.copy_(torch.randn(t.shape, device="cuda", generator=g) * scale)

        fill(self.emb, 1.0)
        for norm_w, w_up, w_down in self.layers:
            norm_w.fill_(1.0)
            fill(w_up, h ** -0.5)
            fill(w_down, f ** -0.5)
        for bs in self.cfg["batch_sizes"]:
            self.starts[bs].copy_(torch.randint(0, v, (bs,), device="cuda", generator=g))
            self.ids[bs].copy_(self.starts[bs])
        torch.cuda.synchronize()

    def alloc_state(self) -> None:
        pass  # the toy engine keeps no KV cache

    def _step(self, x_ids) -> None:
        import torch

        x = self.emb.index_select(0, x_ids)
        for norm_w, w_up, w_down in self.layers:
            y = x.float()
            y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * norm_w
            x = x + torch.nn.functional.gelu(y @ w_up) @ w_down
        x_ids.copy_((x @ self.emb.t()).argmax(-1))

    def warmup(self) -> None:
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bs in self.cfg["batch_sizes"]:
                for _ in range(3):
                    self._step(self.ids[bs])
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def capture(self, graphs) -> None:
        from vitrify.integrations import torch as tt

        self.torch_graphs = {}
        for bs in self.cfg["batch_sizes"]:
            with graphs.capture(f"decode_bs{bs}", pool=tt.pool_id(self.region)) as cap:
                self._step(self.ids[bs])
            self.torch_graphs[bs] = cap.graph

    def state(self) -> dict:
        """The reference tokens: each graph replayed STEPS times from the start, then the inputs
        are reset to the start (the spans are dumped after this)."""
        import torch

        tokens = {}
        for bs in self.cfg["batch_sizes"]:
            self.ids[bs].copy_(self.starts[bs])
            seq = []
            for _ in range(self.cfg["steps"]):
                self.torch_graphs[bs].replay()
                seq.append(self.ids[bs].tolist())
            tokens[str(bs)] = seq
            self.ids[bs].copy_(self.starts[bs])
        torch.cuda.synchronize()
        return {"config": self.cfg, "tokens": tokens,
                "ids": {str(bs): {"offset": t.data_ptr() - self.region.base, "bytes": bs * 8}
                        for bs, t in self.ids.items()}}

    def attach(self, region) -> None:
        self.region = region

    def restore_state(self, state: dict, graphs) -> None:
        self.state_in, self.graphs = state, graphs

    def decode(self) -> dict:
        """THAW: replay every graph STEPS times and compare the tokens with FREEZE's."""
        region, st = self.region, self.state_in
        tokens, mismatches = {}, []
        for bs_s, want in st["tokens"].items():
            loc = st["ids"][bs_s]
            seq = []
            for t in range(len(want)):
                self.graphs.replay(f"decode_bs{bs_s}", stream=0)
                self.graphs.synchronize()
                raw = region.read(region.base + loc["offset"], loc["bytes"])
                seq.append([int.from_bytes(raw[i:i + 8], "little", signed=True)
                            for i in range(0, len(raw), 8)])
                if seq[-1] != want[t]:
                    mismatches.append({"batch_size": int(bs_s), "step": t, "want": want[t],
                                       "got": seq[-1]})
            tokens[bs_s] = seq
        n = sum(len(s) * len(s[0]) for s in tokens.values())
        return {"tokens_compared": n, "identical": not mismatches, "mismatches": mismatches[:5]}


def freeze(path: str, cfg: dict = ENGINE_CONFIG) -> dict:
    """Build, warm up, capture and freeze the demo engine into the archive at ``path``."""
    from vitrify import session

    t0 = time.perf_counter()
    # The session starts recording kernel binaries: before torch initialises CUDA.
    s = session.FreezeSession(ToyDecoder(cfg), path, region_bytes=cfg["region_bytes"],
                              overwrite=True)
    r = s.run()
    r["timings"]["total_s"] = time.perf_counter() - t0
    return {"mode": "freeze", **r}


def thaw(path: str) -> dict:
    """Thaw the demo engine from ``path`` in this (fresh) process and compare its tokens."""
    from vitrify import archive as ar
    from vitrify import session

    t0 = time.perf_counter()
    cfg = ar.open_archive(path).state(0)["engine"]["config"]  # the session checks the rest
    eng = ToyDecoder(cfg)
    r = session.ThawSession(eng, path).run()
    t1 = time.perf_counter()
    out = eng.decode()
    r["timings"]["decode"] = time.perf_counter() - t1
    r["timings"]["total_s"] = time.perf_counter() - t0
    return {"mode": "thaw", **r, **out}


def run_engine(directory: str, out=sys.stdout) -> dict:
    """FREEZE then THAW in two fresh processes; print a summary; return both results."""
    archive = str(Path(directory) / "demo.vitrify")
    results = {}
    for mode in ("freeze", "thaw"):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "vitrify.demo", mode, archive],
                           capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"demo {mode} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["process_wall_s"] = wall
        results[mode] = r
        print(f"  {mode:6s}: {wall:6.2f} s wall for the whole process "
              f"({', '.join(f'{k} {v:.2f}' for k, v in r['timings'].items())})", file=out)
    th = results["thaw"]
    print(f"  tokens : {th['tokens_compared']} greedy tokens over "
          f"{results['freeze']['graphs']} graphs ({results['freeze']['templates']} templates): "
          f"{'identical to FREEZE' if th['identical'] else 'DIFFERENT: ' + str(th['mismatches'])}",
          file=out)
    if not th["identical"]:
        raise RuntimeError("thawed engine produced different tokens than the frozen one")
    return results


GPU_STEP = ("freeze -> thaw of a CUDA-graph engine (weights, warmup and 4 decode graphs frozen; "
            "thawed in a fresh process without torch; greedy tokens compared)")


def demo_gpu(scratch: str, p: Printer) -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise DemoFailure("the freeze side needs torch (pip install torch); vitrify does not")
    r = run_engine(scratch)
    fz, th = r["freeze"], r["thaw"]
    p.step("ok", "freeze -> thaw", f"{th['tokens_compared']} tokens identical; thaw "
           f"{th['process_wall_s']:.1f} s vs freeze {fz['process_wall_s']:.1f} s "
           "(whole processes)")


ENGINE_STEP = ("cold start vs thaw of a small transformers engine (8 layers, 6 decode graphs): "
               "process start -> first token, tokens compared")


def demo_engine(scratch: str, p: Printer) -> None:
    """The transformers engine (vitrify.integrations.transformers) at a small size: frozen once,
    then started cold and thawed, each in a fresh process; both serve 4 new prompts."""
    import importlib.util

    for mod in ("torch", "transformers"):
        if importlib.util.find_spec(mod) is None:
            raise DemoFailure(f"this part needs {mod} (pip install {mod}); vitrify does not")
    from vitrify.bench.coldstart import config
    from vitrify.integrations.transformers import run_process

    cfg = config("eager", small=True)
    archive = str(Path(scratch) / "engine.vitrify")
    opts = {"prompts": 4, "steps": 16, "region_bytes": 4 << 30}
    runs = {}
    for mode in ("freeze", "cold", "thaw"):
        t0 = time.perf_counter()
        runs[mode] = run_process(mode, archive if mode != "cold" else "-", cfg, opts)
        p.step("ok", mode, f"first token {runs[mode]['first_token_s']:.1f} s after process start",
               time.perf_counter() - t0)
    ref = runs["freeze"]
    for mode in ("cold", "thaw"):
        if (runs[mode]["tokens"], runs[mode]["logits_sha256"]) != (ref["tokens"],
                                                                 ref["logits_sha256"]):
            raise DemoFailure(f"the {mode} engine's tokens or logits differ from the frozen one's")
    cold, thaw = runs["cold"]["first_token_s"], runs["thaw"]["first_token_s"]
    p.step("ok", "compare", f"{len(ref['tokens'])} prompts x {len(ref['tokens'][0])} tokens "
           f"identical (logits bit for bit); thaw {thaw:.1f} s vs cold {cold:.1f} s to the first "
           f"token (`vitrify bench coldstart` measures the 1.1 B engine, compiled)")


@dataclass(frozen=True)
class Part:
    name: str
    needs_gpu: bool
    run: Callable[[str, Printer], None]


PARTS: list[Part] = [
    Part("tiers", False, demo_tiers),
    Part("archive", False, demo_archive),
    Part("gpu", True, demo_gpu),
    Part("engine", True, demo_engine),
]


def main(out=sys.stdout, keep: str | None = None) -> int:
    """Run every part; return 0 when all that ran succeeded, 1 otherwise. ``keep``: an existing
    directory where the archive part leaves a copy of its intact archive (``demo.vitrify``), for
    trying ``vitrify inspect`` and ``vitrify verify`` on it afterwards."""
    if keep is not None:
        if not os.path.isdir(keep):
            raise DemoFailure(f"--keep {keep}: not an existing directory")
        if os.path.lexists(os.path.join(keep, "demo.vitrify")):
            raise DemoFailure(f"--keep {keep}: demo.vitrify is already there (remove it or "
                              f"name another directory)")
    p = Printer(out)
    gpu = vitrify.cuda_available()
    failed = 0
    t_all = time.perf_counter()
    for part in PARTS:
        what = {"gpu": GPU_STEP, "engine": ENGINE_STEP}.get(part.name)
        if part.needs_gpu and not gpu:
            p.head(f"{part.name}: [skipped] {what}: no GPU here "
                   f"({vitrify.cuda_unavailable_reason()})")
            continue
        if part.needs_gpu:
            p.head(f"{part.name}: {what}")
        with tempfile.TemporaryDirectory(prefix=f"vitrify-demo-{part.name}-") as scratch:
            try:
                if part.name == "archive":
                    part.run(scratch, p, keep=keep)
                else:
                    part.run(scratch, p)
            except Exception as e:  # a failed part is reported and the next one still runs
                failed += 1
                p.step("failed", part.name, f"{type(e).__name__}: {e}")
        out.flush()
    verdict = "every step passed" if not failed else f"{failed} part(s) failed"
    p.head(f"demo: {verdict} in {_ms(time.perf_counter() - t_all)}; "
           "`vitrify doctor` reports what this machine offers")
    return 1 if failed else 0


def _module_main(argv: list[str]) -> int:
    """``python -m vitrify.demo``: the whole demo; ``... freeze|thaw ARCHIVE``: one engine side."""
    if not argv:
        return main()
    if len(argv) != 2 or argv[0] not in ("freeze", "thaw"):
        print("usage: python -m vitrify.demo [freeze|thaw ARCHIVE]", file=sys.stderr)
        return 2
    r = freeze(argv[1]) if argv[0] == "freeze" else thaw(argv[1])
    print(json.dumps(r))  # run_engine reads the last line
    return 0 if r.get("identical", True) else 1


if __name__ == "__main__":
    sys.exit(_module_main(sys.argv[1:]))
