"""flash_attn_with_kvcache on the GPU against the float64 model of the call
(tests/support/kvcache_reference.py): contiguous and paged caches (shuffled block tables, the last
page partly full), append with rotary (interleaved and not), cache_seqlens of 0 and at capacity,
GQA and MQA, query lengths 1, 2 and 16, split-KV at long context, softcap and ALiBi, and a captured
decode step replayed with new cache_seqlens and block tables. Fresh random inputs, outputs poisoned
first, every element and the whole cache after the append compared."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.kvcache_reference import KvCacheCase, expected
from support.reference import TOLERANCE, alibi_slopes, relative_error, sink_logits

import hipattn
import hipattn.torch as hat
from hipattn import runtime
from hipattn.catalog import decode as decode_catalog
from hipattn.jit.registry import LoadedKernel
from hipattn.ops import decode as decode_ops

from . import conftest as gpu


def _round16(dtype):
    t = gpu.TORCH_DTYPE[dtype]
    return lambda x: torch.from_numpy(x).to(t).double().numpy()


def _numpy(t):
    return None if t is None else t.detach().double().cpu().numpy()


class Call:
    """One call's tensors on the GPU and the same values as a KvCacheCase."""

    def __init__(self, rng, dtype, *, batch, seqlen_q, heads_q, heads_kv, head_dim, capacity, seqlen_new=0,
                 rotary_dim=0, interleaved=True, page_size=None, causal=False, lengths=None, window=(-1, -1),
                 leftpad=None, softcap=0.0, alibi=None, sinks=False):
        t = gpu.TORCH_DTYPE[dtype]
        self.dtype = dtype

        def randn(*shape):
            return torch.randn(*shape, generator=rng, device="cuda").to(t)

        self.q = randn(batch, seqlen_q, heads_q, head_dim)
        self.block_table = None
        if page_size is None:
            cache_shape = (batch, capacity, heads_kv, head_dim)
        else:
            pages = -(-capacity // page_size)
            cache_shape = (batch * pages + 5, page_size, heads_kv, head_dim)
            order = torch.randperm(cache_shape[0], generator=torch.Generator().manual_seed(gpu.fresh_seed()))
            self.block_table = order[:batch * pages].reshape(batch, pages).to(torch.int32).cuda()
            capacity = pages * page_size
        self.capacity = capacity
        self.k_cache, self.v_cache = randn(*cache_shape), randn(*cache_shape)
        self.k = self.v = self.cos = self.sin = None
        if seqlen_new:
            self.k, self.v = randn(batch, seqlen_new, heads_kv, head_dim), randn(batch, seqlen_new, heads_kv, head_dim)
        if rotary_dim:
            angle = torch.rand(capacity, rotary_dim // 2, generator=rng, device="cuda") * 2 * np.pi
            self.cos, self.sin = angle.cos().to(t), angle.sin().to(t)
        if lengths is None:
            lengths = torch.randint(0, capacity - seqlen_new + 1, (batch,), generator=rng, device="cuda").tolist()
        self.cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        self.cache_leftpad = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32, device="cuda")
        self.interleaved, self.causal, self.window = interleaved, causal, window
        # alibi: None, "heads" (slopes [Hq]) or "sequences" ([batch, Hq]).
        self.softcap = softcap
        self.alibi_slopes = None if alibi is None else torch.from_numpy(
            alibi_slopes(batch, heads_q, per_sequence=alibi == "sequences")).cuda()
        # sinks: a learnable logit per query head (reference.sink_logits).
        self.learnable_sink = torch.from_numpy(sink_logits(heads_q)).float().cuda() if sinks else None

    def case(self) -> KvCacheCase:
        return KvCacheCase(q=_numpy(self.q), k_cache=_numpy(self.k_cache), v_cache=_numpy(self.v_cache),
                           cache_seqlens=self.cache_seqlens.cpu().numpy(), k=_numpy(self.k), v=_numpy(self.v),
                           cos=_numpy(self.cos), sin=_numpy(self.sin), interleaved=self.interleaved,
                           block_table=None if self.block_table is None else self.block_table.cpu().numpy(),
                           leftpad=_numpy(self.cache_leftpad), causal=self.causal, window=self.window,
                           softcap=self.softcap, alibi=_numpy(self.alibi_slopes), sink=_numpy(self.learnable_sink))

    def run(self, function=hipattn.flash_attn_with_kvcache, **options):
        return function(self.q, self.k_cache, self.v_cache, self.k, self.v, rotary_cos=self.cos, rotary_sin=self.sin,
                        cache_seqlens=self.cache_seqlens, cache_leftpad=self.cache_leftpad, block_table=self.block_table,
                        causal=self.causal, window_size=self.window, rotary_interleaved=self.interleaved,
                        softcap=self.softcap, alibi_slopes=self.alibi_slopes, learnable_sink=self.learnable_sink,
                        return_softmax_lse=True, **options)


def check(call: Call, out, lse, want, what: str) -> None:
    want_out, want_lse, want_k, want_v = want
    got_out, got_lse = _numpy(out), _numpy(lse)
    assert not np.isnan(got_out).any() and not np.isnan(got_lse).any(), f"{what}: an output element was never written"
    assert relative_error(got_out, want_out) < TOLERANCE[call.dtype], what
    finite = np.isfinite(want_lse)
    assert (np.isinf(got_lse) == ~finite).all(), f"{what}: LSE +inf exactly on rows that see no key (and no sink)"
    assert np.abs(got_lse[finite] - want_lse[finite]).max(initial=0.0) < 2e-3, what
    assert np.array_equal(_numpy(call.v_cache), want_v), f"{what}: values appended bit for bit, nothing else changed"
    k_cache = _numpy(call.k_cache)
    assert np.abs(k_cache - want_k).max() <= 2 * np.abs(want_k).max() * 2.0 ** -8, f"{what}: keys appended (rotated)"


def run_and_check(call: Call, what: str, **options) -> None:
    want = expected(call.case(), call.q.shape[-1] ** -0.5, _round16(call.dtype))
    out = gpu.poisoned(call.q.shape, call.q.dtype)
    lse = gpu.poisoned((call.q.shape[0], call.q.shape[2], call.q.shape[1]), torch.float32)
    call.run(out=out, lse=lse, **options)
    torch.cuda.synchronize()
    check(call, out, lse, want, what)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("heads_q,heads_kv,seqlen_q", [(32, 8, 1), (8, 1, 2), (16, 4, 16)])
def test_decode_matches_float64(rng, dtype, page_size, heads_q, heads_kv, seqlen_q):
    """GQA and MQA, 1, 2 and 16 query tokens (causal, bottom-right), two new tokens appended; lengths 0
    (every row sees only the new keys), at capacity after the append, and partial (the last page partly
    full); the host's split count."""
    capacity = 1000
    call = Call(rng, dtype, batch=4, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv, head_dim=128,
                capacity=capacity, seqlen_new=2, page_size=page_size, causal=seqlen_q > 1, lengths=[0, 0, 0, 0])
    full = call.capacity - 2
    call.cache_seqlens.copy_(torch.tensor([0, full, 517, 3], dtype=torch.int32))
    run_and_check(call, f"{dtype} page {page_size} {heads_q}/{heads_kv} q{seqlen_q}")


def _poison_unseen_rows(call: Call, first_seen, seqlen_new: int) -> None:
    """NaN in every cache row of sequence b before first_seen[b] or past the append: a kernel that
    lets a zero weight meet such a row returns NaN."""
    lengths = call.cache_seqlens.tolist()
    table = None if call.block_table is None else call.block_table.cpu()
    for b, length in enumerate(lengths):
        unseen = torch.tensor([*range(first_seen[b]), *range(length + seqlen_new, call.capacity)], dtype=torch.long)
        for cache in (call.k_cache, call.v_cache):
            if table is None:
                cache[b, unseen] = float("nan")
            else:
                page_size = cache.shape[1]
                cache[table[b, unseen // page_size].long(), unseen % page_size] = float("nan")


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("kernel", ["decode_forward_tma", "decode_forward_mma"])
@pytest.mark.parametrize("head_dim", decode_catalog.DECODE_HEAD_DIMS)
def test_each_kernel_and_head_dim_ignores_the_cache_rows_it_must_not_see(rng, monkeypatch, head_dim, kernel,
                                                                          page_size):
    """Hopper's two tensor-core kernels (the copy engine's and the threads' copies) at every head_dim,
    contiguous and with pages of whole 64-key tiles: three causal query tokens with a window of 150
    keys, cache_leftpad (contiguous caches only, as flash-attn), so that the keys start and end inside
    tiles, NaN in every cache row outside them, three splits."""
    if kernel == "decode_forward_tma" and head_dim not in decode_catalog.DECODE_TMA_TILES:
        pytest.skip(f"the copy-engine kernel has no head_dim {head_dim} row")
    # A runtime of its own: no launch plan recorded by an earlier call of the same signature replays.
    monkeypatch.setattr(runtime, "_active", runtime.Runtime(registry=runtime.active().registry))
    if kernel == "decode_forward_mma":
        monkeypatch.setattr(decode_ops, "cache_has_tensor_maps", lambda call: False)
    ran = []
    launch = LoadedKernel.launch
    monkeypatch.setattr(LoadedKernel, "launch", lambda self, *a, **k: (ran.append(self.spec.family.name),
                                                                       launch(self, *a, **k))[1])
    lengths, new, window = [100, 517, 0, 600], 3, 150
    leftpad = [0, 70, 0, 130] if page_size is None else None
    call = Call(rng, "bf16", batch=4, seqlen_q=new, heads_q=8, heads_kv=2, head_dim=head_dim, capacity=640,
                seqlen_new=new, page_size=page_size, causal=True, window=(window, 0), lengths=lengths, leftpad=leftpad)
    want_out, want_lse, _, _ = expected(call.case(), head_dim ** -0.5, _round16("bf16"))
    # The first query token's diagonal is key `length` (the cache's end after the append, less the new
    # tokens); its window starts `window` keys before.
    first_seen = [max(leftpad[b] if leftpad else 0, length - window) for b, length in enumerate(lengths)]
    _poison_unseen_rows(call, first_seen, new)
    out = gpu.poisoned(call.q.shape, call.q.dtype)
    lse = gpu.poisoned((4, 8, new), torch.float32)
    call.run(out=out, lse=lse, num_splits=3)
    torch.cuda.synchronize()
    assert kernel in ran, f"{kernel} did not run: {ran}"
    got_out, got_lse = _numpy(out), _numpy(lse)
    assert not np.isnan(got_out).any() and not np.isnan(got_lse).any(), "an unseen row reached the output"
    assert relative_error(got_out, want_out) < TOLERANCE["bf16"]
    finite = np.isfinite(want_lse)
    assert (np.isinf(got_lse) == ~finite).all()
    assert np.abs(got_lse[finite] - want_lse[finite]).max(initial=0.0) < 2e-3


@pytest.mark.parametrize("page_size,num_splits", [(None, 1), (64, 3)])
def test_blocks_that_walk_several_work_items_match_float64(rng, page_size, num_splits):
    """More work items (sequence x KV head x split) than the GPU holds blocks: each block of the
    persistent kernel runs several, its next item's queries copied while the last one runs."""
    call = Call(rng, "bf16", batch=96, seqlen_q=1, heads_q=16, heads_kv=4, head_dim=128, capacity=384, seqlen_new=1,
                page_size=page_size)
    slots = runtime.active().compute_units(0) * 2
    assert 96 * 4 * num_splits > slots, "the test needs more items than blocks"
    run_and_check(call, f"several items per block, page_size={page_size}", num_splits=num_splits)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 32), (80, 48), (256, 128)])
