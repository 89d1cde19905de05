"""PyTorch integration: autograd through hipattn's backward, and opaque custom ops for torch.compile.

    import hipattn.torch as hat
    out = hat.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)
    out.float().sum().backward()   # dq, dk, dv from hipattn's backward kernels

The forward and backward are registered as ``torch.library`` custom ops (``hipattn::forward`` and
``hipattn::backward``) with fake (meta) implementations, so ``torch.compile`` treats them as opaque
calls and traces around them; eager calls on plain tensors skip the ops' dispatch (an autograd
Function over the same forward and backward, or the forward alone when nothing needs a gradient).
Gradients flow to q, k and v; the log-sum-exp output is not
differentiable (its gradient is ignored). Calls the kernels cannot serve raise as hipattn.forward
does (NotImplementedError where no kernel serves the call).

``flash_attn_with_kvcache`` is inference-only (nothing to differentiate): it checks that it was given
torch tensors and runs hipattn.flash_attn_with_kvcache on torch's current stream; traced calls go
through the ``hipattn::kvcache`` custom op, which declares that it appends to the caches in place.

``enable()`` (or ``with enabled():``) makes hipattn torch's flash-attention implementation, so that
``torch.nn.functional.scaled_dot_product_attention`` runs hipattn's kernels (hipattn.torch_sdpa);
``disable()`` gives the ops back to torch.

``ring_flash_attn_varlen_func`` (hipattn.ring) splits packed varlen sequences
over the ranks of a torch.distributed group: ring attention, with its own autograd.

Importing this module needs torch; ``import hipattn`` alone never imports it.
"""

# No `from __future__ import annotations` here: torch.library reads the op schemas from the
# annotations at run time.
from typing import Optional

import torch

from . import attention, kvcache, torch_attn_probs, torch_paged, torch_sdpa
from .catalog.common import FLASH_HEAD_DIMS
from .catalog.decode import DECODE_HEAD_DIMS
from .dropout import check_dropout_p
from .errors import DeviceContentError
from .packed import KV_BATCH, KV_VARLEN, QKV_BATCH, QKV_VARLEN, Packing
from .problem import check_bool, check_max_seqlen, check_softcap, check_window, resolve_softmax_scale
from .ring import ring_flash_attn_varlen_func
from .torch_sdpa import disable, enable, enabled, is_enabled

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "enable", "disable", "enabled",
           "is_enabled", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "ring_flash_attn_varlen_func"]

Tensor = torch.Tensor

# flash-attn's testing helper under flash-attn's name: the key-block width that return_attn_probs's
# S_dmask entries are normalized over (hipattn.torch_attn_probs).
_get_block_size_n = torch_attn_probs._get_block_size_n


def _lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> tuple:
    """flash-attn's softmax_lse layout: [Hq, total_q] for varlen, [B, Hq, S_q] for batch."""
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


def _run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, learnable_sink):
    """hipattn's forward kernels on the op's arguments: (out, lse)."""
    return attention.forward(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                             causal=causal, window_size=(window_left, window_right), softcap=softcap,
                             alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                             learnable_sink=None if learnable_sink is None else learnable_sink.detach())


def _dropout_seed(q: Tensor, dropout_p: float) -> Optional[Tensor]:
    """The seed of a call with dropout (hipattn.dropout), None without: a one-element int64 tensor on
    q's device, filled by torch's generator on the current stream. So the same generator state gives
    the same seed (and the same dropped entries), and a captured graph draws a new one per replay."""
    if not dropout_p:
        return None
    return torch.empty(1, dtype=torch.int64, device=q.device).random_()


@torch.library.custom_op("hipattn::forward", mutates_args=())
def _forward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    dropout_p: float,
    dropout_seed: Optional[Tensor],
    learnable_sink: Optional[Tensor],
    deterministic: bool,
) -> tuple[Tensor, Tensor]:
    del deterministic  # a forward is deterministic; the flag is kept for the backward (_setup_context)
    return _run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                        window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, learnable_sink)


@_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                  window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, learnable_sink,
                  deterministic):
    return torch.empty_like(q), q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


