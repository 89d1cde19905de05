"""tools/matrix/gpu.py's runners on the CPU: hipattn's (through a stand-in for its public API that
computes attention in float32) and SDPA's flash backend (which torch also has on the CPU), on small
cells of every layout, through run.measure_cell as on the GPU; the numeric check; the clock reader
without NVML. What stays untested here is what needs CUDA: events, the spin kernel, NVML, the
ceilings, cuDNN, the efficient backend and varlen_attn.
"""

from __future__ import annotations

import math
import sys
import time
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
from tools.matrix import cells, gpu, run  # noqa: E402 - gpu.py imports torch

# ---- a stand-in for hipattn's public API -----------------------------------------------------------

def _attend(q, k, v, causal: bool):
    """One sequence, float32: q [Sq, Hq, D], k/v [Sk, Hkv, D] -> out [Sq, Hq, D], lse [Hq, Sq]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:  # bottom-right
        keep = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


def _sequences(q, cu_seqlens_q, cu_seqlens_k):
    """(query rows, key rows, lse index) per sequence, BSHD or THD."""
    if cu_seqlens_q is None:
        return [(b, b, b) for b in range(q.shape[0])]
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1]), (slice(None), slice(cu_q[i], cu_q[i + 1])))
            for i in range(len(cu_q) - 1)]


def _fake_hipattn(write_forward_output: bool = True) -> types.ModuleType:
    module = types.ModuleType("hipattn")
    module.calls = []

    def forward(q, k, v, *, out=None, lse=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                max_seqlen_k=None, causal=False):
        module.calls.append(("forward", out is not None))
        given = out is not None
        out = torch.empty_like(q) if out is None else out
        if lse is None:
            shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
            lse = torch.empty(shape, dtype=torch.float32)
        if given and not write_forward_output:
            return out, lse
        for rows_q, rows_k, lse_index in _sequences(q, cu_seqlens_q, cu_seqlens_k):
            o, row_lse = _attend(q[rows_q].float(), k[rows_k].float(), v[rows_k].float(), causal)
            out[rows_q] = o.to(out.dtype)
            lse[lse_index] = row_lse
        return out, lse

    def backward(dout, q, k, v, out, lse, *, dq=None, dk=None, dv=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, causal=False):
        module.calls.append(("backward", dq is not None))
        if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
            raise ValueError("backward got a poisoned out or lse")  # hipattn's kernel would read them
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        for rows_q, rows_k, _ in _sequences(q, cu_seqlens_q, cu_seqlens_k):
            leaves = [t.float().requires_grad_() for t in (q[rows_q], k[rows_k], v[rows_k])]
            o, _ = _attend(*leaves, causal)
            grads = torch.autograd.grad(o, leaves, dout[rows_q].float())
            for target, grad in zip((dq, dk, dv), grads, strict=True):
                target[rows_q if target is dq else rows_k] = grad.to(target.dtype)
        return dq, dk, dv

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, causal=False, out=None):
        module.calls.append(("kvcache", block_table is not None))
        for b in range(q.shape[0]):
            rows = block_table[b].long() if block_table is not None else [b]
            keys = torch.cat([k_cache[r] for r in rows])[:int(cache_seqlens[b])]
            values = torch.cat([v_cache[r] for r in rows])[:int(cache_seqlens[b])]
            out[b] = _attend(q[b].float(), keys.float(), values.float(), causal)[0].to(out.dtype)
        return out

    module.forward, module.backward, module.flash_attn_with_kvcache = forward, backward, flash_attn_with_kvcache
    return module


class CpuMeasurer:
    """gpu.py's data and runners, timed with the host clock."""

    def prepare(self, cell):
        return gpu.prepare(cell, "cpu")

    build = staticmethod(gpu.build)
    compare = staticmethod(gpu.compare)

    def first_call(self, runner):
        return runner.run(0)

    def sample(self, runner, start, calls):
        begin = time.perf_counter()
        for call in range(calls):
            runner.run(start + call)
        return (time.perf_counter() - begin) * 1e3 / calls

    def clock_mhz(self):
        return None

    def context_ok(self):
        return True

    def release(self):
        pass


@pytest.fixture
def hipattn(monkeypatch):
    fake = _fake_hipattn()
    monkeypatch.setitem(sys.modules, "hipattn", fake)
    return fake


BATCH_CELLS = [
    cells.Cell("batch", "fwd", 32, 4, 2, causal=True, batch=2, seqlen_q=24, seqlen_k=24),
    cells.Cell("batch", "fwdbwd", 32, 4, 4, causal=False, batch=2, seqlen_q=16, seqlen_k=16),
    cells.Cell("batch", "fwdbwd", 32, 4, 1, causal=True, batch=3, seqlen_q=20, seqlen_k=20),
    cells.Cell("decode", "fwd", 32, 4, 2, batch=3, seqlen_q=1, seqlen_k=40),
    cells.Cell("decode", "fwd", 32, 4, 2, batch=3, seqlen_q=1, seqlen_k=48, page_size=16),
]


