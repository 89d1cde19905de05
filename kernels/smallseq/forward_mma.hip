// Small-sequence attention forward on NVIDIA tensor cores (sm_80+): same contract as
// smallseq/forward.hip (the portable kernel, which AMD targets use until an MFMA variant exists).
//
// Each warp (a team of one) walks a run of problems (smallseq/mma_tiles.h). Per problem it copies
// the Q, K and V rows into its tiles with cp.async, computes S = Q Kᵀ with mma.sync m16n8k16 (at
// most two 16-row query tiles by three 8-key tiles), takes the softmax on the accumulators (row
// reductions inside each quad of lanes), reuses the probabilities as the A operand of O = P V, and
// writes O back through the Q tile with 16-byte stores. Warps are independent: no block barrier.
#pragma once
#include "smallseq/mma_tiles.h"

namespace hipattn {
namespace smallseq {

template <typename T, int HEAD_DIM, int TILE>
using ForwardWarpTiles = WarpTiles<T, HEAD_DIM, TILE, 3>;

// Issue the copies of problem x's Q, K and V rows into `tiles` (in that order).
template <typename T, int HEAD_DIM, int HEADS, int TILE>
HIPATTN_DEVICE void stage_forward(const SmallSeqForwardMmaParams& p, const Problem& x, unsigned char* tiles, int lane) {
  using Tiles = ForwardWarpTiles<T, HEAD_DIM, TILE>;
  const int head_kv = x.head / (HEADS / p.heads_kv);
  stage_rows<T, HEAD_DIM>(tiles, static_cast<const T*>(p.q) + x.batch_index * p.q_batch_stride +
                                    x.q.start * p.q_token_stride + x.head * p.q_head_stride,
                          p.q_token_stride, x.q.length, lane);
  stage_rows<T, HEAD_DIM>(tiles + Tiles::kTileBytes, static_cast<const T*>(p.k) + x.batch_index * p.k_batch_stride +
                                                        x.k.start * p.k_token_stride + head_kv * p.k_head_stride,
                          p.k_token_stride, x.k.length, lane);
  stage_rows<T, HEAD_DIM>(tiles + 2 * Tiles::kTileBytes, static_cast<const T*>(p.v) +
                                                            x.batch_index * p.v_batch_stride +
                                                            x.k.start * p.v_token_stride + head_kv * p.v_head_stride,
                          p.v_token_stride, x.k.length, lane);
}

// O and LSE of problem x, whose rows are staged in `tiles`; O overwrites the Q tile on its way out.
template <typename T, int HEAD_DIM, int TILE>
HIPATTN_DEVICE void forward_problem(const SmallSeqForwardMmaParams& p, const Problem& x, unsigned char* tiles,
                                    unsigned int zero, int lane) {
  using Tiles = ForwardWarpTiles<T, HEAD_DIM, TILE>;
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
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  // The key rows this lane addresses for the B operands of S (three 8-key tiles).
  const unsigned int k_rows01 = row_or_zero(k_tile, zero, 8 * (lane / 16) + lane % 8, len_k, kPitchBytes) +
                                16 * ((lane / 8) % 2);
  const unsigned int k_row2 = row_or_zero(k_tile, zero, 16 + lane % 8, len_k, kPitchBytes) + 16 * ((lane / 8) % 2);

  for (int mt = 0; mt < m_tiles; ++mt) {
    // ---- S = Q Kᵀ for query rows [16 mt, 16 mt + 16) and keys [0, 24) ----
    const unsigned int q_row = row_or_zero(q_tile, zero, 16 * mt + lane % 16, len_q, kPitchBytes) + 16 * (lane / 16);
    float s[3][4] = {};
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      unsigned int a[4];
      mma::ldmatrix_x4(a, q_row + 32 * ks);
      if (n_tiles > 0) {
        unsigned int b[4];
        mma::ldmatrix_x4(b, k_rows01 + 32 * ks);
        mma::mma_16816<T>(s[0], a, b[0], b[1]);
        mma::mma_16816<T>(s[1], a, b[2], b[3]);
      }
      if (n_tiles > 2) {
        unsigned int b[2];
        mma::ldmatrix_x2(b, k_row2 + 32 * ks);
        mma::mma_16816<T>(s[2], a, b[0], b[1]);
      }
    }

    // ---- softmax on the accumulators: a row's 24 scores live in the 4 lanes of one quad ----
    const int row[2] = {16 * mt + g, 16 * mt + g + 8};
    float row_max[2] = {-infinity(), -infinity()};
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = 8 * nt + 2 * t + (e & 1);
        const bool visible = j < len_k && key_visible(row[e / 2], j, len_q, len_k, p.causal);
        s[nt][e] = visible ? s[nt][e] * scale_log2 : -infinity();
        row_max[e / 2] = fmaxf(row_max[e / 2], s[nt][e]);
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
        s[nt][e] = m == -infinity() ? 0.0f : fast_exp2(s[nt][e] - m);
        row_sum[e / 2] += s[nt][e];
      }
    float inv_sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += shfl_xor(row_sum[r], 1, 32, 0xffffffffu);
      row_sum[r] += shfl_xor(row_sum[r], 2, 32, 0xffffffffu);
      // A row that sees no key: O = 0 and LSE = +inf (flash-attn's convention; see forward.hip).
      inv_sum[r] = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
      if (t == 0 && row[r] < len_q) {
        static_cast<float*>(p.lse)[x.batch_index * p.lse_batch_stride + x.head * p.lse_head_stride + x.q.start +
                                   row[r]] =
            row_sum[r] > 0.0f ? (row_max[r] + fast_log2(row_sum[r])) * 0.6931471805599453f : infinity();
      }
    }

