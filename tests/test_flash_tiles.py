"""The NVIDIA flash kernels' tile tables: every row of the tables that serve every sm_80+ part fits the
shared memory of the smallest (the kernels themselves only assert the largest part's limit, so that a
tile sweep on an H200 can try bigger tiles), Hopper's rows fit Hopper's, and every row obeys the warp
layout the kernels assume."""

from __future__ import annotations

import pytest

from hipattn.catalog.common import FLASH_HEAD_DIMS
from hipattn.catalog.flash_backward import (
    FLASH_BACKWARD_MMA_TILES,
    FLASH_BACKWARD_MMA_TILES_HOPPER,
    HOPPER_DQ_KERNEL_HEAD_DIMS,
    dq_kernel_always,
    mma_tiles_for,
    tiles_for,
)
from hipattn.catalog.flash_forward import FLASH_FORWARD_MMA_TILES
from hipattn.catalog.targets import HOPPER_SHARED_BYTES, SM86_SHARED_BYTES
from hipattn.jit.target import Target


@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_every_part_rows_fit_the_smallest_part(head_dim):
    # sm_86 and sm_89 opt in to the least shared memory of the sm_80+ parts one table serves.
    assert FLASH_FORWARD_MMA_TILES[head_dim].shared_bytes(head_dim) <= SM86_SHARED_BYTES
    for tiles in FLASH_BACKWARD_MMA_TILES[head_dim]:  # dK/dV, dQ
        assert tiles.shared_bytes(head_dim) <= SM86_SHARED_BYTES


@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_hopper_rows_fit_hopper_and_serve_only_it(head_dim):
    dkdv, dq = FLASH_BACKWARD_MMA_TILES_HOPPER[head_dim]
    assert dkdv.shared_bytes(head_dim) <= HOPPER_SHARED_BYTES
    assert dq.shared_bytes(head_dim) <= HOPPER_SHARED_BYTES
    for arch in ("sm_90", "sm_90a"):
        assert mma_tiles_for(head_dim, Target.parse(arch)) == (dkdv, dq)
    assert tiles_for(head_dim, Target.parse("sm_90")) == (dkdv, dq)
    for arch in ("sm_80", "sm_86", "sm_89", "sm_120"):
        assert tiles_for(head_dim, Target.parse(arch)) == FLASH_BACKWARD_MMA_TILES[head_dim]


@pytest.mark.parametrize("hopper", [False, True])
@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_backward_rows_follow_the_kernels_warp_layout(head_dim, hopper):
    dkdv, dq = tiles_for(head_dim, Target.parse("sm_90" if hopper else "sm_80"))
    key_slices = dkdv.block_n // 16
    assert dkdv.warps % key_slices == 0, "every 16-key slice has the same number of warps"
    column_groups = dkdv.warps // key_slices
    assert (head_dim // column_groups) % 16 == 0 and (dkdv.block_m // column_groups) % 8 == 0
    assert dkdv.warps % (dkdv.block_m // 16) == 0, "phase 3 gives every warp one 16-row tile of dQ"
    assert dq.warps * 16 == dq.block_m, "the dQ kernel has one warp per 16 query rows"
    assert dkdv.warps <= 8 and dq.warps <= 8


@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_only_hoppers_mma_sync_rows_named_for_it_take_dq_from_the_dq_kernel_in_every_call(head_dim):
    # Head_dim 256 on sm_90's mma.sync dK/dV kernel: its atomic dQ share costs more there than the dQ
    # kernel's pass. sm_90a runs the wgmma dK/dV kernel at every head_dim, which adds dQ itself.
    assert HOPPER_DQ_KERNEL_HEAD_DIMS == {256}
    sm_90 = Target.parse("sm_90")
    assert dq_kernel_always(head_dim, sm_90) == (head_dim == 256)
    if head_dim == 256:
        assert tiles_for(head_dim, sm_90)[0] == FLASH_BACKWARD_MMA_TILES_HOPPER[256][0]
    assert not dq_kernel_always(head_dim, Target.parse("sm_90a"))
    for arch in ("sm_80", "sm_86", "sm_89", "gfx90a", "gfx942"):
        assert not dq_kernel_always(head_dim, Target.parse(arch))
