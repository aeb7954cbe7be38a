"""vitrify's logging: everything goes to the ``vitrify`` logger, which is quiet by default.

``VITRIFY_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR or a number) attaches a stderr handler at that
level when vitrify is imported. Native messages arrive on ``vitrify.native``.

A bad ``VITRIFY_LOG_LEVEL`` never breaks ``import vitrify``: configuring the logger writes one
line naming the variable to stderr and leaves logging quiet; reading the settings
(:func:`vitrify.config.settings`) raises ``ValueError`` with the same text, and the ``vitrify``
command exits non-zero with it.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

logger = logging.getLogger("vitrify")
logger.addHandler(logging.NullHandler())

_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "WARN": 30, "ERROR": 40, "CRITICAL": 50}


def parse_level(text: str | None) -> int | None:
    """Return the numeric level for ``text`` or None when empty; ValueError when unknown."""
    if text is None or text.strip() == "":
        return None
    t = text.strip().upper()
    if t in _LEVELS:
        return _LEVELS[t]
    if t.isdigit():
        return int(t)
    raise ValueError(f"VITRIFY_LOG_LEVEL={text!r}: expected one of "
                     f"{', '.join(sorted(_LEVELS))} or a number")


_env_error: str | None = None


def env_error() -> str | None:
    """The message of a bad ``VITRIFY_LOG_LEVEL`` already reported on stderr, else None."""
    return _env_error


def configure_from_env() -> None:
    """Attach the stderr handler ``VITRIFY_LOG_LEVEL`` asks for; a bad value is reported as one
    line on stderr (once) and logging stays quiet."""
    global _env_error
    try:
        level = parse_level(os.environ.get("VITRIFY_LOG_LEVEL"))
    except ValueError as e:
        if _env_error != str(e):
            _env_error = str(e)
            sys.stderr.write(f"vitrify: {e} (logging stays quiet)\n")
        return
    if level is None:
        return
    logger.setLevel(level)
    if not any(getattr(h, "_vitrify_env", False) for h in logger.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        h._vitrify_env = True  # type: ignore[attr-defined]
        logger.addHandler(h)


def _native_forward(level: int, message: str) -> None:
    logging.getLogger("vitrify.native").log(level, message)


def install_native_sink(native) -> None:
    """Forward native log messages into ``vitrify.native`` while the interpreter lives."""
    native_logger = logging.getLogger("vitrify.native")
    native._set_log_sink(_native_forward, native_logger.getEffectiveLevel())
    atexit.register(native._set_log_sink, None, 0)
