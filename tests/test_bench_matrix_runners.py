"""tools/matrix/gpu.py's runners on the CPU: hipattn's (through a stand-in for its public API that
computes attention in float32, sliding windows and score modifiers included) and SDPA's flash backend
(which torch also has on the CPU), on small cells of every layout, through run.measure_cell as on the
GPU; window and score-modifier cells against FlexAttention run eagerly and the masked and biased SDPA
peers on the math backend; the numeric check; the clock reader without NVML. What stays untested here is what needs CUDA: events, the spin kernel,
NVML, the ceilings, cuDNN, the efficient backend, varlen_attn and torch.compile of flex_attention.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
from tools.matrix import cells, gpu, run  # noqa: E402 - gpu.py imports torch

# ---- a stand-in for hipattn's public API -----------------------------------------------------------

def _attend(q, k, v, causal: bool, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """One sequence, float32: q [Sq, Hq, D], k/v [Sk, Hkv, D] -> out [Sq, Hq, D], lse [Hq, Sq]. Causal
    and window_size=(left, right) bottom-right aligned, as flash-attn: query i sees key j when
    i + d - left <= j <= i + d + right (d = Sk - Sq), a negative side unbounded, causal: right = 0.
    softcap caps the scaled score s to softcap * tanh(s / softcap); ALiBi then adds -slope[h] * |i + d - j|."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    left, right = window_size
    right = 0 if causal else right
    diagonal = torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]
    keys = torch.arange(k.shape[0])[None, :]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.float()[:, None, None] * (diagonal - keys).abs()[None]
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
    module.modifiers = []  # the (softcap, alibi_slopes) of every call

    def forward(q, k, v, *, out=None, lse=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                max_seqlen_k=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
        module.calls.append(("forward", out is not None))
        module.windows.append(window_size)
        module.modifiers.append((softcap, alibi_slopes))
        given = out is not None
        out = torch.empty_like(q) if out is None else out
        if lse is None:
            shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
            lse = torch.empty(shape, dtype=torch.float32)
        if given and not write_forward_output:
            return out, lse
        for rows_q, rows_k, lse_index in _sequences(q, cu_seqlens_q, cu_seqlens_k):
            o, row_lse = _attend(q[rows_q].float(), k[rows_k].float(), v[rows_k].float(), causal, window_size, softcap,
                                 alibi_slopes)
            out[rows_q] = o.to(out.dtype)
            lse[lse_index] = row_lse
        return out, lse

    def backward(dout, q, k, v, out, lse, *, dq=None, dk=None, dv=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, causal=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None):
        module.calls.append(("backward", dq is not None))
        module.windows.append(window_size)
        module.modifiers.append((softcap, alibi_slopes))
        if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
            raise ValueError("backward got a poisoned out or lse")  # hipattn's kernel would read them
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        for rows_q, rows_k, _ in _sequences(q, cu_seqlens_q, cu_seqlens_k):
            leaves = [t.float().requires_grad_() for t in (q[rows_q], k[rows_k], v[rows_k])]
            o, _ = _attend(*leaves, causal, window_size, softcap, alibi_slopes)
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
    masked and biased peers on SDPA's math backend (the efficient one is CUDA-only)."""
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


SCOREMOD_CELLS = [
    cells.Cell("scoremod", "fwd", 32, 4, 2, causal=True, batch=2, seqlen_q=24, seqlen_k=24, softcap=cells.SOFTCAP),
    cells.Cell("scoremod", "fwd", 32, 4, 4, causal=False, batch=2, seqlen_q=20, seqlen_k=20, alibi=True),
    cells.Cell("scoremod", "fwd", 32, 4, 1, causal=True, batch=1, seqlen_q=28, seqlen_k=28, softcap=cells.SOFTCAP,
               alibi=True),
    cells.Cell("scoremod", "fwdbwd", 32, 4, 2, causal=True, batch=2, seqlen_q=24, seqlen_k=24, alibi=True),
    cells.Cell("scoremod", "fwdbwd", 32, 4, 2, causal=False, batch=2, seqlen_q=16, seqlen_k=16, softcap=cells.SOFTCAP),
]


@pytest.mark.parametrize("cell", SCOREMOD_CELLS, ids=lambda c: c.name)
def test_scoremod_cells_match_flexattention_and_the_biased_sdpa(hipattn, eager_flex, cell):
    record = run.measure_cell(cell, CpuMeasurer(), cells.NOMINAL_CEILINGS, rounds=1)
    assert "median_ms" in record["runners"]["hipattn"], record["runners"]["hipattn"]
    slopes = {id(a) for _, a in hipattn.modifiers}
    assert {softcap for softcap, _ in hipattn.modifiers} == {cell.softcap}  # every call got the softcap
    if cell.alibi:  # and one fp32 [Hq] slopes tensor, the same in every call
        (alibi,) = {a for _, a in hipattn.modifiers if a is not None} or {None}
        assert len(slopes) == 1 and alibi.dtype == torch.float32 and alibi.tolist() == list(cells.alibi_slopes(4))
    else:
        assert {a for _, a in hipattn.modifiers} == {None}
    assert set(hipattn.windows) == {(-1, -1)}
    assert cells.peers(cell) == (("flex",) if cell.softcap else ("flex", "sdpa_bias"))
    if cell.direction == "fwd":
        checked = ("flex", "sdpa_bias") if not cell.softcap else ("flex",)
    else:  # FlexAttention has no backward on the CPU: its error is recorded and the cell goes on
        checked = ("sdpa_bias",) if not cell.softcap else ()
        assert "backward on CPU" in record["runners"]["flex"]["error"]
    for peer in checked:
        assert "median_ms" in record["runners"][peer], record["runners"][peer]
        check = record["checks"][peer]
        assert check["ok"] and check["rel_l2"] < 1e-2, (peer, check)
    assert set(record["checks"]) == set(checked)
    assert record["vs_floor"] > 0 and (record["best_peer"] in checked or not checked)


@pytest.mark.parametrize("ignored", ["softcap", "alibi_slopes"])
def test_the_checks_see_a_modifier_that_is_not_applied(monkeypatch, eager_flex, ignored):
    """A hipattn that ignored softcap or alibi_slopes would fail the check against every peer. The softcap
    is 5 here: these small cells' few keys make the matrix's 50 move the output by only 2-4% (the next
    test shows what it does on the matrix's shapes)."""
    fake = _fake_hipattn()
    forward = fake.forward

    def ignoring(*a, **k):
        k.pop(ignored, None)
        return forward(*a, **k)

    fake.forward = ignoring
    monkeypatch.setitem(sys.modules, "hipattn", fake)
    if ignored == "softcap":
        cell, checked = dataclasses.replace(SCOREMOD_CELLS[0], softcap=5.0), ("flex",)
    else:
        cell, checked = SCOREMOD_CELLS[1], ("flex", "sdpa_bias")
    record = run.measure_cell(cell, CpuMeasurer(), cells.NOMINAL_CEILINGS, rounds=1)
    for peer in checked:
        assert not record["checks"][peer]["ok"], (peer, record["checks"][peer])
    assert record["check"]["ok"] is False
    # and the same hipattn that applies it passes against the same peers
    monkeypatch.setitem(sys.modules, "hipattn", _fake_hipattn())
    record = run.measure_cell(cell, CpuMeasurer(), cells.NOMINAL_CEILINGS, rounds=1)
    assert all(record["checks"][peer]["ok"] for peer in checked), record["checks"]


def test_the_score_mod_and_the_alibi_bias_are_the_float64_reference_s():
    from support import reference

    assert cells.alibi_slopes(16) == pytest.approx(reference.alibi_slopes(1, 16).tolist(), rel=1e-7)
    generator = torch.Generator().manual_seed(3)
    for softcap, alibi, causal, (length_q, length_k) in ((2.0, False, False, (7, 7)), (0.0, True, True, (9, 9)),
                                                         (1.5, True, False, (5, 8)), (0.0, True, False, (8, 5))):
        cell = cells.Cell("scoremod", "fwd", 8, 4, 2, causal=causal, batch=1, seqlen_q=length_q, seqlen_k=length_k,
                          softcap=softcap, alibi=alibi)
        slopes = torch.tensor(cells.alibi_slopes(4), dtype=torch.float32)
        modify = gpu.score_mod(cell, slopes if alibi else None)
        scores = 3 * torch.randn(4, length_q, length_k, generator=generator, dtype=torch.float64)
        heads = torch.arange(4)[:, None, None]
        rows, keys = torch.arange(length_q)[None, :, None], torch.arange(length_k)[None, None, :]
        got = modify(scores, 0, heads, rows, keys)
        for h in range(4):
            want, _ = reference.modified_scores(scores[h].numpy(), length_q, length_k, softcap,
                                                float(slopes[h]) if alibi else 0.0)
            assert torch.allclose(got[h], torch.from_numpy(want), rtol=1e-6, atol=1e-6), (cell.name, h)
        if alibi and softcap == 0:
            bias = gpu.alibi_bias(cell, slopes)
            want = torch.stack([torch.from_numpy(reference.modified_scores(
                torch.zeros(length_q, length_k, dtype=torch.float64).numpy(), length_q, length_k, 0.0, float(s))[0])
                for s in slopes]).float()
            visible = torch.from_numpy(reference.visible_keys(length_q, length_k, causal))
            assert torch.equal(bias, torch.where(visible, want, float("-inf")))
            assert int(torch.isfinite(bias).sum()) == 4 * cells.visible_pairs(length_q, length_k, causal)
    plain = cells.Cell("scoremod", "fwd", 8, 4, 2, batch=1, seqlen_q=4, seqlen_k=4)
    assert gpu.score_mod(plain, None) is None


def test_flexattention_gets_a_score_mod_that_reads_the_slopes_tensor(monkeypatch):
    """The score_mod captures the cell's slopes tensor (not its values as Python floats, which torch.compile
    would specialise on), and only masked cells get a block mask."""
    seen = []

    def recording(q, k, v, **extra):
        seen.append(extra)
        return torch.zeros_like(q)

    monkeypatch.setattr(gpu, "_flex_function", lambda: recording)
    for cell in SCOREMOD_CELLS[1:3]:  # non-causal ALiBi; causal softcap and ALiBi
        data = gpu.prepare(cell, "cpu")
        gpu.build("flex", cell, data).run(0)
        extra = seen[-1]
        closure = {id(c.cell_contents): c.cell_contents for c in extra["score_mod"].__closure__}
        assert id(data.alibi_slopes) in closure  # the very tensor hipattn gets
        assert not any(isinstance(value, float) and value in cells.alibi_slopes(cell.heads_q) for value in closure.values())
        assert (extra["block_mask"] is None) == (not cell.causal)
        assert extra.get("enable_gqa", False) == (cell.heads_q != cell.heads_kv)
    plain = BATCH_CELLS[0]  # a plain cell would run without a score_mod (no section does that today)
    gpu.build("flex", plain, gpu.prepare(plain, "cpu")).run(0)
    assert "score_mod" not in seen[-1]


def test_softcap_cells_scale_their_queries_so_that_the_check_sees_the_cap():
    """On a matrix softcap cell's shape (D 128, S 4096, causal; one head), leaving the cap out moves the
    output far beyond the check's tolerance with the cell's queries, and not with unscaled ones."""
    cell = cells.Cell("scoremod", "fwd", 128, 1, 1, causal=True, batch=1, seqlen_q=4096, seqlen_k=4096,
                      softcap=cells.SOFTCAP)
    data = gpu.prepare(cell, "cpu")
    q, k, v = (data.sets[0][n][0, :, 0].float() for n in ("q", "k", "v"))
    assert float(q.std()) == pytest.approx(cells.SOFTCAP_QUERY_SCALE, rel=0.1)
    hidden = torch.ones(4096, 4096, dtype=torch.bool).triu(1)

    def moved(queries):
        scores = (queries @ k.T / 128**0.5).masked_fill(hidden, float("-inf"))
        plain = torch.softmax(scores, -1) @ v
        capped = torch.softmax(cell.softcap * torch.tanh(scores / cell.softcap), -1) @ v
        return float((plain - capped).norm() / capped.norm())

    assert moved(q) > 4 * gpu.REL_L2_TOLERANCE
    assert moved(q / cells.SOFTCAP_QUERY_SCALE) < gpu.REL_L2_TOLERANCE / 4
    plain = gpu.prepare(dataclasses.replace(cell, softcap=0.0, alibi=True), "cpu")
    assert float(plain.sets[0]["q"].float().std()) == pytest.approx(1.0, rel=0.1)  # other cells keep randn


def test_scoremod_cells_refuse_the_peers_without_the_modifiers():
    cell = SCOREMOD_CELLS[0]
    data = gpu.prepare(cell, "cpu")
    assert data.alibi_slopes is None and gpu.prepare(SCOREMOD_CELLS[1], "cpu").alibi_slopes.shape == (4,)
    for peer in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"):
        with pytest.raises(ValueError, match="no softcap or ALiBi"):
            gpu.build(peer, cell, data)
    with pytest.raises(ValueError, match="no softcap or ALiBi"):
        gpu.build("varlen_attn", cell, data)
    with pytest.raises(ValueError, match="SDPA has no softcap"):
        gpu.build("sdpa_bias", cell, data)  # softcap: no explicit mask can express it


def test_the_stand_in_s_modifiers_are_the_float64_reference_s(hipattn):
    """The stand-in's softcap and ALiBi, forward and backward, against tests/support/reference.py (so that
    the checks above, and the softcap backward no CPU peer can check, rest on flash-attn's definition)."""
    from support import reference

    generator = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(2, 12, 4, 16, generator=generator) for _ in range(2))
    k, v = (torch.randn(2, 12, 2, 16, generator=generator) for _ in range(2))
    slopes = torch.tensor(cells.alibi_slopes(4), dtype=torch.float32)
    for softcap, alibi, causal in ((2.0, False, True), (0.0, True, False), (1.5, True, True)):
        arguments = {"causal": causal, "softcap": softcap, "alibi_slopes": slopes if alibi else None}
        out, lse = hipattn.forward(q, k, v, **arguments)
        grads = hipattn.backward(dout, q, k, v, out, lse, **arguments)
        thd = [t.reshape(-1, *t.shape[2:]).double().numpy() for t in (q, k, v, dout)]
        options = {"softcap": softcap, "alibi": slopes.numpy() if alibi else None}
        want_out, _ = reference.reference_forward(*thd[:3], [12, 12], [12, 12], 16**-0.5, causal, **options)
        want = reference.reference_backward(*thd, [12, 12], [12, 12], 16**-0.5, causal, **options)
        assert reference.relative_error(out.reshape(-1, 4, 16).numpy(), want_out) < 1e-5
        for got, expected in zip(grads, want, strict=True):
            assert reference.relative_error(got.reshape(expected.shape).numpy(), expected) < 1e-4


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
