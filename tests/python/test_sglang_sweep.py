"""SAVE's shape sweep (integrations/sglang/sweep.py, PLUGIN.md P19) on the CPU: the plan covers
every compile-time class a request shape selects in SGLang's kernels (batch-size powers of two,
prompt lengths 1 ... the longest, page-unaligned, prefix hits, kinds of answer) and nothing the
server would refuse; running it marks the server "starting", sends the end request even when
requests fail, and sends nothing when SGLang's warm-up is skipped. The scheduler's side (the
sweep's requests not counted, no archive before its end) runs in test_sglang_freeze.py's
worker; the releases' real argument records in sglang_release_cases.py."""

from __future__ import annotations

import enum
import http.server
import json
import threading
import types

import pytest
from vitrify.integrations.sglang import state, sweep, versions
from vitrify.integrations.sglang.config import (
    PluginConfig,
    PluginConfigError,
    from_mapping,
)


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("max_batch", [1, 2, 3, 5, 16, 17, 48, 64, 100, 256, 4096])
def test_batch_sizes_cover_every_power_of_two_class(max_batch):
    sizes = sweep.batch_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and 1 <= sizes[0] and sizes[-1] == max_batch
    assert {pow2(b) for b in sizes} == {pow2(n) for n in range(1, max_batch + 1)}
    if max_batch >= 5:  # a class's bottom and its top: sizes off the decode-graph ladder too
        assert {3, 4, 5} <= set(sizes)


@pytest.mark.parametrize("max_input,page", [(1, 1), (2, 16), (100, 1), (4092, 16), (131000, 64)])
def test_prompt_lengths_cover_every_class_up_to_the_longest(max_input, page):
    lengths = sweep.prompt_lengths(max_input, page)
    assert lengths[0] == 1 and lengths[-1] == max_input
    assert all(1 <= n <= max_input for n in lengths)
    assert {pow2(n) for n in lengths} == {pow2(n) for n in range(1, max_input + 1)}
    assert {n % 16 == 0 for n in lengths if n > 16} <= {True, False}
    if max_input > 2 * page + 1 and page > 1:  # page-aligned and not, around a page
        assert {page - 1, page, page + 1, 2 * page + 1} <= set(lengths)


LIMITS = [sweep.Limits(max_input=4092, max_batch=64, page=16, chunk=8192, vocab=32000),
          sweep.Limits(max_input=30, max_batch=256, page=1, chunk=None, vocab=50),
          sweep.Limits(max_input=131000, max_batch=48, page=64, chunk=2048, vocab=128256),
          sweep.Limits(max_input=1, max_batch=1)]


@pytest.mark.parametrize("lim", LIMITS, ids=lambda x: f"in{x.max_input}-bs{x.max_batch}")
def test_the_plan_covers_the_classes_and_stays_inside_the_limits(lim):
    plan = sweep.plan(lim)
    assert plan == sweep.plan(lim) and plan != sweep.plan(lim, seed=1) or lim.max_input == 1
    for b in plan:
        assert 1 <= len(b.prompts) <= lim.max_batch
        assert all(1 <= len(p) <= lim.max_input for p in b.prompts)
        assert all(10 <= t < max(11, lim.vocab) for p in b.prompts for t in p)
    by = {w: [b for b in plan if b.what == w] for w in ("batch", "prefix", "length", "kind")}
    want = {pow2(n) for n in range(1, lim.max_batch + 1)}
    assert {pow2(len(b.prompts)) for b in by["batch"]} == want
    assert {pow2(len(b.prompts)) for b in by["prefix"]} == (want if lim.max_input > 1 else set())
    room = min(sweep.BATCH_TOKENS, lim.chunk or sweep.BATCH_TOKENS)
    assert all(sum(map(len, b.prompts)) <= max(room, len(b.prompts)) for b in by["batch"])
    # a prefix batch is the batch before it, each prompt grown (a radix-cache hit, then an extend)
    for first, again in zip(by["batch"], by["prefix"]):
        assert len(first.prompts) == len(again.prompts)
        for p, q in zip(first.prompts, again.prompts):
            assert len(q) > len(p) and q[:len(p)] == p
    # every other prompt starts with its own token: no two share a cached prefix
    firsts = [p[0] for w in ("batch", "length", "kind") for b in by[w] for p in b.prompts]
    assert len(firsts) == len(set(firsts)) or lim.vocab < len(firsts) + 10
    assert [len(b.prompts[0]) for b in by["length"]] == sweep.prompt_lengths(lim.max_input,
                                                                             lim.page)
    kinds = {json.dumps([b.sampling, b.logprobs, b.stream], sort_keys=True) for b in by["kind"]}
    assert len(kinds) == len(sweep.KINDS)


def test_a_batch_body_is_one_generate_request_of_every_prompt():
    b = sweep.Batch("batch", ((10, 11), (12,)), sampling={"top_k": 5})
    body = b.body(["r0", "r1"])
    assert body["input_ids"] == [[10, 11], [12]] and body["rid"] == ["r0", "r1"]
    assert body["sampling_params"] == {"temperature": 0, "max_new_tokens": sweep.MAX_NEW_TOKENS,
                                       "ignore_eos": True, "top_k": 5}
    one = sweep.Batch("length", ((10, 11, 12),), logprobs={"return_logprob": True}, stream=True)
    body = one.body(["r"])
    assert body["input_ids"] == [10, 11, 12] and body["rid"] == "r"
    assert body["return_logprob"] is True and body["stream"] is True


