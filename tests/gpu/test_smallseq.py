"""Small-seq forward and backward on the GPU against the float64 reference, fresh random inputs,
outputs poisoned with NaN first, every element checked."""

from __future__ import annotations

import math

import pytest
import torch

import hipattn
from hipattn import runtime
from hipattn.catalog import smallseq
from hipattn.catalog.smallseq import SmallSeqBackwardMmaTiles, SmallSeqForwardMmaTiles, SmallSeqMmaTiles
from hipattn.catalog.smallseq_common import SMALLSEQ_HEAD_DIMS, SMALLSEQ_SHIPPED_HEADS, SMALLSEQ_TILE

from .conftest import (
    ROW_TOLERANCE_FACTOR,
    SCORE_MODS,
    TOLERANCE,
    TORCH_DTYPE,
    alibi_slopes,
    fresh_seed,
    poisoned,
    randn_like,
    record_errors,
    relative_error,
    worst_row_error,
)
from .reference import attention_reference


def _varlen(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, rng):
    cu_q = [0]
    cu_k = [0]
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    t = TORCH_DTYPE[dtype]
    q = torch.randn(cu_q[-1], heads_q, head_dim, generator=rng, device="cuda").to(t)
    k = torch.randn(cu_k[-1], heads_kv, head_dim, generator=rng, device="cuda").to(t)
    v = torch.randn(cu_k[-1], heads_kv, head_dim, generator=rng, device="cuda").to(t)
    return q, k, v, cu_q, cu_k


def _run_and_check(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal, rng, *, bound=SMALLSEQ_TILE,
                   window=(-1, -1), softcap=0.0, alibi=None):
    q, k, v, cu_q, cu_k = _varlen(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, rng)
    cu_q_dev = torch.tensor(cu_q, dtype=torch.int32, device="cuda")
    cu_k_dev = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(head_dim)
    dout = torch.randn(q.shape, generator=rng, device="cuda").to(q.dtype)
    out = poisoned(q.shape, q.dtype)
    lse = poisoned((heads_q, q.shape[0]), torch.float32)
    hipattn.forward(q, k, v, out=out, lse=lse, cu_seqlens_q=cu_q_dev, cu_seqlens_k=cu_k_dev, max_seqlen_q=bound,
                    max_seqlen_k=bound, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi)
    dq, dk, dv = (poisoned(t.shape, t.dtype) for t in (q, k, v))
    hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q_dev, cu_seqlens_k=cu_k_dev,
                     max_seqlen_q=bound, max_seqlen_k=bound, causal=causal, window_size=window, softcap=softcap,
                     alibi_slopes=alibi)
    torch.cuda.synchronize()
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_reference(q, k, v, cu_q, cu_k, causal=causal, scale=scale,
                                                                   dout=dout, window=window, softcap=softcap,
                                                                   alibi=alibi)
    # Every element written: no NaN left from the poison anywhere.
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name} has unwritten (NaN) elements"
    assert not torch.isnan(lse).any(), "lse has unwritten (NaN) elements"
    # Rows that see no key: LSE = +inf exactly where the reference says so, finite elsewhere.
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse is +inf on the wrong rows"
    finite = ~torch.isinf(ref_lse)
    errors = {
        "out": relative_error(out, ref_out),
        "lse": relative_error(lse[finite], ref_lse[finite]),
        "dq": relative_error(dq, ref_dq),
        "dk": relative_error(dk, ref_dk),
        "dv": relative_error(dv, ref_dv),
    }
    row_errors = {name: worst_row_error(t, ref) for name, t, ref in
                  (("out", out, ref_out), ("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv))}
    assert max(row_errors.values()) < ROW_TOLERANCE_FACTOR * TOLERANCE[dtype], row_errors
    return errors


@pytest.fixture(params=["tensor-core", "portable"])
def forward_kernel(request, monkeypatch):
    """Both kernel variants run on the H200: the tensor-core ones and the portable ones AMD uses
    (the switch selects the forward and the backward alike)."""
    if request.param == "portable":
        monkeypatch.setenv("HIPATTN_SMALLSEQ_KERNEL", "portable")
    else:
        monkeypatch.delenv("HIPATTN_SMALLSEQ_KERNEL", raising=False)
    return request.param


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", SMALLSEQ_HEAD_DIMS)
@pytest.mark.parametrize("heads", SMALLSEQ_SHIPPED_HEADS)
def test_every_shipped_instantiation_matches_float64(dtype, head_dim, heads, forward_kernel, rng):
    # Lengths 0, 1 and 17 on both sides, mixed with random ones; Q and KV lengths independent.
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=None)))
    random_q = torch.randint(0, SMALLSEQ_TILE + 1, (21,), generator=gen).tolist()
    random_k = torch.randint(0, SMALLSEQ_TILE + 1, (21,), generator=gen).tolist()
    lengths_q = [0, 1, 17, 17, 5, 0, 1] + random_q
    lengths_k = [3, 1, 17, 0, 17, 0, 17] + random_k
    for causal in (False, True):
        errors = _run_and_check(lengths_q, lengths_k, heads, heads, head_dim, dtype, causal, rng)
        record_errors(f"{dtype} d{head_dim} h{heads} causal={causal} {forward_kernel}", **errors)
        assert max(errors.values()) < TOLERANCE[dtype], errors


