// Small-sequence attention backward on AMD matrix cores (gfx90a, gfx94x; wave64): dQ, dK, dV from dO,
// Q, K, V and the forward's LSE, the contract of smallseq/backward.hip with MFMA 16x16x16.
//
// A workgroup serves one (sequence, KV head) and walks the stacked query rows of its group, 16 per
// tile (smallseq/mfma_tiles.h); its waves split head_dim, 64 columns each, so a wave's registers are
// the same at every head_dim. dK and dV accumulate in registers over the whole group, tile after tile
// in a fixed order, and are written once: no atomics, and the same bits on every run. Per tile, in the
// transposed frame of flash/backward_mfma.hip (a lane owns query `column`, keys 4 quarter .. + 3):
//   Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (K, V fragments in registers; Q, dO rows from global memory), summed
//     over the waves through LDS;
//   Pᵀ = exp(scale Sᵀ - LSE), D = rowsum(P dP) (= rowsum(dO O), so O is never read; two shuffles),
//     dSᵀ = Pᵀ (dPᵀ - D); with SCORE_MODS the scores are common/score_mods.h's, softcap and the row's
//     own query head's ALiBi slope, and dSᵀ carries softcap's factor d(score)/d(scale S); with dropout
//     (common/dropout.h) dPᵀ is first Z dPᵀ / (1 - dropout_p), Z the row's head's keep bits, and P
//     to dV is kept and scaled alike;
//   dQᵀ = Kᵀ dSᵀ: the accumulator of dSᵀ, rounded to T, is the B operand as it stands;
//   dVᵀ += dOᵀ P and dKᵀ += Qᵀ dS, which contract over the tile's queries: their operands are Q's,
//     dO's, P's and dS's fragments transposed in registers by an MFMA with the identity
//     (mma_amd.h's transpose), so nothing but the partial scores goes through LDS.
// Key 16, the only row of the second key tile, would need a second set of dK and dV accumulators of
// which one column is real. Its dV and dK share one instead: P's transpose puts key 16 in column 0,
// dS's, shifted by one, in column 1, and the two products add into the same accumulator.
//
// What this file has not had: a run on AMD hardware. tests/test_smallseq_mfma_emulation.py runs it on
// a gfx90a emulated on the CPU against float64.
#pragma once
#include "smallseq/mfma_tiles.h"

