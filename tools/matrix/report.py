"""What a bench_matrix JSON says: ratios, a summary, a BENCHMARKS.md section, a heat map and an A/B
comparison. Everything here reads the JSON alone (no GPU, no torch), so an old or partial run can be
rendered again anywhere; matplotlib is needed for the heat map only.
"""

from __future__ import annotations

import math
import pathlib

from . import cells

MARKDOWN_NAME = "bench_matrix.md"
PNG_NAME = "bench_matrix.png"
WORST_SHOWN = 5
SECTION_TITLES = {
    "smallseq": "Small-seq (THD, query and key lengths drawn from 1..17, 16384 sequences)",
    "batch": "General batch (BSHD, 16384 tokens: B = 16384 / S)",
    "varlen": "Varlen (THD, 16384 tokens in sequences of 128..4096, head_dim 128)",
    "decode": "Decode (one query token per sequence, flash_attn_with_kvcache, head_dim 128; paged: pages of 256)",
    "window": "Sliding window (flash-attn's window_size=(left, right), wL,R; BSHD at 16384 tokens, and decode steps "
              "whose window limits the keys read; floors count the visible pairs and keys only)",
    "scoremod": "Score modifiers (flash-attn's softcap and alibi_slopes: capN is softcap=N, alibi the ALiBi paper's "
                "slopes 2^(-8 (h + 1) / Hq); BSHD at 16384 tokens; softcap cells' queries have std 8, so that the "
                "scores reach the cap; floors those of plain attention on the shape)",
    "dropout": "Dropout (flash-attn's dropout_p, pP; BSHD at 16384 tokens; floors those of plain attention on the "
               "shape)",
}
SECTION_PEERS = {
    "smallseq": "torch's varlen_attn on the same THD data (the numeric check's reference); SDPA cuDNN and "
                "efficient on the padded [B, H, 17, D] batch without a padding mask (a lower bound on what "
                "padding costs; not checked, other data); SDPA flash is not run (B*H > 65535 ends the CUDA context)",
    "batch": "SDPA flash (FA2), cuDNN and efficient on [B, H, S, D] views of the same data (enable_gqa for GQA)",
    "varlen": "torch's varlen_attn on the same data (SDPA padded to the longest sequence would compute other "
              "attention on 2-3x the tokens, so it is not a peer)",
    "decode": "SDPA flash, cuDNN and efficient on [B, H, 1, D] views, and varlen_attn on THD views, of the same data",
    "window": "FlexAttention (torch.compile'd, a window mask_mod, its block mask built outside the timed calls) and "
              "varlen_attn (FA2) with window_size on views of the same data; SDPA efficient with the window as an "
              "explicit boolean mask (a reference that computes every pair, K/V heads repeated for GQA; not run where "
              "the mask exceeds 64 MiB); decode steps: SDPA flash, cuDNN and efficient on the window's slice of the cache. "
              "SDPA flash and cuDNN take no window (an explicit mask turns them off)",
    "scoremod": "FlexAttention (torch.compile'd, the modifier as a score_mod that reads the slopes from a tensor, a "
                "causal block mask built outside the timed calls) on views of the same data; for ALiBi alone, SDPA "
                "efficient with the bias as an explicit [Hq, S, S] bf16 mask (-inf where causal; a reference that "
                "computes every pair, K/V heads repeated for GQA; not run where the bias exceeds 1024 MiB). SDPA has "
                "no softcap, its flash and cuDNN backends take no bias, and torch's varlen_attn takes neither",
    "dropout": "SDPA flash (FA2), cuDNN and efficient with the same dropout_p on [B, H, S, D] views of the same data. "
               "No numeric check: each library draws its own mask (the GPU tests check hipattn's dropout against "
               "float64 with its mask)",
}
PEER_NAMES = {"sdpa_flash": "FA2 (SDPA)", "sdpa_cudnn": "cuDNN (SDPA)", "sdpa_efficient": "efficient (SDPA)",
              "varlen_attn": "varlen_attn", "hipattn": "hipattn", "flex": "FlexAttention",
              "sdpa_masked": "efficient (SDPA, bool mask)", "sdpa_bias": "efficient (SDPA, ALiBi bias)"}


