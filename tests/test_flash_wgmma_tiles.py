"""The Hopper (wgmma) kernels' tile tables, the forwards' (warp-specialised and FA2-class) and the dK/dV
kernel's: only sm_90a ships and runs them, their rows fit Hopper's shared memory, the bytes the
launcher passes agree with the layouts the kernels compute, and the header that holds the wgmma
instructions refuses every other target (all checked by NVRTC, no GPU needed), and ptxas neither
serialises their wgmmas nor spills, and honours the warp-specialised kernel's register split."""

from __future__ import annotations

import re

import pytest
from support.compilers import compile_family, compile_with_layout_checks, nvrtc_backend, ptxas_resources

from hipattn.catalog import flash_backward, flash_forward
from hipattn.catalog.common import DTYPES, FLASH_HEAD_DIMS, wgmma_row_elements
from hipattn.catalog.fields import SCORE_MODS_PARAM
from hipattn.catalog.targets import HOPPER_SHARED_BYTES, runs_nvidia_wgmma
from hipattn.errors import CompileError
from hipattn.jit.target import Target

FORWARD_ROWS = flash_forward.FLASH_FORWARD_WGMMA_TILES
SPECIALISED_ROWS = flash_forward.FLASH_FORWARD_WARP_SPECIALISED_TILES
SPECIALISED_MODIFIED_ROWS = flash_forward.FLASH_FORWARD_WARP_SPECIALISED_MODIFIED_TILES
DKDV_ROWS = flash_backward.FLASH_BACKWARD_DKDV_WGMMA_TILES
DKDV_MODIFIED_ROWS = flash_backward.FLASH_BACKWARD_DKDV_WGMMA_MODIFIED_TILES
SPECIALISED_DKDV_ROWS = flash_backward.FLASH_BACKWARD_DKDV_WARP_SPECIALISED_TILES


# ---- the forward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", sorted(FORWARD_ROWS))
def test_every_forward_row_fits_hopper_and_names_wgmma_shapes(head_dim):
    tiles = FORWARD_ROWS[head_dim]
    assert tiles.block_n in (64, 128), "S is one m64nN wgmma: the header defines N = 64 and 128 for it"
    assert head_dim in (64, 96, 128, 256), "O is one m64nN wgmma with N = head_dim"
    assert tiles.threads == 128 * tiles.warpgroups and tiles.block_m == 64 * tiles.warpgroups
    assert tiles.stages in (2, 3), "K of the next tile is read while this one's P V runs: two slots at least"
    assert tiles.shared_bytes(head_dim) <= HOPPER_SHARED_BYTES


def test_forward_shared_bytes_formula():
    # head_dim 128, 128-key tiles, two warpgroups, two stages: Q (128 rows), two K and two V slots (128 rows
    # each), 2 bytes.
    assert flash_forward.FlashForwardWgmmaTiles(128, 2, 2).shared_bytes(128) == (128 + 4 * 128) * 128 * 2


def test_forward_shared_bytes_store_head_dim_96_in_whole_swizzle_blocks():
    # Three warpgroups, 64-key tiles, two stages: Q (192 rows), two K and two V slots, 128 columns each.
    assert flash_forward.FlashForwardWgmmaTiles(64, 3, 2).shared_bytes(96) == (192 + 4 * 64) * 128 * 2


def test_only_sm_90a_ships_the_forward_for_every_head_dim():
    specs = flash_forward.FLASH_FORWARD_WGMMA.shipped(Target.parse("sm_90a"))
    assert {(spec.arg("dtype"), spec.arg("head_dim")) for spec in specs} == {
        (dtype, head_dim) for dtype in DTYPES for head_dim in FLASH_HEAD_DIMS
    }
    for arch in ("sm_80", "sm_89", "sm_90", "sm_100a", "gfx90a"):
        assert not runs_nvidia_wgmma(Target.parse(arch))
        assert list(flash_forward.FLASH_FORWARD_WGMMA.shipped(Target.parse(arch))) == []