namespace hipattn {

template <typename T, int HEAD_DIM, int HEADS, int TILE, int WAVES, bool SCORE_MODS>
__global__ void __launch_bounds__(WAVES * 64) smallseq_backward_mfma(const SmallSeqBackwardMfmaParams p) {
  using G = smallseq::MfmaGeometry<HEAD_DIM, TILE, WAVES>;
  static_assert(kWarpSize == 64, "the MFMA layouts of mma_amd.h are wave64's");
  constexpr int kSteps = G::kSteps;
  static_assert(kSteps % 2 == 0, "k-steps run in pairs (mma_amd.h mfma_two_steps)");
  constexpr int kKeyTiles = G::kKeyTiles;
  using mfma::Accumulator;
  using mfma::Operand;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  float* const exchange = reinterpret_cast<float*>(shared_bytes);

  // ---- the block's (sequence, KV head), and this lane's place in it ----
  const int group = HEADS / p.heads_kv;
  const int batch_index = static_cast<int>(blockIdx.x) / p.heads_kv;
  const int head_kv = static_cast<int>(blockIdx.x) % p.heads_kv;
  const Sequence seq_q = query_sequence(p, batch_index, TILE);
  const Sequence seq_k = key_sequence(p, batch_index, TILE);
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;
  const int key_tiles = (len_k + 15) / 16;
  const int query_tiles = (group * len_q + 15) / 16;
  const int wave = static_cast<int>(threadIdx.x) / 64;
  const int lane = static_cast<int>(threadIdx.x) % 64;
  const int column = lane % 16;
  const int quarter = lane / 16;
  const int first_column = wave * G::kColumns;

  // ---- K's and V's fragments (A of Sᵀ and dPᵀ: key 16 n + column), and Kᵀ's (A of dQᵀ: column
  // column(s, column / 4, column % 4), keys 16 n + 4 quarter .. + 3) ----
  const Operand identity = mfma::shifted_identity<T>(0);
  const Operand shifted = mfma::shifted_identity<T>(1);
  Operand k_fragment[kKeyTiles][kSteps], v_fragment[kKeyTiles][kSteps], kt_fragment[kKeyTiles][kSteps];
#pragma unroll
  for (int n = 0; n < kKeyTiles; ++n) {
    const int key = 16 * n + column;
    const bool in = key < len_k;
    const long long token = seq_k.start + (in ? key : 0);
    smallseq::load_row<T, kSteps>(static_cast<const T*>(p.k) + batch_index * p.k_batch_stride + token * p.k_token_stride +
                                      head_kv * p.k_head_stride + first_column,
                                  in, quarter, k_fragment[n]);
    smallseq::load_row<T, kSteps>(static_cast<const T*>(p.v) + batch_index * p.v_batch_stride + token * p.v_token_stride +
                                      head_kv * p.v_head_stride + first_column,
                                  in, quarter, v_fragment[n]);
#pragma unroll
    for (int s = 0; s < kSteps; ++s) kt_fragment[n][s] = mfma::zero_operand();
    if (n < key_tiles) {
#pragma unroll
      for (int s = 0; s < kSteps; ++s) kt_fragment[n][s] = mfma::transpose<T>(k_fragment[n][s], identity);
    }
  }

  // dKᵀ and dVᵀ of keys 0..15 (lane: key `column`, columns column(s, quarter, e)); key 16's dV in
  // column 0 and dK in column 1 of `last`. dK is scaled once, at the end.
  Accumulator dk[kSteps], dv[kSteps], last[kSteps];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) dk[s] = dv[s] = last[s] = mfma::zero_accumulator();

  // The sequence's first row of each per-row tensor, at the wave's columns: rows are then one product
  // per stride away, and the batch strides are not held through the loop.
  const long long first_row = static_cast<long long>(seq_q.start);
  const T* const q_rows = static_cast<const T*>(p.q) + batch_index * p.q_batch_stride + first_row * p.q_token_stride +
                          first_column;
  const T* const dout_rows = static_cast<const T*>(p.dout) + batch_index * p.dout_batch_stride +
                             first_row * p.dout_token_stride + first_column;
  T* const dq_rows = static_cast<T*>(p.dq) + batch_index * p.dq_batch_stride + first_row * p.dq_token_stride + first_column;
  const float* const lse_rows = static_cast<const float*>(p.lse) + batch_index * p.lse_batch_stride + first_row;
  auto row_offset = [&](const smallseq::StackedRow& r, long long token_stride, long long head_stride) {
    return r.token * token_stride + r.head * head_stride;
  };
  auto load_query_rows = [&](const smallseq::StackedRow& r, Operand(&q)[kSteps], Operand(&dout)[kSteps]) {
    smallseq::load_row<T, kSteps>(q_rows + row_offset(r, p.q_token_stride, p.q_head_stride), r.in, quarter, q);
    smallseq::load_row<T, kSteps>(dout_rows + row_offset(r, p.dout_token_stride, p.dout_head_stride), r.in, quarter,
                                  dout);
  };
  const int first_head = head_kv * group;
  smallseq::StackedRow row = smallseq::stacked_row(column, len_q, group, first_head);
  Operand q_fragment[kSteps], do_fragment[kSteps];
  load_query_rows(row, q_fragment, do_fragment);
  const Scores<SCORE_MODS> group_score = scores_of<SCORE_MODS>(p, batch_index, first_head);
  const Dropout<SCORE_MODS> group_dropout = dropout_of<SCORE_MODS>(p, batch_index, first_head);
  const KeyWindow window = key_window(p);

