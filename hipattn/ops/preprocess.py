"""The flash backward's pre- and post-processing: D = rowsum(dO * O), dq_accum zeroing and conversion.

Callable on their own (the low-level API) and used by the general backward. THD tensors
[total, H, D] are treated as one batch of ``total`` rows; BSHD tensors [B, S, H, D] as they are. D
and dq_accum are fp32. Everything is enqueued on the given stream, on the current device.
"""

from __future__ import annotations

from .. import runtime
from ..catalog.preprocess import (
    PREPROCESS_BLOCK_THREADS,
    PREPROCESS_ROWS_PER_BLOCK,
    convert_dq_spec,
    dot_do_o_spec,
)
from ..device_array import DeviceArray
from .fields import put_strided


def _bshd(a: DeviceArray, name: str) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
    """(B, S, H, D) and (batch, token, head) strides of a THD or BSHD tensor."""
    if len(a.shape) == 3:
        return (1, *a.shape), (0, a.strides[0], a.strides[1])
    if len(a.shape) == 4:
        return tuple(a.shape), tuple(a.strides[:3])
    raise ValueError(f"{name} has shape {a.shape}; expected [total, heads, head_dim] or [batch, seqlen, heads, head_dim]")


def _grid(batch: int, seqlen: int, heads: int) -> tuple[int, int, int]:
    rows = batch * seqlen * heads
    return (-(-rows // PREPROCESS_ROWS_PER_BLOCK), 1, 1)


def dot_do_o(out: DeviceArray, dout: DeviceArray, d: DeviceArray, stream: int) -> None:
    """d[b, h, s] (BSHD) or d[h, t] (THD) = sum over head_dim of dout * out, in fp32."""
    (batch, seqlen, heads, head_dim), o_strides = _bshd(out, "out")
    _, do_strides = _bshd(dout, "dout")
    if tuple(dout.shape) != tuple(out.shape) or dout.dtype != out.dtype:
        raise ValueError(f"dout {dout.shape} {dout.dtype} must match out {out.shape} {out.dtype}")
    expected_d = (heads, seqlen) if len(out.shape) == 3 else (batch, heads, seqlen)
    if tuple(d.shape) != expected_d or d.dtype != "fp32" or d.strides[-1] != 1:
        raise ValueError(f"d has shape {d.shape} and dtype {d.dtype}; expected fp32 {expected_d}, last dimension contiguous")
    d_batch_stride, d_head_stride = (0, d.strides[0]) if len(out.shape) == 3 else (d.strides[0], d.strides[1])
    if batch * seqlen * heads == 0:
        return
    kernel = runtime.active().kernel(dot_do_o_spec(out.dtype, head_dim), out.device)
    fields = {"d": d.ptr, "d_batch_stride": d_batch_stride, "d_head_stride": d_head_stride, "batch": batch,
              "seqlen": seqlen, "heads": heads}
    put_strided(fields, "o", out, o_strides)
    put_strided(fields, "dout", dout, do_strides)
    params = kernel.params.from_dict(fields)
    kernel.launch(_grid(batch, seqlen, heads), (PREPROCESS_BLOCK_THREADS, 1, 1), 0, stream, params)


def zero_dq_accum(dq_accum: DeviceArray, stream: int) -> None:
    """Clear the fp32 accumulator the backward kernels add into (must be contiguous)."""
    runtime.active().backend.memset_async(dq_accum.ptr, 0, dq_accum.nbytes, stream)


def convert_dq(dq_accum: DeviceArray, dq: DeviceArray, scale: float, stream: int) -> None:
    """dq = scale * dq_accum, rounded to dq's 16-bit type."""
    (batch, seqlen, heads, head_dim), acc_strides = _bshd(dq_accum, "dq_accum")
    _, dq_strides = _bshd(dq, "dq")
    if dq_accum.dtype != "fp32" or tuple(dq_accum.shape) != tuple(dq.shape):
        raise ValueError(f"dq_accum must be fp32 with dq's shape {dq.shape}; got {dq_accum.dtype} {dq_accum.shape}")
    if batch * seqlen * heads == 0:
        return
    kernel = runtime.active().kernel(convert_dq_spec(dq.dtype, head_dim), dq.device)
    fields = {"scale": float(scale), "batch": batch, "seqlen": seqlen, "heads": heads}
    put_strided(fields, "dq_accum", dq_accum, acc_strides)
    put_strided(fields, "dq", dq, dq_strides)
    params = kernel.params.from_dict(fields)
    kernel.launch(_grid(batch, seqlen, heads), (PREPROCESS_BLOCK_THREADS, 1, 1), 0, stream, params)
