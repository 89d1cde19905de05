"""The general (flash) backward on the GPU, called through hipattn.ops.flash_backward directly (so that
every case reaches it whatever dispatch would choose; tests/gpu/test_flash_dispatch.py goes through
hipattn.backward): O and LSE from the flash forward, then dQ, dK and dV against float64
autograd through the reference attention, fresh random inputs, gradients poisoned with NaN first,
every written element checked and every unwritten one left alone. Both schedules run: the atomic dQ
(deterministic=False) and the two-kernel deterministic one. THD calls give the dK/dV kernel its
work list (varlen_records, prepared the HIPATTN_VARLEN_PREP way) unless a test asks for the grid
sized from max_seqlen_k."""

from __future__ import annotations

import math

import pytest
import torch

from hipattn import runtime
from hipattn.catalog.common import FLASH_HEAD_DIMS
from hipattn.catalog.flash_backward import (
    FLASH_BACKWARD_DKDV_WARP_SPECIALISED_TILES,
    FLASH_BACKWARD_DKDV_WGMMA_TILES,
    dq_kernel_always,
    mma_tiles_for,
    tiles_for,
)

from .conftest import (
    ROW_TOLERANCE_FACTOR,
    SCORE_MODS,
    TOLERANCE,
    TORCH_DTYPE,
    alibi_slopes,
    bshd_inputs,
    cumulative,
    flash_forward_backward,
    poisoned,
    randn_like,
    record_errors,
    relative_error,
    rows_of_each_sequence,
    with_and_without_seqused,
    worst_row_error,
)
from .reference import attention_reference

# Lengths that hit every edge: empty on either side (queries with no key, keys with no query), one
# token, 17/18 around the small-seq tile, and lengths that are not multiples of any tile (63, 65,
# 129, 200); Q shorter and longer than KV both appear.
LENGTHS_Q = [0, 1, 17, 18, 63, 65, 129, 200, 5, 0, 40]
LENGTHS_K = [9, 1, 18, 17, 65, 63, 200, 129, 0, 0, 31]


def _check_gradients(dq, dk, dv, q, k, v, dout, cu_q, cu_k, *, causal, scale, dtype, case, out=None,
                     softmax_d=None, window=(-1, -1), softcap=0.0, alibi=None):
    """Compare the written rows (THD, exactly the sequences' rows) with float64 autograd.

    Given the forward's ``out`` and the backward's ``softmax_d`` (THD, [Hq, total_q]), those are
    checked too: O against float64, Delta against rowsum(dout * out) of that O, so that a wrong
    gradient is traced to the stage that went wrong."""
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_reference(q, k, v, cu_q, cu_k, causal=causal, scale=scale,
                                                                   dout=dout, window=window, softcap=softcap,
                                                                   alibi=alibi)
    stages = {}
    if out is not None:
        stages["out"] = relative_error(out, ref_out)
    if softmax_d is not None:
        stages["delta"] = relative_error(softmax_d, (dout.double() * out.double()).sum(-1).transpose(0, 1))
    if stages:
        record_errors(case, **stages)
        assert max(stages.values()) < TOLERANCE[dtype], (case, stages)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{case}: {name} has unwritten (NaN) elements"
    # A row that sees no key has dQ = 0 exactly; the keys of a sequence without queries dK = dV = 0.
    empty_rows = torch.isinf(ref_lse).transpose(0, 1)  # [total_q, Hq]
    assert bool((dq[empty_rows] == 0).all()), f"{case}: dq of a row that sees no key is not 0"
    for b in range(len(cu_q) - 1):
        if cu_q[b + 1] == cu_q[b]:
            keys = slice(cu_k[b], cu_k[b + 1])
            assert bool((dk[keys] == 0).all() and (dv[keys] == 0).all()), f"{case}: unseen keys' dk/dv are not 0"
    errors = {"dq": relative_error(dq, ref_dq), "dk": relative_error(dk, ref_dk), "dv": relative_error(dv, ref_dv)}
    row_errors = {f"{name}_worst_row": worst_row_error(t, ref)
                  for name, t, ref in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv))}
    record_errors(case, **errors, **row_errors)
    assert max(errors.values()) < TOLERANCE[dtype], (case, errors)
    assert max(row_errors.values()) < ROW_TOLERANCE_FACTOR * TOLERANCE[dtype], (case, row_errors)
    return errors


