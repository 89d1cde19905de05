// Row teams for the flash backward's pre- and post-processing kernels (bwd_dot_do_o.hip,
// bwd_convert_dq.hip). Both see THD (varlen) data as one batch of `seqlen` = total tokens. They are
// memory-bound: a row is read with 16-byte accesses by a team of 8 lanes.
#pragma once
#include "common/types.h"

namespace hipattn {
namespace preprocess {

constexpr int kTeamLanes = 8;
constexpr int kChunk = 8;  // elements per 16-byte access of a 16-bit type
constexpr int kBlockThreads = 256;

struct RowIndex {
  bool valid;
  int batch_index, token, head;
};

// Row r of the flattened [batch, seqlen, heads] index space handled by this thread's team.
HIPATTN_DEVICE RowIndex row_of_team(int batch, int seqlen, int heads) {
  const long long row = (static_cast<long long>(blockIdx.x) * kBlockThreads + threadIdx.x) / kTeamLanes;
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
