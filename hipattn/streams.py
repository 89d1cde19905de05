"""Which device and which stream one call launches on.

The order is the contract (docs/ARCHITECTURE.md, "The path of one call"): find the arrays' device, make it
current, and only then take the stream. A framework's "current stream" is per device, so asking
before the guard returns the stream of whatever device happened to be current, and the work is
enqueued on a stream of the wrong device::

    arrays = [as_device_array(q, "q", stream=explicit), ...]
    device = launch_device(arrays)
    with on_device(backend, device):
        stream = resolve_stream(arrays, stream_argument, device=device)
        ... enqueue everything on `stream` ...

This runs on every launch, so it is kept lean: framework modules are read from ``sys.modules``
(never imported here: a torch tensor means torch is loaded), and the guard is a slotted class.

Default streams. Handle 0 is the NULL stream: the legacy default stream, unless the process runs
in per-thread default-stream mode (CUDA's ``--default-stream per-thread`` / cuda-bindings'
``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1``; HIP's ``-fgpu-default-stream=per-thread``), in
which case 0 means the calling thread's stream. The legacy stream synchronises with every
blocking stream, but not with streams created non-blocking (PyTorch's pool streams are). A
caller mixing threads or non-blocking streams should pass ``stream=`` explicitly.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from .backends.base import Backend
from .device_array import UNKNOWN_DEVICE, DeviceArray

# CAI v3 and DLPack spell the legacy default stream 1 (0 is reserved as ambiguous there); as a
# launch handle the NULL stream 0 means the same thing on both vendors (HIP has no handle 1).
_PROTOCOL_LEGACY_STREAM = 1
LEGACY_DEFAULT_STREAM = 0


def launch_device(arrays: Sequence[DeviceArray], names: Sequence[str] | None = None) -> int:
    """The one device all ``arrays`` live on; ValueError naming the first two that disagree.

    ``names`` (parallel to ``arrays``) are used in the message; without them arrays are named by
    position. Arrays whose device is unknown (a CAI producer that does not say) follow the rest.
    """
    device = UNKNOWN_DEVICE
    first = -1
    for i, array in enumerate(arrays):
        d = array.device
        if d == UNKNOWN_DEVICE:
            continue
        if device == UNKNOWN_DEVICE:
            device, first = d, i
        elif d != device:
            a = names[first] if names else f"array {first}"
            b = names[i] if names else f"array {i}"
            raise ValueError(
                f"{a} is on device {device} but {b} is on device {d}; hipattn needs every array of one "
                "call on the same device"
            )
    if device == UNKNOWN_DEVICE:
        raise ValueError(
            "cannot tell which device the arrays live on (their __cuda_array_interface__ does not say); "
            "describe one with hipattn.arrays.raw_array(..., device=N) or pass torch/CuPy/DLPack arrays"
        )
    return device


class on_device:  # noqa: N801 - used as a context manager, named like one
    """Make ``device`` current on this thread for the block; restore the previous device on exit.

    One ``get_device`` call when the device is already current (the common case); otherwise a
    ``set_device`` on entry and another on exit, also when the block raises.
    """

    __slots__ = ("_backend", "_device", "_previous")

    def __init__(self, backend: Backend, device: int):
        self._backend = backend
        self._device = device
        self._previous: int | None = None

    def __enter__(self) -> int:
        previous = self._backend.get_device()
        if previous != self._device:
            self._backend.set_device(self._device)
            self._previous = previous
        return self._device

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            previous, self._previous = self._previous, None
            self._backend.set_device(previous)


def resolve_stream(arrays: Sequence[DeviceArray], stream: Any = None, *, device: int | None = None) -> int:
    """The stream handle to launch on. Call inside ``on_device``: defaults are per device.

    ``stream`` may be an int handle, a ``torch.cuda.Stream`` (``cuda_stream``), a CuPy stream
    (``ptr``), or anything with ``__cuda_stream__`` (returns ``(version, handle)``). None means:
    the current stream of the first array's framework on ``device`` (torch, CuPy), else the first
    CAI v3 producer stream, else the legacy default stream (0).
    """
    if stream is None:
        return _default_stream(arrays, _device_of(arrays) if device is None else device)
    if type(stream) is int:
        handle = stream
    else:
        handle = _stream_handle(stream)
        stream_device = _stream_device(stream)
        if stream_device is not None:
            expected = _device_of(arrays) if device is None else device
            if expected != UNKNOWN_DEVICE and stream_device != expected:
                raise ValueError(
                    f"stream belongs to device {stream_device} but the arrays are on device {expected}"
                )
    if handle < 0 or handle >> 64:
        what = "negative" if handle < 0 else "wider than 64 bits"
        raise ValueError(f"stream handle {handle} is {what}; expected a stream pointer (0 <= handle < 2**64) or 0")
    return handle


def producer_streams(arrays: Sequence[DeviceArray], launch_stream: int) -> tuple[int, ...]:
    """CAI v3 producer streams other than ``launch_stream``: the launch stream must wait on each
    (record an event there, wait on it here) before reading those arrays."""
    waits: list[int] = []
    for array in arrays:
        s = array.stream
        if s is not None:
            s = LEGACY_DEFAULT_STREAM if s == _PROTOCOL_LEGACY_STREAM else s
            if s != launch_stream and s not in waits:
                waits.append(s)
    return tuple(waits)


def wait_for_producers(backend: Backend, arrays: Sequence[DeviceArray], launch_stream: int) -> None:
    """Order ``launch_stream`` after the pending writes of each CAI v3 producer stream.

    An event recorded on the producer's stream and waited on by the launch stream: the host never
    blocks. The event is destroyed at once; the runtime keeps it until the wait has resolved.
    """
    for producer in producer_streams(arrays, launch_stream):
        event = backend.event_create()
        try:
            backend.event_record(event, producer)
            backend.stream_wait_event(launch_stream, event)
        finally:
            backend.event_destroy(event)


# ---- internals --------------------------------------------------------------------------------


def _device_of(arrays: Sequence[DeviceArray]) -> int:
    for array in arrays:
        if array.device != UNKNOWN_DEVICE:
            return array.device
    return UNKNOWN_DEVICE


def _default_stream(arrays: Sequence[DeviceArray], device: int) -> int:
    producer = None
    for array in arrays:
        framework = array.framework
        if framework == "torch":
            return torch_current_stream(device)
        if framework == "cupy":
            return _cupy_current_stream(device)
        if producer is None and array.stream is not None:
            producer = array.stream
    if producer is not None:
        return LEGACY_DEFAULT_STREAM if producer == _PROTOCOL_LEGACY_STREAM else producer
    return LEGACY_DEFAULT_STREAM


# (torch module, torch._C._cuda_getCurrentRawStream or None), looked up once per module object.
_torch_raw_stream: tuple[Any, Any] = (None, None)


def torch_current_stream(device: int) -> int:
    """``torch.cuda.current_stream(device).cuda_stream``, without building a Stream object.

    The public call checks lazy initialisation, normalises the device and constructs a Python
    ``torch.cuda.Stream`` (several microseconds per launch); ``_cuda_getCurrentRawStream`` (what
    torch.compile's generated code calls, on CUDA and ROCm builds alike) returns the same handle
    directly. It is used only once torch's CUDA state is initialised and healthy: otherwise (first
    use, a forked child, a torch without it) the public call runs, with its own errors.
    """
    global _torch_raw_stream
    torch = sys.modules["torch"]
    module, raw = _torch_raw_stream
    if module is not torch:
        raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
        _torch_raw_stream = (torch, raw)
    cuda = torch.cuda
    if raw is not None and cuda.is_initialized():
        return raw(device)
    return cuda.current_stream(device).cuda_stream


# Whether cupy.cuda.get_current_stream accepts a device id (it does from CuPy 13); probed once.
_cupy_takes_device: bool | None = None


def _cupy_current_stream(device: int) -> int:
    global _cupy_takes_device
    get_current_stream = sys.modules["cupy"].cuda.get_current_stream
    if _cupy_takes_device is not False:
        try:
            handle = get_current_stream(device).ptr
            _cupy_takes_device = True
            return handle
        except TypeError:
            _cupy_takes_device = False
    # Older CuPy: the current stream of the current device, which the guard has made `device`.
    return get_current_stream().ptr


def _stream_handle(stream: Any) -> int:
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol()
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(f"stream.__cuda_stream__() must return (version, handle); got {value!r}")
        handle = value[1]
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise TypeError(f"stream.__cuda_stream__() returned handle {handle!r}; expected an int")
        return int(handle)
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        handle = getattr(stream, attr, None)
        if isinstance(handle, int) and not isinstance(handle, bool):
            return handle
    if isinstance(stream, bool):
        raise TypeError("stream must be a stream handle or object, not a bool")
    if isinstance(stream, int):  # an int subclass (e.g. a ctypes-derived handle type)
        return int(stream)
    handle = getattr(stream, "value", None)  # ctypes.c_void_p
    if type(stream).__module__ == "ctypes" and (handle is None or isinstance(handle, int)):
        return handle or 0
    raise TypeError(
        f"stream has type {type(stream).__module__}.{type(stream).__qualname__}; expected an int handle, a "
        "torch.cuda.Stream, a CuPy stream, or an object with __cuda_stream__"
    )


def _stream_device(stream: Any) -> int | None:
    # torch.cuda.Stream has device_index; CuPy streams have device_id (CuPy 13+). Others: unknown.
    for attr in ("device_index", "device_id"):
        value = getattr(stream, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
