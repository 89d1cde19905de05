"""hipattn.ring on the CPU: the LSE merge, the ring schedule on simulated ranks, and two gloo processes.

The kernels need a GPU, so hipattn.attention.forward/backward are replaced by float64 stand-ins with
the kernels' contract (flash-attn's LSE layout, +inf for a row that sees no key, GQA, bottom-right
causal, varlen). The stand-in backward is flash-attention's: it rebuilds the probabilities from the
LSE it is given and takes D = rowsum(dO * O) from the out it is given, as the kernels do; that is what
makes a per-block backward on the merged out and LSE give the full attention's gradients. The truth
every ring result is held against is plain float64 attention over the unsharded inputs, differentiated
by torch autograd. tests/gpu/test_ring_attention.py runs the ring on the real kernels.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import defaultdict
from itertools import pairwise

import pytest
from support.processes import run_spawned

torch = pytest.importorskip("torch")

import hipattn.torch as hat  # noqa: E402
from hipattn import attention, ring  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# float64 references


def _visible(len_q: int, len_k: int, causal: bool):
    """[len_q, len_k] bool, bottom-right causal: query i sees key j when j <= i + len_k - len_q."""
    if not causal:
        return torch.ones(len_q, len_k, dtype=torch.bool)
    return torch.arange(len_k)[None, :] <= torch.arange(len_q)[:, None] + (len_k - len_q)


def _masked_attention(q, k, v, visible):
    """float64 (out [T, H, D], LSE [H, T], +inf and out 0 where a row sees no key) of one sequence,
    q [T, H, D] and k, v [S, H, D], ``visible`` [H or 1, T, S]."""
    scores = torch.einsum("ihd,jhd->hij", q.double(), k.double()).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
    return torch.einsum("hij,jhd->ihd", probs, v.double()), lse.masked_fill(empty, float("inf"))


def _sequences(cu_seqlens):
    cu = [int(x) for x in cu_seqlens.tolist()] if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return [slice(a, b) for a, b in pairwise(cu)]


def _grouped(t, group):
    return t.double().repeat_interleave(group, dim=1)


def _full_attention(q, k, v, cu_seqlens, scale, causal):
    """The truth: float64 (out, LSE) over the unsharded inputs, differentiable by autograd."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for rows in _sequences(cu_seqlens):
        n = rows.stop - rows.start
        out, lse = _masked_attention(q[rows] * scale, _grouped(k[rows], group), _grouped(v[rows], group),
                                     _visible(n, n, causal)[None])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


