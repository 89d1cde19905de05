// Small-sequence attention backward for grouped heads (GQA/MQA, Hq = G * Hkv with G > 1) on NVIDIA
// tensor cores (sm_80+): the contract of smallseq/backward.hip. Heads without sharing (G = 1) keep
// smallseq/backward_mma.hip.
//
// A team of HEAD_DIM / 64 warps serves one (sequence, KV head) group at a time and walks a run of
// them; each warp owns 64 of the columns. Per group it stages K and V once, then walks the group's
// stacked query rows (smallseq/group_tiles.h) in chunks of 16, with the next chunk's Q, dO and LSE
// in flight while this one computes:
//   S = Q Kᵀ, dP = dO Vᵀ                       (partial sums over each warp's columns)
//   P = exp(scale*S - LSE), D_i = sum_j P_ij dP_ij, dZ = scale * P * (dP - D)   (the first warp, to shared;
//     with SCORE_MODS, common/score_mods.h's scores, each stacked row its own head's ALiBi slope, and
//     dZ times softcap's factor d(score)/d(scale*S); with dropout, common/dropout.h, dP first Z dP /
//     (1 - dropout_p) with the row's head's keep bits Z, and P to dV kept and scaled alike)
//   dVᵀ += dOᵀ P, dKᵀ += Qᵀ dZ                  (fp32 accumulators in registers, across the group)
//   dQ = dZ K                                    (staged over the chunk's Q rows, out with 16-byte stores)
// and after the group's last chunk writes dK and dV once, through the K and V tiles. dZ carries the
// softmax scale, so neither dK nor dQ is scaled again.
//
// dK and dV sum over the group in registers, in a fixed order: chunk after chunk of stacked rows
// (query-major: token after token, the group's heads in order within a token), each chunk's 16 rows
// inside the mma. No atomics and no two teams writing one row, so results are bit-identical from
// run to run. The sums are the transposed products dVᵀ = dOᵀ P and dKᵀ = Qᵀ dZ, with M = columns
// (A = dOᵀ or Qᵀ through ldmatrix.trans of the chunk tiles) and N = keys: 17 keys fill three
// 8-key n-tiles (24) where they would take two 16-key m-tiles (32). A warp's 64 columns hold
// 4 m-tiles x 3 n-tiles x 4 fp32 = 48 accumulators per gradient, 96 for both; 128 columns would need
// 192 and spill, hence 64 columns a warp and teams of HEAD_DIM / 64.
//
// Team hand-over (HEAD_DIM > 64): S and dP are sums over all columns. Warps 1.. write their partial
// sums of a chunk to slots of their own; the first warp adds them in warp order (the same order on
// every run), forms P and dZ and writes them to the team's tiles, which every warp then reads as the
// B operands of its dVᵀ, dKᵀ and the A operand of its dQ. Two team barriers per chunk: partial sums
// ready, P and dZ ready (the second also tells the other warps that the slots are free again, and the
// first of the next chunk that P and dZ were read).
//
// Why this shape. One team per group moves the floor's bytes (Q, dO, dQ per query head; K, V, dK, dV
// once per group); the portable kernel this replaces for GQA ran at 40-100x the floor. What is left
// is latency: on the H200 (ncu) the first version kept 12 warps per SM busy at 1.7 instructions a
// cycle, with about a third of the stall samples waiting on instruction fetch and the rest on the
// chain of mma results. So the code keeps the instruction stream short and the chains wide:
// - S and dP come from one pass over the k-steps (two independent accumulator sets per step), their
//   row addresses built once without per-row conditions (rows past the chunk or the keys read bytes
//   that are masked afterwards; the third key tile's rows stop at TILE - 1, so that they never read
//   the next chunk's Q tile while its cp.async is in flight);
// - dZ carries the softmax scale, so neither dK nor dQ is scaled again;
// - dK and dV leave through movmatrix and 32-bit stores (store_group_gradients) instead of one
//   16-bit store per element.
// Registers: the launch bounds hold ptxas to 168 (12 warps per SM), which every row's shared memory
// also allows (16.5, 33.5 and 67.3 KiB a team), without spills. Measured over the matrix's cells this
// runs at 1.2-1.55x the floor (BENCHMARKS.md), G = 2 the slowest: its groups have the fewest rows to
// share K and V over.
#pragma once
#include "smallseq/group_tiles.h"

