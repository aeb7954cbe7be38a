"""Every wrong argument is one clear line: the table in bad_input_cases.py, per public class and
function (DiskStore, HostPool and its views and layouts, snapshot, archive, graphs, Region, the
HiCache backend's settings), plus the command line.

Each group of cases runs in ONE subprocess, so a segfault or a hang is a failing test naming the
case (the runner announces each case on stderr before running it), never a dead test run. For
every case: the exception has the expected type, its message is one line, names the argument
(and what was received), and carries no binding or C++ source text.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bad_input_cases

HERE = Path(__file__).resolve().parent
FAKE = os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA")
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0

# Text that only a binding layer or C++ source produces; none of it may reach a user.
BINDING_TEXT = ("incompatible function arguments", "Invoked with", "nanobind", "nb::", "csrc/",
                ".cpp", ".hpp", "c_str()", "failed at", "(at ", "std::", "::vitrify", "&st")

_results: dict[str, dict] = {}


def _group_env(group: str) -> tuple[dict | None, str]:
    """(environment for the group's subprocess, or None with the reason to skip)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("VITRIFY_LOG_LEVEL", None)
    if group == "cpu":
        env["VITRIFY_LIBCUDA_PATH"] = "/nonexistent/libcuda.so.1"  # no driver at all
    elif group == "fake":
        if not FAKE:
            return None, "VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)"
        env.update(VITRIFY_LIBCUDA_PATH=FAKE, FAKE_CUDA_DEVICES="1")
    elif group == "host":
        if not FAKE:
            return None, "VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)"
        env.update(VITRIFY_LIBCUDA_PATH=FAKE, FAKE_CUDA_DEVICES="1")
    elif group == "sglang":
        if importlib.util.find_spec("sglang") is None:
            return None, "sglang is not installed"
        env["VITRIFY_LIBCUDA_PATH"] = "/nonexistent/libcuda.so.1"
    return env, ""


def _run_group(group: str) -> dict:
    if group in _results:
        return _results[group]
    env, reason = _group_env(group)
    if env is None:
        _results[group] = {"skip": reason}
        return _results[group]
    try:
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c",
                            f"import bad_input_cases as c; c.main({group!r})"],
                           capture_output=True, text=True, env=env, cwd=str(HERE), timeout=300)
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = "timeout (a hang)"
    res: dict = {"cases": {}, "rc": rc, "stderr": err[-3000:]}
    for line in out.splitlines():
        d = json.loads(line)
        if "id" in d:
            res["cases"][d["id"]] = d
        elif "done" in d:
            res["done"] = True
    started = [ln[5:] for ln in err.splitlines() if ln.startswith("case ")]
    res["last_started"] = started[-1] if started else None
    _results[group] = res
    return res


def _ids(group: str | None = None) -> list[str]:
    return [c.id for c in bad_input_cases.CASES.values() if group is None or c.group == group]


@pytest.mark.parametrize("case_id", _ids())
def test_bad_input_is_one_clear_line(case_id, tmp_path):
    c = bad_input_cases.CASES[case_id]
    if c.nonroot and IS_ROOT:
        pytest.skip("running as root: file permissions do not stop root's writes")
    res = _run_group(c.group)
    if "skip" in res:
        pytest.skip(res["skip"])
    got = res["cases"].get(case_id)
    assert got is not None, (
        f"the {c.group} subprocess ended (exit {res['rc']}) before reporting {case_id}; last case "
        f"started: {res['last_started']}\n{res['stderr']}")
    assert got["types"] is not None, f"{case_id}: no exception was raised"
    assert c.exc in got["types"], f"{case_id}: expected {c.exc}, got {got['types'][0]}: {got['message']}"
    msg = got["message"]
    assert "\n" not in msg, f"{case_id}: the message is more than one line:\n{msg}"
    for bad in BINDING_TEXT:
        assert bad not in msg, f"{case_id}: binding/source text {bad!r} in: {msg}"
    for needle in c.needles:
        if "{t}" in needle:
            # the case's directory lives under the runner's temporary root; compare the tail
            needle = needle.replace("{t}", f"/{case_id}")
        assert needle in msg, f"{case_id}: {needle!r} is not named in: {msg}"


def test_every_group_finished_cleanly():
    """No case crashed or hung its subprocess (each group printed its end marker)."""
    for group in sorted({c.group for c in bad_input_cases.CASES.values()}):
        res = _run_group(group)
        if "skip" in res:
            continue
        assert res.get("done") and res["rc"] == 0, (
            f"group {group}: exit {res['rc']}, last case {res['last_started']}\n{res['stderr']}")


def test_every_public_area_has_cases():
    prefixes = {c.id.split("_", 1)[0] for c in bad_input_cases.CASES.values()}
    # DiskStore, HostPool, HostRegistration, Stream, Copier, layouts, gather, scatter, snapshot,
    # archive, graphs, Region, torch integration, HiCache settings
    assert {"ds", "hp", "hr", "st", "cp", "pl", "ga", "sc", "sn", "ar", "gr", "rg", "ti",
            "hc"} <= prefixes


