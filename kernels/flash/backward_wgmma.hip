// General attention backward, the dK/dV kernel (with dQ's share added atomically), on Hopper's
// warpgroup tensor cores (sm_90a): backward_mma.hip's algorithm with wgmma.mma_async in place of
// mma.sync and ldmatrix, every thread copying.
//
// One block per (key tile, sequence, KV head), found as backward_mma.hip's (flash/backward_common.h).
// K and V stay in shared memory and dK, dV in fp32 registers while the block walks every query tile of
// BLOCK_M rows (of every query head of the KV head's group) whose rows see some of its keys; Q, dO, LSE
// and Delta are double-buffered with cp.async, so the next tile's copies overlap this tile's math, and
// the block meets at a __syncthreads per query tile. What the warpgroups compute per query tile, and
// how they split the keys, queries and columns, is flash/backward_warpgroup.h's. The warp-specialised
// kernel (backward_warp_specialised.hip), whose producer warpgroup copies for the others, takes the
// calls at head_dims 96 and 128 whose Q and dO have tensor maps; this one runs the rest (head_dims 64
// and 256, and arrays no tensor map describes).
#pragma once
#include "flash/backward_warpgroup.h"
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
struct WgmmaKeyBlockTiles : KeyBlockShape<T, HEAD_DIM, WARPGROUPS, COLUMN_GROUPS, BLOCK_M> {
  using Shape = KeyBlockShape<T, HEAD_DIM, WARPGROUPS, COLUMN_GROUPS, BLOCK_M>;
  static constexpr int kThreads = 128 * WARPGROUPS;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = Shape::kKeyElements;
  static constexpr int kQOffset = 2 * Shape::kKeyElements;
  static constexpr int kDoOffset = kQOffset + 2 * Shape::kQueryElements;
  static constexpr int kDsOffset = kDoOffset + 2 * Shape::kQueryElements;
  static constexpr int kPOffset = kDsOffset + Shape::kScoreElements;
  static constexpr int kElements = kPOffset + (Shape::kSharedKeys ? Shape::kScoreElements : 0);
  static constexpr int kStatsOffsetBytes = kElements * static_cast<int>(sizeof(T));
  static constexpr int kDqOffsetBytes = kStatsOffsetBytes + 2 * 2 * BLOCK_M * static_cast<int>(sizeof(float));
  static constexpr int kDqStagedRows = Shape::kSharedKeys ? 0 : WARPGROUPS * 64;
  static constexpr int kBytes = kDqOffsetBytes + kDqStagedRows * Shape::kDqPitch * static_cast<int>(sizeof(float));

  static_assert(kBytes <= 227 * 1024, "the tiles must fit sm_90's 227 KiB of shared memory");
  static_assert(kDqOffsetBytes % 16 == 0, "staged dQ rows are 16-byte aligned, as the copy engine's bulk reductions need");
};

}  // namespace flash

template <typename T, int HEAD_DIM, int WARPGROUPS, int COLUMN_GROUPS, int BLOCK_M, bool WRITE_DQ, bool SCORE_MODS>
__global__ void __launch_bounds__(128 * WARPGROUPS) flash_backward_dkdv_wgmma(const FlashBackwardParams p) {
  using Tiles = flash::WgmmaKeyBlockTiles<T, HEAD_DIM, WARPGROUPS, COLUMN_GROUPS, BLOCK_M>;
  using Warpgroup = flash::KeyBlockWarpgroup<typename Tiles::Shape, T, WRITE_DQ, SCORE_MODS>;
  constexpr int kBlockN = Tiles::kBlockN;
  constexpr int kBlockM = Tiles::kBlockM;
  constexpr int kThreads = Tiles::kThreads;
  extern __shared__ __align__(1024) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);
  float* const stats = reinterpret_cast<float*>(shared_bytes + Tiles::kStatsOffsetBytes);

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

  const flash::KeyBlockTilesAt<T> at{shared + Tiles::kKOffset,
                                     shared + Tiles::kVOffset,
                                     shared + Tiles::kQOffset,
                                     shared + Tiles::kDoOffset,
                                     shared + Tiles::kDsOffset,
                                     shared + Tiles::kPOffset,
                                     reinterpret_cast<float*>(shared_bytes + Tiles::kDqOffsetBytes)};

  // K and V rows past the sequence are zeroed: they meet probabilities of exactly 0 in dS and dQ,
  // and 0 x stale NaN would be NaN.
  {
    const long long token = seq_k.start + n0;
    flash::stage_swizzled_tile<T, HEAD_DIM, kBlockN, kThreads, flash::TileTail::kZeroByStore>(
        at.k, static_cast<const T*>(p.k) + batch_index * p.k_batch_stride + token * p.k_token_stride +
                  block.head_kv * p.k_head_stride,
        p.k_token_stride, keys);
    flash::stage_swizzled_tile<T, HEAD_DIM, kBlockN, kThreads, flash::TileTail::kZeroByStore>(
        at.v, static_cast<const T*>(p.v) + batch_index * p.v_batch_stride + token * p.v_token_stride +
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
          at.q_slots + slot * Tiles::kQueryElements,
          static_cast<const T*>(p.q) + batch_index * p.q_batch_stride + token * p.q_token_stride +
              head * p.q_head_stride,
          p.q_token_stride, rows);
      flash::stage_swizzled_tile<T, HEAD_DIM, kBlockM, kThreads, flash::TileTail::kZeroByStore>(
          at.do_slots + slot * Tiles::kQueryElements,
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

  const Warpgroup warpgroup(p, at, batch_index, seq_q, len_k, n0, first_head, threadIdx.x);
  float dk[Warpgroup::kDTiles][4];
  float dv[Warpgroup::kDTiles][4];
#pragma unroll
  for (int d = 0; d < Warpgroup::kDTiles; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.0f;

  for (int i = 0; i < tiles; ++i) {
    const int slot = i % 2;
    const float* const lse_slot = stats + slot * 2 * kBlockM;
    mma::wait_async_copies();  // item i (and K, V) have landed for this thread: the only group in flight
    wgmma::fence_shared_for_async_proxy();
    __syncthreads();  // ... for every thread; every warpgroup is done with item i - 1's slot and dSᵀ
    load_query_tile(i + 1);
    warpgroup.query_tile(dk, dv, head_of(i), m0_of(i), slot, lse_slot, lse_slot + kBlockM, 0, [] { __syncthreads(); });
  }
  // Every thread's copies have landed (the last commit was empty), and the barrier: every warpgroup
  // is done reading K and V, which now stage dK and dV for wide stores. dQ's last additions are
  // complete before the block's shared memory is released.
  warpgroup.finish_dq();
  mma::wait_async_copies();
  __syncthreads();

  // ---- epilogue: dK and dV through the K and V tiles, rows past the sequence skipped ----
  warpgroup.stage_gradients(dk, dv);
  __syncthreads();
  flash::write_gradients<T, HEAD_DIM, kBlockN, kThreads>(p, at.k, at.v, batch_index, block.head_kv, seq_k.start + n0,
                                                         keys, threadIdx.x);
}

}  // namespace hipattn
