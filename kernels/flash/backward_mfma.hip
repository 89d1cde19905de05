// General attention backward on AMD matrix cores (gfx90a, gfx94x; wave64): FlashAttention-2's two
// kernels with MFMA 16x16x16, the counterpart of backward_mma.hip. Its grids, work list, schedules
// (atomic dQ into dq_accum, or the deterministic dQ kernel) and conventions are backward_mma.hip's;
// P = exp(score(S) - LSE) is recomputed from the forward's LSE (common/score_mods.h's scores, with any
// softcap and ALiBi) and dS = P (dP - Delta) score'(S) uses Delta = rowsum(dO * O) (bwd_dot_do_o.hip)
// and the scores' gradient factor (1 but with softcap).
//
// Both kernels work in the transposed frame of forward_mfma.hip, keys as rows: with the 16x16x16
// layouts (common/mma_amd.h) a lane of Sᵀ = K Qᵀ owns one query, column = lane % 16, and keys
// 4 quarter .. 4 quarter + 3, so its LSE and Delta are one value each; and the accumulator of dSᵀ is,
// rounded to T, the B operand of dQᵀ = Kᵀ dSᵀ with no data movement between lanes.
//
// flash_backward_dkdv_mfma: one block per (key tile of BLOCK_N keys, sequence, KV head), one wave per
// 16 of its keys, whose K and V fragments stay in registers; dKᵀ and dVᵀ accumulate in registers
// while the block walks every 16-row query tile (of every query head of the group) that sees its
// keys. dVᵀ += dOᵀ P and dKᵀ += Qᵀ dS contract over the tile's queries, so they take Pᵀ and dSᵀ
// through LDS (a lane holds four keys of one query; the B operand wants four queries of one key) and
// Qᵀ, dOᵀ staged transposed in LDS by the block. With WRITE_DQ each wave adds its keys' share of dQ
// into dq_accum with atomics (convert_dq scales it).
//
// flash_backward_dq_mfma: the deterministic dQ, one block per (BLOCK_M query rows, sequence, query
// head), one wave per 16 rows, walking the 16-key tiles its rows see, with no LDS at all: Q and dO
// fragments in registers, K and V fragments from global memory (Kᵀ's, four keys of one column, as
// four 16-bit loads).
//
// What this file has not had: a run on AMD hardware (there is none here). tests/test_amd_emulation.py
// runs both kernels on a gfx90a emulated on the CPU against float64; their speed is unmeasured.
#pragma once
#include "common/dropout.h"
#include "common/mma_amd.h"
#include "common/score_mods.h"
#include "common/sequence.h"
#include "flash/backward_common.h"

namespace hipattn {
namespace flash {

// LDS of a dK/dV block, in elements of T: Qᵀ and dOᵀ of the query tile (HEAD_DIM rows of 16
// queries each), then each wave's Pᵀ and dSᵀ (16 keys of 16 queries each). Rows are padded by 4
// elements (8 bytes), as forward_mfma.hip's tiles, so that 16 lanes reading 8 bytes of 16 rows hit
// distinct banks. The host's row (hipattn/catalog/flash_backward.py, FlashDkdvMfmaTiles.shared_bytes)
// computes kBytes.
template <typename T, int HEAD_DIM, int BLOCK_N>
struct MfmaKeyBlockTiles {
  static constexpr int kWaves = BLOCK_N / mfma::kTile;
  static constexpr int kThreads = kWaves * 64;
  static constexpr int kPitch = mfma::kTile + 4;
  static constexpr int kQueryElements = HEAD_DIM * kPitch;      // Qᵀ or dOᵀ
  static constexpr int kScoreElements = mfma::kTile * kPitch;  // one wave's Pᵀ or dSᵀ
  static constexpr int kQOffset = 0;
  static constexpr int kDoOffset = kQueryElements;
  static constexpr int kScoresOffset = 2 * kQueryElements;
  static constexpr int kElements = kScoresOffset + kWaves * 2 * kScoreElements;
  static constexpr int kBytes = kElements * static_cast<int>(sizeof(T));

