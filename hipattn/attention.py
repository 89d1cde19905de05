"""Low-level forward and backward on device arrays, with optional caller-provided outputs.

The path of one call (docs/ARCHITECTURE.md): describe and validate on the host; make the arrays' device
current, *then* take the stream; dispatch; allocate missing outputs in the inputs' framework;
enqueue. Nothing synchronizes, so the call can be captured into a CUDA/HIP graph.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from . import arrays, checks, dispatch, dropout, launch_plans, runtime
from . import problem as problem_mod
from .device_array import UNKNOWN_DEVICE, DeviceArray, contiguous_strides, derived_array
from .errors import HipattnError
from .jit.registry import recording_launches
from .ops import flash, flash_backward, smallseq
from .streams import on_device, resolve_stream, wait_for_producers
from .workspace import WORKSPACE_ALIGNMENT, WorkspacePlan, backward_workspace


def _array(obj: Any, name: str, stream: int | None = None) -> DeviceArray | None:
    return None if obj is None else arrays.as_device_array(obj, name, stream=stream)


def _pointer_device(a: DeviceArray) -> int | None:
    """The runtime's answer to "which device holds this pointer", or None when it cannot say."""
    if not a.ptr:
        return None
    try:
        device = runtime.active().backend.pointer_device(a.ptr)
    except HipattnError:  # no runtime here, or a pointer it does not know: the other arrays decide
        return None
    return device if isinstance(device, int) and device >= 0 else None


def settle_devices(described: tuple, device: int | None = None) -> tuple:
    """``described`` (DeviceArrays or None) with every unknown device (a CAI producer that names
    none) settled: the runtime's answer for its pointer, else ``device``, else the device of the
    first array that knows its own. UNKNOWN_DEVICE never reaches the runtime."""
    settled = list(described)
    pending = []
    for i, a in enumerate(settled):
        if a is not None and a.device == UNKNOWN_DEVICE:
            found = _pointer_device(a)
            if found is None:
                pending.append(i)
            else:
                settled[i] = dataclasses.replace(a, device=found)
    if pending:
        if device is None:
            device = next((a.device for a in settled if a is not None and a.device != UNKNOWN_DEVICE), None)
        if device is None:
            raise ValueError(
                "cannot tell which device the arrays live on (their __cuda_array_interface__ does not say and "
                "the runtime does not know their pointers); describe one with "
                "hipattn.arrays.raw_array(..., device=N) or pass torch/CuPy/DLPack arrays"
            )
        for i in pending:
            settled[i] = dataclasses.replace(settled[i], device=device)
    return tuple(settled)


def _input_spans(call: _Inputs, more: tuple, *outputs: Any) -> tuple:
    """The memory spans of every input (q, k, v, ``more`` as (array, name) pairs, and the sequence
    arrays) when the caller gave any output buffer to check them against.

    Worked out once per call rather than once per (output, input) pair; not at all when every
    output is allocated here (a fresh allocation cannot alias an input).
    """
    for given in outputs:
        if given is not None:
            return problem_mod.memory_spans(_named_inputs(call, more))
    return ()


def _named_inputs(call: _Inputs, more: tuple = ()) -> list:
    """(array, name) of every input of the call that was given."""
    named = [(call.q, "q"), (call.k, "k"), (call.v, "v"), *more]
    for name, a in call.sequences.items():
        if a is not None:
            named.append((a, name))
    if call.alibi_slopes is not None:
        named.append((call.alibi_slopes, "alibi_slopes"))
    if call.dropout_seed is not None:
        named.append((call.dropout_seed, "dropout_seed"))
    if call.learnable_sink is not None:
        named.append((call.learnable_sink, "learnable_sink"))
    return named


def output(given: Any, name: str, like: DeviceArray, shape, dtype, problem, input_spans, stream):
    """(object to return, DeviceArray, memory span or None) for an output: the caller's buffer
    checked, or a new one (which cannot alias anything: no span to check)."""
    if given is None:
        return (*arrays.empty(like, shape, dtype, stream=stream), None)
    described = arrays.as_device_array(given, name)
    if described.device == UNKNOWN_DEVICE:
        (described,) = settle_devices((described,), problem.device)
    span = problem_mod.check_output(described, name, shape, dtype, problem, input_spans)
    return given, described, span


