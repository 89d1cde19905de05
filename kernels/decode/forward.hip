// Attention against a KV cache (decode, speculative decoding, chunked prefill): a few query tokens per
// sequence against a long, possibly paged, cache, with the KV length split across blocks.
//
// The work is bound by reading K and V once, so the kernel is built around that read:
//   - A block owns one (sequence, KV head, split) and up to ROWS query rows of that KV head's group:
//     row r is query token r / group of query head kv_head * group + r % group (GQA/MQA packing), so
//     each K and V row is read once for the whole group.
//   - A team of lanes owns one key at a time; each lane holds 8 consecutive elements of head_dim
//     (one 16-byte load of K and one of V per key). Teams take runs of UNROLL consecutive keys per
//     step, and load the next run while they compute this one, so a block keeps many loads in flight.
//   - Scores are dot products reduced across the team's lanes; each team keeps its own online
//     softmax (running max and sum per row, base 2) and its share of O in fp32. The teams merge
//     through shared memory at the end. Plain scores are linear in q, so q is pre-scaled by
//     softmax_scale * log2 e once; with SCORE_MODS (common/score_mods.h) the scores are formed from
//     the raw dot products (softcap's tanh is not linear), each row by its own query head's modifiers.
//   - With one split the block writes O and the LSE; with more it writes its fp32 partial O and LSE,
//     which decode/combine.hip merges.
//
// Where keys live (paged or contiguous, with clamped indices) is decode/cache.h's.
//
// Which keys a row sees: those of [leftpad, total) in its window, total = cache_seqlens[b] + the new
// tokens the append kernel wrote (at most the capacity), the window bottom-right aligned (causal is
// its right side at 0). `token_keys` is the one place a mask enters; the score modifiers act where the
// mask is applied, on the scores it leaves visible.
#pragma once
#include "common/score_mods.h"
#include "decode/cache.h"
#include "decode/merge.h"

namespace hipattn {
namespace decode {

// How one block is laid out. The host launches kThreads threads (hipattn/catalog/decode.py,
// DECODE_BLOCK_THREADS).
template <int HEAD_DIM, int ROWS, int UNROLL>
struct Layout {
  static constexpr int kThreads = 128;
  static constexpr int kElements = 8;                     // per lane: one 16-byte load of a 16-bit row
  static constexpr int kLanesUsed = HEAD_DIM / kElements;  // lanes holding part of a row
  static constexpr int kLanes = NextPowerOfTwo<kLanesUsed>::value;  // a team: a power of two, for the butterfly
  static constexpr int kTeams = kThreads / kLanes;
  static constexpr int kKeysPerStep = kTeams * UNROLL;
  static constexpr int kRowPitch = HEAD_DIM + 1;  // floats per row of the merge buffer (odd: banks apart)

