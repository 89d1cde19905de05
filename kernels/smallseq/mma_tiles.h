// Shared by the tensor-core small-seq kernels: staging rows of one head into a warp's shared tiles.
#pragma once
#include "common/mma_nvidia.h"
#include "smallseq/common.h"

namespace hipattn {
namespace smallseq {

// Shared-memory tile of one warp: Q (two 16-row tiles), K (three 8-row tiles), V (two 16-row k
// steps), each row padded by 16 bytes so that ldmatrix's eight row reads hit distinct banks.
template <typename T, int HEAD_DIM>
struct MmaTiles {
  static constexpr int kPitch = HEAD_DIM + 8;
  static constexpr int kQRows = 32;
  static constexpr int kKRows = 24;
  static constexpr int kVRows = 32;
  static constexpr int kElements = (kQRows + kKRows + kVRows) * kPitch;
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte pieces of a row
};

// Copy `rows` rows of one head into a shared tile with cp.async.
template <typename T, int HEAD_DIM>
HIPATTN_DEVICE void stage_rows(T* tile, const T* first_row, long long token_stride, int rows, int lane) {
  using Tiles = MmaTiles<T, HEAD_DIM>;
  for (int c = lane; c < rows * Tiles::kChunks; c += 32) {
    const int row = c / Tiles::kChunks;
    const int chunk = c % Tiles::kChunks;
    mma::copy_async_16(tile + row * Tiles::kPitch + chunk * 8, first_row + row * token_stride + chunk * 8);
  }
}

// Zero rows [from, to) of a staged tile: rows that meet zero weights in an MMA must not hold NaN.
template <typename T, int HEAD_DIM>
HIPATTN_DEVICE void zero_rows(T* tile, int from, int to, int lane) {
  using Tiles = MmaTiles<T, HEAD_DIM>;
  for (int c = lane; c < (to - from) * Tiles::kChunks; c += 32)
    *reinterpret_cast<Vec<T, 8>*>(tile + (from + c / Tiles::kChunks) * Tiles::kPitch + (c % Tiles::kChunks) * 8) =
        Vec<T, 8>{};
}

}  // namespace smallseq
}  // namespace hipattn
