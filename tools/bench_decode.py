"""Decode on the GPU: hipattn.flash_attn_with_kvcache's kernels, tiles and split heuristic swept against
torch SDPA's cuDNN and flash backends, on the decode shapes of the benchmark matrix.

    python -m tools.bench_decode --out bench_decode.json                     # the shipped configuration
    python -m tools.bench_decode --kernel mma:2,mma:3 --num-splits 0,1,16 --min-keys 512,1024
    python -m tools.bench_decode --kernel portable:4x4+8x2,portable:4x2+8x1  # the portable kernel on NVIDIA
    python -m tools.bench_decode --kernel shipped,tma:3,tma:5,mma:3          # Hopper's two kernels
    python -m tools.bench_decode --kernel shipped --l2-promotion 0,128,256   # the copy engine's L2 fetches
    python -m tools.bench_decode --only '^b1/' --num-splits 0,8,16,32       # the batch-1 shapes alone

A configuration is one attention row, ``shipped`` (catalog.decode.tiles_for), ``mma:STAGES`` (the
tensor-core kernel with 64-key tiles, its threads copying), ``tma:STAGES`` (the same fed by the copy
engine, persistent; Hopper) or ``portable:ROWSxUNROLL+...`` (the portable kernel's table, smallest rows
first), with one ``num_splits`` (0: ops.decode.choose_splits), one ``MIN_KEYS_PER_SPLIT`` (ops.decode)
and one L2 promotion of the copy-engine kernel's cache maps (ops.decode.CACHE_L2_PROMOTION, bytes; the
shipped one by default); every combination of the given lists is timed on every shape (or those
``--only`` names), contiguous and paged (pages of 256). Times are the median device time per call
over BACK_TO_BACK_CALLS back-to-back calls (benchlib.median_ms), eager (``hipattn_ms``: the host's
time per call shows where it exceeds the device's) and replayed from a CUDA graph (``graph_ms``: the
device's time alone); each configuration's output is checked against cuDNN's. The matrix
(tools/bench_matrix.py) is the record; this is the sweep.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re

from tools.benchlib import median_ms, write_report
from tools.matrix.cells import DECODE_HEAD_DIM, DECODE_PAGE_SIZE, DECODE_SHAPES

COPY_BYTES = 2 * 1024**3
# Calls per timed sample: a call's host time overlaps the previous call's kernels, as in a decode loop.
BACK_TO_BACK_CALLS = 5


def _attention_rows(text: str):
    """``shipped``, ``mma:STAGES`` or ``portable:RxU+RxU``: a function of (head_dim, rows) to the row to run."""
    from hipattn.catalog import decode

    kind, _, detail = text.partition(":")
    if kind == "shipped":
        return None
    if kind == "mma":
        tiles = decode.DecodeMmaTiles(block_n=64, stages=int(detail))
        return lambda head_dim, rows: tiles
    if kind == "tma":
        tiles = decode.DecodeTmaTiles(stages=int(detail))
        return lambda head_dim, rows: tiles
    if kind == "portable":
        table = sorted((decode.DecodeTiles(rows=int(r), unroll=int(u))
                        for r, u in (item.lower().split("x") for item in detail.split("+"))), key=lambda t: t.rows)
        return lambda head_dim, rows: next((t for t in table if rows <= t.rows), table[-1])
    raise ValueError(f"unknown kernel {text!r}: shipped, mma:STAGES, tma:STAGES or portable:RxU+RxU")


def shape_name(batch: int, kv: int, heads_q: int, heads_kv: int) -> str:
    """A decode shape as ``--only`` matches it: ``b{batch}/kv{KV length}/h{Hq}:{Hkv}``."""
    return f"b{batch}/kv{kv}/h{heads_q}:{heads_kv}"


def selected_shapes(only: str | None) -> list[tuple[int, int, int, int]]:
    """The matrix's decode shapes whose name (shape_name) ``only`` matches (re.search); all without it.
    A pattern that matches none is refused, so that a typo costs no GPU time."""
    shapes = [s for s in DECODE_SHAPES if only is None or re.search(only, shape_name(*s))]
    if not shapes:
        names = ", ".join(shape_name(*s) for s in DECODE_SHAPES)
        raise ValueError(f"--only {only!r} matches no decode shape; the shapes are {names}")
    return shapes


def _copy_bandwidth(torch) -> float:
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), repeat=10)
    return 2 * COPY_BYTES / (ms / 1e3)


def _inputs(torch, batch, kv, heads_q, heads_kv, generator):
    """q, contiguous k and v, and the same values paged as the matrix's decode cells page them."""
    from tools.matrix import cells, gpu

    t = torch.bfloat16
    q = torch.randn(batch, 1, heads_q, DECODE_HEAD_DIM, generator=generator, device="cuda").to(t)
    k = torch.randn(batch, kv, heads_kv, DECODE_HEAD_DIM, generator=generator, device="cuda").to(t)
    v = torch.randn(batch, kv, heads_kv, DECODE_HEAD_DIM, generator=generator, device="cuda").to(t)
    cell = cells.Cell("decode", "fwd", DECODE_HEAD_DIM, heads_q, heads_kv, batch=batch, seqlen_q=1, seqlen_k=kv,
                      page_size=DECODE_PAGE_SIZE)
    paged = gpu.decode_cache(cell, {"k": k, "v": v}, generator)
    return q, k, v, paged, paged["block_table"], paged["seqlens"]


