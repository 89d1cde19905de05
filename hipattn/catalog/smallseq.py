"""The small-sequence kernels (every sequence <= SMALLSEQ_TILE tokens on both sides): the portable
CUDA-core forward and backward (any GPU, any wave size), the NVIDIA tensor-core (mma.sync, sm_80+)
forward and backward, for ungrouped heads and for grouped ones (GQA/MQA), and the AMD matrix-core
(MFMA, gfx90a/gfx94x) forward and backward. Each row of
the tables below names its kernel, its spec, its shared memory and how a launch covers a call's
problems."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..jit.params import ParamsStruct
from ..jit.spec import KernelFamily, KernelSpec
from ..jit.target import Target
from .common import DTYPES
from .fields import SEQUENCE_FIELDS, row_statistic, strided
from .index import register
from .targets import runs_amd_mfma, runs_nvidia_mma
from .tiles import ELEMENT_BYTES, KernelTiles

# The longest sequence the small-seq kernels handle, on either side: the tile every problem fits in.
# This is the one definition; it reaches the kernels as their TILE template argument.
SMALLSEQ_TILE = 17
SMALLSEQ_HEAD_DIMS = (64, 128, 256)
# The query head counts shipped precompiled; any other compiles on first use.
SMALLSEQ_SHIPPED_HEADS = (8, 16, 32)
# A portable team's lane holds this many consecutive elements of each row (8-byte accesses).
SMALLSEQ_LANE_ELEMENTS = 4
# A call of fewer than problems_per_team * SMALLSEQ_TEAMS_WANTED problems gives its teams shorter runs,
# so that it still spreads over the GPU.
SMALLSEQ_TEAMS_WANTED = 16384
# The tensor-core backward's P and dZ tiles: [SMALLSEQ_TILE query rows][32 keys + 8 of pad], 16-bit
# (smallseq::kScorePitch).
SMALLSEQ_SCORE_PITCH = 32 + 8


@dataclass(frozen=True)
class SmallSeqLaunch:
    """How one launch covers a call's problems: its grid, block, dynamic shared memory, and the kernel
    fields the launch sets (the tensor-core kernels' run of problems per team, the grouped kernels'
    group size)."""

    blocks: int
    threads: int
    shared_bytes: int
    fields: Mapping[str, int] = field(default_factory=dict)


class SmallSeqTiles(KernelTiles):
    """A small-seq row: it picks the instantiation a call needs and sizes its launch."""

    def call_spec(self, dtype: str, head_dim: int, heads: int) -> KernelSpec:
        """The instantiation serving a call with ``heads`` query heads: the kernels take the head count
        as a template argument (so that a problem index divides by a constant), unless a row's kernel
        takes it at run time."""
        return self.spec(dtype, head_dim, heads=heads)

    @abstractmethod
    def launch(self, problems: int, head_dim: int, group: int) -> SmallSeqLaunch:
        """The launch over ``problems`` problems as the launcher counts them ((sequence, query head)
        pairs for the forward, (sequence, KV head) pairs for the backward), of query heads grouped
        ``group`` to a KV head."""


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
    @property
    def family(self) -> KernelFamily:
        return SMALLSEQ_FORWARD

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES, *, group: int = 1) -> int:
        return 0  # static tiles only


@dataclass(frozen=True)
class SmallSeqBackwardTiles(_PortableTiles):
    """The portable backward: a team per (sequence, KV head) walks the query heads of its group."""

    @property
    def family(self) -> KernelFamily:
        return SMALLSEQ_BACKWARD

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
    @property
    def family(self) -> KernelFamily:
        return SMALLSEQ_FORWARD_MMA

    def team_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """smallseq::ForwardTeamTiles<...>::kBytes: per warp, a zero row and SMALLSEQ_TILE-row Q, K and
        V tiles of head_dim / split columns."""
        pitch = _warp_pitch_bytes(head_dim, self.split, element_bytes)
        return self.split * (pitch + 3 * SMALLSEQ_TILE * pitch)


@dataclass(frozen=True)
class SmallSeqBackwardMmaTiles(SmallSeqMmaTiles):
    @property
    def family(self) -> KernelFamily:
        return SMALLSEQ_BACKWARD_MMA

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

    def call_spec(self, dtype: str, head_dim: int, heads: int) -> KernelSpec:
        return self.spec(dtype, head_dim)  # the group size is a run-time field: one kernel serves every G

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
    @property
    def family(self) -> KernelFamily:
        return SMALLSEQ_FORWARD_GQA_MMA

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
    @property
    def family(self) -> KernelFamily:
        return SMALLSEQ_BACKWARD_GQA_MMA

    def team_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """smallseq::GqaBackwardTeamTiles<...>::kBytes: per warp (64 columns), a zero row, K and V tiles
        and two chunk tiles each of Q and dO; then the team's two chunks of LSE, the P and dZ tiles
        (16 rows of 32 + 8 keys) and a slot for the partial S and dP of each warp after the first."""
        pitch = (SMALLSEQ_GQA_BACKWARD_COLUMNS + 8) * element_bytes
        warp = pitch + 2 * SMALLSEQ_TILE * pitch + 4 * SMALLSEQ_GQA_CHUNK_ROWS * pitch
        lse = 2 * SMALLSEQ_GQA_CHUNK_ROWS * 4
        scores = 2 * SMALLSEQ_GQA_CHUNK_ROWS * SMALLSEQ_SCORE_PITCH * element_bytes
        return self.split * warp + lse + scores + (self.split - 1) * 2 * _GQA_EXCHANGE_BYTES


# Rows chosen by counts, not yet timed (the kernels' header comments): warps per SM from shared memory
# (registers never bind tighter: tests/test_smallseq_gqa_tiles.py), each warp at an instruction every
# 6-7 cycles, should issue a group's instructions in no more time than its bytes take. Forward warps
# need 9.4, 17.8 and (two of 128 columns) 20.8 KiB at head_dim 64, 128 and 256: 20, 12 and 10 per H200
# SM. Backward teams need 16.5, 33.5 and 67.3 KiB: 12 warps per SM at every head_dim. Runs of 2 groups
# a team, as MHA's rows run 2-4 problems. Every block stays within the 99 KiB that sm_86/sm_89 allow.
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
# problems let a block retire less often than one problem per team would. Every block stays within
# the 99 KiB that sm_86/sm_89 allow.
SMALLSEQ_FORWARD_MMA_TILES = {
    64: SmallSeqForwardMmaTiles(warps=4, problems_per_team=4),
    128: SmallSeqForwardMmaTiles(warps=4, problems_per_team=4),
    256: SmallSeqForwardMmaTiles(warps=4, problems_per_team=4, split=2),
}
# The tensor-core backward covers Hq == Hkv; GQA/MQA calls take the portable backward.
SMALLSEQ_BACKWARD_MMA_TILES = {
    64: SmallSeqBackwardMmaTiles(warps=6, problems_per_team=2),
    128: SmallSeqBackwardMmaTiles(warps=2, problems_per_team=2),
    256: SmallSeqBackwardMmaTiles(warps=2, problems_per_team=4, split=2),
}


# ---- AMD matrix cores (MFMA 16x16x16, gfx90a and gfx94x) ----
# A key tile of the MFMA kernels' scores: 16 keys; a 17-token sequence has a second one of one row.
_MFMA_KEY_TILES = -(-SMALLSEQ_TILE // 16)


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
    @property
    def family(self) -> KernelFamily:
        return SMALLSEQ_FORWARD_MFMA

    def launch_blocks(self, problems: int, group: int) -> int:
        """The forward's problems are (sequence, query head) pairs; a workgroup serves a group of them."""
        return problems // group


