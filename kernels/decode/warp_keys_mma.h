// One warp's share of a decode block on NVIDIA tensor cores (mma.sync m16n8k16), for the kernels that
// stage K and V tiles in shared memory and give each of four warps 16 keys of every 64-key tile
// (decode/forward_mma.hip, whose threads copy the tiles, and decode/forward_tma.hip, whose tiles the
// copy engine brings): the lane's two query rows, S = Q Kᵀ over the warp's keys with the mask and the
// score modifiers, the online softmax, O += P V, and the warp's state handed to decode/merge.h.
//
// Where a tile's rows sit in shared memory is the kernel's business: an Operands type gives the
// ldmatrix address of this lane's row for each 16-column step of K (k_step) and of V (v_step).
#pragma once
#include "common/mma_nvidia.h"
#include "common/score_mods.h"
#include "decode/cache.h"
#include "decode/merge.h"
#include "flash/online_softmax_m16n8.h"

namespace hipattn {
namespace decode {

constexpr int kMmaRows = 16;      // query rows of a block: one m16 tile
constexpr int kMmaWarps = 4;      // warps that share a tile's keys
constexpr int kMmaWarpKeys = 16;  // keys of a tile per warp: one k-step of P V
constexpr int kMmaTileKeys = kMmaWarps * kMmaWarpKeys;

// What a lane knows of its two accumulator rows (g and g + 8), which belong to different query heads
// of the group: the keys each row's query token sees up to key_end (the split's last), the key on its
// diagonal, and each row's head's score modifiers (common/score_mods.h; an ALiBi slope is per head).
template <bool SCORE_MODS>
struct LaneRows {
  flash::RowKeys keys;
  Scores<SCORE_MODS> g;
  Scores<SCORE_MODS> g8;
};

template <bool SCORE_MODS, typename Params>
HIPATTN_DEVICE LaneRows<SCORE_MODS> lane_rows(const Params& p, const KeyRange& range, int key_end, int rows,
                                              int row0, int group, int b, int kv_head, int g) {
  const Scores<SCORE_MODS> g_scores = scores_of<SCORE_MODS>(p, b, kv_head * group + (row0 + g) % group);
  LaneRows<SCORE_MODS> lane{{}, g_scores, g_scores.with_head(p, b, kv_head * group + (row0 + g + 8) % group)};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    const TokenKeys seen = row < rows ? token_keys(p, range, (row0 + row) / group) : TokenKeys{0, 0};
    lane.keys.first[r] = seen.first;  // at or past range.start; the other splits see no key before their tiles
    lane.keys.end[r] = seen.end < key_end ? seen.end : key_end;
    lane.keys.diagonal[r] = row < rows ? token_diagonal(p, range, (row0 + row) / group) : 0;
  }
  return lane;
}

// The warp's softmax state over its keys: unnormalised O for the lane's two rows, their running max
// (base 2, scaled) and sum.
template <int HEAD_DIM>
struct WarpState {
  float o[HEAD_DIM / 8][4];
  float row_max[2];
  float row_sum[2];