# ---- per cell ------------------------------------------------------------------------------------

def derive(record: dict) -> dict:
    """best_peer, best_peer_ms, vs_best_peer (hipattn time / best peer's), vs_floor (hipattn time /
    floor) and check (the numeric check against the fastest timed peer that computes the same
    function, else against any checked one; never against a peer whose own output is not finite) of
    one cell's record."""
    runners = record.get("runners", {})
    hipattn_ms = runners.get("hipattn", {}).get("median_ms")
    peer_ms = {name: r["median_ms"] for name, r in runners.items()
               if name != "hipattn" and (r.get("median_ms") or 0) > 0}
    best = min(peer_ms, key=peer_ms.get) if peer_ms else None
    floor_ms = record.get("floor", {}).get("ms")
    checks = {name: c for name, c in record.get("checks", {}).items() if c.get("reference_finite", True)}
    timed_checks = [name for name in checks if name in peer_ms]
    reference = min(timed_checks, key=peer_ms.get) if timed_checks else next(iter(checks), None)
    return {
        "best_peer": best,
        "best_peer_ms": peer_ms.get(best),
        "vs_best_peer": hipattn_ms / peer_ms[best] if hipattn_ms is not None and best else None,
        "vs_floor": hipattn_ms / floor_ms if hipattn_ms and floor_ms else None,
        "check": {"reference": reference, **checks[reference]} if reference else None,
    }


def _order() -> dict[str, int]:
    return {cell.name: i for i, cell in enumerate(cells.all_cells())}


def records(doc: dict) -> list[dict]:
    """The cell records in the matrix's order (cells unknown to this version of the tool last), with
    the derived values recomputed from the raw ones."""
    order = _order()
    found = sorted(doc.get("cells", {}).values(), key=lambda r: (order.get(r["name"], len(order)), r["name"]))
    return [{**r, **derive(r)} if "runners" in r else r for r in found]


def _geometric_mean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summarize(doc: dict, section: str | None = None) -> dict:
    """Counts over the cells (of one section, or all): measured, with a peer, wins (hipattn faster
    than the best peer and its check not failed), check failures, hipattn failures, cells with no
    peer, skipped; geometric means of the ratios; the cells hipattn loses, worst first."""
    chosen = [r for r in records(doc) if section is None or r.get("section") == section]
    compared = [r for r in chosen if r.get("vs_best_peer") is not None]
    failed_checks = [r for r in chosen if r.get("check") is not None and not r["check"].get("ok")]
    hipattn_timed = [r for r in chosen if r.get("vs_floor") is not None]
    skipped = [name for name in doc.get("skipped", {}) if section is None or name.split("/")[0] == section]
    return {
        "cells": len(chosen),
        "compared": len(compared),
        "wins": sum(1 for r in compared if r["vs_best_peer"] < 1 and r not in failed_checks),
        "check_failures": [r["name"] for r in failed_checks],
        "hipattn_failed": [r["name"] for r in chosen if r.get("vs_floor") is None],
        "no_peer": [r["name"] for r in hipattn_timed if r.get("best_peer") is None],
        "skipped": skipped,
        "geomean_vs_best_peer": _geometric_mean([r["vs_best_peer"] for r in compared]),
        "geomean_vs_floor": _geometric_mean([r["vs_floor"] for r in hipattn_timed]),
        "worst": [(r["name"], r["vs_best_peer"], r["best_peer"])
                  for r in sorted(compared, key=lambda r: -r["vs_best_peer"]) if r["vs_best_peer"] > 1][:WORST_SHOWN],
    }


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def summary_text(doc: dict, markdown: bool = False) -> str:
    """One line: wins, geometric mean, check failures, worst cells, what did not run."""
    s = summarize(doc)
    quote = "`" if markdown else ""
    parts = [f"hipattn is faster than the best peer in {s['wins']} of {s['compared']} cells with a peer"]
    if s["geomean_vs_best_peer"] is not None:
        parts[0] += f" (geometric mean of hipattn ÷ best peer {s['geomean_vs_best_peer']:.2f}×)"
    parts.append(f"numeric check failed in {len(s['check_failures'])}"
                 + (": " + ", ".join(f"{quote}{n}{quote}" for n in s["check_failures"][:WORST_SHOWN])
                    if s["check_failures"] else ""))
    if s["worst"]:
        parts.append("worst losses: " + ", ".join(f"{quote}{name}{quote} {ratio:.2f}× ({PEER_NAMES.get(peer, peer)})"
                                           for name, ratio, peer in s["worst"]))
    if s["no_peer"]:
        parts.append(f"no peer ran in {len(s['no_peer'])}")
    if s["hipattn_failed"]:
        parts.append(f"hipattn has no time in {len(s['hipattn_failed'])}")
    if s["skipped"]:
        parts.append(f"skipped {len(s['skipped'])}")
    return "; ".join(parts) + "."


