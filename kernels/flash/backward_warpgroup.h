// What a warpgroup of Hopper's dK/dV kernels (sm_90a) does with one query tile, shared by the kernel
// whose threads all copy (backward_wgmma.hip) and the warp-specialised one whose producer warpgroup
// copies (backward_warp_specialised.hip): the two differ in how a query tile reaches shared memory and
// how the warpgroups learn that it has, not in the products.
//
// Per query tile, each warpgroup, in the transposed frame (keys as rows):
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
// Up to head_dim 128 each warpgroup owns 64 of the tile's keys (64 * WARPGROUPS), as the rows of its
// accumulators, and every column of their dK and dV. Above, dK and dV of 64 keys over every column
// would take more registers than a thread has: COLUMN_GROUPS warpgroups then share the tile's 64 keys,
// each owning a slice of dK's and dV's columns and computing Sᵀ and dPᵀ for a slice of the queries;
// Pᵀ and dSᵀ meet in shared memory, where every warpgroup reads all of them as the A operands of dV and
// dK, and each warpgroup's share of dQ goes to dq_accum from its registers (no shared memory is left
// to stage it).
//
// Conventions are the forward's: the keys a row sees are common/key_window.h's bottom-right aligned
// window; keys no query sees get dK = dV = 0; a row with LSE = +inf gets dQ = 0. With dropout
// (common/dropout.h) the forward's keep bits are regenerated per query tile: dV takes the kept
// probabilities (times 1 / (1 - dropout_p), once at the end), and dSᵀ = Pᵀ (Z dPᵀ / (1 - dropout_p) -
// Delta), Z the keep mask.
#pragma once
#include "common/dropout.h"
#include "common/score_mods.h"
#include "common/wgmma_nvidia.h"
#include "flash/backward_common.h"
#include "flash/tile_visibility.h"