@pytest.mark.parametrize("kw,word", [({"max_input": 0}, "max_input"),
                                     ({"max_batch": True}, "max_batch"),
                                     ({"page": 1.5}, "page"), ({"chunk": 0}, "chunk")])
def test_limits_refuse_what_is_no_limit(kw, word):
    base = {"max_input": 10, "max_batch": 4}
    with pytest.raises(ValueError, match=f"sweep limit {word}"):
        sweep.Limits(**{**base, **kw})


def test_the_config_keys():
    cfg = from_mapping({"mode": "off"})
    assert (cfg.shape_sweep, cfg.sweep_max_batch) == (True, 256)
    cfg = from_mapping({"mode": "off", "shape_sweep": False, "sweep_max_batch": 8})
    assert (cfg.shape_sweep, cfg.sweep_max_batch) == (False, 8)
    with pytest.raises(PluginConfigError, match="'shape_sweep': expected true or false"):
        from_mapping({"mode": "off", "shape_sweep": "yes"})
    with pytest.raises(PluginConfigError, match="'sweep_max_batch': must be between 1 and 4096"):
        from_mapping({"mode": "off", "sweep_max_batch": 0})


class _Args:
    api_key = None
    dp_size = 1
    page_size = 16
    chunked_prefill_size = 512
    max_running_requests = 8
    skip_server_warmup = False

    def __init__(self, port):
        self.port = port

    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def ssl_verify(self):
        return True


Status = enum.Enum("ServerStatus", "Up Starting")


def _server(fail_rid_part=None):
    seen = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((body, tm.server_status))
            rid = body["rid"] if isinstance(body["rid"], str) else body["rid"][0]
            bad = fail_rid_part is not None and fail_rid_part in rid
            self.send_response(500 if bad else 200)
            self.end_headers()
            self.wfile.write(b'{"text": "x"}')

        def log_message(self, *a):
            pass

    tm = types.SimpleNamespace(server_status=Status.Up, max_req_input_len=200,
                               model_config=types.SimpleNamespace(context_len=256, vocab_size=700))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen, tm


@pytest.fixture
def save_state(monkeypatch, tmp_path):
    pytest.importorskip("requests")
    cfg = PluginConfig(mode="save", archive=str(tmp_path / "a"), region_bytes=1 << 30,
                       sweep_max_batch=6)
    monkeypatch.setattr(state, "STATE", state.PluginState(config=cfg))
    return cfg


@pytest.mark.parametrize("fail", [None, "-3-"])
def test_the_sweep_runs_while_the_server_is_starting_and_always_ends(monkeypatch, save_state,
                                                                     caplog, fail):
    srv, seen, tm = _server(fail)
    monkeypatch.setattr(versions.current(), "launcher_status", lambda: (tm, Status))
    args = _Args(srv.server_address[1])
    try:
        caplog.set_level("INFO", logger="vitrify.sglang")
        assert sweep.run(True, args) is True
    finally:
        srv.shutdown()
    lim = sweep.limits(args, tm)  # the request limit and the config's cap: the lower
    assert lim == sweep.Limits(max_input=200, max_batch=6, page=16, chunk=512, vocab=700)
    plan = sweep.plan(lim)
    assert len(seen) == len(plan) + 1 and {st for _, st in seen} == {Status.Starting}
    assert tm.server_status is Status.Up
    assert seen[-1][0]["rid"].startswith(sweep.END_RID_PREFIX)
    assert [b["input_ids"] for b, _ in seen[:-1]] == [p.body(["x"] * len(p.prompts))["input_ids"]
                                                      for p in plan]
    if fail:  # one refused shape: counted, named, and the sweep went on to its end
        assert f"1 of {len(plan)} request(s) failed" in caplog.text
        assert "HTTP 500" in caplog.text
    else:
        assert "failed" not in caplog.text
    assert f"SAVE shape sweep: {len(plan)} request(s)" in caplog.text


def test_no_sweep_when_sglangs_warm_up_is_skipped_or_the_sweep_is_off(monkeypatch, save_state):
    srv, seen, tm = _server()
    monkeypatch.setattr(versions.current(), "launcher_status", lambda: (tm, Status))
    args = _Args(srv.server_address[1])
    try:
        assert sweep.run(False, args) is False  # SGLang's own warm-up failed
        args.skip_server_warmup = True
        assert not sweep.expected(args) and sweep.run(True, args) is True
        args.skip_server_warmup = False
        monkeypatch.setattr(state.STATE, "config", PluginConfig(
            mode="save", archive="/x", region_bytes=1, shape_sweep=False))
        assert not sweep.expected(args) and sweep.run(True, args) is True
        monkeypatch.setattr(state.STATE, "config", PluginConfig(mode="load", archive="/x"))
        assert not sweep.expected(args)
    finally:
        srv.shutdown()
    assert seen == []


def test_unknown_limits_skip_the_sweep_and_still_end_it(monkeypatch, save_state, caplog):
    srv, seen, tm = _server()
    tm.max_req_input_len, tm.model_config = None, None
    monkeypatch.setattr(versions.current(), "launcher_status", lambda: (tm, Status))
    try:
        assert sweep.run(True, _Args(srv.server_address[1])) is True
    finally:
        srv.shutdown()
    assert "shape sweep not run" in caplog.text and "longest prompt is not known" in caplog.text
    assert len(seen) == 1 and seen[0][0]["rid"].startswith(sweep.END_RID_PREFIX)
