"""The ``hipattn`` command: fill, list and clear the compile cache; show what this machine has.

    hipattn warm [--arch ARCH ...] [--family NAME ...] [--jobs N] [-v]
    hipattn list
    hipattn clear
    hipattn info

``warm`` needs no GPU when an arch is named. Each kernel compiles in a worker process (spawned, so
no GPU context or lock is inherited), which keeps a compiler crash from taking the command down.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import __version__, catalog
from .errors import CompileError, HipattnError
from .jit.cache import DiskCache, default_cache_dir
from .jit.cache_safety import printable
from .jit.spec import KernelSpec
from .jit.target import Target

# The exit codes: 0 everything worked, 1 something failed (named on stderr), 2 bad arguments (for
# warm, a target the local compiler cannot compile for counts as one).
EXIT_FAILED = 1
EXIT_USAGE = 2


# ---- warm ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WarmResult:
    spec: str  # canonical text
    arch: str
    compiled: bool  # False: it was already in the cache
    seconds: float
    log: str


def _warm_one(spec_text: str, arch: str, cache_dir: str) -> WarmResult:
    """Worker: compile one spec into the cache. Runs in a spawned process; returns or raises picklable things."""
    from .backends import compiler_backend
    from .jit.registry import fetch_or_compile

    start = time.perf_counter()
    target = Target.parse(arch)
    try:
        compiled, fresh = fetch_or_compile(
            catalog.spec_from_canonical(spec_text), target, compiler_backend(target), DiskCache(cache_dir)
        )
    except CompileError:
        raise
    except Exception as error:
        # Anything else is re-raised as a plain HipattnError: an arbitrary exception might not
        # pickle, and the parent only needs its text.
        raise HipattnError(f"{type(error).__name__}: {error}") from None
    return WarmResult(spec_text, arch, fresh, time.perf_counter() - start, compiled.log)


def _local_targets() -> list[Target]:
    from .backends import get_backend

    backend = get_backend()
    return sorted({backend.device_target(i) for i in range(backend.device_count())}, key=lambda t: t.arch)


def _warm(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.family:
        unknown = [name for name in args.family if name not in catalog.FAMILIES]
        if unknown:
            print(
                f"hipattn warm: unknown kernel family {unknown}; known: {sorted(catalog.FAMILIES)}",
                file=sys.stderr,
            )
            return EXIT_USAGE
    if args.arch:
        targets = args.arch
    else:
        try:
            targets = _local_targets()
        except Exception as error:
            print(
                f"hipattn warm: no local GPU found ({error}); name one with --arch, e.g. --arch sm_90a",
                file=sys.stderr,
            )
            return EXIT_USAGE
        if not targets:
            print(
                "hipattn warm: no local GPU found; name one with --arch, e.g. --arch gfx942", file=sys.stderr
            )
            return EXIT_USAGE

    cache = DiskCache(args.cache_dir)
    if not cache.writable:
        print(
            f"hipattn warm: cache dir {printable(cache.directory)} is not usable (see the warning above)",
            file=sys.stderr,
        )
        return EXIT_FAILED

    # Decide in the parent which (spec, target) pairs can be compiled: an old hiprtc aborts the
    # process on a target it does not know, so such targets are reported, never attempted.
    work: list[tuple[KernelSpec, Target]] = []
    failed = 0
    unsupported: list[str] = []
    for target in targets:
        specs = [s for s in catalog.shipped_specs(target) if not args.family or s.family.name in args.family]
        try:
            from .backends import compiler_backend

            backend = compiler_backend(target)
            compilable = backend.can_compile_for(target)
            identity = backend.compiler_identity()
        except Exception as error:
            print(f"hipattn warm: no compiler for {target.arch}: {error}", file=sys.stderr)
            failed += len(specs) or 1
            continue
        if not compilable:
            reason = backend.unsupported_reason(target) or f"{identity} cannot compile for {target.arch}"
            print(f"hipattn warm: skipped {target.arch} ({len(specs)} kernels): {reason}", file=sys.stderr)
            unsupported.append(target.arch)
            continue
        work.extend((spec, target) for spec in specs)

    counts = {"compiled": 0, "cached": 0, "failed": failed}
    if work:
        jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(work)))
        # A bar on a terminal; elsewhere (a pipe, a CI or container log) plain lines as it goes.
        bar = sys.stderr.isatty()
        if not bar:
            print(f"hipattn warm: compiling {len(work)} kernels in {jobs} processes", file=sys.stderr, flush=True)
        progress_kind = tqdm if bar else PlainProgress
        with progress_kind(total=len(work), unit="kernel", desc="hipattn warm") as progress:

            def report(spec: KernelSpec, target: Target, outcome: WarmResult | BaseException) -> None:
                progress.update(1)
                if isinstance(outcome, WarmResult):
                    counts["compiled" if outcome.compiled else "cached"] += 1
                    if args.verbose:
                        how = f"compiled in {outcome.seconds:.2f} s" if outcome.compiled else "already cached"
                        progress.write(f"{spec} for {target.arch}: {how}")
                        if outcome.log.strip():
                            progress.write(outcome.log.rstrip())
                    return
                counts["failed"] += 1
                separator = "\n" if isinstance(outcome, CompileError) else " "
                progress.write(f"FAILED {spec} for {target.arch}:{separator}{outcome}", file=sys.stderr)

            crashed = run_compile_pool(work, jobs, str(cache.directory), report)
            # A compiler that kills its process (hiprtc aborting on a target it does not know)
            # breaks the whole pool; retry the kernels it took down one process each, so the
            # culprit is named and the innocent ones still get compiled.
            for item in crashed:
                for spec, target in run_compile_pool([item], 1, str(cache.directory), report):
                    report(spec, target, HipattnError("the compiler killed its process (crashed or aborted)"))

    archs = ", ".join(t.arch for t in targets)
    skipped = ""
    if unsupported:
        skipped = f", {len(unsupported)} target{'s' if len(unsupported) > 1 else ''} skipped ({', '.join(unsupported)})"
    print(
        f"hipattn warm ({archs}): {counts['compiled']} compiled, {counts['cached']} already cached, {counts['failed']} failed{skipped}; cache {printable(cache.directory)}"
    )
    if counts["failed"]:
        return EXIT_FAILED
    return EXIT_USAGE if unsupported else 0


class PlainProgress:
    """``warm``'s progress where no terminal shows a bar: a line when a kernel fails, and a count at
    most every PROGRESS_SECONDS and at the end, so that a log shows the command is working."""

    PROGRESS_SECONDS = 10.0

    def __init__(self, total: int, unit: str, desc: str):
        self.total, self.unit, self.desc = total, unit, desc
        self.done = 0
        self.start = self.last = time.monotonic()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.done == self.total or now - self.last >= self.PROGRESS_SECONDS:
            self.last = now
            print(f"{self.desc}: {self.done}/{self.total} {self.unit}s done after {now - self.start:.0f} s",
                  file=sys.stderr, flush=True)

    def write(self, text: str, file=None) -> None:
        print(text, file=file or sys.stdout, flush=True)


def run_compile_pool(
    work: list[tuple[KernelSpec, Target]],
    jobs: int,
    cache_dir: str,
    report: Callable[[KernelSpec, Target, WarmResult | BaseException], None],
    compile_one: Callable[[str, str, str], WarmResult] = _warm_one,
) -> list[tuple[KernelSpec, Target]]:
    """Compile ``work`` in ``jobs`` spawned processes, reporting each outcome; returns the items
    lost to a dead worker (not reported), to be retried in isolation. Tools that precompile the
    kernels they time call it too (tools/sweep_flash_backward.py). ``compile_one(spec text, arch,
    cache dir)`` is what each worker runs (a module-level function: it is pickled by name)."""
    crashed = []
    with compile_pool(jobs) as pool:
        futures = {
            pool.submit(compile_one, spec.canonical(), target.arch, cache_dir): (spec, target)
            for spec, target in work
        }
        for future in concurrent.futures.as_completed(futures):
            spec, target = futures[future]
            try:
                outcome = future.result()
            except concurrent.futures.process.BrokenProcessPool:
                crashed.append((spec, target))
                continue
            except Exception as error:
                outcome = error
            report(spec, target, outcome)
    return crashed


def compile_pool(jobs: int) -> concurrent.futures.ProcessPoolExecutor:
    """``jobs`` spawned worker processes that exit when the process that started them dies, also
    when it is killed with SIGKILL and has no chance to shut them down."""
    context = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_exit_with_parent, initargs=(os.getpid(),)
    )


# How often a worker's watchdog looks for its parent, where the kernel cannot be asked to signal it.
_PARENT_POLL_SECONDS = 0.5
_PR_SET_PDEATHSIG = 1


def _exit_with_parent(parent: int) -> None:
    """Worker initializer: die with ``parent``. On Linux the kernel sends SIGKILL when the parent
    goes (prctl PR_SET_PDEATHSIG; the pool starts its workers from the thread that owns it, which
    lives as long as they do); everywhere a daemon thread also polls os.getppid(), which changes
    once the parent is gone. A compile in progress is abandoned: its temporary file is left for
    ``hipattn clear``, never published."""
    if sys.platform.startswith("linux"):
        try:
            unsigned = ctypes.c_ulong
            ctypes.CDLL(None, use_errno=True).prctl(
                ctypes.c_int(_PR_SET_PDEATHSIG), unsigned(signal.SIGKILL), unsigned(0), unsigned(0), unsigned(0)
            )
        except (OSError, AttributeError):
            pass  # the watchdog below still covers it
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="hipattn-parent-watchdog", daemon=True).start()


# ---- list / clear / info ----------------------------------------------------------------------
def _human_size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _human_age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def _list(args: argparse.Namespace) -> int:
    cache = DiskCache(args.cache_dir, create=False)
    entries = sorted(cache.entries(), key=lambda e: (e.arch, e.family, e.spec))
    if entries:
        # Metadata is data read from files: escaped, so that it cannot drive the terminal.
        rows = [
            (printable(_spec_name(e.spec)), printable(e.arch), printable(e.compiler), _human_size(e.size),
             _human_age(e.age_seconds))
            for e in entries
        ]
        header = ("SPEC", "ARCH", "COMPILER", "SIZE", "AGE")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print(f"{len(entries)} entries, {_human_size(cache.total_size())} in {printable(cache.directory)}")
    return 0


def _spec_name(spec_text: str) -> str:
    """``family[arg=value, ...]`` of a cached spec's canonical text; the text itself for a family this
    hipattn no longer has."""
    try:
        return str(catalog.spec_from_canonical(spec_text))
    except ValueError:
        return spec_text


def _clear(args: argparse.Namespace) -> int:
    cache = DiskCache(args.cache_dir, create=False)
    removed = cache.clear()
    print(f"removed {removed} entries from {printable(cache.directory)}")
    return 0


def _probe(fn: Callable[[], object]) -> str:
    """fn()'s text, or why it is unavailable: info must report, never fail."""
    try:
        return str(fn())
    except Exception as error:
        return f"unavailable ({type(error).__name__}: {error})".replace("\n", " ")


