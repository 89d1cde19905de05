"""hipattn.torch: the custom ops' schemas, fake kernels and autograd wiring, on the CPU.

The kernels need a GPU, so here hipattn.attention.forward/backward are replaced by a float64
reference with the same contract (flash-attn's LSE layout, GQA, bottom-right causal): what is
tested is everything around the kernels — argument order, which gradient goes where, contiguity of
the incoming gradient, the meta shapes torch.compile traces with. tests/gpu/test_torch_gpu.py runs
the same paths on the real kernels.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import hipattn  # noqa: E402
import hipattn.torch as hat  # noqa: E402
from hipattn import attention, kvcache  # noqa: E402


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k):
    """(query rows, key rows) index pairs per sequence, THD or BSHD alike."""
    if cu_seqlens_q is None:
        return [((b, slice(None)), (b, slice(None))) for b in range(q.shape[0])]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [((slice(cq[b], cq[b + 1]),), (slice(ck[b], ck[b + 1]),)) for b in range(len(cq) - 1)]


def _probabilities(qs, ks, softmax_scale, causal):
    """Softmax probabilities [H, Lq, Lk] and row LSE [H, Lq] of one sequence, float64."""
    scores = torch.einsum("ihd,jhd->hij", qs, ks) * softmax_scale
    if causal:
        lq, lk = qs.shape[0], ks.shape[0]
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        scores = scores.masked_fill(j > i + lk - lq, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # A row that sees no key: P = 0 and LSE = +inf (flash-attn's convention, as the kernels do).
    empty = torch.isinf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
    return probs, lse.masked_fill(empty, float("inf"))


def _reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, dout=None):
    """Float64 attention with hipattn's conventions: (out, lse), or (dq, dk, dv) given dout.

    Gradients are written out by hand: custom-op implementations run below autograd.
    """
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float64)
    lse = torch.zeros(hat._lse_shape(q, cu_seqlens_q), dtype=torch.float64)
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    group = q.shape[-2] // k.shape[-2]
    for b, (rows_q, rows_k) in enumerate(_sequences(q, k, cu_seqlens_q, cu_seqlens_k)):
        qs = q[rows_q].double()
        ks = k[rows_k].double().repeat_interleave(group, dim=-2)
        vs = v[rows_k].double().repeat_interleave(group, dim=-2)
        probs, row_lse = _probabilities(qs, ks, softmax_scale, causal)
        out[rows_q] = torch.einsum("hij,jhd->ihd", probs, vs)
        if cu_seqlens_q is None:
            lse[b] = row_lse
        else:
            lse[:, rows_q[0]] = row_lse
        if dout is not None:
            do = dout[rows_q].double()
            dv = torch.einsum("hij,ihd->jhd", probs, do)
            dp = torch.einsum("ihd,jhd->hij", do, vs)
            ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
            dq = torch.einsum("hij,jhd->ihd", ds, ks) * softmax_scale
            dk = torch.einsum("hij,ihd->jhd", ds, qs) * softmax_scale
            # GQA: a KV head's gradient is the sum over the query heads of its group.
            grads[0][rows_q] = dq
            grads[1][rows_k] = dk.unflatten(-2, (k.shape[-2], group)).sum(-2)
            grads[2][rows_k] = dv.unflatten(-2, (k.shape[-2], group)).sum(-2)
    return tuple(grads) if dout is not None else (out, lse)


class ReferenceKernels:
    """Stands in for hipattn.attention's GPU entry points; counts calls, keeps the last gradient."""

    def __init__(self):
        self.forward_calls = 0
        self.backward_calls = 0
        self.last_dout = None
        self.windows = []  # (direction, window_size) of every call
        self.modifiers = []  # (direction, softcap, alibi_slopes) of every call
        self.dropouts = []  # (direction, dropout_p, dropout_seed) of every call
        self.head_dims = []  # the head_dim of every call's q

    def forward(self, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                dropout_seed=None, learnable_sink=None, stream=None):
        self.forward_calls += 1
        self.windows.append(("forward", window_size))
        self.modifiers.append(("forward", softcap, alibi_slopes))
        self.dropouts.append(("forward", dropout_p, dropout_seed))
        self.head_dims.append(q.shape[-1])
        out, lse = _reference(q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        if learnable_sink is not None:  # the kernels' last normalization: one more term with no value
            with_sink = torch.logaddexp(lse, learnable_sink.double()[:, None])
            share = torch.exp(lse - with_sink)  # [Hq, total] or [B, Hq, S]
            out = out * (share.transpose(0, 1) if cu_seqlens_q is not None else share.transpose(1, 2))[..., None]
            lse = with_sink
        return out.to(q.dtype), lse.float()

    def backward(self, dout, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                 dropout_seed=None, learnable_sink=None, deterministic=False):
        self.backward_calls += 1
        self.windows.append(("backward", window_size))
        self.modifiers.append(("backward", softcap, alibi_slopes))
        self.dropouts.append(("backward", dropout_p, dropout_seed))
        self.last_dout = dout
        grads = _reference(q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, dout)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))