namespace hipattn {
namespace flash {

// The warpgroups' split of a key tile and a query tile, which both kernels' layouts build on: with
// one column group each warpgroup owns 64 keys (the tile is 64 * WARPGROUPS keys), with more they
// share 64 keys and split the columns of dK and dV and the queries of Sᵀ and dPᵀ.
template <typename T, int HEAD_DIM, int WARPGROUPS, int COLUMN_GROUPS, int BLOCK_M>
struct KeyBlockShape {
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr bool kSharedKeys = COLUMN_GROUPS > 1;  // the warpgroups split columns, not keys
  static constexpr int kKeyGroups = WARPGROUPS / COLUMN_GROUPS;
  static constexpr int kBlockN = 64 * kKeyGroups;
  static constexpr int kBlockM = BLOCK_M;
  // dQ's share per warpgroup, one wgmma's M of 64 rows: with 64-row query tiles every warpgroup takes
  // kDqColumns of its columns; with 64 rows per warpgroup (Sᵀ and dPᵀ of twice the queries, where dK
  // and dV leave the registers for them: head_dim 64) each takes its own 64 rows, every column.
  static constexpr bool kDqByRows = BLOCK_M == 64 * WARPGROUPS && BLOCK_M > 64;
  static constexpr int kRowElements = (HEAD_DIM + 63) / 64 * 64;
  // A warpgroup's columns of dK and dV, and its queries of Sᵀ and dPᵀ.
  static constexpr int kOwnColumns = kSharedKeys ? kRowElements / COLUMN_GROUPS : HEAD_DIM;
  static constexpr int kOwnQueries = kBlockM / COLUMN_GROUPS;
  static constexpr int kDqColumns = kDqByRows ? kRowElements : kRowElements / WARPGROUPS;  // per warpgroup
  static constexpr int kKeyElements = kBlockN * kRowElements;
  static constexpr int kQueryElements = kBlockM * kRowElements;
  static constexpr int kScoreElements = kBlockN * kBlockM;  // dSᵀ (and Pᵀ): keys x queries
  static constexpr int kDqPitch = kDqColumns + 8;           // floats per staged dQ row

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
  static_assert(kDqPitch * sizeof(float) % 16 == 0,
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
// key + 8; its queries m0 + 8n + 2t and the next, for query tile n): P = exp2(score - LSE), then 0
// where the pair is not visible (`visible`, transposed_visible_bits' word; by selection: a stale NaN is
// overwritten, never multiplied). The exponentials stay straight-line in every tile: a test around
// each compiled into a branch per entry, unmasked tiles included. Pᵀ goes to `p_packed` in T, the A
// operand of dV += Pᵀ dO; `s` keeps P times d(score)/d(s), what dSᵀ needs of the entry (no array of
// gradients stays live). A functor for Scores::visit: with modifiers, the softcap's presence is one
// branch around the tile, so that ALiBi alone forms no tanh (a branch per score if-converts into
// forming both).
template <typename T, int Q_TILES, typename Bits>
struct TransposedProbabilities {
  float (&s)[Q_TILES][4];
  unsigned int (&p_packed)[Q_TILES][2];
  const float* lse_slot;  // the tile's LSE, one per query
  bool masked;            // some pair of the tile may be invisible
  Bits visible;           // with `masked`: which are visible
  int key, m0, t, diagonal;

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
        const float offset = base + static_cast<float>(8 * (e / 2) - 8 * n - (e & 1));
        float gradient = 1.0f;  // d(score)/d(scaled dot product), dSᵀ's factor: 1 but with softcap
        probability[e] = fast_exp2(score(s[n][e], offset, gradient) - lse_log2[e & 1]);
        s[n][e] = probability[e] * gradient;
      }
      p_packed[n][0] = mma::pack2<T>(probability[0], probability[1]);  // key row g
      p_packed[n][1] = mma::pack2<T>(probability[2], probability[3]);  // key row g + 8
    }
    if (masked) {
      unsigned int mask[2 * Q_TILES];
      m16n8_masks(visible, mask);  // pair 2n + r: the visibility of p_packed[n][r]
#pragma unroll
      for (int n = 0; n < Q_TILES; ++n) {
        p_packed[n][0] &= mask[2 * n];
        p_packed[n][1] &= mask[2 * n + 1];
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = ((visible >> (4 * n + e)) & 1u) != 0u ? s[n][e] : 0.0f;
      }
    }
  }
};

// Where a block's tiles sit in shared memory, as the warpgroups read them: K and V (Shape::kBlockN rows
// each), the query tiles' slots of Q and dO (Shape::kQueryElements apart), dSᵀ (and with column groups
// Pᵀ) of one query tile, and each warpgroup's staged dQ rows.
template <typename T>
struct KeyBlockTilesAt {
  T* k;
  T* v;
  T* q_slots;
  T* do_slots;
  T* ds;
  T* p;
  float* dq_staging;
};

// One warpgroup's part of a dK/dV block: its keys, queries and columns, the operands' descriptors, and
// the query-tile step; dK and dV stay with the kernel, which hands them to every step.
template <class Shape, typename T, bool WRITE_DQ, bool SCORE_MODS>
struct KeyBlockWarpgroup {
  static constexpr bool kSharedKeys = Shape::kSharedKeys;
  static constexpr int kBlockN = Shape::kBlockN;
  static constexpr int kBlockM = Shape::kBlockM;
  static constexpr int kOwnQueries = Shape::kOwnQueries;
  static constexpr int kOwnColumns = Shape::kOwnColumns;
  static constexpr int kQTiles = kOwnQueries / 8;  // 8-query accumulator tiles of Sᵀ and dPᵀ
  static constexpr int kDTiles = kOwnColumns / 8;  // 8-column accumulator tiles of dK and dV
  static constexpr int kDqColumns = Shape::kDqColumns;
  static constexpr int kSlotBytes = Shape::kQueryElements * static_cast<int>(sizeof(T));

