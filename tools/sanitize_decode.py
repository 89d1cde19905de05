"""The KV-cache kernels' cases for tools.sanitize: flash_attn_with_kvcache on small caches, valid and
adversarial.

Valid calls cover contiguous and paged caches (pages of 16 and 64 tokens), new tokens appended with
rotary, causal query runs, split counts of 1 and 3, and softcap with ALiBi (whose slopes the kernel
reads per row's query head), so that every KV-cache family shipped for the H200 launches (append, the
tensor-core attention that the copy engine feeds and the one whose threads copy, combine). Adversarial calls give the device arrays values no host check can
see: cache_seqlens past the cache and negative, block-table entries and batch indices outside the
cache, left padding past the sequence, int32 extremes. Such input gives meaningless numbers, but the
kernels must clamp it (kernels/decode/cache.h) and touch no memory outside their tensors: every
output and appended cache sits between guards that must come back unchanged, read-only caches
between NaN guards (a read past one shows up as a NaN in the output), and under memcheck every
tensor is its own allocation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
BATCH = 4
CAPACITY = 96  # tokens per sequence's cache
HEADS_Q, HEADS_KV = 8, 2


@dataclass(frozen=True)
class KvCacheCase:
    name: str
    kind: str = "kvcache"
    dtype: str = "bf16"
    head_dim: int = 128
    seqlen_q: int = 1
    seqlen_new: int = 0
    page_size: int | None = None  # None: a contiguous cache
    cache_seqlens: tuple[int, ...] = (0, 17, 64, 95)
    batch_idx: tuple[int, ...] | None = None
    leftpad: tuple[int, ...] | None = None
    block_table: tuple[tuple[int, ...], ...] | None = None  # None with a page size: a shuffled valid one
    rotary_dim: int = 0
    causal: bool = False
    window: tuple[int, int] = (-1, -1)  # flash-attn's window_size
    softcap: float = 0.0
    alibi: str | None = None  # ALiBi slopes: None, "heads" ([Hq]) or "sequences" ([batch, Hq])
    num_splits: int = 1
    families: tuple[str, ...] = field(default=())


def families_of(case: KvCacheCase) -> tuple[str, ...]:
    """The kernel families a case launches on the H200, in order: append, attention (the copy engine's
    where its table has the head_dim and no page splits a 64-key tile, else the threads'), combine."""
    from hipattn.catalog import decode

    tiles_in_pages = case.page_size is None or case.page_size % decode.MMA_TILE_KEYS == 0
    attention = "decode_forward_tma" if tiles_in_pages and case.head_dim in decode.DECODE_TMA_TILES else (
        "decode_forward_mma")
    return (*(("decode_append",) if case.seqlen_new else ()), attention,
            *(("decode_combine",) if case.num_splits > 1 else ()))


def _pages(page_size: int) -> int:
    return -(-CAPACITY // page_size)


def build_cases(quick: bool = False) -> list[KvCacheCase]:
    cases = [
        KvCacheCase(name="kvcache contiguous valid"),
        KvCacheCase(name="kvcache contiguous append rotary causal splits=3", seqlen_q=3, seqlen_new=2, rotary_dim=64,
                    causal=True, num_splits=3, cache_seqlens=(0, 17, 60, 94)),
        KvCacheCase(name="kvcache paged 16 append splits=3", page_size=16, seqlen_new=1, num_splits=3,
                    cache_seqlens=(0, 17, 64, 95)),
        KvCacheCase(name="kvcache paged 64 fp16 d64", dtype="fp16", head_dim=64, page_size=64, num_splits=3),
        KvCacheCase(name="kvcache batch index and leftpad", batch_idx=(5, 0, 3, 1), leftpad=(0, 3, 64, 10)),
        KvCacheCase(name="kvcache paged 16 window (20, 0) causal splits=3", page_size=16, seqlen_q=2, seqlen_new=1,
                    window=(20, 0), causal=True, num_splits=3),
        KvCacheCase(name="kvcache leftpad softcap alibi causal splits=3", seqlen_q=3, seqlen_new=1, causal=True,
                    leftpad=(0, 3, 40, 10), softcap=30.0, alibi="sequences", num_splits=3),
    ]
    bad_lengths = (-5, CAPACITY + 100, INT32_MAX, INT32_MIN)
    cases += [
        KvCacheCase(name="kvcache cache_seqlens outside the cache", cache_seqlens=bad_lengths, num_splits=3),
        KvCacheCase(name="kvcache cache_seqlens outside the cache, append rotary", cache_seqlens=bad_lengths,
                    seqlen_new=2, rotary_dim=32, causal=True, seqlen_q=2),
        KvCacheCase(name="kvcache block table outside the pages", page_size=16, seqlen_new=1, num_splits=3,
                    block_table=tuple((-1, 10**6, INT32_MAX, INT32_MIN, 3, 2)[i:] + (0,) * i for i in range(BATCH))),
        KvCacheCase(name="kvcache pages of 64, block table outside the pages", page_size=64, seqlen_new=1,
                    num_splits=3, block_table=tuple(((-1, INT32_MAX), (INT32_MIN, 7), (10**6, 0), (3, -2))[b]
                                                    for b in range(BATCH))),
        KvCacheCase(name="kvcache batch index outside the cache", batch_idx=(-3, 6, INT32_MAX, INT32_MIN),
                    seqlen_new=1),
        KvCacheCase(name="kvcache leftpad outside the sequence", leftpad=(-7, INT32_MAX, 200, INT32_MIN)),
        KvCacheCase(name="kvcache cache_seqlens outside the cache, window (30, 2)", cache_seqlens=bad_lengths,
                    seqlen_q=3, window=(30, 2), num_splits=3),
    ]
    if quick:
        cases = cases[1:3] + cases[5:]
    return [KvCacheCase(**{**case.__dict__, "families": families_of(case)}) for case in cases]


def run(runner, case: KvCacheCase) -> None:
    """One call on guarded tensors (tools.sanitize.Runner), then the guard and NaN checks."""
    import hipattn

    torch = runner.torch
    d = case.head_dim
    entries = BATCH + 2 if case.batch_idx is not None else BATCH
    cache_shape = (entries, CAPACITY, HEADS_KV, d)
    table = None
    if case.page_size is not None:
        pages = _pages(case.page_size)
        cache_shape = (BATCH * pages + 2, case.page_size, HEADS_KV, d)
        rows = case.block_table or tuple(tuple(range(b * pages, (b + 1) * pages))[::-1] for b in range(BATCH))
        table = torch.tensor(rows, dtype=torch.int32, device="cuda")
    appending = case.seqlen_new > 0
    # Appended caches are outputs (guards that must stay unchanged); read-only ones inputs (NaN guards).
    if appending:
        k_cache = runner.output("k_cache", cache_shape, case.dtype, fill=0.5)
        v_cache = runner.output("v_cache", cache_shape, case.dtype, fill=-0.25)
    else:
        k_cache, v_cache = runner.input(cache_shape, case.dtype), runner.input(cache_shape, case.dtype)
    q = runner.input((BATCH, case.seqlen_q, HEADS_Q, d), case.dtype)
    k = runner.input((BATCH, case.seqlen_new, HEADS_KV, d), case.dtype) if appending else None
    v = runner.input((BATCH, case.seqlen_new, HEADS_KV, d), case.dtype) if appending else None
    cos = sin = None
    if case.rotary_dim:
        positions = cache_shape[0] * cache_shape[1] if case.page_size else CAPACITY
        angle = torch.rand(positions, case.rotary_dim // 2, device="cuda") * 6.283
        cos, sin = (runner.input(tuple(angle.shape), case.dtype).copy_(f(angle)) for f in (torch.cos, torch.sin))
    slopes = None
    if case.alibi is not None:
        shape = (BATCH, HEADS_Q) if case.alibi == "sequences" else (HEADS_Q,)
        slopes = runner.input(shape, "fp32").copy_(torch.rand(shape, device="cuda"))
    out = runner.output("out", tuple(q.shape), case.dtype)
    lse = runner.output("lse", (BATCH, HEADS_Q, case.seqlen_q), "fp32")
    hipattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=runner.int32(list(case.cache_seqlens)),
        cache_batch_idx=runner.int32(list(case.batch_idx)) if case.batch_idx else None,
        cache_leftpad=runner.int32(list(case.leftpad)) if case.leftpad else None, block_table=table,
        causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=slopes,
        num_splits=case.num_splits, return_softmax_lse=True, out=out, lse=lse)
    # Every row of out and lse is written (a row that sees no key gets O = 0, LSE = +inf); appended
    # caches change only inside, at clamped positions.
    runner.check_outputs({})
