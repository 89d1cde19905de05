"""How a run goes: a supervisor process that never touches the GPU, and worker processes that measure.

The supervisor writes the JSON's header (command, options, source identity, planned cells), fills
hipattn's compile cache (``python -m hipattn warm``), then starts a worker. The worker measures the
ceilings, then one cell after another, rewriting the JSON after each, and names the cell, runner and
phase it is in in a small progress file. A peer that raises is recorded with its error and the cell
goes on. If the worker dies, or finds its CUDA context unusable after an error (a device-side assert
poisons every later call in the process), the supervisor reads the progress file, excludes that
runner from that cell (or records the cell as failed), and starts a new worker, which skips the cells
already done. Cells that would not end before the budget are skipped and recorded as such; a worker
still running at budget + GRACE_S is killed.

``measure_cell`` and ``work_loop`` take the measuring side as an object (gpu.CudaMeasurer on the
GPU, a fake in the tests) with: prepare(cell) -> data; build(name, cell, data) -> runner with
run(i) -> outputs; first_call(runner) -> outputs; sample(runner, start, calls) -> ms per call;
clock_mhz() -> MHz or None; compare(outputs, reference) -> dict with "ok"; context_ok() -> bool;
release(); environment() -> dict; ceilings() -> dict.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time
import warnings

from . import cells, report

JSON_NAME = "bench_matrix.json"
PROGRESS_NAME = "bench_matrix.progress.json"
WORKER_LOG_NAME = "bench_matrix.worker.log"
FORMAT = "hipattn bench_matrix 1"
EXIT_CONTEXT_LOST = 3
GRACE_S = 60  # a worker still running this long after the budget is killed
MAX_WORKERS = 6  # first worker plus restarts after crashes
REPOSITORY = pathlib.Path(__file__).resolve().parent.parent.parent

TIMING = ("per cell, every runner in one process on the same inputs: one check call, one call to size the "
          "samples, then rounds in alternating order (hipattn, peers..., then peers reversed, hipattn); "
          "a sample is CUDA events around back-to-back calls after a short spin kernel (so the host has "
          "queued the calls when the first event fires), rotating among input sets; median over the "
          "samples; SM clock read after every sample")
FLOORS = ("max(FLOPs / bf16 GEMM rate, bytes / copy bandwidth), both measured at the start of the run. FLOPs: "
          "4*Hq*D per visible (query, key) pair forward (causal masks and sliding windows aligned bottom-right as "
          "in flash-attn, counted exactly), 2.5x backward, 3.5x forward + backward. Bytes, each tensor once, real "
          "tokens, K/V once per KV head and only for keys some query sees (a decode window reads its window): "
          "forward q, k, v, out, lse (decode: no lse); backward q, k, v, dout, lse, dq, dk, dv; forward + "
          "backward both. Score modifiers (softcap, ALiBi) add no matrix product and no tensor: plain attention's floor")


class ContextLost(RuntimeError):
    """The process's CUDA context no longer works; only a new process can go on."""


# ---- the JSON and the progress file ----------------------------------------------------------------

