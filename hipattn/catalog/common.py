"""What several kernel groups of the catalog share: the dtypes and head_dims they ship, and the
layout constants their C++ and their host-side shared-memory formulas both use."""

from __future__ import annotations

# Every attention kernel ships for both 16-bit types (same element size, same tiles).
DTYPES = ("fp16", "bf16")

# The head_dims the flash path (forward, backward, pre-processing) serves.
FLASH_HEAD_DIMS = (64, 96, 128, 256)

# Rows of the mma.sync kernels' shared tiles are padded by this many elements (16 bytes) against
# ldmatrix bank conflicts: flash::ForwardTiles::kPitch = HEAD_DIM + 8, and the backward's tiles alike.
FLASH_ROW_PAD = 8

# LDS rows of the MFMA kernels are padded by this many elements (8 bytes) against bank conflicts of
# the 8-byte fragment reads: flash::MfmaForwardTiles::kKPitch = HEAD_DIM + 4 and kVPitch = BLOCK_N + 4.
MFMA_ROW_PAD = 4

# A warpgroup: the four warps that issue a wgmma together, and the M of every wgmma (the rows of its
# accumulators). Both wgmma kernels size their blocks in warpgroups.
WGMMA_WARPGROUP_THREADS = 128
WGMMA_WARPGROUP_ROWS = 64

# A Hopper shared-memory barrier (mbarrier) is one 8-byte word.
MBARRIER_BYTES = 8

# The wgmma kernels' shared tiles are stored in 64-column (128-byte) swizzle blocks, so a row takes
# whole blocks: head_dim 96 is stored as 128 columns (WgmmaForwardTiles::kRowElements).
WGMMA_SWIZZLE_COLUMNS = 64


def wgmma_row_elements(head_dim: int) -> int:
    """The elements a wgmma kernel's shared tile stores per row of ``head_dim`` columns."""
    return -(-head_dim // WGMMA_SWIZZLE_COLUMNS) * WGMMA_SWIZZLE_COLUMNS
