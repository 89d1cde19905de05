// General attention forward on NVIDIA tensor cores (sm_80+): FlashAttention-2 with mma.sync m16n8k16.
//
// A block owns BLOCK_M query rows of one (sequence, query head); each of its warps owns M_TILES
// 16-row tiles of them (16 * M_TILES rows) from start to end. With M_TILES = 2 every K and V
// fragment a warp loads from shared memory feeds two MMAs, halving the shared-memory traffic per
// FLOP (ldmatrix bandwidth, not the tensor cores, limits a 16-row warp). The block walks the key tiles of BLOCK_N keys that its rows'
// windows reach, last tile first (flash/forward_block.h says which need masking). Per tile:
// S = Q Kᵀ on the tensor cores, an online softmax on the accumulators in base 2 (softmax_scale·log2 e
// folded into one multiply), and O += P V with the probabilities reused in registers as the A
// operand (the m16n8 accumulator layout of two adjacent n-tiles is the m16k16 A layout). O stays in
// fp32 registers until the end; LSE is written in fp32. With dropout (the SCORE_MODS instantiation,
// common/dropout.h) the dropped probabilities are zeroed between the softmax and P V.
//
// K and V tiles are staged in shared memory with cp.async through a ring of STAGES slots each,
// interleaved as FlashAttention-2 does: V of a tile loads while S of that tile is computed, K of a
// later tile while P V is. With STAGES = 1 that is FA2's schedule (one K and one V buffer); each
// extra stage lets the copies run one more tile ahead.
//
// Block decode and masking conventions are flash/forward_block.h's (shared with the wgmma and MFMA
// forwards); the online softmax and the LSE are flash/softmax_m16n8.h's (shared with the wgmma one).
#pragma once
#include "common/mma_nvidia.h"
#include "flash/softmax_m16n8.h"
#include "flash/stage_padded_cp_async.h"

namespace hipattn {
namespace flash {

// Shared-memory layout of one block, in elements of T: the Q tile, then STAGES K slots, then
// STAGES V slots, each row padded by 8 elements (16 bytes) so the eight row reads of an ldmatrix hit
// distinct banks. The host's row (hipattn/catalog/flash_forward.py, FlashForwardMmaTiles.shared_bytes)
// computes kBytes from the same template arguments with the same formula; the launcher passes that as
// dynamic shared memory.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, int M_TILES>
struct ForwardTiles {
  static constexpr int kPitch = HEAD_DIM + 8;
  static constexpr int kWarpRows = 16 * M_TILES;
  static constexpr int kWarps = BLOCK_M / kWarpRows;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte pieces of a row
  static constexpr int kQElements = BLOCK_M * kPitch;
  static constexpr int kSlotElements = BLOCK_N * kPitch;
  static constexpr int kKOffset = kQElements;
  static constexpr int kVOffset = kQElements + STAGES * kSlotElements;
  static constexpr int kElements = kQElements + 2 * STAGES * kSlotElements;
  static constexpr int kBytes = kElements * static_cast<int>(sizeof(T));

