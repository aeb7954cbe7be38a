"""Which attention backends the SGLang plugin freezes, found wherever they sit (PLUGIN.md P17).

Owns: walking SGLang's routing backends (:func:`attention_leaves`: a prefill/decode split,
hybrid linear attention, two-batch overlap, nested), which graph-metadata interface a backend
implements (:func:`metadata_api`) and the check at the capture hook (:func:`check_attention`).
The class names are the release's (``versions.*.FROZEN_ATTENTION``, ``ATTENTION_WRAPPERS``,
``METADATA_API``, ``LEGACY_METADATA``). Imports only the standard library at import time.
"""

from __future__ import annotations

from typing import Any

from . import state, versions


def _class_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def attention_leaves(backend: Any, path: str = "attn_backend",
                     ver: Any = None) -> list[tuple[str, Any]]:
    """The attention backends that run attention under ``backend``, with where each sits: a
    routing backend (the release's ``ATTENTION_WRAPPERS``) is looked through, nested ones too;
    the same object reached twice is listed once."""
    wrappers = (ver or versions.current()).ATTENTION_WRAPPERS
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def walk(obj: Any, where: str) -> None:
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        fields = wrappers.get(_class_name(obj))
        if fields is None:
            out.append((where, obj))
            return
        for field in fields:
            child = getattr(obj, field, None)
            if isinstance(child, (list, tuple)):
                for i, c in enumerate(child):
                    walk(c, f"{where}.{field}[{i}]")
            else:
                walk(child, f"{where}.{field}")

    walk(backend, path)
    return out


def metadata_api(backend: Any, ver: Any = None) -> str:
    """Which graph-metadata interface ``backend``'s class implements: "current" (its own
    ``METADATA_API``, ``init_forward_metadata_out_graph``, what the graph runner calls at
    capture and replay), "legacy" (only ``init_forward_metadata_capture_cuda_graph`` /
    ``..._replay_cuda_graph``, which that runner no longer calls), or "none"."""
    ver = ver or versions.current()
    own = [k for k in type(backend).__mro__ if k.__name__ != "AttentionBackend"
           and k is not object]
    if any(ver.METADATA_API in vars(k) for k in own):
        return "current"
    if any(name in vars(k) for k in own for name in ver.LEGACY_METADATA):
        return "legacy"
    return "none"


def check_attention(backend: Any, ver: Any = None) -> list[str]:
    """The kinds (``FROZEN_ATTENTION``'s values) of the attention backends under ``backend``,
    after checking each is one whose graphs are frozen and prepares its graph metadata the way
    the graph runner asks; anything else is a :class:`~.state.FreezeRefused` naming every one."""
    ver = ver or versions.current()
    frozen = ver.FROZEN_ATTENTION
    problems, kinds = [], []
    leaves = attention_leaves(backend, ver=ver)
    if not leaves:
        raise state.FreezeRefused("attention backend: the model runner has none (attn_backend "
                                  "unset)")
    for where, leaf in leaves:
        kind = frozen.get(_class_name(leaf))
        if kind is None:
            problems.append(f"{where} is {type(leaf).__name__} (frozen: "
                            f"{', '.join(n.rsplit('.', 1)[1] for n in frozen)})")
        elif (api := metadata_api(leaf, ver)) != "current":
            how = ("the legacy " + " / ".join(ver.LEGACY_METADATA) if api == "legacy"
                   else "no method")
            problems.append(f"{where} ({type(leaf).__name__}) prepares graph metadata through "
                            f"{how}, which SGLang's graph runner does not call (it calls "
                            f"{ver.METADATA_API})")
        else:
            kinds.append(kind)
    if problems:
        raise state.FreezeRefused("attention backend: " + "; ".join(problems))
    return kinds


__all__ = ["attention_leaves", "check_attention", "metadata_api"]