class FlashStyleKernels:
    """Stands in for hipattn.attention.forward/backward with the kernels' contract; logs every call."""

    def __init__(self):
        self.calls = []  # (thread name, "forward"/"backward", causal); list.append is atomic across threads

    def forward(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None,
                learnable_sink=None, stream=None):
        assert softcap == 0.0 and alibi_slopes is None and dropout_p == 0.0 and learnable_sink is None, (
            "the stand-in has no modifiers")
        self.calls.append((threading.current_thread().name, "forward", causal))
        group = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64)
        for rows_q, rows_k in zip(_sequences(cu_seqlens_q), _sequences(cu_seqlens_k), strict=True):
            visible = _visible(rows_q.stop - rows_q.start, rows_k.stop - rows_k.start, causal)[None]
            out[rows_q], lse[:, rows_q] = _masked_attention(q[rows_q].detach() * softmax_scale,
                                                            _grouped(k[rows_k].detach(), group),
                                                            _grouped(v[rows_k].detach(), group), visible)
        return out.to(q.dtype), lse.float()

    def backward(self, dout, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                 dropout_seed=None, learnable_sink=None, deterministic=False):
        assert softcap == 0.0 and alibi_slopes is None and dropout_p == 0.0 and learnable_sink is None, (
            "the stand-in has no modifiers")
        self.calls.append((threading.current_thread().name, "backward", causal))
        heads_kv, group = k.shape[1], q.shape[1] // k.shape[1]
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
        for rows_q, rows_k in zip(_sequences(cu_seqlens_q), _sequences(cu_seqlens_k), strict=True):
            qs, do, os_ = q[rows_q].double(), dout[rows_q].double(), out[rows_q].double()
            ks, vs = _grouped(k[rows_k], group), _grouped(v[rows_k], group)
            visible = _visible(qs.shape[0], ks.shape[0], causal)[None]
            scores = (torch.einsum("ihd,jhd->hij", qs, ks) * softmax_scale).masked_fill(~visible, float("-inf"))
            # P from the LSE given (the merged one in a ring): exp(-inf) = 0 for masked keys and for
            # rows whose LSE is +inf.
            probs = torch.exp(scores - lse[:, rows_q].double()[..., None])
            d_probs = torch.einsum("ihd,jhd->hij", do, vs)
            row_dot = (do * os_).sum(-1).transpose(0, 1)  # D = rowsum(dO * O), [H, T]
            d_scores = probs * (d_probs - row_dot[..., None])
            dq[rows_q] = torch.einsum("hij,jhd->ihd", d_scores, ks) * softmax_scale
            per_head_dk = torch.einsum("hij,ihd->jhd", d_scores, qs) * softmax_scale
            per_head_dv = torch.einsum("hij,ihd->jhd", probs, do)
            dk[rows_k] = per_head_dk.reshape(-1, heads_kv, group, k.shape[2]).sum(2)
            dv[rows_k] = per_head_dv.reshape(-1, heads_kv, group, k.shape[2]).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def install(self, target=attention) -> FlashStyleKernels:
        target.forward, target.backward = self.forward, self.backward
        return self


@pytest.fixture
def kernels(monkeypatch):
    fake = FlashStyleKernels()
    monkeypatch.setattr(attention, "forward", fake.forward)
    monkeypatch.setattr(attention, "backward", fake.backward)
    return fake


# ---------------------------------------------------------------------------------------------------
# 1. The merge


def _random_blocks(generator, tokens=7, heads=3, head_dim=5, block_keys=(4, 1, 6, 3)):
    q = torch.randn(tokens, heads, head_dim, generator=generator, dtype=torch.float64)
    ks = [torch.randn(n, heads, head_dim, generator=generator, dtype=torch.float64) for n in block_keys]
    vs = [torch.randn(n, heads, head_dim, generator=generator, dtype=torch.float64) for n in block_keys]
    masks = [torch.rand(heads, tokens, n, generator=generator) < 0.6 for n in block_keys]
    masks[0][:, 1] = False  # row 1 sees nothing in block 0 ...
    masks[2][1, 1] = False  # ... nor (head 1) in block 2
    for mask in masks:
        mask[:, 4] = False  # row 4 sees no key in any block
    masks[3][:] = False  # block 3 reaches no row at all
    return q, ks, vs, masks


def test_merging_blocks_by_their_lse_is_the_softmax_over_all_their_keys():
    generator = torch.Generator().manual_seed(0)
    q, ks, vs, masks = _random_blocks(generator)
    partials = [_masked_attention(q, k, v, mask) for k, v, mask in zip(ks, vs, masks, strict=True)]
    out, lse = ring.merge_partials([p[0] for p in partials], [p[1] for p in partials])
    want_out, want_lse = _masked_attention(q, torch.cat(ks), torch.cat(vs), torch.cat(masks, dim=-1))
    assert torch.isinf(want_lse[:, 4]).all() and (want_lse[:, 4] > 0).all()
    # The LSEs and the weights exp(lse_b - lse) are fp32 (hipattn's LSE is): fp32's precision, not float64's.
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[4], torch.zeros_like(out[4]))


def test_a_row_that_saw_no_key_in_a_block_takes_nothing_from_it_whatever_the_block_wrote_there():
    generator = torch.Generator().manual_seed(1)
    q, ks, vs, masks = _random_blocks(generator)
    partials = [list(_masked_attention(q, k, v, mask)) for k, v, mask in zip(ks, vs, masks, strict=True)]
    for block_out, block_lse in partials:
        block_out[torch.isinf(block_lse).transpose(0, 1)] = float("nan")
    out, lse = ring.merge_partials([p[0] for p in partials], [p[1] for p in partials])
    want_out, _ = _masked_attention(q, torch.cat(ks), torch.cat(vs), torch.cat(masks, dim=-1))
    assert not out.isnan().any()
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)


