"""The general (flash) forward on the GPU, called through hipattn.ops.flash directly (so that every
case reaches it whatever dispatch would choose): against the float64 reference and against torch SDPA, fresh random inputs,
outputs poisoned with NaN first, every written element checked and every unwritten one left alone."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hipattn import arrays, runtime
from hipattn import problem as problem_mod
from hipattn.backends import get_backend
from hipattn.catalog.common import FLASH_HEAD_DIMS
from hipattn.catalog.flash_forward import (
    FLASH_FORWARD_MMA_TILES,
    FLASH_FORWARD_WARP_SPECIALISED_TILES,
    FLASH_FORWARD_WGMMA_TILES,
)
from hipattn.catalog.targets import runs_nvidia_wgmma
from hipattn.ops import flash
from hipattn.streams import on_device, resolve_stream

from . import conftest as gpu
from .reference import attention_reference, visible_keys

# Lengths that hit every edge: empty, one token, the small-seq tile (17) and one past it, a long
# sequence, and lengths that are not multiples of any tile (63, 65, 129, 200, 333). Q shorter and
# longer than KV both appear, as does a sequence with queries and no keys.
LENGTHS_Q = [0, 1, 17, 18, 1000, 65, 200, 129, 5, 333, 40]
LENGTHS_K = [9, 1, 18, 17, 1000, 63, 129, 200, 0, 40, 333]


def flash_forward(q, k, v, out, lse, *, stream=None, tiles=None, blocks=None, **call):
    """What attention.forward does, with ops.flash.forward in place of dispatch's choice. ``call``:
    describe_call's keyword arguments; ``tiles`` picks a kernel other than the device's own, ``blocks``
    the grid of a kernel whose blocks walk work items."""
    (qa, ka, va), sequences, problem = gpu.describe_call(q, k, v, **call)
    assert tuple(lse.shape) == problem_mod.lse_shape(problem)
    with on_device(get_backend(), problem.device):
        launch_stream = resolve_stream((qa, ka, va), stream, device=problem.device)
        flash.forward(problem, qa, ka, va, arrays.as_device_array(out, "out"), arrays.as_device_array(lse, "lse"),
                      launch_stream, tiles=tiles, blocks=blocks, **sequences)
    return problem


def sdpa_reference(q, k, v, cu_q, cu_k, *, causal, scale, window=(-1, -1)):
    """torch SDPA per sequence in the inputs' dtype, bottom-right causal mask or window; rows seeing no
    key are NaN."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)  # [H, Lq, D]
        ks = k[cu_k[b]:cu_k[b + 1]].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[cu_k[b]:cu_k[b + 1]].repeat_interleave(group, dim=1).transpose(0, 1)
        len_q, len_k = qs.shape[1], ks.shape[1]
        if len_q == 0:
            continue
        if len_k == 0:
            outs.append(torch.full((len_q, q.shape[1], q.shape[2]), float("nan"), dtype=q.dtype, device=q.device))
            continue
        mask = visible_keys(len_q, len_k, causal, window, q.device) if causal or window != (-1, -1) else None
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs) if outs else q[:0]


