"""The flash forward's grid on Hopper, no GPU: the warp-specialised kernel's blocks walk work items, so
where every item costs the same its launcher runs a persistent grid over the SMs (ops.flash.forward_grid);
where items differ, or the kernel takes one item per block, a block per item. Launches are recorded by a
fake sm_90a backend with 132 SMs (tests/support/fake_backend.py)."""

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


@pytest.mark.parametrize("call", [{"causal": True}, {"window_size": (256, -1)}, {"window_size": (-1, 100)},
                                  {"varlen": True}], ids=["causal", "left-window", "right-window", "varlen"])
def test_items_of_different_costs_get_a_block_each(hopper, call):
    _forward(**call)
    assert _launched(hopper)[1] == 8 * 4 * 16


def test_seqused_gives_items_different_costs(hopper):
    _forward(seqused_k=raw_array(0x30_0000_0000, (4,), "int32", 0))
    assert _launched(hopper)[1] == 8 * 4 * 16


def test_fewer_items_than_sms_get_a_block_each(hopper):
    _forward(batch=2, seqlen=300, heads=8)
    assert _launched(hopper)[1] == 3 * 2 * 8


def test_the_fa2_class_kernel_takes_one_item_per_block(hopper):
    """A broadcast batch has no tensor map, so the FA2-class wgmma kernel runs, whose blocks do not walk."""
    _forward(q_strides=(0, 16 * 128, 128, 1))
    name, grid = _launched(hopper)
    assert b"flash_forward_wgmma<" in name and grid == -(-1000 // FLASH_FORWARD_WGMMA_TILES[128].block_m) * 4 * 16


def test_a_grid_asked_for_is_the_grid_launched(hopper):
    _forward(causal=True, blocks=3)
    assert _launched(hopper)[1] == 3


@pytest.mark.parametrize("blocks,strides", [(0, None), (3, (0, 16 * 128, 128, 1))], ids=["no-blocks", "fa2-class"])
def test_a_grid_no_kernel_can_walk_is_refused_before_any_launch(hopper, blocks, strides):
    with pytest.raises(ValueError, match="blocks="):
        _forward(blocks=blocks, q_strides=strides)
    assert hopper.launches == []
