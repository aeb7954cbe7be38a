"""The vitrify archive: a directory holding everything a vitrify needs, described by ``manifest.json``.

Layout::

    ARCHIVE/manifest.json        format "vitrify-archive", version, created, vitrify_version,
                                 fingerprint {gpu, sm, driver, cuda, torch, engine,
                                              engine_version, model},
                                 region {base, size, granularity, checkpoints {name: offset}},
                                 files {relpath: {bytes, checksum}},
                                 checksum (CRC32C of the manifest without this key)
    ARCHIVE/rank<N>/region/      span files (<name>.span: "warmup" = the warmup gap,
                                 "weights" = the optional weights span)
    ARCHIVE/rank<N>/modules/     kernel binaries by content hash
    ARCHIVE/rank<N>/graphs/      graph files + template index
    ARCHIVE/rank<N>/state.json   engine-specific state

Writing (:class:`ArchiveWriter`) happens in a temporary sibling directory; every file and
directory is fsynced, then the directory is renamed into place, so a reader sees either no
archive or a complete one. With one process per rank, the ranks write into the coordinator's
temporary directory through :class:`RankWriter`. Files shared by several writers go through
:func:`write_shared` (temporary file + ``os.replace``).

Opening (:func:`open_archive`) reads the manifest (a regular file, no link, at most
:data:`MAX_MANIFEST_BYTES`, parsed with bounds) and checks the format, the version, its own
checksum, its schema (:data:`MANIFEST_SCHEMA`: strict types, 64-bit bounds, no path that is
absolute, has ``..`` or a control character), the caller's expected fingerprint (each mismatch
is an :class:`ArchiveMismatch` naming the field and both values), and that every listed file is
a regular file reached through no symlink, of its recorded size. Files are read only after
that, each through the same opener; the JSON files vitrify reads are each checked against
their schema when read. :func:`verify` also checks every file's CRC32C and those schemas, and
returns every problem, one line each. Loading only parses JSON and span files: nothing is
unpickled or executed.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import importlib.metadata
import json
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import _check, _native
from . import snapshot as _snapshot
from ._units import GiB, KiB, MiB

log = logging.getLogger("vitrify.archive")

FORMAT = "vitrify-archive"
VERSION = 1
MANIFEST = "manifest.json"
FINGERPRINT_FIELDS = ("gpu", "sm", "driver", "cuda", "torch", "engine", "engine_version", "model")
_RANK_RE = re.compile(r"^rank(0|[1-9][0-9]{0,5})$")
_MAX_RANK = 999999


# ---- errors ----------------------------------------------------------------------------------

class ArchiveError(Exception):
    """Base of every archive problem (mismatch, corruption, unsafe path)."""


class ArchiveMismatch(ArchiveError):
    """The archive does not fit: ``field`` is ``found`` in the archive, ``expected`` here."""

    def __init__(self, path: str, field: str, expected: Any, found: Any):
        self.path, self.field, self.expected, self.found = path, field, expected, found
        super().__init__(f"archive {path}: {field} mismatch: expected {_check.short(expected)}, "
                         f"the archive has {_check.short(found)}")


class ArchiveCorrupt(ArchiveError):
    """A file of the archive (``relpath``) is missing, truncated, edited or malformed."""

    def __init__(self, path: str, relpath: str, reason: str):
        self.path, self.relpath, self.reason = path, relpath, reason
        # one line whatever the name holds (a newline in a listed path must not start a line)
        super().__init__(f"archive {path}: {_check.shown(str(relpath))}: {reason}")


class UnsafePath(ArchiveCorrupt):
    """A manifest path would leave the archive directory (absolute, ``..``, or a symlink)."""


# ---- fingerprint and region ------------------------------------------------------------------

def _nvidia_driver_version() -> str | None:
    """The NVIDIA kernel driver version ("580.159.04"), or None where it cannot be read."""
    try:
        with open("/sys/module/nvidia/version") as f:
            v = f.read().strip()
            if v:
                return v
    except OSError:
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", f.read())
            if m:
                return m.group(1)
    except OSError:
        pass
    return None


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What must match between freeze and thaw. ``None`` means unknown (and, as an expectation
    passed to :func:`open_archive`, "do not check")."""

    gpu: str | None = None
    sm: str | None = None
    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    engine: str | None = None
    engine_version: str | None = None
    model: str | None = None

    @classmethod
    def current(cls, *, engine: str | None = None, engine_version: str | None = None,
                model: str | None = None, device: int = 0) -> Fingerprint:
        """This machine's fingerprint (GPU name and SM of ``device``, NVIDIA driver, CUDA
        driver API version, installed torch) plus the engine and model the caller names."""
        for name, v in (("engine", engine), ("engine_version", engine_version), ("model", model)):
            if v is not None and not isinstance(v, str):
                raise _check.ArgumentTypeError(f"{name} must be a str or None, got {_check.got(v)}")
        device = _check.integer("device", device, 0, (1 << 31) - 1)
        gpu = sm = cuda = driver = None
        if _native.cuda_available():
            info = _native.device_info(device)
            gpu, sm = info["name"], info["sm"]
            v = _native.driver_version()
            cuda = f"{v // 1000}.{v % 1000 // 10}"
        driver = _nvidia_driver_version()
        try:
            torch = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch = None
        return cls(gpu=gpu, sm=sm, driver=driver, cuda=cuda, torch=torch, engine=engine,
                   engine_version=engine_version, model=model)

    def to_dict(self) -> dict[str, str | None]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Region:
    """The region the archive was frozen in: base address, size, allocation granularity and
    the cursor offsets at named checkpoints (e.g. after weights, after warmup)."""

    base: int
    size: int
    granularity: int
    checkpoints: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base, "size": self.size, "granularity": self.granularity,
                "checkpoints": dict(self.checkpoints)}


# ---- helpers ---------------------------------------------------------------------------------