@dataclass(frozen=True)
class SmallSeqBackwardMfmaTiles(SmallSeqMfmaTiles):
    """The backward's problems are (sequence, KV head) pairs already: a workgroup each."""

    exchanged_tensors = 2

    @property
    def family(self) -> KernelFamily:
        return SMALLSEQ_BACKWARD_MFMA


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
    gfx90a/gfx94x the MFMA kernel (any group); the portable kernel everywhere else."""
    return _row(head_dim, target, group, portable, SMALLSEQ_FORWARD_MMA_TILES, SMALLSEQ_GQA_FORWARD_MMA_TILES,
                SMALLSEQ_FORWARD_MFMA_TILES, SMALLSEQ_FORWARD_TILES)


def backward_tiles(head_dim: int, target: Target | None, *, group: int, portable: bool = False) -> SmallSeqTiles:
    """The backward's row, chosen as the forward's (``forward_tiles``)."""
    return _row(head_dim, target, group, portable, SMALLSEQ_BACKWARD_MMA_TILES, SMALLSEQ_GQA_BACKWARD_MMA_TILES,
                SMALLSEQ_BACKWARD_MFMA_TILES, SMALLSEQ_BACKWARD_TILES)


def _shipped(rows_of_head_dim, target: Target) -> list:
    return [rows_of_head_dim(d).spec(t, d, heads=h) for t in DTYPES for d in SMALLSEQ_HEAD_DIMS
            for h in SMALLSEQ_SHIPPED_HEADS]


def _shipped_mma(table: dict[int, SmallSeqMmaTiles], target: Target) -> list:
    return _shipped(table.__getitem__, target) if runs_nvidia_mma(target) else []


def _shipped_mfma(table: dict[int, SmallSeqMfmaTiles], target: Target) -> list:
    return _shipped(table.__getitem__, target) if runs_amd_mfma(target) else []


def _shipped_grouped(table: dict[int, SmallSeqGroupedMmaTiles], target: Target) -> list:
    """One instantiation per dtype and head_dim: the group size, and so the head count, is run time's."""
    if not runs_nvidia_mma(target):
        return []
    return [table[d].spec(t, d) for t in DTYPES for d in SMALLSEQ_HEAD_DIMS]


