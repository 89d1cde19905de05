// General attention backward, the dK/dV kernel (with dQ's share added atomically), on Hopper's
// warpgroup tensor cores (sm_90a): backward_mma.hip's algorithm with wgmma.mma_async in place of
// mma.sync and ldmatrix.
//
// One block per (key tile, sequence, KV head), found as backward_mma.hip's (flash/backward_common.h).
// Up to head_dim 128 each warpgroup owns 64 of the tile's keys (64 * WARPGROUPS), as the rows of its
// accumulators, and every column of their dK and dV. Above, dK and dV of 64 keys over every column
// would take more registers than a thread has: COLUMN_GROUPS warpgroups then share the tile's 64 keys,
// each owning a slice of dK's and dV's columns and computing Sᵀ and dPᵀ for a slice of the queries;
// Pᵀ and dSᵀ meet in shared memory, where every warpgroup reads all of them as the A operands of dV and
// dK, and each warpgroup's share of dQ goes to dq_accum from its registers (no shared memory is left
// to stage it).
// K and V stay in shared memory and dK, dV in fp32 registers while the block walks every query tile of
// BLOCK_M rows (of every query head of the KV head's group) whose rows see some of its keys; Q, dO, LSE
// and Delta are double-buffered with cp.async, so the next tile's copies overlap this tile's math. Per
// query tile, each warpgroup, in the transposed frame (keys as rows):
//   Sᵀ = K Qᵀ and dPᵀ = V dOᵀ   both operands from shared memory (K-major), issued together; Pᵀ is
//                               exponentiated while dPᵀ is still in flight
//   dV += Pᵀ dO, dK += dSᵀ Q     Pᵀ and dSᵀ = Pᵀ (dPᵀ - Delta) from registers (the accumulator layout
//                               is the A fragment's; from shared memory with column groups), dO and Q
//                               from shared memory read transposed
//   dQ_partial = dS K           WRITE_DQ: dSᵀ goes to shared memory, where the tensor cores read it
//                               transposed as dS; every warpgroup takes HEAD_DIM / WARPGROUPS columns of
//                               dQ (64-row tiles) or 64 rows of every column (tiles of 64 rows per
//                               warpgroup) over all the block's keys, stages them in shared memory, and
//                               the copy engine adds them into the fp32 dq_accum (bulk reductions, one
//                               per row; convert_dq scales them later)
// so no product waits for a register shuffle, and no tile passes through ldmatrix. Shared tiles are in
// wgmma's 128-byte swizzled layout (common/wgmma_nvidia.h).
//
// Conventions are the forward's: the keys a row sees are common/key_window.h's bottom-right aligned
// window; keys no query sees get dK = dV = 0; a row with LSE = +inf gets dQ = 0. With dropout
// (common/dropout.h) the forward's keep bits are regenerated per query tile: dV takes the kept
// probabilities (times 1 / (1 - dropout_p), once at the end), and dSᵀ = Pᵀ (Z dPᵀ / (1 - dropout_p) -
// Delta), Z the keep mask.
#pragma once
#include "common/dropout.h"
#include "common/score_mods.h"
#include "flash/backward_common.h"
#include "flash/stage_swizzled_cp_async.h"