  static_assert(sizeof(T) == 2, "the matrix-core path takes 16-bit inputs");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim is a multiple of 16 up to 256");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16 && BLOCK_N <= 256, "one wave per 16 keys, at most 16 waves");
  static_assert(kBytes <= 64 * 1024, "the tiles must fit 64 KiB of LDS");
};

// Which of a sequence's keys query `query` sees (common/key_window.h's window).
HIPATTN_DEVICE bool key_visible_to(int query, int key, int len_q, int len_k, int diagonal, KeyWindow window) {
  return query < len_q && key < len_k && key_in_window(query, key, diagonal, window);
}

// The forward's LSE (base 2) and Delta of one query row: the lane's, in both kernels' frame.
struct RowStatistics {
  float lse_log2;
  float delta;
};

// Row `token` of query head `head`; a row outside the sequence (`in` false) reads nothing, and its
// probabilities are 0 by key_visible_to.
HIPATTN_DEVICE RowStatistics row_statistics(const FlashBackwardParams& p, int batch_index, int head, long long token,
                                            bool in) {
  if (!in) return {0.0f, 0.0f};
  return {static_cast<const float*>(p.lse)[batch_index * p.lse_batch_stride + head * p.lse_head_stride + token] *
              kLog2e,
          static_cast<const float*>(p.softmax_d)[batch_index * p.softmax_d_batch_stride +
                                                 head * p.softmax_d_head_stride + token]};
}

// A lane's Sᵀ and dPᵀ (query `query`, keys first_key .. first_key + 3) into dV's probabilities Pᵀ in
// place, and dSᵀ = P (dPᵀ - Delta) score'(Sᵀ), returned, with P = exp(score(Sᵀ) - LSE): `scores`
// (common/score_mods.h) is softmax_scale·log2 e and any score modifiers, score' its gradient factor (1
// but with softcap). With dropout (common/dropout.h), Pᵀ keeps the kept entries times 1 / (1 -
// dropout_p) and dPᵀ reaches dS only through them, scaled alike. LSE = +inf (a row that saw no key)
// gives P = 0.
template <typename Scores, typename Dropout>
HIPATTN_DEVICE mfma::Accumulator probabilities_and_dscores(mfma::Accumulator& s, const mfma::Accumulator& dp,
                                                           int query, int first_key, int len_q, int len_k,
                                                           int diagonal, KeyWindow window, const Scores& scores,
                                                           const Dropout& dropout, RowStatistics row) {
  const unsigned int kept = dropout.active() ? dropout.keep_run4(query, first_key) : 0xfu;
  mfma::Accumulator ds;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int key = first_key + e;
    float gradient = 1.0f;  // d(score)/d(scaled dot product), dS's factor: 1 but with softcap
    const float probability = key_visible_to(query, key, len_q, len_k, diagonal, window)
                                  ? fast_exp2(scores(s[e], key - query - diagonal, gradient) - row.lse_log2)
                                  : 0.0f;
    const bool keep = (kept >> e & 1u) != 0;
    s[e] = keep ? probability * dropout.scale() : 0.0f;
    const float dp_kept = keep ? dp[e] * dropout.scale() : 0.0f;
    ds[e] = probability * (dp_kept - row.delta) * gradient;
  }
  return ds;
}

// Four consecutive elements of a gradient row: an accumulator times `scale`, rounded to T.
template <typename T>
HIPATTN_DEVICE void store_scaled(T* destination, const mfma::Accumulator& x, float scale) {
  mfma::Accumulator scaled;
#pragma unroll
  for (int e = 0; e < 4; ++e) scaled[e] = x[e] * scale;
  mfma::store_operand(destination, mfma::to_operand<T>(scaled));
}

// Four 16-bit elements `stride` apart, as one operand (Kᵀ's fragment: four keys of one column).
template <typename T>
HIPATTN_DEVICE mfma::Operand gather_operand(const T* first, long long stride, int count) {
  mfma::Operand x = mfma::zero_operand();
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (e < count) x[e] = static_cast<short>(first[e * stride].bits);
  return x;
}

}  // namespace flash

