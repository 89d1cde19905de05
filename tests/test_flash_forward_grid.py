"""The flash forward's grid on Hopper, no GPU: the warp-specialised kernel's blocks walk work items, so
in a batch of equal sequences its launcher runs a persistent grid over the SMs (ops.flash.forward_grid),
its blocks taking single items, or under a causal mask or window pairs of query tiles from both ends;
where sequences differ, or the kernel takes one item per block, a block per item. Launches are recorded
by a fake sm_90a backend with 132 SMs (tests/support/fake_backend.py)."""

from __future__ import annotations

import pytest
from support.fake_backend import HopperWithMaps

from hipattn import problem as problem_mod
from hipattn import runtime
from hipattn.arrays import raw_array
from hipattn.catalog.flash_forward import FLASH_FORWARD_WARP_SPECIALISED_TILES, FLASH_FORWARD_WGMMA_TILES
from hipattn.jit.cache import DiskCache
from hipattn.jit.registry import Registry
from hipattn.ops import flash
from hipattn.ops.persistent import persistent_blocks

SMS = 132
BLOCK_M = FLASH_FORWARD_WARP_SPECIALISED_TILES[128].block_m


class H200(HopperWithMaps):
    def compute_units(self, device):
        return SMS


@pytest.fixture
def hopper(tmp_path):
    backend = H200()
    with runtime.installed(runtime.Runtime(backend, registry=Registry(backend, DiskCache(tmp_path)))):
        yield backend


def _forward(batch=4, seqlen=1000, heads=16, q_strides=None, blocks=None, **call):
    """A BSHD forward at head_dim 128 (a THD one with ``cu_seqlens``: ``batch`` sequences of ``seqlen``)."""
    memory = iter(range(0x10_0000_0000, 0x20_0000_0000, 1 << 30))
    if call.pop("varlen", False):
        lengths = [seqlen] * batch
        cu = raw_array(next(memory), (batch + 1,), "int32", 0)
        call.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        shape_q, shape_kv, lse_shape = (batch * seqlen, heads, 128), (batch * seqlen, 4, 128), (heads, batch * seqlen)
    else:
        shape_q, shape_kv, lse_shape = (batch, seqlen, heads, 128), (batch, seqlen, 4, 128), (batch, heads, seqlen)
    q = raw_array(next(memory), shape_q, "bf16", 0, q_strides)
    k, v = (raw_array(next(memory), shape_kv, "bf16", 0) for _ in range(2))
    out, lse = raw_array(next(memory), shape_q, "bf16", 0), raw_array(next(memory), lse_shape, "fp32", 0)
    problem = problem_mod.describe(q, k, v, **call)
    sequences = {name: call[name] for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k") if name in call}
    flash.forward(problem, q, k, v, out, lse, 0, blocks=blocks, **sequences)


def _launched(hopper) -> tuple[bytes, int]:
    ((function, grid, _, _, _, _),) = hopper.launches
    return function[1], grid[0]


def test_equal_items_run_on_the_fewest_blocks_that_finish_in_a_full_grids_rounds(hopper):
    _forward()
    name, grid = _launched(hopper)
    items = -(-1000 // BLOCK_M) * 4 * 16
    assert b"flash_forward_warp_specialised<" in name
    assert grid == persistent_blocks(items, SMS) == 128 and items == 512
    assert hopper.launches[0][5].pair_query_tiles == 0


@pytest.mark.parametrize("call", [{"causal": True}, {"window_size": (256, -1)}, {"window_size": (-1, 100)}],
                         ids=["causal", "left-window", "right-window"])
def test_masked_items_run_persistent_in_pairs_of_query_tiles(hopper, call):
    """Under a causal mask or a window a query tile's cost depends on where it sits: the blocks take a
    head's tiles in pairs from both ends (8 tiles: 4 pairs per head), each pair costing the same."""
    _forward(**call)
    ((_, grid, _, _, _, params),) = hopper.launches
    pairs = 4 * 4 * 16
    assert grid[0] == persistent_blocks(pairs, SMS) == 128 and params.pair_query_tiles == 1


def test_an_odd_tile_count_rounds_the_pairs_up(hopper):
    _forward(seqlen=5 * BLOCK_M - 3, causal=True)
    ((_, grid, _, _, _, _),) = hopper.launches
    assert grid[0] == persistent_blocks(3 * 4 * 16, SMS)


@pytest.mark.parametrize("call", [{"varlen": True}, {"varlen": True, "causal": True},
                                  {"seqused_k": raw_array(0x30_0000_0000, (4,), "int32", 0)}],
                         ids=["varlen", "varlen-causal", "seqused"])
def test_sequences_of_different_lengths_get_a_block_per_item(hopper, call):
    _forward(**call)
    ((_, grid, _, _, _, params),) = hopper.launches
    assert grid[0] == 8 * 4 * 16 and params.pair_query_tiles == 0


def test_fewer_items_than_sms_get_a_block_each(hopper):
    _forward(batch=2, seqlen=300, heads=8)
    assert _launched(hopper)[1] == 3 * 2 * 8


def test_the_fa2_class_kernel_takes_one_item_per_block(hopper):
    """A broadcast batch has no tensor map, so the FA2-class wgmma kernel runs, whose blocks do not walk."""
    _forward(q_strides=(0, 16 * 128, 128, 1))
    name, grid = _launched(hopper)
    assert b"flash_forward_wgmma<" in name and grid == -(-1000 // FLASH_FORWARD_WGMMA_TILES[128].block_m) * 4 * 16


@pytest.mark.parametrize("call,paired", [({"causal": True}, 1), ({}, 0), ({"varlen": True, "causal": True}, 0)],
                         ids=["causal", "unmasked", "varlen"])
def test_a_grid_asked_for_is_the_grid_launched_with_the_calls_schedule(hopper, call, paired):
    _forward(blocks=3, **call)
    assert _launched(hopper)[1] == 3 and hopper.launches[0][5].pair_query_tiles == paired


@pytest.mark.parametrize("blocks,strides", [(0, None), (3, (0, 16 * 128, 128, 1))], ids=["no-blocks", "fa2-class"])
def test_a_grid_no_kernel_can_walk_is_refused_before_any_launch(hopper, blocks, strides):
    with pytest.raises(ValueError, match="blocks="):
        _forward(blocks=blocks, q_strides=strides)
    assert hopper.launches == []
