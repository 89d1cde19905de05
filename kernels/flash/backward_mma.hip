// General attention backward on NVIDIA tensor cores (sm_80+): FlashAttention-2's two-pass split with
// mma.sync m16n8k16. Both kernels recompute P = exp(scale S - LSE) from the forward's LSE and take
// Delta = rowsum(dO * O) (bwd_dot_do_o.hip) so that dS = P * (dP - Delta) needs no row reduction.
//
// flash_backward_dkdv_mma: one block per (key tile of BLOCK_N keys, sequence, KV head); in THD mode
// with a work list, only the key tiles the sequences really have (key_block_of). K and V stay
// in shared memory and dK, dV in fp32 registers while the block walks every query tile (of every
// query head of the KV head's group) whose rows see some of its keys; Q, dO, LSE and Delta tiles are
// double-buffered with cp.async so the next tile's copies overlap this tile's math. The block works
// in the transposed frame, keys as rows:
//   phase 1   Sᵀ = K Qᵀ, dPᵀ = V dOᵀ     (K, V as the A operand; Q, dO rows as B: plain ldmatrix)
//             Pᵀ and dSᵀ = Pᵀ * (dPᵀ - Delta) go to shared memory as T, [key][query]
//   phase 2   dV += Pᵀ dO, dK += dSᵀ Q   (Pᵀ, dSᵀ as A: plain ldmatrix; dO, Q as B: ldmatrix.trans)
//   phase 3   dQ_partial = dS K          (dS as A: ldmatrix.trans of dSᵀ; K as B: ldmatrix.trans),
//             added into the fp32 dq_accum with atomics when WRITE_DQ (convert_dq scales it later)
// A warp owns 16 keys (a "key slice") and HEAD_DIM / COLUMN_GROUPS columns of their dK and dV; with
// several column groups per slice (head_dim 256: the accumulators would not fit one warp), the
// slice's warps split its phase-1 queries and its phase-2 columns between them.
//
// flash_backward_dq_mma: the deterministic dQ, one block per (query tile, sequence, query head), one
// warp per 16 rows, walking the key tiles its rows see: S, dP, dS in registers, dQ += dS K with dS
// reused in registers as the A operand; dQ written once, times softmax_scale. No atomics.
//
// Conventions are the forward's (forward_mma.hip): the keys a row sees are common/key_window.h's
// bottom-right aligned window; lengths read from the device are clamped (sequence_bounds) and the
// grid is sized from host facts (max_seqlen, or the work list's bound), so blocks past a sequence's
// real length, or past the work list, return at once.
// Keys of a sequence that no query sees get dK = dV = 0; a row with LSE = +inf gets dQ = 0.
// With dropout (common/dropout.h) both kernels regenerate the forward's keep bits: dV takes the kept
// probabilities times 1 / (1 - dropout_p), and dS = P (Z dP / (1 - dropout_p) - Delta), Z the keep
// bits; Delta = rowsum(dO * O) is unchanged (O is the dropped output).
#pragma once
#include "common/dropout.h"
#include "common/mma_nvidia.h"
#include "common/score_mods.h"
#include "flash/backward_common.h"
#include "flash/stage_padded_cp_async.h"

namespace hipattn {
namespace flash {

// Shared-memory layout of a dK/dV block, in elements of T, then fp32 row statistics:
//   K, V          BLOCK_N rows each
//   Q, dO         two slots of BLOCK_M rows each (double buffer)
//   Pᵀ, dSᵀ       BLOCK_N rows of BLOCK_M queries, [key][query]
//   LSE, Delta    fp32, two slots of BLOCK_M each: [slot][LSE | Delta]
// Every row is padded by 8 elements (16 bytes) against ldmatrix bank conflicts. The host's row
// (hipattn/catalog/flash_backward.py, FlashDkdvMmaTiles.shared_bytes) computes kBytes from the same
// template arguments.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS>
struct KeyBlockTiles {
  static constexpr int kPitch = HEAD_DIM + 8;
  static constexpr int kScorePitch = BLOCK_M + 8;
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte pieces of a row
  static constexpr int kKeySlices = BLOCK_N / 16;
  static constexpr int kColumnGroups = WARPS / kKeySlices;
  static constexpr int kWarpQueries = BLOCK_M / kColumnGroups;  // phase 1: queries of one warp
  static constexpr int kWarpColumns = HEAD_DIM / kColumnGroups;  // phase 2: dK/dV columns of one warp
  static constexpr int kKeyElements = BLOCK_N * kPitch;
  static constexpr int kQueryElements = BLOCK_M * kPitch;
  static constexpr int kScoreElements = BLOCK_N * kScorePitch;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKeyElements;
  static constexpr int kQOffset = 2 * kKeyElements;
  static constexpr int kDoOffset = kQOffset + 2 * kQueryElements;
  static constexpr int kPOffset = kDoOffset + 2 * kQueryElements;
  static constexpr int kDsOffset = kPOffset + kScoreElements;
  static constexpr int kElements = kDsOffset + kScoreElements;
  static constexpr int kStatsOffsetBytes = kElements * static_cast<int>(sizeof(T));
  static constexpr int kBytes = kStatsOffsetBytes + 2 * 2 * BLOCK_M * static_cast<int>(sizeof(float));

