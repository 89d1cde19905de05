"""What every small-sequence kernel row shares (every sequence <= SMALLSEQ_TILE tokens on both
sides): the tile and head-dim constants, a launch's shape, the row base class, the kernels' parameter
fields and how their families register. The rows themselves are in ``smallseq`` (portable and NVIDIA
tensor-core kernels) and ``smallseq_mfma`` (AMD matrix cores)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..jit.params import ParamsStruct
from ..jit.spec import KernelFamily, KernelSpec
from ..jit.target import Target
from .common import DTYPES
from .fields import (
    DROPOUT_FIELDS,
    SCORE_MOD_FIELDS,
    SCORE_MODS_PARAM,
    SCORE_MODS_VALUES,
    SEQUENCE_FIELDS,
    SINK_FIELDS,
    Fields,
    row_statistic,
    strided,
)
from .index import register
from .tiles import KernelTiles

# The longest sequence the small-seq kernels handle, on either side: the tile every problem fits in.
# This is the one definition; it reaches the kernels as their TILE template argument.
SMALLSEQ_TILE = 17
SMALLSEQ_HEAD_DIMS = (64, 128, 256)
# The query head counts shipped precompiled; any other compiles on first use.
SMALLSEQ_SHIPPED_HEADS = (8, 16, 32)
# A portable team's lane holds this many consecutive elements of each row (8-byte accesses).
SMALLSEQ_LANE_ELEMENTS = 4
# A call of fewer than problems_per_team * SMALLSEQ_TEAMS_WANTED problems gives its teams shorter runs,
# so that it still spreads over the GPU.
SMALLSEQ_TEAMS_WANTED = 16384
# The tensor-core backward's P and dZ tiles: [SMALLSEQ_TILE query rows][32 keys + 8 of pad], 16-bit
# (smallseq::kScorePitch).
SMALLSEQ_SCORE_PITCH = 32 + 8


@dataclass(frozen=True)
class SmallSeqLaunch:
    """How one launch covers a call's problems: its grid, block, dynamic shared memory, and the kernel
    fields the launch sets (the tensor-core kernels' run of problems per team, the grouped kernels'
    group size)."""

    blocks: int
    threads: int
    shared_bytes: int
    fields: Mapping[str, int] = field(default_factory=dict)


class SmallSeqTiles(KernelTiles):
    """A small-seq row: it picks the instantiation a call needs and sizes its launch."""

    def call_spec(self, dtype: str, head_dim: int, heads: int, score_mods: bool) -> KernelSpec:
        """The instantiation serving a call with ``heads`` query heads (and score modifiers or not):
        the kernels take the head count as a template argument (so that a problem index divides by a
        constant), unless a row's kernel takes it at run time."""
        return self.spec(dtype, head_dim, heads=heads, score_mods=score_mods)

    @abstractmethod
    def launch(self, problems: int, head_dim: int, group: int) -> SmallSeqLaunch:
        """The launch over ``problems`` problems as the launcher counts them ((sequence, query head)
        pairs for the forward, (sequence, KV head) pairs for the backward), of query heads grouped
        ``group`` to a KV head."""


SMALLSEQ_TEMPLATE = ("dtype", "head_dim", "heads", "tile")
FORWARD_FIELDS = strided("q") + strided("k") + strided("v") + strided("o") + row_statistic("lse", "ptr") + SEQUENCE_FIELDS
BACKWARD_FIELDS = (strided("q") + strided("k") + strided("v") + strided("dout") + strided("dq") + strided("dk")
                    + strided("dv") + row_statistic("lse", "const_ptr") + SEQUENCE_FIELDS)
# The tensor-core kernels' teams walk runs of problems, of a length the launch chooses.
RUN_FIELD = (("problems_per_team", "i32"),)


# Dropout's streams are numbered sequence * heads_q + query head (kernels/common/dropout.h), as the flash
# kernels number them; the small-seq kernels otherwise know Hq as a template argument.
_DROPOUT_STREAMS: Fields = (("heads_q", "i32"),)


def smallseq_params(name: str, fields, *, sinks: bool = False) -> ParamsStruct:
    """A small-seq kernel's struct: ``fields``, then the score modifiers and dropout (last in every
    attention struct), and for a forward (``sinks``) the learnable sinks, which only the forwards read:
    the backwards take them through the LSE."""
    return ParamsStruct(name, fields + SCORE_MOD_FIELDS + DROPOUT_FIELDS + _DROPOUT_STREAMS
                        + (SINK_FIELDS if sinks else ()))


def smallseq_family(name: str, source: str, template_tail: tuple[str, ...], params: ParamsStruct, shipped,
                    template_head: tuple[str, ...] = SMALLSEQ_TEMPLATE) -> KernelFamily:
    return register(KernelFamily(name=name, source=source, template=f"hipattn::{name}",
                                 template_params=template_head + template_tail + (SCORE_MODS_PARAM,), params=params,
                                 shipped=shipped))


def shipped_per_heads(rows_of_head_dim, target: Target) -> list:
    return [rows_of_head_dim(d).spec(t, d, heads=h, score_mods=m) for t in DTYPES for d in SMALLSEQ_HEAD_DIMS
            for h in SMALLSEQ_SHIPPED_HEADS for m in SCORE_MODS_VALUES]
