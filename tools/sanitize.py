"""Every kernel family hipattn ships, on small inputs, for compute-sanitizer.

    python -m tools.sanitize                                        # warm the cache; guard checks
    compute-sanitizer --tool memcheck python -m tools.sanitize      # and racecheck, initcheck, synccheck
    tools/sanitize.sh                                               # all four tools, one summary line each

Each case runs one call with tiny batches: the small-seq forward and backward (tensor-core and
portable kernels, MHA and GQA/MQA, THD and BSHD), the flash forward, the flash backward (THD with
its work list, both dQ schedules, the work list prepared by the varlen_records kernel and by the
host path), bwd_dot_do_o and bwd_convert_dq, and the KV-cache kernels (tools/sanitize_decode.py:
append, attention and combine, with adversarial lengths, block tables and batch indices). Besides valid inputs, the sequence descriptions are adversarial: non-monotonic,
decreasing, the last entry beyond the tensor, lengths above max_seqlen, negative entries, int32
extremes, seqused out of range. Such input gives meaningless numbers, but the kernels must clamp
it (kernels/common/sequence.h) and touch no memory outside their tensors.

Without the sanitizer the script checks what it can itself: outputs sit between guard regions
that must come back unchanged, output rows outside every clamped sequence must keep their fill,
and no output may hold a NaN (inputs sit between NaN guards, so reading past an input shows up).
Under memcheck/initcheck run with ``--no-guards`` and ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every
tensor is then its own allocation, so the sanitizer sees any access one byte past it. Every output
is filled before use, so initcheck sees only the kernels' own reads of unwritten memory.

Exit status: 0 when every case ran and passed its checks, 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from hipattn.catalog import flash_backward as flash_backward_catalog
from hipattn.catalog import flash_forward as flash_forward_catalog
from hipattn.catalog.smallseq import SMALLSEQ_BACKWARD_MMA_TILES, SMALLSEQ_TILE, SmallSeqMmaTiles
from hipattn.jit.target import Target
from tools import sanitize_decode

# The machine compute-sanitizer runs on: an H200.
SANITIZER_TARGET = Target.parse("sm_90a")

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
BATCH = 4
TOTAL_Q = 40  # tokens of the THD q tensor in every small-seq case
TOTAL_K = 36
KERNEL_SWITCH = "HIPATTN_SMALLSEQ_KERNEL"  # hipattn.ops.smallseq.KERNEL_SWITCH, without importing torch paths
PREP_SWITCH = "HIPATTN_VARLEN_PREP"  # hipattn.varlen_prep.PREP_SWITCH


# ---- the sequence descriptions (pure Python: tests/test_sanitize_cases.py checks them on the CPU) ----


def cumulative(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def adversarial_cu_seqlens(total: int) -> dict[str, list[int]]:
    """BATCH + 1 entries each, all malformed for a tensor of ``total`` tokens (total >= 32)."""
    return {
        "non-monotonic": [0, 10, 5, 30, total - 3],
        "decreasing": [total, 30, 20, 10, 0],
        "last-beyond-tensor": [0, 10, 20, 30, total + 1000],
        "all-beyond-tensor": [total + 1, total + 5, total + 100, 2**20, 2**30],
        "longer-than-max-seqlen": [0, 30, 31, 31, total],
        "negative": [-5, -100, 3, -7, total],
        "first-not-zero": [7, 12, 20, 25, total],
        "int32-extremes": [INT32_MIN, INT32_MAX, INT32_MIN, 0, INT32_MAX],
    }


ADVERSARIAL_SEQUSED: dict[str, list[int]] = {
    "seqused-negative": [-1, -17, INT32_MIN, 0],
    "seqused-beyond": [1000, INT32_MAX, SMALLSEQ_TILE + 1, SMALLSEQ_TILE],
}


def _wrap_int32(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def _clamp(x: int, lo: int, hi: int) -> int:
    return lo if x < lo else (hi if x > hi else x)


def clamped_sequences(cu_seqlens: list[int] | None, seqused: list[int] | None, batch: int, max_seqlen: int,
                      total: int, tile: int, *, wrap: bool = True) -> list[tuple[int, int]]:
    """(start, length) of each sequence as kernels/common/sequence.h clamps them.

    ``wrap``: the int32 subtraction cu[b + 1] - cu[b] wraps around (what the GPU does); without
    it, the exact difference. Signed overflow is undefined in C++, so callers take both.
    """
    result = []
    for b in range(batch):
        start, length = 0, max_seqlen
        if cu_seqlens is not None:
            start = cu_seqlens[b]
            length = cu_seqlens[b + 1] - start
            if wrap:
                length = _wrap_int32(length)
        if seqused is not None:
            length = seqused[b]
        start = _clamp(start, 0, total)
        limit = min(max_seqlen, tile)
        length = _clamp(length, 0, min(limit, total - start))
        result.append((start, length))
    return result


def rows_a_kernel_may_write(cu_seqlens: list[int] | None, seqused: list[int] | None, batch: int, max_seqlen: int,
                            total: int, tile: int) -> list[set[int]]:
    """Per batch entry, the token rows a kernel may write: outside them outputs must keep their fill.

    THD (cu_seqlens given): every sequence indexes the one token axis, so all entries are the same
    union. BSHD: entry b holds the rows of sequence b in its own batch slot.
    """
    rows: list[set[int]] = [set() for _ in range(batch)]
    for wrap in (True, False):
        for b, (start, length) in enumerate(clamped_sequences(cu_seqlens, seqused, batch, max_seqlen, total, tile,
                                                               wrap=wrap)):
            rows[b].update(range(start, start + length))
    if cu_seqlens is not None:
        union = set().union(*rows) if rows else set()
        rows = [union for _ in range(batch)]
    return rows


# ---- the cases -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # smallseq | flash_forward | flash_backward | dot_do_o | convert_dq
    dtype: str = "bf16"
    head_dim: int = 64
    heads_q: int = 8
    heads_kv: int = 8
    # small-seq: "tensor-core" or "portable" (HIPATTN_SMALLSEQ_KERNEL=portable); flash forward and the
    # backward's dK/dV kernel: the device's own (on the H200, sm_90a: wgmma at the head_dims of its tables)
    # or "mma.sync" (its tile row), or "fa2-class wgmma" (the wgmma row whose threads copy, where sm_90a
    # runs the warp-specialised kernel)
    kernel: str = "tensor-core"
    layout: str = "thd"
    cu_seqlens_q: list[int] | None = None
    cu_seqlens_k: list[int] | None = None
    seqused_q: list[int] | None = None
    seqused_k: list[int] | None = None
    max_seqlen_q: int = SMALLSEQ_TILE
    max_seqlen_k: int = SMALLSEQ_TILE
    causal: bool = False
    window: tuple[int, int] = (-1, -1)  # flash-attn's window_size
    dropout_p: float = 0.0  # flash kernels: flash-attn's dropout, under a fixed seed
    total_q: int = TOTAL_Q
    total_k: int = TOTAL_K
    allocate_outputs: bool = False  # let hipattn allocate out/lse/dq/dk/dv (valid, fully covered inputs only)
    adversarial: bool = False
    deterministic: bool = False  # flash_backward: the dQ kernel (True) or atomics + bwd_convert_dq
    varlen_prep: str = "device"  # flash_backward: HIPATTN_VARLEN_PREP, how the work list is prepared
    # tensor-core small-seq: every team of warps walks a run of this many problems (None: ops.smallseq's rule,
    # which gives these tiny calls runs of one), so that tiles reused from problem to problem are checked
    problems_per_team: int | None = None
    families: tuple[str, ...] = field(default=())


# A flash forward case's kernel that is the device's own on a grid of PERSISTENT_BLOCKS blocks, each walking
# many of the call's work items (the warp-specialised kernel's, on sm_90a).
PERSISTENT_KERNEL = "persistent"
PERSISTENT_BLOCKS = 2

# The forward rows a case's kernel names instead of the device's own (FORWARD_TILES_OF_KERNEL[kernel][head_dim]).
FORWARD_TILES_OF_KERNEL = {"mma.sync": flash_forward_catalog.FLASH_FORWARD_MMA_TILES,
                           "fa2-class wgmma": flash_forward_catalog.FLASH_FORWARD_WGMMA_TILES}


def flash_forward_family(head_dim: int, kernel: str, score_mods: bool = False) -> str:
    """The flash forward a case launches on the sanitizer's machine (SANITIZER_TARGET): its arrays are
    contiguous, so on Hopper they have tensor maps."""
    if kernel in FORWARD_TILES_OF_KERNEL:
        return FORWARD_TILES_OF_KERNEL[kernel][head_dim].family.name
    return flash_forward_catalog.tiles_for(head_dim, SANITIZER_TARGET, score_mods=score_mods).family.name


def adds_dq_atomically(case: Case) -> bool:
    """Whether a flash_backward case adds dQ atomically (then bwd_convert_dq) or runs the dQ kernel, as
    hipattn.ops.flash_backward decides on the sanitizer's machine (a tiles override, the cases that name a
    kernel, keeps the schedule `deterministic` names)."""
    if case.deterministic:
        return False
    return (backward_tiles_of_kernel(case.head_dim, case.kernel) is not None
            or not flash_backward_catalog.dq_kernel_always(case.head_dim, SANITIZER_TARGET))


def backward_tiles_of_kernel(head_dim: int, kernel: str, score_mods: bool = False) -> tuple | None:
    """The (dK/dV, dQ) rows a backward case's kernel names instead of the device's own (None)."""
    mma_dkdv, mma_dq = flash_backward_catalog.mma_tiles_for(head_dim, SANITIZER_TARGET)
    if kernel == "mma.sync":
        return mma_dkdv, mma_dq
    if kernel == "fa2-class wgmma":
        return flash_backward_catalog.dkdv_wgmma_tiles(score_mods)[head_dim], mma_dq
    return None


def flash_dkdv_family(head_dim: int, kernel: str, score_mods: bool = False) -> str:
    """The backward's dK/dV kernel a case launches on the sanitizer's machine (contiguous arrays: on
    Hopper they have tensor maps), for its plain or modified instantiation (``score_mods``)."""
    named = backward_tiles_of_kernel(head_dim, kernel, score_mods)
    if named is not None:
        return named[0].family.name
    return flash_backward_catalog.tiles_for(head_dim, SANITIZER_TARGET, score_mods=score_mods)[0].family.name


def families_of(case: Case) -> tuple[str, ...]:
    """The kernel families a case launches, by the dispatch rules of hipattn.ops.smallseq and .flash."""
    if case.kind == "smallseq":
        if case.kernel != "tensor-core":
            return ("smallseq_forward", "smallseq_backward")
        if case.heads_q != case.heads_kv:  # GQA/MQA: one team per (sequence, KV head) group
            return ("smallseq_forward_gqa_mma", "smallseq_backward_gqa_mma")
        mma_backward = case.head_dim in SMALLSEQ_BACKWARD_MMA_TILES
        return ("smallseq_forward_mma", "smallseq_backward_mma" if mma_backward else "smallseq_backward")
    if case.kind == "flash_backward":  # the forward gives O and LSE, then the backward's kernels in order
        # (the forward is the device's own whatever the case's kernel)
        return (flash_forward_family(case.head_dim, "device", score_mods=case.dropout_p > 0),
                *(("varlen_records",) if case.varlen_prep == "device" else ()), "bwd_dot_do_o",
                flash_dkdv_family(case.head_dim, case.kernel, score_mods=case.dropout_p > 0),
                "bwd_convert_dq" if adds_dq_atomically(case) else "flash_backward_dq_mma")
    if case.kind == "flash_forward":
        return (flash_forward_family(case.head_dim, case.kernel, score_mods=case.dropout_p > 0),)
    return {"dot_do_o": ("bwd_dot_do_o",), "convert_dq": ("bwd_convert_dq",)}[case.kind]


def _with_families(case: Case) -> Case:
    return Case(**{**case.__dict__, "families": families_of(case)})


def _flash_configurations(kind: str, lengths_q: list[int], lengths_k: list[int], quick: bool):
    """(cu_seqlens_q, cu_seqlens_k, Case fields) of each configuration a flash kernel runs at (the
    second alone when ``quick``): THD sequences of these lengths in arrays with rows past the last
    sequence, bounded by the longest."""
    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    # head_dim 96: the wgmma forward's rows of a column block and a half; 256: the mma.sync dK/dV
    # kernel's 64 x 64 Hopper row, and the dQ kernel in every call.
    configs = (("bf16", 64, 4, 4), ("fp16", 128, 4, 2), ("bf16", 96, 6, 2), ("bf16", 256, 4, 2))
    for dtype, head_dim, hq, hkv in configs[1:2] if quick else configs:
        yield cu_q, cu_k, dict(kind=kind, dtype=dtype, head_dim=head_dim, heads_q=hq, heads_kv=hkv,
                               total_q=cu_q[-1] + 7, total_k=cu_k[-1] + 3, max_seqlen_q=max(lengths_q),
                               max_seqlen_k=max(lengths_k))


def build_cases(quick: bool = False) -> list[Case]:
    """Every case the script runs. ``quick`` (for the sanitizer, which slows each launch 10-100x)
    keeps two configurations per small-seq kernel, malformed descriptions on both sides at once,
    and fewer flash and pre-processing configurations; it still reaches every family."""
    cases: list[Case] = []
    valid_q = cumulative([0, 1, SMALLSEQ_TILE, 13])  # 31 of 40 tokens: rows 31.. are never written
    valid_k = cumulative([3, 0, SMALLSEQ_TILE, 16])  # all 36
    full_q = cumulative([10, 10, 10, 10])
    full_k = cumulative([9, 9, 9, 9])
    configs = [("bf16", 64, 8, 8), ("bf16", 128, 8, 8), ("bf16", 256, 8, 8), ("fp16", 128, 8, 8),
               ("bf16", 64, 8, 2), ("fp16", 128, 8, 1), ("bf16", 256, 8, 4)]
    if quick:
        configs = [("bf16", 128, 8, 8), ("bf16", 64, 8, 2), ("bf16", 256, 8, 8)]
    for kernel in ("tensor-core", "portable"):
        for dtype, head_dim, hq, hkv in configs:
            base = dict(kind="smallseq", dtype=dtype, head_dim=head_dim, heads_q=hq, heads_kv=hkv, kernel=kernel)
            tag = f"{kernel} {dtype} d{head_dim} h{hq}/{hkv}"
            for causal in (False, True):
                cases.append(Case(name=f"{tag} valid causal={causal}", cu_seqlens_q=valid_q, cu_seqlens_k=valid_k,
                                  causal=causal, **base))
            cases.append(Case(name=f"{tag} valid window (3, 2)", cu_seqlens_q=valid_q, cu_seqlens_k=valid_k,
                              window=(3, 2), **base))
            cases.append(Case(name=f"{tag} valid allocated", cu_seqlens_q=full_q, cu_seqlens_k=full_k,
                              allocate_outputs=True, **base))
            if kernel == "tensor-core":
                cases.append(Case(name=f"{tag} valid causal=True runs of 3", cu_seqlens_q=valid_q,
                                  cu_seqlens_k=valid_k, causal=True, problems_per_team=3, **base))
        # The adversarial sweep on one MHA and one GQA configuration per kernel.
        for dtype, head_dim, hq, hkv in (("bf16", 128, 8, 8), ("bf16", 64, 8, 2)):
            base = dict(kind="smallseq", dtype=dtype, head_dim=head_dim, heads_q=hq, heads_kv=hkv, kernel=kernel,
                        adversarial=True)
            tag = f"{kernel} {dtype} d{head_dim} h{hq}/{hkv}"
            bad_q, bad_k = adversarial_cu_seqlens(TOTAL_Q), adversarial_cu_seqlens(TOTAL_K)
            for name in bad_q:
                for side in ("both",) if quick else ("q", "k", "both"):
                    cu_q = bad_q[name] if side in ("q", "both") else valid_q
                    cu_k = bad_k[name] if side in ("k", "both") else valid_k
                    cases.append(Case(name=f"{tag} {name} on {side}", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      causal=side == "both", window=(2, -1) if side == "k" else (-1, -1), **base))
            cases.append(Case(name=f"{tag} max_seqlen below the real lengths", cu_seqlens_q=valid_q,
                              cu_seqlens_k=valid_k, max_seqlen_q=5, max_seqlen_k=3, causal=True, **base))
            cases.append(Case(name=f"{tag} max_seqlen 0", cu_seqlens_q=valid_q, cu_seqlens_k=valid_k,
                              max_seqlen_q=0, max_seqlen_k=0, **base))
            for name, used in ADVERSARIAL_SEQUSED.items():
                cases.append(Case(name=f"{tag} bshd {name}", layout="bshd", seqused_q=used, seqused_k=used[::-1],
                                  total_q=SMALLSEQ_TILE, total_k=SMALLSEQ_TILE - 4, causal=True, **base))
                if not quick:
                    cases.append(Case(name=f"{tag} thd {name} with valid cu_seqlens", cu_seqlens_q=valid_q,
                                      cu_seqlens_k=valid_k, seqused_q=used, seqused_k=used, **base))
    # The flash forward, called directly (dispatch would send short sequences elsewhere): valid, then adversarial.
    for flash_q, flash_k, base in _flash_configurations("flash_forward", [0, 1, 70, 33], [5, 64, 0, 40], quick):
        dtype, head_dim, hq, hkv = base["dtype"], base["head_dim"], base["heads_q"], base["heads_kv"]
        walks = head_dim in flash_forward_catalog.FLASH_FORWARD_WARP_SPECIALISED_TILES
        for causal in (False, True):
            # The FA2-class wgmma forward, which H100/H200 run for arrays without tensor maps, at every head_dim;
            # and the warp-specialised one on a persistent grid of two blocks that walk every item.
            for kernel in ("device", "mma.sync", "fa2-class wgmma") + (PERSISTENT_KERNEL,) * walks:
                cases.append(Case(name=f"flash {dtype} d{head_dim} h{hq}/{hkv} valid causal={causal} kernel={kernel}",
                                  cu_seqlens_q=flash_q, cu_seqlens_k=flash_k, causal=causal, kernel=kernel, **base))
                cases.append(Case(name=f"flash {dtype} d{head_dim} h{hq}/{hkv} valid window (20, 7) causal={causal} "
                                       f"kernel={kernel}", cu_seqlens_q=flash_q, cu_seqlens_k=flash_k, causal=causal,
                                  window=(20, 7), kernel=kernel, **base))
            cases.append(Case(name=f"flash {dtype} d{head_dim} h{hq}/{hkv} valid dropout 0.17 causal={causal}",
                              cu_seqlens_q=flash_q, cu_seqlens_k=flash_k, causal=causal, dropout_p=0.17, **base))
        # A batch of equal sequences under a causal mask or a window: the persistent blocks take each
        # head's query tiles in pairs from both ends (three tiles of 128 rows, Q shorter than KV).
        for causal, window in ((True, (-1, -1)), (False, (20, 7))) if walks else ():
            cases.append(Case(name=f"flash {dtype} d{head_dim} h{hq}/{hkv} bshd pairs window {window} causal={causal} "
                                   f"kernel={PERSISTENT_KERNEL}", layout="bshd", causal=causal, window=window,
                              kernel=PERSISTENT_KERNEL, **{**base, "max_seqlen_q": 333, "max_seqlen_k": 400}))
        bad_q, bad_k = adversarial_cu_seqlens(base["total_q"]), adversarial_cu_seqlens(base["total_k"])
        for i, name in enumerate(bad_q):
            cases.append(Case(name=f"flash {dtype} d{head_dim} h{hq}/{hkv} {name}" + " dropout 0.17" * (i % 2),
                              cu_seqlens_q=bad_q[name], cu_seqlens_k=bad_k[name], adversarial=True,
                              dropout_p=0.17 * (i % 2), **base))
    # The flash backward, called directly, THD with its work list: key lengths across the dK/dV
    # tiles (128 keys, or 64 at head_dim 128 off Hopper: catalog.flash_backward.tiles_for), both dQ schedules, the
    # work list from the kernel and from the host path, the device's dK/dV kernel and the mma.sync one;
    # then adversarial descriptions.
    for backward_q, backward_k, base in _flash_configurations("flash_backward", [0, 1, 90, 33], [5, 150, 0, 70], quick):
        tag = f"flash backward {base['dtype']} d{base['head_dim']} h{base['heads_q']}/{base['heads_kv']}"
        for deterministic in (False, True):
            for prep in ("device", "host"):
                for causal in (deterministic,) if quick else (False, True):
                    for kernel in ("device", "mma.sync", "fa2-class wgmma") if prep == "device" or not quick \
                            else ("device",):
                        cases.append(Case(name=f"{tag} valid causal={causal} det={deterministic} prep={prep} "
                                               f"kernel={kernel}", cu_seqlens_q=backward_q, cu_seqlens_k=backward_k,
                                          causal=causal, deterministic=deterministic, varlen_prep=prep,
                                          kernel=kernel, **base))
                if prep == "device":
                    cases.append(Case(name=f"{tag} valid window (40, 9) det={deterministic}", cu_seqlens_q=backward_q,
                                      cu_seqlens_k=backward_k, window=(40, 9), deterministic=deterministic, **base))
                    cases.append(Case(name=f"{tag} valid dropout 0.17 det={deterministic}", cu_seqlens_q=backward_q,
                                      cu_seqlens_k=backward_k, causal=deterministic, dropout_p=0.17,
                                      deterministic=deterministic, **base))
        bad_q, bad_k = adversarial_cu_seqlens(base["total_q"]), adversarial_cu_seqlens(base["total_k"])
        for i, name in enumerate(bad_q):
            deterministic, prep = bool(i % 2), ("device", "host")[i // 2 % 2]
            cases.append(Case(name=f"{tag} {name} det={deterministic} prep={prep}" + " dropout 0.17" * (i % 3 == 2),
                              cu_seqlens_q=bad_q[name], cu_seqlens_k=bad_k[name], causal=bool(i % 3 == 0),
                              deterministic=deterministic, varlen_prep=prep, adversarial=True,
                              window=(5, 3) if i % 3 == 1 else (-1, -1), dropout_p=0.17 * (i % 3 == 2), **base))
        for i, (name, used) in enumerate(ADVERSARIAL_SEQUSED.items()):
            cases.append(Case(name=f"{tag} {name} with valid cu_seqlens prep={('device', 'host')[i % 2]}",
                              cu_seqlens_q=backward_q, cu_seqlens_k=backward_k, seqused_q=used, seqused_k=used[::-1],
                              deterministic=bool(i % 2), varlen_prep=("device", "host")[i % 2], adversarial=True,
                              **base))
    preprocess_configs = (("bf16", 64), ("fp16", 256), ("fp16", 128), ("bf16", 96))
    for dtype, head_dim in preprocess_configs[:2] if quick else preprocess_configs:
        for layout in ("thd", "bshd"):
            cases.append(Case(name=f"dot_do_o {dtype} d{head_dim} {layout}", kind="dot_do_o", dtype=dtype,
                              head_dim=head_dim, heads_q=3, layout=layout, total_q=37))
            cases.append(Case(name=f"convert_dq {dtype} d{head_dim} {layout}", kind="convert_dq", dtype=dtype,
                              head_dim=head_dim, heads_q=3, layout=layout, total_q=37))
    return [_with_families(case) for case in cases] + sanitize_decode.build_cases(quick)


# ---- running a case on the GPU ------------------------------------------------------------------------

GUARD_ELEMENTS = 1024  # per side; a multiple of every alignment hipattn asks of its arrays


class Runner:
    """Allocates guarded tensors, runs cases and checks what can be checked without the sanitizer."""

    def __init__(self, guards: bool):
        import torch

        self.torch = torch
        self.guards = guards
        self.problems: list[str] = []
        self._outputs: list[tuple[str, object, object, object]] = []  # (name, buffer, snapshot, view)

    # -- tensors --
    def _dtype(self, name: str):
        return {"bf16": self.torch.bfloat16, "fp16": self.torch.float16, "fp32": self.torch.float32,
                "int32": self.torch.int32}[name]

    def input(self, shape, dtype: str):
        """Random values; between NaN guards when guards are on (a read past the tensor gives NaN)."""
        torch = self.torch
        n = math.prod(shape)
        if not self.guards:
            return torch.randn(shape, device="cuda").to(self._dtype(dtype))
        buffer = torch.full((n + 2 * GUARD_ELEMENTS,), float("nan"), device="cuda", dtype=self._dtype(dtype))
        view = buffer[GUARD_ELEMENTS:GUARD_ELEMENTS + n].view(shape)
        view.copy_(torch.randn(shape, device="cuda"))
        return view

    def output(self, name: str, shape, dtype: str, fill: float = -7777.0):
        """Filled with a finite sentinel (initcheck sees every byte written before use), guarded."""
        torch = self.torch
        n = math.prod(shape)
        pad = GUARD_ELEMENTS if self.guards else 0
        buffer = torch.full((n + 2 * pad,), fill, device="cuda", dtype=self._dtype(dtype))
        view = buffer[pad:pad + n].view(shape)
        self._outputs.append((name, buffer, buffer.clone(), view))
        return view

    def int32(self, values: list[int] | None):
        if values is None:
            return None
        return self.torch.tensor(values, dtype=self.torch.int32, device="cuda")

    # -- checks --
    def fail(self, message: str) -> None:
        self.problems.append(message)

    def check_outputs(self, untouched: dict[str, Callable]) -> None:
        """Guards unchanged; rows outside the clamped sequences unchanged; no NaN anywhere.

        ``untouched[name](view) -> bool mask`` of the elements that must keep their fill.
        """
        torch = self.torch
        torch.cuda.synchronize()
        for name, buffer, snapshot, view in self._outputs:
            if self.guards:
                n = view.numel()
                for side, lo, hi in (("before", 0, GUARD_ELEMENTS), ("after", GUARD_ELEMENTS + n, buffer.numel())):
                    if not torch.equal(buffer[lo:hi], snapshot[lo:hi]):
                        self.fail(f"{name}: the guard {side} the output was written")
            if torch.isnan(view).any():
                self.fail(f"{name}: NaN in the output (a read outside an input, or an unguarded overflow)")
            mask_fn = untouched.get(name)
            if mask_fn is not None:
                mask = mask_fn(view)
                before = snapshot[GUARD_ELEMENTS if self.guards else 0:][: view.numel()].view(view.shape)
                changed = (view != before) & mask
                if changed.any():
                    self.fail(f"{name}: {int(changed.sum())} elements outside every clamped sequence were written")
        self._outputs.clear()


def _row_mask(torch, shape, rows_per_batch: list[set[int]], token_axis: int, batch_axis: int | None):
    """True where the token is in no written row (elements that must keep their fill)."""
    mask = torch.ones(shape, dtype=torch.bool)
    for b, rows in enumerate(rows_per_batch):
        index = [slice(None)] * len(shape)
        if batch_axis is not None:
            index[batch_axis] = b
        for r in rows:
            index[token_axis] = r
            mask[tuple(index)] = False
        if batch_axis is None:
            break  # THD: one token axis shared by every sequence
    return mask.cuda()


def run_smallseq(runner: Runner, case: Case) -> None:
    import hipattn

    torch = runner.torch
    thd = case.layout == "thd"
    if thd:
        q_shape = (case.total_q, case.heads_q, case.head_dim)
        k_shape = (case.total_k, case.heads_kv, case.head_dim)
        lse_shape = (case.heads_q, case.total_q)
    else:
        q_shape = (BATCH, case.total_q, case.heads_q, case.head_dim)
        k_shape = (BATCH, case.total_k, case.heads_kv, case.head_dim)
        lse_shape = (BATCH, case.heads_q, case.total_q)
    q, k, v, dout = (runner.input(s, case.dtype) for s in (q_shape, k_shape, k_shape, q_shape))
    args = dict(cu_seqlens_q=runner.int32(case.cu_seqlens_q), cu_seqlens_k=runner.int32(case.cu_seqlens_k),
                seqused_q=runner.int32(case.seqused_q), seqused_k=runner.int32(case.seqused_k), causal=case.causal,
                window_size=case.window)
    if thd or case.max_seqlen_q != SMALLSEQ_TILE:
        args.update(max_seqlen_q=case.max_seqlen_q, max_seqlen_k=case.max_seqlen_k)
    max_q = case.max_seqlen_q if thd else min(case.max_seqlen_q, case.total_q)
    max_k = case.max_seqlen_k if thd else min(case.max_seqlen_k, case.total_k)
    rows_q = rows_a_kernel_may_write(case.cu_seqlens_q, case.seqused_q, BATCH, max_q, case.total_q, SMALLSEQ_TILE)
    rows_k = rows_a_kernel_may_write(case.cu_seqlens_k, case.seqused_k, BATCH, max_k, case.total_k, SMALLSEQ_TILE)
    token_axis, batch_axis = (0, None) if thd else (1, 0)
    lse_token_axis = 1 if thd else 2

    previous = os.environ.get(KERNEL_SWITCH)
    if case.kernel == "portable":
        os.environ[KERNEL_SWITCH] = "portable"
    else:
        os.environ.pop(KERNEL_SWITCH, None)
    rule = SmallSeqMmaTiles.run_length
    if case.problems_per_team is not None:
        SmallSeqMmaTiles.run_length = lambda tiles, problems: case.problems_per_team
    try:
        if case.allocate_outputs:
            out, lse = hipattn.forward(q, k, v, **args)
            dq, dk, dv = hipattn.backward(dout, q, k, v, out, lse, **args)
            torch.cuda.synchronize()
            for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
                if torch.isnan(t).any():
                    runner.fail(f"{name}: NaN in a fully covered, hipattn-allocated output")
            return
        out = runner.output("out", q_shape, case.dtype)
        lse = runner.output("lse", lse_shape, "fp32")
        hipattn.forward(q, k, v, out=out, lse=lse, **args)
        dq = runner.output("dq", q_shape, case.dtype)
        dk = runner.output("dk", k_shape, case.dtype)
        dv = runner.output("dv", k_shape, case.dtype)
        hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **args)
    finally:
        SmallSeqMmaTiles.run_length = rule
        if previous is None:
            os.environ.pop(KERNEL_SWITCH, None)
        else:
            os.environ[KERNEL_SWITCH] = previous
    runner.check_outputs({
        "out": lambda t: _row_mask(torch, t.shape, rows_q, token_axis, batch_axis),
        "lse": lambda t: _row_mask(torch, t.shape, rows_q, lse_token_axis, batch_axis),
        "dq": lambda t: _row_mask(torch, t.shape, rows_q, token_axis, batch_axis),
        "dk": lambda t: _row_mask(torch, t.shape, rows_k, token_axis, batch_axis),
        "dv": lambda t: _row_mask(torch, t.shape, rows_k, token_axis, batch_axis),
    })


def _dropout_seed(runner: Runner, case: Case):
    """A case with dropout: its seed array (a fixed seed with both halves set), as a DeviceArray."""
    if not case.dropout_p:
        return None
    from hipattn import arrays

    seed = runner.torch.tensor([-0x3C6E_F372_FE94_F82B], dtype=runner.torch.int64, device="cuda")
    return arrays.as_device_array(seed, "dropout_seed")  # which keeps the tensor alive


def run_flash_forward(runner: Runner, case: Case) -> None:
    """The flash forward, THD with the case's cu_seqlens, or a BSHD batch of BATCH equal sequences of the
    case's max_seqlen (every row written)."""
    from hipattn import arrays, runtime
    from hipattn import problem as problem_mod
    from hipattn.ops import flash
    from hipattn.streams import on_device, resolve_stream

    torch = runner.torch
    bshd = case.layout == "bshd"
    tokens_q, tokens_k = ((BATCH, case.max_seqlen_q), (BATCH, case.max_seqlen_k)) if bshd else (
        (case.total_q,), (case.total_k,))
    q = runner.input((*tokens_q, case.heads_q, case.head_dim), case.dtype)
    k = runner.input((*tokens_k, case.heads_kv, case.head_dim), case.dtype)
    v = runner.input((*tokens_k, case.heads_kv, case.head_dim), case.dtype)
    out = runner.output("out", tuple(q.shape), case.dtype)
    lse = runner.output("lse", (BATCH, case.heads_q, case.max_seqlen_q) if bshd else (case.heads_q, case.total_q),
                        "fp32")
    qa, ka, va = (arrays.as_device_array(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    sequences = {} if bshd else {
        name: arrays.as_device_array(runner.int32(values), name)
        for name, values in (("cu_seqlens_q", case.cu_seqlens_q), ("cu_seqlens_k", case.cu_seqlens_k))}
    bounds = {} if bshd else {"max_seqlen_q": case.max_seqlen_q, "max_seqlen_k": case.max_seqlen_k}
    seed = _dropout_seed(runner, case)
    problem = problem_mod.describe(qa, ka, va, **sequences, **bounds, causal=case.causal, window_size=case.window,
                                   dropout_p=case.dropout_p, dropout_seed=seed)
    with on_device(runtime.active().backend, problem.device):
        stream = resolve_stream((qa, ka, va), None, device=problem.device)
        flash.forward(problem, qa, ka, va, arrays.as_device_array(out, "out"), arrays.as_device_array(lse, "lse"),
                      stream, dropout_seed=seed, **sequences,
                      tiles=FORWARD_TILES_OF_KERNEL.get(case.kernel, {}).get(case.head_dim),
                      blocks=PERSISTENT_BLOCKS if case.kernel == PERSISTENT_KERNEL else None)
    if bshd:
        runner.check_outputs({})  # every row is written: the guards and the NaN check remain
        return
    # The flash kernels pass max_seqlen as their tile (no tile limit of their own).
    rows_q = rows_a_kernel_may_write(case.cu_seqlens_q, None, BATCH, case.max_seqlen_q, case.total_q, case.max_seqlen_q)
    runner.check_outputs({
        "out": lambda t: _row_mask(torch, t.shape, rows_q, 0, None),
        "lse": lambda t: _row_mask(torch, t.shape, rows_q, 1, None),
    })


def run_flash_backward(runner: Runner, case: Case) -> None:
    """The flash forward for O and LSE, then hipattn.ops.flash_backward.backward with every workspace
    section its own guarded buffer (an overrun of one shows in its guard)."""
    from hipattn import arrays, runtime
    from hipattn import problem as problem_mod
    from hipattn.ops import flash, flash_backward
    from hipattn.streams import on_device, resolve_stream
    from hipattn.workspace import backward_workspace

    torch = runner.torch
    q = runner.input((case.total_q, case.heads_q, case.head_dim), case.dtype)
    k = runner.input((case.total_k, case.heads_kv, case.head_dim), case.dtype)
    v = runner.input((case.total_k, case.heads_kv, case.head_dim), case.dtype)
    dout = runner.input((case.total_q, case.heads_q, case.head_dim), case.dtype)
    # O and LSE are inputs here: rows no sequence covers keep finite fills (dot_do_o reads every row).
    out = torch.zeros_like(q)
    lse = torch.zeros((case.heads_q, case.total_q), device="cuda")
    dq = runner.output("dq", tuple(q.shape), case.dtype)
    dk = runner.output("dk", tuple(k.shape), case.dtype)
    dv = runner.output("dv", tuple(k.shape), case.dtype)

    def array(t, name):
        return None if t is None else arrays.as_device_array(t, name)

    sequences = dict(cu_seqlens_q=array(runner.int32(case.cu_seqlens_q), "cu_seqlens_q"),
                     cu_seqlens_k=array(runner.int32(case.cu_seqlens_k), "cu_seqlens_k"),
                     seqused_q=array(runner.int32(case.seqused_q), "seqused_q"),
                     seqused_k=array(runner.int32(case.seqused_k), "seqused_k"))
    qa, ka, va = array(q, "q"), array(k, "k"), array(v, "v")
    seed = _dropout_seed(runner, case)
    problem = problem_mod.describe(qa, ka, va, max_seqlen_q=case.max_seqlen_q, max_seqlen_k=case.max_seqlen_k,
                                   causal=case.causal, window_size=case.window, dropout_p=case.dropout_p,
                                   dropout_seed=seed, **sequences)
    plan = backward_workspace(problem, adds_dq_atomically(case))
    workspace = {section.name: array(runner.output(section.name, section.shape, section.dtype, fill=0), section.name)
                 for section in plan.sections}
    previous = os.environ.get(PREP_SWITCH)
    os.environ[PREP_SWITCH] = case.varlen_prep
    try:
        with on_device(runtime.active().backend, problem.device):
            stream = resolve_stream((qa, ka, va), None, device=problem.device)
            out_a, lse_a = array(out, "out"), array(lse, "lse")
            flash.forward(problem, qa, ka, va, out_a, lse_a, stream, dropout_seed=seed, **sequences)
            tiles = backward_tiles_of_kernel(case.head_dim, case.kernel, score_mods=case.dropout_p > 0)
            flash_backward.backward(problem, qa, ka, va, out_a, array(dout, "dout"), lse_a, array(dq, "dq"),
                                    array(dk, "dk"), array(dv, "dv"), stream, deterministic=case.deterministic,
                                    tiles=tiles, dropout_seed=seed,
                                    **workspace, **sequences)
    finally:
        if previous is None:
            os.environ.pop(PREP_SWITCH, None)
        else:
            os.environ[PREP_SWITCH] = previous
    # The flash kernels pass max_seqlen as their tile. The atomic schedule's bwd_convert_dq writes
    # every row of dq; the dQ kernel only the sequences' rows.
    rows_q = rows_a_kernel_may_write(case.cu_seqlens_q, case.seqused_q, BATCH, case.max_seqlen_q, case.total_q,
                                     case.max_seqlen_q)
    rows_k = rows_a_kernel_may_write(case.cu_seqlens_k, case.seqused_k, BATCH, case.max_seqlen_k, case.total_k,
                                     case.max_seqlen_k)
    untouched = {"dk": lambda t: _row_mask(torch, t.shape, rows_k, 0, None),
                 "dv": lambda t: _row_mask(torch, t.shape, rows_k, 0, None)}
    if not adds_dq_atomically(case):
        untouched["dq"] = lambda t: _row_mask(torch, t.shape, rows_q, 0, None)
    runner.check_outputs(untouched)


def run_preprocess(runner: Runner, case: Case) -> None:
    from hipattn import arrays, runtime
    from hipattn.ops import preprocess
    from hipattn.streams import on_device

    torch = runner.torch
    if case.layout == "thd":
        shape = (case.total_q, case.heads_q, case.head_dim)
        d_shape = (case.heads_q, case.total_q)
    else:
        shape = (2, case.total_q, case.heads_q, case.head_dim)
        d_shape = (2, case.heads_q, case.total_q)
    stream = torch.cuda.current_stream().cuda_stream
    with on_device(runtime.active().backend, 0):
        if case.kind == "dot_do_o":
            o, do = runner.input(shape, case.dtype), runner.input(shape, case.dtype)
            d = runner.output("d", d_shape, "fp32")
            preprocess.dot_do_o(arrays.as_device_array(o, "o"), arrays.as_device_array(do, "dout"),
                                arrays.as_device_array(d, "d"), stream)
            expected = (o.double() * do.double()).sum(-1)
            expected = expected.T if case.layout == "thd" else expected.transpose(1, 2)
            result = d
        else:
            accum = runner.input(shape, "fp32")
            dq = runner.output("dq", shape, case.dtype)
            preprocess.convert_dq(arrays.as_device_array(accum, "dq_accum"), arrays.as_device_array(dq, "dq"), 0.125,
                                  stream)
            expected = (accum * 0.125).to(dq.dtype)
            result = dq
    torch.cuda.synchronize()
    if not torch.allclose(result.double(), expected.double(), rtol=1e-3, atol=1e-3):
        runner.fail(f"{case.kind}: result differs from torch's")
    runner.check_outputs({})


RUNNERS = {"smallseq": run_smallseq, "flash_forward": run_flash_forward, "flash_backward": run_flash_backward,
           "dot_do_o": run_preprocess,
           "convert_dq": run_preprocess, "kvcache": sanitize_decode.run}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one configuration per kernel (fewest launches)")
    parser.add_argument("--no-guards", dest="guards", action="store_false",
                        help="exact-size allocations (for memcheck/initcheck with PYTORCH_NO_CUDA_MEMORY_CACHING=1)")
    parser.add_argument("--only", default="", help="run the cases whose name contains this text")
    parser.add_argument("--match", default="", help="run the cases whose name matches this regular expression")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    args = parser.parse_args()
    cases = [c for c in build_cases(args.quick) if args.only in c.name and re.search(args.match, c.name)]
    if args.list:
        for case in cases:
            print(f"{case.name}  [{', '.join(case.families)}]")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("sanitize: no GPU", file=sys.stderr)
        return 1
    if not args.guards and os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1":
        print("sanitize: note: --no-guards without PYTORCH_NO_CUDA_MEMORY_CACHING=1: tensors share allocations, "
              "so the sanitizer cannot see an access just past one", file=sys.stderr)
    runner = Runner(args.guards)
    failed: list[str] = []
    families: set[str] = set()
    start = time.perf_counter()
    for case in cases:
        runner.problems.clear()
        t0 = time.perf_counter()
        try:
            RUNNERS[case.kind](runner, case)
        except Exception as error:  # one broken case must not hide the others' results
            runner.fail(f"raised {type(error).__name__}: {error}")
            traceback.print_exc()
        families.update(case.families)
        status = "ok" if not runner.problems else "FAIL " + "; ".join(runner.problems)
        if runner.problems:
            failed.append(case.name)
        print(f"{case.name:<70} {time.perf_counter() - t0:6.2f}s {status}", flush=True)
    print(f"sanitize: {len(cases)} cases, {len(failed)} failed, {time.perf_counter() - start:.1f} s, "
          f"families: {', '.join(sorted(families))}", flush=True)
    for name in failed:
        print(f"  failed: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
