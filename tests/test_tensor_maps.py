"""Tensor maps on the host, no GPU: which attention arrays have one and what it says, the cache that
encodes each (address, layout) once, the parameter struct that carries maps at 64-byte boundaries, and
a recorded launch that replays with maps of its new arrays (hipattn.launch_plans)."""

from __future__ import annotations

import ctypes

import pytest
from support.fake_backend import CountingEncoder, HopperWithMaps

from hipattn import launch_plans, runtime
from hipattn import problem as problem_mod
from hipattn.arrays import raw_array
from hipattn.backends import tensor_maps
from hipattn.backends.tensor_maps import TensorMapCache, TensorMapLayout
from hipattn.catalog.flash_backward import (
    FLASH_BACKWARD_DKDV_WARP_SPECIALISED_TILES,
    FLASH_BACKWARD_MMA_TILES_HOPPER,
)
from hipattn.catalog.flash_forward import (
    FLASH_FORWARD_PARAMS,
    FLASH_FORWARD_TMA_PARAMS,
    FLASH_FORWARD_WARP_SPECIALISED_TILES,
    FLASH_FORWARD_WGMMA_TILES,
)
from hipattn.device_array import DeviceArray, contiguous_strides
from hipattn.jit.cache import DiskCache
from hipattn.jit.params import TENSOR_MAP, TENSOR_MAP_BYTES, ParamsStruct, TensorMapBytes
from hipattn.jit.registry import Registry
from hipattn.ops import flash, flash_backward
from hipattn.ops.tensor_map_fields import map_layout
from hipattn.problem import BSHD, THD


def _array(shape, strides=None, ptr=0x10000, dtype="bf16") -> DeviceArray:
    return DeviceArray(ptr=ptr, shape=shape, strides=strides or contiguous_strides(shape), dtype=dtype, device=0,
                       framework="raw")


# ---- which arrays have a map, and what it says ----------------------------------------------------


def test_a_padded_batch_is_a_map_of_head_dim_heads_tokens_and_batch():
    layout = map_layout(_array((3, 1000, 16, 128)), BSHD, box_rows=128)
    assert layout == TensorMapLayout("bf16", (128, 16, 1000, 3), (256, 16 * 256, 1000 * 16 * 256), (64, 1, 128, 1))


def test_a_varlen_array_is_one_batch_deep():
    layout = map_layout(_array((777, 8, 96)), THD, box_rows=64)
    assert layout.dims == (96, 8, 777, 1) and layout.box == (64, 1, 64, 1)
    assert layout.strides[:2] == (96 * 2, 8 * 96 * 2)


def test_a_dimension_of_one_gets_a_contiguous_stride_whatever_it_had():
    """Its stride is never stepped along, and 0 or an odd value would break the map's rules."""
    layout = map_layout(_array((1, 300, 1, 64), strides=(0, 72, 8, 1)), BSHD, box_rows=128)
    assert layout.strides == (64 * 2, 72 * 2, 300 * 72 * 2)


def test_strides_a_map_cannot_take_leave_the_array_without_one():
    q = (2, 300, 4, 128)
    assert map_layout(_array(q, strides=(0, 512, 128, 1)), BSHD, 128) is None, "a broadcast batch"
    assert map_layout(_array(q, strides=(-153600, 512, 128, 1)), BSHD, 128) is None, "a negative stride"
    assert map_layout(_array(q, strides=(153600, 516, 128, 1)), BSHD, 128) is None, "a row stride off 16 bytes"
    assert map_layout(_array(q, ptr=0x10008), BSHD, 128) is None, "an address off 16 bytes"


# ---- the cache --------------------------------------------------------------------------------------


def test_each_address_and_layout_is_encoded_once_and_knows_its_origin():
    cache, encoder = TensorMapCache(), CountingEncoder()
    layout = map_layout(_array((3, 1000, 16, 128)), BSHD, 128)
    first = cache.get(encoder, 0x10000, layout)
    assert cache.get(encoder, 0x10000, layout) is first
    other = cache.get(encoder, 0x20000, layout)
    assert len(encoder.encoded) == 2 and bytes(other) != bytes(first)
    assert cache.origin(bytes(first)) == (0x10000, layout) and cache.origin(bytes(other)) == (0x20000, layout)
    assert cache.origin(b"\0" * TENSOR_MAP_BYTES) is None


def test_the_cache_starts_over_when_full(monkeypatch):
    monkeypatch.setattr(tensor_maps, "MAX_CACHED_MAPS", 3)
    cache, encoder = TensorMapCache(), CountingEncoder()
    layout = map_layout(_array((3, 1000, 16, 128)), BSHD, 128)
    first = cache.get(encoder, 0x10000, layout)
    for address in (0x20000, 0x30000, 0x40000):
        cache.get(encoder, address, layout)
    assert cache.origin(bytes(first)) is None, "emptied whole at the fourth map"
    cache.get(encoder, 0x10000, layout)
    assert len(encoder.encoded) == 5