def test_one_block_merges_to_itself_bit_for_bit():
    block_out = torch.randn(5, 2, 8).bfloat16()
    block_lse = torch.randn(2, 5)
    block_lse[1, 3] = float("inf")
    block_out[3, 1] = 0
    out, lse = ring.merge_partials([block_out], [block_lse])
    assert torch.equal(out, block_out) and torch.equal(lse, block_lse)


# ---------------------------------------------------------------------------------------------------
# Sharding


def test_shard_and_unshard_are_inverses_and_rank_r_holds_chunk_r_of_every_sequence():
    cu = [0, 6, 9, 21]
    x = torch.arange(21 * 2).reshape(21, 2)
    shards = [ring.shard_varlen(x, cu, r, 3) for r in range(3)]
    assert shards[1][:, 0].tolist() == [4, 6, 14, 26, 28, 30, 32]  # tokens 2-3, 7 and 13-16, times 2
    assert torch.equal(ring.unshard_varlen(shards, cu), x)
    lse = torch.arange(2 * 21).reshape(2, 21)
    assert torch.equal(ring.unshard_varlen([ring.shard_varlen(lse, cu, r, 3, dim=1) for r in range(3)], cu, dim=1),
                       lse)
    assert ring.local_cu_seqlens(torch.tensor(cu, dtype=torch.int32), 3).tolist() == [0, 2, 3, 7]


def test_lengths_that_do_not_split_evenly_are_refused_on_the_host():
    with pytest.raises(ValueError, match="cu_seqlens: sequence 1 has length 5.*world_size=2"):
        ring.shard_varlen(torch.zeros(9, 1), [0, 4, 9], 0, 2)
    with pytest.raises(ValueError, match="rank is 2"):
        ring.shard_varlen(torch.zeros(8, 1), [0, 8], 2, 2)


# ---------------------------------------------------------------------------------------------------
# 2. The ring on simulated ranks (threads of one process)


class _Mailboxes:
    """What the ranks of a simulated ring have sent each other: a FIFO per (receiving rank, tag)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._boxes = defaultdict(queue.Queue)

    def box(self, rank: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes[(rank, tag)]


class _Delivery:
    def __init__(self, box: queue.Queue, into):
        self._box, self._into = box, into

    def wait(self) -> None:
        for dst, src in zip(self._into, self._box.get(timeout=20), strict=True):
            dst.copy_(src)


class ThreadRing:
    """hipattn.ring's Ring for one simulated rank: a shift posts copies (the sender may overwrite its
    buffer once the shift is waited for, as with a real transfer) to rank + 1's mailbox."""

    def __init__(self, mail: _Mailboxes, rank: int, world_size: int):
        self._mail, self.rank, self.world_size = mail, rank, world_size

    def shift(self, tensors, into, tag):
        self._mail.box((self.rank + 1) % self.world_size, tag).put([t.clone() for t in tensors])
        return _Delivery(self._mail.box(self.rank, tag), into)


def _on_simulated_ranks(world_size: int, work):
    """[work(rank, ring) for every rank], each rank on its own thread (named rank-R) of one ring."""
    mail = _Mailboxes()
    results, errors = [None] * world_size, []

    def run(rank):
        try:
            results[rank] = work(rank, ThreadRing(mail, rank, world_size))
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}", daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a simulated rank did not finish (a mismatched shift?)"
    if errors:
        raise errors[0]
    return results


