"""Pinned blocks return to the pool only after the stream reaches their host function; host
functions need no GIL; Python host functions run on the driver's thread and survive replays.

A fake backend records each ``launch_host_func(stream, fn_address, user_data)``; a fake driver
thread later calls the C function pointer through ctypes, as the runtime's callback thread would
when the stream reaches it.
"""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

from hipattn import pinned
from hipattn.pinned import (
    MIN_BLOCK_BYTES,
    PinnedPool,
    Semaphore,
    device_pool,
    launch_python_host_func,
    pending_host_funcs,
    size_class,
)

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_libc = ctypes.CDLL(None)


class FakeBackend:
    """Pinned memory from ctypes buffers; host functions queued per stream until the driver runs them."""

    def __init__(self):
        self.buffers: dict[int, ctypes.Array] = {}
        self.queues: dict[int, list[tuple[int, int]]] = {}
        self.capturing: set[int] = set()
        self.freed: list[int] = []

    def host_alloc(self, nbytes: int) -> int:
        buffer = ctypes.create_string_buffer(nbytes)
        self.buffers[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def host_free(self, ptr: int) -> None:
        del self.buffers[ptr]
        self.freed.append(ptr)

    def launch_host_func(self, stream: int, function_address: int, user_data: int) -> None:
        if not isinstance(function_address, int):  # the hip-python trap: only the int address is right
            raise TypeError("function_address must be an int")
        self.queues.setdefault(stream, []).append((function_address, user_data))

    def stream_is_capturing(self, stream: int) -> bool:
        return stream in self.capturing


class FakeDriver:
    """Runs queued host functions on its own thread, in stream order, through their C addresses."""

    def __init__(self, backend: FakeBackend):
        self.backend = backend
        self.thread_ids: list[int] = []

    def _run(self, calls: list[tuple[int, int]]) -> None:
        self.thread_ids.append(threading.get_ident())
        for address, user_data in calls:
            _HOST_FN(address)(user_data)

    def start(self, stream: int, count: int | None = None, keep: bool = False) -> threading.Thread:
        queue = self.backend.queues.get(stream, [])
        calls = list(queue[:count] if count is not None else queue)
        if not keep:  # a graph's host nodes stay; a stream's callbacks run once
            del queue[: len(calls)]
        thread = threading.Thread(target=self._run, args=(calls,), daemon=True)
        thread.start()
        return thread

    def run(self, stream: int, count: int | None = None, keep: bool = False) -> None:
        thread = self.start(stream, count, keep)
        thread.join(timeout=10)
        assert not thread.is_alive(), "the fake driver thread hung"


@pytest.fixture
def backend():
    return FakeBackend()


@pytest.fixture
def driver(backend):
    return FakeDriver(backend)


def test_size_classes_are_powers_of_two_from_4k():
    assert size_class(0) == size_class(1) == size_class(4096) == MIN_BLOCK_BYTES
    assert size_class(4097) == 8192
    assert size_class(1 << 20) == 1 << 20
    assert size_class((1 << 20) + 1) == 2 << 20
    with pytest.raises(ValueError):
        size_class(-1)


def test_block_has_a_writable_numpy_view_of_its_memory(backend):
    block = PinnedPool(backend).acquire(100)
    assert block.nbytes == 4096 and block.array.shape == (4096,) and block.array.dtype.name == "uint8"
    block.array[:4] = [1, 2, 3, 4]
    assert ctypes.string_at(block.ptr, 4) == bytes([1, 2, 3, 4])


def test_block_is_reused_only_after_the_stream_reaches_its_host_function(backend, driver):
    pool = PinnedPool(backend)
    block = pool.acquire(5000)
    pool.release_after(7, block)
    assert backend.queues[7] == [(pinned.SEM_POST_ADDRESS, backend.queues[7][0][1])]
    assert pool.stats().in_flight_blocks == 1

    other = pool.acquire(5000)
    assert other.ptr != block.ptr, "still in flight: must not be handed out again"
    pool.release(other)

    driver.run(7)
    assert pool.collect() == 1
    again = pool.acquire(5000)
    assert again is block or again is other  # both of that class are free now
    stats = pool.stats()
    assert stats.in_flight_blocks == 0 and stats.held_blocks == 1 and stats.free_blocks == 1


def test_tickets_of_one_stream_complete_in_order(backend, driver):
    pool = PinnedPool(backend)
    first, second = pool.acquire(10), pool.acquire(10)
    pool.release_after(1, first)
    pool.release_after(1, second)
    driver.run(1, count=1)
    pool.collect()
    stats = pool.stats()
    assert (stats.free_blocks, stats.in_flight_blocks) == (1, 1)
    assert pool.acquire(10) is first
    driver.run(1)
    assert pool.collect() == 1


def test_streams_are_independent(backend, driver):
    pool = PinnedPool(backend)
    a, b = pool.acquire(10), pool.acquire(10)
    pool.release_after(1, a)
    pool.release_after(2, b)
    driver.run(2)
    assert pool.acquire(10) is b


def test_blocks_captured_into_a_graph_are_never_recycled(backend, driver):
    pool = PinnedPool(backend)
    backend.capturing.add(3)
    block = pool.acquire(64)
    pool.release_after(3, block)
    backend.capturing.discard(3)
    assert pool.stats().graph_blocks == 1
    for _ in range(5):  # replays: the host node posts the semaphore each time
        driver.run(3, keep=True)
        pool.collect()
    assert pool.acquire(64).ptr != block.ptr
    stats = pool.stats()
    assert stats.graph_blocks == 1 and stats.free_blocks == 0
    assert pool.trim() == 0 and block.ptr not in backend.freed


def test_release_errors_and_trim(backend, driver):
    pool = PinnedPool(backend)
    block = pool.acquire(10)
    pool.release_after(0, block)
    with pytest.raises(ValueError, match="not held"):
        pool.release_after(0, block)
    driver.run(0)
    held = pool.acquire(10)
    with pytest.raises(ValueError, match="passed twice"):
        pool.release_after(0, held, held)
    pool.release(held)
    pool.reserve(10000, count=2)
    stats = pool.stats()
    assert (stats.free_blocks, stats.free_bytes) == (3, 4096 + 2 * 16384)
    assert pool.trim() == 4096 + 2 * 16384
    assert len(backend.freed) == 3 and pool.stats().free_blocks == 0


def test_failed_enqueue_leaves_blocks_with_the_caller(backend):
    class Failing(FakeBackend):
        def launch_host_func(self, stream, function_address, user_data):
            raise RuntimeError("stream is broken")

    pool = PinnedPool(Failing())
    block = pool.acquire(10)
    with pytest.raises(RuntimeError, match="broken"):
        pool.release_after(0, block)
    assert pool.stats().held_blocks == 1
    pool.release(block)


def test_one_pool_per_backend_and_device_created_once_under_concurrent_first_use():
    backends = [FakeBackend(), FakeBackend()]
    barrier = threading.Barrier(8)
    seen: list[tuple[int, int, PinnedPool]] = []

    def first_use(i: int) -> None:
        barrier.wait()
        backend, device = backends[i % 2], i // 2 % 2
        seen.append((i % 2, device, device_pool(backend, device)))

    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    pools = {(b, d): {id(p) for bb, dd, p in seen if (bb, dd) == (b, d)} for b in (0, 1) for d in (0, 1)}
    assert all(len(ids) == 1 for ids in pools.values()), "a device got two pools"
    assert len({next(iter(ids)) for ids in pools.values()}) == 4, "devices or backends share a pool"
    assert device_pool(backends[1], 0) is next(p for b, d, p in seen if (b, d) == (1, 0))


def test_host_function_completes_while_main_thread_waits_releasing_the_gil(backend, driver):
    pool = PinnedPool(backend)
    block = pool.acquire(10)
    pool.release_after(5, block)
    waiter = Semaphore()
    backend.launch_host_func(5, pinned.SEM_POST_ADDRESS, waiter.address)  # "stream finished" marker
    thread = driver.start(5)
    assert waiter.wait(timeout=10), "the host functions never ran"
    thread.join(timeout=10)
    assert pool.collect() == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs pthreads and glibc semaphores")
def test_pool_host_function_needs_no_gil_where_a_python_one_deadlocks(backend):
    """The main thread blocks *holding* the GIL (a PyDLL call, like a C extension that does not
    release it). A native thread runs each host function, as the runtime's callback thread does.
    sem_post completes; a Python host function cannot run until the GIL is released."""
    pyapi_libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
    timed_wait = pyapi_libc["sem_timedwait"]
    timed_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    timed_wait.restype = ctypes.c_int
    pthread_create = _libc["pthread_create"]
    pthread_create.argtypes = [
        ctypes.POINTER(ctypes.c_ulong),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    pthread_join = _libc["pthread_join"]
    pthread_join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]

    def wait_holding_gil(semaphore: Semaphore, seconds: float) -> bool:
        import time

        deadline = time.time() + seconds
        spec = pinned._Timespec(int(deadline), int((deadline % 1) * 1e9))
        return timed_wait(semaphore.address, ctypes.byref(spec)) == 0

    def native_thread(address: int, user_data: int) -> ctypes.c_ulong:
        # A void(void*) host function used as a thread's start routine: same argument passing;
        # its missing return value is never read (the join below discards it).
        tid = ctypes.c_ulong()
        assert pthread_create(ctypes.byref(tid), None, address, user_data) == 0
        return tid

    pool = PinnedPool(backend)
    pool.release_after(9, pool.acquire(10))
    ((address, ticket),) = backend.queues[9]
    ticket_semaphore = pool._in_flight[9][0][0]
    tid = native_thread(address, ticket)
    assert wait_holding_gil(ticket_semaphore, 10), "sem_post must complete while the GIL is held"
    pthread_join(tid, None)
    ticket_semaphore.post()  # hand back the post this test consumed
    assert pool.collect() == 1

    flag = Semaphore()
    launch_python_host_func(backend, 9, flag.post)
    ((address, key),) = backend.queues[9][1:]
    tid = native_thread(address, key)
    assert not wait_holding_gil(flag, 0.3), "a Python host function cannot run while the GIL is held"
    assert flag.wait(timeout=10), "once the GIL is released it runs"
    pthread_join(tid, None)


def test_python_host_function_runs_on_the_driver_thread(backend, driver):
    done = Semaphore()
    ran_on: list[int] = []

    def pack_metadata():
        ran_on.append(threading.get_ident())
        done.post()

    launch_python_host_func(backend, 4, pack_metadata)
    ((address, key),) = backend.queues[4]
    assert address == pinned.TRAMPOLINE_ADDRESS and isinstance(key, int)
    thread = driver.start(4)
    assert done.wait(timeout=10), "main thread waits without the GIL, so the callback can run"
    thread.join(timeout=10)  # the trampoline is still finishing after fn posted
    assert ran_on == driver.thread_ids and ran_on[0] != threading.get_ident()


def test_one_shot_python_host_function_is_dropped_on_the_next_main_thread_call(backend, driver):
    pinned.collect_host_funcs()
    before = pending_host_funcs()
    calls = []
    launch_python_host_func(backend, 4, lambda: calls.append(1))
    assert pending_host_funcs() == before + 1
    driver.run(4)
    assert calls == [1]
    assert pending_host_funcs() == before + 1, "not dropped inside the callback"
    assert pinned.collect_host_funcs() == 1
    assert pending_host_funcs() == before


def test_captured_python_host_function_survives_every_replay(backend, driver):
    pinned.collect_host_funcs()
    before = pending_host_funcs()
    backend.capturing.add(6)
    calls = []
    launch_python_host_func(backend, 6, lambda: calls.append(1))
    backend.capturing.discard(6)
    for _ in range(3):
        driver.run(6, keep=True)
        pinned.collect_host_funcs()
    assert calls == [1, 1, 1]
    assert pending_host_funcs() == before + 1


def test_python_host_function_exception_is_recorded_not_raised_on_the_driver(backend, driver, caplog):
    def broken():
        raise ValueError("bad metadata")

    launch_python_host_func(backend, 8, broken)
    driver.run(8)
    assert isinstance(pinned.host_func_errors[-1], ValueError)
    assert "Python host function raised" in caplog.text
    with pytest.raises(TypeError):
        launch_python_host_func(backend, 8, "not callable")
