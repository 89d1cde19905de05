"""hipattn.torch.enable(): the registration with torch's flash-attention registry, and the SDPA op
overrides' wiring (layouts, strides, which calls fall back to torch's kernel), on the CPU.

hipattn's kernels are replaced by a float64 reference that writes into the given outputs, and torch's
own flash kernel (CUDA only) by a recorder. tests/gpu/test_torch_sdpa.py runs the real thing.
"""

from __future__ import annotations

import logging
import math

import pytest

torch = pytest.importorskip("torch")
registry = pytest.importorskip("torch.nn.attention._registry")

import hipattn.torch as hat  # noqa: E402
from hipattn import attention, torch_sdpa  # noqa: E402
from hipattn.errors import DriverError  # noqa: E402


def _attention_bshd(q, k, v, scale, causal):
    """Float64 attention of [B, S, H, D] inputs: out and LSE [B, H, S_q]."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.double().repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k) * scale
    if causal:
        lq, lk = q.shape[1], k.shape[1]
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        scores = scores.masked_fill(j > i + lk - lq, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v), torch.logsumexp(scores, -1)


class Kernels:
    """hipattn.attention's forward/backward writing into the caller's outputs, as the real ones do."""

    def __init__(self):
        self.calls = []
        self.refuse = None  # an exception to raise instead of computing

    def forward(self, q, k, v, *, out, lse, softmax_scale, causal):
        self.calls.append(("forward", q.stride(), out.stride()))
        if self.refuse is not None:
            raise self.refuse
        scale = softmax_scale or 1 / math.sqrt(q.shape[-1])
        o, row_lse = _attention_bshd(q, k, v, scale, causal)
        out.copy_(o)
        lse.copy_(row_lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, dq, dk, dv, softmax_scale, causal, deterministic):
        self.calls.append(("backward", dout.stride(), dq.stride()))
        if self.refuse is not None:
            raise self.refuse
        for grad in (dq, dk, dv):
            grad.fill_(1.0)
        return dq, dk, dv


@pytest.fixture
def kernels(monkeypatch):
    fake = Kernels()
    monkeypatch.setattr(attention, "forward", fake.forward)
    monkeypatch.setattr(attention, "backward", fake.backward)
    return fake


@pytest.fixture
def torch_kernel(monkeypatch):
    """Records the calls that reach torch's own flash kernel."""
    calls = []
    monkeypatch.setattr(torch_sdpa, "_torch_flash_forward", lambda *args: calls.append("forward") or "torch's")
    monkeypatch.setattr(torch_sdpa, "_torch_flash_backward", lambda *args: calls.append("backward") or "torch's")
    return calls


@pytest.fixture(autouse=True)
def no_active_implementation():
    yield
    registry.restore_flash_attention_impl(_raise_warn=False)


def _bhsd(batch, seqlen, heads, head_dim=16):
    """A [B, H, S, D] view of a [B, S, H, D] tensor, as models pass SDPA their projections."""
    return torch.randn(batch, seqlen, heads, head_dim).transpose(1, 2)


def test_importing_hipattn_torch_registers_it_without_activating_it():
    assert "hipattn" in registry.list_flash_attention_impls()
    assert registry.current_flash_attention_impl() is None and not hat.is_enabled()


def test_enabled_restores_the_implementation_that_was_active_before():
    calls = []
    registry.register_flash_attention_impl("other", register_fn=lambda: calls.append("activated") or _Removable(calls))
    registry.activate_flash_attention_impl("other")
    with hat.enabled():
        assert registry.current_flash_attention_impl() == "hipattn"
    assert registry.current_flash_attention_impl() == "other" and calls == ["activated", "removed", "activated"]
    with hat.enabled():
        hat.disable()
        assert registry.current_flash_attention_impl() is None


class _Removable:
    def __init__(self, calls):
        self.calls = calls

    def remove(self):
        self.calls.append("removed")