  const FlashBackwardParams& p;
  KeyBlockTilesAt<T> at;
  int batch_index, len_q, len_k, diagonal, query_start;
  KeyWindow window;
  int warpgroup, warp, lane, g, t;
  int own_first_key, own_first_query, own_first_column, dq_first_column, dq_first_row, dq_head_columns, own_n0;
  Scores<SCORE_MODS> block_scores;
  Dropout<SCORE_MODS> block_dropout;
  // Descriptors. K and V rows (the warpgroup's 64) are the K-major A of Sᵀ and dPᵀ, whose B, the Q and
  // dO rows (the warpgroup's queries), are K-major too: a k16 step is 32 bytes along a 128-byte row,
  // then the next column block. Q and dO are also the MN-major B of dK and dV (the warpgroup's
  // columns): a k16 step is 16 queries (two 8-row atoms), column blocks BLOCK_M rows apart; with column
  // groups their A, Pᵀ and dSᵀ in shared memory, is K-major. dQ reads dSᵀ as the MN-major A (queries
  // contiguous: one column block, k16 steps of 16 keys) and the warpgroup's columns of K as its MN-major
  // B: whole column blocks, or at head_dim 64 one half of the block (the second half starts 64 bytes
  // into its rows). A kernel that keeps several dSᵀ tiles names the step's at each step, by its offset
  // from at.ds.
  wgmma::u64 k_rows, v_rows, q_rows, do_rows, q_columns, do_columns, p_rows, ds_rows, ds_columns, k_columns;

  // `thread`: the thread's index among the block's warpgroups that compute (128 per warpgroup),
  // unsigned as threadIdx is: the divisions below are then shifts.
  HIPATTN_DEVICE KeyBlockWarpgroup(const FlashBackwardParams& params, const KeyBlockTilesAt<T>& tiles,
                                   int batch, const Sequence& seq_q, int keys_len, int n0,
                                   int first_head, unsigned int thread)
      : p(params), at(tiles), batch_index(batch), len_q(seq_q.length), len_k(keys_len),
        diagonal(keys_len - seq_q.length), query_start(static_cast<int>(seq_q.start)), window(key_window(params)) {
    // Read from lane 0, so that the compiler knows it is the same over the warp: the descriptors and
    // offsets formed from it then live in uniform registers, which the wgmmas read.
    warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(thread / 128), 0);
    warp = (thread / 32) % 4;  // within the warpgroup
    lane = thread % 32;
    g = lane / 4;  // accumulator rows g and g + 8 of the warp's 16
    t = lane % 4;  // accumulator column pair 2t, 2t + 1 of each 8-column tile
    const int column_group = warpgroup / Shape::kKeyGroups;
    own_first_key = 64 * (warpgroup % Shape::kKeyGroups);  // the warpgroup's keys in the block's tile
    own_first_query = kOwnQueries * column_group;          // ... its queries of a query tile
    own_first_column = kSharedKeys ? kOwnColumns * column_group : 0;  // ... its columns of dK, dV
    dq_first_column = Shape::kDqByRows ? 0 : kDqColumns * warpgroup;
    dq_first_row = Shape::kDqByRows ? 64 * warpgroup : 0;  // of the query tile
    // The warpgroup's dQ columns that lie in the head: all of them but at head_dim 96, where the second
    // warpgroup's m64n64 share also reads K's unwritten columns 96-127, into columns it leaves out.
    dq_head_columns =
        Shape::kHeadDim == Shape::kRowElements ? kDqColumns : min(kDqColumns, Shape::kHeadDim - dq_first_column);
    own_n0 = n0 + own_first_key;
    block_scores = scores_of<SCORE_MODS>(params, batch, first_head);
    block_dropout = dropout_of<SCORE_MODS>(params, batch, first_head);
    k_rows = wgmma::descriptor(mma::shared_address(at.k + own_first_key * 64), wgmma::kRowBytes, wgmma::kAtomBytes);
    v_rows = wgmma::descriptor(mma::shared_address(at.v + own_first_key * 64), wgmma::kRowBytes, wgmma::kAtomBytes);
    q_rows = wgmma::descriptor(mma::shared_address(at.q_slots + own_first_query * 64), wgmma::kRowBytes,
                               wgmma::kAtomBytes);
    do_rows = wgmma::descriptor(mma::shared_address(at.do_slots + own_first_query * 64), wgmma::kRowBytes,
                                wgmma::kAtomBytes);
    const int own_column_block = own_first_column / 64 * kBlockM * 64;  // elements
    q_columns = wgmma::descriptor(mma::shared_address(at.q_slots + own_column_block), kBlockM * wgmma::kRowBytes,
                                  wgmma::kAtomBytes);
    do_columns = wgmma::descriptor(mma::shared_address(at.do_slots + own_column_block), kBlockM * wgmma::kRowBytes,
                                   wgmma::kAtomBytes);
    p_rows = wgmma::descriptor(mma::shared_address(at.p), wgmma::kRowBytes, wgmma::kAtomBytes);
    ds_rows = wgmma::descriptor(mma::shared_address(at.ds), wgmma::kRowBytes, wgmma::kAtomBytes);
    ds_columns = wgmma::descriptor(mma::shared_address(at.ds + wgmma::swizzled_offset<kBlockN>(0, dq_first_row)),
                                   kBlockN * wgmma::kRowBytes, wgmma::kAtomBytes);
    k_columns = wgmma::descriptor(mma::shared_address(at.k + wgmma::swizzled_offset<kBlockN>(0, dq_first_column)),
                                  kBlockN * wgmma::kRowBytes, wgmma::kAtomBytes);
  }

