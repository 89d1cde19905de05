// Attention against a KV cache on Hopper (sm_90a): the tensor-core work of decode/forward_mma.hip
// (16 query rows of a KV head's group, four warps of 16 keys per 64-key tile, decode/warp_keys_mma.h)
// fed by the copy engine, in a persistent grid.
//
// Decoding is a read of K and V, and the kernel is laid out for it. One producer thread issues every
// tile's copies (`cp.async.bulk.tensor` through the k_map and v_map tensor maps: [entry or page, token,
// head, dim], a box per 64-column swizzle block) into a ring of STAGES slots; a full mbarrier per slot
// counts its bytes in, an empty one the four consumer warps out. The blocks an SM holds walk a list of
// work items (sequence, KV head, split, chunk of 16 query rows: item blockIdx.x, then every
// gridDim.x-th), so an item's first tiles are copied while the consumers merge the one before, whose
// time they also use to fetch the next item's query rows and key range. A tile's K and V are copied
// side by side into one slot; three slots read the cache faster on the H200 than two or four, than V
// copied a tile behind its K, and than the thread-copy kernel (BENCHMARKS.md).
//
// Tiles are 64-key aligned in the sequence, so that a tile of a paged cache whose page size is a
// multiple of 64 lies in one page (the launcher takes the thread-copy kernel for other page sizes), and
// splits share out whole tiles. The copy engine reads what lies in the cache, so the rows of a tile
// outside the item's keys (before cache_leftpad or the window, past the sequence's end) hold whatever
// is there: their scores are masked by selection, and each warp zeroes its own V rows among them
// before P V (a zero weight times stale memory could be NaN). Rows past the cache's capacity land as
// zeros. Those zeroing writes are the generic proxy's, and the next copy into the slot the async
// proxy's: the writing threads fence the two before the warp releases the slot.
#pragma once
#include "common/async_pipeline_nvidia.h"
#include "common/wgmma_nvidia.h"
#include "decode/warp_keys_mma.h"

namespace hipattn {
namespace decode {

// The block's shared memory in bytes: STAGES slots of a K tile and a V tile (each 64 rows in whole
// 64-column blocks of 128-byte swizzled rows, 1024-byte aligned), the Q tile (rows padded by 8
// elements), the warps' merge states, then the full and empty barrier of every slot. The host's row
// (hipattn/catalog/decode.py, DecodeTmaTiles.shared_bytes) computes kBytes with the same formula.
template <typename T, int HEAD_DIM, int STAGES>
struct TmaLayout {
  static constexpr int kBlockN = kMmaTileKeys;
  static constexpr int kConsumerThreads = 32 * kMmaWarps;
  static constexpr int kThreads = kConsumerThreads + 32;  // the consumer warps, then the producer warp
  // Blocks an SM may hold, as far as registers go: two up to head_dim 128; above, the consumers' O and
  // Q fragments need more than half the register file allows (ptxas spills).
  static constexpr int kResidentBlocks = HEAD_DIM <= 128 ? 2 : 1;
  static constexpr int kColumnBlocks = (HEAD_DIM + 63) / 64;
  static constexpr int kTileBytes = kColumnBlocks * kBlockN * wgmma::kRowBytes;
  static constexpr int kSlotBytes = 2 * kTileBytes;  // K, then V
  static constexpr int kQPitch = HEAD_DIM + 8;       // elements
  static constexpr int kQOffset = STAGES * kSlotBytes;
  static constexpr int kQElements = kMmaRows * kQPitch;  // a Q tile; two: this item's and the next one's
  static constexpr int kMergeOffset = kQOffset + 2 * kQElements * static_cast<int>(sizeof(T));
  static constexpr int kBarrierOffset = kMergeOffset + WarpMerge<HEAD_DIM>::kBytes;
  static constexpr int kBytes = kBarrierOffset + 2 * STAGES * 8;

