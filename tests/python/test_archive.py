"""CPU tests of the vitrify archive: round trip, every corruption and mismatch class, path escapes,
atomicity under a crash, and the inspect/verify CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from vitrify import archive, cli, snapshot
from vitrify.archive import (ArchiveCorrupt, ArchiveMismatch, ArchiveWriter, Fingerprint, Region,
                          UnsafePath)
from vitrify.snapshot import HostBackend

G = 64 << 10
FP = Fingerprint(gpu="NVIDIA H200", sm="9.0", driver="580.159.04", cuda="13.0", torch="2.11.0",
                 engine="demo", engine_version="0.1", model="llama-0.9b@abc123")
REGION = Region(base=0x7F0000000000, size=64 << 30, granularity=2 << 20,
                checkpoints={"weights": 0x40000000, "warmup": 0x48000000})


def build(path, *, ranks=(0, 1), warmup=True, weights=False):
    """An archive with a warmup span (host backend, one hole), graphs, modules and state."""
    spans = {}
    with ArchiveWriter(path, FP, REGION) as w:
        for r in ranks:
            be = HostBackend(6 * G, [(2 * G, 3 * G)])
            data = os.urandom(6 * G)
            be.write(0, data)
            spans[r] = data
            if warmup:
                w.dump_span(r, "warmup", be.base, 0, 6 * G, target=be, chunk_bytes=2 * G,
                            granularity=G, direct_io="off")
            if weights:
                w.dump_span(r, "weights", be.base, 0, 2 * G, target=be, chunk_bytes=2 * G,
                            granularity=G, direct_io="off")
            w.write_bytes(f"rank{r}/graphs/decode_bs1.graph", b"G" * 1000)
            w.write_json(f"rank{r}/graphs/templates.json", {"templates": [r]})
            w.write_bytes(f"rank{r}/modules/ab12cd.cubin", os.urandom(5000))
            w.write_state(r, {"pool_bytes": 123 + r})
    return spans


@pytest.fixture
def arch(tmp_path):
    p = tmp_path / "a.vitrify"
    spans = build(p)
    return p, spans


def test_round_trip(arch):
    p, spans = arch
    a = archive.open_archive(p, expect=FP, checksums=True)
    assert a.fingerprint == FP and a.region == REGION
    assert a.ranks == [0, 1]
    assert a.state(1) == {"pool_bytes": 124}
    assert a.spans(0) == {"warmup": "rank0/region/warmup.span"}
    m = json.loads((p / "manifest.json").read_text())
    assert m["format"] == "vitrify-archive" and m["version"] == 1
    assert set(m) == {"format", "version", "created", "vitrify_version", "fingerprint", "region",
                      "files", "checksum"}
    assert m["region"]["checkpoints"] == {"weights": 0x40000000, "warmup": 0x48000000}
    for rel, e in m["files"].items():
        assert os.path.getsize(p / rel) == e["bytes"]
        assert e["checksum"] == archive.file_checksum(p / rel)
    assert archive.verify(p) == []
    dst = HostBackend(6 * G)
    r = a.restore_span(1, "warmup", dst.base, 6 * G, target=dst, direct_io="off")
    assert r["intervals"] == [(0, 2 * G), (3 * G, 6 * G)]
    assert dst.read(0, 2 * G) == spans[1][:2 * G]
    assert dst.read(3 * G, 3 * G) == spans[1][3 * G:]
    assert snapshot.plan_restore(a, 0).action == "restore"
    assert not list(archive.iter_stale_temporaries(p.parent))


def test_checkpoint_drift_names_both_offsets(arch):
    p, _ = arch
    a = archive.open_archive(p)
    a.check_checkpoint("weights", 0x40000000)
    with pytest.raises(ArchiveMismatch) as e:
        a.check_checkpoint("warmup", 0x48200000)
    assert e.value.field == "region.checkpoints.warmup"
    assert (e.value.expected, e.value.found) == (0x48200000, 0x48000000)
    with pytest.raises(ArchiveMismatch):
        a.check_checkpoint("after_capture", 1)


def test_weights_span_is_just_another_span(tmp_path):
    p = tmp_path / "w.vitrify"
    build(p, ranks=(0,), weights=True)
    a = archive.open_archive(p)
    assert set(a.spans(0)) == {"warmup", "weights"}
    assert a.files["rank0/region/weights.span"]["bytes"] > 2 * G


def test_archive_without_dump_falls_back_to_rerunning_warmup(tmp_path):
    p = tmp_path / "nodump.vitrify"
    build(p, ranks=(0,), warmup=False)
    plan = snapshot.plan_restore(archive.open_archive(p), 0)
    assert plan.action == "rerun-warmup" and "no warmup-gap dump" in plan.reason


# ---- corruption ------------------------------------------------------------------------------

def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("rel", ["rank0/region/warmup.span", "rank1/modules/ab12cd.cubin",
                                 "rank0/state.json", "rank1/graphs/decode_bs1.graph"])
def test_flipped_byte_is_found_by_checksum(arch, rel):
    p, _ = arch
    _flip(p / rel, 4200 if rel.endswith(".span") else 3)
    archive.open_archive(p)  # sizes still match: the cheap open passes
    with pytest.raises(ArchiveCorrupt, match="checksum mismatch") as e:
        archive.open_archive(p, checksums=True)
    assert e.value.relpath == rel
    problems = archive.verify(p)
    assert len(problems) >= 1 and rel in problems[0]


def test_flipped_span_chunk_stops_the_restore(arch):
    p, _ = arch
    _flip(p / "rank0/region/warmup.span", 4096 + 10)
    a = archive.open_archive(p)
    dst = HostBackend(6 * G)
    with pytest.raises(snapshot.SpanFileError, match="chunk 0"):
        a.restore_span(0, "warmup", dst.base, 6 * G, target=dst, direct_io="off")


def test_corrupt_state_json_is_not_parsed(arch):
    p, _ = arch
    text = (p / "rank0/state.json").read_text()
    (p / "rank0/state.json").write_text(text.replace("123", "999"))  # same size
    a = archive.open_archive(p)  # sizes match: the cheap open passes
    with pytest.raises(ArchiveCorrupt, match="checksum mismatch"):
        a.state(0)


def test_truncated_file(arch):
    p, _ = arch
    os.truncate(p / "rank1/region/warmup.span", 4096)
    with pytest.raises(ArchiveCorrupt, match="truncated") as e:
        archive.open_archive(p)
    assert e.value.relpath == "rank1/region/warmup.span"
    assert archive.verify(p)


def test_deleted_file(arch):
    p, _ = arch
    os.unlink(p / "rank0/modules/ab12cd.cubin")
    with pytest.raises(ArchiveCorrupt, match="missing"):
        archive.open_archive(p)


def test_deleted_manifest(arch):
    p, _ = arch
    os.unlink(p / "manifest.json")
    with pytest.raises(ArchiveCorrupt, match="manifest.json: missing"):
        archive.open_archive(p)
    assert cli.main(["verify", str(p)]) == 1


def test_extra_file_is_reported_by_verify(arch):
    p, _ = arch
    (p / "rank0/graphs/sneaky.py").write_text("import os\n")
    assert any("not in the manifest" in x for x in archive.verify(p))


def _edit_manifest(p, fn, *, fix_checksum=True):
    m = json.loads((p / "manifest.json").read_text())
    fn(m)
    if fix_checksum:
        m["checksum"] = archive._manifest_checksum(m)
    (p / "manifest.json").write_text(json.dumps(m))


def test_edited_manifest_is_detected(arch):
    p, _ = arch
    _edit_manifest(p, lambda m: m["fingerprint"].__setitem__("gpu", "NVIDIA A100"),
                   fix_checksum=False)
    with pytest.raises(ArchiveCorrupt, match="edited or damaged"):
        archive.open_archive(p)


def test_manifest_size_edit_is_detected(arch):
    p, _ = arch
    _edit_manifest(p, lambda m: m["files"]["rank0/state.json"].__setitem__("bytes", 1))
    with pytest.raises(ArchiveCorrupt, match="grown"):
        archive.open_archive(p)


def test_manifest_not_json(arch):
    p, _ = arch
    (p / "manifest.json").write_text('{"format": "vitrify-archive", ')
    with pytest.raises(ArchiveCorrupt, match="not valid JSON"):
        archive.open_archive(p)


@pytest.mark.parametrize("edit", [
    lambda m: m.pop("region"),
    lambda m: m["region"].__setitem__("base", "0x7f"),
    lambda m: m["files"]["rank0/state.json"].__setitem__("checksum", "md5:abc"),
    lambda m: m["fingerprint"].__setitem__("extra", "x"),
    lambda m: m.__setitem__("created", 5),
])
def test_malformed_manifest_fields(arch, edit):
    p, _ = arch
    _edit_manifest(p, edit)
    with pytest.raises(ArchiveCorrupt):
        archive.open_archive(p)


# ---- mismatches ------------------------------------------------------------------------------

def test_wrong_version(arch):
    p, _ = arch
    _edit_manifest(p, lambda m: m.__setitem__("version", 2))
    with pytest.raises(ArchiveMismatch) as e:
        archive.open_archive(p)
    assert (e.value.field, e.value.expected, e.value.found) == ("version", 1, 2)
    assert "expected 1" in str(e.value) and "has 2" in str(e.value)


def test_wrong_format(arch):
    p, _ = arch
    _edit_manifest(p, lambda m: m.__setitem__("format", "zip"))
    with pytest.raises(ArchiveMismatch) as e:
        archive.open_archive(p)
    assert e.value.field == "format" and e.value.found == "zip"


# ids avoid bare "gpu": conftest treats a "gpu" keyword as the GPU marker
@pytest.mark.parametrize("field", archive.FINGERPRINT_FIELDS, ids=lambda f: f"field-{f}")
def test_every_fingerprint_field_mismatch_names_field_and_values(arch, field):
    p, _ = arch
    import dataclasses

    other = dataclasses.replace(FP, **{field: "something else"})
    with pytest.raises(ArchiveMismatch) as e:
        archive.open_archive(p, expect=other)
    assert e.value.field == f"fingerprint.{field}"
    assert e.value.expected == "something else" and e.value.found == getattr(FP, field)
    assert f"fingerprint.{field}" in str(e.value) and "something else" in str(e.value)


def test_none_in_expectation_means_do_not_check(arch):
    p, _ = arch
    archive.open_archive(p, expect={"gpu": "NVIDIA H200", "model": None})
    with pytest.raises(ValueError, match="unknown fingerprint fields"):
        archive.open_archive(p, expect={"colour": "blue"})


def test_cold_fallback(arch, caplog):
    p, _ = arch
    a, reason = archive.open_or_cold(p, expect={"sm": "8.0"})
    assert a is None and "fingerprint.sm" in reason and "'8.0'" in reason
    assert any("cold start" in r.getMessage() for r in caplog.records)
    a, reason = archive.open_or_cold(p.parent / "nothing-here")
    assert a is None and "no archive directory" in reason
    a, reason = archive.open_or_cold(p, expect=FP)
    assert a is not None and reason == ""


# ---- paths -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside", "rank0/../../x", "rank0//x",
                                 "./rank0/state.json", "rank0\\x", ""])
def test_manifest_paths_cannot_escape(arch, bad):
    p, _ = arch
    _edit_manifest(p, lambda m: m["files"].__setitem__(bad, {"bytes": 1,
                                                             "checksum": "crc32c:00000000"}))
    with pytest.raises(UnsafePath):
        archive.open_archive(p)


def test_symlink_inside_archive_is_refused(arch, tmp_path):
    p, _ = arch
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 5000)
    os.unlink(p / "rank0/modules/ab12cd.cubin")
    os.symlink(secret, p / "rank0/modules/ab12cd.cubin")
    with pytest.raises(UnsafePath, match="symlink"):
        archive.open_archive(p)
    # a symlinked directory too
    shutil.move(p / "rank1/graphs", tmp_path / "graphs")
    os.symlink(tmp_path / "graphs", p / "rank1/graphs")
    assert any("symlink" in x for x in archive.verify(p))


def test_writer_rejects_unsafe_relpaths(tmp_path):
    with ArchiveWriter(tmp_path / "x.vitrify", FP, REGION) as w:
        for bad in ["../x", "/abs", "a/../b", "a//b"]:
            with pytest.raises(ValueError):
                w.write_bytes(bad, b"")
        with pytest.raises(ValueError):
            w.dump_span(0, "../evil", 0, 0, 0)


# ---- atomicity -------------------------------------------------------------------------------

def test_exception_inside_writer_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with ArchiveWriter(tmp_path / "e.vitrify", FP, REGION) as w:
            w.write_bytes("rank0/state.json", b"{}")
            raise RuntimeError("engine crashed")
    assert os.listdir(tmp_path) == []


def test_failed_rename_leaves_no_archive(tmp_path, monkeypatch):
    w = ArchiveWriter(tmp_path / "r.vitrify", FP, REGION)
    w.write_bytes("rank0/state.json", b"{}")

    def boom(a, b):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(archive.os, "rename", boom)
    with pytest.raises(OSError):
        w.commit()
    assert not (tmp_path / "r.vitrify").exists()


_CHILD = textwrap.dedent("""
    import os, signal, sys
    from vitrify import archive
    from vitrify.archive import ArchiveWriter, Fingerprint, Region
    path, mode = sys.argv[1], sys.argv[2]
    w = ArchiveWriter(path, Fingerprint(gpu="x"), Region(0, 1 << 30, 2 << 20))
    if mode == "commit":  # die at the last step: everything written and fsynced, not renamed
        def die(*a):
            os.kill(os.getpid(), signal.SIGKILL)
        archive.os.rename = die
    for i in range(40 if mode == "commit" else 100000):
        w.write_bytes(f"rank0/graphs/g{i}.graph", os.urandom(4096))
        if i == 20:
            print("writing", flush=True)
    w.commit()
