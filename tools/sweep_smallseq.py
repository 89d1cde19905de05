"""Sweep of the tensor-core small-seq kernels' table rows on the GPU, on bench_matrix's small-seq cells:
each variant timed as a ratio to the cell's floor, and checked against the shipped row's outputs.

    python -m tools.sweep_smallseq --out sweep_smallseq.json                 # every small-seq cell
    python -m tools.sweep_smallseq --cells smallseq/d64/h16:8/bwd --variants bwd:64:4x1,bwd:64:2x4

A variant is ``DIRECTION:HEAD_DIM:WARPSxPROBLEMS_PER_TEAM``, with ``sSPLIT`` appended for teams of
SPLIT warps per problem (``bwd:256:4x2s4``; catalog.smallseq.SmallSeqMmaTiles). It replaces the row
that the cell's launch looks up: the ungrouped heads' table for an MHA cell, the grouped heads'
(GQA/MQA) table otherwise. By default every cell times its shipped row beside a few neighbours (half
and twice the warps per block, and runs of 1 and 4). Cells, data, floors and timing are
bench_matrix's (tools/matrix); a variant whose outputs differ from the shipped row's by more than
bf16 rounding shows as a large "differs" figure, so a fast but wrong variant cannot pass unseen.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import statistics
import sys

from tools.benchlib import precompile
from tools.matrix import cells
from tools.matrix.run import source_identity

SAMPLES = 15
CALLS_PER_SAMPLE = 8


def table_for(cell: cells.Cell) -> dict:
    """The catalog table whose row the cell's launch looks up."""
    from hipattn.catalog import smallseq

    grouped = cell.heads_q != cell.heads_kv
    if cell.direction == "fwd":
        return smallseq.SMALLSEQ_GQA_FORWARD_MMA_TILES if grouped else smallseq.SMALLSEQ_FORWARD_MMA_TILES
    return smallseq.SMALLSEQ_GQA_BACKWARD_MMA_TILES if grouped else smallseq.SMALLSEQ_BACKWARD_MMA_TILES


def spell(tiles) -> str:
    """A row as a variant spells it: WARPSxPROBLEMS_PER_TEAM, and sSPLIT for teams of several warps."""
    return f"{tiles.warps}x{tiles.problems_per_team}" + (f"s{tiles.split}" if tiles.split != 1 else "")


def parse(variant: str) -> tuple[str, int, dict]:
    """(direction, head_dim, row fields) of a variant's spelling."""
    try:
        direction, head_dim, row = variant.split(":")
        row, _, split = row.partition("s")
        warps, per_team = (int(x) for x in row.split("x"))
        if direction not in ("fwd", "bwd"):
            raise ValueError
        return direction, int(head_dim), {"warps": warps, "problems_per_team": per_team, "split": int(split or 1)}
    except ValueError:
        raise SystemExit(f"--variants: {variant!r} is not DIRECTION:HEAD_DIM:WARPSxRUN[sSPLIT] "
                         "(DIRECTION fwd or bwd, e.g. bwd:128:2x2s2)") from None


def neighbours(tiles) -> list[dict]:
    """The shipped row and a few rows around it: half and twice the teams per block, runs of 1 and 4."""
    rows = [dataclasses.asdict(tiles)]
    for teams in (tiles.teams // 2, tiles.teams * 2):
        if teams >= 1 and teams * tiles.split * 32 <= 1024:
            rows.append({**rows[0], "warps": teams * tiles.split})
    for run in (1, 4):
        rows.append({**rows[0], "problems_per_team": run})
    unique = []
    for row in rows:
        if row not in unique:
            unique.append(row)
    return unique


def sweep_cell(measurer, cell: cells.Cell, rows: list[dict], floor_ms: float) -> list[dict]:
    """Time each row on the cell's data (the shipped row first, as the reference of every other)."""
    from tools.matrix import gpu

    table = table_for(cell)
    shipped = table[cell.head_dim]
    data = measurer.prepare(cell)
    results, reference = [], None
    for fields in rows:
        table[cell.head_dim] = dataclasses.replace(shipped, **fields)  # the row the launch looks up, for now
        try:
            runner = measurer.build("hipattn", cell, data)
            outputs = tuple(t.clone() for t in measurer.first_call(runner))
            samples = [measurer.sample(runner, i, CALLS_PER_SAMPLE) for i in range(SAMPLES)]
        finally:
            table[cell.head_dim] = shipped
        if reference is None:
            reference = outputs
        check = gpu.compare(outputs, reference)
        ms = statistics.median(samples)
        row = {"cell": cell.name, "row": spell(dataclasses.replace(shipped, **fields)),
               "shipped": fields == dataclasses.asdict(shipped), "ms": ms, "floor_ms": floor_ms,
               "ratio": ms / floor_ms, "differs_rel_l2": check["rel_l2"], "ok": check["ok"],
               "clock_mhz": measurer.clock_mhz()}
        results.append(row)
        print(json.dumps(row), flush=True)
    measurer.release()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="sweep_smallseq.json")
    parser.add_argument("--cells", default=None, help="comma-separated bench_matrix cell names (default: every "
                        "small-seq cell)")
    parser.add_argument("--variants", default=None, help="comma-separated rows to time besides the shipped one "
                        "(default: its neighbours; an empty string: the shipped row alone)")
    args = parser.parse_args()

    from tools.matrix import gpu

    chosen = ([cells.by_name(name) for name in args.cells.split(",")] if args.cells
              else [c for c in cells.all_cells() if c.section == "smallseq" and c.direction != "fwdbwd"])
    variants = None if args.variants is None else [parse(v) for v in args.variants.split(",") if v]
    measurer = gpu.CudaMeasurer()
    plan = []
    for cell in chosen:
        shipped = table_for(cell)[cell.head_dim]
        rows = neighbours(shipped) if variants is None else [dataclasses.asdict(shipped)] + [
            f for d, h, f in variants if d == cell.direction and h == cell.head_dim]
        plan.append((cell, rows))
    precompile(dataclasses.replace(table_for(cell)[cell.head_dim], **fields).call_spec("bf16", cell.head_dim, cell.heads_q)
               for cell, rows in plan for fields in rows)
    ceilings = cells.Ceilings(**{k: v for k, v in measurer.ceilings().items() if k.endswith("_per_s")})
    results = []
    for cell, rows in plan:
        results += sweep_cell(measurer, cell, rows, cells.floor(cells.work(cell), ceilings)["ms"])
    report = {"date": datetime.date.today().isoformat(),
              "command": "python -m tools.sweep_smallseq " + shlex.join(sys.argv[1:]),
              "source": source_identity(), "environment": measurer.environment(),
              "ceilings": dataclasses.asdict(ceilings), "rows": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
