"""The AMD matrix-core (MFMA 16x16x16, gfx90a, gfx94x and gfx950) small-sequence forward and backward: a
workgroup per (sequence, KV head) over its group's stacked query rows. Each row of the tables below
names its kernel, its spec, its shared memory and how a launch covers a call's problems."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..jit.target import Target
from .smallseq_common import (
    BACKWARD_FIELDS,
    FORWARD_FIELDS,
    SMALLSEQ_TILE,
    SmallSeqLaunch,
    SmallSeqTiles,
    shipped_per_heads,
    smallseq_family,
    smallseq_params,
)
from .targets import runs_amd_mfma
from .tiles import ELEMENT_BYTES

# A key tile of the MFMA kernels' scores: 16 keys; a 17-token sequence has a second one of one row.
_MFMA_KEY_TILES = -(-SMALLSEQ_TILE // 16)


# The families first: each row type below names its own.
SMALLSEQ_FORWARD_MFMA = smallseq_family(
    "smallseq_forward_mfma", "smallseq/forward_mfma.hip", ("waves",),
    smallseq_params("SmallSeqForwardMfmaParams", FORWARD_FIELDS, sinks=True),
    lambda target: _shipped(SMALLSEQ_FORWARD_MFMA_TILES, target))
SMALLSEQ_BACKWARD_MFMA = smallseq_family(
    "smallseq_backward_mfma", "smallseq/backward_mfma.hip", ("waves",),
    smallseq_params("SmallSeqBackwardMfmaParams", BACKWARD_FIELDS),
    lambda target: _shipped(SMALLSEQ_BACKWARD_MFMA_TILES, target))


def _exchange_bytes(waves: int, tensors: int) -> int:
    """smallseq::ScoreExchange<WAVES, TENSORS, KEY_TILES>::kBytes: two buffers of every wave's partial
    scores per tensor, fp32 (key tile 0's 64 lanes x 4, and key 16's 16 queries when a sequence may
    have 17 keys); one wave exchanges nothing."""
    if waves == 1:
        return 0
    per_tensor = 64 * 4 + (16 if _MFMA_KEY_TILES > 1 else 0)
    return 2 * waves * tensors * per_tensor * 4


@dataclass(frozen=True)
class SmallSeqMfmaTiles(SmallSeqTiles):
    """An MFMA kernel's row: a workgroup of ``waves`` 64-lane waves per (sequence, KV head) serves the
    stacked query rows of its whole group, so K and V are read once per group; the waves split
    head_dim and sum their partial scores through LDS (smallseq/mfma_tiles.h)."""

    waves: int

    # The score tensors the waves exchange: the forward's Sᵀ; the backward's Sᵀ and dPᵀ.
    exchanged_tensors = 1

    @property
    def threads(self) -> int:
        return 64 * self.waves

    def template_args(self, head_dim: int) -> dict[str, Any]:
        return {"tile": SMALLSEQ_TILE, "waves": self.waves}

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES, *, group: int = 1) -> int:
        return _exchange_bytes(self.waves, self.exchanged_tensors)

    def launch_blocks(self, problems: int, group: int) -> int:
        """Workgroups for ``problems`` as the launcher counts them (see the subclasses)."""
        return problems

    def launch(self, problems: int, head_dim: int, group: int) -> SmallSeqLaunch:
        return SmallSeqLaunch(self.launch_blocks(problems, group), self.threads, self.shared_bytes(head_dim))


@dataclass(frozen=True)
class SmallSeqForwardMfmaTiles(SmallSeqMfmaTiles):
    family = SMALLSEQ_FORWARD_MFMA

    def launch_blocks(self, problems: int, group: int) -> int:
        """The forward's problems are (sequence, query head) pairs; a workgroup serves a group of them."""
        return problems // group


@dataclass(frozen=True)
class SmallSeqBackwardMfmaTiles(SmallSeqMfmaTiles):
    """The backward's problems are (sequence, KV head) pairs already: a workgroup each."""

    exchanged_tensors = 2

    family = SMALLSEQ_BACKWARD_MFMA


# Waves per workgroup, per head_dim; the registers are hiprtc 5.2's for gfx90a (VGPRs and AGPRs, of
# 512 per SIMD lane). A forward wave keeps K's and Vᵀ's fragments of its columns for the whole group
# (2 key tiles x columns / 16 operands each) besides a tile's Q, O and scores: 100 registers at 64
# columns, 156 at 128 (five and three waves per SIMD), so head_dim 256 takes two waves of 128 columns
# (160) and nothing spills. A backward wave also keeps Kᵀ's fragments and the dK and dV accumulators:
# 232-240 registers at 64 columns (two waves per SIMD), so its waves take 64 columns at every head_dim.
SMALLSEQ_FORWARD_MFMA_TILES = {
    64: SmallSeqForwardMfmaTiles(waves=1),
    128: SmallSeqForwardMfmaTiles(waves=1),
    256: SmallSeqForwardMfmaTiles(waves=2),
}
SMALLSEQ_BACKWARD_MFMA_TILES = {
    64: SmallSeqBackwardMfmaTiles(waves=1),
    128: SmallSeqBackwardMfmaTiles(waves=2),
    256: SmallSeqBackwardMfmaTiles(waves=4),
}


def _shipped(table: dict[int, SmallSeqMfmaTiles], target: Target) -> list:
    return shipped_per_heads(table.__getitem__, target) if runs_amd_mfma(target) else []