def section_table(doc: dict) -> str:
    """A few lines for a terminal: per section, cells, wins, geometric means and the worst loss."""
    lines = [f"{'section':<9} {'cells':>5} {'wins':>9} {'÷peer':>6} {'÷floor':>6}  worst loss"]
    for section in cells.SECTIONS:
        s = summarize(doc, section)
        if not s["cells"] and not s["skipped"]:
            continue
        worst = f"{s['worst'][0][0]} {s['worst'][0][1]:.2f}×" if s["worst"] else "—"
        mean_peer, mean_floor = s["geomean_vs_best_peer"], s["geomean_vs_floor"]
        lines.append(f"{section:<9} {s['cells']:>5} {s['wins']:>4}/{s['compared']:<4} "
                     f"{f'{mean_peer:.2f}' if mean_peer else '—':>6} {f'{mean_floor:.2f}' if mean_floor else '—':>6}  {worst}")
    return "\n".join(lines)


def ceilings_text(ceilings: dict | None) -> str:
    if not ceilings:
        return "ceilings not measured"
    text = (f"copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + written), "
            f"bf16 GEMM 8192³ {ceilings['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s")
    if ceilings.get("nominal"):
        return text + f" (NOT measured: nominal H200 figures; the measurement failed: {ceilings.get('error')})"
    return text + ", measured in the run"


def _source_text(doc: dict) -> str:
    source = doc.get("source", {})
    commit = source["commit"][:10] if source.get("commit") else "unknown commit"
    if source.get("dirty"):
        commit += " + uncommitted changes"
    return f"{commit} (sources sha256 {source.get('source_sha256', '?')[:12]})"


def _clock_range(doc: dict) -> str:
    clocks = [mhz for r in records(doc) for runner in r.get("runners", {}).values()
              for _, mhz in runner.get("samples", []) if mhz is not None]
    if not clocks:
        return "SM clock not read"
    clocks.sort()
    return f"SM clock {clocks[0]:.0f}-{clocks[-1]:.0f} MHz, median {clocks[len(clocks) // 2]:.0f}"


# ---- markdown ------------------------------------------------------------------------------------

def _check_text(check: dict | None) -> str:
    if check is None:
        return "—"
    if check.get("ok"):
        return f"ok ({check.get('rel_l2', float('nan')):.1e})"
    return f"**FAIL** (rel {check.get('rel_l2')}, max {check.get('max_abs_diff')})"


def _peer_text(record: dict) -> str:
    best = record.get("best_peer")
    if best is None:
        return "—"
    padded = " padded" if record["runners"][best].get("padded") else ""
    return PEER_NAMES.get(best, best) + padded