# ---- the parameter struct ---------------------------------------------------------------------------


def test_tensor_maps_sit_on_64_byte_boundaries_after_the_struct_they_extend():
    cls = FLASH_FORWARD_TMA_PARAMS._ctypes_class
    base_bytes = FLASH_FORWARD_PARAMS.nbytes
    offsets = [getattr(cls, name).offset for name in ("q_map", "k_map", "v_map")]
    assert offsets[0] == -(-base_bytes // 64) * 64 and offsets == [offsets[0] + 128 * i for i in range(3)]
    assert FLASH_FORWARD_TMA_PARAMS.nbytes % 64 == 0
    for name, _ in FLASH_FORWARD_PARAMS.fields:
        assert getattr(cls, name).offset == getattr(FLASH_FORWARD_PARAMS._ctypes_class, name).offset
    declaration = FLASH_FORWARD_TMA_PARAMS.cpp_declaration()
    assert "struct FlashForwardTmaParams : FlashForwardParams {" in declaration
    assert "TensorMap q_map;" in declaration and "long long q_batch_stride" not in declaration


def test_a_struct_that_extends_another_must_start_with_its_fields():
    base = ParamsStruct("Base", (("x", "ptr"),))
    with pytest.raises(ValueError, match="must start with its fields"):
        ParamsStruct("Derived", (("y", "i32"), ("x", "ptr")), extends=base)
    derived = ParamsStruct.extending("Derived", base, (("m", TENSOR_MAP),))
    values = derived.new(x=1, m=TensorMapBytes.from_buffer_copy(bytes(range(128))))
    assert ctypes.sizeof(values) == 192 and bytes(values)[64:192] == bytes(range(128))


# ---- a replayed launch encodes the maps of its own arrays ------------------------------------------


class RecordingKernel:
    params = ParamsStruct.extending("MapParams", ParamsStruct("PlainParams", (("q", "const_ptr"), ("n", "i32"))),
                                    (("q_map", TENSOR_MAP),))

    def __init__(self):
        self.launched: list[ctypes.Structure] = []

    def launch(self, grid, block, shared_bytes, stream, params):
        self.launched.append(self.params._ctypes_class.from_buffer_copy(bytes(params)))


def test_a_replay_encodes_the_recorded_layout_at_the_new_address():
    encoder = CountingEncoder()
    fake = runtime.Runtime(backend=encoder)
    q = _array((3, 1000, 16, 128))
    layout = map_layout(q, BSHD, 128)
    kernel = RecordingKernel()
    params = kernel.params.new(q=q.ptr, n=7, q_map=fake.tensor_map(q.ptr, layout))
    plan = launch_plans.record([(kernel, (1, 1, 1), (384, 1, 1), 0, params)], (q,), (q,), ("q",), {}, (), runtime=fake)
    assert plan is not None and plan.launches[0].tensor_maps == ((type(params).q_map.offset, 0, layout),)
    plan.launches[0].run(0, [0x90000], 0)
    (replayed,) = kernel.launched
    assert replayed.q == 0x90000 and replayed.n == 7
    assert bytes(replayed.q_map) == bytes(fake.tensor_map(0x90000, layout))
    assert encoder.encoded == [(0x10000, layout), (0x90000, layout)]


def test_a_map_no_cache_knows_leaves_the_call_without_a_plan():
    q = _array((3, 1000, 16, 128))
    kernel = RecordingKernel()
    params = kernel.params.new(q=q.ptr, n=7, q_map=TensorMapBytes())
    assert launch_plans.record([(kernel, (1, 1, 1), (384, 1, 1), 0, params)], (q,), (q,), ("q",), {}, (),
                               runtime=runtime.Runtime(backend=CountingEncoder())) is None


# ---- the launcher's choice on Hopper -------------------------------------------------------------------


@pytest.fixture
def hopper(tmp_path):
    backend = HopperWithMaps()
    with runtime.installed(runtime.Runtime(backend, registry=Registry(backend, DiskCache(tmp_path)))):
        yield backend


def _launch_forward(q_strides=None, tiles=None):
    q = raw_array(0x100000, (2, 300, 8, 128), "bf16", 0, q_strides)
    k, v = (raw_array(ptr, (2, 300, 2, 128), "bf16", 0) for ptr in (0x400000, 0x500000))
    out = raw_array(0x600000, (2, 300, 8, 128), "bf16", 0)
    lse = raw_array(0x900000, (2, 8, 300), "fp32", 0)
    problem = problem_mod.describe(q, k, v, causal=True)
    flash.forward(problem, q, k, v, out, lse, 0, tiles=tiles)


def test_hopper_runs_the_warp_specialised_forward_with_maps_of_q_k_and_v(hopper):
    _launch_forward()
    ((function, grid, block, _, _, params),) = hopper.launches
    assert b"hipattn::flash_forward_warp_specialised<" in function[1], "the fake binary names its instantiation"
    # A causal batch's query tiles go in pairs to persistent blocks, one per SM: the fake device says one.
    assert block == (384, 1, 1) and grid == (1, 1, 1) and params.pair_query_tiles == 1
    assert [address for address, _ in hopper.maps.encoded] == [0x100000, 0x400000, 0x500000]
    for name, address in (("q_map", 0x100000), ("k_map", 0x400000), ("v_map", 0x500000)):
        assert bytes(getattr(params, name)).startswith(f"{address:x}|".encode())


def test_an_array_no_map_describes_takes_the_fa2_class_kernel(hopper):
    """A broadcast batch (stride 0) is valid input, and no tensor map takes it."""
    _launch_forward(q_strides=(0, 8 * 128, 128, 1))
    ((function, _, block, _, _, params),) = hopper.launches
    assert b"hipattn::flash_forward_wgmma<" in function[1] and block == (FLASH_FORWARD_WGMMA_TILES[128].threads, 1, 1)
    assert not hasattr(params, "q_map") and hopper.maps.encoded == []


def test_the_warp_specialised_tiles_asked_for_refuse_an_array_without_a_map(hopper):
    with pytest.raises(ValueError, match="stride no tensor map takes"):
        _launch_forward(q_strides=(0, 8 * 128, 128, 1), tiles=FLASH_FORWARD_WARP_SPECIALISED_TILES[128])
    assert hopper.launches == []


def _launch_backward(q_strides=None, tiles=None):
    q = raw_array(0x100000, (2, 300, 8, 128), "bf16", 0, q_strides)
    k, v = (raw_array(ptr, (2, 300, 2, 128), "bf16", 0) for ptr in (0x400000, 0x500000))
    out, dout, dq = (raw_array(ptr, (2, 300, 8, 128), "bf16", 0) for ptr in (0x600000, 0xa00000, 0xb00000))
    dk, dv = (raw_array(ptr, (2, 300, 2, 128), "bf16", 0) for ptr in (0xd00000, 0xe00000))
    lse, softmax_d = (raw_array(ptr, (2, 8, 300), "fp32", 0) for ptr in (0x900000, 0xf00000))
    problem = problem_mod.describe(q, k, v, causal=True)
    # The deterministic schedule: no dq_accum to clear (the fake backend has no memset).
    flash_backward.backward(problem, q, k, v, out, dout, lse, dq, dk, dv, 0, softmax_d=softmax_d,
                            deterministic=True, tiles=tiles)


def _dkdv_launch(backend):
    (launch,) = [launch for launch in backend.launches if b"flash_backward_dkdv" in launch[0][1]]
    return launch


def test_hopper_runs_the_warp_specialised_backward_with_maps_of_q_and_dout(hopper):
    _launch_backward()
    function, _, block, _, _, params = _dkdv_launch(hopper)
    assert b"hipattn::flash_backward_dkdv_warp_specialised<" in function[1] and block == (384, 1, 1)
    assert [address for address, _ in hopper.maps.encoded] == [0x100000, 0xa00000]
    for name, address in (("q_map", 0x100000), ("dout_map", 0xa00000)):
        assert bytes(getattr(params, name)).startswith(f"{address:x}|".encode())


def test_a_backward_array_no_map_describes_takes_the_kernel_whose_threads_copy(hopper):
    _launch_backward(q_strides=(0, 8 * 128, 128, 1))
    function, _, block, _, _, params = _dkdv_launch(hopper)
    assert b"hipattn::flash_backward_dkdv_wgmma<" in function[1] and block == (256, 1, 1)
    assert not hasattr(params, "q_map") and hopper.maps.encoded == []


def test_the_warp_specialised_backward_asked_for_refuses_an_array_without_a_map(hopper):
    tiles = (FLASH_BACKWARD_DKDV_WARP_SPECIALISED_TILES[128], FLASH_BACKWARD_MMA_TILES_HOPPER[128][1])
    with pytest.raises(ValueError, match="stride no tensor map takes"):
        _launch_backward(q_strides=(0, 8 * 128, 128, 1), tiles=tiles)
    assert hopper.launches == []


def test_a_layout_names_one_of_the_drivers_l2_promotions():
    with pytest.raises(ValueError, match="l2_promotion must be one of"):
        TensorMapLayout("bf16", (128, 16, 1000, 3), (256, 4096, 4096000), (64, 1, 128, 1), l2_promotion=512)