def _write_atomic(path: pathlib.Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _finite(value):
    """``value`` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def save(doc: dict, directory: pathlib.Path) -> None:
    _write_atomic(directory / JSON_NAME, json.dumps(_finite(doc), indent=1, allow_nan=False))


def load(path: pathlib.Path) -> dict:
    """The report at ``path``: a JSON file, or a directory holding bench_matrix.json."""
    path = pathlib.Path(path)
    return json.loads((path / JSON_NAME if path.is_dir() else path).read_text())


def set_progress(directory: pathlib.Path, cell: str | None, runner: str | None, phase: str) -> None:
    _write_atomic(directory / PROGRESS_NAME,
                  json.dumps({"cell": cell, "runner": runner, "phase": phase, "time": time.time()}))


def read_progress(directory: pathlib.Path) -> dict:
    try:
        return json.loads((directory / PROGRESS_NAME).read_text())
    except (OSError, ValueError):
        return {}


# ---- one cell ------------------------------------------------------------------------------------

def describe_error(error: BaseException, caught: list | None = None) -> str:
    """The exception's type and first line, plus the first lines of up to two warnings raised with it
    (SDPA says why a backend declined only in warnings)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    reasons = [str(w.message).strip().splitlines()[0] for w in (caught or []) if str(w.message).strip()][:2]
    if reasons:
        text += " [" + " | ".join(reasons) + "]"
    return text[:400]


def interleave(runners: dict, measurer, rounds: int) -> dict:
    """Time every runner of a cell: one call each to size its samples (cells.timing_plan), then
    ``rounds`` rounds, even rounds in the given order and odd ones reversed. A runner that raises
    keeps the samples it has, gets its error, and is left out of the later rounds; if the context is
    then unusable, ContextLost."""
    results: dict[str, dict] = {name: {"samples": []} for name in runners}
    next_set = dict.fromkeys(runners, 1)  # the check call used input set 0
    plans: dict[str, tuple[int, int]] = {}
    active = list(runners)

    def fail(name: str, error: Exception) -> None:
        results[name]["error"] = describe_error(error)
        active.remove(name)
        if not measurer.context_ok():
            raise ContextLost(f"{name}: {results[name]['error']}") from error

    for name in list(active):
        try:
            estimate = measurer.sample(runners[name], next_set[name], 1)
        except Exception as error:  # noqa: BLE001 - a failing peer is a result, not a crash
            fail(name, error)
            continue
        next_set[name] += 1
        plans[name] = cells.timing_plan(estimate)
        results[name].update(estimate_ms=estimate, calls_per_sample=plans[name][0])
    for round_index in range(rounds):
        order = list(active) if round_index % 2 == 0 else list(reversed(active))
        for name in order:
            calls, samples = plans[name]
            for _ in range(samples):
                try:
                    ms = measurer.sample(runners[name], next_set[name], calls)
                except Exception as error:  # noqa: BLE001
                    fail(name, error)
                    break
                next_set[name] += calls
                results[name]["samples"].append([ms, measurer.clock_mhz()])
    for result in results.values():
        times = [ms for ms, _ in result["samples"]]
        clocks = [mhz for _, mhz in result["samples"] if mhz is not None]
        if times and "error" not in result:
            result["median_ms"] = statistics.median(times)
        if clocks:
            result["clock_mhz_median"] = statistics.median(clocks)
    return results


def measure_cell(cell: cells.Cell, measurer, ceilings: cells.Ceilings, rounds: int,
                 excluded: dict[str, str] | None = None, progress=None) -> dict:
    """One cell's record: parameters, work, floor, each runner's samples or error, the numeric checks
    of hipattn's outputs against each peer that computes the same function, and the derived ratios."""
    progress = progress or (lambda *_: None)
    excluded = excluded or {}
    started = time.perf_counter()
    lengths_q, lengths_k = cells.lengths(cell)
    cell_work = cells.work(cell)
    record = {
        "name": cell.name, "section": cell.section, "params": cell.params(),
        "shape": {"sequences": len(lengths_q), "total_q": sum(lengths_q), "total_k": sum(lengths_k),
                  "max_seqlen_q": max(lengths_q), "max_seqlen_k": max(lengths_k)},
        "work": {"flops": cell_work.flops, "bytes": cell_work.bytes},
        "floor": cells.floor(cell_work, ceilings),
        "input_sets": cells.input_sets(cell),
        "estimate_seconds": cells.estimate_seconds(cell, ceilings, rounds),
        "runners": {}, "checks": {},
    }
    if cell.section == "varlen":
        record["shape"]["lengths"] = list(lengths_q)
    progress(cell.name, None, "inputs")
    try:
        data = measurer.prepare(cell)
    except Exception as error:  # noqa: BLE001
        record["error"] = "inputs: " + describe_error(error)
        measurer.release()
        if not measurer.context_ok():
            raise ContextLost(record["error"]) from error
        return record
    runners = {}
    hipattn_outputs = None
    for name in ("hipattn", *cells.peers(cell)):
        reason = cells.prescreen(cell, name) or excluded.get(name)
        if reason:
            record["runners"][name] = {"error": reason}
            continue
        progress(cell.name, name, "setup")
        setup_started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                runner = measurer.build(name, cell, data)
                outputs = measurer.first_call(runner)
            except Exception as error:  # noqa: BLE001
                record["runners"][name] = {"error": describe_error(error, caught)}
                if not measurer.context_ok():
                    raise ContextLost(f"{name}: {record['runners'][name]['error']}") from error
                continue
        runners[name] = runner
        record["runners"][name] = {"setup_s": round(time.perf_counter() - setup_started, 3)}
        if cells.padded_peer(cell, name):
            record["runners"][name]["padded"] = True
        if name == "hipattn":
            hipattn_outputs = outputs
        elif hipattn_outputs is not None and cells.checked_peer(cell, name):
            try:
                record["checks"][name] = measurer.compare(hipattn_outputs, outputs)
            except Exception as error:  # noqa: BLE001 - e.g. a peer's output of another shape
                record["checks"][name] = {"ok": False, "error": describe_error(error)}
        del outputs
    runner = hipattn_outputs = None  # the runners dict keeps what the timing needs
    progress(cell.name, None, "timing")
    try:
        for name, result in interleave(runners, measurer, rounds).items():
            record["runners"][name].update(result)
    finally:
        runners = data = None
        measurer.release()
    record.update(report.derive(record))
    record["seconds"] = time.perf_counter() - started
    return record


# ---- the worker ----------------------------------------------------------------------------------

def cell_line(record: dict) -> str:
    """One progress line per cell."""
    if "error" in record:
        return f"{record['name']:<52} failed: {record['error'][:80]}"
    hipattn = record["runners"].get("hipattn", {})
    if "median_ms" not in hipattn:
        return f"{record['name']:<52} hipattn: {hipattn.get('error', 'no time')[:80]}"
    text = f"{record['name']:<52} {hipattn['median_ms']:9.4f} ms  x{record['vs_floor']:.2f} floor"
    if record.get("best_peer"):
        text += f"  x{record['vs_best_peer']:.2f} {record['best_peer']} ({record['best_peer_ms']:.4f} ms)"
    check = record.get("check")
    if check is not None and not check.get("ok"):
        text += "  CHECK FAILED"
    clock = hipattn.get("clock_mhz_median")
    return text + (f"  {clock:.0f} MHz" if clock else "") + f"  [{record['seconds']:.1f} s]"


def estimate_scale(doc: dict) -> float:
    """How much longer than estimated the cells of this run took (the median over those done,
    clipped to 0.5-10), so that the budget check learns this machine's overheads as it goes."""
    ratios = [r["seconds"] / r["estimate_seconds"] for r in doc["cells"].values()
              if r.get("seconds") and r.get("estimate_seconds")]
    return min(10.0, max(0.5, statistics.median(ratios))) if ratios else 1.0


def work_loop(directory: pathlib.Path, deadline: float, measurer) -> int:
    """Measure the planned cells not yet in the JSON; return the exit status (EXIT_CONTEXT_LOST when
    a new process must go on)."""
    doc = load(directory)
    if "ceilings" not in doc:
        set_progress(directory, None, None, "ceilings")
        doc["environment"] = measurer.environment()
        try:
            doc["ceilings"] = measurer.ceilings()
        except Exception as error:  # noqa: BLE001 - the floors then use nominal H200 figures, and say so
            if not measurer.context_ok():
                raise
            nominal = cells.NOMINAL_CEILINGS
            doc["ceilings"] = {"copy_bytes_per_s": nominal.copy_bytes_per_s, "gemm_flops_per_s": nominal.gemm_flops_per_s,
                               "nominal": True, "error": describe_error(error)}
        save(doc, directory)
        ceilings_line = report.ceilings_text(doc["ceilings"])
        print(f"{doc['environment'].get('device')}: {ceilings_line}", flush=True)
    ceilings = cells.Ceilings(doc["ceilings"]["copy_bytes_per_s"], doc["ceilings"]["gemm_flops_per_s"])
    rounds = doc["options"]["rounds"]
    for name in doc["planned"]:
        if name in doc["cells"] or name in doc["skipped"]:
            continue
        cell = cells.by_name(name)
        estimate = cells.estimate_seconds(cell, ceilings, rounds) * estimate_scale(doc)
        if time.time() + estimate > deadline:
            doc["skipped"][name] = f"budget: {estimate:.1f} s expected, {max(0.0, deadline - time.time()):.1f} s left"
            save(doc, directory)
            continue
        try:
            record = measure_cell(cell, measurer, ceilings, rounds, doc["excluded"].get(name, {}),
                                  lambda *where: set_progress(directory, *where))
        except ContextLost as lost:
            print(f"{name}: the CUDA context is lost; a new worker goes on", flush=True)
            print(f"CUDA context lost: {lost}", file=sys.stderr, flush=True)  # the line the supervisor records
            return EXIT_CONTEXT_LOST
        doc["cells"][name] = record
        save(doc, directory)
        print(cell_line(record), flush=True)
    set_progress(directory, None, None, "done")
    return 0


# ---- the supervisor ------------------------------------------------------------------------------

def _git(*arguments: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPOSITORY), *arguments], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_identity(repository: pathlib.Path = REPOSITORY) -> dict:
    """The commit (when git and .git are there), whether hipattn/, kernels/ or tools/ differ from it,
    and a sha256 over hipattn/ and kernels/ that identifies the measured code without git."""
    digest = hashlib.sha256()
    for folder in ("hipattn", "kernels"):
        for path in sorted((repository / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(path.relative_to(repository).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", "hipattn", "kernels", "tools") if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None,
            "source_sha256": digest.hexdigest()}


def new_document(argv: list[str], options: dict, planned: list[cells.Cell]) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "format": FORMAT,
        "date": now.date().isoformat(),
        "started": now.isoformat(timespec="seconds"),
        "command": "python -m tools.bench_matrix " + shlex.join(argv),
        "options": options,
        "source": source_identity(),
        "timing": TIMING,
        "floors": FLOORS,
        "planned": [c.name for c in planned],
        "estimate_seconds": {s: round(t, 1) for s, (_, t) in cells.estimate_by_section(planned, rounds=options["rounds"]).items()},
        "cells": {}, "skipped": {}, "excluded": {}, "workers": [], "warm": None,
    }


def child_environment() -> dict:
    """The children import this checkout's hipattn, whatever is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPOSITORY), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def prewarm(arch: str, timeout: float) -> dict:
    """``python -m hipattn warm --arch ARCH --jobs CPUS``: its exit status, seconds and output tail."""
    command = [sys.executable, "-m", "hipattn", "warm", "--arch", arch, "--jobs", str(os.cpu_count() or 1)]
    started = time.time()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=child_environment())
        status, output = done.returncode, (done.stdout + done.stderr)
    except subprocess.TimeoutExpired as expired:
        status, output = "timeout", f"killed after {timeout:.0f} s: {expired.stderr or ''}"
    except OSError as error:
        status, output = "error", str(error)
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    tail = [line.strip()[:200] for line in output.replace("\r", "\n").splitlines() if line.strip()][-4:]
    return {"command": shlex.join(command), "exit": status, "seconds": round(time.time() - started, 1), "tail": tail}


def after_worker(doc: dict, progress: dict, status: int, tail: str, timed_out: bool) -> str:
    """What a worker's end means: "done", "restart" or "stop". Records in ``doc`` what was lost: a
    runner that was being set up is excluded from its cell (the new worker measures the rest of the
    cell), anything else fails the cell it was in."""
    if status == 0 and not timed_out:
        return "done"
    cell, runner, phase = progress.get("cell"), progress.get("runner"), progress.get("phase")
    how = "was killed past the budget" if timed_out else f"ended with status {status}"
    if cell is None:
        doc.setdefault("errors", []).append(f"worker {how} during {phase or 'start-up'}: {tail}")
        return "stop"
    if timed_out:
        doc["cells"][cell] = {"name": cell, "section": cell.split("/")[0], "params": cells.by_name(cell).params(),
                              "error": f"the worker {how} during {phase} of {runner or 'the cell'}"}
        return "stop"
    if phase == "setup" and runner and runner not in doc["excluded"].get(cell, {}):
        doc["excluded"].setdefault(cell, {})[runner] = f"ended the worker process ({how}): {tail}"[:400]
        return "restart"
    doc["cells"][cell] = {"name": cell, "section": cell.split("/")[0], "params": cells.by_name(cell).params(),
                          "error": f"the worker {how} during {phase} of {runner or 'the cell'}: {tail}"[:400]}
    return "restart"


def _log_tail(path: pathlib.Path, offset: int) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            lines = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def launch_worker(directory: pathlib.Path, deadline: float) -> tuple[int, str, bool]:
    """Run one worker to its end or to deadline + GRACE_S; (status, last line of stderr, timed out)."""
    log_path = directory / WORKER_LOG_NAME
    offset = log_path.stat().st_size if log_path.exists() else 0
    command = [sys.executable, "-m", "tools.bench_matrix", "--worker", str(directory), "--deadline", repr(deadline)]
    with open(log_path, "ab") as log:
        worker = subprocess.Popen(command, stderr=log, env=child_environment())
        try:
            status = worker.wait(timeout=max(1.0, deadline + GRACE_S - time.time()))
            timed_out = False
        except subprocess.TimeoutExpired:
            worker.kill()
            status = worker.wait()
            timed_out = True
    return status, _log_tail(log_path, offset), timed_out


def supervise(directory: pathlib.Path, argv: list[str], options: dict) -> int:
    started = time.time()
    deadline = started + options["budget_seconds"]
    directory.mkdir(parents=True, exist_ok=True)
    planned = cells.select(options["quick"], options["only"])
    if not planned:
        print(f"no cell matches --only {options['only']!r}", file=sys.stderr)
        return 2
    doc = new_document(argv, options, planned)
    print(estimate_text(planned, options["rounds"]), flush=True)
    for stale in (PROGRESS_NAME, WORKER_LOG_NAME):
        (directory / stale).unlink(missing_ok=True)
    save(doc, directory)
    if options["warm"]:
        print(f"prewarm: python -m hipattn warm --arch {options['warm_arch']} ...", flush=True)
        doc["warm"] = prewarm(options["warm_arch"], timeout=min(300.0, 0.6 * options["budget_seconds"]))
        print(f"prewarm: exit {doc['warm']['exit']} in {doc['warm']['seconds']} s", flush=True)
        save(doc, directory)
    for _ in range(MAX_WORKERS):
        worker_started = time.time()
        status, tail, timed_out = launch_worker(directory, deadline)
        doc = load(directory)
        doc["workers"].append({"started_s": round(worker_started - started, 1), "seconds": round(time.time() - worker_started, 1),
                               "exit": status, "timed_out": timed_out, "stderr_tail": tail})
        action = after_worker(doc, read_progress(directory), status, tail, timed_out)
        save(doc, directory)
        if action != "restart":
            break
        print(f"worker ended (status {status}: {tail[:120]}); starting another", flush=True)
    for name in doc["planned"]:
        if name not in doc["cells"] and name not in doc["skipped"]:
            doc["skipped"][name] = "not reached: the worker stopped before it"
    doc["elapsed_seconds"] = round(time.time() - started, 1)
    doc["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    save(doc, directory)
    written = report.write(doc, directory)
    print()
    print(report.section_table(doc))
    print(report.summary_text(doc))
    print("wrote " + ", ".join(str(p) for p in [directory / JSON_NAME, *written]))
    return 0 if doc["cells"] else 1


def estimate_text(planned: list[cells.Cell], rounds: int) -> str:
    lines = ["estimated time per section (nominal ceilings; plus the prewarm, about 1-2 min on 16 cores):"]
    total = 0.0
    for section, (count, seconds) in cells.estimate_by_section(planned, rounds=rounds).items():
        lines.append(f"  {section:<9} {count:4d} cells  ~{seconds:6.0f} s")
        total += seconds
    lines.append(f"  {'total':<9} {len(planned):4d} cells  ~{total:6.0f} s")
    return "\n".join(lines)