  static_assert(sizeof(T) == 2, "the tensor-core path takes 16-bit inputs");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim is a multiple of 16 up to 256");
  static_assert(kTileBytes % wgmma::kAtomBytes == 0, "every tile starts on a swizzle atom");
  static_assert(kBarrierOffset % 8 == 0, "mbarriers are 8-byte aligned");
  static_assert(STAGES >= 2 && STAGES <= 8, "two to eight K/V slots");
  static_assert(kBytes <= 227 * 1024, "the tiles must fit sm_90's 227 KiB of shared memory");
};

// The lane's ldmatrix rows in a swizzled tile (common/wgmma_nvidia.h's layout): a 16-column step is
// two 16-byte chunks along the row, placed by the row's swizzle, and every fourth step the next column
// block. `k_row` and `v_row` are the lane's row addresses, `k_swizzle` and `v_swizzle` the XOR of its
// chunk within a step with its row's swizzle (row % 8).
struct SwizzledOperands {
  unsigned int k_row;
  unsigned int v_row;
  int k_swizzle;
  int v_swizzle;
  HIPATTN_DEVICE unsigned int k_step(int ks) const { return k_row + step(ks, k_swizzle); }
  HIPATTN_DEVICE unsigned int v_step(int dp) const { return v_row + step(dp, v_swizzle); }
  HIPATTN_DEVICE static unsigned int step(int s, int swizzle) {
    return (s / 4) * kMmaTileKeys * wgmma::kRowBytes + ((((2 * s) % 8) ^ swizzle) * 16);
  }
};

// One work item: a chunk of 16 query rows of one (sequence, KV head) and one split of its keys.
struct WorkItem {
  int b;
  int kv_head;
  int split;
  int row0;
};

template <typename Params>
HIPATTN_DEVICE WorkItem work_item(const Params& p, int item) {
  const int pairs = p.batch * p.heads_kv;
  const int pair = item % pairs;
  return {pair / p.heads_kv, pair % p.heads_kv, (item / pairs) % p.splits, item / pairs / p.splits * kMmaRows};
}

template <typename Params>
HIPATTN_DEVICE int work_items(const Params& p) {
  const int rows = p.seqlen_q * (p.heads_q / p.heads_kv);
  return p.batch * p.heads_kv * p.splits * ((rows + kMmaRows - 1) / kMmaRows);
}

// The keys item `item`'s sequence has (key_range), or none past the last item. A block reads them an
// item ahead: the read (cache_seqlens and cache_leftpad in device memory) then overlaps the item
// before, where it would otherwise stall the item's start while the ring stands full.
template <typename Params>
HIPATTN_DEVICE KeyRange item_key_range(const Params& p, int item, int items) {
  return item < items ? key_range(p, work_item(p, item).b) : KeyRange{0, 0};
}

// A split's keys, [begin, end), in whole 64-key tiles of the sequence counted from `first_tile`: the
// visible range's tiles shared out equally.
struct SplitTiles {
  int first_tile;
  int tiles;
  int begin;
  int end;
};

HIPATTN_DEVICE SplitTiles split_tiles(const KeyRange& range, int split, int splits) {
  const int range_first = range.start / kMmaTileKeys;
  const int range_end = range.total > range.start ? (range.total + kMmaTileKeys - 1) / kMmaTileKeys : range_first;
  const int share = (range_end - range_first + splits - 1) / splits;
  const int first = range_first + split * share < range_end ? range_first + split * share : range_end;
  const int last = first + share < range_end ? first + share : range_end;
  const int begin = first * kMmaTileKeys > range.start ? first * kMmaTileKeys : range.start;
  const int end = last * kMmaTileKeys < range.total ? last * kMmaTileKeys : range.total;
  return {first, last - first, begin, end > begin ? end : begin};
}

}  // namespace decode

template <typename T, int HEAD_DIM, int STAGES, bool SCORE_MODS>
__global__ void __launch_bounds__(decode::TmaLayout<T, HEAD_DIM, STAGES>::kThreads,
                                  decode::TmaLayout<T, HEAD_DIM, STAGES>::kResidentBlocks)
    decode_forward_tma(const __grid_constant__ DecodeForwardTmaParams p) {
  using L = decode::TmaLayout<T, HEAD_DIM, STAGES>;
  constexpr int kBlockN = L::kBlockN;
  extern __shared__ __align__(1024) unsigned char shared_bytes[];
  const unsigned int barriers = mma::shared_address(shared_bytes + L::kBarrierOffset);
  auto full = [&](int slot) { return barriers + 8 * slot; };
  auto empty = [&](int slot) { return barriers + 8 * (STAGES + slot); };
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int items = decode::work_items(p);

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbarrier::init(full(s), 1);
      mbarrier::init(empty(s), decode::kMmaWarps);
    }
    mbarrier::publish_inits();
  }
  __syncthreads();  // the last block-wide barrier: from here producer and consumers meet at mbarriers

  if (warp == decode::kMmaWarps) {
    // ---- producer: one thread copies every item's tiles, in the order the consumers take them ----
    if (lane != 0) return;
    int fill = 0;  // tiles copied so far: the slot is fill % STAGES, its use fill / STAGES
    decode::KeyRange range = decode::item_key_range(p, blockIdx.x, items);
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const decode::KeyRange next_range = decode::item_key_range(p, item + gridDim.x, items);
      const decode::WorkItem w = decode::work_item(p, item);
      const decode::CacheAddress address = decode::cache_address(p, w.b, w.kv_head);
      const decode::SplitTiles split = decode::split_tiles(range, w.split, p.splits);
      range = next_range;
      const int entry = address.pages == nullptr ? decode::cache_entry(p, w.b) : 0;
      for (int i = 0; i < split.tiles; ++i, ++fill) {
        const int slot = fill % STAGES;
        // The tile's page is read from the block table before the wait for its slot, which hides the
        // read's latency; after it, the read would delay every copy of a paged cache.
        const decode::TokenSlot at = decode::token_slot(p, address, (split.first_tile + i) * kBlockN);
        mbarrier::wait(empty(slot), ((fill / STAGES) & 1) ^ 1);
        const int outer = address.pages != nullptr ? static_cast<int>(at.page) : entry;
        unsigned char* const k_tile = shared_bytes + slot * L::kSlotBytes;
        unsigned char* const v_tile = k_tile + L::kTileBytes;
        mbarrier::arrive_expecting(full(slot), L::kSlotBytes);
        for (int c = 0; c < L::kColumnBlocks; ++c)
          load_tile(k_tile + c * kBlockN * wgmma::kRowBytes, &p.k_map, 64 * c, w.kv_head, at.token, outer, full(slot));
        for (int c = 0; c < L::kColumnBlocks; ++c)
          load_tile(v_tile + c * kBlockN * wgmma::kRowBytes, &p.v_map, 64 * c, w.kv_head, at.token, outer, full(slot));
      }
    }
    return;
  }

  // ---- consumers: warps 0-3, each 16 keys of every tile ----
  const int g = lane / 4;
  const int t = lane % 4;
  const int group = p.heads_q / p.heads_kv;
  T* const q_tiles = reinterpret_cast<T*>(shared_bytes + L::kQOffset);
  float* const merge_memory = reinterpret_cast<float*>(shared_bytes + L::kMergeOffset);
  constexpr unsigned int kConsumersMeet = 1;  // a named barrier of the consumer threads (0 is the block's)
  // The lane's rows of a slot's tiles: K for S = Q Kᵀ (row 8 * (lane / 16) + lane % 8 of the warp's
  // 16 keys, chunk (lane / 8) % 2 of a step), V transposed for P V (row lane % 16, chunk lane / 16).
  const int k_row = decode::kMmaWarpKeys * warp + 8 * (lane / 16) + lane % 8;
  const int v_row = decode::kMmaWarpKeys * warp + lane % 16;
  const int k_swizzle = ((lane / 8) % 2) ^ (k_row % 8);
  const int v_swizzle = (lane / 16) ^ (v_row % 8);
  // An item's query rows are copied while the item before it runs (one commit group per item, empty
  // past the last), so that no item starts by waiting for them.
  auto rows_of = [&](const decode::WorkItem& w) {
    const int left = p.seqlen_q * group - w.row0;
    return left < decode::kMmaRows ? left : decode::kMmaRows;
  };
  auto stage_queries = [&](int item, T* q_tile) {
    if (item < items) {
      const decode::WorkItem w = decode::work_item(p, item);
      decode::stage_query_rows<T, HEAD_DIM>(q_tile, L::kQPitch, p, rows_of(w), w.row0, group, w.b, w.kv_head,
                                            threadIdx.x, L::kConsumerThreads);
    }
    mma::commit_async_copies();
  };
  stage_queries(blockIdx.x, q_tiles);
  int fill = 0;
  decode::KeyRange next_range = decode::item_key_range(p, blockIdx.x, items);
  for (int item = blockIdx.x, n = 0; item < items; item += gridDim.x, ++n) {
    const decode::WorkItem w = decode::work_item(p, item);
    const int rows = rows_of(w);
    const decode::KeyRange range = next_range;
    next_range = decode::item_key_range(p, item + gridDim.x, items);
    const decode::SplitTiles split = decode::split_tiles(range, w.split, p.splits);

    // The next item's Q tile was last read before the previous item's closing barrier.
    stage_queries(item + gridDim.x, q_tiles + ((n + 1) % 2) * L::kQElements);
    mma::wait_async_copies_except<1>();  // this item's rows, this thread's part ...
    barrier_sync<L::kConsumerThreads>(kConsumersMeet);  // ... and every thread's
    unsigned int q_fragments[HEAD_DIM / 16][4];
    decode::load_query_fragments<T, HEAD_DIM>(q_fragments, q_tiles + (n % 2) * L::kQElements, L::kQPitch, lane);
    const decode::LaneRows<SCORE_MODS> lane_keys =
        decode::lane_rows<SCORE_MODS>(p, range, split.end, rows, w.row0, group, w.b, w.kv_head, g);
    decode::WarpState<HEAD_DIM> state;
    state.reset();

    for (int i = 0; i < split.tiles; ++i, ++fill) {
      const int slot = fill % STAGES;
      mbarrier::wait(full(slot), (fill / STAGES) & 1);
      const unsigned int k_tile = mma::shared_address(shared_bytes + slot * L::kSlotBytes);
      const unsigned int v_tile = k_tile + L::kTileBytes;
      const int n0 = (split.first_tile + i) * kBlockN + decode::kMmaWarpKeys * warp;  // the warp's first key
      const bool outside = n0 < split.begin || n0 + decode::kMmaWarpKeys > split.end;
      if (outside) {
        // Zero the warp's V rows outside [begin, end): two lanes per row, eight 16-byte chunks each per
        // column block.
        unsigned char* const v_bytes = shared_bytes + slot * L::kSlotBytes + L::kTileBytes;
        const int row = decode::kMmaWarpKeys * warp + lane / 2;
        const int key = n0 + lane / 2;
        if (key < split.begin || key >= split.end) {
          for (int c = 0; c < L::kColumnBlocks; ++c)
#pragma unroll
            for (int chunk = 4 * (lane % 2); chunk < 4 * (lane % 2) + 4; ++chunk)
              *reinterpret_cast<Vec<T, 8>*>(v_bytes + (c * kBlockN + row) * wgmma::kRowBytes + 16 * chunk) =
                  Vec<T, 8>{};
        }
        wgmma::fence_shared_for_async_proxy();
        __syncwarp();
      }
      const decode::SwizzledOperands operands{k_tile + k_row * wgmma::kRowBytes, v_tile + v_row * wgmma::kRowBytes,
                                              k_swizzle, v_swizzle};
      decode::attend_warp_keys<T, HEAD_DIM, SCORE_MODS>(state, q_fragments, operands, n0, lane_keys, t);
      __syncwarp();
      if (lane == 0) mbarrier::arrive(empty(slot));
    }

    const decode::MergeBuffer merge = decode::store_warp_state(state, merge_memory, warp, g, t);
    barrier_sync<L::kConsumerThreads>(kConsumersMeet);
    decode::merge_and_store<T, HEAD_DIM, decode::kMmaRows, SCORE_MODS>(p, merge, decode::kMmaWarps, rows, w.row0,
                                                                       group, w.b, w.kv_head, w.split,
                                                                       L::kConsumerThreads);
    barrier_sync<L::kConsumerThreads>(kConsumersMeet);  // the merge buffer and this item's Q tile are free again
  }
  mma::wait_async_copies();  // the empty groups past the last item: no thread leaves with a copy in flight
}

}  // namespace hipattn