@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_each_target_gets_its_forward_kernels_row(head_dim):
    mma_row = flash_forward.FLASH_FORWARD_MMA_TILES[head_dim]
    hopper = Target.parse("sm_90a")
    fa2_class = FORWARD_ROWS.get(head_dim, mma_row)
    assert flash_forward.tiles_for(head_dim, hopper) == SPECIALISED_ROWS.get(head_dim, fa2_class)
    assert flash_forward.tiles_for(head_dim, hopper, score_mods=True) == SPECIALISED_MODIFIED_ROWS.get(head_dim, fa2_class)
    assert flash_forward.tiles_for(head_dim, hopper, tensor_maps=False) == fa2_class, \
        "arrays with no tensor map take the kernel whose threads copy"
    for arch in ("sm_80", "sm_89", "sm_90", "sm_120"):
        assert flash_forward.tiles_for(head_dim, Target.parse(arch)) == mma_row
    for arch in ("gfx90a", "gfx942:xnack-"):
        assert flash_forward.tiles_for(head_dim, Target.parse(arch)) == flash_forward.FLASH_FORWARD_MFMA_TILES[head_dim]


# ---- the warp-specialised forward -----------------------------------------------------------------


@pytest.mark.parametrize("table", [SPECIALISED_ROWS, SPECIALISED_MODIFIED_ROWS], ids=["plain", "modified"])
def test_every_warp_specialised_row_fits_hopper(table):
    assert set(table) == set(SPECIALISED_ROWS), "the modified table changes rows, not head dims"
    for head_dim, tiles in table.items():
        assert tiles.block_n in (64, 128) and head_dim in (64, 96, 128)
        assert tiles.threads == 128 * (tiles.consumers + 1) and tiles.block_m == 64 * tiles.consumers
        assert tiles.ping_pong <= (tiles.consumers >= 2), "turns need two consumers"
        assert tiles.shared_bytes(head_dim) <= HOPPER_SHARED_BYTES
        assert tiles.tensor_map_rows() == {"q": tiles.block_m, "k": tiles.block_n, "v": tiles.block_n}


def test_warp_specialised_shared_bytes_formula():
    # head_dim 128, 128-key tiles, two consumers, two stages: two Q slots (128 rows each), two K and two V
    # slots (128 rows each), 2 bytes; then twelve 8-byte mbarriers (two per Q slot, four per K/V slot).
    tiles = flash_forward.FlashForwardWarpSpecialisedTiles(block_n=128, consumers=2, stages=2)
    assert tiles.shared_bytes(128) == (2 * 128 + 4 * 128) * 128 * 2 + 8 * 12
    assert tiles.shared_bytes(96) == tiles.shared_bytes(128), "head_dim 96 is stored in whole swizzle blocks"


def test_only_sm_90a_ships_the_warp_specialised_forward_both_tables():
    family = flash_forward.FLASH_FORWARD_WARP_SPECIALISED
    shipped = {(spec.arg("dtype"), spec.arg("head_dim"), spec.arg(SCORE_MODS_PARAM), spec.arg("block_n"))
               for spec in family.shipped(Target.parse("sm_90a"))}
    assert shipped == {(dtype, head_dim, mods, table[head_dim].block_n) for dtype in DTYPES
                       for mods, table in ((False, SPECIALISED_ROWS), (True, SPECIALISED_MODIFIED_ROWS))
                       for head_dim in table}
    for arch in ("sm_80", "sm_90", "sm_100a", "gfx90a"):
        assert list(family.shipped(Target.parse(arch))) == []


@pytest.mark.nvrtc
def test_warp_specialised_kernel_gives_its_consumers_the_producers_registers():
    """setmaxnreg takes effect only when the kernel has a register cap at entry: ptxas then emits it
    (USETMAXREG in SASS, checked through the PTX it accepted without warning C7508)."""
    backend, target = nvrtc_backend(), Target.parse("sm_90a")
    spec = SPECIALISED_ROWS[128].spec("bf16", 128, score_mods=False)
    log = compile_family(backend, flash_forward.FLASH_FORWARD_WARP_SPECIALISED, target, spec,
                         options=("--ptxas-options=-v",)).log
    assert "C7508" not in log, log
    registers, _, _, _ = ptxas_resources(log)
    assert registers == 65536 // (3 * 128) // 8 * 8, "the launch bound caps every thread at entry"