  static_assert(HEAD_DIM % kElements == 0 && HEAD_DIM >= 8 && HEAD_DIM <= 256, "head_dim: a multiple of 8 up to 256");
  static_assert(kLanes <= 32 && kTeams >= 1, "a team fits one warp");
  // Eight rows keep the merge buffer within 48 KiB of static shared memory at every head_dim.
  static_assert(ROWS >= 1 && ROWS <= 8, "1 to 8 rows per block");
  static_assert(UNROLL >= 1 && UNROLL <= 8, "1 to 8 keys per team and step");
};

}  // namespace decode

template <typename T, int HEAD_DIM, int ROWS, int UNROLL, bool SCORE_MODS>
__global__ void __launch_bounds__(128) decode_forward(const DecodeForwardParams p) {
  using L = decode::Layout<HEAD_DIM, ROWS, UNROLL>;
  constexpr int E = L::kElements;
  static_assert(sizeof(T) == 2, "16-bit inputs");
  // The teams' running max, sum and O, merged at the end.
  __shared__ float merge_max[L::kTeams][ROWS];
  __shared__ float merge_sum[L::kTeams][ROWS];
  __shared__ float merge_o[L::kTeams][ROWS * L::kRowPitch];

  // grid: x (sequence, KV head), y split, z chunk of ROWS query rows.
  const int b = blockIdx.x / p.heads_kv;
  const int kv_head = blockIdx.x % p.heads_kv;
  const int split = blockIdx.y;
  const int group = p.heads_q / p.heads_kv;
  const int row0 = blockIdx.z * ROWS;
  const int rows = p.seqlen_q * group - row0 < ROWS ? p.seqlen_q * group - row0 : ROWS;
  const int team = threadIdx.x / L::kLanes;
  const int lane = threadIdx.x % L::kLanes;
  const bool holds = lane < L::kLanesUsed;  // lanes of a padded team (head_dim 80: 10 of 16) hold nothing
  const unsigned int mask = group_mask(L::kLanes);

  const decode::CacheAddress address = decode::cache_address(p, b, kv_head);
  const decode::KeyRange range = decode::key_range(p, b);
  // This split's keys: an equal share of the visible ones, in runs of UNROLL keys that start at
  // multiples of UNROLL (keys before cache_leftpad are masked), so that a run never crosses a page.
  const int aligned_start = range.start - range.start % UNROLL;
  int share = (range.total - aligned_start + p.splits - 1) / p.splits;
  share = (share + UNROLL - 1) / UNROLL * UNROLL;
  const long long first = aligned_start + static_cast<long long>(split) * share;
  const int key_begin = first < range.total ? static_cast<int>(first) : range.total;
  const int key_end = key_begin + share < range.total ? key_begin + share : range.total;

  // Q rows in registers; rows past the block's are zeros. Plain scores are linear in q, so q is scaled
  // into the base-2 domain here, once per element; modified scores are formed from the raw dot
  // products, each row's by its query head's Scores.
  const float scale_log2 = p.softmax_scale * kLog2e;
  float q[ROWS][E];
  decode::TokenKeys seen[ROWS];  // the keys each row's query token sees
  int diagonal[ROWS];             // ... and the key on its diagonal
  Scores<SCORE_MODS> scores[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int token = (row0 + r) / group;
    const int head = kv_head * group + (row0 + r) % group;
    seen[r] = r < rows ? decode::token_keys(p, range, token) : decode::TokenKeys{0, 0};
    diagonal[r] = decode::token_diagonal(p, range, token);
    scores[r] = scores_of<SCORE_MODS>(p, b, head);
#pragma unroll
    for (int e = 0; e < E; ++e) q[r][e] = 0.0f;
    if (r < rows && holds) {
      load_as_float<T, E>(static_cast<const T*>(p.q) + b * p.q_batch_stride + token * p.q_token_stride +
                              head * p.q_head_stride + lane * E,
                          q[r]);
      if constexpr (!SCORE_MODS) {
#pragma unroll
        for (int e = 0; e < E; ++e) q[r][e] *= scale_log2;
      }
    }
  }

  float row_max[ROWS], row_sum[ROWS], o[ROWS][E];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    row_max[r] = -infinity();
    row_sum[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[r][e] = 0.0f;
  }

  const T* const k_cache = static_cast<const T*>(p.k) + address.k + lane * E;
  const T* const v_cache = static_cast<const T*>(p.v) + address.v + lane * E;
  // A team's run of UNROLL keys from j0: its K and V rows (zeros past the split's end, whose scores
  // are masked below).
  auto load_run = [&](int j0, Vec<T, E> (&k_rows)[UNROLL], Vec<T, E> (&v_rows)[UNROLL]) {
    const bool run = j0 < key_end && holds;
    const long long k_at = run ? decode::token_offset(p, address, j0, p.k_batch_stride, p.k_token_stride) : 0;
    const long long v_at = run ? decode::token_offset(p, address, j0, p.v_batch_stride, p.v_token_stride) : 0;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (run && j0 + u < key_end) {
        k_rows[u] = *reinterpret_cast<const Vec<T, E>*>(k_cache + k_at + u * p.k_token_stride);
        v_rows[u] = *reinterpret_cast<const Vec<T, E>*>(v_cache + v_at + u * p.v_token_stride);
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) k_rows[u].elements[e] = v_rows[u].elements[e] = T{};
      }
    }
  };

  // Every team runs the same number of steps (the shuffles below need whole warps). Each step first
  // issues the loads of the team's next run, so that they are in flight while this run is computed.
  Vec<T, E> k_rows[UNROLL], v_rows[UNROLL];
  load_run(key_begin + team * UNROLL, k_rows, v_rows);
  for (int step0 = key_begin; step0 < key_end; step0 += L::kKeysPerStep) {
    const int j0 = step0 + team * UNROLL;
    Vec<T, E> k_next[UNROLL], v_next[UNROLL];
    load_run(j0 + L::kKeysPerStep, k_next, v_next);

    float score[ROWS][UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float k_lane[E];
#pragma unroll
      for (int e = 0; e < E; ++e) k_lane[e] = to_float(k_rows[u].elements[e]);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot += q[r][e] * k_lane[e];
        score[r][u] = dot;
      }
    }
#pragma unroll
    for (int width = L::kLanes / 2; width >= 1; width /= 2)
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) score[r][u] += shfl_xor(score[r][u], width, L::kLanes, mask);

    // Online softmax per row over this step's keys, then O += P V.
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float step_max = -infinity();
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int j = j0 + u;
        if (j < seen[r].first || j >= key_end || j >= seen[r].end) {
          score[r][u] = -infinity();
        } else if constexpr (SCORE_MODS) {
          score[r][u] = scores[r](score[r][u], j - diagonal[r]);
        }
        step_max = score[r][u] > step_max ? score[r][u] : step_max;
      }
      const float new_max = step_max > row_max[r] ? step_max : row_max[r];
      // A row that has seen no key yet keeps max -inf; exponentiate against 0 so that nothing is NaN.
      const float reference = new_max == -infinity() ? 0.0f : new_max;
      const float correction = fast_exp2(row_max[r] - reference);
      row_max[r] = new_max;
      row_sum[r] *= correction;
#pragma unroll
      for (int e = 0; e < E; ++e) o[r][e] *= correction;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const float probability = fast_exp2(score[r][u] - reference);
        row_sum[r] += probability;
#pragma unroll
        for (int e = 0; e < E; ++e) o[r][e] += probability * to_float(v_rows[u].elements[e]);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      k_rows[u] = k_next[u];
      v_rows[u] = v_next[u];
    }
  }

  // ---- merge the teams: every team's statistics and O to shared memory, then one pass per element ----
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (lane == 0) {
      merge_max[team][r] = row_max[r];
      merge_sum[team][r] = row_sum[r];
    }
    if (holds) {
#pragma unroll
      for (int e = 0; e < E; ++e) merge_o[team][r * L::kRowPitch + lane * E + e] = o[r][e];
    }
  }
  __syncthreads();
  decode::merge_and_store<T, HEAD_DIM, ROWS, SCORE_MODS>(
      p, {&merge_max[0][0], &merge_sum[0][0], &merge_o[0][0], L::kRowPitch}, L::kTeams, rows, row0, group, b, kv_head,
      split, L::kThreads);
}

}  // namespace hipattn
