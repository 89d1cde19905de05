"""Kernel-argument fields the attention launchers share: tensors, LSE, and the sequence description.

The names match the parameter structs of the catalog (``catalog.fields``: ``strided`` and
``SEQUENCE_FIELDS``); a launcher fills one dict with these and hands it to ``ParamsStruct.from_dict``,
which refuses a missing field.
"""

from __future__ import annotations

from ..device_array import DeviceArray
from ..problem import THD, Problem, alibi_batch_stride, lse_strides


def sequence_fields(problem: Problem, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes) -> dict:
    """The fields every attention struct shares, the sequence description and the score modifiers;
    launchers add their tensors."""
    return {
        **score_mod_fields(problem.softcap, alibi_slopes),
        "cu_seqlens_q": cu_seqlens_q.ptr if cu_seqlens_q is not None else 0,
        "cu_seqlens_k": cu_seqlens_k.ptr if cu_seqlens_k is not None else 0,
        "seqused_q": seqused_q.ptr if seqused_q is not None else 0,
        "seqused_k": seqused_k.ptr if seqused_k is not None else 0,
        "batch": problem.batch,
        "heads_kv": problem.heads_kv,
        "max_seqlen_q": problem.max_seqlen_q,
        "max_seqlen_k": problem.max_seqlen_k,
        "total_q": problem.total_q,
        "total_k": problem.total_k,
        "softmax_scale": problem.softmax_scale,
        "window_left": kernel_window_side(problem.window_left, problem.max_seqlen_k),
        "window_right": kernel_window_side(problem.window_right, problem.max_seqlen_q),
    }


def score_mod_fields(softcap: float, alibi_slopes: DeviceArray | None) -> dict:
    """catalog.fields.SCORE_MOD_FIELDS: softcap (0.0: none) and the ALiBi slopes (null: none)."""
    return {
        "softcap": softcap,
        "alibi_slopes": alibi_slopes.ptr if alibi_slopes is not None else 0,
        "alibi_batch_stride": alibi_batch_stride(alibi_slopes) if alibi_slopes is not None else 0,
    }


def kernel_window_side(side: int, max_seqlen: int) -> int:
    """One side of a window as kernels/common/key_window.h takes it: no bound (-1) becomes
    ``max_seqlen``, and a wider bound is cut to it (the same keys: a row's window can reach no
    further than its sequence). The left side takes max_seqlen_k, the right max_seqlen_q."""
    return max_seqlen if side < 0 or side > max_seqlen else side


# A tensor's four field names (catalog.fields.strided), spelled once rather than formatted per launch.
_TENSOR_FIELD_NAMES = {
    name: (name, f"{name}_batch_stride", f"{name}_token_stride", f"{name}_head_stride")
    for name in ("q", "k", "v", "o", "dout", "dq", "dk", "dv", "dq_accum", "k_new", "v_new", "q_rotated")
}


def put_tensor(fields: dict, name: str, a: DeviceArray, layout: str) -> None:
    """Add ``a``'s pointer and (batch, token, head) strides to ``fields``; THD data is one batch of
    total tokens, with batch stride 0."""
    strides = a.strides
    if layout == THD:
        put_strided(fields, name, a, (0, strides[0], strides[1]))
    else:
        put_strided(fields, name, a, (strides[0], strides[1], strides[2]))


def put_strided(fields: dict, name: str, a: DeviceArray, strides: tuple[int, int, int]) -> None:
    """Add ``a``'s pointer and the given (batch, token, head) element strides to ``fields``."""
    ptr_name, batch_name, token_name, head_name = _TENSOR_FIELD_NAMES[name]
    fields[ptr_name] = a.ptr
    fields[batch_name], fields[token_name], fields[head_name] = strides


def put_absent_tensor(fields: dict, name: str) -> None:
    """A tensor field the kernel does not read on this launch: null pointer, zero strides."""
    for field_name in _TENSOR_FIELD_NAMES[name]:
        fields[field_name] = 0


def put_row_statistic(fields: dict, name: str, a: DeviceArray, problem: Problem) -> None:
    """Add an fp32 array laid out as the LSE (catalog.fields.row_statistic: "lse", or the backward's
    "softmax_d" = rowsum(dO * O)): its pointer and (batch, head) strides."""
    fields[name] = a.ptr
    fields[f"{name}_batch_stride"], fields[f"{name}_head_stride"] = lse_strides(a, problem)


def forward_fields(problem: Problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                   alibi_slopes, learnable_sink) -> dict:
    """The fields every forward struct has: the shared fields (sequence_fields), q, k, v, o, lse and
    the learnable sinks (catalog.fields.SINK_FIELDS; null: none)."""
    fields = sequence_fields(problem, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes)
    fields["learnable_sink"] = learnable_sink.ptr if learnable_sink is not None else 0
    layout = problem.layout
    put_tensor(fields, "q", q, layout)
    put_tensor(fields, "k", k, layout)
    put_tensor(fields, "v", v, layout)
    put_tensor(fields, "o", out, layout)
    put_row_statistic(fields, "lse", lse, problem)
    return fields
