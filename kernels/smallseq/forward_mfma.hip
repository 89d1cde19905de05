// Small-sequence attention forward on AMD matrix cores (gfx90a, gfx94x; wave64): the contract of
// smallseq/forward.hip (the portable kernel, which other AMD targets run) with MFMA 16x16x16.
//
// A workgroup serves one (sequence, KV head) and the stacked query rows of its group, 16 per tile
// (smallseq/mfma_tiles.h). It works in the transposed frame of flash/forward_mfma.hip: Sᵀ = K Qᵀ and
// Oᵀ = Vᵀ Pᵀ, so a lane owns one query row, column = lane % 16, from its scores to its O columns and
// its LSE; a row's max and sum take two shuffles over the four lanes that share it, and the
// accumulator of Sᵀ, rounded to T, is the B operand Pᵀ of the second product as it stands.
//
// Nothing is staged in LDS. K's fragments (A of Sᵀ: key `column`, four columns per k-step) and Q's (B:
// query `column`) are rows, read from global memory with 16-byte loads. Vᵀ's (A of Oᵀ: column
// `column` of V, four keys) are V's row fragments transposed in registers by an MFMA with the identity
// (mma_amd.h's transpose): K and Vᵀ stay in registers for every query tile of the group, and each
// tile's Q is loaded while the previous one finishes. A 17th key is a second key tile with one row:
// it costs a second set of MFMAs (Sᵀ and Oᵀ) only for sequences that have it.
//
// With WAVES > 1 the waves split head_dim and add their shares of Sᵀ through LDS (mfma_tiles.h);
// every wave then runs the same softmax and writes its own O columns, and wave 0 writes the LSE.
//
// Conventions are forward.hip's: the key window is bottom-right aligned, masked scores become -inf by
// selection, a row that sees no key gets O = 0 and LSE = +inf, rows past a sequence are not written.
// With SCORE_MODS each row's scores take softcap and its own query head's ALiBi slope
// (common/score_mods.h), its head's learnable sink joins its softmax sum (common/sink.h), and dropout
// (common/dropout.h) drops with its head's keep bits.
// What this file has not had: a run on AMD hardware. tests/test_smallseq_mfma_emulation.py runs it on
// a gfx90a emulated on the CPU against float64.
#pragma once
#include "smallseq/mfma_tiles.h"

