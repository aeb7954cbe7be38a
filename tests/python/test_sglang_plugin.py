"""vitrify's SGLang plugin on the CPU (PLUGIN.md invariants P1-P8): the TOML config, the entry
point, registration through SGLang's own HookRegistry and loader, and the ServerArgs hook on real
``ServerArgs`` objects (a tiny local model config, ``device="cpu"``: no GPU, no network).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import types
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

sglang = pytest.importorskip("sglang", reason="the SGLang plugin tests need sglang importable")

from sglang.srt import plugins as sgl_plugins  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from vitrify.integrations.sglang import config as pconfig  # noqa: E402
from vitrify.integrations.sglang import plugin, startup, state, versions  # noqa: E402
from vitrify.integrations.sglang import server_args as rules  # noqa: E402
from vitrify.integrations.sglang.config import PluginConfig, PluginConfigError  # noqa: E402
from vitrify.integrations.sglang.versions import v0_5_17 as v17  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PREFIX = "vitrify SGLang plugin:"
TARGET = v17.HOOK_TARGETS["server_args_post_init"]
# the hook 0.5.17's seam registers after ServerArgs.__post_init__ (the argument rules)
(_, _, after_post_init), = v17.argument_hooks(rules.run_phase)

# A tiny Llama: enough for ServerArgs.__post_init__ to resolve everything on the CPU.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


# ------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(d)


def _server_args(model_path, **kw):
    """A real ServerArgs resolved on the CPU (the plugin's hook is not applied here)."""
    return ServerArgs(model_path=model_path, device="cpu", skip_tokenizer_init=True, **kw)


@pytest.fixture
def fresh(monkeypatch):
    """A clean plugin state and an empty SGLang hook registry (both restored afterwards); the
    config env var and SGLang's plugin allow-list unset."""
    monkeypatch.setattr(state, "STATE", state.PluginState())
    monkeypatch.setattr(HookRegistry, "_hooks", collections.defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.delenv(state.CONFIG_ENV, raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    # register() sets these in os.environ (the JIT caches, P10): restored afterwards
    for var in ("TRITON_CACHE_DIR", "TVM_FFI_CACHE_DIR", startup.JIT_ROOT_ENV,
                startup.READ_AHEAD_ENV):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    # apply_hooks() patches ServerArgs.__post_init__; put the original back after the test.
    monkeypatch.setattr(ServerArgs, "__post_init__", ServerArgs.__dict__["__post_init__"])
    return monkeypatch


def _write(path: Path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def save_config(tmp_path):
    return _write(tmp_path / "vitrify.toml", f"""
        mode = "save"
        archive = "{tmp_path / 'archive'}"
        region_bytes = "2GiB"
        """)


def _active(mode="save", tmp=None):
    return PluginConfig(mode=mode, archive=str(tmp or "/tmp/a"), region_bytes=1 << 30)


def _our_hooks():
    return [(t, ht, fn) for t, hooks in HookRegistry._hooks.items() for ht, fn, _ in hooks
            if getattr(fn, "__module__", "").startswith("vitrify.")]


def _one_line_fatal(excinfo) -> str:
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, SystemExit)
    assert msg.startswith(PREFIX), msg
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------------------------
# config (P5)
# ------------------------------------------------------------------------------------------

def test_config_good_file(tmp_path):
    arch = tmp_path / "arch"
    arch.mkdir()
    path = _write(tmp_path / "c.toml", f"""
        mode = "load"
        archive = "{arch}"
        region_bytes = 68719476736
        on_mismatch = "cold-start"
        prefill_graphs = "disabled"
        """)
    cfg = pconfig.load(path)
    assert cfg == PluginConfig(mode="load", archive=str(arch), region_bytes=64 << 30,
                               on_mismatch="cold-start", prefill_graphs="disabled", source=path,
                               jit_dir=cfg.jit_dir)
    assert cfg.active and cfg.jit_caches and cfg.jit_dir


def test_config_defaults_and_save_parent(tmp_path):
    cfg = pconfig.from_mapping({"mode": "save", "archive": str(tmp_path / "new"),
                                "region_bytes": "512MiB"})
    assert (cfg.on_mismatch, cfg.prefill_graphs, cfg.region_bytes) == ("refuse", "disabled",
                                                                       512 << 20)
    assert cfg.archive == str(tmp_path / "new")


def test_config_request_counts(tmp_path):
    cfg = pconfig.from_mapping({"mode": "save", "archive": str(tmp_path / "new"),
                                "region_bytes": "512MiB"})
    assert (cfg.save_after_requests, cfg.warmup_requests) == (1, 8)
    cfg = pconfig.from_mapping({"mode": "save", "archive": str(tmp_path / "new"),
                                "region_bytes": "512MiB", "save_after_requests": 17,
                                "warmup_requests": 0})
    assert (cfg.save_after_requests, cfg.warmup_requests) == (17, 0)


def test_config_is_frozen(tmp_path):
    cfg = pconfig.from_mapping({"mode": "off"})
    with pytest.raises(Exception):
        cfg.mode = "save"
    assert not cfg.active and cfg.archive is None and cfg.region_bytes is None


@pytest.mark.parametrize("value, expected", [
    ("64GiB", 64 << 30), ("64 gib", 64 << 30), ("512MiB", 512 << 20), ("4KiB", 4096),
    ("1TiB", 1 << 40), ("123", 123), ("123B", 123), (4096, 4096), (1, 1),
])
def test_config_sizes(value, expected):
    assert pconfig.parse_size("region_bytes", value) == expected


@pytest.mark.parametrize("value, words", [
    ("64GB", ["'64GB'", "is not a size"]), ("1.5GiB", ["is not a size"]),
    ("", ["is not a size"]), ("-1", ["is not a size"]), ("GiB", ["is not a size"]),
    (0, ["> 0"]), (-5, ["> 0"]), ("0GiB", ["> 0"]), (1 << 63, ["2**63-1"]),
    (True, ["expected an int or a size string", "bool"]),
    (1.5, ["expected an int or a size string", "float", "1.5"]),
    ([1], ["expected an int or a size string", "list"]),
])
def test_config_bad_sizes(value, words):
    with pytest.raises(PluginConfigError) as e:
        pconfig.from_mapping({"mode": "off", "region_bytes": value})
    msg = str(e.value)
    assert "'region_bytes'" in msg and "\n" not in msg
    for w in words:
        assert w in msg, msg


def _bad(tmp_path, **over):
    base = {"mode": "save", "archive": str(tmp_path / "a"), "region_bytes": "1GiB"}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize("over, words", [
    ({"mode": None}, ["'mode' is required"]),
    ({"mode": "freeze"}, ["'mode'", "'freeze'", "not one of", "save"]),
    ({"mode": 1}, ["'mode'", "expected a string", "int", "1"]),
    ({"archive": None}, ["'archive' is required", "'save'"]),
    ({"archive": 7}, ["'archive'", "expected a non-empty path string", "int", "7"]),
    ({"archive": ""}, ["'archive'", "non-empty"]),
    ({"region_bytes": None}, ["'region_bytes' is required"]),
    ({"on_mismatch": "ignore"}, ["'on_mismatch'", "'ignore'", "refuse", "cold-start"]),
    ({"on_mismatch": False}, ["'on_mismatch'", "expected a string", "bool"]),
    ({"prefill_graphs": "breakable"}, ["'prefill_graphs'", "'breakable'",
                                       "prefill CUDA graphs are not frozen yet"]),
    ({"prefill_graphs": 0}, ["'prefill_graphs'", "expected", "int"]),
    ({"save_after_requests": 0}, ["'save_after_requests'", "between 1 and"]),
    ({"save_after_requests": "3"}, ["'save_after_requests'", "expected an int", "str"]),
    ({"save_after_requests": True}, ["'save_after_requests'", "expected an int", "bool"]),
    ({"warmup_requests": 65}, ["'warmup_requests'", "between 0 and 64", "65"]),
    ({"warmup_requests": -1}, ["'warmup_requests'", "between 0 and 64"]),
    ({"warmup_requests": 2.0}, ["'warmup_requests'", "expected an int", "float"]),
])
def test_config_bad_fields(tmp_path, over, words):
    with pytest.raises(PluginConfigError) as e:
        pconfig.from_mapping(_bad(tmp_path, **over))
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_config_unknown_keys(tmp_path):
    with pytest.raises(PluginConfigError) as e:
        pconfig.from_mapping(_bad(tmp_path, regoin_bytes=1, zeta=2))
    assert "['regoin_bytes', 'zeta']" in str(e.value)


def test_config_error_is_value_error():
    assert issubclass(PluginConfigError, ValueError)


def test_config_load_archive_must_exist(tmp_path):
    with pytest.raises(PluginConfigError, match="does not exist"):
        pconfig.from_mapping(_bad(tmp_path, mode="load", archive=str(tmp_path / "nope")))
    (tmp_path / "file").write_text("x")
    with pytest.raises(PluginConfigError, match="is not a directory"):
        pconfig.from_mapping(_bad(tmp_path, mode="load", archive=str(tmp_path / "file")))


def test_config_save_parent(tmp_path, monkeypatch):
    with pytest.raises(PluginConfigError, match="parent directory .* does not exist"):
        pconfig.from_mapping(_bad(tmp_path, archive=str(tmp_path / "no" / "arch")))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):  # root may write anyway: make the check see it read-only
            real = os.access
            monkeypatch.setattr(os, "access",
                                lambda p, m: False if str(p) == str(ro) else real(p, m))
        with pytest.raises(PluginConfigError, match="is not writable"):
            pconfig.from_mapping(_bad(tmp_path, archive=str(ro / "arch")))
    finally:
        ro.chmod(0o755)


def test_config_file_errors(tmp_path):
    with pytest.raises(PluginConfigError, match="cannot read config file"):
        pconfig.load(str(tmp_path / "missing.toml"))
    bad = _write(tmp_path / "bad.toml", 'mode = "save\n')
    with pytest.raises(PluginConfigError, match="is not valid TOML") as e:
        pconfig.load(bad)
    assert "\n" not in str(e.value)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'mode = "save"\narchive = "/tmp/\xff"\n')  # not UTF-8
    with pytest.raises(PluginConfigError, match="is not UTF-8 text"):
        pconfig.load(str(latin))
    unknown = _write(tmp_path / "u.toml", 'mode = "off"\nextra = 1\n')
    with pytest.raises(PluginConfigError, match=r"u\.toml: unknown config key\(s\) \['extra'\]"):
        pconfig.load(unknown)


def test_config_python310_without_tomli(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "version_info", (3, 10, 0))
    monkeypatch.setitem(sys.modules, "tomli", None)  # makes `import tomli` fail
    with pytest.raises(PluginConfigError, match="Python >= 3.11 or the 'tomli' package"):
        pconfig.load(_write(tmp_path / "c.toml", 'mode = "off"\n'))


# ------------------------------------------------------------------------------------------
# entry point and registration (P1-P4, P8)
# ------------------------------------------------------------------------------------------

def test_entry_point_declared_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    group = project["entry-points"]["sglang.srt.plugins"]
    assert group == {"vitrify": "vitrify.integrations.sglang.plugin:register"}
    ep = metadata.EntryPoint("vitrify", group["vitrify"], "sglang.srt.plugins")
    assert ep.load() is plugin.register


def test_inert_without_env(fresh):
    assert plugin.register() is None
    assert _our_hooks() == [] and not state.STATE.registered and state.STATE.config is None
    fresh.setenv(state.CONFIG_ENV, "")
    plugin.register()
    assert _our_hooks() == [] and not state.STATE.registered


def test_inert_imports_nothing_heavy():
    """P1 in a fresh interpreter: register() without the env var imports neither sglang nor
    torch, and neither does importing the entry point's module."""
    env = {k: v for k, v in os.environ.items() if k != state.CONFIG_ENV}
    code = ("import sys; from vitrify.integrations.sglang.plugin import register; register(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_register_registers_after_hook(fresh, save_config):
    fresh.setenv(state.CONFIG_ENV, save_config)
    plugin.register()
    # the argument rules, and SAVE's shape sweep after SGLang's warm-up (P19)
    (target, kind, fn), (warm, wkind, wfn) = _our_hooks()
    assert (target, kind, fn.__name__) == (TARGET, HookType.AFTER, "after_server_args_post_init")
    assert (warm, wkind, wfn.__name__) == (v17.HOOK_TARGETS["wait_and_warmup"], HookType.AROUND,
                                           "around_wait_and_warmup")
    assert state.STATE.registered and state.STATE.sglang_version == sglang.__version__
    assert state.STATE.config.mode == "save" and state.STATE.config.region_bytes == 2 << 30


def test_register_idempotent(fresh, save_config):
    fresh.setenv(state.CONFIG_ENV, save_config)
    plugin.register()
    plugin.register()
    assert len(_our_hooks()) == 2


def test_mode_off_registers_nothing_and_skips_version(fresh, tmp_path):
    fresh.setenv(state.CONFIG_ENV, _write(tmp_path / "off.toml", 'mode = "off"\n'))
    fresh.setattr(sglang, "__version__", "9.9.9")
    plugin.register()
    assert _our_hooks() == [] and state.STATE.config.mode == "off"


def test_bad_config_is_fatal(fresh, tmp_path):
    fresh.setenv(state.CONFIG_ENV, _write(tmp_path / "c.toml", 'mode = "save"\nbogus = 1\n'))
    with pytest.raises(SystemExit) as e:
        plugin.register()
    msg = _one_line_fatal(e)
    assert state.CONFIG_ENV in msg and "['bogus']" in msg
    assert _our_hooks() == []


def test_an_unexpected_error_while_registering_is_fatal_too(fresh, save_config):
    """P3: SGLang only logs what a plugin raises, so register() turns any exception into the
    one-line SystemExit (here the registry itself fails)."""
    fresh.setenv(state.CONFIG_ENV, save_config)

    def broken(*a, **k):
        raise RuntimeError("registry exploded")

    from sglang.srt.plugins.hook_registry import HookRegistry

    fresh.setattr(HookRegistry, "register", broken)
    with pytest.raises(SystemExit) as e:
        plugin.register()
    msg = _one_line_fatal(e)
    assert "RuntimeError: registry exploded" in msg


def test_fatal_exit_status_and_message(tmp_path):
    """P3 as an operator sees it: status 1 and the one line on stderr, nothing else."""
    bad = _write(tmp_path / "c.toml", 'mode = "load"\narchive = "/no/such/archive"\n'
                                      'region_bytes = 1\n')
    env = dict(os.environ, **{state.CONFIG_ENV: bad})
    code = "from vitrify.integrations.sglang.plugin import register; register()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(PREFIX), r.stderr
    assert "'/no/such/archive' does not exist" in r.stderr


def test_version_mismatch_is_fatal(fresh, save_config):
    fresh.setenv(state.CONFIG_ENV, save_config)
    fresh.setattr(sglang, "__version__", "0.5.16")
    with pytest.raises(SystemExit) as e:
        plugin.register()
    msg = _one_line_fatal(e)
    assert "SGLang 0.5.16 is not supported" in msg
    for v in versions.SUPPORTED:
        assert v in msg
    assert _our_hooks() == [] and not state.STATE.registered


@pytest.mark.parametrize("bogus", [
    "sglang.srt.server_args.ServerArgs.no_such_method",
    "sglang.srt.no_such_module.some_function",
    "nodots",
])
def test_missing_target_is_fatal_and_nothing_registered(fresh, save_config, bogus):
    """P2: the valid ServerArgs hook comes first in the table, yet nothing is registered."""
    fresh.setenv(state.CONFIG_ENV, save_config)
    fresh.setitem(v17.HOOK_TARGETS, "bogus", bogus)
    fresh.setattr(plugin, "HOOKS", plugin.HOOKS + (plugin.Hook("bogus", "AROUND", lambda f: f,
                                                               roles=("launcher",)),))
    with pytest.raises(SystemExit) as e:
        plugin.register()
    msg = _one_line_fatal(e)
    assert repr(bogus) in msg and f"SGLang {sglang.__version__}" in msg
    assert _our_hooks() == [] and not state.STATE.registered


class _NotAFunction:
    pass


@pytest.mark.parametrize("hook, words", [
    (plugin.Hook("server_args_post_init", "WRAP", lambda r, *a, **k: None, roles=("launcher",)),
     ["hook kind 'WRAP'"]),
    (plugin.Hook("server_args_post_init", "AFTER", _NotAFunction, roles=("launcher",)),
     ["_NotAFunction", "only as REPLACE"]),
])
def test_bad_hook_entry_is_fatal_and_nothing_registered(fresh, save_config, hook, words):
    fresh.setenv(state.CONFIG_ENV, save_config)
    fresh.setattr(plugin, "HOOKS", plugin.HOOKS + (hook,))
    with pytest.raises(SystemExit) as e:
        plugin.register()
    msg = _one_line_fatal(e)
    for w in words:
        assert w in msg, msg
    assert _our_hooks() == []


def test_missing_server_args_field_is_fatal(fresh, save_config):
    fresh.setenv(state.CONFIG_ENV, save_config)
    fresh.setattr(rules, "LOAD_ARGS", rules.LOAD_ARGS + ("no_such_field",))
    with pytest.raises(SystemExit) as e:
        plugin.register()
    assert "['no_such_field']" in _one_line_fatal(e)
    assert _our_hooks() == []


def _fake_entry_points(monkeypatch):
    """SGLang's loader sees vitrify's entry point (the installed metadata may predate it)."""
    ep = metadata.EntryPoint("vitrify", "vitrify.integrations.sglang.plugin:register",
                             "sglang.srt.plugins")
    monkeypatch.setattr(sgl_plugins, "entry_points",
                        lambda group: metadata.EntryPoints([ep] if group == ep.group else []))
    monkeypatch.setattr(sgl_plugins, "_plugins_loaded", False)


def test_fatal_error_propagates_through_sglang_loader(fresh, save_config):
    """P3: SGLang's load_plugins() catches Exception only, so the SystemExit gets through."""
    _fake_entry_points(fresh)
    fresh.setenv(state.CONFIG_ENV, save_config)
    fresh.setattr(sglang, "__version__", "0.4.0")
    with pytest.raises(SystemExit) as e:
        sgl_plugins.load_plugins()
    assert "SGLang 0.4.0 is not supported" in _one_line_fatal(e)


def test_through_sglang_loader_end_to_end(fresh, save_config, tiny_model, caplog):
    """SGLang's own loader registers and applies the hook twice-safely; a real ServerArgs built
    afterwards goes through it (prefill graphs off, fingerprint stored) and a refused argument
    stops construction."""
    _fake_entry_points(fresh)
    fresh.setenv(state.CONFIG_ENV, save_config)
    sgl_plugins.load_plugins()
    fresh.setattr(sgl_plugins, "_plugins_loaded", False)
    sgl_plugins.load_plugins()  # a second load in the same process (Engine does this)
    assert len(_our_hooks()) == 2
    with caplog.at_level(logging.INFO, logger="vitrify.sglang"):
        args = _server_args(tiny_model)
    assert args.cuda_graph_config.prefill.backend == "disabled"
    assert state.STATE.fingerprint == rules.fingerprint(args)
    assert state.STATE.fingerprint["model_path"] == tiny_model
    assert any("prefill CUDA graphs" in r.getMessage() for r in caplog.records)
    with pytest.raises(SystemExit) as e:
        ServerArgs(model_path="dummy", tp_size=2)
    assert "tp_size=2" in _one_line_fatal(e)


# ------------------------------------------------------------------------------------------
# ServerArgs.__post_init__ hook (P6, P7), called directly on real ServerArgs
# ------------------------------------------------------------------------------------------

@pytest.fixture
def active(fresh, tmp_path):
    fresh.setattr(state.STATE, "config", _active("save", tmp_path / "a"))
    return state.STATE


def test_hook_forces_prefill_graphs_off(active, tiny_model, caplog):
    args = _server_args(tiny_model)
    was = args.cuda_graph_config.prefill.backend
    assert was != "disabled"  # SGLang turned them on by default: the hook has work to do
    decode_before = args.cuda_graph_config.decode.backend
    with caplog.at_level(logging.INFO, logger="vitrify.sglang"):
        assert after_post_init(None, args) is None
    assert args.cuda_graph_config.prefill.backend == "disabled"
    assert args.cuda_graph_backend_prefill == "disabled" and args.disable_prefill_cuda_graph
    assert args.cuda_graph_config.decode.backend == decode_before  # decode graphs untouched
    assert active.prefill_graphs_were == was
    lines = [r.getMessage() for r in caplog.records if r.name == "vitrify.sglang"]
    assert len(lines) == 1 and "forced off" in lines[0] and was in lines[0]
    # Through SGLang's sanctioned mutation point, with provenance.
    assert any(src == "vitrify" for src, _ in getattr(args, "_runtime_mutations", []))


def test_hook_reaches_published_config(active, tiny_model):
    """What the model runner reads (the runtime context's exec.graph bag) says disabled too."""
    from sglang.srt.runtime_context import get_exec, publish
    args = _server_args(tiny_model)
    after_post_init(None, args)
    publish(args, role="test")
    assert get_exec().graph.cuda_graph_config.prefill.backend == "disabled"


def test_hook_already_off_logs_so(active, tiny_model, caplog):
    args = _server_args(tiny_model, cuda_graph_backend_prefill="disabled")
    with caplog.at_level(logging.INFO, logger="vitrify.sglang"):
        after_post_init(None, args)
    lines = [r.getMessage() for r in caplog.records if r.name == "vitrify.sglang"]
    assert len(lines) == 1 and "are off" in lines[0] and "forced" not in lines[0]
    assert args.cuda_graph_config.prefill.backend == "disabled"


@pytest.mark.parametrize("raw, was", [(None, "SGLang's default"),
                                      ({"prefill": {"backend": "full"}}, "full")])
def test_hook_on_unresolved_dummy_args(active, raw, was):
    """model_path "dummy": __post_init__ stops before resolving cuda_graph_config."""
    args = ServerArgs(model_path="dummy", cuda_graph_config=raw)
    after_post_init(None, args)
    assert args.cuda_graph_backend_prefill == "disabled" and args.disable_prefill_cuda_graph
    assert active.prefill_graphs_were == was
    if raw is not None:
        assert args.cuda_graph_config["prefill"]["backend"] == "disabled"
    assert active.fingerprint["cuda_graph_prefill_backend"] == "disabled"


@pytest.mark.parametrize("field, value, flag", [
    ("enable_memory_saver", True, "--enable-memory-saver"),
    ("speculative_algorithm", "EAGLE", "--speculative-algorithm"),
    ("tp_size", 2, "--tp-size"),
    ("pp_size", 2, "--pp-size"),
    ("dp_size", 2, "--dp-size"),
])
def test_hook_refuses_unsupported_args(active, field, value, flag):
    args = ServerArgs(model_path="dummy", **{field: value})  # "dummy": no resolution of these
    with pytest.raises(SystemExit) as e:
        after_post_init(None, args)
    msg = _one_line_fatal(e)
    assert f"{field}={value!r}" in msg and flag in msg and "'save'" in msg
    assert active.fingerprint is None
    # Every other refusable field is at its default, so it is not named.
    for other, _, _, _ in rules.REFUSED_ARGS:
        if other != field:
            assert f"{other}=" not in msg


def test_hook_accepts_single_gpu_defaults(active):
    args = ServerArgs(model_path="dummy")
    after_post_init(None, args)
    assert active.fingerprint is not None


def test_fingerprint_contents(active, tiny_model):
    args = _server_args(tiny_model, dtype="float16", kv_cache_dtype="auto", random_seed=7,
                        context_length=256, max_running_requests=8, chunked_prefill_size=1024,
                        attention_backend="triton", page_size=16,
                        cuda_graph_bs_decode=[1, 2, 4])
    after_post_init(None, args)
    fp = active.fingerprint
    assert set(fp) == set(rules.FINGERPRINT_ARGS) | {
        "cuda_graph_decode_backend", "cuda_graph_decode_max_bs", "cuda_graph_decode_bs",
        "cuda_graph_prefill_backend"}
    assert fp["model_path"] == tiny_model
    assert (fp["dtype"], fp["random_seed"], fp["context_length"], fp["max_running_requests"],
            fp["chunked_prefill_size"], fp["attention_backend"], fp["page_size"],
            fp["tp_size"]) == ("float16", 7, 256, 8, 1024, "triton", 16, 1)
    assert fp["cuda_graph_decode_bs"] == [1, 2, 4] and fp["cuda_graph_decode_max_bs"] == 4
    assert fp["cuda_graph_decode_backend"] == args.cuda_graph_config.decode.backend
    assert fp["cuda_graph_prefill_backend"] == "disabled"
    assert fp["cuda_graph_decode_bs"] == list(args.cuda_graph_config.decode.bs)
    assert json.loads(json.dumps(fp)) == fp  # JSON-able: it goes into the archive


def test_fingerprint_tracks_each_argument(active, tiny_model):
    base = rules.apply_server_args(_server_args(tiny_model, random_seed=1), "save")
    for kw in ({"random_seed": 2}, {"dtype": "float16"}, {"page_size": 32},
               {"chunked_prefill_size": 512}, {"cuda_graph_bs_decode": [1, 8]}):
        other = rules.apply_server_args(_server_args(tiny_model, **{"random_seed": 1, **kw}),
                                         "save")
        changed = {k for k in base if base[k] != other[k]}
        assert changed, kw
        assert changed <= set(kw) | {"cuda_graph_decode_max_bs", "cuda_graph_decode_bs"}, kw


def test_an_archive_saved_without_deterministic_inference_does_not_match_a_server_with_it(
        active, tiny_model):
    """Deterministic inference picks other kernels: it is part of what an archive must match."""
    base = rules.apply_server_args(_server_args(tiny_model, random_seed=1,
                                                attention_backend="triton"), "save")
    det = rules.apply_server_args(_server_args(tiny_model, random_seed=1,
                                               attention_backend="triton",
                                               enable_deterministic_inference=True), "save")
    assert base["enable_deterministic_inference"] is False
    assert det["enable_deterministic_inference"] is True
    assert det != base


def test_apply_is_idempotent_and_pickle_stable(active, tiny_model):
    """P7: a scheduler gets ServerArgs pickled (no __post_init__) and recomputes the same one."""
    import pickle
    args = _server_args(tiny_model, random_seed=3)
    first = rules.apply_server_args(args, "load")
    assert rules.apply_server_args(args, "load") == first
    child = pickle.loads(pickle.dumps(args))
    assert rules.fingerprint(child) == first
    assert child.cuda_graph_config.prefill.backend == "disabled"


def test_hook_inactive_without_config(fresh, tiny_model):
    args = _server_args(tiny_model)
    was = args.cuda_graph_config.prefill.backend
    after_post_init(None, args)
    assert args.cuda_graph_config.prefill.backend == was and state.STATE.fingerprint is None


def test_hook_unexpected_error_is_fatal(active):
    import types
    with pytest.raises(SystemExit) as e:
        after_post_init(None, types.SimpleNamespace(tp_size=1))
    assert "ServerArgs.__post_init__ hook failed: AttributeError" in _one_line_fatal(e)


# ------------------------------------------------------------------------------------------
# JIT caches (P10)
# ------------------------------------------------------------------------------------------

def test_config_jit_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "arch").mkdir()
    save = pconfig.from_mapping({"mode": "save", "archive": str(tmp_path / "a"), "region_bytes": 1})
    assert save.jit_caches and save.jit_dir == str(tmp_path / "a") + ".jit-work"
    load = pconfig.from_mapping({"mode": "load", "archive": str(tmp_path / "arch"), "region_bytes": 1})
    assert load.jit_dir.startswith(str(tmp_path / "xdg" / "vitrify" / "jit"))
    assert pconfig.from_mapping({"mode": "load", "archive": str(tmp_path / "arch"), "region_bytes": 1,
                         "jit_dir": "~/j"}).jit_dir == os.path.expanduser("~/j")
    off = pconfig.from_mapping({"mode": "save", "archive": str(tmp_path / "a"), "region_bytes": 1,
                        "jit_caches": False})
    assert not off.jit_caches and off.jit_dir is None
    with pytest.raises(PluginConfigError, match="'jit_caches': expected true or false"):
        pconfig.from_mapping({"mode": "off", "jit_caches": "yes"})
    with pytest.raises(PluginConfigError, match="'jit_dir': expected a non-empty path"):
        pconfig.from_mapping({"mode": "off", "jit_dir": ""})


def test_save_redirects_the_jit_caches_once_for_every_process(fresh, save_config, tmp_path):
    fresh.setenv(state.CONFIG_ENV, save_config)
    plugin.register()
    work = str(tmp_path / "archive") + ".jit-work"
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(work, "triton")
    assert os.environ["TVM_FFI_CACHE_DIR"] == os.path.join(work, "tvm-ffi")
    assert os.environ[startup.JIT_ROOT_ENV] == work
    assert state.STATE.jit_dirs == {"triton": os.path.join(work, "triton"),
                                     "tvm-ffi": os.path.join(work, "tvm-ffi")}
    # a kernel compiled meanwhile, then a scheduler process (same environment) registers: the
    # caches are not redirected again (which would refuse the non-empty directory)
    (tmp_path / "archive.jit-work" / "triton" / "k.cubin").write_bytes(b"k")
    fresh.setattr(state, "STATE", state.PluginState())
    plugin.register()
    assert state.STATE.jit_dirs["triton"] == os.path.join(work, "triton")


def test_save_refuses_a_jit_directory_that_is_not_its_own(fresh, save_config, tmp_path):
    (tmp_path / "archive.jit-work" / "triton").mkdir(parents=True)
    (tmp_path / "archive.jit-work" / "triton" / "old.cubin").write_bytes(b"old")
    fresh.setenv(state.CONFIG_ENV, save_config)
    with pytest.raises(SystemExit) as e:
        plugin.register()
    assert "is not empty and not vitrify's" in _one_line_fatal(e)
    assert "jit_caches = false" in str(e.value)
    assert _our_hooks() == [] and "TRITON_CACHE_DIR" not in os.environ


def test_save_clears_what_an_earlier_save_left(fresh, save_config, tmp_path):
    fresh.setenv(state.CONFIG_ENV, save_config)
    plugin.register()
    (tmp_path / "archive.jit-work" / "triton" / "k.cubin").write_bytes(b"k")
    for var in ("TRITON_CACHE_DIR", "TVM_FFI_CACHE_DIR", startup.JIT_ROOT_ENV):
        fresh.delenv(var)  # a new launch of the same SAVE, e.g. after a crash
    fresh.setattr(state, "STATE", state.PluginState())
    plugin.register()
    assert os.listdir(tmp_path / "archive.jit-work" / "triton") == []


def _archive_with_jit(path, files: dict):
    from vitrify import jit
    from vitrify.archive import ArchiveWriter, Fingerprint, Region

    root = Path(str(path) + ".src")
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    with ArchiveWriter(str(path), Fingerprint(gpu="g"), Region(0x7F0000000000, 1 << 30, 2 << 20)) as w:
        jit.pack(w, {"triton": str(root / "triton"), "tvm-ffi": str(root / "tvm-ffi")})


def _load_config(tmp_path, arch, **extra) -> str:
    """A LOAD config for ``arch`` with ``extra`` keys (TOML values as Python literals)."""
    lines = [f'mode = "load"', f'archive = "{arch}"', 'region_bytes = "2GiB"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    (tmp_path / "load.toml").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "load.toml")


def test_load_unpacks_the_archives_jit_caches_before_anything_compiles(fresh, tmp_path):
    arch = tmp_path / "engine.vitrify"
    _archive_with_jit(arch, {"triton/AB/k.cubin": b"cubin", "tvm-ffi/m_1/m_1.so": b"so"})
    cfg = _load_config(tmp_path, arch, jit_dir=str(tmp_path / "jit"))
    fresh.setenv(state.CONFIG_ENV, cfg)
    plugin.register()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "jit" / "triton")
    assert (tmp_path / "jit" / "triton" / "AB" / "k.cubin").read_bytes() == b"cubin"
    assert (tmp_path / "jit" / "tvm-ffi" / "m_1" / "m_1.so").read_bytes() == b"so"
    assert _our_hooks()  # registered after the caches were in place


def test_load_with_a_damaged_jit_cache_is_fatal_and_registers_nothing(fresh, tmp_path):
    fresh.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    arch = tmp_path / "engine.vitrify"
    _archive_with_jit(arch, {"triton/AB/k.cubin": b"cubin-bytes"})
    (arch / "jit" / "triton" / "AB" / "k.cubin").write_bytes(b"cubin-bytez")
    cfg = _load_config(tmp_path, arch)
    fresh.setenv(state.CONFIG_ENV, cfg)
    with pytest.raises(SystemExit) as e:
        plugin.register()
    msg = _one_line_fatal(e)
    assert "unpacking the archive's JIT caches" in msg and "checksum mismatch" in msg
    assert _our_hooks() == [] and "TRITON_CACHE_DIR" not in os.environ


def test_load_cold_start_compiles_as_usual_when_the_caches_cannot_be_unpacked(fresh, tmp_path):
    arch = tmp_path / "engine.vitrify"
    _archive_with_jit(arch, {"triton/AB/k.cubin": b"cubin-bytes"})
    (arch / "jit" / "triton" / "AB" / "k.cubin").write_bytes(b"cubin-bytez")
    cfg = _load_config(tmp_path, arch, on_mismatch="cold-start", jit_dir=str(tmp_path / "jit"))
    fresh.setenv(state.CONFIG_ENV, cfg)
    plugin.register()
    assert "TRITON_CACHE_DIR" not in os.environ and state.STATE.jit_dirs == {}
    assert _our_hooks()


def test_load_refuses_a_jit_parent_others_can_write(fresh, tmp_path):
    arch = tmp_path / "engine.vitrify"
    _archive_with_jit(arch, {"triton/AB/k.cubin": b"cubin"})
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cfg = _load_config(tmp_path, arch, jit_dir=str(shared / "jit"))
    fresh.setenv(state.CONFIG_ENV, cfg)
    with pytest.raises(SystemExit) as e:
        plugin.register()
    assert "writable by no one else" in _one_line_fatal(e)
    assert not (shared / "jit").exists()


def test_config_save_refuses_an_existing_archive(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(PluginConfigError, match="exists \\(mode 'save' writes a new archive"):
        pconfig.from_mapping({"mode": "save", "archive": str(tmp_path / "a"), "region_bytes": 1})


def test_the_launcher_is_not_a_scheduler_even_with_the_scheduler_imported(monkeypatch):
    # sglang.Engine imports the scheduler module in the launcher; only a child process that
    # loads plugins is a scheduler
    monkeypatch.setitem(sys.modules, v17.SCHEDULER_MODULE, types.ModuleType("stub"))
    assert v17.process_role() == "launcher"


def test_load_reads_no_checkpoint_save_does(fresh, tmp_path, tiny_model, caplog):
    for mode, want in (("save", "auto"), ("load", "dummy")):
        fresh.setattr(state.STATE, "config", _active(mode, tmp_path / "a"))
        args = _server_args(tiny_model)
        assert args.load_format == "auto"
        with caplog.at_level(logging.INFO, logger="vitrify.sglang"):
            fp = rules.apply_server_args(args, mode)
        assert args.load_format == want and "load_format" not in fp
    assert any("the checkpoint is not read (load_format was auto)" in r.getMessage()
               for r in caplog.records)
    # not provably the same build: the configured loader runs, and the log says why
    fresh.setattr(state.STATE, "config", _active("load", tmp_path / "a"))
    args = _server_args(tiny_model, kv_cache_dtype="fp8_e4m3")
    with caplog.at_level(logging.INFO, logger="vitrify.sglang"):
        rules.apply_server_args(args, "load")
    assert args.load_format == "auto"
    assert any("kv_cache_dtype='fp8_e4m3' (scales come from the weights)" in r.getMessage()
               for r in caplog.records)


def test_config_standby_file(tmp_path):
    arch = tmp_path / "arch"
    arch.mkdir()
    cfg = pconfig.from_mapping({"mode": "load", "archive": str(arch), "region_bytes": "1GiB",
                                "standby_file": str(tmp_path / "go")})
    assert cfg.standby_file == str(tmp_path / "go")
    assert pconfig.from_mapping({"mode": "load", "archive": str(arch),
                                 "region_bytes": "1GiB"}).standby_file is None
    # mode "off" keeps the key unused, as every other key of a mode
    assert pconfig.from_mapping({"mode": "off", "standby_file": str(tmp_path / "no" / "go")}
                                ).standby_file is None
    for extra, words in (({"mode": "save", "archive": str(tmp_path / "new")}, "for mode 'load'"),
                         ({"standby_file": str(tmp_path / "no" / "go")}, "does not exist"),
                         ({"standby_file": ""}, "non-empty path string"),
                         ({"standby_file": 3}, "non-empty path string")):
        data = {"mode": "load", "archive": str(arch), "region_bytes": "1GiB",
                "standby_file": str(tmp_path / "go"), **extra}
        with pytest.raises(PluginConfigError, match=words):
            pconfig.from_mapping(data)


def test_config_read_ahead(tmp_path):
    arch = tmp_path / "arch"
    arch.mkdir()
    base = {"mode": "load", "archive": str(arch), "region_bytes": "1GiB"}
    assert pconfig.from_mapping(base).read_ahead is True
    assert pconfig.from_mapping({**base, "read_ahead": False}).read_ahead is False
    with pytest.raises(PluginConfigError, match="read_ahead.*true or false"):
        pconfig.from_mapping({**base, "read_ahead": "yes"})


def test_the_launcher_reads_the_weights_ahead_and_the_scheduler_does_not(fresh, tmp_path):
    arch = tmp_path / "engine.vitrify"
    _archive_with_jit(arch, {"triton/AB/k.cubin": b"cubin"})
    calls = []
    fresh.setattr(startup, "start_read_ahead", lambda a: calls.append(a.path) or "reading")
    fresh.setenv(state.CONFIG_ENV, _load_config(tmp_path, arch, jit_dir=str(tmp_path / "jit")))
    plugin.register()
    assert calls == [str(arch)] and state.STATE.read_ahead == "reading"
    # a scheduler, a config that says no, a process whose launcher reads already, SAVE
    load = pconfig.from_mapping({"mode": "load", "archive": str(arch), "region_bytes": "1GiB"})
    calls.clear()
    read = startup.launcher_read_ahead
    assert read(load, "scheduler") is None
    assert read(dataclasses.replace(load, read_ahead=False), "launcher") is None
    assert read(dataclasses.replace(load, mode="save"), "launcher") is None
    fresh.setenv(startup.READ_AHEAD_ENV, f"{os.getpid()}:/elsewhere/weights.span")
    assert read(load, "launcher") is None and calls == []
    # another launcher's value (this process launched one before): this launch reads its own
    fresh.setenv(startup.READ_AHEAD_ENV, f"{os.getpid() + 1}:/elsewhere/weights.span")
    assert read(load, "launcher") == "reading"
    fresh.delenv(startup.READ_AHEAD_ENV)
    assert read(load, "launcher") == "reading"
    # the archive this process opened is opened once: every read-ahead asked for the same one
    assert len(calls) == 2 and list(state.STATE.opened) == [str(arch)]
    # a speed-up never stops a server: a failure is a warning
    fresh.setattr(startup, "start_read_ahead", lambda a: 1 / 0)
    assert read(load, "launcher") is None
