// Small-sequence attention backward on NVIDIA tensor cores (sm_80+), for heads without KV sharing
// (Hq == Hkv) and head_dim up to 128; GQA/MQA and head_dim 256 take the portable kernel
// (smallseq/backward.hip), which sums dK/dV over a group in shared memory.
//
// One warp per (sequence, head). Q, K, V and dO are staged in shared memory with cp.async; then
//   S = Q Kᵀ, dP = dO Vᵀ                     (mma, query rows x keys)
//   P = exp(scale*S - LSE), D_i = sum_j P_ij dP_ij, dZ = P * (dP - D)   (on the accumulators)
//   dQ = scale * dZ K                          (dZ reused as the A operand)
//   dV = Pᵀ dO, dK = scale * dZᵀ Q             (Pᵀ and dZᵀ read back transposed with ldmatrix.trans)
// D_i = sum_j P_ij dP_ij equals rowsum(dO * O), so O is never read.
#pragma once
#include "smallseq/mma_tiles.h"

namespace hipattn {
namespace smallseq {

template <typename T, int HEAD_DIM>
struct MmaBackwardTiles {
  static constexpr int kPitch = MmaTiles<T, HEAD_DIM>::kPitch;
  static constexpr int kRows = 32;            // Q, dO and K rows: two 16-row tiles / k-steps
  static constexpr int kVRows = 24;           // V is only the B operand of dP: three 8-key tiles
  static constexpr int kScorePitch = 32 + 8;  // P and dZ as [query][key], keys padded to 32
  static constexpr int kElements = (3 * kRows + kVRows) * kPitch + 2 * kRows * kScorePitch;
};

}  // namespace smallseq

template <typename T, int HEAD_DIM, int HEADS, int TILE, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) smallseq_backward_mma(const SmallSeqBackwardParams p) {
  using Tiles = smallseq::MmaBackwardTiles<T, HEAD_DIM>;
  static_assert(TILE > 16 && TILE <= 24, "the tiles hold up to 32 query rows and 24 keys");
  static_assert(WARPS * Tiles::kElements * sizeof(T) <= 48 * 1024, "static shared memory is limited to 48 KiB");
  __shared__ __align__(16) T shared[WARPS][Tiles::kElements];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const long long problem = static_cast<long long>(blockIdx.x) * WARPS + warp;
  if (problem >= static_cast<long long>(p.batch) * HEADS) return;  // no block barrier follows
  const int batch_index = static_cast<int>(problem / HEADS);
  const int head = static_cast<int>(problem % HEADS);  // Hq == Hkv on this path
  const smallseq::Sequence seq_q = smallseq::sequence_bounds(
      static_cast<const int*>(p.cu_seqlens_q), static_cast<const int*>(p.seqused_q), batch_index, p.max_seqlen_q,
      p.total_q, TILE);
  const smallseq::Sequence seq_k = smallseq::sequence_bounds(
      static_cast<const int*>(p.cu_seqlens_k), static_cast<const int*>(p.seqused_k), batch_index, p.max_seqlen_k,
      p.total_k, TILE);
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;
  const int g = lane / 4;
  const int t = lane % 4;
  if (len_k == 0) {
    // No key: P = 0, so dQ = 0 for every query row, and there is no dK/dV row to write.
    T* dq_rows = static_cast<T*>(p.dq) + batch_index * p.dq_batch_stride + seq_q.start * p.dq_token_stride +
                 head * p.dq_head_stride;
    constexpr int kChunks = smallseq::MmaTiles<T, HEAD_DIM>::kChunks;
    for (int c = lane; c < len_q * kChunks; c += 32)
      *reinterpret_cast<Vec<T, 8>*>(dq_rows + (c / kChunks) * p.dq_token_stride + (c % kChunks) * 8) = Vec<T, 8>{};
    return;
  }
  T* const dk_rows = static_cast<T*>(p.dk) + batch_index * p.dk_batch_stride + seq_k.start * p.dk_token_stride +
                     head * p.dk_head_stride;
  T* const dv_rows = static_cast<T*>(p.dv) + batch_index * p.dv_batch_stride + seq_k.start * p.dv_token_stride +
                     head * p.dv_head_stride;

  T* q_tile = shared[warp];
  T* do_tile = q_tile + Tiles::kRows * Tiles::kPitch;
  T* k_tile = do_tile + Tiles::kRows * Tiles::kPitch;
  T* v_tile = k_tile + Tiles::kRows * Tiles::kPitch;
  T* p_tile = v_tile + Tiles::kVRows * Tiles::kPitch;
  T* dz_tile = p_tile + Tiles::kRows * Tiles::kScorePitch;

  const int q_rows = len_q > 16 ? 32 : 16;
  const int k_rows = len_k > 16 ? 32 : 16;
  smallseq::stage_rows<T, HEAD_DIM>(q_tile,
                                    static_cast<const T*>(p.q) + batch_index * p.q_batch_stride +
                                        seq_q.start * p.q_token_stride + head * p.q_head_stride,
                                    p.q_token_stride, len_q, lane);
  smallseq::stage_rows<T, HEAD_DIM>(do_tile,
                                    static_cast<const T*>(p.dout) + batch_index * p.dout_batch_stride +
                                        seq_q.start * p.dout_token_stride + head * p.dout_head_stride,
                                    p.dout_token_stride, len_q, lane);
  smallseq::stage_rows<T, HEAD_DIM>(k_tile,
                                    static_cast<const T*>(p.k) + batch_index * p.k_batch_stride +
                                        seq_k.start * p.k_token_stride + head * p.k_head_stride,
                                    p.k_token_stride, len_k, lane);
  smallseq::stage_rows<T, HEAD_DIM>(v_tile,
                                    static_cast<const T*>(p.v) + batch_index * p.v_batch_stride +
                                        seq_k.start * p.v_token_stride + head * p.v_head_stride,
                                    p.v_token_stride, len_k, lane);
  // Q and dO are B operands over queries (dK, dV), K over keys (dQ) and V feeds dP: their rows past
  // the sequence meet zero weights, so they must hold zeros, not stale shared memory (0 * NaN is
  // NaN). P and dZ start at zero for the keys and queries no fragment writes.
  smallseq::zero_rows<T, HEAD_DIM>(q_tile, len_q, q_rows, lane);
  smallseq::zero_rows<T, HEAD_DIM>(do_tile, len_q, q_rows, lane);
  smallseq::zero_rows<T, HEAD_DIM>(k_tile, len_k, k_rows, lane);
  smallseq::zero_rows<T, HEAD_DIM>(v_tile, len_k, Tiles::kVRows, lane);
  for (int c = lane; c < 2 * Tiles::kRows * Tiles::kScorePitch / 8; c += 32)
    reinterpret_cast<Vec<T, 8>*>(p_tile)[c] = Vec<T, 8>{};
  mma::wait_async_copies();
  __syncwarp();

  const int n_tiles = (len_k + 7) / 8;
  const int m_tiles = (len_q + 15) / 16;
  const float scale = p.softmax_scale;
  const float scale_log2 = scale * 1.4426950408889634f;

  // ---- per 16-query tile: S, dP, P, dZ; dQ; P and dZ to shared memory ----
  for (int mt = 0; mt < m_tiles; ++mt) {
    float s[3][4] = {}, dp[3][4] = {};
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      unsigned int aq[4], ado[4];
      const int a_offset = (16 * mt + lane % 16) * Tiles::kPitch + 16 * ks + 8 * (lane / 16);
      mma::ldmatrix_x4(aq, q_tile + a_offset);
      mma::ldmatrix_x4(ado, do_tile + a_offset);
      const int b_offset = (8 * (lane / 16) + lane % 8) * Tiles::kPitch + 16 * ks + 8 * ((lane / 8) % 2);
      unsigned int b[4];
      mma::ldmatrix_x4(b, k_tile + b_offset);
      mma::mma_16816<T>(s[0], aq, b[0], b[1]);
      mma::mma_16816<T>(s[1], aq, b[2], b[3]);
      mma::ldmatrix_x4(b, v_tile + b_offset);
      mma::mma_16816<T>(dp[0], ado, b[0], b[1]);
      mma::mma_16816<T>(dp[1], ado, b[2], b[3]);
      if (n_tiles > 2) {
        unsigned int b2[2];
        const int b2_offset = (16 + lane % 8) * Tiles::kPitch + 16 * ks + 8 * ((lane / 8) % 2);
        mma::ldmatrix_x2(b2, k_tile + b2_offset);
        mma::mma_16816<T>(s[2], aq, b2[0], b2[1]);
        mma::ldmatrix_x2(b2, v_tile + b2_offset);
        mma::mma_16816<T>(dp[2], ado, b2[0], b2[1]);
      }
    }

    const int row[2] = {16 * mt + g, 16 * mt + g + 8};
    float lse_log2[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lse_log2[r] = row[r] < len_q ? static_cast<const float*>(p.lse)[batch_index * p.lse_batch_stride +
                                                                       head * p.lse_head_stride + seq_q.start + row[r]] *
                                         1.4426950408889634f
                                   : infinity();  // rows past the sequence: P = 0
    }
    float d_row[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int j = 8 * nt + 2 * t + (e & 1);
        const bool visible = j < len_k && smallseq::key_visible(row[r], j, len_q, len_k, p.causal);
        // LSE = +inf (a row that saw no key, or a row past the sequence) gives P = 0.
        s[nt][e] = visible ? fast_exp2(s[nt][e] * scale_log2 - lse_log2[r]) : 0.0f;
        dp[nt][e] = visible ? dp[nt][e] : 0.0f;
        d_row[r] += s[nt][e] * dp[nt][e];
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      d_row[r] += shfl_xor(d_row[r], 1, 32, 0xffffffffu);
      d_row[r] += shfl_xor(d_row[r], 2, 32, 0xffffffffu);
    }
    unsigned int dz_a[2][4];  // dZ as the A operand of dQ, keys in two k-steps
#pragma unroll
    for (int nt = 0; nt < 3; ++nt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float dz0 = s[nt][2 * r] * (dp[nt][2 * r] - d_row[r]);
        const float dz1 = s[nt][2 * r + 1] * (dp[nt][2 * r + 1] - d_row[r]);
        const unsigned int dz_packed = mma::pack2<T>(dz0, dz1);
        const unsigned int p_packed = mma::pack2<T>(s[nt][2 * r], s[nt][2 * r + 1]);
        *reinterpret_cast<unsigned int*>(dz_tile + row[r] * Tiles::kScorePitch + 8 * nt + 2 * t) = dz_packed;
        *reinterpret_cast<unsigned int*>(p_tile + row[r] * Tiles::kScorePitch + 8 * nt + 2 * t) = p_packed;
        dz_a[nt / 2][(nt % 2) * 2 + r] = dz_packed;
      }
    }
    dz_a[1][2] = dz_a[1][3] = 0u;  // keys 24..31 do not exist

    // dQ rows of this tile = scale * dZ K, written straight from the fragments (4-byte stores).
    const int k_steps = (len_k + 15) / 16;
    T* dq_rows = static_cast<T*>(p.dq) + batch_index * p.dq_batch_stride + seq_q.start * p.dq_token_stride +
                 head * p.dq_head_stride;