@torch.library.custom_op("hipattn::backward", mutates_args=())
def _backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    dropout_p: float,
    dropout_seed: Optional[Tensor],
    learnable_sink: Optional[Tensor],
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return attention.backward(dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                              causal=causal, window_size=(window_left, window_right), softcap=softcap,
                              alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                              learnable_sink=learnable_sink, deterministic=deterministic)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   causal, window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, learnable_sink,
                   deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
     softcap, alibi_slopes, dropout_p, dropout_seed, learnable_sink, deterministic) = inputs
    out, lse = output
    # The backward regenerates the forward's dropout mask from the same seed.
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, learnable_sink)
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window = (window_left, window_right)
    ctx.softcap, ctx.dropout_p = softcap, dropout_p


def _backward(ctx, grad_out: Tensor, grad_lse: Optional[Tensor]):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, learnable_sink = ctx.saved_tensors
    # The kernels read rows with 16-byte accesses: a gradient that autograd hands over expanded or
    # transposed is made contiguous first.
    grad_out = grad_out.contiguous()
    dq, dk, dv = _backward_op(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                              ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.softmax_scale, ctx.causal, *ctx.window,
                              ctx.softcap, alibi_slopes, ctx.dropout_p, dropout_seed,
                              None if learnable_sink is None else learnable_sink.detach(), ctx.deterministic)
    dsink = None
    if learnable_sink is not None and ctx.needs_input_grad[15]:
        dsink = _sink_gradient(grad_out, out, lse, learnable_sink.detach(), cu_seqlens_q)
    # No gradient for the ALiBi slopes, as flash-attn: they are fixed by the model, not learned.
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, dsink, None


def _sink_gradient(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor, cu_seqlens_q: Optional[Tensor]) -> Tensor:
    """d loss / d learnable_sink[h] = -sum over h's rows of exp(sink[h] - lse) * rowsum(dout * out): a
    row's sink weight is exp(sink - lse), and moving it moves every key's probability against the row's
    Delta. Rows no sequence covers (varlen rows past cu_seqlens_q[-1]) count for nothing; nothing
    here synchronizes."""
    delta = (dout.float() * out.float()).sum(-1)  # [total, Hq] or [B, S, Hq]
    if cu_seqlens_q is None:
        weight = torch.exp(sink[None, :, None] - lse)  # lse [B, Hq, S]
        return -(weight * delta.transpose(1, 2)).sum(dim=(0, 2))
    covered = torch.arange(lse.shape[1], device=lse.device) < cu_seqlens_q[-1]
    weight = torch.exp(sink[:, None] - lse).masked_fill(~covered, 0.0)  # lse [Hq, total]
    return -(weight * delta.transpose(0, 1).masked_fill(~covered, 0.0)).sum(1)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom op's forward and autograd without the op's dispatch, for eager calls on plain
    tensors: a custom op call costs tens of microseconds of host time, which decode steps and small
    layers feel. Anything traced (torch.compile, make_fx, a dispatch or function mode) takes the op."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_seed, learnable_sink,
                deterministic):
        inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                  window_right, softcap, alibi_slopes, dropout_p, dropout_seed, learnable_sink, deterministic)
        output = _run_forward(*inputs[:-1])
        ctx.mark_non_differentiable(output[1])
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _backward(ctx, grad_out, grad_lse)


_TENSOR = torch.Tensor


def _eager(*tensors: Tensor) -> bool:
    """Whether a call on these tensors runs eagerly: plain tensors, with no tracing, dispatch mode or
    torch-function mode around it (the custom ops serve every other case)."""
    return (all(type(t) is _TENSOR for t in tensors) and not torch.compiler.is_compiling()
            and not torch._C._len_torch_dispatch_stack() and not torch._C._is_torch_function_mode_enabled())


def _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window,
            softcap, alibi_slopes, dropout_p, dropout_seed, learnable_sink, deterministic):
    """hipattn's forward with autograd: for plain tensors in eager mode, the autograd Function (or,
    when nothing needs a gradient, the forward alone); the custom op for everything traced."""
    if _eager(q, k, v):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (learnable_sink is not None and learnable_sink.requires_grad)):
            return _EagerAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, causal, *window, softcap, alibi_slopes, dropout_p,
                                         dropout_seed, learnable_sink, deterministic)
        return _run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                            *window, softcap, alibi_slopes, dropout_p, dropout_seed, learnable_sink)
    return _forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       *window, softcap, alibi_slopes, dropout_p, dropout_seed, learnable_sink, deterministic)


def _scale(q: Tensor, softmax_scale: Optional[float]) -> float:
    """The custom op takes a float: the default and the checks are the core API's."""
    return float(resolve_softmax_scale(softmax_scale, q.shape[-1]))


