"""Which kernel path serves a call, decided from host-known facts only.

The small-seq path takes every call whose static configuration it supports and whose host-given
bounds max_seqlen_q/k fit its tile. Everything else needs the general flash path, which is not
wired in yet: such calls raise NotImplementedError naming the reason. Nothing here
reads device memory or synchronizes. ``HIPATTN_LOG=debug`` logs each decision and its reason;
``HIPATTN_SMALLSEQ=0`` turns the small-seq path off (A/B comparisons).
"""

from __future__ import annotations

import logging
import os

from .ops import smallseq
from .problem import Problem

logger = logging.getLogger("hipattn")

SMALLSEQ = "smallseq"
FLASH = "flash"


def smallseq_enabled() -> bool:
    return os.environ.get("HIPATTN_SMALLSEQ", "1") != "0"  # read per call: a change applies at once


def choose_path(problem: Problem, direction: str) -> str:
    """``SMALLSEQ`` or ``FLASH`` for a forward or backward call."""
    if not smallseq_enabled():
        path, reason = FLASH, "HIPATTN_SMALLSEQ=0"
    else:
        why_not = smallseq.ineligibility(problem)
        path, reason = (SMALLSEQ, "every sequence fits the small-seq tile") if why_not is None else (FLASH, why_not)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s %s path: %s (%s)", direction, path, reason, problem)
    if path == FLASH:
        raise NotImplementedError(
            f"this call needs the general flash-attention path ({reason}), which hipattn does not have yet; "
            "only calls where every sequence has at most "
            f"{smallseq.SMALLSEQ_TILE} tokens and head_dim is one of {smallseq.SMALLSEQ_HEAD_DIMS} are served"
        )
    return path
