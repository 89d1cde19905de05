"""flash-attn's ``S_dmask``: what ``return_attn_probs=True`` returns for a call with dropout, for testing.

flash-attn returns the attention probabilities with the dropout mask in their signs, so that a test can
rebuild the mask and check both the kept fraction and the output against a reference that applies
the same mask. hipattn's layout of the same thing:

- shape [batch, Hq, round(max_seqlen_q, 128), round(max_seqlen_k, 128)] in q's dtype, entry
  [b, h, i, j] for query row i and key j of sequence b (zero past a sequence, and where row i does not
  see key j);
- each visible entry is exp(score - the row's maximum score), negated where dropout drops it: the
  normalization reads ``_get_block_size_n``, which says that one block spans every row;
- the keep decisions are hipattn.dropout.keep_mask's (computed by keep_grid) under the call's seed: the
  kernels' own.

It is computed here with torch, from q and k, in float32. It reads the sequence lengths back to the
host, which synchronizes: this is a testing aid, as flash-attn documents its own.
"""


import torch

from .dropout import keep_grid

Tensor = torch.Tensor

# flash-attn rounds S_dmask's dimensions up to its kernels' tiles of 128.
_ROUND = 128
# The block width the probabilities are normalized over: hipattn's span a whole row.
WHOLE_ROW = 1 << 30


def _get_block_size_n(device=None, head_dim=None, is_dropout=None, is_causal=None) -> int:
    """flash-attn's helper of that name for hipattn's S_dmask: the key-block width whose running maximum
    each entry is relative to. hipattn's entries are relative to their row's maximum: one block."""
    return WHOLE_ROW


def _rounded(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


# Sequences whose probabilities are computed together hold at most this many entries (in float32,
# a quarter of a GiB), so that S_dmask of a large batch costs a few dozen torch calls, not a few per head.
_BLOCK_ENTRIES = 1 << 26


def _blocks(q: Tensor, k: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None):
    """(first sequence, q rows [n, len_q, Hq, D], k rows [n, len_k, Hkv, D]) over the call's sequences:
    chunks of the batch, or each sequence of the varlen packing on its own."""
    if cu_seqlens_q is None:
        per_sequence = q.shape[2] * q.shape[1] * k.shape[1]
        step = max(1, _BLOCK_ENTRIES // max(per_sequence, 1))
        for first in range(0, q.shape[0], step):
            yield first, q[first:first + step], k[first:first + step]
        return
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        yield b, q[starts_q[b]:starts_q[b + 1]][None], k[starts_k[b]:starts_k[b + 1]][None]


def _signed_probabilities(qs: Tensor, ks: Tensor, first: int, softmax_scale: float, window: tuple, softcap: float,
                          alibi_slopes: Tensor | None, dropout_p: float, seed: Tensor) -> Tensor:
    """S_dmask's entries [n, Hq, len_q, len_k] of the n sequences from ``first`` on."""
    count, len_q, heads_q = qs.shape[:3]
    len_k, group = ks.shape[1], heads_q // ks.shape[2]
    row = torch.arange(len_q, device=qs.device, dtype=torch.int64)[:, None]
    key = torch.arange(len_k, device=qs.device, dtype=torch.int64)[None, :]
    offset = key - row - (len_k - len_q)  # the key's distance from the row's diagonal
    visible = torch.ones_like(offset, dtype=torch.bool)
    left, right = window
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    scores = torch.einsum("bihd,bjhd->bhij", qs.float(), ks.float().repeat_interleave(group, dim=2)) * softmax_scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes[None] if alibi_slopes.dim() == 1 else alibi_slopes[first:first + count]
        scores = scores - slopes[..., None, None].float() * offset.abs()
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0) if len_k else scores
    unnormalized = torch.exp(scores - row_max)
    streams = (first + torch.arange(count, device=qs.device))[:, None] * heads_q + torch.arange(heads_q, device=qs.device)
    kept = keep_grid(seed, streams, len_q, len_k, dropout_p)
    return torch.where(kept, unnormalized, -unnormalized)


def dropout_probabilities(q: Tensor, k: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                          max_seqlen_q: int | None, max_seqlen_k: int | None, softmax_scale: float,
                          window: tuple, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
                          seed: Tensor) -> Tensor:
    """S_dmask (the module docstring) of a call's q and k, window (left, right; -1: no bound),
    softcap, ALiBi slopes, dropout_p and seed tensor."""
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    rows = max_seqlen_q if max_seqlen_q is not None else q.shape[1]
    keys = max_seqlen_k if max_seqlen_k is not None else k.shape[1]
    probs = q.new_zeros((batch, q.shape[-2], _rounded(rows), _rounded(keys)))
    for first, qs, ks in _blocks(q, k, cu_seqlens_q, cu_seqlens_k):
        probs[first:first + qs.shape[0], :, :qs.shape[1], :ks.shape[1]] = _signed_probabilities(
            qs, ks, first, softmax_scale, window, softcap, alibi_slopes, dropout_p, seed)
    return probs