@pytest.fixture
def kernels(monkeypatch):
    fake = ReferenceKernels()
    monkeypatch.setattr(attention, "forward", fake.forward)
    monkeypatch.setattr(attention, "backward", fake.backward)
    return fake


@pytest.mark.parametrize(("window_size", "causal", "kernel_window"), [
    ((-1, -1), False, (-1, -1)), ((-1, -1), True, (-1, 0)), ((8, 2), False, (8, 2)), ((8, 2), True, (8, 0)),
    ((-5, 3), False, (-1, 3)), (torch.tensor([8, 2]), False, (8, 2)),  # flash-attn's tests pass a tensor
])
def test_the_window_reaches_the_forward_and_the_backward_as_flash_attn_reads_it(kernels, window_size, causal,
                                                                                   kernel_window):
    q, k, v, cu_q, cu_k = _varlen([3, 7], [4, 6])
    out = hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, causal=causal, window_size=window_size)
    out.sum().backward()
    assert kernels.windows == [("forward", kernel_window), ("backward", kernel_window)]


@pytest.mark.parametrize("per_sequence", [False, True])
def test_the_score_modifiers_reach_the_forward_and_the_backward(kernels, per_sequence):
    q, k, v, cu_q, cu_k = _varlen([3, 7], [4, 6])
    slopes = torch.rand(2, 4) if per_sequence else torch.rand(4)
    out = hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, softcap=30, alibi_slopes=slopes)
    out.sum().backward()
    assert [(direction, softcap) for direction, softcap, _ in kernels.modifiers] == [("forward", 30.0),
                                                                                     ("backward", 30.0)]
    assert all(given is slopes for _, _, given in kernels.modifiers)
    assert slopes.grad is None  # fixed by the model, as in flash-attn: no gradient


def test_a_softcap_the_kernels_cannot_take_is_refused_before_autograd_records(kernels):
    q, k, v, cu_q, cu_k = _varlen([3, 7], [4, 6])
    with pytest.raises(ValueError, match="softcap is -1.0"):
        hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, softcap=-1.0)
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor, got list"):
        hat.flash_attn_func(q[None], k[None], v[None], alibi_slopes=[0.5] * 4)
    assert kernels.forward_calls == 0


@pytest.mark.parametrize("head_dim,kernel_head_dim", [(40, 64), (80, 96), (59, 64), (160, 256)])
def test_a_head_dim_the_kernels_lack_runs_zero_padded_to_the_next_they_have(kernels, head_dim, kernel_head_dim):
    """The kernels see q, k, v padded with zero columns; out, its gradients and the softmax scale are
    those of the unpadded call."""
    q, k, v, cu_q, cu_k = _varlen([3, 7], [4, 6], head_dim=head_dim)
    out = hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert kernels.head_dims == [kernel_head_dim] and out.shape == q.shape
    scale = head_dim ** -0.5
    want_out, _ = _reference(q.detach(), k.detach(), v.detach(), cu_q, cu_k, scale, True)
    want_grads = _reference(q.detach(), k.detach(), v.detach(), cu_q, cu_k, scale, True, dout)
    torch.testing.assert_close(out.double(), want_out)
    for got, want in zip((q.grad, k.grad, v.grad), want_grads, strict=True):
        torch.testing.assert_close(got.double(), want)


