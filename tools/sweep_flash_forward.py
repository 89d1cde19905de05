"""Tile sweep of the flash forward on the GPU: each forward kernel row of a head_dim timed in one process
beside torch SDPA's flash (FA2) and cuDNN backends on the same data, its output checked.

    python -m tools.sweep_flash_forward --out sweep_flash_forward.json
    python -m tools.sweep_flash_forward --variants 128:s128x2x2,128:s128x2x2n,128:w64x3x2 --seqlens 1024,4096
    python -m tools.sweep_flash_forward --variants 128:s64x2x2,128:w64x3x2 --softcap 30

A variant is ``HEAD_DIM:TILES``, with TILES spelled as tools.bench_flash spells a forward row:
``sBNxCONSUMERSxSTAGES`` the warp-specialised kernel (``...n``: its consumers without ping-pong),
``wBNxWARPGROUPSxSTAGES`` the FA2-class wgmma kernel, ``BMxBNxSTAGESxMTILES`` mma.sync. By default each
head_dim's shipped sm_90a row is timed against the FA2-class wgmma row. Workload: bf16, batch mode,
B = 16384 / S sequences of S tokens, 16 query heads (``--kv-heads`` for GQA), causal and not. Every
variant's kernels are compiled first, in parallel processes, into the disk cache.

Reported per variant and workload: milliseconds of one forward call (five calls back to back per
sample, the median of 15 samples), TFLOP/s, and the largest absolute difference from SDPA's flash
output (plain attention), or from the first variant's (``--softcap``: SDPA takes no softcap; the
modified instantiations then run, and SDPA's plain times stay as a reference). Peers are timed
in turn on each workload, so a clock change between workloads moves every peer alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from tools.bench_flash import forward_tiles, spell_forward_tiles
from tools.benchlib import median_ms, precompile

TOKENS, HEADS = 16384, 16
SEQLENS = (1024, 4096, 16384)
CALLS_PER_SAMPLE = 5


def default_variants() -> list[str]:
    """Per head_dim the flash path ships: sm_90a's row and the FA2-class wgmma row."""
    from hipattn.catalog.common import FLASH_HEAD_DIMS
    from hipattn.catalog.flash_forward import FLASH_FORWARD_WGMMA_TILES, tiles_for
    from hipattn.jit.target import Target

    variants = []
    for head_dim in FLASH_HEAD_DIMS:
        for tiles in (tiles_for(head_dim, Target.parse("sm_90a")), FLASH_FORWARD_WGMMA_TILES[head_dim]):
            variant = f"{head_dim}:{spell_forward_tiles(tiles)}"
            if variant not in variants:
                variants.append(variant)
    return variants


def parse_variant(text: str):
    head_dim, tiles = text.split(":")
    return int(head_dim), forward_tiles(tiles)


def _case(head_dim: int, seqlen: int, causal: bool, kv_heads: int, softcap: float, variants) -> list[dict]:
    """Every variant of ``head_dim`` and both SDPA backends on one workload."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hipattn import arrays, runtime
    from hipattn import problem as problem_mod
    from hipattn.ops import flash
    from hipattn.streams import on_device, resolve_stream

    batch = TOKENS // seqlen
    gen = torch.Generator(device="cuda").manual_seed(seqlen + head_dim)
    q = torch.randn(batch, seqlen, HEADS, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, kv_heads, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    a = {name: arrays.as_device_array(t, name) for name, t in (("q", q), ("k", k), ("v", v))}
    problem = problem_mod.describe(a["q"], a["k"], a["v"], causal=causal, softcap=softcap)
    pairs = batch * (seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen)
    flops = 4.0 * HEADS * head_dim * pairs
    base = {"head_dim": head_dim, "seqlen": seqlen, "causal": causal, "kv_heads": kv_heads, "softcap": softcap}
    rows, reference = [], None

    def timed(name: str, run) -> dict:
        ms = median_ms(run, warmup=3, repeat=15, calls=CALLS_PER_SAMPLE)
        return {**base, "variant": name, "forward_ms": ms, "forward_tflops": flops / (ms * 1e-3) / 1e12}

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's [B, H, S, D] view of the same data
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run_sdpa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                        enable_gqa=kv_heads != HEADS)
        try:
            out = run_sdpa().transpose(1, 2)
        except RuntimeError as error:  # a backend that refuses the shape
            rows.append({**base, "variant": name, "error": str(error).splitlines()[0][:200]})
            continue
        if name == "sdpa_flash" and not softcap:
            reference = out.float()
        rows.append(timed(name, run_sdpa))
        print(json.dumps(rows[-1]), flush=True)

    out = torch.empty_like(q)
    lse = torch.empty(batch, HEADS, seqlen, device="cuda", dtype=torch.float32)
    out_a, lse_a = arrays.as_device_array(out, "out"), arrays.as_device_array(lse, "lse")
    with on_device(runtime.active().backend, problem.device):
        stream = resolve_stream((a["q"],), None, device=problem.device)
        for variant_head_dim, tiles in variants:
            if variant_head_dim != head_dim:
                continue

            def run(tiles=tiles):
                flash.forward(problem, a["q"], a["k"], a["v"], out_a, lse_a, stream, tiles=tiles)

            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            if reference is None:
                reference = out.float().clone()  # the first variant's, under a softcap
            row = timed(spell_forward_tiles(tiles), run)
            row["max_abs_diff"] = float((out.float() - reference).abs().max())  # NaN where a row was not written
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["variant"] for r in rows))
    lines = [f"{'d':>4} {'S':>6} {'causal':>6} " + " ".join(f"{n:>12}" for n in names) + "   (TFLOP/s)"]
    for key in dict.fromkeys((r["head_dim"], r["seqlen"], r["causal"]) for r in rows):
        cells = []
        for n in names:
            row = next((r for r in rows if (r["head_dim"], r["seqlen"], r["causal"]) == key and r["variant"] == n), {})
            cells.append(f"{row['forward_tflops']:12.1f}" if "forward_tflops" in row else f"{'-':>12}")
        lines.append(f"{key[0]:>4} {key[1]:>6} {key[2]!s:>6} " + " ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="sweep_flash_forward.json")
    parser.add_argument("--variants", default=None, help="comma-separated HEAD_DIM:TILES; default: see above")
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--causal", default="0,1", help="comma-separated 0/1")
    parser.add_argument("--kv-heads", type=int, default=HEADS)
    parser.add_argument("--softcap", type=float, default=0.0, help="time the modified instantiations with this softcap")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in (args.variants.split(",") if args.variants else default_variants())]
    precompile([tiles.spec("bf16", head_dim, score_mods=bool(args.softcap)) for head_dim, tiles in variants])
    import torch

    rows = []
    for head_dim in dict.fromkeys(v[0] for v in variants):
        for seqlen in map(int, args.seqlens.split(",")):
            for causal in (bool(int(c)) for c in args.causal.split(",")):
                rows += _case(head_dim, seqlen, causal, args.kv_heads, args.softcap, variants)
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "command": " ".join(["python -m tools.sweep_flash_forward", *sys.argv[1:]])}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(_table(rows))


if __name__ == "__main__":
    main()
