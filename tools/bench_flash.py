"""General attention forward on the GPU: hipattn's flash kernel against torch SDPA, in TFLOP/s.

    python tools/bench_flash.py --out bench_flash.json

Workloads (issue 4): BSHD, bf16, head_dim 128, 16 heads, 16k tokens per batch (B = 16384 / S),
S in 512 .. 16384, causal and not. FLOPs = 4 * B * H * S^2 * D, halved when causal. Peers: hipattn's
flash forward (called through hipattn.ops.flash directly: it is not yet wired into dispatch), torch
SDPA's flash (FA2) and cuDNN backends. Each measurement runs in its own process, so a failing peer
cannot take the others down.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from benchlib import median_ms, run_child  # tools/ is on sys.path when a tool runs as a script

SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
TOKENS, HEADS, HEAD_DIM = 16384, 16, 128
PEERS = ["hipattn", "sdpa_flash", "sdpa_cudnn"]


def flops(batch: int, seqlen: int, causal: bool) -> float:
    total = 4.0 * batch * HEADS * seqlen * seqlen * HEAD_DIM
    return total / 2 if causal else total


def _hipattn_forward(q, k, v, out, lse, causal: bool):
    """A closure that enqueues hipattn's flash forward as attention.forward would (minus dispatch)."""
    from hipattn import arrays
    from hipattn import problem as problem_mod
    from hipattn.backends import get_backend
    from hipattn.ops import flash
    from hipattn.streams import on_device, resolve_stream

    qa, ka, va = (arrays.as_device_array(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    out_a, lse_a = arrays.as_device_array(out, "out"), arrays.as_device_array(lse, "lse")
    backend = get_backend()

    def run():
        problem = problem_mod.describe(qa, ka, va, causal=causal)
        with on_device(backend, problem.device):
            stream = resolve_stream((qa, ka, va), None, device=problem.device)
            flash.forward(problem, qa, ka, va, out_a, lse_a, stream)

    return run


def measure(peer: str, seqlen: int, causal: bool) -> dict:
    import torch

    batch = TOKENS // seqlen
    gen = torch.Generator(device="cuda").manual_seed(seqlen)
    shape = (batch, seqlen, HEADS, HEAD_DIM)  # BSHD, hipattn's and flash-attn's layout
    q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    result = {"peer": peer, "batch": batch, "seqlen": seqlen, "heads": HEADS, "head_dim": HEAD_DIM,
              "causal": causal}
    if peer == "hipattn":
        out = torch.empty_like(q)
        lse = torch.empty(batch, HEADS, seqlen, device="cuda", dtype=torch.float32)
        fn = _hipattn_forward(q, k, v, out, lse, causal)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[peer]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's [B, H, S, D] view of the same data

        def fn():
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    result["forward_ms"] = median_ms(fn, warmup=5, repeat=30)
    result["tflops"] = flops(batch, seqlen, causal) / (result["forward_ms"] * 1e-3) / 1e12
    torch.cuda.synchronize()
    return result


def _run_child(peer: str, seqlen: int, causal: bool) -> dict:
    failure = {"peer": peer, "batch": TOKENS // seqlen, "seqlen": seqlen, "heads": HEADS, "head_dim": HEAD_DIM,
               "causal": causal}
    return run_child(__file__, [peer, str(seqlen), str(int(causal))], failure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_flash.json")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--child", nargs=3, metavar=("PEER", "S", "CAUSAL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        peer, seqlen, causal = args.child[0], int(args.child[1]), bool(int(args.child[2]))
        print(json.dumps(measure(peer, seqlen, causal)), flush=True)
        return

    import torch

    rows = []
    for causal in (False, True):
        for seqlen in map(int, args.seqlens.split(",")):
            for peer in args.peers.split(","):
                row = _run_child(peer, seqlen, causal)
                rows.append(row)
                print(json.dumps(row), flush=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "command": "python tools/bench_flash.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "flops": "4 * B * H * S^2 * D, halved when causal",
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    peers = args.peers.split(",")
    print(f"\n{'causal':>6} {'S':>6} " + " ".join(f"{p:>12}" for p in peers) + "   (TFLOP/s)")
    for causal in (False, True):
        for seqlen in map(int, args.seqlens.split(",")):
            cells = []
            for p in peers:
                row = next(r for r in rows if r["peer"] == p and r["seqlen"] == seqlen and r["causal"] == causal)
                cells.append(f"{row['tflops']:12.1f}" if "tflops" in row else f"{'failed':>12}")
            print(f"{causal!s:>6} {seqlen:>6} " + " ".join(cells))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
