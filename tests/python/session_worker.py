"""Subprocess worker for tests/python/test_session.py: FREEZE and THAW of a torch-free engine
through vitrify.session, in fresh processes, on any driver (the fake one on CPU).

    python session_worker.py freeze ARCHIVE [options as JSON]
    python session_worker.py thaw   ARCHIVE [options as JSON]

The engine ("bytes engine") allocates parameters in build(), fills them with seeded bytes in
load_weights() (and frees a temporary, leaving a hole), allocates a KV block whose bytes are not
state, and in warmup() derives a lookup table from the weights (lazy state that THAW must get
back, by restoring the warmup span or by re-running warmup). restore_state() recomputes a digest
over the weights and the table; THAW reports it with FREEZE's. The last stdout line is JSON.

Options: ``drift`` (build one more block at THAW), ``model`` (fingerprint), ``occupy`` (reserve
the frozen base first so THAW must relocate), ``relocate``, ``warmup_restore``, ``dump_warmup``,
``objectless`` (THAW through ``thaw_without_objects``: nothing rebuilt, the state says where),
``table_in_build`` (warmup writes a table build allocated: no warmup span), ``base_shift``,
``compile_in_region`` (the optional compile phase allocates in the region: refused, P11),
``driven`` (the engine runs its own phases and reports each checkpoint: start / reached /
finish, P12). Mode ``misuse``: an engine-driven session used out of order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import sys

from worker_result import report

MiB = 1 << 20


class BytesEngine:
    def __init__(self, *, drift: bool = False, model: str = "bytes-4x3MiB",
                 table_in_build: bool = False, compile_in_region: bool = False):
        self.drift = drift
        self.compile_in_region = compile_in_region
        self.compiles = 0
        self.table_in_build = table_in_build  # warmup then allocates nothing in the region
        self.model = model
        self.region = None
        self.params: list[tuple[int, int]] = []
        self.table = (0, 0)
        self.kv = 0
        self.result: dict = {}
        self.warmups = 0
        self.capture_block = 0

    def fingerprint(self) -> dict:
        return {"engine": "bytes-engine", "engine_version": "1", "model": self.model}

    def route(self, region, phase):
        return contextlib.nullcontext()

    def build(self, region) -> None:
        self.region = region
        self.params = [(region.allocate(n) - region.base, n) for n in (3 * MiB,) * 4]
        if self.drift:
            region.allocate(2 * MiB)
        if self.table_in_build:
            self.table = (region.allocate(2 * MiB) - region.base, 2 * MiB)

    def load_weights(self) -> None:
        r = self.region
        rng = random.Random(7)
        for off, n in self.params:
            r.write(r.base + off, rng.randbytes(n))
        tmp = r.allocate(4 * MiB)  # a temporary, freed: its chunk is released (a hole)
        r.free(tmp)

    def alloc_state(self) -> None:
        r = self.region
        self.kv = r.allocate(8 * MiB)
        r.write(self.kv, b"\xab" * (8 * MiB))  # not state: never dumped, never compared

    def _weights_digest(self) -> bytes:
        r = self.region
        h = hashlib.sha256()
        for off, n in self.params:
            h.update(r.read(r.base + off, n))
        return h.digest()

    def compile(self) -> None:  # session P11: outside the region, before warmup
        self.compiles += 1
        if self.compile_in_region:
            self.region.allocate(2 * MiB)

    def warmup(self) -> None:
        r = self.region
        self.warmups += 1
        if not self.table_in_build:
            self.table = (r.allocate(2 * MiB) - r.base, 2 * MiB)
        ptr = r.base + self.table[0]
        seed = self._weights_digest()
        r.write(ptr, (seed * (2 * MiB // len(seed)))[: 2 * MiB])

    def capture(self, graphs) -> None:
        assert graphs is None  # record_kernels=False: no graph store
        # a "graph pool" block: what the graphs span holds
        self.capture_block = self.region.allocate(2 * MiB) - self.region.base
        self.region.write(self.region.base + self.capture_block, b"\x5a" * (2 * MiB))

    def _digest(self) -> str:
        r = self.region
        off, n = self.table
        return hashlib.sha256(self._weights_digest() + r.read(r.base + off, n)).hexdigest()

    def state(self) -> dict:
        return {"params": self.params, "table": list(self.table), "digest": self._digest(),
                "capture_block": self.capture_block}

    def restore_state(self, state: dict, graphs) -> None:
        assert [tuple(p) for p in state["params"]] == self.params
        self.table = tuple(state["table"])
        self.result = {"digest": self._digest(), "frozen_digest": state["digest"],
                       "warmups": self.warmups, "compiles": self.compiles}


class ObjectlessBytes(BytesEngine):
    """THAW without the engine's objects: attach(region), then everything from the state."""

    thaw_without_objects = True

    def attach(self, region) -> None:
        self.region = region

    def restore_state(self, state: dict, graphs) -> None:
        self.params = [tuple(p) for p in state["params"]]
        super().restore_state(state, graphs)


def freeze_driven(eng: BytesEngine, path: str, opts: dict) -> dict:
    """FREEZE with the engine running its own phases and reporting each checkpoint (P12)."""
    from vitrify import session

    s = session.FreezeSession(eng, path, region_bytes=256 * MiB, overwrite=True,
                              record_kernels=False, dump_warmup=opts.get("dump_warmup", True))
    region = s.start()
    eng.build(region)
    s.reached("built")
    eng.load_weights()
    s.reached("weights")
    eng.alloc_state()
    s.reached("state")
    eng.warmup()
    s.reached("warmup")
    eng.capture(None)
    s.reached("captured")
    return s.finish(eng.state())


