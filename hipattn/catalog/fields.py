"""The parameter-struct fields the attention kernels share, spelled once for every family.

Launchers fill the same names (``hipattn.ops.fields``); the C++ structs are generated from these
lists (``jit.params``), so the two sides cannot drift apart.
"""

from __future__ import annotations

# Tensors the kernels write: their pointers are ``void*``, every other tensor's ``const void*``.
_OUTPUTS = {"o", "dq", "dk", "dv", "dq_accum"}

Fields = tuple[tuple[str, str], ...]


def strided(name: str, kind: str | None = None) -> Fields:
    """A [batch, token, head, dim] tensor: its pointer and three element strides (dim is contiguous).
    ``kind`` overrides the pointer's constness (a KV cache is read by one kernel, appended to by another)."""
    kind = kind or ("ptr" if name in _OUTPUTS else "const_ptr")
    return ((name, kind), (f"{name}_batch_stride", "i64"), (f"{name}_token_stride", "i64"), (f"{name}_head_stride", "i64"))


def row_statistic(name: str, kind: str) -> Fields:
    """An fp32 value per (batch, head, token) laid out as the LSE, [Hq, total] or [B, Hq, S]: its
    pointer (``kind``: the LSE is the forward's output and the backward's input) and (batch, head)
    element strides; the token stride is 1."""
    return ((name, kind), (f"{name}_batch_stride", "i64"), (f"{name}_head_stride", "i64"))


# The keys each query row sees (kernels/common/key_window.h): causal and sliding windows, encoded by
# ops.fields.kernel_window.
WINDOW_FIELDS: Fields = (("window_left", "i32"), ("window_right", "i32"))

# flash-attn's score modifiers (kernels/common/score_mods.h), filled by ops.fields.score_mod_fields:
# softcap (0: none) and the ALiBi slopes, fp32 [Hq] or [B, Hq] (alibi_batch_stride 0 for [Hq]; a null
# pointer: none). Every attention struct ends with them, so that the plain instantiations, which read
# none of them, see every other field where they saw it before.
SCORE_MOD_FIELDS: Fields = (("softcap", "f32"), ("alibi_slopes", "const_ptr"), ("alibi_batch_stride", "i64"))

# flash-attn's dropout (kernels/common/dropout.h), filled by hipattn.dropout.fields: the 16-bit keep
# threshold (0: no dropout), 1 / (1 - dropout_p), and a device pointer to the call's 64-bit seed. The
# flash and small-seq kernels' structs end with them, after the score modifiers; their modified
# instantiations read them (the decode kernels take no dropout).
DROPOUT_FIELDS: Fields = (("dropout_threshold", "i32"), ("dropout_scale", "f32"), ("dropout_seed", "const_ptr"))

# A learnable attention sink per query head (FlashAttention-4's learnable_sink, gpt-oss): fp32 [Hq], a
# logit that joins every row's softmax denominator and no value; null: none (kernels/common/sink.h).
# The flash and small-seq forwards and the decode attention read it in their modified instantiation,
# the decode combine always; the backwards need nothing, as the LSE they read includes the sink.
SINK_FIELDS: Fields = (("learnable_sink", "const_ptr"),)

# The template parameter that selects a kernel's scores (score_mods.h's Scores<SCORE_MODS>): False is
# plain attention, True reads the fields above (and, in the flash kernels, dropout's through
# dropout.h's Dropout<SCORE_MODS>). Every attention family takes it last.
SCORE_MODS_PARAM = "score_mods"
# Both instantiations of every attention kernel ship.
SCORE_MODS_VALUES = (False, True)

# The sequence description every attention kernel reads (kernels/common/sequence.h clamps it).
SEQUENCE_FIELDS: Fields = (
    ("cu_seqlens_q", "const_ptr"),
    ("cu_seqlens_k", "const_ptr"),
    ("seqused_q", "const_ptr"),
    ("seqused_k", "const_ptr"),
    ("batch", "i32"),
    ("heads_kv", "i32"),
    ("max_seqlen_q", "i32"),
    ("max_seqlen_k", "i32"),
    ("total_q", "i32"),
    ("total_k", "i32"),
    ("softmax_scale", "f32"),
    *WINDOW_FIELDS,
)
