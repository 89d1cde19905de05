"""flash-attn's dropout on the GPU: the flash kernels against float64 with hipattn.dropout's keep mask,
both the ones the device runs (wgmma on sm_90a where it has the head_dim), through hipattn.forward and
hipattn.backward with an explicit seed, and the mma.sync ones every sm_80+ part runs, through the ops
launchers; the small-seq kernels (one problem per head, grouped heads, the portable ones); the keep
rate and its independence across heads and sequences; bit-reproducibility for a given torch generator
state through hipattn.torch; the backward regenerating the forward's mask; and CUDA-graph replays
drawing new seeds."""

from __future__ import annotations

import math

import pytest
import torch

import hipattn
import hipattn.torch as hat
from hipattn import runtime
from hipattn.catalog.common import FLASH_HEAD_DIMS
from hipattn.catalog.flash_backward import mma_tiles_for
from hipattn.catalog.flash_forward import FLASH_FORWARD_MMA_TILES
from hipattn.catalog.smallseq import SMALLSEQ_HEAD_DIMS
from hipattn.dropout import keep_mask
from hipattn.ops import smallseq as smallseq_ops

from .conftest import (
    TOLERANCE,
    TORCH_DTYPE,
    cumulative,
    flash_forward_backward,
    fresh_seed,
    poisoned,
    record_errors,
    relative_error,
)
from .reference import attention_reference

DROPOUT_P = 0.17
# Short sequences among longer ones (so the flash kernels take the call), lengths off every tile,
# empty queries and keys, Q longer and shorter than KV.
LENGTHS_Q = [0, 1, 17, 18, 63, 129, 200, 5, 40]
LENGTHS_K = [9, 1, 18, 17, 65, 200, 129, 0, 31]
# Every sequence within 17 tokens: the small-seq kernels' calls.
SMALLSEQ_LENGTHS_Q = [0, 1, 17, 9, 5, 16, 17]
SMALLSEQ_LENGTHS_K = [9, 1, 17, 0, 12, 3, 17]


def _seed_tensor() -> torch.Tensor:
    """A one-element int64 seed with both 32-bit halves random (and the sign bit)."""
    return torch.tensor([fresh_seed() - (1 << 62)], dtype=torch.int64, device="cuda")


def _varlen_inputs(heads_q, heads_kv, head_dim, dtype, rng, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    t = TORCH_DTYPE[dtype]
    q = torch.randn(cu_q[-1], heads_q, head_dim, generator=rng, device="cuda").to(t)
    k = torch.randn(cu_k[-1], heads_kv, head_dim, generator=rng, device="cuda").to(t)
    v = torch.randn(cu_k[-1], heads_kv, head_dim, generator=rng, device="cuda").to(t)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (48, 16))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("heads_q,heads_kv", [(2, 2), (4, 1)])