  static_assert(sizeof(T) == 2, "the tensor-core path takes 16-bit inputs");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim is a multiple of 16 up to 256");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_M % 16 == 0, "keys and queries come in whole 16-row tiles");
  static_assert(WARPS % kKeySlices == 0 && WARPS <= 8, "every key slice has the same number of warps, at most 8");
  static_assert(kWarpQueries % 8 == 0, "a warp's phase-1 queries are whole 8-query accumulator tiles");
  static_assert(kWarpColumns % 16 == 0, "a warp's phase-2 columns are whole 16-column ldmatrix loads");
  static_assert(WARPS % (BLOCK_M / 16) == 0, "phase 3: every warp keeps one 16-row tile of dQ");
  // 227 KiB is the largest opt-in of any sm_80+ part (sm_90); the shipped table keeps every row
  // within 99 KiB, the smallest (sm_86, sm_89), and tests/test_flash_tiles.py checks that.
  static_assert(kBytes <= 227 * 1024, "the tiles must fit 227 KiB of shared memory");
};

// Shared-memory layout of a dQ block, in elements of T: Q and dO (BLOCK_M rows each), then two
// slots of K and two of V (BLOCK_N rows each). FlashDqMmaTiles.shared_bytes on the host agrees.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS>
struct QueryBlockTiles {
  static constexpr int kPitch = HEAD_DIM + 8;
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kChunks = HEAD_DIM / 8;
  static constexpr int kQueryElements = BLOCK_M * kPitch;
  static constexpr int kSlotElements = BLOCK_N * kPitch;
  static constexpr int kQOffset = 0;
  static constexpr int kDoOffset = kQueryElements;
  static constexpr int kKOffset = 2 * kQueryElements;
  static constexpr int kVOffset = kKOffset + 2 * kSlotElements;
  static constexpr int kElements = kVOffset + 2 * kSlotElements;
  static constexpr int kBytes = kElements * static_cast<int>(sizeof(T));

  static_assert(sizeof(T) == 2, "the tensor-core path takes 16-bit inputs");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim is a multiple of 16 up to 256");
  static_assert(WARPS * 16 == BLOCK_M && WARPS <= 8, "one warp per 16 query rows, at most 8 warps");
  static_assert(BLOCK_N % 16 == 0, "key tiles are whole k-steps of dS K");
  static_assert(kBytes <= 227 * 1024, "the tiles must fit 227 KiB of shared memory");
};

// The dK/dV kernel's phase-1 entries of a lane (keys `key` and key + 8 of its slice, queries m0 + 8n
// + 2t and the next, for query tile n), turned in place from scores into what phase 2 multiplies: Sᵀ
// into the kept probabilities Pᵀ (times dropout's 1 / (1 - p)), dPᵀ into dSᵀ = Pᵀ (Z dPᵀ / (1 - p) -
// Delta) score'(Sᵀ), with P = exp2(score - LSE) and 0 where the pair is not visible (by selection: a
// stale NaN is discarded, never multiplied). `lse` and `delta` point at the tile's rows of query m0. A
// functor for Scores::visit: with modifiers, the softcap's presence is one branch around the tile, so
// that ALiBi alone forms no tanh (a branch per score if-converts into forming both).
template <int Q_TILES, bool DROPOUT>
struct TransposedGradients {
  float (&s)[Q_TILES][4];
  float (&dp)[Q_TILES][4];
  const float* lse;
  const float* delta;
  unsigned long long kept_bits;  // bit 4n + e: entry e of query tile n is kept
  const Dropout<DROPOUT>& dropout;
  bool masked;  // some pair of the tile may be invisible
  int key, m0, t, len_q, len_k, diagonal;
  KeyWindow window;

