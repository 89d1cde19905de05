// The score of a (query, key) pair a row sees: flash-attn's score modifiers, the one place every
// attention kernel turns a dot product q·k into the softmax's input. common/key_window.h decides
// which pairs a row sees; this decides what their scores are.
//
// With s = softmax_scale · q·k (flash-attn's order: softcap first, then the ALiBi bias):
//   softcap:  s -> softcap · tanh(s / softcap)
//   ALiBi:    s -> s - slope · |key - (row + diagonal)|     (the slope of the sequence and query head)
// The kernels work in base 2, so the score is returned times log2 e. A key's distance from its row's
// diagonal, key - (row + diagonal), is the number common/key_window.h bounds by the window's sides;
// kernels pass it as `offset`, a float (exact up to 2^24): a loop over a tile adds constants to one
// base converted per row, where converting every key would cost a conversion per score.
//
// A kernel takes a SCORE_MODS template flag and uses Scores<SCORE_MODS>. Scores<false> is plain
// attention: its score ignores the offset and its gradient factor is 1, so the compiler emits what a
// kernel written without modifiers would (the plain instantiations are unchanged). Scores<true> reads
// the softcap and the ALiBi slope at run time; either may be off (0). A loop over many scores goes
// through visit(f) (f a functor with a templated call operator), which calls f with the softcap's
// presence fixed at compile time: one uniform branch around the loop rather than one per score.
//
// The backward needs d(score)/d(s) to turn dP into dS: 1 - tanh² with softcap, else 1 (the ALiBi bias
// does not depend on s). The kernels multiply dS by it where they form dS; softmax_scale, the
// derivative of s by q·k, is applied where they already apply it.
#pragma once
#include "common/platform.h"

namespace hipattn {

template <bool MODIFIED>
struct Scores;

template <>
struct Scores<false> {
  float scale_log2;  // softmax_scale · log2 e

  HIPATTN_DEVICE float operator()(float dot, float offset) const {
    (void)offset;
    return dot * scale_log2;
  }
  // The score and, in `gradient`, d(score)/d(s): what dS is multiplied by.
  HIPATTN_DEVICE float operator()(float dot, float offset, float& gradient) const {
    (void)offset;
    gradient = 1.0f;
    return dot * scale_log2;
  }
  // Calls f(scores): a loop over a tile's scores written inside f runs as it would outside.
  template <typename F>
  HIPATTN_DEVICE void visit(F&& f) const {
    f(*this);
  }
  // The scores of another query head of the same sequence (a block that walks several heads).
  template <typename Params>
  HIPATTN_DEVICE Scores with_head(const Params& p, int batch_index, int head) const {
    (void)p;
    (void)batch_index;
    (void)head;
    return *this;
  }
};

// The modified scores with the softcap's presence fixed at compile time (Scores<true>::visit).
template <bool CAPPED>
struct ModifiedScores {
  float scale_log2;  // softmax_scale · log2 e, the score's factor without softcap
  float cap_in;      // softmax_scale / softcap: tanh's argument per unit of q·k
  float cap_out;     // softcap · log2 e: the capped score per unit of tanh
  float slope_log2;  // this (sequence, query head)'s ALiBi slope · log2 e; 0 without ALiBi

  HIPATTN_DEVICE float operator()(float dot, float offset) const {
    const float score = CAPPED ? cap_out * fast_tanh(dot * cap_in) : dot * scale_log2;
    return score - slope_log2 * fabsf(offset);
  }
  HIPATTN_DEVICE float operator()(float dot, float offset, float& gradient) const {
    if constexpr (CAPPED) {
      const float t = fast_tanh(dot * cap_in);
      gradient = 1.0f - t * t;
      return cap_out * t - slope_log2 * fabsf(offset);
    } else {
      gradient = 1.0f;
      return dot * scale_log2 - slope_log2 * fabsf(offset);
    }
  }
};

template <>
struct Scores<true> : ModifiedScores<false> {
  // One score: a branch on the softcap each time. A loop over many takes visit, which branches once.
  HIPATTN_DEVICE float operator()(float dot, float offset) const {
    return cap_in != 0.0f ? capped()(dot, offset) : ModifiedScores<false>::operator()(dot, offset);
  }
  HIPATTN_DEVICE float operator()(float dot, float offset, float& gradient) const {
    return cap_in != 0.0f ? capped()(dot, offset, gradient) : ModifiedScores<false>::operator()(dot, offset, gradient);
  }
  // Calls f(scores) with ModifiedScores<true> when this call has a softcap, else ModifiedScores<false>:
  // a uniform branch around the loop inside f instead of one per score.
  template <typename F>
  HIPATTN_DEVICE void visit(F&& f) const {
    if (cap_in != 0.0f) {
      f(capped());
    } else {
      f(static_cast<const ModifiedScores<false>&>(*this));
    }
  }
  template <typename Params>
  HIPATTN_DEVICE Scores with_head(const Params& p, int batch_index, int head) const;

 private:
  HIPATTN_DEVICE ModifiedScores<true> capped() const { return {scale_log2, cap_in, cap_out, slope_log2}; }
};

// The scores of query head `head` of batch entry `batch_index`, from a parameter struct with the
// score-modifier fields of hipattn/catalog/fields.py (softcap: 0 for none; alibi_slopes: fp32
// [batch][heads_q] at alibi_batch_stride, or null). Plain kernels read none of them.
template <bool MODIFIED, typename Params>
HIPATTN_DEVICE Scores<MODIFIED> scores_of(const Params& p, int batch_index, int head) {
  Scores<MODIFIED> scores;
  scores.scale_log2 = p.softmax_scale * kLog2e;
  if constexpr (MODIFIED) {
    scores.cap_in = p.softcap > 0.0f ? p.softmax_scale / p.softcap : 0.0f;
    scores.cap_out = p.softcap * kLog2e;
    const float* const slopes = static_cast<const float*>(p.alibi_slopes);
    scores.slope_log2 = slopes != nullptr ? slopes[batch_index * p.alibi_batch_stride + head] * kLog2e : 0.0f;
  } else {
    (void)batch_index;
    (void)head;
  }
  return scores;
}

template <typename Params>
HIPATTN_DEVICE Scores<true> Scores<true>::with_head(const Params& p, int batch_index, int head) const {
  return scores_of<true>(p, batch_index, head);
}

}  // namespace hipattn
