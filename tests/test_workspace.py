"""Workspace plans: sizes, alignment, offsets and disjoint sections, from host facts only; the
forward and backward planners share one helper."""

from __future__ import annotations

import itertools
import random

import pytest

from hipattn import workspace
from hipattn.problem import BSHD, THD, Problem
from hipattn.varlen_metadata import VARLEN_RECORD_BYTES, VARLEN_RECORD_WORDS
from hipattn.workspace import (
    WORKSPACE_ALIGNMENT,
    SectionRequest,
    backward_workspace,
    plan_workspace,
)


def make_problem(layout=THD, batch=3, heads_q=8, heads_kv=2, head_dim=128, max_seqlen_q=300, max_seqlen_k=700,
                 total_q=1000, total_k=1500) -> Problem:
    return Problem(layout=layout, dtype="bf16", batch=batch, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, total_q=total_q, total_k=total_k,
                   causal=False, softmax_scale=0.1, device=0)


def assert_well_formed(plan) -> None:
    """Every section aligned, inside the total, and disjoint from every other."""
    assert plan.total_bytes % plan.alignment == 0
    for section in plan.sections:
        assert section.offset % plan.alignment == 0, section
        assert section.offset + section.nbytes <= plan.total_bytes, section
    for a, b in itertools.combinations(plan.sections, 2):
        assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset, (a, b)


def test_sections_are_laid_out_in_order_each_aligned():
    plan = plan_workspace([
        SectionRequest("a", (3,), "fp32"),  # 12 bytes
        SectionRequest("b", (2, 5), "int32"),  # 40 bytes
        SectionRequest("c", (0,), "fp32"),
        SectionRequest("d", (256,), "uint8"),
    ])
    assert plan.alignment == WORKSPACE_ALIGNMENT == 256
    assert [(s.name, s.offset, s.nbytes) for s in plan.sections] == [
        ("a", 0, 12), ("b", 256, 40), ("c", 512, 0), ("d", 512, 256)]
    assert plan.total_bytes == 768
    assert plan["b"].shape == (2, 5) and plan["b"].dtype == "int32"
    assert "c" in plan and "e" not in plan and plan.names == ("a", "b", "c", "d")
    assert_well_formed(plan)


def test_random_plans_are_well_formed_and_tight():
    rng = random.Random()
    for _ in range(200):
        alignment = 1 << rng.randrange(0, 10)
        requests = [SectionRequest(f"s{i}", (rng.randrange(0, 5000),), rng.choice(["fp32", "int32", "uint8", "bf16"]))
                    for i in range(rng.randrange(0, 6))]
        plan = plan_workspace(requests, alignment=alignment)
        assert_well_formed(plan)
        end = max((s.offset + s.nbytes for s in plan.sections), default=0)
        assert end <= plan.total_bytes < end + alignment  # no slack beyond the final rounding
        for section, request in zip(plan.sections, requests, strict=True):
            assert section.nbytes == request.shape[0] * {"fp32": 4, "int32": 4, "uint8": 1, "bf16": 2}[request.dtype]


def test_pointer_needs_an_aligned_base():
    plan = plan_workspace([SectionRequest("a", (1,), "fp32"), SectionRequest("b", (1,), "fp32")])
    assert plan.pointer(0x7F0000000000, "b") == 0x7F0000000000 + 256
    with pytest.raises(ValueError, match="not 256-byte aligned"):
        plan.pointer(0x7F0000000010, "b")
    with pytest.raises(KeyError, match="no section 'c'"):
        plan.pointer(0x7F0000000000, "c")


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="requested twice"):
        plan_workspace([SectionRequest("a", (1,), "fp32"), SectionRequest("a", (1,), "fp32")])
    with pytest.raises(ValueError, match="extents must be ints >= 0"):
        plan_workspace([SectionRequest("a", (-1,), "fp32")])
    with pytest.raises(ValueError, match="power of two"):
        plan_workspace([], alignment=48)
    with pytest.raises(ValueError, match="unknown dtype"):
        plan_workspace([SectionRequest("a", (1,), "float")])


@pytest.mark.parametrize("layout", [THD, BSHD])
def test_atomic_backward_sections(layout):
    problem = make_problem(layout, batch=3, heads_q=8, head_dim=128, total_q=1000)
    plan = backward_workspace(problem, atomic_dq=True)
    if layout == THD:
        assert plan.names == ("softmax_d", "dq_accum", "varlen_records")
        assert plan["softmax_d"].shape == (8, 1000)
        assert plan["dq_accum"].shape == (1000, 8, 128)
    else:
        assert plan.names == ("softmax_d", "dq_accum")  # BSHD: no work list, the grid has fixed strides
        assert plan["softmax_d"].shape == (3, 8, 1000)
        assert plan["dq_accum"].shape == (3, 1000, 8, 128)
    assert plan["softmax_d"].nbytes == 4 * 8 * 1000 * (3 if layout == BSHD else 1)
    assert plan["dq_accum"].dtype == "fp32" and plan["dq_accum"].nbytes == 4 * 8 * 128 * 1000 * (3 if layout == BSHD else 1)
    assert_well_formed(plan)


@pytest.mark.parametrize("layout", [THD, BSHD])
def test_the_dq_kernel_schedule_has_no_dq_accum(layout):
    plan = backward_workspace(make_problem(layout), atomic_dq=False)
    assert plan.names == (("softmax_d", "varlen_records") if layout == THD else ("softmax_d",))
    assert_well_formed(plan)


def test_varlen_records_are_one_record_per_sequence_in_both_modes():
    for atomic_dq in (False, True):
        plan = backward_workspace(make_problem(THD, batch=3), atomic_dq=atomic_dq)
        assert plan["varlen_records"].shape == (3, VARLEN_RECORD_WORDS) and plan["varlen_records"].dtype == "int32"
        assert plan["varlen_records"].nbytes == 3 * VARLEN_RECORD_BYTES
        # Host facts only: the lengths in cu_seqlens, which the records hold, do not change the plan.
        assert plan == backward_workspace(make_problem(THD, batch=3, max_seqlen_k=5, total_k=9), atomic_dq)


def test_empty_problems_plan_empty_sections():
    plan = backward_workspace(make_problem(THD, batch=0, total_q=0, total_k=0, max_seqlen_q=0, max_seqlen_k=0),
                              atomic_dq=True)
    assert plan.names == ("softmax_d", "dq_accum", "varlen_records")
    assert all(s.nbytes == 0 for s in plan.sections) and plan.total_bytes == 0


def test_the_backward_carves_through_the_one_helper(monkeypatch):
    calls = []
    real = workspace.plan_workspace

    def spy(sections, *args, **kwargs):
        sections = list(sections)
        calls.append([s.name for s in sections])
        return real(sections, *args, **kwargs)

    monkeypatch.setattr(workspace, "plan_workspace", spy)
    backward_workspace(make_problem(), atomic_dq=False)
    backward_workspace(make_problem(BSHD), atomic_dq=True)
    assert calls == [["softmax_d", "varlen_records"], ["softmax_d", "dq_accum"]]
