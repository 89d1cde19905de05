"""The Hopper (wgmma) dK/dV kernel's tile table: only sm_90a ships it and runs it, its rows fit Hopper's
shared memory, and the bytes the launcher passes agree with the layout the kernel computes (checked
by NVRTC, no GPU needed)."""

from __future__ import annotations

import pytest
from support.compilers import compile_with_layout_checks, nvrtc_backend

from hipattn.catalog.common import DTYPES, FLASH_HEAD_DIMS
from hipattn.catalog.flash_backward import (
    FLASH_BACKWARD_DKDV_WGMMA,
    FLASH_BACKWARD_DKDV_WGMMA_TILES,
    FLASH_BACKWARD_MMA_TILES_HOPPER,
    FlashDkdvWgmmaTiles,
    tiles_for,
)
from hipattn.catalog.targets import HOPPER_SHARED_BYTES
from hipattn.jit.target import Target


@pytest.mark.parametrize("head_dim", sorted(FLASH_BACKWARD_DKDV_WGMMA_TILES))
def test_every_row_fits_hopper_and_splits_dq_into_whole_swizzle_blocks(head_dim):
    tiles = FLASH_BACKWARD_DKDV_WGMMA_TILES[head_dim]
    assert head_dim in (64, 128), "dK and dV are one m64nN wgmma each, N = head_dim"
    assert (head_dim // tiles.warpgroups) % 64 == 0, "each warpgroup's dQ columns are whole 64-column blocks"
    assert tiles.block_n == 64 * tiles.warpgroups and tiles.threads == 128 * tiles.warpgroups
    assert tiles.shared_bytes(head_dim) <= HOPPER_SHARED_BYTES


def test_shared_bytes_formula():
    # head_dim 128, two warpgroups: K and V (128 rows each), two Q and two dO slots (64 rows each),
    # dSᵀ (128 x 64), 2 bytes; then LSE and Delta, two slots of 64 fp32 each; then each warpgroup's
    # 64 staged dQ rows of 64 + 8 fp32.
    assert FlashDkdvWgmmaTiles(2).shared_bytes(128) == (
        (2 * 128 + 4 * 64) * 128 * 2 + 128 * 64 * 2 + 2 * 2 * 64 * 4 + 2 * 64 * 72 * 4)


def test_only_sm_90a_ships_it():
    specs = FLASH_BACKWARD_DKDV_WGMMA.shipped(Target.parse("sm_90a"))
    assert {(spec.arg("dtype"), spec.arg("head_dim"), spec.arg("write_dq")) for spec in specs} == {
        (dtype, head_dim, write_dq) for dtype in DTYPES for head_dim in FLASH_BACKWARD_DKDV_WGMMA_TILES
        for write_dq in (False, True)}
    for arch in ("sm_80", "sm_89", "sm_90", "sm_100a", "gfx90a"):
        assert list(FLASH_BACKWARD_DKDV_WGMMA.shipped(Target.parse(arch))) == []


@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_sm_90a_runs_it_where_the_table_has_the_head_dim(head_dim):
    dkdv, dq = tiles_for(head_dim, Target.parse("sm_90a"))
    mma_dkdv, mma_dq = FLASH_BACKWARD_MMA_TILES_HOPPER[head_dim]
    assert dkdv == FLASH_BACKWARD_DKDV_WGMMA_TILES.get(head_dim, mma_dkdv)
    assert dq == mma_dq, "the deterministic dQ kernel stays mma.sync"
    spec = dkdv.spec("bf16", head_dim, write_dq=True)
    expected = "flash_backward_dkdv_wgmma" if head_dim in FLASH_BACKWARD_DKDV_WGMMA_TILES else "flash_backward_dkdv_mma"
    assert spec.family.name == expected


@pytest.mark.nvrtc
def test_kernel_layout_matches_the_launcher_bytes():
    """One NVRTC compile of the kernel's unit with a static_assert per table row."""
    backend = nvrtc_backend()
    target = Target.parse("sm_90a")
    compile_with_layout_checks(
        backend, FLASH_BACKWARD_DKDV_WGMMA, target, FLASH_BACKWARD_DKDV_WGMMA_TILES,
        lambda head_dim, tiles: f"hipattn::flash::WgmmaKeyBlockTiles<hipattn::bf16_t, {head_dim}, {tiles.warpgroups}>")