def check_outputs_disjoint(spans) -> None:
    """Caller-given outputs, by their memory spans (None: allocated here), must not share memory
    either: the kernels write every one of them."""
    for i, span in enumerate(spans):
        if span is None:
            continue
        for other in spans[:i]:
            if other is not None and span[0] == other[0] and span[1] < other[2] and other[1] < span[2]:
                raise ValueError(f"{span[3]} overlaps {other[3]} in memory; outputs must not alias each other")


class _Inputs(NamedTuple):
    """One call's inputs as device arrays, and the validated problem they describe."""

    q: DeviceArray
    k: DeviceArray
    v: DeviceArray
    sequences: dict  # cu_seqlens_q/k, seqused_q/k as DeviceArray or None, by keyword
    alibi_slopes: DeviceArray | None
    dropout_seed: DeviceArray | None
    learnable_sink: DeviceArray | None
    problem: problem_mod.Problem


def _describe_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                     causal, softmax_scale, stream, window_size=problem_mod.NO_WINDOW, softcap=0.0,
                     alibi_slopes=None, dropout_p=0.0, dropout_seed=None, learnable_sink=None) -> _Inputs:
    # A DLPack producer orders its pending writes before the consumer's stream, which must be named
    # at export: known here only when the caller passed a raw handle (otherwise the protocol's
    # default, the legacy stream, is what the producer syncs with).
    consumer = stream if type(stream) is int else None
    # Plain calls, not a generator over (array, name) pairs: this runs on every launch.
    qa = arrays.as_device_array(q, "q", stream=consumer)
    ka = arrays.as_device_array(k, "k", stream=consumer)
    va = arrays.as_device_array(v, "v", stream=consumer)
    cu_q = _array(cu_seqlens_q, "cu_seqlens_q", consumer)
    cu_k = _array(cu_seqlens_k, "cu_seqlens_k", consumer)
    used_q = _array(seqused_q, "seqused_q", consumer)
    used_k = _array(seqused_k, "seqused_k", consumer)
    slopes = _array(alibi_slopes, "alibi_slopes", consumer)
    seed = _array(dropout_seed, "dropout_seed", consumer)
    sink = _array(learnable_sink, "learnable_sink", consumer)
    # Unknown devices (UNKNOWN_DEVICE, the only negative one a DeviceArray holds) are settled before
    # the devices are compared; spelled out, as this runs on every launch.
    if (qa.device < 0 or ka.device < 0 or va.device < 0 or (cu_q is not None and cu_q.device < 0)
            or (cu_k is not None and cu_k.device < 0) or (used_q is not None and used_q.device < 0)
            or (used_k is not None and used_k.device < 0) or (slopes is not None and slopes.device < 0)
            or (seed is not None and seed.device < 0) or (sink is not None and sink.device < 0)):
        qa, ka, va, cu_q, cu_k, used_q, used_k, slopes, seed, sink = settle_devices(
            (qa, ka, va, cu_q, cu_k, used_q, used_k, slopes, seed, sink))
    sequences = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "seqused_q": used_q, "seqused_k": used_k}
    problem = problem_mod.describe(qa, ka, va, **sequences, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                   causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                   softcap=softcap, alibi_slopes=slopes, dropout_p=dropout_p, dropout_seed=seed,
                                   learnable_sink=sink)
    return _Inputs(qa, ka, va, sequences, slopes, seed, sink, problem)


def _order_after_inputs(backend, stream: int, call: _Inputs, *more: DeviceArray) -> None:
    """Before anything reads the inputs: wait for CAI v3 producers' streams, then (HIPATTN_CHECK=1)
    read the device-side sequence description back on the launch stream."""
    inputs = (call.q, call.k, call.v, *more, *(a for a in call.sequences.values() if a is not None))
    if call.alibi_slopes is not None:
        inputs += (call.alibi_slopes,)
    if call.dropout_seed is not None:
        inputs += (call.dropout_seed,)
    if call.learnable_sink is not None:
        inputs += (call.learnable_sink,)
    wait_for_producers(backend, inputs, stream)
    if checks.enabled():
        checks.check_sequences(backend, stream, call.problem, call.sequences)


