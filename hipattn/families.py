"""Every kernel family hipattn ships, and the instantiations it ships for each target.

This is the one table `hipattn warm` and the CI compile tests walk. The launch code of each family
lives in hipattn/ops/; the C++ templates in kernels/.
"""

from __future__ import annotations

from dataclasses import dataclass

from .params import ParamsStruct
from .spec import KernelFamily, KernelSpec
from .target import NVIDIA, Target
from .varlen_metadata import VARLEN_RECORD

FAMILIES: dict[str, KernelFamily] = {}


def _register(family: KernelFamily) -> KernelFamily:
    if family.name in FAMILIES:
        raise ValueError(f"kernel family {family.name!r} is defined twice")
    FAMILIES[family.name] = family
    return family


def family(name: str) -> KernelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {sorted(FAMILIES)}") from None


def shipped_specs(target: Target) -> list[KernelSpec]:
    """All instantiations hipattn ships for ``target``, in a stable order."""
    return [spec for name in sorted(FAMILIES) for spec in FAMILIES[name].shipped(target)]


def runs_nvidia_mma(target: Target | None) -> bool:
    """Whether ``target`` runs the mma.sync m16n8k16 kernels: NVIDIA sm_80 and newer."""
    return target is not None and target.vendor == NVIDIA and target.compute_capability >= 80


_OUTPUTS = {"o", "dq", "dk", "dv", "dq_accum"}


def _strided(name: str) -> tuple[tuple[str, str], ...]:
    """A [batch, token, head, dim] tensor: its pointer and three element strides (dim is contiguous)."""
    kind = "ptr" if name in _OUTPUTS else "const_ptr"
    return ((name, kind), (f"{name}_batch_stride", "i64"), (f"{name}_token_stride", "i64"), (f"{name}_head_stride", "i64"))


def _row_statistic(name: str, kind: str) -> tuple[tuple[str, str], ...]:
    """An fp32 value per (batch, head, token) laid out as the LSE, [Hq, total] or [B, Hq, S]: its
    pointer (``kind``: the LSE is the forward's output and the backward's input) and (batch, head)
    element strides; the token stride is 1."""
    return ((name, kind), (f"{name}_batch_stride", "i64"), (f"{name}_head_stride", "i64"))


DTYPES = ("fp16", "bf16")

# ---- backward pre-processing: D = rowsum(dO * O), and dq_accum (fp32) -> dq ----------------------

PREPROCESS_HEAD_DIMS = (64, 96, 128, 256)
# A row is read by a team of PREPROCESS_TEAM_LANES lanes with 16-byte accesses; the grid covers
# block_threads / team lanes rows per block.
PREPROCESS_BLOCK_THREADS = 256
PREPROCESS_TEAM_LANES = 8


def preprocess_spec(fam: KernelFamily, dtype: str, head_dim: int) -> KernelSpec:
    return fam.spec(dtype=dtype, head_dim=head_dim, block_threads=PREPROCESS_BLOCK_THREADS,
                    team_lanes=PREPROCESS_TEAM_LANES)

BWD_DOT_DO_O = _register(
    KernelFamily(
        name="bwd_dot_do_o",
        source="flash/bwd_dot_do_o.hip",
        template="hipattn::bwd_dot_do_o",
        template_params=("dtype", "head_dim", "block_threads", "team_lanes"),
        params=ParamsStruct(
            "DotDoOParams",
            _strided("o")
            + _strided("dout")
            + (
                ("d", "ptr"),
                ("d_batch_stride", "i64"),
                ("d_head_stride", "i64"),
                ("batch", "i32"),
                ("seqlen", "i32"),
                ("heads", "i32"),
            ),
        ),
        shipped=lambda target: [
            preprocess_spec(BWD_DOT_DO_O, t, d) for t in DTYPES for d in PREPROCESS_HEAD_DIMS
        ],
    )
)

BWD_CONVERT_DQ = _register(
    KernelFamily(
        name="bwd_convert_dq",
        source="flash/bwd_convert_dq.hip",
        template="hipattn::bwd_convert_dq",
        template_params=("dtype", "head_dim", "block_threads", "team_lanes"),
        params=ParamsStruct(
            "ConvertDqParams",
            _strided("dq_accum")
            + _strided("dq")
            + (("scale", "f32"), ("batch", "i32"), ("seqlen", "i32"), ("heads", "i32")),
        ),
        shipped=lambda target: [
            preprocess_spec(BWD_CONVERT_DQ, t, d) for t in DTYPES for d in PREPROCESS_HEAD_DIMS
        ],
    )
)

# ---- small-sequence attention (every sequence <= SMALLSEQ_TILE tokens) ---------------------------

# The longest sequence the small-seq kernels handle, on either side: the tile every problem fits in.
# This is the one definition; it reaches the kernels as their TILE template argument.
SMALLSEQ_TILE = 17
SMALLSEQ_HEAD_DIMS = (64, 128, 256)
SMALLSEQ_SHIPPED_HEADS = (8, 16, 32)

_SEQUENCE_FIELDS = (
    ("cu_seqlens_q", "const_ptr"),
    ("cu_seqlens_k", "const_ptr"),
    ("seqused_q", "const_ptr"),
    ("seqused_k", "const_ptr"),
    ("batch", "i32"),
    ("heads_kv", "i32"),
    ("max_seqlen_q", "i32"),
    ("max_seqlen_k", "i32"),
    ("total_q", "i32"),
    ("total_k", "i32"),
    ("softmax_scale", "f32"),
    ("causal", "i32"),
)


# The portable kernels (CUDA cores, any wave size): a team of head_dim / SMALLSEQ_LANE_ELEMENTS lanes
# owns one problem and a block holds block_threads / team lanes teams. The backward runs 64-thread
# blocks so that a GQA group's dK/dV sums (2 x tile x head_dim fp32 per team) fit in 64 KiB of LDS on
# AMD and 99 KiB on sm_86/sm_89 together with the static tiles.
SMALLSEQ_LANE_ELEMENTS = 4
SMALLSEQ_PORTABLE_BLOCK_THREADS = {"forward": 128, "backward": 64}


def smallseq_portable_spec(fam: KernelFamily, dtype: str, head_dim: int, heads: int) -> KernelSpec:
    direction = "forward" if fam.name == "smallseq_forward" else "backward"
    return fam.spec(dtype=dtype, head_dim=head_dim, heads=heads, tile=SMALLSEQ_TILE,
                    block_threads=SMALLSEQ_PORTABLE_BLOCK_THREADS[direction], lane_elements=SMALLSEQ_LANE_ELEMENTS)


def smallseq_teams_per_block(spec: KernelSpec) -> int:
    """Problems one block of a portable small-seq kernel serves."""
    args = dict(spec.template_args)
    return args["block_threads"] // (args["head_dim"] // args["lane_elements"])


def _smallseq_specs(fam: KernelFamily) -> list[KernelSpec]:
    return [
        smallseq_portable_spec(fam, t, d, h) for t in DTYPES for d in SMALLSEQ_HEAD_DIMS for h in SMALLSEQ_SHIPPED_HEADS
    ]


