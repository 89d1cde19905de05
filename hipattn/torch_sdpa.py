"""hipattn as torch's flash-attention implementation, behind ``scaled_dot_product_attention``.

    import hipattn.torch
    hipattn.torch.enable()           # or: with hipattn.torch.enabled(): ...
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # hipattn's kernels

torch lets a library replace the CUDA kernels of its flash SDPA ops through
``torch.nn.attention.register_flash_attention_impl`` / ``activate_flash_attention_impl``. Importing
``hipattn.torch`` registers hipattn under the name ``"hipattn"``; ``enable()`` activates it. From
then on ``aten::_scaled_dot_product_flash_attention`` and its backward run hipattn's forward and
backward. SDPA selects that op for calls without a mask on CUDA, and everything built on SDPA
reaches it: transformers' ``attn_implementation="sdpa"``, ``torch.compile``d models, torch's
context parallelism. While hipattn is active the flash backend goes first in SDPA's priority order
(some torch builds prefer cuDNN's on Hopper, and then nothing would reach hipattn).

A call hipattn cannot serve (dropout, an unshipped head_dim, a dtype or layout its kernels refuse,
the debug attention mask) runs torch's own flash kernel instead, which the replaced op would have
called, and the reason is logged at debug level (``HIPATTN_LOG=debug``). hipattn validates every
call on the host before it enqueues anything, so a refused call has launched nothing. Both
implementations take and return flash-attn's log-sum-exp (natural log, [B, H, S_q], fp32), so a
forward by one and a backward by the other still compute the same gradients.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from . import attention
from .log import logger

IMPL_NAME = "hipattn"

# What hipattn's validation raises for a call its kernels cannot serve. Anything else (a driver
# error, a failed compile) is a real failure and propagates.
_REFUSALS = (ValueError, TypeError, NotImplementedError)


def _registry():
    try:
        from torch.nn.attention import _registry
    except ImportError:
        raise RuntimeError(
            f"torch {torch.__version__} has no flash-attention implementation registry "
            "(torch.nn.attention.register_flash_attention_impl); hipattn's SDPA integration needs torch 2.10 "
            "or newer. hipattn.torch.flash_attn_func works with any torch") from None
    return _registry


def register() -> None:
    """Make ``"hipattn"`` known to torch's registry (``torch.nn.attention.list_flash_attention_impls``).
    Providers register at import and never activate: activation is the user's choice."""
    with contextlib.suppress(RuntimeError):
        _registry().register_flash_attention_impl(IMPL_NAME, register_fn=_install)


def enable() -> None:
    """Route torch's flash SDPA ops to hipattn (replacing any other activated implementation)."""
    registry = _registry()
    registry.register_flash_attention_impl(IMPL_NAME, register_fn=_install)
    registry.activate_flash_attention_impl(IMPL_NAME)


def disable() -> None:
    """Give torch's flash SDPA ops back to torch's kernels, if hipattn is the active implementation."""
    registry = _registry()
    if registry.current_flash_attention_impl() == IMPL_NAME:
        registry.restore_flash_attention_impl()


def is_enabled() -> bool:
    try:
        return _registry().current_flash_attention_impl() == IMPL_NAME
    except RuntimeError:
        return False


@contextlib.contextmanager
def enabled():
    """``enable()`` for the block; on exit the implementation active before it is restored."""
    registry = _registry()
    previous = registry.current_flash_attention_impl()
    enable()
    try:
        yield
    finally:
        if previous is None:
            registry.restore_flash_attention_impl()
        elif previous != IMPL_NAME:
            registry.activate_flash_attention_impl(previous)


class _Handle:
    """What torch's registry keeps while hipattn is active; ``remove`` puts torch's kernels and its
    SDPA backend priority back."""

    def __init__(self, library: torch.library.Library, priority: list[int]):
        self.library: torch.library.Library | None = library
        self.priority = priority

    def remove(self) -> None:
        # Dropping the last reference deregisters the library's kernels.
        self.library = None
        torch._C._set_sdp_priority_order(self.priority)


def _install() -> _Handle:
    library = torch.library.Library("aten", "IMPL", "CUDA")
    library.impl("_scaled_dot_product_flash_attention", _sdpa_flash_forward, "CUDA")
    library.impl("_scaled_dot_product_flash_attention_backward", _sdpa_flash_backward, "CUDA")
    # SDPA takes the first backend in its priority order that accepts a call, and some torch builds
    # put cuDNN's ahead of flash on Hopper: then nothing would reach hipattn. Flash goes first while
    # hipattn is active; the others keep their order behind it.
    priority = [int(b) for b in torch._C._get_sdp_priority_order()]
    flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    torch._C._set_sdp_priority_order([flash, *(b for b in priority if b != flash)])
    return _Handle(library, priority)