@pytest.mark.parametrize("kernel", ["device's", "mma.sync"])
@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_and_backward_match_float64_with_the_keep_mask(dtype, head_dim, kernel, heads_q, heads_kv, causal,
                                                               window, deterministic, rng):
    q, k, v, cu_q, cu_k = _varlen_inputs(heads_q, heads_kv, head_dim, dtype, rng)
    dout = torch.randn(q.shape, generator=rng, device="cuda").to(q.dtype)
    seed = _seed_tensor()
    sequences = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                     cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
                     max_seqlen_q=max(LENGTHS_Q), max_seqlen_k=max(LENGTHS_K), causal=causal, window_size=window,
                     dropout_p=DROPOUT_P, dropout_seed=seed)
    dq, dk, dv = (poisoned(x.shape, x.dtype) for x in (q, k, v))
    if kernel == "device's":
        out, lse = poisoned(q.shape, q.dtype), poisoned((heads_q, q.shape[0]), torch.float32)
        hipattn.forward(q, k, v, out=out, lse=lse, **sequences)
        hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, deterministic=deterministic, **sequences)
    else:
        out, lse, _ = flash_forward_backward(q, k, v, dout, dq, dk, dv, deterministic=deterministic,
                                             forward_tiles=FLASH_FORWARD_MMA_TILES[head_dim],
                                             tiles=mma_tiles_for(head_dim, runtime.active().target(0)), **sequences)
    torch.cuda.synchronize()
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_reference(
        q, k, v, cu_q, cu_k, causal=causal, scale=1 / math.sqrt(head_dim), dout=dout, window=window,
        dropout=(DROPOUT_P, seed))
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name} has unwritten (NaN) elements"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~finite), "LSE is the undropped softmax's: +inf only where no key is seen"
    assert (lse.double()[finite] - ref_lse[finite]).abs().max() < 1e-3
    errors = {"out": relative_error(out, ref_out), "dq": relative_error(dq, ref_dq),
              "dk": relative_error(dk, ref_dk), "dv": relative_error(dv, ref_dv)}
    record_errors(f"dropout {kernel} {dtype} d{head_dim} {heads_q}/{heads_kv} causal={causal} window={window}",
                  **errors)
    assert max(errors.values()) < TOLERANCE[dtype], errors


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_q,heads_kv", [(2, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("kernel", ["tensor-core", "portable"])
@pytest.mark.parametrize("head_dim", SMALLSEQ_HEAD_DIMS)
def test_the_small_seq_kernels_drop_with_the_keep_mask(head_dim, kernel, heads_q, heads_kv, causal, rng,
                                                       monkeypatch, caplog):
    """Calls whose sequences all fit 17 tokens run the small-seq kernels, dropout or not: one problem
    per head (2/2), grouped heads (6/2, 4/1; each stacked row with its own head's keep bits), and the
    portable kernels; every output against float64 with the same mask."""
    if kernel == "portable":
        monkeypatch.setenv(smallseq_ops.KERNEL_SWITCH, "portable")
    q, k, v, cu_q, cu_k = _varlen_inputs(heads_q, heads_kv, head_dim, "bf16", rng, SMALLSEQ_LENGTHS_Q,
                                         SMALLSEQ_LENGTHS_K)
    dout = torch.randn(q.shape, generator=rng, device="cuda").to(q.dtype)
    seed = _seed_tensor()
    sequences = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                     cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
                     max_seqlen_q=max(SMALLSEQ_LENGTHS_Q), max_seqlen_k=max(SMALLSEQ_LENGTHS_K), causal=causal,
                     dropout_p=DROPOUT_P, dropout_seed=seed)
    dq, dk, dv = (poisoned(x.shape, x.dtype) for x in (q, k, v))
    out, lse = poisoned(q.shape, q.dtype), poisoned((heads_q, q.shape[0]), torch.float32)
    with caplog.at_level("DEBUG", logger="hipattn"):
        hipattn.forward(q, k, v, out=out, lse=lse, **sequences)
        hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **sequences)
    torch.cuda.synchronize()
    assert "forward smallseq path" in caplog.text and "backward smallseq path" in caplog.text
    ref_out, _, ref_dq, ref_dk, ref_dv = attention_reference(
        q, k, v, cu_q, cu_k, causal=causal, scale=1 / math.sqrt(head_dim), dout=dout, dropout=(DROPOUT_P, seed))
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name} has unwritten (NaN) elements"
    errors = {"out": relative_error(out, ref_out), "dq": relative_error(dq, ref_dq),
              "dk": relative_error(dk, ref_dk), "dv": relative_error(dv, ref_dv)}
    record_errors(f"dropout small-seq {kernel} d{head_dim} {heads_q}/{heads_kv} causal={causal}", **errors)
    assert max(errors.values()) < TOLERANCE["bf16"], errors


