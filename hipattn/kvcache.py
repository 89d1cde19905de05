"""Attention against a KV cache: ``flash_attn_with_kvcache``, flash-attn 2's function of that name.

The path of one call: describe and validate on the host (kvcache_problem); make the arrays' device
current, then take the stream; allocate what the caller did not give (outputs, workspace) in the
inputs' framework; enqueue the append (new K/V into the cache, rotary on K and Q), the split-KV
attention and, with more than one split, the combine (ops.decode). Nothing synchronizes, so a decode
step can be captured into a CUDA/HIP graph and replayed with new cache_seqlens and block tables.
"""

from __future__ import annotations

from typing import Any

from . import checks, kvcache_problem, launch_plans, runtime
from . import problem as problem_mod
from .attention import check_outputs_disjoint, output, window_scalars, workspace_sections
from .jit.registry import recording_launches
from .ops import decode
from .streams import on_device, resolve_stream, wait_for_producers
from .workspace import kvcache_workspace

# A call's array slots, in the order launch_plans indexes them (q, k_cache, v_cache, k, v, rotary_cos,
# rotary_sin, cache_seqlens as an array, cache_batch_idx, cache_leftpad, block_table, out, lse,
# alibi_slopes, learnable_sink), by the kernel fields they fill; out and lse are its outputs.
_SLOTS = ("q", "k", "v", "k_new", "v_new", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
          "cache_leftpad", "block_table", "o", "lse", "alibi_slopes", "learnable_sink")
_OUTPUTS = (11, 12)


