"""The SGLang plugin's tests that hold on every supported SGLang release, run against whichever
release is importable: ``test_sglang_versions.py`` runs this file in a fresh interpreter per
release (0.5.17 from the venv; 0.5.23 from a ``pip install --no-deps --target`` directory put
first on ``sys.path``), against the release's real classes on the CPU.

Registration through SGLang's own loader and the installed entry point, the argument seam of
the release (0.5.17: the hook after ``ServerArgs.__post_init__``; 0.5.23: the resolution steps),
the fingerprint, the refusals, every hook target and name the plugin relies on, what vitrify
changed reaching a scheduler process (the resolved record pickled into a ``spawn`` child, as
SGLang starts its schedulers), process roles, the graph backend's cleanup and names, the
attention check, the warm-up's TLS setting, ``vitrify sglang check``, and archives of another
release refused naming both.

With ``VITRIFY_RELEASE_OUT`` naming a file, the fingerprint of one command line is written
there for the cross-release comparison (``VITRIFY_RELEASE_MODEL``: the model directory both runs
use).
"""

from __future__ import annotations

import collections
import inspect
import json
import logging
import multiprocessing
import os
import pickle
import pkgutil
import types
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

sglang = pytest.importorskip("sglang", reason="the SGLang plugin tests need sglang importable")

from sglang.srt import plugins as sgl_plugins  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from vitrify.integrations.sglang import freeze, graphs, plugin, state, versions  # noqa: E402
from vitrify.integrations.sglang import attention  # noqa: E402
from vitrify.integrations.sglang import server_args as rules  # noqa: E402