@pytest.mark.parametrize("window,causal", [((3, -1), False), ((2, 5), False), ((1, 1), False), ((4, 0), True)])
@pytest.mark.parametrize("heads_q,heads_kv", [(8, 8), (16, 4)])
@pytest.mark.parametrize("head_dim", SMALLSEQ_HEAD_DIMS)
def test_sliding_windows_match_float64(head_dim, heads_q, heads_kv, window, causal, forward_kernel, rng):
    """flash-attn's windows (-1: no bound on that side) on every small-seq kernel: the per-head and the
    grouped tensor-core ones and the portable ones; rows whose window holds no key get O = 0."""
    lengths_q = [17, 9, 0, 4, 1, 13, 17, 2, 17]
    lengths_k = [17, 17, 5, 0, 9, 3, 12, 17, 1]
    errors = _run_and_check(lengths_q, lengths_k, heads_q, heads_kv, head_dim, "bf16", causal, rng, window=window)
    record_errors(f"window={window} causal={causal} d{head_dim} {heads_q}/{heads_kv} {forward_kernel}", **errors)
    assert max(errors.values()) < TOLERANCE["bf16"], errors


@pytest.mark.parametrize("softcap,alibi,causal,window", SCORE_MODS, ids=str)
@pytest.mark.parametrize("heads_q,heads_kv", [(8, 8), (12, 4)])
@pytest.mark.parametrize("head_dim", SMALLSEQ_HEAD_DIMS)
def test_score_modifiers_match_float64(head_dim, heads_q, heads_kv, softcap, alibi, causal, window, forward_kernel,
                                       rng):
    """Softcap and ALiBi (per head, and per sequence, which the grouped kernels' stacked rows of
    several heads each read) on every small-seq kernel, forward and backward."""
    lengths_q = [17, 9, 0, 4, 1, 13, 17, 2, 17]
    lengths_k = [17, 17, 5, 0, 9, 3, 12, 17, 1]
    errors = _run_and_check(lengths_q, lengths_k, heads_q, heads_kv, head_dim, "bf16", causal, rng, window=window,
                            softcap=softcap, alibi=alibi_slopes(alibi, len(lengths_q), heads_q))
    record_errors(f"softcap={softcap} alibi={alibi} causal={causal} window={window} d{head_dim} "
                  f"{heads_q}/{heads_kv} {forward_kernel}", **errors)
    assert max(errors.values()) < TOLERANCE["bf16"], errors