SMALLSEQ_FORWARD = _register(
    KernelFamily(
        name="smallseq_forward",
        source="smallseq/forward.hip",
        template="hipattn::smallseq_forward",
        template_params=("dtype", "head_dim", "heads", "tile", "block_threads", "lane_elements"),
        params=ParamsStruct(
            "SmallSeqForwardParams",
            _strided("q")
            + _strided("k")
            + _strided("v")
            + _strided("o")
            + _row_statistic("lse", "ptr")
            + _SEQUENCE_FIELDS,
        ),
        shipped=lambda target: _smallseq_specs(SMALLSEQ_FORWARD),
    )
)

# NVIDIA tensor-core variants (mma.sync, sm_80+): a team of one or two warps stages its problem in
# shared memory of its own and walks a run of (sequence, head) problems, so they take dynamic shared
# memory.


@dataclass(frozen=True)
class SmallSeqMmaTiles:
    """One row of a tensor-core small-seq kernel's table: warps per block; the run of problems each
    team of warps walks in a large call (smallseq_problems_per_team caps it for small ones); and the
    warps in a team (1 or 2), which split a problem's head_dim columns."""

    warps: int
    problems_per_team: int
    split: int = 1

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def teams(self) -> int:
        return self.warps // self.split


# These kernels are bound by latency (each warp issues one instruction every 6-7 cycles), so the rows
# are chosen for warps per SM and measured on the H200 (BENCHMARKS.md, tools/sweep_smallseq.py).
# A forward warp needs 7 and 14 KiB at head_dim 64 and 128, so an SM holds 28 and 16 of them; at 256
# two warps share a problem's columns, 14 KiB each (16 per SM, where one warp per problem fits 8). A
# backward warp needs 12 and 21 KiB at head_dim 64 and 128 (16 and 10 per SM); at 256 a pair that
# splits the columns 39 KiB (10 warps per SM, where one warp per problem fits 5). Pairs at head_dim
# 128 fit more warps (24 forward) but ran 1.3x slower, each warp's share of the work being too small. Runs
# of 2-4 problems let a block retire less often than one problem per team would. Every block stays
# within the 99 KiB that sm_86/sm_89 allow. (Head_dim 64 is not in issue 3's workloads: its rows
# follow head_dim 128's.)
SMALLSEQ_FORWARD_MMA_TILES = {
    64: SmallSeqMmaTiles(warps=4, problems_per_team=4),
    128: SmallSeqMmaTiles(warps=4, problems_per_team=4),
    256: SmallSeqMmaTiles(warps=4, problems_per_team=4, split=2),
}
SMALLSEQ_BACKWARD_MMA_TILES = {
    64: SmallSeqMmaTiles(warps=2, problems_per_team=2),
    128: SmallSeqMmaTiles(warps=2, problems_per_team=2),
    256: SmallSeqMmaTiles(warps=2, problems_per_team=2, split=2),
}

# The backward's P and dZ tiles: [SMALLSEQ_TILE query rows][32 keys + 8 of pad], 16-bit
# (smallseq::kScorePitch). (The partial sums a warp of a pair hands the other travel in one of its
# tiles that the problem no longer needs, so they take no memory of their own.)
_SMALLSEQ_SCORE_PITCH = 32 + 8


