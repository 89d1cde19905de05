"""The small-sequence kernels' rows (every sequence <= SMALLSEQ_TILE tokens on both sides) for the
portable CUDA-core forward and backward (any GPU, any wave size) and the NVIDIA tensor-core (mma.sync,
sm_80+) forward and backward, for ungrouped heads and for grouped ones (GQA/MQA); the AMD matrix-core
rows are in ``smallseq_mfma``. Each row of the tables below names its kernel, its spec, its shared
memory and how a launch covers a call's problems; ``forward_tiles``/``backward_tiles`` choose a call's
row on its target."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from ..jit.spec import KernelSpec
from ..jit.target import Target
from .common import DTYPES
from .fields import SCORE_MODS_VALUES
from .smallseq_common import (
    BACKWARD_FIELDS,
    FORWARD_FIELDS,
    RUN_FIELD,
    SMALLSEQ_HEAD_DIMS,
    SMALLSEQ_LANE_ELEMENTS,
    SMALLSEQ_SCORE_PITCH,
    SMALLSEQ_TEAMS_WANTED,
    SMALLSEQ_TILE,
    SmallSeqLaunch,
    SmallSeqTiles,
    shipped_per_heads,
    smallseq_family,
    smallseq_params,
)
from .smallseq_mfma import SMALLSEQ_BACKWARD_MFMA_TILES, SMALLSEQ_FORWARD_MFMA_TILES
from .targets import runs_amd_mfma, runs_nvidia_mma
from .tiles import ELEMENT_BYTES

# The families first: each row type below names its own.
SMALLSEQ_FORWARD = smallseq_family(
    "smallseq_forward", "smallseq/forward.hip", ("block_threads", "lane_elements"),
    smallseq_params("SmallSeqForwardParams", FORWARD_FIELDS, sinks=True),
    lambda target: shipped_per_heads(lambda d: SMALLSEQ_FORWARD_TILES, target))
SMALLSEQ_BACKWARD = smallseq_family(
    "smallseq_backward", "smallseq/backward.hip", ("block_threads", "lane_elements"),
    smallseq_params("SmallSeqBackwardParams", BACKWARD_FIELDS),
    lambda target: shipped_per_heads(lambda d: SMALLSEQ_BACKWARD_TILES, target))
SMALLSEQ_FORWARD_MMA = smallseq_family(
    "smallseq_forward_mma", "smallseq/forward_mma.hip", ("warps", "split"),
    smallseq_params("SmallSeqForwardMmaParams", FORWARD_FIELDS + RUN_FIELD, sinks=True),
    lambda target: _shipped_mma(SMALLSEQ_FORWARD_MMA_TILES, target))
SMALLSEQ_BACKWARD_MMA = smallseq_family(
    "smallseq_backward_mma", "smallseq/backward_mma.hip", ("warps", "split"),
    smallseq_params("SmallSeqBackwardMmaParams", BACKWARD_FIELDS + RUN_FIELD),
    lambda target: _shipped_mma(SMALLSEQ_BACKWARD_MMA_TILES, target))
# The grouped kernels take neither the head count nor a per-head problem index: their teams walk groups.
_GROUPED_TEMPLATE = ("dtype", "head_dim", "tile")
_GROUP_FIELDS = RUN_FIELD + (("group_size", "i32"),)
SMALLSEQ_FORWARD_GQA_MMA = smallseq_family(
    "smallseq_forward_gqa_mma", "smallseq/forward_gqa_mma.hip", ("warps", "split"),
    smallseq_params("SmallSeqForwardGqaMmaParams", FORWARD_FIELDS + _GROUP_FIELDS, sinks=True),
    lambda target: _shipped_grouped(SMALLSEQ_GQA_FORWARD_MMA_TILES, target), template_head=_GROUPED_TEMPLATE)
SMALLSEQ_BACKWARD_GQA_MMA = smallseq_family(
    "smallseq_backward_gqa_mma", "smallseq/backward_gqa_mma.hip", ("warps", "split"),
    smallseq_params("SmallSeqBackwardGqaMmaParams", BACKWARD_FIELDS + _GROUP_FIELDS),
    lambda target: _shipped_grouped(SMALLSEQ_GQA_BACKWARD_MMA_TILES, target), template_head=_GROUPED_TEMPLATE)


@dataclass(frozen=True)
class _PortableTiles(SmallSeqTiles):
    """A portable kernel's row: a team of head_dim / lane_elements lanes owns one problem and a block
    holds block_threads / team lanes teams."""

    block_threads: int
    lane_elements: int = SMALLSEQ_LANE_ELEMENTS

    @property
    def threads(self) -> int:
        return self.block_threads

    def teams_per_block(self, head_dim: int) -> int:
        return self.block_threads // (head_dim // self.lane_elements)

    def template_args(self, head_dim: int) -> dict[str, Any]:
        return {"tile": SMALLSEQ_TILE, "block_threads": self.block_threads, "lane_elements": self.lane_elements}

    def launch(self, problems: int, head_dim: int, group: int) -> SmallSeqLaunch:
        per_block = self.teams_per_block(head_dim)
        return SmallSeqLaunch(-(-problems // per_block), self.block_threads, self.shared_bytes(head_dim, group=group))


@dataclass(frozen=True)
class SmallSeqForwardTiles(_PortableTiles):
    family = SMALLSEQ_FORWARD

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES, *, group: int = 1) -> int:
        return 0  # static tiles only


@dataclass(frozen=True)
class SmallSeqBackwardTiles(_PortableTiles):
    """The portable backward: a team per (sequence, KV head) walks the query heads of its group."""

    family = SMALLSEQ_BACKWARD

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES, *, group: int = 1) -> int:
        """Each team's dK/dV sums over its GQA group, fp32 [2][tile][head_dim] (backward.hip's
        group_accum); a team of an ungrouped call writes its dK/dV straight out."""
        if group == 1:
            return 0
        return self.teams_per_block(head_dim) * 2 * SMALLSEQ_TILE * head_dim * 4


@dataclass(frozen=True)
class SmallSeqMmaTiles(SmallSeqTiles):
    """A tensor-core kernel's row: warps per block; the run of problems each team of warps walks in a
    large call (a small call gets shorter runs); and the warps in a team (1 or 2), which split a
    problem's head_dim columns."""

    warps: int
    problems_per_team: int
    split: int = 1

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def teams(self) -> int:
        return self.warps // self.split

    def template_args(self, head_dim: int) -> dict[str, Any]:
        return {"tile": SMALLSEQ_TILE, "warps": self.warps, "split": self.split}

    def run_length(self, problems: int) -> int:
        """The run of problems each team walks in a call of ``problems`` (host facts only)."""
        return max(1, min(self.problems_per_team, problems // SMALLSEQ_TEAMS_WANTED))

    @abstractmethod
    def team_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int: ...

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES, *, group: int = 1) -> int:
        return self.teams * self.team_bytes(head_dim, element_bytes)

    def launch(self, problems: int, head_dim: int, group: int) -> SmallSeqLaunch:
        per_team = self.run_length(problems)
        teams = -(-problems // per_team)
        return SmallSeqLaunch(-(-teams // self.teams), self.threads, self.shared_bytes(head_dim),
                              {"problems_per_team": per_team})


def _warp_pitch_bytes(head_dim: int, split: int, element_bytes: int) -> int:
    """A staged row of one warp's share of the columns, padded by 16 bytes (smallseq::WarpTiles::kPitch)."""
    return (head_dim // split + 8) * element_bytes


@dataclass(frozen=True)
class SmallSeqForwardMmaTiles(SmallSeqMmaTiles):
    family = SMALLSEQ_FORWARD_MMA

    def team_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """smallseq::ForwardTeamTiles<...>::kBytes: per warp, a zero row and SMALLSEQ_TILE-row Q, K and
        V tiles of head_dim / split columns."""
        pitch = _warp_pitch_bytes(head_dim, self.split, element_bytes)
        return self.split * (pitch + 3 * SMALLSEQ_TILE * pitch)


@dataclass(frozen=True)
class SmallSeqBackwardMmaTiles(SmallSeqMmaTiles):
    family = SMALLSEQ_BACKWARD_MMA

    def team_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """smallseq::BackwardTeamTiles<...>::kBytes: per warp, a zero row and Q, dO, K and V tiles; then
        the team's LSE rows (padded to 16 bytes) and its P and dZ tiles. (The partial sums a warp of a
        pair hands the other travel in one of its tiles that the problem no longer needs.)"""
        pitch = _warp_pitch_bytes(head_dim, self.split, element_bytes)
        warp = pitch + 4 * SMALLSEQ_TILE * pitch
        lse = (SMALLSEQ_TILE * 4 + 15) // 16 * 16
        scores = 2 * SMALLSEQ_TILE * SMALLSEQ_SCORE_PITCH * element_bytes
        return self.split * warp + lse + scores


# ---- NVIDIA tensor cores, grouped heads (GQA/MQA, G = Hq / Hkv > 1) ----
# A team serves one (sequence, KV head) group: it stages K and V once and walks the group's G * len_q
# stacked query rows in chunks of 16 (smallseq/group_tiles.h), the next chunk's rows in flight. The
# group size is a run-time field, so one instantiation per dtype and head_dim serves every G; the
# kernels' row -> query division by a reciprocal is exact up to G = 15894, and larger groups take the
# portable kernels.
SMALLSEQ_GQA_MAX_GROUP = 4096
SMALLSEQ_GQA_CHUNK_ROWS = 16
# Partial score sums one warp hands another (group_tiles.h's ChunkExchange): three 8-key accumulator
# tiles of 32 lanes x 4 fp32, per tensor (forward S; backward S and dP).
_GQA_EXCHANGE_BYTES = 3 * 32 * 16
# The backward's warps own 64 columns each: dVᵀ and dKᵀ accumulate in registers across the group, 48
# fp32 each for 64 columns (128 columns would need 192 and spill), so a team has head_dim / 64 warps.
SMALLSEQ_GQA_BACKWARD_COLUMNS = 64


@dataclass(frozen=True)
class SmallSeqGroupedMmaTiles(SmallSeqMmaTiles):
    """A grouped-heads tensor-core row: each team walks a run of (sequence, KV head) groups."""

    def template_args(self, head_dim: int) -> dict[str, Any]:
        return {"tile": SMALLSEQ_TILE, "warps": self.warps, "split": self.split}

    def call_spec(self, dtype: str, head_dim: int, heads: int, score_mods: bool) -> KernelSpec:
        # The group size is a run-time field: one kernel serves every G.
        return self.spec(dtype, head_dim, score_mods=score_mods)

    def groups_of(self, problems: int, group: int) -> int:
        """The (sequence, KV head) groups among ``problems`` as the launcher counts them."""
        return problems

    def launch(self, problems: int, head_dim: int, group: int) -> SmallSeqLaunch:
        groups = self.groups_of(problems, group)
        per_team = self.run_length(groups)
        teams = -(-groups // per_team)
        return SmallSeqLaunch(-(-teams // self.teams), self.threads, self.shared_bytes(head_dim),
                              {"problems_per_team": per_team, "group_size": group})


@dataclass(frozen=True)
class SmallSeqForwardGqaMmaTiles(SmallSeqGroupedMmaTiles):
    family = SMALLSEQ_FORWARD_GQA_MMA

    def groups_of(self, problems: int, group: int) -> int:
        return problems // group  # the forward's problems are (sequence, query head) pairs

    def team_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """smallseq::GqaForwardTeamTiles<...>::kBytes: per warp, rows of its columns + 8 elements: a zero
        row, K and V tiles of SMALLSEQ_TILE rows and two chunk tiles of 16 stacked query rows (this
        chunk and the next one in flight); a pair's warps add two slots for the partial S they hand
        each other."""
        pitch = _warp_pitch_bytes(head_dim, self.split, element_bytes)
        warp = pitch + 2 * SMALLSEQ_TILE * pitch + 2 * SMALLSEQ_GQA_CHUNK_ROWS * pitch
        slots = 0 if self.split == 1 else 2 * _GQA_EXCHANGE_BYTES
        return self.split * (warp + slots)


@dataclass(frozen=True)
class SmallSeqBackwardGqaMmaTiles(SmallSeqGroupedMmaTiles):
    family = SMALLSEQ_BACKWARD_GQA_MMA

    def team_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """smallseq::GqaBackwardTeamTiles<...>::kBytes: per warp (64 columns), a zero row, K and V tiles
        and two chunk tiles each of Q and dO; then the team's two chunks of LSE, the P and dZ tiles
        (16 rows of 32 + 8 keys) and a slot for the partial S and dP of each warp after the first."""
        pitch = (SMALLSEQ_GQA_BACKWARD_COLUMNS + 8) * element_bytes
        warp = pitch + 2 * SMALLSEQ_TILE * pitch + 4 * SMALLSEQ_GQA_CHUNK_ROWS * pitch
        lse = 2 * SMALLSEQ_GQA_CHUNK_ROWS * 4
        scores = 2 * SMALLSEQ_GQA_CHUNK_ROWS * SMALLSEQ_SCORE_PITCH * element_bytes
        return self.split * warp + lse + scores + (self.split - 1) * 2 * _GQA_EXCHANGE_BYTES


# Rows measured on the H200 (tools/sweep_smallseq.py over the matrix's small-seq cells; BENCHMARKS.md).
# The kernels are latency-bound, so a row sets warps per SM and how rarely a block retires. Shared
# memory sets the warps per SM (registers never bind tighter: tests/test_smallseq_gqa_tiles.py):
# forward warps need 9.4, 17.8 and (two of 128 columns) 20.8 KiB at head_dim 64, 128 and 256, so 20,
# 12 and 10 fit an SM; backward teams need 16.5, 33.5 and 67.3 KiB, 12 warps at every head_dim. The
# forward's blocks of 1, 2 or 4 warps and runs of 1 to 4 groups land within about 0.05x of the floor
# of each other. The backward's blocks of 4 warps beat blocks of 2 at G = 2 (1.40 vs 1.47 of the floor
# at head_dim 64, 1.54 vs 1.64 at 128), and at head_dim 256 runs of 4 groups beat runs of 2 (1.54 vs
# 1.59). Every block stays within the 99 KiB that sm_86/sm_89 allow.
SMALLSEQ_GQA_FORWARD_MMA_TILES = {
    64: SmallSeqForwardGqaMmaTiles(warps=4, problems_per_team=2),
    128: SmallSeqForwardGqaMmaTiles(warps=4, problems_per_team=2),
    256: SmallSeqForwardGqaMmaTiles(warps=2, problems_per_team=2, split=2),
}
SMALLSEQ_GQA_BACKWARD_MMA_TILES = {
    64: SmallSeqBackwardGqaMmaTiles(warps=4, problems_per_team=2, split=1),
    128: SmallSeqBackwardGqaMmaTiles(warps=4, problems_per_team=2, split=2),
    256: SmallSeqBackwardGqaMmaTiles(warps=4, problems_per_team=4, split=4),
}


# The portable kernels' rows. The backward runs 64-thread blocks so that a GQA group's dK/dV sums
# (2 x tile x head_dim fp32 per team) fit in 64 KiB of LDS on AMD and 99 KiB on sm_86/sm_89 together
# with the static tiles.
SMALLSEQ_FORWARD_TILES = SmallSeqForwardTiles(block_threads=128)
SMALLSEQ_BACKWARD_TILES = SmallSeqBackwardTiles(block_threads=64)

# The tensor-core kernels are bound by latency (each warp issues one instruction every 6-7 cycles), so
# the rows are chosen for warps per SM and measured on the H200 (BENCHMARKS.md, tools/sweep_smallseq.py).
# A forward warp needs 7 and 14 KiB at head_dim 64 and 128, so an SM holds 28 and 16 of them; at 256
# two warps share a problem's columns, 14 KiB each (16 per SM, where one warp per problem fits 8). A
# backward warp needs 12 and 21 KiB at head_dim 64 and 128 (16 and 10 per SM); at 256 a pair that
# splits the columns 39 KiB (10 warps per SM, where one warp per problem fits 5). Runs of 2-4
# problems let a block retire less often than one problem per team would: the backward's blocks of 6
# warps at head_dim 64 measured 1.44 of the floor where 4 took 1.50, and runs of 4 at head_dim 256
# 1.54 where runs of 2 took 1.56. Every block stays within the 99 KiB that sm_86/sm_89 allow.
SMALLSEQ_FORWARD_MMA_TILES = {
    64: SmallSeqForwardMmaTiles(warps=4, problems_per_team=4),
    128: SmallSeqForwardMmaTiles(warps=4, problems_per_team=4),
    256: SmallSeqForwardMmaTiles(warps=4, problems_per_team=4, split=2),
}
# Ungrouped heads (Hq == Hkv); grouped ones take SMALLSEQ_GQA_BACKWARD_MMA_TILES.
SMALLSEQ_BACKWARD_MMA_TILES = {
    64: SmallSeqBackwardMmaTiles(warps=6, problems_per_team=2),
    128: SmallSeqBackwardMmaTiles(warps=2, problems_per_team=2),
    256: SmallSeqBackwardMmaTiles(warps=2, problems_per_team=4, split=2),
}


def _row(head_dim: int, target: Target | None, group: int, portable: bool, mma: dict, grouped: dict, mfma: dict,
         fallback: SmallSeqTiles) -> SmallSeqTiles:
    if portable:
        return fallback
    if runs_nvidia_mma(target):
        if group == 1:
            return mma[head_dim]
        if group <= SMALLSEQ_GQA_MAX_GROUP:
            return grouped[head_dim]
        return fallback
    if runs_amd_mfma(target):
        return mfma[head_dim]
    return fallback


def forward_tiles(head_dim: int, target: Target | None, *, group: int, portable: bool = False) -> SmallSeqTiles:
    """The forward's row on ``target`` for query heads grouped ``group`` to a KV head, unless
    ``portable``: on NVIDIA sm_80+ the tensor-core kernel of ungrouped or of grouped heads, on AMD
    gfx90a/gfx94x/gfx950 the MFMA kernel (any group); the portable kernel everywhere else."""
    return _row(head_dim, target, group, portable, SMALLSEQ_FORWARD_MMA_TILES, SMALLSEQ_GQA_FORWARD_MMA_TILES,
                SMALLSEQ_FORWARD_MFMA_TILES, SMALLSEQ_FORWARD_TILES)


def backward_tiles(head_dim: int, target: Target | None, *, group: int, portable: bool = False) -> SmallSeqTiles:
    """The backward's row, chosen as the forward's (``forward_tiles``)."""
    return _row(head_dim, target, group, portable, SMALLSEQ_BACKWARD_MMA_TILES, SMALLSEQ_GQA_BACKWARD_MMA_TILES,
                SMALLSEQ_BACKWARD_MFMA_TILES, SMALLSEQ_BACKWARD_TILES)


def _shipped_mma(table: dict[int, SmallSeqMmaTiles], target: Target) -> list:
    return shipped_per_heads(table.__getitem__, target) if runs_nvidia_mma(target) else []


def _shipped_grouped(table: dict[int, SmallSeqGroupedMmaTiles], target: Target) -> list:
    """One instantiation per dtype and head_dim: the group size, and so the head count, is run time's."""
    if not runs_nvidia_mma(target):
        return []
    return [table[d].spec(t, d, score_mods=m) for t in DTYPES for d in SMALLSEQ_HEAD_DIMS for m in SCORE_MODS_VALUES]
