// Small-sequence attention backward on NVIDIA tensor cores (sm_80+), for heads without KV sharing
// (Hq == Hkv); GQA/MQA take the portable kernel (smallseq/backward.hip), which sums dK/dV over a
// group in shared memory.
//
// Each team of warps walks a run of problems (smallseq/mma_tiles.h). Per problem it copies Q, dO,
// K, V and LSE into its tiles with cp.async, then
//   S = Q Kᵀ, dP = dO Vᵀ                     (mma, query rows x keys)
//   P = exp(scale*S - LSE), D_i = sum_j P_ij dP_ij, dZ = P * (dP - D)   (on the accumulators; with
//     SCORE_MODS, common/score_mods.h's scores, and dZ times softcap's factor d(score)/d(scale*S))
//   dQ = scale * dZ K                          (dZ read back as the A operand)
//   dV = Pᵀ dO, dK = scale * dZᵀ Q             (Pᵀ and dZᵀ read back transposed with ldmatrix.trans)
// D_i = sum_j P_ij dP_ij equals rowsum(dO * O), so O is never read. With dropout (SCORE_MODS,
// common/dropout.h) dP is first Z dP / (1 - dropout_p), Z the forward's keep bits, and dV takes the kept
// P / (1 - dropout_p). Each gradient is staged in a tile its inputs no longer need (dQ in V's, dV in
// K's, dK in V's) and leaves with 16-byte stores.
//
// SPLIT warps share a problem (a team): each stages and computes HEAD_DIM / SPLIT of its columns.
// S and dP are sums over all columns, so with SPLIT = 2 the second warp hands its partial sums to
// the first through its V tile (dP was V's last use); the first forms P and dZ, which both then read
// back. At head_dim 256 this halves each warp's tiles, so an SM holds 10 warps instead of 5, and
// halves the chain of dependent instructions per problem.
// The loops over head_dim's 16-column steps that write gradients are unrolled by 4, not fully: at
// head_dim 256 the fully unrolled kernel waits on instruction fetch (ncu: "no instruction" stalls)
// and ran 4-7% slower on the H200 (BENCHMARKS.md).
#pragma once
#include "smallseq/mma_tiles.h"

