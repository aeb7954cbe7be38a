"""The reason a GPU test skips (the driver loader's own message) tells the user what to do:
set ``VITRIFY_LIBCUDA_PATH`` to a full path where the driver lives, never "to libcuda.so.1",
its own default (issue 32)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import vitrify


def _reason(env_path: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "VITRIFY_LIBCUDA_PATH"}
    if env_path is not None:
        env["VITRIFY_LIBCUDA_PATH"] = env_path
    r = subprocess.run([sys.executable, "-c",
                        "import vitrify; print(vitrify.cuda_unavailable_reason())"],
                       capture_output=True, text=True, env=env, timeout=60, check=True)
    return r.stdout.strip()


@pytest.mark.skipif(vitrify.cuda_available(), reason="a driver loads here: nothing to explain")
def test_default_library_missing_asks_for_a_full_path():
    reason = _reason(None)
    assert reason.startswith('dlopen("libcuda.so.1") failed')
    assert "set VITRIFY_LIBCUDA_PATH to its full path" in reason
    assert "to libcuda.so.1)" not in reason


def test_a_named_library_that_does_not_exist_is_named():
    reason = _reason("/nonexistent/dir/libcuda.so.1")
    assert reason.startswith('dlopen("/nonexistent/dir/libcuda.so.1") failed')
    assert "VITRIFY_LIBCUDA_PATH names this library" in reason
