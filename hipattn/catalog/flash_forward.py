"""The general attention forward (FlashAttention-2 style): mma.sync on NVIDIA sm_80+, wgmma on sm_90a,
MFMA 16x16x16 on AMD gfx90a/gfx94x/gfx950. One table per kernel, per head_dim; ``tiles_for`` picks the row
a target runs, and the row's type names the kernel."""

from __future__ import annotations

from dataclasses import dataclass

from ..jit.params import TENSOR_MAP, ParamsStruct
from ..jit.spec import KernelFamily
from ..jit.target import Target
from .common import (
    DTYPES,
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
    SINK_FIELDS,
    row_statistic,
    strided,
)
from .index import register
from .targets import runs_amd_mfma, runs_nvidia_mma, runs_nvidia_wgmma
from .tiles import ELEMENT_BYTES, KernelTiles, WarpgroupTiles

# pair_query_tiles: 1 when a block that walks work items (the warp-specialised kernel) takes a
# sequence's query tiles in pairs, heaviest with lightest (kernels/flash/forward_block.h, ItemWalk);
# the other forwards read it as 0 and take one item per block.
FLASH_FORWARD_PARAMS = ParamsStruct(
    "FlashForwardParams",
    strided("q") + strided("k") + strided("v") + strided("o") + row_statistic("lse", "ptr") + SEQUENCE_FIELDS
    + (("heads_q", "i32"), ("pair_query_tiles", "i32")) + SCORE_MOD_FIELDS
    + DROPOUT_FIELDS + SINK_FIELDS,
)


# The warp-specialised kernel's struct: the forward's fields, then the tensor maps its producer copies
# Q, K and V through (ops.tensor_map_fields): [batch, token, head, dim] maps whose boxes are one
# 64-column swizzle block of a tile's rows.
FLASH_FORWARD_TMA_PARAMS = ParamsStruct.extending(
    "FlashForwardTmaParams", FLASH_FORWARD_PARAMS, (("q_map", TENSOR_MAP), ("k_map", TENSOR_MAP), ("v_map", TENSOR_MAP)))


def _family(name: str, template_params: tuple[str, ...], shipped, params: ParamsStruct = FLASH_FORWARD_PARAMS
            ) -> KernelFamily:
    return register(KernelFamily(
        name=name, source=f"flash/{name.replace('flash_', '')}.hip", template=f"hipattn::{name}",
        template_params=("dtype", "head_dim", *template_params, SCORE_MODS_PARAM), params=params,
        structs=() if params is FLASH_FORWARD_PARAMS else (FLASH_FORWARD_PARAMS,), shipped=shipped))


def _specs(table: dict[int, KernelTiles]) -> list:
    return [row.spec(t, d, score_mods=m) for t in DTYPES for d, row in table.items() for m in SCORE_MODS_VALUES]


# Each ships its table's rows (below) for both dtypes on the targets that run its instructions.
FLASH_FORWARD_MMA = _family("flash_forward_mma", ("block_m", "block_n", "stages", "m_tiles"),
                            lambda target: _specs(FLASH_FORWARD_MMA_TILES) if runs_nvidia_mma(target) else [])
FLASH_FORWARD_WGMMA = _family("flash_forward_wgmma", ("block_n", "warpgroups", "stages"),
                              lambda target: _specs(FLASH_FORWARD_WGMMA_TILES) if runs_nvidia_wgmma(target) else [])
FLASH_FORWARD_WARP_SPECIALISED = _family(
    "flash_forward_warp_specialised", ("block_n", "consumers", "stages", "ping_pong"),
    lambda target: [row.spec(t, d, score_mods=m) for t in DTYPES for m in SCORE_MODS_VALUES
                    for d, row in warp_specialised_tiles(m).items()] if runs_nvidia_wgmma(target) else [],
    params=FLASH_FORWARD_TMA_PARAMS)
FLASH_FORWARD_MFMA = _family("flash_forward_mfma", ("block_m", "block_n"),
                             lambda target: _specs(FLASH_FORWARD_MFMA_TILES) if runs_amd_mfma(target) else [])


@dataclass(frozen=True)
class FlashForwardMmaTiles(KernelTiles):
    """The mma.sync forward's BLOCK_M, BLOCK_N, STAGES and M_TILES."""

    block_m: int  # query rows per block
    block_n: int  # keys per tile of the inner loop
    stages: int  # K and V shared-memory slots each (1 = FlashAttention-2's interleaved K/V schedule)
    m_tiles: int = 1  # 16-row tiles per warp: each K/V fragment a warp loads feeds this many MMAs

    family = FLASH_FORWARD_MMA

    @property
    def threads(self) -> int:
        return self.block_m // (16 * self.m_tiles) * 32

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """flash::ForwardTiles<...>::kBytes: a BLOCK_M-row Q tile, then STAGES K slots and STAGES V slots
        of BLOCK_N rows each, every row HEAD_DIM + 8 elements long."""
        rows = self.block_m + 2 * self.stages * self.block_n
        return rows * (head_dim + FLASH_ROW_PAD) * element_bytes