@pytest.mark.nvrtc
def test_plain_sm_90_is_refused_with_the_reason():
    backend = nvrtc_backend()
    family = flash_forward.FLASH_FORWARD_WGMMA
    spec = family.shipped(Target.parse("sm_90a"))[0]
    with pytest.raises(CompileError, match="needs the sm_90a target"):
        compile_family(backend, family, Target.parse("sm_90"), spec)


# ---- the dK/dV kernel -----------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim, tiles", [*sorted(DKDV_ROWS.items()), *sorted(DKDV_MODIFIED_ROWS.items())], ids=str)
def test_every_dkdv_row_fits_hopper_and_splits_dq_along_swizzle_blocks(head_dim, tiles):
    assert tiles.threads == 128 * tiles.warpgroups
    assert tiles.shared_bytes(head_dim) <= HOPPER_SHARED_BYTES
    if tiles.column_groups == 1:
        assert head_dim in (64, 96, 128), "dK and dV are one m64nN wgmma each, N = head_dim (the header's 64, 96, 128)"
        assert tiles.block_n == 64 * tiles.warpgroups
        if tiles.block_m == 64:
            dq_columns = wgmma_row_elements(head_dim) // tiles.warpgroups
            assert dq_columns % 64 == 0 or dq_columns == 32, \
                "each warpgroup's dQ columns are whole 64-column blocks or one half of a block"
        else:
            assert tiles.block_m == 64 * tiles.warpgroups and head_dim == 64, \
                "each warpgroup takes 64 rows of dQ (one m64n64 wgmma, every column) and Sᵀ of every query"
    else:
        assert head_dim == 256 and tiles.column_groups == tiles.warpgroups == 2, \
            "two warpgroups share 64 keys, each with one m64n128 wgmma of dK and of dV"
        assert tiles.block_n == 64
        assert wgmma_row_elements(head_dim) // tiles.column_groups == 128


def test_dkdv_column_groups_stage_the_transposed_scores_instead_of_dq():
    # head_dim 256, two warpgroups sharing 64 keys: K and V (64 rows each), two Q and two dO slots (64
    # rows each), Pᵀ and dSᵀ (64 x 64 each), 2 bytes; LSE and Delta; no staged dQ.
    tiles = flash_backward.FlashDkdvWgmmaTiles(warpgroups=2, column_groups=2)
    assert tiles.shared_bytes(256) == (2 * 64 + 4 * 64) * 256 * 2 + 2 * 64 * 64 * 2 + 2 * 2 * 64 * 4


def test_dkdv_shared_bytes_formula():
    # head_dim 128, two warpgroups: K and V (128 rows each), two Q and two dO slots (64 rows each),
    # dSᵀ (128 x 64), 2 bytes; then LSE and Delta, two slots of 64 fp32 each; then each warpgroup's
    # 64 staged dQ rows of 64 + 8 fp32.
    assert flash_backward.FlashDkdvWgmmaTiles(2).shared_bytes(128) == (
        (2 * 128 + 4 * 64) * 128 * 2 + 128 * 64 * 2 + 2 * 2 * 64 * 4 + 2 * 64 * 72 * 4)


def test_dkdv_shared_bytes_with_128_query_rows():
    # head_dim 64, two warpgroups, 128-query tiles: K and V (128 rows each), two Q and two dO slots (128
    # rows each), dSᵀ (128 x 128), 2 bytes; LSE and Delta, two slots of 128 fp32 each; each warpgroup's
    # 64 staged dQ rows of every column, 64 + 8 fp32.
    assert flash_backward.FlashDkdvWgmmaTiles(2, block_m=128).shared_bytes(64) == (
        (2 * 128 + 4 * 128) * 64 * 2 + 128 * 128 * 2 + 2 * 2 * 128 * 4 + 2 * 64 * 72 * 4)


