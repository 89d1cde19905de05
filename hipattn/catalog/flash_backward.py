"""The general attention backward: a dK/dV kernel per key block (which also adds each key tile's share
of dQ into an fp32 accumulator on the atomic schedule) and, for ``deterministic=True``, a dQ kernel
per query tile. mma.sync on NVIDIA sm_80+ (larger rows on sm_90's 227 KiB), a wgmma dK/dV kernel on
sm_90a (warp-specialised, its producer copying through tensor maps, at head_dims 96 and 128; every
thread copying at 64 and 256, and for arrays no tensor map describes), MFMA on AMD gfx90a/gfx94x/gfx950.
One row type per kernel; ``tiles_for`` picks a target's pair."""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.params import TENSOR_MAP, ParamsStruct
from ..jit.spec import KernelFamily
from ..jit.target import Target
from ..varlen_metadata import VARLEN_RECORD
from .common import (
    DTYPES,
    FLASH_HEAD_DIMS,
    FLASH_ROW_PAD,
    MBARRIER_BYTES,
    MFMA_ROW_PAD,
    WGMMA_WARPGROUP_ROWS,
    WGMMA_WARPGROUP_THREADS,
    wgmma_row_elements,
)
from .fields import (
    DROPOUT_FIELDS,
    SCORE_MOD_FIELDS,
    SCORE_MODS_PARAM,
    SCORE_MODS_VALUES,
    SEQUENCE_FIELDS,
    row_statistic,
    strided,
)
from .index import register
from .targets import has_hopper_shared_memory, runs_amd_mfma, runs_nvidia_mma, runs_nvidia_wgmma
from .tiles import ELEMENT_BYTES, KernelTiles, WarpgroupTiles

# One struct for every kernel of the backward (a dK/dV and a dQ kernel share a source file, and a
# compile unit declares one struct): the dK/dV kernel leaves dq unread, the dQ kernel dq_accum, dk, dv
# and varlen_records. varlen_records: THD's work list (hipattn.varlen_metadata), or null (BSHD, or THD
# sized from max_seqlen_k).
FLASH_BACKWARD_PARAMS = ParamsStruct(
    "FlashBackwardParams",
    strided("q") + strided("k") + strided("v") + strided("dout") + strided("dq") + strided("dq_accum")
    + strided("dk") + strided("dv") + row_statistic("lse", "const_ptr") + row_statistic("softmax_d", "const_ptr")
    + SEQUENCE_FIELDS + (("heads_q", "i32"), ("varlen_records", "const_ptr")) + SCORE_MOD_FIELDS
    + DROPOUT_FIELDS,
)

# The warp-specialised dK/dV kernel's struct: the backward's fields, then the tensor maps its producer
# copies Q and dO through (ops.tensor_map_fields): [batch, token, head, dim] maps whose boxes are one
# 64-column swizzle block of a query tile's rows.
FLASH_BACKWARD_TMA_PARAMS = ParamsStruct.extending(
    "FlashBackwardTmaParams", FLASH_BACKWARD_PARAMS, (("q_map", TENSOR_MAP), ("dout_map", TENSOR_MAP)))


def _dkdv_specs(rows, score_mods_values=SCORE_MODS_VALUES) -> list:
    return [row.spec(t, d, write_dq=w, score_mods=m) for t in DTYPES for d, row in rows for w in (False, True)
            for m in score_mods_values]


def _dq_specs(rows) -> list:
    return [row.spec(t, d, score_mods=m) for t in DTYPES for d, row in rows for m in SCORE_MODS_VALUES]


def _mma_rows(target: Target, which: int) -> list:
    return [(d, mma_tiles_for(d, target)[which]) for d in FLASH_HEAD_DIMS] if runs_nvidia_mma(target) else []


def _mfma_rows(row: KernelTiles, target: Target) -> list:
    return [(d, row) for d in FLASH_HEAD_DIMS] if runs_amd_mfma(target) else []


