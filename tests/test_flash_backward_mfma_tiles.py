"""The AMD MFMA flash backward's rows: which targets ship its kernels, which rows a target runs, and
the LDS bytes the launcher passes agree with the layout the dK/dV kernel computes (checked by hiprtc,
no GPU needed). Its results are checked in tests/test_amd_emulation.py."""

from __future__ import annotations

import pytest
from support.compilers import compile_with_layout_checks, hiprtc_for
from support.local_rocm import use_local_rocm

from hipattn.catalog.common import DTYPES, FLASH_HEAD_DIMS
from hipattn.catalog.flash_backward import (
    FLASH_BACKWARD_DKDV_MFMA,
    FLASH_BACKWARD_DKDV_MFMA_TILES,
    FLASH_BACKWARD_DQ_MFMA,
    FLASH_BACKWARD_DQ_MFMA_TILES,
    tiles_for,
)
from hipattn.catalog.targets import AMD_LDS_BYTES
from hipattn.jit.target import Target

use_local_rocm()


@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_every_head_dim_runs_the_mfma_rows_on_amd_and_fits_the_hardware(head_dim):
    dkdv, dq = tiles_for(head_dim, Target.parse("gfx942"))
    assert (dkdv, dq) == (FLASH_BACKWARD_DKDV_MFMA_TILES, FLASH_BACKWARD_DQ_MFMA_TILES)
    assert dkdv.block_m == 16 and dkdv.threads == dkdv.block_n // 16 * 64, "a wave per 16 keys, 16-row query tiles"
    assert dq.block_n == 16 and dq.threads == dq.block_m // 16 * 64, "a wave per 16 rows, 16-key steps"
    assert max(dkdv.threads, dq.threads) <= 1024
    assert dkdv.shared_bytes(head_dim) <= AMD_LDS_BYTES
    assert dq.shared_bytes(head_dim) == 0


def test_shared_bytes_formula():
    # Qᵀ and dOᵀ: 128 rows of 16 + 4 elements each; four waves' Pᵀ and dSᵀ: 16 rows of 16 + 4 each.
    assert FLASH_BACKWARD_DKDV_MFMA_TILES.shared_bytes(128) == (2 * 128 * 20 + 4 * 2 * 16 * 20) * 2


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_ships_both_kernels_for_every_dtype_and_head_dim(arch):
    target = Target.parse(arch)
    dkdv = {(s.arg("dtype"), s.arg("head_dim"), s.arg("write_dq")) for s in FLASH_BACKWARD_DKDV_MFMA.shipped(target)}
    assert dkdv == {(t, d, w) for t in DTYPES for d in FLASH_HEAD_DIMS for w in (False, True)}
    dq = {(s.arg("dtype"), s.arg("head_dim")) for s in FLASH_BACKWARD_DQ_MFMA.shipped(target)}
    assert dq == {(t, d) for t in DTYPES for d in FLASH_HEAD_DIMS}


@pytest.mark.parametrize("arch", ["sm_90", "gfx908", "gfx1100"])
def test_ships_nothing_without_the_mfma_instructions(arch):
    assert FLASH_BACKWARD_DKDV_MFMA.shipped(Target.parse(arch)) == []
    assert FLASH_BACKWARD_DQ_MFMA.shipped(Target.parse(arch)) == []


def test_kernel_layout_matches_the_launcher_bytes():
    """One hiprtc compile of the dK/dV kernel's unit with a static_assert per head_dim."""
    backend, target = hiprtc_for("gfx90a")
    table = dict.fromkeys(FLASH_HEAD_DIMS, FLASH_BACKWARD_DKDV_MFMA_TILES)
    compile_with_layout_checks(
        backend, FLASH_BACKWARD_DKDV_MFMA, target, table,
        lambda head_dim, tiles: f"hipattn::flash::MfmaKeyBlockTiles<hipattn::bf16_t, {head_dim}, {tiles.block_n}>")