VER = versions.for_version(sglang.__version__)
PREFIX = "vitrify SGLang plugin:"
ENTRY = "vitrify.integrations.sglang.plugin:register"
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
# one command line whose fingerprint both releases must compute the same way
SHAPED = dict(dtype="float16", random_seed=7, context_length=256, max_running_requests=8,
              chunked_prefill_size=1024, attention_backend="triton", page_size=16,
              cuda_graph_bs_decode=[1, 2, 4])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny Llama's config (``VITRIFY_RELEASE_MODEL``: one directory both releases' runs
    share, so their fingerprints can be compared whole)."""
    d = Path(os.environ.get("VITRIFY_RELEASE_MODEL") or tmp_path_factory.mktemp("tiny-llama"))
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(d)


def resolved(model_path, **kw):
    """A real ServerArgs of this release, resolved on the CPU (0.5.17 resolves in
    ``__post_init__``; 0.5.23 in ``resolve_once()``, where the plugin's steps run)."""
    sa = ServerArgs(model_path=model_path, device="cpu", skip_tokenizer_init=True, **kw)
    if hasattr(sa, "resolve_once"):
        sa.resolve_once()
    return sa


def _write_config(tmp_path, mode, **extra) -> str:
    arch = tmp_path / ("new-archive" if mode == "save" else "archive")
    if mode == "load":
        arch.mkdir(exist_ok=True)
    lines = [f'mode = "{mode}"', f'archive = "{arch}"', 'region_bytes = "2GiB"',
             "jit_caches = false"] + [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    path = tmp_path / f"{mode}.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def fresh(monkeypatch):
    """A clean plugin state, SGLang's hook registry and resolution hooks empty and its plugin
    loader unloaded (all restored afterwards), the targets the launcher's hooks patch restored
    too, the config variable and SGLang's allow-list unset."""
    monkeypatch.setattr(state, "STATE", state.PluginState())
    monkeypatch.setattr(HookRegistry, "_hooks", collections.defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(sgl_plugins, "_plugins_loaded", False)
    if VER.RESOLUTION_STEPS:
        from sglang.srt.arg_groups import resolution_hooks

        monkeypatch.setattr(resolution_hooks, "_HOOKS", {})
    for key in ("server_args_post_init", "wait_and_warmup"):
        if key in VER.HOOK_TARGETS:
            owner, _, attr = VER.HOOK_TARGETS[key].rpartition(".")
            obj = pkgutil.resolve_name(owner)
            monkeypatch.setattr(obj, attr, inspect.getattr_static(obj, attr))
    monkeypatch.delenv(state.CONFIG_ENV, raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    for name in VER.REFUSED_ENV:
        monkeypatch.delenv(name, raising=False)
    # SGLang's loader finds vitrify through its installed entry point; a venv whose metadata
    # predates it gets the same entry point handed to the loader
    if not any(ep.value == ENTRY for ep in metadata.entry_points(group="sglang.srt.plugins")):
        ep = metadata.EntryPoint("vitrify", ENTRY, "sglang.srt.plugins")
        monkeypatch.setattr(sgl_plugins, "entry_points",
                            lambda group: metadata.EntryPoints([ep] if group == ep.group else []))
    return monkeypatch


def _one_line_fatal(excinfo) -> str:
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, SystemExit)
    assert msg.startswith(PREFIX) and "\n" not in msg, msg
    return msg


def _our_hooks():
    return [(t, ht, fn) for t, hooks in HookRegistry._hooks.items() for ht, fn, _ in hooks
            if getattr(fn, "__module__", "").startswith("vitrify.")]


def _our_steps():
    if not VER.RESOLUTION_STEPS:
        return []
    from sglang.srt.arg_groups import resolution_hooks

    return [(step, fn) for step, fns in resolution_hooks._HOOKS.items() for fn in fns
            if getattr(fn, "__module__", "").startswith("vitrify.")]


# ------------------------------------------------------------------------------------------
# the release's module: every name resolves here
# ------------------------------------------------------------------------------------------

def test_the_installed_release_has_its_module():
    assert VER.VERSION == sglang.__version__ and VER.VERSION in versions.SUPPORTED
    version, module = versions.installed()
    assert (version, module) == (VER.VERSION, VER)


def test_every_hook_target_and_name_the_plugin_relies_on_resolves():
    for key, target in VER.HOOK_TARGETS.items():
        assert callable(plugin.resolve(target, VER.VERSION)), key
    for name in VER.REQUIRED + (VER.REGISTRY, VER.HOOK_TYPE, VER.SERVER_ARGS):
        plugin.resolve(name, VER.VERSION)
    hook_type = plugin.resolve(VER.HOOK_TYPE, VER.VERSION)
    assert {"AFTER", "AROUND"} <= set(hook_type.__members__)
    for name in (*VER.FROZEN_ATTENTION, *VER.ATTENTION_WRAPPERS, *VER.ROLE_TARGETS,
                 VER.FULL_GRAPH_BACKEND, VER.POOL_CONFIG, VER.CONFIG_MERGER):
        assert pkgutil.resolve_name(name) is not None, name
    for cls, fields in VER.ATTENTION_WRAPPERS.items():  # the attributes routing backends keep
        source = inspect.getsource(pkgutil.resolve_name(cls).__init__)
        assert all(f"self.{f} =" in source for f in fields), (cls, fields)
    for cls in VER.FROZEN_ATTENTION:
        assert attention.metadata_api(object.__new__(pkgutil.resolve_name(cls)), VER) == "current"
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    assert VER.HEALTH_CHECK_PREFIX == HEALTH_CHECK_RID_PREFIX
    assert pkgutil.resolve_name(VER.MODELS_PACKAGE).__path__
    assert VER.DISABLED_ARCHS_ENV in inspect.getsource(
        pkgutil.resolve_name(f"{VER.MODELS_PACKAGE}.registry"))
    # every field the rules read is a field here; the ones the release lacks are not
    fields = VER.server_args_fields(ServerArgs)
    assert set(rules.fields_read(VER)) <= fields
    assert not set(VER.ABSENT_FIELDS) & fields
    # each resolution step is one SGLang lets a plugin wrap (checked without registering)
    for step, _, _ in VER.RESOLUTION_STEPS:
        assert callable(VER.step_registrar(step))
    # 0.5.17 has no steps; 0.5.23's register_resolution_hook names the unknown one
    with pytest.raises(ValueError, match="'no_such_step'"):
        VER.step_registrar("no_such_step")


def test_an_unknown_release_is_a_one_line_fatal_naming_the_supported_ones(fresh, tmp_path):
    fresh.setenv(state.CONFIG_ENV, _write_config(tmp_path, "save"))
    fresh.setattr(sglang, "__version__", "0.5.24")
    with pytest.raises(SystemExit) as e:
        sgl_plugins.load_plugins()
    msg = _one_line_fatal(e)
    assert "SGLang 0.5.24 is not supported; this vitrify supports SGLang 0.5.17, 0.5.23" in msg
    assert _our_hooks() == [] and _our_steps() == [] and not state.STATE.registered


# ------------------------------------------------------------------------------------------
# registration and the argument seam
# ------------------------------------------------------------------------------------------

def test_registration_through_sglangs_loader_applies_the_rules_where_sglang_resolves(
        fresh, tmp_path, tiny_model, caplog):
    fresh.setenv(state.CONFIG_ENV, _write_config(tmp_path, "save"))
    sgl_plugins.load_plugins()
    fresh.setattr(sgl_plugins, "_plugins_loaded", False)
    sgl_plugins.load_plugins()  # a second load in the same process (Engine does this)
    assert state.STATE.registered and state.STATE.role == "launcher"
    assert state.STATE.sglang_version == VER.VERSION and state.STATE.version is VER
    hooks, steps = _our_hooks(), _our_steps()
    assert [(t, ht.name) for t, ht, _ in hooks] == \
        [(VER.HOOK_TARGETS[key], kind) for key, kind, _ in VER.argument_hooks(rules.run_phase)] + \
        [(VER.HOOK_TARGETS["wait_and_warmup"], "AROUND")]  # SAVE's shape sweep (P19)
    assert [s for s, _ in steps] == [s for s, _, _ in VER.RESOLUTION_STEPS]  # once each
    assert len(hooks) + len(steps) >= 1
    with caplog.at_level(logging.INFO, logger="vitrify.sglang"):
        args = resolved(tiny_model, attention_backend="triton", random_seed=1)
    get = VER.reader(args)
    assert get("cuda_graph_config").prefill.backend == "disabled"
    assert get("cuda_graph_backend_prefill") == "disabled"
    assert state.STATE.fingerprint == rules.fingerprint(args) and \
        state.STATE.fingerprint["model_path"] == tiny_model
    said = [r.getMessage() for r in caplog.records if r.name == "vitrify.sglang"]
    assert sum("prefill CUDA graphs" in m for m in said) == 1, said
    # the explicit JSON outranks every flag in SGLang's parser: it is turned off too, and the
    # decode phase it names stays as asked
    args = resolved(tiny_model, attention_backend="triton", random_seed=1,
                    cuda_graph_config={"prefill": {"backend": "breakable"},
                                       "decode": {"backend": "disabled"}})
    cg = VER.reader(args)("cuda_graph_config")
    assert (cg.prefill.backend, cg.decode.backend) == ("disabled", "disabled")
    assert state.STATE.prefill_graphs_were is not None  # the first record's (CPU: its default)


def test_the_fingerprint_is_a_function_of_the_resolved_arguments(fresh, tmp_path, tiny_model):
    fresh.setenv(state.CONFIG_ENV, _write_config(tmp_path, "save"))
    sgl_plugins.load_plugins()
    args = resolved(tiny_model, **SHAPED)
    fp = state.STATE.fingerprint
    assert set(fp) == set(rules.FINGERPRINT_ARGS) | {
        "cuda_graph_decode_backend", "cuda_graph_decode_max_bs", "cuda_graph_decode_bs",
        "cuda_graph_prefill_backend"}
    assert (fp["dtype"], fp["random_seed"], fp["context_length"], fp["max_running_requests"],
            fp["chunked_prefill_size"], fp["attention_backend"], fp["page_size"],
            fp["tp_size"]) == ("float16", 7, 256, 8, 1024, "triton", 16, 1)
    assert fp["cuda_graph_decode_bs"] == [1, 2, 4] and fp["cuda_graph_decode_max_bs"] == 4
    assert (fp["cuda_graph_decode_backend"], fp["cuda_graph_prefill_backend"]) == \
        ("full", "disabled")
    assert json.loads(json.dumps(fp)) == fp
    # values the operator left unset are the resolved ones, not the raw input (0.5.23 keeps
    # None in the fields: page_size resolves to 1, chunked_prefill_size to a size)
    plain = resolved(tiny_model, attention_backend="triton", random_seed=1)
    fp2 = state.STATE.fingerprint
    assert fp2["page_size"] == 1 and isinstance(fp2["chunked_prefill_size"], int)
    assert fp2["cuda_graph_decode_max_bs"] and fp2["cuda_graph_decode_bs"]
    assert rules.fingerprint(plain) == fp2 and rules.fingerprint(args) == fp
    out = os.environ.get("VITRIFY_RELEASE_OUT")
    if out:  # for test_sglang_versions.py's comparison of the releases
        Path(out).write_text(json.dumps({"version": VER.VERSION, "fingerprint": fp,
                                         "engine": freeze.Engine(fp, VER.VERSION).fingerprint()}))


@pytest.mark.parametrize("kw, words", [
    ({"tp_size": 2}, ["tp_size=2 (--tp-size): only one GPU"]),
    ({"dp_size": 2}, ["dp_size=2 (--dp-size)"]),
    ({"enable_memory_saver": True}, ["enable_memory_saver=True (--enable-memory-saver)"]),
    ({"speculative_algorithm": "EAGLE"}, ["speculative_algorithm='EAGLE'",
                                          "speculative decoding is not frozen yet"]),
])
def test_refused_arguments_stop_the_resolution_in_one_line(fresh, tmp_path, tiny_model, kw,
                                                           words):
    fresh.setenv(state.CONFIG_ENV, _write_config(tmp_path, "save"))
    sgl_plugins.load_plugins()
    with pytest.raises(SystemExit) as e:
        resolved(tiny_model, attention_backend="triton", random_seed=1, **kw)
    msg = _one_line_fatal(e)
    assert "mode 'save' cannot freeze these server arguments yet" in msg
    for w in words:
        assert w in msg, msg
    assert state.STATE.fingerprint is None


def test_the_releases_own_refusals_are_named(fresh, tmp_path, tiny_model):
    """0.5.23: attn_dp_size > 1, startup_weight_load_mode overlap, the SGLANG_ENABLE_* switches
    that add graphs or allocations vitrify's backend does not own (0.5.17 has none of them)."""
    fresh.setenv(state.CONFIG_ENV, _write_config(tmp_path, "save"))
    sgl_plugins.load_plugins()
    own = {field: flag for field, flag, _, _ in VER.EXTRA_REFUSED}
    env = VER.REFUSED_ENV
    if not own and not env:
        assert VER.VERSION == "0.5.17" and VER.refused_env({"SGLANG_ENABLE_GRAPH_POOL_BORROW":
                                                            "1"}) == []
        return
    assert set(own) == {"attn_dp_size", "startup_weight_load_mode"}
    with pytest.raises(SystemExit) as e:  # attn_dp_size needs tp_size >= 2 to resolve at all
        resolved(tiny_model, attention_backend="triton", random_seed=1, tp_size=2,
                 attn_dp_size=2)
    assert "attn_dp_size=2 (--attn-dp-size)" in _one_line_fatal(e)
    with pytest.raises(SystemExit) as e:
        resolved(tiny_model, attention_backend="triton", random_seed=1,
                 startup_weight_load_mode="overlap")
    assert "startup_weight_load_mode='overlap' (--startup-weight-load-mode): the weights " \
           "arrive after the decode graphs are captured" in _one_line_fatal(e)
    assert set(env) == {"SGLANG_ENABLE_METADATA_GLUE_GRAPH", "SGLANG_ENABLE_GRAPH_POOL_PRECARVE",
                        "SGLANG_ENABLE_GRAPH_POOL_BORROW", "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"}
    from sglang.srt.environ import envs

    for name in env:
        fresh.setenv(name, "True")
        assert getattr(envs, name).get() is True  # SGLang reads it as on
        with pytest.raises(SystemExit) as e:
            resolved(tiny_model, attention_backend="triton", random_seed=1)
        assert f"{name}='True' (" in _one_line_fatal(e)
        fresh.setenv(name, "0")
        assert getattr(envs, name).get() is False and VER.refused_env(os.environ) == []
        fresh.delenv(name)


def test_load_reads_no_checkpoint_where_the_dummy_loader_builds_the_same(fresh, tmp_path,
                                                                          tiny_model, caplog):
    fresh.setenv(state.CONFIG_ENV, _write_config(tmp_path, "load"))
    sgl_plugins.load_plugins()
    with caplog.at_level(logging.INFO, logger="vitrify.sglang"):
        args = resolved(tiny_model, attention_backend="triton", random_seed=1)
    assert VER.reader(args)("load_format") == "dummy"
    assert "load_format" not in state.STATE.fingerprint
    assert "the checkpoint is not read (load_format was auto)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vitrify.sglang"):
        args = resolved(tiny_model, attention_backend="triton", random_seed=1,
                        kv_cache_dtype="fp8_e4m3")
    assert VER.reader(args)("load_format") == "auto"
    assert "kv_cache_dtype='fp8_e4m3' (scales come from the weights)" in caplog.text


def test_dummy_model_paths_pass_the_rules_too(fresh, tmp_path):
    """model_path "dummy" (SGLang's helpers): 0.5.23 stops resolving early, 0.5.17 before the
    graph config; the refusals and the fingerprint still apply."""
    fresh.setenv(state.CONFIG_ENV, _write_config(tmp_path, "save"))
    sgl_plugins.load_plugins()
    with pytest.raises(SystemExit) as e:
        sa = ServerArgs(model_path="dummy", tp_size=2)
        if hasattr(sa, "resolve_once"):
            sa.resolve_once()
    assert "tp_size=2" in _one_line_fatal(e)
    sa = ServerArgs(model_path="dummy")
    if hasattr(sa, "resolve_once"):
        sa.resolve_once()
    fp = state.STATE.fingerprint
    assert fp["model_path"] == "dummy" and fp["cuda_graph_prefill_backend"] == "disabled"
    assert VER.reader(sa)("cuda_graph_backend_prefill") == "disabled"


# ------------------------------------------------------------------------------------------
# the scheduler's side: a spawned child with the pickled record
# ------------------------------------------------------------------------------------------

def scheduler_child(records, mode, config_path, conn):
    """A stand-in scheduler (spawned, as SGLang starts them): loads the plugin, publishes each
    pickled record as a scheduler does and runs the plugin's scheduler-side rules on it."""
    out = []
    try:
        os.environ[state.CONFIG_ENV] = config_path
        from sglang.srt import plugins as child_plugins
        from sglang.srt import runtime_context as rc

        child_plugins.load_plugins()
        ver = versions.current()
        role = ver.process_role()  # this function is not SGLang's scheduler: a launcher
        mine = f"{scheduler_child.__module__}.{scheduler_child.__qualname__}"
        roles = (role, versions.process_role_from({mine: "scheduler"}))
        for sa in records:
            kw = {}
            if "ranks" in inspect.signature(rc.publish).parameters:
                kw["ranks"] = rc.SpawnRanks(world_rank=0, dp_rank=None, gpu_id=3)
            rc.publish(sa, role="scheduler", **kw)
            try:
                fp = rules.at_scheduler(sa, mode, ver)
                rules.check_supported(sa, ver, ver.scheduler_reader(sa))
            except SystemExit as e:
                out.append({"fatal": str(e)})
                continue
            out.append({"fingerprint": fp,
                        "prefill": rc.get_exec().graph.cuda_graph_config.prefill.backend,
                        "load_format": rc.get_model().load_format,
                        "gpu": ver.scheduler_gpu(types.SimpleNamespace())})
        conn.send({"roles": roles, "records": out})
    except BaseException as e:  # reported to the parent
        import traceback

        conn.send({"error": traceback.format_exc()})


def test_what_vitrify_changed_reaches_a_spawned_scheduler(fresh, tmp_path, tiny_model):
    config = _write_config(tmp_path, "load")
    fresh.setenv(state.CONFIG_ENV, config)
    sgl_plugins.load_plugins()
    hooked = resolved(tiny_model, attention_backend="triton", random_seed=1)
    launcher_fp = state.STATE.fingerprint
    # a record SGLang resolved without the plugin's rules (the plugin loaded afterwards)
    cfg, state.STATE.config = state.STATE.config, None
    try:
        bare = resolved(tiny_model, attention_backend="triton", random_seed=1)
    finally:
        state.STATE.config = cfg
    assert VER.reader(bare)("load_format") == "auto"
    pickle.dumps(hooked)  # what SGLang hands the scheduler process
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=scheduler_child, args=([hooked, bare], "load", config, child))
    p.start()
    try:
        assert parent.poll(300), "the scheduler child answered nothing"
        got = parent.recv()
    finally:
        p.join(60)
    assert "error" not in got, got.get("error")
    assert got["roles"] == ("launcher", "scheduler")
    first, second = got["records"]
    assert first == {"fingerprint": launcher_fp, "prefill": "disabled", "load_format": "dummy",
                     "gpu": first["gpu"]}, first
    if VER.SCHEDULER_REAPPLIES:  # 0.5.17: the scheduler applies the rules itself
        assert second["fingerprint"] == launcher_fp and second["load_format"] == "dummy"
    else:  # 0.5.23: read only; the missing change is named
        assert first["gpu"] == 3  # runtime_context.get_device().gpu_id (scheduler.ps is gone)
        msg = second["fatal"]
        assert msg.startswith(PREFIX) and "\n" not in msg
        assert "this scheduler's server arguments lack what vitrify changes (load_format: " \
               "'auto', where vitrify's rule makes it 'dummy'" in msg
        assert "without the plugin's resolution hooks" in msg


def test_the_standby_waits_before_the_scheduler_touches_the_gpu(tmp_path):
    """The standby point is registered where the release sets the device: 0.5.17 inside
    init_model_worker (ModelRunner.__init__), 0.5.23 in bootstrap.init_parallel_runtime,
    called from Scheduler.__init__ before init_model_worker."""
    from vitrify.integrations.sglang.config import PluginConfig

    (tmp_path / "a").mkdir()
    cfg = PluginConfig(mode="load", archive=str(tmp_path / "a"), region_bytes=1 << 30,
                       standby_file=str(tmp_path / "go"))
    targets = [t for t, _, _ in plugin.hooks_for(cfg, "scheduler", VER)]
    standby = VER.HOOK_TARGETS[VER.STANDBY_TARGET]
    assert standby in targets
    assert targets.index(standby) <= targets.index(VER.HOOK_TARGETS["init_model_worker"])
    source = inspect.getsource(pkgutil.resolve_name(f"{VER.SCHEDULER_MODULE}.Scheduler"))
    if VER.STANDBY_TARGET == "init_parallel_runtime":
        init = source[source.index("def __init__"):]
        assert init.index("bootstrap.init_parallel_runtime(") < init.index(
            "self.init_model_worker()")
        no_standby = PluginConfig(mode="load", archive=str(tmp_path / "a"), region_bytes=1)
        assert standby not in [t for t, _, _ in plugin.hooks_for(no_standby, "scheduler", VER)]


def test_a_standby_scheduler_refuses_or_waits_before_the_parallel_runtime(tmp_path,
                                                                         monkeypatch):
    """around_init_parallel_runtime (0.5.23's standby point; on 0.5.17 the same steps run in
    init_model_worker): an archive of another release is refused before the wait, or starts
    cold after the go with on_mismatch = "cold-start"; SGLang's call runs after."""
    from vitrify import archive
    from vitrify.integrations.sglang.config import PluginConfig

    other = next(v for v in versions.SUPPORTED if v != VER.VERSION)
    path = tmp_path / "other.vitrify"
    fp = {"model_path": "/m/tiny"}
    engine = freeze.Engine(fp, other).fingerprint()  # this machine, the other release
    with archive.ArchiveWriter(str(path), archive.Fingerprint.current(**engine),
                               archive.Region(0x600000000000, 1 << 30, 2 << 20)) as w:
        w.write_json("rank0/state.json", {"engine": {}})
    monkeypatch.setattr(rules, "at_scheduler", lambda args, mode, ver=None: fp)
    monkeypatch.setattr(rules, "check_supported", lambda *a, **k: None)
    monkeypatch.setattr(freeze, "scheduler_gpu", lambda scheduler: 0)
    calls = []
    original = lambda **kw: calls.append(sorted(kw)) or "ran"  # noqa: E731
    for on_mismatch in ("refuse", "cold-start"):
        cfg = PluginConfig(mode="load", archive=str(path), region_bytes=1 << 30,
                           standby_file=str(tmp_path / "go"), on_mismatch=on_mismatch)
        monkeypatch.setattr(state, "STATE", state.PluginState(config=cfg, version=VER,
                                                              sglang_version=VER.VERSION))
        if on_mismatch == "refuse":
            with pytest.raises(SystemExit) as e:
                freeze.around_init_parallel_runtime(original, server_args=object(),
                                                    device="cpu", dist_port=1)
            msg = _one_line_fatal(e)
            assert f"sglang-{VER.VERSION}/" in msg and f"sglang-{other}/" in msg
            assert calls == [] and not (tmp_path / "go").exists()
            continue
        (tmp_path / "go").touch()  # the operator's go
        assert freeze.around_init_parallel_runtime(original, server_args=object(),
                                                   device="cpu", dist_port=1) == "ran"
        assert calls == [["device", "dist_port", "server_args"]]
        assert state.STATE.before.cold and state.STATE.before.standby_done


@pytest.mark.skipif(not os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA"),
                    reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
def test_save_then_load_through_the_hooks_with_this_releases_classes(tmp_path):
    """The scheduler hooks' whole sequence (sglang_freeze_worker.py, fresh processes on the
    fake driver) with this release's MemoryPoolConfig, attention classes and freeze_gc: SAVE
    writes the archive at the first idle loop after its requests, LOAD restores the weights
    and sizes the pool as SAVE did, checkpoints equal."""
    import subprocess
    import sys

    def worker(mode):
        env = dict(os.environ, VITRIFY_LIBCUDA_PATH=os.environ["VITRIFY_TEST_FAKE_LIBCUDA"],
                   FAKE_CUDA_DEVICES="1", XDG_CACHE_HOME=str(tmp_path / "xdg"))
        p = subprocess.run([sys.executable, str(Path(__file__).with_name(
            "sglang_freeze_worker.py")), mode, str(tmp_path), "{}"], capture_output=True,
            text=True, timeout=300, env=env)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        assert lines, f"{mode} printed no result (rc {p.returncode}):\n{p.stderr[-3000:]}"
        out = json.loads(lines[-1])
        assert out["ok"], out.get("traceback")
        return out

    save = worker("save")
    assert save["requests"] == 2 and save["summary"]["graphs"] == 0
    assert save["span_files"] == ["rank0/region/weights.span"]
    load = worker("load")
    assert load["weights"] == save["weights"] and load["pool_config"] == save["pool_config"]
    assert load["checkpoints"] == save["summary"]["checkpoints"] and load["profiled"] is True


# ------------------------------------------------------------------------------------------
# roles, graphs, attention, warm-up
# ------------------------------------------------------------------------------------------

def test_the_launcher_is_no_scheduler_even_with_the_scheduler_imported():
    import importlib

    importlib.import_module(VER.SCHEDULER_MODULE)
    assert VER.process_role() == "launcher"
    assert all(pkgutil.resolve_name(t).__qualname__ == t.rpartition(".")[2]
               for t in VER.ROLE_TARGETS)


def test_the_graph_backend_forgets_its_shapes_without_resetting_graphs_it_does_not_own():
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    cls = graphs.graph_backend_class()
    assert issubclass(cls, graphs.full_graph_backend())
    for which in (cls, graphs.full_graph_backend()):
        b = object.__new__(which)
        b._graphs, b._outputs, b._pool = {ShapeKey(1): "decode_bs1"}, {ShapeKey(1): ()}, 7
        b._output_buffer = object()
        if which is cls:  # LOAD keeps archive names here: cleanup clears them
            b.cleanup()
            assert b._graphs == {} and b._outputs == {} and b._pool is None
        elif "reset" in inspect.getsource(which.cleanup):  # 0.5.23's resets each graph
            with pytest.raises(AttributeError, match="'str' object has no attribute 'reset'"):
                b.cleanup()


def test_graph_names_tell_every_field_of_sglangs_shape_key_apart():
    import dataclasses

    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    fields = [f.name for f in dataclasses.fields(ShapeKey)]
    assert graphs.graph_name(ShapeKey(8)) == "decode_bs8"
    assert graphs.graph_name(ShapeKey(8, stream_idx=1, variant_label="a/b c")) == \
        "decode_bs8_s1_a-b-c"
    if "attention_variant" in fields:  # 0.5.23: DSA dense/sparse variants of one size
        names = {graphs.graph_name(ShapeKey(8, attention_variant=v))
                 for v in (None, "dense", "sparse")}
        assert names == {"decode_bs8", "decode_bs8+attn-dense", "decode_bs8+attn-sparse"}
        assert graphs.graph_name(ShapeKey(8, variant_label="attn-dense")) not in names
    assert set(fields) <= {"size", "stream_idx", "variant_label", "attention_variant"}


def test_attention_backends_are_found_inside_this_releases_routing_backends(tiny_model):
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.attention.trtllm_mha_backend import TRTLLMHAAttnBackend
    from sglang.srt.runtime_context import publish

    publish(resolved(tiny_model, attention_backend="triton", random_seed=1), role="test")

    def leaf(cls):
        b = object.__new__(cls)
        b.needs_cpu_seq_lens, b.token_to_kv_pool, b.req_to_token_pool = True, "kv", "req"
        return b

    runner = types.SimpleNamespace(
        kv_cache_dtype="bfloat16", token_to_kv_pool="kv", req_to_token_pool="req",
        kv_index_translator=None, model_config=types.SimpleNamespace(context_len=4096),
        server_args=types.SimpleNamespace(speculative_attention_mode="prefill"))
    a, b = leaf(TritonAttnBackend), leaf(TritonAttnBackend)
    split = HybridAttnBackend(runner, prefill_backend=a, decode_backend=b)
    tbo = TboAttnBackend(primary=split, children=[leaf(TritonAttnBackend)])
    assert [w for w, _ in attention.attention_leaves(tbo)] == [
        "attn_backend.primary.prefill_backend", "attn_backend.primary.decode_backend",
        "attn_backend.children[0]"]
    assert attention.check_attention(tbo) == ["triton"] * 3
    with pytest.raises(state.FreezeRefused, match="attn_backend is TRTLLMHAAttnBackend"):
        attention.check_attention(leaf(TRTLLMHAAttnBackend))


def test_the_scheduler_reads_the_decode_backend_where_the_runtime_reads_it(tiny_model):
    """0.5.23's resolve_decode_backend reads the published graph config (a runtime override
    there counts); 0.5.17's reads the record."""
    import copy

    from sglang.srt.runtime_context import get_context, publish

    args = resolved(tiny_model, attention_backend="triton", random_seed=1,
                    cuda_graph_backend_decode="breakable")
    publish(args, role="test")
    problems = rules.unsupported(args, VER, VER.scheduler_reader(args))
    assert "decode graph backend 'breakable' (only ['full', 'disabled'])" in problems
    ok = resolved(tiny_model, attention_backend="triton", random_seed=1)
    publish(ok, role="test")
    assert rules.unsupported(ok, VER, VER.scheduler_reader(ok)) == []
    other = copy.deepcopy(VER.published_graph_config())
    other.decode.backend = "breakable"
    get_context().override("test", cuda_graph_config=other)  # the bag only, not the record
    assert VER.reader(ok)("cuda_graph_config").decode.backend == "full"
    source = inspect.getsource(pkgutil.resolve_name(VER.HOOK_TARGETS["resolve_decode_backend"]))
    problems = rules.unsupported(ok, VER, VER.scheduler_reader(ok))
    if "get_exec().graph.cuda_graph_config" in source:  # what the runtime reads, read here
        assert "decode graph backend 'breakable' (only ['full', 'disabled'])" in problems
    else:
        assert "model_runner.server_args.cuda_graph_config" in source and problems == []


def _generate_server():
    """A local HTTP server answering every POST with a JSON body; the bodies it was sent."""
    import http.server
    import threading

    seen = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"text": "x"}')

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


def test_the_warm_up_requests_reach_the_server_with_this_releases_arguments(
        tiny_model, monkeypatch, caplog):
    """LOAD's warm-up requests (startup.warm_up) on a real resolved record of this release:
    its URL, API key, DP size and TLS setting read the way the release keeps them (0.5.23 has no
    ServerArgs.ssl_verify(): the requests were skipped with a warning)."""
    from vitrify.integrations.sglang import startup
    from vitrify.integrations.sglang.config import PluginConfig

    srv, seen = _generate_server()
    try:
        args = resolved(tiny_model, attention_backend="triton", random_seed=1,
                        host="127.0.0.1", port=srv.server_address[1])
        assert VER.ssl_verify(args) is True and VER.api_key(args) is None
        cfg = PluginConfig(mode="load", archive=str(tiny_model), region_bytes=1 << 30,
                           warmup_requests=2)
        monkeypatch.setattr(state, "STATE", state.PluginState(config=cfg, version=VER))
        monkeypatch.setattr(state, "archive_engine_state",
                            lambda path=None: {"request_lengths": [5, 40]})
        monkeypatch.setattr(VER, "launcher_status", lambda: (None, None))
        with caplog.at_level(logging.INFO, logger="vitrify.sglang"):
            assert startup.warm_up(True, args) is True
    finally:
        srv.shutdown()
    assert "warm-up requests failed" not in caplog.text, caplog.text
    assert [len(b["input_ids"]) for b in seen] == [5, 40]
    assert "LOAD warm-up: 2 request(s) of 5, 40 tokens" in caplog.text


def test_saves_shape_sweep_reads_this_releases_limits_and_reaches_the_server(
        tiny_model, monkeypatch, caplog):
    """SAVE's shape sweep (sweep.run, P19) on a real resolved record of this release: the page
    size, chunked-prefill size, request limit and --skip-server-warmup read the way the release
    keeps them; every request of the sweep carries the sweep's ids, the end one last."""
    import enum

    from vitrify.integrations.sglang import sweep
    from vitrify.integrations.sglang.config import PluginConfig

    srv, seen = _generate_server()
    Status = enum.Enum("ServerStatus", "Up Starting")
    tm = types.SimpleNamespace(server_status=Status.Up, max_req_input_len=300,
                               model_config=types.SimpleNamespace(context_len=512, vocab_size=900))
    try:
        args = resolved(tiny_model, attention_backend="triton", random_seed=1, page_size=16,
                        chunked_prefill_size=256, max_running_requests=12,
                        host="127.0.0.1", port=srv.server_address[1])
        cfg = PluginConfig(mode="save", archive=str(tiny_model), region_bytes=1 << 30)
        monkeypatch.setattr(state, "STATE", state.PluginState(config=cfg, version=VER))
        monkeypatch.setattr(VER, "launcher_status", lambda: (tm, Status))
        assert sweep.limits(args, tm) == sweep.Limits(max_input=300, max_batch=12, page=16,
                                                      chunk=256, vocab=900)
        with caplog.at_level(logging.INFO, logger="vitrify.sglang"):
            assert sweep.run(True, args) is True
        skipped = resolved(tiny_model, attention_backend="triton", random_seed=1,
                           skip_server_warmup=True)
        assert sweep.expected(args) and not sweep.expected(skipped)
    finally:
        srv.shutdown()
    assert "failed" not in caplog.text and "SAVE shape sweep:" in caplog.text, caplog.text
    rids = [r for b in seen for r in ([b["rid"]] if isinstance(b["rid"], str) else b["rid"])]
    assert all(r.startswith(sweep.RID_PREFIX) for r in rids)
    assert seen[-1]["rid"].startswith(sweep.END_RID_PREFIX) and len(seen) == \
        len(sweep.plan(sweep.limits(args, tm))) + 1
    assert max(len(b["input_ids"]) for b in seen if isinstance(b["input_ids"][0], int)) == 300
    assert tm.server_status is Status.Up


def test_sglangs_other_processes_register_nothing(fresh, tmp_path, monkeypatch):
    """0.5.23's detokenizer and DP controller call load_plugins() too: the config is read,
    nothing else (no hook, no resolution step, no read-ahead, no registry narrowing)."""
    from vitrify.integrations.sglang import startup

    (tmp_path / "archive").mkdir()
    fresh.setenv(state.CONFIG_ENV, _write_config(tmp_path, "load"))
    fresh.delenv(startup.READ_AHEAD_ENV, raising=False)
    fresh.delenv(VER.DISABLED_ARCHS_ENV, raising=False)
    for role in ("detokenizer", "dp_controller"):
        fresh.setattr(state, "STATE", state.PluginState())
        fresh.setattr(sgl_plugins, "_plugins_loaded", False)
        fresh.setattr(VER, "process_role", lambda role=role: role)
        sgl_plugins.load_plugins()
        assert state.STATE.registered and state.STATE.role == role
        assert state.STATE.config.mode == "load" and state.STATE.opened == {}
        assert _our_hooks() == [] and _our_steps() == []
        assert startup.READ_AHEAD_ENV not in os.environ
        assert VER.DISABLED_ARCHS_ENV not in os.environ


# ------------------------------------------------------------------------------------------
# the command line and archives of another release
# ------------------------------------------------------------------------------------------

def _vitrify(capsys, *argv):
    from vitrify import cli

    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_vitrify_sglang_check_on_this_release(capsys, tmp_path, monkeypatch, tiny_model):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    args = ["--model-path", tiny_model, "--attention-backend", "triton", "--random-seed", "1"]
    rc, out, err = _vitrify(capsys, "sglang", "check", "--", *args)
    assert rc == 0 and err == "", err
    lines = out.splitlines()
    assert lines[0] == (f"vitrify can freeze and thaw this server (SGLang {VER.VERSION}); "
                        f"nothing is refused.")
    assert ("SAVE changes: cuda_graph_backend_prefill None -> 'disabled'; "
            "disable_prefill_cuda_graph False -> True") in lines
    assert any(ln.startswith("LOAD changes: load_format 'auto' -> 'dummy'") for ln in lines)
    rc, _, err = _vitrify(capsys, "sglang", "check", "--", *args, "--tp-size", "2")
    assert rc == 1 and "tp_size=2 (--tp-size)" in err and err.count("\n") == 1
    if VER.EXTRA_REFUSED:  # this release's own refusals, before anything starts
        monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "1")
        rc, _, err = _vitrify(capsys, "sglang", "check", "--", *args, "--startup-weight-load-mode",
                              "overlap", "--attn-dp-size", "2")
        assert rc == 1 and err.count("\n") == 1, err
        for words in ("startup_weight_load_mode='overlap' (--startup-weight-load-mode)",
                      "attn_dp_size=2 (--attn-dp-size)", "SGLANG_ENABLE_METADATA_GLUE_GRAPH='1'"):
            assert words in err, (words, err)


def test_an_archive_of_the_other_release_refuses_to_load_naming_both(capsys, tmp_path,
                                                                      monkeypatch, tiny_model):
    import tempfile

    from vitrify import archive

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    other = next(v for v in versions.SUPPORTED if v != VER.VERSION)
    engine = freeze.Engine({"model_path": tiny_model}, other).fingerprint()
    fp = archive.Fingerprint.current(engine=engine["engine"],
                                     engine_version=engine["engine_version"],
                                     model=f"{tiny_model}#args-0123456789abcdef")
    path = tmp_path / "made-elsewhere.vitrify"
    with archive.ArchiveWriter(str(path), fp, archive.Region(0x600000000000, 1 << 30,
                                                             2 << 20)) as w:
        w.write_json("rank0/state.json", {"engine": {}})
    rc, out, err = _vitrify(capsys, "sglang", "load", str(path), "--dry-run", "--",
                            "--model-path", tiny_model, "--attention-backend", "triton",
                            "--random-seed", "1")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "the archive does not match this server" in err and "fingerprint.engine_version" in err
    assert f"sglang-{VER.VERSION}/" in err and f"sglang-{other}/" in err
