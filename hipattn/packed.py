"""flash-attn's packed-input functions: q, k and v (or k and v) stacked in one array.

    out = hipattn.flash_attn_qkvpacked_func(qkv, causal=True)              # qkv [batch, seqlen, 3, nheads, headdim]
    out = hipattn.flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

Arguments, order, defaults and return values are flash-attn 2's, plus the keyword-only ``dropout_seed=``,
``learnable_sink=`` and ``stream=`` of hipattn.flash_attn_func. Each function splits the packed array
into q, k and v views of its memory (no copy) and calls ``api.flash_attn_func`` or
``api.flash_attn_varlen_func`` with every other argument as it was given: what those functions support,
refuse (ValueError naming the argument) or record (autograd, for torch tensors that require grad: the
views carry it back to the packed tensor) is the same here, and an error about one of the views (dtype,
device, alignment) names it q, k or v as they do.

The views: torch tensors split by ``unbind`` (whose backward stacks the three gradients into one tensor),
CuPy arrays by indexing; any other kind (``__cuda_array_interface__``, DLPack, a DeviceArray) is described
once and split into DeviceArrays over its memory that keep its producer alive. A view has the packed
array's strides without the stacked dimension, so for a contiguous qkv [B, S, 3, H, D] the token stride is
3 * H * D and the head stride D: the kernels' 16-byte rule holds for the views whenever a row of head_dim
elements is a multiple of 16 bytes, as for unpacked inputs.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from . import api, arrays
from .device_array import ELEMENT_SIZE, DeviceArray


class Packing(NamedTuple):
    """How one packed argument stacks its arrays: its name, rank, the stacked dimension and its extent."""

    name: str
    rank: int
    axis: int
    count: int
    layout: str

    def check_shape(self, shape: tuple) -> None:
        """ValueError naming the argument unless ``shape`` is this packing's (host facts only)."""
        stacked = "q, k and v" if self.count == 3 else "k and v"
        if len(shape) != self.rank:
            raise ValueError(f"{self.name} has shape {shape}; expected {self.rank} dimensions {self.layout} "
                             f"({stacked} stacked in dimension {self.axis})")
        if shape[self.axis] != self.count:
            raise ValueError(f"{self.name} has shape {shape}; its dimension {self.axis} stacks {stacked}, so it must "
                             f"have extent {self.count}, not {shape[self.axis]} (expected {self.layout})")


QKV_BATCH = Packing("qkv", 5, 2, 3, "[batch, seqlen, 3, nheads, headdim]")
KV_BATCH = Packing("kv", 5, 2, 2, "[batch, seqlen_k, 2, nheads_k, headdim]")
QKV_VARLEN = Packing("qkv", 4, 1, 3, "[total, 3, nheads, headdim]")
KV_VARLEN = Packing("kv", 4, 1, 2, "[total_k, 2, nheads_k, headdim]")


def _framework(obj: Any) -> str | None:
    """'torch' or 'cupy' for the arrays whose own indexing makes views; None for every other kind.
    Neither module is imported: an array of one means its module is already in sys.modules."""
    for module, class_name in (("torch", "Tensor"), ("cupy", "ndarray")):
        array_type = getattr(sys.modules.get(module), class_name, None)
        if isinstance(array_type, type) and isinstance(obj, array_type):
            return module
    return None


def split(packed: Any, packing: Packing, stream: Any = None) -> tuple:
    """The arrays stacked in ``packed``, as views of its memory; TypeError or ValueError naming the
    argument for anything that is not an array of ``packing``'s shape, before anything is enqueued."""
    framework = _framework(packed)
    if framework is not None:
        packing.check_shape(tuple(packed.shape))
        if framework == "torch":
            return packed.unbind(packing.axis)
        leading = (slice(None),) * packing.axis
        return tuple(packed[(*leading, i)] for i in range(packing.count))
    # As attention.forward describes its inputs: a DLPack producer orders its pending writes before the
    # consumer's stream, known here only as a raw handle.
    described = arrays.as_device_array(packed, packing.name, stream=stream if type(stream) is int else None)
    packing.check_shape(described.shape)
    return _device_array_views(described, packing)


