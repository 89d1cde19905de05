"""The performance dashboard: hipattn against its peers on every cell of the matrix, in one GPU call.

    python -m tools.bench_matrix --out DIR                  # the full matrix
    python -m tools.bench_matrix --quick --out DIR          # the A/B subset, about 2 minutes
    python -m tools.bench_matrix --only 'smallseq/d128' --out DIR
    python -m tools.bench_matrix --list [--quick] [--only REGEX]    # the cells and time estimates; no GPU
    python -m tools.bench_matrix --report DIR [--out OUTDIR]        # markdown + heat map again from the JSON
    python -m tools.bench_matrix --compare OLD.json NEW.json        # hipattn per cell, A/B

Sections (tools/matrix/cells.py): small-seq THD (head_dim 64/128/256, Hq:Hkv 16:16 .. 16:1 and 8:1,
forward and backward), general batch BSHD (head_dim 64/96/128/256, 16:16 and 16:4, causal or not,
S = 512..16384 at 16384 tokens, forward and forward + backward), varlen THD (lengths 128..4096),
decode (one query token against 1k-128k keys), sliding window (flash-attn's window_size: BSHD at
16384 tokens, S 4096 and 16384, and decode steps; FlexAttention, varlen_attn and a masked SDPA as
peers), scoremod (flash-attn's softcap=50 and ALiBi alibi_slopes: BSHD at 16384 tokens, S 4096 and
16384; FlexAttention with a score_mod, and SDPA with the ALiBi bias as a mask, as peers) and dropout
(dropout_p=0.1, BSHD at 16384 tokens, S 4096; SDPA's backends with the same dropout_p as peers). Every
cell's peers run in the same process as hipattn, interleaved with it; each cell records hipattn's and
every peer's samples with the SM clock, hipattn ÷ best peer, hipattn ÷ floor and a numeric check of
hipattn against a peer that computes the same function (none in dropout cells: each draws its own mask).

A run first fills hipattn's compile cache (``python -m hipattn warm --arch sm_90a``; --no-warm skips
it), then a worker process measures the two ceilings and the cells, rewriting DIR/bench_matrix.json
after each; cells that would not end within --budget-seconds of the start are skipped and recorded.
DIR then holds bench_matrix.json (raw), bench_matrix.md (a BENCHMARKS.md section) and
bench_matrix.png (heat map of hipattn ÷ best peer), plus the worker's stderr log.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

from tools.matrix import cells, report, run

DEFAULT_BUDGET_S = 480


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="folder for bench_matrix.json, .md and .png")
    parser.add_argument("--quick", action="store_true", help="the A/B subset: a few cells of each section")
    parser.add_argument("--only", metavar="REGEX", help="only the cells whose name matches (re.search)")
    parser.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET_S,
                        help="start no cell that would end later than this after the start (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=cells.ROUNDS, help="interleaved rounds per cell (default %(default)s)")
    parser.add_argument("--no-warm", action="store_true", help="skip `python -m hipattn warm` at the start")
    parser.add_argument("--warm-arch", default="sm_90a", help="the arch to prewarm (default %(default)s)")
    parser.add_argument("--list", action="store_true", help="print the selected cells and time estimates, then exit")
    parser.add_argument("--report", type=pathlib.Path, metavar="DIR",
                        help="write bench_matrix.md and .png from DIR's bench_matrix.json (into --out if given)")
    parser.add_argument("--compare", type=pathlib.Path, nargs=2, metavar=("OLD", "NEW"),
                        help="print hipattn per cell of two runs (JSON files or folders)")
    parser.add_argument("--worker", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return parser


def _list(options: argparse.Namespace) -> int:
    selected = cells.select(options.quick, options.only)
    for cell in selected:
        print(f"{cell.name:<52} ~{cells.estimate_seconds(cell, rounds=options.rounds):5.1f} s  "
              f"peers: {', '.join(cells.peers(cell))}")
    print(run.estimate_text(selected, options.rounds))
    return 0 if selected else 2


def main(argv: list[str]) -> int:
    parser = _parser()
    options = parser.parse_args(argv)
    if options.worker:
        from tools.matrix import gpu  # the only module that needs a GPU

        return run.work_loop(options.worker, options.deadline, gpu.CudaMeasurer())
    try:
        re.compile(options.only or "")
    except re.error as error:
        parser.error(f"--only {options.only!r} is not a regular expression: {error}")
    if options.list:
        return _list(options)
    if options.report:
        target = options.out or (options.report if options.report.is_dir() else options.report.parent)
        target.mkdir(parents=True, exist_ok=True)
        doc = run.load(options.report)
        written = report.write(doc, target)
        print(report.section_table(doc))
        print(report.summary_text(doc))
        print("wrote " + ", ".join(map(str, written)))
        return 0
    if options.compare:
        print(report.compare_text(run.load(options.compare[0]), run.load(options.compare[1])))
        return 0
    if options.out is None:
        parser.error("--out DIR is required to measure (or give --list, --report or --compare)")
    if options.rounds < 1:
        parser.error("--rounds must be at least 1")
    settings = {"quick": options.quick, "only": options.only, "budget_seconds": options.budget_seconds,
                "rounds": options.rounds, "warm": not options.no_warm, "warm_arch": options.warm_arch}
    return run.supervise(options.out.resolve(), argv, settings)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
