// Attention against a KV cache on NVIDIA tensor cores (sm_80+): decode/forward.hip's work (one block
// per sequence, KV head and split; a KV head's query-head group packed into the rows) with the dot
// products on mma.sync, so that reading K and V once is all the kernel costs.
//
// A block holds 16 query rows (one m16 tile) and four warps. K and V tiles of BLOCK_N keys are staged
// in shared memory with cp.async through a ring of STAGES slots, one commit group per tile, one barrier
// per tile; the copies of the next STAGES - 1 tiles are in flight while a tile is computed. Each warp
// takes a quarter of every tile (BLOCK_N / 4 keys; decode/warp_keys_mma.h): S = Q Kᵀ for the 16 rows
// and its keys, the online softmax, O += P V with P reused in registers as the A operand. Every warp
// keeps its own softmax state over its keys; decode/merge.h merges the four at the end, through the
// staging memory, and writes O and the LSE, or the split's partials.
//
// Rows are found through decode/cache.h's slots, so paged and contiguous caches and any page size are
// served: a tile within one page (every tile of a contiguous cache, or of pages a multiple of BLOCK_N)
// by running pointers, a tile that crosses pages row by row. Q rows past the block's and V rows past
// the split's keys are zero-filled (a zero weight times stale shared memory could be NaN); scores past
// the keys, before cache_leftpad and outside the window are masked by selection. The two rows a lane
// holds belong to different query heads of the group: with SCORE_MODS each gets its own head's
// modifiers (common/score_mods.h; an ALiBi slope is per head).
#pragma once
#include "decode/warp_keys_mma.h"

namespace hipattn {
namespace decode {

// The block's shared memory in elements of T: the Q tile, then STAGES slots of a K tile and a V tile,
// rows padded by 8 elements against ldmatrix bank conflicts. After the last tile the same memory holds
// the four warps' merge states. The host's row (hipattn/catalog/decode.py, DecodeMmaTiles.shared_bytes)
// computes kBytes with the same formula.
template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES>
struct MmaLayout {
  static constexpr int kRows = kMmaRows;
  static constexpr int kWarps = kMmaWarps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kWarpKeys = BLOCK_N / kWarps;
  static constexpr int kPitch = HEAD_DIM + 8;
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte pieces of a row
  static constexpr int kSlotElements = BLOCK_N * kPitch;
  static constexpr int kKOffset = kRows * kPitch;
  static constexpr int kVOffset = kKOffset + STAGES * kSlotElements;
  static constexpr int kStagingBytes = (kVOffset + STAGES * kSlotElements) * static_cast<int>(sizeof(T));
  static constexpr int kMergeBytes = WarpMerge<HEAD_DIM>::kBytes;
  static constexpr int kBytes = kStagingBytes > kMergeBytes ? kStagingBytes : kMergeBytes;

  static_assert(sizeof(T) == 2, "the tensor-core path takes 16-bit inputs");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim is a multiple of 16 up to 256");
  static_assert(kWarpKeys == kMmaWarpKeys, "each warp's keys are one k-step of P V (BLOCK_N = 64)");
  static_assert(STAGES >= 1 && STAGES <= 4, "one to four K/V slots");
  static_assert(kBytes <= 227 * 1024, "the tiles must fit 227 KiB of shared memory");
};

// The lane's ldmatrix rows in a slot of padded rows: a 16-column step is 32 bytes along the row.
struct PaddedOperands {
  unsigned int k_lane;
  unsigned int v_lane;
  HIPATTN_DEVICE unsigned int k_step(int ks) const { return k_lane + 32 * ks; }
  HIPATTN_DEVICE unsigned int v_step(int dp) const { return v_lane + 32 * dp; }
};

}  // namespace decode

template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, bool SCORE_MODS>
__global__ void __launch_bounds__(128) decode_forward_mma(const DecodeForwardParams p) {
  using L = decode::MmaLayout<T, HEAD_DIM, BLOCK_N, STAGES>;
  constexpr int kThreads = L::kThreads;
  constexpr int kPitch = L::kPitch;
  constexpr int kBytesPerElement = static_cast<int>(sizeof(T));
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);
  T* const q_tile = shared;
  T* const k_slots = shared + L::kKOffset;
  T* const v_slots = shared + L::kVOffset;

