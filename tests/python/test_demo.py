"""``vitrify demo`` (vitrify.demo): the tiers and archive parts on any machine, the freeze -> thaw
engine on a GPU."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

import vitrify
from vitrify import demo


def test_demo_runs_and_says_what_was_skipped():
    r = subprocess.run([sys.executable, "-m", "vitrify", "demo"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "[failed]" not in out
    # tiers: spilled to the host pool and the disk slabs, reloaded and compared, twice
    assert "[ok] spill -> host   64 pages gathered into the host pool" in out
    assert "[ok] spill -> disk   64 pages written and fdatasync'd" in out
    assert out.count("16.0 MiB identical byte for byte") == 2
    assert 'cold_start="load": 64 of 64 pages indexed' in out
    # archive: intact, thawed, then the flipped byte is refused by verify and by the thaw
    assert "[ok] verify          intact" in out
    assert "[ok] thaw            span restored" in out
    refusals = [ln for ln in out.splitlines() if "refuses" in ln]
    assert len(refusals) == 2, out
    assert "rank0/region/warmup.span: checksum mismatch" in refusals[0]
    assert "SpanFileError" in refusals[1] and "warmup.span" in refusals[1]
    assert "CRC32C mismatch" in refusals[1]
    # every step is timed
    for ln in out.splitlines():
        if ln.startswith("  [ok]") and " damage " not in ln:
            assert ln.endswith(" ms)") or ln.endswith(" s)"), ln
    assert "demo: every step passed" in out
    if not vitrify.cuda_available():
        assert "gpu: [skipped] freeze -> thaw of a CUDA-graph engine" in out
        assert "engine: [skipped] cold start vs thaw of a small transformers engine" in out
        assert f"no GPU here ({vitrify.cuda_unavailable_reason()})" in out
        assert vitrify.cuda_unavailable_reason()


def _run_demo_in_process(monkeypatch, gpu: bool = False):
    monkeypatch.setattr(vitrify, "cuda_available", lambda: gpu)
    monkeypatch.setattr(vitrify, "cuda_unavailable_reason", lambda: "" if gpu else "test: no GPU")
    out = io.StringIO()
    rc = demo.main(out=out)
    return rc, out.getvalue()


def test_demo_fails_when_a_reloaded_page_differs(monkeypatch):
    """The tier reload really compares bytes: one flipped byte read back from disk fails it."""
    from vitrify import disk

    real = disk.DiskStore.batch_get_into

    def corrupting(self, keys, outs, kind=None):
        got = real(self, keys, outs, kind)
        outs[5][100] ^= 0x01
        return got

    monkeypatch.setattr(disk.DiskStore, "batch_get_into", corrupting)
    rc, out = _run_demo_in_process(monkeypatch)
    assert rc == 1
    assert "[failed] tiers" in out and "bytes differ, first at byte" in out, out
    assert "[ok] verify          intact" in out  # the next part still ran
    assert "demo: 1 part(s) failed" in out


def test_demo_fails_when_cold_start_load_loses_pages(monkeypatch):
    from vitrify import disk

    real = disk.DiskStore.__init__

    def always_clear(self, *a, **kw):
        kw["cold_start"] = "clear"
        real(self, *a, **kw)

    monkeypatch.setattr(disk.DiskStore, "__init__", always_clear)
    rc, out = _run_demo_in_process(monkeypatch)
    assert rc == 1
    assert "[failed] tiers" in out and "cold_start='load' found 0 of 64 pages" in out, out


def test_demo_fails_when_damage_is_not_refused(monkeypatch):
    """The archive part really checks the refusal: with no byte flipped, it fails."""
    monkeypatch.setattr(demo, "_flip_byte", lambda path, offset: None)
    rc, out = _run_demo_in_process(monkeypatch)
    assert rc == 1
    assert "[failed] archive" in out and "verify did not refuse the damaged " \
        "rank0/region/warmup.span" in out, out


def test_demo_gpu_line_names_the_reason(monkeypatch):
    rc, out = _run_demo_in_process(monkeypatch)
    assert rc == 0, out
    gpu_lines = [ln for ln in out.splitlines() if ln.startswith(("gpu:", "engine:"))]
    assert gpu_lines == [f"gpu: [skipped] {demo.GPU_STEP}: no GPU here (test: no GPU)",
                         f"engine: [skipped] {demo.ENGINE_STEP}: no GPU here (test: no GPU)"]


def test_demo_compare_names_the_first_difference():
    demo.compare(b"abc", bytearray(b"abc"), "x")
    with pytest.raises(demo.DemoFailure, match=r"x: bytes differ, first at byte 2 \(0x64, 0x63"):
        demo.compare(b"abc", b"abd", "x")
    with pytest.raises(demo.DemoFailure, match="x: 2 bytes, 3 expected"):
        demo.compare(b"abc", b"ab", "x")


# ---- the freeze -> thaw engine (python -m vitrify.demo freeze|thaw ARCHIVE) --------------------


def test_usage_error_exits_2():
    r = subprocess.run([sys.executable, "-m", "vitrify.demo", "boil", "x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr


def test_thaw_of_a_missing_archive_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no archive directory"):
        demo.thaw(str(tmp_path / "nothing.vitrify"))


@pytest.mark.gpu
def test_freeze_then_thaw_in_fresh_processes_gives_identical_tokens(tmp_path):
    pytest.importorskip("torch")

    r = demo.run_engine(str(tmp_path))
    th, fz = r["thaw"], r["freeze"]
    assert th["identical"], th["mismatches"]
    cfg = demo.ENGINE_CONFIG
    assert th["tokens_compared"] == sum(cfg["batch_sizes"]) * cfg["steps"]
    assert th["base"] == fz["base"]
    assert fz["templates"] <= fz["graphs"] == len(cfg["batch_sizes"])


@pytest.mark.gpu
def test_engine_part_thaws_and_cold_starts_to_the_same_tokens(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = io.StringIO()
    demo.demo_engine(str(tmp_path), demo.Printer(out))
    text = out.getvalue()
    for step in ("freeze", "cold", "thaw", "compare"):
        assert f"[ok] {step}" in text, text
    assert "identical (logits bit for bit)" in text


def test_demo_shows_inspect_and_verify_and_keeps_an_archive_to_try_them_on(monkeypatch, tmp_path):
    """A user without a GPU sees `vitrify inspect` and `vitrify verify` run on the archive the
    demo wrote, and `--keep DIR` leaves an intact copy that those commands accept."""
    from vitrify import cli

    monkeypatch.setattr(vitrify, "cuda_available", lambda: False)
    monkeypatch.setattr(vitrify, "cuda_unavailable_reason", lambda: "test: no GPU")
    out = io.StringIO()
    assert demo.main(out=out, keep=str(tmp_path)) == 0
    text = out.getvalue()
    assert "`vitrify inspect demo.vitrify` exited 0; it printed:" in text
    assert "      | fingerprint" in text and "engine          vitrify-demo" in text
    assert "`vitrify verify demo.vitrify` exited 0; it printed:" in text
    assert "`vitrify verify demo.vitrify` exited 1; it printed:" in text  # after the damage
    assert "      | FAIL archive " in text and "warmup.span: checksum mismatch" in text
    kept = tmp_path / "demo.vitrify"
    assert f"a copy of the intact archive in {kept}" in text
    assert cli.main(["verify", str(kept)]) == 0
    assert cli.main(["inspect", "--json", str(kept)]) == 0


def test_demo_keep_refuses_a_missing_directory_or_an_archive_already_there(tmp_path):
    with pytest.raises(demo.DemoFailure, match=r"--keep .*nope: not an existing directory"):
        demo.main(out=io.StringIO(), keep=str(tmp_path / "nope"))
    (tmp_path / "demo.vitrify").mkdir()
    (tmp_path / "demo.vitrify" / "mine").write_text("a user's file")
    with pytest.raises(demo.DemoFailure, match=r"demo.vitrify is already there"):
        demo.main(out=io.StringIO(), keep=str(tmp_path))
    assert (tmp_path / "demo.vitrify" / "mine").read_text() == "a user's file"


def test_vitrify_demo_keep_from_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "vitrify", "demo", "--keep", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    kept = tmp_path / "demo.vitrify"
    v = subprocess.run([sys.executable, "-m", "vitrify", "verify", str(kept)],
                       capture_output=True, text=True, timeout=120)
    assert v.returncode == 0 and v.stdout.startswith(f"OK {kept}")
    again = subprocess.run([sys.executable, "-m", "vitrify", "demo", "--keep", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2
    assert again.stderr.strip() == (f"vitrify demo: --keep {tmp_path}: demo.vitrify is already "
                                    f"there (remove it or name another directory)")
    missing = subprocess.run([sys.executable, "-m", "vitrify", "demo", "--keep",
                              str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"vitrify demo: --keep {tmp_path / 'nope'}: not an existing directory"
