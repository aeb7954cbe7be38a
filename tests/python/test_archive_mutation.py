"""Mutation test over the archive formats (issue 33, items 8-15): a real small archive is frozen
on the CPU (the fake CUDA driver: a weights, a warmup and a graphs span, two graphs and their
module, a session state, JIT caches), then mutated many ways, and every mutation must be
refused with one line naming the archive and a file, or thaw identically; none may hang and
none may read outside the archive.

Each mutated copy goes through four consumers in a worker process (this file run as a script,
under the fake driver): ``archive.verify`` (a list of one-line problems, never an exception),
``archive.inspect`` + ``render_inspect``, a full THAW (``session.ThawSession.run``: the restored
bytes, the graphs rebuilt, the checkpoints, compared with the thaw of the pristine archive) and
``jit.unpack`` (the unpacked files compared byte for byte). Each consumer runs under an alarm:
a hang is reported, not waited for. Outside the archive lie identical copies of every file and
directory (the targets of the symlink mutations: following one would pass every check, so only
their access times tell), a sentinel file and a FIFO; the copies' access times must not change
and the sentinel's bytes must never show up.

Mutations: the issue's cases (named ``issue-N-...``; each must be refused by the consumers that
read the file), plus generated ones: every field of the manifest, the session state, the graph
index and the JIT index dropped, duplicated and retyped (null, bool, float, str, list, object,
2**64, -1), with the manifest re-checksummed (and a changed file's manifest entry re-computed)
so that the mutation gets past the checksum; every file and directory replaced by a symlink (to
its identical copy outside, to the sentinel, to a FIFO), a FIFO, a directory, removed, unlisted,
truncated (with and without re-checksumming) and flipped. The counts are printed. The default
run samples the generated mutations (all of them with VITRIFY_LONG_TESTS=1).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

FAKE = os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA")
KiB, MiB = 1 << 10, 1 << 20
SENTINEL = b"vitrify mutation test: bytes outside the archive, never to be read\n"
CONSUMER_TIMEOUT_S = 10
OLD_ATIME = 86400  # outside copies get this access time; any read moves it (relatime)
MANIFEST = "manifest.json"
INDEX = "rank0/graphs/index.json"
STATE = "rank0/state.json"
JIT_INDEX = "jit/index.json"
IMAGE = b".version 8.0\n.entry scale ( // params 0:8 8:4\n"

needs_fake = pytest.mark.skipif(not FAKE, reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test "
                                                 "sets it)")


# ---------------------------------------------------------------------------- the engine
class TinyEngine:
    """Weights, a KV block (never dumped), a warmup table derived from the weights, a graph
    pool block, and two graphs whose kernel parameter points into that block."""

    def __init__(self):
        self.region = None
        self.graphs = None
        self.result: dict = {}

    def fingerprint(self) -> dict:
        return {"engine": "tiny-engine", "engine_version": "1", "model": "tiny@1"}

    def route(self, region, phase):
        return contextlib.nullcontext()

    def build(self, region) -> None:
        self.region = region
        self.weights = region.allocate(64 * KiB) - region.base

    def load_weights(self) -> None:
        r = self.region
        r.write(r.base + self.weights, random.Random(5).randbytes(64 * KiB))

    def alloc_state(self) -> None:
        r = self.region
        self.kv = r.allocate(64 * KiB) - r.base
        r.write(r.base + self.kv, b"\xab" * (64 * KiB))

    def warmup(self) -> None:
        r = self.region
        self.table = r.allocate(16 * KiB) - r.base
        seed = hashlib.sha256(r.read(r.base + self.weights, 64 * KiB)).digest()
        r.write(r.base + self.table, seed * (16 * KiB // len(seed)))

    def capture(self, graphs) -> None:
        from vitrify import _native

        r = self.region
        self.block = r.allocate(16 * KiB) - r.base
        r.write(r.base + self.block, b"\x5a" * (16 * KiB))
        mod = _native.graph_add_recorded_module(IMAGE)
        for name, n in (("decode_bs1", 1), ("decode_bs8", 8)):
            params = struct.pack("<QI", r.base + self.block, n)
            d = {"nodes": [{"kind": "kernel", "module": mod, "name": "scale", "grid": (1, 1, 1),
                            "block": (32, 1, 1), "params": params, "slots": [(0, 8), (8, 4)]}],
                 "edges": []}
            graphs.add(name, _native.graph_find_relocations(_native.graph_build(d), r.base,
                                                            r.size))

    def state(self) -> dict:
        return {"weights": self.weights, "table": self.table, "block": self.block}

    def _digest(self, st: dict) -> str:
        r = self.region
        h = hashlib.sha256()
        for off, n in ((st["weights"], 64 * KiB), (st["table"], 16 * KiB),
                       (st["block"], 16 * KiB)):
            h.update(r.read(r.base + off, n))
        return h.hexdigest()

    def restore_state(self, state: dict, graphs) -> None:
        self.graphs = graphs
        self.result = {"digest": self._digest(state),
                       "graphs": sorted(graphs.names) if graphs is not None else [],
                       "ready": graphs.stats()["ready_graphs"] if graphs is not None else 0}


def _fill_jit(dirs: dict) -> None:
    files = {("triton", "AB12/_fwd.cubin"): b"\x7fELF" + b"k" * 3000,
             ("triton", "AB12/_fwd.json"): b'{"name": "_fwd"}',
             ("tvm-ffi", "kv_9f/kv_9f.so"): b"\x7fELF" + b"s" * 2000}
    for (cache, rel), data in files.items():
        p = Path(dirs[cache]) / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def freeze(path: str, work: str) -> dict:
    import vitrify.graph as tg
    from vitrify import jit, session

    # The fake driver has no CUPTI; the graphs are built by hand (their module registered as
    # recorded), so the recorder is not needed.
    tg.record_modules = lambda *a, **k: None
    eng = TinyEngine()
    s = session.FreezeSession(eng, path, region_bytes=64 * MiB)
    region = s.start()
    for call, checkpoint in ((lambda: eng.build(region), "built"), (eng.load_weights, "weights"),
                             (eng.alloc_state, "state"), (eng.warmup, "warmup"),
                             (lambda: eng.capture(s.graphs), "captured")):
        call()
        s.reached(checkpoint)
    dirs = jit.redirect(work, {})
    _fill_jit(dirs)
    out = s.finish(eng.state(), write_extra=lambda w: jit.pack(w, dirs))
    s.abort()
    return out


def thaw(path: str) -> dict:
    from vitrify import session

    eng = TinyEngine()
    s = session.ThawSession(eng, path)
    try:
        out = s.run()
    finally:
        if eng.graphs is not None:
            eng.graphs.close()
        if s.region is not None and not s.region.closed:
            s.region.close()
    return {**eng.result, "checkpoints": out["checkpoints"], "warmup": out["warmup"],
            "base": out["base"]}


def unpacked(path: str, dest: str) -> dict:
    from vitrify import archive, jit

    if os.path.lexists(dest):
        shutil.rmtree(dest)
    dirs = jit.unpack(archive.open_archive(path), dest, {})
    out = {}
    for cache, d in sorted(dirs.items()):
        for root, _, names in os.walk(d):
            for n in sorted(names):
                full = os.path.join(root, n)
                with open(full, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                out[f"{cache}/{os.path.relpath(full, d)}"] = digest
    return out


# --------------------------------------------------------------------- running a consumer
class _Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise _Hang()


def guarded(fn) -> dict:
    """``fn()`` under an alarm: {"ok": value} / {"error", "message", "classes"} / {"hang"}."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CONSUMER_TIMEOUT_S)
    try:
        return {"ok": fn()}
    except _Hang:
        return {"hang": True}
    except BaseException as e:  # judged below: only a one-line ArchiveError is a refusal
        return {"error": type(e).__name__, "message": str(e),
                "classes": [c.__name__ for c in type(e).__mro__]}
    finally:
        signal.alarm(0)


