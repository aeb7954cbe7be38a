"""``vitrify doctor``: what this machine offers vitrify, without crashing anywhere.

Every section is collected independently; a section that fails reports ``{"error": ...}``
instead of stopping the report.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

from . import _native


def _section(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # the doctor never crashes: it reports what broke
        return {"error": f"{type(e).__name__}: {e}"}


def _vitrify() -> dict:
    from . import config

    info = dict(_native.build_info())
    info["python"] = sys.version.split()[0]
    info["platform"] = platform.platform()
    info["machine"] = platform.machine()
    info["settings"] = config.as_dict()
    return info


def _driver() -> dict:
    if not _native.cuda_available():
        return {"available": False, "reason": _native.cuda_unavailable_reason()}
    out: dict[str, Any] = {
        "available": True,
        "library": _native.driver_library(),
        "driver_version": _native.driver_version(),
        "cuMemcpyBatchAsync": _native.driver_has("cuMemcpyBatchAsync"),
    }
    devices = []
    for i in range(_native.device_count()):
        devices.append(_section(lambda i=i: dict(_native.device_info(i))))
    out["devices"] = devices
    return out


def _directory(path: str) -> dict:
    out: dict[str, Any] = {"path": os.path.abspath(path)}
    probe = dict(_native.probe_direct_io(path))
    out.update(fs_type=probe["fs_type"], block_size=probe["block_size"],
               o_direct=probe["supported"], o_direct_reason=probe["reason"])
    if probe["fs_type"] == "tmpfs":
        out["note"] = "tmpfs accepts misaligned O_DIRECT and hides alignment bugs; not a disk tier"
    return out


def _read_meminfo() -> dict[str, int]:
    vals: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                vals[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return vals


def _hugepages() -> dict:
    mounts = []
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "hugetlbfs":
                mounts.append({"mount": fields[1], "options": fields[3]})
    mem = _read_meminfo()
    sizes = {}
    base = "/sys/kernel/mm/hugepages"
    if os.path.isdir(base):
        for d in sorted(os.listdir(base)):
            def rd(name: str, d: str = d) -> int:
                with open(os.path.join(base, d, name)) as f:
                    return int(f.read().strip())
            sizes[d.replace("hugepages-", "")] = {"total": rd("nr_hugepages"),
                                                  "free": rd("free_hugepages")}
    return {
        "hugetlbfs_mounts": mounts,
        "default_page_bytes": mem.get("Hugepagesize", 0),
        "total_pages": mem.get("HugePages_Total", 0),
        "free_pages": mem.get("HugePages_Free", 0),
        "by_size": sizes,
    }


def _packages() -> dict:
    out: dict[str, Any] = {}
    for name in ("torch", "sglang", "transformers", "triton", "flashinfer-python", "numpy",
                 "prometheus_client"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def collect(directory: str = ".") -> dict:
    """The full report as a JSON-serialisable dict."""
    return {
        "vitrify": _section(_vitrify),
        "driver": _section(_driver),
        "directory": _section(lambda: _directory(directory)),
        "hugepages": _section(_hugepages),
        "packages": _section(_packages),
    }


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(report: dict) -> str:
    """A human-readable text version of :func:`collect`'s report."""
    lines = []
    t = report["vitrify"]
    if "error" in t:
        lines.append(f"vitrify    : {t['error']}")
    else:
        lines.append(f"vitrify    : {t['version']} ({t['git_sha']}, {t['build_type']}, "
                     f"{t['compiler']}, CUDA headers {t['cuda_headers']}, "
                     f"crc32c {'sse4.2' if t['crc32c_hardware'] else 'software'})")
        lines.append(f"python     : {t['python']} on {t['platform']}")
    d = report["driver"]
    if "error" in d:
        lines.append(f"driver     : error: {d['error']}")
    elif not d["available"]:
        lines.append(f"driver     : not available: {d['reason']}")
    else:
        lines.append(f"driver     : {d['library']}, version {d['driver_version']}, "
                     f"cuMemcpyBatchAsync {'yes' if d['cuMemcpyBatchAsync'] else 'no'}")
        for dev in d["devices"]:
            if "error" in dev:
                lines.append(f"  device   : error: {dev['error']}")
                continue
            lines.append(f"  GPU {dev['ordinal']}    : {dev['name']} sm_{dev['sm'].replace('.', '')} "
                         f"{_fmt_bytes(dev['total_bytes'])}, {dev['multiprocessors']} SMs, "
                         f"pci {dev['pci']}")
            lines.append(f"    VMM    : {'supported' if dev['vmm_supported'] else 'NOT supported'}"
                         f", granularity {_fmt_bytes(dev['granularity_min'])} "
                         f"(recommended {_fmt_bytes(dev['granularity_recommended'])})")
    r = report["directory"]
    if "error" in r:
        lines.append(f"directory  : {r['error']}")
    else:
        od = "yes" if r["o_direct"] else f"no ({r['o_direct_reason']})"
        lines.append(f"directory  : {r['path']} ({r['fs_type']}), O_DIRECT {od}")
        if "note" in r:
            lines.append(f"  note     : {r['note']}")
    h = report["hugepages"]
    if "error" in h:
        lines.append(f"hugepages  : {h['error']}")
    else:
        mounts = ", ".join(m["mount"] for m in h["hugetlbfs_mounts"]) or "none"
        lines.append(f"hugepages  : hugetlbfs mounts: {mounts}; free {h['free_pages']} of "
                     f"{h['total_pages']} pages of {_fmt_bytes(h['default_page_bytes'])}")
    p = report["packages"]
    if "error" in p:
        lines.append(f"packages   : {p['error']}")
    else:
        lines.append("packages   : " + ", ".join(
            f"{k} {v if v else '-'}" for k, v in p.items()))
    return "\n".join(lines)
