"""Result files are records (issue 32): every one carries date, git_sha, ok, goals,
goal_direction and ratios, is named with its date and commit, and is never overwritten."""

from __future__ import annotations

import json
import os

import pytest

from vitrify.bench import resultlib


@pytest.fixture
def sha(monkeypatch):
    monkeypatch.setattr(resultlib, "git_sha", lambda: "0123456789abcdef0123456789abcdef01234567")


def test_every_result_carries_the_record_keys(sha):
    res = resultlib.result("x")
    for key in resultlib.REQUIRED_KEYS:
        assert key in res, key
    assert res["ok"] is True and res["goals"] == {} and res["ratios"] == {}
    assert res["goal_direction"] == {}


def test_ok_follows_the_goals_and_their_direction(sha):
    goals = {"up": 2.0, "down": 1.1}
    met = resultlib.result("x", ratios={"up": 2.5, "down": 1.0}, goals=goals,
                           goal_direction={"down": "<="})
    assert met["ok"] is True
    assert met["goal_direction"] == {"up": ">=", "down": "<="}
    missed = resultlib.result("x", ratios={"up": 2.5, "down": 1.2}, goals=goals,
                              goal_direction={"down": "<="})
    assert missed["ok"] is False
    absent = resultlib.result("x", ratios={"up": 2.5}, goals=goals, goal_direction={"down": "<="})
    assert absent["ok"] is False  # a goal without its ratio is not met
    nan = resultlib.result("x", ratios={"up": float("nan"), "down": 1.0}, goals=goals,
                           goal_direction={"down": "<="})
    assert nan["ok"] is False


def test_ok_follows_failed_tests_and_the_callers_verdict(sha):
    assert resultlib.result("s", tests={"passed": 3, "failed": 1, "skipped": 0})["ok"] is False
    assert resultlib.result("s", tests={"passed": 3, "failed": 0, "skipped": 2})["ok"] is True
    assert resultlib.result("e2e", ratios={"r": 0.1}, goals={"r": 1.0}, ok=True)["ok"] is True
    assert resultlib.result("e2e", ok=False)["ok"] is False


def test_a_bad_goal_direction_is_refused(sha):
    with pytest.raises(ValueError, match=r"goal_direction values must be one of"):
        resultlib.result("x", goals={"a": 1.0}, goal_direction={"a": "<"})
    with pytest.raises(ValueError, match=r"names keys that are not goals: \['b'\]"):
        resultlib.result("x", goals={"a": 1.0}, goal_direction={"b": "<="})


def test_named_with_date_and_commit_and_never_overwritten(sha, tmp_path):
    first = resultlib.result("disk", ratios={"a": 1.0})
    second = dict(first, ratios={"a": 2.0})
    third = dict(first, ratios={"a": 3.0})
    p1 = resultlib.write(first, tmp_path)
    p2 = resultlib.write(second, tmp_path)
    p3 = resultlib.write(third, tmp_path)
    day = first["date"][:10]
    assert p1.name == f"disk-{day}-0123456.json"
    assert p2.name == f"disk-{day}-0123456-2.json"
    assert p3.name == f"disk-{day}-0123456-3.json"
    assert [json.loads(p.read_text())["ratios"]["a"] for p in (p1, p2, p3)] == [1.0, 2.0, 3.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (p1, p2, p3))


def test_a_dirty_trees_record_says_so_in_its_name(tmp_path):
    res = dict(resultlib.result("disk"), git_sha="0123456789" * 4 + "-dirty")
    assert resultlib.result_path(res, tmp_path).name == f"disk-{res['date'][:10]}-0123456-dirty.json"
    assert resultlib.result_path(dict(res, git_sha="unknown"), tmp_path).name.endswith("-unknown.json")


def test_an_existing_file_of_that_name_is_kept_byte_for_byte(sha, tmp_path):
    res = resultlib.result("disk")
    taken = resultlib.result_path(res, tmp_path)
    taken.write_text("an earlier record\n")
    p = resultlib.write(res, tmp_path)
    assert p != taken and taken.read_text() == "an earlier record\n"


def test_a_result_without_the_record_keys_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"lacks \['ok', 'goals', 'goal_direction', 'ratios'\]"):
        resultlib.write({"name": "old", "date": "2026-01-01T00:00:00+00:00", "git_sha": "x"},
                        tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_commit_is_named_so(monkeypatch, tmp_path):
    monkeypatch.setattr(resultlib, "git_sha", lambda: "unknown")
    p = resultlib.write(resultlib.result("x"), tmp_path)
    assert p.name.endswith("-unknown.json")


def test_a_link_at_the_temporary_name_is_never_written_through(sha, tmp_path):
    res = resultlib.result("disk")
    victim = tmp_path / "victim.txt"
    victim.write_text("a user's file\n")
    out = tmp_path / "out"
    out.mkdir()
    tmp = out / f".{resultlib.result_path(res, out).name}.{os.getpid()}.tmp"
    os.symlink(victim, tmp)
    p = resultlib.write(res, out)
    assert victim.read_text() == "a user's file\n"
    assert json.loads(p.read_text())["name"] == "disk" and not os.path.lexists(tmp)
