"""flash-attn's score modifiers (softcap, ALiBi), learnable sinks and dropout in every small-seq kernel,
forward and backward, on the emulated devices (tests/support/emulation.py) against float64, through
hipattn's own launch path: the portable kernels (smallseq/forward.hip, backward.hip) at wave64 on the
gfx90a and at warp32 on the sm_80, the MFMA kernels (forward_mfma.hip, backward_mfma.hip) on the
gfx90a, and on the sm_80 the tensor-core kernels of one problem per (sequence, head) (forward_mma.hip,
backward_mma.hip) and of grouped heads (forward_gqa_mma.hip, backward_gqa_mma.hip).

Each kernel meets the four modifier cases: softcap alone (scores and the backward's 1 - tanh² factor),
ALiBi per head, ALiBi per (sequence, head) under a causal mask, and both under a causal mask; a
learnable sink per query head (a logit in every row's softmax sum: the forwards add it, the backwards
read it through the LSE), with and without a causal mask, where a row that sees no key gets LSE = the
sink; and dropout (dropout_p 0.17, a seed with both 32-bit halves set), with and without a causal mask,
whose keep mask (hipattn.dropout's, a function of sequence, query head, row and key) the float64
reference applies too. The grouped kernels walk stacked query rows of several heads (token-major in
the tensor-core kernels, head-major in the MFMA ones, and the portable backward walks a group's heads
in turn), so they run with groups of 3 and 4 whose heads all have different slopes and keep bits: a
row given another head's slope or bits fails. Sequences of 0 to 17 tokens, Q longer and shorter than
KV, empty Q and empty KV, as the files of the plain kernels (test_smallseq_mfma_emulation.py,
test_smallseq_gqa_emulation.py) have them, THD and BSHD with seqused. Outputs are poisoned with NaN
first and every element is compared; BSHD's padding past seqused must stay unwritten."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
from support.emulation import EmulatedDevice, EmulationBackend, needs_compiler
from support.raw_calls import check_bshd_forward_and_backward, check_forward_and_backward
from support.reference import DROPOUT_P, DROPOUT_SEED, SCORE_MODIFIER_CASES

from hipattn.catalog import smallseq as catalog
from hipattn.jit.cache import DiskCache
from hipattn.jit.registry import Registry
from hipattn.jit.target import Target
from hipattn.ops import smallseq as smallseq_ops

pytestmark = needs_compiler

# THD sequences: 0, 1, 16 and 17 tokens on each side, Q longer and shorter than KV.
LENGTHS_Q = [17, 1, 0, 9, 17, 4, 16, 3]
LENGTHS_K = [17, 5, 3, 0, 12, 17, 1, 16]
# BSHD with seqused, in [batch, 17, heads, head_dim] tensors.
USED_Q = [17, 0, 6, 1]
USED_K = [16, 17, 0, 17]


@dataclass(frozen=True)
class Case:
    arch: str  # the emulated device
    portable: bool  # HIPATTN_SMALLSEQ_KERNEL=portable
    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    layout: str  # "thd" or "bshd"
    kernels: tuple[str, str]  # the families the forward and the backward run

    def __str__(self) -> str:
        kind = "portable" if self.portable else self.kernels[0].removeprefix("smallseq_forward_")
        return f"{kind}-{self.arch}-{self.dtype}-d{self.head_dim}-h{self.heads_q}x{self.heads_kv}-{self.layout}"


PORTABLE = ("smallseq_forward", "smallseq_backward")
MFMA = ("smallseq_forward_mfma", "smallseq_backward_mfma")
MMA = ("smallseq_forward_mma", "smallseq_backward_mma")
GQA_MMA = ("smallseq_forward_gqa_mma", "smallseq_backward_gqa_mma")
CASES = [
    # Portable: one problem per (sequence, head) forward; the backward walks a group of 3 heads in turn.
    Case("gfx90a", True, "bf16", 64, 6, 2, "thd", PORTABLE),  # wave64: four teams a wave
    Case("sm_80", True, "fp16", 128, 4, 4, "thd", PORTABLE),  # warp32: one team a warp
    # MFMA: a group's stacked rows cross heads inside a 16-row tile (4 x 17 rows; 3 x 6 rows); at
    # head_dim 128 the backward's two waves add their partial scores through LDS.
    Case("gfx90a", False, "bf16", 64, 4, 1, "thd", MFMA),
    Case("gfx90a", False, "fp16", 128, 6, 2, "bshd", MFMA),
    # One problem per (sequence, head); at head_dim 256 two warps a problem.
    Case("sm_80", False, "bf16", 64, 4, 4, "thd", MMA),
    Case("sm_80", False, "fp16", 256, 2, 2, "bshd", MMA),
    # Grouped heads: G = 4 (MQA) and 3 (a chunk of 16 stacked rows splits a token's heads); at head_dim
    # 256 teams of two warps (forward) and four (backward).
    Case("sm_80", False, "fp16", 64, 4, 1, "thd", GQA_MMA),
    Case("sm_80", False, "bf16", 256, 6, 2, "thd", GQA_MMA),
]


def _specs(case: Case):
    target = Target.parse(case.arch)
    group = case.heads_q // case.heads_kv
    rows = (catalog.forward_tiles(case.head_dim, target, group=group, portable=case.portable),
            catalog.backward_tiles(case.head_dim, target, group=group, portable=case.portable))
    return [(row.call_spec(case.dtype, case.head_dim, case.heads_q, True), case.arch) for row in rows]


@pytest.fixture(scope="module")
def build_dirs(emulation_dirs):
    """Build and cache directories for the module, filled up front: every case's two kernels are
    compiled two at a time (g++ in subprocesses), so the tests then load them from the cache."""
    build, cache = emulation_dirs
    registries = {arch: Registry(EmulationBackend(str(build), arch), DiskCache(str(cache)))
                  for arch in {case.arch for case in CASES}}
    specs = sorted({spec for case in CASES for spec in _specs(case)}, key=lambda s: (s[1], s[0].canonical()))
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda s: registries[s[1]].compile_spec(s[0], Target.parse(s[1])), specs))
    return build, cache


def _mods_id(mods) -> str:
    softcap, alibi, causal = mods
    return "-".join(filter(None, [f"softcap{softcap}" if softcap else "", f"alibi-{alibi}" if alibi else "",
                                  "causal" if causal else ""]))


def _check(device, monkeypatch, score_modified, case, causal, **mods) -> None:
    """hipattn's forward and backward on the emulated device against float64 with ``mods``, through the
    case's kernels."""
    if case.portable:
        monkeypatch.setenv(smallseq_ops.KERNEL_SWITCH, "portable")
    rng = np.random.default_rng()
    if case.layout == "thd":
        score_modified(device, len(LENGTHS_Q), case.heads_q, **mods)
        check_forward_and_backward(device, rng, LENGTHS_Q, LENGTHS_K, case.heads_q, case.heads_kv, case.head_dim,
                                   case.dtype, causal, max_q=17, max_k=17)
    else:
        score_modified(device, len(USED_Q), case.heads_q, **mods)
        check_bshd_forward_and_backward(device, rng, USED_Q, USED_K, 17, 17, case.heads_q, case.heads_kv,
                                        case.head_dim, case.dtype, causal)
    assert device.kernels == list(case.kernels)


