"""JIT caches in archives: what an engine compiled at FREEZE comes back at THAW, so nothing
compiles after a thaw (stdlib only; no torch, Triton or SGLang needed).

An inference server compiles kernels while it starts and on its first requests: Triton kernels
(``TRITON_CACHE_DIR``) and SGLang's C++/CUDA JIT modules built through tvm-ffi
(``TVM_FFI_CACHE_DIR``). Both keep content-addressed caches on disk and load a cached build
instead of compiling. So FREEZE points them at empty directories of its own (:func:`redirect`,
before anything compiles; child processes inherit the environment), and when the engine is
warm packs what they hold into the archive (:func:`pack`: ``jit/<cache>/<path>``, every file
checksummed like the rest of the archive, and ``jit/index.json``). THAW unpacks them into a
fresh directory, verified, and points the environment there (:func:`unpack`) before the engine
starts; :func:`compiled_since` then names every file the JITs added, i.e. every compile after
the thaw (the count that must stay 0).

Design notes (``docs/session.md``, J1-J5):

J1. Only the two caches above. Their entries are keyed by content (source, compiler version,
    GPU architecture), so an entry built for another GPU or toolchain is never used, only
    missed (and the session refuses such an archive anyway); neither embeds the cache's
    absolute path, so they work in another directory. torch inductor's cache is left out: its
    generated modules name files by absolute path.
J2. Packed files: regular files only (a symlink or another type is refused, naming it);
    Triton's in-flight ``tmp.*`` directories and lock files are skipped; of a tvm-ffi build
    directory only the built ``.so`` is kept (the objects and ninja files are build leftovers;
    SGLang loads ``<build dir>/<module>.so`` directly when it exists).
J3. Unpacking is atomic and never trusts the archive's names: paths are the archive's checked
    relative paths, written under a temporary directory with ``O_EXCL | O_NOFOLLOW`` and renamed
    into place. The parent directory must be this user's and writable by no one else (shared
    code is loaded from there: another user's directory is refused). Processes unpacking the
    same archive take turns under a lock in the parent; a directory already unpacked from the
    same content (its marker holds a digest of every file's checksum) is reused as it is.
J4. A cache that is not configured through its variable at FREEZE is still redirected (the
    JIT's default directory holds other engines' builds; the archive gets this engine's only).
    The work directory is marked as vitrify's; an earlier run's leftovers there are cleared,
    any other non-empty directory is refused.
J5. Without a JIT index (an archive frozen without caches) :func:`unpack` returns ``{}`` and
    sets nothing: the engine compiles as usual.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping, MutableMapping
from typing import Any

from . import _check

log = logging.getLogger("vitrify.jit")

JIT_FORMAT = 1
PREFIX = "jit"
INDEX = f"{PREFIX}/index.json"
MARKER = ".vitrify-jit"
WORK_MARKER = ".vitrify-jit-work"
# cache name -> the environment variable its JIT reads (at compile time, so setting it before
# the first compile is enough)
CACHES: dict[str, str] = {"triton": "TRITON_CACHE_DIR", "tvm-ffi": "TVM_FFI_CACHE_DIR"}


class JitCacheError(RuntimeError):
    """A JIT cache cannot be packed or unpacked: what and where."""


def redirect(root: str | os.PathLike, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Point every JIT cache at a fresh empty directory ``root/<cache>`` (created ``0700``) and
    return cache -> directory. ``env`` defaults to ``os.environ`` (inherited by the engine's
    child processes). An existing non-empty ``root/<cache>`` is an error: the archive must get
    what this engine compiles, not an older run's files."""
    env = os.environ if env is None else env
    root = os.path.abspath(_check.path("root", root))
    os.makedirs(root, mode=0o700, exist_ok=True)
    ours = os.path.exists(os.path.join(root, WORK_MARKER))
    out = {}
    for name, var in CACHES.items():
        d = os.path.join(root, name)
        if ours and os.path.isdir(d) and not os.path.islink(d):
            shutil.rmtree(d)  # an earlier FREEZE's leftovers (J4)
        os.makedirs(d, mode=0o700, exist_ok=True)
        if os.listdir(d):
            raise JitCacheError(f"JIT cache directory {d} is not empty and not vitrify's: remove "
                                f"it (a FREEZE records only what its engine compiles)")
        out[name] = d
    with open(os.path.join(root, WORK_MARKER), "w", encoding="utf-8") as f:
        f.write("JIT caches of a vitrify FREEZE; cleared by the next one\n")
    for name, d in out.items():
        env[CACHES[name]] = d
    log.info("JIT caches redirected under %s", root)
    return out


