"""Fingerprints of hipattn's NVIDIA kernels as NVRTC compiles them: kernel refactors checked without a GPU.

    python -m tools.kernel_fingerprint --arch sm_90a                      # one line per shipped kernel
    python -m tools.kernel_fingerprint --arch sm_90a --against c22a6ac    # this tree against a revision
    python -m tools.kernel_fingerprint --arch sm_90a --families flash_forward_wgmma --against HEAD

Every shipped spec of the named families (default: every family shipped for the arch) is compiled to
PTX for the arch's virtual architecture (sm_90a: compute_90a) and hashed, without what changes from one
compile to the next: comment lines, and the per-compilation ID NVRTC writes into the names of
internal-linkage symbols; and without the kernel's own (mangled) name and the byte size of its
parameter struct, so that a template argument added with the value that compiles what the kernel was
before it (NEUTRAL_ARGUMENTS: score_mods=false, which is also left out of the name a spec is compared
by) and fields appended to a struct that a kernel never reads leave its hash alone (a field it reads,
or one moved, changes the offsets its loads name).
Equal hashes mean ptxas gets the same input (but for the order of the module's constant
declarations), so a kernel change that keeps
every hash (comments, renamed locals, helpers moved between headers, macros folded) runs what the GPU
last ran, and one that changes a hash must run on the GPU again. With --against, the revision is
checked out into a temporary git worktree and fingerprinted by this script the same way (in a child
process that imports that tree's hipattn, whichever layout it has); the exit status is 1 when any
kernel differs or exists on one side only. A kernel whose hashes differ is compiled again on this
tree (up to RECOMPILES times): where a compile hashes as the revision's, it is the same kernel (NVRTC
chose the other of its PTXs the first time); where compiles disagree otherwise, NVRTC does not
reproduce its own PTX, the kernel is reported unstable rather than different, and with no other
difference the exit status is 2 (identity unproven: compare the two trees' SASS, or run it on the
GPU). Further compiles can all agree with the first by chance, so an unstable kernel may still be
reported as differing.

NVRTC comes from cuda-bindings (hipattn's `nvidia` extra); no GPU or driver is needed. Both sides are
compiled by the same NVRTC, whose version is part of the output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

# NVRTC names internal-linkage symbols _ZN<length>_INTERNAL_<digits>_<digits>_<file>_<hex id>_<digits><rest>:
# the id and the trailing counter (and with it the length) differ between compiles of the same source.
_INTERNAL_ID = re.compile(rb"[0-9]*_INTERNAL_[0-9]+_[0-9]+_\w+?_[0-9a-f]{8}_[0-9]+")
# A kernel's by-value struct is one byte-array parameter: `.param .align 8 .b8 <name>_param_0[<bytes>]`.
_PARAM_BYTES = re.compile(rb"(\.param \.align [0-9]+ \.b8 \w+_param_[0-9]+)\[[0-9]+\]")
_ENTRY = re.compile(rb"\.entry (\w+)\(")

# Template arguments whose value compiles the kernel as it was before the argument existed: a spec is
# compared under its canonical text without them. Every family's, then one family's own.
NEUTRAL_ARGUMENTS = {"score_mods": False}
FAMILY_NEUTRAL_ARGUMENTS = {"flash_backward_dkdv_wgmma": {"block_m": 64}}


def normalized_ptx(ptx: bytes) -> bytes:
    """PTX without comment lines, with per-compilation symbol IDs and the kernel's name replaced by
    one token each, the parameter struct's byte size left out, and the module's one-line global
    declarations (the constants a kernel's headers define) in sorted order: NVVM declares them in the
    order the code first names them, which moving a helper between headers changes."""
    lines = (line for line in ptx.rstrip(b"\0").split(b"\n") if not line.lstrip().startswith(b"//"))
    text = _PARAM_BYTES.sub(rb"\1[]", _INTERNAL_ID.sub(b"_INTERNAL_", b"\n".join(lines)))
    for name in set(_ENTRY.findall(text)):
        # The kernel's function-local statics (a __shared__ array) carry its name nested in theirs,
        # without the leading _Z.
        text = text.replace(name, b"_KERNEL_").replace(name[2:], b"_KERNEL_")
    # Sorted once the per-compilation IDs are out, which would otherwise order the internal names.
    lines = text.split(b"\n")
    declared = [i for i, line in enumerate(lines) if line.startswith(b".global ") and line.endswith(b";")]
    for i, line in zip(declared, sorted(lines[i] for i in declared), strict=True):
        lines[i] = line
    return b"\n".join(lines)


def comparable_name(canonical: str) -> str:
    """A spec's canonical text without its neutral arguments (NEUTRAL_ARGUMENTS, FAMILY_NEUTRAL_ARGUMENTS)
    at their neutral values."""
    data = json.loads(canonical)
    neutral = {**NEUTRAL_ARGUMENTS, **FAMILY_NEUTRAL_ARGUMENTS.get(data["family"], {})}
    data["args"] = [[name, value] for name, value in data["args"] if neutral.get(name, object()) != value]
    return json.dumps(data, sort_keys=True)


def virtual_arch(arch: str) -> str:
    """The PTX target of a real one: sm_90a -> compute_90a."""
    if not arch.startswith("sm_"):
        raise SystemExit(f"{arch!r} is not an NVIDIA arch (sm_80, sm_90a, ...): only NVRTC's PTX is fingerprinted")
    return "compute_" + arch[len("sm_"):]


def _ptx(nvrtc, source: str, headers: dict[str, str], name_expression: str, arch: str) -> bytes:
    names = [name.encode() for name in headers]
    texts = [text.encode() for text in headers.values()]
    result, program = nvrtc.nvrtcCreateProgram(source.encode(), b"hipattn_kernel.cu", len(names), texts, names)
    if result:
        raise RuntimeError(f"nvrtcCreateProgram: {result}")
    try:
        nvrtc.nvrtcAddNameExpression(program, name_expression.encode())
        options = [f"--gpu-architecture={virtual_arch(arch)}".encode(), b"-std=c++17"]
        (result,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if result:
            _, size = nvrtc.nvrtcGetProgramLogSize(program)
            log = bytearray(size)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"{name_expression} does not compile for {arch}:\n{bytes(log).decode(errors='replace')}")
        _, size = nvrtc.nvrtcGetPTXSize(program)
        ptx = bytearray(size)
        nvrtc.nvrtcGetPTX(program, ptx)
        return bytes(ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _shipped_units(arch: str, family_names: list[str] | None):
    """(canonical spec, compile unit, headers, name expression) of every shipped spec of
    ``family_names`` (None: every family) for ``arch``, from the hipattn that is importable: this
    tree's layout (hipattn.catalog, hipattn.jit) or that of revisions before it (hipattn.families)."""
    try:
        from hipattn.catalog import FAMILIES
        from hipattn.jit.sources import compile_unit
        from hipattn.jit.target import Target

        def expression(family, spec):
            return spec.name_expression()
    except ImportError:
        from hipattn.families import FAMILIES

        from hipattn.jit.sources import compile_unit
        from hipattn.jit.spec import name_expression as expression
        from hipattn.jit.target import Target

    target = Target.parse(arch)
    for name in family_names if family_names is not None else sorted(FAMILIES):
        if name not in FAMILIES:
            continue  # the other side may not have it; the comparison reports its specs
        family = FAMILIES[name]
        specs = list(family.shipped(target))
        if not specs:
            continue
        source, headers = compile_unit(family)
        for spec in specs:
            yield spec.canonical(), source, headers, expression(family, spec)


def fingerprints(arch: str, family_names: list[str] | None, only: set[str] | None = None) -> dict[str, str]:
    """{spec's comparable name: hash of its normalized PTX} for the shipped specs of ``family_names``
    (None: every family shipped for ``arch``), from the hipattn that is importable; with ``only``,
    just the specs of those comparable names."""
    from cuda.bindings import nvrtc

    units = ((comparable_name(canonical), source, headers, expression)
             for canonical, source, headers, expression in _shipped_units(arch, family_names))
    return {name: hashlib.sha256(normalized_ptx(_ptx(nvrtc, source, headers, expression, arch))).hexdigest()[:16]
            for name, source, headers, expression in units if only is None or name in only}


# Compiles of a kernel whose hashes differ, on this tree, before it is called different: NVRTC picks
# one of two PTXs at random for some kernels, and not with even odds, so one more compile often
# agrees with the first.
RECOMPILES = 4


def recompiled(arch: str, family_names: list[str] | None, first: dict[str, str], theirs: dict[str, str],
               names: set[str]) -> tuple[set[str], set[str]]:
    """(reproduced, unstable) among ``names``, the kernels whose first compile here hashed other than
    ``theirs``: up to RECOMPILES more compiles of this tree's source each, and a kernel is reproduced
    when one of them hashes as ``theirs`` (this source gives the other revision's PTX: the same
    kernel), else unstable when its compiles here disagree with each other. NVRTC 13.0 vectorises
    some kernels' loads differently from one compile to the next (the portable small-seq backward,
    bf16 and fp16: four ld.shared.f32 as one ld.shared.v4.f32 in some compiles, as single and paired
    loads in others), so a single differing hash says nothing about the source."""
    reproduced: set[str] = set()
    seen: dict[str, set[str]] = {name: {first[name]} for name in names}
    for _ in range(RECOMPILES):
        left = names - reproduced
        if not left:
            break
        again = fingerprints(arch, family_names, only=left)
        for name in left:
            seen[name].add(again[name])
            if again[name] == theirs[name]:
                reproduced.add(name)
    return reproduced, {name for name in names - reproduced if len(seen[name]) > 1}


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def _fingerprints_of_revision(revision: str, arch: str, family_names: list[str] | None) -> dict[str, str]:
    """This script, run on ``revision`` checked out into a temporary worktree."""
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="hipattn-fingerprint-") as scratch:
        tree = os.path.join(scratch, "tree")
        subprocess.run(["git", "-C", repository, "worktree", "add", "--detach", "--quiet", tree, revision], check=True)
        try:
            command = [sys.executable, os.path.abspath(__file__), "--arch", arch, "--json"]
            if family_names is not None:
                command += ["--families", ",".join(family_names)]
            # The revision's hipattn ahead of any installed one (a path on PYTHONPATH wins over an
            # editable install's finder).
            environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
            done = subprocess.run(command, check=True, capture_output=True, text=True, env=environment)
            return json.loads(done.stdout)
        finally:
            subprocess.run(["git", "-C", repository, "worktree", "remove", "--force", tree], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90a", help="an NVIDIA arch: sm_80, sm_90, sm_90a, ...")
    parser.add_argument("--families", default=None, help="comma-separated kernel families (default: all shipped)")
    parser.add_argument("--against", default=None, help="a git revision to compare this tree with")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    family_names = args.families.split(",") if args.families else None
    ours = fingerprints(args.arch, family_names)
    if args.json:
        print(json.dumps(ours))
        return 0
    if args.against is None:
        print(f"# NVRTC {nvrtc_version()}, {args.arch}")
        for spec, digest in sorted(ours.items()):
            print(digest, spec)
        return 0
    theirs = _fingerprints_of_revision(args.against, args.arch, family_names)
    mismatched = {spec for spec in ours.keys() & theirs.keys() if ours[spec] != theirs[spec]}
    reproduced, unstable = recompiled(args.arch, family_names, ours, theirs, mismatched)
    differing = sorted(mismatched - reproduced - unstable)
    only_ours, only_theirs = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    identical = len(ours.keys() & theirs.keys()) - len(mismatched) + len(reproduced)
    print(f"# NVRTC {nvrtc_version()}, {args.arch}: {identical} kernels identical to {args.against} "
          f"({len(reproduced)} of them on a recompile), {len(differing)} differ, {len(unstable)} unstable "
          f"(this tree's own compiles differ), {len(only_ours)} only here, {len(only_theirs)} only in {args.against}")
    for label, specs in (("differs", differing), ("unstable", sorted(unstable)), ("only here", only_ours),
                         (f"only in {args.against}", only_theirs)):
        for spec in specs:
            print(f"{label}: {spec}")
    if differing or only_ours or only_theirs:
        return 1
    return 2 if unstable else 0


if __name__ == "__main__":
    sys.exit(main())
