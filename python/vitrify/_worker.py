"""The result protocol of vitrify's worker processes (``python -m vitrify.integrations.
transformers``, the GPU test workers): run one mode, print its dict as the last stdout line (JSON)
with ``ok``, exit 0 or 1. A failure is reported, not raised: ``error`` (one line) and
``traceback``."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable


def report(run: Callable[[], dict]) -> int:
    try:
        r = run()
        r["ok"] = True
    except Exception as e:
        r = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    print(json.dumps(r, default=str))
    return 0 if r["ok"] else 1