def _transposed(*tensors: torch.Tensor) -> tuple:
    """SDPA's [B, H, S, D] views as flash-attn's [B, S, H, D] (no copy)."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _forward_refusal(query, key, value, dropout_p, return_debug_mask) -> str | None:
    """Why hipattn will not take this forward, for what its own validation does not cover."""
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (the SDPA backend takes no dropout; hipattn.torch.flash_attn_func does)"
    if return_debug_mask:
        return "return_debug_mask=True (hipattn returns no attention probabilities)"
    if query.dim() != 4:
        return f"query is {query.dim()}-D (nested or packed SDPA inputs)"
    return None


def _sdpa_flash_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                        is_causal: bool = False, return_debug_mask: bool = False, *, scale: float | None = None):
    """``aten::_scaled_dot_product_flash_attention`` on hipattn's kernels, with the op's outputs:
    (out [B, H, S_q, D], logsumexp [B, H, S_q], cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
    philox_offset, debug_attn_mask)."""
    reason = _forward_refusal(query, key, value, dropout_p, return_debug_mask)
    if reason is None:
        # The op's declared strides (its meta function): out like the query, logsumexp contiguous.
        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:3], dtype=torch.float32, device=query.device)
        q, k, v, out_bshd = _transposed(query, key, value, out)
        try:
            attention.forward(q, k, v, out=out_bshd, lse=lse, softmax_scale=scale, causal=is_causal)
        except _REFUSALS as refusal:
            reason = str(refusal)
        else:
            # With no dropout the RNG state is unused; the shapes are those torch's own kernel returns.
            seed = torch.zeros(2, dtype=torch.uint64, device=query.device)
            offset = torch.zeros((), dtype=torch.uint64, device=query.device)
            debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
            return out, lse, None, None, query.shape[2], key.shape[2], seed, offset, debug_mask
    logger.debug("SDPA flash forward runs torch's kernel: %s", reason)
    return _torch_flash_forward(query, key, value, dropout_p, is_causal, return_debug_mask, scale)


def _sdpa_flash_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         out: torch.Tensor, logsumexp: torch.Tensor, cum_seq_q: Any, cum_seq_k: Any, max_q: int,
                         max_k: int, dropout_p: float, is_causal: bool, philox_seed: torch.Tensor,
                         philox_offset: torch.Tensor, *, scale: float | None = None):
    """``aten::_scaled_dot_product_flash_attention_backward`` on hipattn's kernels: (dq, dk, dv)
    shaped and strided like query, key and value."""
    reason = None
    if dropout_p != 0.0:
        reason = f"dropout_p={dropout_p} (hipattn has no dropout)"
    elif cum_seq_q is not None or cum_seq_k is not None or query.dim() != 4:
        reason = "nested or packed SDPA inputs"
    else:
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        # The kernels read rows with 16-byte accesses: autograd may hand over an expanded gradient.
        dout = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        q, k, v, o, do, dq_v, dk_v, dv_v = _transposed(query, key, value, out, dout, dq, dk, dv)
        try:
            attention.backward(do, q, k, v, o, logsumexp, dq=dq_v, dk=dk_v, dv=dv_v, softmax_scale=scale,
                               causal=is_causal, deterministic=torch.are_deterministic_algorithms_enabled())
        except _REFUSALS as refusal:
            reason = str(refusal)
        else:
            return dq, dk, dv
    logger.debug("SDPA flash backward runs torch's kernel: %s", reason)
    return _torch_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                 dropout_p, is_causal, philox_seed, philox_offset, scale)


def _torch_flash_forward(query, key, value, dropout_p, is_causal, return_debug_mask, scale):
    """What torch's CUDA kernel of the SDPA op does: its FlashAttention-2 op on [B, S, H, D] views."""
    q, k, v = _transposed(query, key, value)
    out, lse, seed, offset, debug_mask = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, query.shape[2], key.shape[2], dropout_p, is_causal, return_debug_mask, scale=scale)
    return out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], seed, offset, debug_mask


def _torch_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                          is_causal, philox_seed, philox_offset, scale):
    q, k, v, o, do = _transposed(query, key, value, out, grad_out)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(do, q, k, v, o, logsumexp, cum_seq_q, cum_seq_k, max_q,
                                                          max_k, dropout_p, is_causal, philox_seed, philox_offset,
                                                          scale=scale)
    return _transposed(dq, dk, dv)
