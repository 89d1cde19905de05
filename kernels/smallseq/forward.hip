// Small-sequence attention forward: O = softmax(scale * Q Kᵀ + mask) V and the fp32 log-sum-exp,
// for problems of at most TILE query and TILE key tokens (cross-attention with short sequences).
// With SCORE_MODS the scores take flash-attn's softcap and ALiBi (common/score_mods.h), a learnable sink
// joins each row's softmax sum (common/sink.h), and dropout (common/dropout.h) zeroes the dropped
// probabilities and scales the kept ones by 1 / (1 - dropout_p) after the sum and the LSE are taken.
//
// The work is bound by memory traffic: each team reads its Q, K and V rows once, keeps them in
// registers (Q as fp32, K and V as packed 16-bit), and writes O and LSE once. Score tiles live in
// shared memory. Rows beyond the sequence's real length are skipped with team-uniform branches, so
// a 9-token sequence costs about a quarter of a 17-token one.
#pragma once
#include "smallseq/common.h"

namespace hipattn {

// BLOCK_THREADS and LANE_ELEMENTS come from the host's row (hipattn/catalog/smallseq.py), which sizes the grid
// with them; LANE_ELEMENTS must be the layout this file is written for.
template <typename T, int HEAD_DIM, int HEADS, int TILE, int BLOCK_THREADS, int LANE_ELEMENTS, bool SCORE_MODS>
__global__ void __launch_bounds__(BLOCK_THREADS) smallseq_forward(const SmallSeqForwardParams p) {
  static_assert(LANE_ELEMENTS == smallseq::kElementsPerLane, "each lane holds 4 elements of a row");
  using G = smallseq::Geometry<HEAD_DIM, TILE, BLOCK_THREADS>;
  using Row = Vec<T, smallseq::kElementsPerLane>;
  constexpr int E = smallseq::kElementsPerLane;

  // Partial score sums, one tile per slice of the team; slice 0 is reused for the probabilities.
  __shared__ float scores[G::kTeamsPerBlock][G::kSlices][TILE * G::kTilePad];

  const int team = threadIdx.x / G::kTeamLanes;
  const int team_lane = threadIdx.x % G::kTeamLanes;
  const int slice = team_lane / G::kReduceLanes;
  const int reduce_lane = team_lane % G::kReduceLanes;
  const long long problem = static_cast<long long>(blockIdx.x) * G::kTeamsPerBlock + team;
  // Teams past the last problem stay to take part in the block's barriers.
  const bool active = problem < static_cast<long long>(p.batch) * HEADS;
  const int batch_index = active ? static_cast<int>(problem / HEADS) : 0;
  const int head = static_cast<int>(problem % HEADS);
  const int head_kv = head / (HEADS / p.heads_kv);

  // The scores' factors, set where the softmax starts. Declared ahead of the sequence bounds: declared
  // where it is set, the plain instantiation compiled to other (if equivalent) code on NVIDIA.
  Scores<SCORE_MODS> score;
  smallseq::Sequence seq_q{0, 0}, seq_k{0, 0};
  if (active) {
    seq_q = smallseq::sequence_bounds(static_cast<const int*>(p.cu_seqlens_q), static_cast<const int*>(p.seqused_q),
                                      batch_index, p.max_seqlen_q, p.total_q, TILE);
    seq_k = smallseq::sequence_bounds(static_cast<const int*>(p.cu_seqlens_k), static_cast<const int*>(p.seqused_k),
                                      batch_index, p.max_seqlen_k, p.total_k, TILE);
  }
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;

  // ---- load: every row this lane needs, issued before any use ----
  float q[TILE][E];
  Row k[TILE], v[TILE];
#pragma unroll
  for (int i = 0; i < TILE; ++i) {
    if (i < len_q) {
      load_as_float<T, E>(smallseq::row_pointer<T>(p.q, p.q_batch_stride, p.q_token_stride, p.q_head_stride,
                                                   batch_index, seq_q.start + i, head, team_lane),
                          q[i]);
    }
  }
#pragma unroll
  for (int j = 0; j < TILE; ++j) {
    if (j < len_k) {
      k[j] = *reinterpret_cast<const Row*>(smallseq::row_pointer<T>(
          p.k, p.k_batch_stride, p.k_token_stride, p.k_head_stride, batch_index, seq_k.start + j, head_kv, team_lane));
      v[j] = *reinterpret_cast<const Row*>(smallseq::row_pointer<T>(
          p.v, p.v_batch_stride, p.v_token_stride, p.v_head_stride, batch_index, seq_k.start + j, head_kv, team_lane));
    }
  }

  // ---- scores: S[j][i] = q_i · k_j, summed across the team ----
  float* my_scores = scores[team][slice];
#pragma unroll
  for (int g = 0; g < G::kGroups; ++g) {
    if (g * G::kReduceLanes < len_k * TILE) {
      float partial[G::kReduceLanes];
#pragma unroll
      for (int e = 0; e < G::kReduceLanes; ++e) {
        const int entry = g * G::kReduceLanes + e;
        const int j = entry < G::kEntries ? entry / TILE : 0;  // the last round's spare entries stay in bounds
        const int i = entry % TILE;
        float sum = 0.0f;
        if (entry < G::kEntries && i < len_q && j < len_k) {
#pragma unroll
          for (int x = 0; x < E; ++x) sum += q[i][x] * to_float(k[j].elements[x]);
        }
        partial[e] = sum;
      }
      const float total = reduce_scatter<G::kReduceLanes>(partial, reduce_lane);
      const int entry = g * G::kReduceLanes + reduce_lane;
      if (entry < G::kEntries) my_scores[(entry / TILE) * G::kTilePad + entry % TILE] = total;
    }
  }
  __syncthreads();

  // ---- softmax over keys, one lane per query row; probabilities overwrite slice 0 ----
  float* probs = scores[team][0];
  score = scores_of<SCORE_MODS>(p, batch_index, head);
  const float sink = sink_log2<SCORE_MODS>(p, head);
  const Dropout<SCORE_MODS> dropout = dropout_of<SCORE_MODS>(p, batch_index, head);
  const KeyWindow window = key_window(p);
  for (int i = team_lane; i < len_q; i += G::kTeamLanes) {
    const smallseq::RowKeys keys = smallseq::row_keys(i, len_q, len_k, window);
    const int diagonal = i + len_k - len_q;  // the row's diagonal key, from which ALiBi measures
    float row_max = -infinity();
    for (int j = 0; j < len_k; ++j) {
      float s = 0.0f;
#pragma unroll
      for (int sl = 0; sl < G::kSlices; ++sl) s += scores[team][sl][j * G::kTilePad + i];
      s = keys.contains(j) ? score(s, j - diagonal) : -infinity();
      probs[j * G::kTilePad + i] = s;
      row_max = s > row_max ? s : row_max;
    }
    float row_sum = 0.0f;
    for (int j = 0; j < len_k; ++j) {
      const float e = row_max == -infinity() ? 0.0f : fast_exp2(probs[j * G::kTilePad + i] - row_max);
      probs[j * G::kTilePad + i] = e;
      row_sum += e;
    }
    // A row that sees no key (no keys at all, or none in its window) gets O = 0 and LSE = +inf (the
    // sink's logit with a sink), as in flash-attn: the backward then recomputes P = exp(S - LSE) = 0,
    // so its gradients are zero.
    const float inv_sum = row_inv_sum(row_max, row_sum, sink);
    if (dropout.active()) {
      const unsigned int kept = dropout.row_bits32(i);
      for (int j = 0; j < len_k; ++j)
        probs[j * G::kTilePad + i] *= (kept >> j & 1u) != 0 ? inv_sum * dropout.scale() : 0.0f;
    } else {
      for (int j = 0; j < len_k; ++j) probs[j * G::kTilePad + i] *= inv_sum;
    }
    float* lse = static_cast<float*>(p.lse) + batch_index * p.lse_batch_stride + head * p.lse_head_stride +
                 seq_q.start + i;
    *lse = row_lse(row_max, row_sum, sink);
  }
  __syncthreads();

  // ---- O[i] = sum_j P[j][i] v_j: each lane its own 4 columns, no communication ----
  float o[TILE][E];
#pragma unroll
  for (int i = 0; i < TILE; ++i)
#pragma unroll
    for (int x = 0; x < E; ++x) o[i][x] = 0.0f;
#pragma unroll
  for (int j = 0; j < TILE; ++j) {
    if (j < len_k) {
      float vj[E];
#pragma unroll
      for (int x = 0; x < E; ++x) vj[x] = to_float(v[j].elements[x]);
#pragma unroll
      for (int i = 0; i < TILE; ++i) {
        if (i < len_q) {
          const float pij = probs[j * G::kTilePad + i];
#pragma unroll
          for (int x = 0; x < E; ++x) o[i][x] += pij * vj[x];
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < TILE; ++i) {
    if (i < len_q) {
      T* out = smallseq::row_pointer<T>(p.o, p.o_batch_stride, p.o_token_stride, p.o_head_stride, batch_index,
                                        seq_q.start + i, head, team_lane);
      store_from_float<T, E>(out, o[i]);
    }
  }
}

}  // namespace hipattn
