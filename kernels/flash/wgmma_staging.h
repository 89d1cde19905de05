// Staging of row tiles from global into shared memory with cp.async, in wgmma's 128-byte swizzled
// layout (common/wgmma_nvidia.h), for the flash kernels on Hopper's warpgroup tensor cores.
#pragma once
#include "common/wgmma_nvidia.h"

namespace hipattn {
namespace flash {

// Copy rows [0, rows) of a swizzled tile of TILE_ROWS rows with cp.async; rows past `rows` are
// zero-filled when ZERO_TAIL (V, Q: their products must stay finite) and left alone otherwise (K: their
// scores are masked by selection). Consecutive threads copy consecutive 16-byte chunks of a row.
template <typename T, int HEAD_DIM, int TILE_ROWS, int THREADS, bool ZERO_TAIL>
HIPATTN_DEVICE void stage_swizzled_tile(T* tile, const T* first_row, long long token_stride, int rows) {
  constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row
#pragma unroll
  for (int c = threadIdx.x; c < TILE_ROWS * kChunks; c += THREADS) {
    const int row = c / kChunks;
    const int col = (c % kChunks) * 8;
    T* const destination = tile + wgmma::swizzled_offset<TILE_ROWS>(row, col);
    if (row < rows) {
      mma::copy_async_16(destination, first_row + row * token_stride + col);
    } else if (ZERO_TAIL) {
      *reinterpret_cast<Vec<T, 8>*>(destination) = Vec<T, 8>{};
    }
  }
}

}  // namespace flash
}  // namespace hipattn
