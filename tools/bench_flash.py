"""General attention on the GPU: hipattn's flash path against torch's, in TFLOP/s, forward and backward.

    python -m tools.bench_flash --out bench_flash.json                       # the issue's table
    python -m tools.bench_flash --peers hipattn,hipattn@128x64x1x2 --no-backward   # a forward tile sweep
    python -m tools.bench_flash --peers hipattn@w128x1x1,hipattn@w64x2x2 --no-backward  # wgmma tiles (sm_90a)
    python -m tools.bench_flash --head-dim 64 --peers hipattn,hipattn@w128x2x2,sdpa_flash --no-backward
    python -m tools.bench_flash --peers hipattn@s128x2x2,hipattn@s64x3x2 --no-backward  # warp-specialised tiles

Workloads: bf16, head_dim 128 (--head-dim: another the flash path ships), 16 heads, 16k tokens per batch. Batch mode: BSHD with
B = 16384 / S for S in 512 .. 16384. Varlen: the same 16k tokens split into sequences of lengths
drawn uniformly from 128..4096 (fixed seed), THD. Causal and not. FLOPs of the forward: 4 * H * D
per visible (query, key) pair (4 * B * H * S^2 * D, about halved when causal); forward + backward
counts 3.5 times that (the backward does 2.5 forwards' worth of matrix products).
Times are the median device time per call over back-to-back calls (benchlib.median_ms with several
calls per sample), so a call's host overhead overlaps the previous call's kernels as in a training step.

Peers, each in its own process so that a failing one cannot take the others down: hipattn through
its public entry points (hipattn.forward / hipattn.backward, the flash path), torch SDPA's flash
(FA2) and cuDNN backends on the same data in [B, H, S, D] views (batch mode), and torch's varlen
attention (varlen mode). ``hipattn@BMxBNxSTAGESxMTILES`` times hipattn's mma.sync forward kernel with
those tiles, ``hipattn@wBNxWARPGROUPSxSTAGES`` its FA2-class wgmma one and
``hipattn@sBNxCONSUMERSxSTAGES`` its warp-specialised one (``...n``: without ping-pong), through
ops.flash.forward directly, which lets the mma.sync kernel run on sm_90a too; each checks its output
against SDPA's.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from tools.benchlib import median_ms, run_child, write_report

SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
TOKENS, HEADS, HEAD_DIM = 16384, 16, 128  # HEAD_DIM: the default of --head-dim
VARLEN_RANGE = (128, 4096)
PEERS = ["hipattn", "sdpa_flash", "sdpa_cudnn", "varlen_attn"]
BACKWARD_FLOP_FACTOR = 3.5  # forward + backward FLOPs over forward FLOPs
BACK_TO_BACK_CALLS = 5


def varlen_lengths() -> list[int]:
    """Sequence lengths uniform in VARLEN_RANGE summing to TOKENS (the last one trimmed)."""
    draw = random.Random(2026)
    lengths: list[int] = []
    while sum(lengths) < TOKENS:
        lengths.append(min(draw.randint(*VARLEN_RANGE), TOKENS - sum(lengths)))
    return lengths


def pair_count(lengths: list[int], causal: bool) -> int:
    """Visible (query, key) pairs of self-attention over sequences of ``lengths``."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def forward_flops(lengths: list[int], causal: bool, head_dim: int) -> float:
    return 4.0 * HEADS * head_dim * pair_count(lengths, causal)


def forward_tiles(name: str):
    """The forward tile row a peer or sweep variant spells: ``BMxBNxSTAGESxMTILES`` (mma.sync),
    ``wBNxWARPGROUPSxSTAGES`` (FA2-class wgmma) or ``sBNxCONSUMERSxSTAGES`` (warp-specialised; a trailing
    ``n`` turns its consumers' ping-pong off)."""
    from hipattn.catalog.flash_forward import (
        FlashForwardMmaTiles,
        FlashForwardWarpSpecialisedTiles,
        FlashForwardWgmmaTiles,
    )

    if name.startswith("w"):
        block_n, warpgroups, stages = map(int, name[1:].split("x"))
        return FlashForwardWgmmaTiles(block_n=block_n, warpgroups=warpgroups, stages=stages)
    if name.startswith("s"):
        ping_pong = not name.endswith("n")
        block_n, consumers, stages = map(int, name[1:].rstrip("n").split("x"))
        return FlashForwardWarpSpecialisedTiles(block_n=block_n, consumers=consumers, stages=stages,
                                                ping_pong=ping_pong)
    block_m, block_n, stages, m_tiles = map(int, name.split("x"))
    return FlashForwardMmaTiles(block_m=block_m, block_n=block_n, stages=stages, m_tiles=m_tiles)


