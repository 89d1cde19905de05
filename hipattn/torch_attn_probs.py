"""flash-attn's ``S_dmask``: what ``return_attn_probs=True`` returns for a call with dropout, for testing.

flash-attn returns the attention probabilities with the dropout mask in their signs, so that a test can
rebuild the mask and check both the kept fraction and the output against a reference that applies
the same mask. hipattn's layout of the same thing:

- shape [batch, Hq, round(max_seqlen_q, 128), round(max_seqlen_k, 128)] in q's dtype, entry
  [b, h, i, j] for query row i and key j of sequence b (zero past a sequence, and where row i does not
  see key j);
- each visible entry is exp(score - the row's maximum score), negated where dropout drops it: the
  normalization reads ``_get_block_size_n``, which says that one block spans every row;
- the keep decisions are hipattn.dropout.keep_mask's under the call's seed: the kernels' own.

It is computed here with torch, from q and k, in float32. It reads the sequence lengths back to the
host, which synchronizes: this is a testing aid, as flash-attn documents its own.
"""


import torch

from .dropout import keep_mask

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


def _sequences(q: Tensor, k: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None):
    """(q rows, k rows) per sequence: slices of the batch, or of the varlen packing."""
    if cu_seqlens_q is None:
        return [(q[b], k[b]) for b in range(q.shape[0])]
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(q[starts_q[b]:starts_q[b + 1]], k[starts_k[b]:starts_k[b + 1]]) for b in range(len(starts_q) - 1)]


def dropout_probabilities(q: Tensor, k: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                          max_seqlen_q: int | None, max_seqlen_k: int | None, softmax_scale: float,
                          window: tuple, softcap: float, alibi_slopes: Tensor | None, dropout_p: float,
                          seed: Tensor) -> Tensor:
    """S_dmask (the module docstring) of a call's q and k, window (left, right; -1: no bound),
    softcap, ALiBi slopes, dropout_p and seed tensor."""
    sequences = _sequences(q, k, cu_seqlens_q, cu_seqlens_k)
    heads_q, group = q.shape[-2], q.shape[-2] // k.shape[-2]
    rows = max_seqlen_q if max_seqlen_q is not None else q.shape[1]
    keys = max_seqlen_k if max_seqlen_k is not None else k.shape[1]
    probs = q.new_zeros((len(sequences), heads_q, _rounded(rows), _rounded(keys)))
    left, right = window
    for b, (qs, ks) in enumerate(sequences):
        len_q, len_k = qs.shape[0], ks.shape[0]
        row = torch.arange(len_q, device=q.device, dtype=torch.int64)[:, None]
        key = torch.arange(len_k, device=q.device, dtype=torch.int64)[None, :]
        offset = key - row - (len_k - len_q)  # the key's distance from the row's diagonal
        visible = torch.ones_like(offset, dtype=torch.bool)
        if left >= 0:
            visible &= offset >= -left
        if right >= 0:
            visible &= offset <= right
        for h in range(heads_q):
            scores = (qs[:, h].float() @ ks[:, h // group].float().T) * softmax_scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if alibi_slopes is not None:
                slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
                scores = scores - slope * offset.abs()
            scores = scores.masked_fill(~visible, float("-inf"))
            row_max = scores.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0) if len_k else scores
            unnormalized = torch.exp(scores - row_max)
            kept = keep_mask(seed, b * heads_q + h, row, key, dropout_p)
            probs[b, h, :len_q, :len_k] = torch.where(kept, unnormalized, -unnormalized).to(q.dtype)
    return probs
