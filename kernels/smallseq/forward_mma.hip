// Small-sequence attention forward on NVIDIA tensor cores (sm_80+): same contract as
// smallseq/forward.hip (the portable kernel, which AMD targets use until an MFMA variant exists).
//
// One warp per (sequence, head). The warp copies its Q, K and V rows into shared memory with
// cp.async (16-byte accesses, coalesced), computes S = Q Kᵀ with mma.sync m16n8k16 (at most two
// 16-row query tiles by three 8-key tiles), takes the softmax on the accumulators (row reductions
// inside each quad of lanes), reuses the probabilities as the A operand of O = P V, and writes O
// back through shared memory with 16-byte stores. Warps are independent: no block barrier.
#pragma once
#include "smallseq/mma_tiles.h"

namespace hipattn {


template <typename T, int HEAD_DIM, int HEADS, int TILE, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) smallseq_forward_mma(const SmallSeqForwardParams p) {
  using Tiles = smallseq::MmaTiles<T, HEAD_DIM>;
  static_assert(TILE > 16 && TILE <= 24, "the tiles hold up to 32 query rows, 24 keys and 2 k-steps of keys");
  static_assert(WARPS * Tiles::kElements * sizeof(T) <= 48 * 1024, "static shared memory is limited to 48 KiB");
  __shared__ __align__(16) T shared[WARPS][Tiles::kElements];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const long long problem = static_cast<long long>(blockIdx.x) * WARPS + warp;
  if (problem >= static_cast<long long>(p.batch) * HEADS) return;  // no block barrier follows
  const int batch_index = static_cast<int>(problem / HEADS);
  const int head = static_cast<int>(problem % HEADS);
  const int head_kv = head / (HEADS / p.heads_kv);
  const smallseq::Sequence seq_q = smallseq::sequence_bounds(
      static_cast<const int*>(p.cu_seqlens_q), static_cast<const int*>(p.seqused_q), batch_index, p.max_seqlen_q,
      p.total_q, TILE);
  const smallseq::Sequence seq_k = smallseq::sequence_bounds(
      static_cast<const int*>(p.cu_seqlens_k), static_cast<const int*>(p.seqused_k), batch_index, p.max_seqlen_k,
      p.total_k, TILE);
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;
  if (len_q == 0) return;

  T* q_tile = shared[warp];
  T* k_tile = q_tile + Tiles::kQRows * Tiles::kPitch;
  T* v_tile = k_tile + Tiles::kKRows * Tiles::kPitch;
  smallseq::stage_rows<T, HEAD_DIM>(q_tile,
                                    static_cast<const T*>(p.q) + batch_index * p.q_batch_stride +
                                        seq_q.start * p.q_token_stride + head * p.q_head_stride,
                                    p.q_token_stride, len_q, lane);
  smallseq::stage_rows<T, HEAD_DIM>(k_tile,
                                    static_cast<const T*>(p.k) + batch_index * p.k_batch_stride +
                                        seq_k.start * p.k_token_stride + head_kv * p.k_head_stride,
                                    p.k_token_stride, len_k, lane);
  smallseq::stage_rows<T, HEAD_DIM>(v_tile,
                                    static_cast<const T*>(p.v) + batch_index * p.v_batch_stride +
                                        seq_k.start * p.v_token_stride + head_kv * p.v_head_stride,
                                    p.v_token_stride, len_k, lane);
  // V rows past the last key up to the end of its k-step meet P = 0 in the MMA; zero them, since
  // 0 * (whatever was in shared memory) could be NaN. Unused Q and K rows only reach rows and
  // columns of S that are masked or never stored.
  const int v_rows = len_k > 16 ? 32 : 16;
  for (int c = lane; c < (v_rows - len_k) * Tiles::kChunks; c += 32) {
    *reinterpret_cast<Vec<T, 8>*>(v_tile + (len_k + c / Tiles::kChunks) * Tiles::kPitch + (c % Tiles::kChunks) * 8) =
        Vec<T, 8>{};
  }
  mma::wait_async_copies();
  __syncwarp();

  const int g = lane / 4;  // fragment row within a 16-row tile (and +8)
  const int t = lane % 4;  // fragment column pair
  const int n_tiles = (len_k + 7) / 8;
  const int k_steps = (len_k + 15) / 16;
  const int m_tiles = (len_q + 15) / 16;
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;

  for (int mt = 0; mt < m_tiles; ++mt) {
    // ---- S = Q Kᵀ for query rows [16 mt, 16 mt + 16) and keys [0, 24) ----
    float s[3][4] = {};
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      unsigned int a[4];
      mma::ldmatrix_x4(a, q_tile + (16 * mt + lane % 16) * Tiles::kPitch + 16 * ks + 8 * (lane / 16));
      if (n_tiles > 0) {
        unsigned int b[4];
        mma::ldmatrix_x4(b, k_tile + (8 * (lane / 16) + lane % 8) * Tiles::kPitch + 16 * ks + 8 * ((lane / 8) % 2));
        mma::mma_16816<T>(s[0], a, b[0], b[1]);
        mma::mma_16816<T>(s[1], a, b[2], b[3]);
      }
      if (n_tiles > 2) {
        unsigned int b[2];
        mma::ldmatrix_x2(b, k_tile + (16 + lane % 8) * Tiles::kPitch + 16 * ks + 8 * ((lane / 8) % 2));
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
        const bool visible = j < len_k && smallseq::key_visible(row[e / 2], j, len_q, len_k, p.causal);
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
        static_cast<float*>(p.lse)[batch_index * p.lse_batch_stride + head * p.lse_head_stride + seq_q.start +
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
              b, v_tile + (16 * kk + lane % 8 + 8 * ((lane / 8) % 2)) * Tiles::kPitch + 16 * nt + 8 * (lane / 16));
          mma::mma_16816<T>(o[0], pa[kk], b[0], b[1]);
          mma::mma_16816<T>(o[1], pa[kk], b[2], b[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          *reinterpret_cast<unsigned int*>(q_tile + row[r] * Tiles::kPitch + 16 * nt + 8 * half + 2 * t) =
              mma::pack2<T>(o[half][2 * r] * inv_sum[r], o[half][2 * r + 1] * inv_sum[r]);
        }
    }
    __syncwarp();
    // ---- write this tile's rows of O with 16-byte stores ----
    const int first = 16 * mt;
    const int rows = (len_q < first + 16 ? len_q : first + 16) - first;
    T* o_rows = static_cast<T*>(p.o) + batch_index * p.o_batch_stride + (seq_q.start + first) * p.o_token_stride +
                head * p.o_head_stride;
    for (int c = lane; c < rows * Tiles::kChunks; c += 32) {
      const int r = c / Tiles::kChunks;
      const int chunk = c % Tiles::kChunks;
      *reinterpret_cast<Vec<T, 8>*>(o_rows + r * p.o_token_stride + chunk * 8) =
          *reinterpret_cast<const Vec<T, 8>*>(q_tile + (first + r) * Tiles::kPitch + chunk * 8);
    }
  }
}

}  // namespace hipattn