def _problem(lengths, heads_q=4, heads_kv=2, head_dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = cu[-1]
    q = torch.randn(total, heads_q, head_dim, generator=generator)
    k = torch.randn(total, heads_kv, head_dim, generator=generator)
    v = torch.randn(total, heads_kv, head_dim, generator=generator)
    dout = torch.randn(total, heads_q, head_dim, generator=generator)
    return q, k, v, dout, cu


def _truth(q, k, v, dout, cu, scale, causal):
    """float64 out, LSE and gradients of the unsharded attention, by autograd."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = _full_attention(*leaves, cu, scale, causal)
    out.backward(dout.double())
    return out.detach(), lse, *(t.grad for t in leaves)


def _rank_step(q, k, v, dout, cu, causal, world_size):
    """A rank's part of a training step: its shards through the ring, backward from its share of dout."""
    scale = 1 / math.sqrt(q.shape[-1])
    cu_local = ring.local_cu_seqlens(cu, world_size)
    max_local = max(b - a for a, b in pairwise(cu)) // world_size

    def work(rank, transport):
        shard = [ring.shard_varlen(t, cu, rank, world_size) for t in (q, k, v, dout)]
        leaves = [t.clone().requires_grad_() for t in shard[:3]]
        out, lse = ring.ring_attention(*leaves, cu_local, max_local, softmax_scale=scale, causal=causal,
                                       deterministic=False, ring=transport)
        out.backward(shard[3])
        return out.detach(), lse, *(t.grad for t in leaves)

    return work


def _unsharded(results, cu):
    """(out, LSE, dq, dk, dv) reassembled from every rank's."""
    return tuple(ring.unshard_varlen([r[i] for r in results], cu, dim=1 if i == 1 else 0) for i in range(5))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_ring_on_simulated_ranks_matches_unsharded_attention_and_its_gradients(kernels, world_size, causal):
    lengths = [3 * world_size, world_size, 5 * world_size, 2 * world_size]
    q, k, v, dout, cu = _problem(lengths, seed=world_size)
    results = _on_simulated_ranks(world_size, _rank_step(q, k, v, dout, cu, causal, world_size))
    got = _unsharded(results, cu)
    want = _truth(q, k, v, dout, cu, 1 / math.sqrt(q.shape[-1]), causal)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == (torch.float32), name
        torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_the_causal_schedule_skips_blocks_above_the_diagonal_and_masks_only_the_diagonal(kernels):
    world_size = 4
    q, k, v, dout, cu = _problem([8, 4], seed=5)
    _on_simulated_ranks(world_size, _rank_step(q, k, v, dout, cu, True, world_size))
    for rank in range(world_size):
        for direction in ("forward", "backward"):
            flags = [c for name, d, c in kernels.calls if name == f"rank-{rank}" and d == direction]
            # Rank r holds key chunks r, r-1, ..., 0 in turn: the diagonal first, then r fully seen.
            assert flags == [True] + [False] * rank, (rank, direction, flags)


def test_a_ring_of_one_is_one_call_bit_for_bit(kernels):
    q, k, v, dout, cu = _problem([5, 3, 8], seed=6)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (result,) = _on_simulated_ranks(1, _rank_step(q, k, v, dout, cu, True, 1))
    out, lse = hat.flash_attn_varlen_func(*leaves, cu_t, cu_t, 8, 8, causal=True, return_attn_probs=True)[:2]
    out.backward(dout)
    for got, want in zip(result, (out.detach(), lse, *(t.grad for t in leaves)), strict=True):
        assert torch.equal(got, want)


def test_without_grad_the_ring_runs_the_forward_only(kernels):
    q, k, v, dout, cu = _problem([4, 6], seed=7)
    cu_local = ring.local_cu_seqlens(cu, 2)

    def work(rank, transport):
        shard = [ring.shard_varlen(t, cu, rank, 2) for t in (q, k, v)]
        return ring.ring_attention(*shard, cu_local, 3, softmax_scale=0.3, causal=False, deterministic=False,
                                   ring=transport)

    results = _on_simulated_ranks(2, work)
    assert all(out.grad_fn is None for out, _ in results)
    assert {d for _, d, _ in kernels.calls} == {"forward"}


# ---------------------------------------------------------------------------------------------------
# Argument errors, before any communication


def _local_inputs():
    q, k, v, _, cu = _problem([4, 6])
    return q, k, v, torch.tensor(cu, dtype=torch.int32)


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"window_size": (8, 0)}, ValueError, r"window_size=\(8, 0\).*no sliding window"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"max_seqlen": 2.5}, TypeError, "max_seqlen must be a host int"),
    ({"dropout_p": 0.1}, ValueError, "dropout_p=0.1"),
    ({"softcap": 30.0}, ValueError, "does not support softcap or alibi_slopes"),
    ({"alibi_slopes": torch.rand(2)}, ValueError, "does not support softcap or alibi_slopes"),
    ({"q": "q"}, TypeError, "q must be a torch.Tensor"),
    ({"k": torch.zeros(3, 2, 8), "v": torch.zeros(3, 2, 8)}, ValueError, "k has 3 tokens and q 10"),
    ({"v": torch.zeros(10, 1, 8)}, ValueError, "k and v must have one shape"),
    ({"cu_seqlens": torch.tensor([0, 4, 10])}, ValueError, "cu_seqlens must be int32"),
], ids=["window", "int causal", "float max_seqlen", "dropout", "softcap", "alibi", "str q", "fewer keys", "v unlike k", "int64 cu_seqlens"])
def test_bad_arguments_are_named_before_any_communication(kernels, change, error, message):
    q, k, v, cu = _local_inputs()
    arguments = {"q": q, "k": k, "v": v, "cu_seqlens": cu, "max_seqlen": 6, **change}
    with pytest.raises(error, match=message):
        hat.ring_flash_attn_varlen_func(**arguments)
    assert kernels.calls == []