def _host_arguments(max_seqlen_q, max_seqlen_k, causal, deterministic) -> tuple:
    """The scalars checked as the core API checks them, before the op's schema sees them (its
    RuntimeError would name no argument)."""
    for value, name in ((max_seqlen_q, "max_seqlen_q"), (max_seqlen_k, "max_seqlen_k")):
        if value is not None:
            check_max_seqlen(value, name)
    return check_bool(causal, "causal"), check_bool(deterministic, "deterministic")


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[Tensor] = None,
    *,
    learnable_sink: Optional[Tensor] = None,
):
    """hipattn.flash_attn_varlen_func with autograd: see its docstring for shapes and conventions.

    Returns out, or (out, softmax_lse, S_dmask) with return_attn_probs=True; out.backward() runs
    hipattn's backward, bit-identical run to run with ``deterministic=True``. ``dropout_p`` draws its
    seed from torch's generator (hipattn.dropout); S_dmask is None without dropout, else
    flash-attn's testing output (hipattn.torch_attn_probs: it synchronizes, for testing only).
    ``learnable_sink`` (FlashAttention-4's): fp32 [Hq] logits that join each row's softmax denominator
    with no value; they get a gradient when they require one. ``block_table`` (flash-attn's paged KV):
    k and v are then paged caches, gathered into packed keys first (hipattn.torch_paged), through which
    the caches get their gradients.
    """
    causal, deterministic = _host_arguments(max_seqlen_q, max_seqlen_k, causal, deterministic)
    dropout_p = check_dropout_p(dropout_p)
    _check_slopes(alibi_slopes, learnable_sink)
    scale = _scale(q, softmax_scale)
    window, softcap = check_window(window_size, causal), check_softcap(softcap)
    if block_table is not None:
        k, v = torch_paged.packed_keys_and_values(k, v, block_table, cu_seqlens_k, max_seqlen_k)
    seed = _dropout_seed(q, dropout_p)
    original = (q, k)
    (q, k, v), head_dim = _padded_attention(q, k, v)
    out, lse = _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window,
                       softcap, alibi_slopes, dropout_p, seed, learnable_sink, deterministic)
    if head_dim is not None:
        out = out[..., :head_dim]
    if not return_attn_probs:
        return out
    probs = None if seed is None else torch_attn_probs.dropout_probabilities(
        *original, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window, softcap, alibi_slopes,
        dropout_p, seed)
    return out, lse, probs


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
):
    """hipattn.flash_attn_func (q [B, S_q, Hq, D], k/v [B, S_k, Hkv, D]) with autograd; dropout,
    learnable_sink and return_attn_probs as flash_attn_varlen_func's."""
    causal, deterministic = _host_arguments(None, None, causal, deterministic)
    dropout_p = check_dropout_p(dropout_p)
    _check_slopes(alibi_slopes, learnable_sink)
    scale = _scale(q, softmax_scale)
    window, softcap = check_window(window_size, causal), check_softcap(softcap)
    seed = _dropout_seed(q, dropout_p)
    original = (q, k)
    (q, k, v), head_dim = _padded_attention(q, k, v)
    out, lse = _attend(q, k, v, None, None, None, None, scale, causal, window, softcap, alibi_slopes, dropout_p,
                       seed, learnable_sink, deterministic)
    if head_dim is not None:
        out = out[..., :head_dim]
    if not return_attn_probs:
        return out
    probs = None if seed is None else torch_attn_probs.dropout_probabilities(
        *original, None, None, None, None, scale, window, softcap, alibi_slopes, dropout_p, seed)
    return out, lse, probs