def spell_forward_tiles(tiles) -> str:
    """``tiles`` as forward_tiles spells it."""
    from hipattn.catalog.flash_forward import FlashForwardWarpSpecialisedTiles, FlashForwardWgmmaTiles

    if isinstance(tiles, FlashForwardWgmmaTiles):
        return f"w{tiles.block_n}x{tiles.warpgroups}x{tiles.stages}"
    if isinstance(tiles, FlashForwardWarpSpecialisedTiles):
        return f"s{tiles.block_n}x{tiles.consumers}x{tiles.stages}" + ("" if tiles.ping_pong else "n")
    return f"{tiles.block_m}x{tiles.block_n}x{tiles.stages}x{tiles.m_tiles}"


def _tile_variant_forward(q, k, v, out, lse, causal: bool, tiles):
    """A closure that enqueues hipattn's flash forward kernel with ``tiles`` (what attention.forward
    does, with the tile override that only ops.flash.forward takes)."""
    from hipattn import arrays, runtime
    from hipattn import problem as problem_mod
    from hipattn.ops import flash
    from hipattn.streams import on_device, resolve_stream

    qa, ka, va = (arrays.as_device_array(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    out_a, lse_a = arrays.as_device_array(out, "out"), arrays.as_device_array(lse, "lse")
    backend = runtime.active().backend

    def run():
        problem = problem_mod.describe(qa, ka, va, causal=causal)
        with on_device(backend, problem.device):
            stream = resolve_stream((qa, ka, va), None, device=problem.device)
            flash.forward(problem, qa, ka, va, out_a, lse_a, stream, tiles=tiles)

    return run


def measure(peer: str, workload: str, causal: bool, backward: bool, head_dim: int) -> dict:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(7)
    if workload == "varlen":
        lengths = varlen_lengths()
        shape = (TOKENS, HEADS, head_dim)
    else:
        seqlen = int(workload)
        lengths = [seqlen] * (TOKENS // seqlen)
        shape = (len(lengths), seqlen, HEADS, head_dim)  # BSHD
    q, k, v, dout = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    result = {"peer": peer, "workload": workload, "sequences": len(lengths), "heads": HEADS, "head_dim": head_dim,
              "causal": causal}
    fwd = bwd = None
    if workload == "varlen":
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest = max(lengths)
    if peer == "hipattn":
        import hipattn

        args = {"causal": causal}
        if workload == "varlen":
            args.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
        out, lse = hipattn.forward(q, k, v, **args)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def fwd():
            hipattn.forward(q, k, v, out=out, lse=lse, **args)

        def bwd():
            hipattn.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **args)
    elif peer.startswith("hipattn@"):
        out = torch.empty_like(q)
        lse = torch.empty(shape[0], HEADS, shape[1], device="cuda", dtype=torch.float32)
        fwd = _tile_variant_forward(q, k, v, out, lse, causal, forward_tiles(peer.split("@", 1)[1]))
        fwd()
        reference = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)
        result["max_abs_diff_vs_sdpa"] = float((out.float() - reference.float()).abs().max())
    elif peer == "varlen_attn":
        from torch.nn.attention.varlen import varlen_attn

        mask = {"window_size": (-1, 0)} if causal else {}  # torch spells causal as a (left, right) window

        def fwd():
            return varlen_attn(q, k, v, cu, cu, longest, longest, **mask)

        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        graph_out = varlen_attn(qg, kg, vg, cu, cu, longest, longest, **mask)

        def bwd():
            torch.autograd.grad(graph_out, (qg, kg, vg), dout, retain_graph=True)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[peer]
        qt, kt, vt, dt = (t.transpose(1, 2) for t in (q, k, v, dout))  # SDPA's [B, H, S, D] view of the same data

        def fwd():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        qg, kg, vg = (t.detach().requires_grad_() for t in (qt, kt, vt))
        with sdpa_kernel(backend):
            graph_out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)

        def bwd():
            with sdpa_kernel(backend):
                torch.autograd.grad(graph_out, (qg, kg, vg), dt, retain_graph=True)

    flops = forward_flops(lengths, causal, head_dim)
    # Five calls back to back per sample; runs before 2026-11-30's run 3 timed one call alone.
    result["timing"] = f"back-to-back, {BACK_TO_BACK_CALLS} calls per sample"
    result["forward_ms"] = median_ms(fwd, repeat=10, calls=BACK_TO_BACK_CALLS)
    result["forward_tflops"] = flops / (result["forward_ms"] * 1e-3) / 1e12
    if backward and bwd is not None:
        result["backward_ms"] = median_ms(bwd, repeat=10, calls=BACK_TO_BACK_CALLS)
        total_ms = result["forward_ms"] + result["backward_ms"]
        result["fwd_bwd_tflops"] = BACKWARD_FLOP_FACTOR * flops / (total_ms * 1e-3) / 1e12
    torch.cuda.synchronize()
    return result