namespace hipattn {
namespace smallseq {

// P and dZ of a chunk as [stacked row][key] 16-bit tiles, keys padded to 32 + 8 (dQ's A operand reads
// two 16-key steps; the pad spreads ldmatrix's row reads over the banks).
constexpr int kGroupScorePitch = 32 + 8;

// One team's shared memory, in bytes from its base. Per warp (64 columns each): a zero row; K and V
// tiles of TILE rows; two chunk tiles of 16 stacked rows for Q and two for dO (this chunk, and the
// next one in flight). Then, once per team: the LSE of two chunks, the P and dZ tiles, and a slot per
// warp after the first for its partial S and dP. Rows are 64 + 8 elements. The host's row
// (hipattn/catalog/smallseq.py, SmallSeqBackwardGqaMmaTiles.team_bytes) computes kBytes from the same
// arguments.
template <typename T, int HEAD_DIM, int TILE, int SPLIT>
struct GqaBackwardTeamTiles {
  static constexpr int kCols = 64;
  static constexpr int kPitchBytes = (kCols + 8) * static_cast<int>(sizeof(T));
  static constexpr int kKeyTileBytes = TILE * kPitchBytes;
  static constexpr int kChunkBytes = kChunkRows * kPitchBytes;
  static constexpr int kKOffset = kPitchBytes;  // after the zero row
  static constexpr int kVOffset = kKOffset + kKeyTileBytes;
  static constexpr int kQOffset = kVOffset + kKeyTileBytes;
  static constexpr int kDoOffset = kQOffset + 2 * kChunkBytes;
  static constexpr int kWarpBytes = kDoOffset + 2 * kChunkBytes;
  static constexpr int kStatsOffset = SPLIT * kWarpBytes;
  static constexpr int kStatsBytes = kChunkRows * 4;  // one chunk's LSE
  static constexpr int kScoreTileBytes = kChunkRows * kGroupScorePitch * static_cast<int>(sizeof(T));
  static constexpr int kPOffset = kStatsOffset + 2 * kStatsBytes;
  static constexpr int kDzOffset = kPOffset + kScoreTileBytes;
  static constexpr int kSlotsOffset = kDzOffset + kScoreTileBytes;
  static constexpr int kSlotBytes = ChunkExchange<2>::kBytes;
  static constexpr int kBytes = kSlotsOffset + (SPLIT - 1) * kSlotBytes;
  static_assert(HEAD_DIM == kCols * SPLIT, "each warp of a team owns 64 columns");
  static_assert(SPLIT == 1 || SPLIT == 2 || SPLIT == 4, "head_dim 64, 128 or 256");
  static_assert(kCols + 8 >= kGroupScorePitch, "the zero row is as long as a P or dZ row");
};

// The gradients of one group this warp accumulates: dVᵀ and dKᵀ over its 64 columns,
// [16-column m-tile][8-key n-tile][accumulator].
struct GroupGradients {
  float dv[4][3][4];
  float dk[4][3][4];
};

// Issue the copies of chunk [first, first + 16) of group x into chunk tiles `slot`: Q and dO rows (64
// columns from `column`) and, for the first warp, the rows' LSE.
template <typename T, typename Team>
HIPATTN_DEVICE void stage_backward_chunk(const SmallSeqBackwardGqaMmaParams& p, const Group& x,
                                         const StackedRows& stacked, int first, int column,
                                         const TilePlaces& places, int slot, bool with_lse, int lane) {
  using Copy = RowCopy<T, 64>;
  const int rows = stacked.count - first < kChunkRows ? stacked.count - first : kChunkRows;
  const int heads = x.head_kv * stacked.group;
  const int piece = lane % Copy::kPieces;
  const T* const sources[2] = {
      static_cast<const T*>(p.q) + x.batch_index * p.q_batch_stride + x.q.start * p.q_token_stride +
          heads * p.q_head_stride + column + piece * Copy::kPieceElements,
      static_cast<const T*>(p.dout) + x.batch_index * p.dout_batch_stride + x.q.start * p.dout_token_stride +
          heads * p.dout_head_stride + column + piece * Copy::kPieceElements};
  const unsigned int q_target = places.warp_address(Team::kQOffset + piece * 16) + slot * Team::kChunkBytes;
  const unsigned int do_target = q_target + (Team::kDoOffset - Team::kQOffset);
  const long long token_strides[2] = {p.q_token_stride, p.dout_token_stride};
  const long long head_strides[2] = {p.q_head_stride, p.dout_head_stride};
  for_lane_stacked_rows<T, 64>(stacked, first, rows, lane, sources, token_strides, head_strides,
                               [&](int row, const unsigned char* const (&source)[2]) {
                                 mma::copy_async_16(q_target + row * Copy::kPitchBytes, source[0]);
                                 mma::copy_async_16(do_target + row * Copy::kPitchBytes, source[1]);
                               });
  if (with_lse && lane < rows) {
    const int query = stacked.query(first + lane);
    const int head = first + lane - query * stacked.group;
    mma::copy_async_4(places.team_bytes(Team::kStatsOffset + 4 * lane) + slot * Team::kStatsBytes,
                      static_cast<const float*>(p.lse) + x.batch_index * p.lse_batch_stride +
                          (heads + head) * p.lse_head_stride + x.q.start + query);
  }
}

// sums[m-tile][n-tile] += Xᵀ Y over one chunk: M = this warp's 64 columns (A = Xᵀ: ldmatrix.trans of
// the chunk tile X at lane address `a`), N = 24 keys (B = Y, a [row][key] score tile at lane address
// `b`), K = the chunk's 16 stacked rows.
template <typename T>
HIPATTN_DEVICE void accumulate_transposed(float (&sums)[4][3][4], unsigned int a, unsigned int b) {
  unsigned int b01[4], b23[4];
  mma::ldmatrix_x4_trans(b01, b);
  mma::ldmatrix_x4_trans(b23, b + 32);
#pragma unroll
  for (int mc = 0; mc < 4; ++mc) {
    unsigned int x[4];
    mma::ldmatrix_x4_trans(x, a + 32 * mc);
    mma::mma_16816<T>(sums[mc][0], x, b01[0], b01[1]);
    mma::mma_16816<T>(sums[mc][1], x, b01[2], b01[3]);
    mma::mma_16816<T>(sums[mc][2], x, b23[0], b23[1]);
  }
}

// Partial sums of the chunk's scores over this warp's 64 columns, S = Q Kᵀ and dP = dO Vᵀ: A = the
// chunk's Q rows at lane address `q_row` (dO's lie DO_FROM_Q bytes on), B = the key tile's rows from
// `k_tile` (V's lie V_FROM_K bytes on). The two products advance together, k-step by k-step: each
// accumulator is a chain of four dependent mma, and S's and dP's chains side by side give the tensor
// core twice the independent work. Rows past the chunk's or the keys' are read as they are (stale, or
// never written): the scores they give are masked out with a select before anything uses them, so
// they need no zero row, and every address is a base plus a constant, which holds the registers down.
// Only rows of this chunk's tiles and of the key tiles are read, never a tile that copies may be
// landing in: the third key tile's rows past TILE read row TILE - 1 again, since V's rows past TILE
// would be the next chunk's Q tile.
// WIDE (more than 16 keys) adds the third 8-key tile, a compile-time choice: a branch around it at each
// of the four k-steps cost a branch, a warp barrier and a rebuilt address each.
template <typename T, int TILE, bool WIDE, int DO_FROM_Q, int V_FROM_K>
HIPATTN_DEVICE void chunk_scores(float (&s)[3][4], float (&dp)[3][4], unsigned int q_row, unsigned int k_tile,
                                 int lane) {
  constexpr int kPitchBytes = (64 + 8) * static_cast<int>(sizeof(T));
  const int row2 = 16 + lane % 8 < TILE ? 16 + lane % 8 : TILE - 1;
  const unsigned int k_rows01 = k_tile + (8 * (lane / 16) + lane % 8) * kPitchBytes + 16 * ((lane / 8) % 2);
  const unsigned int k_row2 = k_tile + row2 * kPitchBytes + 16 * ((lane / 8) % 2);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    unsigned int q[4], k[4], d[4], v[4];
    mma::ldmatrix_x4(q, q_row + 32 * ks);
    mma::ldmatrix_x4(k, k_rows01 + 32 * ks);
    mma::ldmatrix_x4(d, q_row + DO_FROM_Q + 32 * ks);
    mma::ldmatrix_x4(v, k_rows01 + V_FROM_K + 32 * ks);
    mma::mma_16816<T>(s[0], q, k[0], k[1]);
    mma::mma_16816<T>(dp[0], d, v[0], v[1]);
    mma::mma_16816<T>(s[1], q, k[2], k[3]);
    mma::mma_16816<T>(dp[1], d, v[2], v[3]);
    if (WIDE) {
      unsigned int k2[2], v2[2];
      mma::ldmatrix_x2(k2, k_row2 + 32 * ks);
      mma::ldmatrix_x2(v2, k_row2 + V_FROM_K + 32 * ks);
      mma::mma_16816<T>(s[2], q, k2[0], k2[1]);
      mma::mma_16816<T>(dp[2], d, v2[0], v2[1]);
    }
  }
}

// dQ = dZ K over this warp's 64 columns (dZ carries the softmax scale), into the chunk tile at
// `dq_bytes` (rows < `rows`).
// WIDE: dZ's second 16-key step too. Keys past the problem's in dZ are zero (past 24: never written
// since the tiles were zeroed) or meet K's zero row.
template <typename T, bool WIDE>
HIPATTN_DEVICE void chunk_dq(unsigned char* dq_bytes, unsigned int dz_tile, unsigned int k_tile, unsigned int zero,
                             int len_k, int rows, int lane) {
  constexpr int kPitchBytes = (64 + 8) * static_cast<int>(sizeof(T));
  constexpr int kScorePitchBytes = kGroupScorePitch * static_cast<int>(sizeof(T));
  constexpr int kSteps = WIDE ? 2 : 1;
  const int g = lane / 4;
  const int t = lane % 4;
  unsigned int dz_a[kSteps][4];
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
    mma::ldmatrix_x4(dz_a[kk], dz_tile + (lane % 16) * kScorePitchBytes + 16 * (lane / 16) + 32 * kk);
  // Two 16-column products at a time, then their stores: a store right after its product waited out the
  // mma's latency four times over, and all four at once held 32 accumulators beside dVᵀ's and dKᵀ's 96,
  // which ptxas spilled.
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    float dq[2][2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      const unsigned int k_row =
          row_or_zero(k_tile, zero, 16 * kk + lane % 8 + 8 * ((lane / 8) % 2), len_k, kPitchBytes) + 16 * (lane / 16);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        unsigned int b[4];
        mma::ldmatrix_x4_trans(b, k_row + 32 * (2 * pair + n));
        mma::mma_16816<T>(dq[n][0], dz_a[kk], b[0], b[1]);
        mma::mma_16816<T>(dq[n][1], dz_a[kk], b[2], b[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (g + 8 * r < rows)
            *reinterpret_cast<unsigned int*>(dq_bytes + (g + 8 * r) * kPitchBytes + 32 * (2 * pair + n) + 16 * half +
                                             4 * t) = mma::pack2<T>(dq[n][half][2 * r], dq[n][half][2 * r + 1]);
  }
}

// One chunk (stacked rows [first, first + rows), staged in chunk tiles `slot`): S and dP, P and dZ
// (first warp), the chunk's share of dVᵀ and dKᵀ, and its dQ rows.
template <typename T, int TILE, int SPLIT, int TEAMS, bool SCORE_MODS>
HIPATTN_DEVICE void backward_chunk(const SmallSeqBackwardGqaMmaParams& p, const Group& x, const StackedRows& stacked,
                                   int first, int rows, int slot, const TilePlaces& places, GroupGradients& grad,
                                   int team, int part, int column, int lane) {
  using Team = GqaBackwardTeamTiles<T, 64 * SPLIT, TILE, SPLIT>;
  constexpr int kPitchBytes = Team::kPitchBytes;
  constexpr int kScorePitchBytes = kGroupScorePitch * static_cast<int>(sizeof(T));
  const int len_q = x.q.length;
  const int len_k = x.k.length;
  const int g = lane / 4;
  const int t = lane % 4;
  const unsigned int zero = places.warp_address(0);
  const unsigned int k_tile = zero + Team::kKOffset;
  const unsigned int v_tile = zero + Team::kVOffset;
  const unsigned int q_tile = zero + Team::kQOffset + slot * Team::kChunkBytes;
  const unsigned int do_tile = q_tile + (Team::kDoOffset - Team::kQOffset);

  // ---- S and dP over this warp's 64 columns ----
  float s[3][4] = {}, dp[3][4] = {};
  {
    constexpr int kDoFromQ = Team::kDoOffset - Team::kQOffset;
    constexpr int kVFromK = Team::kVOffset - Team::kKOffset;
    const unsigned int q_row = q_tile + (lane % 16) * kPitchBytes + 16 * (lane / 16);
    if (len_k > 16)
      chunk_scores<T, TILE, true, kDoFromQ, kVFromK>(s, dp, q_row, k_tile, lane);
    else
      chunk_scores<T, TILE, false, kDoFromQ, kVFromK>(s, dp, q_row, k_tile, lane);
  }

  // ---- the other warps' partial sums to the first, through their slots ----
  // (A team of one warp meets at a warp barrier here instead, which keeps ptxas from hoisting the
  // softmax's row set-up into the mma phase above, beside its 120 accumulators.)
  if (SPLIT == 1) __syncwarp();
  if (SPLIT > 1) {
    if (part > 0) {
      unsigned char* const slot_bytes = places.team_bytes(Team::kSlotsOffset) + (part - 1) * Team::kSlotBytes;
      hand_over_chunk_scores(slot_bytes, 0, s, lane);
      hand_over_chunk_scores(slot_bytes, 1, dp, lane);
    }
    team_sync<SPLIT, TEAMS>(team);
    if (part == 0) {
#pragma unroll 1  // one slot's sums in registers at a time
      for (int w = 0; w < SPLIT - 1; ++w) {
        const unsigned char* const slot_bytes = places.team_bytes(Team::kSlotsOffset) + w * Team::kSlotBytes;
        add_chunk_scores(slot_bytes, 0, s, lane);
        add_chunk_scores(slot_bytes, 1, dp, lane);
      }
    }
  }

  // ---- P = exp(scale S - LSE), dZ = scale P (dP - D) to the team's tiles, by the first warp ----
  if (part == 0) {
    const float scale = p.softmax_scale;
    // Each stacked row has its own query head, so its own scores (ALiBi's slope; plain: one scale for all).
    const Scores<SCORE_MODS> group_score = scores_of<SCORE_MODS>(p, x.batch_index, x.head_kv * stacked.group);
    const float* const lse_rows =
        reinterpret_cast<const float*>(places.team_bytes(Team::kStatsOffset) + slot * Team::kStatsBytes);
    const KeyWindow window = key_window(p);
    const Dropout<SCORE_MODS> group_dropout = dropout_of<SCORE_MODS>(p, x.batch_index, x.head_kv * stacked.group);
    unsigned int visible_keys[2];
    float lse_log2[2];
    Scores<SCORE_MODS> row_score[2];
    int diagonal[2];  // the rows' diagonal keys, from which ALiBi measures
    // Dropout's keep bits of the two rows, each its own head's (bit 2 nt + h: key 8 nt + 2t + h).
    unsigned int kept[2] = {~0u, ~0u};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = first + g + 8 * r;
      const int query = stacked.query(row);
      const int head = x.head_kv * stacked.group + row - query * stacked.group;
      visible_keys[r] = key_bits(stacked_row_keys(row, query, stacked, len_q, len_k, window), t);
      lse_log2[r] = lse_rows[g + 8 * r] * kLog2e;  // past the rows: unused (nothing visible)
      row_score[r] = group_score.with_head(p, x.batch_index, head);
      diagonal[r] = query + len_k - len_q;
      if (group_dropout.active())
        kept[r] = static_cast<unsigned int>(
            group_dropout.with_head(p, x.batch_index, head).template m16n8_bits<4>(query, 0, t));
    }
    float d_row[2] = {0.0f, 0.0f};
    float gradient[3][4];  // d(score)/d(scaled S), dZ's factor: 1 but with softcap
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const bool visible = key_bit(visible_keys[r], nt, e);
        // LSE = +inf (a row that saw no key in the forward) gives P = 0.
        gradient[nt][e] = 1.0f;
        const int key = 8 * nt + 2 * t + (e & 1);
        // Plain rows share the group's scale; taking it from row_score[r] compiled to other (if equal) code.
        const Scores<SCORE_MODS>& score = SCORE_MODS ? row_score[r] : group_score;
        s[nt][e] = visible ? fast_exp2(score(s[nt][e], key - diagonal[r], gradient[nt][e]) - lse_log2[r]) : 0.0f;
        dp[nt][e] = visible ? dp[nt][e] : 0.0f;
        // With dropout, dP reaches only the kept entries, scaled as the forward scaled them.
        if (group_dropout.active())
          dp[nt][e] = (kept[r] >> (2 * nt + (e & 1)) & 1u) != 0 ? dp[nt][e] * group_dropout.scale() : 0.0f;
        d_row[r] += s[nt][e] * dp[nt][e];
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      d_row[r] += shfl_xor(d_row[r], 1, 32, 0xffffffffu);
      d_row[r] += shfl_xor(d_row[r], 2, 32, 0xffffffffu);
    }
    // Every row of the tiles is written, zeros past the chunk's rows, so no read below needs the zero row.
    unsigned char* const p_bytes = places.team_bytes(Team::kPOffset);
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int offset = (g + 8 * r) * kScorePitchBytes + 16 * nt + 4 * t;
        // dV takes the kept probabilities, scaled (without dropout, P as it is).
        const float p0 = (kept[r] >> (2 * nt) & 1u) != 0 ? s[nt][2 * r] * group_dropout.scale() : 0.0f;
        const float p1 = (kept[r] >> (2 * nt + 1) & 1u) != 0 ? s[nt][2 * r + 1] * group_dropout.scale() : 0.0f;
        *reinterpret_cast<unsigned int*>(p_bytes + offset) = mma::pack2<T>(p0, p1);
        *reinterpret_cast<unsigned int*>(p_bytes + Team::kScoreTileBytes + offset) =
            mma::pack2<T>(s[nt][2 * r] * scale * (dp[nt][2 * r] - d_row[r]) * gradient[nt][2 * r],
                          s[nt][2 * r + 1] * scale * (dp[nt][2 * r + 1] - d_row[r]) * gradient[nt][2 * r + 1]);
      }
  }
  team_sync<SPLIT, TEAMS>(team);  // P and dZ are in the team's tiles; the slots are free again