@torch.library.custom_op("hipattn::kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    cache_seqlen: Optional[int],
    cache_batch_idx: Optional[Tensor],
    cache_leftpad: Optional[Tensor],
    block_table: Optional[Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    alibi_slopes: Optional[Tensor],
    num_splits: int,
    learnable_sink: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    return kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens if cache_seqlens is not None else cache_seqlen,
        cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, (window_left, window_right), softcap,
        rotary_interleaved, alibi_slopes, num_splits, True, learnable_sink=learnable_sink)


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen, cache_batch_idx,
                  cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                  rotary_interleaved, alibi_slopes, num_splits, learnable_sink):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None, cache_seqlens=None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: tuple = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False, *,
                            learnable_sink: Optional[Tensor] = None):
    """hipattn.flash_attn_with_kvcache on torch tensors, on torch's current stream (flash-attn's
    arguments, and hipattn's learnable_sink; k_cache and v_cache are appended to in place). Traced
    calls (torch.compile) go through the ``hipattn::kvcache`` custom op, which declares that it
    mutates the caches."""
    given = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "rotary_cos": rotary_cos,
             "rotary_sin": rotary_sin, "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad,
             "block_table": block_table, "alibi_slopes": alibi_slopes, "learnable_sink": learnable_sink}
    if not isinstance(cache_seqlens, int):
        given["cache_seqlens"] = cache_seqlens
    _check_tensors("flash_attn_with_kvcache", **{name: value for name, value in given.items() if value is not None})
    _check_paged_capacity(cache_seqlens, k, k_cache, block_table)
    padded, head_dim = _padded(DECODE_HEAD_DIMS, q, k_cache, v_cache, k, v)
    if head_dim is not None:
        # The call on zero-padded copies, at the real head_dim's scale; the appended rows go back into
        # the caller's caches.
        result = flash_attn_with_kvcache(*padded, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                         cache_leftpad, block_table, resolve_softmax_scale(softmax_scale, head_dim),
                                         causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                         return_softmax_lse, learnable_sink=learnable_sink)
        if k is not None:
            k_cache.copy_(padded[1][..., :head_dim])
            v_cache.copy_(padded[2][..., :head_dim])
        return (result[0][..., :head_dim], result[1]) if isinstance(result, tuple) else result[..., :head_dim]
    if _eager(q):
        return kvcache.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
            return_softmax_lse, learnable_sink=learnable_sink)
    host_length = cache_seqlens if isinstance(cache_seqlens, int) else None
    causal = check_bool(causal, "causal")
    out, lse = _kvcache_op(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                           None if host_length is not None else cache_seqlens, host_length, cache_batch_idx,
                           cache_leftpad, block_table, softmax_scale, causal, *check_window(window_size, causal),
                           check_softcap(softcap), check_bool(rotary_interleaved, "rotary_interleaved"), alibi_slopes,
                           num_splits, learnable_sink)
    return (out, lse) if check_bool(return_softmax_lse, "return_softmax_lse") else out


def _check_paged_capacity(cache_seqlens, k: Optional[Tensor], k_cache: Tensor, block_table: Optional[Tensor]) -> None:
    """flash-attn's guard for paged KV: raise DeviceContentError (a RuntimeError, as flash-attn raises,
    and a ValueError) before anything is enqueued when the longest sequence of a device-side
    ``cache_seqlens``, with the new tokens, needs more pages than a block_table row names.

    Like flash-attn, this reads max(cache_seqlens) to the host, which waits for the stream's earlier
    work: only on eager calls with a block table. While a CUDA graph is captured or torch.compile
    traces, and on the array-level hipattn.flash_attn_with_kvcache, nothing is read back and the
    kernels clamp every page index on the device instead (HIPATTN_CHECK=1 checks every entry)."""
    if (block_table is None or not isinstance(cache_seqlens, Tensor) or cache_seqlens.dim() != 1
            or cache_seqlens.numel() == 0 or block_table.dim() != 2 or k_cache.dim() != 4 or not _eager(cache_seqlens)
            or (cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing())):
        return
    new_tokens = k.shape[1] if isinstance(k, Tensor) and k.dim() == 4 else 0
    pages, page_size = block_table.shape[1], k_cache.shape[1]
    longest = int(cache_seqlens.max())
    if longest + new_tokens > pages * page_size:
        raise DeviceContentError(
            f"cache_seqlens reaches {longest} tokens and k appends {new_tokens}, more than the {pages * page_size} "
            f"tokens that a block_table row of {pages} pages of {page_size} holds; give block_table more columns "
            "or shorten cache_seqlens")


def _padded(shipped: tuple[int, ...], q, *others) -> tuple[tuple, int | None]:
    """((q, *others), None) where the kernels have q's head_dim (``shipped``); else (copies of them padded
    with zero columns to the next head_dim the kernels have, the head_dim to slice the output back to).
    The caller takes the softmax scale from the unpadded q.

    Zero columns add nothing to a score or an output, and the gradients of the padding are dropped by
    the slice that undoes it: flash-attn pads head dims that are not a multiple of 8 the same way.
    Tensors of unequal head dims, or beyond the largest kernel, are left for the core checks to refuse.
    ``others`` may hold None (a KV-cache call without new keys)."""
    tensors = (q, *others)
    if not isinstance(q, Tensor) or q.dim() == 0 or q.shape[-1] < 1 or q.shape[-1] in shipped:
        return tensors, None
    head_dim = q.shape[-1]
    target = next((d for d in shipped if d > head_dim), None)
    if target is None or any(not isinstance(t, Tensor) or t.shape[-1] != head_dim for t in tensors if t is not None):
        return tensors, None
    return tuple(None if t is None else torch.nn.functional.pad(t, (0, target - head_dim)) for t in tensors), head_dim


