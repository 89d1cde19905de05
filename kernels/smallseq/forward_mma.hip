// Small-sequence attention forward on NVIDIA tensor cores (sm_80+): same contract as
// smallseq/forward.hip (the portable kernel, which AMD targets use until an MFMA variant exists).
//
// Each team of warps walks a run of problems (smallseq/mma_tiles.h). Per problem it copies the Q, K
// and V rows into its tiles with cp.async, computes S = Q Kᵀ with mma.sync m16n8k16 (at most two
// 16-row query tiles by three 8-key tiles), takes the softmax on the accumulators (row reductions
// inside each quad of lanes), reuses the probabilities as the A operand of O = P V, and writes O back
// through the Q tile with 16-byte stores. Dropout (SCORE_MODS, common/dropout.h) scales the kept
// probabilities and zeroes the dropped ones before P V, after the sum and the LSE.
//
// SPLIT warps share a problem (a team): each stages HEAD_DIM / SPLIT of its columns. With SPLIT = 2
// each warp hands its partial S to the other through its K tile (K is no longer needed), both add
// the two halves (a + b == b + a, so both hold the same S) and run the same softmax, and each
// computes its own columns of O. At head_dim 256 this halves a warp's tiles, so an SM holds 16 warps
// instead of 8, and halves each warp's chain of dependent instructions. Teams of one warp need no
// block barrier.
#pragma once
#include "smallseq/mma_tiles.h"