def _row(record: dict) -> str:
    short = record["name"].split("/", 1)[1]
    if "error" in record:
        return f"| `{short}` | failed: {record['error'][:100]} | | | | | |"
    hipattn = record["runners"].get("hipattn", {})
    hipattn_text = _ms(hipattn.get("median_ms")) if "median_ms" in hipattn else f"error: {hipattn.get('error', '?')[:80]}"
    ratio = _ratio(record.get("vs_best_peer"))
    if record.get("vs_best_peer") is not None and record["vs_best_peer"] < 1:
        ratio = f"**{ratio}**"
    return (f"| `{short}` | {hipattn_text} | {_peer_text(record)} | {_ms(record.get('best_peer_ms'))} | {ratio} "
            f"| {_ratio(record.get('vs_floor'))} | {_check_text(record.get('check'))} |")


def modifier_costs(doc: dict, section: str = "scoremod") -> dict[str, list[float]]:
    """Per modifier (a scoremod cell's name part, ``cap50``, ``alibi``, ...; a dropout cell's ``pP``):
    hipattn's time on each cell of ``section`` over its time on the plain twin (the batch cell of the
    same shape) in the same run, where both have one."""
    times = {r["name"]: r["runners"].get("hipattn", {}).get("median_ms") for r in records(doc) if "runners" in r}
    costs: dict[str, list[float]] = {}
    for cell in cells.all_cells():
        if cell.section != section:
            continue
        modified, plain = times.get(cell.name), times.get(cells.plain_twin(cell).name)
        if modified and plain:
            name = cell.modifiers if section == "scoremod" else f"p{cell.dropout_p:g}"
            costs.setdefault(name, []).append(modified / plain)
    return costs


def modifier_cost_text(doc: dict, section: str = "scoremod") -> str | None:
    """What the modifiers (or dropout) cost hipattn: a sentence on the geometric means of modifier_costs,
    or None."""
    costs = modifier_costs(doc, section)
    if not costs:
        return None
    parts = [f"{name} {_geometric_mean(ratios):.2f}× ({len(ratios)} cells)" for name, ratios in costs.items()]
    without = "the modifier" if section == "scoremod" else "dropout"
    return (f"Without {without} (hipattn on the `batch` cell of the same shape, same run; not interleaved with "
            "these): hipattn with ÷ without, geometric mean " + ", ".join(parts) + ".")


