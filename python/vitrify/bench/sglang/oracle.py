"""The oracle's power: evidence, in every end-to-end result, that its checks could have failed.

Owns: the prompt pair that shares only its last token (:func:`last_token_pair`) and the verdict
on it (:func:`pair_power`: the two must not give the same tokens and logprobs, or the outputs do
not depend on the context and no check can see a wrong KV cache), the two planted faults —
one KV page whose bytes are another page's under a valid checksum, written through vitrify's
store API into the L3 store between two launches (:func:`plant_page_swap`, with SGLang's page
keys from :func:`page_keys`), and one weight moved by one ulp after LOAD through SGLang's
``/update_weights_from_tensor`` (:func:`weight_ulp_fault`) — and the ``oracle_power`` object a
result carries (:func:`power`): ``ok`` only when every pair differed and the planted fault turned
its comparison false.
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import Any, Callable, Optional

from .harness import logprob_diff, prefix_pages, tokens_identical

KV_KIND = "kv"  # the payload kind of the vitrify HiCache backend's slab stores


def last_token_pair(seed: int, length: int, vocab: int = 32000) -> tuple[list[int], list[int]]:
    """Two prompts of ``length`` random token ids (3..vocab-1) that differ at every position but
    the last, where they share one token."""
    if length < 2:
        raise ValueError(f"a last-token pair needs length >= 2, got {length}")
    rng = random.Random(seed)
    a = [rng.randrange(3, vocab) for _ in range(length)]
    b = []
    for x in a[:-1]:
        y = rng.randrange(3, vocab - 1)
        b.append(y if y < x else y + 1)  # uniform over 3..vocab-1 without x
    return a, b + [a[-1]]


def pair_power(ra: dict, rb: dict, launch: str = "") -> dict:
    """The verdict on one pair's two answers: ``distinct`` True when their output tokens or
    their logprobs differ, False when both are the same (the oracle is blind: attention's
    contribution is below the output's resolution), None when there are no logprobs to tell."""
    rec: dict[str, Any] = {"launch": launch, "prompt_tokens": [ra.get("prompt_tokens"),
                                                               rb.get("prompt_tokens")],
                           "tokens_differ": ra["output_ids"] != rb["output_ids"],
                           "logprob_max_abs_diff": logprob_diff([ra], [rb])}
    if not ra["logprobs"] or not rb["logprobs"]:
        rec["distinct"] = None
        rec["why"] = "no logprobs returned"
        return rec
    diff = rec["logprob_max_abs_diff"]
    rec["distinct"] = rec["tokens_differ"] or (diff is not None and diff > 0.0)
    if not rec["distinct"]:
        rec["why"] = ("prompts that share only their last token gave the same tokens and "
                      "logprobs: the outputs do not depend on the context")
    return rec


def power(pairs: list[dict], fault: Optional[dict], weights: Optional[dict] = None) -> dict:
    """The ``oracle_power`` object: ``ok`` when there is at least one pair, every pair was
    ``distinct`` and the planted ``fault`` was ``caught``; ``why`` lists what failed."""
    why = []
    if not pairs:
        why.append("no last-token pair ran")
    for p in pairs:
        if p.get("distinct") is not True:
            why.append(f"last-token pair in {p.get('launch') or 'a launch'}: "
                       f"{p.get('why', 'not distinct')}")
    if fault is None:
        why.append("no fault was planted")
    elif fault.get("caught") is not True:
        why.append(f"planted fault ({fault.get('fault')}): "
                   f"{fault.get('why', 'not caught: the check stayed true')}")
    out: dict[str, Any] = {"ok": not why, "last_token_pairs": pairs, "planted_fault": fault}
    if weights is not None:
        out["weights"] = weights
    if why:
        out["why"] = why
    return out


# ---- the KV page fault (HiCache) ---------------------------------------------------------------


def page_keys(tokens: list[int], page: int) -> list[str]:
    """SGLang 0.5.17's storage keys of the full pages of ``tokens`` from the root of the radix
    tree (``get_hash_str(tokens, None, page_size=page)``): a SHA-256 chain, page i's key the hex
    digest of page i-1's digest followed by page i's token ids as little-endian uint32."""
    keys, prior = [], b""
    for i in range(len(tokens) // page):
        d = hashlib.sha256(prior + struct.pack(f"<{page}I", *tokens[i * page:(i + 1) * page]))
        prior = d.digest()
        keys.append(d.hexdigest())
    return keys


def fault_page(a: list[int], b: list[int], page: int) -> tuple[int, str, str]:
    """The page of ``a`` the fault replaces (its middle reusable page) and the keys of that page
    in ``a`` and in ``b`` (the same positions of another context)."""
    n = min(prefix_pages(len(a), page), prefix_pages(len(b), page))
    if n < 2:
        raise ValueError(f"the pair's prompts ({len(a)}, {len(b)} tokens) need at least 2 "
                         f"reusable pages of {page} tokens")
    k = n // 2
    return k, page_keys(a, page)[k], page_keys(b, page)[k]


def _swap(store: Any, key_a: str, key_b: str, where: str) -> dict:
    """In one open store: page A's bytes replaced by page B's under A's key (a valid checksum,
    written by the store itself)."""
    a, b = store.get(key_a, KV_KIND), store.get(key_b, KV_KIND)
    if a is None or b is None:
        return {"where": where, "planted": False,
                "why": f"page {'A' if a is None else 'B'} is not in the {where} store"}
    if a == b:
        return {"where": where, "planted": False, "why": "pages A and B hold the same bytes"}
    store.delete(key_a, KV_KIND)
    put = store.put(key_a, b, KV_KIND)
    got = store.get(key_a, KV_KIND)
    return {"where": where, "planted": bool(put and got == b), "bytes": len(b),
            **({} if put and got == b else {"why": "the store did not keep B's bytes under A"})}


def plant_page_swap(store_info: dict, dirs: list[str], key_a: str, key_b: str, *,
                    direct_io: str = "auto", host_bytes: int = 0,
                    host_dir: Optional[str] = None) -> dict:
    """Open the stopped server's KV store (``store_info``: the ``store`` object of the backend's
    stats file: name, page_bytes, budget_bytes) with ``cold_start="load"`` and put page B's
    bytes under page A's key; the same in its host tier when it has one (``host_bytes``: a
    restarted server reads that tier first). The record says whether it was planted."""
    from vitrify import disk, tier

    rec: dict[str, Any] = {"key_a": key_a, "key_b": key_b, "store": store_info.get("name")}
    page = int(store_info["page_bytes"])
    with disk.DiskStore(list(dirs), int(store_info["budget_bytes"]), {KV_KIND: page},
                        name=store_info["name"], cold_start="load", direct_io=direct_io) as st:
        rec["disk"] = _swap(st, key_a, key_b, "disk")
    planted = rec["disk"]["planted"]
    if host_bytes:
        with tier.HostStore(host_bytes, {KV_KIND: page}, dir=host_dir, name=store_info["name"],
                            cold_start="load") as hs:
            if hs.exists(key_a, KV_KIND):
                rec["host"] = _swap(hs, key_a, key_b, "host tier")
                planted = planted and rec["host"]["planted"]
            else:
                rec["host"] = {"where": "host tier", "planted": None, "why": "page A not there"}
    rec["planted"] = planted
    return rec


def judge_page_fault(faulty: dict, control: dict, ref_faulty: dict, ref_control: dict,
                     page: int) -> dict:
    """The verdict on the KV page fault: ``faulty`` (the pair's first prompt, read from L3 with
    page A replaced) against its miss ``ref_faulty``, ``control`` (the pair's second prompt, its
    pages untouched, also from L3) against its miss. ``caught`` needs the faulty comparison
    false, the control's true, and both prompts' whole prefix from storage."""
    def full(r: dict) -> bool:
        return int((r.get("details") or {}).get("storage", 0)) == \
            prefix_pages(r["prompt_tokens"], page) * page > 0

    f_same = tokens_identical([faulty], [ref_faulty]) and \
        logprob_diff([faulty], [ref_faulty]) == 0.0
    c_same = tokens_identical([control], [ref_control]) and \
        logprob_diff([control], [ref_control]) == 0.0
    rec: dict[str, Any] = {
        "faulty_identical_to_miss": f_same, "control_identical_to_miss": c_same,
        "faulty_logprob_max_abs_diff": logprob_diff([faulty], [ref_faulty]),
        "faulty_from_storage": full(faulty), "control_from_storage": full(control)}
    if not (rec["faulty_from_storage"] and rec["control_from_storage"]):
        rec["caught"] = None
        rec["why"] = "the pair was not read whole from L3 storage: the fault was not exercised"
    elif not c_same:
        rec["caught"] = False
        rec["why"] = ("the untouched prompt differed from its miss too: the comparison cannot "
                      "single out the fault (deterministic inference off?)")
    else:
        rec["caught"] = not f_same
        if f_same:
            rec["why"] = "the L3 hit with another page's bytes equalled the miss"
    return rec


# ---- the weight fault (freeze, weights) --------------------------------------------------------


def ulp_up(t: Any, index: int = 0) -> Any:
    """A copy of bf16 tensor ``t`` with element ``index`` (flat) one ulp further from zero."""
    import torch

    if t.dtype != torch.bfloat16:
        raise ValueError(f"ulp_up needs a bfloat16 tensor, got {t.dtype}")
    out = t.clone().contiguous()
    bits = out.view(torch.int16).view(-1)
    bits[index] += 1  # the magnitude's next representable value (sign bit untouched)
    return out


def weight_ulp_fault(update: Callable[[list], tuple[bool, str]],
                     rerun: Callable[[], list[dict]], reference: list[dict], *, name: str,
                     clean: Any, index: int = 0, where: str = "after LOAD") -> dict:
    """Weight ``name`` (whose value is ``clean``) with one element one ulp up through
    ``update(named_tensors) -> (ok, message)``, ``rerun()`` the prompts whose answers were
    ``reference``, then ``clean`` back and ``rerun()`` again. ``caught``: the faulty answers
    differ from ``reference`` (tokens or logprobs bit for bit) while the restored ones equal
    it."""
    faulty = ulp_up(clean, index)
    a = float(clean.reshape(-1)[index])
    b = float(faulty.reshape(-1)[index])
    rec: dict[str, Any] = {
        "fault": f"{name}[{index}] one ulp up {where} ({a!r} -> {b!r}) through SGLang's "
                 f"/update_weights_from_tensor", "param": name, "index": index,
        "from": a, "to": b, "prompts": len(reference)}
    ok, msg = update([(name, faulty)])
    rec["update"] = {"ok": ok, "message": msg[:300]}
    if not ok:
        rec.update(planted=False, caught=None, why=f"the update failed: {msg[:200]}")
        return rec
    rec["planted"] = True
    got = rerun()
    rec["faulty_tokens_identical"] = tokens_identical(got, reference)
    rec["faulty_logprob_max_abs_diff"] = logprob_diff(got, reference)
    ok2, msg2 = update([(name, clean)])
    rec["restore"] = {"ok": ok2, "message": msg2[:300]}
    back = rerun() if ok2 else []
    rec["restored_identical"] = ok2 and tokens_identical(back, reference) and \
        logprob_diff(back, reference) == 0.0
    differs = not (rec["faulty_tokens_identical"] and rec["faulty_logprob_max_abs_diff"] == 0.0)
    if rec["faulty_logprob_max_abs_diff"] is None and rec["faulty_tokens_identical"]:
        rec["caught"] = None
        rec["why"] = "no logprobs to compare"
    elif not rec["restored_identical"]:
        rec["caught"] = False
        rec["why"] = ("with the weight restored the answers did not equal the reference: the "
                      "difference cannot be told from the fault")
    else:
        rec["caught"] = differs
        if not differs:
            rec["why"] = "the answers with the weight one ulp off equalled the reference"
    return rec
