"""Each file of an archive has one schema, checked once when it is read, and is read only after
the manifest vouched for it (issue 33, items 8-15), on the CPU without a driver: a non-regular
manifest is refused without waiting, ``verify`` never raises, types are strict and bounded,
no path holds a control character, and the session state, the graph index and the JIT index
are checked field by field, each problem an ArchiveCorrupt naming the archive, the file and the
field. (The same cases through a real THAW, and many generated ones: test_archive_mutation.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vitrify import _native, archive, cli, graph, jit, session
from vitrify.archive import (ArchiveCorrupt, ArchiveMismatch, ArchiveWriter, Fingerprint, Region,
                             UnsafePath)
from vitrify.snapshot import HostBackend

G = 64 << 10
FP = Fingerprint(gpu="NVIDIA H200", sm="9.0", driver="580.159.04", cuda="13.0", torch="2.11.0",
                 engine="tiny", engine_version="1", model="tiny@1")
CPS = {"built": G, "weights": 2 * G, "state": 3 * G, "warmup": 4 * G, "captured": 5 * G}
HEX = "ab" * 32
INDEX = "rank0/graphs/index.json"
STATE = "rank0/state.json"


def _index() -> dict:
    """A graph index as GraphStore.save writes one (one graph, one module)."""
    return {
        "format": "vitrify-graphs", "version": 1, "graph_format_version": 2, "device": 0,
        "region": {"base": 0x7E0000000000, "size": 1 << 30},
        "graphs": [{"name": "decode", "file": "graphs/00000.tgraph", "bytes": 100,
                    "sha256": "cd" * 32, "nodes": 1, "relocations": 1,
                    "relocations_by_kind": {"pointer parameter": 1}, "relocatable": False,
                    "unclassified": {"count": 1, "words": [
                        {"node": 0, "kernel": "scale", "offset": 8, "value": "0x7e0000001000",
                         "reason": "may be a pointer"}]},
                    "integers_kept": {}, "topology": "ef" * 32, "modules": [HEX]}],
        "templates": [{"topology": "ef" * 32, "graphs": ["decode"]}],
        "modules": {HEX: {"file": f"modules/{HEX}.bin", "bytes": 46, "kind": "ptx",
                          "kernels": 1}},
    }


def _session_state() -> dict:
    return {"session": {"format": 1, "phases": list(session.PHASES),
                        "spans": {"weights": [0, 2 * G], "warmup": [3 * G, 4 * G],
                                  "graphs": [4 * G, 5 * G]},
                        "graphs": 1, "record_kernels": True,
                        "dumped": ["weights", "warmup", "graphs"]},
            "engine": {"anything": [1, 2]}}


def build(path: Path) -> Path:
    """A session-shaped archive written without a driver: the three spans (host memory), the
    session state, a graph index with its graph and module files, and JIT caches."""
    be = HostBackend(5 * G, alignment=G)
    be.write(0, os.urandom(5 * G))
    with ArchiveWriter(path, FP, Region(base=be.base, size=8 * G, granularity=G,
                                        checkpoints=CPS)) as w:
        for name, (lo, hi) in _session_state()["session"]["spans"].items():
            w.dump_span(0, name, be.base, lo, hi, target=be, chunk_bytes=G, granularity=G,
                        direct_io="off")
        w.write_state(0, _session_state())
        w.write_bytes("rank0/graphs/00000.tgraph", b"g" * 100)
        w.write_bytes(f"rank0/modules/{HEX}.bin", b"m" * 46)
        w.write_json(INDEX, _index())
        w.write_bytes("jit/triton/AB/k.cubin", b"k" * 30)
        w.write_json(jit.INDEX, {"format": 1, "caches": {"triton": {
            "variable": "TRITON_CACHE_DIR", "files": ["AB/k.cubin"], "bytes": 30}}})
    return path


@pytest.fixture
def arch(tmp_path) -> Path:
    return build(tmp_path / "a.vitrify")


def _crc(data: bytes) -> str:
    return f"crc32c:{_native.crc32c(data):08x}"


def edit_manifest(p: Path, fn, recheck: bool = True) -> None:
    m = json.loads((p / "manifest.json").read_bytes())
    fn(m)
    if recheck:
        m["checksum"] = archive._manifest_checksum(m)
    (p / "manifest.json").write_text(json.dumps(m))


def rewrite(p: Path, rel: str, data: bytes) -> None:
    """New bytes for ``rel`` that the manifest vouches for (entry and checksum redone)."""
    (p / rel).write_bytes(data)
    edit_manifest(p, lambda m: m["files"].__setitem__(rel, {"bytes": len(data),
                                                             "checksum": _crc(data)}))


def edit_json(p: Path, rel: str, fn) -> None:
    obj = json.loads((p / rel).read_bytes())
    fn(obj)
    rewrite(p, rel, json.dumps(obj).encode())


class _Hang(Exception):
    pass


def bounded(fn, seconds: int = 10):
    """``fn()``, or _Hang after ``seconds`` (a read of a FIFO would wait forever)."""
    def alarm(signum, frame):
        raise _Hang(f"still waiting after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def cli_lines(capsys, *argv) -> tuple[int, list[str]]:
    rc = bounded(lambda: cli.main(list(argv)))
    out = capsys.readouterr()
    return rc, (out.out + out.err).splitlines()


def test_the_archive_built_here_is_intact(arch, capsys):
    assert archive.verify(arch) == []
    a = archive.open_archive(arch, checksums=True)
    assert session.read_state(a)["engine"] == {"anything": [1, 2]}
    assert graph.archive_index(a, 0)["graphs"][0]["name"] == "decode"
    assert jit.read_index(a)["caches"]["triton"]["files"] == ["AB/k.cubin"]
    assert archive.inspect(arch)["ranks"][0]["relocation"]["non_relocatable"] == ["decode"]


# ---- item 10: only a regular file is opened, without following a link, within a bound ---------

@pytest.mark.parametrize("kind", ["fifo", "symlink-to-fifo", "directory", "over-the-bound"])
def test_a_manifest_that_is_not_a_regular_file_is_refused_without_waiting(arch, kind, capsys):
    m = arch / "manifest.json"
    m.unlink()
    if kind == "fifo":
        os.mkfifo(m)
    elif kind == "symlink-to-fifo":
        os.mkfifo(arch.parent / "fifo")
        os.symlink(arch.parent / "fifo", m)
    elif kind == "directory":
        m.mkdir()
    else:
        with open(m, "wb") as f:
            f.truncate(archive.MAX_MANIFEST_BYTES + 1)  # sparse: nothing need be read
    want = {"fifo": "manifest.json: not a regular file (a FIFO)",
            "symlink-to-fifo": "manifest.json: manifest.json is a symlink",
            "directory": "manifest.json: not a regular file (a directory)",
            "over-the-bound": "manifest.json: 67108865 bytes, more than a manifest may have"}[kind]
    with pytest.raises(ArchiveCorrupt, match=re.escape(want)):
        bounded(lambda: archive.open_archive(arch))
    assert [want in p for p in bounded(lambda: archive.verify(arch))] == [True]
    with pytest.raises(ArchiveCorrupt, match=re.escape(want)):
        bounded(lambda: archive.inspect(arch))
    for command in ("verify", "inspect"):
        rc, lines = cli_lines(capsys, command, str(arch))
        assert rc == 1 and len(lines) == 1 and want in lines[0], lines


def test_the_cli_does_not_wait_on_a_fifo_manifest(arch):
    (arch / "manifest.json").unlink()
    os.mkfifo(arch / "manifest.json")
    for command in ("verify", "inspect"):
        p = subprocess.run([sys.executable, "-m", "vitrify", command, str(arch)],
                           capture_output=True, text=True, timeout=60)
        lines = (p.stdout + p.stderr).splitlines()
        assert p.returncode == 1 and len(lines) == 1, lines
        assert "manifest.json: not a regular file (a FIFO)" in lines[0]


# ---- item 11: verify returns problems, one line each naming manifest.json; it never raises ----

def _raw(text: bytes):
    return lambda p: (p / "manifest.json").write_bytes(text)


def _huge_int(p: Path) -> None:
    text = (p / "manifest.json").read_text()
    m = json.loads(text)
    old = f'"size": {m["region"]["size"]}'
    assert old in text
    (p / "manifest.json").write_text(text.replace(old, '"size": ' + "9" * 100000))


def _directory(p: Path) -> None:
    (p / "manifest.json").unlink()
    (p / "manifest.json").mkdir()


def _long_path(p: Path) -> None:
    edit_manifest(p, lambda m: m["files"].__setitem__("rank0/" + "a" * 300, {
        "bytes": 1, "checksum": "crc32c:00000000"}))


@pytest.mark.parametrize("damage, reason", [
    (_directory, "not a regular file (a directory)"),
    (_raw(b"[" * 100000), "not valid JSON: nested too deeply"),
    (_huge_int, "not valid JSON: an integer of 100000 digits"),
    (_long_path, "has a component longer than 255 bytes"),
    (_raw(b'{"format": "vitrify-archive", "format": "zip"}'), "appears twice in one object"),
    (_raw(b'{"format": "\xff"}'), "not UTF-8 text"),
    (_raw(b'{"format": Infinity}'), "Infinity is not JSON"),
    (_raw(b'{"format": 1e999}'), "is not finite"),
    (_raw(b"5"), "must hold a JSON object, got int 5"),
], ids=["directory", "deep-nesting", "100000-digits", "300-character-path", "duplicate-key",
        "not-utf8", "infinity", "float-overflow", "not-an-object"])
def test_verify_reports_a_damaged_manifest_in_one_line_naming_it(arch, damage, reason, capsys):
    damage(arch)
    problems = bounded(lambda: archive.verify(arch))
    assert len(problems) == 1 and "manifest.json: " in problems[0] and reason in problems[0], \
        problems
    assert "\n" not in problems[0] and len(problems[0]) < 600
    rc, lines = cli_lines(capsys, "verify", str(arch))
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("FAIL ") and \
        "manifest.json" in lines[0], lines
    with pytest.raises(ArchiveCorrupt, match="manifest.json"):
        archive.open_archive(arch)


def test_verify_of_a_path_that_cannot_be_an_archive_returns_the_reason(tmp_path):
    assert "no archive directory" in archive.verify(tmp_path / ("a" * 300))[0]
    (tmp_path / "file").write_bytes(b"x")
    assert "no archive directory" in archive.verify(tmp_path / "file")[0]


# ---- item 13: strict types (bool is not int, float is not int) and bounds -------------------

def _set(*path, value):
    def fn(m):
        for k in path[:-1]:
            m = m[k]
        m[path[-1]] = value
    return fn


@pytest.mark.parametrize("edit, field", [
    (_set("region", "base", value=1 << 64), "region.base: must be an int in [0, "),
    (_set("region", "size", value=1 << 64), "region.size: must be an int in [0, "),
    (_set("region", "base", value=(1 << 64) - G), "is past the 64-bit address space"),
    (_set("region", "granularity", value=True), "region.granularity: must be an int"),
    (_set("region", "checkpoints", "built", value=1 << 64), "region.checkpoints['built']: "),
    (_set("region", "checkpoints", "built", value=9 * G), "is past the region's size"),
    (_set("region", "checkpoints", "built", value=1.0), "region.checkpoints['built']: must be "
                                                         "an int in [0, 18446744073709551615], "
                                                         "got float 1.0"),
    (_set("version", value=True), "version: must be an int, got bool True"),
    (_set("version", value=1.0), "version: must be an int, got float 1.0"),
    (_set("files", STATE, "bytes", value=1 << 63), "files['rank0/state.json'].bytes: must be "
                                                   "an int in [0, 9223372036854775807]"),
    (_set("files", STATE, "bytes", value=False), "files['rank0/state.json'].bytes: must be"),
    (_set("fingerprint", "model", value=5), "fingerprint.model: must be a str, got int 5"),
    (_set("fingerprint", "model", value="tiny\nOK"), "fingerprint.model: 'tiny\\nOK' contains "
                                                     "the control character"),
    (_set("created", value=None), "created: must be a str, got NoneType None"),
], ids=["base-2**64", "size-2**64", "base+size", "granularity-bool", "checkpoint-2**64",
        "checkpoint-past-size", "checkpoint-float", "version-true", "version-1.0",
        "bytes-2**63", "bytes-bool", "fingerprint-int", "fingerprint-newline", "created-null"])
def test_manifest_fields_have_strict_types_and_bounds(arch, edit, field):
    edit_manifest(arch, edit)
    with pytest.raises(ArchiveCorrupt) as e:
        archive.open_archive(arch)
    assert e.value.relpath == "manifest.json" and field in str(e.value), str(e.value)
    problems = archive.verify(arch)
    assert len(problems) == 1 and field in problems[0]


def test_another_version_or_format_is_a_mismatch_not_damage(arch):
    edit_manifest(arch, _set("version", value=2))
    with pytest.raises(ArchiveMismatch, match="version mismatch: expected 1, the archive has 2"):
        archive.open_archive(arch)
    edit_manifest(arch, _set("format", value="zip" * 1000))
    with pytest.raises(ArchiveMismatch) as e:
        archive.open_archive(arch)
    assert len(str(e.value)) < 300  # the value read is cut, not printed whole


def test_the_writer_refuses_what_the_reader_would(tmp_path):
    with pytest.raises(ValueError, match="region.checkpoints\\['w'\\]: .* past the region's size"):
        ArchiveWriter(tmp_path / "a", FP, Region(0, G, G, {"w": 2 * G}))
    with pytest.raises(ValueError, match="fingerprint.model: .* control character"):
        ArchiveWriter(tmp_path / "b", Fingerprint(model="m\n"), Region(0, G, G))
    with ArchiveWriter(tmp_path / "c", FP, Region(0, G, G)) as w:
        for bad in ("a\nb", "a\x1bb", "x" * 256, "a/" * 2048 + "b"):
            with pytest.raises(ValueError, match="archive path"):
                w.write_bytes(bad, b"")


# ---- item 14: no control character in any path; output stays one line per problem -----------

@pytest.mark.parametrize("key", ["rank0/x\nOK all good", "rank0/x\rOK", "rank0/\x1b[2Jx",
                                 "rank0/x\x7f", "rank0/x\x85", "rank0/\ud800",
                                 "rank0/x\u2028OK", "rank0/\u202etxt.exe"],
                         ids=["newline", "return", "escape", "delete", "c1-nel", "surrogate",
                              "line-separator", "right-to-left-override"])
def test_a_control_character_in_a_manifest_path_is_refused_on_one_line(arch, key, capsys):
    edit_manifest(arch, lambda m: m["files"].__setitem__(key, {"bytes": 1,
                                                               "checksum": "crc32c:00000000"}))
    with pytest.raises(UnsafePath) as e:
        archive.open_archive(arch)
    assert e.value.relpath == "manifest.json" and repr(key)[1:-1] in str(e.value)
    rc, lines = cli_lines(capsys, "verify", str(arch))
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("FAIL "), lines


def test_an_unlisted_file_named_with_a_newline_is_one_line_of_verify(arch, capsys):
    (arch / "rank0" / "x\nOK all good").write_bytes(b"")
    problems = archive.verify(arch)
    assert problems == [f"archive {arch}: 'rank0/x\\nOK all good': present but not in the "
                        f"manifest"]
    rc, lines = cli_lines(capsys, "verify", str(arch))
    assert rc == 1 and [ln[:5] for ln in lines] == ["FAIL "]


# ---- items 8, 12, 13: the session state --------------------------------------------------------

@pytest.mark.parametrize("edit, where, what", [
    (lambda s: s["session"].__setitem__("graphs", "x"), STATE,
     "session.graphs: must be an int in [0, 4294967295], got str 'x'"),
    (lambda s: s["session"].__setitem__("graphs", True), STATE, "session.graphs: must be an int"),
    (lambda s: s["session"].__setitem__("graphs", 2), STATE,
     "session.graphs: 2, but rank0/graphs/index.json lists 1 graphs"),
    (lambda s: s["session"].pop("spans"), STATE, "session.spans: missing"),
    (lambda s: s.__setitem__("session", []), STATE, "session: must be an object, got list []"),
    (lambda s: s["session"]["spans"].__setitem__("weights", [0]), STATE,
     "session.spans['weights']: must be a list of 2, got list [0]"),
    (lambda s: s["session"]["spans"].__setitem__("weights", [0, 3 * G]), STATE,
     "session.spans.weights: [0, 196608], but the manifest's checkpoints give [0, 131072]"),
    (lambda s: s["session"].__setitem__("phases", ["built"]), STATE, "session.phases:"),
    (lambda s: s["session"].__setitem__("dumped", ["warmup", "graphs"]), STATE,
     "session.dumped: lacks 'weights'"),
    (lambda s: s["session"].__setitem__("dumped", ["weights", "weights"]), STATE,
     "session.dumped[1]: 'weights' appears twice"),
    (lambda s: s["session"].__setitem__("record_kernels", 1), STATE,
     "session.record_kernels: must be true or false, got int 1"),
    (lambda s: s.__setitem__("engine", "x"), STATE, "engine: must be an object"),
], ids=["graphs-str", "graphs-bool", "graphs-miscounted", "spans-missing", "session-list",
        "span-short", "span-moved", "phases", "dumped-lacks-weights", "dumped-twice",
        "record-kernels-int", "engine-str"])
def test_the_session_state_is_checked_field_by_field(arch, edit, where, what):
    edit_json(arch, STATE, edit)
    a = archive.open_archive(arch)
    with pytest.raises(ArchiveCorrupt) as e:
        session.read_state(a)
    assert e.value.relpath == where and what in str(e.value), str(e.value)
    assert [what in p for p in archive.verify(arch)] == [True]


@pytest.mark.parametrize("rel", ["rank0/region/weights.span", "rank0/region/warmup.span",
                                 "rank0/region/graphs.span", INDEX])
def test_a_file_the_session_state_records_must_be_listed(arch, rel):
    """Item 8: the manifest re-checksummed without a file the state records: refused naming it,
    never thawed without it."""
    edit_manifest(arch, lambda m: m["files"].pop(rel))
    a = archive.open_archive(arch)
    with pytest.raises(ArchiveCorrupt) as e:
        session.read_state(a)
    assert e.value.relpath == rel and "not in the manifest" in str(e.value)
    assert any(f"{rel}: not in the manifest" in p for p in archive.verify(arch))


def test_a_span_not_dumped_but_listed_is_refused(arch):
    edit_json(arch, STATE, lambda s: s["session"].__setitem__("dumped", ["weights", "graphs"]))
    with pytest.raises(ArchiveCorrupt, match="warmup.span: listed in the manifest, but the "
                                             "session state says FREEZE did not dump"):
        session.read_state(archive.open_archive(arch))


def test_a_span_is_restored_only_within_its_range(arch):
    """A span file moved into another's place (the manifest re-checksummed) never writes
    outside the range the session state records for it."""
    rewrite(arch, "rank0/region/weights.span", (arch / "rank0/region/warmup.span").read_bytes())
    a = archive.open_archive(arch)
    dst = HostBackend(8 * G, alignment=G)
    with pytest.raises(ArchiveCorrupt, match=r"weights.span: covers \[0x30000, 0x40000\), "
                                             r"outside the weights span \[0x0, 0x20000\)"):
        a.restore_span(0, "weights", dst.base, 8 * G, within=(0, 2 * G), target=dst,
                       direct_io="off")
    assert dst.read(3 * G, G) == b"\0" * G  # nothing written


def test_a_state_that_is_not_valid_json_names_the_file(arch):
    rewrite(arch, STATE, b"[" * 5000)
    with pytest.raises(ArchiveCorrupt, match="rank0/state.json: not valid JSON"):
        archive.open_archive(arch).state(0)


# ---- item 12: the graph index ------------------------------------------------------------------

GRAPH_FIELDS = sorted(_index()["graphs"][0])


@pytest.mark.parametrize("field", GRAPH_FIELDS)
@pytest.mark.parametrize("how", ["missing", "retyped"])
def test_a_graph_entry_missing_or_retyped_is_refused_naming_file_and_field(arch, field, how,
                                                                           capsys):
    def edit(i):
        if how == "missing":
            del i["graphs"][0][field]
        else:
            old = i["graphs"][0][field]
            i["graphs"][0][field] = {"x": 1} if isinstance(old, (int, str, list)) else 7
    edit_json(arch, INDEX, edit)
    a = archive.open_archive(arch)
    with pytest.raises(ArchiveCorrupt) as e:
        graph.archive_index(a, 0)
    assert e.value.relpath == INDEX and f"graphs[0].{field}: " in str(e.value), str(e.value)
    assert [f"graphs[0].{field}: " in p for p in archive.verify(arch)] == [True]
    info = archive.inspect(arch)  # the summary says so, it does not raise
    assert f"graphs[0].{field}: " in info["ranks"][0]["relocation"]["error"]
    assert cli.main(["inspect", str(arch)]) == 0
    assert f"graphs[0].{field}" in capsys.readouterr().out


@pytest.mark.parametrize("edit, what", [
    (lambda i: i.pop("region"), "region: missing"),
    (lambda i: i.__setitem__("graphs", "x"), "graphs: must be a list, got str 'x'"),
    (lambda i: i["region"].__setitem__("base", 1 << 64), "region.base: must be an int"),
    (lambda i: i["graphs"][0]["unclassified"].__setitem__("words", {}),
     "graphs[0].unclassified.words: must be a list"),
    (lambda i: i["graphs"][0].__setitem__("file", "../../state.json"),
     "graphs[0].file: path '../../state.json' has an empty, '.' or '..' component"),
    (lambda i: i["graphs"][0].__setitem__("file", "graphs/index.json"),
     "graphs[0].file: 'graphs/index.json' is the index itself"),
    (lambda i: i["graphs"][0].__setitem__("modules", ["0" * 64]),
     "graphs[0].modules: names module 0000"),
    (lambda i: i["templates"][0].__setitem__("graphs", []), "no template holds graph 'decode'"),
    (lambda i: i["modules"][HEX].__setitem__("bytes", 45),
     f"modules[{HEX[:12]}...].file: rank0/modules/{HEX}.bin is 46 bytes in the manifest, "
     f"the index says 45"),
    (lambda i: i.__setitem__("version", True), "version: graph index version True is not "
                                               "supported"),
], ids=["region-missing", "graphs-str", "base-2**64", "words-dict", "file-outside",
        "file-is-index", "unknown-module", "template-lost", "module-size", "version-bool"])
def test_the_graph_index_is_checked_against_its_schema_and_the_manifest(arch, edit, what):
    edit_json(arch, INDEX, edit)
    with pytest.raises(ArchiveCorrupt) as e:
        graph.archive_index(archive.open_archive(arch), 0)
    assert e.value.relpath == INDEX and what in str(e.value), str(e.value)


def test_an_index_in_a_plain_directory_is_checked_too(tmp_path):
    (tmp_path / "graphs").mkdir()
    index = _index()
    del index["graphs"][0]["file"]
    (tmp_path / graph.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"graph index .*graphs/index.json: graphs\[0\].file: "
                                         r"missing"):
        graph.load(tmp_path)


# ---- item 15: the JIT index --------------------------------------------------------------------

@pytest.mark.parametrize("bad, what", [
    ("../../x", "has an empty, '.' or '..' component"),
    ("/etc/passwd", "is absolute"),
    ("a\x00b", "contains NUL"),
    (5, "must be a non-empty str, got int 5"),
    ("a\nb", "contains the control character '\\n'"),
], ids=["dotdot", "absolute", "nul", "int", "newline"])
def test_a_jit_index_path_is_refused_naming_archive_file_and_field(arch, tmp_path, bad, what):
    edit_json(arch, jit.INDEX, lambda j: j["caches"]["triton"]["files"].__setitem__(0, bad))
    a = archive.open_archive(arch)
    for call in (lambda: jit.read_index(a), lambda: jit.unpack(a, tmp_path / "jit", {})):
        with pytest.raises(UnsafePath) as e:
            call()
        assert e.value.relpath == jit.INDEX and str(arch) in str(e.value)
        assert "caches['triton'].files[0]: path" in str(e.value) and what in str(e.value)
    assert not (tmp_path / "jit").exists()
    assert [f"{jit.INDEX}: caches['triton'].files[0]" in p for p in archive.verify(arch)] == [True]


def test_every_listed_jit_file_is_in_the_index(arch):
    edit_json(arch, jit.INDEX, lambda j: j["caches"]["triton"].update(files=[], bytes=0))
    with pytest.raises(ArchiveCorrupt, match="jit/index.json: lists no jit/triton/AB/k.cubin"):
        jit.read_index(archive.open_archive(arch))
    edit_manifest(arch, lambda m: m["files"].pop(jit.INDEX))
    with pytest.raises(ArchiveCorrupt, match="jit/index.json: not in the manifest, which lists 1 "
                                             "JIT cache files"):
        jit.read_index(archive.open_archive(arch))


# ---- items 9 and 10: every file through one opener, after the manifest ------------------------

@pytest.mark.parametrize("rel", [STATE, INDEX, jit.INDEX, "rank0/region/weights.span"])
@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_listed_file_that_is_not_a_regular_file_is_refused_without_waiting(arch, rel, kind):
    outside = arch.parent / "outside-copy"
    outside.write_bytes((arch / rel).read_bytes())
    os.utime(outside, (86400, os.stat(outside).st_mtime))
    (arch / rel).unlink()
    if kind == "fifo":
        os.mkfifo(arch / rel)
    elif kind == "symlink":
        os.symlink(outside, arch / rel)
    else:
        (arch / rel).mkdir()
    cls = UnsafePath if kind == "symlink" else ArchiveCorrupt
    with pytest.raises(cls, match=re.escape(rel)):
        bounded(lambda: archive.open_archive(arch))
    assert any(rel in p for p in bounded(lambda: archive.verify(arch)))
    assert os.stat(outside).st_atime == 86400  # never read


def test_json_is_read_once_and_its_checksum_is_of_those_bytes(arch, monkeypatch):
    """The state is parsed from the very bytes whose CRC32C was checked: one read."""
    real, opened = os.open, []

    def counting(path, flags, *a, **kw):
        opened.append(path)
        return real(path, flags, *a, **kw)

    a = archive.open_archive(arch)
    monkeypatch.setattr(archive.os, "open", counting)
    a.state(0)
    assert opened.count("state.json") == 1
    assert Path(arch / STATE).read_bytes()  # still there


def test_read_state_is_not_fooled_by_a_state_without_session(arch):
    edit_json(arch, STATE, lambda s: s.pop("session"))
    with pytest.raises(ArchiveCorrupt, match="rank0/state.json: session: missing"):
        session.read_state(archive.open_archive(arch))
    edit_manifest(arch, lambda m: m["files"].pop(STATE))
    with pytest.raises(ArchiveCorrupt, match="rank0/state.json: not in the manifest"):
        session.read_state(archive.open_archive(arch))
