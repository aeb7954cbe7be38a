"""vitrify.weights.direct and the transport's direct updates on CPU: the engine (another
process, weight_worker.py) keeps its tensors in a shared memfd it exports; the trainer (this
process) maps it and writes every move in place. A full update bit for bit (torch sums, and the
Triton kernels under Triton's interpreter), a delta by version tags and by content digests, a
write the engine's checksums catch (the engine left ``incomplete``, a retry completing it), a
staged-only engine refusing a direct update, and the piece enumeration both sides share."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from test_weight_mapping import engine_tensors, megatron_reference  # noqa: E402
from test_weight_transport import Engine, check  # noqa: E402

from vitrify.weights import direct as wd  # noqa: E402
from vitrify.weights import mapping as wm  # noqa: E402
from vitrify.weights import stream as ws  # noqa: E402
from vitrify.weights import transport as wt  # noqa: E402


def _mapping():
    return wm.megatron_llama(heads=8, kv_heads=2, head_dim=8, qkv_bias=True)


def _specs(ts):
    return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in ts.items()}


def test_pieces_cover_every_destination_row_once():
    eng = {n: t.to(torch.bfloat16) for n, t in engine_tensors(bias=True).items()}
    src = megatron_reference(engine_tensors(bias=True), 2, 8, 2, bias=True)
    plan = _mapping().plan(_specs(src), _specs(eng))
    ps = wd.pieces(plan, list(src))
    assert all(p.kind == "rows" for p in ps)
    covered = {}
    for p in ps:
        covered.setdefault(p.dst, []).append((p.dst_row, p.dst_row + p.rows))
    for name, t in eng.items():
        if name.endswith("inv_freq"):
            continue
        spans = sorted(covered[name])
        assert spans[0][0] == 0 and spans[-1][1] == t.shape[0]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), name
    # a delta: only the pieces of the needed source
    one = "decoder.layers.0.self_attention.linear_qkv.weight"
    sub = wd.pieces(plan, [one])
    assert {p.src for p in sub} == {one} and len(sub) == 3 * 2  # q, k, v of 2 KV groups


def _three_updates(path: str) -> list[dict]:
    """The trainer's side of the full / delta / cast updates (run here, or in a process of its
    own under Triton's interpreter)."""
    tx = wt.Sender(direct=True)
    try:
        assert tx.staging is None
        v1 = engine_tensors(bias=True, seed=1)
        # bf16 sources: the moves copy and sum in one pass (the fused kernel when on)
        src1 = {n: t.to(torch.bfloat16) for n, t in
                megatron_reference(v1, 2, 8, 2, bias=True).items()}
        tags = {n: 1 for n in src1}
        fins = [tx.update(path, src1, versions=tags)]
        # a delta by version tags: one tensor's tag moved, only its bytes move
        v2 = {n: t.clone() for n, t in v1.items()}
        v2["model.layers.1.mlp.down_proj.weight"] += 1.0
        src2 = {n: t.to(torch.bfloat16) for n, t in
                megatron_reference(v2, 2, 8, 2, bias=True).items()}
        fins.append(tx.update(path, src2, versions={**tags, _FC2: 2}))
        # float32 sources into the bf16 engine: torch casts, the sums follow
        fins.append(tx.update(path, megatron_reference(engine_tensors(bias=True, seed=3), 2, 8,
                                                        2, bias=True)))
        return fins
    finally:
        tx.close()


_FC2 = "decoder.layers.1.mlp.linear_fc2.weight"


@pytest.mark.parametrize("kernels", [False, True], ids=["torch-sums", "triton-interpreted"])
def test_direct_full_and_delta_updates_across_processes(tmp_path, monkeypatch, kernels):
    import json
    import subprocess
    import sys

    if kernels:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # for the engine's process
    eng = Engine(tmp_path, 3, direct=True, force_kernels=kernels)
    try:
        if kernels:  # Triton's interpreter is chosen when its kernels are defined: a new process
            code = ("import json, test_weight_direct as t, vitrify.weights.direct as d; "
                    "d.FORCE_KERNELS = True; "
                    f"print(json.dumps(t._three_updates({eng.path!r})))")
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               cwd=os.path.dirname(__file__), timeout=600,
                               env={**os.environ, "TRITON_INTERPRET": "1"})
            assert p.returncode == 0, p.stderr[-3000:]
            fins = json.loads(p.stdout.strip().splitlines()[-1])
        else:
            fins = _three_updates(eng.path)
        results = [eng.served() for _ in range(3)]
    finally:
        eng.close()
    assert all(r["ok"] and r["state"] == "ready" for r in results), results
    v1 = engine_tensors(bias=True, seed=1)
    total = sum(t.numel() * 2 for t in megatron_reference(v1, 2, 8, 2, bias=True).values())
    assert fins[0]["direct"] and fins[0]["bytes_moved"] == total
    assert fins[0]["pieces"] > len(megatron_reference(v1, 2, 8, 2, bias=True))  # qkv, fc1 cut
    check(results[0]["engine"], v1)
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["model.layers.1.mlp.down_proj.weight"] += 1.0
    assert fins[1]["tensors"] == 1 and fins[1]["bytes_moved"] == v2[
        "model.layers.1.mlp.down_proj.weight"].numel() * 2
    check(results[1]["engine"], v2)
    assert fins[2]["tensors"] == fins[2]["tensors_total"]
    check(results[2]["engine"], engine_tensors(bias=True, seed=3))