def test_without_a_process_group_the_call_says_so(kernels):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(ValueError, match="group: torch.distributed is not initialized"):
        hat.ring_flash_attn_varlen_func(*_local_inputs(), 6, causal=True)


def test_the_ring_is_in_hipattn_torchs_api():
    assert "ring_flash_attn_varlen_func" in hat.__all__
    assert hat.ring_flash_attn_varlen_func is ring.ring_flash_attn_varlen_func


# ---------------------------------------------------------------------------------------------------
# 3. Two processes over gloo


GLOO_WORLD = 2
GLOO_LENGTHS = [6, 2, 10]


def _gloo_worker(rank: int, init_file: str, results_dir: str) -> None:
    """One rank of the gloo test (spawned): the ring through torch.distributed, both masks."""
    from datetime import timedelta

    import torch.distributed as dist

    FlashStyleKernels().install()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=GLOO_WORLD,
                            timeout=timedelta(seconds=30))
    try:
        q, k, v, dout, cu = _problem(GLOO_LENGTHS, seed=11)
        cu_local = ring.local_cu_seqlens(cu, GLOO_WORLD)
        results = {}
        for causal in (False, True):
            shard = [ring.shard_varlen(t, cu, rank, GLOO_WORLD) for t in (q, k, v, dout)]
            leaves = [t.clone().requires_grad_() for t in shard[:3]]
            out, lse, _ = hat.ring_flash_attn_varlen_func(*leaves, cu_local, 5, causal=causal, return_attn_probs=True)
            out.backward(shard[3])
            results[causal] = (out.detach(), lse, *(t.grad for t in leaves))
        torch.save(results, f"{results_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_match_unsharded_attention_and_its_gradients(tmp_path):
    """Spawns two CPU processes (each imports torch: some seconds on a busy machine), held to 90 s."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    finished = run_spawned(_gloo_worker, (str(tmp_path / "init"), str(tmp_path)), GLOO_WORLD, 90)
    assert finished, "the gloo ranks did not finish within 90 s"
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(GLOO_WORLD)]
    q, k, v, dout, cu = _problem(GLOO_LENGTHS, seed=11)
    for causal in (False, True):
        got = _unsharded([results[causal] for results in per_rank], cu)
        want = _truth(q, k, v, dout, cu, 1 / math.sqrt(q.shape[-1]), causal)
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5,
                                       msg=lambda m, name=name, causal=causal: f"{name} (causal={causal}): {m}")
