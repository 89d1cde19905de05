"""Repeat calls on torch tensors: the launches a validated call made, replayed for the next call of the
same signature (hipattn.forward and hipattn.flash_attn_with_kvcache).

The full path of a call describes and validates every argument, dispatches, and builds the kernels'
argument structs: tens to hundreds of microseconds of Python, which decode steps and small layers
feel. Almost all of it depends only on the call's *signature*: per array its dtype, shape, strides
and device; the host scalars; which outputs were given; the switches read per call. So the first
call of a signature runs the full path and records what it launched, and a later call of that
signature replays it with the new pointers.

A call is a tuple of array *slots* (None where not given); some slots are outputs, which the plan
allocates like the recorded call did when the caller leaves them out, and some are *written* (the
outputs, and a KV cache that is appended to). A recorded kernel pointer is one slot's pointer, or
an offset into the call's workspace, which the plan allocates anew for each replay (stream-ordered,
as the full path's).

What depends on the pointers is checked on every replay, and a call that fails a check takes the
full path, which decides and words the error:
- every pointer has the residue mod 16 the recorded call's had (so the alignment rules hold as they
  did), and is null exactly where the recorded one was;
- every given written array's bytes are disjoint from every other array's.

Only exact ``torch.Tensor`` objects (no subclass: a FakeTensor or a DTensor is not memory hipattn
can launch on) are replayed; every other array kind, a given ``stream`` combined with an
allocated output, ``HIPATTN_CHECK=1`` and ``HIPATTN_LOG=debug`` always take the full path. The plans
live on the runtime (``Runtime.launch_plans``), so installing another runtime starts with none.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import sys
from collections.abc import Callable
from typing import Any

from . import checks
from .dispatch import SMALLSEQ_SWITCH
from .env import raw_reader
from .jit.params import TENSOR_MAP, TENSOR_MAP_BYTES
from .log import logger
from .ops.smallseq import KERNEL_SWITCH
from .problem import extent
from .streams import on_device, resolve_stream, torch_current_stream

_RESIDUE_MASK = 15  # pointers compare by their residue mod 16, the widest alignment a kernel needs
_POINTER = struct.Struct("<Q")
_WORKSPACE = -1  # the slot of a pointer into the call's workspace

_SCALAR_TYPES = frozenset((int, float, bool, type(None)))

# Plans per runtime are capped: a workload with ever-new shapes would otherwise grow it without end.
MAX_PLANS = 512


class Launch:
    """One recorded kernel launch: its argument struct as bytes, where its pointers go, and which of
    its tensor maps describe which slot's array."""

    __slots__ = ("kernel", "grid", "block", "shared_bytes", "struct_class", "template", "pointers", "tensor_maps",
                 "encode_map")

    def __init__(self, kernel: Any, grid, block, shared_bytes: int, params: ctypes.Structure,
                 pointers: tuple[tuple[int, int, int], ...], tensor_maps: tuple[tuple[int, int, Any], ...] = (),
                 encode_map: Callable[[int, Any], Any] | None = None):
        self.kernel = kernel
        self.grid, self.block, self.shared_bytes = grid, block, shared_bytes
        self.struct_class = type(params)
        self.template = bytes(params)
        self.pointers = pointers  # (byte offset in the struct, slot or _WORKSPACE, bytes past that pointer)
        self.tensor_maps = tensor_maps  # (byte offset in the struct, slot, TensorMapLayout)
        self.encode_map = encode_map  # (address, layout) -> the map's bytes: the runtime's cache

    def run(self, stream: int, ptrs: list[int], workspace: int) -> None:
        buffer = bytearray(self.template)
        for offset, slot, past in self.pointers:
            _POINTER.pack_into(buffer, offset, (workspace if slot == _WORKSPACE else ptrs[slot]) + past)
        for offset, slot, layout in self.tensor_maps:
            buffer[offset:offset + TENSOR_MAP_BYTES] = bytes(self.encode_map(ptrs[slot], layout))
        self.kernel.launch(self.grid, self.block, self.shared_bytes, stream, self.struct_class.from_buffer(buffer))


