"""tools/matrix/gpu.py's runners on the CPU: hipattn's (through a stand-in for its public API that
computes attention in float32, sliding windows included) and SDPA's flash backend (which torch also
has on the CPU), on small cells of every layout, through run.measure_cell as on the GPU; window cells
against FlexAttention run eagerly and the masked SDPA peer on the math backend; the numeric check; the
clock reader without NVML. What stays untested here is what needs CUDA: events, the spin kernel,
NVML, the ceilings, cuDNN, the efficient backend, varlen_attn and torch.compile of flex_attention.
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

def _attend(q, k, v, causal: bool, window_size=(-1, -1)):
    """One sequence, float32: q [Sq, Hq, D], k/v [Sk, Hkv, D] -> out [Sq, Hq, D], lse [Hq, Sq]. Causal
    and window_size=(left, right) bottom-right aligned, as flash-attn: query i sees key j when
    i + d - left <= j <= i + d + right (d = Sk - Sq), a negative side unbounded, causal: right = 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    left, right = window_size
    right = 0 if causal else right
    diagonal = torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]
    keys = torch.arange(k.shape[0])[None, :]
    keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    if right >= 0:
        keep &= keys <= diagonal + right
    if left >= 0:
        keep &= keys >= diagonal - left
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
    module.windows = []  # the window_size of every call

    def forward(q, k, v, *, out=None, lse=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                max_seqlen_k=None, causal=False, window_size=(-1, -1)):
        module.calls.append(("forward", out is not None))
        module.windows.append(window_size)
        given = out is not None
        out = torch.empty_like(q) if out is None else out
        if lse is None:
            shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
            lse = torch.empty(shape, dtype=torch.float32)
        if given and not write_forward_output:
            return out, lse
        for rows_q, rows_k, lse_index in _sequences(q, cu_seqlens_q, cu_seqlens_k):
            o, row_lse = _attend(q[rows_q].float(), k[rows_k].float(), v[rows_k].float(), causal, window_size)
            out[rows_q] = o.to(out.dtype)
            lse[lse_index] = row_lse
        return out, lse

    def backward(dout, q, k, v, out, lse, *, dq=None, dk=None, dv=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, causal=False, window_size=(-1, -1)):
        module.calls.append(("backward", dq is not None))
        module.windows.append(window_size)
        if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
            raise ValueError("backward got a poisoned out or lse")  # hipattn's kernel would read them
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        for rows_q, rows_k, _ in _sequences(q, cu_seqlens_q, cu_seqlens_k):
            leaves = [t.float().requires_grad_() for t in (q[rows_q], k[rows_k], v[rows_k])]
            o, _ = _attend(*leaves, causal, window_size)
            grads = torch.autograd.grad(o, leaves, dout[rows_q].float())
            for target, grad in zip((dq, dk, dv), grads, strict=True):
                target[rows_q if target is dq else rows_k] = grad.to(target.dtype)
        return dq, dk, dv

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, causal=False,
                                window_size=(-1, -1), out=None):
        module.calls.append(("kvcache", block_table is not None))
        module.windows.append(window_size)
        for b in range(q.shape[0]):
            rows = block_table[b].long() if block_table is not None else [b]
            keys = torch.cat([k_cache[r] for r in rows])[:int(cache_seqlens[b])]
            values = torch.cat([v_cache[r] for r in rows])[:int(cache_seqlens[b])]
            out[b] = _attend(q[b].float(), keys.float(), values.float(), causal, window_size)[0].to(out.dtype)
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


@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention run eagerly (torch.compile needs a C++ compiler and minutes on the CPU), and the
    masked peer on SDPA's math backend (the efficient one is CUDA-only)."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(gpu, "_flex_function", lambda: flex_attention)
    monkeypatch.setattr(gpu, "MASKED_SDPA_BACKEND", "MATH")


