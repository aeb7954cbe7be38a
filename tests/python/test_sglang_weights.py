"""vitrify's weight update behind SGLang's update_weights_from_tensor (integrations/sglang/
weights.py) on the CPU: the plugin's AROUND hook, called as SGLang's WeightUpdater would call it,
receives a Megatron-layout update into a model holding SGLang's fused parameter names (Llama and
Qwen3 with q/k norms) bit for bit; a failure part-way returns SGLang's (False, reason) and every
new request is aborted until a retry completes; other load formats reach SGLang's own path; and
the plugin registers these hooks only in scheduler processes, with weight_updates on."""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang", reason="the SGLang plugin tests need sglang importable")

from sglang.srt.runtime_context import get_parallel  # noqa: E402
from test_weight_mapping import engine_tensors, fused_engine, megatron_reference  # noqa: E402
from vitrify.integrations.sglang import state  # noqa: E402
from vitrify.integrations.sglang import weights as sw  # noqa: E402
from vitrify.integrations.sglang.versions import v0_5_17  # noqa: E402
from vitrify.weights import stream as ws  # noqa: E402
from vitrify.weights import transport as wt  # noqa: E402


class FakeModel(torch.nn.Module):
    """Parameters under SGLang's names (dots and all), and an HF-like config."""

    def __init__(self, tensors, heads=8, kv_heads=2, hidden=64):
        super().__init__()
        self._named = [(n, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
                       for n, t in tensors.items()]
        self.config = types.SimpleNamespace(num_attention_heads=heads,
                                            num_key_value_heads=kv_heads, hidden_size=hidden)

    def named_parameters(self, *a, **k):
        return iter(self._named)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FakeUpdater:
    """Like SGLang's WeightUpdater: frozen, slots (nothing can be stored on it); its model
    runner, like SGLang's ModelRunner, has no ``tp_size`` (SGLang keeps it in its runtime
    context)."""

    model: Any
    own_calls: list = dataclasses.field(default_factory=list)

    def get_model(self):
        return self.model

    def get_model_runner(self):
        return types.SimpleNamespace(model=self.model)


def _original(updater, named_tensors, load_format=None):
    updater.own_calls.append(load_format)
    return True, "Success"


def _call(updater):
    return lambda nt, lf: sw.around_update_weights_from_tensor(
        _original, updater, named_tensors=nt, load_format=lf)


def _with_qk_norms(eng, src, layers, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    for i in range(layers):
        for x, y in (("q", "q"), ("k", "k")):
            t = torch.randn(hd, generator=g)
            eng[f"model.layers.{i}.self_attn.{x}_norm.weight"] = t
            src[f"decoder.layers.{i}.self_attention.{y}_layernorm.weight"] = t
    return eng, src


@pytest.fixture(autouse=True)
def _fresh_receivers(monkeypatch):
    monkeypatch.setattr(sw, "_RECEIVERS", [])
    monkeypatch.setattr(sw, "_BY_UPDATER", {})
    monkeypatch.setattr(state, "STATE", state.PluginState())
    # one GPU, as a scheduler's runtime context says (no process group on the CPU)
    with get_parallel().override(tp_size=1):
        yield


@pytest.mark.parametrize("qwen3", [False, True], ids=["llama", "qwen3-qk-norm"])
def test_an_update_through_sglangs_entry_point_lands_bit_for_bit(tmp_path, qwen3):
    v = engine_tensors(seed=3)
    eng, src = fused_engine(v, 2), megatron_reference(v, 2, 8, 2)
    if qwen3:
        eng, src = _with_qk_norms(eng, src, 2, 8)
    model = FakeModel(eng)
    up = FakeUpdater(model=model)
    tx = wt.Sender(chunk_bytes=16 << 10)
    try:
        fin = sw.update(_call(up), tx, src, str(tmp_path / "u.sock"))
    finally:
        tx.close()
    assert fin["tensors"] == len(src) and up.own_calls == []
    got = dict(model.named_parameters())
    for n, t in eng.items():
        if not n.endswith("inv_freq"):
            assert torch.equal(got[n], t), n
    assert sw.refusal() is None


def test_a_failed_update_aborts_requests_until_a_retry_completes(tmp_path, monkeypatch):
    v = engine_tensors(seed=4)
    eng, src = fused_engine(v, 2), megatron_reference(v, 2, 8, 2)
    model = FakeModel(eng)
    up = FakeUpdater(model=model)
    tx = wt.Sender(chunk_bytes=8 << 10)
    real, calls = ws.fill, []

    def dying(chunk, tensors, staging):
        calls.append(chunk.index)
        if len(calls) > 2:
            raise RuntimeError("trainer died")
        return real(chunk, tensors, staging)

    class Req:
        to_finish = None

        def set_finish_with_abort(self, msg):
            self.to_finish = msg

    queued = []
    queue = lambda sched, req: queued.append(req)  # noqa: E731
    try:
        monkeypatch.setattr(ws, "fill", dying)
        with pytest.raises(RuntimeError, match="trainer died"):
            sw.update(_call(up), tx, src, str(tmp_path / "a.sock"), timeout=30)
        assert "incomplete" in (sw.refusal() or "")
        r = Req()
        sw.around_add_request_to_queue(queue, object(), r)
        assert queued == [r] and "retry the update" in r.to_finish  # answered, not run
        monkeypatch.setattr(ws, "fill", real)
        fin = sw.update(_call(up), tx, src, str(tmp_path / "b.sock"))
        assert fin["tensors"] == len(src)
        assert sw.refusal() is None
        r2 = Req()
        sw.around_add_request_to_queue(queue, object(), r2)
        assert r2.to_finish is None and queued[-1] is r2
    finally:
        tx.close()
    got = dict(model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in eng.items() if not n.endswith("inv_freq"))


def test_other_formats_reach_sglang_and_bad_payloads_are_refused():
    up = FakeUpdater(model=FakeModel(fused_engine(engine_tensors(), 2)))
    assert sw.around_update_weights_from_tensor(_original, up, [("w", torch.zeros(1))],
                                                load_format=None) == (True, "Success")
    assert sw.around_update_weights_from_tensor(_original, up, [], "direct") == (True, "Success")
    assert up.own_calls == [None, "direct"]
    ok, msg = sw.around_update_weights_from_tensor(_original, up, [("w", torch.zeros(1))],
                                                   load_format="vitrify")
    assert ok is False and "exactly one entry" in msg
    ok, msg = sw.around_update_weights_from_tensor(
        _original, up, sw.payload("/nonexistent/vitrify.sock", timeout=1), "vitrify")
    assert ok is False and "engine ready" in msg  # nothing was touched
    assert sw.refusal() is None


def test_the_plugin_registers_the_weight_hooks_only_where_asked():
    from vitrify.integrations.sglang import config as pconfig
    from vitrify.integrations.sglang import plugin

    off = pconfig.from_mapping({"mode": "off"})
    w = pconfig.from_mapping({"mode": "off", "weight_updates": True})
    assert not off.registers_hooks and w.registers_hooks and not w.active
    assert plugin.hooks_for(w, "launcher", v0_5_17) == ()
    targets = {target for target, _, _ in plugin.hooks_for(w, "scheduler", v0_5_17)}
    assert targets == {v0_5_17.HOOK_TARGETS["update_weights_from_tensor"],
                       v0_5_17.HOOK_TARGETS["add_request_to_queue"]}
    with pytest.raises(pconfig.PluginConfigError, match="weight_updates"):
        pconfig.from_mapping({"mode": "off", "weight_updates": "yes"})


def test_the_update_target_exists_in_the_pinned_sglang():
    """The AROUND hook's target and the signature it relies on (SGLang 0.5.17)."""
    pytest.importorskip("sglang", reason="needs sglang importable")
    import inspect

    from vitrify.integrations.sglang import plugin

    fn = plugin.resolve(v0_5_17.HOOK_TARGETS["update_weights_from_tensor"], "0.5.17")
    assert list(inspect.signature(fn).parameters)[:3] == ["self", "named_tensors", "load_format"]


def test_the_weight_version_reaches_this_processs_hicache_backends(tmp_path, monkeypatch):
    from vitrify.integrations.sglang.hicache import backend

    seen = []

    class Backend:
        def set_weight_version(self, v):
            seen.append(v)

    class Broken:
        def set_weight_version(self, v):
            raise ValueError("closed")

    monkeypatch.setattr(backend, "live_backends", lambda: [Backend(), Broken()])
    v = engine_tensors(seed=6)
    eng, src = fused_engine(v, 2), megatron_reference(v, 2, 8, 2)
    up = FakeUpdater(model=FakeModel(eng))
    answers = []

    def call(nt, lf):
        answers.append(sw.around_update_weights_from_tensor(_original, up, named_tensors=nt,
                                                            load_format=lf))
        return answers[-1]

    tx = wt.Sender(chunk_bytes=16 << 10)
    try:
        sw.update(call, tx, src, str(tmp_path / "v.sock"), weight_version="step-7")
    finally:
        tx.close()
    assert seen == ["step-7"]
    ok, msg = answers[0]
    assert ok and "applied to 1 of 2 HiCache backend(s) (ValueError: closed)" in msg


def test_more_than_one_gpu_is_refused_before_anything_moves():
    """The tensor-parallel size is SGLang's runtime context's (a ModelRunner has none: the
    check read 1 whatever the server ran)."""
    up = FakeUpdater(model=FakeModel(fused_engine(engine_tensors(), 2)))
    with get_parallel().override(tp_size=2):
        ok, msg = sw.around_update_weights_from_tensor(_original, up, sw.payload("/x.sock"),
                                                       "vitrify")
    assert ok is False and "tp_size 2" in msg and sw.refusal() is None
    assert sw.tensor_parallel_size() == 1  # the fixture's one GPU again


def test_a_tensor_parallel_size_that_cannot_be_read_refuses_the_update(monkeypatch):
    import sglang.srt.runtime_context as rc

    class Unset:
        @property
        def tp_size(self):
            raise AssertionError("tensor model parallel group is not initialized")

    monkeypatch.setattr(rc, "get_parallel", lambda: Unset())
    up = FakeUpdater(model=FakeModel(fused_engine(engine_tensors(), 2)))
    ok, msg = sw.around_update_weights_from_tensor(_original, up, sw.payload("/x.sock"),
                                                   "vitrify")
    assert ok is False and sw.refusal() is None
    assert "cannot tell this scheduler's tensor-parallel size (get_parallel().tp_size: " \
           "AssertionError: tensor model parallel group is not initialized)" in msg


class _Loaded:
    """A LOAD's rebuilt graphs, as vitrify.graph.LoadedGraphs counts them."""

    names = ["decode_bs1", "decode_bs2"]

    def __len__(self):
        return len(self.names)

    def stats(self):
        return {"graphs": 2, "ready_graphs": 2, "modules_loaded": 1, "parameter_switches": 0}


def test_a_thawed_server_takes_a_direct_update_in_place_with_its_graphs_untouched(
        tmp_path, monkeypatch):
    v = engine_tensors(seed=6)
    eng, src = _with_qk_norms(fused_engine(v, 2), megatron_reference(v, 2, 8, 2), 2, 8)
    hw = wt.HostWeights({n: torch.zeros_like(t) for n, t in eng.items()})  # a CPU "region"
    model = FakeModel(eng)
    model._named = [(n, torch.nn.Parameter(t, requires_grad=False)) for n, t in hw.tensors.items()]
    monkeypatch.setattr(state.STATE, "run", types.SimpleNamespace(mode="load", loaded=_Loaded(),
                                                                   region=None,
                                                                   timings={"shapes": 2}))
    monkeypatch.setattr(sw, "_exporter", lambda params: hw.export)  # the region's, on a GPU
    up = FakeUpdater(model=model)
    tx = wt.Sender(direct=True)
    try:
        fin = sw.update(_call(up), tx, src, str(tmp_path / "d.sock"))
    finally:
        tx.close()
        hw.close()
    rep = fin["engine_report"]
    assert fin["direct"] and rep["direct"] and rep["tensors"] == len(src)
    assert rep["weights_in_place"] is True
    assert rep["graphs_before"] == rep["graphs_after"] == {
        "graphs": 2, "names": ["decode_bs1", "decode_bs2"], "ready_graphs": 2,
        "modules_loaded": 1, "parameter_switches": 0, "captures": 2}
    assert rep["identity_before"]["addresses"] == rep["identity_after"]["addresses"]
    assert rep["identity_after"]["receiver_holds_the_parameters"]
    got = dict(model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in eng.items() if not n.endswith("inv_freq"))
    # SGLang's own path changes weights behind the receiver's digests: the next vitrify update
    # from the same trainer sends everything again
    rx = sw.receiver_of(up)
    assert rx.applied
    assert sw.around_update_weights_from_tensor(_original, up, named_tensors=[("x", None)],
                                                load_format=None) == (True, "Success")
    assert rx.applied == {} and up.own_calls == [None]


def test_a_report_that_cannot_be_read_never_fails_a_finished_update(tmp_path, monkeypatch):
    v = engine_tensors(seed=7)
    eng, src = fused_engine(v, 2), megatron_reference(v, 2, 8, 2)
    model = FakeModel(eng)
    up = FakeUpdater(model=model)
    calls = []

    def broken(rx, updater):
        calls.append(1)
        if len(calls) > 1:  # after the update
            raise RuntimeError("graphs closed")
        return {"addresses": "x", "receiver_holds_the_parameters": True, "graphs": None}

    monkeypatch.setattr(sw, "engine_identity", broken)
    tx = wt.Sender(chunk_bytes=16 << 10)
    try:
        fin = sw.update(_call(up), tx, src, str(tmp_path / "r.sock"))
    finally:
        tx.close()
    rep = fin["engine_report"]
    assert fin["tensors"] == len(src) and rep["identity_after"] is None
    assert rep["weights_in_place"] is False and sw.refusal() is None
    got = dict(model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in eng.items() if not n.endswith("inv_freq"))


def test_direct_updates_need_every_parameter_in_an_exportable_region(monkeypatch, caplog):
    params = {"a": torch.zeros(64), "b": torch.zeros(64)}
    lo = min(p.data_ptr() for p in params.values())
    hi = max(p.data_ptr() + 256 for p in params.values())
    region = types.SimpleNamespace(base=lo, size=hi - lo, exportable=True, device=0)
    monkeypatch.setattr(state.STATE, "run", None)
    assert sw._exporter(params) is None  # no LOAD: staged updates
    monkeypatch.setattr(state.STATE, "run", types.SimpleNamespace(mode="load", region=region))
    assert callable(sw._exporter(params))
    region.exportable = False  # a LOAD without weight_updates
    assert sw._exporter(params) is None
    region.exportable, region.size = True, hi - lo - 8  # the last one's end outside
    with caplog.at_level("WARNING", logger="vitrify.sglang"):
        assert sw._exporter(params) is None
    region.exportable, region.size = True, 8  # "b" outside the region
    with caplog.at_level("WARNING", logger="vitrify.sglang"):
        assert sw._exporter(params) is None
    assert "outside the thawed region" in caplog.text
    assert state.thawed_graphs() is None  # no graphs rebuilt from an archive


def test_the_report_rides_on_sglangs_message():
    assert sw.report_of("vitrify: 3 of 3 tensors; report: {\"direct\":true}") == {"direct": True}
    assert sw.report_of("Success") is None and sw.report_of(None) is None
    assert sw.report_of("vitrify: x; report: {not json") is None


def test_a_gpu_that_cannot_export_gets_staged_updates(monkeypatch):
    from vitrify import region
    from vitrify.integrations.sglang import freeze

    class NoExport:
        def __init__(self, *a, **k):
            raise RuntimeError("cuMemCreate: CUDA_ERROR_NOT_SUPPORTED (POSIX descriptors)\nmore")

    monkeypatch.setattr(region, "Region", NoExport)
    why = freeze.exportable_here(0)
    assert why == "RuntimeError: cuMemCreate: CUDA_ERROR_NOT_SUPPORTED (POSIX descriptors)"


@pytest.mark.skipif(not os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA"),
                    reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
def test_the_fake_driver_exports_unless_it_lacks_descriptors():
    import subprocess
    import sys

    from test_shared_buffer import fake_env
    code = ("from vitrify.integrations.sglang import freeze; "
            "print(repr(freeze.exportable_here(0)))")
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, env=fake_env())
    assert ok.stdout.strip() == "None", ok.stdout + ok.stderr
    no = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, env=fake_env(FAKE_CUDA_POSIX_FD="0"))
    assert "cannot export memory as a POSIX file descriptor" in no.stdout, no.stdout + no.stderr
