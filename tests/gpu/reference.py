"""A float64 attention reference for varlen (THD) problems, with flash-attn's conventions.

Per sequence: S = scale * q kᵀ, then flash-attn's score modifiers (softcap * tanh(S / softcap), then
ALiBi's -slope * |j - i - d|), causal masks and flash-attn's sliding windows bottom-right aligned
(query i sees key j when i + d - left <= j <= i + d + right, d = len_k - len_q; causal is right = 0),
a row that sees no key gives O = 0 and LSE = +inf. GQA repeats each KV head
for its group of query heads, and dropout applies hipattn.dropout's keep mask. Gradients come from
torch autograd on the float64 graph.
"""

from __future__ import annotations

import torch
from support import reference

from hipattn.dropout import keep_mask


def visible_keys(len_q: int, len_k: int, causal: bool, window=(-1, -1), device=None):
    """[len_q, len_k] bool on ``device``: which keys each query sees (support.reference's rule)."""
    return torch.from_numpy(reference.visible_keys(len_q, len_k, causal, window)).to(device)


def alibi_bias(slopes, b: int, len_q: int, len_k: int, device=None):
    """[H, len_q, len_k] float64 ALiBi bias of sequence ``b``: -slope * |j - i - (len_k - len_q)| per query
    head, from slopes [H] or [batch, H]."""
    head_slopes = (slopes if slopes.dim() == 1 else slopes[b]).double().to(device)
    offset = (torch.arange(len_k, device=device)[None, :] - torch.arange(len_q, device=device)[:, None]
              - (len_k - len_q))
    return -head_slopes[:, None, None] * offset.abs().double()[None]


def dropout_factor(dropout, b: int, heads_q: int, len_q: int, len_k: int, device=None):
    """[H, len_q, len_k] float64: 0 where sequence b's probabilities are dropped, 1 / (1 - dropout_p)
    where kept, for ``dropout`` = (dropout_p, seed tensor)."""
    dropout_p, seed = dropout
    heads = torch.arange(heads_q, device=device, dtype=torch.int64)[:, None, None]
    rows = torch.arange(len_q, device=device, dtype=torch.int64)[None, :, None]
    keys = torch.arange(len_k, device=device, dtype=torch.int64)[None, None, :]
    kept = keep_mask(seed.to(device), b * heads_q + heads, rows, keys, dropout_p)
    return kept.double() / (1.0 - dropout_p)


def attention_reference(q, k, v, cu_q, cu_k, *, causal: bool, scale: float, dout=None, window=(-1, -1), softcap=0.0,
                        alibi=None, dropout=None):
    """Returns (out, lse[, dq, dk, dv]) in float64 for THD inputs and host lists cu_q, cu_k; ``alibi``:
    slopes [Hq] or [batch, Hq]; ``dropout``: (dropout_p, seed tensor), whose keep mask
    (hipattn.dropout.keep_mask) zeroes probabilities on their way to O and scales the rest by
    1 / (1 - dropout_p)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(dout is not None) for t in (q, k, v))
    heads_q, heads_kv = q.shape[1], k.shape[1]
    group = heads_q // heads_kv
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q64[cu_q[b]:cu_q[b + 1]]  # [Lq, Hq, D]
        ks = k64[cu_k[b]:cu_k[b + 1]].repeat_interleave(group, dim=1)
        vs = v64[cu_k[b]:cu_k[b + 1]].repeat_interleave(group, dim=1)
        len_q, len_k = qs.shape[0], ks.shape[0]
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi is not None:
            scores = scores + alibi_bias(alibi, b, len_q, len_k, q.device)
        visible = visible_keys(len_q, len_k, causal, window, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, Lq]; -inf where a row sees nothing
        empty = torch.isinf(lse)
        probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(~visible, 0.0)
        probs = probs.masked_fill(empty[..., None], 0.0)
        if dropout is not None:
            probs = probs * dropout_factor(dropout, b, heads_q, len_q, len_k, q.device)
        outs.append(torch.einsum("hij,jhd->ihd", probs, vs))
        lses.append(lse.masked_fill(empty, float("inf")).detach())
    out = torch.cat(outs) if outs else q64[:0]
    lse = torch.cat(lses, dim=1) if lses else torch.empty(heads_q, 0, dtype=torch.float64, device=q.device)
    if dout is None:
        return out.detach(), lse
    if out.numel():
        out.backward(dout.double())
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (q64, k64, v64)]
    return (out.detach(), lse, *grads)
