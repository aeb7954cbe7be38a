"""What the real CUDA driver does with a SharedBuffer's POSIX fd (R14 in
csrc/src/region/DESIGN.md): the kind of file the exported fd is (does fstat tell the size?),
whether its own process can import it, whether the import needs the fd afterwards, what an import
with another size does, and whether the importer outlives the exporter's release. Prints JSON.

    python scripts/experiments/shared_fd_probe.py   (on a GPU machine, vitrify installed)
"""

from __future__ import annotations

import json
import os
import stat

from vitrify import _native

MiB = 1 << 20


def attempt(fn):
    try:
        return {"ok": fn()}
    except Exception as e:  # noqa: BLE001 - a probe records whatever happens
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> dict:
    out: dict = {}
    a = _native.SharedBuffer(64 * MiB + 1)
    out["size"] = a.size
    a.write(0, b"exporter" * 1024)
    fd = a.export_fd()
    st = os.fstat(fd)
    out["fd"] = {
        "target": os.readlink(f"/proc/self/fd/{fd}"),
        "mode": oct(st.st_mode),
        "regular": stat.S_ISREG(st.st_mode),
        "chr": stat.S_ISCHR(st.st_mode),
        "st_size": st.st_size,
        "cloexec": not os.get_inheritable(fd),
    }
    b = _native.SharedBuffer.import_fd(fd, a.size)
    out["fd_open_after_import"] = attempt(lambda: os.fstat(fd) is not None)
    os.close(fd)
    out["same_process_import"] = {
        "distinct_ptr": b.ptr != a.ptr,
        "sees_exporter": b.read(0, 8 * 1024) == b"exporter" * 1024,
    }
    b.write(a.size - 8, b"importer")
    out["exporter_sees_importer"] = a.read(a.size - 8, 8) == b"importer"
    fd2 = a.export_fd()
    out["smaller_import"] = attempt(lambda: _native.SharedBuffer.import_fd(fd2, a.size // 2).release())
    out["larger_import"] = attempt(lambda: _native.SharedBuffer.import_fd(fd2, a.size * 2).release())
    os.close(fd2)
    out["exporter_release"] = a.release()
    out["importer_reads_after_exporter_release"] = attempt(
        lambda: b.read(0, 8 * 1024) == b"exporter" * 1024)
    out["importer_release"] = b.release()
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
