// dq = scale * dq_accum: from the fp32 accumulator the flash backward adds into, to the 16-bit
// output layout.
#pragma once
#include "flash/preprocess_row_teams.h"

namespace hipattn {

template <typename T, int HEAD_DIM, int BLOCK_THREADS, int TEAM_LANES>
__global__ void __launch_bounds__(BLOCK_THREADS) bwd_convert_dq(const ConvertDqParams p) {
  using namespace preprocess;
  const RowIndex r = row_of_team<BLOCK_THREADS, TEAM_LANES>(p.batch, p.seqlen, p.heads);
  if (!r.valid) return;
  const int lane = threadIdx.x % TEAM_LANES;
  const float* accum = static_cast<const float*>(p.dq_accum) +
                       element_offset(r, p.dq_accum_batch_stride, p.dq_accum_token_stride, p.dq_accum_head_stride);
  T* dq = static_cast<T*>(p.dq) + element_offset(r, p.dq_batch_stride, p.dq_token_stride, p.dq_head_stride);
#pragma unroll
  for (int c = lane * kChunk; c < HEAD_DIM; c += TEAM_LANES * kChunk) {
    float values[kChunk];
    load_as_float<float, 4>(accum + c, *reinterpret_cast<float(*)[4]>(values));
    load_as_float<float, 4>(accum + c + 4, *reinterpret_cast<float(*)[4]>(values + 4));
#pragma unroll
    for (int x = 0; x < kChunk; ++x) values[x] *= p.scale;
    store_from_float<T, kChunk>(dq + c, values);
  }
}

}  // namespace hipattn