@pytest.mark.parametrize("varlen", [False, True])
def test_a_v_head_dim_other_than_qks_runs_padded_to_one_head_dim(kernels, varlen):
    """DeepSeek's MLA shapes, q·k at 192 and v at 128: the kernels see all three zero-padded to 256; out
    has v's head_dim, the softmax scale is q's, and out and the gradients are the unpadded call's."""
    q, k, _, cu_q, cu_k = _varlen([3, 7], [4, 6], head_dim=192)
    v = torch.randn(k.shape[0], k.shape[1], 128, requires_grad=True)
    if varlen:
        out = hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, causal=True)
    else:  # one sequence of the batch layout
        q, k, v = (t.detach()[None, :4].clone().requires_grad_() for t in (q, k, v))
        cu_q = cu_k = None
        out = hat.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert kernels.head_dims == [256] and out.shape == (*q.shape[:-1], 128)
    plain = [t.detach() for t in (q, k, v)]
    want_out, _ = _reference(*plain, cu_q, cu_k, 192 ** -0.5, True)
    want_grads = _reference(*plain, cu_q, cu_k, 192 ** -0.5, True, dout)
    torch.testing.assert_close(out.double(), want_out)
    for got, want in zip((q.grad, k.grad, v.grad), want_grads, strict=True):
        torch.testing.assert_close(got.double(), want)


@pytest.mark.parametrize("head_dim", [128, 264])
def test_a_head_dim_the_kernels_have_or_none_can_take_goes_as_given(kernels, head_dim):
    """No copy where a kernel fits, and none past the largest kernel (the core API refuses that call)."""
    q, k, v, _, _ = _varlen([3], [4], head_dim=head_dim)
    hat.flash_attn_func(q[None], k[None], v[None])
    assert kernels.head_dims == [head_dim]


def _varlen(lengths_q, lengths_k, heads_q=4, heads_kv=2, head_dim=64):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads_q, head_dim, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), heads_kv, head_dim, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), heads_kv, head_dim, requires_grad=True)
    return q, k, v, cu_q, cu_k


def test_loss_backward_runs_hipattns_backward_once_and_grads_land_on_q_k_v(kernels):
    q, k, v, cu_q, cu_k = _varlen([3, 7, 5], [4, 6, 9])
    out = hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 9, causal=True)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    assert kernels.forward_calls == 1 and kernels.backward_calls == 1
    assert torch.equal(kernels.last_dout, weights)
    expected = kernels.backward(weights, q, k, v, None, None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                max_seqlen_q=7, max_seqlen_k=9, softmax_scale=1 / math.sqrt(64), causal=True)
    for grad, want in zip((q.grad, k.grad, v.grad), expected, strict=True):
        torch.testing.assert_close(grad, want)


def test_a_non_contiguous_incoming_gradient_is_made_contiguous(kernels):
    q = torch.randn(2, 5, 4, 64, requires_grad=True)
    k = torch.randn(2, 6, 4, 64, requires_grad=True)
    v = torch.randn(2, 6, 4, 64, requires_grad=True)
    out = hat.flash_attn_func(q, k, v)
    out.sum().backward()  # sum's gradient arrives expanded (stride 0)
    assert kernels.last_dout.is_contiguous()


def test_return_attn_probs_gives_flash_attns_triple_with_the_lse_layout(kernels):
    q, k, v, cu_q, cu_k = _varlen([3, 2], [1, 4])
    out, lse, probs = hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, 5) and lse.dtype == torch.float32 and probs is None