""")


@pytest.mark.parametrize("mode", ["files", "files-later", "commit"])
def test_killed_writer_leaves_no_visible_archive(tmp_path, mode):
    path = tmp_path / "k.vitrify"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), mode],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        if mode == "files-later":
            import time

            time.sleep(0.2)
        if mode != "commit":
            child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    assert not path.exists(), "a half-written archive became visible"
    stale = list(archive.iter_stale_temporaries(tmp_path))
    assert len(stale) == 1 and ".k.vitrify.tmp-" in stale[0]
    with pytest.raises(FileNotFoundError):
        archive.open_archive(path)
    if mode == "commit":  # died just before the rename: the temporary is complete
        assert archive.verify(stale[0]) == []
    else:  # died mid-write: no manifest, the temporary is not an archive
        with pytest.raises(archive.ArchiveCorrupt, match="manifest.json: missing"):
            archive.open_archive(stale[0])


def test_overwrite(tmp_path):
    p = tmp_path / "o.vitrify"
    build(p, ranks=(0,))
    with pytest.raises(FileExistsError):
        ArchiveWriter(p, FP, REGION)
    with ArchiveWriter(p, FP, REGION, overwrite=True) as w:
        w.write_state(3, {"new": True})
    a = archive.open_archive(p)
    assert a.ranks == [3] and a.state(3) == {"new": True}
    assert sorted(os.listdir(tmp_path)) == ["o.vitrify"]


def test_write_shared_replaces_atomically(tmp_path):
    target = tmp_path / "shared.json"
    archive.write_shared(target, b'{"a": 1}')
    archive.write_shared(target, b'{"a": 2}')
    assert json.loads(target.read_text()) == {"a": 2}
    assert os.listdir(tmp_path) == ["shared.json"]


# ---- CLI -------------------------------------------------------------------------------------

def test_cli_inspect_and_verify(arch, capsys):
    p, _ = arch
    assert cli.main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    for needle in ("NVIDIA H200", "llama-0.9b@abc123", "warmup", "0x7f0000000000", "rank",
                   "graphs"):
        assert needle in out, needle
    assert cli.main(["inspect", "--json", str(p)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ranks"]["0"]["spans"]["warmup"]["intervals"] == 2
    assert info["ranks"]["1"]["graphs"]["files"] == 2
    assert cli.main(["verify", str(p)]) == 0
    assert "OK" in capsys.readouterr().out
    _flip(p / "rank1/modules/ab12cd.cubin", 0)
    assert cli.main(["verify", str(p)]) == 1
    assert "rank1/modules/ab12cd.cubin" in capsys.readouterr().out
    assert cli.main(["inspect", str(p.parent / "none")]) == 1


def test_cli_entry_point_exit_codes(arch):
    p, _ = arch
    ok = subprocess.run([sys.executable, "-m", "vitrify", "verify", str(p)], capture_output=True)
    assert ok.returncode == 0, ok.stderr
    os.truncate(p / "rank0/state.json", 1)
    bad = subprocess.run([sys.executable, "-m", "vitrify", "verify", str(p)], capture_output=True,
                         text=True)
    assert bad.returncode == 1 and "truncated" in bad.stdout


# ---- several rank processes, one archive -----------------------------------------------------

_RANK_CHILD = textwrap.dedent("""
    import sys
    from vitrify.archive import RankWriter
    from vitrify.snapshot import HostBackend
    temp, rank = sys.argv[1], int(sys.argv[2])
    w = RankWriter(temp, rank)
    be = HostBackend(4 << 16, [(1 << 16, 2 << 16)])
    be.write(0, bytes([rank]) * (4 << 16))
    w.dump_span("warmup", be.base, 0, 4 << 16, target=be, chunk_bytes=1 << 16,
                granularity=1 << 16, direct_io="off")
    w.write_state({"rank": rank})
    try:
        w.write_bytes("rank0/state.json", b"{}")
    except ValueError as e:
        print("refused:", e)
