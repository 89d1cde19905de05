"""The flash path through the public entry points: dispatch sends calls with max_seqlen above the
small-seq tile there, both paths agree on a call either can serve, the backward's workspace is
allocated or taken from the caller, and torch autograd flows through it."""

from __future__ import annotations

import math

import pytest
import torch

import hipattn
from hipattn import attention

from .conftest import TOLERANCE, randn_like, record_errors, relative_error
from .reference import attention_reference


def _varlen(lengths_q, lengths_k, heads_q, heads_kv, head_dim, rng, dtype=torch.bfloat16):
    cu_q = [0, *torch.tensor(lengths_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(lengths_k).cumsum(0).tolist()]
    q = torch.randn(cu_q[-1], heads_q, head_dim, generator=rng, device="cuda").to(dtype)
    k = torch.randn(cu_k[-1], heads_kv, head_dim, generator=rng, device="cuda").to(dtype)
    v = torch.randn(cu_k[-1], heads_kv, head_dim, generator=rng, device="cuda").to(dtype)
    dout = randn_like(q, rng)
    as_device = {"cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                 "cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32, device="cuda")}
    return q, k, v, dout, cu_q, cu_k, as_device


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_both_paths_agree_on_a_call_either_can_serve(causal, deterministic, monkeypatch, rng):
    q, k, v, dout, cu_q, cu_k, cu = _varlen([17, 3, 0, 9], [5, 17, 4, 0], 8, 2, 128, rng)
    bounds = {"max_seqlen_q": 17, "max_seqlen_k": 17, "causal": causal}
    results = {}
    for path, switch in (("smallseq", "1"), ("flash", "0")):
        monkeypatch.setenv("HIPATTN_SMALLSEQ", switch)
        out, lse = hipattn.forward(q, k, v, **cu, **bounds)
        grads = hipattn.backward(dout, q, k, v, out, lse, **cu, **bounds, deterministic=deterministic)
        results[path] = (out, lse, *grads)
    torch.cuda.synchronize()
    finite = ~torch.isinf(results["smallseq"][1])
    assert torch.equal(finite, ~torch.isinf(results["flash"][1])), "the paths disagree on which rows see no key"
    errors = {}
    for name, small, general in zip(("out", "lse", "dq", "dk", "dv"), results["smallseq"], results["flash"],
                                    strict=True):
        if name == "lse":
            small, general = small[finite], general[finite]
        errors[name] = relative_error(general, small)
    record_errors(f"smallseq vs flash causal={causal} deterministic={deterministic}", **errors)
    assert max(errors.values()) < TOLERANCE["bf16"], errors


def test_long_sequences_go_to_the_flash_path_and_match_float64(rng, caplog):
    q, k, v, dout, cu_q, cu_k, cu = _varlen([300, 1, 77], [250, 40, 0], 8, 4, 64, rng)
    with caplog.at_level("DEBUG", logger="hipattn"):
        out, lse = hipattn.forward(q, k, v, **cu, max_seqlen_q=300, max_seqlen_k=250, causal=True)
        dq, dk, dv = hipattn.backward(dout, q, k, v, out, lse, **cu, max_seqlen_q=300, max_seqlen_k=250,
                                      causal=True)
    assert "forward flash path" in caplog.text and "backward flash path" in caplog.text
    torch.cuda.synchronize()
    ref_out, _, ref_dq, ref_dk, ref_dv = attention_reference(q, k, v, cu_q, cu_k, causal=True,
                                                             scale=1 / math.sqrt(64), dout=dout)
    errors = {name: relative_error(got, ref) for name, got, ref in
              (("out", out, ref_out), ("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv))}
    record_errors("public flash path bf16 d64 gqa causal", **errors)
    assert max(errors.values()) < TOLERANCE["bf16"], errors


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_caller_workspace_gives_the_same_gradients(deterministic, rng):
    q, k, v, dout, cu_q, cu_k, cu = _varlen([100, 30], [64, 90], 4, 4, 128, rng)
    bounds = {"max_seqlen_q": 100, "max_seqlen_k": 90}
    out, lse = hipattn.forward(q, k, v, **cu, **bounds)
    allocated = hipattn.backward(dout, q, k, v, out, lse, **cu, **bounds, deterministic=deterministic)
    size = hipattn.backward_workspace_bytes(q, k, v, **cu, **bounds, deterministic=deterministic)
    assert size > 0
    workspace = torch.full((size,), 0xFF, dtype=torch.uint8, device="cuda")  # garbage the backward must not trust
    given = hipattn.backward(dout, q, k, v, out, lse, **cu, **bounds, deterministic=deterministic,
                             workspace=workspace)
    torch.cuda.synchronize()
    for a, b in zip(allocated, given, strict=True):
        assert relative_error(b, a) < 1e-6 if not deterministic else torch.equal(a, b)
    with pytest.raises(ValueError, match="at least"):
        hipattn.backward(dout, q, k, v, out, lse, **cu, **bounds, workspace=workspace[: size - 256])


def test_small_seq_calls_need_no_workspace(rng):
    q, k, v, _, _, _, cu = _varlen([5, 7], [3, 17], 8, 8, 128, rng)
    assert attention.backward_workspace_bytes(q, k, v, **cu, max_seqlen_q=7, max_seqlen_k=17) == 0


def test_torch_autograd_flows_through_the_flash_path(rng):
    import hipattn.torch as hat

    batch, seqlen, heads, head_dim = 2, 200, 4, 64
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, generator=rng, device="cuda", dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    weights = torch.randn(batch, seqlen, heads, head_dim, generator=rng, device="cuda", dtype=torch.bfloat16)
    (hat.flash_attn_func(q, k, v, causal=True, deterministic=True) * weights).float().sum().backward()
    flat = [t.detach().reshape(batch * seqlen, heads, head_dim) for t in (q, k, v)]
    cu = [0, seqlen, 2 * seqlen]
    _, _, ref_dq, ref_dk, ref_dv = attention_reference(*flat, cu, cu, causal=True, scale=1 / math.sqrt(head_dim),
                                                       dout=weights.reshape(batch * seqlen, heads, head_dim))
    errors = {name: relative_error(t.grad.reshape(ref.shape), ref)
              for name, t, ref in (("dq", q, ref_dq), ("dk", k, ref_dk), ("dv", v, ref_dv))}
    record_errors("torch autograd flash bshd causal", **errors)
    assert max(errors.values()) < TOLERANCE["bf16"], errors