def test_forward_passes_flash_attns_layout_and_returns_the_ops_outputs(kernels, torch_kernel):
    query, key, value = _bhsd(2, 7, 4), _bhsd(2, 9, 2), _bhsd(2, 9, 2)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug = torch_sdpa._sdpa_flash_forward(
        query, key, value, is_causal=True, scale=0.25)
    assert torch_kernel == [] and [c[0] for c in kernels.calls] == ["forward"]
    assert kernels.calls[0][1] == query.transpose(1, 2).stride()  # [B, S, H, D] views, no copy
    assert out.shape == query.shape and out.stride() == query.stride()  # torch.empty_like(query), as the op's meta
    assert lse.shape == (2, 4, 7) and lse.is_contiguous() and lse.dtype == torch.float32
    assert (cum_q, cum_k, max_q, max_k) == (None, None, 7, 9)
    assert seed.shape == (2,) and offset.shape == () and debug.numel() == 0
    expected, expected_lse = _attention_bshd(*(t.transpose(1, 2) for t in (query, key, value)), 0.25, True)
    torch.testing.assert_close(out.transpose(1, 2).double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)


def test_backward_writes_gradients_strided_like_the_inputs_and_makes_dout_rows_contiguous(kernels, torch_kernel):
    query, key, value = _bhsd(2, 7, 4), _bhsd(2, 9, 2), _bhsd(2, 9, 2)
    out, lse = torch.randn(2, 4, 7, 16), torch.randn(2, 4, 7)
    expanded = torch.ones(1).expand(2, 4, 7, 16)  # sum()'s gradient: stride 0 everywhere
    dq, dk, dv = torch_sdpa._sdpa_flash_backward(expanded, query, key, value, out, lse, None, None, 7, 9, 0.0, False,
                                                 None, None, scale=None)
    assert torch_kernel == [] and kernels.calls[0][1][-1] == 1
    assert (dq.stride(), dk.stride(), dv.stride()) == (query.stride(), key.stride(), value.stride())
    assert all(bool((g == 1).all()) for g in (dq, dk, dv))


@pytest.mark.parametrize("change, reason", [
    ({"dropout_p": 0.1}, "dropout_p=0.1"),
    ({"return_debug_mask": True}, "return_debug_mask=True"),
])
def test_what_hipattn_does_not_do_runs_torchs_kernel_and_says_why(kernels, torch_kernel, caplog, change, reason):
    query = _bhsd(1, 5, 2)
    with caplog.at_level(logging.DEBUG, logger="hipattn"):
        assert torch_sdpa._sdpa_flash_forward(query, query, query, **change) == "torch's"
    assert kernels.calls == [] and torch_kernel == ["forward"]
    assert reason in caplog.text


def test_a_call_hipattns_validation_refuses_runs_torchs_kernel(kernels, torch_kernel, caplog):
    kernels.refuse = ValueError("head_dim 80 is not supported")
    query = _bhsd(1, 5, 2)
    with caplog.at_level(logging.DEBUG, logger="hipattn"):
        assert torch_sdpa._sdpa_flash_forward(query, query, query) == "torch's"
        assert torch_sdpa._sdpa_flash_backward(query, query, query, query, query, torch.zeros(1, 2, 5), None, None,
                                               5, 5, 0.0, False, None, None) == "torch's"
    assert torch_kernel == ["forward", "backward"] and "head_dim 80" in caplog.text


def test_a_driver_failure_is_not_hidden_behind_the_fallback(kernels, torch_kernel):
    kernels.refuse = DriverError("cuLaunchKernel", 719, "CUDA_ERROR_LAUNCH_FAILED")
    query = _bhsd(1, 5, 2)
    with pytest.raises(DriverError):
        torch_sdpa._sdpa_flash_forward(query, query, query)
    assert torch_kernel == []


def test_enable_puts_flash_first_in_sdpas_priority_and_disable_restores_the_order():
    flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    cudnn = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    original = list(torch._C._get_sdp_priority_order())
    cudnn_first = [cudnn, *(b for b in original if b != cudnn)]
    torch._C._set_sdp_priority_order(cudnn_first)
    try:
        with hat.enabled():
            order = list(torch._C._get_sdp_priority_order())
            assert order[0] == flash and sorted(order) == sorted(original)
        assert list(torch._C._get_sdp_priority_order()) == cudnn_first
    finally:
        torch._C._set_sdp_priority_order(original)
