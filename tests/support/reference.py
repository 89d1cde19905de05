"""float64 attention references for the emulated-device tests, in flash-attn's conventions: THD inputs
(rows of all sequences packed, cu_seqlens boundaries), bottom-right aligned causal masks and sliding
windows, softcap and ALiBi, dropout (hipattn.dropout's keep mask), learnable sinks, and a row that sees
no key gets O = 0 and LSE = +inf (the sink's logit with a sink)."""

from __future__ import annotations

import numpy as np

from hipattn.dropout import keep_mask

# bf16/fp16 inputs, fp32 accumulation: relative error of O and gradients against float64.
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3}


def visible_keys(len_q, len_k, causal, window=(-1, -1)):
    """[len_q, len_k] bool, flash-attn's window_size=(left, right), bottom-right aligned: query i sees key j
    when i + d - left <= j <= i + d + right, d = len_k - len_q. A negative side has no bound; causal
    makes the right side 0."""
    left, right = window[0], 0 if causal else window[1]
    offset = np.arange(len_k)[None, :] - np.arange(len_q)[:, None] - (len_k - len_q)
    return ((left < 0) | (offset >= -left)) & ((right < 0) | (offset <= right))


# flash-attn's score modifiers as the emulated-kernel tests run them, (softcap, ALiBi slopes, causal): a
# softcap small enough to bend N(0, 1) scores (1.5 where flash-attn's tests use 50), ALiBi slopes per head
# ("heads") or per (sequence, head) ("sequences"), and both together under a causal mask.
SCORE_MODIFIER_CASES = [(1.5, None, False), (0.0, "heads", False), (0.0, "sequences", True), (1.5, "heads", True)]


# Dropout as the emulated-kernel tests run it, (window_size, causal): no mask, causal, and a window with
# both sides bounded; with flash-attn's tests' dropout_p and a seed with both 32-bit halves (and the
# sign bit) set.
DROPOUT_CASES = [((-1, -1), False), ((-1, -1), True), ((20, 8), False)]
DROPOUT_P, DROPOUT_SEED = 0.17, -0x3C6E_F372_FE94_F82B


def alibi_slopes(batch, heads, per_sequence=False):
    """ALiBi slopes for tests: the geometric series of the ALiBi paper over the heads ([heads]), or
    ([batch, heads]) that series scaled differently per sequence."""
    series = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    if not per_sequence:
        return series.astype(np.float32)
    return (series[None, :] * (1.0 + 0.5 * np.arange(batch))[:, None]).astype(np.float32)


def modified_scores(s, len_q, len_k, softcap=0.0, slope=0.0):
    """flash-attn's score modifiers on [len_q, len_k] scaled scores s: softcap * tanh(s / softcap), then
    ALiBi's -slope * |j - i - (len_k - len_q)|. Returns the scores and d(score)/d(s)."""
    gradient = np.ones_like(s)
    if softcap:
        t = np.tanh(s / softcap)
        s, gradient = softcap * t, 1.0 - t * t
    offset = np.arange(len_k)[None, :] - np.arange(len_q)[:, None] - (len_k - len_q)
    return s - slope * np.abs(offset), gradient


def dropout_factor(dropout, b, h, heads_q, len_q, len_k):
    """[len_q, len_k]: what sequence b, query head h's probabilities are multiplied by under ``dropout``
    = (dropout_p, seed) or None: 0 where dropped, 1 / (1 - dropout_p) where kept."""
    if dropout is None:
        return 1.0
    dropout_p, seed = dropout
    rows = np.arange(len_q, dtype=np.int64)[:, None]
    keys = np.arange(len_k, dtype=np.int64)[None, :]
    kept = keep_mask(np.int64(seed), b * heads_q + h, rows, keys, dropout_p)
    return np.where(kept, 1.0 / (1.0 - dropout_p), 0.0)


def sink_logits(heads_q: int) -> np.ndarray:
    """Learnable sink logits [Hq] for a test, float32 values (what the kernels read) as float64: from well
    below to well above N(0, 1) scores, so that some rows' sinks dominate and others' barely count."""
    return np.linspace(-4.0, 3.0, heads_q).astype(np.float32).astype(np.float64)


def _slope(slopes, b, h):
    if slopes is None:
        return 0.0
    return float(slopes[h] if slopes.ndim == 1 else slopes[b, h])


