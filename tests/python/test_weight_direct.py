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


def _four_updates(path: str) -> list[dict]:
    """The trainer's side of the full / in-place / delta / cast updates (run here, or in a
    process of its own under Triton's interpreter)."""
    tx = wt.Sender(direct=True)
    try:
        assert tx.staging is None
        v1 = engine_tensors(bias=True, seed=1)
        # bf16 sources: the moves copy and sum in one pass (the fused kernel when on)
        src1 = {n: t.to(torch.bfloat16) for n, t in
                megatron_reference(v1, 2, 8, 2, bias=True).items()}
        tags = {n: 1 for n in src1}
        fins = [tx.update(path, src1, versions=tags)]
        # a trainer's next step: the same tensors, new values in place, every tag moved; the
        # sender reuses its plan, pieces and writer (the engine's memory is mapped anew)
        v4 = engine_tensors(bias=True, seed=4)
        for n, t in megatron_reference(v4, 2, 8, 2, bias=True).items():
            src1[n].copy_(t.to(torch.bfloat16))
        tags = {n: 4 for n in src1}
        fins.append(tx.update(path, src1, versions=tags))
        # a delta by version tags: one tensor's tag moved, only its bytes move
        v2 = {n: t.clone() for n, t in v4.items()}
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
    eng = Engine(tmp_path, 4, direct=True, force_kernels=kernels)
    try:
        if kernels:  # Triton's interpreter is chosen when its kernels are defined: a new process
            code = ("import json, test_weight_direct as t, vitrify.weights.direct as d; "
                    "d.FORCE_KERNELS = True; "
                    f"print(json.dumps(t._four_updates({eng.path!r})))")
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               cwd=os.path.dirname(__file__), timeout=600,
                               env={**os.environ, "TRITON_INTERPRET": "1"})
            assert p.returncode == 0, p.stderr[-3000:]
            fins = json.loads(p.stdout.strip().splitlines()[-1])
        else:
            fins = _four_updates(eng.path)
        results = [eng.served() for _ in range(4)]
    finally:
        eng.close()
    assert all(r["ok"] and r["state"] == "ready" for r in results), results
    v1 = engine_tensors(bias=True, seed=1)
    total = sum(t.numel() * 2 for t in megatron_reference(v1, 2, 8, 2, bias=True).values())
    assert fins[0]["direct"] and fins[0]["bytes_moved"] == total
    assert fins[0]["pieces"] > len(megatron_reference(v1, 2, 8, 2, bias=True))  # qkv, fc1 cut
    check(results[0]["engine"], v1)
    assert [f["trainer_reused_plan"] for f in fins] == [False, True, False, False]
    v4 = engine_tensors(bias=True, seed=4)
    assert fins[1]["tensors"] == fins[1]["tensors_total"] and fins[1]["bytes_moved"] == total
    check(results[1]["engine"], v4)
    v2 = {n: t.clone() for n, t in v4.items()}
    v2["model.layers.1.mlp.down_proj.weight"] += 1.0
    assert fins[2]["tensors"] == 1 and fins[2]["bytes_moved"] == v2[
        "model.layers.1.mlp.down_proj.weight"].numel() * 2
    check(results[2]["engine"], v2)
    assert fins[3]["tensors"] == fins[3]["tensors_total"]
    check(results[3]["engine"], engine_tensors(bias=True, seed=3))