WINDOW_CELLS = [
    cells.Cell("window", "fwd", 32, 4, 2, causal=True, batch=2, seqlen_q=40, seqlen_k=40, window_left=7, window_right=0),
    cells.Cell("window", "fwdbwd", 32, 4, 4, causal=False, batch=2, seqlen_q=36, seqlen_k=36, window_left=5,
               window_right=9),
    cells.Cell("window", "fwdbwd", 32, 4, 1, causal=True, batch=1, seqlen_q=48, seqlen_k=48, window_left=11,
               window_right=0),
    cells.Cell("window", "fwd", 32, 4, 2, causal=True, batch=3, seqlen_q=1, seqlen_k=70, window_left=20, window_right=0),
]


@pytest.mark.parametrize("cell", WINDOW_CELLS, ids=lambda c: c.name)
def test_window_cells_match_flexattention_and_the_masked_sdpa(hipattn, eager_flex, cell):
    record = run.measure_cell(cell, CpuMeasurer(), cells.NOMINAL_CEILINGS, rounds=1)
    assert "median_ms" in record["runners"]["hipattn"], record["runners"]["hipattn"]
    assert set(hipattn.windows) == {cell.window}  # every hipattn call got the cell's window
    if cell.is_decode:
        assert set(hipattn.calls) == {("kvcache", False)}
        checked = ("flex", "sdpa_flash")  # SDPA on the window's slice of the cache
    elif cell.direction == "fwd":
        checked = ("flex", "sdpa_masked")
    else:  # FlexAttention has no backward on the CPU: its error is recorded and the cell goes on
        checked = ("sdpa_masked",)
        assert "backward on CPU" in record["runners"]["flex"]["error"]
    for peer in checked:
        assert "median_ms" in record["runners"][peer], record["runners"][peer]
        check = record["checks"][peer]
        assert check["ok"] and check["rel_l2"] < 1e-2, (peer, check)
    assert "error" in record["runners"]["varlen_attn"]  # FA2 only: not on the CPU
    assert record["best_peer"] in checked and record["vs_floor"] > 0


def test_the_checks_see_a_window_that_is_not_applied(monkeypatch, eager_flex):
    """A hipattn that ignored window_size would fail the check against every peer."""
    fake = _fake_hipattn()
    forward = fake.forward
    fake.forward = lambda *a, window_size=(-1, -1), **k: forward(*a, **k)
    monkeypatch.setitem(sys.modules, "hipattn", fake)
    record = run.measure_cell(WINDOW_CELLS[0], CpuMeasurer(), cells.NOMINAL_CEILINGS, rounds=1)
    assert not record["checks"]["flex"]["ok"] and not record["checks"]["sdpa_masked"]["ok"]
    assert record["check"]["ok"] is False


def test_the_window_mask_is_flash_attn_s_rule_and_holds_the_visible_pairs():
    for causal, window in ((True, (3, 0)), (False, (2, 4)), (False, (-1, 1)), (False, (5, -1)), (True, (-1, -1))):
        for length_q, length_k in ((9, 9), (4, 11), (1, 13)):
            cell = cells.Cell("window", "fwd", 8, 2, 2, causal=causal, batch=1, seqlen_q=length_q, seqlen_k=length_k,
                              window_left=window[0], window_right=window[1])
            mask = gpu.window_mask(cell, "cpu")
            shift, (left, right) = length_k - length_q, window
            right = 0 if causal else right
            drawn = [[(left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)
                      for j in range(length_k)] for i in range(length_q)]
            assert mask.tolist() == drawn
            assert int(mask.sum()) == cells.visible_pairs(length_q, length_k, causal, window)


def test_non_window_cells_call_hipattn_without_a_window(hipattn):
    for cell in (BATCH_CELLS[0], BATCH_CELLS[3]):
        gpu.build("hipattn", cell, gpu.prepare(cell, "cpu")).run(0)
    assert set(hipattn.windows) == {(-1, -1)}  # the stand-in's default: no window_size was passed


def test_sdpa_refuses_a_batch_window_cell():
    cell = WINDOW_CELLS[0]
    with pytest.raises(ValueError, match="no sliding window"):
        gpu.build("sdpa_flash", cell, gpu.prepare(cell, "cpu"))


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
