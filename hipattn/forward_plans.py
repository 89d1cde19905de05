"""Repeat forward calls on torch tensors: the launch a validated call made, replayed for the next
call of the same signature.

The full path of a call (attention.forward) describes and validates every argument, dispatches,
and builds the kernel's argument struct: tens of microseconds of Python, which decode steps and
small layers feel. Almost all of it depends only on the call's *signature*: per array its dtype,
shape, strides and device; the host scalars; which outputs were given; the switches read per call.
So the first call of a signature runs the full path and records what it launched, and a later call
of that signature replays it with the new pointers.

What depends on the pointers is checked on every replay, and a call that fails a check takes the
full path, which decides and words the error:
- every pointer has the residue mod 16 the recorded call's had (so the alignment rules hold as they
  did), and is null exactly where the recorded one was;
- every caller-given output's bytes are disjoint from every input's and from the other outputs'.

Only exact ``torch.Tensor`` objects (no subclass: a FakeTensor or a DTensor is not memory hipattn
can launch on) are replayed; every other array kind, a given ``stream`` combined with an
allocated output, ``HIPATTN_CHECK=1`` and ``HIPATTN_LOG=debug`` always take the full path. The plans live on the
runtime (``Runtime.forward_plans``), so installing another runtime starts with none.
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
from .log import logger
from .ops.smallseq import KERNEL_SWITCH
from .problem import extent
from .streams import on_device, resolve_stream, torch_current_stream

# The arrays of a forward call, in the order the plans index them; kernel pointer fields name them
# the same way, except the output ("o").
SLOTS = ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")
_OUTPUTS = (SLOTS.index("out"), SLOTS.index("lse"))
_FIELD_SLOT = {("o" if name == "out" else name): i for i, name in enumerate(SLOTS)}
_RESIDUE_MASK = 15  # pointers compare by their residue mod 16, the widest alignment a kernel needs
_POINTER = struct.Struct("<Q")

_SCALAR_TYPES = frozenset((int, float, bool, type(None)))

# Plans per runtime are capped: a workload with ever-new shapes would otherwise grow it without end.
MAX_PLANS = 512


class Launch:
    """One recorded kernel launch: its argument struct as bytes, and where its pointers go."""

    __slots__ = ("kernel", "grid", "block", "shared_bytes", "struct_class", "template", "pointers")

    def __init__(self, kernel: Any, grid, block, shared_bytes: int, params: ctypes.Structure,
                 pointers: tuple[tuple[int, int], ...]):
        self.kernel = kernel
        self.grid, self.block, self.shared_bytes = grid, block, shared_bytes
        self.struct_class = type(params)
        self.template = bytes(params)
        self.pointers = pointers  # (byte offset in the struct, slot)

    def run(self, stream: int, ptrs: list[int]) -> None:
        buffer = bytearray(self.template)
        for offset, slot in self.pointers:
            _POINTER.pack_into(buffer, offset, ptrs[slot])
        self.kernel.launch(self.grid, self.block, self.shared_bytes, stream, self.struct_class.from_buffer(buffer))


class Plan:
    """What a validated forward call of one signature launches, and how to check a new call's pointers."""

    __slots__ = ("device", "launches", "residues", "disjoint", "allocate")

    def __init__(self, device: int, launches: tuple[Launch, ...], residues: tuple, spans: tuple,
                 allocate: tuple):
        self.device = device
        self.launches = launches
        # (slot, ptr % 16 or None for a null pointer) of every array the caller gave.
        self.residues = residues
        # (output slot, other slot, output span, other span) of every pair that must not share a byte:
        # each given output against every other array that holds elements. Spans are (first byte, end
        # byte) relative to the pointer.
        self.disjoint = tuple(
            (output, other, spans[output], spans[other])
            for output in _OUTPUTS if spans[output] is not None
            for other in range(len(spans)) if other != output and spans[other] is not None
            and not (other in _OUTPUTS and other < output))
        # (slot, (q) -> new array) of each output the caller left to hipattn.
        self.allocate = allocate


_read_check = raw_reader(checks.SWITCH)
# The switches the full path reads on every call to choose a kernel: part of the signature.
_read_switches = tuple(raw_reader(name) for name in (KERNEL_SWITCH, SMALLSEQ_SWITCH))