def smallseq_mma_team_bytes(direction: str, head_dim: int, split: int = 1, element_bytes: int = 2) -> int:
    """Shared memory of one team of a tensor-core small-seq kernel: smallseq::ForwardTeamTiles<...>::kBytes
    or smallseq::BackwardTeamTiles<...>::kBytes.

    Per warp, a zero row and SMALLSEQ_TILE-row tiles of head_dim / split columns (forward Q, K, V;
    backward Q, dO, K, V), rows head_dim / split + 8 elements long. The backward's team then holds
    the LSE rows (padded to 16 bytes) and the P and dZ tiles.
    """
    pitch = (head_dim // split + 8) * element_bytes
    if direction == "forward":
        return split * (pitch + 3 * SMALLSEQ_TILE * pitch)
    warp = pitch + 4 * SMALLSEQ_TILE * pitch
    lse = (SMALLSEQ_TILE * 4 + 15) // 16 * 16
    scores = 2 * SMALLSEQ_TILE * _SMALLSEQ_SCORE_PITCH * element_bytes
    return split * warp + lse + scores


def smallseq_mma_shared_bytes(direction: str, head_dim: int, tiles: SmallSeqMmaTiles) -> int:
    """Dynamic shared memory of one block of a tensor-core small-seq kernel."""
    return tiles.teams * smallseq_mma_team_bytes(direction, head_dim, tiles.split)


# A call of fewer than problems_per_team * SMALLSEQ_TEAMS_WANTED problems gives its teams shorter
# runs, so that it still spreads over the GPU.
SMALLSEQ_TEAMS_WANTED = 16384


def smallseq_problems_per_team(problems: int, tiles: SmallSeqMmaTiles) -> int:
    """The run of problems each team of a tensor-core small-seq kernel walks (host facts only)."""
    return max(1, min(tiles.problems_per_team, problems // SMALLSEQ_TEAMS_WANTED))


def smallseq_mma_spec(fam: KernelFamily, dtype: str, head_dim: int, heads: int,
                      tiles: SmallSeqMmaTiles | None = None) -> KernelSpec:
    """The tensor-core forward or backward instantiation with ``tiles`` (default: its table's row)."""
    if tiles is None:
        table = SMALLSEQ_FORWARD_MMA_TILES if fam.name == "smallseq_forward_mma" else SMALLSEQ_BACKWARD_MMA_TILES
        tiles = table[head_dim]
    return fam.spec(dtype=dtype, head_dim=head_dim, heads=heads, tile=SMALLSEQ_TILE, warps=tiles.warps,
                    split=tiles.split)


def _smallseq_mma_specs(fam: KernelFamily, target: Target) -> list[KernelSpec]:
    if not runs_nvidia_mma(target):
        return []
    return [smallseq_mma_spec(fam, t, d, h) for t in DTYPES for d in SMALLSEQ_HEAD_DIMS for h in SMALLSEQ_SHIPPED_HEADS]


SMALLSEQ_FORWARD_MMA = _register(
    KernelFamily(
        name="smallseq_forward_mma",
        source="smallseq/forward_mma.hip",
        template="hipattn::smallseq_forward_mma",
        template_params=("dtype", "head_dim", "heads", "tile", "warps", "split"),
        params=ParamsStruct("SmallSeqForwardMmaParams", SMALLSEQ_FORWARD.params.fields + (("problems_per_team", "i32"),)),
        shipped=lambda target: _smallseq_mma_specs(SMALLSEQ_FORWARD_MMA, target),
    )
)

# The tensor-core kernels above serve Hq == Hkv; GQA/MQA calls on sm_80+ take the grouped-heads
# families below.

SMALLSEQ_BACKWARD = _register(
    KernelFamily(
        name="smallseq_backward",
        source="smallseq/backward.hip",
        template="hipattn::smallseq_backward",
        template_params=("dtype", "head_dim", "heads", "tile", "block_threads", "lane_elements"),
        params=ParamsStruct(
            "SmallSeqBackwardParams",
            _strided("q")
            + _strided("k")
            + _strided("v")
            + _strided("dout")
            + _strided("dq")
            + _strided("dk")
            + _strided("dv")
            + _row_statistic("lse", "const_ptr")
            + _SEQUENCE_FIELDS,
        ),
        shipped=lambda target: _smallseq_specs(SMALLSEQ_BACKWARD),
    )
)

SMALLSEQ_BACKWARD_MMA = _register(
    KernelFamily(
        name="smallseq_backward_mma",
        source="smallseq/backward_mma.hip",
        template="hipattn::smallseq_backward_mma",
        template_params=("dtype", "head_dim", "heads", "tile", "warps", "split"),
        params=ParamsStruct("SmallSeqBackwardMmaParams",
                            SMALLSEQ_BACKWARD.params.fields + (("problems_per_team", "i32"),)),
        shipped=lambda target: _smallseq_mma_specs(SMALLSEQ_BACKWARD_MMA, target),
    )
)

# Grouped heads (GQA/MQA, G = Hq / Hkv > 1) on NVIDIA tensor cores: a team serves one (sequence, KV
# head) group, staging K and V once and walking the group's G * len_q stacked query rows in chunks of
# 16 (kernels/smallseq/group_tiles.h), with the next chunk's rows in flight. The group size is a run-time
# field, so one instantiation per dtype and head_dim serves every G; the kernels' row -> query
# division by a reciprocal is exact up to G = 15894, and larger groups take the portable kernels.
SMALLSEQ_GQA_MAX_GROUP = 4096
_SMALLSEQ_GQA_CHUNK_ROWS = 16
# Partial score sums one warp hands another (group_tiles.h's ChunkExchange): three 8-key accumulator
# tiles of 32 lanes x 4 fp32, per tensor (forward S; backward S and dP).
_SMALLSEQ_GQA_EXCHANGE_BYTES = 3 * 32 * 16
# The backward's warps own 64 columns each: dVᵀ and dKᵀ accumulate in registers across the group, 48
# fp32 each for 64 columns (128 columns would need 192 and spill), so a team has head_dim / 64 warps.
SMALLSEQ_GQA_BACKWARD_COLUMNS = 64

# Rows chosen by counts, not yet timed (the kernels' header comments): warps per SM from shared memory
# (registers never bind tighter: tests/test_smallseq_gqa_tiles.py), each warp at an instruction every
# 6-7 cycles, should issue a group's instructions in no more time than its bytes take. Forward warps
# need 9.4, 17.8 and (two of 128 columns) 20.8 KiB at head_dim 64, 128 and 256: 20, 12 and 10 per H200
# SM. Backward teams need 16.5, 33.5 and 67.3 KiB: 12 warps per SM at every head_dim. Runs of 2 groups
# a team, as MHA's rows run 2-4 problems. Every block stays within the 99 KiB that sm_86/sm_89 allow.
SMALLSEQ_GQA_FORWARD_MMA_TILES = {
    64: SmallSeqMmaTiles(warps=4, problems_per_team=2),
    128: SmallSeqMmaTiles(warps=4, problems_per_team=2),
    256: SmallSeqMmaTiles(warps=2, problems_per_team=2, split=2),
}
SMALLSEQ_GQA_BACKWARD_MMA_TILES = {
    64: SmallSeqMmaTiles(warps=2, problems_per_team=2, split=1),
    128: SmallSeqMmaTiles(warps=2, problems_per_team=2, split=2),
    256: SmallSeqMmaTiles(warps=4, problems_per_team=2, split=4),
}


def smallseq_gqa_mma_team_bytes(direction: str, head_dim: int, split: int, element_bytes: int = 2) -> int:
    """Shared memory of one team of a grouped-heads tensor-core small-seq kernel:
    smallseq::GqaForwardTeamTiles<...>::kBytes or smallseq::GqaBackwardTeamTiles<...>::kBytes.

    Per warp, rows of its columns + 8 elements: a zero row, K and V tiles of SMALLSEQ_TILE rows, and
    two chunk tiles of 16 stacked query rows per staged tensor (forward Q; backward Q and dO). The
    forward's warps of a pair add two slots for the partial S they hand each other. The backward's
    team then holds two chunks' LSE, the P and dZ tiles (16 rows of 32 + 8 keys) and a slot for the
    partial S and dP of each warp after the first.
    """
    if direction == "forward":
        pitch = (head_dim // split + 8) * element_bytes
        warp = pitch + 2 * SMALLSEQ_TILE * pitch + 2 * _SMALLSEQ_GQA_CHUNK_ROWS * pitch
        slots = 0 if split == 1 else 2 * _SMALLSEQ_GQA_EXCHANGE_BYTES
        return split * (warp + slots)
    pitch = (SMALLSEQ_GQA_BACKWARD_COLUMNS + 8) * element_bytes
    warp = pitch + 2 * SMALLSEQ_TILE * pitch + 4 * _SMALLSEQ_GQA_CHUNK_ROWS * pitch
    lse = 2 * _SMALLSEQ_GQA_CHUNK_ROWS * 4
    scores = 2 * _SMALLSEQ_GQA_CHUNK_ROWS * _SMALLSEQ_SCORE_PITCH * element_bytes
    return split * warp + lse + scores + (split - 1) * 2 * _SMALLSEQ_GQA_EXCHANGE_BYTES


def smallseq_gqa_mma_shared_bytes(direction: str, head_dim: int, tiles: SmallSeqMmaTiles) -> int:
    """Dynamic shared memory of one block of a grouped-heads tensor-core small-seq kernel."""
    return tiles.teams * smallseq_gqa_mma_team_bytes(direction, head_dim, tiles.split)


def smallseq_gqa_mma_spec(fam: KernelFamily, dtype: str, head_dim: int,
                          tiles: SmallSeqMmaTiles | None = None) -> KernelSpec:
    """The grouped-heads forward or backward instantiation with ``tiles`` (default: its table's row)."""
    if tiles is None:
        forward = fam.name == "smallseq_forward_gqa_mma"
        tiles = (SMALLSEQ_GQA_FORWARD_MMA_TILES if forward else SMALLSEQ_GQA_BACKWARD_MMA_TILES)[head_dim]
    return fam.spec(dtype=dtype, head_dim=head_dim, tile=SMALLSEQ_TILE, warps=tiles.warps, split=tiles.split)


def _smallseq_gqa_mma_specs(fam: KernelFamily, target: Target) -> list[KernelSpec]:
    if not runs_nvidia_mma(target):
        return []
    return [smallseq_gqa_mma_spec(fam, t, d) for t in DTYPES for d in SMALLSEQ_HEAD_DIMS]


_GQA_FIELDS = (("problems_per_team", "i32"), ("group_size", "i32"))

SMALLSEQ_FORWARD_GQA_MMA = _register(
    KernelFamily(
        name="smallseq_forward_gqa_mma",
        source="smallseq/forward_gqa_mma.hip",
        template="hipattn::smallseq_forward_gqa_mma",
        template_params=("dtype", "head_dim", "tile", "warps", "split"),
        params=ParamsStruct("SmallSeqForwardGqaMmaParams", SMALLSEQ_FORWARD.params.fields + _GQA_FIELDS),
        shipped=lambda target: _smallseq_gqa_mma_specs(SMALLSEQ_FORWARD_GQA_MMA, target),
    )
)

SMALLSEQ_BACKWARD_GQA_MMA = _register(
    KernelFamily(
        name="smallseq_backward_gqa_mma",
        source="smallseq/backward_gqa_mma.hip",
        template="hipattn::smallseq_backward_gqa_mma",
        template_params=("dtype", "head_dim", "tile", "warps", "split"),
        params=ParamsStruct("SmallSeqBackwardGqaMmaParams", SMALLSEQ_BACKWARD.params.fields + _GQA_FIELDS),
        shipped=lambda target: _smallseq_gqa_mma_specs(SMALLSEQ_BACKWARD_GQA_MMA, target),
    )
)

# ---- general attention forward (FlashAttention-2 on NVIDIA tensor cores, sm_80+) -----------------

FLASH_HEAD_DIMS = (64, 96, 128, 256)


@dataclass(frozen=True)
class FlashForwardTiles:
    """One row of the flash forward's tile table: the kernel's BLOCK_M, BLOCK_N and STAGES."""

    block_m: int  # query rows per block
    block_n: int  # keys per tile of the inner loop
    stages: int  # K and V shared-memory slots each (1 = FlashAttention-2's interleaved K/V schedule)
    m_tiles: int = 1  # 16-row tiles per warp: each K/V fragment a warp loads feeds this many MMAs

    @property
    def threads(self) -> int:
        return self.block_m // (16 * self.m_tiles) * 32


# Per head_dim, for both 16-bit dtypes (same element size, same tiles) and every sm_80+ target: every
# row fits 99 KiB of shared memory (sm_86/sm_89's opt-in limit; tests/test_flash_tiles.py checks it). The
# block's registers grow with head_dim (a warp holds 16 m_tiles x head_dim of O and 16 m_tiles x
# block_n of S in fp32), so head_dim 256 takes half the rows and half the keys per tile.
#
# Two 16-row tiles per warp (m_tiles=2, four warps of 32 rows, as FlashAttention-2 lays a 128-row
# block out) beat one on the H200 by 20-35% at head_dim 128 (BENCHMARKS.md, tile sweep of
# 2026-11-30): each K and V fragment then feeds two MMAs. head_dim 128 keeps 176 bytes of spills
# with block_n 64 and is still the fastest row there; head_dim 256 cannot hold two tiles' O (spills).
FLASH_FORWARD_TILES: dict[int, FlashForwardTiles] = {
    64: FlashForwardTiles(block_m=128, block_n=64, stages=2, m_tiles=2),
    96: FlashForwardTiles(block_m=128, block_n=64, stages=1, m_tiles=2),
    128: FlashForwardTiles(block_m=128, block_n=64, stages=1, m_tiles=2),
    256: FlashForwardTiles(block_m=64, block_n=32, stages=2, m_tiles=1),
}

# Rows of shared tiles are padded by this many elements (16 bytes) against ldmatrix bank conflicts:
# flash::ForwardTiles::kPitch = HEAD_DIM + 8.
_FLASH_ROW_PAD = 8


def flash_forward_shared_bytes(head_dim: int, tiles: FlashForwardTiles, element_bytes: int = 2) -> int:
    """Dynamic shared memory of one flash forward block: flash::ForwardTiles<...>::kBytes.

    The kernel's layout, from the same template arguments: a BLOCK_M-row Q tile, then STAGES K
    slots and STAGES V slots of BLOCK_N rows each, every row HEAD_DIM + 8 elements long.
    """
    rows = tiles.block_m + 2 * tiles.stages * tiles.block_n
    return rows * (head_dim + _FLASH_ROW_PAD) * element_bytes


def flash_forward_spec(dtype: str, head_dim: int, tiles: FlashForwardTiles | None = None) -> KernelSpec:
    tiles = tiles or FLASH_FORWARD_TILES[head_dim]
    return FLASH_FORWARD_MMA.spec(dtype=dtype, head_dim=head_dim, block_m=tiles.block_m, block_n=tiles.block_n,
                                  stages=tiles.stages, m_tiles=tiles.m_tiles)


def _flash_forward_mma_specs(target: Target) -> list[KernelSpec]:
    if not runs_nvidia_mma(target):
        return []
    return [flash_forward_spec(t, d) for t in DTYPES for d in FLASH_HEAD_DIMS]


FLASH_FORWARD_MMA = _register(
    KernelFamily(
        name="flash_forward_mma",
        source="flash/forward_mma.hip",
        template="hipattn::flash_forward_mma",
        template_params=("dtype", "head_dim", "block_m", "block_n", "stages", "m_tiles"),
        params=ParamsStruct(
            "FlashForwardParams",
            _strided("q")
            + _strided("k")
            + _strided("v")
            + _strided("o")
            + _row_statistic("lse", "ptr")
            + _SEQUENCE_FIELDS
            + (("heads_q", "i32"),),
        ),
        shipped=_flash_forward_mma_specs,
    )
)

# ---- general attention forward on Hopper's warpgroup tensor cores (wgmma, sm_90a) ----------------

# The only target with wgmma: the arch-specific variant of compute capability 9.0 (H100, H200, GH200).
# The CUDA backend reports every 9.0 device as sm_90a, so these kernels, and every other one, are
# built for it there.
WGMMA_ARCH = "sm_90a"


def runs_nvidia_wgmma(target: Target | None) -> bool:
    """Whether ``target`` runs the wgmma kernels: NVIDIA sm_90a."""
    return target is not None and target.arch == WGMMA_ARCH


# A warpgroup: the four warps that issue a wgmma together, and the M of every wgmma (the rows of its
# accumulators). Both wgmma kernels size their blocks in warpgroups.
WGMMA_WARPGROUP_THREADS = 128
WGMMA_WARPGROUP_ROWS = 64


@dataclass(frozen=True)
class FlashForwardWgmmaTiles:
    """One row of the wgmma flash forward's tile table: the kernel's BLOCK_N, WARPGROUPS and STAGES."""

    block_n: int  # keys per tile of the inner loop: one wgmma's N for S (64 or 128)
    warpgroups: int  # 64 query rows each; they share the block's K and V tiles
    stages: int = 2  # K and V shared-memory slots each: copies run stages - 1 tiles ahead (2 or 3)

    @property
    def block_m(self) -> int:
        return WGMMA_WARPGROUP_ROWS * self.warpgroups

    @property
    def threads(self) -> int:
        return WGMMA_WARPGROUP_THREADS * self.warpgroups


# Per head_dim, for both 16-bit dtypes. The tensor cores read Q, K and V from shared memory, so a
# thread holds only S (block_n / 2 fp32), P twice (block_n / 4 each: this tile's, in flight, and the
# next one's) and O (head_dim / 2). Three warpgroups (192 query rows) read each K/V tile from L2 for
# 1.5 times the rows of two, and that wins on the H200 (BENCHMARKS.md, wgmma sweep of 2026-11-30:
# 422 against 319 TFLOP/s at head_dim 128, S = 16384): 384 threads leave 170 registers each, which
# 64-key tiles fit without spills at head_dims 64 and 128. head_dim 256 needs 229 registers, so two
# warpgroups (its row is not measured against the others). head_dim 96 is not here: its 192-byte rows
# are not whole 128-byte swizzle blocks, so it runs the mma.sync kernel on sm_90a too.
FLASH_FORWARD_WGMMA_TILES: dict[int, FlashForwardWgmmaTiles] = {
    64: FlashForwardWgmmaTiles(block_n=64, warpgroups=3),
    128: FlashForwardWgmmaTiles(block_n=64, warpgroups=3),
    256: FlashForwardWgmmaTiles(block_n=64, warpgroups=2),
}


def flash_forward_wgmma_shared_bytes(head_dim: int, tiles: FlashForwardWgmmaTiles, element_bytes: int = 2) -> int:
    """Dynamic shared memory of one wgmma flash forward block: flash::WgmmaForwardTiles<...>::kBytes.

    The Q tile (64 rows per warpgroup), then STAGES K slots and STAGES V slots (block_n rows each),
    unpadded (the 128-byte swizzle, not padding, keeps the banks apart).
    """
    return (tiles.block_m + 2 * tiles.stages * tiles.block_n) * head_dim * element_bytes


def flash_forward_wgmma_spec(dtype: str, head_dim: int, tiles: FlashForwardWgmmaTiles | None = None) -> KernelSpec:
    tiles = tiles or FLASH_FORWARD_WGMMA_TILES[head_dim]
    return FLASH_FORWARD_WGMMA.spec(dtype=dtype, head_dim=head_dim, block_n=tiles.block_n,
                                    warpgroups=tiles.warpgroups, stages=tiles.stages)


def _flash_forward_wgmma_specs(target: Target) -> list[KernelSpec]:
    if not runs_nvidia_wgmma(target):
        return []
    return [flash_forward_wgmma_spec(t, d) for t in DTYPES for d in FLASH_FORWARD_WGMMA_TILES]


FLASH_FORWARD_WGMMA = _register(
    KernelFamily(
        name="flash_forward_wgmma",
        source="flash/forward_wgmma.hip",
        template="hipattn::flash_forward_wgmma",
        template_params=("dtype", "head_dim", "block_n", "warpgroups", "stages"),
        params=FLASH_FORWARD_MMA.params,
        shipped=_flash_forward_wgmma_specs,
    )
)

# ---- general attention forward on AMD matrix cores (MFMA 16x16x16, wave64: gfx90a, gfx94x) --------

# The processors whose MFMA 16x16x16 f16 and bf16_1k instructions kernels/common/mma_amd.h uses (its
# #error guard names the same list). gfx908 lacks the bf16_1k form; gfx950 is left out until a
# compiler that knows it has built the kernels.
AMD_MFMA_ARCHS = ("gfx90a", "gfx940", "gfx941", "gfx942")


def runs_amd_mfma(target: Target | None) -> bool:
    """Whether ``target`` runs the MFMA 16x16x16 kernels: AMD gfx90a and gfx94x, any target features."""
    return target is not None and target.base_arch in AMD_MFMA_ARCHS


@dataclass(frozen=True)
class FlashForwardMfmaTiles:
    """One row of the MFMA flash forward's tile table: the kernel's BLOCK_M and BLOCK_N."""

    block_m: int  # query rows per block; one 64-lane wave per 16 rows
    block_n: int  # keys per tile of the inner loop

    @property
    def threads(self) -> int:
        return self.block_m // 16 * 64


# Per head_dim, for both 16-bit dtypes. LDS holds one K tile and one transposed V tile (Q and O live
# in registers), so every row fits 64 KiB (the kernel static_asserts it; flash_forward_mfma_shared_bytes
# gives 17, 25.3, 33.5 and 18.1 KiB). Eight waves per block leave each wave 256 registers per lane
# (gfx90a's unified 512 shared by 2 waves per SIMD). A wave holds 16 x head_dim of O in fp32 (64
# registers per lane at head_dim 256) and its Q fragments (32 more); with block_n 32 the hiprtc 5.2
# build of head_dim 256 spilled 9 registers, with block_n 16 it needs 204 and spills none.
FLASH_FORWARD_MFMA_TILES: dict[int, FlashForwardMfmaTiles] = {
    64: FlashForwardMfmaTiles(block_m=128, block_n=64),
    96: FlashForwardMfmaTiles(block_m=128, block_n=64),
    128: FlashForwardMfmaTiles(block_m=128, block_n=64),
    256: FlashForwardMfmaTiles(block_m=128, block_n=16),
}

# LDS rows are padded by this many elements (8 bytes) against bank conflicts of the 8-byte fragment
# reads: flash::MfmaForwardTiles::kKPitch = HEAD_DIM + 4 and kVPitch = BLOCK_N + 4.
_MFMA_ROW_PAD = 4
# gfx90a's and gfx94x's LDS per workgroup.
AMD_LDS_BYTES = 64 * 1024


def flash_forward_mfma_shared_bytes(head_dim: int, tiles: FlashForwardMfmaTiles, element_bytes: int = 2) -> int:
    """Dynamic LDS of one MFMA flash forward block: flash::MfmaForwardTiles<...>::kBytes.

    The kernel's layout, from the same template arguments: a K tile of BLOCK_N rows of HEAD_DIM + 4
    elements, then Vᵀ: HEAD_DIM rows of BLOCK_N + 4 elements.
    """
    elements = tiles.block_n * (head_dim + _MFMA_ROW_PAD) + head_dim * (tiles.block_n + _MFMA_ROW_PAD)
    return elements * element_bytes


def flash_forward_mfma_spec(dtype: str, head_dim: int, tiles: FlashForwardMfmaTiles | None = None) -> KernelSpec:
    tiles = tiles or FLASH_FORWARD_MFMA_TILES[head_dim]
    return FLASH_FORWARD_MFMA.spec(dtype=dtype, head_dim=head_dim, block_m=tiles.block_m, block_n=tiles.block_n)


def _flash_forward_mfma_specs(target: Target) -> list[KernelSpec]:
    if not runs_amd_mfma(target):
        return []
    return [flash_forward_mfma_spec(t, d) for t in DTYPES for d in FLASH_HEAD_DIMS]


FLASH_FORWARD_MFMA = _register(
    KernelFamily(
        name="flash_forward_mfma",
        source="flash/forward_mfma.hip",
        template="hipattn::flash_forward_mfma",
        template_params=("dtype", "head_dim", "block_m", "block_n"),
        params=FLASH_FORWARD_MMA.params,
        shipped=_flash_forward_mfma_specs,
    )
)

# A row of any of the three forward tables: its type names the kernel (ops.flash launches by it).
FlashForwardRow = FlashForwardTiles | FlashForwardWgmmaTiles | FlashForwardMfmaTiles


def flash_forward_tiles(head_dim: int, target: Target | None) -> FlashForwardRow:
    """The forward's table row for ``head_dim`` on ``target``; its type names the kernel: MFMA on AMD
    gfx90a/gfx94x, wgmma on sm_90a (but head_dim 96), mma.sync on every other target."""
    if runs_amd_mfma(target):
        return FLASH_FORWARD_MFMA_TILES[head_dim]
    if runs_nvidia_wgmma(target) and head_dim in FLASH_FORWARD_WGMMA_TILES:
        return FLASH_FORWARD_WGMMA_TILES[head_dim]
    return FLASH_FORWARD_TILES[head_dim]


# ---- general attention backward (FlashAttention-2 on NVIDIA tensor cores, sm_80+) ----------------


@dataclass(frozen=True)
class FlashBackwardTiles:
    """One row of a flash backward tile table: the kernel's BLOCK_M, BLOCK_N and WARPS.

    dK/dV kernel: a warp owns 16 keys and head_dim / (warps / (block_n / 16)) columns of their dK and
    dV. dQ kernel: one warp per 16 query rows (warps = block_m / 16).
    """

    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    warps: int

    @property
    def threads(self) -> int:
        return self.warps * 32


# Per head_dim, for both 16-bit dtypes and every sm_80+ target; every row fits 99 KiB of shared memory
# (sm_86/sm_89's opt-in limit; tests/test_flash_tiles.py checks it). dK/dV: K, V, Pᵀ and dSᵀ
# of a key tile plus two slots of Q and dO stay in shared memory, so the query tile is short (32 rows)
# and the key tile as long as the budget allows: 128 keys up to head_dim 96, 64 at 128. A warp's dK
# and dV accumulators take head_dim / 2 registers per lane when it owns all columns of its 16 keys: at
# head_dim 128 two warps share each 16-key slice (64 columns each; 8 warps at ~160 registers rather
# than 4 at ~245), and at head_dim 256 they must (128 columns each), with the tiles shrunk to 16 x 32
# to fit the shared memory. Every row compiles without spills for sm_90 (ptxas -v).
FLASH_BACKWARD_DKDV_TILES: dict[int, FlashBackwardTiles] = {
    64: FlashBackwardTiles(block_m=32, block_n=128, warps=8),
    96: FlashBackwardTiles(block_m=32, block_n=128, warps=8),
    128: FlashBackwardTiles(block_m=32, block_n=64, warps=8),
    256: FlashBackwardTiles(block_m=16, block_n=32, warps=4),
}

# dQ: like the forward (Q and dO of the block, two K and two V slots), the key tile shrinking as
# head_dim grows so that the double-buffered K/V slots fit.
FLASH_BACKWARD_DQ_TILES: dict[int, FlashBackwardTiles] = {
    64: FlashBackwardTiles(block_m=128, block_n=64, warps=8),
    96: FlashBackwardTiles(block_m=64, block_n=64, warps=4),
    128: FlashBackwardTiles(block_m=64, block_n=32, warps=4),
    256: FlashBackwardTiles(block_m=64, block_n=16, warps=4),
}

# Hopper (sm_90, sm_90a) lets a block opt in to 227 KiB of shared memory, and the larger tiles that
# buys win on the H200 (tools/sweep_flash_backward.py, BENCHMARKS.md): 128-key tiles with 64-row query
# tiles at head_dims 64 to 128 (one warp per 16 keys holding all their dK/dV columns: no spills at
# ~250 registers) make the atomic backward 1.2x (64) to 1.7x (128) faster, since every key tile
# adds its dQ share once and a longer key tile means fewer additions; 32 x 64 at head_dim 256, 1.6x.
# 128-row dQ tiles make the deterministic schedule (dK/dV kernel, then dQ kernel) 2-7% faster still.
HOPPER_SHARED_BYTES = 227 * 1024
FLASH_BACKWARD_DKDV_TILES_HOPPER: dict[int, FlashBackwardTiles] = {
    64: FlashBackwardTiles(block_m=64, block_n=128, warps=8),
    96: FlashBackwardTiles(block_m=64, block_n=128, warps=8),
    128: FlashBackwardTiles(block_m=64, block_n=128, warps=8),
    256: FlashBackwardTiles(block_m=32, block_n=64, warps=8),
}
FLASH_BACKWARD_DQ_TILES_HOPPER: dict[int, FlashBackwardTiles] = {
    64: FlashBackwardTiles(block_m=128, block_n=128, warps=8),
    96: FlashBackwardTiles(block_m=128, block_n=64, warps=8),
    128: FlashBackwardTiles(block_m=128, block_n=64, warps=8),
    256: FlashBackwardTiles(block_m=128, block_n=32, warps=8),
}


def has_hopper_shared_memory(target: Target | None) -> bool:
    """Whether ``target`` is an NVIDIA sm_90 part (227 KiB of opt-in shared memory per block)."""
    return target is not None and target.vendor == NVIDIA and target.compute_capability == 90


@dataclass(frozen=True)
class FlashBackwardWgmmaTiles:
    """One row of the wgmma dK/dV kernel's table (sm_90a): its WARPGROUPS, 64 keys each, which walk
    query tiles of 64 rows (the M of dQ's wgmma)."""

    warpgroups: int

    block_m = WGMMA_WARPGROUP_ROWS  # query rows per tile, fixed (dQ's M): not a field

    @property
    def block_n(self) -> int:
        return WGMMA_WARPGROUP_ROWS * self.warpgroups

    @property
    def threads(self) -> int:
        return WGMMA_WARPGROUP_THREADS * self.warpgroups


# Padding (fp32 words) of each staged dQ row of the wgmma dK/dV kernel (WgmmaKeyBlockTiles::kDqPitch):
# a warp's two-word stores of rows g and g + 8 then meet no bank twice.
_WGMMA_DQ_ROW_PAD = 8

# head_dim 128 only: two warpgroups hold dK and dV (64 fp32 registers each per thread) beside Sᵀ and
# dPᵀ (32 each), and each takes 64 of dQ's columns, a whole swizzle block of K. At head_dim 64 two
# warpgroups would split dQ into 32-column halves of a swizzle block, and one warpgroup would add dQ
# per 64 keys instead of 128; at 96 the rows are not whole swizzle blocks, and at 256 dK and dV alone
# would take every register. Those keep the mma.sync kernel.
FLASH_BACKWARD_DKDV_WGMMA_TILES: dict[int, FlashBackwardWgmmaTiles] = {
    128: FlashBackwardWgmmaTiles(warpgroups=2),
}

# A dK/dV row: its type names the kernel.
@dataclass(frozen=True)
class FlashBackwardMfmaTiles:
    """One row of the MFMA backward's tables (AMD gfx90a, gfx94x): a dK/dV block has one 64-lane wave
    per 16 of its block_n keys and walks 16-row query tiles (block_m = 16); a dQ block has one wave per
    16 of its block_m rows and walks 16-key tiles (block_n = 16)."""

    block_m: int
    block_n: int

    @property
    def threads(self) -> int:
        # The kernel that owns the longer side runs one wave per 16 of it.
        return max(self.block_m, self.block_n) // 16 * 64


# Every head_dim, both dtypes. dK/dV: four waves of 16 keys each; a wave keeps its K and V fragments,
# Kᵀ's for dQ, and dKᵀ and dVᵀ in registers, and LDS holds Qᵀ and dOᵀ of one query tile and each
# wave's Pᵀ and dSᵀ (flash_backward_dkdv_mfma_shared_bytes: 10 to 25 KiB). dQ: four waves of 16
# rows, no LDS. hiprtc 5.2's gfx90a code objects use 100-196 of a lane's 512 registers up to
# head_dim 128 and 372 at 256 (dK/dV; dQ 80-216), with no spills. Not tuned or timed: there is no
# AMD GPU here (tests/test_amd_emulation.py checks the results on an emulated gfx90a).
FLASH_BACKWARD_DKDV_MFMA_TILES = FlashBackwardMfmaTiles(block_m=16, block_n=64)
FLASH_BACKWARD_DQ_MFMA_TILES = FlashBackwardMfmaTiles(block_m=64, block_n=16)

FlashBackwardDkdvRow = FlashBackwardTiles | FlashBackwardWgmmaTiles | FlashBackwardMfmaTiles
FlashBackwardDqRow = FlashBackwardTiles | FlashBackwardMfmaTiles


def flash_backward_mma_tiles(head_dim: int, target: Target | None) -> tuple[FlashBackwardTiles, FlashBackwardTiles]:
    """The mma.sync kernels' (dK/dV, dQ) rows of ``head_dim`` for ``target``: Hopper's, or the every-part ones."""
    if has_hopper_shared_memory(target):
        return FLASH_BACKWARD_DKDV_TILES_HOPPER[head_dim], FLASH_BACKWARD_DQ_TILES_HOPPER[head_dim]
    return FLASH_BACKWARD_DKDV_TILES[head_dim], FLASH_BACKWARD_DQ_TILES[head_dim]


def flash_backward_tiles(head_dim: int, target: Target | None) -> tuple[FlashBackwardDkdvRow, FlashBackwardDqRow]:
    """The (dK/dV, dQ) rows ``target`` runs at ``head_dim``: MFMA's on AMD; the wgmma dK/dV kernel on
    sm_90a where its table has the head_dim, else the mma.sync rows. (On NVIDIA the deterministic
    schedule's dQ kernel is mma.sync everywhere.)"""
    if runs_amd_mfma(target):
        return FLASH_BACKWARD_DKDV_MFMA_TILES, FLASH_BACKWARD_DQ_MFMA_TILES
    dkdv, dq = flash_backward_mma_tiles(head_dim, target)
    if runs_nvidia_wgmma(target) and head_dim in FLASH_BACKWARD_DKDV_WGMMA_TILES:
        dkdv = FLASH_BACKWARD_DKDV_WGMMA_TILES[head_dim]
    return dkdv, dq


def flash_backward_dkdv_shared_bytes(head_dim: int, tiles: FlashBackwardDkdvRow, element_bytes: int = 2) -> int:
    """Dynamic shared memory of one dK/dV block of any of the kernels."""
    if isinstance(tiles, FlashBackwardWgmmaTiles):
        return flash_backward_dkdv_wgmma_shared_bytes(head_dim, tiles, element_bytes)
    if isinstance(tiles, FlashBackwardMfmaTiles):
        return flash_backward_dkdv_mfma_shared_bytes(head_dim, tiles, element_bytes)
    return flash_backward_dkdv_mma_shared_bytes(head_dim, tiles, element_bytes)


def flash_backward_dkdv_mfma_shared_bytes(head_dim: int, tiles: FlashBackwardMfmaTiles,
                                          element_bytes: int = 2) -> int:
    """Dynamic LDS of one MFMA dK/dV block: flash::MfmaKeyBlockTiles<...>::kBytes.

    Qᵀ and dOᵀ of a 16-row query tile (head_dim rows of 16 + 4 elements each), then each wave's Pᵀ
    and dSᵀ (16 rows of 16 + 4).
    """
    pitch = 16 + _MFMA_ROW_PAD
    return (2 * head_dim * pitch + tiles.block_n // 16 * 2 * 16 * pitch) * element_bytes


def flash_backward_dkdv_wgmma_shared_bytes(head_dim: int, tiles: FlashBackwardWgmmaTiles,
                                           element_bytes: int = 2) -> int:
    """Dynamic shared memory of one wgmma dK/dV block: flash::WgmmaKeyBlockTiles<...>::kBytes.

    K and V (block_n rows each), two slots each of Q and dO (block_m rows), unpadded (swizzled); dSᵀ
    (block_n rows of block_m); then fp32 LSE and Delta, two slots of block_m; then each warpgroup's
    fp32 share of dQ (block_m rows of its head_dim / warpgroups columns, padded by 8 words).
    """
    elements = (2 * tiles.block_n + 4 * tiles.block_m) * head_dim + tiles.block_n * tiles.block_m
    dq_pitch = head_dim // tiles.warpgroups + _WGMMA_DQ_ROW_PAD
    return elements * element_bytes + 2 * 2 * tiles.block_m * 4 + tiles.warpgroups * tiles.block_m * dq_pitch * 4


def flash_backward_dkdv_mma_shared_bytes(head_dim: int, tiles: FlashBackwardTiles, element_bytes: int = 2) -> int:
    """Dynamic shared memory of one mma.sync dK/dV block: flash::KeyBlockTiles<...>::kBytes.

    K and V (block_n rows each), two slots each of Q and dO (block_m rows), every row head_dim + 8
    elements; Pᵀ and dSᵀ (block_n rows of block_m + 8); then fp32 LSE and Delta, two slots of block_m.
    """
    pitch = head_dim + _FLASH_ROW_PAD
    elements = (2 * tiles.block_n + 4 * tiles.block_m) * pitch + 2 * tiles.block_n * (tiles.block_m + _FLASH_ROW_PAD)
    return elements * element_bytes + 2 * 2 * tiles.block_m * 4


def flash_backward_dq_shared_bytes(head_dim: int, tiles: FlashBackwardDqRow, element_bytes: int = 2) -> int:
    """Dynamic shared memory of one dQ block: flash::QueryBlockTiles<...>::kBytes (mma.sync).

    Q and dO (block_m rows each), then two K and two V slots (block_n rows each), rows head_dim + 8 long.
    The MFMA dQ kernel takes none.
    """
    if isinstance(tiles, FlashBackwardMfmaTiles):
        return 0
    return (2 * tiles.block_m + 4 * tiles.block_n) * (head_dim + _FLASH_ROW_PAD) * element_bytes


def flash_backward_dkdv_spec(dtype: str, head_dim: int, write_dq: bool, tiles: FlashBackwardDkdvRow) -> KernelSpec:
    """The dK/dV kernel of ``tiles``' type (wgmma, MFMA or mma.sync) with those tiles."""
    if isinstance(tiles, FlashBackwardWgmmaTiles):
        return FLASH_BACKWARD_DKDV_WGMMA.spec(dtype=dtype, head_dim=head_dim, warpgroups=tiles.warpgroups,
                                              write_dq=write_dq)
    if isinstance(tiles, FlashBackwardMfmaTiles):
        return FLASH_BACKWARD_DKDV_MFMA.spec(dtype=dtype, head_dim=head_dim, block_n=tiles.block_n, write_dq=write_dq)
    return FLASH_BACKWARD_DKDV_MMA.spec(dtype=dtype, head_dim=head_dim, block_m=tiles.block_m,
                                        block_n=tiles.block_n, warps=tiles.warps, write_dq=write_dq)


def flash_backward_dq_spec(dtype: str, head_dim: int, tiles: FlashBackwardDqRow) -> KernelSpec:
    """The deterministic dQ kernel of ``tiles``' type (MFMA or mma.sync) with those tiles."""
    if isinstance(tiles, FlashBackwardMfmaTiles):
        return FLASH_BACKWARD_DQ_MFMA.spec(dtype=dtype, head_dim=head_dim, block_m=tiles.block_m)
    return FLASH_BACKWARD_DQ_MMA.spec(dtype=dtype, head_dim=head_dim, block_m=tiles.block_m, block_n=tiles.block_n,
                                      warps=tiles.warps)


# One struct for both kernels (they share a source file, and a compile unit declares one struct):
# the dK/dV kernel leaves dq unread, the dQ kernel dq_accum, dk, dv and varlen_records.
# varlen_records: THD's work list (hipattn.varlen_metadata), or null (BSHD, or THD sized from
# max_seqlen_k).
FLASH_BACKWARD_PARAMS = ParamsStruct(
    "FlashBackwardParams",
    _strided("q")
    + _strided("k")
    + _strided("v")
    + _strided("dout")
    + _strided("dq")
    + _strided("dq_accum")
    + _strided("dk")
    + _strided("dv")
    + _row_statistic("lse", "const_ptr")
    + _row_statistic("softmax_d", "const_ptr")
    + _SEQUENCE_FIELDS
    + (("heads_q", "i32"), ("varlen_records", "const_ptr")),
)


def _flash_backward_dkdv_specs(target: Target) -> list[KernelSpec]:
    if not runs_nvidia_mma(target):
        return []
    return [flash_backward_dkdv_spec(t, d, w, flash_backward_mma_tiles(d, target)[0])
            for t in DTYPES for d in FLASH_HEAD_DIMS for w in (False, True)]


def _flash_backward_dkdv_wgmma_specs(target: Target) -> list[KernelSpec]:
    if not runs_nvidia_wgmma(target):
        return []
    return [flash_backward_dkdv_spec(t, d, w, tiles) for t in DTYPES
            for d, tiles in FLASH_BACKWARD_DKDV_WGMMA_TILES.items() for w in (False, True)]


def _flash_backward_dq_specs(target: Target) -> list[KernelSpec]:
    if not runs_nvidia_mma(target):
        return []
    return [flash_backward_dq_spec(t, d, flash_backward_mma_tiles(d, target)[1])
            for t in DTYPES for d in FLASH_HEAD_DIMS]


def _flash_backward_family(name: str, source: str, template_params: tuple[str, ...], shipped) -> KernelFamily:
    """One of the flash backward's kernel families: all take FLASH_BACKWARD_PARAMS and the work list's
    record struct, and are named as their templates."""
    return _register(KernelFamily(name=name, source=source, template=f"hipattn::{name}", template_params=template_params,
                                  params=FLASH_BACKWARD_PARAMS, shipped=shipped, structs=(VARLEN_RECORD,)))


FLASH_BACKWARD_DKDV_MMA = _flash_backward_family(
    "flash_backward_dkdv_mma", "flash/backward_mma.hip",
    ("dtype", "head_dim", "block_m", "block_n", "warps", "write_dq"), _flash_backward_dkdv_specs)
FLASH_BACKWARD_DKDV_WGMMA = _flash_backward_family(
    "flash_backward_dkdv_wgmma", "flash/backward_wgmma.hip", ("dtype", "head_dim", "warpgroups", "write_dq"),
    _flash_backward_dkdv_wgmma_specs)
FLASH_BACKWARD_DQ_MMA = _flash_backward_family(
    "flash_backward_dq_mma", "flash/backward_mma.hip", ("dtype", "head_dim", "block_m", "block_n", "warps"),
    _flash_backward_dq_specs)


def _flash_backward_mfma_specs(target: Target, dkdv: bool) -> list[KernelSpec]:
    if not runs_amd_mfma(target):
        return []
    if dkdv:
        return [flash_backward_dkdv_spec(t, d, w, FLASH_BACKWARD_DKDV_MFMA_TILES)
                for t in DTYPES for d in FLASH_HEAD_DIMS for w in (False, True)]
    return [flash_backward_dq_spec(t, d, FLASH_BACKWARD_DQ_MFMA_TILES) for t in DTYPES for d in FLASH_HEAD_DIMS]


FLASH_BACKWARD_DKDV_MFMA = _flash_backward_family(
    "flash_backward_dkdv_mfma", "flash/backward_mfma.hip", ("dtype", "head_dim", "block_n", "write_dq"),
    lambda target: _flash_backward_mfma_specs(target, dkdv=True))
FLASH_BACKWARD_DQ_MFMA = _flash_backward_family(
    "flash_backward_dq_mfma", "flash/backward_mfma.hip", ("dtype", "head_dim", "block_m"),
    lambda target: _flash_backward_mfma_specs(target, dkdv=False))

# ---- the varlen backward's work list, derived on the device (hipattn.varlen_prep) -----------------

# One block walks the batch, one sequence per thread per chunk, carrying a block-wide scan from
# chunk to chunk. Portable (no warp intrinsics, any wave size): shipped for every target.
VARLEN_RECORDS_BLOCK_THREADS = 256


def varlen_records_spec() -> KernelSpec:
    return VARLEN_RECORDS.spec(block_threads=VARLEN_RECORDS_BLOCK_THREADS)


VARLEN_RECORDS = _register(
    KernelFamily(
        name="varlen_records",
        source="flash/varlen_records.hip",
        template="hipattn::varlen_records",
        template_params=("block_threads",),
        params=ParamsStruct(
            "VarlenRecordsParams",
            (
                ("cu_seqlens_q", "const_ptr"),
                ("cu_seqlens_k", "const_ptr"),
                ("seqused_q", "const_ptr"),
                ("seqused_k", "const_ptr"),
                ("records", "ptr"),
                ("batch", "i32"),
                ("max_seqlen_q", "i32"),
                ("max_seqlen_k", "i32"),
                ("total_q", "i32"),
                ("total_k", "i32"),
                ("block_n", "i32"),
                ("key_block_bound", "i32"),
            ),
        ),
        shipped=lambda target: [varlen_records_spec()],
        structs=(VARLEN_RECORD,),
    )
)
