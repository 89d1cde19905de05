"""hipattn as torch's flash SDPA implementation (hipattn.torch.enable): SDPA's flash ops run hipattn's
kernels, calls hipattn cannot serve run torch's own kernel, and disable() gives the ops back."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import hipattn
import hipattn.torch as hat
from hipattn import attention

from .conftest import TOLERANCE, randn_like, relative_error


@pytest.fixture
def hipattn_calls(monkeypatch):
    """The names of hipattn's low-level calls that ran to completion during the test."""
    calls = []
    for name in ("forward", "backward"):
        real = getattr(attention, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            result = _real(*args, **kwargs)
            calls.append(_name)
            return result

        monkeypatch.setattr(attention, name, recording)
    return calls


def _sdpa_inputs(rng, batch, seqlen, heads_q, heads_kv, head_dim):
    """q, k, v as models hand them to SDPA: [B, H, S, D] views of [B, S, H, D] projections."""
    make = lambda heads: torch.randn(batch, seqlen, heads, head_dim, generator=rng, device="cuda")  # noqa: E731
    return [make(h).bfloat16().transpose(1, 2).requires_grad_() for h in (heads_q, heads_kv, heads_kv)]


def _sdpa_with_gradients(q, k, v, dout, **kwargs):
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), *grads


def _float64_reference(q, k, v, dout, **kwargs):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        return _sdpa_with_gradients(*leaves, dout.double(), **kwargs)


@pytest.mark.parametrize(
    "batch, seqlen, heads_q, heads_kv, head_dim, kwargs",
    [
        (2, 128, 8, 8, 64, {}),
        (2, 200, 16, 4, 128, {"is_causal": True, "scale": 0.1}),
        (3, 1024, 8, 8, 96, {"is_causal": True}),
        (2, 333, 8, 1, 256, {}),
        (4, 9, 8, 2, 128, {"is_causal": True}),  # every sequence short: the small-seq kernels
    ],
)
def test_sdpa_flash_runs_hipattn_forward_and_backward(rng, hipattn_calls, batch, seqlen, heads_q, heads_kv, head_dim,
                                                      kwargs):
    q, k, v = _sdpa_inputs(rng, batch, seqlen, heads_q, heads_kv, head_dim)
    dout = randn_like(q, rng)
    # Only the flash backend: if SDPA did not pick the op hipattn replaces, the call fails.
    with hat.enabled(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        results = _sdpa_with_gradients(q, k, v, dout, **kwargs)
    assert hipattn_calls == ["forward", "backward"]
    expected = _float64_reference(q, k, v, dout, **kwargs)
    for name, got, want, like in zip(("out", "dq", "dk", "dv"), results, expected, (q, q, k, v), strict=True):
        assert got.shape == want.shape and got.stride() == like.stride(), name  # the ops' meta strides
        assert relative_error(got, want) < TOLERANCE["bf16"], name


def test_calls_hipattn_cannot_serve_run_torchs_kernel_and_log_why(rng, hipattn_calls, caplog):
    q, k, v = _sdpa_inputs(rng, 2, 64, 8, 8, 80)  # head_dim 80: no hipattn kernel ships for it
    dout = randn_like(q, rng)
    with caplog.at_level(logging.DEBUG, logger="hipattn"), hat.enabled(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        results = _sdpa_with_gradients(q, k, v, dout, is_causal=True)
        dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        dropped.sum().backward()
    assert hipattn_calls == []
    assert "SDPA flash forward runs torch's kernel" in caplog.text
    assert "dropout_p=0.5" in caplog.text
    expected = _float64_reference(q, k, v, dout, is_causal=True)
    assert max(relative_error(got, want) for got, want in zip(results, expected, strict=True)) < TOLERANCE["bf16"]


def test_disable_gives_the_ops_back_to_torch(rng, hipattn_calls):
    q, k, v = _sdpa_inputs(rng, 2, 128, 8, 8, 128)
    hat.enable()
    assert hat.is_enabled() and torch.nn.attention.current_flash_attention_impl() == "hipattn"
    hat.disable()
    assert not hat.is_enabled()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert hipattn_calls == []


def test_hipattn_flash_attn_func_records_autograd_for_torch_tensors(rng):
    """``import hipattn as flash_attn`` trains: the plain API records gradients like hipattn.torch's."""
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in _sdpa_inputs(rng, 2, 300, 8, 2, 128))
    dout = randn_like(q, rng)
    out = hipattn.flash_attn_func(q, k, v, causal=True)
    assert out.requires_grad
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected_out = hat.flash_attn_func(q, k, v, causal=True)
    expected = torch.autograd.grad(expected_out, (q, k, v), dout)
    assert torch.equal(out, expected_out)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    with torch.no_grad():
        assert not hipattn.flash_attn_func(q, k, v).requires_grad
