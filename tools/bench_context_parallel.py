"""Context parallelism across GPUs: how close two GPUs come to halving one's time, hipattn against torch's
own flash kernels, both under torch's context_parallel engine.

    python -m tools.bench_context_parallel --out bench_cp.json                # 1 GPU, and 2 if present
    python -m tools.bench_context_parallel --seqlens 65536 --gpus 2 --out bench_cp.json

Workload: one causal self-attention forward + backward through F.scaled_dot_product_attention on
[1, 32, S, 128] bf16 q, k and v (Llama-8B's query heads), S = 32k to 128k tokens. With G GPUs the
sequence is sharded over a one-dimensional device mesh by
torch.distributed.tensor.experimental.context_parallel (head-tail load balancing for causal), whose
ring runs the flash SDPA op on each shard pair and merges the partial outputs by their LSEs. Two
implementations of that op: hipattn's (hipattn.torch.enable()) and torch's own FlashAttention-2
(``torch`` below). Times are the slowest rank's median per step (CUDA events around back-to-back
steps after warm-up); G = 1 runs the same code on a mesh of one. Scaling efficiency at G GPUs:
time on 1 ÷ (G × time on G).

Each (implementation, G) runs in its own group of spawned processes over NCCL; a report with its
date, device and command goes to --out. Written without a multi-GPU machine at hand: not run yet.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile

from tools.benchlib import median_ms, write_report

SEQLENS = [32768, 65536, 131072]
HEADS, HEAD_DIM = 32, 128
IMPLEMENTATIONS = ("hipattn", "torch")
STEPS_PER_SAMPLE = 2


def _step(leaves, dout) -> None:
    """One causal SDPA forward and backward (under context_parallel: the sharded ring)."""
    import torch.nn.functional as F

    F.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)


def _worker(rank: int, gpus: int, init_file: str, implementation: str, seqlens: list[int], result_file: str) -> None:
    """One rank: each sequence length's median step time; rank 0 writes the slowest rank's."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=gpus,
                            device_id=torch.device("cuda", rank), timeout=timedelta(seconds=300))
    try:
        if implementation == "hipattn":
            import hipattn.torch

            hipattn.torch.enable()
        mesh = init_device_mesh("cuda", (gpus,))
        times = {}
        for seqlen in seqlens:
            shape = (1, HEADS, seqlen, HEAD_DIM)
            q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            # The buffers are sharded in place for the whole measurement (torch resizes them, so they
            # may not require grad: the leaves are views of the shards), then restored. Both
            # implementations are the flash SDPA op (torch would otherwise prefer cuDNN's on Hopper).
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION), \
                    context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                ms = median_ms(functools.partial(_step, leaves, dout), warmup=3, repeat=10, calls=STEPS_PER_SAMPLE)
            slowest = torch.tensor([ms], device="cuda")
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[seqlen] = float(slowest.item())
            del q, k, v, dout, leaves
            torch.cuda.empty_cache()
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(times, f)
    finally:
        dist.destroy_process_group()


def _run(implementation: str, gpus: int, seqlens: list[int], seconds: float = 1200) -> dict:
    """{seqlen: ms} of ``implementation`` on ``gpus`` GPUs, or {"error": ...}: the ranks in spawned
    processes, ended at the deadline so that a hung rank cannot stall the run."""
    import time

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as scratch:
        result_file = os.path.join(scratch, "times.json")
        context = mp.start_processes(_worker, args=(gpus, os.path.join(scratch, "init"), implementation, seqlens,
                                                    result_file), nprocs=gpus, join=False, start_method="spawn")
        deadline = time.monotonic() + seconds
        try:
            finished = False
            while not finished and time.monotonic() < deadline:
                finished = context.join(timeout=max(deadline - time.monotonic(), 0.1))
        except Exception as failure:  # a rank raised: report it, keep the other measurements
            return {"error": str(failure).strip().splitlines()[-1][:300]}
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
        if not finished:
            return {"error": f"not finished within {seconds:.0f} s"}
        with open(result_file) as f:
            return {int(seqlen): ms for seqlen, ms in json.load(f).items()}


def efficiency(times: dict[int, dict[int, float]], gpus: int, seqlen: int) -> float | None:
    """Time on one GPU ÷ (``gpus`` × time on ``gpus``) at ``seqlen``, or None when either is missing."""
    one, many = times.get(1, {}).get(seqlen), times.get(gpus, {}).get(seqlen)
    return one / (gpus * many) if one and many else None


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_context_parallel.json")
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)), help="comma-separated sequence lengths")
    parser.add_argument("--gpus", type=int, default=min(torch.cuda.device_count(), 2),
                        help="the most GPUs to shard over (default: 2 if present); 1 is always measured")
    args = parser.parse_args()
    seqlens = [int(s) for s in args.seqlens.split(",")]
    if args.gpus > torch.cuda.device_count():
        raise SystemExit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
    counts = sorted({1, args.gpus})
    results = {impl: {g: _run(impl, g, seqlens) for g in counts} for impl in IMPLEMENTATIONS}
    rows = []
    for impl in IMPLEMENTATIONS:
        for seqlen in seqlens:
            row = {"implementation": impl, "seqlen": seqlen}
            for g in counts:
                row[f"ms_{g}gpu"] = results[impl][g].get(seqlen)
            for g in counts[1:]:
                row[f"efficiency_{g}gpu"] = efficiency(results[impl], g, seqlen)
            rows.append(row)
            print(json.dumps(row), flush=True)
    errors = {f"{impl}/{g}": r["error"] for impl in IMPLEMENTATIONS for g, r in results[impl].items() if "error" in r}
    write_report(args.out, "tools.bench_context_parallel", torch=torch.__version__, heads=HEADS, head_dim=HEAD_DIM,
                 causal=True, rows=rows, errors=errors)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