def test_append_with_rotary_matches_float64(rng, interleaved, head_dim, rotary_dim):
    """New keys rotated at their cache positions, queries at cache_seqlens + their index (causal), on all
    or part of head_dim, GPT-J (interleaved) and GPT-NeoX pairs, into a paged cache."""
    call = Call(rng, "bf16", batch=3, seqlen_q=3, heads_q=8, heads_kv=2, head_dim=head_dim, capacity=600,
                seqlen_new=3, rotary_dim=rotary_dim, interleaved=interleaved, page_size=16, causal=True)
    run_and_check(call, f"rotary {rotary_dim}/{head_dim} interleaved={interleaved}")


@pytest.mark.parametrize("num_splits", [0, 1, 7, 128])
def test_long_context_split_kv_matches_float64(rng, num_splits):
    """Batch 1 at 32k keys: the host's split count, none, and up to 128 splits merged by their LSEs."""
    call = Call(rng, "bf16", batch=1, seqlen_q=1, heads_q=32, heads_kv=8, head_dim=128, capacity=32768,
                lengths=[32768 - 5])
    run_and_check(call, f"32k num_splits={num_splits}", num_splits=num_splits)


@pytest.mark.parametrize("window,causal", [((1000, -1), False), ((4096, 0), True), ((64, 3), False)])
@pytest.mark.parametrize("page_size,num_splits", [(None, 0), (256, 0), (16, 5)])
def test_sliding_windows_match_float64(rng, window, causal, page_size, num_splits):
    """flash-attn's window_size against the cache, aligned with its end: a left side shorter than the
    cache (the splits share out only the window's keys), a band under the causal diagonal, and a right
    side that matters with 4 query tokens; rotary (windowed calls rotate q at advancing positions);
    lengths 0, within the window, and past it."""
    call = Call(rng, "bf16", batch=4, seqlen_q=4, heads_q=16, heads_kv=4, head_dim=128, capacity=8192, seqlen_new=2,
                rotary_dim=64, page_size=page_size, causal=causal, window=window, lengths=[0, 50, 3000, 8186])
    run_and_check(call, f"window={window} causal={causal} page_size={page_size}", num_splits=num_splits)


