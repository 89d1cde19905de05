"""Plot a bench_flash.py report: TFLOP/s per workload, forward and forward + backward, hipattn against
each peer, causal and not.

    python -m tools.plot_flash benchmarks/2026-11-30_h200_flash_run3.json benchmarks/2026-11-30_h200_flash_run3.png
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
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    figure, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    width = 0.8 / len(peers)
    for column, causal in enumerate((False, True)):
        for line, (key, title) in enumerate((("forward_tflops", "forward"), ("fwd_bwd_tflops", "forward + backward"))):
            axis = axes[line][column]
            for p, peer in enumerate(peers):
                values = []
                for workload in workloads:
                    row = next((r for r in rows if (r["peer"], r["workload"], r["causal"]) == (peer, workload, causal)),
                               {})
                    values.append(row.get(key, float("nan")))
                positions = [i + (p - (len(peers) - 1) / 2) * width for i in range(len(workloads))]
                axis.bar(positions, values, width, label=peer)
            axis.set_xticks(range(len(workloads)), [f"S={w}" if w != "varlen" else "varlen" for w in workloads])
            axis.set_ylabel("TFLOP/s (higher is better)")
            axis.set_title(f"{title}, {'causal' if causal else 'non-causal'}; bf16, D=128, H=16, 16k tokens")
    axes[0][0].legend(fontsize=8)
    figure.suptitle(f"{report['device']}, {report['date']}; a missing bar: the peer takes no such layout")
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