template <typename T, int HEAD_DIM, int BLOCK_N, bool WRITE_DQ, bool SCORE_MODS>
__global__ void __launch_bounds__(BLOCK_N / 16 * 64) flash_backward_dkdv_mfma(const FlashBackwardParams p) {
  using Tiles = flash::MfmaKeyBlockTiles<T, HEAD_DIM, BLOCK_N>;
  static_assert(kWarpSize == 64, "the MFMA layouts of mma_amd.h are wave64's");
  static_assert(Tiles::kThreads == BLOCK_N / 16 * 64, "__launch_bounds__ above is Tiles::kThreads");
  constexpr int kThreads = Tiles::kThreads;
  constexpr int kDSteps = HEAD_DIM / 16;  // k-steps of Sᵀ and dPᵀ; 16-column tiles of dKᵀ, dVᵀ, dQᵀ
  static_assert(kDSteps % 2 == 0, "k-steps run in pairs (mma_amd.h mfma_two_steps)");
  constexpr int kQueries = mfma::kTile;   // rows of a query tile
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);

  const flash::KeyBlock block = flash::key_block_of<BLOCK_N, HEAD_DIM>(blockIdx.x, p);
  if (block.batch_index < 0) return;  // past the work list's last key block; before any barrier
  const int batch_index = block.batch_index;
  const Sequence seq_q = query_sequence(p, batch_index, p.max_seqlen_q);
  const Sequence seq_k = key_sequence(p, batch_index, p.max_seqlen_k);
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;
  const int n0 = block.n_block * BLOCK_N;
  if (n0 >= len_k) return;  // uniform over the block, before any barrier

  const int diagonal = len_k - len_q;
  const KeyWindow window = key_window(p);
  const int keys = len_k - n0 < BLOCK_N ? len_k - n0 : BLOCK_N;
  const flash::QueryTiles seeing = flash::query_tiles_seeing<kQueries>(n0, keys, len_q, diagonal, window);
  const int group = p.heads_q / p.heads_kv;
  const int first_head = block.head_kv * group;
  const int tiles = group * seeing.count;  // zero: no query sees these keys, and dK = dV = 0 is written

  const int wave = threadIdx.x / 64;
  const int lane = threadIdx.x % 64;
  const int column = lane % mfma::kTile;
  const int quarter = lane / mfma::kTile;
  const int wave_key0 = n0 + 16 * wave;  // the wave's first key in the sequence
  T* const qt_tile = shared + Tiles::kQOffset;
  T* const dot_tile = shared + Tiles::kDoOffset;
  T* const pt_tile = shared + Tiles::kScoresOffset + wave * 2 * Tiles::kScoreElements;
  T* const dst_tile = pt_tile + Tiles::kScoreElements;

  // The wave's K and V fragments (A of Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: key `column`, four columns per
  // k-step), zero past the sequence; and, for dQᵀ = Kᵀ dSᵀ, Kᵀ's (column `column` of each 16-column
  // tile, keys 4 quarter .. 4 quarter + 3).
  const long long key_token = seq_k.start + wave_key0;
  const T* const k_rows = static_cast<const T*>(p.k) + batch_index * p.k_batch_stride +
                          key_token * p.k_token_stride + block.head_kv * p.k_head_stride;
  const T* const v_rows = static_cast<const T*>(p.v) + batch_index * p.v_batch_stride +
                          key_token * p.v_token_stride + block.head_kv * p.v_head_stride;
  const bool key_in = wave_key0 + column < len_k;
  mfma::Operand k_fragment[kDSteps], v_fragment[kDSteps], kt_fragment[kDSteps];
#pragma unroll
  for (int d = 0; d < kDSteps; ++d) {
    k_fragment[d] = key_in ? mfma::load_operand(k_rows + column * p.k_token_stride + 16 * d + 4 * quarter)
                           : mfma::zero_operand();
    v_fragment[d] = key_in ? mfma::load_operand(v_rows + column * p.v_token_stride + 16 * d + 4 * quarter)
                           : mfma::zero_operand();
    const int keys_here = len_k - (wave_key0 + 4 * quarter);
    kt_fragment[d] = WRITE_DQ ? flash::gather_operand(k_rows + 4 * quarter * p.k_token_stride + 16 * d + column,
                                                      p.k_token_stride, keys_here)
                              : mfma::zero_operand();
  }

  mfma::Accumulator dk[kDSteps], dv[kDSteps];  // dKᵀ, dVᵀ: column d0 + 4 quarter + e of key `column`