def applies(peer: str, workload: str) -> bool:
    """Whether ``peer`` takes ``workload``: SDPA and the tile variants have no varlen layout, and
    torch's varlen attention is timed on the varlen workload only."""
    if workload == "varlen":
        return peer in ("hipattn", "varlen_attn")
    return peer != "varlen_attn"


def _run_child(peer: str, workload: str, causal: bool, backward: bool, head_dim: int) -> dict:
    failure = {"peer": peer, "workload": workload, "heads": HEADS, "head_dim": head_dim, "causal": causal}
    return run_child(__spec__.name, [peer, workload, str(int(causal)), str(int(backward)), str(head_dim)], failure)


def _table(rows: list[dict], peers: list[str], workloads: list[str], key: str) -> str:
    lines = [f"{'causal':>6} {'workload':>8} " + " ".join(f"{p:>14}" for p in peers) + f"   ({key}, TFLOP/s)"]
    for causal in (False, True):
        for workload in workloads:
            cells = []
            for p in peers:
                row = next((r for r in rows if r["peer"] == p and r["workload"] == workload and r["causal"] == causal),
                           {})
                cells.append(f"{row[key]:14.1f}" if key in row else f"{'-':>14}")
            lines.append(f"{causal!s:>6} {workload:>8} " + " ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_flash.json")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="comma-separated; hipattn@BMxBNxSTAGESxMTILES (mma.sync), hipattn@wBNxWARPGROUPSxSTAGES "
                             "(wgmma) or hipattn@sBNxCONSUMERSxSTAGES (warp-specialised) times hipattn's "
                             "forward with those tiles")
    parser.add_argument("--workloads", default=",".join([*map(str, SEQLENS), "varlen"]),
                        help="sequence lengths S of batch mode, and/or 'varlen'")
    parser.add_argument("--no-backward", action="store_true", help="time the forward only")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help=f"the workloads' head_dim (default {HEAD_DIM})")
    parser.add_argument("--child", nargs=5, metavar=("PEER", "WORKLOAD", "CAUSAL", "BACKWARD", "HEAD_DIM"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        peer, workload, causal, backward, head_dim = args.child
        print(json.dumps(measure(peer, workload, bool(int(causal)), bool(int(backward)), int(head_dim))), flush=True)
        return

    import torch

    peers, workloads = args.peers.split(","), args.workloads.split(",")
    rows = []
    for causal in (False, True):
        for workload in workloads:
            for peer in peers:
                if not applies(peer, workload):
                    continue
                row = _run_child(peer, workload, causal, not args.no_backward, args.head_dim)
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_report(args.out, "tools.bench_flash", torch=torch.__version__,
                 flops="forward: 4 * H * D per visible (query, key) pair; forward + backward: 3.5 x that",
                 varlen_lengths=varlen_lengths(), rows=rows)
    print()
    print(_table(rows, peers, workloads, "forward_tflops"))
    if not args.no_backward:
        print()
        print(_table(rows, peers, workloads, "fwd_bwd_tflops"))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
