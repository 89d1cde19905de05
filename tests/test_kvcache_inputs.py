"""flash_attn_with_kvcache's arguments on the host: each invalid call fails with a TypeError or
ValueError that names the argument, before anything is enqueued; a valid one launches the
copy-engine kernel over a persistent grid, or, where no tensor map can read the cache, the
thread-copy kernel over (sequences x KV heads, splits, query-row chunks).

Inputs are raw arrays at fake device addresses, each in its own range, on a fake sm_90a backend with
132 SMs that records launches and encodes maps that spell their address
(tests/support/fake_backend.py); no GPU is needed.
"""

from __future__ import annotations

import pytest
from support.fake_backend import HopperWithMaps

import hipattn
from hipattn import runtime
from hipattn.arrays import raw_array
from hipattn.device_array import contiguous_strides
from hipattn.jit.cache import DiskCache
from hipattn.jit.registry import Registry
from hipattn.ops import decode as decode_ops
from hipattn.ops import persistent


class H200(HopperWithMaps):
    def compute_units(self, device):
        return 132


@pytest.fixture
def backend(tmp_path, monkeypatch):
    fake = H200()
    monkeypatch.setattr(runtime, "_active", runtime.Runtime(fake, registry=Registry(fake, DiskCache(tmp_path))))
    return fake


class Addresses:
    """A fresh 1 MiB-aligned fake device range per array, so that no two overlap unless a test says so."""

    def __init__(self):
        self.next = 0x10_0000_0000

    def array(self, shape, dtype="bf16", strides=None, at=None):
        ptr = at if at is not None else self.next
        self.next += 1 << 30
        return raw_array(ptr, shape, dtype, 0, strides or contiguous_strides(shape))


def _call(**changes):
    """A valid call (batch 2, one query token, 8 query heads over 2 KV heads, head_dim 128, a
    512-token cache, device cache_seqlens), with ``changes`` applied to its arguments."""
    memory = Addresses()
    arguments = dict(q=memory.array((2, 1, 8, 128)), k_cache=memory.array((2, 512, 2, 128)),
                     v_cache=memory.array((2, 512, 2, 128)), cache_seqlens=memory.array((2,), "int32"),
                     out=memory.array((2, 1, 8, 128)))
    for name, value in changes.items():
        arguments[name] = value(memory, arguments) if callable(value) else value
    return arguments