  // One query tile of `head` from row m0: its Q and dO in slot `slot`, its LSE and Delta at lse_slot
  // and delta_slot, dSᵀ (and Pᵀ) at `score_offset` elements past at.ds (at.p); dV and dK accumulate
  // into the kernel's registers. `sync_warpgroups()` meets every computing warpgroup: before dV and
  // dK read Pᵀ and dSᵀ from shared memory (column groups), or before dQ reads dSᵀ. On return every
  // product of the tile has completed (the slot may be refilled), dQ's share may still be on its way
  // to dq_accum from the staging rows, and dSᵀ may still be read by another warpgroup's dQ.
  template <class SyncWarpgroups>
  HIPATTN_DEVICE void query_tile(float (&dk)[kDTiles][4], float (&dv)[kDTiles][4], int head, int m0, int slot,
                                 const float* lse_slot, const float* delta_slot, int score_offset,
                                 SyncWarpgroups sync_warpgroups) const {
    const Scores<SCORE_MODS> scores = block_scores.with_head(p, batch_index, head);
    const Dropout<SCORE_MODS> dropout = block_dropout.with_head(p, batch_index, head);
    const int key = own_n0 + 16 * warp + g;  // this lane's keys: key, key + 8
    // Dropout's keep bits of this lane's entries (bit 4n + e for entry e of query tile n), before the
    // products are issued: made while they run, the Philox rounds measured slower on the H200.
    static_assert(kQTiles <= 16, "four keep bits per 8-query tile fit one 64-bit word");
    using KeepBits = typename KeepBitsWord<(kQTiles > 8)>::type;
    const int q0 = m0 + own_first_query;  // the warpgroup's first query
    const KeepBits kept_bits = static_cast<KeepBits>(
        dropout.active() ? dropout.template transposed_m16n8_bits<kQTiles>(key, q0, t) : ~0ull);
    // The tile needs the mask when it reaches past either sequence or past a side of the window: its
    // first row's last key or its last row's first key lies outside. Its entries' visibility is formed
    // here too, before the products are issued, where its bounds cost no registers that Sᵀ needs.
    const bool masked = q0 + kOwnQueries > len_q || own_n0 + 64 > len_k ||
                        !key_in_window(q0, own_n0 + 63, diagonal, window) ||
                        !key_in_window(q0 + kOwnQueries - 1, own_n0, diagonal, window);
    const KeepBits visible =
        masked ? transposed_visible_bits<KeepBits, kQTiles>(key, q0, t, len_q, len_k, diagonal, window) : ~KeepBits{0};
    const int score_bytes = score_offset * static_cast<int>(sizeof(T));

    // ---- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, 64 keys x the warpgroup's queries, two groups ----
    float s[kQTiles][4];
    float dp[kQTiles][4];
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < Shape::kHeadDim / 16; ++ks)
      wgmma::mma_ss<T, kOwnQueries>(s, wgmma::advance(k_rows, wgmma::k_major_step<kBlockN>(ks)),
                                    wgmma::advance(q_rows, slot * kSlotBytes + wgmma::k_major_step<kBlockM>(ks)),
                                    ks > 0);
    wgmma::commit();
#pragma unroll
    for (int ks = 0; ks < Shape::kHeadDim / 16; ++ks)
      wgmma::mma_ss<T, kOwnQueries>(dp, wgmma::advance(v_rows, wgmma::k_major_step<kBlockN>(ks)),
                                    wgmma::advance(do_rows, slot * kSlotBytes + wgmma::k_major_step<kBlockM>(ks)),
                                    ks > 0);
    wgmma::commit();
    // ---- Pᵀ, while dPᵀ is in flight ----
    wgmma::wait<1>();
    wgmma::pin(s);
    unsigned int p_packed[kQTiles][2];  // Pᵀ in T: the A operand of dV += Pᵀ dO
    scores.visit(TransposedProbabilities<T, kQTiles, KeepBits>{s, p_packed, lse_slot + own_first_query, masked,
                                                               visible, key, q0, t, diagonal});
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
    auto store_transposed = [&](T* tile, const unsigned int(&packed)[kQTiles][2]) {
#pragma unroll
      for (int n = 0; n < kQTiles; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<unsigned int*>(tile + wgmma::swizzled_offset<kBlockN>(own_first_key + 16 * warp + g + 8 * r,
                                                                                  own_first_query + 8 * n + 2 * t)) =
              packed[n][r];
    };
    if constexpr (kSharedKeys) {
      store_transposed(at.p + score_offset, p_packed);
      store_transposed(at.ds + score_offset, ds_packed);
      wgmma::fence_shared_for_async_proxy();
      sync_warpgroups();  // every warpgroup's queries of Pᵀ and dSᵀ are in shared memory
    }

    // ---- dV += Pᵀ dO and dK += dSᵀ Q over the tile's 64 queries, one group ----
    wgmma::pin(dv);
    wgmma::pin(dk);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const wgmma::u64 b = wgmma::advance(do_columns, slot * kSlotBytes + 2 * wgmma::kAtomBytes * kk);
      if constexpr (kSharedKeys) {
        wgmma::mma_ss_k_mn<T, kOwnColumns>(dv, wgmma::advance(p_rows, score_bytes + wgmma::k_major_step<kBlockN>(kk)),
                                           b, 1);
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
        wgmma::mma_ss_k_mn<T, kOwnColumns>(dk,
                                           wgmma::advance(ds_rows, score_bytes + wgmma::k_major_step<kBlockN>(kk)), b, 1);
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
        store_transposed(at.ds + score_offset, ds_packed);
        wgmma::fence_shared_for_async_proxy();
        sync_warpgroups();  // every warpgroup's dSᵀ is in shared memory
      }
      float dq[kDqColumns / 8][4];
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma::mma_ss_mn<T, kDqColumns>(dq, wgmma::advance(ds_columns, score_bytes + 2 * wgmma::kAtomBytes * kk),
                                        wgmma::advance(k_columns, 2 * wgmma::kAtomBytes * kk), kk > 0);
      wgmma::commit();
      wgmma::wait<0>();
      wgmma::pin(dq);
      float* const dq_rows = static_cast<float*>(p.dq_accum) + batch_index * p.dq_accum_batch_stride +
                             static_cast<long long>(query_start + m0 + dq_first_row) * p.dq_accum_token_stride +
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
            wgmma::reduce_add_quad(dq_rows + row * p.dq_accum_token_stride + 8 * n + column, odd ? got_x : keep_x,
                                   odd ? got_y : keep_y, odd ? keep_x : got_x, odd ? keep_y : got_y);
        }
      } else {
        // The share leaves through shared memory: each warp stages its 16 rows, and 16 of its lanes hand
        // one row each to the copy engine, which adds it into dq_accum. Reductions straight from the
        // registers (red.global) held them until the load/store unit took them, and the next writes to
        // those registers waited (12% of the kernel's stall samples, ncu; BENCHMARKS.md, run 6). One
        // lane issuing all 16 rows measured slower than 16 lanes. dq_accum is the workspace's contiguous
        // section, so its rows are 16-byte aligned.
        const int own_row = 16 * warp + lane;  // the row lanes 0-15 hand over
        float* const warp_rows = at.dq_staging + (64 * warpgroup + 16 * warp) * Shape::kDqPitch;
        if (lane < 16) wgmma::bulk_wait_read<0>();  // the copy engine has read this row of the last tile
        __syncwarp();
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int n = 0; n < kDqColumns / 8; ++n) {
            float2 pair;
            pair.x = dq[n][2 * r];
            pair.y = dq[n][2 * r + 1];
            *reinterpret_cast<float2*>(warp_rows + (g + 8 * r) * Shape::kDqPitch + 8 * n + 2 * t) = pair;
          }
        wgmma::fence_shared_for_async_proxy();
        __syncwarp();
        if (lane < 16) {
          // Rows past the sequence belong to the next one (THD) or to padding.
          if (m0 + dq_first_row + own_row < len_q)
            wgmma::bulk_reduce_add(dq_rows + own_row * p.dq_accum_token_stride,
                                   mma::shared_address(warp_rows + lane * Shape::kDqPitch),
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

  // Before the epilogue: this thread's dQ rows have reached dq_accum (the staging rows are about to
  // be released with the block's shared memory).
  HIPATTN_DEVICE void finish_dq() const {
    if (WRITE_DQ && !kSharedKeys && lane < 16) wgmma::bulk_wait_all();
  }

  // dK = scale * dSᵀ Q and dV (times dropout's 1 / (1 - p)) into the K and V tiles, once every
  // computing warpgroup is done reading them.
  HIPATTN_DEVICE void stage_gradients(const float (&dk)[kDTiles][4], const float (&dv)[kDTiles][4]) const {
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int offset =
            wgmma::swizzled_offset<kBlockN>(own_first_key + 16 * warp + g + 8 * r, own_first_column + 8 * d + 2 * t);
        *reinterpret_cast<unsigned int*>(at.k + offset) =
            mma::pack2<T>(dk[d][2 * r] * p.softmax_scale, dk[d][2 * r + 1] * p.softmax_scale);
        *reinterpret_cast<unsigned int*>(at.v + offset) =
            mma::pack2<T>(dv[d][2 * r] * block_dropout.scale(), dv[d][2 * r + 1] * block_dropout.scale());
      }
  }
};

