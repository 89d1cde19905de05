"""The description of one device array, and the checks of its fields.

``DeviceArray`` is how every later layer sees an array: pointer, shape, strides in elements, dtype
name, device ordinal, and the producer's object kept alive. ``arrays`` builds these from what users
pass; this module holds the description itself, the dtype names and sizes, the views hipattn carves
out of a buffer, and the field checks every reader shares (each names the argument it checks).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Bytes per element of each hipattn dtype name.
ELEMENT_SIZE = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "fp16": 2,
    "bf16": 2,
    "int32": 4,
    "fp32": 4,
    "int64": 8,
    "fp64": 8,
}

# A CAI array whose producer says nothing about its device (CAI has no device field) and for
# which no pointer_device resolver was given. The launch path asks the runtime about its pointer or
# lets the other arrays decide (attention.settle_devices); -1 never reaches the runtime.
UNKNOWN_DEVICE = -1

# The widths of the fields these values end up in: kernel pointers are u64, strides i64.
POINTER_LIMIT = 1 << 64
_STRIDE_MIN, _STRIDE_MAX = -(1 << 63), (1 << 63) - 1


def element_size(dtype: str) -> int:
    """Bytes per element of a hipattn dtype name ('fp16', 'bf16', 'fp32', 'int32', 'int64', ...)."""
    try:
        return ELEMENT_SIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(ELEMENT_SIZE)}") from None


@dataclass(frozen=True)
class DeviceArray:
    """One device array as hipattn sees it. ``strides`` are in elements, not bytes.

    ``owner`` keeps the producer's memory alive for as long as this description exists (the
    original tensor, or for DLPack the managed tensor whose deleter runs when the owner dies).
    ``stream`` is the producer's stream from CAI v3 (the data is ready in that stream's order),
    None when the producer named none.
    """

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device: int
    framework: str  # 'torch' | 'cupy' | 'cai' | 'dlpack' | 'raw'
    # Equality and hashing ignore the owner (a torch tensor's == is elementwise).
    owner: Any = field(default=None, compare=False, repr=False)
    stream: int | None = None
    readonly: bool = False

    def __post_init__(self) -> None:
        # Runs for DeviceArrays built by hand only: the readers (arrays, dlpack) build theirs
        # through unchecked_device_array, after checking each field with the argument's name.
        shape = int_tuple(self.shape, "shape", "DeviceArray")
        strides = int_tuple(self.strides, "strides", "DeviceArray", allow_negative=True)
        if len(strides) != len(shape):
            raise ValueError(f"DeviceArray got {len(shape)}-d shape {shape} but strides {strides}")
        check_strides(strides, "DeviceArray")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "strides", strides)
        check_pointer(self.ptr, "DeviceArray")
        element_size(self.dtype)
        if isinstance(self.device, bool) or not isinstance(self.device, int) or self.device < UNKNOWN_DEVICE:
            raise ValueError(
                f"DeviceArray got device {self.device!r}; expected a device ordinal >= 0 "
                f"(or {UNKNOWN_DEVICE}: unknown, settled from the other arrays of a call)"
            )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for extent in self.shape:
            n *= extent
        return n

    @property
    def nbytes(self) -> int:
        return self.size * ELEMENT_SIZE[self.dtype]


_new_object = object.__new__


def unchecked_device_array(
    ptr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: str,
    device: int,
    framework: str,
    owner: Any,
    stream: int | None = None,
    readonly: bool = False,
) -> DeviceArray:
    # The hot-path constructor: the frozen dataclass __init__ sets each field through
    # object.__setattr__ (~1.5 us); filling __dict__ directly builds the same object in ~0.6 us.
    array = _new_object(DeviceArray)
    array.__dict__.update(
        ptr=ptr, shape=shape, strides=strides, dtype=dtype, device=device,
        framework=framework, owner=owner, stream=stream, readonly=readonly,
    )  # fmt: skip
    return array


def derived_array(
    base: DeviceArray, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, owner: Any
) -> DeviceArray:
    """A view hipattn itself carves out of ``base`` (a workspace section): on ``base``'s device and
    framework, built without checking its fields again, as they were derived from checked ones."""
    return unchecked_device_array(ptr, shape, strides, dtype, base.device, base.framework, owner)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """C-order strides in elements for ``shape``."""
    strides = [0] * len(shape)
    step = 1
    for axis in range(len(shape) - 1, -1, -1):
        strides[axis] = step
        step *= max(int(shape[axis]), 1)
    return tuple(strides)


def int_tuple(values: Any, what: str, name: str, allow_negative: bool = False) -> tuple[int, ...]:
    """``values`` as a tuple of ints. Only true integers count (NumPy's among them, through
    ``__index__``): 3.7 is refused, not truncated, and so are "3" and True."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name}: {what} must be a sequence of ints; got {values!r}")
    try:
        result = tuple(_index(v) for v in values)
    except TypeError:
        raise TypeError(f"{name}: {what} must be a sequence of ints; got {values!r}") from None
    if not allow_negative and any(v < 0 for v in result):
        raise ValueError(f"{name}: {what} {result} has a negative entry")
    return result


def _index(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not an extent")
    return operator.index(value)


def check_pointer(ptr: Any, what: str) -> None:
    """A device address: an int in [0, 2**64) (the kernels take u64 pointers)."""
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise TypeError(f"{what} needs the pointer as an int; got {ptr!r} ({type(ptr).__name__})")
    if ptr < 0:
        raise ValueError(f"{what} got a negative pointer {ptr}")
    if ptr >= POINTER_LIMIT:
        raise ValueError(f"{what} got pointer 0x{ptr:x}, which does not fit in 64 bits")


def check_strides(strides: tuple[int, ...], what: str) -> None:
    for stride in strides:
        if not _STRIDE_MIN <= stride <= _STRIDE_MAX:
            raise ValueError(f"{what}: strides {strides} has {stride}, which does not fit in 64 bits (the kernels take int64 strides)")


def null_pointer_message(name: str, shape: tuple[int, ...]) -> str:
    return f"{name} has a null data pointer (0) but shape {shape} is not empty; pass the array's device memory"


def byte_strides_to_elements(byte_strides: Sequence[int], itemsize: int, name: str) -> tuple[int, ...]:
    strides = []
    for s in byte_strides:
        if s % itemsize:
            raise ValueError(
                f"{name} has byte strides {tuple(byte_strides)} that are not multiples of its element size "
                f"{itemsize}; hipattn needs element-aligned strides"
            )
        strides.append(s // itemsize)
    return tuple(strides)


def nonzero_size(shape: tuple[int, ...]) -> bool:
    return all(extent > 0 for extent in shape)


def checked_device(device: Any, what: str) -> int:
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"{what} is {device!r}; expected a device ordinal (an int)")
    if device < 0:
        raise ValueError(f"{what} is {device}; expected a device ordinal >= 0")
    return int(device)