    // ---- O = P V: the probabilities' accumulator layout is the A-operand layout ----
    unsigned int pa[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      pa[kk][0] = mma::pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = mma::pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = kk == 0 ? mma::pack2<T>(s[1][0], s[1][1]) : 0u;  // keys 24..31 do not exist
      pa[kk][3] = kk == 0 ? mma::pack2<T>(s[1][2], s[1][3]) : 0u;
    }
    __syncwarp();  // every lane has read this tile's Q rows; O is staged over them
#pragma unroll
    for (int nt = 0; nt < HEAD_DIM / 16; ++nt) {
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
  // ---- O's rows out with 16-byte stores ----
  store_rows<T, HEAD_DIM>(static_cast<T*>(p.o) + x.batch_index * p.o_batch_stride + x.q.start * p.o_token_stride +
                              x.head * p.o_head_stride,
                          p.o_token_stride, tiles, len_q, lane);
}

}  // namespace smallseq

// WARPS warps per block, each walking its run of problems_per_team problems; the host's table
// (families.SMALLSEQ_FORWARD_MMA_TILES) sizes the dynamic shared memory.
template <typename T, int HEAD_DIM, int HEADS, int TILE, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) smallseq_forward_mma(const SmallSeqForwardMmaParams p) {
  using Tiles = smallseq::ForwardWarpTiles<T, HEAD_DIM, TILE>;
  static_assert(TILE > 16 && TILE <= 24, "the fragments cover up to 32 query rows, 24 keys and 2 k-steps of keys");
  extern __shared__ __align__(16) unsigned char shared_bytes[];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const smallseq::Run run =
      smallseq::team_run(static_cast<long long>(p.batch) * HEADS, p.problems_per_team, WARPS, warp);
  unsigned char* const base = shared_bytes + warp * Tiles::kBytes;
  smallseq::zero_bytes(base, Tiles::kPitchBytes, lane);  // the zero row; the first __syncwarp publishes it
  const unsigned int zero = mma::shared_address(base);
  unsigned char* const tiles = base + Tiles::kTilesOffset;

  smallseq::Problem x = smallseq::no_problem();
  for (long long index = run.first; index < run.end; index += run.step) {
    x = smallseq::locate_problem<HEADS, TILE>(p, index, x);
    smallseq::stage_forward<T, HEAD_DIM, HEADS, TILE>(p, x, tiles, lane);
    mma::wait_async_copies();
    __syncwarp();
    if (x.q.length > 0) smallseq::forward_problem<T, HEAD_DIM, TILE>(p, x, tiles, zero, lane);
    __syncwarp();  // every lane is done with the tiles before the next problem's copies land in them
  }
}

}  // namespace hipattn