def test_the_modified_dkdv_kernel_keeps_64_query_rows_where_the_plain_one_takes_128():
    assert DKDV_ROWS[64].block_m == 128 and DKDV_MODIFIED_ROWS[64].block_m == 64
    others = [d for d in DKDV_ROWS if d != 64]
    assert [DKDV_MODIFIED_ROWS[d] for d in others] == [DKDV_ROWS[d] for d in others]
    assert DKDV_MODIFIED_ROWS.keys() == DKDV_ROWS.keys()
    target = Target.parse("sm_90a")
    assert flash_backward.tiles_for(64, target, score_mods=True, tensor_maps=False)[0] == DKDV_MODIFIED_ROWS[64]
    assert flash_backward.tiles_for(64, target, tensor_maps=False)[0] == DKDV_ROWS[64]


def test_dkdv_shared_bytes_store_head_dim_96_in_whole_swizzle_blocks():
    # Rows of 128 columns; each warpgroup stages 64 of dQ's (the second's last 32 past the head).
    assert flash_backward.FlashDkdvWgmmaTiles(2).shared_bytes(96) == flash_backward.FlashDkdvWgmmaTiles(2).shared_bytes(128)


def test_only_sm_90a_ships_the_dkdv_kernel():
    family = flash_backward.FLASH_BACKWARD_DKDV_WGMMA
    specs = family.shipped(Target.parse("sm_90a"))
    assert {(spec.arg("dtype"), spec.arg("head_dim"), spec.arg("write_dq"), spec.arg(SCORE_MODS_PARAM),
             spec.arg("block_m")) for spec in specs} == {
        (dtype, head_dim, write_dq, mods, table[head_dim].block_m) for dtype in DTYPES for write_dq in (False, True)
        for mods, table in ((False, DKDV_ROWS), (True, DKDV_MODIFIED_ROWS)) for head_dim in table}
    for arch in ("sm_80", "sm_89", "sm_90", "sm_100a", "gfx90a"):
        assert list(family.shipped(Target.parse(arch))) == []


@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
@pytest.mark.parametrize("score_mods", [False, True], ids=["plain", "modified"])
def test_sm_90a_runs_the_dkdv_kernels_where_their_tables_have_the_head_dim(head_dim, score_mods):
    target = Target.parse("sm_90a")
    mma_dkdv, mma_dq = flash_backward.FLASH_BACKWARD_MMA_TILES_HOPPER[head_dim]
    wgmma_rows = DKDV_MODIFIED_ROWS if score_mods else DKDV_ROWS
    fa2_class = wgmma_rows.get(head_dim, mma_dkdv)
    dkdv, dq = flash_backward.tiles_for(head_dim, target, score_mods=score_mods)
    assert dkdv == SPECIALISED_DKDV_ROWS.get(head_dim, fa2_class), "modified calls too"
    assert dq == mma_dq, "the deterministic dQ kernel stays mma.sync"
    assert flash_backward.tiles_for(head_dim, target, score_mods=score_mods, tensor_maps=False) == (fa2_class, mma_dq), \
        "arrays with no tensor map take the kernel whose threads copy"
    spec = dkdv.spec("bf16", head_dim, write_dq=True, score_mods=score_mods)
    expected = ("flash_backward_dkdv_warp_specialised" if head_dim in SPECIALISED_DKDV_ROWS
                else "flash_backward_dkdv_wgmma" if head_dim in wgmma_rows else "flash_backward_dkdv_mma")
    assert spec.family.name == expected


# ---- the warp-specialised dK/dV kernel --------------------------------------------------------------


def test_every_warp_specialised_dkdv_row_fits_hopper():
    assert set(SPECIALISED_DKDV_ROWS) <= {64, 96, 128}, "each consumer owns 64 keys and every column of their dK and dV"
    for head_dim, tiles in SPECIALISED_DKDV_ROWS.items():
        assert tiles.threads == 3 * 128 and tiles.block_n == 128, "a producer and two consumers of 64 keys"
        assert tiles.block_m in (64, 128), "a producer thread copies one row of LSE and Delta per tile"
        assert tiles.block_m == 64 or head_dim == 64, "128-query tiles split dQ by rows: head_dim 64 only"
        assert tiles.shared_bytes(head_dim) <= HOPPER_SHARED_BYTES
        assert tiles.tensor_map_rows() == {"q": tiles.block_m, "dout": tiles.block_m}


