"""Shared by the benchmark scripts in tools/: event timing, one-peer-per-process runs and the report file."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

# The checkout the tools belong to: a child started there imports its hipattn and tools packages.
REPOSITORY = Path(__file__).resolve().parent.parent


def median_ms(fn, warmup: int = 3, repeat: int = 20, calls: int = 1) -> float:
    """Median device time per call of ``fn()`` in milliseconds, over ``repeat`` samples of ``calls``
    back-to-back calls between two CUDA events.

    With one call per sample, the device waits for the host before each call: its time alone, host
    launch latency included. With several, a call's host overhead overlaps the previous call's
    kernels, as in a training step, and only an overhead longer than the device's work shows.
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    return times[len(times) // 2]


def run_child(module: str, arguments: list[str], failure: dict, timeout: int = 600) -> dict:
    """Run ``python -m module --child ARGUMENTS`` (a tool, from the repository root) in its own process
    and return the JSON line it prints.

    A peer that fails (some break the process with an illegal address) returns ``failure`` plus
    the last line of its output under "error", and cannot take the other measurements down.
    """
    done = subprocess.run([sys.executable, "-m", module, "--child", *arguments], capture_output=True, text=True,
                          timeout=timeout, cwd=REPOSITORY)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {**failure, "error": tail[0][:300]}


def precompile(specs) -> None:
    """Every spec into the disk cache for device 0's target, in parallel processes (hipattn warm's
    pool), so that a sweep's first call of each variant times nothing but the kernel."""
    from hipattn import runtime
    from hipattn.cli import WarmResult, run_compile_pool
    from hipattn.jit.cache import default_cache_dir

    target = runtime.active().target(0)  # what the registry will look the kernels up for
    failures = []

    def report(spec, target, outcome) -> None:
        if not isinstance(outcome, WarmResult):
            failures.append(f"{spec} for {target.arch}: {outcome}")

    crashed = run_compile_pool([(spec, target) for spec in set(specs)], os.cpu_count() or 1,
                               str(default_cache_dir()), report)
    failures += [f"{spec} for {target.arch}: the compiler killed its process" for spec, target in crashed]
    if failures:
        raise SystemExit("could not compile:\n" + "\n".join(failures))


def write_report(path: str, module: str, **fields) -> None:
    """Write a benchmark's JSON report to ``path``: the date, the device and the command that measured
    it (``python -m module`` with this process's arguments), then ``fields`` in the order given."""
    import torch

    report = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "command": f"python -m {module} " + " ".join(sys.argv[1:]), **fields}
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