  template <typename Score>
  HIPATTN_DEVICE void operator()(const Score& score) const {
    // The offset of key + 8 (e / 2) from query m0 + 8n + 2t + (e & 1)'s diagonal: a base plus constants.
    const float base = static_cast<float>(key - m0 - 2 * t - diagonal);
#pragma unroll
    for (int n = 0; n < Q_TILES; ++n) {
      const int column = 8 * n + 2 * t;  // this lane's queries in the tile: column, column + 1
      const float lse_log2[2] = {lse[column] * kLog2e, lse[column + 1] * kLog2e};
      const float row_delta[2] = {delta[column], delta[column + 1]};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool kept = ((kept_bits >> (4 * n + e)) & 1ull) != 0;
        const int query = m0 + column + (e & 1);
        const int row_key = key + 8 * (e / 2);
        const bool visible =
            !masked || (query < len_q && row_key < len_k && key_in_window(query, row_key, diagonal, window));
        float gradient = 1.0f;  // d(score)/d(scaled dot product), dS's factor: 1 but with softcap
        const float offset = base + static_cast<float>(8 * (e / 2) - 8 * n - (e & 1));
        const float probability =
            visible ? fast_exp2(score(s[n][e], offset, gradient) - lse_log2[e & 1]) : 0.0f;
        // With dropout, dV takes the kept probabilities scaled, and dP reaches only kept entries.
        s[n][e] = kept ? probability * dropout.scale() : 0.0f;
        const float dp_kept = kept ? dp[n][e] * dropout.scale() : 0.0f;
        dp[n][e] = probability * (dp_kept - row_delta[e & 1]) * gradient;
      }
    }
  }
};

// The dQ kernel's entries of a lane (rows `row` and row + 8, keys n0 + 8n + 2t and the next, for key
// tile n): dP turned in place into dS = P (Z dP / (1 - p) - Delta) score'(S), with P = exp2(score -
// LSE) from the scores in `s`, 0 where the pair is not visible. A functor for Scores::visit, as
// TransposedGradients.
template <int N_TILES, bool DROPOUT>
struct RowGradients {
  const float (&s)[N_TILES][4];
  float (&dp)[N_TILES][4];
  const float (&lse_log2)[2];  // per row r (row, row + 8): LSE in base 2, Delta, its visible keys
  const float (&delta)[2];
  const unsigned int (&kept)[2][N_TILES];  // dropout's packed keep masks per row and key tile
  const Dropout<DROPOUT>& dropout;
  bool masked;  // some pair of the tile may be invisible
  int n0, row, t;
  const int (&key_first)[2];
  const int (&key_limit)[2];
  int diagonal;