def window_scalars(window_size: Any) -> tuple:
    """window_size as plan-key scalars: its two sides, or the object itself where it is not a
    tuple of two (launch_plans.signature then refuses the key and the full path checks it)."""
    if type(window_size) is tuple and len(window_size) == 2:
        return window_size
    return (window_size,)


# A forward call's array slots, by the kernel fields they fill (launch_plans): q, k, v, out, lse,
# cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, dropout_seed, learnable_sink; out and
# lse are its outputs.
_FORWARD_SLOTS = ("q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k",
                  "alibi_slopes", "dropout_seed", "learnable_sink")
_FORWARD_OUTPUTS = (3, 4)


def forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    out: Any = None,
    lse: Any = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    seqused_q: Any = None,
    seqused_k: Any = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = problem_mod.NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: Any = None,
    learnable_sink: Any = None,
    stream: Any = None,
) -> tuple[Any, Any]:
    """Attention forward. Returns ``(out, lse)``: out like q, lse fp32 in flash-attn's layout.

    Varlen (THD) when cu_seqlens are given: q [total_q, Hq, D], k/v [total_k, Hkv, D], int32
    cu_seqlens [batch + 1] and host-int upper bounds max_seqlen_q/k. Batch (BSHD) otherwise:
    q [B, S_q, Hq, D], k/v [B, S_k, Hkv, D], optional int32 seqused_q/k [B] (per-sequence lengths
    of a padded batch). Rows beyond a sequence's length are not written. ``window_size=(left,
    right)``: flash-attn's sliding window (hipattn.flash_attn_varlen_func says how it aligns).
    ``softcap`` and ``alibi_slopes``: flash-attn's score modifiers (hipattn.flash_attn_varlen_func).
    ``dropout_p`` drops each probability with that chance (and scales the rest by 1 / (1 - dropout_p));
    ``dropout_seed``, a one-element int64 device array, holds the 64-bit seed that decides which
    (hipattn.dropout): the same seed drops the same entries, and the backward takes the forward's.
    ``learnable_sink``: fp32 [Hq] sink logits (FlashAttention-4's): each row's softmax denominator
    gains exp(sink) and the LSE includes it, so the backward needs nothing more.

    A repeat call with torch tensors of the same signature replays the launch the first one
    validated, checking only what depends on the pointers (launch_plans).
    """
    given = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, dropout_seed,
             learnable_sink)
    active = runtime.active()
    key = launch_plans.signature("forward", given,
                                 (max_seqlen_q, max_seqlen_k, softmax_scale, causal, *window_scalars(window_size),
                                  softcap, dropout_p),
                                 stream, _FORWARD_OUTPUTS)
    if key is not None:
        plan = active.launch_plans.get(key)
        if plan is not None:
            replayed = launch_plans.replay(plan, active.backend, given, stream)
            if replayed is not None:
                return replayed[3], replayed[4]
    call = _describe_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                            max_seqlen_k, causal, softmax_scale, stream, window_size, softcap, alibi_slopes,
                            dropout_p, dropout_seed, learnable_sink)
    qa, ka, va, problem = call.q, call.k, call.v, call.problem
    path = dispatch.choose_path(problem, "forward")
    backend = active.backend
    with on_device(backend, problem.device):
        launch_stream = resolve_stream((qa, ka, va), stream, device=problem.device)
        _order_after_inputs(backend, launch_stream, call)
        spans = _input_spans(call, (), out, lse)
        out_obj, out_a, out_span = output(out, "out", qa, qa.shape, qa.dtype, problem, spans, launch_stream)
        lse_obj, lse_a, lse_span = output(lse, "lse", qa, problem_mod.lse_shape(problem), "fp32", problem, spans,
                                           launch_stream)
        if lse_a.strides and lse_a.strides[-1] != 1:
            raise ValueError(f"lse has strides {lse_a.strides}; its last dimension must be contiguous")
        problem_mod.check_row_statistic_alignment(lse_a, "lse")
        problem_mod.check_alignment(out_a, "out", problem.layout)
        check_outputs_disjoint((out_span, lse_span))
        with recording_launches() as launches:
            if path == dispatch.SMALLSEQ:
                smallseq.forward(problem, qa, ka, va, out_a, lse_a, launch_stream, **call.sequences,
                                 alibi_slopes=call.alibi_slopes, dropout_seed=call.dropout_seed,
                                 learnable_sink=call.learnable_sink)
            else:
                flash.forward(problem, qa, ka, va, out_a, lse_a, launch_stream, **call.sequences,
                              alibi_slopes=call.alibi_slopes, dropout_seed=call.dropout_seed,
                              learnable_sink=call.learnable_sink)
    if key is not None and len(active.launch_plans) < launch_plans.MAX_PLANS:
        made = {slot: obj for slot, obj in zip(_FORWARD_OUTPUTS, (out_obj, lse_obj), strict=True) if given[slot] is None}
        plan = launch_plans.record(launches, given,
                                   (qa, ka, va, out_a, lse_a, *call.sequences.values(), call.alibi_slopes,
                                    call.dropout_seed, call.learnable_sink),
                                   _FORWARD_SLOTS, made, _FORWARD_OUTPUTS, runtime=active)
        if plan is not None:
            active.launch_plans[key] = plan
    return out_obj, lse_obj


def backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    seqused_q: Any = None,
    seqused_k: Any = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = problem_mod.NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: Any = None,
    learnable_sink: Any = None,
    deterministic: bool = False,
    workspace: Any = None,
    stream: Any = None,
) -> tuple[Any, Any, Any]:
    """Attention backward: ``(dq, dk, dv)`` from the forward's inputs, ``out``, ``lse`` and ``dout``.

    Same layouts and arguments as ``forward`` (the same ``softcap``, ``alibi_slopes``, ``dropout_p`` and
    ``dropout_seed`` as the forward that made ``out`` and ``lse``: the backward regenerates its dropout
    mask from them; and its ``learnable_sink``, which the LSE already includes: given, it sends the
    call down the forward's path). The sinks' own gradient, -sum over rows of exp(sink - lse) *
    rowsum(dout * out), is hipattn.torch's to compute. dK and dV are summed over the query heads of each
    KV group (GQA/MQA). The small-seq path is deterministic whatever ``deterministic`` says; the flash
    path is bit-identical run to run with ``deterministic=True`` (a separate dQ pass, no atomics).

    ``workspace``: a device buffer of at least ``backward_workspace_bytes(...)`` bytes,
    256-byte aligned (workspace.WORKSPACE_ALIGNMENT), for callers that manage their own memory (raw arrays have no
    allocator hipattn can use). Without it the flash path allocates its workspace in the inputs'
    framework, on the launch stream.
    """
    call = _describe_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                            max_seqlen_k, causal, softmax_scale, stream, window_size, softcap, alibi_slopes,
                            dropout_p, dropout_seed, learnable_sink)
    qa, ka, va, problem = call.q, call.k, call.v, call.problem
    consumer = stream if type(stream) is int else None
    douta = arrays.as_device_array(dout, "dout", stream=consumer)
    outa = arrays.as_device_array(out, "out", stream=consumer)
    lsea = arrays.as_device_array(lse, "lse", stream=consumer)
    if UNKNOWN_DEVICE in (douta.device, outa.device, lsea.device):
        douta, outa, lsea = settle_devices((douta, outa, lsea), problem.device)
    problem_mod.check_backward_inputs(problem, qa, douta, outa, lsea)
    deterministic = problem_mod.check_bool(deterministic, "deterministic")
    path = dispatch.choose_path(problem, "backward")
    more_inputs = ((douta, "dout"), (outa, "out"), (lsea, "lse"))
    backend = runtime.active().backend
    with on_device(backend, problem.device):
        launch_stream = resolve_stream((qa, ka, va, douta), stream, device=problem.device)
        _order_after_inputs(backend, launch_stream, call, douta, outa, lsea)
        spans = _input_spans(call, more_inputs, dq, dk, dv)
        dq_obj, dqa, dq_span = output(dq, "dq", qa, qa.shape, qa.dtype, problem, spans, launch_stream)
        dk_obj, dka, dk_span = output(dk, "dk", ka, ka.shape, ka.dtype, problem, spans, launch_stream)
        dv_obj, dva, dv_span = output(dv, "dv", va, va.shape, va.dtype, problem, spans, launch_stream)
        for a, name in ((dqa, "dq"), (dka, "dk"), (dva, "dv")):
            problem_mod.check_alignment(a, name, problem.layout)
        check_outputs_disjoint((dq_span, dk_span, dv_span))
        if path == dispatch.SMALLSEQ:
            smallseq.backward(problem, douta, qa, ka, va, lsea, dqa, dka, dva, launch_stream, **call.sequences,
                              alibi_slopes=call.alibi_slopes, dropout_seed=call.dropout_seed)
        else:
            plan = backward_workspace(problem, flash_backward.adds_dq_atomically(problem, deterministic))
            # An allocation made here is freed on return: the frameworks' allocators are stream-
            # ordered, so its memory is not handed out again before the launch stream has passed
            # the kernels that use it.
            sections, _ = workspace_sections(workspace, plan, qa, launch_stream,
                                              (*_named_inputs(call, more_inputs), (dqa, "dq"), (dka, "dk"), (dva, "dv")))
            flash_backward.backward(problem, qa, ka, va, outa, douta, lsea, dqa, dka, dva, launch_stream,
                                    deterministic=deterministic, **sections, **call.sequences,
                                    alibi_slopes=call.alibi_slopes, dropout_seed=call.dropout_seed)
    return dq_obj, dk_obj, dv_obj


