"""SAVE's shape sweep: requests that compile, before the archive is written, the kernel variants
later request shapes would compile (PLUGIN.md P19).

Owns: the sweep's plan (:func:`plan`: which batch sizes, prompt lengths, prefix hits and kinds of
answer, from the server's limits), its request ids (:data:`RID_PREFIX`, :data:`END_RID_PREFIX`:
the scheduler neither counts them as traffic nor records their lengths, and freezes only after
the end one), and running it in SAVE's launcher (:func:`run`) after SGLang's own warm-up request
and before the server reports ready.

Why: SGLang's kernels are specialised on what a request's shape makes of their arguments — the
paged allocator's ``alloc_extend_kernel`` / ``alloc_decode_kernel`` take
``next_power_of_2(batch size)`` as a compile-time constant, Triton specialises integer arguments
on divisibility by 16 and pointers on alignment — so a server that has served a few prompts has
compiled a few of the variants. The archive holds the JIT caches as they were at the freeze; a
variant compiled only later is compiled again by every LOAD. The sweep runs every power-of-two
class of batch size up to the server's batch limit (its top and its bottom), prompt lengths
1 … the longest prompt the server takes (each power of two, one less and one more: page-
unaligned, past the chunked-prefill size), prefix hits (the same prompts again, longer: an
extend with a prefix) at every batch-size class, and the kinds of answer (sampling, penalties,
logprobs with input logprobs, streaming).

Imports only the standard library at import time.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
import uuid
from typing import Any

from . import state, versions

log = logging.getLogger("vitrify.sglang")

RID_PREFIX = "vitrify-sweep-"
END_RID_PREFIX = RID_PREFIX + "end-"
BUDGET_S = 600.0  # the whole sweep; what is left unsent is a warning
MAX_NEW_TOKENS = 3  # two decode steps at each batch's size
BATCH_TOKENS = 8192  # the most prompt tokens one batch of the sweep holds (several forwards above)
# the kinds of answer, each a path of its own through the sampler and the logits processor
KINDS: tuple[dict, ...] = (
    {"sampling": {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05}},
    {"sampling": {"temperature": 0.8, "frequency_penalty": 0.5, "presence_penalty": 0.3,
                  "repetition_penalty": 1.1}},
    {"logprobs": {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}},
    {"stream": True, "logprobs": {"return_logprob": True}},
)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server takes: the longest prompt (tokens), the most requests in one batch, the
    KV page size, the chunked-prefill size (None: not chunked) and the vocabulary."""

    max_input: int
    max_batch: int
    page: int = 1
    chunk: int | None = None
    vocab: int = 1000

    def __post_init__(self) -> None:
        for name in ("max_input", "max_batch", "page", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"sweep limit {name} must be an int >= 1, got {v!r}")
        if self.chunk is not None and (isinstance(self.chunk, bool) or
                                       not isinstance(self.chunk, int) or self.chunk < 1):
            raise ValueError(f"sweep limit chunk must be None or an int >= 1, got {self.chunk!r}")


@dataclasses.dataclass(frozen=True)
class Batch:
    """One request of the sweep: its prompts (token ids; several are one batch), what it covers,
    and its ``/generate`` fields besides the prompts."""

    what: str  # "batch", "prefix", "length" or "kind"
    prompts: tuple
    sampling: dict = dataclasses.field(default_factory=dict)
    logprobs: dict = dataclasses.field(default_factory=dict)
    stream: bool = False

    def body(self, rids: list[str]) -> dict:
        one = len(self.prompts) == 1
        return {"input_ids": list(self.prompts[0]) if one else [list(p) for p in self.prompts],
                "rid": rids[0] if one else rids, "stream": self.stream, **self.logprobs,
                "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS,
                                    "ignore_eos": True, **self.sampling}}


