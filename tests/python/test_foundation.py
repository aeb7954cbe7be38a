"""The package, its errors, logging, configuration and the driver seam on any machine."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vitrify
from vitrify import _native, config

FAKE = os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA")


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=120)


def test_version_and_build_info():
    info = vitrify.build_info()
    assert vitrify.__version__ == info["version"]
    assert info["cuda_headers"] >= 12040
    assert info["build_type"]


def test_cuda_available_gives_a_reason_when_false():
    if vitrify.cuda_available():
        assert vitrify.cuda_unavailable_reason() == ""
    else:
        assert vitrify.cuda_unavailable_reason() != ""


def test_missing_driver_path_is_reported():
    r = run_py("import vitrify; print(vitrify.cuda_available()); print(vitrify.cuda_unavailable_reason())",
               VITRIFY_LIBCUDA_PATH="/nonexistent/libcuda.so.1")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "False"
    assert 'dlopen("/nonexistent/libcuda.so.1") failed' in out[1]


def test_driver_calls_without_driver_raise_unavailable():
    r = run_py("import vitrify\n"
               "from vitrify import _native\n"
               "try:\n    _native.device_count()\n"
               "except vitrify.CudaUnavailableError as e:\n    print('unavailable', e)\n",
               VITRIFY_LIBCUDA_PATH="/nonexistent/libcuda.so.1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("unavailable CUDA driver unavailable: dlopen")


@pytest.mark.skipif(not FAKE, reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
def test_fake_driver_loads_and_doctor_reports_no_devices():
    r = run_py("import json, vitrify; from vitrify import doctor\n"
               "print(json.dumps(doctor.collect('.')['driver']))", VITRIFY_LIBCUDA_PATH=FAKE)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["available"] is True
    assert d["driver_version"] == 13000
    assert d["devices"] == []


@pytest.mark.skipif(not FAKE, reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
def test_fake_driver_init_failure_is_a_reason():
    r = run_py("import vitrify; print(vitrify.cuda_unavailable_reason())", VITRIFY_LIBCUDA_PATH=FAKE,
               FAKE_CUDA_INIT="100")
    assert r.returncode == 0, r.stderr
    assert "cuInit(0) failed: CUDA_ERROR_NO_DEVICE (100)" in r.stdout


def test_error_mapping():
    with pytest.raises(vitrify.CudaError) as e:
        _native._raise_for_test("cuda")
    assert isinstance(e.value, RuntimeError)
    assert e.value.code == 1 and e.value.result_name == "CUDA_ERROR_INVALID_VALUE"
    assert e.value.call == "cuTest(x)"
    with pytest.raises(MemoryError) as e:
        _native._raise_for_test("cuda_oom")
    assert isinstance(e.value, vitrify.CudaOutOfMemoryError)
    assert isinstance(e.value, vitrify.CudaError)
    with pytest.raises(vitrify.CudaUnavailableError):
        _native._raise_for_test("unavailable")
    with pytest.raises(MemoryError, match="region full"):
        _native._raise_for_test("space")
    with pytest.raises(FileNotFoundError) as e:
        _native._raise_for_test("os")
    assert e.value.errno == 2
    with pytest.raises(ValueError, match="bad value"):
        _native._raise_for_test("value")


def test_crc32c_known_value():
    assert _native.crc32c(b"123456789") == 0xE3069283
    assert _native.crc32c(b"56789", _native.crc32c(b"1234")) == 0xE3069283


def test_probe_direct_io(tmp_path):
    p = _native.probe_direct_io(str(tmp_path))
    assert p["fs_type"]
    assert p["supported"] or p["reason"]
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        _native.probe_direct_io(str(tmp_path / "missing"))


def test_logging_is_quiet_by_default_and_native_messages_arrive(caplog):
    r = run_py("import vitrify; from vitrify import _native; _native._log(30, 'native says hi')")
    assert r.returncode == 0
    assert r.stderr == "" and r.stdout == ""
    r = run_py("import vitrify; from vitrify import _native; _native._log(30, 'native says hi')",
               VITRIFY_LOG_LEVEL="INFO")
    assert "vitrify.native WARNING: native says hi" in r.stderr
    with caplog.at_level(logging.WARNING, logger="vitrify"):
        _native._log(30, "into caplog")
    assert any(rec.name == "vitrify.native" and rec.message == "into caplog"
               for rec in caplog.records)


def test_config_validation():
    s = config.from_environ({})
    assert s.direct_io == "auto" and s.max_slab_gb == 480.0 and s.warmup_restore is True
    s = config.from_environ({"VITRIFY_DIRECT_IO": "OFF", "VITRIFY_MAX_SLAB_GB": "0.5",
                             "VITRIFY_WARMUP_RESTORE": "0", "VITRIFY_LOG_LEVEL": "debug"})
    assert (s.direct_io, s.max_slab_gb, s.warmup_restore, s.log_level) == ("off", 0.5, False, 10)
    for env, name in [({"VITRIFY_DIRECT_IO": "maybe"}, "VITRIFY_DIRECT_IO"),
                      ({"VITRIFY_MAX_SLAB_GB": "-1"}, "VITRIFY_MAX_SLAB_GB"),
                      ({"VITRIFY_MAX_SLAB_GB": "lots"}, "VITRIFY_MAX_SLAB_GB"),
                      ({"VITRIFY_MAX_SLAB_GB": "nan"}, "VITRIFY_MAX_SLAB_GB"),
                      ({"VITRIFY_WARMUP_RESTORE": "2"}, "VITRIFY_WARMUP_RESTORE"),
                      ({"VITRIFY_LOG_LEVEL": "loud"}, "VITRIFY_LOG_LEVEL")]:
        with pytest.raises(ValueError, match=name):
            config.from_environ(env)
    with config.override(direct_io="off") as s:
        assert config.settings().direct_io == "off"
    assert config.settings().direct_io != "off" or os.environ.get("VITRIFY_DIRECT_IO") == "off"


def test_direct_io_modes_come_from_the_one_native_parser():
    assert _native.DIRECT_IO_MODES == ("auto", "on", "off")
    assert [_native.parse_direct_io(t) for t in ("AUTO", "On", "off")] == ["auto", "on", "off"]
    with pytest.raises(ValueError, match='direct_io must be auto, on or off, got "sometimes"'):
        _native.parse_direct_io("sometimes")
    assert config.from_environ({"VITRIFY_DIRECT_IO": " On "}).direct_io == "on"
    with pytest.raises(ValueError, match="VITRIFY_DIRECT_IO='of': expected auto, on or off"):
        config.from_environ({"VITRIFY_DIRECT_IO": "of"})


def test_bad_log_level_env_is_one_line_at_import_not_a_traceback():
    r = run_py("import vitrify; print('imported')", VITRIFY_LOG_LEVEL="loud")
    assert r.returncode == 0 and r.stdout.strip() == "imported"
    assert r.stderr.splitlines() == [
        "vitrify: VITRIFY_LOG_LEVEL='loud': expected one of CRITICAL, DEBUG, ERROR, INFO, WARN, "
        "WARNING or a number (logging stays quiet)"]
    # reading the settings raises, naming the variable
    r = run_py("import vitrify; from vitrify import config; config.settings()",
               VITRIFY_LOG_LEVEL="loud")
    assert r.returncode != 0 and "ValueError: VITRIFY_LOG_LEVEL='loud'" in r.stderr


REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "REFERENCE.md"
SCRIPT_ONLY = {"VITRIFY_SGLANG_E2E", "VITRIFY_SGLANG_WEIGHTS_E2E", "VITRIFY_SGLANG_E2E_ARGS",
               "VITRIFY_SGLANG_FREEZE_E2E"}  # read by gpu-suite.sh only


def test_config_table_is_the_readme_table():
    """docs/REFERENCE.md's Configuration rows name every variable of config.VARIABLES with the
    same values and default, and no other variable the package would read."""
    text = REFERENCE.read_text()
    section = text[text.index("## Configuration"):]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`VITRIFY_"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    table = {v.name: (v.values, v.default) for v in config.VARIABLES}
    assert set(rows) - SCRIPT_ONLY == set(table)
    for name, cells in table.items():
        assert rows[name] == cells, name
    fields = {f.name for f in dataclasses.fields(config.Settings)}
    assert {v.field for v in config.VARIABLES} == fields
    assert len({v.field for v in config.VARIABLES}) == len(config.VARIABLES)


def test_only_config_reads_vitrify_variables():
    """The package reads VITRIFY_* variables through config's table alone; the core none."""
    root = Path(vitrify.__file__).resolve().parent
    read = re.compile(r"""(environ\.get\(|environ\[|getenv\()\s*["']VITRIFY_""")
    offenders = [str(f.relative_to(root)) for f in root.rglob("*.py")
                 if f.name != "config.py" and read.search(f.read_text())]
    assert offenders == []
    src = Path(__file__).resolve().parents[2] / "csrc"
    if src.is_dir():
        offenders = [str(f) for f in src.rglob("*.[ch]pp")
                     if re.search(r'getenv\("VITRIFY_', f.read_text())]
        assert offenders == []