#pragma unroll
  for (int d = 0; d < kDSteps; ++d) dk[d] = dv[d] = mfma::zero_accumulator();
  const Scores<SCORE_MODS> block_scores = scores_of<SCORE_MODS>(p, batch_index, first_head);
  const Dropout<SCORE_MODS> block_dropout = dropout_of<SCORE_MODS>(p, batch_index, first_head);

  for (int i = 0; i < tiles; ++i) {
    const int head = first_head + i / seeing.count;
    const int m0 = (seeing.first + i % seeing.count) * kQueries;
    const long long token = seq_q.start + m0;
    const T* const q_rows = static_cast<const T*>(p.q) + batch_index * p.q_batch_stride + token * p.q_token_stride +
                            head * p.q_head_stride;
    const T* const do_rows = static_cast<const T*>(p.dout) + batch_index * p.dout_batch_stride +
                             token * p.dout_token_stride + head * p.dout_head_stride;
    const Scores<SCORE_MODS> scores = block_scores.with_head(p, batch_index, head);
    const Dropout<SCORE_MODS> dropout = block_dropout.with_head(p, batch_index, head);

    // ---- Qᵀ and dOᵀ of the tile into LDS, zero past the sequence (they meet P = dS = 0 there) ----
    __syncthreads();  // every wave is done with the previous tile's
    for (int x = threadIdx.x; x < kQueries * HEAD_DIM; x += kThreads) {
      const int row = x / HEAD_DIM;
      const int col = x % HEAD_DIM;
      const bool in = m0 + row < len_q;
      qt_tile[col * Tiles::kPitch + row] = in ? q_rows[row * p.q_token_stride + col] : T{0};
      dot_tile[col * Tiles::kPitch + row] = in ? do_rows[row * p.dout_token_stride + col] : T{0};
    }

    // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: B is query `column`'s row, four columns per k-step ----
    const int query = m0 + column;
    const bool query_in = query < len_q;
    mfma::Accumulator s = mfma::zero_accumulator(), dp = mfma::zero_accumulator();
#pragma unroll
    for (int d = 0; d < kDSteps; d += 2) {
      const T* q_row = q_rows + column * p.q_token_stride + 4 * quarter;
      const T* do_row = do_rows + column * p.dout_token_stride + 4 * quarter;
      const mfma::Operand q0 = query_in ? mfma::load_operand(q_row + 16 * d) : mfma::zero_operand();
      const mfma::Operand q1 = query_in ? mfma::load_operand(q_row + 16 * (d + 1)) : mfma::zero_operand();
      const mfma::Operand do0 = query_in ? mfma::load_operand(do_row + 16 * d) : mfma::zero_operand();
      const mfma::Operand do1 = query_in ? mfma::load_operand(do_row + 16 * (d + 1)) : mfma::zero_operand();
      s = mfma::mfma_two_steps<T>(k_fragment[d], k_fragment[d + 1], q0, q1, s);
      dp = mfma::mfma_two_steps<T>(v_fragment[d], v_fragment[d + 1], do0, do1, dp);
    }

    // ---- Pᵀ = exp(score(Sᵀ) - LSE), dSᵀ = Pᵀ (dPᵀ - Delta) score'(Sᵀ): the lane's query, four keys ----
    const long long row_token = seq_q.start + (query_in ? query : 0);
    const mfma::Accumulator ds = flash::probabilities_and_dscores(
        s, dp, query, wave_key0 + 4 * quarter, len_q, len_k, diagonal, window, scores, dropout,
        flash::row_statistics(p, batch_index, head, row_token, query_in));
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      pt_tile[(4 * quarter + e) * Tiles::kPitch + column] = from_float<T>(s[e]);
      dst_tile[(4 * quarter + e) * Tiles::kPitch + column] = from_float<T>(ds[e]);
    }
    __syncthreads();  // Qᵀ, dOᵀ, and the wave's Pᵀ and dSᵀ are in LDS

    // ---- dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS: B is key `column`'s four queries from Pᵀ and dSᵀ ----
    const mfma::Operand p_b = mfma::load_operand(pt_tile + column * Tiles::kPitch + 4 * quarter);
    const mfma::Operand ds_b = mfma::load_operand(dst_tile + column * Tiles::kPitch + 4 * quarter);