namespace hipattn {

template <typename T, int HEAD_DIM, int HEADS, int TILE, int WAVES, bool SCORE_MODS>
__global__ void __launch_bounds__(WAVES * 64) smallseq_forward_mfma(const SmallSeqForwardMfmaParams p) {
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
  const int column = lane % 16;   // the lane's query row in a tile, and its key row in K's fragments
  const int quarter = lane / 16;  // it holds keys 4 quarter .. + 3 of each key tile
  const int first_column = wave * G::kColumns;

  // ---- K's fragments and Vᵀ's, zero past the sequence ----
  const Operand identity = mfma::shifted_identity<T>(0);
  Operand k_fragment[kKeyTiles][kSteps], vt_fragment[kKeyTiles][kSteps];
#pragma unroll
  for (int n = 0; n < kKeyTiles; ++n) {
    const int key = 16 * n + column;
    const bool in = key < len_k;
    const long long token = seq_k.start + (in ? key : 0);
    smallseq::load_row<T, kSteps>(static_cast<const T*>(p.k) + batch_index * p.k_batch_stride + token * p.k_token_stride +
                                      head_kv * p.k_head_stride + first_column,
                                  in, quarter, k_fragment[n]);
    Operand v_row[kSteps];
    smallseq::load_row<T, kSteps>(static_cast<const T*>(p.v) + batch_index * p.v_batch_stride + token * p.v_token_stride +
                                      head_kv * p.v_head_stride + first_column,
                                  in, quarter, v_row);
#pragma unroll
    for (int s = 0; s < kSteps; ++s) vt_fragment[n][s] = mfma::zero_operand();
    if (n < key_tiles) {
#pragma unroll
      for (int s = 0; s < kSteps; ++s) vt_fragment[n][s] = mfma::transpose<T>(v_row[s], identity);
    }
  }

  auto q_row = [&](const smallseq::StackedRow& r) {
    return static_cast<const T*>(p.q) + batch_index * p.q_batch_stride +
           static_cast<long long>(seq_q.start + r.token) * p.q_token_stride + r.head * p.q_head_stride + first_column;
  };
  const int first_head = head_kv * group;
  smallseq::StackedRow row = smallseq::stacked_row(column, len_q, group, first_head);
  Operand q_fragment[kSteps];
  smallseq::load_row<T, kSteps>(q_row(row), row.in, quarter, q_fragment);
  const Scores<SCORE_MODS> group_score = scores_of<SCORE_MODS>(p, batch_index, first_head);
  const Dropout<SCORE_MODS> group_dropout = dropout_of<SCORE_MODS>(p, batch_index, first_head);
  const KeyWindow window = key_window(p);

  for (int m = 0; m < query_tiles; ++m) {
    // ---- Sᵀ = K Qᵀ over the wave's columns: s[0][n][e] is S[row][16 n + 4 quarter + e] ----
    Accumulator s[1][kKeyTiles];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
      s[0][n] = mfma::zero_accumulator();
      if (n < key_tiles) {
#pragma unroll
        for (int k = 0; k < kSteps; k += 2)
          s[0][n] = mfma::mfma_two_steps<T>(k_fragment[n][k], k_fragment[n][k + 1], q_fragment[k], q_fragment[k + 1],
                                            s[0][n]);
      }
    }
    // The next tile's Q rows are on their way while this tile finishes.
    const smallseq::StackedRow next = smallseq::stacked_row(16 * (m + 1) + column, len_q, group, first_head);
    if (m + 1 < query_tiles) smallseq::load_row<T, kSteps>(q_row(next), next.in, quarter, q_fragment);
    smallseq::sum_over_waves<WAVES, 1, kKeyTiles>(exchange, m, wave, lane, s);

    // ---- softmax over the row's keys, base 2; a row's keys live in its four lanes column + 16 quarter ----
    // The row's own query head's scores (ALiBi's slope differs from row to row of a tile), measured from
    // its diagonal key.
    const Scores<SCORE_MODS> score = group_score.with_head(p, batch_index, row.head);
    const int diagonal = row.token + len_k - len_q;
    const smallseq::RowKeys keys = smallseq::row_keys(row.token, len_q, len_k, window);
    float row_max = -infinity();
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 16 * n + 4 * quarter + e;
        s[0][n][e] = keys.contains(key) ? score(s[0][n][e], key - diagonal) : -infinity();
        row_max = fmaxf(row_max, s[0][n][e]);
      }
    row_max = fmaxf(row_max, shfl_xor(row_max, 16, kWarpSize, group_mask(kWarpSize)));
    row_max = fmaxf(row_max, shfl_xor(row_max, 32, kWarpSize, group_mask(kWarpSize)));
    // A row that sees no key keeps max -inf; subtracting 0 instead makes every p 0, not NaN.
    const float reference = row_max == -infinity() ? 0.0f : row_max;
    float row_sum = 0.0f;
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[0][n][e] = fast_exp2(s[0][n][e] - reference);
        row_sum += s[0][n][e];
      }
    row_sum += shfl_xor(row_sum, 16, kWarpSize, group_mask(kWarpSize));
    row_sum += shfl_xor(row_sum, 32, kWarpSize, group_mask(kWarpSize));
    // Normalised before rounding: 8 products per lane where O would take 4 per column tile. With a
    // learnable sink (the modified kernel) the row's head's sink joins the sum (common/sink.h).
    const float sink = sink_log2<SCORE_MODS>(p, row.head);
    const float inv_sum = row_inv_sum(row_max, row_sum, sink);
    // Dropout after the sum and the LSE, with the row's head's keep bits: dropped probabilities are 0,
    // kept ones scaled, by a multiply (a select per entry costs a lane mask and grew the kernel past
    // its register budget).
    if (group_dropout.active()) {
      const Dropout<SCORE_MODS> dropout = group_dropout.with_head(p, batch_index, row.head);
      const unsigned int kept = dropout.row_bits32(row.token);
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[0][n][e] *= static_cast<float>(kept >> (16 * n + 4 * quarter + e) & 1u) * dropout.scale();
    }

    // ---- Oᵀ = Vᵀ Pᵀ: the probabilities of key tile n, rounded to T, are the B operand of k-step n ----
    Operand p_fragment[kKeyTiles];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) p_fragment[n] = mfma::to_operand<T>(s[0][n] * inv_sum);
    Accumulator o[kSteps];
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      o[k] = mfma::zero_accumulator();
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n)
        if (n < key_tiles) o[k] = mfma::mfma_16x16x16<T>(vt_fragment[n][k], p_fragment[n], o[k]);
    }

    // ---- O straight to global memory (16-byte stores), and the row's LSE from wave 0 ----
    if (row.in) {
      const long long token = seq_q.start + row.token;
      smallseq::store_row<T, kSteps>(static_cast<T*>(p.o) + batch_index * p.o_batch_stride + token * p.o_token_stride +
                                         row.head * p.o_head_stride + first_column,
                                     o, 1.0f, quarter);
      if (wave == 0 && quarter == 0) {
        static_cast<float*>(p.lse)[batch_index * p.lse_batch_stride + row.head * p.lse_head_stride + token] =
            row_lse(row_max, row_sum, sink);
      }
    }
    row = next;
  }
}

}  // namespace hipattn
