"""The catalog of hipattn's attention kernels: every kernel family, its tile tables and the
instantiations it ships, one module per kernel group.

- ``smallseq``: every sequence <= 17 tokens (portable and tensor-core kernels);
- ``flash_forward`` and ``flash_backward``: the general path (mma.sync, wgmma, MFMA);
- ``preprocess``: the backward's Delta = rowsum(dO * O) and dQ conversion;
- ``varlen``: the varlen backward's device-side work list;
- ``decode``: attention against a KV cache (append with rotary, split-KV attention, combine).

A table's row names its kernel (``tiles.KernelTiles``): it builds the spec and computes the shared
memory, so the launchers in ``hipattn.ops`` never dispatch on a row's type. ``index`` holds the
families by name; importing this package registers them all.
"""

from __future__ import annotations

from . import decode, flash_backward, flash_forward, preprocess, smallseq, varlen
from .index import FAMILIES, family, shipped_specs, spec_from_canonical

__all__ = ["FAMILIES", "family", "shipped_specs", "spec_from_canonical", "decode", "flash_backward", "flash_forward",
           "preprocess", "smallseq", "varlen"]