@pytest.mark.parametrize("heads_q,heads_kv", [(16, 4), (32, 1), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_mqa_sum_kv_gradients_over_the_group(heads_q, heads_kv, causal, forward_kernel, rng):
    lengths_q = [17, 9, 0, 4, 1, 13, 17, 2]
    lengths_k = [17, 3, 6, 0, 1, 16, 8, 17]
    errors = _run_and_check(lengths_q, lengths_k, heads_q, heads_kv, 128, "bf16", causal, rng)
    record_errors(f"gqa {heads_q}/{heads_kv} causal={causal} {forward_kernel}", **errors)
    assert max(errors.values()) < TOLERANCE["bf16"], errors


@pytest.mark.parametrize("per_team", [2, 3, 16, 64])
@pytest.mark.parametrize("head_dim", SMALLSEQ_HEAD_DIMS)
def test_warps_walking_runs_of_problems_match_float64(per_team, head_dim, monkeypatch, rng):
    """Each warp of the tensor-core kernels walks a run of problems in its own tiles: runs that start
    and end inside a sequence and cross empty ones must all match."""
    monkeypatch.setattr(SmallSeqMmaTiles, "run_length", lambda tiles, problems: per_team)
    gen = torch.Generator().manual_seed(fresh_seed())
    lengths_q = [0, 17, 1, 0] + torch.randint(0, SMALLSEQ_TILE + 1, (36,), generator=gen).tolist()
    lengths_k = [5, 17, 0, 0] + torch.randint(0, SMALLSEQ_TILE + 1, (36,), generator=gen).tolist()
    for causal in (False, True):
        errors = _run_and_check(lengths_q, lengths_k, 8, 8, head_dim, "bf16", causal, rng)
        record_errors(f"runs of {per_team} d{head_dim} causal={causal}", **errors)
        assert max(errors.values()) < TOLERANCE["bf16"], errors


@pytest.fixture
def mma_row(monkeypatch):
    """Run both tensor-core kernels with other table rows: use(head_dim, warps=..., problems_per_team=...,
    split=...)."""
    def use(head_dim, **row):
        monkeypatch.setitem(smallseq.SMALLSEQ_FORWARD_MMA_TILES, head_dim, SmallSeqForwardMmaTiles(**row))
        monkeypatch.setitem(smallseq.SMALLSEQ_BACKWARD_MMA_TILES, head_dim, SmallSeqBackwardMmaTiles(**row))
    return use


# Teams of two split head_dim 256's columns (at 64 and 128 a warp's half-width tiles cannot carry the
# partial sums; the kernels' static_asserts reject it).
TEAM_ROWS = [(head_dim, 1) for head_dim in SMALLSEQ_HEAD_DIMS] + [(256, 2)]


@pytest.mark.parametrize("head_dim,split", TEAM_ROWS)
def test_teams_of_one_or_two_warps_match_float64(head_dim, split, mma_row, monkeypatch, rng):
    """Two warps of a team split a problem's columns and hand their partial sums over (S in the
    forward, S and dP in the backward): either team size, runs of three problems per team, three teams
    per block (each pair with a named barrier of its own)."""
    mma_row(head_dim, warps=3 * split, problems_per_team=3, split=split)
    monkeypatch.setattr(SmallSeqMmaTiles, "run_length", lambda tiles, problems: 3)
    gen = torch.Generator().manual_seed(fresh_seed())
    lengths_q = [17, 0, 1, 17, 9] + torch.randint(0, SMALLSEQ_TILE + 1, (20,), generator=gen).tolist()
    lengths_k = [17, 4, 0, 1, 17] + torch.randint(0, SMALLSEQ_TILE + 1, (20,), generator=gen).tolist()
    for causal in (False, True):
        errors = _run_and_check(lengths_q, lengths_k, 8, 8, head_dim, "bf16", causal, rng)
        record_errors(f"teams of {split} d{head_dim} causal={causal}", **errors)
        assert max(errors.values()) < TOLERANCE["bf16"], errors


def _run_a_batch_of_zero(heads_q, heads_kv):
    """hipattn.forward and hipattn.backward of zero sequences: valid calls, with empty outputs of the right shapes."""
    q = torch.empty(0, heads_q, 64, dtype=torch.bfloat16, device="cuda")
    kv = torch.empty(0, heads_kv, 64, dtype=torch.bfloat16, device="cuda")
    cu = torch.zeros(1, dtype=torch.int32, device="cuda")
    args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=SMALLSEQ_TILE, max_seqlen_k=SMALLSEQ_TILE)
    out, lse = hipattn.forward(q, kv, kv, **args)
    dq, dk, dv = hipattn.backward(q, q, kv, kv, out, lse, **args)
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (heads_q, 0) and dq.shape == q.shape
    assert dk.shape == dv.shape == kv.shape


def test_batch_zero_is_valid_and_touches_nothing(forward_kernel):
    _run_a_batch_of_zero(8, 8)


@pytest.mark.parametrize("lengths", [([7], [11]), ([17], [17]), ([1], [1]), ([0, 4], [0, 9]), ([12], [3])])
def test_a_single_or_tiny_batch_matches_float64(lengths, forward_kernel, rng):
    lengths_q, lengths_k = lengths
    for causal in (False, True):
        errors = _run_and_check(lengths_q, lengths_k, 8, 8, 64, "bf16", causal, rng)
        assert max(errors.values()) < TOLERANCE["bf16"], errors


def test_empty_kv_gives_zero_output_infinite_lse_and_zero_gradients(rng):
    q, k, v, cu_q, cu_k = _varlen([5], [0], 8, 8, 64, "bf16", rng)
    k = torch.empty(0, 8, 64, dtype=q.dtype, device="cuda")
    v = torch.empty(0, 8, 64, dtype=q.dtype, device="cuda")
    cu_q_dev = torch.tensor(cu_q, dtype=torch.int32, device="cuda")
    cu_k_dev = torch.tensor([0, 0], dtype=torch.int32, device="cuda")
    out, lse = hipattn.forward(q, k, v, cu_seqlens_q=cu_q_dev, cu_seqlens_k=cu_k_dev, max_seqlen_q=5, max_seqlen_k=0)
    dq, dk, dv = hipattn.backward(randn_like(q, rng), q, k, v, out, lse, cu_seqlens_q=cu_q_dev, cu_seqlens_k=cu_k_dev,
                                  max_seqlen_q=5, max_seqlen_k=0)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isinf(lse).all() and (lse > 0).all()
    assert torch.equal(dq, torch.zeros_like(dq))


def _captured_forward_backward(batch, heads_q, heads_kv, head_dim, dtype, causal):
    """THD buffers with room for ``batch`` sequences of up to 17 tokens, their cu_seqlens, and a CUDA graph of
    hipattn.forward then hipattn.backward on them captured with that capacity bound (after a warm-up
    call compiled and loaded the kernels outside the capture): (graph, tensors, cu_q, cu_k)."""
    capacity = batch * SMALLSEQ_TILE
    t = TORCH_DTYPE[dtype]
    q = torch.empty(capacity, heads_q, head_dim, dtype=t, device="cuda")
    k = torch.empty(capacity, heads_kv, head_dim, dtype=t, device="cuda")
    v, dout = torch.empty_like(k), torch.empty_like(q)
    out, dq, dk, dv = torch.empty_like(q), torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
    lse = torch.empty(heads_q, capacity, dtype=torch.float32, device="cuda")
    cu_q = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=SMALLSEQ_TILE, max_seqlen_k=SMALLSEQ_TILE,
                causal=causal)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        hipattn.forward(q, k, v, out=out, lse=lse, **args)
        hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **args)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        hipattn.forward(q, k, v, out=out, lse=lse, **args)
        hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **args)
    return graph, (q, k, v, dout, out, lse, dq, dk, dv), cu_q, cu_k


