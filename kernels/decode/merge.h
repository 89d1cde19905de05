// The end of a decode block: the partial softmax states that parts of the block (teams of lanes in
// decode/forward.hip, warps in decode/forward_mma.hip, waves in decode/forward_mfma.hip) kept over
// their own keys, merged per query row and written as the output (one split) or as the split's
// partial for decode/combine.hip. A learnable sink (common/sink.h) joins the row's sum where the row
// is final: here with one split, else in the combine.
#pragma once
#include "common/sink.h"
#include "common/types.h"

namespace hipattn {
namespace decode {

// One state per (part, row) in shared memory, base-2 and scaled as the kernels keep them: running
// max[part * ROWS + r], sum[part * ROWS + r], and unnormalised O at o[(part * ROWS + r) * pitch + d].
struct MergeBuffer {
  const float* max;
  const float* sum;
  const float* o;
  int pitch;
};

// Called by every thread of the block after a barrier that follows the last write to `m`. Row r of
// the block is query token (row0 + r) / group of query head kv_head * group + (row0 + r) % group.
// MODIFIED: the kernel's modified instantiation, which reads the sinks.
template <typename T, int HEAD_DIM, int ROWS, bool MODIFIED, typename Params>
HIPATTN_DEVICE void merge_and_store(const Params& p, const MergeBuffer& m, int parts, int rows, int row0, int group,
                                    int b, int kv_head, int split, int threads) {
  const bool single = p.splits == 1;
  for (int index = threadIdx.x; index < rows * HEAD_DIM; index += threads) {
    const int r = index / HEAD_DIM;
    const int d = index % HEAD_DIM;
    float max_all = -infinity();
    for (int part = 0; part < parts; ++part) max_all = fmaxf(max_all, m.max[part * ROWS + r]);
    const float reference = max_all == -infinity() ? 0.0f : max_all;
    float sum = 0.0f, value = 0.0f;
    for (int part = 0; part < parts; ++part) {
      const float weight = fast_exp2(m.max[part * ROWS + r] - reference);
      sum += m.sum[part * ROWS + r] * weight;
      value += m.o[(part * ROWS + r) * m.pitch + d] * weight;
    }
    const int token = (row0 + r) / group;
    const int head = kv_head * group + (row0 + r) % group;
    if (single) {
      // A row that saw no key: O = 0 and LSE +inf (hipattn's convention), or the sink's logit.
      float inv_sum, lse;
      finish_row(max_all, sum, sink_log2<MODIFIED>(p, head), inv_sum, lse);
      static_cast<T*>(p.o)[b * p.o_batch_stride + token * p.o_token_stride + head * p.o_head_stride + d] =
          from_float<T>(value * inv_sum);
      if (d == 0 && p.lse != nullptr)
        static_cast<float*>(p.lse)[b * p.lse_batch_stride + head * p.lse_head_stride + token] = lse;
    } else {
      // Partials: [split][b][head][token][d] and [split][b][head][token], contiguous. A split that saw
      // no key: O = 0 and LSE -inf (it then weighs nothing in the combine).
      const long long slot = ((static_cast<long long>(split) * p.batch + b) * p.heads_q + head) * p.seqlen_q + token;
      static_cast<float*>(p.o_partial)[slot * HEAD_DIM + d] = sum > 0.0f ? value / sum : 0.0f;
      if (d == 0)
        static_cast<float*>(p.lse_partial)[slot] = sum > 0.0f ? (max_all + fast_log2(sum)) * kLn2 : -infinity();
    }
  }
}

}  // namespace decode
}  // namespace hipattn