def _device_array_views(base: DeviceArray, packing: Packing) -> tuple[DeviceArray, ...]:
    """DeviceArrays over each slice of ``base`` along the stacked dimension: its device, framework,
    producer stream and read-only flag, and its owner, which keeps the memory alive while a view lives."""
    axis = packing.axis
    shape = base.shape[:axis] + base.shape[axis + 1:]
    strides = base.strides[:axis] + base.strides[axis + 1:]
    # A null pointer is only allowed for an empty array, and then every view is empty too: no memory.
    step = base.strides[axis] * ELEMENT_SIZE[base.dtype] if base.ptr else 0
    return tuple(DeviceArray(base.ptr + i * step, shape, strides, base.dtype, base.device, base.framework,
                             base.owner, base.stream, base.readonly)
                 for i in range(packing.count))


def flash_attn_qkvpacked_func(
    qkv: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_seed: Any = None,
    learnable_sink: Any = None,
    stream: Any = None,
):
    """hipattn.flash_attn_func on q, k, v stacked in ``qkv`` [batch, seqlen, 3, nheads, headdim]
    (one head count: for GQA/MQA, flash_attn_kvpacked_func). Returns out [batch, seqlen, nheads,
    headdim], or (out, softmax_lse [batch, nheads, seqlen], None) with return_attn_probs=True. Given a
    torch tensor that requires grad it records autograd, and the gradient lands in qkv.grad as one
    tensor of qkv's shape."""
    q, k, v = split(qkv, QKV_BATCH, stream)
    return api.flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                               deterministic=deterministic, return_attn_probs=return_attn_probs,
                               dropout_seed=dropout_seed, learnable_sink=learnable_sink, stream=stream)


def flash_attn_kvpacked_func(
    q: Any,
    kv: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_seed: Any = None,
    learnable_sink: Any = None,
    stream: Any = None,
):
    """hipattn.flash_attn_func on q [batch, seqlen_q, nheads, headdim] and k, v stacked in ``kv``
    [batch, seqlen_k, 2, nheads_k, headdim], nheads a multiple of nheads_k (GQA/MQA). causal aligns
    the mask bottom-right, as flash_attn_func does. Returns what flash_attn_func returns."""
    k, v = split(kv, KV_BATCH, stream)
    return api.flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                               deterministic=deterministic, return_attn_probs=return_attn_probs,
                               dropout_seed=dropout_seed, learnable_sink=learnable_sink, stream=stream)


def flash_attn_varlen_qkvpacked_func(
    qkv: Any,
    cu_seqlens: Any,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_seed: Any = None,
    learnable_sink: Any = None,
    stream: Any = None,
):
    """hipattn.flash_attn_varlen_func on q, k, v stacked in ``qkv`` [total, 3, nheads, headdim], one
    set of sequences for queries and keys: int32 ``cu_seqlens`` [batch + 1] and the host int
    ``max_seqlen`` serve as both cu_seqlens_q/k and max_seqlen_q/k (errors about them name those).
    Returns out [total, nheads, headdim], or (out, softmax_lse [nheads, total], None) with
    return_attn_probs=True."""
    q, k, v = split(qkv, QKV_VARLEN, stream)
    return api.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout_p,
                                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                      softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                                      return_attn_probs=return_attn_probs, dropout_seed=dropout_seed,
                                      learnable_sink=learnable_sink, stream=stream)


def flash_attn_varlen_kvpacked_func(
    q: Any,
    kv: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_seed: Any = None,
    learnable_sink: Any = None,
    stream: Any = None,
):
    """hipattn.flash_attn_varlen_func on q [total_q, nheads, headdim] and k, v stacked in ``kv``
    [total_k, 2, nheads_k, headdim], nheads a multiple of nheads_k (GQA/MQA). Returns what
    flash_attn_varlen_func returns."""
    k, v = split(kv, KV_VARLEN, stream)
    return api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                      deterministic=deterministic, return_attn_probs=return_attn_probs,
                                      dropout_seed=dropout_seed, learnable_sink=learnable_sink, stream=stream)