@pytest.mark.skipif(not FAKE, reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
def test_core_settings_come_from_python_at_import(tmp_path):
    """VITRIFY_CUPTI_PATH and VITRIFY_LOG_LEVEL reach the core through config.configure_native.
    (A driver is loaded, the fake one: without any, record_modules says there is no GPU.)"""
    missing = str(tmp_path / "libcupti-missing.so.13")
    r = run_py("import vitrify.graph as g; g.record_modules()", VITRIFY_CUPTI_PATH=missing,
               VITRIFY_LIBCUDA_PATH=FAKE)
    assert r.returncode != 0 and missing in r.stderr and "VITRIFY_CUPTI_PATH" in r.stderr
    # Without the Python sink the core writes to stderr at the level config handed it.
    code = ("import vitrify; from vitrify import _native; _native._set_log_sink(None, 0); "
            "_native._log(20, 'core info')")
    assert "vitrify[20]: core info" in run_py(code, VITRIFY_LOG_LEVEL="INFO").stderr
    assert "core info" not in run_py(code, VITRIFY_LOG_LEVEL="").stderr
    assert "core info" not in run_py(code, VITRIFY_LOG_LEVEL="loud").stderr


def test_driver_library_cannot_change_once_loaded():
    vitrify.cuda_available()  # loads (or fails to load) the driver
    with pytest.raises(ValueError, match=r"^libcuda_path=/elsewhere/libcuda\.so\.1: the CUDA "
                                         r"driver is already loaded from "):
        _native.configure(libcuda_path="/elsewhere/libcuda.so.1")
    s = config.settings()  # the same library again is fine
    _native.configure(libcuda_path=s.libcuda_path, cupti_path=s.cupti_path or "")


def test_doctor_json_is_valid_and_complete(tmp_path):
    r = subprocess.run([sys.executable, "-m", "vitrify", "doctor", "--json", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert set(rep) == {"vitrify", "driver", "directory", "hugepages", "packages"}
    assert rep["vitrify"]["version"] == vitrify.__version__
    assert rep["directory"]["path"] == str(tmp_path)
    assert isinstance(rep["directory"]["o_direct"], bool)
    assert "hugetlbfs_mounts" in rep["hugepages"]
    if not rep["driver"]["available"]:
        assert rep["driver"]["reason"]


def test_doctor_text_and_broken_sections_do_not_crash(tmp_path):
    from vitrify import doctor

    rep = doctor.collect(str(tmp_path / "missing"))
    assert "error" in rep["directory"] and "FileNotFoundError" in rep["directory"]["error"]
    text = doctor.render(rep)
    assert "directory  : FileNotFoundError" in text
    assert text.startswith("vitrify    : ")


@pytest.mark.gpu
def test_gpu_doctor_reports_device_and_granularity():
    from vitrify import doctor

    d = doctor.collect(".")["driver"]
    assert d["available"], d
    dev = d["devices"][0]
    assert dev["name"] and dev["total_bytes"] > 1 << 30
    assert dev["vmm_supported"] and dev["granularity_min"] >= 4096


@pytest.mark.gpu
def test_gpu_device_buffer_roundtrip():
    data = os.urandom(8 << 20)
    b = _native.DeviceBuffer(len(data), 0)
    assert b.ptr != 0
    b.write(data)
    assert b.read(len(data)) == data
    b.fill(7)
    assert b.read(16, offset=len(data) - 16) == bytes([7]) * 16
    with pytest.raises(ValueError):
        b.read(17, offset=len(data) - 16)
    del b
