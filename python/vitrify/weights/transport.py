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

Direct updates (``Sender(direct=True)``; :mod:`vitrify.weights.direct`): the hello carries no
buffer; the engine answers ``ready`` with its planned moves, where each destination tensor lies
in the memory it exports (the descriptors ride on ``ready``), the trainer maps that memory,
writes every piece in place, checksums what it wrote, releases its mapping and sends ``finish``
with the checksums; the engine checksums the same pieces in its own tensors and answers
``finished`` only when every one agrees.

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
from . import direct, stream
from .mapping import Copy, Mapping, MappingError, Plan, first_misfit

log = logging.getLogger("vitrify.weights")

PROTOCOL = 1
_LEN = struct.Struct("<I")
_MAX_FRAME = 64 << 20
# Descriptors one frame may carry (the kernel's SCM_MAX_FD is 253).
_MAX_FDS = 250


class UpdateError(RuntimeError):
    """The update could not be done; the message says what and, from the engine, why."""


# ---- framing ------------------------------------------------------------------------------------


def _encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def _send(sock: socket.socket, msg: dict | bytes, fds: list[int] | None = None) -> None:
    """One frame: ``msg`` as JSON, or already encoded (:func:`_encode`)."""
    body = msg if isinstance(msg, bytes) else _encode(msg)
    data = _LEN.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data, got, flags, _addr = socket.recv_fds(sock, n - len(buf), _MAX_FDS)
        fds.extend(got)
        if flags & socket.MSG_CTRUNC:  # descriptors beyond room were dropped by the kernel
            raise UpdateError(f"a frame carried more than {_MAX_FDS} descriptors")
        if not data:
            raise UpdateError(f"the peer closed the connection ({len(buf)} of {n} bytes read)")
        buf += data
    return bytes(buf)


def _recv(sock: socket.socket, known: tuple[bytes, dict] | None = None,
          keep_raw: bool = False) -> tuple[dict, list[int]]:
    """One frame and the descriptors that came with it (closed here if the frame is bad).
    ``known``: a frame received before and its decoding, returned as it is when this frame's
    bytes are the same (a trainer's next step gets the engine's same large ``ready``);
    ``keep_raw``: a newly decoded frame carries its bytes under ``_raw`` (for the next
    ``known``)."""
    fds: list[int] = []
    try:
        (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, fds))
        if n > _MAX_FRAME:
            raise UpdateError(f"a frame of {n} bytes is larger than {_MAX_FRAME}")
        body = _recv_exact(sock, n, fds)
        if known is not None and body and known[0] == body:
            return known[1], fds
        try:
            msg = json.loads(body)
        except ValueError as e:
            raise UpdateError(f"a frame that is not JSON: {e}") from None
        if not isinstance(msg, dict) or "type" not in msg:
            raise UpdateError(f"not a protocol frame: {str(msg)[:200]}")
        if keep_raw:
            msg["_raw"] = body  # for the caller's next known frame; not part of the protocol
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


def _expect(sock: socket.socket, kind: str, known: tuple[bytes, dict] | None = None,
            keep_raw: bool = False) -> tuple[dict, list[int]]:
    msg, fds = _recv(sock, known, keep_raw)
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
        fd, self.fd = self.fd, None
        buf, self.buffer = self.buffer, None
        _release(fd, buf, "the staging buffer's mapping")


def _release(fd: int | None, buffer: Any, what: str) -> None:
    """Close a descriptor and release a SharedBuffer's mapping (either may be None)."""
    if fd is not None:
        os.close(fd)
    if buffer is not None:
        rc = buffer.release()
        if rc:
            raise UpdateError(f"releasing {what} failed: CUresult {rc}")


def _device_tensor(ptr: int, nbytes: int, device: int) -> Any:
    """A ``uint8`` torch tensor over ``nbytes`` of device memory at ``ptr`` (not owned)."""
    from ..integrations import torch as vt

    return vt.tensor_at(ptr, nbytes, device)


def _staging_fd(staging: Any) -> int:
    return staging.export() if hasattr(staging, "export") else staging.fd