# ---- the command line and the environment ----------------------------------------------------

def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("VITRIFY_LOG_LEVEL", None)
    e.update(env)
    return subprocess.run([sys.executable, "-m", "vitrify", *args], capture_output=True,
                          text=True, env=e, timeout=120)


@pytest.mark.parametrize("args, env, needles", [
    (["doctor", "--dir", "/nonexistent/vitrify-dir"], {}, ["--dir", "/nonexistent/vitrify-dir"]),
    (["doctor", "--dir", "/etc/passwd"], {}, ["--dir", "/etc/passwd", "not a directory"]),
    (["doctor"], {"VITRIFY_LOG_LEVEL": "loud"}, ["VITRIFY_LOG_LEVEL", "'loud'"]),
    (["doctor"], {"VITRIFY_DIRECT_IO": "sometimes"}, ["VITRIFY_DIRECT_IO", "'sometimes'"]),
    (["doctor"], {"VITRIFY_MAX_SLAB_GB": "-1"}, ["VITRIFY_MAX_SLAB_GB"]),
    (["inspect", "/nonexistent/archive"], {}, ["/nonexistent/archive"]),
    (["frobnicate"], {}, ["frobnicate"]),
    (["doctor", "--no-such-flag"], {}, ["--no-such-flag"]),
    ([], {}, ["command"]),
])
def test_cli_errors_are_one_line_and_fail(args, env, needles):
    r = _cli(*args, **env)
    assert r.returncode != 0, r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_log_level_is_one_line_at_import_and_import_works():
    r = subprocess.run([sys.executable, "-c", "import vitrify; print(vitrify.__version__)"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, VITRIFY_LOG_LEVEL="chatty"))
    assert r.returncode == 0 and r.stdout.strip()
    assert len(r.stderr.splitlines()) == 1 and "VITRIFY_LOG_LEVEL='chatty'" in r.stderr


def test_a_failing_command_is_one_line_with_the_traceback_only_at_debug(tmp_path):
    """An unexpected failure inside a command: one line; VITRIFY_LOG_LEVEL=DEBUG adds the
    traceback through the vitrify.cli logger."""
    code = ("import sys, vitrify.cli as c\n"
            "def boom(args): raise RuntimeError('disk on fire\\nsecond line')\n"
            "p = c.build_parser\n"
            "def bp():\n"
            "    parser = p(); sub = parser._subparsers._group_actions[0]\n"
            "    sub.choices['doctor'].set_defaults(func=boom); return parser\n"
            "c.build_parser = bp\n"
            "sys.exit(c.main(['doctor']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "VITRIFY_LOG_LEVEL"})
    assert r.returncode == 1
    assert r.stderr.splitlines() == ["vitrify doctor: RuntimeError: disk on fire ..."]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, VITRIFY_LOG_LEVEL="DEBUG"))
    assert r.returncode == 1 and "Traceback" in r.stderr
    assert r.stderr.splitlines()[-1] == "vitrify doctor: RuntimeError: disk on fire ..."


# ---- native messages: the call, the errno text and the path; never source text ---------------

def test_native_syscall_errors_name_the_call_errno_and_path():
    from vitrify import _native

    # past the Python checks (the mount vanished between them and the native call)
    with pytest.raises(FileNotFoundError) as e:
        _native.HostPool(2 << 20, 2 << 20, 1 << 30, "/nonexistent/vitrify-huge", "off", True, 1,
                         False, 0, None)
    assert str(e.value) == ('[Errno 2] statfs("/nonexistent/vitrify-huge"): '
                            'No such file or directory')
    with pytest.raises(FileNotFoundError) as e:
        _native.span_file_info("/nonexistent/vitrify.span")
    assert str(e.value) == ('[Errno 2] open("/nonexistent/vitrify.span"): '
                            'No such file or directory')
    with pytest.raises(ValueError) as e:
        _native.host_plan_slabs(0, 4096, 1 << 20, 4096)
    assert str(e.value) == "total_bytes must be positive, got 0"  # no "(at csrc/...)"


@pytest.mark.skipif(not FAKE, reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
def test_cuda_errors_name_the_driver_call_not_the_source_expression():
    code = ("import vitrify\n"
            "r = vitrify.Region(1 << 30)\n"
            "try:\n"
            "    r.allocate(4096)\n"
            "except vitrify.CudaError as e:\n"
            "    print(repr(e.call)); print(str(e)); print(e.where)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, VITRIFY_LIBCUDA_PATH=FAKE, FAKE_CUDA_DEVICES="1",
                                FAKE_CUDA_FAIL="cuMemCreate"))
    assert r.returncode == 0, r.stderr
    call, msg, where = r.stdout.splitlines()
    assert call == "'cuMemCreate'"
    assert msg.startswith("cuMemCreate failed: CUDA_ERROR_UNKNOWN (999)"), msg
    for bad in BINDING_TEXT:
        assert bad not in msg, msg
    assert where.startswith("csrc/src/") and ".cpp:" in where  # kept for bug reports only
