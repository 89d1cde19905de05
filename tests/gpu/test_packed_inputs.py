"""flash-attn's packed-input functions on the GPU: flash_attn_qkvpacked_func, flash_attn_kvpacked_func and
their varlen forms, in hipattn and hipattn.torch.

Each packed call runs the kernels on views of the packed tensor (token stride 3 * H * D or 2 * H * D),
so it must compute exactly what the unpacked call computes on contiguous copies of q, k and v (the same
kernels on the same values: bit for bit, the backward with deterministic=True), its gradient must arrive
in the packed tensor as dq, dk and dv stacked, and both must be within the dtype's tolerance of the
float64 reference. GQA for the kv-packed forms; varlen with several sequences, an empty one among them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import hipattn
import hipattn.torch as hat

from .conftest import TOLERANCE, TORCH_DTYPE, cumulative, randn_like, record_errors, relative_error
from .reference import attention_reference


@dataclass
class PackedCall:
    """One packed call and its unpacked counterpart.

    tensors: the packed call's tensors (qkv, or q and kv); call(module, *tensors, **options) makes the
    packed call in ``module`` (hipattn or hipattn.torch), unpacked(module, q, k, v, **options) the
    unpacked one; unpack(*tensors) gives q, k, v; pack(dq, dk, dv) gives the gradients of ``tensors``;
    reference(q, k, v, dout) gives float64 (out, dq, dk, dv)."""

    tensors: tuple
    call: Callable
    unpacked: Callable
    unpack: Callable
    pack: Callable
    reference: Callable


def _random(shape, dtype, rng):
    return torch.randn(shape, generator=rng, device="cuda").to(TORCH_DTYPE[dtype])


def _batch_reference(causal):
    """The float64 reference of a padded batch: each batch entry is one sequence of its padded length."""

    def reference(q, k, v, dout):
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        cu_q = [b * seqlen_q for b in range(batch + 1)]
        cu_k = [b * seqlen_k for b in range(batch + 1)]
        out, _, dq, dk, dv = attention_reference(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                                                 causal=causal, scale=1 / math.sqrt(q.shape[-1]),
                                                 dout=dout.flatten(0, 1))
        return out.view(q.shape), dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)

    return reference


def _varlen_reference(cu_q, cu_k, causal):
    def reference(q, k, v, dout):
        out, _, dq, dk, dv = attention_reference(q, k, v, cu_q, cu_k, causal=causal, scale=1 / math.sqrt(q.shape[-1]),
                                                 dout=dout)
        return out, dq, dk, dv

    return reference


def _check(packed: PackedCall, rng, dtype: str, case: str) -> None:
    """The packed call against the unpacked one (bit for bit) and against float64, forward and backward."""
    tolerance = TOLERANCE[dtype]
    q, k, v = (t.contiguous() for t in packed.unpack(*packed.tensors))

    out = packed.call(hipattn, *packed.tensors)
    assert not out.requires_grad
    assert torch.equal(out, packed.unpacked(hipattn, q, k, v)), f"{case}: the packed forward differs from the unpacked"
    dout = randn_like(out, rng)
    ref_out, *ref_grads = packed.reference(q, k, v, dout)
    errors = {"out": relative_error(out, ref_out)}

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = packed.pack(*torch.autograd.grad(packed.unpacked(hat, *leaves, deterministic=True), leaves, dout))
    references = packed.pack(*ref_grads)
    # hipattn.torch's packed forms, and hipattn's, which record autograd through hipattn.torch.
    for module in (hat, hipattn):
        packed_leaves = [t.clone().requires_grad_() for t in packed.tensors]
        packed_out = packed.call(module, *packed_leaves, deterministic=True)
        assert torch.equal(packed_out, out)
        grads = torch.autograd.grad(packed_out, packed_leaves, dout)
        for i, (grad, want, reference) in enumerate(zip(grads, expected, references, strict=True)):
            assert grad.shape == packed.tensors[i].shape
            assert torch.equal(grad, want), f"{case}: {module.__name__}'s gradient of input {i} differs from the unpacked call's"
            errors[f"grad {i}"] = relative_error(grad, reference)
    record_errors(f"packed {case}", **errors)
    assert all(error < tolerance for error in errors.values()), errors  # a NaN fails it too


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen,heads,head_dim", [(9, 4, 64), (300, 4, 128), (257, 2, 256)])
def test_qkvpacked_matches_the_unpacked_call_and_float64(rng, dtype, causal, seqlen, heads, head_dim):
    qkv = _random((2, seqlen, 3, heads, head_dim), dtype, rng)
    packed = PackedCall(
        tensors=(qkv,),
        call=lambda module, qkv, **options: module.flash_attn_qkvpacked_func(qkv, causal=causal, **options),
        unpacked=lambda module, q, k, v, **options: module.flash_attn_func(q, k, v, causal=causal, **options),
        unpack=lambda qkv: qkv.unbind(2),
        pack=lambda dq, dk, dv: (torch.stack([dq, dk, dv], dim=2),),
        reference=_batch_reference(causal),
    )
    _check(packed, rng, dtype, f"qkvpacked {dtype} causal={causal} S={seqlen} H={heads} D={head_dim}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads_q,heads_kv,head_dim",
                         [(7, 13, 8, 2, 128), (257, 300, 8, 2, 128), (300, 129, 6, 1, 64), (200, 200, 4, 4, 96)])
def test_kvpacked_with_gqa_matches_the_unpacked_call_and_float64(rng, causal, seqlen_q, seqlen_k, heads_q, heads_kv,
                                                                  head_dim):
    q = _random((2, seqlen_q, heads_q, head_dim), "bf16", rng)
    kv = _random((2, seqlen_k, 2, heads_kv, head_dim), "bf16", rng)
    packed = PackedCall(
        tensors=(q, kv),
        call=lambda module, q, kv, **options: module.flash_attn_kvpacked_func(q, kv, causal=causal, **options),
        unpacked=lambda module, q, k, v, **options: module.flash_attn_func(q, k, v, causal=causal, **options),
        unpack=lambda q, kv: (q, *kv.unbind(2)),
        pack=lambda dq, dk, dv: (dq, torch.stack([dk, dv], dim=2)),
        reference=_batch_reference(causal),
    )
    _check(packed, rng, "bf16", f"kvpacked causal={causal} S_q={seqlen_q} S_k={seqlen_k} Hq={heads_q} Hkv={heads_kv} "
                                f"D={head_dim}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths,heads,head_dim", [([5, 17, 1, 0, 12], 4, 128), ([17, 3, 0, 129, 300, 64], 4, 128),
                                                    ([1000, 33, 65], 2, 64)])
def test_varlen_qkvpacked_matches_the_unpacked_call_and_float64(rng, causal, lengths, heads, head_dim):
    cu = cumulative(lengths)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device="cuda")
    max_seqlen = max(lengths)
    qkv = _random((cu[-1], 3, heads, head_dim), "bf16", rng)
    packed = PackedCall(
        tensors=(qkv,),
        call=lambda module, qkv, **options: module.flash_attn_varlen_qkvpacked_func(
            qkv, cu_seqlens, max_seqlen, causal=causal, **options),
        unpacked=lambda module, q, k, v, **options: module.flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal, **options),
        unpack=lambda qkv: qkv.unbind(1),
        pack=lambda dq, dk, dv: (torch.stack([dq, dk, dv], dim=1),),
        reference=_varlen_reference(cu, cu, causal),
    )
    _check(packed, rng, "bf16", f"varlen qkvpacked causal={causal} lengths={lengths} H={heads} D={head_dim}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths_q,lengths_k,heads_q,heads_kv,head_dim", [
    ([5, 17, 0, 9, 12], [3, 17, 4, 0, 16], 8, 2, 128),
    ([5, 200, 0, 33, 17], [40, 129, 9, 0, 17], 8, 2, 128),
    ([300, 1, 64], [300, 257, 1], 6, 3, 64),
])
def test_varlen_kvpacked_with_gqa_matches_the_unpacked_call_and_float64(rng, causal, lengths_q, lengths_k, heads_q,
                                                                         heads_kv, head_dim):
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    cu_seqlens_q = torch.tensor(cu_q, dtype=torch.int32, device="cuda")
    cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
    bounds = (max(lengths_q), max(lengths_k))
    q = _random((cu_q[-1], heads_q, head_dim), "bf16", rng)
    kv = _random((cu_k[-1], 2, heads_kv, head_dim), "bf16", rng)
    packed = PackedCall(
        tensors=(q, kv),
        call=lambda module, q, kv, **options: module.flash_attn_varlen_kvpacked_func(
            q, kv, cu_seqlens_q, cu_seqlens_k, *bounds, causal=causal, **options),
        unpacked=lambda module, q, k, v, **options: module.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, *bounds, causal=causal, **options),
        unpack=lambda q, kv: (q, *kv.unbind(1)),
        pack=lambda dq, dk, dv: (dq, torch.stack([dk, dv], dim=1)),
        reference=_varlen_reference(cu_q, cu_k, causal),
    )
    _check(packed, rng, "bf16", f"varlen kvpacked causal={causal} lengths_q={lengths_q} lengths_k={lengths_k} "
                                f"Hq={heads_q} Hkv={heads_kv} D={head_dim}")


def test_return_attn_probs_gives_the_unpacked_calls_triple(rng):
    qkv = _random((2, 65, 3, 4, 128), "bf16", rng)
    out, lse, probs = hipattn.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    want_out, want_lse, _ = hipattn.flash_attn_func(*(t.contiguous() for t in qkv.unbind(2)), causal=True,
                                                    return_attn_probs=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and probs is None
    assert lse.shape == (2, 4, 65) and lse.dtype == torch.float32