# ---- the engine's memory, exported (direct updates) ---------------------------------------------


class HostWeights:
    """A CPU engine's tensors in one shared memfd, so a direct update can map them: ``tensors``
    (name -> tensor over the memfd, each 256-byte aligned) initialised from ``like`` (name ->
    tensor), and :meth:`export` for :class:`Receiver`'s ``exporter``."""

    def __init__(self, like: MappingABC[str, Any]):
        import torch

        offsets, at = {}, 0
        for n, t in like.items():
            offsets[n] = at
            at += -(-t.numel() * t.element_size() // 256) * 256
        self.nbytes = max(at, 256)
        self.fd = os.memfd_create("vitrify-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.nbytes)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.buffer = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=self.nbytes,
                                      dtype=torch.uint8)
        self.tensors = {}
        for n, t in like.items():
            nb = t.numel() * t.element_size()
            v = self.buffer[offsets[n]:offsets[n] + nb].view(t.dtype).view(t.shape)
            v.copy_(t)
            self.tensors[n] = v

    def export(self, lo: int, hi: int) -> dict:
        base = self.buffer.data_ptr()
        if not base <= lo <= hi <= base + self.nbytes:
            raise UpdateError(f"0x{lo:x}..0x{hi:x} is not in the engine's shared weights")
        return {"kind": "host", "base": base, "pieces": [(self.nbytes, os.dup(self.fd))]}

    def close(self) -> None:
        self.tensors, self.buffer = {}, None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def region_exporter(region: Any) -> Callable[[int, int], dict]:
    """:class:`Receiver`'s ``exporter`` for tensors in a :class:`vitrify.Region` created with
    ``exportable=True``: the region's chunks covering the addresses, as file descriptors."""
    def export(lo: int, hi: int) -> dict:
        if not getattr(region, "exportable", False):
            raise UpdateError("the engine's region was not created exportable: thaw it with "
                              "exportable weights to take direct updates")
        chunks = region.export(lo - region.base, max(1, hi - lo))
        return {"kind": "cuda", "device": region.device, "base": region.base + chunks[0][0],
                "pieces": [(size, fd) for _, size, fd in chunks]}
    return export


class _Imported:
    """The trainer's mapping of the engine's exported memory: ``tensor(offset, shape, dtype)``
    views into it; :meth:`close` releases it (and every descriptor)."""

    def __init__(self, meta: dict, fds: list[int], device: int | None):
        """Map the engine's pieces; ``fds`` are closed here on every path (the mapping holds
        its own references)."""
        import torch

        self.buffer, self.fd, self.base, self.device = None, None, None, device
        try:
            sizes = [int(n) for n in meta["sizes"]]
            self.kind = str(meta["kind"])
            if len(sizes) != len(fds) or not fds or min(sizes) < 1:
                raise UpdateError(f"the engine sent {len(fds)} descriptors for {len(sizes)} "
                                  f"pieces")
            self.nbytes = sum(sizes)
            if self.kind == "host":
                if len(fds) != 1:
                    raise UpdateError("host memory comes as one descriptor")
                self.fd = fds.pop()
                # the engine cannot shrink it under this mapping (SIGBUS): sealed, large enough
                if not fcntl.fcntl(self.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                    raise UpdateError("the engine's memory is not sealed against shrinking")
                if os.fstat(self.fd).st_size < self.nbytes:
                    raise UpdateError(f"the engine's memory holds {os.fstat(self.fd).st_size} "
                                      f"bytes, {self.nbytes} claimed")
                self.base = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True,
                                            size=self.nbytes, dtype=torch.uint8)
            elif self.kind == "cuda":
                from .. import _native

                dev = 0 if device is None else device
                self.buffer = _native.SharedBuffer.import_fds(list(zip(fds, sizes)), dev)
                self.base = _device_tensor(self.buffer.ptr, self.nbytes, dev)
                self.device = dev
            else:
                raise UpdateError(f"unknown exported memory kind {self.kind!r}")
        except (KeyError, TypeError, ValueError) as e:
            self._abandon(fds)
            raise UpdateError(f"a malformed description of the engine's memory: {e!r}") from None
        except BaseException:
            self._abandon(fds)
            raise
        finally:
            _close_all(fds)

    def _abandon(self, fds: list[int]) -> None:
        _close_all(fds)
        try:
            self.close()
        except UpdateError as e:  # the first error is the one that propagates
            log.debug("releasing a partial import: %s", e)

    @property
    def address(self) -> int:
        """Where the engine's memory is mapped in this process."""
        return int(self.base.data_ptr())

    def synchronize(self) -> None:
        """Wait for the work queued on the mapped memory's device (before it is unmapped)."""
        if self.buffer is not None:
            import torch

            torch.cuda.synchronize(self.device)

    def tensor(self, offset: int, shape: list[int], dtype: str) -> Any:
        import torch

        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype):
            raise UpdateError(f"the engine names an unknown dtype {dtype!r}")
        if any(d < 0 for d in shape):
            raise UpdateError(f"the engine names a tensor of shape {shape}")
        n = math.prod(shape) * dt.itemsize
        if not 0 <= offset <= self.nbytes - n:
            raise UpdateError(f"a tensor of {n} bytes at offset {offset} is outside the "
                              f"{self.nbytes} exported bytes")
        return self.base[offset:offset + n].view(dt).view(shape)

    def close(self) -> None:
        self.base = None
        fd, self.fd = self.fd, None
        buf, self.buffer = self.buffer, None
        _release(fd, buf, "the mapping of the engine's weights")