@dataclass(frozen=True)
class FlashForwardWgmmaTiles(WarpgroupTiles):
    """The wgmma forward's BLOCK_N, WARPGROUPS and STAGES (sm_90a)."""

    block_n: int  # keys per tile of the inner loop: one wgmma's N for S (64 or 128)
    warpgroups: int  # 64 query rows each; they share the block's K and V tiles
    stages: int = 2  # K and V shared-memory slots each: copies run stages - 1 tiles ahead (2 or 3)

    family = FLASH_FORWARD_WGMMA

    @property
    def block_m(self) -> int:
        return self.warpgroup_rows

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """flash::WgmmaForwardTiles<...>::kBytes: the Q tile (64 rows per warpgroup), then STAGES K
        slots and STAGES V slots (block_n rows each), unpadded (the 128-byte swizzle, not padding,
        keeps the banks apart) but stored in whole 64-column blocks."""
        rows = self.block_m + 2 * self.stages * self.block_n
        return rows * wgmma_row_elements(head_dim) * element_bytes


@dataclass(frozen=True)
class FlashForwardWarpSpecialisedTiles(KernelTiles):
    """The warp-specialised wgmma forward's BLOCK_N, CONSUMERS, STAGES and PING_PONG (sm_90a): one
    producer warpgroup stages Q, K and V, and ``consumers`` warpgroups of 64 query rows compute on them,
    taking turns at the tensor cores when ``ping_pong``. Its blocks walk work items (``walks_items``),
    so a persistent grid can launch it (ops.flash.forward_grid)."""

    block_n: int  # keys per tile of the inner loop: one wgmma's N for S (64 or 128)
    consumers: int  # computing warpgroups, 64 query rows each
    stages: int = 2  # K and V shared-memory slots each (2 to 4)
    ping_pong: bool = True  # the consumers issue their products in turn (two consumers at least)

    family = FLASH_FORWARD_WARP_SPECIALISED
    walks_items = True

    @property
    def block_m(self) -> int:
        return WGMMA_WARPGROUP_ROWS * self.consumers

    @property
    def threads(self) -> int:
        return WGMMA_WARPGROUP_THREADS * (self.consumers + 1)

    def tensor_map_rows(self) -> dict[str, int]:
        """Q, K and V reach the kernel as tensor maps whose boxes hold a tile's rows."""
        return {"q": self.block_m, "k": self.block_n, "v": self.block_n}

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """flash::WarpSpecialisedForwardTiles<...>::kBytes: two Q slots (a persistent block copies the
        next item's Q while this one's output leaves through the other), the K and V slots as the
        FA2-class wgmma forward's, then the mbarriers (two per Q slot, four per K/V slot)."""
        rows = 2 * self.block_m + 2 * self.stages * self.block_n
        return rows * wgmma_row_elements(head_dim) * element_bytes + MBARRIER_BYTES * (4 + 4 * self.stages)


@dataclass(frozen=True)
class FlashForwardMfmaTiles(KernelTiles):
    """The MFMA forward's BLOCK_M and BLOCK_N (AMD gfx90a, gfx94x, gfx950)."""

    block_m: int  # query rows per block; one 64-lane wave per 16 rows
    block_n: int  # keys per tile of the inner loop

    family = FLASH_FORWARD_MFMA

    @property
    def threads(self) -> int:
        return self.block_m // 16 * 64

    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """flash::MfmaForwardTiles<...>::kBytes: a K tile of BLOCK_N rows of HEAD_DIM + 4 elements, then
        Vᵀ: HEAD_DIM rows of BLOCK_N + 4 elements."""
        elements = self.block_n * (head_dim + MFMA_ROW_PAD) + head_dim * (self.block_n + MFMA_ROW_PAD)
        return elements * element_bytes


FlashForwardTiles = (FlashForwardMmaTiles | FlashForwardWgmmaTiles | FlashForwardWarpSpecialisedTiles
                     | FlashForwardMfmaTiles)

# Every sm_80+ target, both 16-bit dtypes. Every row fits the 99 KiB of sm_86/sm_89
# (tests/test_flash_tiles.py). A warp holds 16 m_tiles x head_dim of O and 16 m_tiles x block_n of S
# in fp32, so head_dim 256 takes half the rows and half the keys per tile. Two 16-row tiles per warp
# (four warps of 32 rows) beat one on the H200 by 20-35% at head_dim 128: each K and V fragment then
# feeds two MMAs; head_dim 256 cannot hold two tiles' O (spills).
FLASH_FORWARD_MMA_TILES: dict[int, FlashForwardMmaTiles] = {
    64: FlashForwardMmaTiles(block_m=128, block_n=64, stages=2, m_tiles=2),
    96: FlashForwardMmaTiles(block_m=128, block_n=64, stages=1, m_tiles=2),
    128: FlashForwardMmaTiles(block_m=128, block_n=64, stages=1, m_tiles=2),
    256: FlashForwardMmaTiles(block_m=64, block_n=32, stages=2, m_tiles=1),
}

