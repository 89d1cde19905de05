// The second step of a split-KV decode: merge the splits' partial O and LSE of each query row.
//
// decode/forward.hip wrote, per split s, an fp32 O_s normalised over its own keys and LSE_s (-inf for
// a split that saw no key). The row's LSE is log Σ_s exp(LSE_s), and O = Σ_s exp(LSE_s - LSE) O_s. A
// learnable sink (common/sink.h: learnable_sink given) is one more term of the first sum.
// One block per row: its threads weigh the splits (one split each, at most MAX_SPLITS), then each
// warp sums a quarter of the splits over the whole row, 4 elements per lane per load, and the four
// partial sums meet in shared memory. Many splits with few rows (batch 1 at long context) is the
// common case, so the splits, not the rows, are spread over the threads.
#pragma once
#include "common/sink.h"
#include "common/types.h"

namespace hipattn {

template <typename T, int MAX_SPLITS>
__global__ void __launch_bounds__(128) decode_combine(const DecodeCombineParams p) {
  constexpr int kThreads = 128;
  constexpr int kWarps = kThreads / 32;  // 32-lane groups (half a wave on AMD)
  static_assert(MAX_SPLITS <= kThreads, "one split per thread when weighing them");
  __shared__ float weight[MAX_SPLITS];
  __shared__ float reduce[kWarps];
  __shared__ float sums[kWarps][256];

  const long long row = blockIdx.x;
  const long long rows = static_cast<long long>(p.batch) * p.heads_q * p.seqlen_q;
  const int splits = p.splits < MAX_SPLITS ? p.splits : MAX_SPLITS;
  const int group = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const unsigned int mask = group_mask(32);
  const float* const lse_partial = static_cast<const float*>(p.lse_partial);
  const int token = static_cast<int>(row % p.seqlen_q);
  const int head = static_cast<int>((row / p.seqlen_q) % p.heads_q);
  const int b = static_cast<int>(row / (static_cast<long long>(p.seqlen_q) * p.heads_q));

  // ---- weights: exp(LSE_s - LSE) per split ----
  const float mine = threadIdx.x < splits ? lse_partial[threadIdx.x * rows + row] : -infinity();
  float max_lse = mine;
  for (int width = 16; width >= 1; width /= 2) {
    const float other = shfl_xor(max_lse, width, 32, mask);
    max_lse = other > max_lse ? other : max_lse;
  }
  if (lane == 0) reduce[group] = max_lse;
  __syncthreads();
  max_lse = reduce[0];
  for (int w = 1; w < kWarps; ++w) max_lse = reduce[w] > max_lse ? reduce[w] : max_lse;
  const float reference = max_lse == -infinity() ? 0.0f : max_lse;
  float sum = fast_exp2((mine - reference) * kLog2e);  // 0 for -inf
  for (int width = 16; width >= 1; width /= 2) sum += shfl_xor(sum, width, 32, mask);
  __syncthreads();  // every thread has read reduce[] as maxima
  if (lane == 0) reduce[group] = sum;
  __syncthreads();
  sum = 0.0f;
  for (int w = 0; w < kWarps; ++w) sum += reduce[w];
  // No split saw a key: O = 0 and LSE = +inf, or the sink's logit, as the one-split kernel writes.
  float inv_sum, lse;
  finish_row(max_lse * kLog2e, sum, sink_log2<true>(p, head), inv_sum, lse);
  if (threadIdx.x < splits) weight[threadIdx.x] = fast_exp2((mine - reference) * kLog2e) * inv_sum;
  __syncthreads();

  // ---- O: warp w sums splits w, w + 4, ...; lane l owns elements 4l .. 4l + 3 of each 128 ----
  const float* const o_partial = static_cast<const float*>(p.o_partial);
  const int quads = p.head_dim / 4;
  for (int quad = lane; quad < quads; quad += 32) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = group; s < splits; s += kWarps) {
      float part[4];
      load_as_float<float, 4>(o_partial + (s * rows + row) * p.head_dim + 4 * quad, part);
      const float w = weight[s];
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] += w * part[e];
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) sums[group][4 * quad + e] = acc[e];
  }
  __syncthreads();
  T* const out = static_cast<T*>(p.o) + b * p.o_batch_stride + token * p.o_token_stride + head * p.o_head_stride;
  for (int d = threadIdx.x; d < p.head_dim; d += kThreads) {
    float value = 0.0f;
    for (int w = 0; w < kWarps; ++w) value += sums[w][d];
    out[d] = from_float<T>(value);
  }
  if (threadIdx.x == 0 && p.lse != nullptr)
    static_cast<float*>(p.lse)[b * p.lse_batch_stride + head * p.lse_head_stride + token] = lse;
}

}  // namespace hipattn