  // grid: x (sequence, KV head), y split, z chunk of 16 query rows.
  const int b = blockIdx.x / p.heads_kv;
  const int kv_head = blockIdx.x % p.heads_kv;
  const int split = blockIdx.y;
  const int group = p.heads_q / p.heads_kv;
  const int row0 = blockIdx.z * L::kRows;
  const int rows = p.seqlen_q * group - row0 < L::kRows ? p.seqlen_q * group - row0 : L::kRows;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // accumulator rows g and g + 8
  const int t = lane % 4;

  const decode::CacheAddress address = decode::cache_address(p, b, kv_head);
  const decode::KeyRange range = decode::key_range(p, b);
  // This split's keys: an equal share of the visible ones, in whole tiles.
  int share = (range.total - range.start + p.splits - 1) / p.splits;
  share = (share + BLOCK_N - 1) / BLOCK_N * BLOCK_N;
  const long long first = range.start + static_cast<long long>(split) * share;
  const int key_begin = first < range.total ? static_cast<int>(first) : range.total;
  const int key_end = key_begin + share < range.total ? key_begin + share : range.total;
  const int n_tiles = (key_end - key_begin + BLOCK_N - 1) / BLOCK_N;

  // Tile i's K and V rows (V rows past key_end zeroed); always commits, so the group count is uniform.
  // A thread copies one 16-byte chunk of every kPassRows-th row. Where the tile lies in one page (a
  // contiguous cache, or a paged one whose page size is a multiple of BLOCK_N: paged calls start at
  // key 0, so a tile starting on a multiple of BLOCK_N stays in its page), its rows are one stride
  // apart: one block-table read per tile and a running pointer per row. Recomputing each row's
  // address (64-bit products of the strides) cost more instructions than the rest of the tile's work.
  constexpr int kPassRows = kThreads / L::kChunks;  // rows a pass of the block's threads copies
  constexpr int kPasses = (BLOCK_N + kPassRows - 1) / kPassRows;
  const T* const k_cache = static_cast<const T*>(p.k) + address.k;
  const T* const v_cache = static_cast<const T*>(p.v) + address.v;
  const int chunk = threadIdx.x % L::kChunks;
  const int first_row = threadIdx.x / L::kChunks;  // kPassRows or more: a thread left over, idle
  const bool page_holds_tiles = address.pages == nullptr || p.page_size % BLOCK_N == 0;
  auto load_tile = [&](int i) {
    if (i < n_tiles && first_row < kPassRows) {
      const int n0 = key_begin + i * BLOCK_N;
      T* const k_slot = k_slots + (i % STAGES) * L::kSlotElements + chunk * 8;
      T* const v_slot = v_slots + (i % STAGES) * L::kSlotElements + chunk * 8;
      if (page_holds_tiles && n0 % BLOCK_N == 0) {
        const decode::TokenSlot tile_slot = decode::token_slot(p, address, n0 + first_row);
        const T* k_row = k_cache + decode::slot_offset(tile_slot, p.k_batch_stride, p.k_token_stride) + chunk * 8;
        const T* v_row = v_cache + decode::slot_offset(tile_slot, p.v_batch_stride, p.v_token_stride) + chunk * 8;
        const unsigned int k_target = mma::shared_address(k_slot);
        const unsigned int v_target = mma::shared_address(v_slot);
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
          const int row = first_row + pass * kPassRows;
          if (kPasses * kPassRows > BLOCK_N && row >= BLOCK_N) break;
          if (n0 + row < key_end) {
            mma::copy_async_16(k_target + row * kPitch * kBytesPerElement, k_row);
            mma::copy_async_16(v_target + row * kPitch * kBytesPerElement, v_row);
          } else {
            *reinterpret_cast<Vec<T, 8>*>(v_slot + row * kPitch) = Vec<T, 8>{};
          }
          k_row += kPassRows * p.k_token_stride;
          v_row += kPassRows * p.v_token_stride;
        }
      } else {  // a tile that crosses pages: each row's page from the block table
        for (int row = first_row; row < BLOCK_N; row += kPassRows) {
          const int j = n0 + row;
          if (j < key_end) {
            const decode::TokenSlot slot = decode::token_slot(p, address, j);
            mma::copy_async_16(k_slot + row * kPitch,
                               k_cache + decode::slot_offset(slot, p.k_batch_stride, p.k_token_stride) + chunk * 8);
            mma::copy_async_16(v_slot + row * kPitch,
                               v_cache + decode::slot_offset(slot, p.v_batch_stride, p.v_token_stride) + chunk * 8);
          } else {
            *reinterpret_cast<Vec<T, 8>*>(v_slot + row * kPitch) = Vec<T, 8>{};
          }
        }
      }
    }
    mma::commit_async_copies();
  };

  // ---- prologue: Q (rows past the block's zeroed) with tile 0, then tiles up to the ring's depth ----
  decode::stage_query_rows<T, HEAD_DIM>(q_tile, kPitch, p, rows, row0, group, b, kv_head, threadIdx.x, kThreads);
  // Tiles 0 .. STAGES - 2 (tile 0 with one slot): group 0 holds Q and tile 0.
