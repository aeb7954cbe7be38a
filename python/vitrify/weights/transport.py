"""A weight update between two processes: a trainer (:class:`Sender`) streams tensors into an
engine (:class:`Receiver`) through one shared staging buffer, over a Unix socket.

Protocol (length-prefixed JSON frames; the staging buffer's file descriptor rides on the first
frame with ``SCM_RIGHTS``, exported **once**):

1. sender -> ``hello``: the manifest (name, shape, dtype, digest of every source tensor), the
   staging buffer (kind, bytes, slots) and its descriptor.
2. receiver: checks the peer's credentials (``SO_PEERCRED``: same user unless allowed), plans the
   mapping against the engine's tensors (a misfit is an ``error`` frame naming the tensor, sent
   before any byte moves), maps the buffer, answers ``ready`` with the names it needs: those
   whose digest differs from the last update it completed (a delta update), or all.
3. sender -> ``chunk`` (index, slot, entries, checksum) for each chunk of the needed tensors;
   the staging buffer holds ``slots`` chunks, so the sender fills one slot while the receiver
   applies another; receiver -> ``done`` per chunk after its copies finished.
4. sender -> ``finish``; the receiver releases the buffer's mapping and closes its descriptor,
   then answers ``finished`` (bytes moved, bytes of the whole model, seconds).

While an update runs, and after one that failed, the receiver's :attr:`Receiver.state` is
``"updating"`` / ``"incomplete"``: the engine must refuse to serve (its weights may be half
old, half new) until an update completes (``"ready"``). A retry sends everything whose digest is
not the last completed one, so it completes what failed.

Staging buffers: :class:`HostStaging` (a memfd, for CPU engines and tests) and, on a GPU,
:class:`CudaStaging` (VMM memory exported as a POSIX file descriptor; legacy CUDA IPC cannot
export VMM memory). Both are ``uint8`` torch tensors over the shared bytes on either side.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Mapping as MappingABC
from typing import Any

from .. import _check
from . import stream
from .mapping import Mapping, MappingError, first_misfit

log = logging.getLogger("vitrify.weights")

PROTOCOL = 1
_LEN = struct.Struct("<I")
_MAX_FRAME = 64 << 20


class UpdateError(RuntimeError):
    """The update could not be done; the message says what and, from the engine, why."""


# ---- framing ------------------------------------------------------------------------------------


def _send(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    body = json.dumps(msg, separators=(",", ":")).encode()
    data = _LEN.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data, got, _flags, _addr = socket.recv_fds(sock, n - len(buf), 4)
        fds.extend(got)
        if not data:
            raise UpdateError(f"the peer closed the connection ({len(buf)} of {n} bytes read)")
        buf += data
    return bytes(buf)


def _recv(sock: socket.socket) -> tuple[dict, list[int]]:
    """One frame and the descriptors that came with it (closed here if the frame is bad)."""
    fds: list[int] = []
    try:
        (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, fds))
        if n > _MAX_FRAME:
            raise UpdateError(f"a frame of {n} bytes is larger than {_MAX_FRAME}")
        try:
            msg = json.loads(_recv_exact(sock, n, fds))
        except ValueError as e:
            raise UpdateError(f"a frame that is not JSON: {e}") from None
        if not isinstance(msg, dict) or "type" not in msg:
            raise UpdateError(f"not a protocol frame: {str(msg)[:200]}")
    except BaseException:
        _close_all(fds)
        raise
    return msg, fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _expect(sock: socket.socket, kind: str) -> tuple[dict, list[int]]:
    msg, fds = _recv(sock)
    if msg["type"] == "error":
        _close_all(fds)
        raise UpdateError(f"the engine refused the update: {msg.get('message')}")
    if msg["type"] != kind:
        _close_all(fds)
        raise UpdateError(f"expected a {kind!r} frame, got {msg['type']!r}")
    return msg, fds


# ---- staging buffers ----------------------------------------------------------------------------


class HostStaging:
    """Shared host memory (a memfd) as a ``uint8`` torch tensor; the descriptor is what crosses
    the socket. ``open`` maps a received descriptor (and closes it on :meth:`close`)."""

    kind = "host"

    def __init__(self, nbytes: int, *, fd: int | None = None):
        import torch

        self.nbytes = _check.integer("nbytes", nbytes, 1, _check.U64_MAX)
        if fd is None:
            fd = os.memfd_create("vitrify-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, self.nbytes)
            # Its size is fixed for good: a peer cannot shrink it under a mapping (SIGBUS).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                        | fcntl.F_SEAL_SEAL)
        else:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK:
                raise UpdateError("the staging descriptor is not sealed against shrinking")
            if os.fstat(fd).st_size < self.nbytes:
                raise UpdateError(f"the staging descriptor holds {os.fstat(fd).st_size} bytes, "
                                  f"{self.nbytes} expected")
        self.fd = fd
        self.tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=self.nbytes,
                                      dtype=torch.uint8)

    @classmethod
    def open(cls, fd: int, meta: dict, device: int | None = None) -> HostStaging:
        """Map a received descriptor (owned from now on: closed on failure too)."""
        try:
            return cls(int(meta["bytes"]), fd=fd)
        except BaseException:
            os.close(fd)
            raise

    def meta(self) -> dict:
        return {"kind": self.kind, "bytes": self.nbytes}

    def close(self) -> None:
        self.tensor = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class CudaStaging:
    """VMM device memory created exportable (``vitrify._native.SharedBuffer``), as a ``uint8``
    torch tensor on that device; exported once as a POSIX file descriptor."""

    kind = "cuda"

    def __init__(self, nbytes: int, device: int = 0, *, _buffer: Any = None):
        from .. import _native

        self.device = device
        self.buffer = _buffer if _buffer is not None else _native.SharedBuffer(nbytes, device)
        self.nbytes = int(nbytes)
        self.tensor = _device_tensor(self.buffer.ptr, self.nbytes, device)
        self.fd: int | None = None

    def export(self) -> int:
        if self.fd is None:
            self.fd = self.buffer.export_fd()
        return self.fd

    @classmethod
    def open(cls, fd: int, meta: dict, device: int | None = None) -> CudaStaging:
        """Map a received descriptor on ``device`` (this process's numbering: the engine's
        device, not the sender's number); the descriptor is closed either way."""
        from .. import _native

        dev = int(meta["device"]) if device is None else device
        try:
            buf = _native.SharedBuffer.import_fd(fd, int(meta["allocated"]), dev)
        finally:
            os.close(fd)
        if not 0 < int(meta["bytes"]) <= buf.size:
            buf.release()
            raise UpdateError(f"the sender claims {meta['bytes']} staging bytes of a "
                              f"{buf.size}-byte buffer")
        return cls(int(meta["bytes"]), dev, _buffer=buf)

    def meta(self) -> dict:
        return {"kind": self.kind, "bytes": self.nbytes, "allocated": int(self.buffer.size),
                "device": self.device}

    def close(self) -> None:
        self.tensor = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.buffer is not None:
            buf, self.buffer = self.buffer, None
            rc = buf.release()
            if rc:
                raise UpdateError(f"releasing the staging buffer's mapping failed: CUresult {rc}")


def _device_tensor(ptr: int, nbytes: int, device: int) -> Any:
    """A ``uint8`` torch tensor over ``nbytes`` of device memory at ``ptr`` (not owned)."""
    import torch

    class _Iface:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                    "version": 3}

    with torch.cuda.device(device):
        return torch.as_tensor(_Iface(), device=f"cuda:{device}")


