"""vitrify.session on CPU: FREEZE and THAW of a torch-free engine (session_worker.py) in fresh
processes against the fake CUDA driver (VMM emulated on host memory): same checkpoints, the
weights and the warmup state back byte for byte, the KV block never dumped, relocation when the
frozen range is taken, warmup re-run (setting and archive without the span), and the refusals:
a drifting engine (both offsets named), another model, relocation not allowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vitrify import session

FAKE = os.environ.get("VITRIFY_TEST_FAKE_LIBCUDA")
WORKER = Path(__file__).with_name("session_worker.py")
MiB = 1 << 20

needs_fake = pytest.mark.skipif(not FAKE, reason="VITRIFY_TEST_FAKE_LIBCUDA not set (make test "
                                                 "sets it)")


def run(mode: str, archive: Path, **opts) -> dict:
    env = dict(os.environ, VITRIFY_LIBCUDA_PATH=FAKE or "", FAKE_CUDA_DEVICES="1")
    p = subprocess.run([sys.executable, str(WORKER), mode, str(archive), json.dumps(opts)],
                       capture_output=True, text=True, timeout=120, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"{mode} printed no result (rc {p.returncode}):\n{p.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    if not FAKE:
        pytest.skip("VITRIFY_TEST_FAKE_LIBCUDA not set (make test sets it)")
    path = tmp_path_factory.mktemp("session") / "engine.vitrify"
    fz = run("freeze", path)
    assert fz["ok"], fz.get("traceback")
    return path, fz


@needs_fake
def test_freeze_records_every_phase_and_dumps_all_but_the_kv_cache(frozen):
    _, fz = frozen
    cps = fz["checkpoints"]
    assert list(cps) == list(session.PHASES)
    assert cps["built"] == 4 * 4 * MiB  # four 3 MiB parameters, 2 MiB granules
    assert cps["weights"] > cps["built"]  # the freed temporary moved the cursor
    assert cps["state"] - cps["weights"] == 8 * MiB
    # The weights span holds the parameters (the freed temporary's chunk is a hole); the KV
    # block [weights, state) is in no span.
    assert fz["span_bytes"]["weights"] == 4 * 4 * MiB
    assert fz["span_bytes"]["warmup"] == 2 * MiB
    assert fz["span_bytes"]["graphs"] == 2 * MiB  # the capture's "graph pool" block
    assert set(fz["timings"]) >= {"reserve", "build", "load_weights", "compile", "warmup",
                                  "dump_spans"}
    assert fz["compiles"] == 1


@needs_fake
def test_thaw_restores_weights_and_warmup_state_at_the_same_base(frozen):
    path, fz = frozen
    th = run("thaw", path)
    assert th["ok"], th.get("traceback")
    assert th["base"] == fz["base"] and not th["relocated"]
    assert th["checkpoints"] == fz["checkpoints"]
    assert th["warmup"] == "restore" and th["warmups"] == 0 and th["compiles"] == 0
    assert th["digest"] == th["frozen_digest"]


@needs_fake
def test_thaw_relocates_when_the_frozen_range_is_taken(frozen):
    path, fz = frozen
    th = run("thaw", path, occupy=True)
    assert th["ok"], th.get("traceback")
    assert th["relocated"] and th["base"] != fz["base"]
    assert th["checkpoints"] == fz["checkpoints"]
    assert th["digest"] == th["frozen_digest"]


@needs_fake
def test_relocation_not_allowed_is_a_clear_refusal(frozen):
    path, _ = frozen
    th = run("thaw", path, occupy=True, relocate=False)
    assert not th["ok"]
    assert th["error"].startswith("SessionError: the frozen region's range 0x")
    assert "relocate=True" in th["error"]


@needs_fake
def test_warmup_rerun_reaches_the_same_checkpoints_and_state(frozen):
    path, fz = frozen
    th = run("thaw", path, warmup_restore=False)
    assert th["ok"], th.get("traceback")
    assert th["warmup"] == "rerun-warmup" and th["warmups"] == 1
    assert th["compiles"] == 1  # a re-run warmup runs compiled code: compile first (P11)
    assert th["checkpoints"] == fz["checkpoints"]
    assert th["digest"] == th["frozen_digest"]


@needs_fake
def test_a_compile_phase_that_allocates_in_the_region_is_refused(tmp_path):
    fz = run("freeze", tmp_path / "jit.vitrify", compile_in_region=True)
    assert not fz["ok"]
    assert "SessionError" in fz["error"] and "compile phase moved the region's cursor" in fz["error"]
    assert not (tmp_path / "jit.vitrify").exists()  # P8: no archive


@needs_fake
def test_an_archive_without_the_warmup_span_reruns_warmup(tmp_path):
    path = tmp_path / "no-warmup.vitrify"
    fz = run("freeze", path, dump_warmup=False)
    assert fz["ok"], fz.get("traceback")
    assert "warmup" not in fz["span_bytes"]
    th = run("thaw", path)
    assert th["ok"], th.get("traceback")
    assert th["warmup"] == "rerun-warmup" and th["warmups"] == 1
    assert th["digest"] == th["frozen_digest"]


@needs_fake
def test_a_drifting_engine_is_refused_naming_the_phase_and_both_offsets(frozen):
    path, fz = frozen
    th = run("thaw", path, drift=True)
    assert th["ok"], th.get("traceback")
    assert th["phase"] == "built"
    assert th["frozen"] == fz["checkpoints"]["built"]
    assert th["here"] == fz["checkpoints"]["built"] + 2 * MiB
    assert f"{th['here']} bytes" in th["drift"] and f"{th['frozen']} bytes" in th["drift"]
    assert th["region_released"]  # the failed THAW closed its region (P10)


@needs_fake
@pytest.mark.parametrize("opened", [False, True])
def test_an_archive_of_another_model_is_refused(frozen, opened):
    """By path, or an archive the caller opened already (one open per process): the
    fingerprint is checked at start() either way."""
    path, _ = frozen
    th = run("thaw", path, model="bytes-other", opened=opened)
    assert not th["ok"]
    assert "fingerprint.model mismatch" in th["error"] and "bytes-other" in th["error"]


@needs_fake
def test_a_thaw_of_an_opened_archive_restores_the_same_bytes(frozen):
    path, fz = frozen
    th = run("thaw", path, opened=True)
    assert th["ok"], th.get("traceback")
    assert th["checkpoints"] == fz["checkpoints"] and th["digest"] == th["frozen_digest"]


@needs_fake
def test_an_engine_without_objects_at_thaw_gets_the_same_bytes(frozen):
    path, fz = frozen
    th = run("thaw", path, objectless=True)
    assert th["ok"], th.get("traceback")
    assert th["checkpoints"] == fz["checkpoints"] and th["warmup"] == "restore"
    assert th["digest"] == th["frozen_digest"]
    # It cannot re-run warmup (no objects): a refusal saying so.
    th = run("thaw", path, objectless=True, warmup_restore=False)
    assert not th["ok"] and th["error"].startswith("SessionError: warmup restore is off (VITRIFY_WARMUP_RESTORE=0")
    assert "cannot re-run warmup" in th["error"]


@needs_fake
def test_an_explicit_other_base_needs_relocate(frozen):
    path, fz = frozen
    th = run("thaw", path, base_shift=1 << 40, relocate=False)
    assert not th["ok"] and "relocate=False" in th["error"]
    th = run("thaw", path, base_shift=1 << 40)
    assert th["ok"], th.get("traceback")
    assert th["relocated"] and th["base"] == fz["base"] + (1 << 40)
    assert th["digest"] == th["frozen_digest"]


@needs_fake
def test_a_warmup_that_allocates_nothing_has_nothing_to_restore(tmp_path):
    path = tmp_path / "table-in-build.vitrify"
    fz = run("freeze", path, table_in_build=True)
    assert fz["ok"], fz.get("traceback")
    assert fz["checkpoints"]["warmup"] == fz["checkpoints"]["state"]
    assert "warmup" not in fz["span_bytes"]
    # Even an engine that keeps no objects thaws: there is no warmup to re-run.
    th = run("thaw", path, objectless=True, table_in_build=True)
    assert th["ok"], th.get("traceback")
    assert th["warmup"] == "restore" and th["digest"] == th["frozen_digest"]


@needs_fake
@pytest.mark.parametrize("warmup_restore", [None, False], ids=["restore", "rerun"])
def test_an_engine_driving_its_own_phases_freezes_and_thaws_the_same(frozen, tmp_path,
                                                                      warmup_restore):
    """P12: start / reached / finish, the engine calling its own phases (SGLang's shape), give
    the archive and the thaw that run() gives; both directions mix."""
    path, fz = frozen
    driven = run("freeze", tmp_path / "driven.vitrify", driven=True)
    assert driven["ok"], driven.get("traceback")
    assert driven["checkpoints"] == fz["checkpoints"]
    assert driven["span_bytes"] == fz["span_bytes"]
    assert {"build", "load_weights", "alloc_state", "warmup", "capture", "dump_spans",
            "total"} <= set(driven["timings"])
    for archive in (path, tmp_path / "driven.vitrify"):   # pull-frozen and engine-frozen
        th = run("thaw", archive, driven=True, warmup_restore=warmup_restore)
        assert th["ok"], th.get("traceback")
        assert th["digest"] == th["frozen_digest"]
        assert th["warmups"] == (0 if warmup_restore is None else 1)
        assert th["checkpoints"] == fz["checkpoints"]
        assert "restore_weights" in th["timings"] and "build" in th["timings"]
        assert th["graph_span_restored"]
        pulled = run("thaw", archive)
        assert pulled["ok"] and pulled["digest"] == th["digest"]
    # an engine whose graph memory is scratch has the span mapped, not restored
    mapped = run("thaw", path, driven=True, restore_graph_span=False)
    assert mapped["ok"], mapped.get("traceback")
    assert not mapped["graph_span_restored"] and mapped["checkpoints"] == fz["checkpoints"]


@needs_fake
def test_an_engine_driven_session_refuses_checkpoints_out_of_order(frozen):
    path, _ = frozen
    out = run("misuse", path)
    assert out["ok"], out.get("traceback")
    assert "reported checkpoint 'state' but the next one is 'built'" in out["freeze_order"]
    assert out["freeze_region_closed"]
    assert "has not reached ['weights', 'state', 'warmup', 'captured']" in out["freeze_early_finish"]
    assert out["early_finish_region_open"]
    assert "has finished; the region is the engine's" in out["freeze_late"]
    assert out["late_region_open"]
    assert "start() the session before reporting" in out["thaw_before_start"]
    assert "start() the THAW session first" in out["state_before_start"]
    assert "reported checkpoint 'warmup' but the next one is 'built'" in out["thaw_order"]
    assert out["thaw_region_released"]
    assert "started already" in out["thaw_twice"]


class _NotAnAdapter:
    def fingerprint(self):
        return {}


def test_a_non_adapter_is_refused_naming_what_it_lacks(tmp_path):
    # an engine that runs its own phases (start/reached/finish) needs only a fingerprint; the
    # session that runs them (run()) needs the whole protocol
    with pytest.raises(TypeError, match="lacks route, build, load_weights"):
        session.ThawSession(_NotAnAdapter(), tmp_path / "a").run()
    with pytest.raises(TypeError, match="lacks route, build, load_weights"):
        session.FreezeSession(_NotAnAdapter(), tmp_path / "b", region_bytes=MiB,
                              record_kernels=False).run()
    with pytest.raises(TypeError, match="lacks fingerprint"):
        session.ThawSession(object(), tmp_path / "a")


def test_bad_arguments_are_one_line_errors(tmp_path):
    from session_worker import BytesEngine

    with pytest.raises(ValueError, match="region_bytes"):
        session.FreezeSession(BytesEngine(), tmp_path / "a", region_bytes=0, record_kernels=False)
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        session.FreezeSession(BytesEngine(), tmp_path / "exists", region_bytes=MiB,
                              record_kernels=False)
    with pytest.raises(TypeError, match="graph_threads"):
        session.ThawSession(BytesEngine(), tmp_path / "a", graph_threads="4")
    assert isinstance(BytesEngine(), session.EngineAdapter)


def test_a_thaw_reads_its_spans_the_way_it_was_asked():
    from session_worker import BytesEngine

    seen = []

    class _Archive:
        def restore_span(self, rank, name, base, end, **kw):
            seen.append((name, kw["direct_io"], kw["within"]))

    region = type("R", (), {"offset": 1 << 40, "base": 0})()
    for asked in (None, "off", "auto"):
        sess = session.ThawSession(BytesEngine(), "/nowhere", direct_io=asked)
        sess._cps = {"weights": 4096}
        sess._restore(_Archive(), region, {"weights": "w"}, "weights", 4096)
    # each span is restored only within the range the session state records for it
    assert seen == [("weights", None, (0, 4096)), ("weights", "off", (0, 4096)),
                    ("weights", "auto", (0, 4096))]
    with pytest.raises(ValueError, match="direct_io"):
        session.ThawSession(BytesEngine(), "/nowhere", direct_io="sometimes")


_NO_GPU_FREEZE = """
import sys
import vitrify
from vitrify import session
sys.path.insert(0, sys.argv[2])
from session_worker import BytesEngine
try:
    session.FreezeSession(BytesEngine(), sys.argv[1], region_bytes=1 << 20)
    print("constructed")
except Exception as e:
    print(f"{type(e).__name__}: {e}")
print("GPU" if vitrify.cuda_available() else "no GPU")
print(vitrify.cuda_unavailable_reason())
"""


def test_a_freeze_without_a_gpu_says_there_is_no_gpu(tmp_path):
    """Issue 32: FreezeSession records kernel binaries (CUPTI) first; without a GPU that said
    "cuptiSubscribe failed: CUPTI result 999". It must say what every GPU entry point says: the
    CUDA driver is unavailable, and the loader's reason. (The real driver loader here: no fake
    driver in that process.)"""
    env = {k: v for k, v in os.environ.items() if k != "VITRIFY_LIBCUDA_PATH"}
    p = subprocess.run([sys.executable, "-c", _NO_GPU_FREEZE, str(tmp_path / "a.vitrify"),
                        str(WORKER.parent)], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    error, gpu, reason = p.stdout.splitlines()[-3:]
    if gpu == "GPU":
        pytest.skip("this machine has a GPU")
    assert reason and error == (f"CudaUnavailableError: cannot record kernel binaries: CUDA "
                                f"driver unavailable: {reason}")
    assert "CUPTI" not in error
    assert not (tmp_path / "a.vitrify").exists()