namespace hipattn {
namespace smallseq {

// One team's shared memory, in bytes from its base: each warp's zero row and Q, K and V tiles of
// HEAD_DIM / SPLIT columns. The host's row (hipattn/catalog/smallseq.py, SmallSeqForwardMmaTiles.team_bytes) computes kBytes from the
// same arguments.
template <typename T, int HEAD_DIM, int TILE, int SPLIT>
struct ForwardTeamTiles {
  using Warp = WarpTiles<T, HEAD_DIM / SPLIT, TILE, 3>;
  static constexpr int kBytes = SPLIT * Warp::kBytes;
  static_assert(SPLIT == 1 || SPLIT == 2, "one warp per problem, or two that split its columns");
  static_assert(HEAD_DIM % (16 * SPLIT) == 0, "each warp takes whole 16-column mma steps");
  static_assert(SPLIT == 1 || Warp::kTileBytes >= ScoreExchange<1>::kBytes, "the partial S fits in K's tile");
};

// Issue the copies of problem x's Q, K and V rows (COLS columns from `column`) into `tiles` (in that
// order).
template <typename T, int COLS, int HEADS, int TILE>
HIPATTN_DEVICE void stage_forward(const SmallSeqForwardMmaParams& p, const Problem& x, int column, unsigned char* tiles,
                                  int lane) {
  using Tiles = WarpTiles<T, COLS, TILE, 3>;
  const int head_kv = x.head / (HEADS / p.heads_kv);
  stage_rows<T, COLS>(tiles, static_cast<const T*>(p.q) + x.batch_index * p.q_batch_stride +
                                 x.q.start * p.q_token_stride + x.head * p.q_head_stride + column,
                      p.q_token_stride, x.q.length, lane);
  stage_rows<T, COLS>(tiles + Tiles::kTileBytes, static_cast<const T*>(p.k) + x.batch_index * p.k_batch_stride +
                                                     x.k.start * p.k_token_stride + head_kv * p.k_head_stride + column,
                      p.k_token_stride, x.k.length, lane);
  stage_rows<T, COLS>(tiles + 2 * Tiles::kTileBytes, static_cast<const T*>(p.v) + x.batch_index * p.v_batch_stride +
                                                         x.k.start * p.v_token_stride + head_kv * p.v_head_stride +
                                                         column,
                      p.v_token_stride, x.k.length, lane);
}

// O and LSE of problem x: this warp's `part` of the team's columns, staged in `tiles`; O overwrites
// the Q tile on its way out. `partner_k_tile` is the other warp's K tile (SPLIT = 2).
template <typename T, int HEAD_DIM, int TILE, int SPLIT, int TEAMS, bool SCORE_MODS>
HIPATTN_DEVICE void forward_problem(const SmallSeqForwardMmaParams& p, const Problem& x, unsigned char* tiles,
                                    const unsigned char* partner_k_tile, unsigned int zero, int team, int part,
                                    int lane) {
  constexpr int COLS = HEAD_DIM / SPLIT;
  using Tiles = WarpTiles<T, COLS, TILE, 3>;
  constexpr int kPitchBytes = Tiles::kPitchBytes;
  const int len_q = x.q.length;
  const int len_k = x.k.length;
  const unsigned int q_tile = mma::shared_address(tiles);
  const unsigned int k_tile = q_tile + Tiles::kTileBytes;
  const unsigned int v_tile = k_tile + Tiles::kTileBytes;
  const int g = lane / 4;  // fragment row within a 16-row tile (and +8)
  const int t = lane % 4;  // fragment column pair
  const int n_tiles = (len_k + 7) / 8;
  const int k_steps = (len_k + 15) / 16;
  const int m_tiles = (len_q + 15) / 16;
  const Scores<SCORE_MODS> score = scores_of<SCORE_MODS>(p, x.batch_index, x.head);
  const float sink = sink_log2<SCORE_MODS>(p, x.head);
  const Dropout<SCORE_MODS> dropout = dropout_of<SCORE_MODS>(p, x.batch_index, x.head);
  const KeyWindow window = key_window(p);
  // The key rows this lane addresses for the B operands of S (three 8-key tiles).
  const unsigned int k_rows01 = row_or_zero(k_tile, zero, 8 * (lane / 16) + lane % 8, len_k, kPitchBytes) +
                                16 * ((lane / 8) % 2);
  const unsigned int k_row2 = row_or_zero(k_tile, zero, 16 + lane % 8, len_k, kPitchBytes) + 16 * ((lane / 8) % 2);

  auto scores_of_query_tile = [&](float(&scores)[3][4], int mt) {
    // S = Q Kᵀ over this warp's columns, for query rows [16 mt, 16 mt + 16) and keys [0, 24).
    const unsigned int q_row = row_or_zero(q_tile, zero, 16 * mt + lane % 16, len_q, kPitchBytes) + 16 * (lane / 16);
#pragma unroll
    for (int ks = 0; ks < COLS / 16; ++ks) {
      unsigned int a[4];
      mma::ldmatrix_x4(a, q_row + 32 * ks);
      if (n_tiles > 0) {
        unsigned int b[4];
        mma::ldmatrix_x4(b, k_rows01 + 32 * ks);
        mma::mma_16816<T>(scores[0], a, b[0], b[1]);
        mma::mma_16816<T>(scores[1], a, b[2], b[3]);
      }
      if (n_tiles > 2) {
        unsigned int b[2];
        mma::ldmatrix_x2(b, k_row2 + 32 * ks);
        mma::mma_16816<T>(scores[2], a, b[0], b[1]);
      }
    }
  };
  // A team of two computes both query tiles' partial S first and hands them over through each warp's
  // own K tile, which S no longer needs; each warp then adds the other's half.
  float team_scores[2][3][4] = {};
  if (SPLIT == 2) {
    scores_of_query_tile(team_scores[0], 0);
    if (m_tiles > 1) scores_of_query_tile(team_scores[1], 1);
    __syncwarp();  // every lane has read K
    hand_over_scores<1>(tiles + Tiles::kTileBytes, 0, team_scores, lane);
    team_sync<SPLIT, TEAMS>(team);
    add_handed_scores<1>(partner_k_tile, 0, team_scores, lane);
  }

  for (int mt = 0; mt < m_tiles; ++mt) {
    float scores[3][4] = {};
    if (SPLIT == 1) {
      scores_of_query_tile(scores, mt);
      __syncwarp();  // every lane has read this tile's Q rows; its O rows are staged over them
    } else {
      // Selected, not indexed by mt, which would put team_scores in local memory.
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) scores[nt][e] = mt == 0 ? team_scores[0][nt][e] : team_scores[1][nt][e];
    }
    // ---- softmax on the accumulators: a row's 24 scores live in the 4 lanes of one quad ----
    const int row[2] = {16 * mt + g, 16 * mt + g + 8};
    const RowKeys keys[2] = {row_keys(row[0], len_q, len_k, window), row_keys(row[1], len_q, len_k, window)};
    const int diagonal[2] = {row[0] + len_k - len_q, row[1] + len_k - len_q};  // the rows' diagonal keys (ALiBi)
    float row_max[2] = {-infinity(), -infinity()};
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = 8 * nt + 2 * t + (e & 1);
        scores[nt][e] = keys[e / 2].contains(j) ? score(scores[nt][e], j - diagonal[e / 2]) : -infinity();
        row_max[e / 2] = fmaxf(row_max[e / 2], scores[nt][e]);
      }
    float row_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[r] = fmaxf(row_max[r], shfl_xor(row_max[r], 1, 32, 0xffffffffu));
      row_max[r] = fmaxf(row_max[r], shfl_xor(row_max[r], 2, 32, 0xffffffffu));
    }
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float m = row_max[e / 2];
        scores[nt][e] = m == -infinity() ? 0.0f : fast_exp2(scores[nt][e] - m);
        row_sum[e / 2] += scores[nt][e];
      }
    float inv_sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += shfl_xor(row_sum[r], 1, 32, 0xffffffffu);
      row_sum[r] += shfl_xor(row_sum[r], 2, 32, 0xffffffffu);
      // A row that sees no key: O = 0 and LSE = +inf, or the sink (flash-attn's convention; see forward.hip).
      inv_sum[r] = row_inv_sum(row_max[r], row_sum[r], sink);
      if (part == 0 && t == 0 && row[r] < len_q) {
        static_cast<float*>(p.lse)[x.batch_index * p.lse_batch_stride + x.head * p.lse_head_stride + x.q.start +
                                   row[r]] = row_lse(row_max[r], row_sum[r], sink);
      }
    }

    // Dropout after the sum and the LSE: the dropped probabilities are 0, the kept ones scaled.
    if (dropout.active()) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const unsigned long long kept = dropout.template m16n8_bits<4>(row[r], 0, t);  // keys 0..31
