"""hipattn.forward and hipattn.backward called with raw host arrays, as the emulated-device tests make
them: THD inputs rounded to 16 bits, outputs poisoned with NaN first, workspace from host memory."""

from __future__ import annotations

import numpy as np

import hipattn
from support.emulation import aligned_bytes, array_16bit, from_16bit, to_16bit

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
