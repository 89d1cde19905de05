"""Python threads launching at once: four threads on four streams give the results of a
serial run, with kernels loaded concurrently into a fresh registry; a main thread blocked on a
stream while another thread launches (kernels and Python host functions) never deadlocks."""

from __future__ import annotations

import faulthandler
import threading

import pytest
import torch

from hipattn import runtime
from hipattn.backends import get_backend
from hipattn.jit.registry import Registry
from hipattn.pinned import collect_host_funcs, host_func_errors, launch_python_host_func

from .conftest import TOLERANCE
from .workloads import first_difference, make_calls, max_error_against_reference, run

THREADS = 4
CALLS = 500
# One configuration per thread, so the threads also race to load different kernels: MHA and
# GQA/MQA, three head dims, both dtypes.
CONFIGS = [
    dict(heads_q=8, heads_kv=8, head_dim=64, dtype=torch.bfloat16),
    dict(heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16),
    dict(heads_q=16, heads_kv=16, head_dim=128, dtype=torch.float16),
    dict(heads_q=8, heads_kv=1, head_dim=256, dtype=torch.bfloat16),
]
DEADLOCK_TIMEOUT_S = 300


@pytest.fixture
def fresh_registry(monkeypatch):
    """A registry with nothing loaded (the disk cache is the default one): the first calls load concurrently."""
    fresh = Registry()
    monkeypatch.setattr(runtime, "_active", runtime.Runtime(registry=fresh))
    return fresh


@pytest.fixture
def deadlock_guard():
    """A hung test would hang the session: dump every thread's stack and exit instead."""
    faulthandler.dump_traceback_later(DEADLOCK_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _join(threads) -> None:
    for t in threads:
        t.join(timeout=DEADLOCK_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), f"a thread did not finish within {DEADLOCK_TIMEOUT_S} s (deadlock?)"


def test_four_threads_on_four_streams_match_a_serial_run(fresh_registry, deadlock_guard):
    calls = [make_calls(CALLS, 0, seed=500 + i, **CONFIGS[i]) for i in range(THREADS)]
    threaded: list[list] = [[] for _ in range(THREADS)]
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def launch(i: int) -> None:
        try:
            stream = torch.cuda.Stream()
            start.wait(timeout=60)
            with torch.cuda.stream(stream):  # this thread's current stream; others keep theirs
                for call in calls[i]:
                    threaded[i].append(run(call))
            stream.synchronize()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=launch, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    _join(threads)
    assert not errors, errors
    loaded = {(k.spec, k.device) for k in fresh_registry.loaded()}
    assert fresh_registry.load_count == len(loaded), "a kernel was loaded twice by racing threads"

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        serial = [[run(call) for call in calls[i]] for i in range(THREADS)]
    stream.synchronize()
    assert fresh_registry.load_count == len(loaded), "the serial run needed kernels the threads had not loaded"
    for i in range(THREADS):
        difference = first_difference(serial[i], threaded[i])
        assert difference is None, f"thread {i} ({CONFIGS[i]}): {difference}"
        for j in (0, CALLS - 1):
            assert max_error_against_reference(calls[i][j], threaded[i][j]) < TOLERANCE["bf16"]


@pytest.mark.parametrize("wait", ["torch", "backend"])
def test_main_thread_waiting_on_a_stream_while_another_thread_launches_does_not_deadlock(wait, deadlock_guard):
    """The main thread blocks on the worker's stream (torch's synchronize, or hipattn's backend call
    that HIPATTN_CHECK uses) over and over while the worker launches kernels and Python host
    functions on it: a host function needs the GIL on the callback thread, so a wait that kept the
    GIL would hang here."""
    backend = get_backend()
    calls = make_calls(200, 0, seed=900)
    expected = [run(call) for call in calls]
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    results: list = []
    ran: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()
    errors_before = len(host_func_errors)

    def worker() -> None:
        try:
            with torch.cuda.stream(stream):
                for i, call in enumerate(calls):
                    torch.cuda._sleep(20_000)  # keep the stream a little behind the host
                    results.append(run(call))
                    launch_python_host_func(backend, stream.cuda_stream, lambda i=i: ran.append(i))
        except BaseException as error:
            errors.append(error)
        finally:
            done.set()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    waits = 0
    while not done.is_set():
        if wait == "torch":
            stream.synchronize()
        else:
            backend.stream_synchronize(stream.cuda_stream)
        waits += 1
    _join([thread])
    stream.synchronize()
    collect_host_funcs()
    assert not errors, errors
    assert waits > 0
    assert ran == list(range(len(calls))), "host functions ran out of order or not at all"
    assert len(host_func_errors) == errors_before
    assert first_difference(expected, results) is None