def _info(args: argparse.Namespace) -> int:
    print(f"hipattn {__version__} (Python {sys.version.split()[0]})")

    def compiler(arch: str):
        from .backends import compiler_backend

        return compiler_backend(Target.parse(arch)).compiler_identity()

    print(f"nvrtc:   {_probe(lambda: compiler('sm_90'))}")
    print(f"hiprtc:  {_probe(lambda: compiler('gfx90a'))}")

    def devices() -> str:
        from .backends import get_backend

        backend = get_backend()
        lines = [f"{backend.name} ({backend.compiler_identity()})"]
        for i in range(backend.device_count()):
            lines.append(f"  device {i}: {backend.device_name(i)} ({backend.device_target(i).arch})")
        if len(lines) == 1:
            lines.append("  no devices")
        return "\n".join(lines)

    print(f"backend: {_probe(devices)}")
    cache = DiskCache(args.cache_dir, create=False)
    if cache.missing:
        state = "not created yet"
    else:
        state = "writable" if cache.writable else "read-only" if cache.readable else "unusable (memory only)"
    entries = len(cache.entries())
    print(f"cache:   {printable(cache.directory)} ({state}; {entries} entries, {_human_size(cache.total_size())})")
    return 0


# ---- entry point --------------------------------------------------------------------------------
def _arch(text: str) -> Target:
    try:
        return Target.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _cache_dir(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"--cache-dir {text!r}: expected a directory, not an empty path")
    return text


