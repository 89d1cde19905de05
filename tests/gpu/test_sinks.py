"""Learnable attention sinks (FlashAttention-4's learnable_sink, gpt-oss) on the GPU: the flash forwards
(the device's own kernel and mma.sync) and the small-seq kernels (tensor cores and portable) against
float64 softmax over [scores, sink] with outputs poisoned first, the backward reading the
sink-including LSE, and the sinks' gradient through hipattn.torch against float64 autograd."""

from __future__ import annotations

import math

import pytest
import torch

import hipattn
import hipattn.torch as hat
from hipattn.catalog.common import FLASH_HEAD_DIMS
from hipattn.catalog.smallseq_common import SMALLSEQ_HEAD_DIMS
from hipattn.ops import smallseq as smallseq_ops

from .conftest import TOLERANCE, TORCH_DTYPE, cumulative, poisoned, record_errors, relative_error

LENGTHS_Q = [0, 1, 17, 18, 63, 129, 200, 5, 40]
LENGTHS_K = [9, 1, 18, 17, 65, 200, 129, 0, 31]


def sink_reference(q, k, v, cu_q, cu_k, sink, *, causal, scale, dout=None):
    """float64 (out, lse[, dq, dk, dv, dsink]) of THD inputs: softmax over each row's visible scores
    and the head's sink logit, whose value is 0."""
    leaves = [t.detach().double().requires_grad_(dout is not None) for t in (q, k, v, sink)]
    q64, k64, v64, sink64 = leaves
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q64[cu_q[b]:cu_q[b + 1]]
        ks = k64[cu_k[b]:cu_k[b + 1]].repeat_interleave(group, dim=1)
        vs = v64[cu_k[b]:cu_k[b + 1]].repeat_interleave(group, dim=1)
        len_q, len_k = qs.shape[0], ks.shape[0]
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if causal:
            rows = torch.arange(len_q, device=q.device)[:, None]
            keys = torch.arange(len_k, device=q.device)[None, :]
            scores = scores.masked_fill(keys > rows + len_k - len_q, float("-inf"))
        logits = torch.cat([scores, sink64[:, None, None].expand(-1, len_q, 1)], dim=-1)
        lses.append(torch.logsumexp(logits, dim=-1).detach())
        outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(logits, dim=-1)[..., :len_k], vs))
    out = torch.cat(outs)
    lse = torch.cat(lses, dim=1)
    if dout is None:
        return out.detach(), lse
    out.backward(dout.double())
    return (out.detach(), lse, *(t.grad for t in leaves))


def _check_forward_and_backward(dtype, head_dim, heads_kv, causal, lengths_q, lengths_k, rng, label):
    """hipattn.forward and .backward with sinks on THD inputs (4 query heads) against float64, outputs
    poisoned first: every row's LSE includes its head's sink, so none is +inf."""
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    t = TORCH_DTYPE[dtype]
    q = torch.randn(cu_q[-1], 4, head_dim, generator=rng, device="cuda").to(t)
    k, v = (torch.randn(cu_k[-1], heads_kv, head_dim, generator=rng, device="cuda").to(t) for _ in range(2))
    dout = torch.randn(q.shape, generator=rng, device="cuda").to(t)
    sink = torch.tensor([3.0, -4.0, 0.5, 1.5], device="cuda")
    sequences = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                     cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
                     max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), causal=causal, learnable_sink=sink)
    out, lse = poisoned(q.shape, t), poisoned((4, q.shape[0]), torch.float32)
    hipattn.forward(q, k, v, out=out, lse=lse, **sequences)
    dq, dk, dv = (poisoned(x.shape, t) for x in (q, k, v))
    hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **sequences)
    torch.cuda.synchronize()
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv, _ = sink_reference(q, k, v, cu_q, cu_k, sink, causal=causal,
                                                                 scale=1 / math.sqrt(head_dim), dout=dout)
    assert torch.isfinite(lse).all(), "every row has the sink: no LSE is +inf"
    assert (lse.double() - ref_lse).abs().max() < 1e-3
    errors = {"out": relative_error(out, ref_out), "dq": relative_error(dq, ref_dq),
              "dk": relative_error(dk, ref_dk), "dv": relative_error(dv, ref_dv)}
    record_errors(f"sinks {dtype} d{head_dim} causal={causal} {label}", **errors)
    assert max(errors.values()) < TOLERANCE[dtype], errors


@pytest.mark.parametrize("kernel", ["device", "mma.sync"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", FLASH_HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_and_backward_match_float64(dtype, head_dim, causal, kernel, rng, monkeypatch):
    if kernel == "mma.sync":  # the device's flash forward on sm_90a is wgmma: force the other one too
        from hipattn.catalog import flash_forward

        monkeypatch.setattr(flash_forward, "runs_nvidia_wgmma", lambda target: False)
    _check_forward_and_backward(dtype, head_dim, 2, causal, LENGTHS_Q, LENGTHS_K, rng, kernel)


@pytest.mark.parametrize("kernel", ["tensor cores", "portable"])
@pytest.mark.parametrize("heads_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", SMALLSEQ_HEAD_DIMS)
def test_the_small_seq_kernels_match_float64(head_dim, causal, heads_kv, kernel, rng, monkeypatch):
    """Sequences of at most 17 tokens take the small-seq kernels, whose forwards add the sinks (the
    backwards read them through the LSE): one problem per head, grouped heads, and the portable kernels."""
    if kernel == "portable":
        monkeypatch.setenv(smallseq_ops.KERNEL_SWITCH, "portable")
    lengths_q, lengths_k = [0, 1, 17, 9, 5, 16], [9, 1, 17, 0, 12, 3]
    _check_forward_and_backward("bf16", head_dim, heads_kv, causal, lengths_q, lengths_k, rng, f"small-seq {kernel}")


def test_the_sinks_gradient_through_hipattn_torch(rng):
    cu_q, cu_k = cumulative(LENGTHS_Q), cumulative(LENGTHS_K)
    q = torch.randn(cu_q[-1], 4, 64, generator=rng, device="cuda").to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(cu_k[-1], 2, 64, generator=rng, device="cuda").to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    sink = torch.tensor([1.0, -2.0, 0.25, 2.0], device="cuda", requires_grad=True)
    out = hat.flash_attn_varlen_func(q, k, v, torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                                     torch.tensor(cu_k, dtype=torch.int32, device="cuda"), max(LENGTHS_Q),
                                     max(LENGTHS_K), causal=True, learnable_sink=sink)
    dout = torch.randn(out.shape, generator=rng, device="cuda").to(out.dtype)
    out.backward(dout)
    *_, ref_dsink = sink_reference(q, k, v, cu_q, cu_k, sink, causal=True, scale=1 / 8, dout=dout)
    assert relative_error(sink.grad, ref_dsink) < TOLERANCE["bf16"]