def test_warp_specialised_dkdv_shared_bytes_formula():
    # head_dim 128, 64-query tiles, two slots: K and V (128 rows each), two Q and two dO slots (64 rows
    # each), two dSᵀ buffers (128 x 64), 2 bytes; LSE and Delta, two slots of 64 fp32; each consumer's 64
    # staged dQ rows of 64 + 8 fp32; then five 8-byte mbarriers (K and V's, two per slot).
    tiles = flash_backward.FlashDkdvWarpSpecialisedTiles(block_m=64, stages=2)
    assert tiles.shared_bytes(128) == ((2 * 128 + 4 * 64) * 128 * 2 + 2 * 128 * 64 * 2 + 2 * 2 * 64 * 4
                                       + 2 * 64 * 72 * 4 + 8 * 5)
    assert tiles.shared_bytes(96) == tiles.shared_bytes(128), "head_dim 96 is stored in whole swizzle blocks"


def test_only_sm_90a_ships_the_warp_specialised_dkdv_kernel():
    family = flash_backward.FLASH_BACKWARD_DKDV_WARP_SPECIALISED
    shipped = {(spec.arg("dtype"), spec.arg("head_dim"), spec.arg("write_dq"), spec.arg(SCORE_MODS_PARAM),
                spec.arg("block_m")) for spec in family.shipped(Target.parse("sm_90a"))}
    assert shipped == {(dtype, head_dim, write_dq, mods, tiles.block_m) for dtype in DTYPES
                       for write_dq in (False, True) for mods in (False, True)
                       for head_dim, tiles in SPECIALISED_DKDV_ROWS.items()}
    for arch in ("sm_80", "sm_90", "sm_100a", "gfx90a"):
        assert list(family.shipped(Target.parse(arch))) == []


# ---- both -----------------------------------------------------------------------------------------


def _dkdv_layout(head_dim, tiles):
    return (f"hipattn::flash::WgmmaKeyBlockTiles<hipattn::bf16_t, {head_dim}, {tiles.warpgroups}, "
            f"{tiles.column_groups}, {tiles.block_m}>")


def _specialised_dkdv_layout(head_dim, tiles):
    return (f"hipattn::flash::WarpSpecialisedKeyBlockTiles<hipattn::bf16_t, {head_dim}, {tiles.block_m}, "
            f"{tiles.stages}>")


def _specialised_layout(head_dim, tiles):
    return (f"hipattn::flash::WarpSpecialisedForwardTiles<hipattn::bf16_t, {head_dim}, {tiles.block_n}, "
            f"{tiles.consumers}, {tiles.stages}>")


@pytest.mark.nvrtc
@pytest.mark.parametrize("family, table, layout_of", [
    (flash_forward.FLASH_FORWARD_WGMMA, FORWARD_ROWS,
     lambda head_dim, tiles: f"hipattn::flash::WgmmaForwardTiles<hipattn::bf16_t, {head_dim}, {tiles.block_n}, "
                             f"{tiles.warpgroups}, {tiles.stages}>"),
    (flash_forward.FLASH_FORWARD_WARP_SPECIALISED, SPECIALISED_ROWS, _specialised_layout),
    (flash_forward.FLASH_FORWARD_WARP_SPECIALISED, SPECIALISED_MODIFIED_ROWS, _specialised_layout),
    (flash_backward.FLASH_BACKWARD_DKDV_WGMMA, DKDV_ROWS, _dkdv_layout),
    (flash_backward.FLASH_BACKWARD_DKDV_WGMMA, DKDV_MODIFIED_ROWS, _dkdv_layout),
    (flash_backward.FLASH_BACKWARD_DKDV_WARP_SPECIALISED, {
        **SPECIALISED_DKDV_ROWS, 64: flash_backward.FlashDkdvWarpSpecialisedTiles(block_m=128)}, _specialised_dkdv_layout),
], ids=["forward", "specialised", "specialised-modified", "dkdv", "dkdv-modified", "specialised-dkdv"])
def test_kernel_layout_matches_the_launcher_bytes(family, table, layout_of):
    """One NVRTC compile of each kernel's unit with a static_assert per table row."""
    compile_with_layout_checks(nvrtc_backend(), family, Target.parse("sm_90a"), table, layout_of)