namespace hipattn {
namespace flash {

// Shared-memory layout of a block, in elements of T, then fp32 row statistics; every tile swizzled and
// 1024-byte aligned, rows of K, V, Q and dO in whole 64-column blocks (kRowElements: head_dim 96 is
// stored as 128, its last 32 columns never written):
//   K, V        BLOCK_N rows each
//   Q, dO       two slots of BLOCK_M rows each (double buffer)
//   dSᵀ         BLOCK_N rows of BLOCK_M queries (a 128-byte swizzle row per 64 queries)
//   Pᵀ          the same, with column groups only
//   LSE, Delta  fp32, two slots of BLOCK_M each: [slot][LSE | Delta]
//   dQ          without column groups: fp32, per warpgroup 64 rows of its kDqColumns (every column
//               with 64 query rows per warpgroup; else kRowElements / WARPGROUPS: at head_dim 96 the
//               second warpgroup's last 32 lie past the head and never leave), each row padded by 8
//               words: a warp's two-word stores of rows g and g + 8 then meet no bank twice, and a row
//               stays a contiguous 16-byte-aligned run for the copy engine (staged in deterministic
//               mode too: a block fits an SM either way)
// The host's row (hipattn/catalog/flash_backward.py, FlashDkdvWgmmaTiles.shared_bytes) computes kBytes
// from the same arguments.
template <typename T, int HEAD_DIM, int WARPGROUPS, int COLUMN_GROUPS, int BLOCK_M>
struct WgmmaKeyBlockTiles {
  static constexpr bool kSharedKeys = COLUMN_GROUPS > 1;  // the warpgroups split columns, not keys
  static constexpr int kKeyGroups = WARPGROUPS / COLUMN_GROUPS;
  static constexpr int kBlockN = 64 * kKeyGroups;
  static constexpr int kBlockM = BLOCK_M;
  // dQ's share per warpgroup, one wgmma's M of 64 rows: with 64-row query tiles every warpgroup takes
  // kDqColumns of its columns; with 64 rows per warpgroup (Sᵀ and dPᵀ of twice the queries, where dK
  // and dV leave the registers for them: head_dim 64) each takes its own 64 rows, every column.
  static constexpr bool kDqByRows = BLOCK_M == 64 * WARPGROUPS && BLOCK_M > 64;
  static constexpr int kThreads = 128 * WARPGROUPS;
  static constexpr int kRowElements = (HEAD_DIM + 63) / 64 * 64;
  // A warpgroup's columns of dK and dV, and its queries of Sᵀ and dPᵀ.
  static constexpr int kOwnColumns = kSharedKeys ? kRowElements / COLUMN_GROUPS : HEAD_DIM;
  static constexpr int kOwnQueries = kBlockM / COLUMN_GROUPS;
  static constexpr int kDqColumns = kDqByRows ? kRowElements : kRowElements / WARPGROUPS;  // per warpgroup
  static constexpr int kKeyElements = kBlockN * kRowElements;
  static constexpr int kQueryElements = kBlockM * kRowElements;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKeyElements;
  static constexpr int kQOffset = 2 * kKeyElements;
  static constexpr int kDoOffset = kQOffset + 2 * kQueryElements;
  static constexpr int kDsOffset = kDoOffset + 2 * kQueryElements;
  static constexpr int kPOffset = kDsOffset + kBlockN * kBlockM;
  static constexpr int kElements = kPOffset + (kSharedKeys ? kBlockN * kBlockM : 0);
  static constexpr int kStatsOffsetBytes = kElements * static_cast<int>(sizeof(T));
  static constexpr int kDqPitch = kDqColumns + 8;  // floats per staged dQ row
  static constexpr int kDqOffsetBytes = kStatsOffsetBytes + 2 * 2 * kBlockM * static_cast<int>(sizeof(float));
  static constexpr int kDqStagedRows = kSharedKeys ? 0 : WARPGROUPS * 64;
  static constexpr int kBytes = kDqOffsetBytes + kDqStagedRows * kDqPitch * static_cast<int>(sizeof(float));

  static_assert(sizeof(T) == 2, "the tensor-core path takes 16-bit inputs");
  static_assert(WARPGROUPS >= 1 && WARPGROUPS <= 2, "one or two warpgroups");
  static_assert(COLUMN_GROUPS >= 1 && WARPGROUPS % COLUMN_GROUPS == 0, "column groups split the warpgroups");
  static_assert(kOwnColumns == 64 || kOwnColumns == 96 || kOwnColumns == 128,
                "a warpgroup's dK and dV are one wgmma's N each (64 to 128 columns)");
  static_assert(!kSharedKeys || (kOwnColumns % 64 == 0 && kOwnQueries % 16 == 0),
                "column groups take whole 64-column blocks of dK and dV and whole k16 steps of queries");
  static_assert(kDqColumns % 64 == 0 || kDqColumns == 32,
                "a warpgroup's dQ columns are whole 64-column swizzle blocks of K or one half of a block: one "
                "wgmma's N");
  static_assert(BLOCK_M == 64 || (kDqByRows && !kSharedKeys), "64-row query tiles, or 64 rows per warpgroup");
  static_assert(kBytes <= 227 * 1024, "the tiles must fit sm_90's 227 KiB of shared memory");
  static_assert(kDqOffsetBytes % 16 == 0 && kDqPitch * sizeof(float) % 16 == 0,
                "staged dQ rows are 16-byte aligned, as the copy engine's bulk reductions need");
};

// Dropout's keep bits of a lane's entries, four per 8-query tile: a 32-bit word up to eight tiles.
template <bool ABOVE_EIGHT_TILES>
struct KeepBitsWord {
  using type = unsigned int;
};
template <>
struct KeepBitsWord<true> {
  using type = unsigned long long;
};

// Pᵀ of a warpgroup's 64 keys x its queries, from Sᵀ in the accumulators (this lane's keys `key` and
// key + 8; its queries m0 + 8n + 2t and the next, for query tile n): P = exp2(score - LSE), 0 where the
// pair is not visible (by selection: a stale NaN is discarded, never multiplied). Pᵀ goes to `p_packed`
// in T, the A operand of dV += Pᵀ dO; `s` keeps P times d(score)/d(s), what dSᵀ needs of the entry (no
// array of gradients stays live). A functor for Scores::visit: with modifiers, the softcap's presence
// is one branch around the tile, so that ALiBi alone forms no tanh (a branch per score if-converts into
// forming both).
template <typename T, int Q_TILES>
struct TransposedProbabilities {
  float (&s)[Q_TILES][4];
  unsigned int (&p_packed)[Q_TILES][2];
  const float* lse_slot;  // the tile's LSE, one per query
  bool masked;            // some pair of the tile may be invisible
  int key, m0, t, len_q, len_k, diagonal;
  KeyWindow window;