def backward_workspace_bytes(q: Any, k: Any, v: Any, *, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                             seqused_q: Any = None, seqused_k: Any = None, max_seqlen_q: int | None = None,
                             max_seqlen_k: int | None = None, causal: bool = False,
                             window_size: tuple[int, int] = problem_mod.NO_WINDOW,
                             deterministic: bool = False, dropout_p: float = 0.0) -> int:
    """Bytes of the ``workspace`` a ``backward`` call with these arguments needs (0 on the small-seq
    path, which needs none; ``dropout_p``, the call's, is checked as the backward checks it). Reads no
    device memory."""
    call = _describe_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                            max_seqlen_k, causal, None, None, window_size)
    problem = dataclasses.replace(call.problem, dropout_p=dropout.check_dropout_p(dropout_p))
    if dispatch.choose_path(problem, "backward") == dispatch.SMALLSEQ:
        return 0
    return backward_workspace(problem, flash_backward.adds_dq_atomically(problem, deterministic)).total_bytes


def workspace_sections(workspace: Any, plan: WorkspacePlan, like: DeviceArray, stream: int,
                       others: tuple[tuple[DeviceArray, str], ...]) -> tuple[dict[str, DeviceArray], DeviceArray]:
    """One DeviceArray per section of ``plan``, in the caller's ``workspace`` (checked: writable,
    large enough, aligned, and disjoint from every named array in ``others``) or in a new allocation
    (which the sections' ``owner`` keeps alive); and the whole buffer's."""
    if workspace is None:
        owner, base = arrays.empty(like, (plan.total_bytes // 4,), "fp32", stream=stream)
    else:
        owner, base = workspace, arrays.as_device_array(workspace, "workspace")
        if base.device == UNKNOWN_DEVICE:
            (base,) = settle_devices((base,), like.device)
        if base.readonly:
            raise ValueError("workspace is read-only (its producer exported it so); hipattn writes it: pass a writable buffer")
        if base.device != like.device:
            raise ValueError(f"workspace is on device {base.device} but q is on device {like.device}")
        if base.nbytes < plan.total_bytes or contiguous_strides(base.shape) != base.strides:
            raise ValueError(
                f"workspace must be a contiguous device buffer of at least {plan.total_bytes} bytes "
                f"(backward_workspace_bytes); got shape {base.shape}, strides {base.strides}, {base.nbytes} bytes")
        if base.ptr % WORKSPACE_ALIGNMENT:
            raise ValueError(f"workspace must be {WORKSPACE_ALIGNMENT}-byte aligned; it starts at 0x{base.ptr:x}")
        for other, name in others:
            if problem_mod.overlaps(base, other):
                raise ValueError(f"workspace overlaps {name} in memory; it must be memory of its own")
    sections = {
        s.name: derived_array(base, plan.pointer(base.ptr, s.name), s.shape, contiguous_strides(s.shape), s.dtype,
                              owner)
        for s in plan.sections
    }
    return sections, base
