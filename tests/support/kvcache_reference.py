"""A float64 model of flash_attn_with_kvcache, for the emulated-device and GPU tests: the append (with
rotary on the new keys) into a contiguous or paged cache, rotary on the queries, and attention over
each sequence's visible keys, in flash-attn's conventions (bottom-right causal, keys from
cache_leftpad, softcap and ALiBi with key positions counted from cache_leftpad, a learnable sink per
query head in every row's softmax sum, a row that sees no key gets O = 0 and LSE = +inf, or the
sink's logit).

Arrays are NumPy float64 in the call's layouts; ``round16`` rounds float64 to the call's 16-bit
dtype and back, as the kernels store rotated rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from support.reference import modified_scores, visible_keys


def rotate(x, cos, sin, positions, interleaved):
    """x [T, H, D] with rotary at ``positions`` [T] (cos/sin [P, R/2]): GPT-J pairs (2i, 2i+1) when
    interleaved, GPT-NeoX halves (i, i + R/2) otherwise; columns past R unchanged."""
    half = cos.shape[1]
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    out = x.copy()
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = a * c - b * s
        out[..., 1:2 * half:2] = a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half] = a * c - b * s
        out[..., half:2 * half] = a * s + b * c
    return out


@dataclass
class KvCacheCase:
    """One call's inputs (float64 values exactly representable in the dtype), as the test built them."""

    q: np.ndarray  # [B, Sq, Hq, D]
    k_cache: np.ndarray  # [entries, S, Hkv, D] (paged: [pages, page_size, Hkv, D])
    v_cache: np.ndarray
    cache_seqlens: np.ndarray  # [B] int
    k: np.ndarray | None = None  # [B, S_new, Hkv, D]
    v: np.ndarray | None = None
    cos: np.ndarray | None = None  # [P, R/2]
    sin: np.ndarray | None = None
    interleaved: bool = True
    batch_idx: np.ndarray | None = None
    leftpad: np.ndarray | None = None
    block_table: np.ndarray | None = None  # [B, pages per sequence]
    causal: bool = False
    window: tuple = (-1, -1)  # flash-attn's window_size; -1: no bound on that side
    softcap: float = 0.0
    alibi: np.ndarray | None = None  # ALiBi slopes, [Hq] or [B, Hq]
    sink: np.ndarray | None = None  # learnable sink logits, [Hq]

    def sequence_rows(self, b):
        """(cache array index, token index) arrays of sequence b's cache positions 0 .. capacity-1."""
        if self.block_table is not None:
            page_size = self.k_cache.shape[1]
            positions = np.arange(self.block_table.shape[1] * page_size)
            return self.block_table[b][positions // page_size], positions % page_size
        entry = self.batch_idx[b] if self.batch_idx is not None else b
        positions = np.arange(self.k_cache.shape[1])
        return np.full(positions.shape, entry), positions


def expected(case: KvCacheCase, scale: float, round16):
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq], k_cache, v_cache) after the call, in float64."""
    k_cache, v_cache = case.k_cache.copy(), case.v_cache.copy()
    batch, seqlen_q, heads_q, _ = case.q.shape
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    seqlen_new = 0 if case.k is None else case.k.shape[1]
    out = np.zeros(case.q.shape)
    lse = np.full((batch, heads_q, seqlen_q), np.inf)
    for b in range(batch):
        length = int(case.cache_seqlens[b])
        entries, tokens = case.sequence_rows(b)
        q = case.q[b]
        if seqlen_new:
            new_positions = length + np.arange(seqlen_new)
            k_new = case.k[b]
            if case.cos is not None:
                k_new = round16(rotate(k_new, case.cos, case.sin, new_positions, case.interleaved))
            k_cache[entries[new_positions], tokens[new_positions]] = k_new
            v_cache[entries[new_positions], tokens[new_positions]] = case.v[b]
        if case.cos is not None:
            # Causal and windowed calls rotate query token t at cache_seqlens + t, as flash-attn does.
            advancing = case.causal or any(0 <= side < case.k_cache.shape[1] * (
                1 if case.block_table is None else case.block_table.shape[1]) for side in case.window)
            q_positions = length + (np.arange(seqlen_q) if advancing else np.zeros(seqlen_q, int))
            q = round16(rotate(q, case.cos, case.sin, q_positions, case.interleaved))
        total = length + seqlen_new
        start = int(case.leftpad[b]) if case.leftpad is not None else 0
        keys = k_cache[entries[:total], tokens[:total]]  # [total, Hkv, D]
        values = v_cache[entries[:total], tokens[:total]]
        # The window, bottom-right aligned with the cache's end, and no key before leftpad.
        visible = visible_keys(seqlen_q, total, case.causal, case.window)
        visible[:, :start] = False
        for h in range(heads_q):
            # flash-attn's sequence starts at leftpad: its keys are positions 0 .. len_k - 1 from there.
            s = np.full((seqlen_q, total), -np.inf)
            slope = 0.0 if case.alibi is None else float(case.alibi[h] if case.alibi.ndim == 1 else case.alibi[b, h])
            s[:, start:], _ = modified_scores(scale * q[:, h] @ keys[start:, h // group].T, seqlen_q, total - start,
                                              case.softcap, slope)
            sink = -np.inf if case.sink is None else float(case.sink[h])
            for i in range(seqlen_q):
                if not visible[i].any():
                    lse[b, h, i] = np.inf if case.sink is None else sink
                    continue
                row = np.where(visible[i], s[i], -np.inf)
                m = max(row.max(), sink)
                p = np.exp(row - m)
                denominator = p.sum() + np.exp(sink - m)  # the sink: one more term, with no value
                out[b, i, h] = p @ values[:, h // group] / denominator
                lse[b, h, i] = m + np.log(denominator)
    return out, lse, k_cache, v_cache