  template <typename Score>
  HIPATTN_DEVICE void operator()(const Score& score) const {
    // The offset of key + 8 (e / 2) from query m0 + 8n + 2t + (e & 1)'s diagonal: a base plus constants.
    const float base = static_cast<float>(key - m0 - 2 * t - diagonal);
#pragma unroll
    for (int n = 0; n < Q_TILES; ++n) {
      const int column = 8 * n + 2 * t;  // this lane's queries in the tile: column, column + 1
      const float2 lse = *reinterpret_cast<const float2*>(lse_slot + column);
      const float lse_log2[2] = {lse.x * kLog2e, lse.y * kLog2e};
      float probability[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int query = m0 + column + (e & 1);
        const int row_key = key + 8 * (e / 2);
        const bool visible =
            !masked || (query < len_q && row_key < len_k && key_in_window(query, row_key, diagonal, window));
        const float offset = base + static_cast<float>(8 * (e / 2) - 8 * n - (e & 1));
        float gradient = 1.0f;  // d(score)/d(scaled dot product), dSᵀ's factor: 1 but with softcap
        probability[e] = visible ? fast_exp2(score(s[n][e], offset, gradient) - lse_log2[e & 1]) : 0.0f;
        s[n][e] = probability[e] * gradient;
      }
      p_packed[n][0] = mma::pack2<T>(probability[0], probability[1]);  // key row g
      p_packed[n][1] = mma::pack2<T>(probability[2], probability[3]);  // key row g + 8
    }
  }
};

}  // namespace flash

template <typename T, int HEAD_DIM, int WARPGROUPS, int COLUMN_GROUPS, int BLOCK_M, bool WRITE_DQ, bool SCORE_MODS>
__global__ void __launch_bounds__(128 * WARPGROUPS) flash_backward_dkdv_wgmma(const FlashBackwardParams p) {
  using Tiles = flash::WgmmaKeyBlockTiles<T, HEAD_DIM, WARPGROUPS, COLUMN_GROUPS, BLOCK_M>;
  constexpr bool kSharedKeys = Tiles::kSharedKeys;
  constexpr int kBlockN = Tiles::kBlockN;
  constexpr int kBlockM = Tiles::kBlockM;
  constexpr int kThreads = Tiles::kThreads;
  constexpr int kOwnQueries = Tiles::kOwnQueries;
  constexpr int kOwnColumns = Tiles::kOwnColumns;
  constexpr int kQTiles = kOwnQueries / 8;  // 8-query accumulator tiles of Sᵀ and dPᵀ
  constexpr int kDTiles = kOwnColumns / 8;  // 8-column accumulator tiles of dK and dV
  constexpr int kDqColumns = Tiles::kDqColumns;
  extern __shared__ __align__(1024) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);
  float* const stats = reinterpret_cast<float*>(shared_bytes + Tiles::kStatsOffsetBytes);
  float* const dq_staging = reinterpret_cast<float*>(shared_bytes + Tiles::kDqOffsetBytes);

  const flash::KeyBlock block = flash::key_block_of<kBlockN, HEAD_DIM>(blockIdx.x, p);
  if (block.batch_index < 0) return;  // past the work list's last key block; before any barrier
  const int batch_index = block.batch_index;
  const Sequence seq_q = query_sequence(p, batch_index, p.max_seqlen_q);
  const Sequence seq_k = key_sequence(p, batch_index, p.max_seqlen_k);
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;
  const int n0 = block.n_block * kBlockN;
  if (n0 >= len_k) return;  // no key of this sequence here; uniform over the block, before any barrier
  const int keys = len_k - n0 < kBlockN ? len_k - n0 : kBlockN;