  static_assert(sizeof(T) == 2, "the tensor-core path takes 16-bit inputs");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim is a multiple of 16 up to 256");
  static_assert(M_TILES >= 1 && M_TILES <= 2, "a warp owns one or two 16-row tiles");
  static_assert(BLOCK_M % kWarpRows == 0 && kWarps >= 1 && kWarps <= 8, "whole warps, at most 8");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16, "key tiles are whole k-steps of P V");
  static_assert(STAGES >= 1 && STAGES <= 3, "one to three K/V slots");
  // 227 KiB is the largest opt-in of any sm_80+ part (sm_90); the shipped table keeps every row
  // within 99 KiB, the smallest (sm_86, sm_89), and tests/test_flash_tiles.py checks that.
  static_assert(kBytes <= 227 * 1024, "the tiles must fit 227 KiB of shared memory");
};

}  // namespace flash

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES, int M_TILES, bool SCORE_MODS>
__global__ void __launch_bounds__(BLOCK_M * 2 / M_TILES) flash_forward_mma(const FlashForwardParams p) {
  using Tiles = flash::ForwardTiles<T, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, M_TILES>;
  constexpr int kThreads = Tiles::kThreads;
  constexpr int kPitch = Tiles::kPitch;
  constexpr int kNTiles = BLOCK_N / 8;    // 8-key accumulator tiles of S
  constexpr int kDTiles = HEAD_DIM / 8;   // 8-column accumulator tiles of O
  // Every async-copy group is committed in the same order by every thread: Q+K[0], then V[0], K[1],
  // V[1], ... (empty groups past the last tile). Waiting for K[n] or V[n] leaves the newest
  // 2 STAGES - 2 groups in flight.
  constexpr int kInFlight = 2 * STAGES - 2;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);

  bool empty;
  const flash::ForwardBlock b = flash::forward_block<T, BLOCK_M, BLOCK_N>(p, blockIdx.x, empty);
  if (empty) return;  // uniform over the block, before any barrier
  const int len_q = b.seq_q.length;
  const int len_k = b.seq_k.length;
  const int m0 = b.m0;
  const int n_tiles = b.n_tiles;
  const int tile_end = b.tile_end;
  const T* const q_rows = static_cast<const T*>(b.q);
  const T* const k_rows = static_cast<const T*>(b.k);
  const T* const v_rows = static_cast<const T*>(b.v);
  T* const q_tile = shared;
  T* const k_slots = shared + Tiles::kKOffset;
  T* const v_slots = shared + Tiles::kVOffset;

  // Iteration i handles key tile tile_end - 1 - i; these issue its K or V copies (or nothing past
  // the last iteration) and always commit, so that the group count stays uniform.
  auto load_k = [&](int i) {
    if (i < n_tiles) {
      const int n0 = (tile_end - 1 - i) * BLOCK_N;
      const int rows = len_k - n0 < BLOCK_N ? len_k - n0 : BLOCK_N;
      flash::stage_tile<T, HEAD_DIM, kThreads, false>(k_slots + (i % STAGES) * Tiles::kSlotElements,
                                                      k_rows + n0 * p.k_token_stride, p.k_token_stride, rows,
                                                      BLOCK_N);
    }
    mma::commit_async_copies();
  };
  auto load_v = [&](int i) {
    if (i < n_tiles) {
      const int n0 = (tile_end - 1 - i) * BLOCK_N;
      const int rows = len_k - n0 < BLOCK_N ? len_k - n0 : BLOCK_N;
      flash::stage_tile<T, HEAD_DIM, kThreads, true>(v_slots + (i % STAGES) * Tiles::kSlotElements,
                                                     v_rows + n0 * p.v_token_stride, p.v_token_stride, rows,
                                                     BLOCK_N);
    }
    mma::commit_async_copies();
  };

  // ---- prologue: Q with K of the first tile, then V/K pairs up to the ring's depth ----
  {
    const int rows = len_q - m0 < BLOCK_M ? len_q - m0 : BLOCK_M;
    // Q rows past the sequence are zeroed: they only feed rows that are never stored, but zeros keep
    // every lane's arithmetic finite.
    flash::stage_tile<T, HEAD_DIM, kThreads, true>(q_tile, q_rows, p.q_token_stride, rows, BLOCK_M);
  }
  load_k(0);