def _family(name: str, source: str, template_params: tuple[str, ...], shipped,
            params: ParamsStruct = FLASH_BACKWARD_PARAMS) -> KernelFamily:
    """A backward kernel family: all take FLASH_BACKWARD_PARAMS (or a struct extending it) and the work
    list's record struct, and are named as their templates."""
    structs = (VARLEN_RECORD,) if params is FLASH_BACKWARD_PARAMS else (VARLEN_RECORD, FLASH_BACKWARD_PARAMS)
    return register(KernelFamily(name=name, source=source, template=f"hipattn::{name}",
                                 template_params=("dtype", "head_dim", *template_params, SCORE_MODS_PARAM),
                                 params=params, shipped=shipped, structs=structs))


# Each ships its rows (below) for both dtypes (and the dK/dV kernels with and without dQ) on the
# targets that run its instructions.
FLASH_BACKWARD_DKDV_MMA = _family(
    "flash_backward_dkdv_mma", "flash/backward_mma.hip", ("block_m", "block_n", "warps", "write_dq"),
    lambda target: _dkdv_specs(_mma_rows(target, 0)))
FLASH_BACKWARD_DKDV_WGMMA = _family(
    "flash_backward_dkdv_wgmma", "flash/backward_wgmma.hip",
    ("warpgroups", "column_groups", "block_m", "write_dq"),
    lambda target: [spec for m in SCORE_MODS_VALUES for spec in _dkdv_specs(dkdv_wgmma_tiles(m).items(), (m,))]
    if runs_nvidia_wgmma(target) else [])
FLASH_BACKWARD_DKDV_WARP_SPECIALISED = _family(
    "flash_backward_dkdv_warp_specialised", "flash/backward_warp_specialised.hip", ("block_m", "stages", "write_dq"),
    lambda target: _dkdv_specs(FLASH_BACKWARD_DKDV_WARP_SPECIALISED_TILES.items())
    if runs_nvidia_wgmma(target) else [],
    params=FLASH_BACKWARD_TMA_PARAMS)
FLASH_BACKWARD_DQ_MMA = _family(
    "flash_backward_dq_mma", "flash/backward_mma.hip", ("block_m", "block_n", "warps"),
    lambda target: _dq_specs(_mma_rows(target, 1)))
FLASH_BACKWARD_DKDV_MFMA = _family(
    "flash_backward_dkdv_mfma", "flash/backward_mfma.hip", ("block_n", "write_dq"),
    lambda target: _dkdv_specs(_mfma_rows(FLASH_BACKWARD_DKDV_MFMA_TILES, target)))
FLASH_BACKWARD_DQ_MFMA = _family(
    "flash_backward_dq_mfma", "flash/backward_mfma.hip", ("block_m",),
    lambda target: _dq_specs(_mfma_rows(FLASH_BACKWARD_DQ_MFMA_TILES, target)))


@dataclass(frozen=True)
class _MmaRow(KernelTiles):
    """BLOCK_M, BLOCK_N and WARPS of an mma.sync backward kernel."""

    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    warps: int

    @property
    def threads(self) -> int:
        return self.warps * 32



@dataclass(frozen=True)
class FlashDkdvMmaTiles(_MmaRow):
    """The mma.sync dK/dV kernel: a warp owns 16 keys and head_dim / (warps / (block_n / 16)) columns of
    their dK and dV."""

    family = FLASH_BACKWARD_DKDV_MMA

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """flash::KeyBlockTiles<...>::kBytes: K and V (block_n rows each), two slots each of Q and dO
        (block_m rows), every row head_dim + 8 elements; Pᵀ and dSᵀ (block_n rows of block_m + 8); then
        fp32 LSE and Delta, two slots of block_m."""
        pitch = head_dim + FLASH_ROW_PAD
        elements = (2 * self.block_n + 4 * self.block_m) * pitch + 2 * self.block_n * (self.block_m + FLASH_ROW_PAD)
        return elements * element_bytes + 2 * 2 * self.block_m * 4


@dataclass(frozen=True)
class FlashDqMmaTiles(_MmaRow):
    """The mma.sync dQ kernel of the deterministic schedule: one warp per 16 query rows."""

    family = FLASH_BACKWARD_DQ_MMA

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """flash::QueryBlockTiles<...>::kBytes: Q and dO (block_m rows each), then two K and two V slots
        (block_n rows each), rows head_dim + 8 long."""
        return (2 * self.block_m + 4 * self.block_n) * (head_dim + FLASH_ROW_PAD) * element_bytes


