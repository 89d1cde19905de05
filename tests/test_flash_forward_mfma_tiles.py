"""The AMD MFMA flash forward's tile table: which targets ship it, and the LDS bytes the launcher
passes agree with the layout the kernel computes (checked by hiprtc, no GPU needed)."""

from __future__ import annotations

import pytest
from support.compilers import compile_with_layout_checks, hiprtc_for
from support.local_rocm import use_local_rocm

from hipattn.catalog.common import DTYPES, FLASH_HEAD_DIMS
from hipattn.catalog.fields import SCORE_MODS_PARAM, SCORE_MODS_VALUES
from hipattn.catalog.flash_forward import FLASH_FORWARD_MFMA, FLASH_FORWARD_MFMA_TILES
from hipattn.catalog.targets import AMD_LDS_BYTES, runs_amd_mfma
from hipattn.jit.target import Target

use_local_rocm()


@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_every_head_dim_has_a_row_that_fits_the_hardware(head_dim):
    tiles = FLASH_FORWARD_MFMA_TILES[head_dim]
    assert head_dim % 16 == 0, "head_dim is walked in 16-wide MFMA k-steps"
    assert tiles.block_m % 16 == 0 and tiles.block_n % 16 == 0
    assert tiles.threads == tiles.block_m // 16 * 64
    assert tiles.threads <= 1024, "a workgroup holds at most 16 waves"
    assert tiles.shared_bytes(head_dim) <= AMD_LDS_BYTES


def test_shared_bytes_formula():
    # K: 64 rows of 128 + 4 elements; Vᵀ: 128 rows of 64 + 4 elements; 2 bytes each.
    tiles = FLASH_FORWARD_MFMA_TILES[128]
    assert (tiles.block_m, tiles.block_n) == (128, 64)
    assert tiles.shared_bytes(128) == (64 * 132 + 128 * 68) * 2


@pytest.mark.parametrize("arch", ["gfx90a", "gfx90a:xnack-", "gfx940", "gfx941", "gfx942", "gfx942:sramecc+:xnack-"])
def test_ships_every_dtype_and_head_dim_for_mfma_targets(arch):
    target = Target.parse(arch)
    assert runs_amd_mfma(target)
    specs = FLASH_FORWARD_MFMA.shipped(target)
    assert {(spec.arg("dtype"), spec.arg("head_dim"), spec.arg(SCORE_MODS_PARAM)) for spec in specs} == {
        (dtype, head_dim, score_mods)
        for dtype in DTYPES for head_dim in FLASH_HEAD_DIMS for score_mods in SCORE_MODS_VALUES
    }
    assert len(specs) == len(DTYPES) * len(FLASH_HEAD_DIMS) * len(SCORE_MODS_VALUES)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "gfx908", "gfx1030", "gfx1100"])
def test_ships_nothing_without_the_mfma_instructions(arch):
    assert not runs_amd_mfma(Target.parse(arch))
    assert list(FLASH_FORWARD_MFMA.shipped(Target.parse(arch))) == []


def test_kernel_layout_matches_the_launcher_bytes():
    """One hiprtc compile of the kernel's unit with a static_assert per table row."""
    backend, target = hiprtc_for("gfx90a")
    compile_with_layout_checks(
        backend, FLASH_FORWARD_MFMA, target, FLASH_FORWARD_MFMA_TILES,
        lambda head_dim, tiles: f"hipattn::flash::MfmaForwardTiles<hipattn::bf16_t, {head_dim}, {tiles.block_m}, "
                                f"{tiles.block_n}>")