class _Targets(MappingABC):
    """The engine's tensors as mapped in this process (``meta``: name -> [offset, shape,
    dtype]), each view made at its first use: a reused :class:`~vitrify.weights.direct.Writer`
    touches only the few that torch copies or sums."""

    def __init__(self, mem: _Imported, meta: dict):
        self._mem, self._meta, self._views = mem, meta, {}

    def __getitem__(self, name: str) -> Any:
        v = self._views.get(name)
        if v is None:
            off, shape, dtype = self._meta[name]
            v = self._views[name] = self._mem.tensor(int(off), [int(d) for d in shape],
                                                     str(dtype))
        return v

    def __iter__(self):
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)


def _copy_json(c: Copy) -> list:
    return [c.src, c.dst, c.src_dim, list(c.src_rows), c.dst_dim, list(c.dst_rows)]


def _copy_of(v: list) -> Copy:
    return Copy(str(v[0]), str(v[1]), int(v[2]), tuple(int(x) for x in v[3]), int(v[4]),
                tuple(int(x) for x in v[5]))


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
    is mapped (default: the engine's tensors' device). ``exporter``: lets a trainer write the
    engine's tensors directly (a direct update, :mod:`vitrify.weights.direct`)."""

    def __init__(self, engine: MappingABC[str, Any], mapping: Mapping, *,
                 allowed_uids: tuple[int, ...] | None = None,
                 synchronize: Callable[[], None] | None = None, device: int | None = None,
                 exporter: Callable[[int, int], dict] | None = None):
        self.engine = engine
        self.mapping = mapping
        # Direct updates: exporter(lo, hi) gives the memory holding the engine's tensors in
        # [lo, hi) as descriptors (region_exporter, HostWeights.export); None: staged only.
        self.exporter = exporter
        self.allowed_uids = {os.getuid()} if allowed_uids is None else set(allowed_uids)
        self.synchronize = synchronize or (lambda: None)
        if device is None:
            first = next(iter(engine.values()), None)
            device = getattr(getattr(first, "device", None), "index", None)
        self.device = device
        self.state = "ready"
        self.applied: dict[str, str] = {}  # source name -> digest of the last completed update
        self._last_plan: tuple[tuple, Plan] | None = None
        # the last direct update's pieces and verifier, for the next one with the same plan,
        # needed sources and destination addresses (every step of a trainer's, normally)
        self._last_direct: tuple[tuple, _DirectWork] | None = None
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
            plan = self._plan(manifest)  # names the misfit
            if hello.get("direct"):
                return self._serve_direct(conn, plan, manifest, digests, fds)
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


    def _plan(self, manifest: dict[str, tuple[tuple[int, ...], str]]) -> Plan:
        """The mapping planned for this manifest against the engine's tensors; the last plan is
        kept, since a trainer sends the same manifest every step (planning 200+ tensors costs
        milliseconds of every update)."""
        engine = _specs(self.engine)
        key = (tuple(manifest.items()), tuple(engine.items()))
        if self._last_plan is None or self._last_plan[0] != key:
            self._last_plan = (key, self.mapping.plan(manifest, engine))
        return self._last_plan[1]

    def _direct_work(self, plan: Plan, need: list[str]) -> _DirectWork:
        """The pieces of a direct update of ``need`` and their verifier: the last update's when
        the plan, the needed sources and the destinations' addresses are the same (the sorting
        and the device tables cost more than the checksums' kernel), else new ones."""
        last = self._last_direct
        if last is not None and last[0][0] is plan and last[0][1] == tuple(need):
            work = last[1]
            if work.addresses == _where(self.engine, work.dsts):
                return work
        work = _DirectWork(plan, need, self.engine)
        self._last_direct = ((plan, tuple(need)), work)
        return work

    def _serve_direct(self, conn: socket.socket, plan: Plan,
                      manifest: dict[str, tuple[tuple[int, ...], str]], digests: dict[str, str],
                      fds: list[int]) -> dict:
        """serve_one's direct update (its caller handles failures): export the memory of the
        destinations, send the moves, take the trainer's checksums and compare them with the
        engine's own of the same pieces."""
        if fds:
            raise UpdateError(f"a direct update's hello carried {len(fds)} descriptors")
        if self.exporter is None:
            raise UpdateError("this engine takes staged updates only (it exports no memory "
                              "for a direct update)")
        need = [n for n in manifest if self.applied.get(n) != digests[n]]
        work = self._direct_work(plan, need)
        sub, ps, ends = work.sub, work.pieces, work.ends
        t_export = time.perf_counter()
        # the engine's own queued work (a replay reading the weights) finishes before another
        # process may write them
        self.synchronize()
        exp = self.exporter(min(a for a, _ in ends), max(b for _, b in ends)) if ps else \
            {"kind": "none", "base": 0, "pieces": []}
        t_export = time.perf_counter() - t_export
        out_fds = [fd for _, fd in exp["pieces"]]
        try:
            frame = work.ready_frame(need, exp)  # names a destination outside the export
            if len(out_fds) > _MAX_FDS:
                raise UpdateError(f"the engine's weights span {len(out_fds)} exported pieces, "
                                  f"more than {_MAX_FDS} (one message): map them in larger "
                                  f"chunks")
            self.state = "updating"
            for n in need:
                self.applied.pop(n, None)
            _send(conn, frame, out_fds)
        finally:
            _close_all(out_fds)  # the trainer holds its own references now
        t0 = time.perf_counter()
        fin, extra = _expect(conn, "finish")
        _close_all(extra)
        if not fin.get("released"):
            raise UpdateError("the trainer did not release its mapping of the engine's weights")
        t1 = time.perf_counter()
        want = work.verifier().run(self.engine)  # its sums are read back: nothing queued
        bad = direct.first_difference(ps, [int(x) for x in fin.get("sums", [])], want)
        if bad is not None:
            raise UpdateError(f"the update is not what the trainer wrote: {bad}")
        total_model = sum(stream._itemsize(d) * math.prod(sh) for sh, d in manifest.values())
        last = {"bytes_moved": sum(stream._itemsize(manifest[n][1])
                                   * math.prod(manifest[n][0]) for n in need),
                "bytes_total": total_model, "pieces": len(ps), "copies": len(sub.copies),
                "tensors": len(need), "tensors_total": len(manifest), "direct": True,
                "verify_seconds": time.perf_counter() - t1, "export_seconds": t_export,
                "seconds": time.perf_counter() - t0}
        for n in need:  # the summary is computed: nothing below can fail before "ready"
            self.applied[n] = digests[n]
        self.last = last
        self.state = "ready"
        _send(conn, {"type": "finished", **self.last})
        return self.last


