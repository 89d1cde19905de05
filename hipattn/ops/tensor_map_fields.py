"""The tensor-map fields of an attention kernel whose producer copies tiles with Hopper's copy engine
(a catalog row whose ``tensor_map_rows`` names arrays): each [batch, token, head, dim] input as a 4-D
map, innermost first (head_dim, heads, tokens, batch), whose box is one 64-column swizzle block of
one head's rows.

A varlen (THD) array is one batch of tokens. A map cannot describe every array hipattn takes: its
strides must be positive multiples of 16 bytes, so an array with a broadcast (zero) or negative
stride has no map, and the launcher then runs a kernel that copies with its threads.
"""

from __future__ import annotations

from ..backends.tensor_maps import DEFAULT_L2_PROMOTION, TensorMapLayout
from ..catalog.common import WGMMA_SWIZZLE_COLUMNS
from ..device_array import DeviceArray, element_size
from ..errors import DriverError
from ..log import logger
from ..problem import THD

# What the copy engine takes: addresses and strides in multiples of 16 bytes, strides below 2^40 bytes,
# at most 2^32 elements along a dimension.
_TENSOR_MAP_UNIT = 16
_MAX_STRIDE_BYTES = 1 << 40
_MAX_EXTENT = 1 << 32


def map_layout(a: DeviceArray, layout: str, box_rows: int,
               l2_promotion: int = DEFAULT_L2_PROMOTION) -> TensorMapLayout | None:
    """The map of attention input ``a`` (``layout`` BSHD or THD) with boxes of ``box_rows`` tokens and
    L2 fetches of ``l2_promotion`` bytes (TensorMapLayout), or None when no map can describe it."""
    if layout == THD:
        (tokens, heads, head_dim), (token_stride, head_stride, _) = a.shape, a.strides
        batch, batch_stride = 1, 0
    else:
        (batch, tokens, heads, head_dim), (batch_stride, token_stride, head_stride, _) = a.shape, a.strides
    dims = (head_dim, heads, tokens, batch)
    itemsize = element_size(a.dtype)
    strides = [head_stride * itemsize, token_stride * itemsize, batch_stride * itemsize]
    # A dimension of extent 1 is never stepped along, so whatever stride it has (0 for a varlen array's
    # batch) becomes a contiguous array's, which the map's rules accept.
    extent_bytes = head_dim * itemsize
    for i, extent in enumerate(dims[1:]):
        if extent == 1:
            strides[i] = extent_bytes
        extent_bytes = strides[i] * extent
    if a.ptr % _TENSOR_MAP_UNIT or any(extent >= _MAX_EXTENT for extent in dims) or any(
            stride <= 0 or stride % _TENSOR_MAP_UNIT or stride >= _MAX_STRIDE_BYTES for stride in strides):
        return None
    return TensorMapLayout(a.dtype, dims, tuple(strides), (WGMMA_SWIZZLE_COLUMNS, 1, box_rows, 1), l2_promotion)


def has_tensor_maps(arrays: dict[str, DeviceArray], layout: str, box_rows: dict[str, int]) -> bool:
    """Whether every array ``box_rows`` names has a map (map_layout), by host facts alone."""
    return all(map_layout(arrays[name], layout, rows) is not None for name, rows in box_rows.items())


def tensor_map_fields(runtime, layout: str, arrays: dict[str, DeviceArray], box_rows: dict[str, int],
                      l2_promotion: int = DEFAULT_L2_PROMOTION) -> dict | None:
    """``{name}_map`` of each array ``box_rows`` names (its box's rows; arrays in ``layout``, BSHD or
    THD; L2 fetches of ``l2_promotion`` bytes), encoded through ``runtime`` (cached per address and
    layout), or None when one of them has no map."""
    fields = {}
    for name, rows in box_rows.items():
        a = arrays[name]
        map_of = map_layout(a, layout, rows, l2_promotion)
        if map_of is None:
            return None
        try:
            fields[f"{name}_map"] = runtime.tensor_map(a.ptr, map_of)
        except DriverError as error:  # strides the driver's rules refuse beyond the ones above
            logger.debug("no tensor map for %s (%s): %s", name, map_of, error)
            return None
    return fields


def maps_or_fallback(runtime, layout: str, arrays: dict[str, DeviceArray], tiles, chosen: bool, what: str,
                     fallback) -> tuple:
    """(tiles, ``{name}_map`` fields) a launcher runs: ``tiles`` with the maps of the arrays its
    ``tensor_map_rows`` names (none when it names none). When one of them has no map, the row the
    target chose (``chosen``) gives way to ``fallback()``, the row whose threads copy, with no maps; a
    row the caller asked for is refused with a ValueError naming ``what`` (the launcher and its arrays)."""
    box_rows = tiles.tensor_map_rows()
    if not box_rows:
        return tiles, {}
    fields = tensor_map_fields(runtime, layout, arrays, box_rows)
    if fields is not None:
        return tiles, fields
    if not chosen:
        raise ValueError(f"{what}: {tiles} copies {' and '.join(box_rows)} through tensor maps, and one of them "
                         "has a stride no tensor map takes (a positive multiple of 16 bytes)")
    return fallback(), {}