def _padded_attention(q, k, v) -> tuple[tuple, int | None]:
    """(q, k, v) as the attention kernels take them, and the head_dim to slice the output back to (None:
    no slice). Equal head dims: ``_padded``'s. A v head_dim other than q's and k's (DeepSeek's MLA: 192
    for q·k, 128 for v): all three padded with zero columns to the first head_dim the kernels have that
    holds both, at q's softmax scale (the caller's), and the output sliced to v's head_dim. Other
    mismatches are left for the core checks to refuse."""
    if not all(isinstance(t, Tensor) and t.dim() > 0 for t in (q, k, v)) or v.shape[-1] == q.shape[-1]:
        return _padded(FLASH_HEAD_DIMS, q, k, v)
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    target = next((d for d in FLASH_HEAD_DIMS if d >= max(qk_dim, v_dim)), None)
    if target is None or k.shape[-1] != qk_dim or min(qk_dim, v_dim) < 1:
        return (q, k, v), None
    return tuple(torch.nn.functional.pad(t, (0, target - t.shape[-1])) for t in (q, k, v)), v_dim


def _check_slopes(alibi_slopes, learnable_sink=None) -> None:
    """The op's schema takes tensors or None: anything else is refused here, by name (its own error
    would name no argument); the shape, dtype and device checks are the core API's."""
    given = {name: t for name, t in (("alibi_slopes", alibi_slopes), ("learnable_sink", learnable_sink))
             if t is not None}
    _check_tensors("flash_attn_func", **given)


def _check_tensors(function: str, **given) -> None:
    """TypeError naming the first of ``given`` that is not a torch tensor (hipattn.``function`` is the
    entry point for other array kinds)."""
    for name, value in given.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}; hipattn.{function} takes "
                            "other array kinds")


def _unpack(packed: Tensor, packing: Packing) -> tuple:
    """Views of the tensors stacked in ``packed``: unbind's backward stacks their gradients into one
    tensor of the packed shape, as flash-attn's dqkv and dkv are."""
    packing.check_shape(tuple(packed.shape))
    return packed.unbind(packing.axis)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
):
    """flash_attn_func with autograd on q, k, v stacked in qkv [B, S, 3, H, D]: the gradient arrives in
    qkv.grad, one tensor of qkv's shape (hipattn.flash_attn_qkvpacked_func's docstring)."""
    _check_tensors("flash_attn_qkvpacked_func", qkv=qkv)
    q, k, v = _unpack(qkv, QKV_BATCH)
    return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           deterministic=deterministic, return_attn_probs=return_attn_probs,
                           learnable_sink=learnable_sink)


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
):
    """flash_attn_func with autograd on q [B, S_q, Hq, D] and k, v stacked in kv [B, S_k, 2, Hkv, D]."""
    _check_tensors("flash_attn_kvpacked_func", q=q, kv=kv)
    k, v = _unpack(kv, KV_BATCH)
    return flash_attn_func(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           deterministic=deterministic, return_attn_probs=return_attn_probs,
                           learnable_sink=learnable_sink)


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
):
    """flash_attn_varlen_func with autograd on q, k, v stacked in qkv [total, 3, H, D], cu_seqlens and
    max_seqlen serving queries and keys alike."""
    _check_tensors("flash_attn_varlen_qkvpacked_func", qkv=qkv, cu_seqlens=cu_seqlens)
    q, k, v = _unpack(qkv, QKV_VARLEN)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout_p,
                                  softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                  softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                                  return_attn_probs=return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Optional[Tensor] = None,
):
    """flash_attn_varlen_func with autograd on q [total_q, Hq, D] and k, v stacked in kv [total_k, 2, Hkv, D]."""
    _check_tensors("flash_attn_varlen_kvpacked_func", q=q, kv=kv, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k)
    k, v = _unpack(kv, KV_VARLEN)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  deterministic=deterministic, return_attn_probs=return_attn_probs,
                                  learnable_sink=learnable_sink)


torch_sdpa.register()