def _where(tensors: MappingABC[str, Any], names: list[str]) -> tuple:
    """What a kept direct update's work depends on besides the plan: each tensor's address,
    shape and strides, and whether the checksums run as kernels (a setting that can change)."""
    return (direct.kernels_on(),
            *((tensors[n].data_ptr(), tuple(tensors[n].shape), tuple(tensors[n].stride()))
              for n in names))


class _DirectWork:
    """The engine's side of a direct update of some sources under a plan: their moves
    (``sub``), pieces, destinations (each contiguous, else :class:`UpdateError`), the bytes
    they span, the encoded ``ready`` frame, and the verifier (built at its first use, after the
    trainer wrote)."""

    def __init__(self, plan: Plan, need: list[str], engine: MappingABC[str, Any]):
        want = set(need)
        self.sub = Plan(tuple(c for c in plan.copies if c.src in want))
        self.pieces = direct.pieces(self.sub, need)
        self.dsts = sorted({c.dst for c in self.sub.copies})
        for d in self.dsts:
            if not engine[d].is_contiguous():
                raise UpdateError(f"{d!r}: the engine's tensor is not contiguous")
        self.addresses = _where(engine, self.dsts)
        self.ends = [(engine[d].data_ptr(),
                      engine[d].data_ptr() + engine[d].numel() * engine[d].element_size())
                     for d in self.dsts]
        self.copies_json = [_copy_json(c) for c in self.sub.copies]
        self._engine = engine
        self._ready: tuple[tuple, bytes] | None = None
        self._verifier: direct.Verifier | None = None

    def layout(self, base: int, total: int) -> dict[str, list]:
        """Each destination's offset in the exported memory (at ``base``, ``total`` bytes),
        shape and dtype, as the ``ready`` frame carries them."""
        tensors = {}
        for d, (lo, hi) in zip(self.dsts, self.ends):
            t = self._engine[d]
            if not 0 <= lo - base <= total - (hi - lo):
                raise UpdateError(f"{d!r} is not in the memory the engine exports")
            tensors[d] = [lo - base, list(t.shape), str(t.dtype).removeprefix("torch.")]
        return tensors

    def ready_frame(self, need: list[str], exp: dict) -> bytes:
        """The encoded ``ready`` frame for the memory ``exp`` the exporter described (the last
        one again when nothing in it changed: at the 8B shape it is 50 KB of JSON)."""
        sizes = [size for size, _ in exp["pieces"]]
        key = (tuple(need), exp["kind"], exp["base"], tuple(sizes))
        if self._ready is None or self._ready[0] != key:
            tensors = self.layout(exp["base"], sum(sizes))
            self._ready = (key, _encode({"type": "ready", "need": need,
                                         "direct": {"kind": exp["kind"], "sizes": sizes,
                                                    "tensors": tensors,
                                                    "copies": self.copies_json}}))
        return self._ready[1]

    def verifier(self) -> direct.Verifier:
        if self._verifier is None:
            self._verifier = direct.Verifier(self.sub, self.pieces, self._engine)
        return self._verifier


