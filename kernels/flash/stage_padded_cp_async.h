// Staging of row tiles from global into shared memory with cp.async, for the flash kernels on NVIDIA
// tensor cores. Shared rows are HEAD_DIM + 8 elements long: the 16-byte pad puts the eight row reads
// of an ldmatrix in distinct banks.
#pragma once
#include "common/mma_nvidia.h"

namespace hipattn {
namespace flash {

// Copy rows [0, rows) of a BLOCK_N- or BLOCK_M-row tile with cp.async; rows [rows, tile_rows) are
// zero-filled when ZERO_TAIL (a row a tensor-core product multiplies by a weight of 0 must be finite:
// 0 x NaN from stale shared memory is NaN) and left alone otherwise (rows that only reach scores
// that are masked by selection, or rows that are never stored).
template <typename T, int HEAD_DIM, int THREADS, bool ZERO_TAIL>
HIPATTN_DEVICE void stage_tile(T* tile, const T* first_row, long long token_stride, int rows, int tile_rows) {
  constexpr int kChunks = HEAD_DIM / 8;
  constexpr int kPitch = HEAD_DIM + 8;
  const int limit = ZERO_TAIL ? tile_rows : rows;
  for (int c = threadIdx.x; c < limit * kChunks; c += THREADS) {
    const int row = c / kChunks;
    const int chunk = c % kChunks;
    T* destination = tile + row * kPitch + chunk * 8;
    if (row < rows) {
      mma::copy_async_16(destination, first_row + row * token_stride + chunk * 8);
    } else {
      *reinterpret_cast<Vec<T, 8>*>(destination) = Vec<T, 8>{};
    }
  }
}

}  // namespace flash
}  // namespace hipattn
