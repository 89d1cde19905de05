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


class _LlamaStyleAttention(torch.nn.Module):
    """Projections to grouped heads, causal SDPA, the output projection: the attention block of a
    Llama-style model, written the way such models call SDPA."""

    def __init__(self, hidden=512, heads_q=8, heads_kv=2):
        super().__init__()
        self.heads_q, self.heads_kv, self.head_dim = heads_q, heads_kv, hidden // heads_q
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * heads_kv * self.head_dim, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        batch, seqlen, _ = x.shape
        q = self.q(x).view(batch, seqlen, self.heads_q, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(batch, seqlen, 2, self.heads_kv, self.head_dim).unbind(2)
        y = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(batch, seqlen, -1))


def test_a_torch_compiled_attention_block_runs_hipattn(rng, hipattn_calls):
    layer = _LlamaStyleAttention().cuda().bfloat16()
    x = torch.randn(2, 256, 512, generator=rng, device="cuda").bfloat16().requires_grad_()
    # The reference: the same bf16 weights and input, computed in float64.
    reference_layer = _LlamaStyleAttention().cuda().double()
    reference_layer.load_state_dict({name: t.double() for name, t in layer.state_dict().items()})
    x64 = x.detach().double().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        reference = reference_layer(x64)
    reference.sum().backward()
    with hat.enabled():
        y = torch.compile(layer)(x)
        y.sum().backward()
    assert hipattn_calls == ["forward", "backward"]  # the compiled graph's SDPA ops ran hipattn
    limit = 2 * TOLERANCE["bf16"]  # three bf16 projections around the attention
    assert relative_error(y.detach(), reference.detach()) < limit
    assert relative_error(x.grad, x64.grad) < limit
    for (name, p), p64 in zip(layer.named_parameters(), reference_layer.parameters(), strict=True):
        assert relative_error(p.grad, p64.grad) < limit, name
