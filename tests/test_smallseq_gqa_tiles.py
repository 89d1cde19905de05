"""The grouped-heads (GQA/MQA) tensor-core small-seq kernels' tables and builds, with no GPU: every block
fits the smallest sm_80+ part's shared memory, the bytes the launcher reserves are the ones the
kernels lay out (NVRTC static_asserts), every shipped instantiation compiles for sm_80 and sm_90a with
no spills and with registers that never hold an SM below the warps its shared memory allows, and the
launch path sends Hq != Hkv there and refuses a grid past the limit before enqueuing anything."""

from __future__ import annotations

import pytest
from support.compilers import compile_family, nvrtc_backend, ptxas_resources
from support.fake_backend import FakeBackend

from hipattn import problem as problem_module
from hipattn import runtime
from hipattn.arrays import raw_array
from hipattn.catalog import shipped_specs
from hipattn.catalog import smallseq as smallseq_catalog
from hipattn.catalog.common import DTYPES
from hipattn.catalog.fields import SCORE_MODS_PARAM, SCORE_MODS_VALUES
from hipattn.catalog.smallseq import (
    SMALLSEQ_BACKWARD_GQA_MMA,
    SMALLSEQ_FORWARD_GQA_MMA,
    SMALLSEQ_GQA_BACKWARD_COLUMNS,
    SMALLSEQ_GQA_BACKWARD_MMA_TILES,
    SMALLSEQ_GQA_FORWARD_MMA_TILES,
    SMALLSEQ_HEAD_DIMS,
    SMALLSEQ_TILE,
    SmallSeqBackwardGqaMmaTiles,
    SmallSeqForwardGqaMmaTiles,
)
from hipattn.catalog.targets import SM86_SHARED_BYTES
from hipattn.jit.target import Target
from hipattn.ops import smallseq

TABLES = {"forward": SMALLSEQ_GQA_FORWARD_MMA_TILES, "backward": SMALLSEQ_GQA_BACKWARD_MMA_TILES}
ROWS = {"forward": SmallSeqForwardGqaMmaTiles, "backward": SmallSeqBackwardGqaMmaTiles}
FAMILIES = {"forward": SMALLSEQ_FORWARD_GQA_MMA, "backward": SMALLSEQ_BACKWARD_GQA_MMA}
LAYOUTS = {"forward": "GqaForwardTeamTiles", "backward": "GqaBackwardTeamTiles"}


@pytest.mark.parametrize("direction", TABLES)
def test_every_head_dim_has_a_row_whose_block_fits_every_sm_80_part(direction):
    assert sorted(TABLES[direction]) == sorted(SMALLSEQ_HEAD_DIMS)
    for head_dim, tiles in TABLES[direction].items():
        assert tiles.problems_per_team >= 1 and tiles.warps % tiles.split == 0
        assert tiles.teams <= 15, "a block's teams of several warps each take a named barrier of 1..15"
        if direction == "forward":
            assert tiles.split in (1, 2)
        else:
            assert tiles.split * SMALLSEQ_GQA_BACKWARD_COLUMNS == head_dim, "each backward warp owns 64 columns"
        assert tiles.shared_bytes(head_dim) <= SM86_SHARED_BYTES


def _team_bytes(direction: str, head_dim: int, split: int) -> int:
    return ROWS[direction](warps=split, problems_per_team=1, split=split).team_bytes(head_dim)


def test_team_bytes_formula():
    pitch = (128 + 8) * 2
    # Forward: a zero row, K and V of 17 rows, two chunk tiles of 16 stacked query rows ...
    assert _team_bytes("forward", 128, 1) == pitch + 2 * SMALLSEQ_TILE * pitch + 2 * 16 * pitch
    # ... and with two warps of 128 columns each, two slots of 3 x 32 x 16 bytes for the partial S.
    assert _team_bytes("forward", 256, 2) == 2 * (pitch + 2 * SMALLSEQ_TILE * pitch + 2 * 16 * pitch + 2 * 1536)
    # Backward warps own 64 columns: a zero row, K and V, two Q and two dO chunk tiles; the team then holds
    # two chunks' LSE (2 x 64 bytes), P and dZ (16 rows of 40 16-bit keys each) and a 3072-byte slot per
    # warp after the first.
    warp = 144 + 2 * SMALLSEQ_TILE * 144 + 4 * 16 * 144
    assert _team_bytes("backward", 64, 1) == warp + 128 + 2 * 16 * 80
    assert _team_bytes("backward", 256, 4) == 4 * warp + 128 + 2 * 16 * 80 + 3 * 3072


@pytest.mark.parametrize("direction", TABLES)
def test_the_launcher_reserves_the_bytes_the_kernel_lays_out(direction):
    backend = nvrtc_backend()
    checks = []
    for dtype in ("hipattn::bf16_t", "hipattn::half_t"):
        for head_dim, tiles in sorted(TABLES[direction].items()):
            cpp = f"hipattn::smallseq::{LAYOUTS[direction]}<{dtype}, {head_dim}, {SMALLSEQ_TILE}, {tiles.split}>"
            checks.append(f'static_assert({cpp}::kBytes == {tiles.team_bytes(head_dim)},'
                          f' "{cpp}: bytes differ from its tile row\'s team_bytes");')
    target = Target.parse("sm_90")
    compile_family(backend, FAMILIES[direction], target, FAMILIES[direction].shipped(target)[0], checks)


# What an SM of each target holds (CUDA's occupancy rules): shared memory per SM, of which each block
# also takes 1 KiB; 64K registers, allocated per warp in units of 256; at most 64 warps and 32 blocks.
SM_SHARED_BYTES = {"sm_80": 164 * 1024, "sm_90a": 228 * 1024}
# The most a modified instantiation may spill: one 8-byte slot.
MODIFIED_SPILL_BYTES = 8