@pytest.mark.parametrize("varlen", [False, True])
def test_learnable_sinks_get_the_gradient_of_attention_with_a_sink(kernels, varlen):
    """hipattn.torch computes d loss / d learnable_sink from dout, out and the LSE (which includes the
    sinks): it matches float64 autograd through softmax over [scores, sink] with the sink's value 0."""
    sink = torch.tensor([0.7, -1.0, 2.5, 0.0], requires_grad=True)
    if varlen:
        q, k, v, cu_q, cu_k = _varlen([3, 7], [4, 6])
        out = hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, learnable_sink=sink)
        pieces = [(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]) for b in range(2)]
    else:
        q, k, v = (torch.randn(2, n, 4, 16) for n in (5, 6, 6))
        out = hat.flash_attn_func(q, k, v, learnable_sink=sink)
        pieces = [(q[b], k[b], v[b]) for b in range(2)]
    grad = torch.randn(out.shape)
    (out.float() * grad).sum().backward()
    sink64 = sink.detach().double().requires_grad_()
    outs = []
    for qs, ks, vs in pieces:
        group = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,jhd->hij", qs.double(), ks.double()) * qs.shape[-1] ** -0.5
        padded = torch.cat([scores, sink64[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
        probs = torch.softmax(padded, dim=-1)[..., :-1]
        outs.append(torch.einsum("hij,jhd->ihd", probs, vs.double()))
    expected = torch.cat(outs) if varlen else torch.stack(outs)
    torch.testing.assert_close(out.double(), expected, rtol=1e-3, atol=1e-3)
    (expected * grad.double()).sum().backward()
    torch.testing.assert_close(sink.grad.double(), sink64.grad, rtol=1e-3, atol=1e-4)


def test_unsupported_arguments_are_named():
    with pytest.raises(ValueError, match=r"dropout_p is 1\.0; it must be in \[0, 1\)"):
        hat.flash_attn_func(torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16), dropout_p=1.0)


PAGE = 4


def _paged(lengths_k, spare_pages=3, heads_kv=2, head_dim=64):
    """Paged caches of PAGE keys a page holding the keys of _varlen's k and v, every sequence's pages
    at shuffled places among spare ones, and its block table (one spare column)."""
    _, k, v, _, cu_k = _varlen([1] * len(lengths_k), lengths_k, heads_kv, heads_kv, head_dim)
    pages = -(-max(lengths_k) // PAGE) + 1
    places = torch.randperm(len(lengths_k) * pages + spare_pages)[:len(lengths_k) * pages].reshape(-1, pages)
    k_cache = torch.randn(len(lengths_k) * pages + spare_pages, PAGE, heads_kv, head_dim)
    v_cache = torch.randn_like(k_cache)
    for b, length in enumerate(lengths_k):
        for j in range(length):
            k_cache[places[b, j // PAGE], j % PAGE] = k[int(cu_k[b]) + j].detach()
            v_cache[places[b, j // PAGE], j % PAGE] = v[int(cu_k[b]) + j].detach()
    return k, v, k_cache.requires_grad_(), v_cache.requires_grad_(), places.to(torch.int32), cu_k


def test_a_paged_varlen_call_attends_to_the_keys_its_block_table_names(kernels):
    lengths_q, lengths_k = [3, 7, 0, 5], [4, 10, 2, 0]
    q, _, _, cu_q, _ = _varlen(lengths_q, lengths_k)
    k, v, k_cache, v_cache, table, cu_k = _paged(lengths_k)
    want, want_lse, _ = hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 10, causal=True, return_attn_probs=True)
    got, lse, _ = hat.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 7, 10, causal=True,
                                             return_attn_probs=True, block_table=table)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse, want_lse)


def test_a_paged_varlen_call_gives_each_page_the_gradient_of_its_keys(kernels, monkeypatch):
    lengths_q, lengths_k = [3, 7, 5], [4, 10, 6]
    q, _, _, cu_q, _ = _varlen(lengths_q, lengths_k)
    k, v, k_cache, v_cache, table, cu_k = _paged(lengths_k)
    backward = kernels.backward

    def leaves_rows_past_every_sequence_unwritten(dout, q, k, v, *args, **kwargs):
        grads = backward(dout, q, k, v, *args, **kwargs)
        for grad in grads[1:]:
            grad[int(kwargs["cu_seqlens_k"][-1]):] = float("nan")  # as the kernels leave them
        return grads

    monkeypatch.setattr(attention, "backward", leaves_rows_past_every_sequence_unwritten)
    weights = torch.randn(q.shape)
    (hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 10) * weights).sum().backward()
    want = (k.grad, v.grad)
    (hat.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 7, 10, block_table=table) * weights).sum().backward()
    for cache, grad in zip((k_cache, v_cache), want, strict=True):
        expected = torch.zeros_like(cache)
        for b, length in enumerate(lengths_k):
            for j in range(length):
                expected[table[b, j // PAGE], j % PAGE] = grad[int(cu_k[b]) + j]
        torch.testing.assert_close(cache.grad, expected)  # spare pages and unused rows: exactly 0, no NaN


def test_a_block_table_entry_outside_the_cache_reads_a_page_of_it_instead_of_faulting(kernels):
    q, _, _, cu_q, _ = _varlen([2, 3], [5, 3])
    _, _, k_cache, v_cache, table, cu_k = _paged([5, 3])
    table[0, 1], table[1, 0] = 10**6, -7
    out = hat.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 3, 5, block_table=table)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize(("change", "error", "message"), [
    (lambda a: {**a, "block_table": a["block_table"][:, :2]}, ValueError, r"needs 3 pages of 4 keys, but block_table rows name 2"),
    (lambda a: {**a, "block_table": a["block_table"].long()}, TypeError, "block_table has dtype torch.int64; expected int32"),
    (lambda a: {**a, "block_table": a["block_table"][0]}, ValueError, r"block_table has shape \(4,\); expected \[batch, pages\]"),
    (lambda a: {**a, "block_table": a["block_table"][:1]}, ValueError, "block_table has 1 rows but cu_seqlens_k describes 2"),
    (lambda a: {**a, "v": a["v"][:, :2]}, ValueError, "v has shape"),
    (lambda a: {**a, "k": a["k"][0]}, ValueError, r"with block_table it is a paged cache"),
    (lambda a: {**a, "block_table": a["block_table"].numpy()}, TypeError, "block_table must be a torch tensor"),
    (lambda a: {**a, "cu_k": a["cu_k"].long()}, TypeError, "cu_seqlens_k has dtype torch.int64; expected int32"),
])
def test_paged_arguments_are_checked_before_anything_runs(kernels, change, error, message):
    q, _, _, cu_q, _ = _varlen([2, 3], [9, 3])
    _, _, k_cache, v_cache, table, cu_k = _paged([9, 3])
    arguments = change({"k": k_cache, "v": v_cache, "block_table": table, "cu_k": cu_k})
    with pytest.raises(error, match=message):
        hat.flash_attn_varlen_func(q, arguments["k"], arguments["v"], cu_q, arguments["cu_k"], 3, 9,
                                   block_table=arguments["block_table"])
    assert kernels.forward_calls == 0


def test_the_plain_api_sends_paged_torch_calls_to_hipattn_torch_and_refuses_other_arrays(kernels):
    q, _, _, cu_q, _ = _varlen([2, 3], [5, 3])
    _, _, k_cache, v_cache, table, cu_k = _paged([5, 3])
    with torch.no_grad():
        out = hipattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 3, 5, block_table=table)
    assert out.shape == q.shape and kernels.forward_calls == 1
    with pytest.raises(ValueError, match="block_table \\(paged KV\\) in flash_attn_varlen_func takes torch tensors"):
        hipattn.flash_attn_varlen_func(q.detach().numpy(), k_cache.detach().numpy(), v_cache.detach().numpy(),
                                       cu_q.numpy(), cu_k.numpy(), 3, 5, block_table=table.numpy())
    with pytest.raises(ValueError, match="takes torch tensors on torch's current stream"):
        hipattn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 3, 5, block_table=table, stream=0)


def test_dropout_draws_its_seed_from_torchs_generator_and_the_backward_gets_the_same(kernels):
    """The seed is a one-element int64 tensor on q's device, drawn by torch's generator: the same
    generator state gives the same seed, the next call another; the backward receives the forward's."""
    q, k, v, cu_q, cu_k = _varlen([3, 7], [4, 6])
    seeds = []
    for _ in range(2):
        torch.manual_seed(7)
        hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, dropout_p=0.25).sum().backward()
        (_, p_forward, seed), (_, p_backward, seed_backward) = kernels.dropouts[-2:]
        assert p_forward == p_backward == 0.25 and seed_backward is seed
        assert seed.dtype == torch.int64 and seed.shape == (1,) and seed.device == q.device
        seeds.append(int(seed))
    hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, dropout_p=0.25)
    assert seeds[0] == seeds[1] != int(kernels.dropouts[-1][2])
    hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6)
    assert kernels.dropouts[-1] == ("forward", 0.0, None), "no dropout: no seed drawn"