namespace hipattn {
namespace smallseq {

// P and dZ as [query][key] bf16/fp16 tiles of TILE query rows, keys padded to 32 + 8 (the fragments
// read two 16-key steps; the pad spreads rows over banks).
constexpr int kScorePitch = 32 + 8;

template <typename T, int TILE>
struct ScoreTiles {
  static constexpr int kBytes = 2 * TILE * kScorePitch * static_cast<int>(sizeof(T));
};

// One team's shared memory, in bytes from its base: each warp's zero row and Q, dO, K and V tiles
// of HEAD_DIM / SPLIT columns; then the LSE rows (padded to 16 bytes), and P and dZ.
// The host's row (hipattn/catalog/smallseq.py, SmallSeqBackwardMmaTiles.team_bytes) computes kBytes from
// the same arguments.
template <typename T, int HEAD_DIM, int TILE, int SPLIT>
struct BackwardTeamTiles {
  using Warp = WarpTiles<T, HEAD_DIM / SPLIT, TILE, 4>;
  static constexpr int kStatsOffset = SPLIT * Warp::kBytes;
  static constexpr int kScoresOffset = kStatsOffset + (TILE * 4 + 15) / 16 * 16;
  static constexpr int kBytes = kScoresOffset + ScoreTiles<T, TILE>::kBytes;
  // The second warp's V tile, which carries its partial S and dP to the first.
  static constexpr int kExchangeOffset = Warp::kBytes + Warp::kTilesOffset + 3 * Warp::kTileBytes;
  static_assert(SPLIT == 1 || SPLIT == 2, "one warp per problem, or two that split its columns");
  static_assert(HEAD_DIM % (16 * SPLIT) == 0, "each warp takes whole 16-column mma steps");
  static_assert(Warp::kPitch >= kScorePitch, "the zero row also stands in for P's and dZ's rows");
  static_assert(SPLIT == 1 || Warp::kTileBytes >= ScoreExchange<2>::kBytes, "the partial S and dP fit in V's tile");
};

// A team's pieces of shared memory, for one of its warps.
struct BackwardShared {
  unsigned char* tiles;  // this warp's Q, dO, K, V tiles
  unsigned int zero;     // this warp's zero row (shared address)
  float* lse_rows;
  unsigned char* scores;    // P, then dZ
  unsigned char* exchange;  // partial S and dP (SPLIT = 2): the second warp's V tile
};

// Issue the copies of problem x's Q, dO, K and V rows (COLS columns from `column`, tiles in that
// order) and, when `with_lse`, its LSE.
template <typename T, int COLS, int TILE>
HIPATTN_DEVICE void stage_backward(const SmallSeqBackwardMmaParams& p, const Problem& x, int column,
                                   unsigned char* tiles, float* lse_rows, bool with_lse, int lane) {
  using Tiles = WarpTiles<T, COLS, TILE, 4>;
  stage_rows<T, COLS>(tiles, static_cast<const T*>(p.q) + x.batch_index * p.q_batch_stride +
                                 x.q.start * p.q_token_stride + x.head * p.q_head_stride + column,
                      p.q_token_stride, x.q.length, lane);
  stage_rows<T, COLS>(tiles + Tiles::kTileBytes, static_cast<const T*>(p.dout) + x.batch_index * p.dout_batch_stride +
                                                     x.q.start * p.dout_token_stride + x.head * p.dout_head_stride +
                                                     column,
                      p.dout_token_stride, x.q.length, lane);
  stage_rows<T, COLS>(tiles + 2 * Tiles::kTileBytes, static_cast<const T*>(p.k) + x.batch_index * p.k_batch_stride +
                                                         x.k.start * p.k_token_stride + x.head * p.k_head_stride +
                                                         column,
                      p.k_token_stride, x.k.length, lane);
  stage_rows<T, COLS>(tiles + 3 * Tiles::kTileBytes, static_cast<const T*>(p.v) + x.batch_index * p.v_batch_stride +
                                                         x.k.start * p.v_token_stride + x.head * p.v_head_stride +
                                                         column,
                      p.v_token_stride, x.k.length, lane);
  if (with_lse && lane < x.q.length) {
    mma::copy_async_4(lse_rows + lane, static_cast<const float*>(p.lse) + x.batch_index * p.lse_batch_stride +
                                           x.head * p.lse_head_stride + x.q.start + lane);
  }
}

// dQ, dK and dV of problem x: this warp's `part` of the team's columns, staged in its tiles.
template <typename T, int HEAD_DIM, int TILE, int SPLIT, int TEAMS, bool SCORE_MODS>
HIPATTN_DEVICE void backward_problem(const SmallSeqBackwardMmaParams& p, const Problem& x, const BackwardShared& sh,
                                     int team, int part, int lane) {
  constexpr int COLS = HEAD_DIM / SPLIT;
  using Tiles = WarpTiles<T, COLS, TILE, 4>;
  constexpr int kPitchBytes = Tiles::kPitchBytes;
  constexpr int kScorePitchBytes = kScorePitch * static_cast<int>(sizeof(T));
  const int len_q = x.q.length;
  const int len_k = x.k.length;
  const int g = lane / 4;
  const int t = lane % 4;
  const int first_column = part * COLS;
  T* const dq_rows = static_cast<T*>(p.dq) + x.batch_index * p.dq_batch_stride + x.q.start * p.dq_token_stride +
                     x.head * p.dq_head_stride + first_column;
  unsigned char* const k_tile_bytes = sh.tiles + 2 * Tiles::kTileBytes;
  unsigned char* const v_tile_bytes = sh.tiles + 3 * Tiles::kTileBytes;
  if (len_k == 0) {
    // No key: P = 0, so dQ = 0 for every query row, and there is no dK/dV row to write. (Both warps
    // of a team take this branch: they share the problem.)
    zero_bytes(v_tile_bytes, Tiles::kTileBytes, lane);
    __syncwarp();
    store_rows<T, COLS>(dq_rows, p.dq_token_stride, v_tile_bytes, len_q, lane);
    return;
  }
  const unsigned int zero = sh.zero;
  const unsigned int q_tile = mma::shared_address(sh.tiles);
  const unsigned int do_tile = q_tile + Tiles::kTileBytes;
  const unsigned int k_tile = q_tile + 2 * Tiles::kTileBytes;
  const unsigned int v_tile = q_tile + 3 * Tiles::kTileBytes;
  unsigned char* const p_tile = sh.scores;
  unsigned char* const dz_tile = sh.scores + TILE * kScorePitchBytes;
  const unsigned int p_base = mma::shared_address(p_tile);
  const unsigned int dz_base = mma::shared_address(dz_tile);

  const int n_tiles = (len_k + 7) / 8;
  const int m_tiles = (len_q + 15) / 16;
  const int k_steps = (len_k + 15) / 16;
  const float scale = p.softmax_scale;
  const Scores<SCORE_MODS> score = scores_of<SCORE_MODS>(p, x.batch_index, x.head);
  const Dropout<SCORE_MODS> dropout = dropout_of<SCORE_MODS>(p, x.batch_index, x.head);
  const KeyWindow window = key_window(p);
  // Key rows this lane addresses for the B operands of S and dP (keys 0..15, then 16..23).
  const int key01 = 8 * (lane / 16) + lane % 8;
  const int key2 = 16 + lane % 8;
  const int b_column = 16 * ((lane / 8) % 2);
  const unsigned int k_row01 = row_or_zero(k_tile, zero, key01, len_k, kPitchBytes) + b_column;
  const unsigned int v_row01 = row_or_zero(v_tile, zero, key01, len_k, kPitchBytes) + b_column;
  const unsigned int k_row2 = row_or_zero(k_tile, zero, key2, len_k, kPitchBytes) + b_column;
  const unsigned int v_row2 = row_or_zero(v_tile, zero, key2, len_k, kPitchBytes) + b_column;

  // ---- S and dP over this warp's columns, per 16-query tile ----
  float s[2][3][4] = {}, dp[2][3][4] = {};
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    if (mt < m_tiles) {
      const int a_row = 16 * mt + lane % 16;
      const unsigned int q_row = row_or_zero(q_tile, zero, a_row, len_q, kPitchBytes) + 16 * (lane / 16);
      const unsigned int do_row = row_or_zero(do_tile, zero, a_row, len_q, kPitchBytes) + 16 * (lane / 16);
#pragma unroll
      for (int ks = 0; ks < COLS / 16; ++ks) {
        unsigned int aq[4], ado[4], b[4];
        mma::ldmatrix_x4(aq, q_row + 32 * ks);
        mma::ldmatrix_x4(ado, do_row + 32 * ks);
        mma::ldmatrix_x4(b, k_row01 + 32 * ks);
        mma::mma_16816<T>(s[mt][0], aq, b[0], b[1]);
        mma::mma_16816<T>(s[mt][1], aq, b[2], b[3]);
        mma::ldmatrix_x4(b, v_row01 + 32 * ks);
        mma::mma_16816<T>(dp[mt][0], ado, b[0], b[1]);
        mma::mma_16816<T>(dp[mt][1], ado, b[2], b[3]);
        if (n_tiles > 2) {
          unsigned int b2[2];
          mma::ldmatrix_x2(b2, k_row2 + 32 * ks);
          mma::mma_16816<T>(s[mt][2], aq, b2[0], b2[1]);
          mma::ldmatrix_x2(b2, v_row2 + 32 * ks);
          mma::mma_16816<T>(dp[mt][2], ado, b2[0], b2[1]);
        }
      }
    }
  }