def _blocks_per_sm(arch: str, shared_bytes: int, warps: int, registers: int) -> tuple[int, int]:
    """Blocks an SM holds by its shared memory, and by its registers."""
    by_shared = min(32, 64 // warps, SM_SHARED_BYTES[arch] // (shared_bytes + 1024))
    warp_registers = -(-registers * 32 // 256) * 256
    return by_shared, 65536 // (warps * warp_registers)


@pytest.mark.parametrize("arch", sorted(SM_SHARED_BYTES))
@pytest.mark.parametrize("direction", TABLES)
def test_every_shipped_instantiation_compiles_without_spills(arch, direction):
    """ptxas's report through NVRTC (--ptxas-options=-v): no stack frame and no spills in the plain
    instantiations, and registers that let an SM hold as many blocks as its shared memory does (the
    backward's launch bounds ask for 168). The modified (softcap and ALiBi) instantiations may spill one
    8-byte slot at that bound: NVRTC 13.0 spills one in the backward at head_dim 64 on sm_80 and 128 on
    sm_90a, a cost of the modifiers' registers that README's open items name."""
    backend = nvrtc_backend()
    family = FAMILIES[direction]
    target = Target.parse(arch)
    specs = family.shipped(target)
    assert len(specs) == len(DTYPES) * len(SMALLSEQ_HEAD_DIMS) * len(SCORE_MODS_VALUES)
    for spec in specs:
        compiled = compile_family(backend, family, target, spec, options=("--ptxas-options=-v",))
        registers, stack, stores, loads = ptxas_resources(compiled.log)
        if spec.arg(SCORE_MODS_PARAM):
            assert stack <= MODIFIED_SPILL_BYTES and stores <= MODIFIED_SPILL_BYTES, f"{spec} on {arch}: {compiled.log}"
        else:
            assert (stack, stores, loads) == (0, 0, 0), f"{spec} on {arch}: {compiled.log}"
        head_dim = spec.arg("head_dim")
        tiles = TABLES[direction][head_dim]
        by_shared, by_registers = _blocks_per_sm(arch, tiles.shared_bytes(head_dim), tiles.warps, registers)
        assert by_registers >= by_shared, f"{spec} on {arch}: {registers} registers hold an SM to {by_registers} blocks"


def test_the_grouped_kernels_ship_for_sm_80_and_newer_only():
    for arch in ("sm_80", "sm_86", "sm_90", "sm_90a"):
        families = {spec.family.name for spec in shipped_specs(Target.parse(arch))}
        assert {"smallseq_forward_gqa_mma", "smallseq_backward_gqa_mma"} <= families, arch
    for arch in ("sm_75", "gfx90a"):
        families = {spec.family.name for spec in shipped_specs(Target.parse(arch))}
        assert not {"smallseq_forward_gqa_mma", "smallseq_backward_gqa_mma"} & families, arch


@pytest.fixture
def nvidia_device(monkeypatch):
    """Device 0 is an sm_90 (a fake backend that runs nothing); every kernel request fails the test."""

    class NoKernels(runtime.Runtime):
        __slots__ = ()

        def kernel(self, spec, device):
            raise AssertionError(f"{spec} was requested: the call should have been refused first")

    monkeypatch.setattr(runtime, "_active", NoKernels(FakeBackend(device_arch="sm_90")))
    monkeypatch.delenv(smallseq.KERNEL_SWITCH, raising=False)


def _bshd(batch, heads_q, heads_kv, head_dim):
    """Raw BSHD arrays of one token a sequence at fake addresses, and their Problem."""
    q = raw_array(0x1000_0000, (batch, 1, heads_q, head_dim), "bf16", 0)
    kv = raw_array(0x2000_0000, (batch, 1, heads_kv, head_dim), "bf16", 0)
    out = raw_array(0x3000_0000, (batch, 1, heads_q, head_dim), "bf16", 0)
    lse = raw_array(0x4000_0000, (batch, heads_q, 1), "fp32", 0)
    problem = problem_module.describe(q, kv, kv)
    return problem, q, kv, out, lse


@pytest.mark.parametrize("which", [smallseq_catalog.forward_tiles, smallseq_catalog.backward_tiles])
def test_gqa_calls_take_the_grouped_kernels_and_mha_calls_keep_theirs(which):
    sm90 = Target.parse("sm_90")
    grouped = {SMALLSEQ_FORWARD_GQA_MMA, SMALLSEQ_BACKWARD_GQA_MMA}
    assert which(128, sm90, group=3).family in grouped  # Hq 12 / Hkv 4
    assert which(64, sm90, group=8).family in grouped  # MQA of 8 heads
    assert which(128, sm90, group=16).family in grouped
    assert which(256, sm90, group=1).family.name.endswith("_mma") and which(256, sm90, group=1).family not in grouped
    assert which(128, sm90, group=3, portable=True).family.name in ("smallseq_forward", "smallseq_backward")
    past = smallseq_catalog.SMALLSEQ_GQA_MAX_GROUP + 1  # past the kernels' exact row -> query division
    assert which(128, sm90, group=past).family.name in ("smallseq_forward", "smallseq_backward")


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_grid_past_the_limit_is_refused_before_any_kernel_is_requested(nvidia_device, direction):
    # 2^31 - 1 sequences x 64 KV heads: 2^37 groups, in runs of 2 per team of 4 (or 1) a block.
    problem, q, kv, out, lse = _bshd(2**31 - 1, 128, 64, 128)
    with pytest.raises(ValueError, match="one launch takes at most"):
        if direction == "forward":
            smallseq.forward(problem, q, kv, kv, out, lse, 0)
        else:
            smallseq.backward(problem, out, q, kv, kv, lse, out, kv, kv, 0)