@pytest.mark.parametrize("mods", SCORE_MODIFIER_CASES, ids=_mods_id)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_small_seq_kernels_match_float64_with_score_modifiers(build_dirs, monkeypatch, score_modified, case, mods):
    softcap, alibi, causal = mods
    device = EmulatedDevice(*build_dirs, monkeypatch, arch=case.arch)
    _check(device, monkeypatch, score_modified, case, causal, softcap=softcap, alibi=alibi)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_small_seq_kernels_match_float64_with_learnable_sinks(build_dirs, monkeypatch, score_modified, case,
                                                                   causal):
    device = EmulatedDevice(*build_dirs, monkeypatch, arch=case.arch)
    _check(device, monkeypatch, score_modified, case, causal, sink=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_small_seq_kernels_match_float64_with_dropout(build_dirs, monkeypatch, score_modified, dropped, case,
                                                         causal):
    device = EmulatedDevice(*build_dirs, monkeypatch, arch=case.arch)

    def score_modified_and_dropped(device, batch, heads_q, **mods):
        # After score_modified, which sets the references afresh: dropped adds its mask to them.
        slopes = score_modified(device, batch, heads_q, **mods)
        dropped(device, DROPOUT_P, DROPOUT_SEED)
        return slopes

    _check(device, monkeypatch, score_modified_and_dropped, case, causal)
