"""Shared pieces of the SGLang HiCache backend tests (no SGLang import here)."""

from __future__ import annotations


def extra_config(d, **kw) -> dict:
    """SGLang's extra-config dict for vitrify's backend on directory `d` (16 MiB budget), with
    `kw` overriding or adding keys."""
    e = {"backend_name": "vitrify", "module_path": "vitrify.integrations.sglang.hicache",
         "class_name": "VitrifyStorage", "interface_v1": 1, "dirs": [str(d)],
         "budget_bytes": 16 << 20}
    e.update(kw)
    return e