def _check_pieces(plan: Plan, ps: list, sources: MappingABC[str, Any],
                  targets: MappingABC[str, Any]) -> None:
    """The engine's moves against the trainer's tensors, before a byte is written: every row
    range inside both tensors, the rows' other dimensions equal (UpdateError naming it)."""
    for p in ps:
        src, dst = sources.get(p.src), targets.get(p.dst)
        if src is None or dst is None:
            raise UpdateError(f"a move from {p.src!r} to {p.dst!r} names a tensor the update "
                              f"does not map")
        if p.kind != "rows":
            continue
        if (src.dim() == 0 or dst.dim() == 0 or tuple(src.shape[1:]) != tuple(dst.shape[1:])
                or p.rows < 0
                or not (0 <= p.src_row and p.src_row + p.rows <= src.shape[0])
                or not (0 <= p.dst_row and p.dst_row + p.rows <= dst.shape[0])):
            raise UpdateError(f"rows {p.src_row}..{p.src_row + p.rows} of {p.src!r} "
                              f"{list(src.shape)} do not fit rows {p.dst_row}.. of {p.dst!r} "
                              f"{list(dst.shape)}")


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
    the trainer's layout) to the engine listening at ``path``. ``direct=True``: no staging
    buffer; the trainer maps the memory the engine exports (on ``device``, the engine's GPU in
    this process's numbering) and writes every move there (:mod:`vitrify.weights.direct`).

    The digests that let the engine skip unchanged tensors (a delta update) are keyed sums of
    every tensor's bytes, under a key of this sender (the same for each of its updates, unknown
    to anyone else); ``update(versions=...)`` replaces them with the trainer's version tags (no
    read of the tensors)."""

    def __init__(self, chunk_bytes: int | None = None, *, slots: int = 2,
                 device: int | None = None, direct: bool = False):
        self.direct = bool(direct)
        self.device = device
        self.key = (secrets.randbelow((1 << 31) - 1) + 1, secrets.randbelow((1 << 31) - 1) + 1)
        self.staging = None
        # the last direct update's (need, sources), the engine's description, plan, pieces and
        # writer (Writer): reused while the next update is the same moves
        self._last_direct: tuple | None = None
        self._last_ready: tuple[bytes, dict] | None = None  # the engine's last ready frame
        if self.direct:  # no staging at all: the trainer writes into the engine's memory
            self.chunk_bytes = self.slot_bytes = 0
            self.slots = 0
            return
        if chunk_bytes is None:
            raise MappingError("a staged update needs chunk_bytes (or direct=True)")
        _check.integer("chunk_bytes", chunk_bytes, 1, _check.U64_MAX)
        self.slots = _check.integer("slots", slots, 1, 64)
        self.slot_bytes = chunk_bytes // slots // 256 * 256
        if self.slot_bytes == 0:
            raise MappingError(f"chunk_bytes={chunk_bytes} leaves no room for {slots} slots")
        self.chunk_bytes = chunk_bytes
        self.staging = (HostStaging(chunk_bytes) if device is None
                        else CudaStaging(chunk_bytes, device))

    def update(self, path: str, tensors: MappingABC[str, Any], *, timeout: float = 600.0,
               connect_timeout: float = 0.0, synchronize: Callable[[], None] | None = None,
               versions: MappingABC[str, Any] | None = None) -> dict:
        """Stream the tensors the engine needs (all, or those changed since its last completed
        update); returns the engine's ``finished`` summary. Raises :class:`UpdateError` with the
        engine's reason when it refuses or fails. ``connect_timeout``: keep trying to connect
        that long while nothing listens at ``path`` yet (an engine still thawing)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            _connect(sock, path, connect_timeout)
            return self.update_over(sock, tensors, synchronize=synchronize,
                                    where=f"the engine at {path}", versions=versions)

    def update_over(self, sock: socket.socket, tensors: MappingABC[str, Any], *,
                    synchronize: Callable[[], None] | None = None,
                    where: str = "the engine",
                    versions: MappingABC[str, Any] | None = None) -> dict:
        """:meth:`update` over a connected socket (the engine's next frame is ``hello``).
        ``versions``: name -> the trainer's version tag of every tensor, used as its digest
        instead of a keyed sum of its bytes (an unchanged tag means unchanged bytes)."""
        if versions is not None:
            missing = [n for n in tensors if n not in versions]
            if missing:
                raise UpdateError(f"versions lacks a tag for {missing[:4]}")

        def dig(n: str, t: Any) -> str:
            if versions is None:
                return digest(t, self.key)
            # scoped to this sender: another trainer's tag 1 is not this one's
            return (f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}:"
                    f"v:{self.key[0]:x}.{self.key[1]:x}:{versions[n]}")

        manifest = [{"name": n, "shape": list(t.shape),
                     "dtype": str(t.dtype).removeprefix("torch."), "digest": dig(n, t)}
                    for n, t in tensors.items()]
        try:
            if self.direct:
                return self._direct(sock, tensors, manifest, synchronize or (lambda: None))
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
        fin, extra = _expect(sock, "finished")
        _close_all(extra)
        return fin

    def _direct(self, sock: socket.socket, tensors: MappingABC[str, Any], manifest: list,
                sync: Callable[[], None]) -> dict:
        _send(sock, {"type": "hello", "protocol": PROTOCOL, "manifest": manifest, "direct": True})
        ready, fds = _expect(sock, "ready", self._last_ready, keep_raw=True)
        raw = ready.pop("_raw", None)
        if raw is not None:
            self._last_ready = (raw, ready)
        t0 = time.perf_counter()
        try:
            meta = ready.get("direct")
            if not isinstance(meta, dict):
                raise UpdateError("the engine answered a direct update with a staged one")
            unknown = [n for n in ready["need"] if n not in tensors]
            if unknown:
                raise UpdateError(f"the engine asks for tensors this update does not have: "
                                  f"{unknown[:4]}")
            need = list(ready["need"])
            # the last update's plan, pieces and writer, when the engine describes the same moves
            # into the same memory and the sources are the same tensors (a trainer's next step)
            sources = (direct.kernels_on(),
                       *((n, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
                         for n in need for t in (tensors[n],)))
            last = self._last_direct
            reuse = last is not None and last[0] == (need, sources) and last[1] == meta
            if reuse:
                plan, ps, writer = last[2], last[3], last[4]
            else:
                self._last_direct = None
                plan = Plan(tuple(_copy_of(v) for v in meta["copies"]))
                rows = sum(int(v[1][0]) if v[1] else 1 for v in meta["tensors"].values())
                ps = direct.pieces(plan, need, limit=rows)
                writer = None
        except (KeyError, TypeError, ValueError, IndexError) as e:
            _close_all(fds)
            raise UpdateError(f"a malformed ready frame from the engine: {e!r}") from None
        except BaseException:
            _close_all(fds)
            raise
        times = {"plan_s": time.perf_counter() - t0}
        sums: list[int] = []
        if ps:  # else nothing changed: no memory to map
            t = time.perf_counter()
            mem = _Imported(meta, fds, self.device)  # closes the descriptors
            times["import_s"] = time.perf_counter() - t
            ok = False
            try:
                t = time.perf_counter()
                targets = _Targets(mem, meta["tensors"])
                if writer is None:  # checked against both sides' tensors before a byte moves
                    _check_pieces(plan, ps, tensors, targets)
                    writer = direct.Writer(plan, ps, tensors, targets, base=mem.address)
                times["check_s"] = time.perf_counter() - t
                t = time.perf_counter()
                sums = writer.run(tensors, targets, base=mem.address)
                sync()
                times["write_s"] = time.perf_counter() - t
                ok = True
            finally:
                targets = None
                t = time.perf_counter()
                if not ok:  # queued copies must finish before their memory is unmapped
                    self._last_direct = None  # a failed update's writer is not kept
                    try:
                        mem.synchronize()
                    except Exception as e:  # the first error is the one that propagates
                        log.debug("synchronize before releasing the engine's memory: %s", e)
                mem.close()  # released before "finish" says so
                times["release_s"] = time.perf_counter() - t
            self._last_direct = ((need, sources), meta, plan, ps, writer)
        else:
            _close_all(fds)
        written = time.perf_counter() - t0
        try:
            _send(sock, {"type": "finish", "released": True, "sums": [str(x) for x in sums]})
            fin, extra = _expect(sock, "finished")
        except BaseException:  # the engine refused what was written: plan the retry anew
            self._last_direct = None
            raise
        _close_all(extra)
        return {**fin, "trainer_write_seconds": written, "trainer_times": times,
                "trainer_reused_plan": bool(ps) and reuse}

    def close(self) -> None:
        self._last_direct = self._last_ready = None  # the kept device tables go with them
        if self.staging is not None:
            self.staging.close()