# sm_90a. The tensor cores read Q, K and V from shared memory, so a thread holds only S (block_n / 2
# fp32), P twice (this tile's, in flight, and the next one's) and O (head_dim / 2). Three warpgroups
# (192 query rows) read each K/V tile from L2 for 1.5 times the rows of two, which wins on the H200;
# 384 threads leave 170 registers each, which 64-key tiles fit without spills at head_dims 64 to 128.
# head_dim 96 stores its rows as 128 columns (whole swizzle blocks) and computes on 96. head_dim 256
# needs 229 registers, so two warpgroups.
FLASH_FORWARD_WGMMA_TILES: dict[int, FlashForwardWgmmaTiles] = {
    64: FlashForwardWgmmaTiles(block_n=64, warpgroups=3),
    96: FlashForwardWgmmaTiles(block_n=64, warpgroups=3),
    128: FlashForwardWgmmaTiles(block_n=64, warpgroups=3),
    256: FlashForwardWgmmaTiles(block_n=64, warpgroups=2),
}

# sm_90a, the warp-specialised kernel (its producer copies through tensor maps and keeps 24 registers;
# two consumers share the rest, 240 each), by head_dim: 128-key tiles, and three K/V slots at head_dim
# 64, whose rows are small. Head_dim 256 stays with the FA2-class kernel: O alone takes 128 of a
# consumer's registers, and 64-key tiles beside it spilled. tools.sweep_flash_forward measured these
# rows against 64-key tiles, three slots and no ping-pong (BENCHMARKS.md).
FLASH_FORWARD_WARP_SPECIALISED_TILES: dict[int, FlashForwardWarpSpecialisedTiles] = {
    64: FlashForwardWarpSpecialisedTiles(block_n=128, consumers=2, stages=3),
    96: FlashForwardWarpSpecialisedTiles(block_n=128, consumers=2),
    128: FlashForwardWarpSpecialisedTiles(block_n=128, consumers=2),
}
# The modified instantiations (score modifiers, dropout, sinks) unroll their main loop by two
# (forward_wgmma.hip says why), which at head_dim 128 holds more than 240 registers with 128-key tiles:
# they take 64-key ones there.
FLASH_FORWARD_WARP_SPECIALISED_MODIFIED_TILES: dict[int, FlashForwardWarpSpecialisedTiles] = {
    **FLASH_FORWARD_WARP_SPECIALISED_TILES,
    128: FlashForwardWarpSpecialisedTiles(block_n=64, consumers=2),
}


def warp_specialised_tiles(score_mods: bool) -> dict[int, FlashForwardWarpSpecialisedTiles]:
    """The warp-specialised kernel's table for its plain or its modified instantiations."""
    return FLASH_FORWARD_WARP_SPECIALISED_MODIFIED_TILES if score_mods else FLASH_FORWARD_WARP_SPECIALISED_TILES

# AMD gfx90a/gfx94x/gfx950. LDS holds one K tile and one transposed V tile (Q and O live in registers), so
# every row fits 64 KiB (17, 25.3, 33.5 and 18.1 KiB). Eight waves per block leave each wave 256
# registers per lane; with block_n 32 the hiprtc 5.2 build of head_dim 256 spilled, with block_n 16
# it needs 204 registers and spills none.
FLASH_FORWARD_MFMA_TILES: dict[int, FlashForwardMfmaTiles] = {
    64: FlashForwardMfmaTiles(block_m=128, block_n=64),
    96: FlashForwardMfmaTiles(block_m=128, block_n=64),
    128: FlashForwardMfmaTiles(block_m=128, block_n=64),
    256: FlashForwardMfmaTiles(block_m=128, block_n=16),
}


def tiles_for(head_dim: int, target: Target | None, tensor_maps: bool = True,
              score_mods: bool = False) -> FlashForwardTiles:
    """The row ``target`` runs at ``head_dim``: MFMA on AMD gfx90a/gfx94x/gfx950, on sm_90a the
    warp-specialised wgmma kernel where its table has the head_dim and the call's arrays have tensor
    maps (``tensor_maps``; the row of its plain or modified instantiation, by ``score_mods``), else
    the FA2-class wgmma kernel, and mma.sync on every other target."""
    if runs_amd_mfma(target):
        return FLASH_FORWARD_MFMA_TILES[head_dim]
    if tensor_maps and runs_nvidia_wgmma(target) and head_dim in FLASH_FORWARD_WARP_SPECIALISED_TILES:
        return warp_specialised_tiles(score_mods)[head_dim]
    if runs_nvidia_wgmma(target) and head_dim in FLASH_FORWARD_WGMMA_TILES:
        return FLASH_FORWARD_WGMMA_TILES[head_dim]
    return FLASH_FORWARD_MMA_TILES[head_dim]