#pragma unroll
    for (int d = 0; d < kDSteps; ++d) {
      const int row = 16 * d + column;
      dv[d] = mfma::mfma_16x16x16<T>(mfma::load_operand(dot_tile + row * Tiles::kPitch + 4 * quarter), p_b, dv[d]);
      dk[d] = mfma::mfma_16x16x16<T>(mfma::load_operand(qt_tile + row * Tiles::kPitch + 4 * quarter), ds_b, dk[d]);
    }

    // ---- dQᵀ += Kᵀ dSᵀ over the wave's keys, added into dq_accum (query `column`, 4 columns) ----
    if (WRITE_DQ) {
      const mfma::Operand ds_operand = mfma::to_operand<T>(ds);
      float* const dq_row = static_cast<float*>(p.dq_accum) + batch_index * p.dq_accum_batch_stride +
                            row_token * p.dq_accum_token_stride + head * p.dq_accum_head_stride;
#pragma unroll
      for (int d = 0; d < kDSteps; ++d) {
        const mfma::Accumulator dq = mfma::mfma_16x16x16<T>(kt_fragment[d], ds_operand, mfma::zero_accumulator());
        if (query_in)
#pragma unroll
          for (int e = 0; e < 4; ++e) atomic_add(dq_row + 16 * d + 4 * quarter + e, dq[e]);
      }
    }
  }

  // ---- dK = scale dSᵀ Q and dV: key `column`'s columns 16 d + 4 quarter .. + 3, one 8-byte store each ----
  if (key_in) {
    T* const dk_row = static_cast<T*>(p.dk) + batch_index * p.dk_batch_stride +
                      (key_token + column) * p.dk_token_stride + block.head_kv * p.dk_head_stride;
    T* const dv_row = static_cast<T*>(p.dv) + batch_index * p.dv_batch_stride +
                      (key_token + column) * p.dv_token_stride + block.head_kv * p.dv_head_stride;
#pragma unroll
    for (int d = 0; d < kDSteps; ++d) {
      flash::store_scaled(dk_row + 16 * d + 4 * quarter, dk[d], p.softmax_scale);
      mfma::store_operand(dv_row + 16 * d + 4 * quarter, mfma::to_operand<T>(dv[d]));
    }
  }
}

