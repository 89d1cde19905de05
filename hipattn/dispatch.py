"""Which kernel path serves a call, decided from host-known facts only.

The small-seq path takes every call whose static configuration it supports and whose host-given
bounds max_seqlen_q/k fit its tile; the general flash path takes the rest. A call neither can take
raises NotImplementedError naming both reasons. Nothing here reads device memory or synchronizes.
``HIPATTN_LOG=debug`` logs each decision and its reason; ``HIPATTN_SMALLSEQ=0`` (or false, no,
off) turns the small-seq path off (A/B comparisons).
"""

from __future__ import annotations

import logging
import os

from . import env
from .ops import flash, smallseq
from .problem import Problem

logger = logging.getLogger("hipattn")

SMALLSEQ = "smallseq"
FLASH = "flash"

SMALLSEQ_SWITCH = "HIPATTN_SMALLSEQ"


def smallseq_enabled() -> bool:
    return env.flag(SMALLSEQ_SWITCH, True)  # read per call: a change applies at once


def choose_path(problem: Problem, direction: str) -> str:
    """``SMALLSEQ`` or ``FLASH`` for a ``"forward"`` or ``"backward"`` call."""
    if smallseq_enabled():
        why_not_smallseq = smallseq.ineligibility(problem)
    else:
        why_not_smallseq = f"{SMALLSEQ_SWITCH}={os.environ[SMALLSEQ_SWITCH].strip()}"
    if why_not_smallseq is None:
        path, reason = SMALLSEQ, "every sequence fits the small-seq tile"
    else:
        why_not_flash = flash.ineligibility(problem, direction)
        if why_not_flash is not None:
            raise NotImplementedError(
                f"hipattn has no {direction} kernel for this call: not the small-seq path ({why_not_smallseq}), "
                f"not the flash path ({why_not_flash})"
            )
        path, reason = FLASH, why_not_smallseq
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s %s path: %s (%s)", direction, path, reason, problem)
    return path