def _keep(cache: str, rel: str) -> bool:
    parts = rel.split("/")
    if any(p.startswith("tmp.") or p.endswith(".lock") for p in parts):
        return False
    if cache == "tvm-ffi":
        return rel.endswith(".so")
    return True


def listing(dirs: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """cache -> {relative path: bytes} of the files :func:`pack` would keep (J2); a symlink or
    special file is a :class:`JitCacheError` naming it."""
    out: dict[str, dict[str, int]] = {}
    for name, root in dirs.items():
        if name not in CACHES:
            raise ValueError(f"unknown JIT cache {name!r}; one of {sorted(CACHES)}")
        files: dict[str, int] = {}
        if os.path.isdir(root):
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for d in dirnames:
                    if os.path.islink(os.path.join(dirpath, d)):
                        raise JitCacheError(f"JIT cache {name}: {os.path.join(dirpath, d)} is "
                                            f"a symlink (only regular files are archived)")
                for f in sorted(filenames):
                    full = os.path.join(dirpath, f)
                    rel = os.path.relpath(full, root).replace(os.sep, "/")
                    if f == MARKER or not _keep(name, rel):
                        continue
                    st = os.lstat(full)
                    if not stat.S_ISREG(st.st_mode):
                        raise JitCacheError(f"JIT cache {name}: {full} is not a regular file "
                                            f"(only regular files are archived)")
                    files[rel] = st.st_size
        out[name] = files
    return out


def pack(writer: Any, dirs: Mapping[str, str]) -> dict:
    """Write the caches' files into an open :class:`vitrify.archive.ArchiveWriter` as
    ``jit/<cache>/<path>`` and the index ``jit/index.json``; returns the index (cache ->
    files, bytes). Call it when the engine is warm (its compiles done)."""
    files = listing(dirs)
    index: dict[str, Any] = {"format": JIT_FORMAT, "caches": {}}
    for name, members in files.items():
        total = 0
        for rel in members:
            with open(os.path.join(dirs[name], *rel.split("/")), "rb") as f:
                data = f.read()
            writer.write_bytes(f"{PREFIX}/{name}/{rel}", data)
            total += len(data)
        index["caches"][name] = {"variable": CACHES[name], "files": sorted(members),
                                 "bytes": total}
    writer.write_json(INDEX, index)
    log.info("JIT caches packed: %s", {n: len(c["files"]) for n, c in index["caches"].items()})
    return index


def _index_rule(index: dict, field: str) -> None:
    for name, c in index["caches"].items():
        if c["variable"] != CACHES[name]:
            raise _check.SchemaError(f"caches[{name!r}].variable",
                                     f"{c['variable']!r}; the {name} cache is {CACHES[name]}")


#: ``jit/index.json`` as :func:`pack` writes it; checked by :func:`read_index` before any use.
INDEX_SCHEMA = _check.Obj({
    "format": _check.Int(0, _check.U32_MAX),
    "caches": _check.Map(_check.Str(choices=sorted(CACHES)), _check.Obj({
        "variable": _check.Str(max_len=64),
        "files": _check.List(_check.RelPath(), unique=True),
        "bytes": _check.Int(0, _check.I64_MAX),
    })),
}, rule=_index_rule)


def read_index(archive: Any) -> dict | None:
    """The archive's JIT index, read after the manifest vouched for it and checked
    (:data:`INDEX_SCHEMA`, every file it lists in the manifest, its byte count theirs); None
    when it was frozen without JIT caches (J5). A problem is an
    :class:`vitrify.archive.ArchiveCorrupt` naming the archive, ``jit/index.json`` and the
    field."""
    from . import archive as _archive

    if not archive.has_file(INDEX):
        cached = sorted(rel for rel in archive.files if rel.startswith(PREFIX + "/"))
        if cached:
            raise _archive.ArchiveCorrupt(archive.path, INDEX, f"not in the manifest, which "
                                                               f"lists {len(cached)} JIT cache "
                                                               f"files ({cached[0]}, ...)")
        return None
    index = archive.read_json(INDEX)
    fmt = index.get("format") if type(index) is dict else None
    if type(fmt) is not int or fmt != JIT_FORMAT:
        raise _archive.ArchiveCorrupt(archive.path, INDEX, f"format: {_check.short(fmt)}: not "
                                                           f"a JIT index of format {JIT_FORMAT}")
    try:
        _check.validate(INDEX_SCHEMA, index)
    except _check.PathSchemaError as e:
        raise _archive.UnsafePath(archive.path, INDEX, str(e)) from None
    except _check.SchemaError as e:
        raise _archive.ArchiveCorrupt(archive.path, INDEX, str(e)) from None
    for name, c in index["caches"].items():
        total = 0
        for i, rel in enumerate(c["files"]):
            entry = archive.files.get(f"{PREFIX}/{name}/{rel}")
            if entry is None:
                raise _archive.ArchiveCorrupt(archive.path, INDEX, f"caches[{name!r}].files[{i}]: "
                                                                   f"lists {name}/{rel}, which "
                                                                   f"the manifest lacks")
            total += entry["bytes"]
        if total != c["bytes"]:
            raise _archive.ArchiveCorrupt(archive.path, INDEX, f"caches[{name!r}].bytes: "
                                                               f"{c['bytes']}, but its files "
                                                               f"hold {total}")
    # and the index accounts for every JIT cache file the manifest lists
    indexed = {f"{PREFIX}/{n}/{r}" for n, c in index["caches"].items() for r in c["files"]}
    for rel in archive.files:
        if rel.startswith(PREFIX + "/") and rel != INDEX and rel not in indexed:
            raise _archive.ArchiveCorrupt(archive.path, INDEX, f"lists no {rel}, which the "
                                                               f"manifest lists")
    return index


def unpack(archive: Any, dest: str | os.PathLike,
           env: MutableMapping[str, str] | None = None, *, threads: int = 8) -> dict[str, str]:
    """Unpack the archive's JIT caches into ``dest/<cache>`` (verified, atomic, J3) and point
    the environment at them; returns cache -> directory ({} for an archive without caches).
    ``archive``: an open :class:`vitrify.archive.Archive`."""
    env = os.environ if env is None else env
    dest = os.path.abspath(_check.path("dest", dest))
    index = read_index(archive)
    if index is None:
        log.info("archive %s holds no JIT caches: the engine compiles as usual", archive.path)
        return {}
    rels = [f"{PREFIX}/{n}/{r}" for n, c in index["caches"].items() for r in c["files"]]
    stamp = hashlib.sha256("\n".join([archive.files[INDEX]["checksum"]] + [
        f"{rel} {archive.files[rel]['checksum']}" for rel in rels]).encode()).hexdigest()
    parent = os.path.dirname(dest)
    _own_directory(parent)
    with _locked(os.path.join(parent, f".{os.path.basename(dest)}.lock")):
        if _marker(dest) == stamp:
            log.info("JIT caches already unpacked at %s", dest)
        else:
            _unpack_into(archive, index, rels, dest, stamp, threads)
    out = {name: os.path.join(dest, name) for name in index["caches"]}
    for name, d in out.items():
        env[CACHES[name]] = d
    return out


def _own_directory(path: str) -> None:
    """Create ``path`` (0700) if needed; it must be a directory of this user that no one else
    can write (J3): code is loaded from below it."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise JitCacheError(f"{path} must be a directory owned by this user (uid {os.getuid()}) "
                            f"and writable by no one else; it is owned by uid {st.st_uid} with "
                            f"mode {stat.filemode(st.st_mode)}: choose another jit_dir")


class _locked:
    """An exclusive ``flock`` on ``path`` for the block (created 0600)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _unpack_into(archive: Any, index: dict, rels: list[str], dest: str, stamp: str,
                 threads: int) -> None:
    """Every listed file verified into a fresh temporary sibling, then renamed to ``dest``."""
    tmp = tempfile.mkdtemp(prefix=os.path.basename(dest) + ".tmp-", dir=os.path.dirname(dest))
    try:
        data = archive.read_files(rels, checksum=True, threads=threads) if rels else {}
        for name in index["caches"]:
            os.makedirs(os.path.join(tmp, name), mode=0o700, exist_ok=True)
        for rel, blob in data.items():
            _write_new(os.path.join(tmp, *rel.split("/")[1:]), blob)
        _write_new(os.path.join(tmp, MARKER), stamp.encode())
        if os.path.lexists(dest):
            shutil.rmtree(dest)  # an older or partial unpack (J3); the lock keeps others out
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("JIT caches unpacked at %s: %s", dest,
             {n: len(c["files"]) for n, c in index["caches"].items()})


def compiled_since(dirs: Mapping[str, str], index: Mapping[str, Any] | None) -> dict[str, list[str]]:
    """Files each JIT cache has that the archive's index does not list: what was compiled since
    the thaw (J2's filter applied). {} entries mean no JIT work."""
    have = listing(dirs)
    known = {n: set(c["files"]) for n, c in ((index or {}).get("caches") or {}).items()}
    return {n: sorted(set(files) - known.get(n, set())) for n, files in have.items()}


def _marker(dest: str) -> str | None:
    try:
        with open(os.path.join(dest, MARKER), encoding="utf-8") as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _write_new(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


__all__ = ["CACHES", "INDEX", "JitCacheError", "compiled_since", "listing", "pack", "read_index",
           "redirect", "unpack"]