class Plan:
    """What a validated call of one signature launches, and how to check a new call's pointers."""

    __slots__ = ("device", "launches", "residues", "disjoint", "allocate", "workspace_bytes")

    def __init__(self, device: int, launches: tuple[Launch, ...], residues: tuple, disjoint: tuple,
                 allocate: tuple, workspace_bytes: int):
        self.device = device
        self.launches = launches
        # (slot, ptr % 16 or None for a null pointer) of every array the caller gave.
        self.residues = residues
        # (written slot, other slot, its span, the other's span) of every pair that must not share a
        # byte. Spans are (first byte, end byte) relative to the pointer.
        self.disjoint = disjoint
        # (slot, (first array) -> new array) of each output the caller left to hipattn.
        self.allocate = allocate
        self.workspace_bytes = workspace_bytes


_read_check = raw_reader(checks.SWITCH)
# The switches the full path reads on every call to choose a kernel: part of the signature.
_read_switches = tuple(raw_reader(name) for name in (KERNEL_SWITCH, SMALLSEQ_SWITCH))


def signature(kind: str, arrays: tuple, scalars: tuple, stream: Any, outputs: tuple[int, ...]) -> tuple | None:
    """The plan key of a call of ``kind`` (its output slots ``outputs``), or None when the call must
    take the full path."""
    torch = sys.modules.get("torch")
    if torch is None or (_read_check() is not None and checks.enabled()) or logger.isEnabledFor(logging.DEBUG):
        return None  # HIPATTN_LOG=debug logs every call's path, which only the full path decides
    tensor, strided = torch.Tensor, torch.strided
    described = [kind]
    append = described.append
    for a in arrays:
        if a is None:
            append(None)
        elif type(a) is tensor and a.layout is strided:  # a sparse tensor reports strides too
            append((a.dtype, a.shape, a.stride(), a.get_device()))
        else:
            return None
    if stream is not None:
        for slot in outputs:
            if arrays[slot] is None:
                return None  # an allocation for another stream than the current one: the full path's care
    for value in scalars:
        if type(value) not in _SCALAR_TYPES:
            return None  # an array or a mutable number: its value could change under an equal key
        append((type(value), value))  # True == 1 == 1.0, but the checks tell them apart
    append(stream is None)
    for read in _read_switches:
        append(read())
    return tuple(described)


def replay(plan: Plan, backend: Any, arrays: tuple, stream: Any) -> list | None:
    """Launch ``plan`` for ``arrays``; returns the call's arrays with the allocated outputs filled in,
    or None (nothing enqueued) when a pointer check fails."""
    ptrs = [0 if a is None else a.data_ptr() for a in arrays]
    for slot, residue in plan.residues:
        ptr = ptrs[slot]
        if (ptr & _RESIDUE_MASK if ptr else None) != residue:
            return None
    for written, other, span, other_span in plan.disjoint:
        if ptrs[other] + other_span[0] < ptrs[written] + span[1] and ptrs[written] + span[0] < ptrs[other] + other_span[1]:
            return None
    with on_device(backend, plan.device):
        launch_stream = torch_current_stream(plan.device) if stream is None else resolve_stream(
            (), stream, device=plan.device)
        results = list(arrays)
        for slot, new in plan.allocate:
            results[slot] = new(arrays[0])
            ptrs[slot] = results[slot].data_ptr()
        # Freed on return: torch's allocator is stream-ordered, so the memory is not handed out again
        # before the launch stream has passed the kernels that use it.
        workspace = arrays[0].new_empty((plan.workspace_bytes,), dtype=sys.modules["torch"].uint8) if (
            plan.workspace_bytes) else None
        workspace_ptr = workspace.data_ptr() if workspace is not None else 0
        for launch in plan.launches:
            launch.run(launch_stream, ptrs, workspace_ptr)
    return results


