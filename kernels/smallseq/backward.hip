// Small-sequence attention backward: dQ, dK, dV from dO, Q, K, V and the forward's LSE.
//
// One team per (sequence, KV head). The team walks the query heads of its group (GQA/MQA) and sums
// their dK and dV itself, so no two teams ever write the same row: no atomics, and bit-identical
// results from run to run. Per query head, from registers and shared memory only:
//   S = Q Kᵀ and dP = dO Vᵀ (team reductions), P = exp(scale*S - LSE),
//   dZ = P * (dP - D) with D_i = sum_j P_ij dP_ij  (equal to rowsum(dO * O), so O is never read),
//   dV += Pᵀ dO,  dK += scale * dZᵀ Q,  dQ = scale * dZ K.
// With SCORE_MODS the scores take flash-attn's softcap and ALiBi (common/score_mods.h), each query head
// its own slope, and dZ also carries softcap's factor d(score)/d(scale*S). With dropout
// (common/dropout.h) the forward's keep bits are regenerated: dP becomes Z dP / (1 - dropout_p) (Z the
// bits) before D and dZ are formed from it, and dV takes the kept P / (1 - dropout_p).
#pragma once
#include "smallseq/common.h"

namespace hipattn {
namespace smallseq {

// S[j][i] (key-major) = sum over the team of a_i · b_j: the shared step of the scores and dP.
template <typename T, int HEAD_DIM, int TILE, int BLOCK_THREADS>
HIPATTN_DEVICE void team_scores(const Vec<T, kElementsPerLane> (&a)[TILE], const Vec<T, kElementsPerLane> (&b)[TILE],
                                int len_a, int len_b, int reduce_lane, float* tile) {
  using G = Geometry<HEAD_DIM, TILE, BLOCK_THREADS>;
#pragma unroll
  for (int g = 0; g < G::kGroups; ++g) {
    if (g * G::kReduceLanes < len_b * TILE) {
      float partial[G::kReduceLanes];
#pragma unroll
      for (int e = 0; e < G::kReduceLanes; ++e) {
        const int entry = g * G::kReduceLanes + e;
        const int j = entry / TILE;
        const int i = entry % TILE;
        partial[e] = 0.0f;
        if (entry < G::kEntries && i < len_a && j < len_b) {
#pragma unroll
          for (int x = 0; x < kElementsPerLane; ++x) partial[e] += to_float(a[i].elements[x]) * to_float(b[j].elements[x]);
        }
      }
      const float total = reduce_scatter<G::kReduceLanes>(partial, reduce_lane);
      const int entry = g * G::kReduceLanes + reduce_lane;
      if (entry < G::kEntries) tile[(entry / TILE) * G::kTilePad + entry % TILE] = total;
    }
  }
}

}  // namespace smallseq

// BLOCK_THREADS and LANE_ELEMENTS come from the host's row (hipattn/catalog/smallseq.py), which sizes the grid
// with them; LANE_ELEMENTS must be the layout this file is written for.
template <typename T, int HEAD_DIM, int HEADS, int TILE, int BLOCK_THREADS, int LANE_ELEMENTS, bool SCORE_MODS>
__global__ void __launch_bounds__(BLOCK_THREADS) smallseq_backward(const SmallSeqBackwardParams p) {
  static_assert(LANE_ELEMENTS == smallseq::kElementsPerLane, "each lane holds 4 elements of a row");
  using G = smallseq::Geometry<HEAD_DIM, TILE, BLOCK_THREADS>;
  using Row = Vec<T, smallseq::kElementsPerLane>;
  constexpr int E = smallseq::kElementsPerLane;

  __shared__ float scores[G::kTeamsPerBlock][G::kSlices][TILE * G::kTilePad];  // S partials, then P  [j][i]
  __shared__ float dprobs[G::kTeamsPerBlock][G::kSlices][TILE * G::kTilePad];  // dP partials, then dZ [j][i]
  __shared__ float dscores_t[G::kTeamsPerBlock][TILE * G::kTilePad];            // dZ transposed       [i][j]
  // dK and dV sums over a GQA group, [team][dk|dv][key][lane][E]; only launched with when group > 1.
  extern __shared__ float group_accum[];

  const int team = threadIdx.x / G::kTeamLanes;
  const int team_lane = threadIdx.x % G::kTeamLanes;
  const int slice = team_lane / G::kReduceLanes;
  const int reduce_lane = team_lane % G::kReduceLanes;
  const int group = HEADS / p.heads_kv;
  const long long problem = static_cast<long long>(blockIdx.x) * G::kTeamsPerBlock + team;
  const bool active = problem < static_cast<long long>(p.batch) * p.heads_kv;
  const int batch_index = active ? static_cast<int>(problem / p.heads_kv) : 0;
  const int head_kv = static_cast<int>(problem % p.heads_kv);

  // The scores' factors: the group's, set where the walk over its query heads starts, and each head's.
  // Declared ahead of the sequence bounds: declared where they are set, the plain instantiation compiled
  // to other (if equivalent) code on NVIDIA.
  Scores<SCORE_MODS> group_score, score;
  smallseq::Sequence seq_q{0, 0}, seq_k{0, 0};
  if (active) {
    seq_q = smallseq::sequence_bounds(static_cast<const int*>(p.cu_seqlens_q), static_cast<const int*>(p.seqused_q),
                                      batch_index, p.max_seqlen_q, p.total_q, TILE);
    seq_k = smallseq::sequence_bounds(static_cast<const int*>(p.cu_seqlens_k), static_cast<const int*>(p.seqused_k),
                                      batch_index, p.max_seqlen_k, p.total_k, TILE);
  }
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;

  Row k[TILE], v[TILE];
#pragma unroll
  for (int j = 0; j < TILE; ++j) {
    if (j < len_k) {
      k[j] = *reinterpret_cast<const Row*>(smallseq::row_pointer<T>(
          p.k, p.k_batch_stride, p.k_token_stride, p.k_head_stride, batch_index, seq_k.start + j, head_kv, team_lane));
      v[j] = *reinterpret_cast<const Row*>(smallseq::row_pointer<T>(
          p.v, p.v_batch_stride, p.v_token_stride, p.v_head_stride, batch_index, seq_k.start + j, head_kv, team_lane));
    }
  }

  const bool accumulate_group = group > 1;
  float* dk_accum = group_accum + (team * 2 + 0) * TILE * G::kTeamLanes * E;
  float* dv_accum = group_accum + (team * 2 + 1) * TILE * G::kTeamLanes * E;
  if (accumulate_group) {
    for (int j = 0; j < len_k; ++j)
#pragma unroll
      for (int x = 0; x < E; ++x) {
        dk_accum[(j * G::kTeamLanes + team_lane) * E + x] = 0.0f;
        dv_accum[(j * G::kTeamLanes + team_lane) * E + x] = 0.0f;
      }
  }

  const float scale = p.softmax_scale;
  // What the group's heads share; each head's own scores (its ALiBi slope) come from with_head below. Made
  // for head 0: for the group's first head, head_kv * group, the plain instantiation compiled to other (if
  // equivalent) code on AMD.
  group_score = scores_of<SCORE_MODS>(p, batch_index, 0);
  const KeyWindow window = key_window(p);
  float* probs = scores[team][0];
  float* dz = dprobs[team][0];
  float* dz_t = dscores_t[team];

  for (int group_head = 0; group_head < group; ++group_head) {
    const int head = head_kv * group + group_head;
    score = group_score.with_head(p, batch_index, head);
    const Dropout<SCORE_MODS> dropout = dropout_of<SCORE_MODS>(p, batch_index, head);
    Row q[TILE], dout[TILE];
#pragma unroll
    for (int i = 0; i < TILE; ++i) {
      if (i < len_q) {
        q[i] = *reinterpret_cast<const Row*>(smallseq::row_pointer<T>(
            p.q, p.q_batch_stride, p.q_token_stride, p.q_head_stride, batch_index, seq_q.start + i, head, team_lane));
        dout[i] = *reinterpret_cast<const Row*>(smallseq::row_pointer<T>(p.dout, p.dout_batch_stride, p.dout_token_stride,
                                                                         p.dout_head_stride, batch_index,
                                                                         seq_q.start + i, head, team_lane));
      }
    }

    smallseq::team_scores<T, HEAD_DIM, TILE, BLOCK_THREADS>(q, k, len_q, len_k, reduce_lane, scores[team][slice]);
    smallseq::team_scores<T, HEAD_DIM, TILE, BLOCK_THREADS>(dout, v, len_q, len_k, reduce_lane, dprobs[team][slice]);
    __syncthreads();

    // ---- P and dZ, one lane per query row ----
    for (int i = team_lane; i < len_q; i += G::kTeamLanes) {
      const smallseq::RowKeys keys = smallseq::row_keys(i, len_q, len_k, window);
      const int diagonal = i + len_k - len_q;  // the row's diagonal key, from which ALiBi measures
      const float lse_log2 = static_cast<const float*>(p.lse)[batch_index * p.lse_batch_stride +
                                                               head * p.lse_head_stride + seq_q.start + i] *
                             1.4426950408889634f;
      // With dropout, dP reaches only the kept entries, scaled as the forward scaled them; D = sum_j P
      // dP over them is rowsum(dO * O) of the dropped output.
      const unsigned int kept = dropout.active() ? dropout.row_bits32(i) : 0xffffffffu;
      float d_row = 0.0f;
      for (int j = 0; j < len_k; ++j) {
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int sl = 0; sl < G::kSlices; ++sl) {
          s += scores[team][sl][j * G::kTilePad + i];
          dp += dprobs[team][sl][j * G::kTilePad + i];
        }
        if (dropout.active()) dp = (kept >> j & 1u) != 0 ? dp * dropout.scale() : 0.0f;
        // LSE = +inf (a row that saw no key) gives P = 0 and so zero gradients.
        float gradient = 1.0f;  // d(score)/d(scaled dot product), dZ's factor: 1 but with softcap
        const float pij = keys.contains(j) ? fast_exp2(score(s, j - diagonal, gradient) - lse_log2) : 0.0f;
        probs[j * G::kTilePad + i] = pij;
        dz[j * G::kTilePad + i] = dp;
        // The factor waits in this row's dZᵀ entry, which only this lane writes, and only below.
        if constexpr (SCORE_MODS) dz_t[i * G::kTilePad + j] = gradient;
        d_row += pij * dp;
      }
      for (int j = 0; j < len_k; ++j) {
        const float gradient = SCORE_MODS ? dz_t[i * G::kTilePad + j] : 1.0f;
        const float pij = probs[j * G::kTilePad + i];
        const float dzij = pij * (dz[j * G::kTilePad + i] - d_row) * gradient;
        dz[j * G::kTilePad + i] = dzij;
        dz_t[i * G::kTilePad + j] = dzij;
        // dV takes the kept probabilities, scaled.
        if (dropout.active()) probs[j * G::kTilePad + i] = (kept >> j & 1u) != 0 ? pij * dropout.scale() : 0.0f;
      }
    }
    __syncthreads();

    // ---- dV_j += sum_i P_ij dO_i, dK_j += scale * sum_i dZ_ij Q_i: each lane its own columns ----
#pragma unroll
    for (int j = 0; j < TILE; ++j) {
      if (j < len_k) {
        float dv[E] = {}, dk[E] = {};
#pragma unroll
        for (int i = 0; i < TILE; ++i) {
          if (i < len_q) {
            const float pij = probs[j * G::kTilePad + i];
            const float dzij = dz[j * G::kTilePad + i];
#pragma unroll
            for (int x = 0; x < E; ++x) {
              dv[x] += pij * to_float(dout[i].elements[x]);
              dk[x] += dzij * to_float(q[i].elements[x]);
            }
          }
        }
#pragma unroll
        for (int x = 0; x < E; ++x) dk[x] *= scale;
        if (accumulate_group) {
#pragma unroll
          for (int x = 0; x < E; ++x) {
            dk_accum[(j * G::kTeamLanes + team_lane) * E + x] += dk[x];
            dv_accum[(j * G::kTeamLanes + team_lane) * E + x] += dv[x];
          }
        } else {
          store_from_float<T, E>(smallseq::row_pointer<T>(p.dk, p.dk_batch_stride, p.dk_token_stride,
                                                                          p.dk_head_stride, batch_index,
                                                                          seq_k.start + j, head_kv, team_lane),
                                 dk);
          store_from_float<T, E>(smallseq::row_pointer<T>(p.dv, p.dv_batch_stride, p.dv_token_stride,
                                                                          p.dv_head_stride, batch_index,
                                                                          seq_k.start + j, head_kv, team_lane),
                                 dv);
        }
      }
    }

    // ---- dQ_i = scale * sum_j dZ_ij K_j ----
#pragma unroll
    for (int i = 0; i < TILE; ++i) {
      if (i < len_q) {
        float dq[E] = {};
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
          if (j < len_k) {
            const float dzij = dz_t[i * G::kTilePad + j];
#pragma unroll
            for (int x = 0; x < E; ++x) dq[x] += dzij * to_float(k[j].elements[x]);
          }
        }
#pragma unroll
        for (int x = 0; x < E; ++x) dq[x] *= scale;
        store_from_float<T, E>(smallseq::row_pointer<T>(p.dq, p.dq_batch_stride, p.dq_token_stride,
                                                                        p.dq_head_stride, batch_index,
                                                                        seq_q.start + i, head, team_lane),
                               dq);
      }
    }
    __syncthreads();  // the next query head overwrites the score tiles
  }

  if (accumulate_group) {
    for (int j = 0; j < len_k; ++j) {
      float dk[E], dv[E];
#pragma unroll
      for (int x = 0; x < E; ++x) {
        dk[x] = dk_accum[(j * G::kTeamLanes + team_lane) * E + x];
        dv[x] = dv_accum[(j * G::kTeamLanes + team_lane) * E + x];
      }
      store_from_float<T, E>(smallseq::row_pointer<T>(p.dk, p.dk_batch_stride, p.dk_token_stride,
                                                                      p.dk_head_stride, batch_index, seq_k.start + j,
                                                                      head_kv, team_lane),
                             dk);
      store_from_float<T, E>(smallseq::row_pointer<T>(p.dv, p.dv_batch_stride, p.dv_token_stride,
                                                                      p.dv_head_stride, batch_index, seq_k.start + j,
                                                                      head_kv, team_lane),
                             dv);
    }
  }
}

}  // namespace hipattn