def consume(path: str, jit_dest: str) -> dict:
    from vitrify import archive

    return {"verify": guarded(lambda: archive.verify(path)),
            "inspect": guarded(lambda: archive.render_inspect(archive.inspect(path))),
            "thaw": guarded(lambda: thaw(path)),
            "jit": guarded(lambda: unpacked(path, jit_dest))}


def judge(res: dict, base: dict, path: str, names: list[str], must: set[str]) -> list[str]:
    """What is wrong with one mutation's results (empty: refused or identical everywhere)."""
    bad = []
    if SENTINEL.decode().strip() in json.dumps(res):
        bad.append("the sentinel's bytes outside the archive showed up")
    for consumer, r in res.items():
        if "hang" in r:
            bad.append(f"{consumer} hung (over {CONSUMER_TIMEOUT_S} s)")
            continue
        if consumer == "verify":
            if "error" in r:
                bad.append(f"verify raised {r['error']}: {r['message'][:300]}")
            elif any("\n" in p or "\r" in p for p in r["ok"]):
                bad.append(f"verify printed a problem over several lines: {r['ok']}")
            elif "verify" in must and not r["ok"]:
                bad.append("verify found nothing wrong")
            continue
        if "error" in r:
            msg = r["message"]
            if not ({"ArchiveError", "SpanFileError"} & set(r["classes"])):
                bad.append(f"{consumer} raised {r['error']} (not an archive refusal): {msg[:300]}")
            elif "\n" in msg or "\r" in msg:
                bad.append(f"{consumer}'s refusal is not one line: {msg!r}")
            elif path not in msg or not (any(n in msg for n in names)
                                         or "ArchiveMismatch" in r["classes"]):
                bad.append(f"{consumer}'s refusal names no file of the archive: {msg[:300]}")
        elif consumer in must:
            bad.append(f"{consumer} was not refused")
    # A server start unpacks the JIT caches, then thaws: refused by either, or both identical.
    if not any("error" in res[c] or "hang" in res[c] for c in ("thaw", "jit")):
        for c in ("thaw", "jit"):
            if res[c]["ok"] != base[c]["ok"]:
                bad.append(f"{c} succeeded differently: {res[c]['ok']} (pristine: "
                           f"{base[c]['ok']})")
    return bad


