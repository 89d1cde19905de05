"""Workspace planning: one device buffer per call, carved into aligned sections on the host.

``plan_workspace`` is the one helper that lays sections out; the forward and backward planners
below only say which sections they need (the seed review asked for the duplicated forward/backward
carving to be factored out). Every size comes from host-known facts (the ``Problem``'s shapes and
``max_seqlen`` bounds, a kernel's tile sizes): nothing here reads device memory, so a plan is
made before anything is enqueued and a whole call stays capturable into a graph.

Sections are laid out in the order given, each at a multiple of ``WORKSPACE_ALIGNMENT`` bytes from
the base, and the base must be aligned as well (device allocators return 256-byte aligned memory).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MappingProxyType

from .arrays import element_size
from .problem import THD, Problem, lse_shape
from .varlen_metadata import INT32_MAX, VARLEN_RECORD_DTYPE, SequenceLimits, key_block_splits

# Every section starts on this boundary: a multiple of every vector access width the kernels use
# (16 bytes) and of a cache line's sector group, and what cudaMalloc/hipMalloc return.
WORKSPACE_ALIGNMENT = 256

VARLEN_RECORD_WORDS = len(VARLEN_RECORD_DTYPE.names)


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


def forward_workspace(problem: Problem) -> WorkspacePlan:
    """The flash forward needs no workspace: one pass per query tile, O and LSE written straight to
    the caller's buffers (no split-KV partial results, no LSE accumulation). An empty plan, kept so
    that a future split-KV forward adds its sections here, through the same helper."""
    del problem  # every forward variant so far is workspace-free
    return plan_workspace(())


def needs_varlen_metadata(problem: Problem, deterministic: bool) -> bool:
    """Whether the backward needs the per-sequence records (varlen_metadata).

    Only the deterministic varlen backward does: its dq_accum slices sit at prefix-sum offsets.
    The atomic backward reads cu_seqlens on the device as the forward does, and skips the host
    round trip.
    """
    return problem.layout == THD and deterministic


def backward_workspace(problem: Problem, deterministic: bool, block_n: int) -> WorkspacePlan:
    """Sections of the flash backward, for key blocks of ``block_n`` (the kernel's tile-table BLOCK_N).

    - ``softmax_d``: fp32 D = rowsum(dO * O), laid out as the LSE: [Hq, total_q] (THD) or
      [B, Hq, S_q] (BSHD).
    - ``dq_accum``: fp32. Atomic mode: dq's shape, [total_q, Hq, D] or [B, S_q, Hq, D]. Deterministic
      mode: one slice per key block. BSHD: [splits, B, S_q, Hq, D] with splits =
      ceil(max_seqlen_k / block_n). THD: [splits * total_q, Hq, D] rows, of which sequence b uses
      ``key_splits * query_length`` rows from its record's ``dq_accum_row_offset`` (a bound, since
      only the device knows the lengths).
    - ``varlen_metadata``: int32 [batch, VARLEN_RECORD_WORDS], one record per sequence
      (hipattn.varlen_metadata), only where ``needs_varlen_metadata``.

    Zeroing ``dq_accum`` (ops.preprocess.zero_dq_accum) covers the whole section.
    """
    heads, head_dim = problem.heads_q, problem.head_dim
    splits = key_block_splits(problem.max_seqlen_k, block_n)  # validates block_n in both modes
    if not deterministic:
        dq_accum = (problem.total_q, heads, head_dim) if problem.layout == THD else (
            problem.batch, problem.total_q, heads, head_dim)
    else:
        if problem.layout == THD:
            rows = SequenceLimits.of(problem).dq_accum_rows(block_n)
            if rows > INT32_MAX:
                raise ValueError(
                    f"deterministic varlen backward: {splits} key blocks (max_seqlen_k {problem.max_seqlen_k}, "
                    f"block_n {block_n}) x {problem.total_q} query tokens = {rows} dq_accum rows, beyond the "
                    f"int32 row offsets ({INT32_MAX}); use deterministic=False or split the batch"
                )
            dq_accum = (rows, heads, head_dim)
        else:
            dq_accum = (splits, problem.batch, problem.total_q, heads, head_dim)
    sections = [
        SectionRequest("softmax_d", lse_shape(problem), "fp32"),
        SectionRequest("dq_accum", dq_accum, "fp32"),
    ]
    if needs_varlen_metadata(problem, deterministic):
        sections.append(SectionRequest("varlen_metadata", (problem.batch, VARLEN_RECORD_WORDS), "int32"))
    return plan_workspace(sections)
