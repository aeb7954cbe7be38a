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
    with pytest.raises(wt.UpdateError, match="holds 0 bytes"):
        fd = os.memfd_create("empty")
        try:
            wt.HostStaging(10, fd=fd)
        finally:
            os.close(fd)