def _check(out, lse, q, k, v, cu_q, cu_k, *, causal, scale, dtype, case, window=(-1, -1), softcap=0.0, alibi=None):
    """Compare the written rows with both references (SDPA only without score modifiers); return the
    errors."""
    ref_out, ref_lse = attention_reference(q, k, v, cu_q, cu_k, causal=causal, scale=scale, window=window,
                                           softcap=softcap, alibi=alibi)
    assert not torch.isnan(out).any(), f"{case}: out has unwritten (NaN) elements"
    assert not torch.isnan(lse).any(), f"{case}: lse has unwritten (NaN) elements"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"{case}: lse is +inf on the wrong rows"
    assert bool((lse[torch.isinf(lse)] > 0).all()), f"{case}: an infinite lse is not +inf"
    empty_rows = torch.isinf(ref_lse).transpose(0, 1)  # [total_q, H]
    assert bool((out[empty_rows] == 0).all()), f"{case}: a row that sees no key is not 0"
    finite = ~torch.isinf(ref_lse)
    errors = {"out": gpu.relative_error(out, ref_out), "lse": gpu.relative_error(lse[finite], ref_lse[finite])}
    if softcap or alibi is not None:
        # SDPA has no softcap, and ALiBi as its float mask is rounded to the inputs' 16 bits: a bias of
        # hundreds loses whole units, far more than the kernels' error.
        gpu.record_errors(case, **errors)
        assert max(errors.values()) < gpu.TOLERANCE[dtype], (case, errors)
        return errors
    # Second, independent reference: SDPA in the same precision. hipattn may be at most about twice
    # as far from the float64 answer as SDPA is (flash-attn's criterion).
    sdpa = sdpa_reference(q, k, v, cu_q, cu_k, causal=causal, scale=scale, window=window)
    seen = ~empty_rows
    sdpa_error = gpu.relative_error(sdpa[seen], ref_out[seen])
    errors["out_vs_sdpa"] = gpu.relative_error(out[seen], sdpa[seen])
    gpu.record_errors(case, sdpa_to_float64=sdpa_error, **errors)
    assert max(errors.values()) < gpu.TOLERANCE[dtype], (case, errors)
    assert errors["out"] <= 2 * sdpa_error + gpu.TOLERANCE[dtype] / 10, (case, errors, sdpa_error)
    return errors


def _varlen_case(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal, rng, *, bound_slack=0,
                 tail_rows=0, tiles=None, blocks=None, case="", window=(-1, -1), softcap=0.0, alibi=None):
    """THD with cu_seqlens; `tail_rows` extra rows past the last sequence must stay untouched."""
    cu_q, cu_k = gpu.cumulative(lengths_q), gpu.cumulative(lengths_k)
    t = gpu.TORCH_DTYPE[dtype]
    q = torch.randn(cu_q[-1] + tail_rows, heads_q, head_dim, generator=rng, device="cuda").to(t)
    k = torch.randn(cu_k[-1] + tail_rows, heads_kv, head_dim, generator=rng, device="cuda").to(t)
    v = torch.randn(cu_k[-1] + tail_rows, heads_kv, head_dim, generator=rng, device="cuda").to(t)
    out = gpu.poisoned(q.shape, t)
    lse = gpu.poisoned((heads_q, q.shape[0]), torch.float32)
    scale = 1.0 / math.sqrt(head_dim)
    flash_forward(q, k, v, out, lse, cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                  cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
                  max_seqlen_q=max(lengths_q, default=0) + bound_slack,
                  max_seqlen_k=max(lengths_k, default=0) + bound_slack, causal=causal, tiles=tiles, blocks=blocks,
                  window_size=window,
                  softcap=softcap, alibi_slopes=alibi)
    torch.cuda.synchronize()
    nq, nk = cu_q[-1], cu_k[-1]
    assert torch.isnan(out[nq:]).all() and torch.isnan(lse[:, nq:]).all(), f"{case}: rows past the last sequence written"
    return _check(out[:nq], lse[:, :nq], q[:nq], k[:nk], v[:nk], cu_q, cu_k, causal=causal, scale=scale,
                  dtype=dtype, case=case, window=window, softcap=softcap, alibi=alibi)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_every_shipped_instantiation_matches_float64_and_sdpa(dtype, head_dim, causal, rng):
    _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 4, head_dim, dtype, causal, rng, tail_rows=3,
                 case=f"{dtype} d{head_dim} causal={causal}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_mma_sync_kernel_matches_float64_and_sdpa(dtype, head_dim, causal, rng):
    """The sm_80+ kernel that H100/H200 do not pick (they run wgmma), through its table row."""
    _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, dtype, causal, rng, tail_rows=3,
                 tiles=FLASH_FORWARD_MMA_TILES[head_dim], case=f"mma.sync {dtype} d{head_dim} causal={causal}")


