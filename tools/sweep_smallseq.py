"""Sweep of the tensor-core small-seq kernels' table rows on the GPU: warps per block and problems per
warp, each timed on bench_smallseq's workloads as a ratio to the memory floor.

    python -m tools.sweep_smallseq --out sweep_smallseq.json
    python -m tools.sweep_smallseq --variants forward:128:4x4,forward:128:1x1

A variant is ``DIRECTION:HEAD_DIM:WARPSxPROBLEMS_PER_TEAM``, with ``sSPLIT`` appended for teams of
SPLIT warps per problem (``backward:256:2x2s2``; catalog.smallseq.SmallSeqMmaTiles); by default every table
row is timed beside 1x1 and 4x4. Workloads, data and floors are bench_smallseq.py's;
every variant's outputs are compared with the table row's on the same data, so a fast but wrong
variant shows as a large "differs" figure.
"""

from __future__ import annotations

import argparse
import datetime
import json

from tools.bench_smallseq import TILE, WORKLOADS, _data, copy_bandwidth, floor_bytes
from tools.benchlib import median_ms


def default_variants() -> list[str]:
    from hipattn.catalog.smallseq import SMALLSEQ_BACKWARD_MMA_TILES, SMALLSEQ_FORWARD_MMA_TILES

    variants = []
    for direction, table in (("forward", SMALLSEQ_FORWARD_MMA_TILES), ("backward", SMALLSEQ_BACKWARD_MMA_TILES)):
        for head_dim, tiles in sorted(table.items()):
            for row in (spell(tiles), "1x1", "4x4"):
                if f"{direction}:{head_dim}:{row}" not in variants:
                    variants.append(f"{direction}:{head_dim}:{row}")
    return variants


def spell(tiles) -> str:
    """A row as a variant spells it: WARPSxPROBLEMS_PER_TEAM, and sSPLIT for teams of several warps."""
    return f"{tiles.warps}x{tiles.problems_per_team}" + (f"s{tiles.split}" if tiles.split != 1 else "")


def parse(variant: str):
    from hipattn.catalog.smallseq import SmallSeqBackwardMmaTiles, SmallSeqForwardMmaTiles

    direction, head_dim, row = variant.split(":")
    row, _, split = row.partition("s")
    warps, per_team = (int(x) for x in row.split("x"))
    row_type = SmallSeqForwardMmaTiles if direction == "forward" else SmallSeqBackwardMmaTiles
    return direction, int(head_dim), row_type(warps=warps, problems_per_team=per_team, split=int(split or 1))


def sweep_workload(workload, variants, bandwidth: float) -> list[dict]:
    """Time every variant of the workload's head_dim on its data; rows as main() reports them."""
    import torch

    import hipattn
    from hipattn.catalog import smallseq

    batch, heads, head_dim = workload
    q, k, v, cu_q, cu_k, total_q, total_k = _data(batch, heads, head_dim, seed=batch * 1000 + heads + head_dim)
    dout = torch.randn_like(q)
    forward_bytes, backward_bytes = floor_bytes(total_q, total_k, heads, head_dim)
    floors = {"forward": forward_bytes / bandwidth * 1e3, "backward": backward_bytes / bandwidth * 1e3}
    seq = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=TILE, max_seqlen_k=TILE)
    out, lse = hipattn.forward(q, k, v, **seq)  # the shipped rows' results: what every variant must match
    reference = {"forward": out.clone(), "backward": torch.cat(hipattn.backward(dout, q, k, v, out, lse, **seq))}
    out_variant, lse_variant = torch.empty_like(out), torch.empty_like(lse)  # the backward reads the shipped LSE
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    runs = {
        "forward": lambda: hipattn.forward(q, k, v, out=out_variant, lse=lse_variant, **seq),
        "backward": lambda: hipattn.backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], **seq),
    }
    tables = {"forward": smallseq.SMALLSEQ_FORWARD_MMA_TILES, "backward": smallseq.SMALLSEQ_BACKWARD_MMA_TILES}
    rows = []
    for direction, variant_head_dim, tiles in variants:
        if variant_head_dim != head_dim:
            continue
        shipped = tables[direction][head_dim]
        tables[direction][head_dim] = tiles  # the row the launcher looks up for this head_dim, for now
        try:
            ms = median_ms(runs[direction])
        finally:
            tables[direction][head_dim] = shipped
        got = out_variant if direction == "forward" else torch.cat(grads)
        differs = float((got.float() - reference[direction].float()).abs().max())
        row = {"direction": direction, "batch": batch, "heads": heads, "head_dim": head_dim, "warps": tiles.warps,
               "split": tiles.split, "problems_per_team": tiles.run_length(batch * heads),
               "ms": ms,
               "floor_ms": floors[direction], "ratio": ms / floors[direction], "differs": differs}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="sweep_smallseq.json")
    parser.add_argument("--variants", default=None)
    args = parser.parse_args()

    import torch

    variants = [parse(v) for v in (args.variants.split(",") if args.variants else default_variants())]
    bandwidth = copy_bandwidth()
    rows = []
    for workload in WORKLOADS:
        rows += sweep_workload(workload, variants, bandwidth)
    report = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