def _graph_ms(torch, call) -> float:
    """The call's device time alone: captured once into a CUDA graph and timed by its replays."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    return median_ms(graph.replay, calls=BACK_TO_BACK_CALLS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="shipped", help="comma-separated attention rows (see above)")
    parser.add_argument("--num-splits", default="0", help="comma-separated num_splits values (0: the heuristic)")
    parser.add_argument("--min-keys", default=None, help="comma-separated MIN_KEYS_PER_SPLIT values")
    parser.add_argument("--l2-promotion", default=None,
                        help="comma-separated L2 promotions of the cache maps, in bytes (0, 64, 128, 256)")
    parser.add_argument("--only", default=None,
                        help="only the shapes whose name (b{batch}/kv{KV length}/h{Hq}:{Hkv}) matches this regex")
    parser.add_argument("--out", default="bench_decode.json")
    args = parser.parse_args()
    try:
        shapes = selected_shapes(args.only)
    except (ValueError, re.error) as error:
        parser.error(str(error))

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import hipattn
    from hipattn import runtime
    from hipattn.errors import CompileError
    from hipattn.ops import decode as ops

    kernels = args.kernel.split(",")
    shipped_tiles = ops.attention_tiles
    promotions = [int(x) for x in args.l2_promotion.split(",")] if args.l2_promotion else [ops.CACHE_L2_PROMOTION]
    split_counts = [int(x) for x in args.num_splits.split(",")]
    min_keys = [int(x) for x in args.min_keys.split(",")] if args.min_keys else [ops.MIN_KEYS_PER_SPLIT]
    bandwidth = _copy_bandwidth(torch)
    generator = torch.Generator(device="cuda").manual_seed(2026)
    results = []
    for batch, kv, heads_q, heads_kv in shapes:
        q, k, v, paged, table, seqlens = _inputs(torch, batch, kv, heads_q, heads_kv, generator)
        floor_ms = (q.nbytes * 2 + k.nbytes + v.nbytes) / bandwidth * 1e3
        views = [x.transpose(1, 2) for x in (q, k, v)]
        peers, reference = {}, None
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel(backend):
                peer = functools.partial(torch.nn.functional.scaled_dot_product_attention, *views,
                                         enable_gqa=heads_q != heads_kv)
                if reference is None:  # cuDNN's output: what every configuration is checked against
                    reference = peer().transpose(1, 2)
                peers[name] = median_ms(peer, calls=BACK_TO_BACK_CALLS)
        shape = {"batch": batch, "kv": kv, "heads_q": heads_q, "heads_kv": heads_kv, "floor_ms": floor_ms, **peers}
        for kernel, splits, keys, promotion in itertools.product(kernels, split_counts, min_keys, promotions):
            rows = _attention_rows(kernel)
            ops.attention_tiles = shipped_tiles if rows is None else (
                lambda problem, tensor_maps=True, rows=rows: rows(problem.head_dim, problem.rows_per_kv_head))
            ops.MIN_KEYS_PER_SPLIT = keys
            ops.CACHE_L2_PROMOTION = promotion
            runtime.active().launch_plans.clear()  # a plan replays the configuration it recorded
            config = {"kernel": kernel, "num_splits": splits, "min_keys": keys, "l2_promotion": promotion}
            for layout, (kc, vc, bt) in (("contiguous", (k, v, None)), ("paged", (paged["k"], paged["v"], table))):
                out = torch.full_like(q, float("nan"))
                call = functools.partial(hipattn.flash_attn_with_kvcache, q, kc, vc, cache_seqlens=seqlens,
                                         block_table=bt, num_splits=splits, out=out)
                try:
                    call()
                except CompileError as error:  # a row the kernel refuses (one that does not fit, say): the rest go on
                    row = {**shape, **config, "layout": layout, "error": str(error).splitlines()[0]}
                    results.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                error = float((out.float() - reference.float()).norm() / reference.float().norm())
                ms = median_ms(call, calls=BACK_TO_BACK_CALLS)
                row = {**shape, **config, "layout": layout, "hipattn_ms": ms, "rel_l2_vs_cudnn": error,
                       "vs_floor": ms / floor_ms, "vs_cudnn": ms / peers["sdpa_cudnn"],
                       "graph_ms": _graph_ms(torch, call)}
                results.append(row)
                print(json.dumps(row), flush=True)
        del q, k, v, paged
        torch.cuda.empty_cache()
    write_report(args.out, "tools.bench_decode", copy_bytes_per_s=bandwidth, results=results)


if __name__ == "__main__":
    main()