  // ---- dVᵀ += dOᵀ P and dKᵀ += Qᵀ dZ: M = this warp's columns, N = keys, K = the chunk's rows ----
  const unsigned int p_tile = places.team_address(Team::kPOffset);
  const unsigned int dz_tile = p_tile + Team::kScoreTileBytes;
  {
    // B operands (keys 0..15, then 16..31 of which 16..23 are used), rows = the chunk's stacked rows.
    // A operands: the 8x8 blocks (rows 0-7 | 8-15) x (columns 0-7 | 8-15) of the chunk tile, transposed.
    const unsigned int b_row = (lane % 8 + 8 * ((lane / 8) % 2)) * kScorePitchBytes + 16 * (lane / 16);
    const int a_row = 8 * (lane / 16) + lane % 8;
    const int a_column = 16 * ((lane / 8) % 2);
    const unsigned int do_a = row_or_zero(do_tile, zero, a_row, rows, kPitchBytes) + a_column;
    const unsigned int q_a = row_or_zero(q_tile, zero, a_row, rows, kPitchBytes) + a_column;
    accumulate_transposed<T>(grad.dv, do_a, p_tile + b_row);
    // A warp barrier orders shared-memory reads, so ptxas keeps dKᵀ's operand loads after it rather
    // than hoisting all eight A and four B fragments (48 registers) beside the 96 accumulators.
    __syncwarp();
    accumulate_transposed<T>(grad.dk, q_a, dz_tile + b_row);
  }
  __syncwarp();  // every lane has read the chunk's Q rows; dQ is staged over them