#pragma unroll
    for (int nt = 0; nt < HEAD_DIM / 16; ++nt) {
      float dq[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        if (kk < k_steps) {
          unsigned int b[4];
          mma::ldmatrix_x4_trans(
              b, k_tile + (16 * kk + lane % 8 + 8 * ((lane / 8) % 2)) * Tiles::kPitch + 16 * nt + 8 * (lane / 16));
          mma::mma_16816<T>(dq[0], dz_a[kk], b[0], b[1]);
          mma::mma_16816<T>(dq[1], dz_a[kk], b[2], b[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (row[r] < len_q)
            *reinterpret_cast<unsigned int*>(dq_rows + row[r] * p.dq_token_stride + 16 * nt + 8 * half + 2 * t) =
                mma::pack2<T>(dq[half][2 * r] * scale, dq[half][2 * r + 1] * scale);
    }
  }
  __syncwarp();  // P and dZ of every query tile are in shared memory

  // ---- dV = Pᵀ dO and dK = scale * dZᵀ Q, per 16-key tile ----
  const int query_steps = (len_q + 15) / 16;
  const int key_tiles = (len_k + 15) / 16;
  for (int mk = 0; mk < key_tiles; ++mk) {
    unsigned int pt[2][4], dzt[2][4];  // Pᵀ and dZᵀ A operands, per 16-query k-step
#pragma unroll
    for (int kq = 0; kq < 2; ++kq) {
      const int offset = (16 * kq + lane % 8 + 8 * (lane / 16)) * Tiles::kScorePitch + 16 * mk + 8 * ((lane / 8) % 2);
      mma::ldmatrix_x4_trans(pt[kq], p_tile + offset);
      mma::ldmatrix_x4_trans(dzt[kq], dz_tile + offset);
    }
    const int key[2] = {16 * mk + g, 16 * mk + g + 8};
#pragma unroll
    for (int nt = 0; nt < HEAD_DIM / 16; ++nt) {
      float dv[2][4] = {}, dk[2][4] = {};
#pragma unroll
      for (int kq = 0; kq < 2; ++kq) {
        if (kq < query_steps) {
          const int offset = (16 * kq + lane % 8 + 8 * ((lane / 8) % 2)) * Tiles::kPitch + 16 * nt + 8 * (lane / 16);
          unsigned int b[4];
          mma::ldmatrix_x4_trans(b, do_tile + offset);
          mma::mma_16816<T>(dv[0], pt[kq], b[0], b[1]);
          mma::mma_16816<T>(dv[1], pt[kq], b[2], b[3]);
          mma::ldmatrix_x4_trans(b, q_tile + offset);
          mma::mma_16816<T>(dk[0], dzt[kq], b[0], b[1]);
          mma::mma_16816<T>(dk[1], dzt[kq], b[2], b[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (key[r] < len_k) {
            const int column = 16 * nt + 8 * half + 2 * t;
            *reinterpret_cast<unsigned int*>(dv_rows + key[r] * p.dv_token_stride + column) =
                mma::pack2<T>(dv[half][2 * r], dv[half][2 * r + 1]);
            *reinterpret_cast<unsigned int*>(dk_rows + key[r] * p.dk_token_stride + column) =
                mma::pack2<T>(dk[half][2 * r] * scale, dk[half][2 * r + 1] * scale);
          }
    }
  }
}

}  // namespace hipattn