@pytest.mark.parametrize("softcap,alibi,page_size,seqlen_q,leftpad", [
    (1.5, None, None, 1, [0, 100, 0, 2]), (0.0, "heads", 256, 4, None), (0.0, "sequences", 16, 2, None),
    (1.5, "sequences", None, 16, [0, 0, 500, 1])])
def test_score_modifiers_match_float64(rng, softcap, alibi, page_size, seqlen_q, leftpad):
    """flash-attn's softcap and ALiBi (slopes per query head or per sequence and head) against the cache:
    a group of 3 query heads per KV head, so that a block's rows need different heads' slopes; causal
    query runs of 2 to 16 tokens, appended as new keys (rotated, as the queries); key positions counted
    from cache_leftpad; lengths 0, at capacity after the append, and partial; the host's split count."""
    seqlen_new = max(seqlen_q, 2)
    call = Call(rng, "bf16", batch=4, seqlen_q=seqlen_q, heads_q=24, heads_kv=8, head_dim=128, capacity=2000,
                seqlen_new=seqlen_new, rotary_dim=64, page_size=page_size, causal=seqlen_q > 1, lengths=[0, 0, 0, 0],
                leftpad=leftpad, softcap=softcap, alibi=alibi)
    call.cache_seqlens.copy_(torch.tensor([0, call.capacity - seqlen_new, 517, 3], dtype=torch.int32))
    run_and_check(call, f"softcap={softcap} alibi={alibi} page_size={page_size} q{seqlen_q} leftpad={leftpad}")


