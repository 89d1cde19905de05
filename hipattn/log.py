"""hipattn's one logging switch: HIPATTN_LOG=debug|info|warning|error (default: warning).

The library logs through logging.getLogger("hipattn") and never prints. When HIPATTN_LOG is set
and the application has configured no handler, one stderr handler is attached so the switch works
on its own.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("hipattn")


def configure_from_environment() -> None:
    level_name = os.environ.get("HIPATTN_LOG")
    if not level_name:
        return
    level = logging.getLevelName(level_name.upper())
    if not isinstance(level, int):
        logger.warning("HIPATTN_LOG=%s is not a logging level; use debug, info, warning or error", level_name)
        return
    logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("hipattn %(levelname)s: %(message)s"))
        logger.addHandler(handler)