  // ---- dQ = dZ K over this warp's columns, staged over the chunk's Q rows ----
  unsigned char* const dq_bytes = places.warp_bytes(Team::kQOffset) + slot * Team::kChunkBytes;
  if (len_k > 16)
    chunk_dq<T, true>(dq_bytes, dz_tile, k_tile, zero, len_k, rows, lane);
  else
    chunk_dq<T, false>(dq_bytes, dz_tile, k_tile, zero, len_k, rows, lane);
  __syncwarp();
  store_stacked_rows<T, 64>(static_cast<T*>(p.dq) + x.batch_index * p.dq_batch_stride +
                                x.q.start * p.dq_token_stride + x.head_kv * stacked.group * p.dq_head_stride + column,
                            p.dq_token_stride, p.dq_head_stride, dq_bytes, stacked, first, rows, lane);
}

// dV and dK of the group, this warp's columns, out through its V and K tiles (their last use was the
// group's last chunk). Each accumulator pair (a column, two adjacent keys) packed to 16 bits is a
// fragment of an 8x8 block of dVᵀ or dKᵀ; movmatrix transposes it in registers, so that a lane then
// holds two adjacent columns of one key and writes them with one 32-bit store (a row of the tile per
// key). Keys past the problem's are not written.
template <typename T, typename Team>
HIPATTN_DEVICE void store_group_gradients(const SmallSeqBackwardGqaMmaParams& p, const Group& x,
                                          const GroupGradients& grad, const TilePlaces& places, int column,
                                          int lane) {
  constexpr int kPitchBytes = Team::kPitchBytes;
  const int g = lane / 4;
  const int t = lane % 4;
  const int len_k = x.k.length;
  unsigned char* const k_tile = places.warp_bytes(Team::kKOffset);
  unsigned char* const v_tile = k_tile + (Team::kVOffset - Team::kKOffset);
  __syncwarp();  // every lane is done with K and V
#pragma unroll
  for (int nt = 0; nt < 3; ++nt)
#pragma unroll
    for (int mc = 0; mc < 4; ++mc)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // movmatrix is a whole-warp instruction: every lane transposes, the lanes of real keys store.
        const unsigned int dv = mma::movmatrix_trans(mma::pack2<T>(grad.dv[mc][nt][2 * r], grad.dv[mc][nt][2 * r + 1]));
        const unsigned int dk = mma::movmatrix_trans(mma::pack2<T>(grad.dk[mc][nt][2 * r], grad.dk[mc][nt][2 * r + 1]));
        const int key = 8 * nt + g;
        const int offset = key * kPitchBytes + 2 * (16 * mc + 8 * r + 2 * t);
        if (key < len_k) {
          *reinterpret_cast<unsigned int*>(v_tile + offset) = dv;
          *reinterpret_cast<unsigned int*>(k_tile + offset) = dk;
        }
      }
  __syncwarp();
  store_rows<T, 64>(static_cast<T*>(p.dv) + x.batch_index * p.dv_batch_stride + x.k.start * p.dv_token_stride +
                        x.head_kv * p.dv_head_stride + column,
                    p.dv_token_stride, v_tile, len_k, lane);
  store_rows<T, 64>(static_cast<T*>(p.dk) + x.batch_index * p.dk_batch_stride + x.k.start * p.dk_token_stride +
                        x.head_kv * p.dk_head_stride + column,
                    p.dk_token_stride, k_tile, len_k, lane);
  __syncwarp();  // dK and dV have left the tiles before the next group's K and V land in them
}

}  // namespace smallseq

