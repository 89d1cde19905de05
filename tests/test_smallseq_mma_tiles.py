"""The tensor-core small-seq kernels' tables: every block fits the smallest sm_80+ part's shared
memory, the bytes the launcher reserves agree with the layout the kernels compute (checked by NVRTC,
no GPU needed), and the runs of problems the teams of warps walk cover every problem once."""

from __future__ import annotations

import pytest
from support.compilers import compile_family, nvrtc_backend

from hipattn.catalog import smallseq as catalog
from hipattn.catalog.smallseq import SMALLSEQ_HEAD_DIMS, SMALLSEQ_TEAMS_WANTED, SMALLSEQ_TILE
from hipattn.catalog.targets import SM86_SHARED_BYTES
from hipattn.jit.target import Target

TABLES = {"forward": catalog.SMALLSEQ_FORWARD_MMA_TILES, "backward": catalog.SMALLSEQ_BACKWARD_MMA_TILES}
ROWS = {"forward": catalog.SmallSeqForwardMmaTiles, "backward": catalog.SmallSeqBackwardMmaTiles}


@pytest.mark.parametrize("direction", TABLES)
def test_every_head_dim_has_a_row_whose_block_fits_every_sm_80_part(direction):
    assert sorted(TABLES[direction]) == sorted(SMALLSEQ_HEAD_DIMS)
    for head_dim, tiles in TABLES[direction].items():
        assert tiles.problems_per_team >= 1 and tiles.threads == 32 * tiles.warps
        assert tiles.warps % tiles.split == 0 and tiles.teams <= 15, "whole teams, each with its named barrier"
        assert tiles.split in (1, 2)
        assert tiles.shared_bytes(head_dim) <= SM86_SHARED_BYTES


def test_team_bytes_formula():
    forward, backward = ROWS["forward"], ROWS["backward"]
    pitch = (128 + 8) * 2
    one, pair = {"warps": 1, "problems_per_team": 1}, {"warps": 2, "problems_per_team": 1, "split": 2}
    # A zero row and the tiles: forward Q, K, V ...
    assert forward(**one).team_bytes(128) == pitch + 3 * SMALLSEQ_TILE * pitch
    # ... backward Q, dO, K, V; then 17 LSE floats (80 bytes) and P and dZ (17 rows of 40 16-bit elements).
    assert backward(**one).team_bytes(128) == pitch + 4 * SMALLSEQ_TILE * pitch + 80 + 2 * 17 * 80
    # Two warps of 128 of head_dim 256's columns each; the partial sums one hands the other travel in
    # one of its tiles, so they add nothing.
    assert forward(**pair).team_bytes(256) == 2 * (pitch + 3 * SMALLSEQ_TILE * pitch)
    assert backward(**pair).team_bytes(256) == 2 * (pitch + 4 * SMALLSEQ_TILE * pitch) + 80 + 2 * 17 * 80
    assert backward(warps=4, problems_per_team=1, split=2).shared_bytes(256) == 2 * backward(**pair).team_bytes(256)


@pytest.mark.parametrize("family,direction,layout", [
    (catalog.SMALLSEQ_FORWARD_MMA, "forward", "ForwardTeamTiles<hipattn::bf16_t, {d}, {tile}, {split}>"),
    (catalog.SMALLSEQ_BACKWARD_MMA, "backward", "BackwardTeamTiles<hipattn::bf16_t, {d}, {tile}, {split}>"),
])
def test_the_launcher_reserves_the_bytes_the_kernel_lays_out(family, direction, layout):
    backend = nvrtc_backend()
    checks = []
    # Teams of two at head_dim 256, where the tables use them (at 64 and 128 a warp's half-width tile
    # cannot carry the partial sums: the kernels' static_asserts reject that split).
    for head_dim, split in [(head_dim, 1) for head_dim in SMALLSEQ_HEAD_DIMS] + [(256, 2)]:
        cpp = "hipattn::smallseq::" + layout.format(d=head_dim, tile=SMALLSEQ_TILE, split=split)
        row = ROWS[direction](warps=split, problems_per_team=1, split=split)
        checks.append(f'static_assert({cpp}::kBytes == {row.team_bytes(head_dim)}, '
                      f'"{cpp}: bytes differ from its tile row\'s team_bytes");')
    target = Target.parse("sm_90")
    compile_family(backend, family, target, family.shipped(target)[0], checks)


@pytest.mark.parametrize("problems", [1, 7, SMALLSEQ_TEAMS_WANTED - 1, 2 * SMALLSEQ_TEAMS_WANTED + 5, 80_000 * 32,
                                      10**9])
@pytest.mark.parametrize("tiles", [catalog.SmallSeqForwardMmaTiles(warps=4, problems_per_team=4),
                                   catalog.SmallSeqBackwardMmaTiles(warps=1, problems_per_team=1),
                                   catalog.SmallSeqForwardMmaTiles(warps=4, problems_per_team=16, split=2)])
def test_the_runs_of_problems_cover_every_problem_once(problems, tiles):
    per_team = tiles.run_length(problems)
    assert 1 <= per_team <= tiles.problems_per_team
    if problems < SMALLSEQ_TEAMS_WANTED:
        assert per_team == 1, "a small call spreads over as many teams as it has problems"
    if problems >= tiles.problems_per_team * SMALLSEQ_TEAMS_WANTED:
        assert per_team == tiles.problems_per_team, "a large call runs the table's row"
    teams = -(-problems // per_team)
    assert (teams - 1) * per_team < problems <= teams * per_team
