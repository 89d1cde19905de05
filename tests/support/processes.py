"""Worker processes for the multi-process tests (torch.distributed over gloo or NCCL)."""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def nccl_rank(rank: int, world_size: int, init_file: str, seconds: float | None = None):
    """This process as rank ``rank`` of a ``world_size``-rank NCCL group on GPU ``rank`` (rendezvous
    through ``init_file``; ``seconds``: the collectives' timeout, torch's default when None), the group
    destroyed on exit."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    timeout = {} if seconds is None else {"timeout": timedelta(seconds=seconds)}
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank), **timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_spawned(worker, args: tuple, processes: int, seconds: float) -> bool:
    """Run ``worker(rank, *args)`` in ``processes`` spawned processes; True when every one ended in
    time (a failing one raises ProcessRaisedException). Processes still alive at the deadline are
    terminated, so a hung rank cannot outlive the test."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=processes, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    finished = False
    try:
        # join returns as soon as any one process ends (False while others still run): loop to the deadline.
        while not finished and time.monotonic() < deadline:
            finished = context.join(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    return finished
