// Staging of row tiles from global into shared memory with cp.async, in wgmma's 128-byte swizzled
// layout (common/wgmma_nvidia.h), for the flash kernels on Hopper's warpgroup tensor cores.
#pragma once
#include "common/async_pipeline_nvidia.h"
#include "common/wgmma_nvidia.h"

namespace hipattn {
namespace flash {

// What a staged tile holds past its sequence's rows: left alone (K: its scores are masked by
// selection), or zeros (V, Q: their products must stay finite, and 0 x NaN is NaN), written by ordinary
// stores or, for a warp-specialised producer that signals its slot through cp.async's own mbarrier
// arrival (which tracks its copies, not its stores), by cp.async reading no bytes.
enum class TileTail { kLeave, kZeroByStore, kZeroByCopy };

// Copy rows [0, rows) of a swizzled tile of TILE_ROWS rows with cp.async, and the rows past `rows`
// as TAIL says. Consecutive threads copy consecutive 16-byte chunks of a row, and a
// pass covers kPassRows rows, a multiple of the swizzle's 8: so a thread copies the same chunk of every
// kPassRows-th row, at the same swizzled column, and its addresses move by constants from pass to
// pass. Worked out per chunk instead, the index arithmetic was a fifth of the dK/dV kernel's
// instructions (1480 against 1205 per warp and query tile, ncu; BENCHMARKS.md, run 6). A pass takes
// every thread when a row's chunks divide them into whole 8-row groups; head_dim 96 (12 chunks) on 256
// threads uses 192 of them, 16 rows a pass.
template <typename T, int HEAD_DIM, int TILE_ROWS, int THREADS, TileTail TAIL>
HIPATTN_DEVICE void stage_swizzled_tile(T* tile, const T* first_row, long long token_stride, int rows) {
  constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row
  constexpr int kPassRows = THREADS / kChunks / 8 * 8;
  static_assert(HEAD_DIM % 8 == 0 && kPassRows >= 8, "a pass of the threads covers 8 rows at least");
  if (kPassRows * kChunks < THREADS && static_cast<int>(threadIdx.x) >= kPassRows * kChunks) return;
  const int row0 = static_cast<int>(threadIdx.x) / kChunks;
  const int col = static_cast<int>(threadIdx.x) % kChunks * 8;
  T* const destination = tile + wgmma::swizzled_offset<TILE_ROWS>(row0, col);
  const T* const source = first_row + row0 * token_stride + col;
#pragma unroll
  for (int pass = 0; pass * kPassRows < TILE_ROWS; ++pass) {
    const int row = row0 + pass * kPassRows;
    if (TILE_ROWS % kPassRows != 0 && row >= TILE_ROWS) break;  // the last pass covers part of the rows
    if (TAIL == TileTail::kZeroByCopy) {
      // A zero row's copy still names an address, the tile's first row's, which exists.
      copy_async_16_or_zero(destination + pass * kPassRows * 64,
                            row < rows ? source + pass * kPassRows * token_stride : first_row, row < rows);
    } else if (row < rows) {
      mma::copy_async_16(destination + pass * kPassRows * 64, source + pass * kPassRows * token_stride);
    } else if (TAIL == TileTail::kZeroByStore) {
      *reinterpret_cast<Vec<T, 8>*>(destination + pass * kPassRows * 64) = Vec<T, 8>{};
    }
  }
}

// The cp.async copy by a warp-specialised kernel's producer warpgroup (threads 0-127) of rows [0, rows)
// of a tile of TILE_ROWS rows starting at `first_row`, the rest as TAIL says. Head_dim 256 goes in two
// 128-column halves (two swizzle blocks each): a pass of 128 threads covers 8 rows of 128 columns at
// most. The stride is hidden from the optimiser
// at each call, so that the rows' addresses are formed per tile: hoisted out of the producer's loop,
// one 64-bit register pair per row of a pass overflowed the few registers the producer keeps.
template <typename T, int HEAD_DIM, int TILE_ROWS, TileTail TAIL>
HIPATTN_DEVICE void produce_tile(T* tile, const T* first_row, long long token_stride, int rows) {
  constexpr int kPart = HEAD_DIM > 128 ? 128 : HEAD_DIM;
  const long long stride = mma::opaque_64(token_stride);
#pragma unroll
  for (int c0 = 0; c0 < HEAD_DIM; c0 += kPart)
    stage_swizzled_tile<T, kPart, TILE_ROWS, 128, TAIL>(tile + c0 * TILE_ROWS, first_row + c0, stride, rows);
}

}  // namespace flash
}  // namespace hipattn
