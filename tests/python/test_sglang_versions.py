"""The SGLang plugin against BOTH supported releases' real classes, on the CPU (issue 34, "Proof"):
``sglang_release_cases.py`` runs in a fresh interpreter per release — 0.5.17 as this venv has
it, 0.5.23 from the directory ``scripts/setup.sh`` installs it into with
``pip install --no-deps --target`` (``$VENV/sglang-0.5.23``; ``VITRIFY_SGLANG_SITE`` names
another), put first on ``sys.path``, so the venv's own SGLang is shadowed and every other package
(torch, transformers, ...) is the venv's. Then the two releases' fingerprints of one command
line are compared: the same function of the resolved arguments, and engine versions that name
each release (an archive of one is refused by the other, naming both: the cases check that)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from vitrify.integrations.sglang import versions

pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent
CASES = HERE / "sglang_release_cases.py"
RELEASES = versions.SUPPORTED  # the venv's own (requirements-sglang-test.txt), then the other
SITE_ENV = "VITRIFY_SGLANG_SITE"


def _venvs() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def site_of(release: str) -> str | None:
    """Where ``release`` is importable from: None for the venv's own, else its ``--target``
    directory (``VITRIFY_SGLANG_SITE``, or ``$VENV/sglang-<release>`` where setup.sh puts it)."""
    if release == _venvs():
        return None
    return os.environ.get(SITE_ENV) or os.path.join(sys.prefix, f"sglang-{release}")


def _installed(release: str) -> str | None:
    """None when ``release`` can be run here, else why not."""
    if importlib.util.find_spec("sglang") is None or _venvs() is None:
        return "sglang is not installed"
    if _venvs() not in RELEASES:
        return f"this venv has SGLang {_venvs()}, which the plugin does not support"
    site = site_of(release)
    if site is not None and not (Path(site) / f"sglang-{release}.dist-info").is_dir():
        return (f"SGLang {release} is not installed at {site} (scripts/setup.sh installs it "
                f"there; {SITE_ENV} names another --target directory)")
    return None


def run_cases(cases: Path, release: str, tmp: Path, env: dict, drop: tuple = ()) -> tuple:
    """``cases`` run by pytest in a fresh interpreter against ``release`` (its ``--target``
    directory first on ``PYTHONPATH`` where it is not the venv's own), with ``env`` added and
    the names in ``drop`` taken out of this environment; (exit status, output, the JSON the
    cases recorded at ``VITRIFY_RELEASE_OUT`` or None)."""
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", SITE_ENV) + drop}
    e.update(env)
    e["VITRIFY_RELEASE_OUT"] = str(tmp / "recorded.json")
    site = site_of(release)
    if site is not None:
        e["PYTHONPATH"] = site
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-o", "addopts=-ra", "--rootdir", str(HERE), "--basetemp",
                        str(tmp / "basetemp"), str(cases)],
                       cwd=str(HERE), env=e, capture_output=True, text=True, timeout=900)
    recorded = tmp / "recorded.json"
    return (p.returncode, p.stdout + p.stderr,
            json.loads(recorded.read_text()) if recorded.exists() else None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each release's run of the cases: (exit status, output, the fingerprint it recorded)."""
    out = {}
    model = tmp_path_factory.mktemp("shared") / "tiny-llama"  # one model path for both
    for release in RELEASES:
        why = _installed(release)
        if why is not None:
            out[release] = why
            continue
        out[release] = run_cases(CASES, release, tmp_path_factory.mktemp(f"sglang-{release}"),
                                 {"VITRIFY_RELEASE_MODEL": str(model)})
    return out


@pytest.mark.parametrize("release", RELEASES)
def test_the_plugins_tests_pass_against_the_real_release(runs, release):
    run = runs[release]
    if isinstance(run, str):
        pytest.skip(run)
    rc, output, recorded = run
    tail = output[-6000:]
    assert rc == 0, f"SGLang {release}: the cases failed:\n{tail}"
    summary = [ln for ln in output.splitlines() if " passed" in ln]
    assert summary and "failed" not in summary[-1] and "error" not in summary[-1], tail
    # a case skips only where the fake driver is not given (make test gives it)
    skipped = [ln for ln in output.splitlines() if ln.startswith("SKIPPED")]
    assert all("VITRIFY_TEST_FAKE_LIBCUDA not set" in ln for ln in skipped), skipped
    # every case ran against this release (the module's importorskip would skip them all)
    assert recorded is not None and recorded["version"] == release, tail


def test_the_fingerprint_is_the_same_function_of_the_resolved_arguments_on_both(runs):
    for release in RELEASES:
        if isinstance(runs[release], str):
            pytest.skip(runs[release])
    assert len(RELEASES) == 2  # a third release: compare each pair
    a, b = (runs[r][2] for r in RELEASES)
    if a is None or b is None:
        pytest.fail("a release's run recorded no fingerprint (see its test above)")
    fa, fb = a["fingerprint"], b["fingerprint"]
    assert set(fa) == set(fb)
    # the command line sets each of these (sglang_release_cases.SHAPED): both releases resolve
    # them to the same values, so one archive's arguments compare equal on both
    assert fa == fb, {k: (fa[k], fb[k]) for k in fa if fa[k] != fb[k]}
    # the engine version names the release: an archive of one is refused by the other
    assert a["engine"]["model"] == b["engine"]["model"]
    for release, run in zip(RELEASES, (a, b)):
        assert run["engine"]["engine_version"].startswith(f"sglang-{release}/")
