"""Tile sweep of the flash backward on the GPU: each (dK/dV tiles, dQ tiles) variant timed on both dQ
schedules, its gradients checked against torch SDPA's flash backend on the same data.

    python -m tools.sweep_flash_backward --out sweep_flash_backward.json
    python -m tools.sweep_flash_backward --variants 128:32x64x8/64x32x4,128:32x128x8/64x64x4

A variant is ``HEAD_DIM:BMxBNxWARPS/BMxBNxWARPS``, the dK/dV kernel's tiles then the dQ kernel's
(catalog.flash_backward.FlashDkdvMmaTiles and FlashDqMmaTiles); a dK/dV part ``wWARPGROUPS``
(``128:w2/128x64x8``), or ``wWARPGROUPScCOLUMN_GROUPS`` (``256:w2c2/128x32x8``), with ``mQUERY_ROWS``
after it where the query tile is not 64 rows (``64:w2m128/128x128x8``), runs the wgmma dK/dV kernel
(sm_90a; FlashDkdvWgmmaTiles); ``sQUERY_ROWSxSTAGES`` (``128:s64x2/128x64x8``) the warp-specialised one
(sm_90a; FlashDkdvWarpSpecialisedTiles). By default each head_dim's every-part table row is
timed against Hopper's mma.sync rows and, where sm_90a has one, its wgmma row. Workload: bf16, batch
mode, B = 16384 / S sequences of S tokens, 16 heads, causal and not.
Every variant's kernels are compiled first, in parallel processes, into the disk cache.

Reported per variant: milliseconds of one backward call (Delta, the dK/dV kernel, and dQ either by
atomics plus the conversion or by the dQ kernel) and its TFLOP/s (2.5 forwards' worth of matrix
products), and the largest relative error of dQ, dK, dV against SDPA's. Also timed once per head_dim:
Delta = rowsum(dO * O) alone (preprocess.dot_do_o) and the dq_accum conversion alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from tools.benchlib import median_ms, precompile

TOKENS, HEADS = 16384, 16
# Sweeps add --variants of their own; by default each head_dim's table rows are compared.
def default_variants() -> list[str]:
    """Per head_dim, the every-part table's rows, Hopper's mma.sync rows, and sm_90a's where they differ
    (catalog.flash_backward.tiles_for)."""
    from hipattn.catalog.common import FLASH_HEAD_DIMS
    from hipattn.catalog.flash_backward import tiles_for
    from hipattn.jit.target import Target

    variants = []
    for head_dim in FLASH_HEAD_DIMS:
        for arch in ("sm_80", "sm_90", "sm_90a"):
            dkdv, dq = tiles_for(head_dim, Target.parse(arch))
            variant = f"{head_dim}:{spell(dkdv)}/{spell(dq)}"
            if variant not in variants:
                variants.append(variant)
    return variants


def spell(tiles) -> str:
    """A row as a variant spells it: BMxBNxWARPS (mma.sync), wWARPGROUPS with cCOLUMN_GROUPS where
    there are several and mQUERY_ROWS where they are not 64 (the wgmma dK/dV kernel), or
    sQUERY_ROWSxSTAGES (the warp-specialised one)."""
    from hipattn.catalog.flash_backward import (
        FLASH_BACKWARD_DKDV_WARP_SPECIALISED,
        FLASH_BACKWARD_DKDV_WGMMA,
        FlashDkdvWgmmaTiles,
    )

    if tiles.family is FLASH_BACKWARD_DKDV_WARP_SPECIALISED:
        return f"s{tiles.block_m}x{tiles.stages}"
    if tiles.family is FLASH_BACKWARD_DKDV_WGMMA:
        column_groups = f"c{tiles.column_groups}" if tiles.column_groups > 1 else ""
        rows = f"m{tiles.block_m}" if tiles.block_m != FlashDkdvWgmmaTiles.block_m else ""
        return f"w{tiles.warpgroups}{column_groups}{rows}"
    return f"{tiles.block_m}x{tiles.block_n}x{tiles.warps}"


def parse_variant(text: str):
    from hipattn.catalog.flash_backward import (
        FlashDkdvMmaTiles,
        FlashDkdvWarpSpecialisedTiles,
        FlashDkdvWgmmaTiles,
        FlashDqMmaTiles,
    )

    head_dim, tiles = text.split(":")
    dkdv_text, dq_text = tiles.split("/")
    if dkdv_text.startswith("s"):
        block_m, stages = dkdv_text[1:].split("x")
        dkdv = FlashDkdvWarpSpecialisedTiles(int(block_m), int(stages))
    elif dkdv_text.startswith("w"):
        groups, _, block_m = dkdv_text[1:].partition("m")
        warpgroups, _, column_groups = groups.partition("c")
        dkdv = FlashDkdvWgmmaTiles(int(warpgroups), int(column_groups or 1),
                                   int(block_m or FlashDkdvWgmmaTiles.block_m))
    else:
        dkdv = FlashDkdvMmaTiles(*map(int, dkdv_text.split("x")))
    return int(head_dim), dkdv, FlashDqMmaTiles(*map(int, dq_text.split("x")))


def compile_variants(variants) -> None:
    """Every variant's three kernels (the plain instantiations the sweep's calls run) into the disk cache,
    in parallel."""
    specs = []
    for head_dim, dkdv, dq in variants:
        specs += [dkdv.spec("bf16", head_dim, write_dq=write_dq, score_mods=False) for write_dq in (False, True)]
        specs.append(dq.spec("bf16", head_dim, score_mods=False))
    precompile(specs)


def relative_error(actual, expected) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def _case(head_dim: int, seqlen: int, causal: bool, variants) -> list[dict]:
    """Every variant of ``head_dim`` on one workload, after Delta and the conversion alone."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import hipattn
    from hipattn import arrays, runtime
    from hipattn import problem as problem_mod
    from hipattn.ops import flash_backward, preprocess
    from hipattn.streams import on_device, resolve_stream

    batch = TOKENS // seqlen
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, dout = (torch.randn(batch, seqlen, HEADS, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    out, lse = hipattn.forward(q, k, v, causal=causal)
    qg, kg, vg = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        reference = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal),
                                        (qg, kg, vg), dout.transpose(1, 2))
    reference = [g.transpose(1, 2) for g in reference]
    a = {name: arrays.as_device_array(t, name) for name, t in
         (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse))}
    problem = problem_mod.describe(a["q"], a["k"], a["v"], causal=causal)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    dq, dk, dv = (arrays.as_device_array(t, n) for t, n in zip(grads, ("dq", "dk", "dv"), strict=True))
    softmax_d = arrays.as_device_array(torch.empty(lse.shape, device="cuda", dtype=torch.float32), "softmax_d")
    dq_accum = arrays.as_device_array(torch.empty(q.shape, device="cuda", dtype=torch.float32), "dq_accum")
    pairs = batch * (seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen)
    flops = 4.0 * HEADS * head_dim * pairs
    rows = []
    backend = runtime.active().backend
    with on_device(backend, problem.device):
        stream = resolve_stream((a["q"],), None, device=problem.device)
        rows.append({"head_dim": head_dim, "seqlen": seqlen, "causal": causal,
                     "dot_do_o_ms": median_ms(lambda: preprocess.dot_do_o(a["out"], a["dout"], softmax_d, stream)),
                     "convert_dq_ms": median_ms(lambda: preprocess.convert_dq(dq_accum, dq, 0.1, stream))})
        print(json.dumps(rows[-1]), flush=True)
        for variant_head_dim, dkdv_tiles, dq_tiles in variants:
            if variant_head_dim != head_dim:
                continue
            for deterministic in (False, True):
                def run(deterministic=deterministic, tiles=(dkdv_tiles, dq_tiles)):
                    flash_backward.backward(problem, a["q"], a["k"], a["v"], a["out"], a["dout"], a["lse"], dq, dk, dv,
                                            stream, softmax_d=softmax_d, dq_accum=dq_accum,
                                            deterministic=deterministic, tiles=tiles)

                for g in grads:
                    g.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                error = max(relative_error(g, r) for g, r in zip(grads, reference, strict=True))
                ms = median_ms(run, warmup=3, repeat=15)
                rows.append({"head_dim": head_dim, "seqlen": seqlen, "causal": causal,
                             "dkdv": spell(dkdv_tiles), "dq": spell(dq_tiles),
                             "deterministic": deterministic, "backward_ms": ms,
                             "backward_tflops": 2.5 * flops / (ms * 1e-3) / 1e12, "max_error_vs_sdpa_flash": error})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="sweep_flash_backward.json")
    parser.add_argument("--variants", default=None, help="comma-separated; default: each head_dim's two table rows")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", default="0,1", help="comma-separated 0/1")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in (args.variants.split(",") if args.variants else default_variants())]
    compile_variants(variants)
    import torch

    rows = []
    for head_dim in sorted({v[0] for v in variants}):
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            rows += _case(head_dim, args.seqlen, causal, variants)
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "command": " ".join(["python", *sys.argv])}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