// dK and dV of the block's `keys` rows from the K and V tiles, where stage_gradients put them, to
// global memory: 16 bytes per thread and step, THREADS threads from `thread`.
template <typename T, int HEAD_DIM, int BLOCK_N, int THREADS>
HIPATTN_DEVICE void write_gradients(const FlashBackwardParams& p, const T* dk_tile, const T* dv_tile, int batch_index,
                                    int head_kv, long long token, int keys, int thread) {
  constexpr int kChunks = HEAD_DIM / 8;
  T* const dk_rows = static_cast<T*>(p.dk) + batch_index * p.dk_batch_stride + token * p.dk_token_stride +
                     head_kv * p.dk_head_stride;
  T* const dv_rows = static_cast<T*>(p.dv) + batch_index * p.dv_batch_stride + token * p.dv_token_stride +
                     head_kv * p.dv_head_stride;
  for (int c = thread; c < keys * kChunks; c += THREADS) {
    const int row = c / kChunks;
    const int col = (c % kChunks) * 8;
    const int offset = wgmma::swizzled_offset<BLOCK_N>(row, col);
    *reinterpret_cast<Vec<T, 8>*>(dk_rows + row * p.dk_token_stride + col) =
        *reinterpret_cast<const Vec<T, 8>*>(dk_tile + offset);
    *reinterpret_cast<Vec<T, 8>*>(dv_rows + row * p.dv_token_stride + col) =
        *reinterpret_cast<const Vec<T, 8>*>(dv_tile + offset);
  }
}

}  // namespace flash
}  // namespace hipattn
