"""The backward key blocks' visibility words (kernels/flash/tile_visibility.h) against the mask rule
itself: a C++ program (tests/support/tile_visibility_check.cpp), built with g++ and the emulated
device's header, forms the word of millions of random tiles and compares every bit with key_in_window
and the two lengths. The tiles reach lengths near the int32 limit, unbounded window sides, and the
sequences' ends and the window's edges, where a tile's bits change."""

from __future__ import annotations

import subprocess
from pathlib import Path

from support.emulation import EMULATED_ARCHS, RUNTIME_DIR, RUNTIME_HEADER, compiler, needs_compiler

from hipattn.jit.sources import kernels_dir

pytestmark = needs_compiler

CHECK_PROGRAM = Path(__file__).parent / "support" / "tile_visibility_check.cpp"


def test_every_bit_of_the_visibility_word_follows_the_mask_rule(tmp_path):
    program = tmp_path / "tile_visibility_check"
    # Built as the emulated sm_80's kernels are, so that platform.h takes NVIDIA's branches.
    built = subprocess.run([compiler(), "-std=c++17", "-O1", *EMULATED_ARCHS["sm_80"].defines,
                            "-include", str(RUNTIME_HEADER), f"-I{kernels_dir()}", f"-I{RUNTIME_DIR}",
                            str(CHECK_PROGRAM), "-o", str(program)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    done = subprocess.run([str(program), "200000", "2026"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    # Three tile widths (4, 8 and 16 query tiles, four entries each) per random draw.
    assert done.stdout.split() == ["checked", str(200000 * 4 * (4 + 8 + 16)), "mismatches", "0"], done.stdout
