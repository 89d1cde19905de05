// Row teams for the flash backward's pre- and post-processing kernels (bwd_dot_do_o.hip,
// bwd_convert_dq.hip). Both see THD (varlen) data as one batch of `seqlen` = total tokens. They are
// memory-bound: a row is read with 16-byte accesses by a team of TEAM_LANES lanes (a power of two up
// to 32); BLOCK_THREADS and TEAM_LANES are template arguments from the host's table (catalog/preprocess.py),
// which sizes the grid with the same numbers.
#pragma once
#include "common/types.h"

namespace hipattn {
namespace preprocess {

constexpr int kChunk = 8;  // elements per 16-byte access of a 16-bit type

struct RowIndex {
  bool valid;
  int batch_index, token, head;
};

// Row r of the flattened [batch, seqlen, heads] index space handled by this thread's team.
template <int BLOCK_THREADS, int TEAM_LANES>
HIPATTN_DEVICE RowIndex row_of_team(int batch, int seqlen, int heads) {
  static_assert(BLOCK_THREADS % 32 == 0 && TEAM_LANES <= 32 && (TEAM_LANES & (TEAM_LANES - 1)) == 0,
                "whole warps per block; teams are power-of-two slices of a warp");
  const long long row = (static_cast<long long>(blockIdx.x) * BLOCK_THREADS + threadIdx.x) / TEAM_LANES;
  const long long rows = static_cast<long long>(batch) * seqlen * heads;
  RowIndex index{row < rows, 0, 0, 0};
  if (index.valid) {
    index.head = static_cast<int>(row % heads);
    index.token = static_cast<int>((row / heads) % seqlen);
    index.batch_index = static_cast<int>(row / (static_cast<long long>(heads) * seqlen));
  }
  return index;
}

HIPATTN_DEVICE long long element_offset(const RowIndex& r, long long batch_stride, long long token_stride,
                                        long long head_stride) {
  return r.batch_index * batch_stride + r.token * token_stride + r.head * head_stride;
}

}  // namespace preprocess

}  // namespace hipattn