# Padding (fp32 words) of each staged dQ row of the wgmma dK/dV kernel (WgmmaKeyBlockTiles::kDqPitch):
# a warp's two-word stores of rows g and g + 8 then meet no bank twice.
WGMMA_DQ_ROW_PAD = 8


@dataclass(frozen=True)
class FlashDkdvWgmmaTiles(WarpgroupTiles):
    """The wgmma dK/dV kernel (sm_90a): its WARPGROUPS walk query tiles of 64 rows (the M of dQ's
    wgmma). With one column group each warpgroup owns 64 keys and every column of their dK and dV;
    with ``column_groups`` of them, that many warpgroups share 64 keys and split the columns (head_dim
    256, whose dK and dV of 64 keys would not fit one warpgroup's registers)."""

    warpgroups: int
    column_groups: int = 1
    block_m: int = WGMMA_WARPGROUP_ROWS  # query rows per tile: 64, or 64 per warpgroup (dQ split by rows)

    family = FLASH_BACKWARD_DKDV_WGMMA

    @property
    def block_n(self) -> int:
        return self.warpgroup_rows // self.column_groups

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """flash::WgmmaKeyBlockTiles<...>::kBytes: K and V (block_n rows each), two slots each of Q and
        dO (block_m rows), unpadded (swizzled) in whole 64-column blocks; dSᵀ (block_n rows of block_m),
        and with column groups Pᵀ the same; then fp32 LSE and Delta, two slots of block_m; then, with
        one column group, each warpgroup's fp32 share of dQ (block_m rows of its stored columns /
        warpgroups, padded by 8 words)."""
        row_elements = wgmma_row_elements(head_dim)
        shared_keys = self.column_groups > 1
        score_tiles = 2 if shared_keys else 1
        elements = (2 * self.block_n + 4 * self.block_m) * row_elements + score_tiles * self.block_n * self.block_m
        dq_by_rows = self.block_m > WGMMA_WARPGROUP_ROWS
        dq_pitch = (row_elements if dq_by_rows else row_elements // self.warpgroups) + WGMMA_DQ_ROW_PAD
        staged_dq_rows = 0 if shared_keys else self.warpgroups * WGMMA_WARPGROUP_ROWS
        return elements * element_bytes + 2 * 2 * self.block_m * 4 + staged_dq_rows * dq_pitch * 4


@dataclass(frozen=True)
class FlashDkdvWarpSpecialisedTiles(KernelTiles):
    """The warp-specialised wgmma dK/dV kernel (sm_90a): a producer warpgroup copies each query tile's
    Q and dO (through tensor maps), LSE and Delta into a ring of ``stages`` slots, and two consumer
    warpgroups of 64 keys each (128-key tiles) compute on them as the wgmma dK/dV kernel's warpgroups
    with one column group do."""

    block_m: int = WGMMA_WARPGROUP_ROWS  # query rows per tile: 64, or 128 (dQ split by rows)
    stages: int = 2  # query-tile slots of the ring

    family = FLASH_BACKWARD_DKDV_WARP_SPECIALISED

    consumers = 2
    block_n = WGMMA_WARPGROUP_ROWS * consumers

    @property
    def threads(self) -> int:
        return WGMMA_WARPGROUP_THREADS * (self.consumers + 1)

    def tensor_map_rows(self) -> dict[str, int]:
        """Q and dO reach the kernel as tensor maps whose boxes hold a query tile's rows."""
        return {"q": self.block_m, "dout": self.block_m}

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """flash::WarpSpecialisedKeyBlockTiles<...>::kBytes: K and V (128 rows each), ``stages`` slots
        each of Q and dO (block_m rows), swizzled in whole 64-column blocks; two dSᵀ buffers (128 keys
        by block_m); fp32 LSE and Delta, ``stages`` slots of block_m; each consumer's fp32 share of dQ
        (64 rows of its stored columns, padded by 8 words); then the mbarriers (K and V's, and two per
        slot)."""
        row_elements = wgmma_row_elements(head_dim)
        elements = (2 * self.block_n + 2 * self.stages * self.block_m) * row_elements + 2 * self.block_n * self.block_m
        dq_by_rows = self.block_m > WGMMA_WARPGROUP_ROWS
        dq_pitch = (row_elements if dq_by_rows else row_elements // self.consumers) + WGMMA_DQ_ROW_PAD
        return (elements * element_bytes + self.stages * 2 * self.block_m * 4
                + self.consumers * WGMMA_WARPGROUP_ROWS * dq_pitch * 4 + MBARRIER_BYTES * (1 + 2 * self.stages))


@dataclass(frozen=True)
class FlashDkdvMfmaTiles(KernelTiles):
    """The MFMA dK/dV kernel (AMD gfx90a, gfx94x, gfx950): one 64-lane wave per 16 of its block_n keys, walking
    16-row query tiles."""

    block_n: int

    block_m = 16  # query rows per tile, fixed: the MFMA's M

    family = FLASH_BACKWARD_DKDV_MFMA

    @property
    def threads(self) -> int:
        return self.block_n // 16 * 64

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """flash::MfmaKeyBlockTiles<...>::kBytes: Qᵀ and dOᵀ of a 16-row query tile (head_dim rows of
        16 + 4 elements each), then each wave's Pᵀ and dSᵀ (16 rows of 16 + 4)."""
        pitch = 16 + MFMA_ROW_PAD
        return (2 * head_dim * pitch + self.block_n // 16 * 2 * 16 * pitch) * element_bytes


@dataclass(frozen=True)
class FlashDqMfmaTiles(KernelTiles):
    """The MFMA dQ kernel (AMD): one wave per 16 of its block_m rows, walking 16-key tiles; no LDS."""

    block_m: int

    block_n = 16  # keys per tile, fixed: the MFMA's N

    family = FLASH_BACKWARD_DQ_MFMA

    @property
    def threads(self) -> int:
        return self.block_m // 16 * 64

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        return 0


FlashDkdvTiles = FlashDkdvMmaTiles | FlashDkdvWgmmaTiles | FlashDkdvWarpSpecialisedTiles | FlashDkdvMfmaTiles
FlashDqTiles = FlashDqMmaTiles | FlashDqMfmaTiles

# The mma.sync kernels' (dK/dV, dQ) rows per head_dim: a backward runs the pair.
#
# Every sm_80+ target; every row fits 99 KiB (sm_86/sm_89's opt-in limit; tests/test_flash_tiles.py).
# dK/dV: K, V, Pᵀ and dSᵀ of a key tile plus two slots of Q and dO stay in shared memory, so the
# query tile is short (32 rows) and the key tile as long as the budget allows: 128 keys up to
# head_dim 96, 64 at 128. A warp's dK and dV accumulators take head_dim / 2 registers per lane when it
# owns all columns of its 16 keys: at head_dim 128 two warps share each 16-key slice, and at 256 they
# must, with the tiles shrunk to 16 x 32 to fit. Every row compiles without spills for sm_90.
# dQ: like the forward (Q and dO of the block, two K and two V slots), the key tile shrinking as
# head_dim grows so that the double-buffered K/V slots fit.
FLASH_BACKWARD_MMA_TILES: dict[int, tuple[FlashDkdvMmaTiles, FlashDqMmaTiles]] = {
    64: (FlashDkdvMmaTiles(block_m=32, block_n=128, warps=8), FlashDqMmaTiles(block_m=128, block_n=64, warps=8)),
    96: (FlashDkdvMmaTiles(block_m=32, block_n=128, warps=8), FlashDqMmaTiles(block_m=64, block_n=64, warps=4)),
    128: (FlashDkdvMmaTiles(block_m=32, block_n=64, warps=8), FlashDqMmaTiles(block_m=64, block_n=32, warps=4)),
    256: (FlashDkdvMmaTiles(block_m=16, block_n=32, warps=4), FlashDqMmaTiles(block_m=64, block_n=16, warps=4)),
}

# Hopper (sm_90, sm_90a) lets a block opt in to 227 KiB, and the larger tiles that buys win on the
# H200 (tools/sweep_flash_backward.py): 128-key tiles with 64-row query tiles at head_dims 64 to 128
# (every key tile adds its dQ share once, and a longer key tile means fewer additions); 64 x 64 at
# head_dim 256 (217 KiB; 9-13% faster than 32 x 64, 64 x 32 slower by half). 128-row dQ tiles make the
# deterministic schedule 2-7% faster still.
FLASH_BACKWARD_MMA_TILES_HOPPER: dict[int, tuple[FlashDkdvMmaTiles, FlashDqMmaTiles]] = {
    64: (FlashDkdvMmaTiles(block_m=64, block_n=128, warps=8), FlashDqMmaTiles(block_m=128, block_n=128, warps=8)),
    96: (FlashDkdvMmaTiles(block_m=64, block_n=128, warps=8), FlashDqMmaTiles(block_m=128, block_n=64, warps=8)),
    128: (FlashDkdvMmaTiles(block_m=64, block_n=128, warps=8), FlashDqMmaTiles(block_m=128, block_n=64, warps=8)),
    256: (FlashDkdvMmaTiles(block_m=64, block_n=64, warps=8), FlashDqMmaTiles(block_m=128, block_n=32, warps=8)),
}

# Head_dims at which Hopper's mma.sync backward (sm_90 without the "a" features; sm_90a runs the wgmma
# dK/dV kernel there, which adds dQ itself) takes dQ from the dQ kernel in every call, deterministic or
# not: at 256 a dK/dV warp's atomic share of dQ (16 keys by 256 columns per query tile) costs more than the
# dQ kernel's second pass over the keys (on the H200, S 4096: 19.2 against 21.4 ms non-causal, 10.1
# against 11.2 causal; tools/sweep_flash_backward.py). The schedule is then bit-identical run to run
# whatever `deterministic` says.
HOPPER_DQ_KERNEL_HEAD_DIMS = frozenset({256})

# Two warpgroups, 128 keys: each holds dK and dV of its 64 keys (head_dim / 2 fp32 registers each per
# thread) beside Sᵀ and dPᵀ of a query tile. At head_dim 64 that leaves room for tiles of 128 queries
# (Sᵀ and dPᵀ 64 registers each), and each warpgroup takes 64 of their rows of dQ, every column: half
# the barriers and dQ additions per key, and on an H100 (B 4, S 4096, H 16, tools/sweep_flash_backward.py)
# 2.81-2.84 ms against 3.30-3.34 with 64-query tiles non-causal, 1.60-1.62 against 1.87 causal. At 96
# and 128 the query tile is 64 rows, and each warpgroup takes half of dQ's stored columns: a whole
# swizzle block of K at 128, and at 96 (rows stored as 128 columns) the first block, and the second of
# which 32 columns are the head's. One warpgroup would add dQ once per 64 keys instead of 128. At 256
# dK and dV of 64 keys alone would take every register: two warpgroups share 64 keys, each with 128
# columns of dK and dV (128 registers) and 32 queries of Sᵀ and dPᵀ (16 each); K, V, two slots of Q
# and dO and Pᵀ and dSᵀ take 209 KiB, and dQ leaves from the registers.
FLASH_BACKWARD_DKDV_WGMMA_TILES: dict[int, FlashDkdvWgmmaTiles] = {
    64: FlashDkdvWgmmaTiles(warpgroups=2, block_m=128),
    96: FlashDkdvWgmmaTiles(warpgroups=2),
    128: FlashDkdvWgmmaTiles(warpgroups=2),
    256: FlashDkdvWgmmaTiles(warpgroups=2, column_groups=2),
}
# The modified instantiations (score modifiers, dropout, sinks) keep more per entry: with 128-query
# tiles at head_dim 64 they hit the 255-register bound and spill, so they walk 64-query tiles there.
FLASH_BACKWARD_DKDV_WGMMA_MODIFIED_TILES: dict[int, FlashDkdvWgmmaTiles] = {
    **FLASH_BACKWARD_DKDV_WGMMA_TILES,
    64: FlashDkdvWgmmaTiles(warpgroups=2),
}


def dkdv_wgmma_tiles(score_mods: bool) -> dict[int, FlashDkdvWgmmaTiles]:
    """The wgmma dK/dV kernel's table for its plain or its modified instantiations."""
    return FLASH_BACKWARD_DKDV_WGMMA_MODIFIED_TILES if score_mods else FLASH_BACKWARD_DKDV_WGMMA_TILES


# The warp-specialised dK/dV kernel at head_dims 96 and 128: 64-query tiles, two slots. On an H100
# (tools/sweep_flash_backward.py, B = 16384 / S, 16 heads, atomic dQ) it took the backward 7-14% below
# the wgmma kernel's time at S 4096 and 4-7% at S 1024. Head_dim 64 stays on the wgmma kernel's
# 128-query tiles: there the consumers, at 240 registers, spill with 128-query tiles (the wgmma
# kernel's warpgroups use 244-254) and ran from 2% faster to 7% slower than it (slower in three of
# four cells), and 64-query tiles 6-12% slower.
# Its layout takes 128-query tiles and head_dim 64 all the same, for sweeps. The modified
# instantiations (score modifiers, dropout, sinks) ship too: they spill at 240 registers (as the wgmma
# kernel's do at 255; tests/test_flash_wgmma_tiles.py bounds both), and took the head_dim-128 softcap,
# ALiBi and dropout cells of the matrix 3-7% below the wgmma kernel's forward+backward time on the H200.
FLASH_BACKWARD_DKDV_WARP_SPECIALISED_TILES: dict[int, FlashDkdvWarpSpecialisedTiles] = {
    96: FlashDkdvWarpSpecialisedTiles(),
    128: FlashDkdvWarpSpecialisedTiles(),
}


# Every head_dim, both dtypes. dK/dV: four waves of 16 keys each; a wave keeps its K and V fragments,
# Kᵀ's for dQ, and dKᵀ and dVᵀ in registers, and LDS holds Qᵀ and dOᵀ of one query tile and each
# wave's Pᵀ and dSᵀ (10 to 25 KiB). dQ: four waves of 16 rows, no LDS. hiprtc 5.2's gfx90a code
# objects use 100-196 of a lane's 512 registers up to head_dim 128 and 372 at 256 (dK/dV; dQ 80-216),
# with no spills. Not tuned or timed: there is no AMD GPU here.
FLASH_BACKWARD_DKDV_MFMA_TILES = FlashDkdvMfmaTiles(block_n=64)
FLASH_BACKWARD_DQ_MFMA_TILES = FlashDqMfmaTiles(block_m=64)


def mma_tiles_for(head_dim: int, target: Target | None) -> tuple[FlashDkdvMmaTiles, FlashDqMmaTiles]:
    """The mma.sync kernels' (dK/dV, dQ) rows of ``head_dim`` for ``target``: Hopper's, or the every-part ones."""
    table = FLASH_BACKWARD_MMA_TILES_HOPPER if has_hopper_shared_memory(target) else FLASH_BACKWARD_MMA_TILES
    return table[head_dim]


def dq_kernel_always(head_dim: int, target: Target | None) -> bool:
    """Whether ``target``'s backward at ``head_dim`` computes dQ with the dQ kernel in every call (the
    deterministic schedule) instead of adding it from the dK/dV kernel when ``deterministic`` is off."""
    return (has_hopper_shared_memory(target) and head_dim in HOPPER_DQ_KERNEL_HEAD_DIMS
            and not (runs_nvidia_wgmma(target) and head_dim in FLASH_BACKWARD_DKDV_WGMMA_TILES))


def tiles_for(head_dim: int, target: Target | None, score_mods: bool = False,
              tensor_maps: bool = True) -> tuple[FlashDkdvTiles, FlashDqTiles]:
    """The (dK/dV, dQ) rows ``target`` runs at ``head_dim``: MFMA's on AMD; on sm_90a the
    warp-specialised dK/dV kernel where its table has the head_dim and Q and dO have tensor maps
    (``tensor_maps``), else the wgmma dK/dV kernel where its table has it (the row of its plain or
    modified instantiation: ``score_mods``, the call's score modifiers, dropout or sinks); else the
    mma.sync rows. (On NVIDIA the deterministic schedule's dQ kernel is mma.sync everywhere.)"""
    if runs_amd_mfma(target):
        return FLASH_BACKWARD_DKDV_MFMA_TILES, FLASH_BACKWARD_DQ_MFMA_TILES
    dkdv, dq = mma_tiles_for(head_dim, target)
    if runs_nvidia_wgmma(target):
        if tensor_maps and head_dim in FLASH_BACKWARD_DKDV_WARP_SPECIALISED_TILES:
            dkdv = FLASH_BACKWARD_DKDV_WARP_SPECIALISED_TILES[head_dim]
        elif head_dim in FLASH_BACKWARD_DKDV_WGMMA_TILES:
            dkdv = dkdv_wgmma_tiles(score_mods)[head_dim]
    return dkdv, dq
