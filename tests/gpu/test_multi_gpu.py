"""Two GPUs (the device guard before the stream, tested for real): inputs on GPU 1 while
GPU 0 is current run on GPU 1's current stream and leave GPU 0 current; arrays split across GPUs
are refused; two threads driving the two GPUs at once agree with a serial run.

Runs on nvidia-h200-x2; skipped on machines with fewer than two GPUs.
"""

from __future__ import annotations

import threading

import pytest
import torch

import hipattn
from hipattn.backends import get_backend
from hipattn.catalog.smallseq import SMALLSEQ_TILE

from .conftest import TOLERANCE
from .workloads import current_stream_on, first_difference, make_calls, max_error_against_reference, run

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")

SLEEP_CYCLES = 500_000_000  # about 0.25 s of GPU time at 2 GHz: long enough to hold a stream behind the host


@pytest.fixture(autouse=True)
def gpu0_current():
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(0)


def test_inputs_on_gpu1_while_gpu0_is_current_are_correct_and_gpu0_stays_current():
    (call,) = make_calls(1, 1, seed=11)
    assert torch.cuda.current_device() == 0
    results = run(call)
    assert torch.cuda.current_device() == 0, "hipattn left GPU 1 current"
    assert get_backend().get_device() == 0
    assert all(t.device == torch.device("cuda", 1) for t in results)
    torch.cuda.synchronize(1)
    assert max_error_against_reference(call, results) < TOLERANCE["bf16"]


@pytest.mark.parametrize("kernel", ["tensor-core", "portable"])
def test_the_work_runs_on_gpu1s_current_stream(kernel, monkeypatch):
    """GPU 1's current stream is a fresh stream, held busy by a sleep, and the inputs are written on
    it only after the sleep. Work enqueued on any other stream would read the NaN placeholders; so
    a correct result after synchronizing that one stream (and nothing else) shows where it ran."""
    if kernel == "portable":
        monkeypatch.setenv("HIPATTN_SMALLSEQ_KERNEL", "portable")
    else:
        monkeypatch.delenv("HIPATTN_SMALLSEQ_KERNEL", raising=False)
    (staged,) = make_calls(1, 1, seed=12)
    run(staged)  # compile and load on GPU 1 first: a first-use load may synchronize
    torch.cuda.synchronize(1)
    q, k, v, dout = (torch.full_like(t, float("nan")) for t in (staged.q, staged.k, staged.v, staged.dout))
    torch.cuda.synchronize(1)
    stream = torch.cuda.Stream(device=1)
    with current_stream_on(1, stream, keep_device=0):
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(1) == stream
        with torch.cuda.device(1):
            torch.cuda._sleep(SLEEP_CYCLES)  # on GPU 1's current stream: `stream`
            for dst, src in ((q, staged.q), (k, staged.k), (v, staged.v), (dout, staged.dout)):
                dst.copy_(src)
        torch.cuda.set_device(0)
        args = dict(cu_seqlens_q=staged.cu_q, cu_seqlens_k=staged.cu_k, max_seqlen_q=SMALLSEQ_TILE,
                    max_seqlen_k=SMALLSEQ_TILE, causal=staged.causal)
        out, lse = hipattn.forward(q, k, v, **args)
        dq, dk, dv = hipattn.backward(dout, q, k, v, out, lse, **args)
        assert torch.cuda.current_device() == 0, "hipattn left GPU 1 current"
        assert not stream.query(), "the call waited for the stream (or the sleep was too short to tell)"
        stream.synchronize()  # this stream only
        results = (out, lse, dq, dk, dv)
        expected = run(staged)
        torch.cuda.synchronize(1)
    assert first_difference([expected], [results]) is None, "the work did not run on GPU 1's current stream"
    assert max_error_against_reference(staged, results) < TOLERANCE["bf16"]
    assert torch.cuda.current_device() == 0


def test_an_explicit_gpu1_stream_is_used_with_gpu0_current():
    (call,) = make_calls(1, 1, seed=13)
    stream = torch.cuda.Stream(device=1)
    results = run(call, stream=stream)
    assert torch.cuda.current_device() == 0
    stream.synchronize()
    assert max_error_against_reference(call, results) < TOLERANCE["bf16"]


def test_a_stream_of_the_other_gpu_is_refused():
    (call,) = make_calls(1, 1, seed=14)
    with pytest.raises(ValueError, match="device 0.*device 1"):
        run(call, stream=torch.cuda.Stream(device=0))


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_cu_seqlens_on_another_gpu_than_q_is_refused_naming_both_devices(which, direction):
    (call,) = make_calls(1, 1, seed=15)
    out, lse, *_ = run(call)
    torch.cuda.synchronize(1)
    args = dict(cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k, max_seqlen_q=SMALLSEQ_TILE,
                max_seqlen_k=SMALLSEQ_TILE)
    args[which] = args[which].to("cuda:0")
    out_before = out.clone()
    with pytest.raises(ValueError) as raised:
        if direction == "forward":
            hipattn.forward(call.q, call.k, call.v, out=out, lse=lse, **args)
        else:
            hipattn.backward(call.dout, call.q, call.k, call.v, out, lse, **args)
    message = str(raised.value)
    assert which in message and "device 0" in message and "device 1" in message, message
    torch.cuda.synchronize(1)
    assert torch.equal(out, out_before), "a refused call wrote its output"
    assert torch.cuda.current_device() == 0


def test_two_threads_driving_the_two_gpus_at_once_match_a_serial_run():
    calls_per_gpu = 200
    calls = {device: make_calls(calls_per_gpu, device, seed=100 + device) for device in (0, 1)}
    streams = {device: torch.cuda.Stream(device=device) for device in (0, 1)}

    serial = {}
    for device in (0, 1):
        serial[device] = [run(call, stream=streams[device]) for call in calls[device]]
        streams[device].synchronize()

    threaded: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    devices_after: dict[int, int] = {}
    start = threading.Barrier(2)

    def drive(device: int) -> None:
        try:
            # Each thread starts with GPU 0 current (a new thread's default) and makes its GPU's
            # current stream its own stream; hipattn must find both from the arrays.
            stream = torch.cuda.Stream(device=device)
            with current_stream_on(device, stream, keep_device=0):
                start.wait(timeout=60)
                for call in calls[device]:
                    threaded[device].append(run(call))
                devices_after[device] = torch.cuda.current_device()
                stream.synchronize()
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=drive, args=(d,), daemon=True) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish within 300 s (deadlock?)"
    assert not errors, errors
    assert devices_after == {0: 0, 1: 0}, f"current device after the calls, per thread: {devices_after}"
    for device in (0, 1):
        difference = first_difference(serial[device], threaded[device])
        assert difference is None, f"GPU {device}: {difference}"
        for i in (0, calls_per_gpu - 1):
            assert max_error_against_reference(calls[device][i], threaded[device][i]) < TOLERANCE["bf16"]