def test_a_wrong_write_is_caught_and_a_retry_completes(tmp_path, monkeypatch):
    eng = Engine(tmp_path, 2, direct=True)
    tx = wt.Sender(direct=True)
    real = wd.Writer.run

    def corrupt(self, sources, targets, base=None):
        sums = real(self, sources, targets, base)
        t = targets["model.layers.0.self_attn.k_proj.weight"]
        t.view(-1)[3] += 1  # a byte the trainer did not mean to write
        return sums

    try:
        v1 = engine_tensors(bias=True, seed=5)
        src = megatron_reference(v1, 2, 8, 2, bias=True)
        monkeypatch.setattr(wd.Writer, "run", corrupt)
        with pytest.raises(wt.UpdateError, match=r"k_proj.weight' rows 0\.\.8 .*engine reads"):
            tx.update(eng.path, src)
        got = eng.served()
        assert not got["ok"] and got["state"] == "incomplete"
        monkeypatch.setattr(wd.Writer, "run", real)
        fin = tx.update(eng.path, src)  # every tensor again: none was known complete
        assert not fin["trainer_reused_plan"]  # a refused update's writer is not kept
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


def test_unchanged_tensors_complete_without_exporting_and_tags_belong_to_their_sender(tmp_path):
    eng = Engine(tmp_path, 4, direct=True)
    a, b = wt.Sender(direct=True), wt.Sender(direct=True)
    try:
        v1 = engine_tensors(bias=True, seed=11)
        src1 = megatron_reference(v1, 2, 8, 2, bias=True)
        tags = {n: 7 for n in src1}
        assert a.update(eng.path, src1, versions=tags)["tensors"] == len(src1)
        assert eng.served()["ok"]
        # the same tags again: nothing to move, no memory exported, the engine stays ready
        fin = a.update(eng.path, src1, versions=tags)
        got = eng.served()
        assert got["ok"] and got["state"] == "ready", got
        assert fin["tensors"] == 0 and fin["pieces"] == 0 and fin["bytes_moved"] == 0
        check(got["engine"], v1)
        # another trainer with the same tags but other weights: its tags are not a's
        v2 = engine_tensors(bias=True, seed=12)
        fin = b.update(eng.path, megatron_reference(v2, 2, 8, 2, bias=True), versions=tags)
        got = eng.served()
        assert got["ok"] and fin["tensors"] == len(src1)
        check(got["engine"], v2)
        # and a's tags no longer describe the engine's bytes either
        fin = a.update(eng.path, src1, versions=tags)
        got = eng.served()
        assert got["ok"] and fin["tensors"] == len(src1)
        check(got["engine"], v1)
    finally:
        a.close()
        b.close()
        eng.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_malformed_description_of_the_engines_memory_leaks_nothing():
    hw = wt.HostWeights({"a": torch.ones(64, dtype=torch.bfloat16)})
    try:
        before = _open_fds()
        for meta in ({"kind": "host"}, {"sizes": ["x"], "kind": "host"},
                     {"sizes": [1 << 40], "kind": "host"}, {"sizes": [256], "kind": "tape"},
                     {"sizes": [256, 256], "kind": "host"}):
            fds = [os.dup(hw.fd) for _ in meta.get("sizes", [0])]
            with pytest.raises(wt.UpdateError):
                wt._Imported(meta, fds, None)
            assert fds == []
        assert _open_fds() == before
        # an unsealed memfd is refused (it could shrink under the mapping)
        fd = os.memfd_create("unsealed")
        os.ftruncate(fd, 4096)
        with pytest.raises(wt.UpdateError, match="not sealed"):
            wt._Imported({"sizes": [4096], "kind": "host"}, [fd], None)
        assert _open_fds() == before
        m = wt._Imported({"sizes": [hw.nbytes], "kind": "host"}, [os.dup(hw.fd)], None)
        with pytest.raises(wt.UpdateError, match="unknown dtype"):
            m.tensor(0, [4], "nonsense")
        with pytest.raises(wt.UpdateError, match="outside"):
            m.tensor(hw.nbytes - 2, [4], "bfloat16")
        assert m.tensor(0, [4], "bfloat16").tolist() == [1.0] * 4
        m.close()
        assert _open_fds() == before
    finally:
        hw.close()


