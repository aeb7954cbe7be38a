"""vitrify.weights.transport on CPU: a trainer (this process) updates an engine in another process
(weight_worker.py) over a Unix socket, through one shared memfd staging buffer exported once —
the full update bit for bit, a delta update that moves only the changed tensor, an update that
dies mid-way leaving the engine ``incomplete`` and a retry that completes it, a misfit layout
refused before a byte moves (the engine untouched), and a sender of a user the engine does not
allow refused."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_weight_mapping import engine_tensors, megatron_reference  # noqa: E402
from vitrify.weights import stream as ws  # noqa: E402
from vitrify.weights import transport as wt  # noqa: E402

WORKER = Path(__file__).with_name("weight_worker.py")


class Engine:
    """The worker process: one JSON line per connection it served."""

    def __init__(self, tmp_path, connections, **opts):
        self.path = str(tmp_path / "engine.sock")
        self.p = subprocess.Popen([sys.executable, str(WORKER), self.path, str(connections),
                                   json.dumps(opts)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  cwd=str(WORKER.parent))
        line = self.p.stdout.readline()
        assert line, self.p.stderr.read()[-3000:]
        assert json.loads(line)["listening"] == self.path

    def served(self) -> dict:
        line = self.p.stdout.readline()
        assert line, self.p.stderr.read()[-3000:]
        return json.loads(line)

    def close(self):
        self.p.kill()
        self.p.communicate()  # reaps it and closes its pipes


def expected(ref) -> dict:
    return {n: hashlib.sha256(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
            .hexdigest() for n, t in ref.items() if not n.endswith("inv_freq")}


def check(engine_hashes, ref):
    want = expected(ref)
    bad = [n for n in want if engine_hashes[n] != want[n]]
    assert not bad, bad[:5]


def test_full_delta_failed_and_retried_updates_across_processes(tmp_path, monkeypatch):
    eng = Engine(tmp_path, 4)
    tx = wt.Sender(chunk_bytes=16 << 10, slots=2)
    try:
        v1 = engine_tensors(bias=True, seed=1)
        src1 = megatron_reference(v1, 2, 8, 2, bias=True)
        total = sum(t.numel() * t.element_size() for t in src1.values())
        fin = tx.update(eng.path, src1)
        got = eng.served()
        assert got["ok"] and got["state"] == "ready"
        assert fin["bytes_moved"] == total == fin["bytes_total"]
        assert fin["chunks"] >= total // (8 << 10)  # two 8 KiB slots: many chunks
        check(got["engine"], v1)

        # Delta: one tensor of many changed -> only its bytes move.
        v2 = {n: t.clone() for n, t in v1.items()}
        v2["model.layers.1.mlp.down_proj.weight"] += 1.0
        src2 = megatron_reference(v2, 2, 8, 2, bias=True)
        fin = tx.update(eng.path, src2)
        got = eng.served()
        assert got["ok"] and fin["tensors"] == 1 < fin["tensors_total"]
        assert fin["bytes_moved"] == src2["decoder.layers.1.mlp.linear_fc2.weight"].numel() * 4
        assert fin["bytes_moved"] <= 0.02 * total * 10  # a few percent of the model
        check(got["engine"], v2)

        # Dies after two chunks: the engine is "incomplete" (must not serve).
        v3 = engine_tensors(bias=True, seed=3)
        src3 = megatron_reference(v3, 2, 8, 2, bias=True)
        real_fill, calls = ws.fill, []

        def dying_fill(chunk, tensors, staging):
            calls.append(chunk.index)
            if len(calls) > 2:
                raise RuntimeError("trainer died")
            return real_fill(chunk, tensors, staging)

        monkeypatch.setattr(ws, "fill", dying_fill)
        with pytest.raises(RuntimeError, match="trainer died"):
            tx.update(eng.path, src3)
        got = eng.served()
        assert not got["ok"] and got["state"] == "incomplete"
        monkeypatch.setattr(ws, "fill", real_fill)

        # The retry sends what is not known complete and finishes the update.
        fin = tx.update(eng.path, src3)
        got = eng.served()
        assert got["ok"] and got["state"] == "ready" and fin["tensors"] == fin["tensors_total"]
        check(got["engine"], v3)
    finally:
        tx.close()
        eng.close()


def test_a_misfit_layout_is_refused_before_a_byte_moves(tmp_path):
    eng = Engine(tmp_path, 1)
    tx = wt.Sender(chunk_bytes=16 << 10)
    try:
        # a trainer with 4 KV heads; the engine has 2
        ref = engine_tensors(bias=True, kv_heads=4)
        src = megatron_reference(ref, 2, 8, 4, bias=True)
        with pytest.raises(wt.UpdateError, match=r"engine refused.*linear_qkv"):
            tx.update(eng.path, src)
        got = eng.served()
        assert not got["ok"] and got["state"] == "ready"
        assert "linear_qkv.weight': rows 96.. of 128 go nowhere" in got["error"]
        zeros = {n: hashlib.sha256(torch.zeros(t.shape, dtype=torch.int16).numpy().tobytes())
                 .hexdigest() for n, t in engine_tensors(bias=True).items()}
        assert got["engine"] == zeros  # nothing was touched
    finally:
        tx.close()
        eng.close()


def test_a_sender_of_another_user_is_refused(tmp_path):
    eng = Engine(tmp_path, 1, allowed_uids=[os.getuid() + 1])
    tx = wt.Sender(chunk_bytes=16 << 10)
    try:
        src = megatron_reference(engine_tensors(bias=True), 2, 8, 2, bias=True)
        with pytest.raises(wt.UpdateError, match=f"user {os.getuid()} may not update"):
            tx.update(eng.path, src)
        got = eng.served()
        assert not got["ok"] and got["state"] == "ready"
    finally:
        tx.close()
        eng.close()


def test_host_staging_is_shared_through_its_descriptor():
    a = wt.HostStaging(4096)
    b = wt.HostStaging.open(os.dup(a.fd), a.meta())
    a.tensor[:5] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    assert b.tensor[:5].tolist() == [1, 2, 3, 4, 5]
    b.close()
    a.close()
    import fcntl

    fd = os.memfd_create("empty", os.MFD_ALLOW_SEALING)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    try:
        with pytest.raises(wt.UpdateError, match="holds 0 bytes"):
            wt.HostStaging(10, fd=fd)
    finally:
        os.close(fd)


def _small_engine():
    ref = engine_tensors(bias=True)
    return {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in ref.items()}


def _receiver(engine, **kw):
    from vitrify.weights import mapping as wm

    return wt.Receiver(engine, wm.megatron_llama(heads=8, kv_heads=2, head_dim=8, qkv_bias=True),
                       **kw)


def _serve_in_thread(rx, conn):
    import threading

    box = {}

    def run():
        try:
            box["summary"] = rx.serve_one(conn)
        except Exception as e:  # what the engine saw
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_finish_without_the_data_is_refused_and_the_engine_stays_incomplete():
    import socket

    engine = _small_engine()
    rx = _receiver(engine)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    t, box = _serve_in_thread(rx, a)
    src = megatron_reference(engine_tensors(bias=True), 2, 8, 2, bias=True)
    staging = wt.HostStaging(1 << 16)
    try:
        manifest = [{"name": n, "shape": list(x.shape), "dtype": "float32", "digest": "d"}
                    for n, x in src.items()]
        wt._send(b, {"type": "hello", "protocol": wt.PROTOCOL, "manifest": manifest,
                     "staging": staging.meta(), "slot_bytes": 1 << 15, "slots": 2}, [staging.fd])
        wt._expect(b, "ready")
        wt._send(b, {"type": "finish"})  # no chunk at all
        with pytest.raises(wt.UpdateError, match="never arrived: the update is not complete"):
            wt._expect(b, "finished")
    finally:
        t.join(timeout=30)
        a.close()
        b.close()
        staging.close()
    assert isinstance(box.get("error"), wt.UpdateError)
    assert rx.state == "incomplete" and rx.applied == {}
    assert all(not x.any() for x in engine.values())


def test_the_sender_gets_the_engines_reason_when_it_fails_mid_stream(tmp_path):
    engine = _small_engine()
    calls = []

    def failing_sync():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("engine GPU fault")

    rx = _receiver(engine, synchronize=failing_sync)
    path = str(tmp_path / "e.sock")
    srv = wt.listen(path)
    import threading

    box = {}

    def accept_and_serve():
        conn, _ = srv.accept()
        with conn:
            try:
                rx.serve_one(conn)
            except Exception as e:
                box["error"] = e

    t = threading.Thread(target=accept_and_serve)
    t.start()
    tx = wt.Sender(chunk_bytes=8 << 10, slots=2)
    try:
        src = megatron_reference(engine_tensors(bias=True), 2, 8, 2, bias=True)
        with pytest.raises(wt.UpdateError, match="engine GPU fault"):
            tx.update(path, src)
    finally:
        t.join(timeout=30)
        srv.close()
        tx.close()
    assert rx.state == "incomplete"


def test_digests_see_structured_changes_views_and_dtypes():
    key = (12345, 67890)
    x = torch.tensor([1, 2, 2, 1], dtype=torch.int32)
    y = torch.tensor([2, 1, 1, 2], dtype=torch.int32)  # the position-weighted sum ties these
    assert ws.checksum(x.view(torch.uint8)) == ws.checksum(y.view(torch.uint8))
    assert wt.digest(x, key) != wt.digest(y, key)
    z = torch.tensor([5, 3, 7, 7], dtype=torch.int32)  # +1/-1 pairs at (0,1) and -1/+1 at (2,3)
    z2 = torch.tensor([6, 2, 6, 8], dtype=torch.int32)
    assert wt.digest(z, key) != wt.digest(z2, key)
    flat = torch.arange(9, dtype=torch.bfloat16)
    view = flat[1:7]  # 2 bytes past a 4-byte boundary
    assert wt.digest(view, key) == wt.digest(view.clone(), key)
    assert wt.digest(view, key) != wt.digest(view, (1, 2))  # keyed
    assert wt.digest(x, key) != wt.digest(x.view(torch.float32), key)  # dtype is part of it


def test_an_unsealed_staging_descriptor_is_refused_and_closed():
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, 4096)
    with pytest.raises(wt.UpdateError, match="not sealed"):
        wt.HostStaging.open(fd, {"kind": "host", "bytes": 4096})
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the failed open
