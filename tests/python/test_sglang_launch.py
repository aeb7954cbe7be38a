"""``vitrify sglang save|load|serve|check`` (vitrify/integrations/sglang/launch.py): SGLang's
arguments parsed by the pinned SGLang's own parser on the CPU, refusals in one line before
anything starts, the plugin's TOML and the exact command line (``--dry-run``), and the exec into
SGLang's launcher with the arguments unchanged (a stand-in for the Python it runs)."""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from vitrify import cli

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = ["-m", "sglang.launch_server"]
sglang = pytest.mark.sglang


def _run(capsys, *argv) -> tuple[int, str, str]:
    """``vitrify ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str, prefix: str) -> str:
    line = err.strip()
    assert line.startswith(prefix) and "\n" not in line, err
    assert "Traceback" not in line
    return line


@pytest.fixture
def tmpdir_for_configs(tmp_path, monkeypatch):
    """The plugin's TOML goes under tempfile's directory: a private one per test."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    return d


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return str(d)


def _args(model, *extra):
    return ["--model-path", model, "--attention-backend", "triton", "--random-seed", "7", *extra]


def _split_dry_run(out: str) -> tuple[dict, list[str]]:
    """--dry-run's output: the TOML (comments included) and the command line (its last line)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    text, _, cmd = out.rstrip("\n").rpartition("\n")
    return tomllib.loads(text), shlex.split(cmd)


def _archive(path: Path, model: str, **fingerprint) -> Path:
    """An archive whose fingerprint is what SGLang's SAVE here would record (the engine, its
    versions, this machine), with ``fingerprint`` overriding fields."""
    from vitrify import archive
    from vitrify.integrations.sglang import freeze

    engine = freeze.Engine({}, "0.5.17").fingerprint()
    fp = archive.Fingerprint.current(engine=engine["engine"],
                                     engine_version=engine["engine_version"],
                                     model=f"{model}#args-0123456789abcdef")
    fp = archive.Fingerprint(**{**fp.to_dict(), **fingerprint})
    region = archive.Region(base=0x600000000000, size=6 << 30, granularity=2 << 20,
                            checkpoints={"built": 0})
    with archive.ArchiveWriter(str(path), fp, region) as w:
        w.write_json("rank0/state.json", {"engine": {}})
    return path


# ---------------------------------------------------------------------------------------------
# help
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["sglang", "--help"], ["sglang", "save", "--help"],
                                  ["sglang", "load", "--help"], ["sglang", "serve", "--help"],
                                  ["sglang", "check", "--help"]])
def test_every_help_of_the_commands_exits_0(capsys, argv):
    rc, out, err = _run(capsys, *argv)
    assert rc == 0 and err == "" and out.startswith("usage: vitrify")
    if argv[0] == "sglang" and len(argv) == 3:
        assert "-- SGLANG_SERVER_ARGS..." in out
        assert ("--archive" if argv[1] == "check" else "--dry-run") in out


def test_the_top_level_help_and_every_subcommand_help_exit_0_in_a_fresh_process():
    """Every command and subcommand of ``vitrify`` (argparse formats help texts with %, so
    one stray % breaks a help page): found from the parser, each run in a fresh process."""
    import argparse

    def walk(parser, path):
        yield path
        for action in parser._actions:  # the parser's own structure, what --help prints
            if isinstance(action, argparse._SubParsersAction):
                for name, p in action.choices.items():
                    yield from walk(p, path + [name])

    paths = list(walk(cli.build_parser(), []))
    assert ["sglang", "check"] in paths and ["bench"] in paths
    code = ("import sys, contextlib, io\nfrom vitrify import cli\nbad = []\n"
            "for argv in %r:\n"
            "    try:\n"
            "        with contextlib.redirect_stdout(io.StringIO()):\n"
            "            cli.main(argv + ['--help'])\n"
            "    except SystemExit as e:\n"
            "        if e.code != 0: bad.append((argv, e.code))\n"
            "    except Exception as e:\n"
            "        bad.append((argv, repr(e)))\n"
            "print(bad)\n") % paths
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------


@sglang
@pytest.mark.parametrize("extra, words", [
    (["--tp", "2"], "tp_size=2 (--tp-size): only one GPU is supported for now"),
    (["--dp-size", "2"], "dp_size=2 (--dp-size)"),
    (["--enable-memory-saver"], "enable_memory_saver=True (--enable-memory-saver)"),
    (["--speculative-algorithm", "EAGLE"], "speculative decoding is not frozen yet"),
    (["--attention-backend", "fa3"], "attention_backend='fa3' (only ['triton', 'flashinfer']"),
    (["--enable-hierarchical-cache"], "enable_hierarchical_cache=True"),
    (["--cuda-graph-backend-decode", "breakable"], "decode graph backend 'breakable'"),
    # the JSON form, as SGLang's parser reads it (unresolved: a dict)
    (["--cuda-graph-config", '{"decode": {"backend": "breakable"}}'],
     "decode graph backend 'breakable'"),
])
def test_check_reports_a_refusal_in_one_line_and_exits_1(capsys, tmpdir_for_configs, model,
                                                         extra, words):
    rc, out, err = _run(capsys, "sglang", "check", "--", *_args(model, *extra))
    line = _one_line(err, "vitrify sglang check: vitrify would refuse this server: ")
    assert rc == 1 and out == "" and words in line


@sglang
def test_check_names_every_refusal_at_once_and_an_unset_random_seed(capsys, tmpdir_for_configs,
                                                                    model):
    rc, _, err = _run(capsys, "sglang", "check", "--", "--model-path", model, "--tp", "2")
    line = _one_line(err, "vitrify sglang check: vitrify would refuse this server: ")
    assert rc == 1
    assert "tp_size=2" in line and "attention_backend unset" in line
    assert "random_seed unset (--random-seed)" in line and "pass --random-seed N" in line


@sglang
def test_check_of_a_clean_command_says_what_vitrify_changes(capsys, tmpdir_for_configs, model):
    from vitrify.integrations.sglang import state

    before = state.STATE
    rc, out, err = _run(capsys, "sglang", "check", "--", *_args(model))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == ("vitrify can freeze and thaw this server (SGLang 0.5.17); nothing is "
                        "refused.")
    assert ("SAVE changes: cuda_graph_backend_prefill None -> 'disabled'; "
            "disable_prefill_cuda_graph False -> True") in lines
    assert ("LOAD changes: load_format 'auto' -> 'dummy'; cuda_graph_backend_prefill None -> "
            "'disabled'; disable_prefill_cuda_graph False -> True") in lines
    # the plugin's own reasons, as its log lines say them
    assert "  vitrify (mode load): the weights come from the archive, the checkpoint is not read " \
           "(load_format was auto)" in lines
    assert any(ln.startswith("  vitrify (mode save): prefill CUDA graphs forced off")
               for ln in lines)
    assert state.STATE is before and state.STATE.prefill_graphs_were is None
    # a loader LOAD cannot replace keeps reading the checkpoint: not changed
    rc, out, _ = _run(capsys, "sglang", "check", "--", *_args(model, "--load-format", "gguf"))
    assert rc == 0 and "load_format" not in out.split("LOAD changes:")[1].splitlines()[0]
    assert "the configured loader reads the checkpoint (load_format='gguf')" in out


@sglang
def test_check_compares_an_archive_when_asked(capsys, tmpdir_for_configs, model, tmp_path):
    good = _archive(tmp_path / "good.vitrify", model)
    other = _archive(tmp_path / "other.vitrify", "/models/another")
    rc, out, _ = _run(capsys, "sglang", "check", "--archive", str(good), "--", *_args(model))
    assert rc == 0 and f"--archive {good}: engine, versions, GPU and model path match" in out
    rc, _, err = _run(capsys, "sglang", "check", "--archive", str(other), "--", *_args(model))
    line = _one_line(err, "vitrify sglang check: vitrify would refuse this server: --archive: ")
    assert rc == 1 and f"--model-path {model!r} here, '/models/another' when it was saved" in line


@sglang
def test_a_typo_in_sglangs_arguments_is_reported_by_sglangs_parser_in_one_line(
        capsys, tmpdir_for_configs, model, tmp_path):
    for command in (["check"], ["save", str(tmp_path / "a"), "--region-bytes", "1GiB"]):
        rc, out, err = _run(capsys, "sglang", *command, "--", *_args(model, "--tp-sizee", "2"))
        line = _one_line(err, f"vitrify sglang {command[0]}: SGLang's argument parser: ")
        assert rc == 2 and out == ""
        assert "unrecognized arguments: --tp-sizee 2" in line
    rc, _, err = _run(capsys, "sglang", "check", "--", "--model-path", model, "--port", "x")
    assert rc == 2 and "argument --port: invalid int value: 'x'" in _one_line(err, "vitrify")
    rc, _, err = _run(capsys, "sglang", "check", "--", "--attention-backend", "triton")
    assert rc == 2 and "the following arguments are required: --model-path" in \
        _one_line(err, "vitrify sglang check: SGLang's argument parser:")
    assert not (tmp_path / "a").exists()


@sglang
def test_without_a_usable_sglang_each_command_says_so_in_one_line(capsys, tmpdir_for_configs,
                                                                  model, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", None)  # not importable
    rc, _, err = _run(capsys, "sglang", "check", "--", *_args(model))
    assert rc == 2 and "cannot import SGLang's server arguments (sglang.srt.server_args): " \
                       "ModuleNotFoundError: import of sglang.srt.server_args halted" in \
        _one_line(err, "vitrify sglang check: ")
    real = importlib.metadata.version

    def version(name, found="0.5.24"):
        if name != "sglang":
            return real(name)
        if found is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return found

    monkeypatch.setattr(importlib.metadata, "version", version)
    rc, _, err = _run(capsys, "sglang", "check", "--", *_args(model))
    assert rc == 2 and "SGLang 0.5.24 is installed; this vitrify supports SGLang 0.5.17, " \
                       "0.5.23 (the plugin would stop the server)" in \
        _one_line(err, "vitrify sglang check: ")
    monkeypatch.setattr(importlib.metadata, "version", lambda n: version(n, None))
    rc, _, err = _run(capsys, "sglang", "load", "/nowhere", "--", *_args(model))
    assert rc == 2 and "SGLang is not installed in this Python" in \
        _one_line(err, "vitrify sglang load: ")


@sglang
def test_an_environment_where_sglang_would_skip_the_plugin_is_refused(capsys, tmpdir_for_configs,
                                                                      model, monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    rc, _, err = _run(capsys, "sglang", "check", "--", *_args(model))
    assert rc == 1 and "SGLANG_PLUGINS='someone_else' does not list vitrify" in \
        _one_line(err, "vitrify sglang check: vitrify would refuse this server: ")
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else, vitrify")
    assert _run(capsys, "sglang", "check", "--", *_args(model))[0] == 0


# ---------------------------------------------------------------------------------------------
# save / load / serve --dry-run
# ---------------------------------------------------------------------------------------------


@sglang
def test_save_dry_run_prints_the_toml_and_the_exact_exec_line(capsys, tmpdir_for_configs, model,
                                                              tmp_path):
    from vitrify.integrations.sglang import config

    arch = tmp_path / "qwen.vitrify"
    sglang_args = _args(model, "--served-model-name", "my model", "--mem-fraction-static", "0.5",
                        "--chat-template", "{{ x }}")
    rc, out, err = _run(capsys, "sglang", "save", str(arch), "--region-bytes", "8GiB",
                        "--save-after-requests", "17", "--dry-run", "--", *sglang_args)
    assert rc == 0 and err == ""
    table, cmd = _split_dry_run(out)
    assert table == {"mode": "save", "archive": str(arch), "region_bytes": 8 << 30,
                     "save_after_requests": 17}
    env, *argv = cmd
    path = env.removeprefix("VITRIFY_SGLANG_CONFIG=")
    assert env.startswith("VITRIFY_SGLANG_CONFIG=") and argv == [sys.executable, *LAUNCHER,
                                                                  *sglang_args]
    assert path.startswith(str(tmpdir_for_configs)) and path.endswith(".toml")
    assert f"to be written to {path}" in out
    # nothing was written or created; the table is what the plugin accepts
    assert not os.path.exists(path) and not arch.exists() and not list(tmpdir_for_configs.iterdir())
    cfg = config.from_mapping(table)
    assert (cfg.mode, cfg.archive, cfg.region_bytes, cfg.save_after_requests) == \
        ("save", str(arch), 8 << 30, 17)


@sglang
def test_load_dry_run_states_the_archives_region_and_every_option(capsys, tmpdir_for_configs,
                                                                  model, tmp_path):
    arch = _archive(tmp_path / "a.vitrify", model)
    go = tmp_path / "go"
    sglang_args = _args(model, "--port", "30001")
    rc, out, err = _run(capsys, "sglang", "load", str(arch), "--standby-file", str(go),
                        "--on-mismatch", "cold-start", "--warmup-requests", "0",
                        "--no-read-ahead", "--weight-updates", "--no-jit-caches", "--dry-run",
                        "--", *sglang_args)
    assert rc == 0 and err == ""
    table, (env, *argv) = _split_dry_run(out)
    assert table == {"mode": "load", "archive": str(arch), "region_bytes": 6 << 30,
                     "on_mismatch": "cold-start", "standby_file": str(go), "warmup_requests": 0,
                     "read_ahead": False, "weight_updates": True, "jit_caches": False}
    assert argv == [sys.executable, *LAUNCHER, *sglang_args]
    assert f"# LOAD from {arch}; then this process becomes SGLang's launcher" in out


@sglang
def test_load_of_a_missing_archive_is_one_line(capsys, tmpdir_for_configs, model, tmp_path):
    for where in (tmp_path / "missing", tmp_path / "a-file"):
        if where.name == "a-file":
            where.write_text("x")
        rc, out, err = _run(capsys, "sglang", "load", str(where), "--", *_args(model))
        line = _one_line(err, f"vitrify sglang load: {where} ")
        assert rc == 2 and out == ""
        assert ("does not exist" if where.name == "missing" else "is not a directory") in line


@sglang
def test_load_of_an_archive_that_does_not_match_is_one_line(capsys, tmpdir_for_configs, model,
                                                            tmp_path):
    for arch, words in (
            (_archive(tmp_path / "m.vitrify", "/models/other"),
             f"--model-path {model!r} here, '/models/other' when it was saved"),
            (_archive(tmp_path / "v.vitrify", model, engine_version="sglang-0.5.9/vitrify-0.0.1"),
             "fingerprint.engine_version mismatch"),
            (_archive(tmp_path / "t.vitrify", model, engine="transformers"),
             "fingerprint.engine mismatch: expected 'sglang', the archive has 'transformers'")):
        rc, out, err = _run(capsys, "sglang", "load", str(arch), "--dry-run", "--",
                            *_args(model))
        line = _one_line(err, "vitrify sglang load: the archive does not match this server: ")
        assert rc == 2 and out == "" and words in line
        assert "--on-mismatch cold-start starts it cold" in line
    # on_mismatch cold-start: started anyway, and said so (the plugin starts it cold)
    rc, out, err = _run(capsys, "sglang", "load", str(arch), "--on-mismatch", "cold-start",
                        "--dry-run", "--", *_args(model))
    assert rc == 0 and "the server starts cold" in out
    assert _split_dry_run(out)[0]["on_mismatch"] == "cold-start"


@sglang
def test_a_damaged_archive_is_one_line_before_sglang_starts(capsys, tmpdir_for_configs, model,
                                                            tmp_path):
    arch = _archive(tmp_path / "d.vitrify", model)
    (arch / "rank0" / "state.json").write_text("{}")  # another size than the manifest says
    rc, _, err = _run(capsys, "sglang", "load", str(arch), "--dry-run", "--", *_args(model))
    line = _one_line(err, "vitrify sglang load: the archive cannot be read: ")
    assert rc == 2 and "state.json" in line and f"vitrify verify {arch}" in line


@sglang
def test_save_refuses_an_existing_archive_and_leaves_it(capsys, tmpdir_for_configs, model,
                                                        tmp_path):
    arch = _archive(tmp_path / "a.vitrify", model)
    before = sorted(p.name for p in arch.rglob("*"))
    rc, out, err = _run(capsys, "sglang", "save", str(arch), "--region-bytes", "1GiB", "--",
                        *_args(model))
    line = _one_line(err, f"vitrify sglang save: {arch} exists: save writes a new archive")
    assert rc == 2 and out == "" and "remove the old one" in line
    assert sorted(p.name for p in arch.rglob("*")) == before


@sglang
def test_serve_loads_a_matching_archive_and_saves_where_there_is_none(capsys, tmpdir_for_configs,
                                                                      model, tmp_path):
    arch = tmp_path / "s.vitrify"
    opts = ["--region-bytes", "2GiB", "--standby-file", str(tmp_path / "go"), "--dry-run"]
    rc, out, _ = _run(capsys, "sglang", "serve", str(arch), *opts, "--", *_args(model))
    table, (_, *argv) = _split_dry_run(out)
    assert rc == 0 and table == {"mode": "save", "archive": str(arch), "region_bytes": 2 << 30}
    assert f"no archive at {arch}: SGLang starts as usual, then SAVE to {arch}" in out
    assert argv == [sys.executable, *LAUNCHER, *_args(model)]
    _archive(arch, model)
    rc, out, _ = _run(capsys, "sglang", "serve", str(arch), *opts, "--", *_args(model))
    table = _split_dry_run(out)[0]
    assert rc == 0 and table == {"mode": "load", "archive": str(arch), "region_bytes": 6 << 30,
                                 "standby_file": str(tmp_path / "go")}
    rc, _, err = _run(capsys, "sglang", "serve", str(arch), *opts, "--",
                      *_args("/models/other"))
    line = _one_line(err, "vitrify sglang serve: the archive does not match this server: ")
    assert rc == 2 and "remove it to save a new one, or --on-mismatch cold-start" in line


@sglang
@pytest.mark.parametrize("command, opts, words", [
    (["save", "A"], ["--region-bytes", "8XB"], "--region-bytes: '8XB' is not a size"),
    (["save", "A"], ["--region-bytes", "0"], "--region-bytes: must be > 0 bytes"),
    (["save", "A"], ["--region-bytes", "1GiB", "--save-after-requests", "0"],
     "--save-after-requests: config key 'save_after_requests': must be between 1 and"),
    (["load", "ARCH"], ["--warmup-requests", "65"],
     "--warmup-requests: config key 'warmup_requests': must be between 0 and 64, got 65"),
    (["load", "ARCH"], ["--standby-file", "/no/such/dir/go"],
     "--standby-file: config key 'standby_file': the directory '/no/such/dir' does not exist"),
    (["save", "/no/such/dir/a"], ["--region-bytes", "1GiB"],
     "/no/such/dir is not a directory: save writes the archive there"),
])
def test_bad_options_are_one_line(capsys, tmpdir_for_configs, model, tmp_path, command, opts,
                                  words):
    arch = _archive(tmp_path / "arch.vitrify", model)
    where = {"A": str(tmp_path / "new.vitrify"), "ARCH": str(arch)}
    command = [command[0], where.get(command[1], command[1])]
    rc, out, err = _run(capsys, "sglang", *command, *opts, "--dry-run", "--", *_args(model))
    assert rc == 2 and out == "" and words in _one_line(err, f"vitrify sglang {command[0]}: ")


def test_usage_mistakes_are_one_line(capsys, tmp_path):
    for argv, words in ((["sglang", "load", str(tmp_path)], "give SGLang's server arguments "
                                                            "after --"),
                        (["sglang", "load", str(tmp_path), "--on-mismatch", "maybe", "--", "x"],
                         "argument --on-mismatch: invalid choice: 'maybe'"),
                        (["sglang", "save", "--", "--model-path", "x"],
                         "the following arguments are required: ARCHIVE"),
                        (["sglang"], "the following arguments are required: sglang_command"),
                        (["sglang", "check", "--warmup-requests", "1", "--", "x"],
                         "unrecognized arguments: --warmup-requests 1")):
        rc, out, err = _run(capsys, *argv)
        assert rc == 2 and out == "" and words in _one_line(err, "vitrify"), (argv, err)


# ---------------------------------------------------------------------------------------------
# the exec
# ---------------------------------------------------------------------------------------------


def _stand_in(tmp_path: Path) -> Path:
    """An executable standing in for the Python SGLang runs under: it records its arguments,
    its config variable and the config's text."""
    out = tmp_path / "exec.txt"
    script = tmp_path / "python-stand-in"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        {{ printf '%s\\n' "$@"; echo "CONFIG=$VITRIFY_SGLANG_CONFIG"; echo "PID=$$"; }} > {out}
        """))
    script.chmod(0o755)
    return out


@sglang
@pytest.mark.parametrize("check", [True, False])
def test_save_execs_sglangs_launcher_with_the_config_and_the_arguments_unchanged(tmp_path, model,
                                                                                check):
    """The real exec, in a fresh process whose ``sys.executable`` is a stand-in: this process
    becomes it, with the user's arguments unchanged and VITRIFY_SGLANG_CONFIG naming a TOML the
    plugin accepts, in a private directory."""
    from vitrify.integrations.sglang import config

    out = _stand_in(tmp_path)
    arch = tmp_path / "a.vitrify"
    sglang_args = _args(model, "--served-model-name", "my model", "--port", "30001")
    argv = ["sglang", "save", str(arch), "--region-bytes", "3GiB",
            *([] if check else ["--no-check"]), "--", *sglang_args]
    code = (f"import os, sys; print('PID=%d' % os.getpid(), flush=True); "
            f"sys.executable = {str(tmp_path / 'python-stand-in')!r}; "
            f"from vitrify import cli; sys.exit(cli.main({argv!r}))")
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS",)}
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert lines[:-2] == [*LAUNCHER, *sglang_args]  # argv[0] is the program itself
    assert lines[-1] == r.stdout.strip().splitlines()[0]  # the same process: exec, not a child
    path = lines[-2].removeprefix("CONFIG=")
    assert path.startswith(str(tmp_path / "tmp" / f"vitrify-{os.geteuid()}" / "sglang") + "/")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    cfg = config.load(path)
    assert (cfg.mode, cfg.archive, cfg.region_bytes) == ("save", str(arch), 3 << 30)
    assert f"vitrify sglang save: SAVE to {arch} (region 3.0 GiB) (config {path})" in r.stderr


@sglang
def test_the_config_is_not_written_through_a_link_or_into_anothers_directory(
        capsys, tmpdir_for_configs, model, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmpdir_for_configs / f"vitrify-{os.geteuid()}").symlink_to(elsewhere)
    monkeypatch.setattr(os, "execvpe", lambda *a: pytest.fail("exec reached"))
    rc, _, err = _run(capsys, "sglang", "save", str(tmp_path / "a"), "--region-bytes", "1GiB",
                      "--", *_args(model))
    assert rc == 2 and "is not a directory (a link or a file): the plugin's config is not " \
                       "written there" in _one_line(err, "vitrify sglang save: ")
    assert not list(elsewhere.iterdir())
    link = tmpdir_for_configs / f"vitrify-{os.geteuid()}"
    link.unlink()
    link.mkdir(mode=0o777)
    link.chmod(0o777)
    rc, _, err = _run(capsys, "sglang", "save", str(tmp_path / "a"), "--region-bytes", "1GiB",
                      "--", *_args(model))
    assert rc == 2 and "others can write it" in _one_line(err, "vitrify sglang save: ")