def _staging_fd(staging: Any) -> int:
    return staging.export() if hasattr(staging, "export") else staging.fd


# ---- digests ------------------------------------------------------------------------------------


def digest(t: Any, key: tuple[int, int]) -> str:
    """A content digest of a tensor: its dtype, shape and :func:`stream.keyed_sums` of its bytes
    under ``key`` (a sender's secret: the same key gives the same digest for the same bytes, and
    a change the position-weighted checksum would not see is caught with probability about
    1 - 2**-46). Computed on the tensor's device."""
    import torch

    flat = t.detach().contiguous().view(-1)
    if (flat.storage_offset() * flat.element_size()) % 4:  # 32-bit words need aligned bytes
        flat = flat.clone()
    sums = stream.keyed_sums(flat.view(torch.uint8), key)
    return f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}:{sums:x}"


def _specs(tensors: MappingABC[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()}


# ---- receiver -----------------------------------------------------------------------------------


class Receiver:
    """The engine's side: ``engine`` maps names to its tensors (updated in place), ``mapping``
    the trainer's layout onto them. ``allowed_uids``: the users whose processes may send
    (SO_PEERCRED; default: this process's user only). ``synchronize``: called after each
    chunk's copies (torch.cuda.synchronize on a GPU engine) before ``done`` lets the sender reuse
    the slot, and before the staging buffer is released. ``device``: where a GPU staging buffer
    is mapped (default: the engine's tensors' device)."""

    def __init__(self, engine: MappingABC[str, Any], mapping: Mapping, *,
                 allowed_uids: tuple[int, ...] | None = None,
                 synchronize: Callable[[], None] | None = None, device: int | None = None):
        self.engine = engine
        self.mapping = mapping
        self.allowed_uids = {os.getuid()} if allowed_uids is None else set(allowed_uids)
        self.synchronize = synchronize or (lambda: None)
        if device is None:
            first = next(iter(engine.values()), None)
            device = getattr(getattr(first, "device", None), "index", None)
        self.device = device
        self.state = "ready"
        self.applied: dict[str, str] = {}  # source name -> digest of the last completed update
        self.last: dict = {}

    def serve_one(self, conn: socket.socket) -> dict:
        """Run one update on an accepted connection; returns its summary. On any failure after
        the engine said ``ready`` the state is ``"incomplete"``; the peer gets an ``error`` frame
        when it can, the staging mapping is released (after the queued copies), every received
        descriptor is closed, and the error propagates."""
        staging = None
        fds: list[int] = []
        try:
            hello, fds = _expect(conn, "hello")
            uid = _peer_uid(conn)
            if uid not in self.allowed_uids:
                raise UpdateError(f"a process of user {uid} may not update this engine "
                                  f"(allowed: {sorted(self.allowed_uids)})")
            if hello.get("protocol") != PROTOCOL:
                raise UpdateError(f"protocol {hello.get('protocol')!r}, this engine speaks "
                                  f"{PROTOCOL}")
            manifest = {m["name"]: (tuple(int(d) for d in m["shape"]), str(m["dtype"]))
                        for m in hello["manifest"]}
            digests = {m["name"]: str(m["digest"]) for m in hello["manifest"]}
            plan = self.mapping.plan(manifest, _specs(self.engine))  # names the misfit
            if len(fds) != 1:
                raise UpdateError(f"the hello frame carried {len(fds)} descriptors, not 1")
            meta = hello["staging"]
            opener = {"host": HostStaging, "cuda": CudaStaging}.get(meta.get("kind"))
            if opener is None:
                raise UpdateError(f"unknown staging buffer kind {meta.get('kind')!r}")
            staging = opener.open(fds.pop(), meta, self.device)  # owns the descriptor now
            slot_bytes, slots = int(hello["slot_bytes"]), int(hello["slots"])
            if slot_bytes < 1 or slots < 1 or slot_bytes * slots > staging.nbytes:
                raise UpdateError(f"{slots} slots of {slot_bytes} bytes do not fit the "
                                  f"{staging.nbytes}-byte staging buffer")
            need = [n for n in manifest if self.applied.get(n) != digests[n]]
            self.state = "updating"
            for n in need:
                self.applied.pop(n, None)
            _send(conn, {"type": "ready", "need": need})
            t0 = time.perf_counter()
            moved = copies = chunks = 0
            got: dict[str, list[tuple[int, int]]] = {n: [] for n in need}
            while True:
                msg, extra = _recv(conn)
                _close_all(extra)
                if msg["type"] == "finish":
                    break
                if msg["type"] != "chunk":
                    raise UpdateError(f"expected a chunk or finish frame, got {msg['type']!r}")
                ch = stream.Chunk(int(msg["index"]),
                                  tuple(stream.Entry(e[0], e[1], tuple(e[2]), *e[3:])
                                        for e in msg["entries"]), int(msg["nbytes"]))
                stream.check_chunk(ch, {n: manifest[n] for n in need}, slot_bytes)
                slot = int(msg["slot"])
                if not 0 <= slot < slots:
                    raise UpdateError(f"chunk {ch.index} names slot {slot} of {slots}")
                for e in ch.entries:
                    got[e.name].append((e.row0, e.row1))
                view = staging.tensor[slot * slot_bytes:(slot + 1) * slot_bytes]
                copies += stream.apply(ch, plan, view, self.engine, int(msg["checksum"]))
                self.synchronize()
                moved += sum(e.nbytes for e in ch.entries)
                chunks += 1
                _send(conn, {"type": "done", "index": ch.index})
            _check_complete(got, manifest)  # every row of every needed tensor, exactly once
            st, staging = staging, None
            st.close()  # released before "finished" is signalled
            for n in need:
                self.applied[n] = digests[n]
            total = sum(stream._itemsize(d) * math.prod(sh) for sh, d in manifest.values())
            self.last = {"bytes_moved": moved, "bytes_total": total, "chunks": chunks,
                         "copies": copies, "tensors": len(need), "tensors_total": len(manifest),
                         "seconds": time.perf_counter() - t0}
            self.state = "ready"
            _send(conn, {"type": "finished", **self.last})
            return self.last
        except BaseException as e:
            if self.state == "updating":
                self.state = "incomplete"
            try:
                _send(conn, {"type": "error", "message": f"{type(e).__name__}: {e}"})
            except OSError:
                pass
            raise
        finally:
            _close_all(fds)
            if staging is not None:
                try:
                    self.synchronize()  # no queued copy may read the buffer after it is unmapped
                except Exception as e:  # the first error is the one that propagates
                    log.debug("synchronize before releasing the staging buffer: %s", e)
                staging.close()


def _check_complete(got: dict[str, list[tuple[int, int]]],
                    manifest: MappingABC[str, tuple[tuple[int, ...], str]]) -> None:
    """Every needed tensor's rows arrived, each exactly once; else :class:`UpdateError`."""
    for name, spans in got.items():
        bad = first_misfit(spans, manifest[name][0][0] if manifest[name][0] else 1)
        if bad is not None:
            kind, lo, hi = bad
            how = "arrived twice" if kind == "overlap" else "never arrived"
            raise UpdateError(f"rows {lo}..{hi} of {name!r} {how}: the update is not complete")


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _connect(sock: socket.socket, path: str, patience: float) -> None:
    deadline = time.monotonic() + patience
    while True:
        try:
            sock.connect(path)
            return
        except (FileNotFoundError, ConnectionRefusedError) as e:
            if time.monotonic() >= deadline:
                raise UpdateError(f"no engine listening at {path}: {e.strerror}") from None
            time.sleep(0.05)


def listen(path: str) -> socket.socket:
    """A Unix socket listening at ``path`` (created ``0600``; an existing socket file there is
    replaced)."""
    _check.path("path", path)
    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    s.listen(1)
    return s


# ---- sender -------------------------------------------------------------------------------------


class Sender:
    """The trainer's side: one staging buffer of ``chunk_bytes`` (split into ``slots``), created
    once and exported once per connection; :meth:`update` streams ``tensors`` (name -> tensor in
    the trainer's layout) to the engine listening at ``path``."""

    def __init__(self, chunk_bytes: int, *, slots: int = 2, device: int | None = None):
        _check.integer("chunk_bytes", chunk_bytes, 1, _check.U64_MAX)
        self.slots = _check.integer("slots", slots, 1, 64)
        self.slot_bytes = chunk_bytes // slots // 256 * 256
        if self.slot_bytes == 0:
            raise MappingError(f"chunk_bytes={chunk_bytes} leaves no room for {slots} slots")
        self.chunk_bytes = chunk_bytes
        # The digests' key: the same for every update of this sender (so unchanged tensors
        # are recognised), unknown to anyone else.
        self.key = (secrets.randbelow((1 << 31) - 1) + 1, secrets.randbelow((1 << 31) - 1) + 1)
        self.staging = (HostStaging(chunk_bytes) if device is None
                        else CudaStaging(chunk_bytes, device))

    def update(self, path: str, tensors: MappingABC[str, Any], *, timeout: float = 600.0,
               connect_timeout: float = 0.0,
               synchronize: Callable[[], None] | None = None) -> dict:
        """Stream the tensors the engine needs (all, or those changed since its last completed
        update); returns the engine's ``finished`` summary. Raises :class:`UpdateError` with the
        engine's reason when it refuses or fails. ``connect_timeout``: keep trying to connect
        that long while nothing listens at ``path`` yet (an engine still thawing)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            _connect(sock, path, connect_timeout)
            return self.update_over(sock, tensors, synchronize=synchronize,
                                    where=f"the engine at {path}")

    def update_over(self, sock: socket.socket, tensors: MappingABC[str, Any], *,
                    synchronize: Callable[[], None] | None = None,
                    where: str = "the engine") -> dict:
        """:meth:`update` over a connected socket (the engine's next frame is ``hello``)."""
        manifest = [{"name": n, "shape": list(t.shape),
                     "dtype": str(t.dtype).removeprefix("torch."), "digest": digest(t, self.key)}
                    for n, t in tensors.items()]
        try:
            return self._stream(sock, tensors, manifest, synchronize or (lambda: None))
        except OSError as e:  # the engine hung up: its error frame says why, if it sent one
            try:
                sock.settimeout(5.0)
                _expect(sock, "error")
            except UpdateError as refused:
                raise refused from e
            except OSError:
                pass
            raise UpdateError(f"the connection to {where} broke: {e}") from e

    def _stream(self, sock: socket.socket, tensors: MappingABC[str, Any], manifest: list,
                sync: Callable[[], None]) -> dict:
        _send(sock, {"type": "hello", "protocol": PROTOCOL, "manifest": manifest,
                     "staging": self.staging.meta(), "slot_bytes": self.slot_bytes,
                     "slots": self.slots}, [_staging_fd(self.staging)])
        ready, _ = _expect(sock, "ready")
        unknown = [n for n in ready["need"] if n not in tensors]
        if unknown:
            raise UpdateError(f"the engine asks for tensors this update does not have: "
                              f"{unknown[:4]}")
        need = {n: tensors[n] for n in ready["need"]}
        chunks = stream.plan_chunks(_specs(need), self.slot_bytes)
        in_flight: list[int] = []

        def wait_oldest() -> None:
            done, _ = _expect(sock, "done")
            if int(done["index"]) != in_flight[0]:
                raise UpdateError(f"the engine finished chunk {done['index']}, expected "
                                  f"{in_flight[0]}")
            in_flight.pop(0)

        for ch in chunks:
            slot = ch.index % self.slots
            if len(in_flight) == self.slots:  # the oldest chunk's slot is this one
                wait_oldest()
            view = self.staging.tensor[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]
            check = stream.fill(ch, need, view)
            sync()
            _send(sock, {"type": "chunk", "index": ch.index, "slot": slot, "nbytes": ch.nbytes,
                         "checksum": check,
                         "entries": [[e.name, e.dtype, list(e.shape), e.row0, e.row1, e.offset,
                                      e.nbytes] for e in ch.entries]})
            in_flight.append(ch.index)
        while in_flight:
            wait_oldest()
        _send(sock, {"type": "finish"})
        fin, _ = _expect(sock, "finished")
        return fin

    def close(self) -> None:
        self.staging.close()