def _hopper_rows_not_picked() -> list:
    """The sm_90a rows a call does not pick by default, each as pytest.param(head_dim, row): the
    FA2-class wgmma kernel where the warp-specialised one serves the head_dim, and the warp-specialised
    kernel with its consumers' ping-pong off (both kept: tools.sweep_flash_forward times them against
    the default)."""
    rows = []
    for head_dim, tiles in FLASH_FORWARD_WARP_SPECIALISED_TILES.items():
        rows.append(pytest.param(head_dim, FLASH_FORWARD_WGMMA_TILES[head_dim], id=f"fa2-class-wgmma-d{head_dim}"))
        if tiles.ping_pong:
            rows.append(pytest.param(head_dim, dataclasses.replace(tiles, ping_pong=False),
                                     id=f"no-ping-pong-d{head_dim}"))
    return rows


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,tiles", _hopper_rows_not_picked())
def test_the_hopper_kernels_a_call_does_not_pick_match_float64(head_dim, tiles, causal, rng):
    _needs_wgmma()
    _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, "bf16", causal, rng, tail_rows=3, tiles=tiles,
                 case=f"{tiles} causal={causal}")


def _needs_wgmma() -> None:
    if not runs_nvidia_wgmma(runtime.active().target(torch.cuda.current_device())):
        pytest.skip("the wgmma kernels run on sm_90a (H100, H200) only")


@pytest.mark.parametrize("softcap,alibi", [(0.0, None), (30.0, "sequences")], ids=["plain", "softcap-alibi"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [1, 3, 7])
@pytest.mark.parametrize("head_dim", sorted(FLASH_FORWARD_WARP_SPECIALISED_TILES))
def test_a_few_persistent_blocks_walk_every_item(head_dim, blocks, causal, softcap, alibi, rng):
    """The warp-specialised kernel's blocks walk work items blockIdx.x, + gridDim.x, ...: a grid of a few
    blocks over a varlen call's 352 items (empty ones, rows that see no key, partial tiles, Q longer and
    shorter than KV), so that its K/V ring and the consumers' turns run on across items and its two Q
    slots alternate; plain and modified instantiations."""
    _needs_wgmma()
    _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, "bf16", causal, rng, tail_rows=3, blocks=blocks,
                 softcap=softcap, alibi=gpu.alibi_slopes(alibi, len(LENGTHS_Q), 4),
                 case=f"d{head_dim} blocks={blocks} causal={causal} softcap={softcap} alibi={alibi}")


@pytest.mark.parametrize("window,causal", [((-1, -1), True), ((200, 0), True), ((100, 37), False)],
                         ids=["causal", "causal-window", "window"])
@pytest.mark.parametrize("blocks", [None, 1, 3], ids=["device-grid", "1-block", "3-blocks"])
@pytest.mark.parametrize("head_dim", sorted(FLASH_FORWARD_WARP_SPECIALISED_TILES))
def test_blocks_take_a_batchs_query_tiles_in_pairs(head_dim, blocks, window, causal, rng):
    """A batch of equal sequences under a causal mask or a window: persistent blocks take each head's
    query tiles in pairs from both ends (here an odd count, five, the middle one alone; Q shorter than
    KV), on the device's grid and on one and three blocks."""
    _needs_wgmma()
    block_m = FLASH_FORWARD_WARP_SPECIALISED_TILES[head_dim].block_m
    batch, heads, seqlen_q, seqlen_k = 3, 8, 5 * block_m - 3, 900
    q, k, v = gpu.bshd_inputs(batch, seqlen_q, seqlen_k, heads, 2, head_dim, "bf16", rng)
    out = gpu.poisoned(q.shape, q.dtype)
    lse = gpu.poisoned((batch, heads, seqlen_q), torch.float32)
    flash_forward(q, k, v, out, lse, causal=causal, window_size=window, blocks=blocks)
    torch.cuda.synchronize()
    lengths_q, lengths_k = [seqlen_q] * batch, [seqlen_k] * batch
    thd = [gpu.rows_of_each_sequence(x, n) for x, n in ((out, lengths_q), (q, lengths_q), (k, lengths_k), (v, lengths_k))]
    _check(thd[0], gpu.rows_of_each_sequence(lse, lengths_q, dim=1), *thd[1:], gpu.cumulative(lengths_q),
           gpu.cumulative(lengths_k), causal=causal, scale=1.0 / math.sqrt(head_dim), dtype="bf16", window=window,
           case=f"pairs d{head_dim} blocks={blocks} window={window} causal={causal}")


