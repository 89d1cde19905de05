"""Device, then stream: the guard makes the arrays' device current before any stream is taken."""

from __future__ import annotations

import sys
import time
import types

import pytest

from hipattn.arrays import raw_array
from hipattn.device_array import DeviceArray
from hipattn.streams import on_device, producer_streams, resolve_stream, wait_for_producers


class FakeBackend:
    """Only what the guard uses: a per-thread current device, and a log of calls."""

    def __init__(self, current: int = 0):
        self.current = current
        self.calls: list[tuple] = []

    def get_device(self) -> int:
        self.calls.append(("get_device",))
        return self.current

    def set_device(self, device: int) -> None:
        self.calls.append(("set_device", device))
        self.current = device


def _array(framework: str, device: int, stream: int | None = None) -> DeviceArray:
    return DeviceArray(0x1000, (2, 2), (2, 1), "fp16", device, framework, stream=stream)


@pytest.fixture
def fake_frameworks(monkeypatch):
    """torch and cupy whose 'current stream' calls record which device was current when asked:
    the stream handle encodes that device, as a real per-device current stream would."""
    backend = FakeBackend(current=0)
    seen: list[tuple[str, int, int | None]] = []

    def torch_current_stream(device):
        seen.append(("torch", backend.current, device))
        return types.SimpleNamespace(cuda_stream=0x1000 + backend.current)

    def cupy_get_current_stream(device_id=None):
        seen.append(("cupy", backend.current, device_id))
        return types.SimpleNamespace(ptr=0x2000 + backend.current)

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(current_stream=torch_current_stream)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(get_current_stream=cupy_get_current_stream)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return backend, seen


@pytest.mark.parametrize("framework, base", [("torch", 0x1000), ("cupy", 0x2000)])
def test_device_is_current_before_the_stream_is_resolved(fake_frameworks, framework, base):
    backend, seen = fake_frameworks
    arrays = [_array(framework, 1), _array(framework, 1)]
    with on_device(backend, 1):
        stream = resolve_stream(arrays, None)
    assert seen == [(framework, 1, 1)], "the framework was asked with the arrays' device current"
    assert stream == base + 1, "the stream of device 1, not of the device current at entry (0)"
    assert backend.current == 0, "the previous device is restored"
    assert backend.calls == [("get_device",), ("set_device", 1), ("set_device", 0)]


def test_already_current_device_costs_one_get_device(fake_frameworks):
    backend, _ = fake_frameworks
    backend.current = 2
    with on_device(backend, 2):
        resolve_stream([_array("torch", 2)], None)
    assert backend.calls == [("get_device",)]


def test_previous_device_restored_when_the_block_raises(fake_frameworks):
    backend, _ = fake_frameworks
    with pytest.raises(RuntimeError, match="launch failed"), on_device(backend, 3):
        assert backend.current == 3
        raise RuntimeError("launch failed")
    assert backend.current == 0
    assert backend.calls[-1] == ("set_device", 0)


def test_failing_set_device_leaves_nothing_to_restore():
    class Refuses(FakeBackend):
        def set_device(self, device):
            raise RuntimeError("no such device")

    backend = Refuses(current=0)
    with pytest.raises(RuntimeError, match="no such device"), on_device(backend, 7):
        pass
    assert backend.current == 0


def test_default_without_framework_uses_cai_v3_stream_then_legacy_default():
    assert resolve_stream([_array("cai", 0, stream=0x7700)], None) == 0x7700
    assert resolve_stream([_array("cai", 0, stream=1)], None) == 0, "CAI's legacy marker 1 is handle 0"
    assert resolve_stream([_array("cai", 0, stream=2)], None) == 2, "per-thread default stays 2"
    assert resolve_stream([raw_array(0x10, (1,), "fp16", 0)], None) == 0


def test_explicit_streams_of_every_spelling():
    arrays = [_array("raw", 1)]
    assert resolve_stream(arrays, 0xBEEF) == 0xBEEF
    assert resolve_stream(arrays, types.SimpleNamespace(cuda_stream=0x11, device_index=1)) == 0x11
    assert resolve_stream(arrays, types.SimpleNamespace(ptr=0x22, device_id=1)) == 0x22

    class ProtocolStream:
        def __cuda_stream__(self):
            return (0, 0x33)

    assert resolve_stream(arrays, ProtocolStream()) == 0x33


def test_explicit_stream_of_another_device_is_rejected():
    with pytest.raises(ValueError, match="device 0 but the arrays are on device 1"):
        resolve_stream([_array("torch", 1)], types.SimpleNamespace(cuda_stream=0x11, device_index=0))


def test_bad_streams_are_rejected():
    with pytest.raises(TypeError, match="expected an int handle"):
        resolve_stream([_array("raw", 0)], "default")
    with pytest.raises(ValueError, match="negative"):
        resolve_stream([_array("raw", 0)], -5)
    with pytest.raises(TypeError, match="not a bool"):
        resolve_stream([_array("raw", 0)], True)


def test_producer_streams_lists_streams_the_launch_must_wait_on():
    arrays = [_array("cai", 0, stream=0x50), _array("cai", 0, stream=0x60), _array("cai", 0, stream=0x50)]
    assert producer_streams(arrays, 0x60) == (0x50,)
    assert producer_streams([_array("cai", 0, stream=1)], 0) == ()


def test_guard_and_resolution_are_cheap(fake_frameworks):
    """Runs on every launch: guard + resolution must stay in the low microseconds."""
    backend, _ = fake_frameworks
    backend.current = 1
    backend.calls = []
    arrays = [_array("torch", 1)] * 4
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        with on_device(backend, 1):
            resolve_stream(arrays, None)
    per_call = (time.perf_counter() - start) / n
    assert per_call < 20e-6, f"{per_call * 1e6:.1f} µs per guard + resolve"


class EventBackend:
    """Records the event calls wait_for_producers makes, in order."""

    def __init__(self):
        self.calls: list[tuple] = []
        self._next = 100

    def event_create(self, timing: bool = False) -> int:
        self._next += 1
        self.calls.append(("event_create", self._next))
        return self._next

    def event_record(self, event: int, stream: int) -> None:
        self.calls.append(("event_record", event, stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.calls.append(("stream_wait_event", stream, event))

    def event_destroy(self, event: int) -> None:
        self.calls.append(("event_destroy", event))


def test_the_launch_stream_waits_for_each_cai_v3_producer_stream_without_blocking_the_host():
    backend = EventBackend()
    inputs = [_array("cai", 0, stream=0x1234), _array("cai", 0, stream=0x1234), _array("cai", 0, stream=7),
              _array("cai", 0, stream=0x5678), _array("raw", 0)]
    wait_for_producers(backend, inputs, launch_stream=7)
    assert backend.calls == [
        ("event_create", 101), ("event_record", 101, 0x1234), ("stream_wait_event", 7, 101), ("event_destroy", 101),
        ("event_create", 102), ("event_record", 102, 0x5678), ("stream_wait_event", 7, 102), ("event_destroy", 102),
    ]


def test_inputs_already_on_the_launch_stream_cost_no_event():
    backend = EventBackend()
    wait_for_producers(backend, [_array("cai", 0, stream=7), _array("torch", 0)], launch_stream=7)
    assert backend.calls == []