@pytest.mark.parametrize("varlen", [False, True])
def test_return_attn_probs_with_dropout_gives_flash_attns_s_dmask(kernels, varlen):
    """S_dmask: [batch, Hq, rows and keys rounded up to 128], exp(score - row max) at each visible
    entry (so 1 at a row's maximum), negative exactly where hipattn.dropout.keep_mask drops under the
    call's seed, zero elsewhere; and _get_block_size_n says one block spans each row."""
    from hipattn.dropout import keep_mask

    torch.manual_seed(3)
    lengths_q, lengths_k = [3, 7], [4, 6]
    if varlen:
        q, k, v, cu_q, cu_k = _varlen(lengths_q, lengths_k)
        _, _, probs = hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, dropout_p=0.3, causal=True,
                                                 return_attn_probs=True)
    else:
        q, k, v = (torch.randn(2, n, 4, 16) for n in (7, 6, 6))
        lengths_q, lengths_k = [7, 7], [6, 6]
        _, _, probs = hat.flash_attn_func(q, k, v, dropout_p=0.3, causal=True, return_attn_probs=True)
    seed = kernels.dropouts[-1][2]
    assert probs.shape == (2, 4, 128, 128) and probs.dtype == q.dtype
    assert hat._get_block_size_n(q.device, 16, True, True) >= 128
    for b, (len_q, len_k) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        rows, keys = torch.arange(len_q)[:, None], torch.arange(len_k)[None, :]
        visible = keys <= rows + len_k - len_q
        block = probs[b, :, :len_q, :len_k]
        assert not probs[b, :, len_q:].any() and not probs[b, :, :, len_k:].any()
        assert not block[:, ~visible].any(), "entries a row does not see are 0"
        seen = visible.any(1)
        assert torch.allclose(block.abs().amax(-1)[:, seen], torch.ones(4, int(seen.sum())))
        for h in range(4):
            kept = keep_mask(seed, b * 4 + h, rows, keys, 0.3)
            assert torch.equal(block[h] < 0, visible & ~kept)


