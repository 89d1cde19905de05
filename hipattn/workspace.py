"""Workspace planning: one device buffer per call, carved into aligned sections on the host.

``plan_workspace`` is the one helper that lays sections out; a planner (the flash backward's and the
KV-cache call's below) only says which sections it needs. Every size comes from host-known
facts (the ``Problem``'s shapes and batch): nothing here reads device memory, so a plan is made
before anything is enqueued and a whole call stays capturable into a graph. What only the device knows (the lengths in ``cu_seqlens``) is
derived into a section on the launch stream (``varlen_records``, hipattn.varlen_prep).

Sections are laid out in the order given, each at a multiple of ``WORKSPACE_ALIGNMENT`` bytes from
the base, and the base must be aligned as well (device allocators return 256-byte aligned memory).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MappingProxyType

from .device_array import element_size
from .problem import THD, Problem, lse_shape
from .varlen_metadata import VARLEN_RECORD_WORDS

# Every section starts on this boundary: a multiple of every vector access width the kernels use
# (16 bytes) and of a cache line's sector group, and what cudaMalloc/hipMalloc return.
WORKSPACE_ALIGNMENT = 256


@dataclass(frozen=True)
class SectionRequest:
    """A section a planner asks for: a contiguous array of ``shape`` and ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Section:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # bytes from the workspace base; a multiple of the plan's alignment
    nbytes: int


@dataclass(frozen=True)
class WorkspacePlan:
    sections: tuple[Section, ...]
    total_bytes: int  # what to allocate: the last section's end, rounded up to the alignment
    alignment: int
    _by_name: MappingProxyType = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", MappingProxyType({s.name: s for s in self.sections}))

    def __getitem__(self, name: str) -> Section:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"the workspace has no section {name!r}; it has {list(self._by_name)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def pointer(self, base: int, name: str) -> int:
        """The device address of section ``name`` in a workspace allocated at ``base``."""
        if base % self.alignment:
            raise ValueError(f"workspace base 0x{base:x} is not {self.alignment}-byte aligned")
        return base + self[name].offset


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan_workspace(sections: Iterable[SectionRequest], alignment: int = WORKSPACE_ALIGNMENT) -> WorkspacePlan:
    """Lay ``sections`` out one after another, each aligned; an empty list is an empty plan."""
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two; got {alignment!r}")
    laid_out: list[Section] = []
    seen: set[str] = set()
    end = 0
    for request in sections:
        if request.name in seen:
            raise ValueError(f"workspace section {request.name!r} is requested twice")
        seen.add(request.name)
        count = 1
        for extent in request.shape:
            if isinstance(extent, bool) or not isinstance(extent, int) or extent < 0:
                raise ValueError(
                    f"workspace section {request.name!r} has shape {request.shape}; extents must be ints >= 0"
                )
            count *= extent
        offset = _aligned(end, alignment)
        nbytes = count * element_size(request.dtype)
        laid_out.append(Section(request.name, tuple(request.shape), request.dtype, offset, nbytes))
        end = offset + nbytes
    return WorkspacePlan(tuple(laid_out), _aligned(end, alignment), alignment)


# ---- the flash path's planners -------------------------------------------------------------------


def backward_workspace(problem: Problem, atomic_dq: bool) -> WorkspacePlan:
    """Sections of the flash backward.

    - ``softmax_d``: fp32 D = rowsum(dO * O), laid out as the LSE: [Hq, total_q] (THD) or
      [B, Hq, S_q] (BSHD).
    - ``dq_accum``: fp32, dq's shape, [total_q, Hq, D] or [B, S_q, Hq, D]; only for the atomic
      schedule (``atomic_dq``; ops.flash_backward.adds_dq_atomically says when a call runs it): the
      dQ kernel's schedule sums dQ per query tile in registers.
    - ``varlen_records``: int32 [batch, VARLEN_RECORD_WORDS], one record per sequence: the dK/dV
      kernel's work list (hipattn.varlen_metadata), prepared on the launch stream; only THD.
    """
    heads, head_dim = problem.heads_q, problem.head_dim
    sections = [SectionRequest("softmax_d", lse_shape(problem), "fp32")]
    if atomic_dq:
        dq_accum = (problem.total_q, heads, head_dim) if problem.layout == THD else (
            problem.batch, problem.total_q, heads, head_dim)
        sections.append(SectionRequest("dq_accum", dq_accum, "fp32"))
    if problem.layout == THD:
        sections.append(SectionRequest("varlen_records", (problem.batch, VARLEN_RECORD_WORDS), "int32"))
    return plan_workspace(sections)


def kvcache_workspace(problem, splits: int) -> WorkspacePlan:
    """Sections of a KV-cache call (``problem``: a kvcache_problem.KvCacheProblem).

    - ``q_rotated``: q's dtype, [B, S_q, Hq, D]: the queries with rotary applied; only with rotary.
    - ``o_partial``: fp32 [splits, B, Hq, S_q, D] and ``lse_partial``: fp32 [splits, B, Hq, S_q]: each
      split's O and LSE, merged by the combine kernel; only with more than one split.
    """
    rows = (problem.batch, problem.heads_q, problem.seqlen_q)
    sections = []
    if problem.rotary_dim:
        sections.append(SectionRequest("q_rotated", (problem.batch, problem.seqlen_q, problem.heads_q,
                                                     problem.head_dim), problem.dtype))
    if splits > 1:
        sections.append(SectionRequest("o_partial", (splits, *rows, problem.head_dim), "fp32"))
        sections.append(SectionRequest("lse_partial", (splits, *rows), "fp32"))
    return plan_workspace(sections)
