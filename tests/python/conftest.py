"""Markers: `gpu`, `odirect`, `sglang` skip (with the reason) where the machine lacks them;
`long` runs only with VITRIFY_LONG_TESTS=1 or when selected with -m long."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest

import vitrify
from vitrify import _native


def _odirect_reason() -> str | None:
    d = os.environ.get("VITRIFY_TEST_DIR") or tempfile.gettempdir()
    p = _native.probe_direct_io(d)
    if not p["supported"]:
        return f"O_DIRECT not supported in {d} ({p['fs_type']}): {p['reason']}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_skip = None
    if not vitrify.cuda_available():
        gpu_skip = pytest.mark.skip(reason=f"no CUDA GPU: {vitrify.cuda_unavailable_reason()}")
    odirect_reason = _odirect_reason()
    sglang_skip = None
    if importlib.util.find_spec("sglang") is None:
        sglang_skip = pytest.mark.skip(reason="sglang is not installed")
    run_long = os.environ.get("VITRIFY_LONG_TESTS") == "1" or "long" in (config.option.markexpr or "")
    for item in items:
        if gpu_skip and "gpu" in item.keywords:
            item.add_marker(gpu_skip)
        if odirect_reason and "odirect" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=odirect_reason))
        if sglang_skip and "sglang" in item.keywords:
            item.add_marker(sglang_skip)
        if "long" in item.keywords and not run_long:
            item.add_marker(pytest.mark.skip(reason="long test: set VITRIFY_LONG_TESTS=1 or -m long"))
