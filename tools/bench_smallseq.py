"""Small-seq attention on the GPU: hipattn against its peers, as ratios to the memory floor.

    python -m tools.bench_smallseq --out bench_smallseq.json

Workloads: THD, bf16, query and key lengths drawn independently and uniformly from
1..17. For each: the floor is the bytes that must move (Q, K, V read, O and LSE written, real tokens
only; backward reads Q, K, V, O, dO, LSE and writes dQ, dK, dV) divided by the device-to-device copy
bandwidth measured in the same run. Peers: torch SDPA's flash, cuDNN and efficient backends on the
padded [B, H, 17, D] layout, and torch's varlen attention on the same THD data. Each measurement
runs in its own process: a failing peer (B*H above 65535 breaks some backends, sometimes with an
illegal address that poisons the process) cannot take the others down.
"""

from __future__ import annotations

import argparse
import json
import os

from tools.benchlib import median_ms, run_child, write_report

WORKLOADS = [(16384, 16, 128), (16384, 32, 128), (8192, 16, 256), (4096, 32, 256)]
TILE = 17
PEERS = ["hipattn", "hipattn_portable", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "varlen_attn"]


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    import torch

    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def _data(batch: int, heads: int, head_dim: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths_q = torch.randint(1, TILE + 1, (batch,), generator=gen)
    lengths_k = torch.randint(1, TILE + 1, (batch,), generator=gen)
    cu_q = torch.zeros(batch + 1, dtype=torch.int32)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32)
    cu_q[1:] = lengths_q.cumsum(0)
    cu_k[1:] = lengths_k.cumsum(0)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(total_q, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total_k, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total_k, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    return q, k, v, cu_q.cuda(), cu_k.cuda(), total_q, total_k


def floor_bytes(total_q: int, total_k: int, heads: int, head_dim: int) -> tuple[int, int]:
    row = heads * head_dim * 2
    forward = total_q * row * 2 + total_k * row * 2 + total_q * heads * 4  # Q, O; K, V; LSE
    backward = total_q * row * 4 + total_k * row * 4 + total_q * heads * 4  # Q, O, dO, dQ; K, V, dK, dV; LSE
    return forward, backward


def measure(peer: str, batch: int, heads: int, head_dim: int) -> dict:
    import torch

    q, k, v, cu_q, cu_k, total_q, total_k = _data(batch, heads, head_dim, seed=batch * 1000 + heads + head_dim)
    dout = torch.randn_like(q)
    result = {"peer": peer, "batch": batch, "heads": heads, "head_dim": head_dim, "total_q": total_q,
              "total_k": total_k}
    if peer in ("hipattn", "hipattn_portable"):
        import hipattn

        if peer == "hipattn_portable":  # the kernel AMD targets use, measured on this GPU
            os.environ["HIPATTN_SMALLSEQ_KERNEL"] = "portable"

        args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=TILE, max_seqlen_k=TILE)
        out, lse = hipattn.forward(q, k, v, **args)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        result["forward_ms"] = median_ms(lambda: hipattn.forward(q, k, v, out=out, lse=lse, **args))
        result["backward_ms"] = median_ms(
            lambda: hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **args))
    elif peer == "varlen_attn":
        from torch.nn.attention.varlen import varlen_attn

        def fwd():
            return varlen_attn(q, k, v, cu_q, cu_k, TILE, TILE)

        result["forward_ms"] = median_ms(fwd)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = varlen_attn(qg, kg, vg, cu_q, cu_k, TILE, TILE)
        result["backward_ms"] = median_ms(
            lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True))
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                   "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[peer]
        # The padded layout a user without varlen support would run: every sequence padded to 17.
        qp = torch.randn(batch, heads, TILE, head_dim, device="cuda", dtype=torch.bfloat16)
        kp, vp, dp = torch.randn_like(qp), torch.randn_like(qp), torch.randn_like(qp)
        with sdpa_kernel(backend):
            sdpa = torch.nn.functional.scaled_dot_product_attention
            result["forward_ms"] = median_ms(lambda: sdpa(qp, kp, vp))
            qg, kg, vg = (t.detach().requires_grad_() for t in (qp, kp, vp))
            out = sdpa(qg, kg, vg)
            result["backward_ms"] = median_ms(
                lambda: torch.autograd.grad(out, (qg, kg, vg), dp, retain_graph=True))
    torch.cuda.synchronize()
    return result


def _run_child(peer: str, workload: tuple[int, int, int]) -> dict:
    batch, heads, head_dim = workload
    failure = {"peer": peer, "batch": batch, "heads": heads, "head_dim": head_dim}
    return run_child(__spec__.name, [peer, *map(str, workload)], failure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_smallseq.json")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--child", nargs=4, metavar=("PEER", "B", "H", "D"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        peer, batch, heads, head_dim = args.child[0], *map(int, args.child[1:])
        print(json.dumps(measure(peer, batch, heads, head_dim)), flush=True)
        return

    import torch

    bandwidth = copy_bandwidth()
    rows = []
    for workload in WORKLOADS:
        for peer in args.peers.split(","):
            row = _run_child(peer, workload)
            if "total_q" not in row:
                q, k, v, *_, total_q, total_k = _data(*workload, seed=workload[0] * 1000 + workload[1] + workload[2])
                row.update(total_q=total_q, total_k=total_k)
                del q, k, v
            fwd_bytes, bwd_bytes = floor_bytes(row["total_q"], row["total_k"], workload[1], workload[2])
            row["forward_floor_ms"] = fwd_bytes / bandwidth * 1e3
            row["backward_floor_ms"] = bwd_bytes / bandwidth * 1e3
            for direction in ("forward", "backward"):
                if f"{direction}_ms" in row:
                    row[f"{direction}_ratio"] = row[f"{direction}_ms"] / row[f"{direction}_floor_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_report(args.out, "tools.bench_smallseq", copy_bandwidth_bytes_per_s=bandwidth, torch=torch.__version__,
                 rows=rows)
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'workload':>18} {'peer':>15} {'fwd ms':>8} {'fwd/floor':>9} {'bwd ms':>8} {'bwd/floor':>9}")
    for row in rows:
        name = f"{row['batch']}x{row['heads']}x{row['head_dim']}"
        if "error" in row:
            print(f"{name:>18} {row['peer']:>15}  failed: {row['error'][:60]}")
            continue
        print(f"{name:>18} {row['peer']:>15} {row['forward_ms']:8.3f} {row['forward_ratio']:9.2f} "
              f"{row['backward_ms']:8.3f} {row['backward_ratio']:9.2f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