  // Every query head of the KV head's group walks the same query tiles; the work list is (group head,
  // query tile) flattened, so the copies run ahead across heads.
  const int diagonal = len_k - len_q;  // the window's alignment (common/key_window.h)
  const KeyWindow window = key_window(p);
  const flash::QueryTiles seeing = flash::query_tiles_seeing<kBlockM>(n0, keys, len_q, diagonal, window);
  const int group = p.heads_q / p.heads_kv;
  const int first_head = block.head_kv * group;
  const int tiles = group * seeing.count;  // zero: no query sees these keys, and dK = dV = 0 is written

  T* const k_tile = shared + Tiles::kKOffset;
  T* const v_tile = shared + Tiles::kVOffset;
  T* const q_slots = shared + Tiles::kQOffset;
  T* const do_slots = shared + Tiles::kDoOffset;
  T* const ds_tile = shared + Tiles::kDsOffset;
  T* const p_tile = shared + Tiles::kPOffset;  // with column groups only

  // K and V rows past the sequence are zeroed: they meet probabilities of exactly 0 in dS and dQ,
  // and 0 x stale NaN would be NaN.
  {
    const long long token = seq_k.start + n0;
    flash::stage_swizzled_tile<T, HEAD_DIM, kBlockN, kThreads, flash::TileTail::kZeroByStore>(
        k_tile, static_cast<const T*>(p.k) + batch_index * p.k_batch_stride + token * p.k_token_stride +
                    block.head_kv * p.k_head_stride,
        p.k_token_stride, keys);
    flash::stage_swizzled_tile<T, HEAD_DIM, kBlockN, kThreads, flash::TileTail::kZeroByStore>(
        v_tile, static_cast<const T*>(p.v) + batch_index * p.v_batch_stride + token * p.v_token_stride +
                    block.head_kv * p.v_head_stride,
        p.v_token_stride, keys);
  }

