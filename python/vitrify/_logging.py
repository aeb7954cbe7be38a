"""vitrify's logging: everything goes to the ``vitrify`` logger, which is quiet by default.

``VITRIFY_LOG_LEVEL`` (read and validated by :mod:`vitrify.config`) attaches a stderr handler at
that level when vitrify is imported. Native messages arrive on ``vitrify.native``.
"""

from __future__ import annotations

import atexit
import logging

logger = logging.getLogger("vitrify")
logger.addHandler(logging.NullHandler())


def configure(level: int | None) -> None:
    """Attach a stderr handler at ``level`` (None: stay quiet); once, however often called."""
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