def reference_forward(q, k, v, lengths_q, lengths_k, scale, causal, window=(-1, -1), softcap=0.0, alibi=None,
                      dropout=None, sink=None):
    """float64 O [total_q, Hq, D] and LSE [Hq, total_q] of THD inputs (flash-attn's conventions; ``alibi``:
    slopes [Hq] or [batch, Hq]; ``dropout``: (dropout_p, seed) or None; ``sink``: learnable sink logits [Hq],
    one more term exp(sink) of every row's denominator, with no value)."""
    heads_q, heads_kv = q.shape[1], k.shape[1]
    out = np.zeros(q.shape)
    lse = np.full((heads_q, q.shape[0]), np.inf)
    start_q = start_k = 0
    for b, (len_q, len_k) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        for h in range(heads_q):
            qs = q[start_q:start_q + len_q, h]
            ks = k[start_k:start_k + len_k, h // (heads_q // heads_kv)]
            vs = v[start_k:start_k + len_k, h // (heads_q // heads_kv)]
            s, _ = modified_scores(scale * qs @ ks.T, len_q, len_k, softcap, _slope(alibi, b, h))
            s = np.where(visible_keys(len_q, len_k, causal, window), s, -np.inf)
            factor = np.broadcast_to(dropout_factor(dropout, b, h, heads_q, len_q, len_k), s.shape)
            for i in range(len_q):
                row = s[i] if sink is None else np.append(s[i], sink[h])  # the sink: a key with no value
                if np.isneginf(row).all():
                    continue  # sees no key: O = 0, LSE = +inf
                m = row.max()
                p = np.exp(row - m)
                out[start_q + i, h] = (p[:len_k] * factor[i]) @ vs / p.sum()
                lse[h, start_q + i] = m + np.log(p.sum())
        start_q += len_q
        start_k += len_k
    return out, lse


def reference_backward(q, k, v, dout, lengths_q, lengths_k, scale, causal, window=(-1, -1), softcap=0.0,
                       alibi=None, dropout=None, sink=None):
    """float64 dQ, dK, dV of THD inputs; dK and dV summed over each KV head's group of query heads. With
    ``dropout``, O = (P Z) V for the factor Z (dropout_factor): dV = (P Z)ᵀ dO, and dP = Z (dO Vᵀ)
    enters dS = P (dP - rowsum(P dP))."""
    heads_q, heads_kv = q.shape[1], k.shape[1]
    group = heads_q // heads_kv
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    start_q = start_k = 0
    for b, (len_q, len_k) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        rows, keys = slice(start_q, start_q + len_q), slice(start_k, start_k + len_k)
        for h in range(heads_q):
            qs, ks, vs, dos = q[rows, h], k[keys, h // group], v[keys, h // group], dout[rows, h]
            s, gradient = modified_scores(scale * qs @ ks.T, len_q, len_k, softcap, _slope(alibi, b, h))
            visible = visible_keys(len_q, len_k, causal, window)
            s = np.where(visible, s, -np.inf)
            m = np.where(visible.any(1), s.max(1, initial=-np.inf), 0.0)
            p = np.where(visible, np.exp(s - m[:, None]), 0.0)
            sink_weight = 0.0 if sink is None else np.exp(sink[h] - m)[:, None]  # in each row's denominator
            p /= np.maximum(p.sum(1, keepdims=True) + sink_weight, 1e-300)
            factor = dropout_factor(dropout, b, h, heads_q, len_q, len_k)
            dp = (dos @ vs.T) * factor
            ds = p * (dp - (p * dp).sum(1, keepdims=True)) * gradient
            dq[rows, h] = scale * ds @ ks
            dk[keys, h // group] += scale * ds.T @ qs
            dv[keys, h // group] += (p * factor).T @ dos
        start_q += len_q
        start_k += len_k
    return dq, dk, dv


def relative_error(got, want):
    """The largest absolute error relative to the largest reference value (0 for empty arrays)."""
    return float(np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-30))


def packed(x, lengths):
    """THD rows [sum(lengths), ...] of a padded [B, S, ...] array's first lengths[b] tokens per sequence."""
    return np.concatenate([x[b, :n] for b, n in enumerate(lengths)])


def assert_forward_matches(out, lse, want_out, want_lse, dtype):
    """Every element written, O within the dtype's tolerance of float64, and LSE +inf exactly on the
    rows that see no key and close to the reference on every other."""
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an output element was never written"
    assert relative_error(out, want_out) < TOLERANCE[dtype]
    finite = np.isfinite(want_lse)
    assert (np.isinf(lse) == ~finite).all(), "rows that see no key have LSE = +inf, all others a finite one"
    assert np.abs(lse[finite] - want_lse[finite]).max(initial=0.0) < 1e-3


def assert_gradients_match(got, want, dtype):
    """dQ, dK and dV (in that order) each fully written and within the dtype's tolerance of float64."""
    for name, g, w in zip("qkv", got, want, strict=True):
        assert not np.isnan(g).any(), f"d{name}: an element was never written"
        assert relative_error(g, w) < TOLERANCE[dtype], f"d{name}"