  HIPATTN_DEVICE void reset() {
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    row_max[0] = row_max[1] = -infinity();
    row_sum[0] = row_sum[1] = 0.0f;
  }
};

// The block's 16 query rows into a shared tile of rows `pitch` elements apart, with cp.async (the
// caller waits for its copies); rows past `rows` are zeroed. Row r is query token (row0 + r) / group
// of query head kv_head * group + (row0 + r) % group.
template <typename T, int HEAD_DIM, typename Params>
HIPATTN_DEVICE void stage_query_rows(T* q_tile, int pitch, const Params& p, int rows, int row0, int group, int b,
                                     int kv_head, int thread, int threads) {
  constexpr int kChunks = HEAD_DIM / 8;  // 16-byte pieces of a row
  for (int c = thread; c < kMmaRows * kChunks; c += threads) {
    const int r = c / kChunks;
    const int chunk = c % kChunks;
    T* const destination = q_tile + r * pitch + chunk * 8;
    if (r < rows) {
      const int token = (row0 + r) / group;
      const int head = kv_head * group + (row0 + r) % group;
      mma::copy_async_16(destination, static_cast<const T*>(p.q) + b * p.q_batch_stride + token * p.q_token_stride +
                                          head * p.q_head_stride + chunk * 8);
    } else {
      *reinterpret_cast<Vec<T, 8>*>(destination) = Vec<T, 8>{};
    }
  }
}

// The 16 query rows as mma.sync A fragments, from a shared tile of rows `pitch` elements apart.
template <typename T, int HEAD_DIM>
HIPATTN_DEVICE void load_query_fragments(unsigned int (&q)[HEAD_DIM / 16][4], const T* q_tile, int pitch, int lane) {
#pragma unroll
  for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
    mma::ldmatrix_x4(q[ks], q_tile + (lane % 16) * pitch + 8 * (lane / 16) + 16 * ks);
}

// The warp's 16 keys of one tile, the first of them key n0: S = Q Kᵀ (two 8-key accumulator tiles),
// masked by selection with the scores formed here, each row's by its head, then the online softmax
// and O += P V with P's two n-tiles as the A operand of one k-step.
template <typename T, int HEAD_DIM, bool SCORE_MODS, typename Operands>
HIPATTN_DEVICE void attend_warp_keys(WarpState<HEAD_DIM>& state, const unsigned int (&q)[HEAD_DIM / 16][4],
                                     const Operands& tile, int n0, const LaneRows<SCORE_MODS>& lane, int t) {
  float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
  for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
    unsigned int kb[4];
    mma::ldmatrix_x4(kb, tile.k_step(ks));
    mma::mma_16816<T>(s[0], q[ks], kb[0], kb[1]);
    mma::mma_16816<T>(s[1], q[ks], kb[2], kb[3]);
  }
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = n0 + 8 * n + 2 * t + (e & 1);
      const int r = e / 2;
      const bool visible = key >= lane.keys.first[r] && key < lane.keys.end[r];
      s[n][e] = visible ? (r == 0 ? lane.g : lane.g8)(s[n][e], key - lane.keys.diagonal[r]) : -infinity();
    }
  unsigned int p_packed[2][2];
  float correction[2];
  flash::online_softmax<T, 2>(s, state.row_max, state.row_sum, p_packed, correction, false, 0, lane.keys,
                              Scores<false>{1.0f}, t);
  flash::rescale(state.o, correction);
  const unsigned int pa[4] = {p_packed[0][0], p_packed[0][1], p_packed[1][0], p_packed[1][1]};
#pragma unroll
  for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
    unsigned int vb[4];
    mma::ldmatrix_x4_trans(vb, tile.v_step(dp));
    mma::mma_16816<T>(state.o[2 * dp], pa, vb[0], vb[1]);
    mma::mma_16816<T>(state.o[2 * dp + 1], pa, vb[2], vb[3]);
  }
}

// Shared memory for the four warps' states: a max and a sum per (warp, row), then O rows of fp32
// padded by 4 against bank conflicts.
template <int HEAD_DIM>
struct WarpMerge {
  static constexpr int kPitch = HEAD_DIM + 4;
  static constexpr int kBytes = kMmaWarps * kMmaRows * (kPitch + 2) * 4;
};

// The warp's state into the merge buffer at `memory` (WarpMerge<HEAD_DIM>::kBytes); the block then
// synchronises and calls merge_and_store with the returned view.
template <int HEAD_DIM>
HIPATTN_DEVICE MergeBuffer store_warp_state(const WarpState<HEAD_DIM>& state, float* memory, int warp, int g, int t) {
  float* const merge_max = memory;
  float* const merge_sum = merge_max + kMmaWarps * kMmaRows;
  float* const merge_o = merge_sum + kMmaWarps * kMmaRows;
  constexpr int kPitch = WarpMerge<HEAD_DIM>::kPitch;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = state.row_sum[r];
    sum += shfl_xor(sum, 1, 32, 0xffffffffu);
    sum += shfl_xor(sum, 2, 32, 0xffffffffu);
    const int row = g + 8 * r;
    if (t == 0) {
      merge_max[warp * kMmaRows + row] = state.row_max[r];
      merge_sum[warp * kMmaRows + row] = sum;
    }
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; ++d) {
      float* const at = merge_o + (warp * kMmaRows + row) * kPitch + 8 * d + 2 * t;
      at[0] = state.o[d][2 * r];
      at[1] = state.o[d][2 * r + 1];
    }
  }
  return {merge_max, merge_sum, merge_o, kPitch};
}

}  // namespace decode
}  // namespace hipattn