def _adds_dq_atomically(head_dim, deterministic, tiles):
    """The call's dQ schedule, as hipattn.ops.flash_backward picks it (a tiles override keeps the one
    `deterministic` names; otherwise the device's rows may take the dQ kernel in every call)."""
    if deterministic:
        return False
    return tiles is not None or not dq_kernel_always(head_dim, runtime.active().target(torch.cuda.current_device()))


def _check_rows_past_the_end(dq, dk, dv, nq, nk, atomic_dq, case):
    """Rows past the last sequence: dK, dV never written; dQ neither by the dQ kernel, while the atomic
    schedule's convert_dq writes every row of dq (zeros there)."""
    assert torch.isnan(dk[nk:]).all() and torch.isnan(dv[nk:]).all(), f"{case}: dk/dv rows past the end written"
    if atomic_dq:
        assert bool((dq[nq:] == 0).all()), f"{case}: convert_dq left dq rows past the end non-zero"
    else:
        assert torch.isnan(dq[nq:]).all(), f"{case}: dq rows past the end written"


def _varlen_case(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal, rng, *, deterministic=False,
                 bound_slack=0, tail_rows=0, work_list=True, tiles=None, case="", window=(-1, -1), softcap=0.0,
                 alibi=None):
    """THD with cu_seqlens; `tail_rows` extra rows past the last sequence must stay untouched. ``softcap``
    and ``alibi`` (slopes [Hq] or [batch, Hq] on the GPU): flash-attn's score modifiers."""
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    t = TORCH_DTYPE[dtype]
    q = torch.randn(cu_q[-1] + tail_rows, heads_q, head_dim, generator=rng, device="cuda").to(t)
    k = torch.randn(cu_k[-1] + tail_rows, heads_kv, head_dim, generator=rng, device="cuda").to(t)
    v = torch.randn(cu_k[-1] + tail_rows, heads_kv, head_dim, generator=rng, device="cuda").to(t)
    dout = torch.randn(q.shape, generator=rng, device="cuda").to(t)
    dq, dk, dv = (poisoned(x.shape, t) for x in (q, k, v))
    scale = 1.0 / math.sqrt(head_dim)
    out, _, softmax_d = flash_forward_backward(
        q, k, v, dout, dq, dk, dv, cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
        max_seqlen_q=max(lengths_q, default=0) + bound_slack, max_seqlen_k=max(lengths_k, default=0) + bound_slack,
        causal=causal, deterministic=deterministic, work_list=work_list, tiles=tiles, window_size=window,
        softcap=softcap, alibi_slopes=alibi)
    torch.cuda.synchronize()
    nq, nk = cu_q[-1], cu_k[-1]
    _check_rows_past_the_end(dq, dk, dv, nq, nk, _adds_dq_atomically(head_dim, deterministic, tiles), case)
    return _check_gradients(dq[:nq], dk[:nk], dv[:nk], q[:nq], k[:nk], v[:nk], dout[:nq], cu_q, cu_k, causal=causal,
                            scale=scale, dtype=dtype, case=case, out=out[:nq], softmax_d=softmax_d[:, :nq],
                            window=window, softcap=softcap, alibi=alibi)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_every_shipped_instantiation_matches_float64(dtype, head_dim, causal, deterministic, rng):
    _varlen_case(LENGTHS_Q, LENGTHS_K, 2, 2, head_dim, dtype, causal, rng, deterministic=deterministic, tail_rows=3,
                 case=f"{dtype} d{head_dim} causal={causal} deterministic={deterministic}")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", sorted(FLASH_BACKWARD_DKDV_WGMMA_TILES))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_mma_sync_dkdv_kernel_matches_float64(dtype, head_dim, causal, deterministic, rng):
    """These head_dims run the wgmma dK/dV kernel on sm_90a; their mma.sync rows (what every other
    sm_80+ part runs) are checked here too, through the tiles override."""
    tiles = mma_tiles_for(head_dim, runtime.active().target(0))
    _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, dtype, causal, rng, deterministic=deterministic, tail_rows=3,
                 tiles=tiles, case=f"mma.sync {dtype} d{head_dim} causal={causal} deterministic={deterministic}")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", sorted(FLASH_BACKWARD_DKDV_WARP_SPECIALISED_TILES))
