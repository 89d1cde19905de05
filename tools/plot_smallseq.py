"""Plot a bench_smallseq.py report: time / floor per workload, hipattn against each peer.

    python -m tools.plot_smallseq benchmarks/2026-11-30_h200_smallseq.json benchmarks/2026-11-30_h200_smallseq.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(report_path: str, png_path: str) -> None:
    report = json.load(open(report_path))
    rows = report["rows"]
    workloads = sorted({(r["batch"], r["heads"], r["head_dim"]) for r in rows}, key=lambda w: (w[2], w[0], w[1]))
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=False)
    width = 0.8 / len(peers)
    for axis, direction, bar in zip(axes, ("forward", "backward"), (1.3, 1.6), strict=True):
        for p, peer in enumerate(peers):
            values = []
            for w in workloads:
                row = next(r for r in rows if (r["batch"], r["heads"], r["head_dim"]) == w and r["peer"] == peer)
                values.append(row.get(f"{direction}_ratio", float("nan")))
            positions = [i + (p - (len(peers) - 1) / 2) * width for i in range(len(workloads))]
            axis.bar(positions, values, width, label=peer)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.axhline(bar, color="red", linestyle="--", linewidth=0.8, label=f"issue bar {bar}x")
        axis.set_xticks(range(len(workloads)), [f"B={b}\nH={h} D={d}" for b, h, d in workloads])
        axis.set_ylabel("time / memory floor (lower is better)")
        axis.set_title(f"small-seq {direction}, bf16, lengths U(1..17)")
    axes[0].legend(fontsize=8)
    figure.suptitle(f"{report['device']}, {report['date']}; missing bars: the peer failed (B*H > 65535)")
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