@pytest.mark.parametrize("cell", BATCH_CELLS, ids=lambda c: c.name)
def test_hipattn_matches_sdpa_flash_through_the_runners(hipattn, cell):
    record = run.measure_cell(cell, CpuMeasurer(), cells.NOMINAL_CEILINGS, rounds=1)
    assert "median_ms" in record["runners"]["hipattn"], record["runners"]["hipattn"]
    assert "median_ms" in record["runners"]["sdpa_flash"], record["runners"]["sdpa_flash"]
    check = record["checks"]["sdpa_flash"]
    assert check["ok"] and check["rel_l2"] < 1e-2, check
    assert record["best_peer"] is not None and record["vs_floor"] > 0
    if cell.section == "decode":  # flash_attn_with_kvcache, paged through a block table in paged cells
        assert set(hipattn.calls) == {("kvcache", bool(cell.page_size))}
    else:  # forward/backward with the outputs passed in, after one allocating call per input set
        sets = cells.input_sets(cell)
        assert hipattn.calls[:sets * (1 if cell.direction == "fwd" else 2)] == (
            [("forward", False)] * sets if cell.direction == "fwd" else [("forward", False), ("backward", False)] * sets)
        assert all(given for _, given in hipattn.calls[sets * (1 if cell.direction == "fwd" else 2):])


def test_a_small_seq_backward_runs_on_thd_and_its_padded_peer_is_not_checked(hipattn):
    cell = cells.Cell("smallseq", "bwd", 32, 4, 2, batch=6)
    record = run.measure_cell(cell, CpuMeasurer(), cells.NOMINAL_CEILINGS, rounds=1)
    assert "median_ms" in record["runners"]["hipattn"], record["runners"]["hipattn"]
    assert record["runners"]["sdpa_flash"]["padded"] is True and "median_ms" in record["runners"]["sdpa_flash"]
    assert "error" in record["runners"]["varlen_attn"]  # FA2 only: not on the CPU
    assert record["checks"] == {}
    assert record["shape"]["total_q"] == sum(cells.smallseq_lengths(6)[0])


def test_the_hipattn_backward_runner_returns_its_gradients_and_keeps_out_and_lse(hipattn):
    cell = cells.Cell("smallseq", "bwd", 32, 4, 2, batch=5)
    data = gpu.prepare(cell, "cpu")
    grads = gpu.build("hipattn", cell, data).run(0)
    s = data.sets[0]
    _, expected_dk, _ = _fake_hipattn().backward(s["dout"], s["q"], s["k"], s["v"],
                                                 *_fake_hipattn().forward(s["q"], s["k"], s["v"], **data.sequence_args),
                                                 **data.sequence_args)
    assert [g.shape for g in grads] == [s["q"].shape, s["k"].shape, s["v"].shape]
    assert torch.equal(grads[1], expected_dk)


def test_an_output_hipattn_does_not_write_fails_the_check(monkeypatch):
    monkeypatch.setitem(sys.modules, "hipattn", _fake_hipattn(write_forward_output=False))
    cell = BATCH_CELLS[0]
    record = run.measure_cell(cell, CpuMeasurer(), cells.NOMINAL_CEILINGS, rounds=1)
    assert record["checks"]["sdpa_flash"] == {"ok": False, "finite": False, "rel_l2": None, "max_abs_diff": None}
    assert record["check"]["ok"] is False


def test_prepare_draws_fresh_random_sets_and_thd_sequence_bounds():
    cell = cells.Cell("smallseq", "fwd", 32, 4, 2, batch=7)
    data = gpu.prepare(cell, "cpu")
    lengths_q, lengths_k = cells.smallseq_lengths(7)
    assert data.sequence_args["cu_seqlens_q"].tolist() == [0, *torch.tensor(lengths_q).cumsum(0).tolist()]
    assert data.sequence_args["max_seqlen_k"] == max(lengths_k) and data.sequence_args["cu_seqlens_k"].dtype == torch.int32
    assert len(data.sets) == cells.input_sets(cell) > 1
    q0, q1 = data.sets[0]["q"], data.sets[1]["q"]
    assert q0.dtype == torch.bfloat16 and q0.shape == (sum(lengths_q), 4, 32) and not torch.equal(q0, q1)
    assert float(q0.float().std()) == pytest.approx(1.0, rel=0.2)  # never zeros
    assert torch.equal(gpu.prepare(cell, "cpu").sets[0]["k"], data.sets[0]["k"])  # seeded by the cell's name


def test_compare():
    reference = (torch.randn(64, 8), torch.randn(16, 8))
    same = gpu.compare(tuple(t.bfloat16() for t in reference), reference)
    assert same["ok"] and same["rel_l2"] < 5e-3
    off = gpu.compare((reference[0] * 1.1, reference[1]), reference)
    assert not off["ok"] and off["rel_l2"] == pytest.approx(0.1, rel=1e-3)
    spike = reference[0].clone()
    spike[3, 3] += 10 * float(reference[0].abs().max())
    assert not gpu.compare((spike, reference[1]), reference)["ok"]
    nan = reference[1].clone()
    nan[0, 0] = float("nan")
    assert gpu.compare((reference[0], nan), reference)["finite"] is False
    with pytest.raises(ValueError, match="shape"):
        gpu.compare((reference[0].T, reference[1]), reference)


def test_the_clock_reader_answers_none_without_nvml_or_nvidia_smi(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)
    reader = gpu.ClockReader(0)
    assert reader.source == "none" and reader.read() is None