INVALID = {
    "q dtype": (dict(q=lambda m, a: m.array((2, 1, 8, 128), "fp32")), TypeError, "q has dtype fp32"),
    "head_dim": (dict(q=lambda m, a: m.array((2, 1, 8, 48))), ValueError, "head_dim 48 is not one of"),
    "cache dtype": (dict(k_cache=lambda m, a: m.array((2, 512, 2, 128), "fp16")), TypeError, "k_cache has dtype fp16"),
    "v_cache shape": (dict(v_cache=lambda m, a: m.array((2, 256, 2, 128))), ValueError, "v_cache has shape"),
    "head groups": (dict(k_cache=lambda m, a: m.array((2, 512, 3, 128)), v_cache=lambda m, a: m.array((2, 512, 3, 128))),
                    ValueError, "multiple of the cache's"),
    "too few cache entries": (dict(k_cache=lambda m, a: m.array((1, 512, 2, 128)),
                                   v_cache=lambda m, a: m.array((1, 512, 2, 128))), ValueError, "pass cache_batch_idx"),
    "block_table dtype": (dict(block_table=lambda m, a: m.array((2, 2), "int64")), TypeError, "block_table has dtype int64"),
    "block_table shape": (dict(block_table=lambda m, a: m.array((3, 2), "int32")), ValueError, "block_table has shape"),
    "page size": (dict(k_cache=lambda m, a: m.array((8, 6, 2, 128)), v_cache=lambda m, a: m.array((8, 6, 2, 128)),
                       block_table=lambda m, a: m.array((2, 2), "int32")), ValueError, "page size of 6 tokens is not supported"),
    "batch index with pages": (dict(block_table=lambda m, a: m.array((2, 1), "int32"),
                                    cache_batch_idx=lambda m, a: m.array((2,), "int32")), ValueError,
                               "cache_batch_idx with paged KV"),
    "k without v": (dict(k=lambda m, a: m.array((2, 1, 2, 128))), ValueError, "both k and v"),
    "k shape": (dict(k=lambda m, a: m.array((2, 1, 4, 128)), v=lambda m, a: m.array((2, 1, 4, 128))), ValueError,
                "k has shape"),
    "cache_seqlens past the cache": (dict(cache_seqlens=512, k=lambda m, a: m.array((2, 1, 2, 128)),
                                          v=lambda m, a: m.array((2, 1, 2, 128))), ValueError,
                                     "cache_seqlens=512 plus 1 new tokens does not fit"),
    "cache_seqlens kind": (dict(cache_seqlens=3.0), TypeError, "cache_seqlens must be an int"),
    "cache_seqlens dtype": (dict(cache_seqlens=lambda m, a: m.array((2,), "int64")), TypeError,
                            "cache_seqlens has dtype int64"),
    "rotary without new tokens": (dict(rotary_cos=lambda m, a: m.array((512, 32)),
                                       rotary_sin=lambda m, a: m.array((512, 32))), ValueError, "needs the new k and v"),
    "rotary_dim": (dict(k=lambda m, a: m.array((2, 1, 2, 128)), v=lambda m, a: m.array((2, 1, 2, 128)),
                        rotary_cos=lambda m, a: m.array((512, 72)), rotary_sin=lambda m, a: m.array((512, 72))),
                   ValueError, "rotary_dim 144 must be in"),
    "rotary positions": (dict(k=lambda m, a: m.array((2, 1, 2, 128)), v=lambda m, a: m.array((2, 1, 2, 128)),
                              rotary_cos=lambda m, a: m.array((100, 32)), rotary_sin=lambda m, a: m.array((100, 32))),
                         ValueError, "rotary_cos has 100 positions"),
    "num_splits range": (dict(num_splits=129), ValueError, "num_splits is 129"),
    "num_splits kind": (dict(num_splits=True), TypeError, "num_splits must be an int"),
    "window kind": (dict(window_size=(4.0, 0)), TypeError, "window_size must be a pair of ints"),
    "softcap negative": (dict(softcap=-1.0), ValueError, "softcap is -1.0"),
    "softcap kind": (dict(softcap="30"), TypeError, "softcap must be a host number"),
    "alibi dtype": (dict(alibi_slopes=lambda m, a: m.array((8,), "bf16")), TypeError, "alibi_slopes has dtype bf16"),
    "alibi shape": (dict(alibi_slopes=lambda m, a: m.array((2, 4), "fp32")), ValueError, "alibi_slopes has shape"),
    "alibi device": (dict(alibi_slopes=lambda m, a: raw_array(m.array((8,), "fp32").ptr, (8,), "fp32", 1, (1,))),
                     ValueError, "alibi_slopes is on device 1"),
    "out over the slopes": (dict(alibi_slopes=lambda m, a: m.array((8,), "fp32", at=a["out"].ptr)), ValueError,
                            "out overlaps alibi_slopes"),
    "sink dtype": (dict(learnable_sink=lambda m, a: m.array((8,), "bf16")), TypeError, "learnable_sink has dtype bf16"),
    "sink shape": (dict(learnable_sink=lambda m, a: m.array((2, 8), "fp32")), ValueError, "learnable_sink has shape"),
    "out over the sinks": (dict(learnable_sink=lambda m, a: m.array((8,), "fp32", at=a["out"].ptr)), ValueError,
                           "out overlaps learnable_sink"),
    "lse without asking": (dict(lse=lambda m, a: m.array((2, 8, 1), "fp32")), ValueError, "return_softmax_lse is False"),
    "new keys inside the cache": (dict(k=lambda m, a: m.array((2, 1, 2, 128), at=a["k_cache"].ptr),
                                       v=lambda m, a: m.array((2, 1, 2, 128))), ValueError, "k_cache overlaps k"),
    "out inside the cache": (dict(out=lambda m, a: m.array((2, 1, 8, 128), at=a["v_cache"].ptr + 4096)), ValueError,
                             "out overlaps v_cache"),
}