def _replay_with_new_cu_seqlens(graph, tensors, cu_q, cu_k, batch, heads_q, head_dim, dtype, causal, rng, gen):
    """Write new lengths (0, 1 and 17 among them) into the captured cu_seqlens, fresh inputs and NaN
    outputs into the captured buffers, replay, and return the errors against float64."""
    q, k, v, dout, out, lse, dq, dk, dv = tensors
    lengths_q = [0, 1, SMALLSEQ_TILE] + torch.randint(0, SMALLSEQ_TILE + 1, (batch - 3,), generator=gen).tolist()
    lengths_k = [SMALLSEQ_TILE, 1, 0] + torch.randint(0, SMALLSEQ_TILE + 1, (batch - 3,), generator=gen).tolist()
    host_q = [0] + torch.tensor(lengths_q).cumsum(0).tolist()
    host_k = [0] + torch.tensor(lengths_k).cumsum(0).tolist()
    cu_q.copy_(torch.tensor(host_q, dtype=torch.int32))
    cu_k.copy_(torch.tensor(host_k, dtype=torch.int32))
    for buffer in (q, k, v, dout):
        buffer.normal_(generator=rng)
    for buffer in (out, dq, dk, dv, lse):
        buffer.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    nq, nk = host_q[-1], host_k[-1]
    for name, t in (("out", out[:nq]), ("lse", lse[:, :nq]), ("dq", dq[:nq]), ("dk", dk[:nk]), ("dv", dv[:nk])):
        assert not torch.isnan(t).any(), f"replay: {name} has unwritten (NaN) elements"
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_reference(q[:nq], k[:nk], v[:nk], host_q, host_k,
                                                                   causal=causal, scale=1 / math.sqrt(head_dim),
                                                                   dout=dout[:nq])
    assert torch.equal(torch.isinf(lse[:, :nq]), torch.isinf(ref_lse)), "replay: lse is +inf on the wrong rows"
    return {"out": relative_error(out[:nq], ref_out), "dq": relative_error(dq[:nq], ref_dq),
            "dk": relative_error(dk[:nk], ref_dk), "dv": relative_error(dv[:nk], ref_dv)}