def peer_ratios(section_records: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per direction (fwd, bwd, fwdbwd), per peer (its report name, "padded" where it ran on padded
    data): hipattn's time ÷ the peer's in each cell where both ran. A target is often set against one
    peer (FA2 across the board, cuDNN at long sequences), not against whichever is fastest in a cell,
    so each peer gets its own ratios."""
    ratios: dict[str, dict[str, list[float]]] = {}
    for r in section_records:
        hipattn_ms = r.get("runners", {}).get("hipattn", {}).get("median_ms")
        if not hipattn_ms:
            continue
        for name, runner in r["runners"].items():
            if name != "hipattn" and (runner.get("median_ms") or 0) > 0:
                by_peer = ratios.setdefault(r["params"]["direction"], {})
                label = PEER_NAMES.get(name, name) + (" padded" if runner.get("padded") else "")
                by_peer.setdefault(label, []).append(hipattn_ms / runner["median_ms"])
    return ratios


def peer_ratio_text(section_records: list[dict]) -> str | None:
    """'fwd: FA2 (SDPA) 0.66-1.02× (geometric mean 0.78×, 24 cells), ...; fwdbwd: ...', or None."""
    ratios = peer_ratios(section_records)
    if not ratios:
        return None
    parts = []
    for direction, by_peer in ratios.items():
        peers = ", ".join(f"{name} {min(values):.2f}-{max(values):.2f}× (geometric mean "
                          f"{_geometric_mean(values):.2f}×, {len(values)} cell{'s' * (len(values) != 1)})"
                          for name, values in by_peer.items())
        parts.append(f"{direction}: {peers}")
    return "hipattn ÷ each peer, lowest-highest: " + "; ".join(parts) + "."


def _peer_errors(section_records: list[dict]) -> list[str]:
    """'peer: N cells (first error)' for each peer that did not run somewhere in the section."""
    errors: dict[str, list[str]] = {}
    for r in section_records:
        for name, runner in r.get("runners", {}).items():
            if name != "hipattn" and "median_ms" not in runner and runner.get("error"):
                errors.setdefault(name, []).append(runner["error"])
    return [f"{PEER_NAMES.get(name, name)} in {len(found)} cells ({found[0][:160]})" for name, found in errors.items()]


def markdown(doc: dict) -> str:
    env = doc.get("environment", {})
    lines = [
        f"## Performance matrix — {doc.get('date', '?')}, {env.get('device', 'unknown device')}, commit {_source_text(doc)}",
        "",
        f"Command: `{doc.get('command', '?')}` (raw: `bench_matrix.json`, heat map: `bench_matrix.png`). "
        f"torch {env.get('torch', '?')}, CUDA {env.get('cuda_runtime', '?')}, cuDNN {env.get('cudnn', '?')}, "
        f"driver {env.get('driver', '?')}. Ceilings: {ceilings_text(doc.get('ceilings'))}; "
        f"{_clock_range(doc)} ({env.get('clock_source', '?')}).",
        "",
        f"Timing: {doc.get('timing', '?')}. Floor: {doc.get('floors', '?')}. "
        "÷ best peer < 1: hipattn is faster (bold). Check: ‖hipattn − peer‖ / ‖peer‖ against the fastest peer "
        "that computes the same function on the same data.",
        "",
        f"**Summary:** {summary_text(doc, markdown=True)}",
    ]
    if doc.get("errors"):
        lines += ["", "Run errors: " + "; ".join(doc["errors"])]
    all_records = records(doc)
    for section in cells.SECTIONS:
        section_records = [r for r in all_records if r.get("section") == section]
        skipped = [n for n in doc.get("skipped", {}) if n.split("/")[0] == section]
        if not section_records and not skipped:
            continue
        s = summarize(doc, section)
        means = []
        if s["geomean_vs_best_peer"] is not None:
            means.append(f"geometric mean ÷ best peer {s['geomean_vs_best_peer']:.2f}×")
        if s["geomean_vs_floor"] is not None:
            means.append(f"÷ floor {s['geomean_vs_floor']:.2f}×")
        lines += ["", f"### {SECTION_TITLES[section]}", "",
                  f"Peers: {SECTION_PEERS[section]}. hipattn wins {s['wins']} of {s['compared']}"
                  + (f"; {', '.join(means)}" if means else "") + "."]
        if section_records:
            lines += ["", "| cell | hipattn ms | best peer | peer ms | ÷ best peer | ÷ floor | check |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            lines += [_row(r) for r in section_records]
            ratio_text = peer_ratio_text(section_records)
            if ratio_text:
                lines += ["", ratio_text]
        if section in ("scoremod", "dropout"):
            cost = modifier_cost_text(doc, section)
            if cost:
                lines += ["", cost]
        errors = _peer_errors(section_records)
        if errors:
            lines += ["", "Peers that did not run: " + "; ".join(errors) + "."]
        if skipped:
            reasons = doc["skipped"]
            shown = ", ".join(f"`{n.split('/', 1)[1]}`" for n in skipped[:8]) + (", …" if len(skipped) > 8 else "")
            lines += ["", f"Skipped {len(skipped)} cells ({reasons[skipped[0]]}): {shown}."]
    warm = doc.get("warm")
    if warm:
        lines += ["", f"Prewarm: `{warm['command']}`, exit {warm['exit']}, {warm['seconds']} s."]
    return "\n".join(lines) + "\n"


# ---- heat map ------------------------------------------------------------------------------------

def panel_position(params: dict) -> tuple[str, str]:
    """(row, column) of a cell in its section's panel."""
    heads = f"h{params['heads_q']}:{params['heads_kv']}"
    mask = "causal" if params["causal"] else "noncausal"
    section, direction = params["section"], params["direction"]
    if section == "smallseq":
        return f"d{params['head_dim']} {direction}", heads
    if section == "batch":
        return f"d{params['head_dim']} {heads} {mask}", f"s{params['seqlen_q']}\n{direction}"
    if section == "varlen":
        return mask, f"{heads}\n{direction}"
    if section == "window":
        window = f"w{params.get('window_left', -1)},{params.get('window_right', -1)}"
        if params["seqlen_q"] == 1:
            return f"decode {window} {mask}", f"b{params['batch']} kv{params['seqlen_k']}\n{heads}"
        return f"d{params['head_dim']} {heads} {window} {mask}", f"s{params['seqlen_q']}\n{direction}"
    if section == "scoremod":
        modifiers = cells.modifier_name(params.get("softcap", 0.0), params.get("alibi", False))
        return f"d{params['head_dim']} {heads} {modifiers} {mask}", f"s{params['seqlen_q']}\n{direction}"
    if section == "dropout":
        return f"d{params['head_dim']} {heads} p{params['dropout_p']:g} {mask}", f"s{params['seqlen_q']}\n{direction}"
    return direction, f"b{params['batch']} kv{params['seqlen_k']}\n{heads}"


def panels(doc: dict) -> list[dict]:
    """Per section with cells: its row and column labels, and per (row, column) the ratio (or None)
    and the text to print there."""
    found = []
    all_records = records(doc)
    skipped = doc.get("skipped", {})
    for section in cells.SECTIONS:
        section_records = [r for r in all_records if r.get("section") == section]
        section_records += [{"name": c.name, "params": c.params(), "skipped": True}
                            for c in cells.all_cells() if c.section == section and c.name in skipped]
        if not section_records:
            continue
        order = _order()
        section_records.sort(key=lambda r: order.get(r["name"], len(order)))
        rows, columns, entries = [], [], {}
        for r in section_records:
            row, column = panel_position(r["params"])
            rows += [] if row in rows else [row]
            columns += [] if column in columns else [column]
            ratio = r.get("vs_best_peer")
            if r.get("skipped"):
                text = "skip"
            elif "error" in r or r.get("vs_floor") is None:
                text = "error"
            elif ratio is None:
                text = "no peer"
            else:
                text = f"{ratio:.2f}"
            if r.get("check") is not None and not r["check"].get("ok"):
                text += "\nFAIL"
            entries[(row, column)] = (ratio, text)
        found.append({"section": section, "rows": rows, "columns": columns, "entries": entries})
    return found


def heatmap(doc: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import Normalize
    from matplotlib.patches import Rectangle

    laid_out = panels(doc)
    if not laid_out:
        raise ValueError("no cells to draw")
    widest = max(len(p["columns"]) for p in laid_out)
    heights = [len(p["rows"]) + 1.6 for p in laid_out]
    figure, axes = plt.subplots(len(laid_out), 1, figsize=(2.8 + 1.05 * widest, 0.42 * sum(heights) + 1.2),
                                gridspec_kw={"height_ratios": heights}, squeeze=False, layout="constrained")
    norm, colormap = Normalize(-2.0, 2.0), matplotlib.colormaps["RdBu_r"].with_extremes(bad="#d9d9d9")
    image = None
    for axis, panel in zip(axes[:, 0], laid_out, strict=True):
        grid = np.full((len(panel["rows"]), len(panel["columns"])), np.nan)
        for (row, column), (ratio, text) in panel["entries"].items():
            i, j = panel["rows"].index(row), panel["columns"].index(column)
            if ratio is not None:
                grid[i, j] = math.log2(ratio)
            dark = ratio is not None and abs(math.log2(ratio)) > 1.2
            axis.text(j, i, text, ha="center", va="center", fontsize=7.5, color="white" if dark else "black", zorder=3)
            if text.endswith("FAIL"):  # a wrong result: its ratio means nothing
                axis.add_patch(Rectangle((j - 0.47, i - 0.45), 0.94, 0.9, fill=False, edgecolor="black",
                                         linewidth=1.6, hatch="//"))
        image = axis.imshow(np.ma.masked_invalid(grid), cmap=colormap, norm=norm, aspect="auto")
        axis.set_xticks(range(len(panel["columns"])), panel["columns"], fontsize=7.5)
        axis.set_yticks(range(len(panel["rows"])), panel["rows"], fontsize=7.5)
        axis.set_title(SECTION_TITLES[panel["section"]], fontsize=9)
        axis.tick_params(length=0)
    colorbar = figure.colorbar(image, ax=axes[:, 0].tolist(), shrink=0.5, pad=0.01)
    colorbar.set_ticks([-2, -1, 0, 1, 2], labels=["0.25", "0.5", "1", "2", "4"])
    colorbar.set_label("hipattn time ÷ best peer's (blue: hipattn faster)")
    env = doc.get("environment", {})
    figure.suptitle(f"hipattn ÷ best peer per cell — {env.get('device', '?')}, {doc.get('date', '?')}, "
                    f"commit {_source_text(doc)}; grey: no ratio (the text says why); hatched: numeric check failed",
                    fontsize=10)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def write(doc: dict, directory: pathlib.Path) -> list[pathlib.Path]:
    """bench_matrix.md, and bench_matrix.png where matplotlib is installed; the paths written."""
    directory = pathlib.Path(directory)
    written = [directory / MARKDOWN_NAME]
    written[0].write_text(markdown(doc))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no heat map")
        return written
    if records(doc) or doc.get("skipped"):
        heatmap(doc, directory / PNG_NAME)
        written.append(directory / PNG_NAME)
    return written


# ---- A/B -----------------------------------------------------------------------------------------

def compare_text(old: dict, new: dict, threshold: float = 0.03) -> str:
    """Per cell in both runs: hipattn's time before and after, their ratio, each run's hipattn ÷ best
    peer and SM clock; then the geometric mean and what changed beyond ``threshold``."""
    old_records = {r["name"]: r for r in records(old)}
    new_records = {r["name"]: r for r in records(new)}
    lines = [f"old: {old.get('command', '?')} ({_source_text(old)}, {old.get('date', '?')})",
             f"new: {new.get('command', '?')} ({_source_text(new)}, {new.get('date', '?')})",
             f"{'cell':<52} {'old ms':>9} {'new ms':>9} {'new/old':>8} {'old÷peer':>9} {'new÷peer':>9} {'MHz old/new':>12}"]
    ratios = []
    for name, after in new_records.items():
        before = old_records.get(name)
        if before is None:
            continue
        old_ms = before.get("runners", {}).get("hipattn", {}).get("median_ms")
        new_ms = after.get("runners", {}).get("hipattn", {}).get("median_ms")
        ratio = new_ms / old_ms if old_ms and new_ms else None
        if ratio is not None:
            ratios.append(ratio)
        clocks = "/".join(f"{r.get('runners', {}).get('hipattn', {}).get('clock_mhz_median', 0):.0f}"
                          for r in (before, after))
        lines.append(f"{name:<52} {_ms(old_ms):>9} {_ms(new_ms):>9} {_ratio(ratio):>8} "
                     f"{_ratio(before.get('vs_best_peer')):>9} {_ratio(after.get('vs_best_peer')):>9} {clocks:>12}")
    if ratios:
        faster = sum(1 for r in ratios if r < 1 - threshold)
        slower = sum(1 for r in ratios if r > 1 + threshold)
        lines.append(f"geometric mean new/old over {len(ratios)} cells: {_geometric_mean(ratios):.3f}; "
                     f"faster by more than {threshold:.0%} in {faster}, slower in {slower}")
    else:
        lines.append("no cell has a hipattn time in both runs")
    only_old, only_new = set(old_records) - set(new_records), set(new_records) - set(old_records)
    if only_old or only_new:
        lines.append(f"cells only in old: {len(only_old)}; only in new: {len(only_new)}")
    return "\n".join(lines)