def signature(arrays: tuple, scalars: tuple, stream: Any) -> tuple | None:
    """The call's plan key, or None when the call must take the full path."""
    torch = sys.modules.get("torch")
    if torch is None or (_read_check() is not None and checks.enabled()) or logger.isEnabledFor(logging.DEBUG):
        return None  # HIPATTN_LOG=debug logs every call's path, which only the full path decides
    tensor, strided = torch.Tensor, torch.strided
    described = []
    append = described.append
    for a in arrays:
        if a is None:
            append(None)
        elif type(a) is tensor and a.layout is strided:  # a sparse tensor reports strides too
            append((a.dtype, a.shape, a.stride(), a.get_device()))
        else:
            return None
    if stream is not None and (arrays[3] is None or arrays[4] is None):
        return None  # an allocation for another stream than the current one: the full path's care
    typed_scalars = []
    for value in scalars:
        if type(value) not in _SCALAR_TYPES:
            return None  # an array or a mutable number: its value could change under an equal key
        typed_scalars.append((type(value), value))  # True == 1 == 1.0, but the checks tell them apart
    return (*described, *typed_scalars, stream is None, *(read() for read in _read_switches))


def replay(plan: Plan, backend: Any, arrays: tuple, stream: Any) -> tuple[Any, Any] | None:
    """Launch ``plan`` for ``arrays``, or None (nothing enqueued) when a pointer check fails."""
    ptrs = [0 if a is None else a.data_ptr() for a in arrays]
    for slot, residue in plan.residues:
        ptr = ptrs[slot]
        if (ptr & _RESIDUE_MASK if ptr else None) != residue:
            return None
    for output, other, span, other_span in plan.disjoint:
        if ptrs[other] + other_span[0] < ptrs[output] + span[1] and ptrs[output] + span[0] < ptrs[other] + other_span[1]:
            return None
    with on_device(backend, plan.device):
        launch_stream = torch_current_stream(plan.device) if stream is None else resolve_stream(
            (), stream, device=plan.device)
        return _launch(plan, arrays, ptrs, launch_stream)


def _launch(plan: Plan, arrays: tuple, ptrs: list[int], stream: int) -> tuple[Any, Any]:
    """Allocate what the caller left to hipattn, and enqueue the plan's kernels on ``stream``."""
    results = list(arrays)
    for slot, new in plan.allocate:
        results[slot] = new(arrays[0])
        ptrs[slot] = results[slot].data_ptr()
    for launch in plan.launches:
        launch.run(stream, ptrs)
    return results[3], results[4]


def record(launches: list, arrays: tuple, described: tuple, out_obj: Any, lse_obj: Any) -> Plan | None:
    """The plan of a call that just ran the full path, from its recorded launches
    (``registry.recording_launches``) and its arrays as given and as described (DeviceArrays, with
    the outputs the call allocated); None when the call did something a plan cannot replay."""
    recorded = []
    ptrs = [0 if d is None else d.ptr for d in described]
    for kernel, grid, block, shared_bytes, params in launches:
        pointers = []
        for name, kind in kernel.params.fields:
            if kind not in ("ptr", "const_ptr"):
                continue
            slot = _FIELD_SLOT.get(name)
            value = getattr(params, name)
            if slot is None or value != ptrs[slot]:
                return None  # a pointer that is not one of the call's arrays (a workspace, an offset view)
            pointers.append((getattr(type(params), name).offset, slot))
        recorded.append(Launch(kernel, grid, block, shared_bytes, params, tuple(pointers)))
    given = [slot for slot, a in enumerate(arrays) if a is not None]
    residues = tuple((slot, ptrs[slot] & _RESIDUE_MASK if ptrs[slot] else None) for slot in given)
    spans = tuple(None if arrays[slot] is None else _relative_span(d) for slot, d in enumerate(described))
    allocate = tuple((slot, _allocator(slot, made)) for slot, made in zip(_OUTPUTS, (out_obj, lse_obj), strict=True)
                     if arrays[slot] is None)
    return Plan(described[0].device, tuple(recorded), residues, spans, allocate)


def _relative_span(a) -> tuple[int, int] | None:
    """(first, end) byte of ``a`` relative to its pointer; None when it holds no element."""
    start, end = extent(a)
    return None if start == end else (start - a.ptr, end - a.ptr)


def _allocator(slot: int, made: Any) -> Callable[[Any], Any]:
    """``(q) -> a new tensor`` like ``made`` (which the recorded call allocated: contiguous, on q's
    device), on the current stream. ``q.new_empty`` rather than ``torch.empty``: it parses no dtype
    or device arguments, a few microseconds per call."""
    shape = tuple(made.shape)
    if slot == _OUTPUTS[0]:  # out: q's dtype
        return lambda q: q.new_empty(shape)
    float32 = sys.modules["torch"].float32
    return lambda q: q.new_empty(shape, dtype=float32)