def test_max_seqlen_is_an_upper_bound_and_graph_replays_new_cu_seqlens(rng):
    """Capture with a capacity bound (17) once; replay with new lengths written into the same buffers."""
    batch, heads, head_dim = 64, 16, 128
    graph, tensors, cu_q, cu_k = _captured_forward_backward(batch, heads, heads, head_dim, "bf16", False)
    gen = torch.Generator().manual_seed(fresh_seed())
    for replay in range(3):
        errors = _replay_with_new_cu_seqlens(graph, tensors, cu_q, cu_k, batch, heads, head_dim, "bf16", False, rng,
                                             gen)
        record_errors(f"graph replay {replay}", **errors)
        assert max(errors.values()) < TOLERANCE["bf16"], errors


def test_bshd_with_per_sequence_lengths(forward_kernel, rng):
    batch, seqlen, heads, head_dim = 6, SMALLSEQ_TILE, 8, 64
    q = torch.randn(batch, seqlen, heads, head_dim, generator=rng, device="cuda").bfloat16()
    k = torch.randn(batch, seqlen - 4, heads, head_dim, generator=rng, device="cuda").bfloat16()
    v = randn_like(k, rng)
    used_q = torch.tensor([17, 0, 3, 9, 1, 12], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([13, 5, 0, 2, 13, 7], dtype=torch.int32, device="cuda")
    out, lse = hipattn.forward(q, k, v, seqused_q=used_q, seqused_k=used_k, causal=True)
    torch.cuda.synchronize()
    lq, lk = used_q.tolist(), used_k.tolist()
    q_thd = torch.cat([q[b, : lq[b]] for b in range(batch)])
    k_thd = torch.cat([k[b, : lk[b]] for b in range(batch)])
    v_thd = torch.cat([v[b, : lk[b]] for b in range(batch)])
    cu_q = [0] + torch.tensor(lq).cumsum(0).tolist()
    cu_k = [0] + torch.tensor(lk).cumsum(0).tolist()
    ref_out, ref_lse = attention_reference(q_thd, k_thd, v_thd, cu_q, cu_k, causal=True, scale=1 / math.sqrt(head_dim))
    out_thd = torch.cat([out[b, : lq[b]] for b in range(batch)])
    lse_thd = torch.cat([lse[b, :, : lq[b]] for b in range(batch)], dim=1)
    error = relative_error(out_thd, ref_out)
    record_errors("bshd seqused causal", out=error)
    assert error < TOLERANCE["bf16"]
    assert torch.equal(torch.isinf(lse_thd), torch.isinf(ref_lse))


def test_eighty_thousand_sequences_times_32_heads_run():
    """A batch past grid.y's 65535: flash-attn has failed such calls with 'invalid configuration argument'."""
    batch, heads, head_dim, length = 80_000, 32, 64, 16
    q = torch.randn(batch * length, heads, head_dim, device="cuda").bfloat16()
    cu = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device="cuda")
    out, lse = hipattn.forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length, max_seqlen_k=length)
    torch.cuda.synchronize()
    # Spot-check a few sequences against the reference, including the last one.
    for b in (0, 12_345, batch - 1):
        rows = slice(b * length, (b + 1) * length)
        ref, _ = attention_reference(q[rows], q[rows], q[rows], [0, length], [0, length], causal=False,
                                     scale=1 / math.sqrt(head_dim))
        assert relative_error(out[rows], ref) < TOLERANCE["bf16"]
    assert not torch.isnan(out).any()


