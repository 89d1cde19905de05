"""The MFMA small-seq kernels' rows (AMD gfx90a, gfx94x): which targets ship and run them, how a launch
covers a call's problems, the LDS bytes the launcher passes against the layout the kernels compute,
and every shipped instantiation compiled by hiprtc for gfx90a without scratch (no GPU needed). Their
results are checked in tests/test_smallseq_mfma_emulation.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import amdgpu_metadata
from support.compilers import compile_family, hiprtc_for
from support.local_rocm import use_local_rocm

from hipattn.catalog.common import DTYPES
from hipattn.catalog.fields import SCORE_MODS_PARAM, SCORE_MODS_VALUES
from hipattn.catalog.smallseq import (
    SMALLSEQ_BACKWARD_TILES,
    SMALLSEQ_FORWARD_TILES,
    backward_tiles,
    forward_tiles,
)
from hipattn.catalog.smallseq_common import SMALLSEQ_HEAD_DIMS, SMALLSEQ_SHIPPED_HEADS, SMALLSEQ_TILE
from hipattn.catalog.smallseq_mfma import (
    SMALLSEQ_BACKWARD_MFMA,
    SMALLSEQ_BACKWARD_MFMA_TILES,
    SMALLSEQ_FORWARD_MFMA,
    SMALLSEQ_FORWARD_MFMA_TILES,
)
from hipattn.catalog.targets import AMD_LDS_BYTES
from hipattn.jit.cache import DiskCache
from hipattn.jit.registry import compile_inputs
from hipattn.jit.target import Target

use_local_rocm()

MFMA_ARCHS = ["gfx90a", "gfx90a:xnack-", "gfx940", "gfx941", "gfx942", "gfx942:sramecc+:xnack-"]
TABLES = {"forward": SMALLSEQ_FORWARD_MFMA_TILES, "backward": SMALLSEQ_BACKWARD_MFMA_TILES}
FAMILIES = {"forward": SMALLSEQ_FORWARD_MFMA, "backward": SMALLSEQ_BACKWARD_MFMA}
# Each direction ships one instantiation per dtype, head_dim, head count and score-modifier switch.
SHIPPED_PER_DIRECTION = len(DTYPES) * len(SMALLSEQ_HEAD_DIMS) * len(SMALLSEQ_SHIPPED_HEADS) * len(SCORE_MODS_VALUES)
# Registers per lane the tables were chosen for (gfx90a's unified count: VGPRs and AGPRs; a SIMD
# holds 512 // count waves of a kernel): a change to a kernel that needs more shows here first.
REGISTER_BUDGET = {"forward": 168, "backward": 256}


@pytest.mark.parametrize("direction", TABLES)
def test_every_head_dim_has_a_row_whose_workgroup_fits_the_hardware(direction):
    table = TABLES[direction]
    assert sorted(table) == sorted(SMALLSEQ_HEAD_DIMS)
    for head_dim, tiles in table.items():
        assert head_dim % tiles.waves == 0 and (head_dim // tiles.waves) % 32 == 0, "whole 32-column pieces a wave"
        assert tiles.threads == 64 * tiles.waves <= 1024
        assert tiles.shared_bytes(head_dim) <= AMD_LDS_BYTES
        assert tiles.shared_bytes(head_dim) == 0 or tiles.waves > 1, "one wave exchanges nothing"


def test_shared_bytes_formula():
    # Two buffers x waves x tensors x (64 lanes x 4 floats of key tile 0 + key 16's 16), 4 bytes each.
    assert SMALLSEQ_TILE == 17
    assert SMALLSEQ_FORWARD_MFMA_TILES[256].shared_bytes(256) == 2 * 2 * 1 * (256 + 16) * 4
    assert SMALLSEQ_BACKWARD_MFMA_TILES[256].shared_bytes(256) == 2 * 4 * 2 * (256 + 16) * 4
    assert SMALLSEQ_BACKWARD_MFMA_TILES[64].shared_bytes(64) == 0


@pytest.mark.parametrize("problems,group", [(1, 1), (24, 8), (12, 3), (80_000 * 32, 4)])
def test_a_launch_gives_every_sequence_and_kv_head_one_workgroup(problems, group):
    # The launcher counts the forward's problems per query head, the backward's per KV head.
    for head_dim in SMALLSEQ_HEAD_DIMS:
        forward = SMALLSEQ_FORWARD_MFMA_TILES[head_dim].launch(problems, head_dim, group)
        assert forward.blocks == problems // group and not forward.fields
        backward = SMALLSEQ_BACKWARD_MFMA_TILES[head_dim].launch(problems // group, head_dim, group)
        assert backward.blocks == problems // group and not backward.fields
        assert backward.threads == SMALLSEQ_BACKWARD_MFMA_TILES[head_dim].threads
        assert backward.shared_bytes == SMALLSEQ_BACKWARD_MFMA_TILES[head_dim].shared_bytes(head_dim)


@pytest.mark.parametrize("arch", MFMA_ARCHS)
def test_mfma_targets_run_the_mfma_rows_unless_portable_is_forced(arch):
    target = Target.parse(arch)
    for head_dim in SMALLSEQ_HEAD_DIMS:
        assert forward_tiles(head_dim, target, group=1) == SMALLSEQ_FORWARD_MFMA_TILES[head_dim]
        assert forward_tiles(head_dim, target, group=1, portable=True) == SMALLSEQ_FORWARD_TILES
        for group in (1, 3, 8):
            assert backward_tiles(head_dim, target, group=group) == SMALLSEQ_BACKWARD_MFMA_TILES[head_dim]
            assert backward_tiles(head_dim, target, group=group, portable=True) == SMALLSEQ_BACKWARD_TILES


@pytest.mark.parametrize("arch", ["gfx908", "gfx1030", "gfx1100"])
def test_other_amd_targets_run_the_portable_rows(arch):
    target = Target.parse(arch)
    assert forward_tiles(128, target, group=1) == SMALLSEQ_FORWARD_TILES
    assert backward_tiles(128, target, group=2) == SMALLSEQ_BACKWARD_TILES


@pytest.mark.parametrize("arch", MFMA_ARCHS)
def test_ships_every_dtype_head_dim_and_shipped_head_count_for_mfma_targets(arch):
    target = Target.parse(arch)
    for direction, family in FAMILIES.items():
        specs = family.shipped(target)
        assert {(s.arg("dtype"), s.arg("head_dim"), s.arg("heads"), s.arg(SCORE_MODS_PARAM)) for s in specs} == {
            (t, d, h, m) for t in DTYPES for d in SMALLSEQ_HEAD_DIMS for h in SMALLSEQ_SHIPPED_HEADS
            for m in SCORE_MODS_VALUES}
        assert len(specs) == SHIPPED_PER_DIRECTION
        assert all(s.arg("waves") == TABLES[direction][s.arg("head_dim")].waves for s in specs)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "gfx908", "gfx1100"])
def test_ships_nothing_without_the_mfma_instructions(arch):
    assert SMALLSEQ_FORWARD_MFMA.shipped(Target.parse(arch)) == []
    assert SMALLSEQ_BACKWARD_MFMA.shipped(Target.parse(arch)) == []


@pytest.mark.parametrize("direction", TABLES)
def test_kernel_layout_matches_the_launcher_bytes(direction):
    """One hiprtc compile of the kernel's unit with static_asserts per row: the exchange's LDS bytes
    and the workgroup's threads."""
    backend, target = hiprtc_for("gfx90a")
    tensors = 1 if direction == "forward" else 2
    checks = []
    for head_dim, tiles in sorted(TABLES[direction].items()):
        geometry = f"hipattn::smallseq::MfmaGeometry<{head_dim}, {SMALLSEQ_TILE}, {tiles.waves}>"
        exchange = f"hipattn::smallseq::ScoreExchange<{tiles.waves}, {tensors}, {geometry}::kKeyTiles>"
        checks += [f'static_assert({exchange}::kBytes == {tiles.shared_bytes(head_dim)}, '
                   f'"{exchange}: bytes differ from its tile row\'s shared_bytes");',
                   f'static_assert({geometry}::kThreads == {tiles.threads}, "{geometry}: threads differ from its row");']
    family = FAMILIES[direction]
    compile_family(backend, family, target, family.shipped(target)[0], checks)