def test_the_wgmma_dkdv_kernel_whose_threads_copy_matches_float64(head_dim, causal, deterministic, rng):
    """These head_dims run the warp-specialised dK/dV kernel on sm_90a where Q and dO have tensor maps;
    the kernel whose every thread copies, which arrays without maps take, is checked here through the
    tiles override."""
    tiles = tiles_for(head_dim, runtime.active().target(0), tensor_maps=False)
    assert tiles[0].family.name == "flash_backward_dkdv_wgmma"
    _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, "bf16", causal, rng, deterministic=deterministic, tail_rows=3,
                 tiles=tiles, case=f"wgmma d{head_dim} causal={causal} deterministic={deterministic}")


@pytest.mark.parametrize("window,causal", [((256, -1), False), ((100, 37), False), ((31, 31), False),
                                           ((200, 0), True)])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_sliding_windows_match_float64(head_dim, deterministic, window, causal, rng):
    """flash-attn's windows (-1: no bound on that side) through both dQ schedules: the dK/dV kernels'
    query-tile range (rows_seeing) and masks, the dQ kernel's key-tile range; GQA; keys no query sees
    get dK = dV = 0. On sm_90a head_dim 128 also runs its mma.sync dK/dV row."""
    _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, "bf16", causal, rng, deterministic=deterministic, tail_rows=3,
                 window=window, case=f"d{head_dim} window={window} causal={causal} deterministic={deterministic}")
    if head_dim == 128:
        _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, 128, "bf16", causal, rng, deterministic=deterministic, tail_rows=3,
                     window=window, tiles=mma_tiles_for(128, runtime.active().target(0)),
                     case=f"mma.sync d128 window={window} causal={causal} deterministic={deterministic}")


@pytest.mark.parametrize("softcap,alibi,causal,window", SCORE_MODS, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
def test_score_modifiers_match_float64(head_dim, deterministic, softcap, alibi, causal, window, rng):
    """Softcap (dS times 1 - tanh²) and ALiBi through both dQ schedules; GQA. On sm_90a head_dim 128 also
    runs its mma.sync dK/dV row."""
    slopes = alibi_slopes(alibi, len(LENGTHS_Q), 4)
    case = f"d{head_dim} softcap={softcap} alibi={alibi} causal={causal} window={window} deterministic={deterministic}"
    _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, head_dim, "bf16", causal, rng, deterministic=deterministic, tail_rows=3,
                 window=window, softcap=softcap, alibi=slopes, case=case)
    if head_dim == 128:
        _varlen_case(LENGTHS_Q, LENGTHS_K, 4, 2, 128, "bf16", causal, rng, deterministic=deterministic, tail_rows=3,
                     window=window, softcap=softcap, alibi=slopes, tiles=mma_tiles_for(128, runtime.active().target(0)),
                     case="mma.sync " + case)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])  # 256: on sm_90a two warpgroups share each key tile
