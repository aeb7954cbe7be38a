"""GPU tests' result artifacts (scripts/gpu-suite.sh sets VITRIFY_TEST_ARTIFACTS): each one a
result of vitrify's convention (vitrify.bench.resultlib: date, commit, ok, goals, ratios), with
the test's own verdict as ``ok``, written under a name that no earlier file has."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vitrify.bench import resultlib


def write_artifact(name: str, payload: dict[str, Any], *, ok: bool) -> Path | None:
    """Write ``payload`` as result ``name`` when VITRIFY_TEST_ARTIFACTS names a directory."""
    art = os.environ.get("VITRIFY_TEST_ARTIFACTS")
    if not art:
        return None
    return resultlib.write(resultlib.result(name, ok=ok, **payload), Path(art))
