"""Property-based fuzz of valid calls: hypothesis draws a layout, lengths, heads, head_dim,
dtype, mask and schedule at small sizes; hipattn.forward and hipattn.backward, through whichever
path dispatch picks, must match the float64 reference on every row a sequence owns and leave the
padding rows of O untouched.

Each draw is fresh (hypothesis is not derandomised and the inputs come from a drawn seed), so every
run tries new cases; the count of cases run is written to the error report (HIPATTN_ERROR_REPORT).
Heads are drawn from the small-seq path's shipped instantiations (it compiles one kernel per head
count): a fuzz run then never waits on a compile.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hipattn
from hipattn.catalog.common import FLASH_HEAD_DIMS
from hipattn.catalog.smallseq_common import SMALLSEQ_SHIPPED_HEADS, SMALLSEQ_TILE

from .conftest import (
    ROW_TOLERANCE_FACTOR,
    TOLERANCE,
    TORCH_DTYPE,
    cumulative,
    poisoned,
    record_errors,
    relative_error,
    worst_row_error,
)
from .reference import attention_reference

# Long enough for several flash tiles on either side, short enough for a float64 reference per draw.
LONGEST = 300
EXAMPLES = 60
CASES_RUN = {"valid calls": 0}


@st.composite
def valid_calls(draw):
    heads_q = draw(st.sampled_from(SMALLSEQ_SHIPPED_HEADS))
    batch = draw(st.integers(1, 4))
    # Half the draws fit the small-seq tile (that path serves them), half reach past it (flash).
    longest = SMALLSEQ_TILE if draw(st.booleans()) else LONGEST
    lengths = st.lists(st.integers(0, longest), min_size=batch, max_size=batch)
    return dict(
        layout=draw(st.sampled_from(["thd", "bshd"])),
        dtype=draw(st.sampled_from(sorted(TORCH_DTYPE))),
        head_dim=draw(st.sampled_from(FLASH_HEAD_DIMS)),
        heads_q=heads_q,
        heads_kv=heads_q // draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads_q % g == 0])),
        lengths_q=draw(lengths),
        lengths_k=draw(lengths),
        bound_slack=draw(st.integers(0, 40)),  # max_seqlen is an upper bound, not the maximum
        causal=draw(st.booleans()),
        deterministic=draw(st.booleans()),
        seed=draw(st.integers(0, 2**62)),
    )


def _thd_inputs(call, gen):
    t = TORCH_DTYPE[call["dtype"]]
    total_q, total_k = sum(call["lengths_q"]), sum(call["lengths_k"])

    def randn(rows, heads):
        return torch.randn(rows, heads, call["head_dim"], generator=gen, device="cuda").to(t)

    return randn(total_q, call["heads_q"]), randn(total_k, call["heads_kv"]), randn(total_k, call["heads_kv"]), \
        randn(total_q, call["heads_q"])


def _run_thd(call, q, k, v, dout):
    """Returns (out, lse, dq, dk, dv) of a THD call, outputs poisoned before they are written."""
    lq, lk = call["lengths_q"], call["lengths_k"]
    args = dict(cu_seqlens_q=torch.tensor(cumulative(lq), dtype=torch.int32, device="cuda"),
                cu_seqlens_k=torch.tensor(cumulative(lk), dtype=torch.int32, device="cuda"),
                max_seqlen_q=max(lq) + call["bound_slack"], max_seqlen_k=max(lk) + call["bound_slack"],
                causal=call["causal"])
    out = poisoned(q.shape, q.dtype)
    lse = poisoned((call["heads_q"], q.shape[0]), torch.float32)
    hipattn.forward(q, k, v, out=out, lse=lse, **args)
    grads = [poisoned(x.shape, x.dtype) for x in (q, k, v)]
    hipattn.backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                     deterministic=call["deterministic"], **args)
    return out, lse, *grads


def _padded(x, lengths, rows):
    """THD rows -> [batch, rows, H, D]; the padding rows NaN."""
    padded = torch.full((len(lengths), rows, *x.shape[1:]), float("nan"), dtype=x.dtype, device=x.device)
    for b, (start, n) in enumerate(zip(cumulative(lengths)[:-1], lengths, strict=True)):
        padded[b, :n] = x[start:start + n]
    return padded


def _unpadded(x, lengths):
    return torch.cat([x[b, :n] for b, n in enumerate(lengths)])


def _run_bshd(call, q, k, v, dout):
    """The same sequences as a padded batch with seqused: returns THD-shaped results, and whether
    every padding row of O stayed poisoned."""
    lq, lk = call["lengths_q"], call["lengths_k"]
    rows_q, rows_k = max(lq) + call["bound_slack"], max(lk) + call["bound_slack"]
    # Padding rows of the inputs hold NaN: a kernel that lets one reach a result is caught.
    qb, kb, vb, doutb = _padded(q, lq, rows_q), _padded(k, lk, rows_k), _padded(v, lk, rows_k), _padded(dout, lq, rows_q)
    args = dict(seqused_q=torch.tensor(lq, dtype=torch.int32, device="cuda"),
                seqused_k=torch.tensor(lk, dtype=torch.int32, device="cuda"), causal=call["causal"])
    out = poisoned(qb.shape, qb.dtype)
    lse = poisoned((len(lq), call["heads_q"], rows_q), torch.float32)
    hipattn.forward(qb, kb, vb, out=out, lse=lse, **args)
    grads = [poisoned(x.shape, x.dtype) for x in (qb, kb, vb)]
    hipattn.backward(doutb, qb, kb, vb, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                     deterministic=call["deterministic"], **args)
    torch.cuda.synchronize()
    padding_untouched = all(bool(torch.isnan(out[b, n:]).all()) for b, n in enumerate(lq))
    lse_thd = torch.cat([lse[b, :, :n] for b, n in enumerate(lq)], dim=1)
    return (_unpadded(out, lq), lse_thd, _unpadded(grads[0], lq), _unpadded(grads[1], lk), _unpadded(grads[2], lk),
            padding_untouched)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=valid_calls())
def test_every_valid_call_matches_float64(call):
    gen = torch.Generator(device="cuda").manual_seed(call["seed"])
    q, k, v, dout = _thd_inputs(call, gen)
    if call["layout"] == "thd":
        out, lse, dq, dk, dv = _run_thd(call, q, k, v, dout)
        torch.cuda.synchronize()
    else:
        out, lse, dq, dk, dv, padding_untouched = _run_bshd(call, q, k, v, dout)
        assert padding_untouched, f"{call}: O rows past seqused were written"
    cu_q, cu_k = cumulative(call["lengths_q"]), cumulative(call["lengths_k"])
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_reference(
        q, k, v, cu_q, cu_k, causal=call["causal"], scale=1 / math.sqrt(call["head_dim"]), dout=dout)
    tolerance = TOLERANCE[call["dtype"]]
    results = {"out": (out, ref_out), "dq": (dq, ref_dq), "dk": (dk, ref_dk), "dv": (dv, ref_dv)}
    errors = {name: relative_error(a, ref) for name, (a, ref) in results.items()}
    rows = {name: worst_row_error(a, ref) for name, (a, ref) in results.items()}
    seen = torch.isfinite(ref_lse)  # rows that see at least one key; the others have LSE +inf
    lse_error = (lse.double()[seen] - ref_lse[seen]).abs().max().item() if bool(seen.any()) else 0.0
    assert bool((lse[~seen] == float("inf")).all()), f"{call}: a row that sees no key has LSE != +inf"
    CASES_RUN["valid calls"] += 1
    record_errors(f"fuzz {call['dtype']}", **{f"case {CASES_RUN['valid calls']} {n}": e for n, e in errors.items()})
    assert max(errors.values()) < tolerance, (call, errors)
    assert max(rows.values()) < ROW_TOLERANCE_FACTOR * tolerance, (call, rows)
    assert lse_error < 1e-2, (call, lse_error)