def test_softmax_scale_is_checked_as_the_core_api_checks_it():
    """A bool is not a scale (float(True) would quietly give 1.0), nor is a non-finite number."""
    q = torch.randn(1, 2, 2, 16)
    with pytest.raises(TypeError, match="softmax_scale must be a number"):
        hat.flash_attn_func(q, q, q, softmax_scale=True)
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        hat.flash_attn_func(q, q, q, softmax_scale=math.inf)


def test_the_ops_pass_torch_librarys_checks(kernels):
    """Schema, fake (meta) kernels against the real outputs, and the autograd registration."""
    q, k, v, cu_q, cu_k = _varlen([3, 4], [5, 2])
    slopes = torch.rand(4)
    seed = torch.tensor([12345], dtype=torch.int64)
    sink = torch.rand(4)
    # ..., causal, window left, right, softcap, ALiBi slopes, dropout_p, its seed, learnable sinks, deterministic
    args = (q, k, v, cu_q, cu_k, 4, 5, 0.25, False, 3, -1, 30.0, slopes, 0.1, seed, sink, False)
    torch.library.opcheck(torch.ops.hipattn.forward.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    out, lse = torch.ops.hipattn.forward(*args)
    backward_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, 4, 5, 0.25, False, 3, -1,
                     30.0, slopes, 0.1, seed, sink, True)
    torch.library.opcheck(torch.ops.hipattn.backward.default, backward_args, test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_traces_around_the_opaque_ops_and_matches_eager(kernels):
    q = torch.randn(2, 5, 4, 16, requires_grad=True)
    k = torch.randn(2, 7, 2, 16, requires_grad=True)
    v = torch.randn(2, 7, 2, 16, requires_grad=True)

    def step(q, k, v):
        return (hat.flash_attn_func(q, k, v, causal=True) ** 2).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    step(q, k, v).backward()
    torch.testing.assert_close(loss, step(q, k, v))
    for grad, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(grad, t.grad)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"max_seqlen_q": 5.5}, TypeError, "max_seqlen_q must be a host int"),
        ({"max_seqlen_k": "9"}, TypeError, "max_seqlen_k must be a host int"),
        ({"causal": 1}, TypeError, "causal must be a bool, got 1"),
        ({"deterministic": "yes"}, TypeError, "deterministic must be a bool, got 'yes'"),
        ({"dropout_p": "0"}, TypeError, "dropout_p must be a host number"),
    ],
    ids=["float max_seqlen_q", "str max_seqlen_k", "int causal", "str deterministic", "str dropout_p"],
)
def test_odd_host_scalars_are_named_before_the_op_schema_sees_them(kernels, change, error, message):
    q, k, v, cu_q, cu_k = _varlen([3, 2], [1, 4])
    arguments = {"max_seqlen_q": 3, "max_seqlen_k": 4, **change}
    with pytest.raises(error, match=message):
        hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, **arguments)
    assert kernels.forward_calls == 0


