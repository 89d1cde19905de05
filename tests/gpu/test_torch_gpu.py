"""hipattn.torch on the GPU: loss.backward() through hipattn's kernels, eager and under torch.compile,
against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

import hipattn.torch as hat

from .conftest import TOLERANCE, relative_error
from .reference import attention_reference


def _varlen(rng, lengths_q, lengths_k, heads_q=16, heads_kv=4, head_dim=128, v_head_dim=128):
    cu_q = [0, *torch.tensor(lengths_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(lengths_k).cumsum(0).tolist()]
    make = lambda rows, heads, dim: torch.randn(rows, heads, dim, generator=rng, device="cuda").bfloat16()  # noqa: E731
    q, k, v = make(cu_q[-1], heads_q, head_dim), make(cu_k[-1], heads_kv, head_dim), make(cu_k[-1], heads_kv, v_head_dim)
    return q, k, v, cu_q, cu_k


def _check_gradients(step, rng, lengths_q=(17, 3, 0, 9, 12), lengths_k=(5, 17, 4, 0, 11), head_dims=(128, 128),
                     **modifiers):
    """``step``'s output and gradients against float64, with q·k and v head dims ``head_dims``;
    ``modifiers``: the softcap and ALiBi slopes (alibi_slopes) ``step`` was given, for the reference."""
    q, k, v, cu_q, cu_k = _varlen(rng, list(lengths_q), list(lengths_k), head_dim=head_dims[0],
                                  v_head_dim=head_dims[1])
    dout = torch.randn((*q.shape[:-1], v.shape[-1]), generator=rng, device="cuda").bfloat16()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cu_q_dev = torch.tensor(cu_q, dtype=torch.int32, device="cuda")
    cu_k_dev = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
    out = step(*leaves, cu_q_dev, cu_k_dev)
    out.backward(dout)
    ref = attention_reference(q, k, v, cu_q, cu_k, causal=True, scale=1 / math.sqrt(q.shape[-1]), dout=dout,
                              softcap=modifiers.get("softcap", 0.0), alibi=modifiers.get("alibi_slopes"))
    errors = [relative_error(out.detach(), ref[0])] + [
        relative_error(t.grad, g) for t, g in zip(leaves, ref[2:], strict=True)
    ]
    assert max(errors) < TOLERANCE["bf16"], errors


def _step(q, k, v, cu_q, cu_k):
    return hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, causal=True)


def test_loss_backward_flows_through_hipattn(rng):
    _check_gradients(_step, rng)


def test_torch_compile_keeps_the_ops_opaque_and_gives_the_same_gradients(rng):
    _check_gradients(torch.compile(_step, fullgraph=True), rng)


@pytest.mark.parametrize("lengths_q,lengths_k", [((17, 3, 0, 9, 12), (5, 17, 4, 0, 11)),
                                                 ((300, 3, 0, 90, 129), (50, 170, 4, 0, 211))],
                         ids=["small-seq", "flash"])
@pytest.mark.parametrize("compiled", [False, True])
def test_softcap_and_alibi_train_through_both_paths(lengths_q, lengths_k, compiled, rng):
    """Softcap and per-sequence ALiBi slopes reach the forward and the backward, eager and compiled, on
    the small-seq path and the flash one."""
    modifiers = {"softcap": 2.0, "alibi_slopes": torch.rand(len(lengths_q), 16, generator=rng, device="cuda")}

    def step(q, k, v, cu_q, cu_k):
        return hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                          **modifiers)

    _check_gradients(torch.compile(step, fullgraph=True) if compiled else step, rng, lengths_q, lengths_k,
                     **modifiers)


@pytest.mark.parametrize("lengths_q,lengths_k", [((17, 3, 0, 9, 12), (5, 17, 4, 0, 11)),
                                                 ((300, 3, 0, 90, 129), (50, 170, 4, 0, 211))],
                         ids=["short", "flash"])
def test_a_v_head_dim_other_than_qks_trains_through_padding(lengths_q, lengths_k, rng):
    """DeepSeek's MLA shapes, q·k at 192 and v at 128: hipattn.torch pads all three to the 256 kernels
    and slices the output back to 128, at q's softmax scale."""
    def step(q, k, v, cu_q, cu_k):
        return hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)

    _check_gradients(step, rng, lengths_q, lengths_k, head_dims=(192, 128))


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("lengths_q,lengths_k", [((17, 3, 0, 9, 12), (5, 17, 4, 0, 11)),
                                                 ((300, 3, 0, 90, 129), (50, 170, 4, 0, 611))],
                         ids=["small-seq", "flash"])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_paged_cache_trains_through_its_block_table(lengths_q, lengths_k, page_size, compiled, rng):
    """flash-attn's paged varlen call (block_table): the keys and values sit in pages at shuffled places
    of a cache with spare pages; output and gradients match float64 on the packed keys, and the
    gradients reach k and v through the cache."""
    pages = -(-max(lengths_k) // page_size)
    blocks = len(lengths_k) * pages + 3
    places = torch.randperm(blocks, generator=rng, device="cuda")[:len(lengths_k) * pages]
    table = places.reshape(len(lengths_k), pages).to(torch.int32)
    # The cache row of every packed key: its sequence's page for it, and its place in the page.
    keys = [torch.arange(n, device="cuda") for n in lengths_k]
    rows = torch.cat([table[b, j // page_size].long() * page_size + j % page_size for b, j in enumerate(keys)])

    def step(q, k, v, cu_q, cu_k):
        def paged(x):
            return x.new_zeros(blocks * page_size, *x.shape[1:]).index_copy(0, rows, x).unflatten(0, (blocks, page_size))

        return hat.flash_attn_varlen_func(q, paged(k), paged(v), cu_q, cu_k, max(lengths_q), max(lengths_k),
                                          causal=True, block_table=table)

    _check_gradients(torch.compile(step, fullgraph=True) if compiled else step, rng, lengths_q, lengths_k)