@pytest.mark.parametrize("case", INVALID, ids=list(INVALID))
def test_an_invalid_call_names_its_argument_and_enqueues_nothing(backend, case):
    changes, error, message = INVALID[case]
    with pytest.raises(error, match=message):
        hipattn.flash_attn_with_kvcache(**_call(**changes))
    assert backend.launches == []


def _kernel_name(launch) -> str:
    return launch[0][1].split(b"|")[1].decode()


def _workspace():
    return raw_array(0x20_0000_0000, (1 << 20,), "uint8", 0)


def test_a_valid_call_launches_the_copy_engine_kernel_over_a_persistent_grid(backend):
    arguments = _call(num_splits=3)
    hipattn.flash_attn_with_kvcache(**arguments, workspace=_workspace())
    attention, (_, combine_grid, *_) = backend.launches
    _, grid, block, shared, _, params = attention
    assert _kernel_name(attention).startswith("hipattn::decode_forward_tma<")
    assert grid == (2 * 2 * 3, 1, 1), "a block per work item (sequence x KV head x split x row chunk), at most an SM each"
    assert block == (128 + 32, 1, 1) and shared > 0
    assert params.splits == 3 and params.heads_q == 8 and params.cache_capacity == 512
    assert bytes(params.k_map).startswith(f"{arguments['k_cache'].ptr:x}|(128, 2, 512, 2)|(64, 1, 64, 1)".encode())
    assert bytes(params.v_map).startswith(f"{arguments['v_cache'].ptr:x}|".encode())
    assert combine_grid == (2 * 8 * 1, 1, 1), "one combine block per query row"


def test_more_work_items_than_sms_share_the_sms_evenly(backend):
    hipattn.flash_attn_with_kvcache(**_call(q=lambda m, a: m.array((2, 1, 8, 128))), num_splits=40,
                                    workspace=_workspace())
    (_, grid, *_), _ = backend.launches
    assert grid == (80, 1, 1), "160 items on 132 SMs take two rounds: 80 blocks walk two items each"


@pytest.mark.parametrize("keys, splits", [(32768, 16), (131072, 16), (4096, 4), (1024, 1)])
def test_the_split_heuristic_leaves_no_sm_idle_that_a_full_wave_would_use(backend, keys, splits):
    """Batch 1, 32 query heads over 8 KV heads at head_dim 128: one copy-engine block an SM (its shared
    memory), 8 work items a split on 132 SMs. 16 splits (128 items) is the fewest whose wave is within
    5% of the best count's; FlashAttention-2's 85% took 14 (112) at 32k and 15 at 128k. Shorter
    caches get fewer splits, each keeping MIN_KEYS_PER_SPLIT keys."""
    cache = (1, keys, 8, 128)
    hipattn.flash_attn_with_kvcache(**_call(q=lambda m, a: m.array((1, 1, 32, 128)), k_cache=lambda m, a: m.array(cache),
                                            v_cache=lambda m, a: m.array(cache),
                                            cache_seqlens=lambda m, a: m.array((1,), "int32"),
                                            out=lambda m, a: m.array((1, 1, 32, 128))),
                                    workspace=_workspace())
    assert backend.launches[0][-1].splits == splits
    assert keys // splits >= decode_ops.MIN_KEYS_PER_SPLIT


@pytest.mark.parametrize("items, slots, blocks", [(4096, 264, 256), (512, 264, 256), (265, 264, 133),
                                                   (264, 264, 264), (100, 264, 100)])