# ----------------------------------------------------------------------------- mutations
def _crc(data: bytes) -> str:
    from vitrify import _native

    return f"crc32c:{_native.crc32c(data):08x}"


def _put(p: Path, data: bytes) -> None:
    """A new file at ``p`` (the copies share the pristine's inodes: never write in place)."""
    if p.is_symlink() or p.exists():
        p.unlink()
    p.write_bytes(data)


def _manifest(d: Path) -> dict:
    return json.loads((d / MANIFEST).read_bytes())


def _save_manifest(d: Path, m: dict, recheck: bool = True) -> None:
    from vitrify import archive

    if recheck:
        m["checksum"] = archive._manifest_checksum(m)
    _put(d / MANIFEST, json.dumps(m, indent=1).encode())


def _rewrite(d: Path, rel: str, data: bytes) -> None:
    """``rel`` gets new bytes and the manifest vouches for them (entry and checksum redone)."""
    _put(d / rel, data)
    m = _manifest(d)
    m["files"][rel] = {"bytes": len(data), "checksum": _crc(data)}
    _save_manifest(d, m)


def _edit_json(d: Path, rel: str, fn, recheck: bool = True) -> None:
    obj = json.loads((d / rel).read_bytes())
    fn(obj)
    if rel == MANIFEST:
        _save_manifest(d, obj, recheck)
    else:
        _rewrite(d, rel, json.dumps(obj, indent=1).encode())


def _unlist(d: Path, rel: str) -> None:
    m = _manifest(d)
    del m["files"][rel]
    _save_manifest(d, m)


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file() or stat.S_ISFIFO(os.lstat(p).st_mode):
        p.unlink()
    else:
        shutil.rmtree(p)


def _replace_fifo(p: Path) -> None:
    _remove(p)
    os.mkfifo(p)


def _replace_link(p: Path, target: Path) -> None:
    _remove(p)
    os.symlink(target, p)


def _truncate(d: Path, rel: str, size: int, recheck: bool) -> None:
    data = (d / rel).read_bytes()[:size]
    if recheck and rel != MANIFEST:
        _rewrite(d, rel, data)
    else:
        _put(d / rel, data)


def _flip(d: Path, rel: str, offset: int, recheck: bool) -> None:
    data = bytearray((d / rel).read_bytes())
    data[offset % len(data)] ^= 0x20
    if recheck and rel != MANIFEST:
        _rewrite(d, rel, bytes(data))
    else:
        _put(d / rel, bytes(data))


def _dumps_dup(obj, target: tuple) -> str:
    """JSON text of ``obj`` with the key at ``target`` written twice (the same value)."""
    if isinstance(obj, dict):
        parts = []
        for k, v in obj.items():
            sub = _dumps_dup(v, target[1:] if target and target[0] == k else ())
            parts.append(f"{json.dumps(k)}: {sub}")
            if len(target) == 1 and target[0] == k:
                parts.append(f"{json.dumps(k)}: {sub}")
        return "{" + ", ".join(parts) + "}"
    if isinstance(obj, list):
        return "[" + ", ".join(_dumps_dup(v, target[1:] if target and target[0] == i else ())
                               for i, v in enumerate(obj)) + "]"
    return json.dumps(obj)


