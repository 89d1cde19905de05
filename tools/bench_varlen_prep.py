"""How the varlen backward's work list is prepared, timed on many small back-to-back calls.

    python -m tools.bench_varlen_prep --out bench_varlen_prep.json

Three ways, on the same calls: ``device`` (a one-block kernel derives the records on the stream),
``host`` (cu_seqlens copied to pinned memory, a host function packs the records,
copied back; nothing blocks the host), and ``sync`` (what the stream-async preparation replaces: cu_seqlens copied to the
host with a blocking copy before each call, as a launcher that packs on the host would). Each call
is a varlen backward of 32 sequences of 16..512 tokens (8 heads, head_dim 64, bf16, new cu_seqlens
contents every call); the figure is the wall time per call over 300 back-to-back calls, and the
device time of one call alone (CUDA events) for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tools.benchlib import median_ms, write_report

CALLS, SEQUENCES, HEADS, HEAD_DIM, LENGTHS = 300, 32, 8, 64, (16, 512)
WAYS = ("device", "host", "sync")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_varlen_prep.json")
    args = parser.parse_args()

    import torch

    import hipattn

    gen = torch.Generator(device="cuda").manual_seed(3)
    capacity = SEQUENCES * LENGTHS[1]
    q, k, v, dout = (torch.randn(capacity, HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    # One cu_seqlens buffer per call, drawn up front, so that each call sees new contents.
    cu_seqlens = []
    for _ in range(CALLS):
        lengths = torch.randint(*LENGTHS, (SEQUENCES,), generator=gen, device="cuda")
        cu_seqlens.append(torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32))
    bounds = {"max_seqlen_q": LENGTHS[1], "max_seqlen_k": LENGTHS[1]}
    out, lse = hipattn.forward(q, k, v, cu_seqlens_q=cu_seqlens[0], cu_seqlens_k=cu_seqlens[0], **bounds)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def call(i: int, way: str) -> None:
        cu = cu_seqlens[i % CALLS]
        if way == "sync":
            cu.cpu()  # the blocking copy the stream-async preparation replaces
        hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu, cu_seqlens_k=cu, **bounds)

    rows = []
    for way in WAYS:
        os.environ["HIPATTN_VARLEN_PREP"] = "host" if way == "host" else "device"
        for i in range(20):
            call(i, way)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(CALLS):
            call(i, way)
        torch.cuda.synchronize()
        per_call_us = (time.perf_counter() - start) / CALLS * 1e6
        alone_ms = median_ms(lambda way=way: call(0, way))
        rows.append({"way": way, "wall_us_per_call_back_to_back": per_call_us, "device_ms_one_call": alone_ms})
        print(json.dumps(rows[-1]), flush=True)
    write_report(args.out, "tools.bench_varlen_prep", calls=CALLS, sequences=SEQUENCES, heads=HEADS,
                 head_dim=HEAD_DIM, lengths=LENGTHS, rows=rows)


if __name__ == "__main__":
    main()