template <typename T, int HEAD_DIM, int BLOCK_M, bool SCORE_MODS>
__global__ void __launch_bounds__(BLOCK_M / 16 * 64) flash_backward_dq_mfma(const FlashBackwardParams p) {
  static_assert(kWarpSize == 64, "the MFMA layouts of mma_amd.h are wave64's");
  static_assert(sizeof(T) == 2, "the matrix-core path takes 16-bit inputs");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim is a multiple of 16 up to 256");
  static_assert(BLOCK_M % 16 == 0 && BLOCK_M >= 16 && BLOCK_M <= 256, "one wave per 16 query rows, at most 16");
  constexpr int kDSteps = HEAD_DIM / 16;
  static_assert(kDSteps % 2 == 0, "k-steps run in pairs (mma_amd.h mfma_two_steps)");
  constexpr int kKeys = mfma::kTile;  // keys per step

  const int m_blocks = (p.max_seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const flash::QueryBlock block = flash::query_block_of(blockIdx.x, m_blocks, p.heads_q);
  const int batch_index = block.batch_index;
  const int head = block.head;
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const Sequence seq_q = query_sequence(p, batch_index, p.max_seqlen_q);
  const Sequence seq_k = key_sequence(p, batch_index, p.max_seqlen_k);
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;
  const int wave = threadIdx.x / 64;
  const int lane = threadIdx.x % 64;
  const int column = lane % mfma::kTile;
  const int quarter = lane / mfma::kTile;
  const int m0 = block.m_block * BLOCK_M + 16 * wave;  // the wave's first row; waves share nothing
  if (m0 >= len_q) return;  // uniform over the wave

  // Keys the wave's rows see: from its first row's first key to its last row's last.
  const int diagonal = len_k - len_q;
  const KeyWindow window = key_window(p);
  const int row_end = len_q < m0 + 16 ? len_q : m0 + 16;
  const int key_begin = first_visible_key(m0, diagonal, window, len_k);
  const int key_end = visible_key_end(row_end - 1, diagonal, window, len_k);

  const int query = m0 + column;
  const bool query_in = query < len_q;
  const long long row_token = seq_q.start + (query_in ? query : 0);
  const T* const q_row = static_cast<const T*>(p.q) + batch_index * p.q_batch_stride + row_token * p.q_token_stride +
                         head * p.q_head_stride;
  const T* const do_row = static_cast<const T*>(p.dout) + batch_index * p.dout_batch_stride +
                          row_token * p.dout_token_stride + head * p.dout_head_stride;
  mfma::Operand q_fragment[kDSteps], do_fragment[kDSteps];  // B of Sᵀ and dPᵀ: the lane's query row
#pragma unroll
  for (int d = 0; d < kDSteps; ++d) {
    q_fragment[d] = query_in ? mfma::load_operand(q_row + 16 * d + 4 * quarter) : mfma::zero_operand();
    do_fragment[d] = query_in ? mfma::load_operand(do_row + 16 * d + 4 * quarter) : mfma::zero_operand();
  }
  const flash::RowStatistics row = flash::row_statistics(p, batch_index, head, row_token, query_in);
  const Scores<SCORE_MODS> scores = scores_of<SCORE_MODS>(p, batch_index, head);
  const Dropout<SCORE_MODS> dropout = dropout_of<SCORE_MODS>(p, batch_index, head);
  const T* const k_rows = static_cast<const T*>(p.k) + batch_index * p.k_batch_stride +
                          static_cast<long long>(seq_k.start) * p.k_token_stride + head_kv * p.k_head_stride;
  const T* const v_rows = static_cast<const T*>(p.v) + batch_index * p.v_batch_stride +
                          static_cast<long long>(seq_k.start) * p.v_token_stride + head_kv * p.v_head_stride;

  mfma::Accumulator dq[kDSteps];  // dQᵀ: columns 16 d + 4 quarter + e of query `column`
#pragma unroll
  for (int d = 0; d < kDSteps; ++d) dq[d] = mfma::zero_accumulator();
  for (int n0 = key_begin / kKeys * kKeys; n0 < key_end; n0 += kKeys) {
    // Sᵀ and dPᵀ of keys [n0, n0 + 16): A is key n0 + column's row, zero past the sequence.
    const bool key_in = n0 + column < len_k;
    mfma::Accumulator s = mfma::zero_accumulator(), dp = mfma::zero_accumulator();
#pragma unroll
    for (int d = 0; d < kDSteps; d += 2) {
      const T* k_row = k_rows + (n0 + column) * p.k_token_stride + 4 * quarter;
      const T* v_row = v_rows + (n0 + column) * p.v_token_stride + 4 * quarter;
      const mfma::Operand k0 = key_in ? mfma::load_operand(k_row + 16 * d) : mfma::zero_operand();
      const mfma::Operand k1 = key_in ? mfma::load_operand(k_row + 16 * (d + 1)) : mfma::zero_operand();
      const mfma::Operand v0 = key_in ? mfma::load_operand(v_row + 16 * d) : mfma::zero_operand();
      const mfma::Operand v1 = key_in ? mfma::load_operand(v_row + 16 * (d + 1)) : mfma::zero_operand();
      s = mfma::mfma_two_steps<T>(k0, k1, q_fragment[d], q_fragment[d + 1], s);
      dp = mfma::mfma_two_steps<T>(v0, v1, do_fragment[d], do_fragment[d + 1], dp);
    }
    const mfma::Accumulator ds = flash::probabilities_and_dscores(s, dp, query, n0 + 4 * quarter, len_q, len_k,
                                                                  diagonal, window, scores, dropout, row);
    // dQᵀ += Kᵀ dSᵀ: the dSᵀ accumulator, rounded to T, is the B operand as it stands.
    const mfma::Operand ds_operand = mfma::to_operand<T>(ds);
    const int keys_here = len_k - (n0 + 4 * quarter);
#pragma unroll
    for (int d = 0; d < kDSteps; ++d) {
      const mfma::Operand kt_a = flash::gather_operand(k_rows + (n0 + 4 * quarter) * p.k_token_stride + 16 * d + column,
                                                       p.k_token_stride, keys_here);
      dq[d] = mfma::mfma_16x16x16<T>(kt_a, ds_operand, dq[d]);
    }
  }

  if (query_in) {
    T* const dq_row = static_cast<T*>(p.dq) + batch_index * p.dq_batch_stride + row_token * p.dq_token_stride +
                      head * p.dq_head_stride;
#pragma unroll
    for (int d = 0; d < kDSteps; ++d) flash::store_scaled(dq_row + 16 * d + 4 * quarter, dq[d], p.softmax_scale);
  }
}

}  // namespace hipattn