# ptxas's performance warnings for wgmma (C7510-C7519) say that it serialised the kernel's wgmmas: each
# waits for the one before, and the tensor cores idle while the softmax runs.
_SERIALISED = re.compile(r"\(C751\d\)[^\n]*")


# Bytes ptxas (NVRTC 13.0) may spill in each family's shipped instantiations, plain and modified (score
# modifiers, dropout, sinks). The forwards spill nothing. The dK/dV kernels form a tile's visibility
# as a word of bits before its products and read the warpgroup index from lane 0, so that the operand
# descriptors live in uniform registers: that spills at the 255-register bound (the wgmma kernel: 80
# bytes at head_dim 64 with dQ, 32 modified at 128) and at the warp-specialised consumers' 240 (36 and
# 76 bytes at head_dim 128 with dQ), and ran the 36 forward+backward cells timed on an H100 in
# 0.80-1.01x the time of the form that spilled at most 24 (BENCHMARKS.md, 2026-12-07).
_SPILL_BYTES = {
    flash_forward.FLASH_FORWARD_WGMMA.name: {False: 0, True: 0},
    flash_forward.FLASH_FORWARD_WARP_SPECIALISED.name: {False: 0, True: 0},
    flash_backward.FLASH_BACKWARD_DKDV_WGMMA.name: {False: 80, True: 32},
    flash_backward.FLASH_BACKWARD_DKDV_WARP_SPECIALISED.name: {False: 36, True: 76},
}


@pytest.mark.nvrtc
@pytest.mark.parametrize("family", [flash_forward.FLASH_FORWARD_WGMMA, flash_forward.FLASH_FORWARD_WARP_SPECIALISED,
                                    flash_backward.FLASH_BACKWARD_DKDV_WGMMA], ids=["forward", "specialised", "dkdv"])
def test_no_shipped_instantiation_is_serialised_by_ptxas_or_spills_past_its_allowance(family):
    """Every bf16 instantiation (fp16 compiles to the same schedule), plain and modified, through NVRTC
    with ptxas's report: no wgmma serialisation warning, and no more spill stores than the family's
    allowance."""
    backend, target = nvrtc_backend(), Target.parse("sm_90a")
    specs = [spec for spec in family.shipped(target) if spec.arg("dtype") == "bf16"]
    assert {spec.arg(SCORE_MODS_PARAM) for spec in specs} == {False, True}
    for spec in specs:
        log = compile_family(backend, family, target, spec, options=("--ptxas-options=-v",)).log
        assert not _SERIALISED.findall(log), f"{spec}: {_SERIALISED.findall(log)}"
        _, _, spill_stores, _ = ptxas_resources(log)
        assert spill_stores <= _SPILL_BYTES[family.name][spec.arg(SCORE_MODS_PARAM)], f"{spec}: {log}"


@pytest.mark.nvrtc
def test_warp_specialised_dkdv_kernel_is_not_serialised_and_spills_at_most_its_allowance():
    backend, target = nvrtc_backend(), Target.parse("sm_90a")
    family = flash_backward.FLASH_BACKWARD_DKDV_WARP_SPECIALISED
    specs = [spec for spec in family.shipped(target) if spec.arg("dtype") == "bf16"]
    assert specs
    for spec in specs:
        log = compile_family(backend, family, target, spec, options=("--ptxas-options=-v",)).log
        assert "C7508" not in log, log
        assert not _SERIALISED.findall(log), f"{spec}: {_SERIALISED.findall(log)}"
        registers, _, spill_stores, _ = ptxas_resources(log)
        assert registers == 65536 // (3 * 128) // 8 * 8, "the launch bound caps every thread at entry"
        assert spill_stores <= _SPILL_BYTES[family.name][spec.arg(SCORE_MODS_PARAM)], f"{spec}: {log}"
