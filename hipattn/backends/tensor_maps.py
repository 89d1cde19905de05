"""Tensor maps: the descriptors Hopper's copy engine reads a tile of a strided array through
(``cp.async.bulk.tensor``), encoded on the host and passed by value in a kernel's parameter struct.

A map names an array's address, its dimensions and strides, the box (tile) one copy moves and the
shared-memory swizzle the box lands in. Everything but the address is a ``TensorMapLayout``, fixed by
a call's shapes; the address changes from call to call, so maps are cached per (address, layout):
a training step that sees the same tensors again (the allocator hands the same blocks back) pays for
its encodings once. The cache also answers which address and layout a map was encoded from, which is
what a replayed launch (hipattn.launch_plans) needs to encode the map of its own arrays.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..jit.params import TensorMapBytes

# Encoded maps kept per process: far more than the arrays one training step passes.
MAX_CACHED_MAPS = 4096
# The L2 promotions a map may name, in bytes (0: none): cuTensorMapEncodeTiled's CUtensorMapL2promotion.
L2_PROMOTIONS = (0, 64, 128, 256)
# What the flash kernels' maps ask for: a 128-byte box row's L2 fetch widened to 256 bytes, a whole
# head_dim-128 row, whose other half the next box reads.
DEFAULT_L2_PROMOTION = 256


@dataclass(frozen=True)
class TensorMapLayout:
    """A tiled tensor map without its address: a 16-bit ``dtype`` ("bf16" or "fp16"), its ``dims`` in
    elements, innermost (contiguous) first, the byte ``strides`` of every dimension but the innermost,
    and the ``box`` a copy moves, in elements per dimension. The box's rows are 128 bytes at most and
    land in shared memory in the 128-byte swizzle (common/wgmma_nvidia.h's layout); elements outside
    the dims read as zeros. ``l2_promotion`` is the granularity of L2's fetches for the copies, in bytes:
    0 (what a copy asks for), 64, 128 or 256 (DEFAULT_L2_PROMOTION; decode's cache maps take 0,
    ops.decode.CACHE_L2_PROMOTION)."""

    dtype: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    l2_promotion: int = DEFAULT_L2_PROMOTION

    def __post_init__(self) -> None:
        if self.l2_promotion not in L2_PROMOTIONS:
            raise ValueError(f"l2_promotion must be one of {L2_PROMOTIONS} bytes, got {self.l2_promotion!r}")


class TensorMapCache:
    """Encoded maps by (address, layout), and the way back, bounded by MAX_CACHED_MAPS (emptied whole
    when full: a new working set is encoded once more)."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, TensorMapLayout], TensorMapBytes] = {}
        self._origins: dict[bytes, tuple[int, TensorMapLayout]] = {}
        self._lock = threading.Lock()

    def get(self, backend, address: int, layout: TensorMapLayout) -> TensorMapBytes:
        """The map of ``layout`` at ``address``, encoded by ``backend`` on a miss."""
        key = (address, layout)
        encoded = self._maps.get(key)
        if encoded is None:
            encoded = backend.encode_tensor_map(address, layout)
            with self._lock:
                if len(self._maps) >= MAX_CACHED_MAPS:
                    self._maps.clear()
                    self._origins.clear()
                self._maps[key] = encoded
                self._origins[bytes(encoded)] = key
        return encoded

    def origin(self, encoded: bytes) -> tuple[int, TensorMapLayout] | None:
        """(address, layout) of a map this cache encoded, or None."""
        return self._origins.get(bytes(encoded))