@pytest.mark.parametrize("head_dim", sorted(FLASH_FORWARD_WARP_SPECIALISED_TILES))
def test_a_batch_of_equal_sequences_runs_on_a_persistent_grid(head_dim, rng):
    """A non-causal BSHD call with more items than SMs: the device's grid is persistent (fewer blocks than
    items, each walking the same number give or take one), and every row is right."""
    _needs_wgmma()
    batch, seqlen, heads = 3, 1000, 16
    q, k, v = gpu.bshd_inputs(batch, seqlen, seqlen, heads, 4, head_dim, "bf16", rng)
    out = gpu.poisoned(q.shape, q.dtype)
    lse = gpu.poisoned((batch, heads, seqlen), torch.float32)
    problem = flash_forward(q, k, v, out, lse)
    tiles = FLASH_FORWARD_WARP_SPECIALISED_TILES[head_dim]
    items = flash.grid_blocks(problem, tiles.block_m)
    units = runtime.active().compute_units(problem.device)
    grid, paired = flash.forward_grid(problem, tiles, flash.EQUAL_ITEMS, units)
    assert items > units and grid <= units and -(-items // grid) == -(-items // units) and not paired
    torch.cuda.synchronize()
    lengths = [seqlen] * batch
    thd = [gpu.rows_of_each_sequence(x, lengths) for x in (out, q, k, v)]
    _check(thd[0], gpu.rows_of_each_sequence(lse, lengths, dim=1), *thd[1:], gpu.cumulative(lengths),
           gpu.cumulative(lengths), causal=False, scale=1.0 / math.sqrt(head_dim), dtype="bf16",
           case=f"persistent bshd d{head_dim}")


# flash-attn's sliding windows (-1: no bound on that side): a long left side with none on the right,
# both sides bounded (rows of the short-KV sequences see nothing, long rows skip key tiles at both
# ends), a one-tile band, and causal with a left side (a band under the diagonal).
WINDOWS = [((256, -1), False), ((100, 37), False), ((31, 31), False), ((200, 0), True), ((0, 0), True)]


@pytest.mark.parametrize("window,causal", WINDOWS)
@pytest.mark.parametrize("kernel", ["device's", "mma.sync"])
@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_sliding_windows_match_float64_and_sdpa(head_dim, kernel, window, causal, rng):
    """The window's key-tile range and its masks at both edges, on the kernel the device runs (wgmma on
    sm_90a) and on the mma.sync one, GQA, varlen with Q longer and shorter than KV."""
    tiles = FLASH_FORWARD_MMA_TILES[head_dim] if kernel == "mma.sync" else None
    _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, "bf16", causal, rng, tail_rows=3, tiles=tiles, window=window,
                 case=f"{kernel} d{head_dim} window={window} causal={causal}")