_SMALLSEQ_TEMPLATE = ("dtype", "head_dim", "heads", "tile")
_FORWARD_FIELDS = strided("q") + strided("k") + strided("v") + strided("o") + row_statistic("lse", "ptr") + SEQUENCE_FIELDS
_BACKWARD_FIELDS = (strided("q") + strided("k") + strided("v") + strided("dout") + strided("dq") + strided("dk")
                    + strided("dv") + row_statistic("lse", "const_ptr") + SEQUENCE_FIELDS)
# The tensor-core kernels' teams walk runs of problems, of a length the launch chooses.
_RUN_FIELD = (("problems_per_team", "i32"),)


def _family(name: str, source: str, template_tail: tuple[str, ...], params: ParamsStruct, shipped) -> KernelFamily:
    return register(KernelFamily(name=name, source=source, template=f"hipattn::{name}",
                                 template_params=_SMALLSEQ_TEMPLATE + template_tail, params=params, shipped=shipped))


SMALLSEQ_FORWARD = _family(
    "smallseq_forward", "smallseq/forward.hip", ("block_threads", "lane_elements"),
    ParamsStruct("SmallSeqForwardParams", _FORWARD_FIELDS),
    lambda target: _shipped(lambda d: SMALLSEQ_FORWARD_TILES, target))
SMALLSEQ_BACKWARD = _family(
    "smallseq_backward", "smallseq/backward.hip", ("block_threads", "lane_elements"),
    ParamsStruct("SmallSeqBackwardParams", _BACKWARD_FIELDS),
    lambda target: _shipped(lambda d: SMALLSEQ_BACKWARD_TILES, target))
SMALLSEQ_FORWARD_MMA = _family(
    "smallseq_forward_mma", "smallseq/forward_mma.hip", ("warps", "split"),
    ParamsStruct("SmallSeqForwardMmaParams", _FORWARD_FIELDS + _RUN_FIELD),
    lambda target: _shipped_mma(SMALLSEQ_FORWARD_MMA_TILES, target))
SMALLSEQ_BACKWARD_MMA = _family(
    "smallseq_backward_mma", "smallseq/backward_mma.hip", ("warps", "split"),
    ParamsStruct("SmallSeqBackwardMmaParams", _BACKWARD_FIELDS + _RUN_FIELD),
    lambda target: _shipped_mma(SMALLSEQ_BACKWARD_MMA_TILES, target))
# The grouped kernels take neither the head count nor a per-head problem index: their teams walk groups.
_GROUPED_TEMPLATE = ("dtype", "head_dim", "tile", "warps", "split")
_GROUP_FIELDS = _RUN_FIELD + (("group_size", "i32"),)
SMALLSEQ_FORWARD_GQA_MMA = register(KernelFamily(
    name="smallseq_forward_gqa_mma", source="smallseq/forward_gqa_mma.hip",
    template="hipattn::smallseq_forward_gqa_mma", template_params=_GROUPED_TEMPLATE,
    params=ParamsStruct("SmallSeqForwardGqaMmaParams", _FORWARD_FIELDS + _GROUP_FIELDS),
    shipped=lambda target: _shipped_grouped(SMALLSEQ_GQA_FORWARD_MMA_TILES, target)))
SMALLSEQ_BACKWARD_GQA_MMA = register(KernelFamily(
    name="smallseq_backward_gqa_mma", source="smallseq/backward_gqa_mma.hip",
    template="hipattn::smallseq_backward_gqa_mma", template_params=_GROUPED_TEMPLATE,
    params=ParamsStruct("SmallSeqBackwardGqaMmaParams", _BACKWARD_FIELDS + _GROUP_FIELDS),
    shipped=lambda target: _shipped_grouped(SMALLSEQ_GQA_BACKWARD_MMA_TILES, target)))
SMALLSEQ_FORWARD_MFMA = _family(
    "smallseq_forward_mfma", "smallseq/forward_mfma.hip", ("waves",),
    ParamsStruct("SmallSeqForwardMfmaParams", _FORWARD_FIELDS),
    lambda target: _shipped_mfma(SMALLSEQ_FORWARD_MFMA_TILES, target))
SMALLSEQ_BACKWARD_MFMA = _family(
    "smallseq_backward_mfma", "smallseq/backward_mfma.hip", ("waves",),
    ParamsStruct("SmallSeqBackwardMfmaParams", _BACKWARD_FIELDS),
    lambda target: _shipped_mfma(SMALLSEQ_BACKWARD_MFMA_TILES, target))