  for (int m = 0; m < query_tiles; ++m) {
    // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ over the wave's columns: sd[0] is Sᵀ, sd[1] dPᵀ ----
    Accumulator sd[2][kKeyTiles];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      sd[0][n] = sd[1][n] = mfma::zero_accumulator();
      if (n < key_tiles) {
#pragma unroll
        for (int k = 0; k < kSteps; k += 2) {
          sd[0][n] = mfma::mfma_two_steps<T>(k_fragment[n][k], k_fragment[n][k + 1], q_fragment[k], q_fragment[k + 1],
                                             sd[0][n]);
          sd[1][n] = mfma::mfma_two_steps<T>(v_fragment[n][k], v_fragment[n][k + 1], do_fragment[k],
                                             do_fragment[k + 1], sd[1][n]);
        }
      }
    }
    smallseq::sum_over_waves<WAVES, 2, kKeyTiles>(exchange, m, wave, lane, sd);

    // ---- Pᵀ = exp(scale Sᵀ - LSE) on the row's visible keys, D = rowsum(P dP), dSᵀ = Pᵀ (dPᵀ - D) ----
    // LSE = +inf (a row that saw no key) gives P = 0 and so zero gradients.
    const float lse_log2 = row.in ? lse_rows[row.head * p.lse_head_stride + row.token] * kLog2e : 0.0f;
    const smallseq::RowKeys keys =
        row.in ? smallseq::row_keys(row.token, len_q, len_k, window) : smallseq::RowKeys{0, 0};
    // The row's own query head's scores (ALiBi's slope differs from row to row of a tile), measured from
    // its diagonal key.
    const Scores<SCORE_MODS> score = group_score.with_head(p, batch_index, row.head);
    const int diagonal = row.token + len_k - len_q;
    Accumulator probs[kKeyTiles], dscores[kKeyTiles];
    float gradient[kKeyTiles][4];  // d(score)/d(scaled S), dSᵀ's factor: 1 but with softcap
    // With dropout, the row's head's keep bits: dP reaches only the kept entries, scaled as the forward
    // scaled them, and dV takes the kept probabilities, scaled. Each entry's factor is a multiply, not
    // a select: selects on the bits kept a 64-bit lane mask per entry in scalar registers, past the
    // 102 a wave has.
    const Dropout<SCORE_MODS> dropout = group_dropout.with_head(p, batch_index, row.head);
    float keep[kKeyTiles][4];  // the entry's 1 / (1 - dropout_p), or 0 where it was dropped; 1 without dropout
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) keep[n][e] = 1.0f;
    if (dropout.active()) {
      const unsigned int kept = dropout.row_bits32(row.token);
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          keep[n][e] = static_cast<float>(kept >> (16 * n + 4 * quarter + e) & 1u) * dropout.scale();
    }
    float d_row = 0.0f;
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 16 * n + 4 * quarter + e;
        gradient[n][e] = 1.0f;
        probs[n][e] =
            keys.contains(key) ? fast_exp2(score(sd[0][n][e], key - diagonal, gradient[n][e]) - lse_log2) : 0.0f;
        if (SCORE_MODS) sd[1][n][e] *= keep[n][e];
        d_row += probs[n][e] * sd[1][n][e];
      }
    d_row += shfl_xor(d_row, 16, kWarpSize, group_mask(kWarpSize));
    d_row += shfl_xor(d_row, 32, kWarpSize, group_mask(kWarpSize));
    Operand p_operand[kKeyTiles], ds_operand[kKeyTiles];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dscores[n][e] = probs[n][e] * (sd[1][n][e] - d_row) * gradient[n][e];
        if (SCORE_MODS) probs[n][e] *= keep[n][e];
      }
      p_operand[n] = mfma::to_operand<T>(probs[n]);
      ds_operand[n] = mfma::to_operand<T>(dscores[n]);
    }

    // ---- dQᵀ = Kᵀ dSᵀ, scaled, straight to global memory ----
    Accumulator dq[kSteps];
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      dq[k] = mfma::zero_accumulator();
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
        if (n < key_tiles) dq[k] = mfma::mfma_16x16x16<T>(kt_fragment[n][k], ds_operand[n], dq[k]);
    }
    if (row.in) {
      smallseq::store_row<T, kSteps>(dq_rows + row_offset(row, p.dq_token_stride, p.dq_head_stride), dq,
                                     p.softmax_scale, quarter);
    }

    // Qᵀ and dOᵀ (A of dKᵀ and dVᵀ: column column(s, column / 4, column % 4), queries 4 quarter .. + 3);
    // then the next tile's rows are on their way while this tile finishes. Transposed here, not right
    // after Sᵀ and dPᵀ, so that neither they nor the next rows are live through the softmax: that
    // keeps a wave within 256 registers (two waves per SIMD).
    Operand qt_fragment[kSteps], dot_fragment[kSteps];
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      qt_fragment[k] = mfma::transpose<T>(q_fragment[k], identity);
      dot_fragment[k] = mfma::transpose<T>(do_fragment[k], identity);
    }
    const smallseq::StackedRow next = smallseq::stacked_row(16 * (m + 1) + column, len_q, group, first_head);
    if (m + 1 < query_tiles) load_query_rows(next, q_fragment, do_fragment);

    // ---- dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS: B is P and dS with keys as columns (key `column`, 4 queries) ----
    if (key_tiles > 0) {
      const Operand p_b = mfma::transpose<T>(p_operand[0], identity);
      const Operand ds_b = mfma::transpose<T>(ds_operand[0], identity);
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        dv[k] = mfma::mfma_16x16x16<T>(dot_fragment[k], p_b, dv[k]);
        dk[k] = mfma::mfma_16x16x16<T>(qt_fragment[k], ds_b, dk[k]);
      }
    }
    if constexpr (kKeyTiles > 1) {
      if (key_tiles > 1) {
        // Keys past 16 have P = dS = 0, so column 0 of P's transpose is key 16's alone, and column 1
        // of dS's shifted transpose.
        const Operand p_b = mfma::transpose<T>(p_operand[1], identity);
        const Operand ds_b = mfma::transpose<T>(ds_operand[1], shifted);
#pragma unroll
        for (int k = 0; k < kSteps; ++k) {
          last[k] = mfma::mfma_16x16x16<T>(dot_fragment[k], p_b, last[k]);
          last[k] = mfma::mfma_16x16x16<T>(qt_fragment[k], ds_b, last[k]);
        }
      }
    }
    row = next;
  }

  // ---- dK and dV of the wave's columns, once per (sequence, KV head); zeros for keys no query sees ----
  auto key_offset = [&](int key, long long batch_stride, long long token_stride, long long head_stride) {
    return batch_index * batch_stride + static_cast<long long>(seq_k.start + key) * token_stride +
           head_kv * head_stride + first_column;
  };
  if (column < len_k) {
    smallseq::store_row<T, kSteps>(
        static_cast<T*>(p.dk) + key_offset(column, p.dk_batch_stride, p.dk_token_stride, p.dk_head_stride), dk,
        p.softmax_scale, quarter);
    smallseq::store_row<T, kSteps>(
        static_cast<T*>(p.dv) + key_offset(column, p.dv_batch_stride, p.dv_token_stride, p.dv_head_stride), dv, 1.0f,
        quarter);
  }
  if (kKeyTiles > 1 && len_k > 16) {
    if (column == 0) {
      smallseq::store_row<T, kSteps>(
          static_cast<T*>(p.dv) + key_offset(16, p.dv_batch_stride, p.dv_token_stride, p.dv_head_stride), last, 1.0f,
          quarter);
    } else if (column == 1) {
      smallseq::store_row<T, kSteps>(
          static_cast<T*>(p.dk) + key_offset(16, p.dk_batch_stride, p.dk_token_stride, p.dk_head_stride), last,
          p.softmax_scale, quarter);
    }
  }
}

}  // namespace hipattn