def test_every_shipped_instantiation_compiles_for_gfx90a_without_scratch(tmp_path):
    """`hipattn warm` of both families for gfx90a (parallel processes), then each binary's AMDGPU
    metadata: no spills, no private (scratch) segment, no static LDS, registers within budget."""
    backend, target = hiprtc_for("gfx90a")
    environment = dict(os.environ, HIPATTN_CACHE_DIR=str(tmp_path / "cache"))
    command = [sys.executable, "-m", "hipattn", "warm", "--arch", "gfx90a", "--jobs", str(os.cpu_count() or 2)]
    for family in FAMILIES.values():
        command += ["--family", family.name]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    cache = DiskCache(tmp_path / "cache")
    found = []
    for direction, family in FAMILIES.items():
        for spec in family.shipped(target):
            compiled = cache.get(compile_inputs(spec, target, backend).key, target.arch)
            assert compiled is not None, f"{spec} was not compiled"
            (kernel,) = amdgpu_metadata.kernels(compiled.binary)
            usage = {name: kernel[f".{name}"] for name in ("vgpr_count", "agpr_count", "sgpr_count",
                                                           "vgpr_spill_count", "sgpr_spill_count",
                                                           "private_segment_fixed_size", "group_segment_fixed_size")}
            found.append((str(spec), usage))
            assert usage["vgpr_spill_count"] == usage["sgpr_spill_count"] == 0, f"{spec} spills: {usage}"
            assert usage["private_segment_fixed_size"] == 0, f"{spec} uses scratch: {usage}"
            assert usage["group_segment_fixed_size"] == 0, f"{spec}: all its LDS is the launcher's dynamic bytes"
            assert usage["vgpr_count"] <= REGISTER_BUDGET[direction], f"{spec} needs more registers: {usage}"
    assert len(found) == len(FAMILIES) * SHIPPED_PER_DIRECTION