// WARPS warps per block in teams of SPLIT = HEAD_DIM / 64, each team walking its run of
// problems_per_team groups; the host's table (catalog.smallseq.SMALLSEQ_GQA_BACKWARD_MMA_TILES) sizes the
// dynamic shared memory. The launch bounds ask for 12 warps per SM (12 / WARPS blocks: 168 registers),
// which every table row's shared memory allows.
template <typename T, int HEAD_DIM, int TILE, int WARPS, int SPLIT, bool SCORE_MODS>
__global__ void __launch_bounds__(WARPS * 32, 12 / WARPS)
    smallseq_backward_gqa_mma(const SmallSeqBackwardGqaMmaParams p) {
  using Team = smallseq::GqaBackwardTeamTiles<T, HEAD_DIM, TILE, SPLIT>;
  static_assert(TILE > 16 && TILE <= 24, "the fragments cover 24 keys and 2 k-steps of keys");
  static_assert(WARPS % SPLIT == 0, "whole teams");
  constexpr int TEAMS = WARPS / SPLIT;
  extern __shared__ __align__(16) unsigned char shared_bytes[];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int team = warp / SPLIT;
  const int part = warp % SPLIT;
  smallseq::Group x;
  if (!smallseq::first_group<TILE, TEAMS>(p, team, x)) return;  // a team past the last group; barriers are per team
  const smallseq::TilePlaces places{shared_bytes, team * Team::kBytes + part * Team::kWarpBytes, team * Team::kBytes};
  // The zero row, and P and dZ: their keys 24..31 are never written and must be finite (dQ reads them
  // against K's zero row). The first team barrier publishes the zeros.
  smallseq::zero_bytes(places.warp_bytes(0), Team::kPitchBytes, lane);
  if (part == 0) smallseq::zero_bytes(places.team_bytes(Team::kPOffset), 2 * Team::kScoreTileBytes, lane);
  smallseq::team_sync<SPLIT, TEAMS>(team);
  const int column = part * Team::kCols;

  smallseq::StackedRows stacked = smallseq::stacked_rows(p.group_size);
  // Chunk c of a group uses chunk tiles c % 2 (the next chunk's copies land in the other pair). The
  // parity restarts with each group: no copy is in flight across a group's end, and the team's slots
  // and P and dZ tiles are ordered by two barriers a chunk, not by alternating.
  for (;;) {
    stacked.count = p.group_size * x.q.length;
    smallseq::GroupGradients grad;
#pragma unroll
    for (int mc = 0; mc < 4; ++mc)
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) grad.dv[mc][nt][e] = grad.dk[mc][nt][e] = 0.0f;
    if (stacked.count > 0) {  // no query rows: dK = dV = 0, and no K or V to read
      smallseq::stage_rows<T, 64>(places.warp_bytes(Team::kKOffset),
                                  static_cast<const T*>(p.k) + x.batch_index * p.k_batch_stride +
                                      x.k.start * p.k_token_stride + x.head_kv * p.k_head_stride + column,
                                  p.k_token_stride, x.k.length, lane);
      smallseq::stage_rows<T, 64>(places.warp_bytes(Team::kVOffset),
                                  static_cast<const T*>(p.v) + x.batch_index * p.v_batch_stride +
                                      x.k.start * p.v_token_stride + x.head_kv * p.v_head_stride + column,
                                  p.v_token_stride, x.k.length, lane);
      smallseq::stage_backward_chunk<T, Team>(p, x, stacked, 0, column, places, 0, part == 0, lane);
    }
    mma::commit_async_copies();
    for (int first = 0; first < stacked.count; first += smallseq::kChunkRows) {
      const int slot = (first / smallseq::kChunkRows) % 2;
      if (first + smallseq::kChunkRows < stacked.count) {
        // The next chunk's Q, dO and LSE land in the other tiles while this one computes.
        smallseq::stage_backward_chunk<T, Team>(p, x, stacked, first + smallseq::kChunkRows, column, places, 1 - slot,
                                          part == 0, lane);
        mma::commit_async_copies();
        mma::wait_async_copies_except<1>();
      } else {
        mma::wait_async_copies_except<0>();
      }
      __syncwarp();
      const int rows = stacked.count - first < smallseq::kChunkRows ? stacked.count - first : smallseq::kChunkRows;
      smallseq::backward_chunk<T, TILE, SPLIT, TEAMS, SCORE_MODS>(p, x, stacked, first, rows, slot, places, grad, team,
                                                                  part, column, lane);
      __syncwarp();  // dQ has left the chunk tile before the chunk after next lands in it
    }
    smallseq::store_group_gradients<T, Team>(p, x, grad, places, column, lane);
    if (!smallseq::next_group_of_block<TILE, TEAMS>(p, x)) break;
  }
}

}  // namespace hipattn