def _jobs(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--jobs {value}: expected a count >= 1 (or 0 for one per CPU)")
    return value


def build_parser() -> argparse.ArgumentParser:
    # --cache-dir goes before or after the command (hipattn --cache-dir D list, hipattn list --cache-dir D).
    cache_option = argparse.ArgumentParser(add_help=False)
    cache_option.add_argument(
        "--cache-dir",
        type=_cache_dir,
        default=argparse.SUPPRESS,
        help=f"cache directory (default: $HIPATTN_CACHE_DIR, else the XDG cache dir; now {printable(default_cache_dir())})",
    )
    parser = argparse.ArgumentParser(
        prog="hipattn", description="hipattn's kernel compile cache and environment.", parents=[cache_option]
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help_text, parents=[cache_option])

    warm = command("warm", "compile the shipped kernels into the cache")
    warm.add_argument(
        "--arch",
        type=_arch,
        action="append",
        help="target to compile for, without needing that GPU: gfx90a, gfx942, gfx950, sm_80, sm_90, sm_90a, "
        "or with features (gfx90a:xnack-); repeatable. Default: every local GPU's arch",
    )
    warm.add_argument("--family", action="append", help="only this kernel family; repeatable")
    warm.add_argument(
        "--jobs", "-j", type=_jobs, default=0, help="parallel compile processes (default: CPU count)"
    )
    warm.add_argument(
        "--verbose", "-v", action="store_true", help="name each kernel and show compiler warnings"
    )
    warm.set_defaults(run=_warm)

    command("list", "list cached kernels (spec, arch, size, age)").set_defaults(run=_list)
    command("clear", "delete every cached kernel").set_defaults(run=_clear)
    command("info", "show backend, devices, compilers and the cache").set_defaults(run=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Not a parser default: set_defaults would also change the shared option's default in the
    # commands' parsers, and a command would then overwrite a --cache-dir given before it.
    args.cache_dir = getattr(args, "cache_dir", None)
    # Importing hipattn already attached a handler when HIPATTN_LOG is set (hipattn.log); a second
    # one here would print every record twice. Otherwise show warnings (cache problems) on stderr.
    if not logging.getLogger("hipattn").handlers:
        logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (hipattn list | head): stop quietly, and keep Python's exit-time
        # flush of stdout from raising the same error again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