def test_a_wrong_write_is_caught_and_a_retry_completes(tmp_path, monkeypatch):
    eng = Engine(tmp_path, 2, direct=True)
    tx = wt.Sender(direct=True)
    real = wd.send

    def corrupt(plan, ps, sources, targets):
        sums = real(plan, ps, sources, targets)
        t = targets["model.layers.0.self_attn.k_proj.weight"]
        t.view(-1)[3] += 1  # a byte the trainer did not mean to write
        return sums

    try:
        v1 = engine_tensors(bias=True, seed=5)
        src = megatron_reference(v1, 2, 8, 2, bias=True)
        monkeypatch.setattr(wd, "send", corrupt)
        with pytest.raises(wt.UpdateError, match=r"k_proj.weight' rows 0\.\.8 .*engine reads"):
            tx.update(eng.path, src)
        got = eng.served()
        assert not got["ok"] and got["state"] == "incomplete"
        monkeypatch.setattr(wd, "send", real)
        fin = tx.update(eng.path, src)  # every tensor again: none was known complete
        got = eng.served()
        assert got["ok"] and got["state"] == "ready" and fin["tensors"] == fin["tensors_total"]
        check(got["engine"], v1)
    finally:
        tx.close()
        eng.close()


def test_a_staged_only_engine_refuses_a_direct_update(tmp_path):
    eng = Engine(tmp_path, 1)
    tx = wt.Sender(direct=True)
    try:
        src = megatron_reference(engine_tensors(bias=True), 2, 8, 2, bias=True)
        with pytest.raises(wt.UpdateError, match="takes staged updates only"):
            tx.update(eng.path, src)
        got = eng.served()
        assert not got["ok"] and got["state"] == "ready"
    finally:
        tx.close()
        eng.close()


def test_sender_arguments():
    with pytest.raises(wm.MappingError, match="needs chunk_bytes"):
        wt.Sender()
    tx = wt.Sender(direct=True)
    with pytest.raises(wt.UpdateError, match="versions lacks a tag"):
        import socket

        a, b = socket.socketpair()
        with a, b:
            tx.update_over(a, {"x": torch.zeros(4)}, versions={})


def test_host_weights_export_covers_its_tensors_only():
    hw = wt.HostWeights({"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(5)})
    try:
        a = hw.tensors["a"]
        assert a.tolist() == [1.0, 1.0, 1.0] and hw.tensors["b"].data_ptr() % 256 == 0
        exp = hw.export(a.data_ptr(), a.data_ptr() + 6)
        assert exp["kind"] == "host" and exp["base"] == a.data_ptr()
        for _, fd in exp["pieces"]:
            os.close(fd)
        with pytest.raises(wt.UpdateError, match="not in the engine's shared weights"):
            hw.export(0, 8)
    finally:
        hw.close()


def test_checksums_of_pieces_equal_the_reference_sums():
    t = torch.randint(-2**15, 2**15, (40, 6), dtype=torch.int16).to(torch.bfloat16)
    t = torch.randn(40, 6).to(torch.bfloat16)
    c = wm.Copy("s", "d", 0, (0, 2, 20, 3, 5), 0, (0, 2, 5, 0, 5))
    plan = wm.Plan((c,))
    ps = wd.pieces(plan, ["s"])
    dst = torch.zeros(10, 6, dtype=torch.bfloat16)
    sums = wd.send(plan, ps, {"s": t}, {"d": dst})
    assert torch.equal(dst[:5], t[3:8]) and torch.equal(dst[5:], t[23:28])
    assert sums == wd.verify(plan, ps, {"d": dst})
    assert sums[0] == ws.checksum(dst[:5].contiguous().view(-1).view(torch.uint8).clone())


def test_a_frame_carries_many_descriptors():
    """A 16 GB engine exports 16 chunks: every descriptor must arrive with its frame."""
    import socket

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = [os.memfd_create(f"x{i}") for i in range(20)]
    try:
        with a, b:
            wt._send(a, {"type": "ready"}, fds)
            msg, got = wt._recv(b)
            assert msg["type"] == "ready" and len(got) == 20
            wt._close_all(got)
    finally:
        for fd in fds:
            os.close(fd)
