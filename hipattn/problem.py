"""Validate one attention call on the host and describe it: everything dispatch and launch need.

Every check here runs before anything is enqueued and raises TypeError (wrong kind of thing) or
ValueError (right kind, wrong value) with a message that says what was given and what is expected.
Nothing reads device memory: what only the device knows (cu_seqlens contents) is clamped by the
kernels instead.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from . import dropout
from .device_array import ELEMENT_SIZE, DeviceArray, element_size

SUPPORTED_DTYPES = ("fp16", "bf16")
THD = "thd"  # varlen: q [total_q, Hq, D], k/v [total_k, Hkv, D], int32 cu_seqlens of length batch+1
BSHD = "bshd"  # batch: q [B, S_q, Hq, D], k/v [B, S_k, Hkv, D], optional int32 seqused of length B
# Kernels read rows with 16-byte accesses: pointers and row strides must allow that.
ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class Problem:
    layout: str
    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    max_seqlen_q: int  # upper bound on every query length (exact for BSHD: the padded length)
    max_seqlen_k: int
    total_q: int  # rows a sequence may reach: THD total tokens; BSHD padded length
    total_k: int
    causal: bool
    softmax_scale: float
    device: int
    # The keys a query row sees, flash-attn's window_size with causal folded in (right 0): -1 is no
    # bound on that side. (-1, -1) is plain attention.
    window_left: int = -1
    window_right: int = -1
    # flash-attn's score modifiers (kernels/common/score_mods.h): softcap (0.0: none), and whether
    # ALiBi slopes were given (the array itself travels beside the problem, as the other inputs do).
    softcap: float = 0.0
    alibi: bool = False
    # flash-attn's dropout_p (kernels/common/dropout.h; hipattn.dropout): 0.0 is none. The seed array
    # travels beside the problem.
    dropout_p: float = 0.0
    # Whether learnable sinks were given (FlashAttention-4's learnable_sink: one logit per query head
    # that joins each row's softmax denominator); the array travels beside the problem.
    sink: bool = False

    @property
    def score_mods(self) -> bool:
        """Whether the kernels' modified instantiation (softcap, ALiBi, dropout or sinks, read at run
        time) serves this call, or the plain one."""
        return self.softcap != 0.0 or self.alibi or self.dropout_p != 0.0 or self.sink


def dims(a: DeviceArray, name: str, layout: str) -> tuple[int, int, int, int]:
    """(batch, tokens, heads, head_dim) of a THD or BSHD tensor."""
    rank = 3 if layout == THD else 4
    if len(a.shape) != rank:
        expected = "[total_tokens, heads, head_dim]" if layout == THD else "[batch, seqlen, heads, head_dim]"
        raise ValueError(f"{name} has shape {a.shape}; expected {rank} dimensions {expected} ({layout.upper()} layout)")
    if a.strides[-1] != 1 and a.shape[-1] > 1:
        raise ValueError(f"{name} has strides {a.strides}; its last dimension (head_dim) must be contiguous (stride 1)")
    return (1, *a.shape) if layout == THD else tuple(a.shape)


def check_dtype(a: DeviceArray, name: str, expected: tuple[str, ...]) -> None:
    if a.dtype not in expected:
        raise TypeError(f"{name} has dtype {a.dtype}; hipattn supports {' and '.join(expected)} here")


def check_alignment(a: DeviceArray, name: str, layout: str) -> None:
    itemsize = element_size(a.dtype)
    if a.ptr % ALIGNMENT_BYTES:
        raise ValueError(f"{name}'s data pointer 0x{a.ptr:x} is not {ALIGNMENT_BYTES}-byte aligned; pass a fresh allocation or a copy")
    # Every element size divides 16, so "stride * itemsize is a multiple of 16" is "stride is a
    # multiple of 16 // itemsize": one modulo per stride, no tuple built (this runs per array per call).
    step = ALIGNMENT_BYTES // itemsize
    strides = a.strides
    if strides[0] % step or strides[1] % step or (layout != THD and strides[2] % step):
        raise ValueError(
            f"{name} has strides {a.strides}; every stride must be a multiple of {step} "
            f"elements ({ALIGNMENT_BYTES} bytes) so rows can be read with 16-byte accesses; pass a contiguous copy"
        )


def check_index_array(a: DeviceArray | None, name: str, length: int, device: int) -> None:
    """An optional int32 vector of ``length`` on ``device`` that kernels read (cu_seqlens, seqused,
    a KV cache's lengths or batch indices): dtype, alignment, shape, contiguity, device."""
    if a is None:
        return
    if a.dtype != "int32":
        raise TypeError(f"{name} has dtype {a.dtype}; expected int32")
    if a.ptr % 4:  # the kernels read it as int32
        raise ValueError(f"{name}'s data pointer 0x{a.ptr:x} is not aligned to its 4-byte elements")
    if len(a.shape) != 1 or a.shape[0] != length:
        raise ValueError(f"{name} has shape {a.shape}; expected ({length},)")
    if a.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous; got strides {a.strides}")
    if a.device != device:
        raise ValueError(f"{name} is on device {a.device} but q is on device {device}; move it to device {device}")


def check_max_seqlen(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a host int (flash-attn's varlen convention), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} is {value}; it must be >= 0 (an upper bound on every sequence length)")
    return value


def _is_numpy_bool(value: object) -> bool:
    # numpy.bool_ (spelled numpy.bool from NumPy 2), accepted as flash-attn users pass it; 0 and 1 are not bools.
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")


def check_bool(value: object, name: str) -> bool:
    """``value`` as a bool: True, False or a NumPy bool; anything else (1, "yes", None) is a TypeError."""
    if type(value) is bool:
        return value
    if _is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


NO_WINDOW = (-1, -1)


def check_window(window_size: object, causal: bool) -> tuple[int, int]:
    """flash-attn's ``window_size=(left, right)`` as the kernels' (left, right): a negative side has no
    bound (-1), and causal makes the right side 0, as flash-attn does. Query i of a sequence sees key j
    when i + len_k - len_q - left <= j <= i + len_k - len_q + right (bottom-right aligned)."""
    if type(window_size) is tuple and window_size == NO_WINDOW and type(window_size[0]) is int:
        return (-1, 0 if causal else -1)
    # Any pair of integers: flash-attn's own tests pass a 2-element integer tensor, whose elements
    # operator.index reads as Python ints. Bools are refused, as everywhere else an int is expected.
    try:
        sides = tuple(window_size)  # type: ignore[arg-type]
        if len(sides) != 2 or any(isinstance(side, bool) or _is_numpy_bool(side) for side in sides):
            raise TypeError
        left, right = (max(operator.index(side), -1) for side in sides)
    except TypeError:
        # An array is named by its type: its repr could be large, or read device memory to print it.
        given = repr(window_size) if isinstance(window_size, (tuple, list, int, float, str)) else type(window_size)
        raise TypeError(f"window_size must be a pair of ints (left, right), got {given}") from None
    return (left, 0 if causal else right)


def check_softcap(softcap: object) -> float:
    """flash-attn's ``softcap``: a host number, 0 for none, else positive and finite (scores become
    softcap * tanh(score / softcap))."""
    if type(softcap) is float and softcap == 0.0:  # the common case: one comparison per call
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        # An array is named by its type: its repr could be large, or read device memory to print it.
        given = repr(softcap) if isinstance(softcap, (str, bool)) or softcap is None else type(softcap).__qualname__
        raise TypeError(f"softcap must be a host number (0.0 for none), got {given}")
    value = float(softcap)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"softcap is {softcap!r}; it must be 0.0 (no capping) or a positive finite number")
    if value and value <= _FLOAT32_ROUNDS_TO_ZERO:
        raise ValueError(f"softcap {softcap!r} rounds to 0 in float32, which the kernels take")
    return min(value, FLOAT32_MAX)


def check_alibi_slopes(slopes: DeviceArray | None, batch: int, heads_q: int, device: int) -> None:
    """flash-attn's ``alibi_slopes``: fp32 of shape [Hq] (one slope per query head) or [batch, Hq],
    the head dimension contiguous, on q's device. Query i then adds -slope * |i + len_k - len_q - j| to
    its score for key j."""
    if slopes is None:
        return
    if slopes.dtype != "fp32":
        raise TypeError(f"alibi_slopes has dtype {slopes.dtype}; expected fp32 (flash-attn's)")
    if tuple(slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes has shape {tuple(slopes.shape)}; expected ({heads_q},) or ({batch}, {heads_q}): "
                         "one slope per query head, optionally per sequence")
    if slopes.shape[-1] > 1 and slopes.strides[-1] != 1:
        raise ValueError(f"alibi_slopes has strides {slopes.strides}; its last dimension (heads) must be contiguous")
    if slopes.ptr % 4:
        raise ValueError(f"alibi_slopes's data pointer 0x{slopes.ptr:x} is not aligned to its 4-byte fp32 elements")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes is on device {slopes.device} but q is on device {device}; move it to device {device}")


def check_learnable_sink(sink: DeviceArray | None, heads_q: int, device: int) -> None:
    """FlashAttention-4's ``learnable_sink``: fp32 of shape [Hq], contiguous, on q's device: query head
    h's rows put weight exp(sink[h] - LSE) on a sink with no value, and the LSE includes it."""
    if sink is None:
        return
    if sink.dtype != "fp32":
        raise TypeError(f"learnable_sink has dtype {sink.dtype}; expected fp32")
    if tuple(sink.shape) != (heads_q,):
        raise ValueError(f"learnable_sink has shape {tuple(sink.shape)}; expected ({heads_q},): one logit per query head")
    if heads_q > 1 and sink.strides[0] != 1:
        raise ValueError(f"learnable_sink has strides {sink.strides}; it must be contiguous")
    if sink.ptr % 4:
        raise ValueError(f"learnable_sink's data pointer 0x{sink.ptr:x} is not aligned to its 4-byte fp32 elements")
    if sink.device != device:
        raise ValueError(f"learnable_sink is on device {sink.device} but q is on device {device}; move it to device {device}")


def alibi_batch_stride(slopes: DeviceArray) -> int:
    """Elements between two sequences' slopes: 0 for [Hq] slopes, which every sequence shares."""
    return slopes.strides[0] if len(slopes.shape) == 2 else 0


# The kernels take softmax_scale as a float32: a double beyond its range would become inf (and the
# output NaN), and one below half its smallest subnormal would become 0 (a uniform average).
FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_ROUNDS_TO_ZERO = 2.0**-150


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale`` checked, or 1/sqrt(head_dim) when None.

    It must be a host number that float32 represents: finite, at most FLOAT32_MAX in magnitude,
    and not so small that it rounds to 0 (0 itself, negative values and float32 subnormals are
    accepted: each keeps its meaning).
    """
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a number (a host float), got {softmax_scale!r}")
    try:
        value = float(softmax_scale)
    except OverflowError:  # an int beyond even a double, such as 10**400: finite, but far too large
        value = None
    else:
        if not math.isfinite(value):
            raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    if value is None or abs(value) > FLOAT32_MAX:
        raise ValueError(
            f"softmax_scale {softmax_scale!r} does not fit in float32, which the kernels take "
            f"(|softmax_scale| <= {FLOAT32_MAX:.8g})"
        )
    if value and abs(value) <= _FLOAT32_ROUNDS_TO_ZERO:
        raise ValueError(f"softmax_scale {softmax_scale!r} rounds to 0 in float32, which the kernels take")
    return value


def describe(
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    *,
    cu_seqlens_q: DeviceArray | None = None,
    cu_seqlens_k: DeviceArray | None = None,
    seqused_q: DeviceArray | None = None,
    seqused_k: DeviceArray | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: DeviceArray | None = None,
    dropout_p: float = 0.0,
    dropout_seed: DeviceArray | None = None,
    learnable_sink: DeviceArray | None = None,
) -> Problem:
    """Check q, k, v, the sequence description, the score modifiers, dropout and sinks; the layout
    follows from cu_seqlens being given."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("give both cu_seqlens_q and cu_seqlens_k (varlen) or neither (batch)")
    layout = THD if cu_seqlens_q is not None else BSHD
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        check_dtype(a, name, SUPPORTED_DTYPES)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    qb, q_tokens, heads_q, head_dim = dims(q, "q", layout)
    kb, k_tokens, heads_kv, k_dim = dims(k, "k", layout)
    if tuple(v.shape) != tuple(k.shape):
        if tuple(v.shape[:-1]) == tuple(k.shape[:-1]):
            raise ValueError(f"v has head_dim {v.shape[-1]} but k has {k.shape[-1]}: the kernels take one head_dim for "
                             "q, k and v; hipattn.torch (and hipattn.flash_attn_func with autograd) pads them to one")
        raise ValueError(f"v has shape {v.shape}; it must match k's {k.shape}")
    dims(v, "v", layout)
    if k_dim != head_dim:
        raise ValueError(f"k has head_dim {k_dim} but q has {head_dim}; they must be equal")
    if head_dim < 1:
        raise ValueError(f"head_dim is {head_dim}; it must be at least 1 (q has shape {q.shape})")
    if layout == BSHD and kb != qb:
        raise ValueError(f"k has batch {kb} but q has batch {qb}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"q has {heads_q} heads and k/v {heads_kv}; the query heads must be a multiple of the key/value heads (GQA/MQA)"
        )
    if heads_q == 0:
        # 0 is a multiple of any head count, but the backward would then never write dK and dV.
        raise ValueError(f"q has 0 heads (shape {q.shape}); it needs at least one, as k/v have {heads_kv}")
    device = q.device
    for a, name in ((k, "k"), (v, "v")):
        if a.device != device:
            raise ValueError(f"{name} is on device {a.device} but q is on device {device}; all inputs must share one device")
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        check_alignment(a, name, layout)
    if type(causal) is not bool:  # the common case costs one comparison: this runs on every call
        causal = check_bool(causal, "causal")
    window_left, window_right = check_window(window_size, causal)
    softmax_scale = resolve_softmax_scale(softmax_scale, head_dim)
    softcap = check_softcap(softcap)
    if type(dropout_p) is not float or dropout_p != 0.0 or dropout_seed is not None:
        dropout_p = dropout.check_dropout_p(dropout_p)
        dropout.check_seed(dropout_seed, dropout_p, device)

    if layout == THD:
        if cu_seqlens_q.shape != cu_seqlens_k.shape or len(cu_seqlens_q.shape) != 1 or cu_seqlens_q.shape[0] < 1:
            raise ValueError(
                f"cu_seqlens_q {cu_seqlens_q.shape} and cu_seqlens_k {cu_seqlens_k.shape} must both have shape (batch + 1,)"
            )
        batch = cu_seqlens_q.shape[0] - 1
        check_index_array(cu_seqlens_q, "cu_seqlens_q", batch + 1, device)
        check_index_array(cu_seqlens_k, "cu_seqlens_k", batch + 1, device)
        if max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("varlen calls need max_seqlen_q and max_seqlen_k (host ints, upper bounds of the lengths)")
        max_q = check_max_seqlen(max_seqlen_q, "max_seqlen_q")
        max_k = check_max_seqlen(max_seqlen_k, "max_seqlen_k")
        total_q, total_k = q_tokens, k_tokens
    else:
        batch = qb
        # The padded lengths bound every sequence; a caller's smaller bound is honoured.
        max_q = q_tokens if max_seqlen_q is None else min(check_max_seqlen(max_seqlen_q, "max_seqlen_q"), q_tokens)
        max_k = k_tokens if max_seqlen_k is None else min(check_max_seqlen(max_seqlen_k, "max_seqlen_k"), k_tokens)
        total_q, total_k = q_tokens, k_tokens
    check_index_array(seqused_q, "seqused_q", batch, device)
    check_index_array(seqused_k, "seqused_k", batch, device)
    check_alibi_slopes(alibi_slopes, batch, heads_q, device)
    check_learnable_sink(learnable_sink, heads_q, device)
    if max(total_q, total_k, batch, max_q, max_k, heads_q, heads_kv) > _INT32_MAX:
        check_fits_int32(total_q=total_q, total_k=total_k, batch=batch, max_seqlen_q=max_q, max_seqlen_k=max_k,
                          heads_q=heads_q, heads_kv=heads_kv)
    return _problem(layout, q.dtype, batch, heads_q, heads_kv, head_dim, max_q, max_k, total_q, total_k,
                    causal, softmax_scale, device, window_left, window_right, softcap, alibi_slopes is not None,
                    dropout_p, learnable_sink is not None)


# The kernels take token counts, batch and bounds as 32-bit ints (ctypes would wrap larger values
# silently, and a negative total would make every sequence look empty).
_INT32_MAX = 2**31 - 1


def check_backward_inputs(problem: Problem, q: DeviceArray, dout: DeviceArray, out: DeviceArray,
                          lse: DeviceArray) -> None:
    """The backward's further inputs: dout and out like q (dtype, shape, device, layout, alignment),
    and the forward's fp32 lse in flash-attn's layout."""
    for a, name in ((dout, "dout"), (out, "out")):
        if a.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {a.dtype}; expected q's {q.dtype}")
        if tuple(a.shape) != tuple(q.shape):
            raise ValueError(f"{name} has shape {a.shape}; expected q's {q.shape}")
        if a.device != problem.device:
            raise ValueError(f"{name} is on device {a.device} but q is on device {problem.device}")
        if a.strides[-1] != 1 and a.shape[-1] > 1:
            raise ValueError(f"{name} has strides {a.strides}; its last dimension (head_dim) must be contiguous (stride 1)")
        check_alignment(a, name, problem.layout)
    check_dtype(lse, "lse", ("fp32",))
    if lse.device != problem.device:
        raise ValueError(f"lse is on device {lse.device} but q is on device {problem.device}")
    expected = lse_shape(problem)
    if tuple(lse.shape) != expected or lse.strides[-1] != 1:
        raise ValueError(f"lse has shape {lse.shape}; expected {expected} fp32, last dimension contiguous")
    check_row_statistic_alignment(lse, "lse")


def check_fits_int32(**counts: int) -> None:
    for name, value in counts.items():
        if value > _INT32_MAX:
            raise ValueError(f"{name} is {value}; hipattn's kernels index with 32-bit ints (at most {_INT32_MAX})")


_new_object = object.__new__


def _problem(layout, dtype, batch, heads_q, heads_kv, head_dim, max_seqlen_q, max_seqlen_k, total_q, total_k,
             causal, softmax_scale, device, window_left, window_right, softcap, alibi, dropout_p=0.0,
             sink=False) -> Problem:
    # The hot-path constructor (as device_array.unchecked_device_array): the frozen dataclass __init__
    # sets its fields one object.__setattr__ at a time (~2 us); filling __dict__ builds the same
    # object in a third.
    problem = _new_object(Problem)
    problem.__dict__.update(
        layout=layout, dtype=dtype, batch=batch, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, total_q=total_q, total_k=total_k, causal=causal,
        softmax_scale=softmax_scale, device=device, window_left=window_left, window_right=window_right,
        softcap=softcap, alibi=alibi, dropout_p=dropout_p, sink=sink,
    )  # fmt: skip
    return problem


def lse_shape(problem: Problem) -> tuple[int, ...]:
    """flash-attn's softmax_lse layout: [Hq, total_q] for varlen, [B, Hq, S_q] for batch."""
    if problem.layout == THD:
        return (problem.heads_q, problem.total_q)
    return (problem.batch, problem.heads_q, problem.total_q)


def lse_strides(lse: DeviceArray, problem: Problem) -> tuple[int, int]:
    """(batch, head) element strides of an LSE array; the token stride must be 1."""
    return (0, lse.strides[0]) if problem.layout == THD else (lse.strides[0], lse.strides[1])


# (device, first byte, one past the last byte, name) of one input: see memory_spans.
Span = tuple[int, int, int, str]


def memory_spans(inputs: Sequence[tuple[DeviceArray, str]]) -> list[Span]:
    """The byte range of each named input, (array, name) pairs, worked out once per call and
    checked against every output."""
    spans = []
    for a, input_name in inputs:
        start, end = extent(a)
        spans.append((a.device, start, end, input_name))
    return spans


def check_output(out: DeviceArray, name: str, shape: tuple[int, ...], dtype: str, problem: Problem,
                 inputs: Sequence[Span]) -> Span:
    """A caller-provided output buffer: shape, dtype, device, layout, no element written twice, and
    no overlap with any input. Returns its own span, to check the outputs against each other.

    ``inputs`` are the inputs' ``memory_spans``.
    """
    if out.dtype != dtype:
        raise TypeError(f"{name} has dtype {out.dtype}; expected {dtype}")
    if out.readonly:
        raise ValueError(f"{name} is read-only (its producer exported it so); hipattn writes it: pass a writable buffer")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(out.shape)}; expected {tuple(shape)}")
    if out.device != problem.device:
        raise ValueError(f"{name} is on device {out.device} but the inputs are on device {problem.device}")
    if out.strides and out.strides[-1] != 1 and out.shape[-1] > 1:
        raise ValueError(f"{name} has strides {out.strides}; its last dimension must be contiguous")
    check_no_self_overlap(out, name)
    device = out.device
    start, end = extent(out)
    for input_device, input_start, input_end, input_name in inputs:
        if input_device == device and start < input_end and input_start < end:
            raise ValueError(f"{name} overlaps {input_name} in memory; outputs must not alias inputs")
    return device, start, end, name


def check_no_self_overlap(out: DeviceArray, name: str) -> None:
    """Refuse an output in which two elements share memory: a broadcast (stride 0), reversed or
    otherwise too tightly strided view, which the kernels would write through twice.

    Sufficient and exact for the views frameworks make: with the dimensions ordered by stride, each
    stride must step past everything the dimensions inside it span.
    """
    shape, strides = out.shape, out.strides
    if 0 in shape:
        return  # nothing is written
    inner = 1  # elements spanned by the dimensions inside the current one, in the order given
    ordered = True
    for i in range(len(shape) - 1, -1, -1):
        n = shape[i]
        if n > 1:
            stride = strides[i]
            if stride <= 0:
                raise ValueError(f"{name} has strides {strides}; an output needs positive strides (no broadcast or reversed views)")
            if stride < inner:
                ordered = False
            inner += (n - 1) * stride
    if ordered:  # the common case, any C-ordered view: no sort needed
        return
    inner = 1
    for stride, n in sorted((stride, n) for n, stride in zip(shape, strides, strict=True) if n > 1):
        if stride < inner:
            raise ValueError(
                f"{name} has shape {shape} and strides {strides}, so some of its elements share memory; "
                "an output needs every element at its own address (pass a contiguous buffer)"
            )
        inner += (n - 1) * stride


def check_row_statistic_alignment(a: DeviceArray, name: str) -> None:
    """An fp32 LSE array: the kernels read and write it as 4-byte scalars (copy_async_4 on NVIDIA)."""
    if a.ptr % 4:
        raise ValueError(f"{name}'s data pointer 0x{a.ptr:x} is not aligned to its 4-byte fp32 elements")


def extent(a: DeviceArray) -> tuple[int, int]:
    """[lowest byte, one past the highest byte] an array can touch, for strides of any sign."""
    ptr = a.ptr
    low = high = 0
    for n, s in zip(a.shape, a.strides, strict=True):
        if n == 0:
            return ptr, ptr
        if s >= 0:
            high += (n - 1) * s
        else:
            low += (n - 1) * s
    size = ELEMENT_SIZE[a.dtype]
    return ptr + low * size, ptr + (high + 1) * size


def overlaps(a: DeviceArray, b: DeviceArray) -> bool:
    if a.device != b.device:
        return False
    a0, a1 = extent(a)
    b0, b1 = extent(b)
    return a0 < b1 and b0 < a1