def test_numpy_bools_pass_as_causal_and_deterministic(kernels):
    import numpy as np

    q, k, v, cu_q, cu_k = _varlen([3, 2], [1, 4])
    hat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, causal=np.bool_(True), deterministic=np.bool_(False))
    assert kernels.forward_calls == 1


def test_the_plain_api_records_autograd_for_tensors_that_require_grad(kernels):
    """``import hipattn as flash_attn`` trains: hipattn.flash_attn_func goes through the custom ops."""
    import hipattn

    q, k, v, cu_q, cu_k = _varlen([3, 7], [4, 6])
    out = hipattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, causal=True)
    out.sum().backward()
    assert kernels.forward_calls == 1 and kernels.backward_calls == 1 and q.grad is not None
    batch = [torch.randn(2, 5, 4, 16, requires_grad=True) for _ in range(3)]
    hipattn.flash_attn_func(*batch).sum().backward()
    assert kernels.backward_calls == 2 and all(t.grad is not None for t in batch)


def test_the_plain_api_records_nothing_without_grad_mode_and_refuses_a_stream_with_autograd(kernels):
    import hipattn

    q, k, v = (torch.randn(2, 5, 4, 16, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        out = hipattn.flash_attn_func(q, k, v, softmax_scale=0.25)
    assert out.grad_fn is None and kernels.forward_calls == 1
    with pytest.raises(ValueError, match=r"stream= cannot be combined with autograd.*torch\.cuda\.stream"):
        hipattn.flash_attn_func(q, k, v, stream=0)
    assert kernels.forward_calls == 1


def test_eager_calls_skip_the_custom_ops_dispatch_and_traced_ones_take_the_op(kernels, monkeypatch):
    """Plain tensors in eager mode go through an autograd Function (the op's dispatch costs tens of
    microseconds); under a dispatch mode, as under any tracer, the custom op is what runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    op_calls = []
    real_op = hat._forward_op
    monkeypatch.setattr(hat, "_forward_op", lambda *args: op_calls.append(1) or real_op(*args))
    q, k, v = (torch.randn(2, 5, 4, 16, requires_grad=True) for _ in range(3))
    hat.flash_attn_func(q, k, v).sum().backward()
    with torch.no_grad():
        hat.flash_attn_func(q, k, v)
    assert op_calls == [] and kernels.forward_calls == 2 and q.grad is not None
    with PassThrough():
        hat.flash_attn_func(q, k, v)
    assert op_calls == [1] and kernels.forward_calls == 3


def test_flash_attn_with_kvcache_traces_as_a_custom_op_that_appends_to_the_caches():
    """Traced, the KV-cache call is the hipattn::kvcache op, whose fake kernel gives out [B, S_q, Hq, D]
    and the LSE [B, Hq, S_q], and whose schema declares that it writes k_cache and v_cache (so that
    torch.compile orders it against every other use of the caches)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k_cache, v_cache, k, v, lengths):
        return hat.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, return_softmax_lse=True)

    arguments = (torch.randn(2, 3, 8, 64, dtype=torch.bfloat16), torch.randn(2, 32, 2, 64, dtype=torch.bfloat16),
                 torch.randn(2, 32, 2, 64, dtype=torch.bfloat16), torch.randn(2, 1, 2, 64, dtype=torch.bfloat16),
                 torch.randn(2, 1, 2, 64, dtype=torch.bfloat16), torch.tensor([3, 5], dtype=torch.int32))
    traced = make_fx(step, tracing_mode="fake")(*arguments)
    assert "hipattn.kvcache" in traced.code
    schema = torch.ops.hipattn.kvcache.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"k_cache", "v_cache"}
    outputs = [node for node in traced.graph.nodes if node.op == "output"][0].args[0]
    assert [tuple(node.meta["val"].shape) for node in outputs] == [(2, 3, 8, 64), (2, 8, 3)]