def test_a_plan_with_more_pieces_than_rows_is_refused():
    c = wm.Copy("s", "d", 0, (0, 1 << 30, 1, 0, 1), 0, (0, 1 << 30, 1, 0, 1))
    with pytest.raises(wm.MappingError, match="more pieces"):
        wd.pieces(wm.Plan((c,)), ["s"], limit=100)
    bad = wd.Piece("rows", 0, "s", "d", 0, 0, -1)
    with pytest.raises(wt.UpdateError, match="do not fit"):
        wt._check_pieces(wm.Plan((c,)), [bad], {"s": torch.zeros(4, 2)}, {"d": torch.zeros(4, 2)})


def test_finish_without_released_is_refused():
    import socket
    import threading

    hw = wt.HostWeights({n: torch.zeros_like(t, dtype=torch.bfloat16)
                         for n, t in engine_tensors(bias=True).items()})
    rx = wt.Receiver(hw.tensors, _mapping(), exporter=hw.export)
    src = megatron_reference(engine_tensors(bias=True, seed=2), 2, 8, 2, bias=True)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    box = {}

    def run():
        try:
            rx.serve_one(b)
        except Exception as e:
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    try:
        manifest = [{"name": n, "shape": list(v.shape), "dtype": "float32", "digest": "x"}
                    for n, v in src.items()]
        wt._send(a, {"type": "hello", "protocol": wt.PROTOCOL, "manifest": manifest,
                     "direct": True})
        ready, fds = wt._expect(a, "ready")
        wt._close_all(fds)
        wt._send(a, {"type": "finish", "sums": []})
        with pytest.raises(wt.UpdateError, match="did not release"):
            wt._expect(a, "finished")
    finally:
        t.join()
        a.close()
        b.close()
        hw.close()
    assert "did not release" in str(box["error"]) and rx.state == "incomplete"


def test_the_engine_reuses_its_pieces_while_its_destinations_stay():
    eng = {n: t.to(torch.bfloat16) for n, t in engine_tensors(bias=True).items()}
    src = megatron_reference(engine_tensors(bias=True), 2, 8, 2, bias=True)
    rx = wt.Receiver(eng, _mapping())
    plan = rx._plan(_specs(src))
    work = rx._direct_work(plan, list(src))
    assert rx._direct_work(plan, list(src)) is work  # a trainer's next step
    one = rx._direct_work(plan, list(src)[:1])  # a delta: other sources, other pieces
    assert one is not work and {p.src for p in one.pieces} == set(list(src)[:1])
    work = rx._direct_work(plan, list(src))
    name = "model.layers.0.self_attn.k_proj.weight"
    eng[name] = eng[name].clone()  # the engine's tensor moved
    moved = rx._direct_work(plan, list(src))
    assert moved is not work and moved.addresses != work.addresses
    assert moved.layout(min(a for a, _ in moved.ends), 1 << 40)[name][0] == \
        eng[name].data_ptr() - min(a for a, _ in moved.ends)
    assert rx._plan(_specs(src)) is plan  # the plan itself is kept per manifest


def test_a_frame_seen_before_is_not_decoded_again():
    import socket

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        frame = {"type": "ready", "need": ["x"], "direct": {"copies": [[1, 2]]}}
        wt._send(a, wt._encode(frame))
        first, _ = wt._expect(b, "ready", None, keep_raw=True)
        raw = first.pop("_raw")
        assert first == frame
        wt._send(a, frame)
        again, _ = wt._expect(b, "ready", (raw, first))
        assert again is first  # the same bytes: the earlier decoding
        wt._send(a, {**frame, "need": ["y"]})
        other, _ = wt._expect(b, "ready", (raw, first))
        assert other is not first and other["need"] == ["y"] and "_raw" not in other
        # an empty frame is never "seen before": it is refused, its descriptors closed
        r, w = os.pipe()
        try:
            socket.send_fds(a, [wt._LEN.pack(0)], [r])
            with pytest.raises(wt.UpdateError, match="not JSON"):
                wt._expect(b, "ready", (b"", {}), keep_raw=True)
        finally:
            os.close(r)
            os.close(w)