@pytest.mark.parametrize("page_size,seqlen_q,num_splits", [(None, 1, 1), (256, 1, 0), (16, 4, 3)])
def test_learnable_sinks_match_float64(rng, page_size, seqlen_q, num_splits):
    """gpt-oss's attention sinks in decode: a logit per query head joins every row's softmax sum and the
    LSE, in the one-split kernel's merge and in the combine; an empty cache with no new token leaves its
    rows the sink alone (O = 0, LSE = the sink); GQA 64/8, causal query runs; both entry points."""
    call = Call(rng, "bf16", batch=4, seqlen_q=seqlen_q, heads_q=64, heads_kv=8, head_dim=64, capacity=4096,
                page_size=page_size, causal=seqlen_q > 1, lengths=[0, 4096, 1000, 5], sinks=True)
    run_and_check(call, f"sinks page_size={page_size} q{seqlen_q} splits={num_splits}", num_splits=num_splits)
    want = expected(call.case(), 64 ** -0.5, _round16("bf16"))
    out, lse = call.run(hat.flash_attn_with_kvcache, num_splits=num_splits)
    torch.cuda.synchronize()
    check(call, out, lse, want, f"sinks through hipattn.torch page_size={page_size}")


def test_the_torch_function_matches_and_refuses_other_arrays(rng):
    call = Call(rng, "bf16", batch=2, seqlen_q=1, heads_q=8, heads_kv=2, head_dim=128, capacity=300, seqlen_new=1)
    want = expected(call.case(), 128 ** -0.5, _round16("bf16"))
    out, lse = call.run(hat.flash_attn_with_kvcache)
    torch.cuda.synchronize()
    check(call, out, lse, want, "hipattn.torch")
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        hat.flash_attn_with_kvcache(np.zeros((1, 1, 8, 128)), call.k_cache, call.v_cache, cache_seqlens=3)