def test_gqa_and_mqa_sum_kv_gradients_over_the_group(heads_q, heads_kv, causal, head_dim, rng):
    for deterministic in (False, True):
        _varlen_case(LENGTHS_Q, LENGTHS_K, heads_q, heads_kv, head_dim, "bf16", causal, rng,
                     deterministic=deterministic, tail_rows=2,
                     case=f"gqa {heads_q}/{heads_kv} d{head_dim} causal={causal} deterministic={deterministic}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths_q,lengths_k", [
    ([1000], [17]),  # Q much longer than KV: causal rows before 983 see nothing
    ([17], [1000]),  # Q much shorter: every key tile but the last is seen by all rows
    ([1], [1]),
    ([127, 128, 129], [129, 128, 127]),  # one short of, exactly, one past the tile multiples
    # the wgmma dK/dV kernel's 128-key block: a last block whose second warpgroup has no key, or a few
    ([63, 64, 65, 191], [64, 63, 193, 65]),
    ([0, 0, 3], [0, 5, 0]),
])
def test_lengths_around_the_tiles(lengths_q, lengths_k, causal, rng):
    for head_dim in (64, 128, 256):  # the tile shapes at the ends of the tables, and the wgmma kernel's
        for deterministic in (False, True):
            _varlen_case(lengths_q, lengths_k, 2, 1, head_dim, "bf16", causal, rng, deterministic=deterministic,
                         case=f"lengths {lengths_q}/{lengths_k} d{head_dim} causal={causal} det={deterministic}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_a_long_sequence_walks_many_tiles(head_dim, causal, rng):
    for deterministic in (False, True):
        _varlen_case([1000, 777], [1000, 1200], 4, 2, head_dim, "bf16", causal, rng, deterministic=deterministic,
                     case=f"long d{head_dim} causal={causal} deterministic={deterministic}")


@pytest.mark.parametrize("work_list", [True, False])
def test_max_seqlen_is_an_upper_bound(work_list, rng):
    """A bound far above every real length launches idle blocks that must write nothing: with the
    work list (blocks past its end) and with the grid sized from max_seqlen_k."""
    slack = 3 * max(tiles_for(head_dim, runtime.active().target(0))[0].block_n for head_dim in FLASH_HEAD_DIMS) + 5
    for deterministic in (False, True):
        _varlen_case([33, 250, 7], [250, 33, 7], 4, 2, 128, "bf16", True, rng, deterministic=deterministic,
                     bound_slack=slack, tail_rows=2, work_list=work_list,
                     case=f"bound slack deterministic={deterministic} work_list={work_list}")


@pytest.mark.parametrize("deterministic", [False, True])
def test_keys_without_queries_get_zero_gradients(deterministic, rng):
    """max_seqlen_q 0 with keys present: the forward does nothing, the backward still zeroes dK, dV."""
    q = torch.empty(0, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(7, 2, 64, generator=rng, device="cuda").bfloat16()
    v = randn_like(k, rng)
    dq, dk, dv = poisoned(q.shape, q.dtype), poisoned(k.shape, k.dtype), poisoned(v.shape, v.dtype)
    flash_forward_backward(q, k, v, torch.empty_like(q), dq, dk, dv,
                           cu_seqlens_q=torch.zeros(2, dtype=torch.int32, device="cuda"),
                           cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32, device="cuda"),
                           max_seqlen_q=0, max_seqlen_k=7, deterministic=deterministic)
    torch.cuda.synchronize()
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


@pytest.mark.parametrize("deterministic", [False, True])
def test_batch_zero_does_nothing(deterministic):
    q = torch.randn(0, 2, 64, device="cuda", dtype=torch.bfloat16)
    dq, dk, dv = (poisoned(q.shape, q.dtype) for _ in range(3))
    cu = torch.zeros(1, dtype=torch.int32, device="cuda")
    flash_forward_backward(q, q, q, q, dq, dk, dv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=0, max_seqlen_k=0,
                           deterministic=deterministic)
    torch.cuda.synchronize()


# Grouped-query heads under a causal mask: the dK/dV grid takes key tile first at head_dim 128 and key
# tile fastest at 256 (flash/backward_common.h key_block_of).
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_bshd_with_and_without_seqused(dtype, causal, head_dim, rng):
    q, k, v = bshd_inputs(4, 300, 211, 4, 2, head_dim, dtype, rng)
    dout = randn_like(q, rng)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for lq, lk, seqused in with_and_without_seqused(q, k, [300, 0, 17, 129], [211, 5, 0, 64]):
        for deterministic in (False, True):
            dq, dk, dv = (poisoned(x.shape, x.dtype) for x in (q, k, v))
            flash_forward_backward(q, k, v, dout, dq, dk, dv, causal=causal, deterministic=deterministic, **seqused)
            torch.cuda.synchronize()
            case = f"bshd {dtype} d{head_dim} causal={causal} seqused={bool(seqused)} deterministic={deterministic}"
            for b in range(q.shape[0]):  # rows past seqused: dK, dV never written; dQ see _check_rows_past_the_end
                assert torch.isnan(dk[b, lk[b]:]).all() and torch.isnan(dv[b, lk[b]:]).all(), case
                if deterministic:
                    assert torch.isnan(dq[b, lq[b]:]).all(), case
            thd = [rows_of_each_sequence(x, n) for x, n in
                   ((dq, lq), (dk, lk), (dv, lk), (q, lq), (k, lk), (v, lk), (dout, lq))]
            _check_gradients(*thd, cumulative(lq), cumulative(lk), causal=causal, scale=scale, dtype=dtype,
                             case=case)


# One head per block under a causal mask: the dK/dV grid takes key tile first at head_dim 64 once a
# sequence has 16 key tiles of 128 (2,100 keys: 17), key tile fastest below (600 keys: 5)
# (flash/backward_common.h key_block_of).
@pytest.mark.parametrize("seqlen", [600, 2100])
def test_mha_causal_bshd_reaches_every_key_tile(seqlen, rng):
    q, k, v = bshd_inputs(2, seqlen, seqlen, 2, 2, 64, "bf16", rng)
    dout = randn_like(q, rng)
    lengths = [seqlen, seqlen]
    for deterministic in (False, True):
        dq, dk, dv = (poisoned(x.shape, x.dtype) for x in (q, k, v))
        flash_forward_backward(q, k, v, dout, dq, dk, dv, causal=True, deterministic=deterministic)
        torch.cuda.synchronize()
        thd = [rows_of_each_sequence(x, lengths) for x in (dq, dk, dv, q, k, v, dout)]
        _check_gradients(*thd, cumulative(lengths), cumulative(lengths), causal=True, scale=1.0 / math.sqrt(64),
                         dtype="bf16", case=f"mha bshd causal S{seqlen} deterministic={deterministic}")


def test_softmax_scale_is_honoured(rng):
    lengths = [129, 300]
    cu = cumulative(lengths)
    q = torch.randn(cu[-1], 4, 64, generator=rng, device="cuda").bfloat16()
    k, v, dout = randn_like(q, rng), randn_like(q, rng), randn_like(q, rng)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    for deterministic in (False, True):
        dq, dk, dv = (poisoned(x.shape, x.dtype) for x in (q, k, v))
        out, _, softmax_d = flash_forward_backward(q, k, v, dout, dq, dk, dv, cu_seqlens_q=cu_dev, cu_seqlens_k=cu_dev,
                                                   max_seqlen_q=300, max_seqlen_k=300, softmax_scale=0.3,
                                                   deterministic=deterministic)
        torch.cuda.synchronize()
        _check_gradients(dq, dk, dv, q, k, v, dout, cu, cu, causal=False, scale=0.3, dtype="bf16",
                         case=f"softmax_scale 0.3 deterministic={deterministic}", out=out, softmax_d=softmax_d)


def test_one_hot_rows_match_flash_attention_2s_arithmetic(rng):
    """k == q and scale 0.3: every row puts probability ~1 on its own key. The true dS is then far
    below the rounding of the 16-bit O that D = rowsum(dO * O) comes from, so dQ and dK are compared
    with float64 arithmetic fed the same rounded O (what FlashAttention-2 computes), and dV, which
    does not involve D, with the exact gradient."""
    lengths, heads, head_dim, scale = [129, 300], 4, 64, 0.3
    cu = cumulative(lengths)
    q = torch.randn(cu[-1], heads, head_dim, generator=rng, device="cuda").bfloat16()
    v, dout = randn_like(q, rng), randn_like(q, rng)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    for deterministic in (False, True):
        dq, dk, dv = (poisoned(q.shape, q.dtype) for _ in range(3))
        out, _, _ = flash_forward_backward(q, q, v, dout, dq, dk, dv, cu_seqlens_q=cu_dev, cu_seqlens_k=cu_dev,
                                           max_seqlen_q=300, max_seqlen_k=300, softmax_scale=scale,
                                           deterministic=deterministic)
        torch.cuda.synchronize()
        case = f"one-hot rows deterministic={deterministic}"
        expected = {"dq": [], "dk": []}
        for start, end in zip(cu[:-1], cu[1:], strict=True):
            qs, vs, dos, os = (x[start:end].double() for x in (q, v, dout, out))
            probabilities = torch.softmax(torch.einsum("ihd,jhd->hij", qs, qs) * scale, dim=-1)
            dp = torch.einsum("ihd,jhd->hij", dos, vs)
            ds = probabilities * (dp - (dos * os).sum(-1).transpose(0, 1)[..., None])
            expected["dq"].append(scale * torch.einsum("hij,jhd->ihd", ds, qs))
            expected["dk"].append(scale * torch.einsum("hij,ihd->jhd", ds, qs))
        errors = {name: relative_error(actual, torch.cat(expected[name])) for name, actual in (("dq", dq), ("dk", dk))}
        _, _, _, _, ref_dv = attention_reference(q, q, v, cu, cu, causal=False, scale=scale, dout=dout)
        errors["dv"] = relative_error(dv, ref_dv)
        record_errors(case, **errors)
        assert max(errors.values()) < TOLERANCE["bf16"], (case, errors)


@pytest.mark.parametrize("head_dim", [128, 256])  # on sm_90a: the wgmma dK/dV kernel split by keys, by columns
def test_deterministic_is_bit_identical_run_to_run(head_dim, rng):
    """Three backward runs on one forward's output: identical bits, and close to float64."""
    lengths_q, lengths_k = [700, 65, 0, 333], [512, 129, 40, 333]
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    q = torch.randn(cu_q[-1], 8, head_dim, generator=rng, device="cuda").bfloat16()
    k = torch.randn(cu_k[-1], 2, head_dim, generator=rng, device="cuda").bfloat16()
    v, dout = randn_like(k, rng), randn_like(q, rng)
    args = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
                max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), causal=True, deterministic=True)
    runs = []
    out = lse = None
    for _ in range(3):
        dq, dk, dv = (poisoned(x.shape, x.dtype) for x in (q, k, v))
        out, lse, _ = flash_forward_backward(q, k, v, dout, dq, dk, dv, out=out, lse=lse, **args)
        torch.cuda.synchronize()
        runs.append((dq, dk, dv))
    for dq, dk, dv in runs[1:]:
        assert torch.equal(dq, runs[0][0]) and torch.equal(dk, runs[0][1]) and torch.equal(dv, runs[0][2])
    _check_gradients(*runs[0], q, k, v, dout, cu_q, cu_k, causal=True, scale=1 / math.sqrt(head_dim), dtype="bf16",
                     case=f"deterministic repeat d{head_dim}")