def batch_sizes(max_batch: int) -> list[int]:
    """Every power-of-two class of batch size up to ``max_batch``: each class's top (its power of
    two, or ``max_batch`` in the last class) and its bottom (half the power, plus one)."""
    out, c = set(), 1
    while True:
        out.add(min(c, max_batch))
        if c // 2 + 1 <= max_batch:
            out.add(c // 2 + 1)
        if c >= max_batch:
            return sorted(out)
        c *= 2


def prompt_lengths(max_input: int, page: int = 1) -> list[int]:
    """Prompt lengths 1 … ``max_input``: 1 to 3, each power of two with one less and one more
    (page-unaligned ones among them), one page and its neighbours, and the longest."""
    want = {1, 2, 3, max_input, page - 1, page, page + 1, 2 * page + 1}
    p = 4
    while p - 1 <= max_input:
        want |= {p - 1, p, p + 1}
        p *= 2
    return sorted(n for n in want if 1 <= n <= max_input)


def plan(lim: Limits, seed: int = 0) -> list[Batch]:
    """The sweep for a server of limits ``lim`` (deterministic in ``seed``): batches of every
    size class, the same prompts again grown by a few tokens (prefix hits), every prompt length
    class, then each kind of answer at one prompt and at three."""
    rng = random.Random(seed)
    top = max(11, min(lim.vocab, 32000))
    made = [0]

    def prompt(n: int) -> tuple:
        made[0] += 1  # a distinct first token per prompt: no two share a cached prefix
        first = 10 + (made[0] * 7919) % (top - 10)
        return (first, *(rng.randrange(10, top) for _ in range(n - 1)))

    out: list[Batch] = []
    short = max(3, 2 * lim.page + lim.page // 2 + 3)  # a few pages, page-unaligned
    room = min(BATCH_TOKENS, lim.chunk or BATCH_TOKENS)
    for b in batch_sizes(lim.max_batch):
        # room to grow each prompt by up to a page and one for its prefix hit
        cap = max(1, min(short, lim.max_input - lim.page - 1, room // b))
        ps = tuple(prompt(rng.randint(1, cap)) for _ in range(b))
        out.append(Batch("batch", ps))
        grow = min(lim.page + 1, lim.max_input - max(len(p) for p in ps))
        if grow >= 1:  # none where the longest prompt is one token
            out.append(Batch("prefix", tuple(p + tuple(rng.randrange(10, top)
                                                       for _ in range(rng.randint(1, grow)))
                                             for p in ps)))
    out.extend(Batch("length", (prompt(n),)) for n in prompt_lengths(lim.max_input, lim.page))
    for kind in KINDS:
        for b in (1, min(3, lim.max_batch)):
            out.append(Batch("kind", tuple(prompt(rng.randint(1, min(64, lim.max_input)))
                                           for _ in range(b)), **kind))
    return out


def expected(server_args: Any) -> bool:
    """Whether a SAVE scheduler waits for the sweep's end before it freezes: the sweep is on and
    SGLang runs its warm-up (the sweep runs after it; ``--skip-server-warmup`` runs neither)."""
    cfg = state.STATE.config
    if cfg is None or cfg.mode != "save" or not cfg.shape_sweep:
        return False
    try:
        return not bool(versions.current().reader(server_args)("skip_server_warmup"))
    except Exception:  # noqa: BLE001 - a field this release lacks: its warm-up runs
        return True


def limits(server_args: Any, tm: Any) -> Limits:
    """The server's limits as the launcher knows them after SGLang's warm-up: the tokenizer
    manager's longest prompt (the schedulers' figure) and vocabulary, the resolved arguments'
    page size, chunked-prefill size and request limit, capped by ``sweep_max_batch``."""
    read = versions.current().reader(server_args)
    cfg = state.STATE.config
    mc = getattr(tm, "model_config", None)
    # SGLang refuses a prompt past the schedulers' figure, or one whose answer would pass the
    # context length
    bounds = [n for n in (getattr(tm, "max_req_input_len", None),
                          (getattr(mc, "context_len", None) or 0) - MAX_NEW_TOKENS - 1)
              if isinstance(n, int) and not isinstance(n, bool) and n >= 1]
    if not bounds:
        raise RuntimeError("the server's longest prompt is not known (no max_req_input_len, no "
                           "context length)")
    running = read("max_running_requests")
    batch = min(cfg.sweep_max_batch, running) if isinstance(running, int) and running > 0 \
        else cfg.sweep_max_batch
    chunk = read("chunked_prefill_size")
    return Limits(max_input=min(bounds), max_batch=batch,
                  page=max(1, int(read("page_size") or 1)),
                  chunk=chunk if isinstance(chunk, int) and chunk > 0 else None,
                  vocab=max(11, int(getattr(mc, "vocab_size", None) or 1000)))


def run(result: Any, server_args: Any = None) -> Any:
    """SAVE, launcher: after SGLang's own warm-up request, the sweep's requests (the server
    answers 503 to others meanwhile), then the end request the scheduler freezes after. A
    failed request is counted and the sweep goes on; the end request is always sent."""
    if result is False or server_args is None or not expected(server_args):
        return result
    from . import startup

    ver = versions.current()
    tm, status = ver.launcher_status()
    token = uuid.uuid4().hex[:12]
    t = time.perf_counter()
    sent = failed = 0
    batches: list[Batch] = []
    first_error = ""
    with startup.starting(tm, status):
        try:
            lim = limits(server_args, tm)
            batches = plan(lim)
            for i, b in enumerate(batches):
                left = BUDGET_S - (time.perf_counter() - t)
                if left <= 0:
                    log.warning("vitrify: SAVE's shape sweep: %.0f s spent, %d request(s) not "
                                "sent: LOAD may compile their kernels", BUDGET_S,
                                len(batches) - i)
                    break
                rids = [f"{RID_PREFIX}{token}-{i}-{j}" for j in range(len(b.prompts))]
                try:
                    startup.post_generate(server_args, b.body(rids), left)
                except Exception as e:  # noqa: BLE001 - one shape the server refused: go on
                    failed += 1
                    first_error = first_error or f"{b.what} of {len(b.prompts)}: " \
                                                 f"{type(e).__name__}: {e}"
                sent += 1
        except Exception as e:  # noqa: BLE001 - the limits: no sweep, the archive still made
            log.warning("vitrify: SAVE's shape sweep not run (%s: %s): LOAD may compile kernels "
                        "later request shapes need", type(e).__name__, e)
        finally:
            try:
                startup.post_generate(server_args, {
                    "input_ids": [10], "rid": f"{END_RID_PREFIX}{token}",
                    "sampling_params": {"temperature": 0, "max_new_tokens": 1}}, 120.0)
            except Exception as e:  # noqa: BLE001 - reported: SAVE then never writes
                log.error("vitrify: SAVE's shape sweep could not send its end request (%s: %s): "
                          "the scheduler waits for it before it writes the archive",
                          type(e).__name__, e)
    if failed:
        log.warning("vitrify: SAVE's shape sweep: %d of %d request(s) failed (first: %s)",
                    failed, sent, first_error[:300])
    if batches:
        sizes = sorted({len(b.prompts) for b in batches if b.what == "batch"})
        log.info("vitrify: SAVE shape sweep: %d request(s), %d prompt(s) (batch sizes %s; "
                 "prompt lengths 1..%d) in %.1f s", sent, sum(len(b.prompts) for b in batches),
                 ",".join(map(str, sizes)),
                 max(len(b.prompts[0]) for b in batches if b.what == "length"),
                 time.perf_counter() - t)
    return result


__all__ = [
    "BATCH_TOKENS",
    "BUDGET_S",
    "END_RID_PREFIX",
    "KINDS",
    "MAX_NEW_TOKENS",
    "RID_PREFIX",
    "Batch",
    "Limits",
    "batch_sizes",
    "expected",
    "limits",
    "plan",
    "prompt_lengths",
    "run",
]