def test_the_keep_rate_is_dropout_p_and_independent_across_heads_and_sequences():
    """The mask hipattn.dropout.keep_mask computes is the kernels' (the test above); here, its
    statistics on a large grid: the drop rate within 5 standard deviations of dropout_p, and the
    masks of two heads, and of two sequences, agreeing no more than independent draws do."""
    seed = _seed_tensor()
    rows = torch.arange(512, device="cuda")[:, None]
    keys = torch.arange(512, device="cuda")[None, :]
    masks = [keep_mask(seed, stream, rows, keys, DROPOUT_P) for stream in (0, 1, 8, 9)]
    n = masks[0].numel()
    for mask in masks:
        dropped = 1.0 - mask.double().mean().item()
        assert abs(dropped - DROPOUT_P) < 5 * math.sqrt(DROPOUT_P * (1 - DROPOUT_P) / n), dropped
    both_dropped = DROPOUT_P * DROPOUT_P
    for a, b in ((0, 1), (0, 2), (1, 3)):  # heads of one sequence; the same head of two sequences
        joint = (~masks[a] & ~masks[b]).double().mean().item()
        assert abs(joint - both_dropped) < 5 * math.sqrt(both_dropped * (1 - both_dropped) / n), (a, b, joint)
    # Neighbouring keys and rows are not correlated either (the counter layout packs them together).
    for shifted in (~masks[0][:, 1:] & ~masks[0][:, :-1], ~masks[0][1:] & ~masks[0][:-1]):
        joint = shifted.double().mean().item()
        assert abs(joint - both_dropped) < 5 * math.sqrt(both_dropped / shifted.numel()), joint


def test_the_same_generator_state_gives_bit_identical_results_through_hipattn_torch(rng):
    """hipattn.torch draws the seed from torch's generator: torch.manual_seed(s) twice gives the same
    output and gradients bit for bit (deterministic=True), the next draw another output."""
    q, k, v = (torch.randn(2, 300, 4, 64, generator=rng, device="cuda").to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    results = []
    for _ in range(2):
        torch.manual_seed(1234)
        out = hat.flash_attn_func(q, k, v, dropout_p=DROPOUT_P, causal=True, deterministic=True)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    for first, second in zip(*results, strict=True):
        assert torch.equal(first, second)
    other = hat.flash_attn_func(q, k, v, dropout_p=DROPOUT_P, causal=True)
    assert not torch.equal(other, results[0][0])


def test_return_attn_probs_marks_the_kernels_dropped_entries():
    """S_dmask's negative entries are exactly the entries the forward dropped: rebuilding O from
    S_dmask (normalized, the negatives zeroed, scaled by 1 / (1 - dropout_p)) gives the kernel's O."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 150, 3, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    out, lse, probs = hat.flash_attn_func(q, k, v, dropout_p=DROPOUT_P, return_attn_probs=True)
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) / math.sqrt(128)
    normalizer = torch.exp(scores.amax(-1, keepdim=True) - lse[..., None])
    kept = probs[:, :, :150, :150].float().clamp(min=0) * normalizer / (1 - DROPOUT_P)
    rebuilt = torch.einsum("bhij,bjhd->bihd", kept, v.float())
    assert relative_error(out, rebuilt) < TOLERANCE["fp16"] * 2


def test_graph_replays_draw_new_seeds():
    """Captured in a CUDA graph, the seed is drawn by torch's generator inside the graph: each replay
    drops other entries (its output differs), and each replay's drop rate is dropout_p's."""
    q, k, v = (torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v_ones = torch.ones_like(v)
    hat.flash_attn_func(q, k, v_ones, dropout_p=DROPOUT_P)  # compile and plan outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hat.flash_attn_func(q, k, v_ones, dropout_p=DROPOUT_P)
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append(out.clone())
    assert not torch.equal(replays[0], replays[1])
    for o in replays:
        # With V = 1, a row's output is its kept probability mass over 1 - dropout_p: about 1 on average.
        assert abs(o.float().mean().item() - 1.0) < 0.05
