"""Exercise every CudaBackend method on a real NVIDIA GPU and time one launch.

Run from the repository root on a machine with an NVIDIA GPU:

    python -m tools.gpu_check_backend [--device 0] [--launches 10000]

Prints one PASS/FAIL line per check and a launch-overhead line (median microseconds of Python time per
``backend.launch``); exits non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
import traceback

from hipattn.backends.cuda import CudaBackend
from hipattn.errors import CompileError, DriverError
from hipattn.jit.params import ParamsStruct
from hipattn.jit.sources import include_closure
from hipattn.jit.target import Target

FILL = ParamsStruct("FillParams", (("out", "ptr"), ("n", "i32"), ("value", "f32")))

SOURCE = (
    '#include "common/platform.h"\n'
    "namespace hipattn {\n"
    f"{FILL.cpp_declaration()}"
    "// out[i] = value * SCALE + i, for i < n\n"
    "template <int SCALE>\n"
    "__global__ void fill(FillParams p) {\n"
    "  const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "  if (i < p.n) static_cast<float*>(p.out)[i] = p.value * SCALE + i;\n"
    "}\n"
    "// Touches every byte of a large dynamic shared buffer, then writes out[0] = its byte count.\n"
    "__global__ void big_shared(FillParams p) {\n"
    "  extern __shared__ unsigned char buffer[];\n"
    "  for (int i = threadIdx.x; i < p.n; i += blockDim.x) buffer[i] = 1;\n"
    "  __syncthreads();\n"
    "  if (threadIdx.x == 0) {\n"
    "    int sum = 0;\n"
    "    for (int i = 0; i < p.n; ++i) sum += buffer[i];\n"
    "    static_cast<float*>(p.out)[0] = static_cast<float>(sum);\n"
    "  }\n"
    "}\n"
    "// Busy-waits about n * 1000 clock cycles: work that is still running when the host asks.\n"
    "__global__ void spin(FillParams p) {\n"
    "  const long long start = clock64();\n"
    "  while (clock64() - start < p.n * 1000LL) {\n"
    "  }\n"
    "}\n"
    "}  // namespace hipattn\n"
)

results: list[tuple[str, bool, str]] = []


def check(name: str, condition: bool, detail: str = "") -> bool:
    results.append((name, bool(condition), detail))
    print(f"{'PASS' if condition else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)
    return bool(condition)


def floats_at(address: int, count: int) -> list[float]:
    return list((ctypes.c_float * count).from_address(address))


def compile_and_load(backend: CudaBackend, target: Target, expression: str):
    options = backend.compile_options(target)
    kernel = backend.compile(SOURCE, include_closure(SOURCE), expression, target, options, f"gpu_check {expression}")
    return backend.load_function(kernel.binary, kernel.lowered_name)


def run(device: int, launches: int) -> None:
    backend = CudaBackend()
    from cuda.bindings import driver  # only for stream capture, which the backend does not wrap

    count = backend.device_count()
    check("device_count", count >= 1, f"{count} device(s)")
    target = backend.device_target(device)
    check("device_target", target.vendor == "nvidia" and target.arch.startswith("sm_"), str(target))
    check("device_name", bool(backend.device_name(device)), backend.device_name(device))
    check("compiler_identity", backend.compiler_identity().startswith("nvrtc "), backend.compiler_identity())
    backend.set_device(device)
    check("set_device/get_device", backend.get_device() == device, f"current device {backend.get_device()}")

    fill = compile_and_load(backend, target, "hipattn::fill<3>")
    check("compile + load_function", fill.handle is not None, fill.name)
    # The arch-specific variant must load on its own device too (wgmma kernels will need it).
    arch_specific = Target.parse(target.arch + "a") if not target.arch.endswith("a") else target
    try:
        compile_and_load(backend, arch_specific, "hipattn::fill<1>")
        check(f"compile + load for {arch_specific}", True)
    except (CompileError, DriverError) as error:
        check(f"compile + load for {arch_specific}", False, str(error).splitlines()[0])

    stream = backend.stream_create()
    check("stream_create", stream != 0, hex(stream))
    check("stream_is_capturing (idle stream)", backend.stream_is_capturing(stream) is False)

    n = 1000
    nbytes = n * 4
    free_before, total = backend.mem_get_info()
    check("mem_get_info", 0 < free_before <= total, f"free {free_before >> 20} MiB of {total >> 20} MiB")
    device_buffer = backend.malloc_async(nbytes, stream)
    check("malloc_async", device_buffer != 0, hex(device_buffer))
    pinned = backend.host_alloc(nbytes)
    check("host_alloc", pinned != 0, hex(pinned))

    # memset: poison, copy to pinned, check every byte.
    backend.memset_async(device_buffer, 0xFF, nbytes, stream)
    backend.memcpy_async(pinned, device_buffer, nbytes, stream)
    backend.stream_synchronize(stream)
    check("memset_async + memcpy_async device->pinned", ctypes.string_at(pinned, nbytes) == b"\xff" * nbytes)

    # launch: one struct by value.
    params = FILL.new(out=device_buffer, n=n, value=2.0)
    backend.launch(fill, ((n + 127) // 128, 1, 1), (128, 1, 1), 0, stream, params)
    backend.memcpy_async(pinned, device_buffer, nbytes, stream)
    backend.stream_synchronize(stream)
    got = floats_at(pinned, n)
    expected = [2.0 * 3 + i for i in range(n)]
    check("launch (struct by value)", got == expected, f"out[:3] = {got[:3]}")

    # memcpy pinned->device->pinned.
    pattern = (ctypes.c_float * n)(*[float(-i) for i in range(n)])
    ctypes.memmove(pinned, pattern, nbytes)
    second_pinned = backend.host_alloc(nbytes)
    backend.memcpy_async(device_buffer, pinned, nbytes, stream)
    backend.memcpy_async(second_pinned, device_buffer, nbytes, stream)
    backend.stream_synchronize(stream)
    check("memcpy_async pinned->device->pinned", floats_at(second_pinned, n) == list(pattern))

    # Host function through the int address of a CFUNCTYPE; it must stay alive until it has run.
    ran: list[int] = []
    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda user_data: ran.append(user_data or 0))
    address = ctypes.cast(callback, ctypes.c_void_p).value
    backend.launch_host_func(stream, address, 0x1234)
    backend.stream_synchronize(stream)
    check("launch_host_func", ran == [0x1234], f"ran with {[hex(x) for x in ran]}")

    # Events: ordering (no timing) and timing.
    event = backend.event_create()
    backend.launch(fill, ((n + 127) // 128, 1, 1), (128, 1, 1), 0, stream, params)
    backend.event_record(event, stream)
    backend.event_synchronize(event)
    check("event_record/event_synchronize/event_query", backend.event_query(event) is True)
    # Cross-stream order: a second stream waits for an event of the first, then copies what it wrote.
    other = backend.stream_create()
    backend.launch(fill, ((n + 127) // 128, 1, 1), (128, 1, 1), 0, stream, FILL.new(out=device_buffer, n=n, value=4.0))
    backend.event_record(event, stream)
    backend.stream_wait_event(other, event)
    backend.memcpy_async(pinned, device_buffer, nbytes, other)
    backend.stream_synchronize(other)
    check("stream_wait_event orders another stream", floats_at(pinned, n)[:2] == [12.0, 13.0])
    backend.stream_destroy(other)
    start, end = backend.event_create(timing=True), backend.event_create(timing=True)
    backend.event_record(start, stream)
    for _ in range(100):
        backend.launch(fill, ((n + 127) // 128, 1, 1), (128, 1, 1), 0, stream, params)
    backend.event_record(end, stream)
    backend.event_synchronize(end)
    elapsed = backend.event_elapsed_ms(start, end)
    check("event_elapsed_ms", elapsed > 0.0, f"{elapsed:.3f} ms for 100 launches")
    # A query on work still running answers False rather than raising.
    spin = compile_and_load(backend, target, "hipattn::spin")
    pending = backend.event_create()
    backend.launch(spin, (1, 1, 1), (1, 1, 1), 0, stream, FILL.new(out=0, n=100_000, value=0.0))  # ~50 ms
    backend.event_record(pending, stream)
    answered = backend.event_query(pending)
    backend.event_synchronize(pending)
    check("event_query on pending work is False, then True", answered is False and backend.event_query(pending))

    # Dynamic shared memory above the 48 KiB default needs the opt-in.
    big = compile_and_load(backend, target, "hipattn::big_shared")
    shared = 96 * 1024
    backend.set_max_dynamic_shared_memory(big, shared)
    backend.launch(big, (1, 1, 1), (256, 1, 1), shared, stream, FILL.new(out=device_buffer, n=shared, value=0.0))
    backend.memcpy_async(pinned, device_buffer, 4, stream)
    backend.stream_synchronize(stream)
    check("set_max_dynamic_shared_memory (96 KiB)", floats_at(pinned, 1)[0] == float(shared))

    # Errors: a zero grid is rejected and named.
    try:
        backend.launch(fill, (0, 1, 1), (128, 1, 1), 0, stream, params)
        check("launch error raises DriverError", False, "no error")
    except DriverError as error:
        check("launch error raises DriverError", "cuLaunchKernel" in error.call and bool(error.name), str(error))

    # Launch overhead: Python time per backend.launch, draining the queue outside the timed calls.
    times = []
    for i in range(launches):
        begin = time.perf_counter_ns()
        backend.launch(fill, (1, 1, 1), (32, 1, 1), 0, stream, params)
        times.append(time.perf_counter_ns() - begin)
        if i % 512 == 511:
            backend.stream_synchronize(stream)
    backend.stream_synchronize(stream)
    median_us = statistics.median(times) / 1000
    check("launch overhead", median_us < 20.0, f"median {median_us:.2f} us per backend.launch over {launches}")
    times = []
    for _ in range(launches):
        begin = time.perf_counter_ns()
        backend.set_device(device)
        times.append(time.perf_counter_ns() - begin)
    print(f"INFO set_device: median {statistics.median(times) / 1000:.2f} us", flush=True)

    # Stream capture: the backend's calls are capturable, and is_capturing sees the capture.
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    (result,) = driver.cuStreamBeginCapture(stream, mode)
    captured_ok = not result
    capturing = backend.stream_is_capturing(stream)
    ran.clear()
    graph_params = FILL.new(out=device_buffer, n=n, value=5.0)
    backend.memset_async(device_buffer, 0, nbytes, stream)
    backend.launch(fill, ((n + 127) // 128, 1, 1), (128, 1, 1), 0, stream, graph_params)
    backend.memcpy_async(pinned, device_buffer, nbytes, stream)
    backend.launch_host_func(stream, address, 0x99)
    result, graph = driver.cuStreamEndCapture(stream)
    check("stream_is_capturing (capturing)", captured_ok and capturing and not result)
    result, graph_exec = driver.cuGraphInstantiate(graph, 0)
    for _ in range(2):
        driver.cuGraphLaunch(graph_exec, stream)
    backend.stream_synchronize(stream)
    check(
        "graph replay of memset/launch/memcpy/host function",
        floats_at(pinned, n) == [5.0 * 3 + i for i in range(n)] and ran == [0x99, 0x99],
        f"host function ran {len(ran)} time(s)",
    )
    driver.cuGraphExecDestroy(graph_exec)
    driver.cuGraphDestroy(graph)

    # Clean up, then check nothing leaked from the device's point of view.
    backend.free_async(device_buffer, stream)
    backend.stream_synchronize(stream)
    for handle in (event, start, end, pending):
        backend.event_destroy(handle)
    backend.host_free(pinned)
    backend.host_free(second_pinned)
    backend.stream_destroy(stream)
    check("free_async/event_destroy/host_free/stream_destroy", True)
    free_after, _ = backend.mem_get_info()
    print(f"INFO mem_get_info free: before {free_before >> 20} MiB, after {free_after >> 20} MiB", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--launches", type=int, default=10_000)
    args = parser.parse_args()
    try:
        run(args.device, args.launches)
    except Exception:
        traceback.print_exc()
        check("run to completion", False, "an unexpected exception stopped the checks")
    failed = [name for name, ok, _ in results if not ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed" + (f": {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
