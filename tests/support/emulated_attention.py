"""Attention on the emulated gfx90a (tests/support/emulation.py) against float64: the references,
the tolerances, THD inputs rounded to 16 bits, and forward and backward calls through hipattn's own
API with NaN-poisoned outputs. Shared by the AMD emulation tests."""

from __future__ import annotations

import numpy as np

import hipattn
from support.emulation import aligned_bytes, array_16bit, from_16bit, to_16bit

# bf16/fp16 inputs, fp32 accumulation: relative error of O and gradients against float64.
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3}
# A quiet NaN's bits: outputs are poisoned with it before each run.
NAN_BITS = {"bf16": 0x7FC0, "fp16": 0x7E00}


def reference_forward(q, k, v, lengths_q, lengths_k, scale, causal):
    """float64 O [total_q, Hq, D] and LSE [Hq, total_q] of THD inputs (flash-attn's conventions)."""
    heads_q, heads_kv = q.shape[1], k.shape[1]
    out = np.zeros(q.shape)
    lse = np.full((heads_q, q.shape[0]), np.inf)
    start_q = start_k = 0
    for len_q, len_k in zip(lengths_q, lengths_k, strict=True):
        for h in range(heads_q):
            qs = q[start_q:start_q + len_q, h]
            ks = k[start_k:start_k + len_k, h // (heads_q // heads_kv)]
            vs = v[start_k:start_k + len_k, h // (heads_q // heads_kv)]
            s = scale * qs @ ks.T
            if causal:  # bottom-right aligned: query i sees key j <= i + len_k - len_q
                visible = np.arange(len_k)[None, :] <= np.arange(len_q)[:, None] + (len_k - len_q)
                s = np.where(visible, s, -np.inf)
            for i in range(len_q):
                if np.isneginf(s[i]).all():
                    continue  # sees no key: O = 0, LSE = +inf
                m = s[i].max()
                p = np.exp(s[i] - m)
                out[start_q + i, h] = p @ vs / p.sum()
                lse[h, start_q + i] = m + np.log(p.sum())
        start_q += len_q
        start_k += len_k
    return out, lse


def reference_backward(q, k, v, dout, lengths_q, lengths_k, scale, causal):
    """float64 dQ, dK, dV of THD inputs; dK and dV summed over each KV head's group of query heads."""
    heads_q, heads_kv = q.shape[1], k.shape[1]
    group = heads_q // heads_kv
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    start_q = start_k = 0
    for len_q, len_k in zip(lengths_q, lengths_k, strict=True):
        rows, keys = slice(start_q, start_q + len_q), slice(start_k, start_k + len_k)
        for h in range(heads_q):
            qs, ks, vs, dos = q[rows, h], k[keys, h // group], v[keys, h // group], dout[rows, h]
            s = scale * qs @ ks.T
            visible = np.ones(s.shape, bool)
            if causal:
                visible = np.arange(len_k)[None, :] <= np.arange(len_q)[:, None] + (len_k - len_q)
            s = np.where(visible, s, -np.inf)
            m = np.where(visible.any(1), s.max(1, initial=-np.inf), 0.0)
            p = np.where(visible, np.exp(s - m[:, None]), 0.0)
            p /= np.maximum(p.sum(1, keepdims=True), 1e-300)
            dp = dos @ vs.T
            ds = p * (dp - (p * dp).sum(1, keepdims=True))
            dq[rows, h] = scale * ds @ ks
            dk[keys, h // group] += scale * ds.T @ qs
            dv[keys, h // group] += p.T @ dos
        start_q += len_q
        start_k += len_k
    return dq, dk, dv


def relative_error(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def thd_inputs(rng, lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype):
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    values = {name: rng.standard_normal((total, heads, head_dim))
              for name, total, heads in (("q", total_q, heads_q), ("k", total_k, heads_kv), ("v", total_k, heads_kv))}
    bits = {name: to_16bit(x, dtype) for name, x in values.items()}
    exact = {name: from_16bit(b, dtype) for name, b in bits.items()}  # the rounded inputs, as the kernel sees them
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    return bits, exact, cu_q, cu_k


def run_forward(device, bits, cu_q, cu_k, max_q, max_k, heads_q, dtype, causal):
    total_q = bits["q"].shape[0]
    out = np.full(bits["q"].shape, NAN_BITS[dtype], dtype=np.uint16)
    lse = np.full((heads_q, total_q), np.nan, dtype=np.float32)
    hipattn.forward(*(array_16bit(bits[n], dtype) for n in ("q", "k", "v")), out=array_16bit(out, dtype),
                    lse=device.array(lse), cu_seqlens_q=device.array(cu_q), cu_seqlens_k=device.array(cu_k),
                    max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal)
    return from_16bit(out, dtype), lse.astype(np.float64)


def run_backward(device, bits, out_bits, lse, dout_bits, cu_q, cu_k, max_q, max_k, dtype, causal, **options):
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