  template <typename Score>
  HIPATTN_DEVICE void operator()(const Score& score) const {
    // The offset of key n0 + 8n + 2t + (e & 1) from row + 8r's diagonal: a base plus constants.
    const float base = static_cast<float>(n0 + 2 * t - row - diagonal);
#pragma unroll
    for (int n = 0; n < N_TILES; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int key = n0 + 8 * n + 2 * t + (e & 1);
        const bool visible = !masked || (key >= key_first[r] && key < key_limit[r]);
        float gradient = 1.0f;  // d(score)/d(scaled dot product), dS's factor: 1 but with softcap
        const float offset = base + static_cast<float>(8 * n + (e & 1) - 8 * r);
        const float probability = visible ? fast_exp2(score(s[n][e], offset, gradient) - lse_log2[r]) : 0.0f;
        // With dropout, dP reaches only the kept entries, scaled as the forward scaled them.
        const bool keep = !dropout.active() || (kept[r][n] >> (16 * (e & 1)) & 1u) != 0;
        const float dp_kept = keep ? dp[n][e] * dropout.scale() : 0.0f;
        dp[n][e] = probability * (dp_kept - delta[r]) * gradient;
      }
  }
};

}  // namespace flash

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool WRITE_DQ, bool SCORE_MODS>
__global__ void __launch_bounds__(WARPS * 32) flash_backward_dkdv_mma(const FlashBackwardParams p) {
  using Tiles = flash::KeyBlockTiles<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS>;
  constexpr int kThreads = Tiles::kThreads;
  constexpr int kPitch = Tiles::kPitch;
  constexpr int kScorePitch = Tiles::kScorePitch;
  constexpr int kQTiles = Tiles::kWarpQueries / 8;  // 8-query accumulator tiles of Sᵀ per warp
  constexpr int kDTiles = Tiles::kWarpColumns / 8;  // 8-column accumulator tiles of dK, dV per warp
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);
  float* const stats = reinterpret_cast<float*>(shared_bytes + Tiles::kStatsOffsetBytes);

  const flash::KeyBlock block = flash::key_block_of<BLOCK_N, HEAD_DIM>(blockIdx.x, p);
  if (block.batch_index < 0) return;  // past the work list's last key block; before any barrier
  const int batch_index = block.batch_index;
  const Sequence seq_q = query_sequence(p, batch_index, p.max_seqlen_q);
  const Sequence seq_k = key_sequence(p, batch_index, p.max_seqlen_k);
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;
  const int n0 = block.n_block * BLOCK_N;
  if (n0 >= len_k) return;  // no key of this sequence here; uniform over the block, before any barrier
  const int keys = len_k - n0 < BLOCK_N ? len_k - n0 : BLOCK_N;

  // Query tiles whose rows see some of keys [n0, n0 + keys). Every query head of the KV head's group
  // walks the same tiles; the block's work list is (group head, query tile) flattened, so the copies
  // run ahead across heads.
  const int diagonal = len_k - len_q;  // the window's alignment (common/key_window.h)
  const KeyWindow window = key_window(p);
  const flash::QueryTiles seeing = flash::query_tiles_seeing<BLOCK_M>(n0, keys, len_q, diagonal, window);
  const int group = p.heads_q / p.heads_kv;
  const int first_head = block.head_kv * group;
  const int tiles = group * seeing.count;  // zero: no query sees these keys, and dK = dV = 0 is written

  T* const k_tile = shared + Tiles::kKOffset;
  T* const v_tile = shared + Tiles::kVOffset;
  T* const q_slots = shared + Tiles::kQOffset;
  T* const do_slots = shared + Tiles::kDoOffset;
  T* const p_tile = shared + Tiles::kPOffset;
  T* const ds_tile = shared + Tiles::kDsOffset;

  // K and V rows past the sequence are zeroed: they meet probabilities of exactly 0 in dS and dQ,
  // and 0 x stale NaN would be NaN.
  {
    const long long token = seq_k.start + n0;
    flash::stage_tile<T, HEAD_DIM, kThreads, true>(
        k_tile, static_cast<const T*>(p.k) + batch_index * p.k_batch_stride + token * p.k_token_stride +
                    block.head_kv * p.k_head_stride,
        p.k_token_stride, keys, BLOCK_N);
    flash::stage_tile<T, HEAD_DIM, kThreads, true>(
        v_tile, static_cast<const T*>(p.v) + batch_index * p.v_batch_stride + token * p.v_token_stride +
                    block.head_kv * p.v_head_stride,
        p.v_token_stride, keys, BLOCK_N);
  }

  // Tile i of the work list: its query head and first row.
  auto head_of = [&](int i) { return first_head + i / seeing.count; };
  auto m0_of = [&](int i) { return (seeing.first + i % seeing.count) * BLOCK_M; };
  // Issue the copies of work item i into slot i % 2 (nothing past the last item) and always commit,
  // so that at the top of iteration i exactly one group, item i's, is in flight.
  auto load_query_tile = [&](int i) {
    if (i < tiles) {
      const int head = head_of(i);
      const int m0 = m0_of(i);
      const int rows = len_q - m0 < BLOCK_M ? len_q - m0 : BLOCK_M;
      const int slot = i % 2;
      const long long token = seq_q.start + m0;
      // Q and dO rows past the sequence are zeroed: they are B operands of dK and dV, met by P = 0.
      flash::stage_tile<T, HEAD_DIM, kThreads, true>(
          q_slots + slot * Tiles::kQueryElements,
          static_cast<const T*>(p.q) + batch_index * p.q_batch_stride + token * p.q_token_stride +
              head * p.q_head_stride,
          p.q_token_stride, rows, BLOCK_M);
      flash::stage_tile<T, HEAD_DIM, kThreads, true>(
          do_slots + slot * Tiles::kQueryElements,
          static_cast<const T*>(p.dout) + batch_index * p.dout_batch_stride + token * p.dout_token_stride +
              head * p.dout_head_stride,
          p.dout_token_stride, rows, BLOCK_M);
      float* const lse_slot = stats + slot * 2 * BLOCK_M;
      float* const delta_slot = lse_slot + BLOCK_M;
      const float* const lse_row =
          static_cast<const float*>(p.lse) + batch_index * p.lse_batch_stride + head * p.lse_head_stride + token;
      const float* const delta_row = static_cast<const float*>(p.softmax_d) +
                                     batch_index * p.softmax_d_batch_stride + head * p.softmax_d_head_stride + token;
      for (int r = threadIdx.x; r < BLOCK_M; r += kThreads) {
        if (r < rows) {
          mma::copy_async_4(lse_slot + r, lse_row + r);
          mma::copy_async_4(delta_slot + r, delta_row + r);
        } else {
          // Rows past the sequence: P = exp(-inf) = 0, and a finite Delta (dot_do_o's value there
          // comes from rows of O nobody wrote).
          lse_slot[r] = infinity();
          delta_slot[r] = 0.0f;
        }
      }
    }
    mma::commit_async_copies();
  };
  load_query_tile(0);  // in one group with K and V

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // accumulator rows g and g + 8 of the warp's 16
  const int t = lane % 4;  // accumulator column pair 2t, 2t + 1 of each 8-column tile
  const int key_slice = warp % Tiles::kKeySlices;
  const int column_group = warp / Tiles::kKeySlices;
  const int query_base = column_group * Tiles::kWarpQueries;   // phase 1: this warp's queries in the tile
  const int column_base = column_group * Tiles::kWarpColumns;  // phase 2: this warp's dK/dV columns
  const int slice_row = 16 * key_slice;                        // the warp's keys in the block's tiles
  const Scores<SCORE_MODS> block_scores = scores_of<SCORE_MODS>(p, batch_index, first_head);
  const Dropout<SCORE_MODS> block_dropout = dropout_of<SCORE_MODS>(p, batch_index, first_head);

  float dk[kDTiles][4];
  float dv[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.0f;

  for (int i = 0; i < tiles; ++i) {
    const int head = head_of(i);
    const int m0 = m0_of(i);
    const int slot = i % 2;
    const T* const q_tile = q_slots + slot * Tiles::kQueryElements;
    const T* const do_tile = do_slots + slot * Tiles::kQueryElements;
    const float* const lse_slot = stats + slot * 2 * BLOCK_M;
    const float* const delta_slot = lse_slot + BLOCK_M;
    const Scores<SCORE_MODS> scores = block_scores.with_head(p, batch_index, head);
    const Dropout<SCORE_MODS> dropout = block_dropout.with_head(p, batch_index, head);

    mma::wait_async_copies();  // item i (and K, V) have landed for this thread: the only group in flight
    __syncthreads();           // ... for every thread; every warp is done with item i - 1's slot, Pᵀ, dSᵀ
    load_query_tile(i + 1);

    // ---- phase 1: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, 16 keys x kWarpQueries queries per warp ----
    float s[kQTiles][4];
    float dp[kQTiles][4];
#pragma unroll
    for (int n = 0; n < kQTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      unsigned int ak[4], av[4];
      const int a_offset = (slice_row + lane % 16) * kPitch + 16 * ks + 8 * (lane / 16);
      mma::ldmatrix_x4(ak, k_tile + a_offset);
      mma::ldmatrix_x4(av, v_tile + a_offset);
#pragma unroll
      for (int np = 0; np < kQTiles / 2; ++np) {
        const int b_offset = (query_base + 16 * np + 8 * (lane / 16) + lane % 8) * kPitch + 16 * ks + 8 * ((lane / 8) % 2);
        unsigned int b[4];
        mma::ldmatrix_x4(b, q_tile + b_offset);
        mma::mma_16816<T>(s[2 * np], ak, b[0], b[1]);
        mma::mma_16816<T>(s[2 * np + 1], ak, b[2], b[3]);
        mma::ldmatrix_x4(b, do_tile + b_offset);
        mma::mma_16816<T>(dp[2 * np], av, b[0], b[1]);
        mma::mma_16816<T>(dp[2 * np + 1], av, b[2], b[3]);
      }
      if constexpr (kQTiles % 2 == 1) {  // a last, unpaired 8-query tile
        const int b_offset = (query_base + 8 * (kQTiles - 1) + lane % 8) * kPitch + 16 * ks + 8 * ((lane / 8) % 2);
        unsigned int b[2];
        mma::ldmatrix_x2(b, q_tile + b_offset);
        mma::mma_16816<T>(s[kQTiles - 1], ak, b[0], b[1]);
        mma::ldmatrix_x2(b, do_tile + b_offset);
        mma::mma_16816<T>(dp[kQTiles - 1], av, b[0], b[1]);
      }
    }

    // ---- Pᵀ and dSᵀ = Pᵀ (dPᵀ - Delta); masked entries are 0 by selection (a stale NaN is discarded,
    // never multiplied). A tile needs the mask when it reaches past either sequence or past a side
    // of the window: its first row's last key or its last row's first key lies outside. ----
    const bool masked = m0 + BLOCK_M > len_q || n0 + BLOCK_N > len_k ||
                        !key_in_window(m0, n0 + BLOCK_N - 1, diagonal, window) ||
                        !key_in_window(m0 + BLOCK_M - 1, n0, diagonal, window);
    // Dropout's keep bits of this lane's entries, bit 4n + e for entry e of query tile n.
    const unsigned long long kept_bits =
        dropout.active() ? dropout.template transposed_m16n8_bits<kQTiles>(n0 + slice_row + g, m0 + query_base, t)
                         : ~0ull;
    scores.visit(flash::TransposedGradients<kQTiles, SCORE_MODS>{
        s, dp, lse_slot + query_base, delta_slot + query_base, kept_bits, dropout, masked, n0 + slice_row + g,
        m0 + query_base, t, len_q, len_k, diagonal, window});
#pragma unroll
    for (int n = 0; n < kQTiles; ++n) {
      const int column = query_base + 8 * n + 2 * t;  // this lane's queries: column, column + 1
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int offset = (slice_row + g + 8 * r) * kScorePitch + column;
        *reinterpret_cast<unsigned int*>(p_tile + offset) = mma::pack2<T>(s[n][2 * r], s[n][2 * r + 1]);
        *reinterpret_cast<unsigned int*>(ds_tile + offset) = mma::pack2<T>(dp[n][2 * r], dp[n][2 * r + 1]);
      }
    }
    __syncthreads();  // Pᵀ and dSᵀ of every warp are in shared memory

    // ---- phase 2: dV += Pᵀ dO and dK += dSᵀ Q over the tile's BLOCK_M queries ----
#pragma unroll
    for (int kq = 0; kq < BLOCK_M / 16; ++kq) {
      unsigned int ap[4], ads[4];
      const int a_offset = (slice_row + lane % 16) * kScorePitch + 16 * kq + 8 * (lane / 16);
      mma::ldmatrix_x4(ap, p_tile + a_offset);
      mma::ldmatrix_x4(ads, ds_tile + a_offset);
#pragma unroll
      for (int dp2 = 0; dp2 < Tiles::kWarpColumns / 16; ++dp2) {
        const int b_offset =
            (16 * kq + lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + column_base + 16 * dp2 + 8 * (lane / 16);
        unsigned int b[4];
        mma::ldmatrix_x4_trans(b, do_tile + b_offset);
        mma::mma_16816<T>(dv[2 * dp2], ap, b[0], b[1]);
        mma::mma_16816<T>(dv[2 * dp2 + 1], ap, b[2], b[3]);
        mma::ldmatrix_x4_trans(b, q_tile + b_offset);
        mma::mma_16816<T>(dk[2 * dp2], ads, b[0], b[1]);
        mma::mma_16816<T>(dk[2 * dp2 + 1], ads, b[2], b[3]);
      }
    }

    // ---- phase 3: dQ of the tile's rows += dS K over the block's keys, added into dq_accum. Each warp
    // keeps one 16-row tile (its dS A fragments loaded once) and takes every n-th 16-column chunk. ----
    if constexpr (WRITE_DQ) {
      constexpr int kRowTiles = BLOCK_M / 16;
      constexpr int kKeySteps = BLOCK_N / 16;
      const int row_tile = warp % kRowTiles;
      unsigned int a[kKeySteps][4];
#pragma unroll
      for (int kk = 0; kk < kKeySteps; ++kk)
        mma::ldmatrix_x4_trans(a[kk],
                               ds_tile + (16 * kk + lane % 8 + 8 * (lane / 16)) * kScorePitch + 16 * row_tile +
                                   8 * ((lane / 8) % 2));
      float* const dq_rows = static_cast<float*>(p.dq_accum) + batch_index * p.dq_accum_batch_stride +
                             static_cast<long long>(seq_q.start + m0) * p.dq_accum_token_stride +
                             head * p.dq_accum_head_stride;
      for (int chunk = warp / kRowTiles; chunk < HEAD_DIM / 16; chunk += WARPS / kRowTiles) {
        float acc[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < kKeySteps; ++kk) {
          unsigned int b[4];
          mma::ldmatrix_x4_trans(
              b, k_tile + (16 * kk + lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + 16 * chunk + 8 * (lane / 16));
          mma::mma_16816<T>(acc[0], a[kk], b[0], b[1]);
          mma::mma_16816<T>(acc[1], a[kk], b[2], b[3]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = 16 * row_tile + g + 8 * r;
          if (m0 + row < len_q) {  // rows past the sequence belong to the next one (THD) or to padding
            float* const destination = dq_rows + row * p.dq_accum_token_stride + 16 * chunk + 2 * t;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              atomic_add(destination + 8 * half, acc[half][2 * r]);
              atomic_add(destination + 8 * half + 1, acc[half][2 * r + 1]);
            }
          }
        }
      }
    }
  }
  // Every thread's copies have landed (the last commit was empty), and the barrier: every warp is
  // done reading K and V, which now stage dK and dV for wide stores.
  mma::wait_async_copies();
  __syncthreads();

  // ---- epilogue: dK = scale * dSᵀ Q and dV through the K and V tiles, rows past the sequence skipped ----
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int offset = (slice_row + g + 8 * r) * kPitch + column_base + 8 * d + 2 * t;
      *reinterpret_cast<unsigned int*>(k_tile + offset) =
          mma::pack2<T>(dk[d][2 * r] * p.softmax_scale, dk[d][2 * r + 1] * p.softmax_scale);
      *reinterpret_cast<unsigned int*>(v_tile + offset) = mma::pack2<T>(dv[d][2 * r], dv[d][2 * r + 1]);
    }
  __syncthreads();
  const long long token = seq_k.start + n0;
  T* const dk_rows = static_cast<T*>(p.dk) + batch_index * p.dk_batch_stride + token * p.dk_token_stride +
                     block.head_kv * p.dk_head_stride;
  T* const dv_rows = static_cast<T*>(p.dv) + batch_index * p.dv_batch_stride + token * p.dv_token_stride +
                     block.head_kv * p.dv_head_stride;
  for (int c = threadIdx.x; c < keys * Tiles::kChunks; c += kThreads) {
    const int row = c / Tiles::kChunks;
    const int chunk = c % Tiles::kChunks;
    *reinterpret_cast<Vec<T, 8>*>(dk_rows + row * p.dk_token_stride + chunk * 8) =
        *reinterpret_cast<const Vec<T, 8>*>(k_tile + row * kPitch + chunk * 8);
    *reinterpret_cast<Vec<T, 8>*>(dv_rows + row * p.dv_token_stride + chunk * 8) =
        *reinterpret_cast<const Vec<T, 8>*>(v_tile + row * kPitch + chunk * 8);
  }
}

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool SCORE_MODS>
__global__ void __launch_bounds__(WARPS * 32) flash_backward_dq_mma(const FlashBackwardParams p) {
  using Tiles = flash::QueryBlockTiles<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS>;
  constexpr int kThreads = Tiles::kThreads;
  constexpr int kPitch = Tiles::kPitch;
  constexpr int kNTiles = BLOCK_N / 8;   // 8-key accumulator tiles of S and dP
  constexpr int kDTiles = HEAD_DIM / 8;  // 8-column accumulator tiles of dQ
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);

  const int m_blocks = (p.max_seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const flash::QueryBlock block = flash::query_block_of(blockIdx.x, m_blocks, p.heads_q);
  const int batch_index = block.batch_index;
  const int head = block.head;
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const Sequence seq_q = query_sequence(p, batch_index, p.max_seqlen_q);
  const Sequence seq_k = key_sequence(p, batch_index, p.max_seqlen_k);
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;
  const int m0 = block.m_block * BLOCK_M;
  if (m0 >= len_q) return;  // uniform over the block, before any barrier

  // Keys this block's rows see: from its first row's first key to its last row's last.
  const int diagonal = len_k - len_q;
  const KeyWindow window = key_window(p);
  const int row_end = len_q < m0 + BLOCK_M ? len_q : m0 + BLOCK_M;
  const int key_begin = first_visible_key(m0, diagonal, window, len_k);
  const int key_end = visible_key_end(row_end - 1, diagonal, window, len_k);
  const int tile_begin = key_begin / BLOCK_N;
  // Zero: the rows see nothing, and dQ = 0 is written.
  const int n_tiles = key_end > key_begin ? (key_end + BLOCK_N - 1) / BLOCK_N - tile_begin : 0;

  const long long q_token = seq_q.start + m0;
  T* const q_tile = shared + Tiles::kQOffset;
  T* const do_tile = shared + Tiles::kDoOffset;
  T* const k_slots = shared + Tiles::kKOffset;
  T* const v_slots = shared + Tiles::kVOffset;
  const T* const k_rows = static_cast<const T*>(p.k) + batch_index * p.k_batch_stride +
                          static_cast<long long>(seq_k.start) * p.k_token_stride + head_kv * p.k_head_stride;
  const T* const v_rows = static_cast<const T*>(p.v) + batch_index * p.v_batch_stride +
                          static_cast<long long>(seq_k.start) * p.v_token_stride + head_kv * p.v_head_stride;
  {
    // Rows past the sequence are zeroed: their dQ is never stored, but zeros keep every lane finite.
    const int rows = row_end - m0;
    flash::stage_tile<T, HEAD_DIM, kThreads, true>(
        q_tile, static_cast<const T*>(p.q) + batch_index * p.q_batch_stride + q_token * p.q_token_stride +
                    head * p.q_head_stride,
        p.q_token_stride, rows, BLOCK_M);
    flash::stage_tile<T, HEAD_DIM, kThreads, true>(
        do_tile, static_cast<const T*>(p.dout) + batch_index * p.dout_batch_stride + q_token * p.dout_token_stride +
                     head * p.dout_head_stride,
        p.dout_token_stride, rows, BLOCK_M);
  }
  // Key tile i into slot i % 2 (nothing past the last) and always a commit: at the top of iteration i
  // exactly one group, tile i's, is in flight. Rows past the sequence are zeroed: K rows meet dS = 0
  // in dQ and V rows feed dP entries met by P = 0, and 0 x stale NaN would be NaN.
  auto load_keys = [&](int i) {
    if (i < n_tiles) {
      const int n0 = (tile_begin + i) * BLOCK_N;
      const int rows = len_k - n0 < BLOCK_N ? len_k - n0 : BLOCK_N;
      flash::stage_tile<T, HEAD_DIM, kThreads, true>(k_slots + (i % 2) * Tiles::kSlotElements,
                                                     k_rows + n0 * p.k_token_stride, p.k_token_stride, rows, BLOCK_N);
      flash::stage_tile<T, HEAD_DIM, kThreads, true>(v_slots + (i % 2) * Tiles::kSlotElements,
                                                     v_rows + n0 * p.v_token_stride, p.v_token_stride, rows, BLOCK_N);
    }
    mma::commit_async_copies();
  };
  load_keys(0);  // in one group with Q and dO

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const Scores<SCORE_MODS> scores = scores_of<SCORE_MODS>(p, batch_index, head);
  const Dropout<SCORE_MODS> dropout = dropout_of<SCORE_MODS>(p, batch_index, head);
  // Per accumulator row r (g, g + 8): LSE in base 2, Delta, and the keys [key_first, key_limit) it sees.
  float lse_log2[2], delta[2];
  int key_first[2], key_limit[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = m0 + 16 * warp + g + 8 * r;
    const bool stored = row < len_q;
    lse_log2[r] = stored ? static_cast<const float*>(p.lse)[batch_index * p.lse_batch_stride +
                                                            head * p.lse_head_stride + seq_q.start + row] *
                               kLog2e
                         : infinity();
    delta[r] = stored ? static_cast<const float*>(p.softmax_d)[batch_index * p.softmax_d_batch_stride +
                                                               head * p.softmax_d_head_stride + seq_q.start + row]
                      : 0.0f;
    key_first[r] = first_visible_key(row, diagonal, window, len_k);
    key_limit[r] = !stored ? 0 : visible_key_end(row, diagonal, window, len_k);
  }
  // A tile needs masking when it reaches past the sequence or past a side of some row's window: it
  // starts before the last row's first key or ends after the first row's last. (Rows past the
  // sequence have LSE +inf: their P is 0 in any tile.)
  const int unmasked_begin = first_visible_key(row_end - 1, diagonal, window, len_k);
  const int unmasked_end = visible_key_end(m0, diagonal, window, len_k);

  float dq[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) dq[d][0] = dq[d][1] = dq[d][2] = dq[d][3] = 0.0f;

  const T* const q_warp = q_tile + 16 * warp * kPitch;
  const T* const do_warp = do_tile + 16 * warp * kPitch;
  for (int i = 0; i < n_tiles; ++i) {
    const int n0 = (tile_begin + i) * BLOCK_N;
    const T* const k_tile = k_slots + (i % 2) * Tiles::kSlotElements;
    const T* const v_tile = v_slots + (i % 2) * Tiles::kSlotElements;

    mma::wait_async_copies();  // tile i (and Q, dO) have landed for this thread
    __syncthreads();           // ... for every thread; every warp is done with tile i - 1's slot
    load_keys(i + 1);

    // ---- S = Q Kᵀ and dP = dO Vᵀ: 16 rows x BLOCK_N keys per warp ----
    float s[kNTiles][4];
    float dp[kNTiles][4];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      unsigned int aq[4], ado[4];
      const int a_offset = (lane % 16) * kPitch + 16 * ks + 8 * (lane / 16);
      mma::ldmatrix_x4(aq, q_warp + a_offset);
      mma::ldmatrix_x4(ado, do_warp + a_offset);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        const int b_offset = (16 * np + 8 * (lane / 16) + lane % 8) * kPitch + 16 * ks + 8 * ((lane / 8) % 2);
        unsigned int b[4];
        mma::ldmatrix_x4(b, k_tile + b_offset);
        mma::mma_16816<T>(s[2 * np], aq, b[0], b[1]);
        mma::mma_16816<T>(s[2 * np + 1], aq, b[2], b[3]);
        mma::ldmatrix_x4(b, v_tile + b_offset);
        mma::mma_16816<T>(dp[2 * np], ado, b[0], b[1]);
        mma::mma_16816<T>(dp[2 * np + 1], ado, b[2], b[3]);
      }
    }

    // ---- P and dS = P (dP - Delta); masked entries are 0 by selection ----
    const bool masked = n0 < unmasked_begin || n0 + BLOCK_N > unmasked_end;
    // Dropout's keep masks of the two rows, as the forward computes them (packed pairs, m16n8 layout).
    unsigned int kept[2][kNTiles];
    if (dropout.active()) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
        m16n8_masks(dropout.template m16n8_bits<kNTiles>(m0 + 16 * warp + g + 8 * r, n0, t), kept[r]);
    }
    scores.visit(flash::RowGradients<kNTiles, SCORE_MODS>{s, dp, lse_log2, delta, kept, dropout, masked, n0,
                                                          m0 + 16 * warp + g, t, key_first, key_limit, diagonal});

    // ---- dQ += dS K: n-tiles 2 kk and 2 kk + 1 of dS are the A operand of k-step kk ----
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      unsigned int a[4];
      a[0] = mma::pack2<T>(dp[2 * kk][0], dp[2 * kk][1]);
      a[1] = mma::pack2<T>(dp[2 * kk][2], dp[2 * kk][3]);
      a[2] = mma::pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      a[3] = mma::pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
      for (int dp2 = 0; dp2 < HEAD_DIM / 16; ++dp2) {
        unsigned int b[4];
        mma::ldmatrix_x4_trans(
            b, k_tile + (16 * kk + lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + 16 * dp2 + 8 * (lane / 16));
        mma::mma_16816<T>(dq[2 * dp2], a, b[0], b[1]);
        mma::mma_16816<T>(dq[2 * dp2 + 1], a, b[2], b[3]);
      }
    }
  }
  // Every copy has landed, and (the barrier) every other thread's too: with no key tile at all,
  // another warp's copy of this warp's Q rows could otherwise land over its staged dQ.
  mma::wait_async_copies();
  __syncthreads();

  // ---- epilogue: dQ = scale * dS K through the warp's own Q rows (only this warp read them) ----
  T* const dq_stage = const_cast<T*>(q_warp);
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      *reinterpret_cast<unsigned int*>(dq_stage + (g + 8 * r) * kPitch + 8 * d + 2 * t) =
          mma::pack2<T>(dq[d][2 * r] * p.softmax_scale, dq[d][2 * r + 1] * p.softmax_scale);
    }
  __syncwarp();
  const int warp_first = m0 + 16 * warp;
  const int rows = len_q - warp_first < 16 ? len_q - warp_first : 16;
  T* const dq_rows = static_cast<T*>(p.dq) + batch_index * p.dq_batch_stride +
                     static_cast<long long>(seq_q.start + warp_first) * p.dq_token_stride + head * p.dq_head_stride;
  for (int c = lane; c < rows * Tiles::kChunks; c += 32) {
    const int r = c / Tiles::kChunks;
    const int chunk = c % Tiles::kChunks;
    *reinterpret_cast<Vec<T, 8>*>(dq_rows + r * p.dq_token_stride + chunk * 8) =
        *reinterpret_cast<const Vec<T, 8>*>(dq_stage + r * kPitch + chunk * 8);
  }
}

}  // namespace hipattn
