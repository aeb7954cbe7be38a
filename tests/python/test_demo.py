"""The freeze -> vitrify demo engine (vitrify.integrations.demo)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_usage_error_exits_2():
    r = subprocess.run([sys.executable, "-m", "vitrify.integrations.demo", "boil", "x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr


def test_thaw_of_a_missing_archive_is_a_clear_error(tmp_path):
    from vitrify.integrations import demo

    with pytest.raises(FileNotFoundError, match="no archive directory"):
        demo.thaw(str(tmp_path / "nothing.vitrify"))


@pytest.mark.gpu
def test_freeze_then_thaw_in_fresh_processes_gives_identical_tokens(tmp_path):
    pytest.importorskip("torch")
    from vitrify.integrations import demo

    r = demo.run_demo(str(tmp_path))
    th, fz = r["thaw"], r["freeze"]
    assert th["identical"], th["mismatches"]
    assert th["tokens_compared"] == sum(demo.CONFIG["batch_sizes"]) * demo.CONFIG["steps"]
    assert th["base"] == fz["base"]
    assert fz["templates"] <= fz["graphs"] == len(demo.CONFIG["batch_sizes"])