""")


def test_rank_processes_write_into_one_archive(tmp_path):
    p = tmp_path / "multi.vitrify"
    w = ArchiveWriter(p, FP, REGION)
    w.write_state(0, {"rank": 0})
    for rank in (1, 2):
        out = subprocess.run([sys.executable, "-c", _RANK_CHILD, w.temp_path, str(rank)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "refused: rank %d may only write under rank%d/" % (rank, rank) in out.stdout
    assert not p.exists(), "visible before the coordinator commits"
    w.commit()
    a = archive.open_archive(p, checksums=True)
    assert a.ranks == [0, 1, 2]
    assert [a.state(r)["rank"] for r in (0, 1, 2)] == [0, 1, 2]
    assert snapshot.plan_restore(a, 2).action == "restore"
    assert snapshot.plan_restore(a, 0).action == "rerun-warmup"
    dst = HostBackend(4 << 16)
    r = a.restore_span(2, "warmup", dst.base, 4 << 16, target=dst, direct_io="off")
    assert r["intervals"] == [(0, 1 << 16), (2 << 16, 4 << 16)]
    assert dst.read(2 << 16, 2 << 16) == b"\x02" * (2 << 16)
    with pytest.raises(FileNotFoundError):
        archive.RankWriter(w.temp_path, 3)  # committed: the temporary is gone
    with pytest.raises(ValueError):
        archive.RankWriter(tmp_path, 0)  # not a writer's temporary


def test_current_fingerprint_names_engine_and_model():
    fp = Fingerprint.current(engine="sglang", engine_version="0.5.17", model="qwen3@1")
    assert (fp.engine, fp.engine_version, fp.model) == ("sglang", "0.5.17", "qwen3@1")
    for v in fp.to_dict().values():
        assert v is None or isinstance(v, str)
    import vitrify

    if not vitrify.cuda_available():
        assert fp.gpu is None and fp.sm is None


def test_read_files_reads_and_checks_many_files_in_one_call(arch, tmp_path):
    p, _ = arch
    rels = ["rank0/graphs/decode_bs1.graph", "rank0/modules/ab12cd.cubin",
            "rank1/graphs/templates.json", "rank0/graphs/templates.json"]
    got = archive.open_archive(p).read_files(rels, checksum=True, threads=3)
    assert list(got) == rels
    for rel in rels:
        assert got[rel] == (p / rel).read_bytes()
    # Each damage is named as check_file names it.
    a = archive.open_archive(p)
    _flip(p / "rank0/modules/ab12cd.cubin", 10)
    with pytest.raises(ArchiveCorrupt, match="rank0/modules/ab12cd.cubin.*checksum mismatch"):
        a.read_files(rels, checksum=True)
    assert a.read_files(rels[1:2], checksum=False)  # size only
    with open(p / "rank0/graphs/decode_bs1.graph", "ab") as f:
        f.write(b"x")
    with pytest.raises(ArchiveCorrupt, match="decode_bs1.graph.*grown: 1001 bytes"):
        a.read_files(rels, checksum=False)
    (p / "rank1/graphs/templates.json").unlink()
    with pytest.raises(ArchiveCorrupt, match="rank1/graphs/templates.json.*missing"):
        a.read_files(rels[2:3], checksum=False)
    os.symlink(p / "rank0/graphs/templates.json", p / "rank1/graphs/templates.json")
    with pytest.raises(UnsafePath, match="symlink"):
        a.read_files(rels[2:3], checksum=False)
    with pytest.raises(ArchiveCorrupt, match="not listed"):
        a.read_files(["rank0/graphs/other.graph"], checksum=False)


def test_commit_takes_a_spans_checksum_from_its_dump_unless_the_file_changed(tmp_path, monkeypatch):
    real = archive.file_checksum
    read_back = []

    def counting(path):
        read_back.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(archive, "file_checksum", counting)
    p = tmp_path / "a.vitrify"
    build(p, ranks=(0,), weights=True)
    # the span files' checksums came from the dump; the small files were read back
    assert not any(n.endswith(".span") for n in read_back) and "ab12cd.cubin" in read_back
    a = archive.open_archive(p, checksums=True)
    assert a.verify() == []
    for rel, entry in a.files.items():  # the manifest holds the files' true checksums
        assert entry["checksum"] == real(os.path.join(p, rel)), rel
    # a span file changed after its dump: the commit reads it back
    read_back.clear()
    with ArchiveWriter(tmp_path / "b.vitrify", FP, REGION) as w:
        be = HostBackend(2 * G, [])
        be.write(0, os.urandom(2 * G))
        w.dump_span(0, "weights", be.base, 0, 2 * G, target=be, chunk_bytes=G, granularity=G,
                    direct_io="off")
        full = w.file_path(snapshot.span_relpath(0, "weights"))
        with open(full, "ab") as f:
            f.write(b"x")
    assert read_back == ["weights.span"]
    b = archive.open_archive(tmp_path / "b.vitrify")
    assert b.files["rank0/region/weights.span"]["checksum"] == real(full.replace(
        str(w.temp_path), str(tmp_path / "b.vitrify")))