@pytest.mark.parametrize("softcap,alibi,causal,window", gpu.SCORE_MODS, ids=str)
@pytest.mark.parametrize("kernel", ["device's", "mma.sync"])
@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_score_modifiers_match_float64(head_dim, kernel, softcap, alibi, causal, window, rng):
    """Softcap and ALiBi in the forward's masked and unmasked tiles, on the kernel the device runs (wgmma
    on sm_90a) and on the mma.sync one, GQA, varlen with Q longer and shorter than KV."""
    tiles = FLASH_FORWARD_MMA_TILES[head_dim] if kernel == "mma.sync" else None
    _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, "bf16", causal, rng, tail_rows=3, tiles=tiles, window=window,
                 softcap=softcap, alibi=gpu.alibi_slopes(alibi, len(LENGTHS_Q), 4),
                 case=f"{kernel} d{head_dim} softcap={softcap} alibi={alibi} causal={causal} window={window}")


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (6, 1), (12, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_and_mqa(heads_q, heads_kv, causal, head_dim, rng):
    _varlen_case(LENGTHS_Q, LENGTHS_K, heads_q, heads_kv, head_dim, "bf16", causal, rng,
                 case=f"gqa {heads_q}/{heads_kv} d{head_dim} causal={causal}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths_q,lengths_k", [
    ([1000], [17]),  # Q much longer than KV: causal rows before 983 see nothing
    ([17], [1000]),  # Q much shorter: causal rows see all but the last keys
    ([1], [1]),
    ([127, 128, 129], [129, 128, 127]),  # one short of, exactly, one past BLOCK_M / 2 BLOCK_N
    # around the wgmma kernel's 192-row block (3 warpgroups): a last block whose second and third
    # warpgroups have no row, and causal blocks whose warpgroups see different numbers of key tiles
    ([191, 192, 193, 65, 129], [193, 192, 191, 300, 64]),
    ([0, 0, 3], [0, 5, 0]),
])
def test_lengths_around_the_tiles(lengths_q, lengths_k, causal, rng):
    for head_dim in (64, 128, 256):  # the tile shapes of the table: 3 warpgroups at 64 and 128, 2 at 256
        _varlen_case(lengths_q, lengths_k, 2, 2, head_dim, "bf16", causal, rng,
                     case=f"lengths {lengths_q}/{lengths_k} d{head_dim} causal={causal}")


def test_max_seqlen_is_an_upper_bound(rng):
    """A bound far above every real length launches idle blocks that must write nothing."""
    block_m = max(tiles.block_m for table in (FLASH_FORWARD_MMA_TILES, FLASH_FORWARD_WGMMA_TILES,
                                              FLASH_FORWARD_WARP_SPECIALISED_TILES) for tiles in table.values())
    _varlen_case([33, 250, 7], [250, 33, 7], 4, 2, 128, "bf16", True, rng, bound_slack=3 * block_m + 5,
                 tail_rows=2, case="bound slack")


def test_batch_zero_does_nothing(rng):
    q = torch.randn(0, 2, 64, device="cuda", dtype=torch.bfloat16)
    out = gpu.poisoned(q.shape, q.dtype)
    lse = gpu.poisoned((2, 0), torch.float32)
    cu = torch.zeros(1, dtype=torch.int32, device="cuda")
    flash_forward(q, q, q, out, lse, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=0, max_seqlen_k=0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_bshd_with_and_without_seqused(dtype, causal, rng):
    q, k, v = gpu.bshd_inputs(4, 300, 211, 4, 2, 128, dtype, rng)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for lq, lk, seqused in gpu.with_and_without_seqused(q, k, [300, 0, 17, 129], [211, 5, 0, 64]):
        out = gpu.poisoned(q.shape, q.dtype)
        lse = gpu.poisoned((q.shape[0], q.shape[2], q.shape[1]), torch.float32)
        flash_forward(q, k, v, out, lse, causal=causal, **seqused)
        torch.cuda.synchronize()
        for b in range(q.shape[0]):  # rows past seqused are not written
            assert torch.isnan(out[b, lq[b]:]).all() and torch.isnan(lse[b, :, lq[b]:]).all()
        thd = [gpu.rows_of_each_sequence(x, n) for x, n in ((out, lq), (q, lq), (k, lk), (v, lk))]
        _check(thd[0], gpu.rows_of_each_sequence(lse, lq, dim=1), *thd[1:], gpu.cumulative(lq), gpu.cumulative(lk),
               causal=causal, scale=scale, dtype=dtype, case=f"bshd {dtype} causal={causal} seqused={bool(seqused)}")


def test_softmax_scale_is_honoured(rng):
    lengths = [129, 300]
    cu = gpu.cumulative(lengths)
    q = torch.randn(cu[-1], 4, 64, generator=rng, device="cuda").bfloat16()
    k, v = gpu.randn_like(q, rng), gpu.randn_like(q, rng)
    out = gpu.poisoned(q.shape, q.dtype)
    lse = gpu.poisoned((4, cu[-1]), torch.float32)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    flash_forward(q, k, v, out, lse, cu_seqlens_q=cu_dev, cu_seqlens_k=cu_dev, max_seqlen_q=300, max_seqlen_k=300,
                  softmax_scale=0.3)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, cu, cu, causal=False, scale=0.3, dtype="bf16", case="softmax_scale 0.3")


def test_graph_replays_new_cu_seqlens(rng):
    """Capture once with capacity bounds; replay with new lengths written into the same buffers."""
    batch, heads, head_dim, capacity_per_sequence = 6, 4, 128, 700
    capacity = batch * capacity_per_sequence
    t = torch.bfloat16
    q = torch.empty(capacity, heads, head_dim, dtype=t, device="cuda")
    k, v = torch.empty_like(q), torch.empty_like(q)
    out = torch.empty_like(q)
    lse = torch.empty(heads, capacity, dtype=torch.float32, device="cuda")
    cu_q = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=capacity_per_sequence,
                max_seqlen_k=capacity_per_sequence, causal=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        flash_forward(q, k, v, out, lse, **args)  # warm: compile and load outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        flash_forward(q, k, v, out, lse, **args)
    for replay in range(3):
        gen = torch.Generator().manual_seed(1000 + replay + gpu.fresh_seed() % 1000)
        lengths_q = torch.randint(0, capacity_per_sequence + 1, (batch,), generator=gen).tolist()
        lengths_k = torch.randint(0, capacity_per_sequence + 1, (batch,), generator=gen).tolist()
        host_q, host_k = gpu.cumulative(lengths_q), gpu.cumulative(lengths_k)
        cu_q.copy_(torch.tensor(host_q, dtype=torch.int32))
        cu_k.copy_(torch.tensor(host_k, dtype=torch.int32))
        for buffer in (q, k, v):
            buffer.normal_(generator=rng)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        nq, nk = host_q[-1], host_k[-1]
        _check(out[:nq], lse[:, :nq], q[:nq], k[:nk], v[:nk], host_q, host_k, causal=True,
               scale=1 / math.sqrt(head_dim), dtype="bf16", case=f"graph replay {replay}")
        assert torch.isnan(out[nq:]).all()


def test_many_sequences_put_the_count_on_grid_x(rng):
    """More than 65535 (sequence, head) pairs of two query tiles each: no grid.y/z limit is hit."""
    batch, heads, head_dim, length = 20_000, 4, 64, 130
    q = torch.randn(batch * length, heads, head_dim, generator=rng, device="cuda").bfloat16()
    out = gpu.poisoned(q.shape, q.dtype)
    lse = gpu.poisoned((heads, q.shape[0]), torch.float32)
    cu = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device="cuda")
    flash_forward(q, q, q, out, lse, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length, max_seqlen_k=length)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for b in (0, 12_345, batch - 1):
        rows = slice(b * length, (b + 1) * length)
        ref, _ = attention_reference(q[rows], q[rows], q[rows], [0, length], [0, length], causal=False,
                                     scale=1 / math.sqrt(head_dim))
        assert gpu.relative_error(out[rows], ref) < gpu.TOLERANCE["bf16"]
