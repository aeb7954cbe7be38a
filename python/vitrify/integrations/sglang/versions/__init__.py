"""One module per supported SGLang release (PLUGIN.md, "One seam per SGLang version").

Owns: the list of supported releases (:data:`SUPPORTED`), which module serves which
(:func:`for_version`), the installed SGLang's version check (:func:`installed`) and the module
the rest of the plugin asks (:func:`current`). Each ``v0_5_*`` module holds everything that
knows an SGLang internal for its release — hook targets, how arguments are read, resolved and
changed, field lists, process roles, log lines — and imports only the standard library at import
time (SGLang lazily, inside its functions). Adding a release is one new module here, one line
in :data:`SUPPORTED`, and its tests.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .. import state

SUPPORTED = ("0.5.17", "0.5.23")


def _module_name(version: str) -> str:
    return "v" + version.replace(".", "_")


def supported_text() -> str:
    return ", ".join(SUPPORTED)


def for_version(version: str) -> ModuleType:
    """The module for SGLang ``version``; any other is the plugin's one-line fatal naming the
    supported releases (P4)."""
    if version not in SUPPORTED:
        raise state.fatal(f"SGLang {version} is not supported; this vitrify supports SGLang "
                          f"{supported_text()}")
    return importlib.import_module(f"{__name__}.{_module_name(version)}")


def installed() -> tuple[str, ModuleType]:
    """The importable SGLang's ``__version__`` and its module (fatal when SGLang cannot be
    imported or is not supported)."""
    try:
        import sglang
    except Exception as e:
        raise state.fatal(f"cannot import sglang: {type(e).__name__}: {e}") from None
    version = str(getattr(sglang, "__version__", "unknown"))
    return version, for_version(version)


def process_role_from(targets: dict[str, str]) -> str:
    """This process's part in an SGLang server, from the function ``multiprocessing`` started
    it with (``module.qualname`` looked up in ``targets``, a release's table): the process no
    multiprocessing target started (or one started by a function not in the table, e.g. a
    user's process that builds an ``Engine``) is a "launcher"."""
    import multiprocessing

    if multiprocessing.parent_process() is None:
        return "launcher"
    target = getattr(multiprocessing.current_process(), "_target", None)
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
    return targets.get(name, "launcher")


def current() -> ModuleType:
    """The module of this process's SGLang: the one ``register()`` chose, else the importable
    SGLang's (the hooks run inside SGLang, so it is imported already)."""
    if state.STATE.version is None:
        state.STATE.sglang_version, state.STATE.version = installed()
    return state.STATE.version


__all__ = ["SUPPORTED", "current", "for_version", "installed", "process_role_from",
           "supported_text"]
