"""vitrify's HiCache backend against BOTH supported SGLang releases' real classes, on the CPU
(issue 35, part 2): ``sglang_hicache_release_cases.py`` runs in a fresh interpreter per release,
0.5.17 as this venv has it and 0.5.23 from its ``pip install --no-deps --target`` directory put
first on ``sys.path`` (``VITRIFY_SGLANG_SITE`` names another; found the way
``test_sglang_versions.py`` finds it). Then the two runs are compared: one host pool geometry
and model get the same pool identity and store name on both releases, so pages stored under
0.5.17 are found after an upgrade to 0.5.23 (and a page of another geometry never is)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_sglang_versions import RELEASES, _installed, run_cases

pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent
CASES = HERE / "sglang_hicache_release_cases.py"
# the cases set these themselves; one left in the caller's environment would change every run
_INJECTOR_ENV = ("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY",
                 "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE",
                 "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each release's run of the cases: (exit status, output, what it recorded), or why it
    cannot run here."""
    out = {}
    for release in RELEASES:
        why = _installed(release)
        if why is not None:
            out[release] = why
            continue
        out[release] = run_cases(CASES, release, tmp_path_factory.mktemp(f"hicache-{release}"),
                                 {}, drop=_INJECTOR_ENV)
    return out


@pytest.mark.parametrize("release", RELEASES)
def test_the_hicache_cases_pass_against_the_real_release(runs, release):
    run = runs[release]
    if isinstance(run, str):
        pytest.skip(run)
    rc, output, recorded = run
    tail = output[-6000:]
    assert rc == 0, f"SGLang {release}: the HiCache cases failed:\n{tail}"
    summary = [ln for ln in output.splitlines() if " passed" in ln]
    assert summary and "failed" not in summary[-1] and "error" not in summary[-1], tail
    # every case runs on every release (a release without a feature checks that it is absent)
    skipped = [ln for ln in output.splitlines() if ln.startswith("SKIPPED")]
    assert not skipped, skipped
    assert recorded is not None and recorded["version"] == release, tail


def test_one_geometry_is_stored_under_the_same_name_on_both_releases(runs):
    for release in RELEASES:
        if isinstance(runs[release], str):
            pytest.skip(runs[release])
    assert len(RELEASES) == 2  # a third release: compare each pair
    a, b = (runs[r][2] for r in RELEASES)
    if a is None or b is None:
        pytest.fail("a release's run recorded nothing (see its test above)")
    assert a["pool"] == b["pool"], (a["pool"], b["pool"])
    assert a["rank"] == b["rank"] == "tp0of1-pp0of1-cp0of1"
    assert a["store"] == b["store"]