def test_a_persistent_grid_is_the_fewest_blocks_that_finish_in_a_full_grids_rounds(items, slots, blocks):
    assert persistent.persistent_blocks(items, slots) == blocks
    rounds = -(-items // slots)
    assert (rounds - 1) * blocks < items <= rounds * blocks, "every block walks rounds or rounds - 1 items"


def test_the_cache_maps_ask_l2_for_no_more_than_the_copies_read(backend):
    hipattn.flash_attn_with_kvcache(**_call(num_splits=1))
    layouts = [layout for _, layout in backend.maps.encoded]
    assert len(layouts) == 2 and all(layout.l2_promotion == 0 for layout in layouts), layouts


def test_pages_that_split_a_tile_take_the_thread_copy_kernel(backend):
    """A 64-key tile must lie in one page for the copy engine's box; pages of 16 tokens take the
    kernel whose threads copy row by row, one block per (sequence x KV head, split, row chunk)."""
    paged = _call(k_cache=lambda m, a: m.array((64, 16, 2, 128)), v_cache=lambda m, a: m.array((64, 16, 2, 128)),
                  block_table=lambda m, a: m.array((2, 32), "int32"))
    hipattn.flash_attn_with_kvcache(**paged, num_splits=3, workspace=_workspace())
    attention, _ = backend.launches
    _, grid, block, *_ = attention
    assert _kernel_name(attention).startswith("hipattn::decode_forward_mma<")
    assert grid == (2 * 2, 3, 1) and block == (128, 1, 1)


def test_pages_of_whole_tiles_take_the_copy_engine_kernel_with_page_maps(backend):
    paged = _call(k_cache=lambda m, a: m.array((16, 64, 2, 128)), v_cache=lambda m, a: m.array((16, 64, 2, 128)),
                  block_table=lambda m, a: m.array((2, 8), "int32"))
    hipattn.flash_attn_with_kvcache(**paged, num_splits=1)
    (attention,) = backend.launches
    assert _kernel_name(attention).startswith("hipattn::decode_forward_tma<")
    assert bytes(attention[-1].k_map).startswith(f"{paged['k_cache'].ptr:x}|(128, 2, 64, 16)|".encode()), \
        "a map of [page, token, head, dim]: a box is 64 tokens of one page"


def test_a_cache_no_map_describes_takes_the_thread_copy_kernel(backend):
    """A map's strides are positive: a cache broadcast over its entries (stride 0) is read by the threads."""
    shared = (0, 2 * 128, 128, 1)
    hipattn.flash_attn_with_kvcache(**_call(k_cache=lambda m, a: m.array((2, 512, 2, 128), strides=shared),
                                            v_cache=lambda m, a: m.array((2, 512, 2, 128), strides=shared)),
                                     num_splits=1)
    (attention,) = backend.launches
    assert _kernel_name(attention).startswith("hipattn::decode_forward_mma<")


def test_score_modifiers_launch_the_modified_kernel_with_their_fields(backend):
    """softcap and per-sequence ALiBi slopes reach the kernel's fields, and pick its score_mods
    instantiation; a plain call keeps the plain one."""
    arguments = _call(softcap=30.0, alibi_slopes=lambda m, a: m.array((2, 8), "fp32"))
    hipattn.flash_attn_with_kvcache(**arguments, num_splits=1)
    hipattn.flash_attn_with_kvcache(**_call(), num_splits=1)
    (modified, *_, params), (plain, *_, plain_params) = backend.launches
    assert params.softcap == 30.0 and params.alibi_slopes == arguments["alibi_slopes"].ptr
    assert params.alibi_batch_stride == 8, "[batch, Hq] slopes: a sequence's row of 8 heads"
    assert plain_params.softcap == 0.0 and not plain_params.alibi_slopes
    name = modified[1].split(b"|")[1].decode()
    assert name.startswith("hipattn::decode_forward_tma<") and name.endswith("true>")
    assert plain[1].split(b"|")[1].decode().endswith("false>")


def test_sinks_reach_the_modified_kernel_and_the_combine(backend):
    arguments = _call(learnable_sink=lambda m, a: m.array((8,), "fp32"))
    hipattn.flash_attn_with_kvcache(**arguments, num_splits=3,
                                    workspace=raw_array(0x20_0000_0000, (1 << 20,), "uint8", 0))
    (attention, *_, params), (_, *_, combine_params) = backend.launches
    assert attention[1].split(b"|")[1].decode().endswith("true>"), "sinks take the modified instantiation"
    assert params.learnable_sink == combine_params.learnable_sink == arguments["learnable_sink"].ptr
