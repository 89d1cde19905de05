"""The Hopper (wgmma) flash forward's tile table: only sm_90a ships it, its rows fit Hopper's shared
memory, the bytes the launcher passes agree with the layout the kernel computes, and the header that
holds the wgmma instructions refuses every other target (all checked by NVRTC, no GPU needed)."""

from __future__ import annotations

import pytest
from support.compilers import compile_family, compile_with_layout_checks, nvrtc_backend

from hipattn.catalog.common import DTYPES, FLASH_HEAD_DIMS
from hipattn.catalog.flash_forward import (
    FLASH_FORWARD_MFMA_TILES,
    FLASH_FORWARD_MMA_TILES,
    FLASH_FORWARD_WGMMA,
    FLASH_FORWARD_WGMMA_TILES,
    FlashForwardWgmmaTiles,
    tiles_for,
)
from hipattn.catalog.targets import HOPPER_SHARED_BYTES, runs_nvidia_wgmma
from hipattn.errors import CompileError
from hipattn.jit.target import Target


@pytest.mark.parametrize("head_dim", sorted(FLASH_FORWARD_WGMMA_TILES))
def test_every_row_fits_hopper_and_names_wgmma_shapes(head_dim):
    tiles = FLASH_FORWARD_WGMMA_TILES[head_dim]
    assert tiles.block_n in (64, 128), "S is one m64nN wgmma: the header defines N = 64 and 128 for it"
    assert head_dim in (64, 128, 256), "O is one m64nN wgmma with N = head_dim, in whole 64-column blocks"
    assert tiles.threads == 128 * tiles.warpgroups and tiles.block_m == 64 * tiles.warpgroups
    assert tiles.stages in (2, 3), "K of the next tile is read while this one's P V runs: two slots at least"
    assert tiles.shared_bytes(head_dim) <= HOPPER_SHARED_BYTES


def test_shared_bytes_formula():
    # head_dim 128, 128-key tiles, two warpgroups, two stages: Q (128 rows), two K and two V slots (128 rows
    # each), 2 bytes.
    assert FlashForwardWgmmaTiles(128, 2, 2).shared_bytes(128) == (128 + 4 * 128) * 128 * 2


def test_only_sm_90a_ships_it_for_every_head_dim_but_96():
    specs = FLASH_FORWARD_WGMMA.shipped(Target.parse("sm_90a"))
    assert {(spec.arg("dtype"), spec.arg("head_dim")) for spec in specs} == {
        (dtype, head_dim) for dtype in DTYPES for head_dim in FLASH_HEAD_DIMS if head_dim != 96
    }
    for arch in ("sm_80", "sm_89", "sm_90", "sm_100a", "gfx90a"):
        assert not runs_nvidia_wgmma(Target.parse(arch))
        assert list(FLASH_FORWARD_WGMMA.shipped(Target.parse(arch))) == []


@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_each_target_gets_its_kernels_row(head_dim):
    wgmma_row = FLASH_FORWARD_WGMMA_TILES.get(head_dim, FLASH_FORWARD_MMA_TILES[head_dim])
    assert tiles_for(head_dim, Target.parse("sm_90a")) == wgmma_row
    for arch in ("sm_80", "sm_89", "sm_90", "sm_120"):
        assert tiles_for(head_dim, Target.parse(arch)) == FLASH_FORWARD_MMA_TILES[head_dim]
    for arch in ("gfx90a", "gfx942:xnack-"):
        assert tiles_for(head_dim, Target.parse(arch)) == FLASH_FORWARD_MFMA_TILES[head_dim]


@pytest.mark.nvrtc
def test_kernel_layout_matches_the_launcher_bytes():
    """One NVRTC compile of the kernel's unit with a static_assert per table row."""
    backend = nvrtc_backend()
    target = Target.parse("sm_90a")
    compile_with_layout_checks(
        backend, FLASH_FORWARD_WGMMA, target, FLASH_FORWARD_WGMMA_TILES,
        lambda head_dim, tiles: f"hipattn::flash::WgmmaForwardTiles<hipattn::bf16_t, {head_dim}, {tiles.block_n}, "
                                f"{tiles.warpgroups}, {tiles.stages}>")


@pytest.mark.nvrtc
def test_plain_sm_90_is_refused_with_the_reason():
    backend = nvrtc_backend()
    spec = FLASH_FORWARD_WGMMA.shipped(Target.parse("sm_90a"))[0]
    with pytest.raises(CompileError, match="needs the sm_90a target"):
        compile_family(backend, FLASH_FORWARD_WGMMA, Target.parse("sm_90"), spec)