#pragma unroll
  for (int s = 0; s < (STAGES > 1 ? STAGES - 1 : 1); ++s) load_tile(s);

  const decode::LaneRows<SCORE_MODS> lane_keys =
      decode::lane_rows<SCORE_MODS>(p, range, key_end, rows, row0, group, b, kv_head, g);
  decode::WarpState<HEAD_DIM> state;
  state.reset();
  unsigned int q_fragments[HEAD_DIM / 16][4];

  for (int i = 0; i < n_tiles; ++i) {
    mma::wait_async_copies_except<(STAGES > 1 ? STAGES - 2 : 0)>();  // tile i (and Q) landed, this thread's part
    __syncthreads();  // ... every thread's; tile i - 1's slot is free
    if (STAGES > 1) {
      load_tile(i + STAGES - 1);
    }
    if (i == 0) decode::load_query_fragments<T, HEAD_DIM>(q_fragments, q_tile, kPitch, lane);
    const T* const k_tile = k_slots + (i % STAGES) * L::kSlotElements;
    const T* const v_tile = v_slots + (i % STAGES) * L::kSlotElements;
    const decode::PaddedOperands operands{
        mma::opaque(mma::shared_address(
            k_tile + (L::kWarpKeys * warp + 8 * (lane / 16) + lane % 8) * kPitch + 8 * ((lane / 8) % 2))),
        mma::opaque(mma::shared_address(
            v_tile + (L::kWarpKeys * warp + lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + 8 * (lane / 16)))};
    decode::attend_warp_keys<T, HEAD_DIM, SCORE_MODS>(state, q_fragments, operands, key_begin + i * BLOCK_N + L::kWarpKeys * warp, lane_keys, t);
    if (STAGES == 1) {
      __syncthreads();  // every warp is done with the one slot
      load_tile(i + 1);
    }
  }
  // No copy in flight (the groups past the last tile are empty), and every warp done with the tiles.
  mma::wait_async_copies();
  __syncthreads();

  // ---- the warps' states into the staging memory, then merged per row ----
  const decode::MergeBuffer merge =
      decode::store_warp_state(state, reinterpret_cast<float*>(shared_bytes), warp, g, t);
  __syncthreads();
  decode::merge_and_store<T, HEAD_DIM, L::kRows, SCORE_MODS>(p, merge, L::kWarps, rows, row0, group, b, kv_head,
                                                             split, kThreads);
}

}  // namespace hipattn