def flash_attn_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    cache_seqlens: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    block_table: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Any = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    learnable_sink: Any = None,
    out: Any = None,
    lse: Any = None,
    workspace: Any = None,
    stream: Any = None,
) -> Any:
    """Attention of q against a KV cache, appending the new k and v to it first; flash-attn 2's
    arguments, order and semantics. Returns ``out`` [B, S_q, Hq, D], or ``(out, softmax_lse)``
    ([B, Hq, S_q], fp32) with ``return_softmax_lse=True``.

    - ``k_cache``/``v_cache``: [B_cache, S_cache, Hkv, D], or with ``block_table`` (int32
      [B, max_pages]) paged: [pages, page_size, Hkv, D]. Written in place when k/v are given.
    - ``k``/``v``: [B, S_new, Hkv, D], appended at ``cache_seqlens`` (an int, or int32 [B] on the
      device); ``rotary_cos``/``rotary_sin`` ([positions, rotary_dim / 2]) rotate the new keys at their
      cache positions, and q at cache_seqlens (+ its token index when causal or windowed),
      interleaved (GPT-J) or not (GPT-NeoX).
    - ``cache_batch_idx`` (int32 [B]): which cache entry each sequence uses; ``cache_leftpad`` (int32
      [B]): where each sequence's keys start.
    - ``causal`` and ``window_size=(left, right)`` (flash-attn's sliding window): bottom-right
      aligned with the cache's end; ``num_splits``: 0 chooses from host-known sizes.
    - ``softcap`` > 0 caps the scores (s = softmax_scale q·k becomes softcap * tanh(s / softcap));
      ``alibi_slopes``, fp32 [Hq] or [B, Hq], then adds -slope * |i + len_k - len_q - j| to the score of
      query token i and key j, positions counted from cache_leftpad (len_k: the sequence's keys from
      there, the new ones included), as flash-attn does.
    - ``learnable_sink``, fp32 [Hq] (FlashAttention-4's, gpt-oss): a logit per query head that joins
      every row's softmax denominator with no value; the LSE includes it.

    The low-level keywords take caller buffers and a stream: ``out``, ``lse`` (needs
    ``return_softmax_lse``), ``workspace`` (``kvcache_workspace_bytes`` bytes; needed only with raw
    arrays, for rotary or split calls) and ``stream``. A cache_seqlens past the cache (as a device
    array) is clamped on the device: the output is then wrong but nothing is read or written out of
    bounds. A repeat call with torch tensors of the same signature replays the launches the first one
    validated (launch_plans), in about the host time of a torch SDPA call.
    """
    given = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
             None if cache_seqlens is None or type(cache_seqlens) is int else cache_seqlens, cache_batch_idx,
             cache_leftpad, block_table, out, lse, alibi_slopes, learnable_sink)
    active = runtime.active()
    key = None
    if workspace is None:
        host_length = cache_seqlens if type(cache_seqlens) is int else None
        key = launch_plans.signature(
            "kvcache", given, (host_length, cache_seqlens is None, softmax_scale, causal, rotary_interleaved, num_splits,
                               return_softmax_lse, *window_scalars(window_size), softcap), stream,
            _OUTPUTS if return_softmax_lse else _OUTPUTS[:1])
        plan = active.launch_plans.get(key) if key is not None else None
        if plan is not None:
            replayed = launch_plans.replay(plan, active.backend, given, stream)
            if replayed is not None:
                return (replayed[11], replayed[12]) if return_softmax_lse else replayed[11]
    call = kvcache_problem.describe(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                    cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                    rotary_interleaved, num_splits, return_softmax_lse, stream, window_size,
                                    softcap, alibi_slopes, learnable_sink)
    p = call.problem
    if lse is not None and not p.return_lse:
        raise ValueError("lse= was given but return_softmax_lse is False; pass return_softmax_lse=True")
    backend = active.backend
    with on_device(backend, p.device), recording_launches() as launches:
        launch_stream = resolve_stream((call.q, call.k_cache, call.v_cache), stream, device=p.device)
        inputs = call.inputs()
        wait_for_producers(backend, [a for a, _ in inputs] + [call.k_cache, call.v_cache], launch_stream)
        if checks.enabled():
            checks.check_kvcache(backend, launch_stream, call)
        written = [(call.k_cache, "k_cache"), (call.v_cache, "v_cache")] if p.seqlen_new else []
        _check_cache_disjoint(inputs, written)
        spans = problem_mod.memory_spans(inputs + [(call.k_cache, "k_cache"), (call.v_cache, "v_cache")])
        out_obj, out_a, out_span = output(out, "out", call.q, (p.batch, p.seqlen_q, p.heads_q, p.head_dim), p.dtype,
                                          p, spans, launch_stream)
        lse_obj = lse_a = lse_span = None
        if p.return_lse:
            lse_obj, lse_a, lse_span = output(lse, "lse", call.q, (p.batch, p.heads_q, p.seqlen_q), "fp32", p, spans,
                                              launch_stream)
            if p.seqlen_q > 1 and lse_a.strides[-1] != 1:
                raise ValueError(f"lse has strides {lse_a.strides}; its last dimension must be contiguous")
            problem_mod.check_row_statistic_alignment(lse_a, "lse")
        check_outputs_disjoint((out_span, lse_span))
        tiles, splits = decode.attention_plan(call)
        plan = kvcache_workspace(p, splits)
        sections, base = {}, None
        if plan.sections:
            named = inputs + written + [(out_a, "out")] + ([(lse_a, "lse")] if lse_a is not None else [])
            sections, base = workspace_sections(workspace, plan, call.q, launch_stream, tuple(named))
        q_rotated = sections.get("q_rotated")
        decode.append(call, q_rotated, launch_stream)
        decode.attend(call, q_rotated if q_rotated is not None else call.q, out_a, lse_a, splits,
                      sections.get("o_partial"), sections.get("lse_partial"), launch_stream, tiles)
    if key is not None and len(active.launch_plans) < launch_plans.MAX_PLANS:
        described = (*call[:11], out_a, lse_a, call.alibi_slopes, call.learnable_sink)
        made = {slot: obj for slot, obj in zip(_OUTPUTS, (out_obj, lse_obj), strict=True)
                if given[slot] is None and obj is not None}
        written_slots = _OUTPUTS + ((1, 2) if p.seqlen_new else ())
        recorded = launch_plans.record(launches, given, described, _SLOTS, made, written_slots, base,
                                       runtime=active)
        if recorded is not None:
            active.launch_plans[key] = recorded
    return (out_obj, lse_obj) if p.return_lse else out_obj


def kvcache_workspace_bytes(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None,
                            rotary_cos: Any = None, rotary_sin: Any = None, cache_seqlens: Any = None,
                            cache_batch_idx: Any = None, cache_leftpad: Any = None, block_table: Any = None,
                            causal: bool = False, num_splits: int = 0,
                            window_size: tuple[int, int] = problem_mod.NO_WINDOW) -> int:
    """Bytes of the ``workspace`` a ``flash_attn_with_kvcache`` call with these arguments needs (0 when
    none: no rotary and one split). Reads no device memory."""
    call = kvcache_problem.describe(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                    cache_batch_idx, cache_leftpad, block_table, None, causal, True,
                                    num_splits, False, None, window_size)
    return kvcache_workspace(call.problem, decode.attention_plan(call)[1]).total_bytes


def _check_cache_disjoint(inputs: list, written: list) -> None:
    """The caches, when appended to, must share no memory with anything else the call reads, nor with
    each other: the append writes them while other kernels of the call read the rest."""
    for i, (cache, cache_name) in enumerate(written):
        for other, other_name in inputs + written[:i]:
            if problem_mod.overlaps(cache, other):
                raise ValueError(f"{cache_name} overlaps {other_name} in memory; the append writes {cache_name}, "
                                 "so it must be memory of its own")
