"""The decode attention kernels' tile tables on NVIDIA: Hopper runs the copy-engine kernel where the
cache has tensor maps and ships the thread-copy kernel beside it for the caches that have none; other
sm_80+ parts run the thread-copy kernel. Every row fits its target's shared memory, the bytes and
threads the launcher passes agree with the layouts the kernels compute, and ptxas spills in no
copy-engine instantiation (all checked by NVRTC, no GPU needed)."""

from __future__ import annotations

import pytest
from support.compilers import compile_family, compile_with_layout_checks, nvrtc_backend, ptxas_resources

from hipattn.catalog import decode
from hipattn.catalog.targets import HOPPER_SHARED_BYTES, SM86_SHARED_BYTES
from hipattn.jit.target import Target

HOPPER = Target.parse("sm_90a")
TMA_ROWS = decode.DECODE_TMA_TILES


@pytest.mark.parametrize("head_dim", sorted(TMA_ROWS))
def test_every_copy_engine_row_fits_hopper_with_a_ring_of_two_slots_or_more(head_dim):
    tiles = TMA_ROWS[head_dim]
    assert tiles.stages >= 2, "the producer copies the next tile while the consumers read this one"
    assert tiles.shared_bytes(head_dim) <= HOPPER_SHARED_BYTES
    assert tiles.blocks_per_unit(HOPPER, head_dim) * (tiles.shared_bytes(head_dim) + 1024) <= 228 * 1024
    assert tiles.persistent


def test_copy_engine_shared_bytes_store_rows_in_whole_swizzle_blocks():
    """Head_dim 96's K and V rows take two 64-column blocks (the second half used), as the copy
    engine's 128-byte swizzle lays them out."""
    tiles = decode.DecodeTmaTiles(stages=1)
    slot_96 = tiles.shared_bytes(96) - 2 * 16 * (96 + 8) * 2 - 4 * 16 * (96 + 6) * 4 - 2 * 8
    assert slot_96 == 2 * 64 * 128 * 2


@pytest.mark.parametrize("head_dim", decode.DECODE_HEAD_DIMS)
def test_hopper_reads_a_cache_with_maps_by_the_copy_engine_and_any_other_by_threads(head_dim):
    with_maps = decode.tiles_for(HOPPER, head_dim, rows=4)
    without = decode.tiles_for(HOPPER, head_dim, rows=4, tensor_maps=False)
    assert isinstance(without, decode.DecodeMmaTiles)
    assert without.shared_bytes(head_dim) <= HOPPER_SHARED_BYTES
    if head_dim in TMA_ROWS:
        assert with_maps == TMA_ROWS[head_dim]
    else:
        assert with_maps == without


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
def test_other_nvidia_parts_run_the_thread_copy_kernel(arch):
    target = Target.parse(arch)
    for head_dim in decode.DECODE_HEAD_DIMS:
        tiles = decode.tiles_for(target, head_dim, rows=4)
        assert isinstance(tiles, decode.DecodeMmaTiles)
        limit = HOPPER_SHARED_BYTES if arch == "sm_90" else SM86_SHARED_BYTES
        assert tiles.shared_bytes(head_dim) <= limit
    assert decode.DECODE_FORWARD_TMA.shipped(target) == []


def test_sm_90a_ships_both_kernels_for_every_head_dim_the_tables_name():
    shipped_tma = {(s.arg("dtype"), s.arg("head_dim")) for s in decode.DECODE_FORWARD_TMA.shipped(HOPPER)}
    shipped_mma = {(s.arg("dtype"), s.arg("head_dim")) for s in decode.DECODE_FORWARD_MMA.shipped(HOPPER)}
    assert shipped_tma == {(dtype, d) for dtype in ("fp16", "bf16") for d in TMA_ROWS}
    assert shipped_mma == {(dtype, d) for dtype in ("fp16", "bf16") for d in decode.DECODE_HEAD_DIMS}


@pytest.mark.nvrtc
@pytest.mark.parametrize("family, table, layout_of", [
    (decode.DECODE_FORWARD_TMA, TMA_ROWS,
     lambda head_dim, tiles: f"hipattn::decode::TmaLayout<hipattn::bf16_t, {head_dim}, {tiles.stages}>"),
    (decode.DECODE_FORWARD_MMA, decode.DECODE_MMA_TILES_HOPPER,
     lambda head_dim, tiles: f"hipattn::decode::MmaLayout<hipattn::bf16_t, {head_dim}, {tiles.block_n}, "
                             f"{tiles.stages}>"),
], ids=["copy-engine", "thread-copy"])
def test_kernel_layout_matches_the_launcher_bytes(family, table, layout_of):
    compile_with_layout_checks(nvrtc_backend(), family, HOPPER, table, layout_of)


@pytest.mark.nvrtc
def test_copy_engine_launch_bound_is_the_blocks_an_sm_is_given():
    checks = [f"static_assert(hipattn::decode::TmaLayout<hipattn::bf16_t, {d}, 2>::kResidentBlocks == "
              f"{decode.DecodeTmaTiles.resident_blocks(d)}, \"head_dim {d}\");" for d in decode.DECODE_HEAD_DIMS]
    compile_family(nvrtc_backend(), decode.DECODE_FORWARD_TMA, HOPPER, decode.DECODE_FORWARD_TMA.shipped(HOPPER)[0],
                   checks)


@pytest.mark.nvrtc
@pytest.mark.parametrize("spec", decode.DECODE_FORWARD_TMA.shipped(HOPPER), ids=lambda spec: spec.canonical())
def test_copy_engine_kernel_spills_nothing(spec):
    log = compile_family(nvrtc_backend(), decode.DECODE_FORWARD_TMA, HOPPER, spec,
                         options=("--ptxas-options=-v",)).log
    _, _, spill_stores, spill_loads = ptxas_resources(log)
    assert spill_stores == spill_loads == 0, log
