"""vitrify's weight update behind SGLang's own entry point (``update_weights_from_tensor``).

An RL framework updates an SGLang server the way it already does — ``Engine.
update_weights_from_tensor`` or the ``/update_weights_from_tensor`` HTTP route — with
``load_format="vitrify"`` and a one-entry payload naming a Unix socket where its
:class:`vitrify.weights.transport.Sender` listens (:func:`payload`, :func:`update`). In the
scheduler process the plugin's AROUND hook on ``WeightUpdater.update_weights_from_tensor``
(:func:`around_update_weights_from_tensor`) connects there and runs a
:class:`~vitrify.weights.transport.Receiver` over the model's parameters (SGLang's fused names,
``megatron_llama(engine="fused")``): the tensors stream through the sender's staging buffer (or
are written in place when the server's weights are exportable) and are verified on the GPU.
SGLang gets ``(False, reason)`` for any failure; its other load formats pass through untouched.

A failed update leaves the receiver ``incomplete`` (the weights may be half old, half new): the
AROUND hook on ``Scheduler._add_request_to_queue`` (:func:`around_add_request_to_queue`) then
finishes every new request with an abort naming the reason, until an update completes.

The server needs the plugin's config with ``weight_updates = true`` (``VITRIFY_SGLANG_CONFIG``).

Owns: the weight-update receiver behind SGLang's update routes (the two hooks above), the
trainer's side (:func:`payload`, :func:`update`, :func:`report_of`) and the refusal of requests
while the weights are incomplete (:func:`refusal`). What it needs of a thawed server (its
exportable region, its rebuilt graphs) it reads from ``state.py``; the tensor-parallel size from
the release's module. Imports only the standard library at import time.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping as MappingABC
from typing import Any

from . import state, versions

log = logging.getLogger("vitrify.sglang")

LOAD_FORMAT = "vitrify"
REPORT_PREFIX = "report: "  # the success message ends with it and the update's JSON report
_PREFIX = "vitrify:"  # the payload's one tensor name: the prefix, then JSON

# Receivers of this process, one per WeightUpdater (SGLang's is a frozen dataclass with slots:
# nothing can be stored on it or weakly referenced), for the queue hook.
_RECEIVERS: list[Any] = []
_BY_UPDATER: dict[int, tuple[Any, Any]] = {}  # id -> (updater, receiver): the ref keeps the id
_LOCK = threading.Lock()


def payload(path: str, *, timeout: float = 600.0,
            weight_version: str | None = None) -> list[tuple[str, Any]]:
    """``named_tensors`` for ``update_weights_from_tensor(..., load_format="vitrify")``: the
    socket where the trainer's sender listens, carried in the one entry's name (its value is
    None: nothing for SGLang's serializer to share). ``weight_version``: after the update,
    vitrify's HiCache backends of the server store and find pages under it (no KV of the old
    weights is served)."""
    meta = {"socket": str(path), "timeout": float(timeout)}
    if weight_version is not None:
        meta["weight_version"] = str(weight_version)
    return [(_PREFIX + json.dumps(meta, separators=(",", ":")), None)]


def _parse(named_tensors: Any) -> dict:
    entries = [n for n, _ in named_tensors if isinstance(n, str) and n.startswith(_PREFIX)]
    if len(entries) != 1 or len(named_tensors) != 1:
        raise ValueError(f"load_format={LOAD_FORMAT!r} takes exactly one entry made by "
                         f"vitrify.integrations.sglang.weights.payload(), got "
                         f"{len(named_tensors)} entries")
    meta = json.loads(entries[0][len(_PREFIX):])
    if not isinstance(meta, dict) or not isinstance(meta.get("socket"), str):
        raise ValueError(f"the vitrify payload names no socket: {entries[0][:200]!r}")
    return meta


def mapping_for(model: Any) -> Any:
    """The Megatron-style layout onto this SGLang model's fused parameters, from its config
    (heads, KV heads, head size) and parameters (QKV bias, Qwen3's q/k norms)."""
    from ...weights.mapping import megatron_llama

    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if cfg is None or heads is None:
        raise ValueError(f"{type(model).__name__} has no config with num_attention_heads")
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    names = {n for n, _ in model.named_parameters()}
    return megatron_llama(heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                          qkv_bias=any(n.endswith("self_attn.qkv_proj.bias") for n in names),
                          qk_norm=any(n.endswith("self_attn.q_norm.weight") for n in names),
                          engine="fused")


def tensor_parallel_size() -> int:
    """This scheduler's tensor-parallel size, where SGLang keeps it (its runtime context's
    ``get_parallel().tp_size``, on every supported release: a ModelRunner has no ``tp_size``).
    A ValueError names why when it cannot be read (the update is then refused)."""
    try:
        return versions.current().tp_size()
    except SystemExit:
        raise
    except Exception as e:
        raise ValueError(f"cannot tell this scheduler's tensor-parallel size "
                         f"(get_parallel().tp_size: {type(e).__name__}: {e})") from None


def receiver_of(updater: Any) -> Any:
    """The updater's receiver (made once: its state and digests outlive each update)."""
    with _LOCK:
        known = _BY_UPDATER.get(id(updater))
    if known is not None:
        return known[1]
    import torch

    from ...weights.transport import Receiver

    tp = tensor_parallel_size()
    if tp != 1:  # every rank would connect to the one trainer socket
        raise ValueError(f"vitrify weight updates take one GPU for now (tp_size {tp})")
    model = updater.get_model()
    params = dict(model.named_parameters())
    rx = Receiver(params, mapping_for(model),
                  synchronize=torch.cuda.synchronize if torch.cuda.is_available() else None,
                  exporter=_exporter(params))
    with _LOCK:
        _BY_UPDATER[id(updater)] = (updater, rx)
        _RECEIVERS.append(rx)
    return rx


def _exporter(params: MappingABC[str, Any]) -> Callable[[int, int], dict] | None:
    """Direct updates (the trainer writes in place, no staging) on a server thawed with
    exportable weights: every parameter in the LOAD's region. Else None: staged updates."""
    from ...weights.transport import region_exporter

    region = state.exportable_region()
    if region is None:
        return None
    end = region.base + region.size
    outside = [n for n, p in params.items() if p.numel() and not (
        region.base <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= end)]
    if outside:
        log.warning("vitrify: %d parameter(s) lie outside the thawed region (first %r): weight "
                    "updates are staged, not written in place", len(outside), outside[0])
        return None
    return region_exporter(region)


def engine_identity(rx: Any, updater: Any) -> dict:
    """What a weight update must leave as it was: the model's parameters, read from SGLang
    afresh (the same tensor objects the receiver writes, at the same addresses: a digest of
    them), and the thawed decode graphs (count, captures, builds; None outside a LOAD)."""
    import hashlib

    params = dict(updater.get_model().named_parameters())
    same = params.keys() == rx.engine.keys() and all(params[n] is rx.engine[n] for n in params)
    where = ",".join(f"{n}@{int(t.data_ptr()):x}" for n, t in params.items())
    return {"addresses": hashlib.sha256(where.encode()).hexdigest()[:16],
            "receiver_holds_the_parameters": same, "graphs": state.thawed_graphs()}


def _identity_or_none(rx: Any, updater: Any) -> dict | None:
    """:func:`engine_identity`, or None (logged) when it cannot be read: the report is for the
    caller's checks, never a reason to call a finished update failed."""
    try:
        return engine_identity(rx, updater)
    except Exception as e:
        log.warning("vitrify: the weight update's report could not read the engine: %s", e)
        return None


def around_update_weights_from_tensor(original: Callable, updater: Any, named_tensors: Any,
                                      load_format: str | None = None, *args: Any,
                                      **kwargs: Any) -> Any:
    """AROUND hook: ``load_format="vitrify"`` runs vitrify's receiver and returns SGLang's
    ``(success, message)``; any other format is SGLang's own path."""
    if load_format != LOAD_FORMAT:
        try:
            return original(updater, named_tensors, load_format, *args, **kwargs)
        finally:  # SGLang's own path changed weights behind the receiver's digests: a later
            with _LOCK:  # vitrify update sends everything
                known = _BY_UPDATER.get(id(updater))
            if known is not None:
                known[1].applied.clear()
    try:
        meta = _parse(named_tensors)
        rx = receiver_of(updater)
    except Exception as e:
        return False, f"vitrify: {type(e).__name__}: {e}"
    try:
        before = _identity_or_none(rx, updater)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(float(meta.get("timeout", 600.0)))
            conn.connect(meta["socket"])
            summary = rx.serve_one(conn)
    except Exception as e:  # the receiver's state says whether the weights are intact
        msg = f"vitrify: the weight update failed ({type(e).__name__}: {e}); engine {rx.state}"
        log.error("%s", msg)
        return False, msg
    how = "written in place" if summary.get("direct") else "through the trainer's staging"
    msg = (f"vitrify: {summary['tensors']} of {summary['tensors_total']} tensors, "
           f"{summary['bytes_moved']} bytes {how} in {summary['seconds']:.3f} s")
    if meta.get("weight_version") is not None:
        msg += "; " + _new_weight_version(str(meta["weight_version"]))
    # for a caller that checks: the summary, and whether the parameters and graphs stayed
    after = _identity_or_none(rx, updater)
    report = {**summary, "identity_before": before, "identity_after": after,
              "weights_in_place": bool(before and after and before["addresses"] ==
                                       after["addresses"] and
                                       after["receiver_holds_the_parameters"]),
              "graphs_before": (before or {}).get("graphs"),
              "graphs_after": (after or {}).get("graphs")}
    return True, msg + "; " + REPORT_PREFIX + json.dumps(report, separators=(",", ":"))


def _new_weight_version(version: str) -> str:
    """Tell this process's vitrify HiCache backends (if any) the weights' new version: pages
    are stored and found under it from now on. A backend that cannot reopen its store keeps
    none (it serves no stored page) and says so."""
    from .hicache import backend  # the HiCache backends open in this process register there

    backends = backend.live_backends()
    failed = []
    for b in backends:
        try:
            b.set_weight_version(version)
        except Exception as e:
            failed.append(f"{type(e).__name__}: {e}")
            log.error("vitrify: weight version %r not applied to a HiCache backend: %s",
                      version, e)
    return (f"weight version {version!r} applied to {len(backends) - len(failed)} of "
            f"{len(backends)} HiCache backend(s)" + (f" ({failed[0]})" if failed else ""))


def refusal() -> str | None:
    """Why this process must not serve now (a weight update failed or runs), or None."""
    with _LOCK:
        states = [rx.state for rx in _RECEIVERS]
    bad = [s for s in states if s != "ready"]
    if not bad:
        return None
    why = "a weight update failed part-way" if bad[0] == "incomplete" else \
        "a weight update is running"
    return f"vitrify: the model's weights are {bad[0]} ({why}); retry the update before serving"


def around_add_request_to_queue(original: Callable, scheduler: Any, req: Any, *args: Any,
                                **kwargs: Any) -> Any:
    """AROUND hook: while :func:`refusal` says so, the request is finished with an abort (SGLang
    answers it with the reason) instead of running on half-updated weights."""
    why = refusal()
    if why is not None and getattr(req, "to_finish", None) is None:
        req.set_finish_with_abort(why)
    return original(scheduler, req, *args, **kwargs)


def update(call: Callable[[list, str], Any], sender: Any, tensors: MappingABC[str, Any],
           path: str, *, versions: MappingABC[str, Any] | None = None,
           timeout: float = 600.0, weight_version: str | None = None) -> dict:
    """The trainer's side: listen at ``path``, ask SGLang to update through ``call(named_tensors,
    load_format)`` (e.g. ``lambda nt, lf: engine.update_weights_from_tensor(named_tensors=nt,
    load_format=lf)``), and stream ``tensors`` to the receiver that connects
    (``weight_version``: see :func:`payload`). Returns the engine's summary, with the engine's
    report (:func:`report_of`) as ``engine_report``; raises
    :class:`~vitrify.weights.transport.UpdateError` when either side failed (SGLang's answer
    included)."""
    from ...weights.transport import UpdateError, listen

    box: dict[str, Any] = {}

    def ask() -> None:
        try:
            box["answer"] = call(payload(path, timeout=timeout,
                                         weight_version=weight_version), LOAD_FORMAT)
        except BaseException as e:  # reported below
            box["error"] = e

    with listen(path) as srv:
        srv.settimeout(timeout)
        t = threading.Thread(target=ask, name="vitrify-sglang-update", daemon=True)
        t.start()
        try:
            conn, _ = srv.accept()
        except OSError as e:
            t.join(timeout)
            raise UpdateError(f"SGLang did not connect for the update: {e}; its answer: "
                              f"{box.get('answer', box.get('error'))}") from None
        try:
            with conn:
                conn.settimeout(timeout)
                fin = sender.update_over(conn, tensors, versions=versions,
                                         where="the SGLang server")
        finally:  # SGLang's answer, also when this side failed (it saw the socket close)
            t.join(timeout)
    if "error" in box:
        raise UpdateError(f"SGLang's update call failed: {box['error']}")
    answer = box.get("answer")
    ok = answer[0] if isinstance(answer, (tuple, list)) and answer else \
        getattr(answer, "success", True)
    if ok is False:
        raise UpdateError(f"SGLang reported a failed update: {answer}")
    message = answer[1] if isinstance(answer, (tuple, list)) and len(answer) > 1 else \
        getattr(answer, "message", None)
    return {**fin, "engine_report": report_of(message)}


def report_of(message: Any) -> dict | None:
    """The JSON report at the end of a successful vitrify update's message (the engine's
    summary, ``weights_in_place``, ``graphs_before`` / ``graphs_after``), or None."""
    if not isinstance(message, str) or REPORT_PREFIX not in message:
        return None
    try:
        report = json.loads(message.rsplit(REPORT_PREFIX, 1)[1])
    except ValueError:
        return None
    return report if isinstance(report, dict) else None