  // Work item i: its query head and first row.
  auto head_of = [&](int i) { return first_head + i / seeing.count; };
  auto m0_of = [&](int i) { return (seeing.first + i % seeing.count) * kBlockM; };
  // Issue the copies of work item i into slot i % 2 (nothing past the last item) and always commit,
  // so that at the top of iteration i exactly one group, item i's, is in flight.
  auto load_query_tile = [&](int i) {
    if (i < tiles) {
      const int head = head_of(i);
      const int m0 = m0_of(i);
      const int rows = len_q - m0 < kBlockM ? len_q - m0 : kBlockM;
      const int slot = i % 2;
      const long long token = seq_q.start + m0;
      // Q and dO rows past the sequence are zeroed: they are B operands of dK and dV, met by P = 0.
      flash::stage_swizzled_tile<T, HEAD_DIM, kBlockM, kThreads, flash::TileTail::kZeroByStore>(
          q_slots + slot * Tiles::kQueryElements,
          static_cast<const T*>(p.q) + batch_index * p.q_batch_stride + token * p.q_token_stride +
              head * p.q_head_stride,
          p.q_token_stride, rows);
      flash::stage_swizzled_tile<T, HEAD_DIM, kBlockM, kThreads, flash::TileTail::kZeroByStore>(
          do_slots + slot * Tiles::kQueryElements,
          static_cast<const T*>(p.dout) + batch_index * p.dout_batch_stride + token * p.dout_token_stride +
              head * p.dout_head_stride,
          p.dout_token_stride, rows);
      float* const lse_slot = stats + slot * 2 * kBlockM;
      float* const delta_slot = lse_slot + kBlockM;
      const float* const lse_row =
          static_cast<const float*>(p.lse) + batch_index * p.lse_batch_stride + head * p.lse_head_stride + token;
      const float* const delta_row = static_cast<const float*>(p.softmax_d) +
                                     batch_index * p.softmax_d_batch_stride + head * p.softmax_d_head_stride + token;
      for (int r = threadIdx.x; r < kBlockM; r += kThreads) {
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

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;  // within the warpgroup
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // accumulator rows g and g + 8 of the warp's 16
  const int t = lane % 4;  // accumulator column pair 2t, 2t + 1 of each 8-column tile
  const int column_group = warpgroup / Tiles::kKeyGroups;
  const int own_first_key = 64 * (warpgroup % Tiles::kKeyGroups);  // the warpgroup's keys in the block's tile
  const int own_first_query = kOwnQueries * column_group;         // ... its queries of a query tile
  const int own_first_column = kSharedKeys ? kOwnColumns * column_group : 0;  // ... its columns of dK, dV
  const int dq_first_column = Tiles::kDqByRows ? 0 : kDqColumns * warpgroup;
  const int dq_first_row = Tiles::kDqByRows ? 64 * warpgroup : 0;  // of the query tile
  // The warpgroup's dQ columns that lie in the head: all of them but at head_dim 96, where the second
  // warpgroup's m64n64 share also reads K's unwritten columns 96-127, into columns it leaves out.
  const int dq_head_columns =
      HEAD_DIM == Tiles::kRowElements ? kDqColumns : min(kDqColumns, HEAD_DIM - dq_first_column);
  const int own_n0 = n0 + own_first_key;
  const Scores<SCORE_MODS> block_scores = scores_of<SCORE_MODS>(p, batch_index, first_head);
  const Dropout<SCORE_MODS> block_dropout = dropout_of<SCORE_MODS>(p, batch_index, first_head);

  float dk[kDTiles][4];
  float dv[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.0f;

  // Descriptors. K and V rows (the warpgroup's 64) are the K-major A of Sᵀ and dPᵀ, whose B, the Q and
  // dO rows (the warpgroup's queries), are K-major too: a k16 step is 32 bytes along a 128-byte row,
  // then the next column block. Q and dO are also the MN-major B of dK and dV (the warpgroup's
  // columns): a k16 step is 16 queries (two 8-row atoms), column blocks BLOCK_M rows apart; with column
  // groups their A, Pᵀ and dSᵀ in shared memory, is K-major. dQ reads dSᵀ as the MN-major A (queries
  // contiguous: one column block, k16 steps of 16 keys) and the warpgroup's columns of K as its MN-major
  // B: whole column blocks, or at head_dim 64 one half of the block (the second half starts 64 bytes
  // into its rows).
  constexpr int kSlotBytes = Tiles::kQueryElements * static_cast<int>(sizeof(T));
  const wgmma::u64 k_rows = wgmma::descriptor(mma::shared_address(k_tile + own_first_key * 64), wgmma::kRowBytes,
                                              wgmma::kAtomBytes);
  const wgmma::u64 v_rows = wgmma::descriptor(mma::shared_address(v_tile + own_first_key * 64), wgmma::kRowBytes,
                                              wgmma::kAtomBytes);
  const wgmma::u64 q_rows = wgmma::descriptor(mma::shared_address(q_slots + own_first_query * 64),
                                              wgmma::kRowBytes, wgmma::kAtomBytes);
  const wgmma::u64 do_rows = wgmma::descriptor(mma::shared_address(do_slots + own_first_query * 64),
                                               wgmma::kRowBytes, wgmma::kAtomBytes);
  const int own_column_block = own_first_column / 64 * kBlockM * 64;  // elements
  const wgmma::u64 q_columns = wgmma::descriptor(mma::shared_address(q_slots + own_column_block),
                                                 kBlockM * wgmma::kRowBytes, wgmma::kAtomBytes);
  const wgmma::u64 do_columns = wgmma::descriptor(mma::shared_address(do_slots + own_column_block),
                                                  kBlockM * wgmma::kRowBytes, wgmma::kAtomBytes);
  const wgmma::u64 p_rows = wgmma::descriptor(mma::shared_address(p_tile), wgmma::kRowBytes, wgmma::kAtomBytes);
  const wgmma::u64 ds_rows = wgmma::descriptor(mma::shared_address(ds_tile), wgmma::kRowBytes, wgmma::kAtomBytes);
  const wgmma::u64 ds_columns =
      wgmma::descriptor(mma::shared_address(ds_tile + wgmma::swizzled_offset<kBlockN>(0, dq_first_row)),
                        kBlockN * wgmma::kRowBytes, wgmma::kAtomBytes);
  const wgmma::u64 k_columns =
      wgmma::descriptor(mma::shared_address(k_tile + wgmma::swizzled_offset<kBlockN>(0, dq_first_column)),
                        kBlockN * wgmma::kRowBytes, wgmma::kAtomBytes);

  for (int i = 0; i < tiles; ++i) {
    const int head = head_of(i);
    const int m0 = m0_of(i);
    const int slot = i % 2;
    const float* const lse_slot = stats + slot * 2 * kBlockM;
    const float* const delta_slot = lse_slot + kBlockM;
    const Scores<SCORE_MODS> scores = block_scores.with_head(p, batch_index, head);
    const Dropout<SCORE_MODS> dropout = block_dropout.with_head(p, batch_index, head);

    mma::wait_async_copies();  // item i (and K, V) have landed for this thread: the only group in flight
    wgmma::fence_shared_for_async_proxy();
    __syncthreads();  // ... for every thread; every warpgroup is done with item i - 1's slot and dSᵀ
    load_query_tile(i + 1);

    const int key = own_n0 + 16 * warp + g;  // this lane's keys: key, key + 8
    // Dropout's keep bits of this lane's entries (bit 4n + e for entry e of query tile n), before the
    // products are issued: made while they run, the Philox rounds measured slower on the H200.
    static_assert(kQTiles <= 16, "four keep bits per 8-query tile fit one 64-bit word");
    using KeepBits = typename flash::KeepBitsWord<(kQTiles > 8)>::type;
    const int q0 = m0 + own_first_query;  // the warpgroup's first query
    const KeepBits kept_bits = static_cast<KeepBits>(
        dropout.active() ? dropout.template transposed_m16n8_bits<kQTiles>(key, q0, t) : ~0ull);

    // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, 64 keys x the warpgroup's queries, two groups ----
    float s[kQTiles][4];
    float dp[kQTiles][4];
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
      wgmma::mma_ss<T, kOwnQueries>(s, wgmma::advance(k_rows, wgmma::k_major_step<kBlockN>(ks)),
                                    wgmma::advance(q_rows, slot * kSlotBytes + wgmma::k_major_step<kBlockM>(ks)),
                                    ks > 0);
    wgmma::commit();
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
      wgmma::mma_ss<T, kOwnQueries>(dp, wgmma::advance(v_rows, wgmma::k_major_step<kBlockN>(ks)),
                                    wgmma::advance(do_rows, slot * kSlotBytes + wgmma::k_major_step<kBlockM>(ks)),
                                    ks > 0);
    wgmma::commit();
    // ---- Pᵀ, while dPᵀ is in flight. The warpgroup's tile needs the mask when it reaches past either
    // sequence or past a side of the window: its first row's last key or its last row's first key lies
    // outside. ----
    wgmma::wait<1>();
    wgmma::pin(s);
    const bool masked = q0 + kOwnQueries > len_q || own_n0 + 64 > len_k ||
                        !key_in_window(q0, own_n0 + 63, diagonal, window) ||
                        !key_in_window(q0 + kOwnQueries - 1, own_n0, diagonal, window);
    unsigned int p_packed[kQTiles][2];  // Pᵀ in T: the A operand of dV += Pᵀ dO
    scores.visit(flash::TransposedProbabilities<T, kQTiles>{s, p_packed, lse_slot + own_first_query, masked, key, q0,
                                                           t, len_q, len_k, diagonal, window});
    // Dropout, one branch per tile (selects per entry, which ptxas if-converts, ran with dropout off
    // too, and cost the modified kernel 3-4% on the H200): dV takes the kept probabilities, their
    // 1 / (1 - dropout_p) applied to dV once in the epilogue; a dropped entry's s is negated, which
    // marks it for dSᵀ without keeping the bits live until dPᵀ lands (the modified kernel runs at its
    // 255-register bound), and P >= 0 times the gradient >= 0 is 0 or positive, so the sign is free.
    if (dropout.active()) {
      unsigned int mask[2 * kQTiles];
      m16n8_masks(kept_bits, mask);  // pair 2n + r: the keep bits of p_packed[n][r]
#pragma unroll
      for (int n = 0; n < kQTiles; ++n) {
        p_packed[n][0] &= mask[2 * n];
        p_packed[n][1] &= mask[2 * n + 1];
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = ((kept_bits >> (4 * n + e)) & 1u) != 0u ? s[n][e] : -s[n][e];
      }
    }
    wgmma::wait<0>();
    wgmma::pin(dp);
    // With dropout, dPᵀ reaches only the kept entries (s > 0), scaled as the forward scaled them.
    if (dropout.active()) {
#pragma unroll
      for (int n = 0; n < kQTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dp[n][e] = s[n][e] > 0.0f ? dp[n][e] * dropout.scale() : 0.0f;
          s[n][e] = fabsf(s[n][e]);
        }
    }
    unsigned int ds_packed[kQTiles][2];  // dSᵀ in T: the A operand of dK += dSᵀ Q
#pragma unroll
    for (int n = 0; n < kQTiles; ++n) {
      const float2 delta = *reinterpret_cast<const float2*>(delta_slot + own_first_query + 8 * n + 2 * t);
      ds_packed[n][0] = mma::pack2<T>(s[n][0] * (dp[n][0] - delta.x), s[n][1] * (dp[n][1] - delta.y));
      ds_packed[n][1] = mma::pack2<T>(s[n][2] * (dp[n][2] - delta.x), s[n][3] * (dp[n][3] - delta.y));
    }

    // dSᵀ (and with column groups Pᵀ) to shared memory, [key][query]: each lane's pairs are two queries
    // of one key.
    auto store_transposed = [&](T* tile, const unsigned int (&packed)[kQTiles][2]) {
#pragma unroll
      for (int n = 0; n < kQTiles; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<unsigned int*>(tile + wgmma::swizzled_offset<kBlockN>(own_first_key + 16 * warp + g + 8 * r,
                                                                                  own_first_query + 8 * n + 2 * t)) =
              packed[n][r];
    };
    if constexpr (kSharedKeys) {
      store_transposed(p_tile, p_packed);
      store_transposed(ds_tile, ds_packed);
      wgmma::fence_shared_for_async_proxy();
      __syncthreads();  // every warpgroup's queries of Pᵀ and dSᵀ are in shared memory
    }

    // ---- dV += Pᵀ dO and dK += dSᵀ Q over the tile's 64 queries, one group ----
    wgmma::pin(dv);
    wgmma::pin(dk);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const wgmma::u64 b = wgmma::advance(do_columns, slot * kSlotBytes + 2 * wgmma::kAtomBytes * kk);
      if constexpr (kSharedKeys) {
        wgmma::mma_ss_k_mn<T, kOwnColumns>(dv, wgmma::advance(p_rows, wgmma::k_major_step<kBlockN>(kk)), b, 1);
      } else {
        const unsigned int a[4] = {p_packed[2 * kk][0], p_packed[2 * kk][1], p_packed[2 * kk + 1][0],
                                   p_packed[2 * kk + 1][1]};
        wgmma::mma_rs<T, kOwnColumns>(dv, a, b, 1);
      }
    }
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const wgmma::u64 b = wgmma::advance(q_columns, slot * kSlotBytes + 2 * wgmma::kAtomBytes * kk);
      if constexpr (kSharedKeys) {
        wgmma::mma_ss_k_mn<T, kOwnColumns>(dk, wgmma::advance(ds_rows, wgmma::k_major_step<kBlockN>(kk)), b, 1);
      } else {
        const unsigned int a[4] = {ds_packed[2 * kk][0], ds_packed[2 * kk][1], ds_packed[2 * kk + 1][0],
                                   ds_packed[2 * kk + 1][1]};
        wgmma::mma_rs<T, kOwnColumns>(dk, a, b, 1);
      }
    }
    wgmma::commit();

    // ---- dQ of the tile's rows += dS K over the block's keys, added into dq_accum ----
    if constexpr (WRITE_DQ) {
      if constexpr (!kSharedKeys) {
        store_transposed(ds_tile, ds_packed);
        wgmma::fence_shared_for_async_proxy();
        __syncthreads();  // every warpgroup's dSᵀ is in shared memory
      }
      float dq[kDqColumns / 8][4];
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma::mma_ss_mn<T, kDqColumns>(dq, wgmma::advance(ds_columns, 2 * wgmma::kAtomBytes * kk),
                                        wgmma::advance(k_columns, 2 * wgmma::kAtomBytes * kk), kk > 0);
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::pin(dq);
      float* const dq_rows = static_cast<float*>(p.dq_accum) + batch_index * p.dq_accum_batch_stride +
                             static_cast<long long>(seq_q.start + m0 + dq_first_row) * p.dq_accum_token_stride +
                             head * p.dq_accum_head_stride + dq_first_column;
      if constexpr (kSharedKeys) {
        // Straight from the registers, four words per reduction: lanes 2j and 2j + 1 trade pairs so
        // that the even lane holds four adjacent columns of row g and the odd one four of row g + 8.
        // Rows past the sequence are skipped.
        const int odd = t & 1;
        const int row = 16 * warp + g + 8 * odd;
        const int column = 2 * (t & ~1);
#pragma unroll
        for (int n = 0; n < kDqColumns / 8; ++n) {
          // The even lane sends its row g + 8 pair and keeps row g's; the odd lane the other way round.
          const float send_x = odd ? dq[n][0] : dq[n][2];
          const float send_y = odd ? dq[n][1] : dq[n][3];
          const float got_x = shfl_xor(send_x, 1, 32, 0xffffffffu);
          const float got_y = shfl_xor(send_y, 1, 32, 0xffffffffu);
          const float keep_x = odd ? dq[n][2] : dq[n][0];
          const float keep_y = odd ? dq[n][3] : dq[n][1];
          if (m0 + row < len_q)
            wgmma::reduce_add_quad(dq_rows + row * p.dq_accum_token_stride + 8 * n + column,
                                   odd ? got_x : keep_x, odd ? got_y : keep_y, odd ? keep_x : got_x,
                                   odd ? keep_y : got_y);
        }
      } else {
        // The share leaves through shared memory: each warp stages its 16 rows, and 16 of its lanes hand
        // one row each to the copy engine, which adds it into dq_accum. Reductions straight from the
        // registers (red.global) held them until the load/store unit took them, and the next writes to
        // those registers waited (12% of the kernel's stall samples, ncu; BENCHMARKS.md, run 6). One
        // lane issuing all 16 rows measured slower than 16 lanes. dq_accum is the workspace's contiguous
        // section, so its rows are 16-byte aligned.
        const int own_row = 16 * warp + lane;  // the row lanes 0-15 hand over
        float* const warp_rows = dq_staging + (64 * warpgroup + 16 * warp) * Tiles::kDqPitch;
        if (lane < 16) wgmma::bulk_wait_read<0>();  // the copy engine has read this row of the last tile
        __syncwarp();
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int n = 0; n < kDqColumns / 8; ++n) {
            float2 pair;
            pair.x = dq[n][2 * r];
            pair.y = dq[n][2 * r + 1];
            *reinterpret_cast<float2*>(warp_rows + (g + 8 * r) * Tiles::kDqPitch + 8 * n + 2 * t) = pair;
          }
        wgmma::fence_shared_for_async_proxy();
        __syncwarp();
        if (lane < 16) {
          // Rows past the sequence belong to the next one (THD) or to padding.
          if (m0 + dq_first_row + own_row < len_q)
            wgmma::bulk_reduce_add(dq_rows + own_row * p.dq_accum_token_stride,
                                   mma::shared_address(warp_rows + lane * Tiles::kDqPitch),
                                   dq_head_columns * static_cast<int>(sizeof(float)));
          wgmma::bulk_commit();
        }
      }
    } else {
      wgmma::wait<0>();
    }
    wgmma::pin(dv);
    wgmma::pin(dk);
    wgmma::pin(p_packed);
    wgmma::pin(ds_packed);
  }
  // Every thread's copies have landed (the last commit was empty), and the barrier: every warpgroup
  // is done reading K and V, which now stage dK and dV for wide stores. dQ's last additions are
  // complete before the block's shared memory is released.
  if (WRITE_DQ && !kSharedKeys && lane < 16) wgmma::bulk_wait_all();
  mma::wait_async_copies();
  __syncthreads();

  // ---- epilogue: dK = scale * dSᵀ Q and dV (times dropout's 1 / (1 - p)) through the K and V tiles,
  // rows past the sequence skipped ----
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int offset =
          wgmma::swizzled_offset<kBlockN>(own_first_key + 16 * warp + g + 8 * r, own_first_column + 8 * d + 2 * t);
      *reinterpret_cast<unsigned int*>(k_tile + offset) =
          mma::pack2<T>(dk[d][2 * r] * p.softmax_scale, dk[d][2 * r + 1] * p.softmax_scale);
      *reinterpret_cast<unsigned int*>(v_tile + offset) =
          mma::pack2<T>(dv[d][2 * r] * block_dropout.scale(), dv[d][2 * r + 1] * block_dropout.scale());
    }
  __syncthreads();
  constexpr int kChunks = HEAD_DIM / 8;
  const long long token = seq_k.start + n0;
  T* const dk_rows = static_cast<T*>(p.dk) + batch_index * p.dk_batch_stride + token * p.dk_token_stride +
                     block.head_kv * p.dk_head_stride;
  T* const dv_rows = static_cast<T*>(p.dv) + batch_index * p.dv_batch_stride + token * p.dv_token_stride +
                     block.head_kv * p.dv_head_stride;
  for (int c = threadIdx.x; c < keys * kChunks; c += kThreads) {
    const int row = c / kChunks;
    const int col = (c % kChunks) * 8;
    const int offset = wgmma::swizzled_offset<kBlockN>(row, col);
    *reinterpret_cast<Vec<T, 8>*>(dk_rows + row * p.dk_token_stride + col) =
        *reinterpret_cast<const Vec<T, 8>*>(k_tile + offset);
    *reinterpret_cast<Vec<T, 8>*>(dv_rows + row * p.dv_token_stride + col) =
        *reinterpret_cast<const Vec<T, 8>*>(v_tile + offset);
  }
}

}  // namespace hipattn