#pragma unroll
  for (int s = 0; s + 1 < STAGES; ++s) {
    load_v(s);
    load_k(s + 1);
  }

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // accumulator rows g and g + 8 of each 16-row tile
  const int t = lane % 4;  // accumulator column pair 2t, 2t + 1 of each 8-column tile
  const Scores<SCORE_MODS> scores = scores_of<SCORE_MODS>(p, b.batch_index, b.head);
  const Dropout<SCORE_MODS> dropout = dropout_of<SCORE_MODS>(p, b.batch_index, b.head);
  const int warp_first = m0 + Tiles::kWarpRows * warp;  // the warp's first query row in the sequence
  flash::RowKeys keys[M_TILES];  // per m-tile: the keys each accumulator row sees
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) keys[mt] = flash::row_keys(b, warp_first + 16 * mt + g);

  float o[M_TILES][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.0f;
  // In the scaled base-2 domain; row_sum is this lane's share of the row, summed at the end.
  float row_max[M_TILES][2], row_sum[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mt][r] = -infinity();
      row_sum[mt][r] = 0.0f;
    }

  const T* const q_warp = q_tile + Tiles::kWarpRows * warp * kPitch;
  for (int i = 0; i < n_tiles; ++i) {
    const int n0 = (tile_end - 1 - i) * BLOCK_N;
    const T* const k_tile = k_slots + (i % STAGES) * Tiles::kSlotElements;
    const T* const v_tile = v_slots + (i % STAGES) * Tiles::kSlotElements;

    mma::wait_async_copies_except<kInFlight>();  // K[i] (and Q) have landed for this thread
    __syncthreads();                             // ... for every thread; V[i - 1]'s slot is free
    load_v(i + STAGES - 1);
    // This lane's ldmatrix row in each tile (mma_nvidia.h's fragment layouts); every fragment below
    // is at a constant byte offset from these (mma::opaque says why they are recomputed per tile).
    const unsigned int q_lane = mma::opaque(mma::shared_address(q_warp + (lane % 16) * kPitch + 8 * (lane / 16)));
    const unsigned int k_lane = mma::opaque(
        mma::shared_address(k_tile + (8 * (lane / 16) + lane % 8) * kPitch + 8 * ((lane / 8) % 2)));
    const unsigned int v_lane = mma::opaque(
        mma::shared_address(v_tile + (lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + 8 * (lane / 16)));
    constexpr int kBytes = static_cast<int>(sizeof(T));

    // ---- S = Q Kᵀ: 16 * M_TILES rows x BLOCK_N keys per warp; each K fragment feeds M_TILES MMAs ----
    float s[M_TILES][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      unsigned int a[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
        mma::ldmatrix_x4(a[mt], q_lane + ((16 * mt) * kPitch + 16 * ks) * kBytes);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        unsigned int b[4];
        mma::ldmatrix_x4(b, k_lane + ((16 * np) * kPitch + 16 * ks) * kBytes);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma::mma_16816<T>(s[mt][2 * np], a[mt], b[0], b[1]);
          mma::mma_16816<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // ---- online softmax ----
    const bool masked = n0 < b.unmasked_begin || n0 + BLOCK_N > b.unmasked_end;
    unsigned int p_packed[M_TILES][kNTiles][2];  // P in T, the A operand of P V
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      float correction[2];
      flash::online_softmax<T>(s[mt], row_max[mt], row_sum[mt], p_packed[mt], correction, masked, n0, keys[mt],
                               scores, t);
      flash::rescale(o[mt], correction);
      // Dropout zeroes probabilities after the row sums took them (common/dropout.h).
      if (dropout.active())
        flash::drop(p_packed[mt], flash::keep_bits<kNTiles>(dropout, warp_first + 16 * mt + g, n0, t));
    }

    mma::wait_async_copies_except<kInFlight>();  // V[i] has landed for this thread
    __syncthreads();                             // ... for every thread; K[i]'s slot is free
    load_k(i + STAGES);

    // ---- O += P V: n-tiles 2 kk and 2 kk + 1 of P are the A operand of k-step kk; each V fragment
    // feeds M_TILES MMAs ----
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      unsigned int pa[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        pa[mt][0] = p_packed[mt][2 * kk][0];
        pa[mt][1] = p_packed[mt][2 * kk][1];
        pa[mt][2] = p_packed[mt][2 * kk + 1][0];
        pa[mt][3] = p_packed[mt][2 * kk + 1][1];
      }
#pragma unroll
      for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
        unsigned int b[4];
        mma::ldmatrix_x4_trans(b, v_lane + ((16 * kk) * kPitch + 16 * dp) * kBytes);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma::mma_16816<T>(o[mt][2 * dp], pa[mt], b[0], b[1]);
          mma::mma_16816<T>(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
        }
      }
    }
  }
  // Every thread's copies have landed, and (the barrier) every other thread's too: with no key tile
  // at all, another warp's copy of this warp's Q rows could otherwise land over its staged O.
  mma::wait_async_copies();
  __syncthreads();

  // ---- epilogue: normalise, LSE, and O through the warp's own Q rows (only this warp read them) ----
  T* const o_stage = const_cast<T*>(q_warp);
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
    float inv_sum[2];
    flash::finish_rows(p, b, warp_first + 16 * mt + g, row_max[mt], row_sum[mt], inv_sum, t,
                       sink_log2<SCORE_MODS>(p, b.head));
    inv_sum[0] *= dropout.scale();  // the kept probabilities' 1 / (1 - dropout_p)
    inv_sum[1] *= dropout.scale();
#pragma unroll
    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        *reinterpret_cast<unsigned int*>(o_stage + (16 * mt + g + 8 * r) * kPitch + 8 * d + 2 * t) =
            mma::pack2<T>(o[mt][d][2 * r] * inv_sum[r], o[mt][d][2 * r + 1] * inv_sum[r]);
      }
  }
  __syncwarp();
  const int rows = len_q - warp_first < Tiles::kWarpRows ? len_q - warp_first : Tiles::kWarpRows;
  T* const o_rows = static_cast<T*>(p.o) + b.batch_index * p.o_batch_stride +
                    static_cast<long long>(b.seq_q.start + warp_first) * p.o_token_stride + b.head * p.o_head_stride;
  for (int c = lane; c < rows * Tiles::kChunks; c += 32) {
    const int r = c / Tiles::kChunks;
    const int chunk = c % Tiles::kChunks;
    *reinterpret_cast<Vec<T, 8>*>(o_rows + r * p.o_token_stride + chunk * 8) =
        *reinterpret_cast<const Vec<T, 8>*>(o_stage + r * kPitch + chunk * 8);
  }
}

}  // namespace hipattn