def thaw_driven(eng: BytesEngine, path: str, opts: dict) -> dict:
    """THAW with the engine running its own phases: no weights loaded, warmup as the session
    decided, nothing captured; the state and graphs handed over by finish()."""
    from vitrify import session

    s = session.ThawSession(eng, path, warmup_restore=opts.get("warmup_restore"),
                            restore_graph_span=opts.get("restore_graph_span", True))
    region = s.start()
    eng.build(region)
    s.reached("built")  # the session restores the weights span here
    s.reached("weights")
    eng.alloc_state()
    s.reached("state")
    if s.warmup_action != "restore":
        eng.warmup()
    s.reached("warmup")
    s.reached("captured")
    state, graphs = s.finish()
    eng.restore_state(state, graphs)
    block = region.read(region.base + state["capture_block"], 16)
    return {**s.summary, **eng.result, "graph_span_restored": block == b"\x5a" * 16}


def driven_misuse(eng: BytesEngine, path: str, opts: dict) -> dict:
    """Checkpoints out of order, finish too early: one-line SessionErrors, and the region of
    the failed session is released (P10)."""
    from vitrify import session

    out = {}
    fz = session.FreezeSession(eng, path + ".misuse", region_bytes=64 * MiB, overwrite=True,
                               record_kernels=False)
    fz.start()
    try:
        fz.reached("state")
    except session.SessionError as e:
        out["freeze_order"] = str(e)
    out["freeze_region_closed"] = fz.region.closed
    fz2 = session.FreezeSession(eng, path + ".misuse2", region_bytes=64 * MiB, overwrite=True,
                                record_kernels=False)
    fz2.start()
    fz2.reached("built")
    try:
        fz2.finish({})
    except session.SessionError as e:
        out["freeze_early_finish"] = str(e)
    out["early_finish_region_open"] = not fz2.region.closed  # the engine's until abort()
    fz2.abort()
    # a late call after a good finish is refused and leaves the engine's region alone
    fz3 = session.FreezeSession(BytesEngine(), path + ".misuse3", region_bytes=64 * MiB,
                                overwrite=True, record_kernels=False)
    e3 = fz3.adapter
    region = fz3.start()
    for call, cp in ((lambda: e3.build(region), "built"), (e3.load_weights, "weights"),
                     (e3.alloc_state, "state"), (e3.warmup, "warmup"), (lambda: None, "captured")):
        call()
        fz3.reached(cp)
    fz3.finish(e3.state())
    for late in (lambda: fz3.reached("built"), lambda: fz3.finish({})):
        try:
            late()
        except session.SessionError as e:
            out["freeze_late"] = str(e)
    out["late_region_open"] = not fz3.region.closed
    fz3.abort()
    th0 = session.ThawSession(eng, path)
    try:
        th0.reached("built")
    except session.SessionError as e:
        out["thaw_before_start"] = str(e)
    try:
        th0.frozen_state
    except session.SessionError as e:
        out["state_before_start"] = str(e)
    th = session.ThawSession(eng, path)
    th.start()
    try:
        th.reached("warmup")
    except session.SessionError as e:
        out["thaw_order"] = str(e)
    out["thaw_region_released"] = th.region is None
    try:
        th.start()
    except session.SessionError as e:
        out["thaw_twice"] = str(e)
    return out


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}

    def run() -> dict:
        from vitrify import session

        kind = ObjectlessBytes if opts.get("objectless") and mode == "thaw" else BytesEngine
        eng = kind(drift=opts.get("drift", False), model=opts.get("model", "bytes-4x3MiB"),
                   table_in_build=opts.get("table_in_build", False),
                   compile_in_region=opts.get("compile_in_region", False))
        if mode == "misuse":
            return driven_misuse(eng, path, opts)
        if opts.get("driven"):
            return (freeze_driven if mode == "freeze" else thaw_driven)(eng, path, opts)
        if mode == "freeze":
            s = session.FreezeSession(eng, path, region_bytes=256 * MiB, overwrite=True,
                                      record_kernels=False,
                                      dump_warmup=opts.get("dump_warmup", True))
            out = s.run()
            out["compiles"] = eng.compiles
            return out
        blocker = None
        if opts.get("occupy"):
            from vitrify import Region, archive

            frozen = archive.open_archive(path).region
            blocker = Region(frozen.size, base=frozen.base)  # the frozen range is taken
        base = None
        if "base_shift" in opts:
            from vitrify import archive

            base = archive.open_archive(path).region.base + opts["base_shift"]
        src = path
        if opts.get("opened"):  # the caller's archive, opened before the session
            from vitrify import archive

            src = archive.open_archive(path)
        s = session.ThawSession(eng, src, relocate=opts.get("relocate", True), base=base,
                                warmup_restore=opts.get("warmup_restore"))
        try:
            out = s.run()
        except session.CheckpointDrift as e:
            return {"drift": str(e), "phase": e.phase, "frozen": e.found, "here": e.expected,
                    "region_released": s.region is None}
        out.update(eng.result)
        del blocker
        return out

    return report(run)


if __name__ == "__main__":
    sys.exit(main())