def record(launches: list, arrays: tuple, described: tuple, names: tuple[str, ...], made: dict,
           written: tuple[int, ...], workspace=None, runtime=None) -> Plan | None:
    """The plan of a call that just ran the full path, from its recorded launches
    (``registry.recording_launches``), its arrays as given and as described (DeviceArrays, with the
    outputs the call allocated), the kernel field name of each slot, ``made`` (slot -> the object the
    call allocated for an output left out), the slots it writes, its workspace (a DeviceArray, or
    None) and the runtime whose tensor maps its launches were handed; None when the call did something
    a plan cannot replay.

    A kernel pointer belongs to the slot of its field's name when it holds that slot's pointer
    (cu_seqlens_q and cu_seqlens_k are often one array); else to the one slot that holds it; else to
    the workspace; else (no array or two of them) there is no plan. A tensor map (field ``NAME_map``)
    belongs to the slot whose pointer it was encoded from, found the same way, and a replay encodes the
    same layout at that slot's new pointer."""
    ptrs = [0 if d is None else d.ptr for d in described]
    slot_of_name = {name: slot for slot, name in enumerate(names)}
    by_pointer: dict[int, int] = {}
    for slot, ptr in enumerate(ptrs):
        if ptr:
            by_pointer[ptr] = -2 if ptr in by_pointer else slot  # -2: two arrays share it
    base, size = (workspace.ptr, workspace.nbytes) if workspace is not None else (0, 0)

    def slot_holding(name: str, value: int) -> int | None:
        """The slot of field ``name`` when it holds that slot's pointer, else the one slot that holds
        ``value`` (-2: two do), else None."""
        slot = slot_of_name.get(name)
        if slot is None or ptrs[slot] != value:
            slot = by_pointer.get(value)
        return slot

    recorded = []
    for kernel, grid, block, shared_bytes, params in launches:
        pointers, tensor_maps = [], []
        for name, kind in kernel.params.fields:
            offset = getattr(type(params), name).offset
            if kind == TENSOR_MAP:
                origin = runtime.tensor_maps.origin(bytes(getattr(params, name))) if runtime is not None else None
                slot = slot_holding(name.removesuffix("_map"), origin[0]) if origin is not None else None
                if slot is None or slot == -2:
                    return None
                tensor_maps.append((offset, slot, origin[1]))
                continue
            if kind not in ("ptr", "const_ptr"):
                continue
            value = getattr(params, name)
            if not value:
                continue  # null in every replay: the residues keep the arrays that could fill it null
            slot = slot_holding(name, value)
            if slot is None and base <= value < base + size:
                slot, past = _WORKSPACE, value - base
            elif slot is None or slot == -2:
                return None
            else:
                past = 0
            pointers.append((offset, slot, past))
        recorded.append(Launch(kernel, grid, block, shared_bytes, params, tuple(pointers), tuple(tensor_maps),
                               runtime.tensor_map if tensor_maps else None))
    given = [slot for slot, a in enumerate(arrays) if a is not None]
    residues = tuple((slot, ptrs[slot] & _RESIDUE_MASK if ptrs[slot] else None) for slot in given)
    spans = [None if arrays[slot] is None else _relative_span(d) for slot, d in enumerate(described)]
    disjoint = tuple(
        (w, other, spans[w], spans[other])
        for w in written if spans[w] is not None
        for other in range(len(spans)) if other != w and spans[other] is not None
        and not (other in written and other < w))
    allocate = tuple((slot, _allocator(obj)) for slot, obj in made.items())
    return Plan(described[0].device, tuple(recorded), residues, disjoint, allocate, size)


def _relative_span(a) -> tuple[int, int] | None:
    """(first, end) byte of ``a`` relative to its pointer; None when it holds no element."""
    start, end = extent(a)
    return None if start == end else (start - a.ptr, end - a.ptr)


def _allocator(made: Any) -> Callable[[Any], Any]:
    """``(first array) -> a new tensor`` like ``made`` (which the recorded call allocated: contiguous,
    on that array's device), on the current stream. ``new_empty`` rather than ``torch.empty``: it
    parses no device argument, a few microseconds per call."""
    shape, dtype = tuple(made.shape), made.dtype
    return lambda first: first.new_empty(shape, dtype=dtype)
