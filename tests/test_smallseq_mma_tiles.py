"""The tensor-core small-seq kernels' tables: every block fits the smallest sm_80+ part's shared
memory, the bytes the launcher reserves agree with the layout the kernels compute (checked by NVRTC,
no GPU needed), and the runs of problems the warps walk cover every problem once."""

from __future__ import annotations

import pytest
from compilers import compile_family, nvrtc_backend

from hipattn.families import (
    SMALLSEQ_BACKWARD_MMA,
    SMALLSEQ_BACKWARD_MMA_TILES,
    SMALLSEQ_FORWARD_MMA,
    SMALLSEQ_FORWARD_MMA_TILES,
    SMALLSEQ_HEAD_DIMS,
    SMALLSEQ_TILE,
    SMALLSEQ_WARPS_WANTED,
    SmallSeqMmaTiles,
    smallseq_mma_shared_bytes,
    smallseq_mma_warp_bytes,
    smallseq_problems_per_warp,
)
from hipattn.target import Target

SM86_SHARED_BYTES_PER_BLOCK = 99 * 1024
TABLES = {"forward": SMALLSEQ_FORWARD_MMA_TILES, "backward": SMALLSEQ_BACKWARD_MMA_TILES}


@pytest.mark.parametrize("direction", TABLES)
def test_every_head_dim_has_a_row_whose_block_fits_every_sm_80_part(direction):
    assert sorted(TABLES[direction]) == sorted(SMALLSEQ_HEAD_DIMS)
    for head_dim, tiles in TABLES[direction].items():
        assert tiles.problems_per_warp >= 1 and tiles.threads == 32 * tiles.warps
        assert smallseq_mma_shared_bytes(direction, head_dim, tiles) <= SM86_SHARED_BYTES_PER_BLOCK


def test_warp_bytes_formula():
    pitch = (128 + 8) * 2
    # A zero row, then the tiles: forward Q, K, V; backward Q, dO, K, V and 17 LSE floats (80 bytes) ...
    assert smallseq_mma_warp_bytes("forward", 128) == pitch + 3 * SMALLSEQ_TILE * pitch
    # ... and the backward's P and dZ: 17 query rows of 40 16-bit elements each.
    assert smallseq_mma_warp_bytes("backward", 128) == pitch + 4 * SMALLSEQ_TILE * pitch + 80 + 2 * 17 * 80


@pytest.mark.parametrize("family,direction,layout", [
    (SMALLSEQ_FORWARD_MMA, "forward", "ForwardWarpTiles"),
    (SMALLSEQ_BACKWARD_MMA, "backward", "BackwardWarpTiles"),
])
def test_the_launcher_reserves_the_bytes_the_kernel_lays_out(family, direction, layout):
    backend = nvrtc_backend()
    checks = []
    for head_dim in SMALLSEQ_HEAD_DIMS:
        cpp = f"hipattn::smallseq::{layout}<hipattn::bf16_t, {head_dim}, {SMALLSEQ_TILE}>"
        checks.append(f'static_assert({cpp}::kBytes == {smallseq_mma_warp_bytes(direction, head_dim)}, '
                      f'"{cpp}: bytes differ from families.smallseq_mma_warp_bytes");')
    target = Target.parse("sm_90")
    compile_family(backend, family, target, family.shipped(target)[0], checks)


@pytest.mark.parametrize("problems", [1, 7, SMALLSEQ_WARPS_WANTED - 1, 2 * SMALLSEQ_WARPS_WANTED + 5, 80_000 * 32,
                                      10**9])
@pytest.mark.parametrize("tiles", [SmallSeqMmaTiles(warps=4, problems_per_warp=4),
                                   SmallSeqMmaTiles(warps=1, problems_per_warp=1),
                                   SmallSeqMmaTiles(warps=3, problems_per_warp=16)])
def test_the_runs_of_problems_cover_every_problem_once(problems, tiles):
    per_warp = smallseq_problems_per_warp(problems, tiles)
    assert 1 <= per_warp <= tiles.problems_per_warp
    if problems < SMALLSEQ_WARPS_WANTED:
        assert per_warp == 1, "a small call spreads over as many warps as it has problems"
    if problems >= tiles.problems_per_warp * SMALLSEQ_WARPS_WANTED:
        assert per_warp == tiles.problems_per_warp, "a large call runs the table's row"
    warps = -(-problems // per_warp)
    assert (warps - 1) * per_warp < problems <= warps * per_warp