def file_checksum(path: str | os.PathLike) -> str:
    """``"crc32c:xxxxxxxx"`` of a whole file (native, large reads, GIL released)."""
    return f"crc32c:{_native.file_crc32c(_check.existing_file('path', path)):08x}"


def _manifest_checksum(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"crc32c:{_native.crc32c(text):08x}"


def check_relpath(rel: Any) -> str:
    """Return ``rel`` if it is a safe relative path inside an archive, else raise ValueError:
    a non-empty str of ``/``-separated components, none empty, ``.`` or ``..``, no backslash,
    NUL or other control character, not absolute, each component at most 255 bytes and the
    whole at most 4095 (see :func:`vitrify._check.relpath_problem`)."""
    problem = _check.relpath_problem(rel)
    if problem:
        raise ValueError(f"archive path {_check.short(rel)} {problem}")
    return rel


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shared(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary sibling is written and fsynced, then
    ``os.replace``d over ``path`` and the directory fsynced. A concurrent reader sees the old
    content or the new, never a half-written file."""
    path = _check.path("path", path)
    _check.buffer("data", data)
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise FileNotFoundError(2, "path: the directory does not exist", d)
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_path(d, directory=True)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


# ---- writing ---------------------------------------------------------------------------------

class _FileWriter:
    """File helpers shared by :class:`ArchiveWriter` and :class:`RankWriter`."""

    temp_path: str
    _rank: int | None = None
    # rel -> (size, mtime_ns, inode, checksum) of files whose checksum was computed while writing
    # them (span dumps in this process): the manifest takes it while the file is unchanged,
    # instead of reading it back
    _known: dict[str, tuple[int, int, int, str]] | None = None

    def _check_open(self) -> None:  # overridden by ArchiveWriter
        pass

    # -- files --
    def file_path(self, rel: str) -> str:
        """Absolute path of ``rel`` inside the temporary directory (parents created)."""
        self._check_open()
        check_relpath(rel)
        if self._rank is not None and not rel.startswith(f"rank{self._rank}/"):
            raise ValueError(f"rank {self._rank} may only write under rank{self._rank}/, "
                             f"not {rel!r}")
        full = os.path.join(self.temp_path, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if self._known:
            self._known.pop(rel, None)  # whoever asks for the path may rewrite the file
        return full

    def write_bytes(self, rel: str, data: bytes) -> str:
        _check.buffer("data", data)
        full = self.file_path(rel)
        with open(full, "wb") as f:
            f.write(data)
        return full

    def write_json(self, rel: str, obj: Any) -> str:
        try:
            data = _json_bytes(obj)
        except (TypeError, ValueError) as e:
            raise _check.ArgumentTypeError(f"obj for {rel!r} is not plain JSON: {e}") from None
        return self.write_bytes(rel, data)

    def write_state(self, rank: int, state: Mapping[str, Any]) -> str:
        """``rank<N>/state.json``: engine-specific state (JSON only)."""
        rank = _check.integer("rank", rank, 0, _MAX_RANK)
        if not isinstance(state, Mapping):
            raise _check.ArgumentTypeError(f"state must be a mapping (JSON object), got "
                                           f"{_check.got(state)}")
        try:
            data = _json_bytes(dict(state))
        except (TypeError, ValueError) as e:
            raise _check.ArgumentTypeError(f"state is not plain JSON: {e}") from None
        return self.write_bytes(f"rank{rank}/state.json", data)

    def dump_span(self, rank: int, name: str, base: int, start: int, end: int,
                  **kw: Any) -> dict:
        """Dump a region span into ``rank<N>/region/<name>.span`` (see
        :func:`vitrify.snapshot.dump_to_file` for ``kw``: target, chunk_bytes, granularity,
        direct_io, progress). ``name`` ``"warmup"`` is the warmup gap; ``"weights"`` the
        optional weights span. Dump the warmup gap BEFORE the engine empties its caching
        allocator."""
        rank = _check.integer("rank", rank, 0, _MAX_RANK)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) \
                or name in (".", ".."):
            raise ValueError(f"span name {name!r}: use letters, digits, '_', '-', '.'")
        rel = _snapshot.span_relpath(rank, name)
        full = self.file_path(rel)
        out = _snapshot.dump_to_file(full, base, start, end, **kw)
        if "file_crc32c" in out:
            st = os.stat(full)
            if st.st_size == out["file_bytes"]:
                if self._known is None:
                    self._known = {}
                self._known[rel] = (st.st_size, st.st_mtime_ns, st.st_ino,
                                    f"crc32c:{out['file_crc32c']:08x}")
        return out


class ArchiveWriter(_FileWriter):
    """Builds an archive in a temporary sibling directory; :meth:`commit` makes it appear at
    ``path`` atomically. As a context manager it commits on success and removes the temporary
    directory on an exception.

    Files may be written with the helpers below or directly at :meth:`file_path` (e.g. by graph
    serializers); at commit every regular file under the temporary directory is checksummed into
    the manifest.

    A crash before the final rename leaves only the temporary directory (see
    :func:`iter_stale_temporaries`). With ``overwrite=True`` the old archive is first renamed
    aside (``.<name>.old-<token>``), so a crash between the two renames leaves no archive at
    ``path`` — never a mixed one.
    """

    def __init__(self, path: str | os.PathLike, fingerprint: Fingerprint, region: Region, *,
                 overwrite: bool = False):
        self._done = True  # nothing to abort until the temporary directory exists
        self.path = os.path.abspath(_check.path("path", path))
        if not isinstance(fingerprint, Fingerprint):
            raise _check.ArgumentTypeError(f"fingerprint must be a vitrify.archive.Fingerprint, "
                                           f"got {_check.got(fingerprint)}")
        if not isinstance(region, Region):
            raise _check.ArgumentTypeError(f"region must be a vitrify.archive.Region, got "
                                           f"{_check.got(region)}")
        overwrite = _check.boolean("overwrite", overwrite)
        for name, v in (("base", region.base), ("size", region.size),
                        ("granularity", region.granularity)):
            _check.integer(f"region.{name}", v, 0, _check.U64_MAX)
        if not isinstance(region.checkpoints, Mapping):
            raise _check.ArgumentTypeError(f"region.checkpoints must be a mapping name -> offset, "
                                           f"got {_check.got(region.checkpoints)}")
        for k, v in region.checkpoints.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"region.checkpoints[{k!r}] must map a str to an offset >= 0, "
                                 f"got {v!r}")
        # what open_archive would refuse is not written
        for name, schema, value in (("fingerprint", FINGERPRINT_SCHEMA, fingerprint.to_dict()),
                                    ("region", REGION_SCHEMA, region.to_dict())):
            try:
                _check.validate(schema, value)
            except _check.SchemaError as e:
                raise ValueError(f"{name}.{e}") from None
        parent = os.path.dirname(self.path)
        if not os.path.exists(parent):
            raise FileNotFoundError(2, "path: the parent directory does not exist", parent)
        if not os.path.isdir(parent):
            raise NotADirectoryError(20, "path: the parent is not a directory", parent)
        if os.path.lexists(self.path) and not overwrite:
            raise FileExistsError(17, "path: the archive already exists (pass overwrite=True)",
                                  self.path)
        self.fingerprint = fingerprint
        self.region = region
        self.overwrite = overwrite
        self.temp_path = os.path.join(
            parent, f".{os.path.basename(self.path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(self.temp_path, 0o755)
        except OSError as e:
            raise type(e)(e.errno, f"path: cannot create the archive's temporary directory "
                                   f"({e.strerror})", self.temp_path) from None
        self._done = False

    # -- commit --
    def _check_open(self) -> None:
        if self._done:
            raise ValueError(f"archive writer for {self.path} is already committed or aborted")

    def _collect(self) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = {}
        for root, dirs, names in os.walk(self.temp_path):
            for n in dirs + names:
                full = os.path.join(root, n)
                st = os.lstat(full)
                rel = os.path.relpath(full, self.temp_path).replace(os.sep, "/")
                if stat.S_ISLNK(st.st_mode):
                    raise ValueError(f"archive {self.path}: {rel} is a symlink; archives hold "
                                     "regular files only")
                if n in names and rel != MANIFEST:
                    if not stat.S_ISREG(st.st_mode):
                        raise ValueError(f"archive {self.path}: {rel} is not a regular file")
                    known = (self._known or {}).get(rel)
                    checksum = known[3] if known is not None and \
                        known[:3] == (st.st_size, st.st_mtime_ns, st.st_ino) \
                        else file_checksum(full)
                    files[check_relpath(rel)] = {"bytes": st.st_size, "checksum": checksum}
        return dict(sorted(files.items()))

    def commit(self) -> str:
        """Checksum every file, write the manifest, fsync everything, rename into place.
        Returns the archive path."""
        self._check_open()
        files = self._collect()
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "vitrify_version": _native.build_info()["version"],
            "fingerprint": self.fingerprint.to_dict(),
            "region": self.region.to_dict(),
            "files": files,
        }
        manifest["checksum"] = _manifest_checksum(manifest)
        with open(os.path.join(self.temp_path, MANIFEST), "wb") as f:
            f.write(_json_bytes(manifest))
        for root, dirs, names in os.walk(self.temp_path, topdown=False):
            for n in names:
                _fsync_path(os.path.join(root, n))
            _fsync_path(root, directory=True)
        parent = os.path.dirname(self.path)
        old = None
        if os.path.lexists(self.path):
            if not self.overwrite:
                raise FileExistsError(f"archive {self.path} appeared while writing")
            old = os.path.join(parent, f".{os.path.basename(self.path)}.old-{secrets.token_hex(4)}")
            os.rename(self.path, old)
        os.rename(self.temp_path, self.path)
        _fsync_path(parent, directory=True)
        self._done = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        log.info("wrote archive %s: %d files, %d bytes", self.path, len(files),
                 sum(e["bytes"] for e in files.values()))
        return self.path

    def abort(self) -> None:
        """Remove the temporary directory; nothing appears at ``path``."""
        if not self._done:
            self._done = True
            shutil.rmtree(self.temp_path, ignore_errors=True)

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.commit()


class RankWriter(_FileWriter):
    """Writes one rank's files into another process's :class:`ArchiveWriter`.

    Multi-process engines (one process per rank): the coordinating process creates the
    ArchiveWriter and hands ``writer.temp_path`` to every rank; each rank writes its
    ``rank<N>/`` files through a RankWriter; after all ranks are done (the caller's barrier) the
    coordinator commits. Nothing is visible at the archive path before that commit.
    """

    def __init__(self, temp_path: str | os.PathLike, rank: int):
        self.temp_path = os.path.abspath(_check.path("temp_path", temp_path))
        if not (os.path.basename(self.temp_path).startswith(".")
                and ".tmp-" in os.path.basename(self.temp_path)):
            raise ValueError(f"{self.temp_path} is not an ArchiveWriter temporary directory")
        if not os.path.isdir(self.temp_path) or os.path.islink(self.temp_path):
            raise FileNotFoundError(f"archive temporary directory {self.temp_path} is missing "
                                    "(committed or aborted already?)")
        self._rank = _check.integer("rank", rank, 0, _MAX_RANK)

    def write_state(self, state: Mapping[str, Any]) -> str:  # type: ignore[override]
        """This rank's ``state.json``."""
        return super().write_state(self._rank, state)

    def dump_span(self, name: str, base: int, start: int, end: int,  # type: ignore[override]
                  **kw: Any) -> dict:
        """This rank's span file (see :meth:`ArchiveWriter.dump_span`)."""
        return super().dump_span(self._rank, name, base, start, end, **kw)


# ---- reading ---------------------------------------------------------------------------------
#
# Every file of an archive is untrusted input, and is read only after the manifest vouches for
# it: the manifest itself first, then only the files it lists, each through one opener
# (``_open_dir`` + ``_open_leaf``: the manifest's read, ``Archive._visit`` for every listed
# file) that follows no symbolic link in any component and opens nothing but a regular file
# (``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``: a FIFO is refused, never waited on). Each JSON
# file is checked once, when it is read, against one schema (the manifest's below; a rank's
# session state in ``session.py``, the graph index in ``graph.py``, the JIT index in
# ``jit.py``), with bounded parsing (``_check.load_json``). Every problem is an
# :class:`ArchiveCorrupt` naming the archive, the file and the field.

#: The largest manifest read (bytes): about 100 bytes per listed file.
MAX_MANIFEST_BYTES = 64 * MiB
#: The largest other JSON file of an archive read whole (a rank's state, the graph index, the
#: JIT index).
MAX_JSON_BYTES = 64 * MiB

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def _open_error(path: str, rel: str, sub: str, e: OSError, dfd: int, name: str) -> ArchiveError:
    """The error for a failed ``openat(dfd, name)`` of component ``sub`` of listed file ``rel``."""
    if e.errno == errno.ENOENT:
        return ArchiveCorrupt(path, rel, "missing" if sub == rel else f"missing ({sub} does "
                                                                      f"not exist)")
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            return UnsafePath(path, rel, f"{_check.shown(sub)} is a symlink")
        if e.errno == errno.ENOTDIR:
            return ArchiveCorrupt(path, rel, f"{_check.shown(sub)} is not a directory")
    return ArchiveCorrupt(path, rel, f"cannot open {_check.shown(sub)}: {e.strerror}")


def _open_dir(path: str, parts: list[str], rel: str) -> int:
    """A descriptor of the directory ``path/parts...``, reached without following a link (the
    archive directory ``path`` itself is the caller's and may be one)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ArchiveCorrupt(path, rel, f"cannot open the archive directory: {e.strerror}") \
            from None
    try:
        for i, part in enumerate(parts):
            try:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                raise _open_error(path, rel, "/".join(parts[:i + 1]), e, fd, part) from None
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_leaf(path: str, rel: str, dfd: int, name: str) -> tuple[int, os.stat_result]:
    """``name`` in the directory ``dfd`` opened for reading if it is a regular file: (fd, stat).
    A link is not followed; a FIFO, device or socket is refused without blocking."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
    except OSError as e:
        raise _open_error(path, rel, rel, e, dfd, name) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArchiveCorrupt(path, rel, f"not a regular file "
                                            f"({_KINDS.get(stat.S_IFMT(st.st_mode), 'special')})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _open_member(path: str, rel: str) -> tuple[int, os.stat_result]:
    """The one way an archive's file is opened: ``rel`` (a checked relative path) under the
    archive directory ``path``, no link followed in any component, a regular file only."""
    parts = rel.split("/")
    dfd = _open_dir(path, parts[:-1], rel)
    try:
        return _open_leaf(path, rel, dfd, parts[-1])
    finally:
        os.close(dfd)


def _read_fd(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes from ``fd``'s start (one more says the file is longer)."""
    chunks, left = [], limit
    while left > 0:
        b = os.pread(fd, min(left, 16 * MiB), limit - left)
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def _fd_path(fd: int, full: str) -> str:
    """A path that opens the very file ``fd`` holds (so a native reader cannot be sent elsewhere
    between the check and its open), where ``/proc`` has one; else ``full``."""
    p = f"/proc/self/fd/{fd}"
    return p if os.path.exists(p) else full


def _load(path: str, rel: str, raw: bytes, schema: _check.Schema | None) -> Any:
    """``raw`` parsed as JSON (bounded) and checked against ``schema``: ArchiveCorrupt naming
    ``rel`` and the field (UnsafePath for a path field)."""
    try:
        value = _check.load_json(raw)
        return value if schema is None else _check.validate(schema, value)
    except _check.PathSchemaError as e:
        raise UnsafePath(path, rel, str(e)) from None
    except ValueError as e:
        raise ArchiveCorrupt(path, rel, str(e)) from None


_CHECKSUM = _check.Str(pattern=r"crc32c:[0-9a-f]{8}")
_U64 = _check.Int(0, _check.U64_MAX)


def _region_rule(r: dict, field: str) -> None:
    at = f"{field}." if field else ""
    if r["base"] + r["size"] > _check.U64_MAX + 1:
        raise _check.SchemaError(f"{at}size", f"base {r['base']:#x} + size {r['size']:#x} is "
                                              f"past the 64-bit address space")
    for k, v in r["checkpoints"].items():
        if v > r["size"]:
            raise _check.SchemaError(f"{at}checkpoints[{_check.short(k)}]",
                                     f"{v} is past the region's size {r['size']}")


def _manifest_rule(m: dict, field: str) -> None:
    if MANIFEST in m["files"]:
        raise _check.SchemaError(f"files[{MANIFEST!r}]", "the manifest lists itself")


#: The region of a manifest (also what :class:`ArchiveWriter` accepts).
REGION_SCHEMA = _check.Obj({
    "base": _U64, "size": _U64, "granularity": _U64,
    "checkpoints": _check.Map(_check.Str(max_len=256), _U64, max_len=4096),
}, rule=_region_rule)
#: The fingerprint of a manifest (also what :class:`ArchiveWriter` accepts).
FINGERPRINT_SCHEMA = _check.Obj({f: _check.Nullable(_check.Str(max_len=1024))
                                 for f in FINGERPRINT_FIELDS})
#: ``manifest.json`` (format and version are checked first, then the checksum, then this).
MANIFEST_SCHEMA = _check.Obj({
    "format": _check.Str(choices=[FORMAT]),
    "version": _check.Int(VERSION, VERSION),
    "created": _check.Str(max_len=64),
    "vitrify_version": _check.Str(max_len=256),
    "fingerprint": FINGERPRINT_SCHEMA,
    "region": REGION_SCHEMA,
    "files": _check.Map(_check.RelPath(), _check.Obj({"bytes": _check.Int(0, _check.I64_MAX),
                                                      "checksum": _CHECKSUM}),
                        max_len=1 << 22),
    "checksum": _CHECKSUM,
}, rule=_manifest_rule)


def _read_manifest(path: str) -> bytes:
    """``manifest.json``'s bytes, through the archive's opener and within
    :data:`MAX_MANIFEST_BYTES`."""
    try:
        fd, st = _open_member(path, MANIFEST)
    except ArchiveCorrupt as e:
        if e.reason == "missing":
            raise ArchiveCorrupt(path, MANIFEST, "missing (not a vitrify archive, or an "
                                                 "unfinished one)") from None
        raise
    try:
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ArchiveCorrupt(path, MANIFEST, f"{st.st_size} bytes, more than a manifest "
                                                 f"may have ({MAX_MANIFEST_BYTES})")
        try:
            raw = _read_fd(fd, MAX_MANIFEST_BYTES + 1)
        except OSError as e:
            raise ArchiveCorrupt(path, MANIFEST, f"cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ArchiveCorrupt(path, MANIFEST, f"more than a manifest may have "
                                             f"({MAX_MANIFEST_BYTES} bytes)")
    return raw


def _parse_manifest(path: str, raw: bytes) -> dict[str, Any]:
    m = _load(path, MANIFEST, raw, None)
    if type(m) is not dict:
        raise ArchiveCorrupt(path, MANIFEST, f"must hold a JSON object, got {_check.got(m)}")
    fmt, version = m.get("format"), m.get("version")
    if type(fmt) is not str or fmt != FORMAT:
        if fmt is not None and type(fmt) is not str:
            raise ArchiveCorrupt(path, MANIFEST, f"format: must be a str, got {_check.got(fmt)}")
        raise ArchiveMismatch(path, "format", FORMAT, fmt)
    if type(version) is not int:
        raise ArchiveCorrupt(path, MANIFEST, f"version: must be an int, got "
                                             f"{_check.got(version)}")
    if version != VERSION:
        raise ArchiveMismatch(path, "version", VERSION, version)
    want = m.get("checksum")
    got = _manifest_checksum(m)
    if want != got:
        raise ArchiveCorrupt(path, MANIFEST, f"edited or damaged: its checksum is "
                                             f"{_check.short(want)}, its content hashes to "
                                             f"{got!r}")
    try:
        _check.validate(MANIFEST_SCHEMA, m)
    except _check.PathSchemaError as e:
        raise UnsafePath(path, MANIFEST, str(e)) from None
    except _check.SchemaError as e:
        raise ArchiveCorrupt(path, MANIFEST, str(e)) from None
    return m


class Archive:
    """An opened, structurally checked archive (see :func:`open_archive`)."""

    def __init__(self, path: str, manifest: dict[str, Any]):
        self.path = path
        self.manifest = manifest
        self.fingerprint = Fingerprint(**manifest["fingerprint"])
        r = manifest["region"]
        self.region = Region(r["base"], r["size"], r["granularity"], dict(r["checkpoints"]))
        self.files: dict[str, dict[str, Any]] = manifest["files"]

    def check_fingerprint(self, expect: Fingerprint | Mapping) -> None:
        """Raise :class:`ArchiveMismatch` (naming the field and both values) unless every field
        of ``expect`` that is not None equals this archive's: what ``open_archive(expect=...)``
        checks, for an archive opened before its expected fingerprint was known."""
        _compare_fingerprint(self.path, self.fingerprint, expect)

    @property
    def ranks(self) -> list[int]:
        """Ranks with at least one file (``rank<N>/...``), ascending."""
        out = set()
        for rel in self.files:
            m = _RANK_RE.match(rel.split("/", 1)[0])
            if m:
                out.add(int(m.group(1)))
        return sorted(out)

    def check_checkpoint(self, name: str, offset: int) -> None:
        """Compare this process's region cursor at checkpoint ``name`` with the frozen one: THAW
        must walk the same cursor trajectory as FREEZE. A drift (or an unknown checkpoint) is an
        :class:`ArchiveMismatch` with both numbers."""
        _check.string("name", name)
        _check.integer("offset", offset, 0, _check.U64_MAX)
        found = self.region.checkpoints.get(name)
        if found != offset:
            raise ArchiveMismatch(self.path, f"region.checkpoints.{name}", offset, found)

    def has_file(self, rel: str) -> bool:
        return rel in self.files

    # -- the one opener: every read of a listed file starts here --
    def _visit(self, rels: list[str], fn: Callable[[str, int], Any] | None = None) -> None:
        """Open each listed file of ``rels`` (see :func:`_open_member`; each directory reached
        once), check its size against the manifest and call ``fn(rel, fd)`` on it (the fd is
        closed after)."""
        by_dir: dict[str, list[str]] = {}
        for rel in rels:
            if rel not in self.files:
                raise ArchiveCorrupt(self.path, rel, "not listed in the manifest")
            by_dir.setdefault(check_relpath(rel).rpartition("/")[0], []).append(rel)
        for d, members in by_dir.items():
            dfd = _open_dir(self.path, d.split("/") if d else [], members[0])
            try:
                for rel in members:
                    fd, st = _open_leaf(self.path, rel, dfd, rel.rpartition("/")[2])
                    try:
                        self._check_size(rel, st.st_size)
                        if fn is not None:
                            fn(rel, fd)
                    finally:
                        os.close(fd)
            finally:
                os.close(dfd)

    def _checksum(self, rel: str, fd: int) -> None:
        """Compare the CRC32C of the file open at ``fd`` with the manifest's."""
        try:
            crc = _native.file_crc32c(_fd_path(fd, os.path.join(self.path, rel)))
        except OSError as e:
            raise ArchiveCorrupt(self.path, rel, f"cannot read: {e.strerror}") from None
        self._check_crc(rel, crc)

    def _check_size(self, rel: str, size: int) -> None:
        want = self.files[rel]["bytes"]
        if size != want:
            kind = "truncated" if size < want else "grown"
            raise ArchiveCorrupt(self.path, rel, f"{kind}: {size} bytes, the manifest says {want}")

    def _check_crc(self, rel: str, crc: int) -> None:
        want = self.files[rel]["checksum"]
        if f"crc32c:{crc:08x}" != want:
            raise ArchiveCorrupt(self.path, rel, f"checksum mismatch: the manifest says {want}, "
                                                 f"the file has crc32c:{crc:08x}")

    def file_path(self, rel: str) -> str:
        """Absolute path of a listed file, after checking that it is a regular file inside the
        archive reached through no symlink, of its listed size. Raises :class:`UnsafePath` /
        :class:`ArchiveCorrupt`."""
        self._visit([rel])
        return os.path.join(self.path, rel)

    def check_file(self, rel: str, *, checksum: bool) -> str:
        """Check a listed file's size (and with ``checksum``, its CRC32C); return its path."""
        self._visit([rel], self._checksum if checksum else None)
        return os.path.join(self.path, rel)

    def check_files(self, *, checksum: bool) -> None:
        """:meth:`check_file` of every listed file (the first problem raises)."""
        self._visit(list(self.files), self._checksum if checksum else None)

    def read_bytes(self, rel: str, *, checksum: bool = True,
                   max_bytes: int = MAX_JSON_BYTES) -> bytes:
        """A listed file's bytes, read once: its size (at most ``max_bytes``) and, with
        ``checksum``, the CRC32C of exactly these bytes checked against the manifest."""
        want = self.files[rel]["bytes"] if rel in self.files else 0
        if want > max_bytes:
            raise ArchiveCorrupt(self.path, rel, f"{want} bytes, more than such a file may have "
                                                 f"({max_bytes})")
        got: list[bytes] = []

        def read(rel: str, fd: int) -> None:
            try:
                got.append(_read_fd(fd, want + 1))
            except OSError as e:
                raise ArchiveCorrupt(self.path, rel, f"cannot read: {e.strerror}") from None

        self._visit([rel], read)
        data = got[0]
        self._check_size(rel, len(data))
        if checksum:
            self._check_crc(rel, _native.crc32c(data))
        return data

    def read_json(self, rel: str, schema: _check.Schema | None = None) -> Any:
        """Parse a listed JSON file (read once, its checksum verified; JSON only, nothing
        executes), checked against ``schema`` when given: any problem is an
        :class:`ArchiveCorrupt` naming the file and the field."""
        return _load(self.path, rel, self.read_bytes(rel), schema)

    def read_files(self, rels: list[str], *, checksum: bool, threads: int = 8) -> dict[str, bytes]:
        """Listed files read whole, each checked as :meth:`check_file` checks it (inside the
        archive, no symlink, a regular file, its size, with ``checksum`` its CRC32C): rel ->
        bytes. One native call reads them, ``threads`` at a time, without the GIL, so a
        background loader of ~150 small files does not wait for the GIL per file while the
        main thread runs Python (a THAW imports torch meanwhile)."""
        rels = list(rels)
        threads = _check.integer("threads", threads, 1, 256)
        self._visit(rels)  # each checked through the opener before the native reader opens it
        paths = [os.path.join(self.path, rel) for rel in rels]
        try:
            got = _native.read_whole_files(paths, [int(self.files[r]["bytes"]) for r in rels],
                                           threads)
        except OSError as e:
            where = os.path.relpath(e.filename, self.path) if e.filename else "a listed file"
            raise ArchiveCorrupt(self.path, where, f"cannot read: {e.strerror}") from None
        out: dict[str, bytes] = {}
        for rel, (size, data, crc) in zip(rels, got):
            self._check_size(rel, size if data is None else len(data))
            if checksum:
                self._check_crc(rel, crc)
            out[rel] = data
        return out

    def state(self, rank: int) -> dict[str, Any]:
        """``rank<N>/state.json`` ({} when absent): engine-specific, any JSON object (a session's
        part is checked by :func:`vitrify.session.read_state`)."""
        rel = f"rank{_check.integer('rank', rank, 0, _MAX_RANK)}/state.json"
        if rel not in self.files:
            return {}
        s = self.read_json(rel)
        if type(s) is not dict:
            raise ArchiveCorrupt(self.path, rel, f"must hold a JSON object, got {_check.got(s)}")
        return s

    def spans(self, rank: int) -> dict[str, str]:
        """Span name -> relative path of the rank's span files."""
        prefix = f"rank{_check.integer('rank', rank, 0, _MAX_RANK)}/region/"
        return {rel[len(prefix):-len(".span")]: rel for rel in self.files
                if rel.startswith(prefix) and rel.endswith(".span") and "/" not in rel[len(prefix):]}

    def span_info(self, rank: int, name: str) -> dict:
        """The header and tables of span ``name`` of ``rank`` (see
        :func:`vitrify.snapshot.file_info`); damage is an :class:`ArchiveCorrupt`."""
        return self._span_file_info(_snapshot.span_relpath(rank, name))

    def _span_file_info(self, rel: str) -> dict:
        full = self.file_path(rel)
        try:
            return _snapshot.file_info(full)
        except _snapshot.SpanFileError as e:
            raise ArchiveCorrupt(self.path, rel, f"not a valid span file: {e}") from None

    def restore_span(self, rank: int, name: str, base: int, ceiling: int, *,
                     within: tuple[int, int] | None = None, **kw: Any) -> dict:
        """Restore span ``name`` of ``rank`` to ``base`` clamped to ``ceiling``; chunk CRCs are
        verified on the way (see :func:`vitrify.snapshot.restore_from_file` for ``kw``).
        ``within=(lo, hi)``: the offsets the span must lie in (its header is checked first, so
        a span file put in another's place never writes outside its range; a damaged header is
        then an :class:`ArchiveCorrupt`). A chunk whose CRC32C does not match is a
        :class:`vitrify.snapshot.SpanFileError` naming the file and the chunk."""
        rel = _snapshot.span_relpath(rank, name)
        if within is not None:
            lo, hi = within
            info = self.span_info(rank, name)
            if not (lo <= info["start"] <= info["end"] <= hi):
                raise ArchiveCorrupt(self.path, rel, f"covers [{info['start']:#x}, "
                                                     f"{info['end']:#x}), outside the "
                                                     f"{name} span [{lo:#x}, {hi:#x}) the "
                                                     f"session state records")
        return _snapshot.restore_from_file(self.file_path(rel), base, ceiling, **kw)

    def verify(self) -> list[str]:
        """Every problem found (empty when the archive is intact), one line each: each listed
        file's presence, type, size and CRC32C, span-file structure, the schema of each JSON
        file vitrify reads (a rank's session state, the graph index, the JIT index), and files
        present but not listed. Never raises for damage."""
        from . import graph as _graph
        from . import jit as _jit
        from . import session as _session

        problems: list[str] = []

        def note(fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except (ArchiveError, _snapshot.SpanFileError) as e:
                if str(e) not in problems:
                    problems.append(str(e))
            except OSError as e:
                problems.append(f"archive {self.path}: {e.strerror or e}")

        def span(rel: str) -> None:
            self.check_file(rel, checksum=True)
            if rel.endswith(".span"):
                self._span_file_info(rel)

        def state(r: int) -> None:
            if "session" in self.state(r):
                _session.read_state(self, r)

        for rel in self.files:
            note(span, rel)
        for r in self.ranks:
            if f"rank{r}/state.json" in self.files:
                note(state, r)
            if f"rank{r}/{_graph.INDEX_FILE}" in self.files:
                note(_graph.archive_index, self, r)
        note(_jit.read_index, self)

        def walk_error(e: OSError) -> None:
            problems.append(f"archive {self.path}: cannot list "
                            f"{_check.shown(os.path.relpath(e.filename or self.path, self.path))}"
                            f": {e.strerror}")

        for root, dirs, names in os.walk(self.path, onerror=walk_error):
            for n in dirs + names:
                full = os.path.join(root, n)
                rel = _check.shown(os.path.relpath(full, self.path).replace(os.sep, "/"))
                if os.path.islink(full):
                    problems.append(f"archive {self.path}: {rel}: symlink inside the archive")
                elif n in names and rel != MANIFEST and rel not in self.files:
                    problems.append(f"archive {self.path}: {rel}: present but not in the manifest")
        return problems


def _compare_fingerprint(path: str, found: Fingerprint, expect: Fingerprint | Mapping) -> None:
    if not isinstance(expect, (Fingerprint, Mapping)):
        raise _check.ArgumentTypeError(f"expect must be a Fingerprint, a mapping or None, got "
                                       f"{_check.got(expect)}")
    exp = expect.to_dict() if isinstance(expect, Fingerprint) else dict(expect)
    unknown = set(exp) - set(FINGERPRINT_FIELDS)
    if unknown:
        raise ValueError(f"unknown fingerprint fields {sorted(unknown)}; "
                         f"known: {list(FINGERPRINT_FIELDS)}")
    for field in FINGERPRINT_FIELDS:
        want = exp.get(field)
        have = getattr(found, field)
        if want is not None and want != have:
            raise ArchiveMismatch(path, f"fingerprint.{field}", want, have)


def open_archive(path: str | os.PathLike, *, expect: Fingerprint | Mapping | None = None,
                 checksums: bool = False) -> Archive:
    """Open and check an archive; raise :class:`ArchiveError` (or FileNotFoundError when there
    is no directory at ``path``).

    Checks, in order: manifest format and version (:class:`ArchiveMismatch` with field
    ``format`` / ``version``), the manifest checksum and structure, every path (no escape), each
    ``expect`` field that is not None (``fingerprint.<field>``), and every listed file's size.
    ``checksums=True`` also verifies every file's CRC32C (reads everything).
    """
    path = os.path.abspath(_check.path("path", path))
    checksums = _check.boolean("checksums", checksums)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no archive directory at {path}")
    a = Archive(path, _parse_manifest(path, _read_manifest(path)))
    if expect is not None:
        _compare_fingerprint(path, a.fingerprint, expect)
    a.check_files(checksum=checksums)
    return a


def open_or_cold(path: str | os.PathLike, *,
                 expect: Fingerprint | Mapping | None = None) -> tuple[Archive | None, str]:
    """Like :func:`open_archive`, but a mismatch, a damaged archive or a missing one returns
    ``(None, reason)`` — the caller takes the cold path — and the reason is logged."""
    _check.path("path", path)
    if expect is not None and not isinstance(expect, (Fingerprint, Mapping)):
        raise _check.ArgumentTypeError(f"expect must be a Fingerprint, a mapping or None, got "
                                       f"{_check.got(expect)}")
    try:
        return open_archive(path, expect=expect), ""
    except (ArchiveError, FileNotFoundError) as e:
        reason = f"cold start: {e}"
        log.warning("%s", reason)
        return None, reason


def verify(path: str | os.PathLike) -> list[str]:
    """All problems of the archive at ``path`` (empty list: intact), one line each. Never raises
    for damage (only for a ``path`` that is not a path)."""
    _check.path("path", path)
    try:
        a = open_archive(path)
    except ArchiveError as e:
        return [str(e)]
    except OSError as e:  # no directory there, or one that cannot be read
        return [str(e) if isinstance(e, FileNotFoundError) else
                f"archive {os.path.abspath(path)}: {e.strerror or e}"]
    return a.verify()


# ---- inspect ---------------------------------------------------------------------------------

def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """A summary for humans and tools: manifest facts, and per rank its spans (intervals and
    bytes from the span headers), graphs, modules and state."""
    a = open_archive(path)
    ranks: dict[int, Any] = {}
    for r in a.ranks:
        prefix = f"rank{r}/"
        mine = {rel: e for rel, e in a.files.items() if rel.startswith(prefix)}
        spans = {}
        for name, rel in a.spans(r).items():
            entry: dict[str, Any] = {"file": rel, "file_bytes": a.files[rel]["bytes"]}
            try:
                info = a._span_file_info(rel)
                entry.update(start=info["start"], end=info["end"], bytes=info["data_bytes"],
                             intervals=len(info["intervals"]))
            except ArchiveError as e:
                entry["error"] = str(e)
            spans[name] = entry

        def group(sub: str) -> dict[str, int]:
            sel = [e for rel, e in mine.items() if rel.startswith(prefix + sub + "/")]
            return {"files": len(sel), "bytes": sum(e["bytes"] for e in sel)}

        ranks[r] = {"spans": spans, "graphs": group("graphs"), "modules": group("modules"),
                    "state": f"{prefix}state.json" in a.files,
                    "bytes": sum(e["bytes"] for e in mine.values())}
        if f"{prefix}graphs/index.json" in a.files:
            ranks[r]["relocation"] = _relocation_counts(a, r)
    return {"path": a.path, "format": a.manifest["format"], "version": a.manifest["version"],
            "created": a.manifest["created"], "vitrify_version": a.manifest["vitrify_version"],
            "fingerprint": a.fingerprint.to_dict(), "region": a.region.to_dict(),
            "files": len(a.files), "bytes": sum(e["bytes"] for e in a.files.values()),
            "ranks": ranks}


def _relocation_counts(a: Archive, rank: int) -> dict[str, Any]:
    """Relocatability of one rank's graphs, from its graph index (read as THAW reads it): how
    many graphs, how many FREEZE marked non-relocatable, and their unclassified words."""
    from . import graph as _graph

    try:
        graphs = _graph.archive_index(a, rank)["graphs"]
    except ArchiveError as e:
        return {"error": str(e)}
    fixed = [g for g in graphs if not g["relocatable"]]
    return {"graphs": len(graphs), "relocatable": len(graphs) - len(fixed),
            "non_relocatable": [g["name"] for g in fixed],
            "unclassified_words": sum(g["unclassified"]["count"] for g in fixed)}


def _size(n: int) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def render_inspect(info: Mapping[str, Any]) -> str:
    """The human table printed by ``vitrify inspect``."""
    lines = [f"archive   {info['path']}",
             f"format    {info['format']} v{info['version']}, created {info['created']}, "
             f"vitrify {info['vitrify_version']}",
             f"size      {_size(info['bytes'])} in {info['files']} files", "", "fingerprint"]
    for k, v in info["fingerprint"].items():
        lines.append(f"  {k:<15} {v if v is not None else '-'}")
    reg = info["region"]
    lines += ["", f"region    base {reg['base']:#x}, size {_size(reg['size'])}, "
                  f"granularity {_size(reg['granularity'])}"]
    for k, v in sorted(reg["checkpoints"].items(), key=lambda kv: (kv[1], kv[0])):
        lines.append(f"  checkpoint {k:<20} {v:#x} ({_size(v)})")
    lines += ["", f"{'rank':<5} {'span':<10} {'range':<31} {'intervals':>9} {'bytes':>12}"]
    for r, d in info["ranks"].items():
        if not d["spans"]:
            lines.append(f"{r:<5} {'(none)':<10}")
        for name, s in d["spans"].items():
            if "error" in s:
                lines.append(f"{r:<5} {name:<10} ERROR {s['error']}")
            else:
                rng = f"[{s['start']:#x}, {s['end']:#x})"
                lines.append(f"{r:<5} {name:<10} {rng:<31} {s['intervals']:>9} "
                             f"{_size(s['bytes']):>12}")
    lines += ["", f"{'rank':<5} {'graphs':>14} {'modules':>14} {'state':>6} {'total':>12}"]
    for r, d in info["ranks"].items():
        g, m = d["graphs"], d["modules"]
        lines.append(f"{r:<5} {g['files']:>4} {_size(g['bytes']):>9} {m['files']:>4} "
                     f"{_size(m['bytes']):>9} {'yes' if d['state'] else 'no':>6} "
                     f"{_size(d['bytes']):>12}")
    for r, d in info["ranks"].items():
        rel = d.get("relocation")
        if rel is None:
            continue
        if "error" in rel:
            lines.append(f"rank {r} relocation: ERROR {rel['error']}")
            continue
        line = (f"rank {r} relocation: {rel['relocatable']} of {rel['graphs']} graphs "
                f"relocatable")
        if rel["non_relocatable"]:
            names = ", ".join(rel["non_relocatable"][:5])
            more = "" if len(rel["non_relocatable"]) <= 5 else ", ..."
            line += (f"; {len(rel['non_relocatable'])} only at the frozen base ({names}{more}: "
                     f"{rel['unclassified_words']} unclassified word(s); "
                     f"see vitrify inspect --relocations)")
        lines.append(line)
    return "\n".join(lines)


def iter_stale_temporaries(parent: str | os.PathLike) -> Iterator[str]:
    """Temporary directories left in ``parent`` by writers that died before committing
    (``.<name>.tmp-<pid>-<token>``); never archives. Safe to delete once no writer runs."""
    for n in sorted(os.listdir(parent)):
        if n.startswith(".") and ".tmp-" in n and os.path.isdir(os.path.join(parent, n)):
            yield os.path.join(os.fspath(parent), n)


__all__ = [
    "Archive", "ArchiveCorrupt", "ArchiveError", "ArchiveMismatch", "ArchiveWriter", "RankWriter",
    "FINGERPRINT_FIELDS", "FORMAT", "Fingerprint", "MANIFEST", "Region", "UnsafePath", "VERSION",
    "check_relpath", "file_checksum", "inspect", "iter_stale_temporaries", "open_archive",
    "open_or_cold", "render_inspect", "verify", "write_shared",
]
