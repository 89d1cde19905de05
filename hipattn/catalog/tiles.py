"""What every row of a kernel's tile table knows: the kernel it names, and that kernel's spec and
shared memory for the row's tiles.

A table maps a head_dim (and a target, by the table chosen) to a row; the row's type names one
kernel family. Launchers and tools therefore never ask which kind of row they hold: they ask the row
for its spec, its block size and its dynamic shared memory, and a new kernel is a new row type, with
nothing to add to a dispatch ladder.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any

from ..jit.spec import KernelFamily, KernelSpec
from .common import WGMMA_WARPGROUP_ROWS, WGMMA_WARPGROUP_THREADS

# bf16 and fp16 alike: the element size every shared-memory formula defaults to.
ELEMENT_BYTES = 2


class KernelTiles(ABC):
    """A tile row (subclasses are frozen dataclasses whose fields are the kernel's template arguments,
    unless they say otherwise in ``template_args``). ``threads`` is a block's thread count."""

    # Whether the kernel's blocks walk work items blockIdx.x, + gridDim.x, ..., so that its launcher
    # may run fewer blocks than items (a persistent grid); otherwise a block takes one item.
    walks_items = False

    @property
    @abstractmethod
    def family(self) -> KernelFamily:
        """The kernel family whose template this row's tiles instantiate."""

    @property
    @abstractmethod
    def threads(self) -> int: ...

    def template_args(self, head_dim: int) -> dict[str, Any]:
        """The template arguments the row fixes (beyond ``dtype`` and ``head_dim``): by default its
        dataclass fields, each named as the template parameter it sets. Launchers ask once per
        (row, dtype, head_dim), so this is not on the launch path."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @abstractmethod
    def shared_bytes(self, head_dim: int, element_bytes: int = ELEMENT_BYTES) -> int:
        """Dynamic shared memory of one block: the kernel's own constexpr layout, from the same numbers."""

    def tensor_map_rows(self) -> dict[str, int]:
        """The arrays the kernel copies through tensor maps (hipattn.ops.tensor_map_fields), each with the
        rows of its box: none, unless the kernel's producer uses Hopper's copy engine."""
        return {}

    def spec(self, dtype: str, head_dim: int, **more: Any) -> KernelSpec:
        """The instantiation of this row's kernel for ``dtype`` and ``head_dim`` (``more``: the family's
        other template arguments, such as ``heads`` or ``write_dq``)."""
        return self.family.spec(dtype=dtype, head_dim=head_dim, **self.template_args(head_dim), **more)


class WarpgroupTiles(KernelTiles):
    """A row of a wgmma kernel (sm_90a): its ``warpgroups`` (a field of the subclass) of 128 threads
    each take 64 rows, a wgmma's M, of the tile they split."""

    @property
    def threads(self) -> int:
        return WGMMA_WARPGROUP_THREADS * self.warpgroups

    @property
    def warpgroup_rows(self) -> int:
        """The rows of the tile the warpgroups split: 64 each."""
        return WGMMA_WARPGROUP_ROWS * self.warpgroups