def test_the_torch_function_refuses_a_paged_call_past_its_block_table_and_captures_without_reading_back(rng):
    """flash-attn's paged guard, eagerly: a cache_seqlens whose longest sequence with the new token
    needs more pages than a block-table row names is a RuntimeError naming block_table, and the caches
    are left as they were. Captured in a CUDA graph, the same function reads nothing back (a read
    would break the capture) and replays with new lengths as serving engines run it."""
    call = Call(rng, "bf16", batch=2, seqlen_q=1, heads_q=8, heads_kv=2, head_dim=128, capacity=64, seqlen_new=1,
                page_size=16)
    k_before, v_before = call.k_cache.clone(), call.v_cache.clone()
    call.cache_seqlens.copy_(torch.tensor([5, call.capacity], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="block_table"):
        call.run(hat.flash_attn_with_kvcache)
    torch.cuda.synchronize()
    assert torch.equal(call.k_cache, k_before) and torch.equal(call.v_cache, v_before), "nothing was enqueued"
    call.cache_seqlens.copy_(torch.tensor([5, call.capacity - 1], dtype=torch.int32))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call.run(hat.flash_attn_with_kvcache)  # compile and load outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out, lse = call.run(hat.flash_attn_with_kvcache)
    for lengths in ([0, 17], [call.capacity - 1, 40]):
        call.cache_seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        torch.cuda.synchronize()
        want = expected(call.case(), 128 ** -0.5, _round16("bf16"))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(call, out, lse, want, f"captured torch call, lengths {lengths}")


def test_a_captured_decode_step_replays_with_new_lengths_and_block_tables(rng):
    """Capture one paged decode step (append with rotary, split-KV attention, combine) in a CUDA graph,
    then replay it with new cache_seqlens, a reshuffled block table and new inputs written into the
    same buffers, as serving engines run it."""
    call = Call(rng, "bf16", batch=4, seqlen_q=1, heads_q=32, heads_kv=8, head_dim=128, capacity=4096, seqlen_new=1,
                rotary_dim=128, page_size=256)
    out = torch.empty_like(call.q)
    lse = torch.empty(4, 32, 1, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call.run(out=out, lse=lse, num_splits=4)  # compile and load outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call.run(out=out, lse=lse, num_splits=4)
    host = torch.Generator().manual_seed(gpu.fresh_seed())
    for replay in range(3):
        call.cache_seqlens.copy_(torch.randint(0, call.capacity, (4,), generator=host, dtype=torch.int32))
        pages = call.block_table.numel()
        order = torch.randperm(call.k_cache.shape[0], generator=host)[:pages].reshape(call.block_table.shape)
        call.block_table.copy_(order.to(torch.int32))
        for buffer in (call.q, call.k, call.v, call.k_cache, call.v_cache):
            buffer.normal_(generator=rng)
        torch.cuda.synchronize()
        want = expected(call.case(), 128 ** -0.5, _round16("bf16"))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(call, out, lse, want, f"graph replay {replay}")


def test_repeat_calls_replay_the_validated_launches(rng, monkeypatch):
    """The first call of a signature records its launches (append, attention, combine, with a
    workspace); repeats with new values in the same buffers, and with outputs left to hipattn, replay
    them and match the model as the full path does."""
    fresh = runtime.Runtime(registry=runtime.active().registry)
    monkeypatch.setattr(runtime, "_active", fresh)
    call = Call(rng, "bf16", batch=3, seqlen_q=2, heads_q=16, heads_kv=4, head_dim=128, capacity=2048,
                seqlen_new=2, rotary_dim=64, page_size=256, causal=True)
    run_and_check(call, "first call", num_splits=3)
    assert len(fresh.launch_plans) == 1
    for repeat in range(2):
        for buffer in (call.q, call.k, call.v):
            buffer.normal_(generator=rng)
        call.cache_seqlens.copy_(torch.randint(0, call.capacity - 2, (3,), generator=rng, device="cuda"))
        run_and_check(call, f"replay {repeat}", num_splits=3)
    assert len(fresh.launch_plans) == 1, "the repeats replayed the first call's plan"
    # Outputs left to hipattn: a plan of its own, then its replay, which allocates new ones. The same
    # append twice writes the same rows, so both calls have the same answer.
    want = expected(call.case(), 128 ** -0.5, _round16("bf16"))
    first_out, first_lse = call.run(num_splits=3)
    out, lse = call.run(num_splits=3)
    torch.cuda.synchronize()
    assert len(fresh.launch_plans) == 2 and out.data_ptr() != first_out.data_ptr()
    check(call, first_out, first_lse, want, "allocated outputs")
    check(call, out, lse, want, "allocated outputs, replayed")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_decode_step_appends_to_the_caches_and_matches_float64(rng, backend):
    """torch.compile traces hipattn.torch.flash_attn_with_kvcache as the hipattn::kvcache op: the
    compiled step appends (rotated) to the paged caches in place and matches the model."""
    call = Call(rng, "bf16", batch=2, seqlen_q=1, heads_q=8, heads_kv=2, head_dim=128, capacity=256, seqlen_new=1,
                rotary_dim=64, page_size=16)
    want = expected(call.case(), 128 ** -0.5, _round16("bf16"))

    @torch.compile(backend=backend, fullgraph=True)
    def step(q, k_cache, v_cache, k, v, cos, sin, lengths, table):
        return hat.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=lengths, block_table=table, return_softmax_lse=True)

    out, lse = step(call.q, call.k_cache, call.v_cache, call.k, call.v, call.cos, call.sin, call.cache_seqlens,
                    call.block_table)
    torch.cuda.synchronize()
    check(call, out, lse, want, f"compiled ({backend})")