def _paths(obj, prefix=()):
    """Every node's path below ``obj`` (keys and list indices)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) \
        else ()
    for k, v in items:
        yield prefix + (k,)
        yield from _paths(v, prefix + (k,))


def _at(obj, path):
    for k in path:
        obj = obj[k]
    return obj


REPLACEMENTS = {"null": None, "bool": True, "float": 1.5, "str": "x", "list": [], "object": {},
                "u64+1": 1 << 64, "neg": -1}


def _json_cases(rel: str, doc) -> list:
    cases = []
    for path in _paths(doc):
        if rel == STATE and path[0] == "engine" and len(path) > 1:
            continue  # the engine's own state: passed to the adapter unread
        where = "/".join(map(str, path))[:80]
        parent = _at(doc, path[:-1])

        def drop(obj, path=path):
            del _at(obj, path[:-1])[path[-1]]
        # an edit of the manifest's own checksum is left as it is (refused by the checksum)
        recheck = not (rel == MANIFEST and path[0] == "checksum")
        cases.append((f"{rel}:{where}:drop", rel, set(),
                      lambda d, c, f=drop, r=recheck: _edit_json(d, rel, f, r)))
        for kind, value in REPLACEMENTS.items():
            old = _at(doc, path)
            if (type(old) is type(value) and old == value) or \
                    (rel == STATE and path == ("engine",) and kind == "object"):
                continue  # no change; another engine state is the engine's to judge

            def retype(obj, path=path, value=value):
                _at(obj, path[:-1])[path[-1]] = value
            cases.append((f"{rel}:{where}:{kind}", rel, set(),
                          lambda d, c, f=retype, r=recheck: _edit_json(d, rel, f, r)))
        if isinstance(parent, dict):
            def dup(d, c, path=path):
                text = _dumps_dup(json.loads((d / rel).read_bytes()), path).encode()
                if rel == MANIFEST:
                    _put(d / rel, text)  # the same value twice: the checksum still matches
                else:
                    _rewrite(d, rel, text)
            cases.append((f"{rel}:{where}:dup", rel, set(), dup))
    return cases


def _file_cases(files: list[str], dirs: list[str]) -> list:
    """File-level mutations of every listed file and directory."""
    cases = []
    every = {"thaw", "jit", "verify"}  # all three open the archive, which checks every file
    for rel in [MANIFEST] + files:
        def add(name, must, fn, rel=rel):
            cases.append((f"{rel}:{name}", rel, must, fn))
        add("symlink-to-its-copy", every, lambda d, c, rel=rel: _replace_link(d / rel, c / rel))
        add("symlink-to-sentinel", every,
            lambda d, c, rel=rel: _replace_link(d / rel, c / "sentinel"))
        add("symlink-to-fifo", every, lambda d, c, rel=rel: _replace_link(d / rel, c / "fifo"))
        add("fifo", every, lambda d, c, rel=rel: _replace_fifo(d / rel))
        add("directory", every, lambda d, c, rel=rel: (_remove(d / rel), (d / rel).mkdir()))
        add("missing", every, lambda d, c, rel=rel: _remove(d / rel))
        add("truncated-half", every,
            lambda d, c, rel=rel: _truncate(d, rel, os.path.getsize(d / rel) // 2, False))
        add("flip-first", {"verify"}, lambda d, c, rel=rel: _flip(d, rel, 0, False))
        add("flip-middle", {"verify"},
            lambda d, c, rel=rel: _flip(d, rel, os.path.getsize(d / rel) // 2, False))
        add("flip-last", {"verify"}, lambda d, c, rel=rel: _flip(d, rel, -1, False))
        if rel == MANIFEST:
            continue
        reader = {"jit"} if rel.startswith("jit/") else {"thaw"}
        add("unlisted", reader, lambda d, c, rel=rel: _unlist(d, rel))
        add("unlisted-fifo", reader,
            lambda d, c, rel=rel: (_unlist(d, rel), _replace_fifo(d / rel)))
        add("unlisted-symlink-to-its-copy", reader,
            lambda d, c, rel=rel: (_unlist(d, rel), _replace_link(d / rel, c / rel)))
        add("truncated-half-rechecked", set(),
            lambda d, c, rel=rel: _truncate(d, rel, os.path.getsize(d / rel) // 2, True))
        add("empty-rechecked", set(), lambda d, c, rel=rel: _truncate(d, rel, 0, True))
        if rel.endswith(".span"):
            for off in (8, 100, 4096 + 7, -100, -5):
                add(f"flip-rechecked@{off}", set(),
                    lambda d, c, rel=rel, off=off: _flip(d, rel, off, True))
    for rel in dirs:
        cases.append((f"{rel}/:symlink-to-its-copy", rel, every,
                      lambda d, c, rel=rel: _replace_link(d / rel, c / rel)))
        cases.append((f"{rel}/:fifo", rel, every, lambda d, c, rel=rel: _replace_fifo(d / rel)))
    return cases


def _issue_cases(m: dict) -> list:
    """The cases issue 33 names (each must be refused by the consumers that read the file)."""
    every = {"thaw", "jit", "verify"}
    weights, graph0 = "rank0/region/weights.span", "rank0/graphs/00000.tgraph"

    def manifest_path(key):
        def fn(d, c):
            mm = _manifest(d)
            mm["files"][key] = {"bytes": 1, "checksum": "crc32c:00000000"}
            _save_manifest(d, mm)
        return fn

    def raw_manifest(text: bytes):
        return lambda d, c: _put(d / MANIFEST, text)

    def huge_base(d, c):
        text = (d / MANIFEST).read_text()
        key = f'"base": {m["region"]["base"]}'
        assert key in text
        _put(d / MANIFEST, text.replace(key, '"base": ' + "7" * 100000).encode())

    def jit_files(value):
        return lambda d, c: _edit_json(d, JIT_INDEX, lambda j: j["caches"]["triton"]["files"]
                                       .__setitem__(0, value))

    def state(fn):
        return lambda d, c: _edit_json(d, STATE, fn)

    def index(fn):
        return lambda d, c: _edit_json(d, INDEX, fn)

    def session_set(key, value):
        return state(lambda s: s["session"].__setitem__(key, value))

    def region_set(key, value):
        return lambda d, c: _edit_json(d, MANIFEST, lambda mm: mm["region"].__setitem__(key, value))

    def checkpoint_set(name, value):
        return lambda d, c: _edit_json(d, MANIFEST,
                                       lambda mm: mm["region"]["checkpoints"].__setitem__(name,
                                                                                          value))

    def newline_on_disk(d, c):
        (d / "rank0" / "x\nOK all good").write_bytes(b"")

    def weights_is_warmup(d, c):  # another span's file in the weights span's place
        _rewrite(d, weights, (d / "rank0/region/warmup.span").read_bytes())

    def sparse_manifest(d, c):
        _remove(d / MANIFEST)
        with open(d / MANIFEST, "wb") as f:
            f.truncate(70 * MiB)

    built = m["region"]["checkpoints"]["built"]
    return [
        ("issue-8-weights-span-unlisted", weights, {"thaw"}, lambda d, c: _unlist(d, weights)),
        ("issue-8-graph-index-unlisted", INDEX, {"thaw"}, lambda d, c: _unlist(d, INDEX)),
        ("issue-8-graph-file-unlisted", graph0, {"thaw"}, lambda d, c: _unlist(d, graph0)),
        ("issue-8-weights-span-replaced-by-another-span", weights, {"thaw"}, weights_is_warmup),
        # review: a state edited to "no graphs" would thaw without the graphs FREEZE saved
        ("issue-8-session-graphs-zero-with-an-index", STATE, {"thaw"},
         session_set("graphs", 0)),
        ("issue-9-graph-index-unlisted-fifo", INDEX, {"thaw"},
         lambda d, c: (_unlist(d, INDEX), _replace_fifo(d / INDEX))),
        ("issue-9-graph-index-unlisted-symlink-outside", INDEX, {"thaw"},
         lambda d, c: (_unlist(d, INDEX), _replace_link(d / INDEX, c / INDEX))),
        ("issue-10-manifest-fifo", MANIFEST, every, lambda d, c: _replace_fifo(d / MANIFEST)),
        ("issue-10-manifest-symlink-to-fifo", MANIFEST, every,
         lambda d, c: _replace_link(d / MANIFEST, c / "fifo")),
        ("issue-10-manifest-over-the-size-bound", MANIFEST, every, sparse_manifest),
        ("issue-11-manifest-directory", MANIFEST, every,
         lambda d, c: (_remove(d / MANIFEST), (d / MANIFEST).mkdir())),
        ("issue-11-manifest-deep-nesting", MANIFEST, every, raw_manifest(b"[" * 100000)),
        ("issue-11-manifest-100000-digit-int", MANIFEST, every, huge_base),
        ("issue-11-manifest-300-character-path", MANIFEST, every,
         manifest_path("rank0/" + "a" * 300)),
        ("issue-11-manifest-not-utf8", MANIFEST, every, raw_manifest(b'{"format": "\xff"}')),
        ("issue-11-manifest-nan", MANIFEST, every, raw_manifest(b'{"format": NaN}')),
        ("issue-12-state-spans-missing", STATE, {"thaw"},
         state(lambda s: s["session"].pop("spans"))),
        ("issue-12-state-session-a-list", STATE, {"thaw"},
         state(lambda s: s.__setitem__("session", []))),
        ("issue-12-index-graph-without-file", INDEX, {"thaw"},
         index(lambda i: i["graphs"][0].pop("file"))),
        ("issue-12-index-graphs-a-str", INDEX, {"thaw"}, index(lambda i: i.__setitem__("graphs",
                                                                                        "x"))),
        ("issue-12-index-region-missing", INDEX, {"thaw"}, index(lambda i: i.pop("region"))),
        ("issue-12-index-unclassified-words-a-dict", INDEX, {"thaw"},
         index(lambda i: i["graphs"][0]["unclassified"].__setitem__("words", {}))),
        ("issue-13-region-base-2**64", MANIFEST, every, region_set("base", 1 << 64)),
        ("issue-13-region-size-2**64", MANIFEST, every, region_set("size", 1 << 64)),
        ("issue-13-checkpoint-2**64", MANIFEST, every, checkpoint_set("built", 1 << 64)),
        ("issue-13-checkpoint-moved", MANIFEST, {"thaw"}, checkpoint_set("built", built + 2 * MiB)),
        ("issue-13-version-true", MANIFEST, every,
         lambda d, c: _edit_json(d, MANIFEST, lambda mm: mm.__setitem__("version", True))),
        ("issue-13-version-1.0", MANIFEST, every,
         lambda d, c: _edit_json(d, MANIFEST, lambda mm: mm.__setitem__("version", 1.0))),
        ("issue-13-file-bytes-2**63", MANIFEST, every,
         lambda d, c: _edit_json(d, MANIFEST, lambda mm: mm["files"][STATE].__setitem__(
             "bytes", 1 << 63))),
        ("issue-13-session-graphs-str", STATE, {"thaw"}, session_set("graphs", "x")),
        ("issue-13-session-graphs-true", STATE, {"thaw"}, session_set("graphs", True)),
        ("issue-13-session-graphs-miscounted", STATE, {"thaw"}, session_set("graphs", 3)),
        ("issue-13-session-format-1.0", STATE, {"thaw"}, session_set("format", 1.0)),
        ("issue-13-session-span-2**64", STATE, {"thaw"},
         state(lambda s: s["session"]["spans"].__setitem__("weights", [0, 1 << 64]))),
        ("issue-13-session-dumped-lacks-spans", STATE, {"thaw"}, session_set("dumped",
                                                                             ["weights"])),
        ("issue-14-newline-in-a-manifest-path", MANIFEST, every,
         manifest_path("rank0/x\nOK all good")),
        ("issue-14-escape-in-a-manifest-path", MANIFEST, every,
         manifest_path("rank0/x\x1b[2J")),
        ("issue-14-surrogate-in-a-manifest-path", MANIFEST, every, manifest_path("rank0/\ud800")),
        ("issue-14-newline-in-an-unlisted-name", MANIFEST, {"verify"}, newline_on_disk),
        ("issue-14-newline-in-the-fingerprint", MANIFEST, every,
         lambda d, c: _edit_json(d, MANIFEST, lambda mm: mm["fingerprint"].__setitem__(
             "model", "tiny@1\nOK"))),
        ("issue-15-jit-path-dotdot", JIT_INDEX, {"jit", "verify"}, jit_files("../../x")),
        ("issue-15-jit-path-absolute", JIT_INDEX, {"jit", "verify"}, jit_files("/etc/passwd")),
        ("issue-15-jit-path-nul", JIT_INDEX, {"jit", "verify"}, jit_files("a\x00b")),
        ("issue-15-jit-path-int", JIT_INDEX, {"jit", "verify"}, jit_files(5)),
        ("issue-15-jit-path-newline", JIT_INDEX, {"jit", "verify"}, jit_files("a\nb")),
        ("manifest-path-dotdot", MANIFEST, every, manifest_path("../x")),
        ("manifest-path-absolute", MANIFEST, every, manifest_path("/etc/passwd")),
        ("manifest-path-nul", MANIFEST, every, manifest_path("rank0/x\x00y")),
        ("manifest-lists-itself", MANIFEST, every, manifest_path(MANIFEST)),
        ("index-graph-file-outside", INDEX, {"thaw"},
         index(lambda i: i["graphs"][0].__setitem__("file", "../../state.json"))),
        ("index-graph-file-is-the-index", INDEX, {"thaw"},
         index(lambda i: i["graphs"][0].__setitem__("file", "graphs/index.json"))),
        ("index-graph-name-twice", INDEX, {"thaw"},
         index(lambda i: i["graphs"][1].__setitem__("name", i["graphs"][0]["name"]))),
        ("index-unknown-module", INDEX, {"thaw"},
         index(lambda i: i["graphs"][0].__setitem__("modules", ["0" * 64]))),
        ("index-graphs-list-no-modules", INDEX, {"thaw"},
         index(lambda i: [g.__setitem__("modules", []) for g in i["graphs"]])),
        ("index-graph-renamed", INDEX, {"thaw"},
         index(lambda i: i["graphs"][0].__setitem__("name", "prefill"))),
    ]


def all_cases(pristine: Path) -> tuple[list, list]:
    """(the issue's cases, the generated ones), in a fixed order."""
    m = json.loads((pristine / MANIFEST).read_bytes())
    files = sorted(m["files"])
    dirs = sorted({rel.rsplit("/", i)[0] for rel in files for i in range(1, rel.count("/") + 1)})
    generated = _file_cases(files, dirs)
    for rel in (MANIFEST, STATE, INDEX, JIT_INDEX):
        generated += _json_cases(rel, json.loads((pristine / rel).read_bytes()))
    return _issue_cases(m), generated


# -------------------------------------------------------------------------------- worker
def worker(pristine: str, outside: str, scratch: str, shard: int, shards: int, which: str,
           sample: int) -> int:
    """Runs this shard's mutations; one JSON line per mutation on stdout."""
    pristine_p, outside_p = Path(pristine), Path(outside)
    issue, generated = all_cases(pristine_p)
    if sample and len(generated) > sample:
        step = len(generated) / sample
        generated = [generated[int(i * step)] for i in range(sample)]
    cases = issue if which == "issue" else generated if which == "generated" else issue + generated
    names = sorted(json.loads((pristine_p / MANIFEST).read_bytes())["files"]) + [MANIFEST]
    base = consume(pristine, os.path.join(scratch, "jit-pristine"))
    assert "ok" in base["thaw"] and "ok" in base["jit"], base
    print(json.dumps({"baseline": base["thaw"]["ok"], "cases": len(cases)}), flush=True)
    for i, (name, target, must, apply) in enumerate(cases):
        if i % shards != shard:
            continue
        print(json.dumps({"start": name}), flush=True)
        d = Path(scratch) / f"m{i}.vitrify"
        shutil.copytree(pristine_p, d, copy_function=os.link)
        try:
            apply(d, outside_p)
        except Exception as e:  # a mutation this archive cannot take: the test's own bug
            print(json.dumps({"name": name, "bad": [f"cannot apply: {e!r}"]}), flush=True)
            continue
        res = consume(str(d), os.path.join(scratch, f"jit-{i}"))
        bad = judge(res, base, str(d), names, must)
        refused = any("error" in res[c] for c in ("thaw", "jit"))
        print(json.dumps({"name": name, "target": target, "bad": bad,
                          "outcome": "refused" if refused else "identical",
                          "thaw": res["thaw"].get("message", "identical")[:300]}), flush=True)
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(os.path.join(scratch, f"jit-{i}"), ignore_errors=True)
    return 0


# ---------------------------------------------------------------------------------- tests
def _env() -> dict:
    return dict(os.environ, VITRIFY_LIBCUDA_PATH=FAKE or "", FAKE_CUDA_DEVICES="1")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    if not FAKE:
        pytest.skip("VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
    root = tmp_path_factory.mktemp("mutation")
    path = root / "pristine.vitrify"
    p = subprocess.run([sys.executable, __file__, "freeze", str(path), str(root / "jit-work")],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    # outside the archive: an identical copy of every file and directory, a sentinel, a FIFO
    outside = root / "outside"
    shutil.copytree(path, outside)
    (outside / "sentinel").write_bytes(SENTINEL)
    os.mkfifo(outside / "fifo")
    for dirpath, _, names in os.walk(outside):
        for n in names:
            full = os.path.join(dirpath, n)
            if os.path.isfile(full):
                os.utime(full, (OLD_ATIME, os.stat(full).st_mtime))
    return path, outside


def _outside_untouched(outside: Path) -> list[str]:
    read = []
    for dirpath, _, names in os.walk(outside):
        for n in names:
            full = os.path.join(dirpath, n)
            if os.path.isfile(full) and os.stat(full).st_atime != OLD_ATIME:
                read.append(os.path.relpath(full, outside))
    return read


def _run_workers(pristine: Path, outside: Path, which: str, sample: int, shards: int,
                 timeout: int) -> list[dict]:
    scratch = [tempfile.mkdtemp(prefix=f"vitrify-mutation-{i}-", dir=pristine.parent)
               for i in range(shards)]
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(pristine), str(outside),
                               scratch[i], str(i), str(shards), which, str(sample)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env()) for i in range(shards)]
    results = []
    for i, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            started = [json.loads(ln)["start"] for ln in out.splitlines() if '"start"' in ln]
            pytest.fail(f"worker {i} did not finish in {timeout} s; the last mutation it "
                        f"started: {started[-1:] or '(none)'}")
        lines = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
        assert proc.returncode == 0 and lines, f"worker {i} failed:\n{err[-3000:]}"
        results += [r for r in lines if "name" in r]
    for s in scratch:
        shutil.rmtree(s, ignore_errors=True)
    return results


def _report(results: list[dict], capsys, what: str) -> None:
    refused = sum(r.get("outcome") == "refused" for r in results)
    identical = sum(r.get("outcome") == "identical" for r in results)
    with capsys.disabled():
        print(f"\n{what}: {refused} refused, {identical} thawed identically, "
              f"{len(results)} total")


@needs_fake
def test_the_issues_archive_cases_are_refused_naming_the_file(pristine, capsys):
    """Issue 33 items 8-15, each on a real archive: refused (by the consumers that read the
    file) with one line naming the archive and a file, no hang, nothing read outside."""
    path, outside = pristine
    results = _run_workers(path, outside, "issue", 0, 1, 300)
    bad = {r["name"]: r["bad"] for r in results if r["bad"]}
    assert not bad, json.dumps(bad, indent=1)
    assert len(results) == len(_issue_cases(json.loads((path / MANIFEST).read_bytes())))
    assert _outside_untouched(outside) == []
    _report(results, capsys, "issue 33 archive cases")
    # the refusals name what the issue says they name
    by_name = {r["name"]: r["thaw"] for r in results}
    assert "rank0/region/weights.span: not in the manifest" in \
        by_name["issue-8-weights-span-unlisted"]
    assert "rank0/graphs/index.json: not in the manifest" in \
        by_name["issue-9-graph-index-unlisted-fifo"]
    assert "manifest.json: not a regular file (a FIFO)" in by_name["issue-10-manifest-fifo"]
    assert "manifest.json: not valid JSON: nested too deeply" in \
        by_name["issue-11-manifest-deep-nesting"]
    assert "rank0/state.json: session.graphs: must be an int" in \
        by_name["issue-13-session-graphs-str"]


@needs_fake
def test_every_mutation_is_refused_or_thaws_identically(pristine, capsys):
    path, outside = pristine
    full = os.environ.get("VITRIFY_LONG_TESTS") == "1"
    results = _run_workers(path, outside, "all", 0 if full else 700, 2, 600)
    bad = {r["name"]: r["bad"] for r in results if r["bad"]}
    assert not bad, f"{len(bad)} mutations went wrong:\n" + json.dumps(dict(list(bad.items())[:40]),
                                                                       indent=1)
    assert _outside_untouched(outside) == [], "a file outside the archive was read"
    assert sum(r["outcome"] == "refused" for r in results) > len(results) // 2
    _report(results, capsys, "archive mutations" + ("" if full else " (sampled; "
                                                    "VITRIFY_LONG_TESTS=1 runs all)"))


def main(argv: list[str]) -> int:
    if argv[0] == "freeze":
        freeze(argv[1], argv[2])
        return 0
    if argv[0] == "worker":
        pristine, outside, scratch, shard, shards, which, sample = argv[1:8]
        return worker(pristine, outside, scratch, int(shard), int(shards), which, int(sample))
    raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def test_inspect_relocations_reads_only_what_the_manifest_vouches_for(pristine, tmp_path):
    """`vitrify inspect --relocations` on the CPU: the audit table of both graphs; a graph file
    swapped for a link to its identical copy outside is refused in one line naming the file,
    and that copy is never read."""
    path, outside = pristine
    env = dict(os.environ, VITRIFY_LIBCUDA_PATH=FAKE or "", FAKE_CUDA_DEVICES="1")
    r = subprocess.run([sys.executable, "-m", "vitrify", "inspect", "--relocations", str(path)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("rank 0: region base 0x")
    assert "2 graphs" in r.stdout.splitlines()[0]
    assert {"decode_bs1", "decode_bs8"} <= {ln.split()[0] for ln in r.stdout.splitlines()[2:]}
    copy = tmp_path / "linked.vitrify"
    shutil.copytree(path, copy)
    index = json.loads((copy / INDEX).read_text())
    graph_rel = "rank0/" + index["graphs"][0]["file"]
    os.unlink(copy / graph_rel)
    os.symlink(outside / graph_rel, copy / graph_rel)
    before = os.stat(outside / graph_rel).st_atime
    r = subprocess.run([sys.executable, "-m", "vitrify", "inspect", "--relocations", str(copy)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and graph_rel in r.stderr, r.stderr
    assert os.stat(outside / graph_rel).st_atime == before
