"""hipattn.forward and hipattn.backward called with raw host arrays, as the emulated-device tests make
them: THD inputs rounded to 16 bits, outputs poisoned with NaN first, workspace from host memory; and the
checks of a forward and a backward against float64 that those tests share."""

from __future__ import annotations

import numpy as np

import hipattn
from support.emulation import aligned_bytes, array_16bit, from_16bit, to_16bit
from support.reference import (
    assert_forward_matches,
    assert_gradients_match,
    packed,
    reference_backward,
    reference_forward,
)

# A quiet NaN's bits: outputs are poisoned with it before each run.
NAN_BITS = {"bf16": 0x7FC0, "fp16": 0x7E00}


def thd_inputs(rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype):
    """Random q, k, v of THD sequences as 16-bit bits, the same values exactly as float64, and cu_seqlens."""
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    values = {name: rng.standard_normal((total, heads, head_dim))
              for name, total, heads in (("q", total_q, heads_q), ("k", total_k, heads_kv), ("v", total_k, heads_kv))}
    bits = {name: to_16bit(x, dtype) for name, x in values.items()}
    exact = {name: from_16bit(b, dtype) for name, b in bits.items()}  # the rounded inputs, as the kernel sees them
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    return bits, exact, cu_q, cu_k


def run_forward(device, bits, cu_q, cu_k, max_q, max_k, heads_q, dtype, causal):
    """O (float64) and LSE of a THD forward on ``device`` (an EmulatedDevice)."""
    total_q = bits["q"].shape[0]
    out = np.full(bits["q"].shape, NAN_BITS[dtype], dtype=np.uint16)
    lse = np.full((heads_q, total_q), np.nan, dtype=np.float32)
    hipattn.forward(*(array_16bit(bits[n], dtype) for n in ("q", "k", "v")), out=array_16bit(out, dtype),
                    lse=device.array(lse), cu_seqlens_q=device.array(cu_q), cu_seqlens_k=device.array(cu_k),
                    max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal)
    return from_16bit(out, dtype), lse.astype(np.float64)


def run_backward(device, bits, out_bits, lse, dout_bits, cu_q, cu_k, max_q, max_k, dtype, causal, **options):
    """dQ, dK, dV (float64) of a THD backward on ``device``, with the workspace it asks for."""
    grads = {name: np.full(bits[name].shape, NAN_BITS[dtype], dtype=np.uint16) for name in ("q", "k", "v")}
    arrays = [array_16bit(x, dtype) for x in (dout_bits, bits["q"], bits["k"], bits["v"], out_bits)]
    seq = dict(cu_seqlens_q=device.array(cu_q), cu_seqlens_k=device.array(cu_k), max_seqlen_q=max_q,
               max_seqlen_k=max_k, causal=causal)
    workspace_bytes = hipattn.backward_workspace_bytes(*arrays[1:4], **seq, **options)
    workspace = aligned_bytes(workspace_bytes)
    if workspace_bytes:
        options["workspace"] = device.array(workspace)
    hipattn.backward(*arrays, device.array(lse), dq=array_16bit(grads["q"], dtype),
                     dk=array_16bit(grads["k"], dtype), dv=array_16bit(grads["v"], dtype), **seq, **options)
    return tuple(from_16bit(grads[name], dtype) for name in ("q", "k", "v"))


def check_forward(device, rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal, *, max_q=None,
                  max_k=None):
    """Fresh random THD inputs of these lengths through hipattn.forward on ``device``, checked against
    float64 (``assert_forward_matches``); ``max_q``/``max_k`` default to the longest sequences. Returns
    what a backward from this forward needs: (bits, exact, cu_q, cu_k, out, lse)."""
    max_q = max(lengths_q, default=0) if max_q is None else max_q
    max_k = max(lengths_k, default=0) if max_k is None else max_k
    bits, exact, cu_q, cu_k = thd_inputs(rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype)
    out, lse = run_forward(device, bits, cu_q, cu_k, max_q, max_k, heads_q, dtype, causal)
    want_out, want_lse = reference_forward(exact["q"], exact["k"], exact["v"], lengths_q, lengths_k,
                                           head_dim ** -0.5, causal)
    assert_forward_matches(out, lse, want_out, want_lse, dtype)
    return bits, exact, cu_q, cu_k, out, lse


