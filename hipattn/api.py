"""flash-attn's functional API, so that users switch by changing the import.

Argument names and order follow flash-attn 2's ``flash_attn_func`` and ``flash_attn_varlen_func``.
Given torch tensors that require grad (with grad mode on), the calls record autograd through
``hipattn.torch``, so ``import hipattn as flash_attn`` trains unchanged; every other
input kind takes the raw-array path, which records nothing. Arguments hipattn does not support
raise ValueError naming them. ``window_size`` is flash-attn's sliding window, ``softcap`` and
``alibi_slopes`` its score modifiers, ``dropout_p`` its dropout (with a seed: hipattn.dropout), and
``block_table`` its paged KV, which takes torch tensors (hipattn.torch_paged gathers the pages).
"""

from __future__ import annotations

from typing import Any

from . import attention
from .dropout import check_dropout_p


def _gathers_pages_in_torch(stream: Any, block_table: Any, q: Any) -> bool:
    """Whether a paged call (``block_table``) goes to hipattn.torch, which gathers the pages with torch
    operations (hipattn.torch_paged); any other array kind, or a stream= beside torch tensors, is refused."""
    if block_table is None:
        return False
    if stream is None and type(q).__module__.startswith("torch"):
        return True
    raise ValueError("block_table (paged KV) in flash_attn_varlen_func takes torch tensors on torch's current stream "
                     "(select another with `with torch.cuda.stream(s):`): hipattn.torch gathers the pages; "
                     "hipattn.flash_attn_with_kvcache takes paged caches of any array kind")


def _draws_seed_in_torch(stream: Any, dropout_p: float, dropout_seed: Any, q: Any) -> bool:
    """Whether a dropout call without a seed goes to hipattn.torch, which draws it from torch's
    generator; any other array kind must bring its seed."""
    if not dropout_p:
        return False
    if dropout_seed is not None:
        if getattr(q, "requires_grad", False) is True:
            raise ValueError("dropout_seed is for calls without autograd: with autograd the seed comes from torch's "
                             "generator (torch.manual_seed makes it reproducible)")
        return False
    if stream is None and type(q).__module__.startswith("torch"):
        return True
    raise ValueError(f"dropout_p is {dropout_p}: pass dropout_seed=, a one-element int64 device array holding the "
                     "64-bit seed (torch tensors without it draw one from torch's generator, on its current stream)")


def _records_gradients(stream: Any, *arrays: Any) -> bool:
    """Whether this call must record autograd: a torch tensor among ``arrays`` requires grad and
    torch's grad mode is on. Decided without importing torch for inputs that are not torch's."""
    if not any(getattr(a, "requires_grad", False) is True for a in arrays):
        return False
    import torch

    if not torch.is_grad_enabled():
        return False
    if stream is not None:
        raise ValueError(
            "stream= cannot be combined with autograd (q, k or v requires grad): torch runs the backward on the "
            "forward's stream, so select it with `with torch.cuda.stream(s):` around the call instead")
    return True


def flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
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
    block_table: Any = None,
    *,
    dropout_seed: Any = None,
    learnable_sink: Any = None,
    stream: Any = None,
):
    """Varlen attention forward, as flash-attn's.

    q: [total_q, nheads, headdim]; k, v: [total_k, nheads_k, headdim] with nheads a multiple of
    nheads_k; cu_seqlens_q/k: int32 [batch + 1] on the device; max_seqlen_q/k: host ints, upper
    bounds of the sequence lengths (any larger value gives the same result). causal aligns the mask
    to the bottom-right corner, as flash-attn 2.1+ does for unequal lengths; for
    len_q = 2, len_k = 5 (1 = kept):
        1 1 1 1 0
        1 1 1 1 1
    window_size=(left, right) is a sliding window aligned the same way: query i sees keys
    [i + len_k - len_q - left, i + len_k - len_q + right]; a negative side has no bound, and causal
    sets right to 0.
    softcap > 0 caps the scores, s = softmax_scale q·k becoming softcap * tanh(s / softcap) (Gemma 2);
    alibi_slopes, fp32 [nheads] or [batch, nheads], adds -slope * |i + len_k - len_q - j| to the score
    of query i and key j (ALiBi: BLOOM, MPT), after the softcap, as flash-attn does.
    dropout_p drops each attention probability with that chance and scales the rest by
    1 / (1 - dropout_p); which are dropped follows from a 64-bit seed (hipattn.dropout), drawn from
    torch's generator for torch tensors, else passed as ``dropout_seed`` (a one-element int64
    device array; hipattn.backward takes the same one). learnable_sink, fp32 [nheads]
    (FlashAttention-4's), adds a logit per query head to every row's softmax denominator, with no value.
    block_table, int32 [batch, pages], reads k and v as paged caches [num_blocks, page_size, nheads_k,
    headdim] (flash-attn's paged KV; key j of sequence b is row j % page_size of page
    block_table[b, j // page_size], cu_seqlens_k giving the lengths): torch tensors only, whose pages
    hipattn.torch gathers into packed keys of batch * max_seqlen_k rows before the kernels run
    (hipattn.torch_paged).
    Returns out [total_q, nheads, headdim]; with return_attn_probs=True, (out, softmax_lse, None)
    where softmax_lse is fp32 [nheads, total_q] (+inf for a row that sees no key); hipattn.torch returns
    flash-attn's S_dmask in place of None for calls with dropout. Torch tensors that require grad, or
    that need a seed drawn, go through hipattn.torch (see the module docstring); for other inputs
    hipattn.backward computes the gradients from out and softmax_lse.
    """
    dropout_p = check_dropout_p(dropout_p)
    if (_gathers_pages_in_torch(stream, block_table, q) or _records_gradients(stream, q, k, v, learnable_sink)
            or _draws_seed_in_torch(stream, dropout_p, dropout_seed, q)):
        from . import torch as autograd_api

        return autograd_api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   dropout_p, softmax_scale, causal, window_size, softcap,
                                                   alibi_slopes, deterministic, return_attn_probs, block_table,
                                                   learnable_sink=learnable_sink)
    out, lse = attention.forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                                 causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 dropout_p=dropout_p, dropout_seed=dropout_seed, learnable_sink=learnable_sink,
                                 stream=stream)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(
    q: Any,
    k: Any,
    v: Any,
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
    """Batch attention forward, as flash-attn's: q [batch, seqlen_q, nheads, headdim], k, v
    [batch, seqlen_k, nheads_k, headdim]. Returns out (and (out, softmax_lse [batch, nheads,
    seqlen_q], None) with return_attn_probs=True). Records autograd, and takes dropout, as
    flash_attn_varlen_func does."""
    dropout_p = check_dropout_p(dropout_p)
    if (_records_gradients(stream, q, k, v, learnable_sink)
            or _draws_seed_in_torch(stream, dropout_p, dropout_seed, q)):
        from . import torch as autograd_api

        return autograd_api.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                            alibi_slopes, deterministic, return_attn_probs,
                                            learnable_sink=learnable_sink)
    out, lse = attention.forward(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                 softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                 dropout_seed=dropout_seed, learnable_sink=learnable_sink, stream=stream)
    return (out, lse, None) if return_attn_probs else out