#pragma unroll
        for (int nt = 0; nt < 3; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            scores[nt][2 * r + h] = (kept >> (2 * nt + h) & 1ull) != 0 ? scores[nt][2 * r + h] * dropout.scale() : 0.0f;
      }
    }

    // ---- O = P V over this warp's columns: the probabilities' accumulator layout is the A-operand layout ----
    unsigned int pa[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      pa[kk][0] = mma::pack2<T>(scores[2 * kk][0], scores[2 * kk][1]);
      pa[kk][1] = mma::pack2<T>(scores[2 * kk][2], scores[2 * kk][3]);
      pa[kk][2] = kk == 0 ? mma::pack2<T>(scores[1][0], scores[1][1]) : 0u;  // keys 24..31 do not exist
      pa[kk][3] = kk == 0 ? mma::pack2<T>(scores[1][2], scores[1][3]) : 0u;
    }
#pragma unroll
    for (int nt = 0; nt < COLS / 16; ++nt) {
      float o[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        if (kk < k_steps) {
          unsigned int b[4];
          mma::ldmatrix_x4_trans(
              b, row_or_zero(v_tile, zero, 16 * kk + lane % 8 + 8 * ((lane / 8) % 2), len_k, kPitchBytes) +
                     32 * nt + 16 * (lane / 16));
          mma::mma_16816<T>(o[0], pa[kk], b[0], b[1]);
          mma::mma_16816<T>(o[1], pa[kk], b[2], b[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (row[r] < len_q)  // the Q tile holds TILE rows
            *reinterpret_cast<unsigned int*>(tiles + row[r] * kPitchBytes + 32 * nt + 16 * half + 4 * t) =
                mma::pack2<T>(o[half][2 * r] * inv_sum[r], o[half][2 * r + 1] * inv_sum[r]);
    }
  }
  __syncwarp();
  // ---- O's rows (this warp's columns) out with 16-byte stores ----
  store_rows<T, COLS>(static_cast<T*>(p.o) + x.batch_index * p.o_batch_stride + x.q.start * p.o_token_stride +
                          x.head * p.o_head_stride + part * COLS,
                      p.o_token_stride, tiles, len_q, lane);
}

}  // namespace smallseq

// WARPS warps per block in teams of SPLIT, each team walking its run of problems_per_team problems;
// the host's table (catalog.smallseq.SMALLSEQ_FORWARD_MMA_TILES) sizes the dynamic shared memory.
template <typename T, int HEAD_DIM, int HEADS, int TILE, int WARPS, int SPLIT, bool SCORE_MODS>
__global__ void __launch_bounds__(WARPS * 32) smallseq_forward_mma(const SmallSeqForwardMmaParams p) {
  using Team = smallseq::ForwardTeamTiles<T, HEAD_DIM, TILE, SPLIT>;
  using Warp = typename Team::Warp;
  static_assert(TILE > 16 && TILE <= 24, "the fragments cover up to 32 query rows, 24 keys and 2 k-steps of keys");
  static_assert(WARPS % SPLIT == 0, "whole teams");
  constexpr int TEAMS = WARPS / SPLIT;
  extern __shared__ __align__(16) unsigned char shared_bytes[];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int team = warp / SPLIT;
  const int part = warp % SPLIT;
  const smallseq::Run run =
      smallseq::team_run(static_cast<long long>(p.batch) * HEADS, p.problems_per_team, TEAMS, team);
  unsigned char* const team_base = shared_bytes + team * Team::kBytes;
  unsigned char* const base = team_base + part * Warp::kBytes;
  smallseq::zero_bytes(base, Warp::kPitchBytes, lane);  // the zero row; the first __syncwarp publishes it
  const unsigned int zero = mma::shared_address(base);
  unsigned char* const tiles = base + Warp::kTilesOffset;
  const unsigned char* const partner_k_tile =
      team_base + (SPLIT - 1 - part) * Warp::kBytes + Warp::kTilesOffset + Warp::kTileBytes;

  smallseq::Problem x = smallseq::no_problem();
  for (long long index = run.first; index < run.end; index += run.step) {
    x = smallseq::locate_problem<HEADS, TILE>(p, index, x);
    smallseq::stage_forward<T, HEAD_DIM / SPLIT, HEADS, TILE>(p, x, part * (HEAD_DIM / SPLIT), tiles, lane);
    mma::wait_async_copies();
    __syncwarp();
    if (x.q.length > 0)  // the same for both warps of a team: they share the problem
      smallseq::forward_problem<T, HEAD_DIM, TILE, SPLIT, TEAMS, SCORE_MODS>(p, x, tiles, partner_k_tile, zero, team,
                                                                         part, lane);
    // Every lane is done with the tiles (and, SPLIT = 2, the other warp with this one's partial S in
    // its K tile) before the next problem's copies land in them.
    smallseq::team_sync<SPLIT, TEAMS>(team);
  }
}

}  // namespace hipattn