def test_a_kvcache_call_of_a_head_dim_the_kernels_lack_runs_padded_and_appends_to_the_callers_cache(monkeypatch):
    """flash-attn's kvcache tests use head_dim 59: the kernels get q, the caches and the new k/v padded
    to 64, and the appended rows land in the caller's caches."""
    seen = []

    def kernels(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, softmax_scale, *arguments, **keywords):
        seen.append((q.shape[-1], k_cache.shape[-1], k.shape[-1], softmax_scale))
        k_cache[:, 3:3 + k.shape[1]] = k  # an append at cache_seqlens = 3
        v_cache[:, 3:3 + v.shape[1]] = v
        return q * 2

    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", kernels)
    q = torch.randn(2, 1, 4, 59)
    k_cache, v_cache = torch.zeros(2, 8, 2, 59), torch.zeros(2, 8, 2, 59)
    k, v = torch.randn(2, 1, 2, 59), torch.randn(2, 1, 2, 59)
    out = hat.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)
    assert seen == [(64, 64, 64, 1 / math.sqrt(59))]  # the real head_dim's softmax scale
    assert torch.equal(out, q * 2)
    assert torch.equal(k_cache[:, 3:4], k) and torch.equal(v_cache[:, 3:4], v)
    assert not k_cache[:, :3].any() and not k_cache[:, 4:].any()


def _paged_call(monkeypatch, cache_seqlens, new_tokens):
    """A paged KV-cache call (pages of 16, two pages a sequence) on the CPU, with kernels that record
    that they ran; returns the list they append to."""
    ran = []
    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", lambda q, *arguments, **keywords: ran.append(1) or q)
    q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
    k_cache, v_cache = torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16), torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16)
    new = [torch.randn(2, new_tokens, 2, 64, dtype=torch.bfloat16) for _ in range(2)] if new_tokens else [None, None]
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    hat.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=torch.tensor(cache_seqlens, dtype=torch.int32),
                                block_table=table)
    return ran


@pytest.mark.parametrize("cache_seqlens, new_tokens", [([3, 33], 0), ([32, 5], 1)])
def test_a_paged_call_whose_longest_sequence_outgrows_its_block_table_row_raises_before_running(
        monkeypatch, cache_seqlens, new_tokens):
    """flash-attn's guard: two pages of 16 hold 32 tokens, so 33 cached, or 32 and one appended, is a
    RuntimeError naming block_table (hipattn's DeviceContentError, also a ValueError), and no kernel runs."""
    from hipattn.errors import DeviceContentError

    with pytest.raises(RuntimeError, match="block_table") as raised:
        _paged_call(monkeypatch, cache_seqlens, new_tokens)
    assert isinstance(raised.value, DeviceContentError) and isinstance(raised.value, ValueError)
    assert "33" in str(raised.value) or "appends 1" in str(raised.value)


def test_a_paged_call_that_fills_its_block_table_rows_exactly_runs(monkeypatch):
    assert _paged_call(monkeypatch, [31, 12], 1) == [1]


def test_a_traced_paged_call_reads_nothing_back():
    """Under tracing the guard cannot read cache_seqlens (its values are not known): the call traces as
    the hipattn::kvcache op, and the kernels clamp on the device as in a captured graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k_cache, v_cache, lengths, table):
        return hat.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)

    arguments = (torch.randn(2, 1, 4, 64, dtype=torch.bfloat16), torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16),
                 torch.zeros(6, 16, 2, 64, dtype=torch.bfloat16), torch.tensor([40, 50], dtype=torch.int32),
                 torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    assert "hipattn.kvcache" in make_fx(step, tracing_mode="fake")(*arguments).code
