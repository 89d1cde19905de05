// Learnable attention sinks (FlashAttention-4's learnable_sink, gpt-oss): one logit per query head that
// joins every row's softmax sum with no value. It scales O down and raises the LSE, and a row that saw
// no key gets O = 0 and LSE = the sink. Shared by the flash and small-seq forwards and the decode
// kernels' last step.
#pragma once
#include "common/types.h"

namespace hipattn {

// A row's end in the base-2 domain: from its running max and sum, what O's accumulators are multiplied
// by (`inv_sum`) and the LSE (natural log). A row that saw no key (sum 0) gets O = 0 and LSE = +inf.
// With a sink (`sink_log2`: the head's sink logit times log2 e, -inf for none) the sink is one more
// term of the sum. The plain kernels pass the constant -inf, so they compile the first branch alone.
HIPATTN_DEVICE void finish_row(float row_max, float sum, float sink_log2, float& inv_sum, float& lse) {
  if (sink_log2 == -infinity()) {
    inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
    lse = sum > 0.0f ? (row_max + fast_log2(sum)) * kLn2 : infinity();
    return;
  }
  const float top = fmaxf(row_max, sink_log2);  // row_max is -inf for a row that saw no key
  const float keys = fast_exp2(row_max - top);   // the keys' sum's scale at the new maximum: 0 without keys
  const float total = sum * keys + fast_exp2(sink_log2 - top);
  inv_sum = keys / total;
  lse = (top + fast_log2(total)) * kLn2;
}

// finish_row's two results one at a time (the other's arithmetic is dead code to the compiler), for a
// kernel that writes the LSE from one lane of a row and computes it in that lane only.
HIPATTN_DEVICE float row_inv_sum(float row_max, float sum, float sink_log2) {
  float inv_sum, lse;
  finish_row(row_max, sum, sink_log2, inv_sum, lse);
  return inv_sum;
}

HIPATTN_DEVICE float row_lse(float row_max, float sum, float sink_log2) {
  float inv_sum, lse;
  finish_row(row_max, sum, sink_log2, inv_sum, lse);
  return lse;
}

// Query head `head`'s sink times log2 e, or -inf without one: a parameter struct's learnable_sink
// (hipattn/catalog/fields.py's SINK_FIELDS, fp32 [Hq]), read by the modified instantiations only.
template <bool MODIFIED, typename Params>
HIPATTN_DEVICE float sink_log2(const Params& p, int head) {
  if constexpr (MODIFIED) {
    const float* const sinks = static_cast<const float*>(p.learnable_sink);
    return sinks != nullptr ? sinks[head] * kLog2e : -infinity();
  } else {
    (void)p;
    (void)head;
    return -infinity();
  }
}

}  // namespace hipattn
