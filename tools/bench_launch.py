"""Compile and launch costs of the runtime-compiled pipeline, on the machine it runs on.

    python -m tools.bench_launch --out bench_launch.json

Measures, for a few representative specs: cold compile time (empty cache), load time from the disk
cache into a fresh registry (read + verify + module load), and the host (Python) time of one launch
through the warm registry, both for a bare kernel launch and for a whole hipattn.forward call with
caller-provided outputs (validation, device guard, stream resolution, dispatch, launch).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import hipattn
from hipattn import arrays, runtime
from hipattn.catalog import preprocess as preprocess_catalog
from hipattn.catalog.smallseq import SMALLSEQ_BACKWARD_TILES, SMALLSEQ_FORWARD_TILES
from hipattn.jit.cache import DiskCache
from hipattn.jit.registry import Registry
from hipattn.ops import preprocess
from hipattn.streams import on_device
from tools.benchlib import write_report

SPECS = [
    preprocess_catalog.dot_do_o_spec("bf16", 128),
    SMALLSEQ_FORWARD_TILES.spec("bf16", 128, heads=16),
    SMALLSEQ_BACKWARD_TILES.spec("bf16", 128, heads=16),
]


def _median_us(fn, count: int) -> float:
    times = []
    for _ in range(count):
        begin = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - begin)
    return statistics.median(times) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_launch.json")
    parser.add_argument("--launches", type=int, default=5000)
    args = parser.parse_args()

    import torch

    backend = runtime.active().backend
    device = 0
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        cold = Registry(backend, DiskCache(Path(directory)))
        warm_from_disk = Registry(backend, DiskCache(Path(directory)))
        with on_device(backend, device):
            for spec in SPECS:
                begin = time.perf_counter()
                cold.get_kernel(spec, device)
                compile_s = time.perf_counter() - begin
                begin = time.perf_counter()
                warm_from_disk.get_kernel(spec, device)
                load_s = time.perf_counter() - begin
                hit_us = _median_us(lambda spec=spec: warm_from_disk.get_kernel(spec, device), 1000)
                rows.append({"spec": str(spec), "cold_compile_s": compile_s, "load_from_disk_ms": load_s * 1e3,
                             "registry_hit_us": hit_us})

    # Host time of launches through the default (warm) registry. Tiny problems, so the GPU queue
    # never fills; the stream is drained outside the timed calls now and then.
    o = torch.randn(64, 4, 128, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(o)
    d = torch.empty(4, 64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    a_o, a_do, a_d = (arrays.as_device_array(x, n) for x, n in ((o, "o"), (do, "do"), (d, "d")))
    with on_device(backend, device):
        preprocess.dot_do_o(a_o, a_do, a_d, stream)
        torch.cuda.synchronize()
        kernel_us = _median_us(lambda: preprocess.dot_do_o(a_o, a_do, a_d, stream), args.launches)
    torch.cuda.synchronize()

    q = torch.randn(8 * 9, 16, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, 8 * 9 + 1, 9, dtype=torch.int32, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(16, q.shape[0], device="cuda")
    call = dict(out=out, lse=lse, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9, max_seqlen_k=9)
    hipattn.forward(q, q, q, **call)
    torch.cuda.synchronize()
    api_us = _median_us(lambda: hipattn.forward(q, q, q, **call), args.launches)
    torch.cuda.synchronize()
    write_report(args.out, "tools.bench_launch", compiler=backend.compiler_identity(), specs=rows,
                 preprocess_launch_host_us=kernel_us, forward_call_host_us=api_us)
    for row in rows:
        print(f"{row['spec']:>70}  compile {row['cold_compile_s']:6.2f} s  load {row['load_from_disk_ms']:7.2f} ms"
              f"  hit {row['registry_hit_us']:.2f} us")
    print(f"host time per launch: ops.preprocess.dot_do_o {kernel_us:.1f} us; hipattn.forward (torch, 5 arrays) {api_us:.1f} us")


if __name__ == "__main__":
    main()