# ---- grouped heads (GQA/MQA) on the tensor cores: one team per (sequence, KV head) group ----------

# Every shipped-config ratio (G = 8, 8, 4, 2, 8, 4), MQA at 8 and 16 query heads, odd groups (G = 3)
# and G = 16 (Hq = 16 * Hkv).
GROUPED_HEADS = [(8, 1), (16, 2), (16, 4), (16, 8), (32, 4), (32, 8), (16, 1), (12, 4), (18, 6), (32, 2)]


@pytest.fixture
def launched_families(monkeypatch):
    """The kernel family of every launch the small-seq path makes, in order."""
    families_seen: list[str] = []

    class Recording(runtime.Runtime):
        __slots__ = ()

        def kernel(self, spec, device):
            families_seen.append(spec.family.name)
            return super().kernel(spec, device)

    active = runtime.active()
    monkeypatch.setattr(runtime, "_active", Recording(active.backend, registry=active.registry))
    monkeypatch.delenv("HIPATTN_SMALLSEQ_KERNEL", raising=False)
    return families_seen


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_q,heads_kv", GROUPED_HEADS)
@pytest.mark.parametrize("head_dim", SMALLSEQ_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_grouped_heads_match_float64_and_replay_in_a_graph(dtype, head_dim, heads_q, heads_kv, causal,
                                                          launched_families, rng):
    """The grouped kernels (dK and dV summed over the group in registers), directly and then captured
    in a CUDA graph with a capacity bound and replayed with new cu_seqlens."""
    gen = torch.Generator().manual_seed(fresh_seed())
    lengths_q = [0, 1, 17, 17, 5, 0, 1, 9] + torch.randint(0, SMALLSEQ_TILE + 1, (16,), generator=gen).tolist()
    lengths_k = [3, 1, 17, 0, 17, 0, 17, 1] + torch.randint(0, SMALLSEQ_TILE + 1, (16,), generator=gen).tolist()
    errors = _run_and_check(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal, rng)
    record_errors(f"grouped {dtype} d{head_dim} {heads_q}/{heads_kv} causal={causal}", **errors)
    assert max(errors.values()) < TOLERANCE[dtype], errors
    assert launched_families == ["smallseq_forward_gqa_mma", "smallseq_backward_gqa_mma"]

    batch = 24
    graph, tensors, cu_q, cu_k = _captured_forward_backward(batch, heads_q, heads_kv, head_dim, dtype, causal)
    for replay in range(2):
        errors = _replay_with_new_cu_seqlens(graph, tensors, cu_q, cu_k, batch, heads_q, head_dim, dtype, causal, rng,
                                             gen)
        record_errors(f"grouped graph replay {replay} {dtype} d{head_dim} {heads_q}/{heads_kv} causal={causal}",
                      **errors)
        assert max(errors.values()) < TOLERANCE[dtype], errors


@pytest.mark.parametrize("lengths", [([17], [17]), ([1], [1]), ([0], [9]), ([12], [0]), ([1], [17])])
@pytest.mark.parametrize("heads_q,heads_kv", [(8, 1), (12, 4)])
def test_grouped_heads_on_a_batch_of_one(lengths, heads_q, heads_kv, launched_families, rng):
    lengths_q, lengths_k = lengths
    for causal in (False, True):
        errors = _run_and_check(lengths_q, lengths_k, heads_q, heads_kv, 128, "bf16", causal, rng)
        assert max(errors.values()) < TOLERANCE["bf16"], errors
    # A batch of one launches its kernels even when a side is empty (the lengths live on the device).
    assert launched_families == 2 * ["smallseq_forward_gqa_mma", "smallseq_backward_gqa_mma"]


def test_grouped_heads_batch_zero_is_valid_and_touches_nothing(launched_families):
    _run_a_batch_of_zero(8, 2)
    assert launched_families == [], "batch 0 launches nothing"


@pytest.mark.parametrize("head_dim", SMALLSEQ_HEAD_DIMS)
def test_grouped_heads_bshd_with_per_sequence_lengths(head_dim, launched_families, rng):
    batch, heads_q, heads_kv = 6, 18, 6  # G = 3
    q = torch.randn(batch, SMALLSEQ_TILE, heads_q, head_dim, generator=rng, device="cuda").bfloat16()
    k = torch.randn(batch, SMALLSEQ_TILE - 2, heads_kv, head_dim, generator=rng, device="cuda").bfloat16()
    v, dout = randn_like(k, rng), randn_like(q, rng)
    used_q = torch.tensor([17, 0, 3, 9, 1, 12], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([13, 5, 0, 2, 15, 1], dtype=torch.int32, device="cuda")
    out, lse = poisoned(q.shape, q.dtype), poisoned((batch, heads_q, SMALLSEQ_TILE), torch.float32)
    hipattn.forward(q, k, v, out=out, lse=lse, seqused_q=used_q, seqused_k=used_k, causal=True)
    dq, dk, dv = poisoned(q.shape, q.dtype), poisoned(k.shape, k.dtype), poisoned(v.shape, v.dtype)
    hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, seqused_q=used_q, seqused_k=used_k, causal=True)
    torch.cuda.synchronize()
    assert launched_families == ["smallseq_forward_gqa_mma", "smallseq_backward_gqa_mma"]
    lq, lk = used_q.tolist(), used_k.tolist()

    def thd(x, lengths):
        return torch.cat([x[b, : lengths[b]] for b in range(batch)])

    cu_q = [0] + torch.tensor(lq).cumsum(0).tolist()
    cu_k = [0] + torch.tensor(lk).cumsum(0).tolist()
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_reference(thd(q, lq), thd(k, lk), thd(v, lk), cu_q, cu_k,
                                                                   causal=True, scale=1 / math.sqrt(head_dim),
                                                                   dout=thd(dout, lq))
    lse_thd = torch.cat([lse[b, :, : lq[b]] for b in range(batch)], dim=1)
    assert torch.equal(torch.isinf(lse_thd), torch.isinf(ref_lse))
    errors = {"out": relative_error(thd(out, lq), ref_out), "dq": relative_error(thd(dq, lq), ref_dq),
              "dk": relative_error(thd(dk, lk), ref_dk), "dv": relative_error(thd(dv, lk), ref_dv)}
    record_errors(f"grouped bshd seqused d{head_dim}", **errors)
    assert max(errors.values()) < TOLERANCE["bf16"], errors
    # Rows past each sequence's length are never written: still the poison.
    for b in range(batch):
        assert torch.isnan(out[b, lq[b]:]).all() and torch.isnan(lse[b, :, lq[b]:]).all()
        assert torch.isnan(dq[b, lq[b]:]).all() and torch.isnan(dk[b, lk[b]:]).all() and torch.isnan(dv[b, lk[b]:]).all()
