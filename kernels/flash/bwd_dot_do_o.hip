// D[b, h, s] = sum_d dO[b, s, h, d] * O[b, s, h, d] in fp32: the row term of the softmax gradient
// dS = P * (dP - D) in the flash backward.
#pragma once
#include "flash/preprocess_row_teams.h"

namespace hipattn {

template <typename T, int HEAD_DIM, int BLOCK_THREADS, int TEAM_LANES>
__global__ void __launch_bounds__(BLOCK_THREADS) bwd_dot_do_o(const DotDoOParams p) {
  using namespace preprocess;
  static_assert(HEAD_DIM % kChunk == 0, "head_dim must be a multiple of 8");
  const RowIndex r = row_of_team<BLOCK_THREADS, TEAM_LANES>(p.batch, p.seqlen, p.heads);
  const int lane = threadIdx.x % TEAM_LANES;
  float sum = 0.0f;
  if (r.valid) {
    const T* o = static_cast<const T*>(p.o) + element_offset(r, p.o_batch_stride, p.o_token_stride, p.o_head_stride);
    const T* dout = static_cast<const T*>(p.dout) +
                    element_offset(r, p.dout_batch_stride, p.dout_token_stride, p.dout_head_stride);
#pragma unroll
    for (int c = lane * kChunk; c < HEAD_DIM; c += TEAM_LANES * kChunk) {
      float a[kChunk], b[kChunk];
      load_as_float<T, kChunk>(o + c, a);
      load_as_float<T, kChunk>(dout + c, b);
#pragma unroll
      for (int x = 0; x < kChunk; ++x) sum += a[x] * b[x];
    }
  }
  // Every lane of the warp reaches the shuffles; teams past the end contribute zeros.
#pragma unroll
  for (int width = TEAM_LANES / 2; width >= 1; width /= 2)
    sum += shfl_xor(sum, width, TEAM_LANES, group_mask(TEAM_LANES));
  if (r.valid && lane == 0) {
    static_cast<float*>(p.d)[r.batch_index * p.d_batch_stride + r.head * p.d_head_stride + r.token] = sum;
  }
}

}  // namespace hipattn