  // ---- the second warp's partial sums to the first, through its V tile ----
  if (SPLIT == 2 && part == 1) {
    __syncwarp();  // every lane has read V
    hand_over_scores<2>(sh.exchange, 0, s, lane);
    hand_over_scores<2>(sh.exchange, 1, dp, lane);
  }
  team_sync<SPLIT, TEAMS>(team);
  if (SPLIT == 2 && part == 0) {
    add_handed_scores<2>(sh.exchange, 0, s, lane);
    add_handed_scores<2>(sh.exchange, 1, dp, lane);
  }

  // ---- P = exp(scale S - LSE), dZ = P (dP - D) to shared memory, by the first warp ----
  if (part == 0) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      if (mt >= m_tiles) continue;
      const int row[2] = {16 * mt + g, 16 * mt + g + 8};
      const RowKeys keys[2] = {row_keys(row[0], len_q, len_k, window), row_keys(row[1], len_q, len_k, window)};
      float lse_log2[2];
#pragma unroll
      for (int r = 0; r < 2; ++r)  // rows past the sequence: LSE = +inf, so P = 0
        lse_log2[r] = row[r] < len_q ? sh.lse_rows[row[r]] * 1.4426950408889634f : infinity();
      const int diagonal[2] = {row[0] + len_k - len_q, row[1] + len_k - len_q};  // the rows' diagonal keys (ALiBi)
      // Dropout's keep bits of the two rows (bit 2 nt + h: key 8 nt + 2t + h); all kept without dropout.
      unsigned int kept[2] = {~0u, ~0u};
      if (dropout.active()) {
#pragma unroll
        for (int r = 0; r < 2; ++r) kept[r] = static_cast<unsigned int>(dropout.template m16n8_bits<4>(row[r], 0, t));
      }
      float d_row[2] = {0.0f, 0.0f};
      float gradient[3][4];  // d(score)/d(scaled S), dZ's factor: 1 but with softcap
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2;
          const int j = 8 * nt + 2 * t + (e & 1);
          const bool visible = keys[r].contains(j);
          // LSE = +inf (a row that saw no key, or a row past the sequence) gives P = 0.
          gradient[nt][e] = 1.0f;
          s[mt][nt][e] =
              visible ? fast_exp2(score(s[mt][nt][e], j - diagonal[r], gradient[nt][e]) - lse_log2[r]) : 0.0f;
          dp[mt][nt][e] = visible ? dp[mt][nt][e] : 0.0f;
          // With dropout, dP reaches only the kept entries, scaled as the forward scaled them.
          if (dropout.active())
            dp[mt][nt][e] = (kept[r] >> (2 * nt + (e & 1)) & 1u) != 0 ? dp[mt][nt][e] * dropout.scale() : 0.0f;
          d_row[r] += s[mt][nt][e] * dp[mt][nt][e];
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        d_row[r] += shfl_xor(d_row[r], 1, 32, 0xffffffffu);
        d_row[r] += shfl_xor(d_row[r], 2, 32, 0xffffffffu);
      }
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (row[r] < len_q) {  // the score tiles hold TILE query rows; later ones read the zero row
            const float* ps = s[mt][nt];
            const float* dps = dp[mt][nt];
            const float* gs = gradient[nt];
            const int offset = row[r] * kScorePitchBytes + 16 * nt + 4 * t;
            // dV takes the kept probabilities, scaled (without dropout, P as it is).
            const float p0 = (kept[r] >> (2 * nt) & 1u) != 0 ? ps[2 * r] * dropout.scale() : 0.0f;
            const float p1 = (kept[r] >> (2 * nt + 1) & 1u) != 0 ? ps[2 * r + 1] * dropout.scale() : 0.0f;
            *reinterpret_cast<unsigned int*>(p_tile + offset) = mma::pack2<T>(p0, p1);
            *reinterpret_cast<unsigned int*>(dz_tile + offset) =
                mma::pack2<T>(ps[2 * r] * (dps[2 * r] - d_row[r]) * gs[2 * r],
                              ps[2 * r + 1] * (dps[2 * r + 1] - d_row[r]) * gs[2 * r + 1]);
          }
    }
  }
  team_sync<SPLIT, TEAMS>(team);  // P and dZ are in shared memory; V's tile (and the partial sums in it) is free

  // ---- dQ = scale * dZ K, per 16-query tile, staged in V's tile ----
  // dZ's columns past the keys this problem wrote hold an earlier problem's finite values (or the
  // zeros they started as); they meet K's zero row.
  for (int mt = 0; mt < m_tiles; ++mt) {
    const unsigned int dz_row = row_or_zero(dz_base, zero, 16 * mt + lane % 16, len_q, kScorePitchBytes) +
                                16 * (lane / 16);
    unsigned int dz_a[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) mma::ldmatrix_x4(dz_a[kk], dz_row + 32 * kk);
    const int row[2] = {16 * mt + g, 16 * mt + g + 8};
#pragma unroll 4
    for (int nt = 0; nt < COLS / 16; ++nt) {
      float dq[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        if (kk < k_steps) {
          unsigned int b[4];
          mma::ldmatrix_x4_trans(
              b, row_or_zero(k_tile, zero, 16 * kk + lane % 8 + 8 * ((lane / 8) % 2), len_k, kPitchBytes) + 32 * nt +
                     16 * (lane / 16));
          mma::mma_16816<T>(dq[0], dz_a[kk], b[0], b[1]);
          mma::mma_16816<T>(dq[1], dz_a[kk], b[2], b[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (row[r] < len_q)
            *reinterpret_cast<unsigned int*>(v_tile_bytes + row[r] * kPitchBytes + 32 * nt + 16 * half + 4 * t) =
                mma::pack2<T>(dq[half][2 * r] * scale, dq[half][2 * r + 1] * scale);
    }
  }
  __syncwarp();  // dQ is staged; K is no longer needed
  store_rows<T, COLS>(dq_rows, p.dq_token_stride, v_tile_bytes, len_q, lane);
  __syncwarp();  // dQ has left V's tile

  // ---- dV = Pᵀ dO and dK = scale * dZᵀ Q, per 16-key tile, staged in K's and V's tiles ----
  // P's and dZ's columns past the keys the fragments wrote reach only rows of dV and dK past len_k,
  // which are not stored.
  const int query_steps = (len_q + 15) / 16;
  const int key_tiles = (len_k + 15) / 16;
  for (int mk = 0; mk < key_tiles; ++mk) {
    unsigned int pt[2][4], dzt[2][4];  // Pᵀ and dZᵀ A operands, per 16-query k-step
#pragma unroll
    for (int kq = 0; kq < 2; ++kq) {
      const int query = 16 * kq + lane % 8 + 8 * (lane / 16);
      const int column = 32 * mk + 16 * ((lane / 8) % 2);
      mma::ldmatrix_x4_trans(pt[kq], row_or_zero(p_base, zero, query, len_q, kScorePitchBytes) + column);
      mma::ldmatrix_x4_trans(dzt[kq], row_or_zero(dz_base, zero, query, len_q, kScorePitchBytes) + column);
    }
    const int key[2] = {16 * mk + g, 16 * mk + g + 8};
#pragma unroll 4
    for (int nt = 0; nt < COLS / 16; ++nt) {
      float dv[2][4] = {}, dk[2][4] = {};
#pragma unroll
      for (int kq = 0; kq < 2; ++kq) {
        if (kq < query_steps) {
          const int query = 16 * kq + lane % 8 + 8 * ((lane / 8) % 2);
          const int column = 32 * nt + 16 * (lane / 16);
          unsigned int b[4];
          mma::ldmatrix_x4_trans(b, row_or_zero(do_tile, zero, query, len_q, kPitchBytes) + column);
          mma::mma_16816<T>(dv[0], pt[kq], b[0], b[1]);
          mma::mma_16816<T>(dv[1], pt[kq], b[2], b[3]);
          mma::ldmatrix_x4_trans(b, row_or_zero(q_tile, zero, query, len_q, kPitchBytes) + column);
          mma::mma_16816<T>(dk[0], dzt[kq], b[0], b[1]);
          mma::mma_16816<T>(dk[1], dzt[kq], b[2], b[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (key[r] < len_k) {
            const int offset = key[r] * kPitchBytes + 32 * nt + 16 * half + 4 * t;
            *reinterpret_cast<unsigned int*>(k_tile_bytes + offset) =
                mma::pack2<T>(dv[half][2 * r], dv[half][2 * r + 1]);
            *reinterpret_cast<unsigned int*>(v_tile_bytes + offset) =
                mma::pack2<T>(dk[half][2 * r] * scale, dk[half][2 * r + 1] * scale);
          }
    }
  }
  __syncwarp();
  store_rows<T, COLS>(static_cast<T*>(p.dv) + x.batch_index * p.dv_batch_stride + x.k.start * p.dv_token_stride +
                          x.head * p.dv_head_stride + first_column,
                      p.dv_token_stride, k_tile_bytes, len_k, lane);
  store_rows<T, COLS>(static_cast<T*>(p.dk) + x.batch_index * p.dk_batch_stride + x.k.start * p.dk_token_stride +
                          x.head * p.dk_head_stride + first_column,
                      p.dk_token_stride, v_tile_bytes, len_k, lane);
}

}  // namespace smallseq

// WARPS warps per block in teams of SPLIT, each team walking its run of problems_per_team problems;
// the host's table (catalog.smallseq.SMALLSEQ_BACKWARD_MMA_TILES) sizes the dynamic shared memory.
template <typename T, int HEAD_DIM, int HEADS, int TILE, int WARPS, int SPLIT, bool SCORE_MODS>
__global__ void __launch_bounds__(WARPS * 32) smallseq_backward_mma(const SmallSeqBackwardMmaParams p) {
  using Team = smallseq::BackwardTeamTiles<T, HEAD_DIM, TILE, SPLIT>;
  static_assert(TILE > 16 && TILE <= 24, "the fragments cover up to 32 query rows and 24 keys");
  static_assert(WARPS % SPLIT == 0, "whole teams");
  constexpr int TEAMS = WARPS / SPLIT;
  extern __shared__ __align__(16) unsigned char shared_bytes[];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int team = warp / SPLIT;
  const int part = warp % SPLIT;
  const smallseq::Run run =
      smallseq::team_run(static_cast<long long>(p.batch) * HEADS, p.problems_per_team, TEAMS, team);
  unsigned char* const base = shared_bytes + team * Team::kBytes;
  unsigned char* const warp_base = base + part * Team::Warp::kBytes;
  const smallseq::BackwardShared sh{warp_base + Team::Warp::kTilesOffset, mma::shared_address(warp_base),
                                    reinterpret_cast<float*>(base + Team::kStatsOffset), base + Team::kScoresOffset,
                                    base + Team::kExchangeOffset};
  // The zero row, and P and dZ: their columns past a problem's keys must be finite (they meet K's
  // zero row in dQ). The first team barrier publishes the zeros.
  smallseq::zero_bytes(warp_base, Team::Warp::kPitchBytes, lane);
  if (part == 0) smallseq::zero_bytes(base + Team::kScoresOffset, smallseq::ScoreTiles<T, TILE>::kBytes, lane);
  smallseq::team_sync<SPLIT, TEAMS>(team);

  smallseq::Problem x = smallseq::no_problem();
  for (long long index = run.first; index < run.end; index += run.step) {
    x = smallseq::locate_problem<HEADS, TILE>(p, index, x);
    smallseq::stage_backward<T, HEAD_DIM / SPLIT, TILE>(p, x, part * (HEAD_DIM / SPLIT), sh.tiles, sh.lse_rows,
                                                        part == 0, lane);
    mma::wait_async_copies();
    __syncwarp();
    smallseq::backward_problem<T, HEAD_DIM, TILE, SPLIT, TEAMS, SCORE_MODS>(p, x, sh, team, part, lane);
    __syncwarp();  // every lane is done with the tiles before the next problem's copies land in them
  }
}

}  // namespace hipattn
