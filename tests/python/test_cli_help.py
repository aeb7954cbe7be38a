"""Every ``--help`` of the ``vitrify`` command works: the top level, every command, every
subcommand at every depth (issue 32: ``vitrify bench --help`` crashed on a "%" in a help text
while only ``bench NAME --help`` was tested)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from vitrify import cli


def _command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """Every command path of the parser tree: (), ("doctor",), ("bench", "disk"), ..."""
    yield prefix
    for action in parser._actions:  # argparse offers no public walk of its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _command_paths(sub, prefix + (name,))


PATHS = sorted(set(_command_paths(cli.build_parser())))


def test_the_tree_has_the_commands_users_are_told_about():
    names = {p[0] for p in PATHS if p}
    assert {"doctor", "demo", "inspect", "verify", "tier", "bench"} <= names
    assert len([p for p in PATHS if p[:1] == ("bench",)]) > 3


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "vitrify")
def test_help_prints_and_exits_0(path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*path, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr()
    assert out.err == ""
    assert out.out.startswith("usage: vitrify")
    if path:
        assert path[-1] in out.out.splitlines()[0]


def test_bench_help_as_a_user_types_it():
    """The exact command of the report, as a process: help text, exit 0, no traceback."""
    r = subprocess.run([sys.executable, "-m", "vitrify", "bench", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "1 % delta" in r.stdout