def check_forward_and_backward(device, rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, causal, *,
                               max_q=None, max_k=None, **backward_options):
    """``check_forward``, then hipattn.backward from its O and LSE with a fresh random dO (and
    ``backward_options``, such as deterministic=True), dQ, dK and dV checked against float64 from the
    same rounded inputs (``assert_gradients_match``)."""
    max_q = max(lengths_q, default=0) if max_q is None else max_q
    max_k = max(lengths_k, default=0) if max_k is None else max_k
    bits, exact, cu_q, cu_k, out, lse = check_forward(device, rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim,
                                                      dtype, causal, max_q=max_q, max_k=max_k)
    dout_bits = to_16bit(rng.standard_normal(bits["q"].shape), dtype)
    got = run_backward(device, bits, to_16bit(out, dtype), lse.astype(np.float32), dout_bits, cu_q, cu_k, max_q,
                       max_k, dtype, causal, **backward_options)
    want = reference_backward(exact["q"], exact["k"], exact["v"], from_16bit(dout_bits, dtype), lengths_q, lengths_k,
                              head_dim ** -0.5, causal)
    assert_gradients_match(got, want, dtype)


def check_bshd_forward_and_backward(device, rng, lengths_q, lengths_k, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
                                    dtype, causal, *, dq_padding_written=False, **backward_options):
    """A padded batch (BSHD: [batch, seqlen, heads, head_dim]) with per-sequence lengths (seqused_q/k) through
    hipattn.forward, then hipattn.backward from its O and LSE (with ``backward_options``): each sequence's
    rows checked against float64 as THD, and every row past a sequence's length (the padding) left as
    the poison, but dQ's where ``dq_padding_written`` (the flash backward's atomic schedule converts
    the whole dQ accumulator, zeros past each sequence included)."""
    batch = len(lengths_q)
    shapes = {"q": (batch, seqlen_q, heads_q, head_dim), "k": (batch, seqlen_k, heads_kv, head_dim),
              "v": (batch, seqlen_k, heads_kv, head_dim)}
    bits = {name: to_16bit(rng.standard_normal(shape), dtype) for name, shape in shapes.items()}
    dout_bits = to_16bit(rng.standard_normal(shapes["q"]), dtype)
    used_q, used_k = np.array(lengths_q, np.int32), np.array(lengths_k, np.int32)
    seq = dict(seqused_q=device.array(used_q), seqused_k=device.array(used_k), causal=causal)
    inputs = [array_16bit(bits[n], dtype) for n in ("q", "k", "v")]
    out = np.full(shapes["q"], NAN_BITS[dtype], np.uint16)
    lse = np.full((batch, heads_q, seqlen_q), np.nan, np.float32)
    hipattn.forward(*inputs, out=array_16bit(out, dtype), lse=device.array(lse), **seq)
    grads = {name: np.full(shapes[name], NAN_BITS[dtype], np.uint16) for name in shapes}
    workspace_bytes = hipattn.backward_workspace_bytes(*inputs, **seq, **backward_options)
    workspace = aligned_bytes(workspace_bytes)
    if workspace_bytes:
        backward_options["workspace"] = device.array(workspace)
    hipattn.backward(array_16bit(dout_bits, dtype), *inputs, array_16bit(out, dtype), device.array(lse),
                     dq=array_16bit(grads["q"], dtype), dk=array_16bit(grads["k"], dtype),
                     dv=array_16bit(grads["v"], dtype), **seq, **backward_options)

    lengths = {"q": lengths_q, "k": lengths_k, "v": lengths_k}
    thd = {name: packed(from_16bit(bits[name], dtype), lengths[name]) for name in bits}
    scale = head_dim ** -0.5
    want_out, want_lse = reference_forward(thd["q"], thd["k"], thd["v"], lengths_q, lengths_k, scale, causal)
    got_out = from_16bit(out, dtype)
    got_lse = np.concatenate([lse[b, :, :n] for b, n in enumerate(lengths_q)], axis=1).astype(np.float64)
    assert_forward_matches(packed(got_out, lengths_q), got_lse, want_out, want_lse, dtype)
    want = reference_backward(thd["q"], thd["k"], thd["v"], packed(from_16bit(dout_bits, dtype), lengths_q), lengths_q,
                              lengths_k, scale, causal)
    got = {name: from_16bit(grads[name], dtype) for name in "qkv"}
    assert_gradients_match([packed(got[name], lengths[name]) for name in "qkv"], want, dtype)
    for b, n in enumerate(lengths_q):
        assert np.isnan(got_out[b, n:]).all() and np.isnan(lse[b, :, n:]).all(), "O or LSE past seqused was written"
    for name in "kv" if dq_padding_written else "qkv":
        assert all(np.isnan(got[name][b, n:]).all() for b, n in enumerate(lengths[name])), f"d{name} past seqused was written"
    if dq_padding_written:
        assert all((got["q"][b, n:] == 0).all() for b, n in enumerate(lengths_q)), "dq past seqused is not zero"
