// What the flash backward's kernels (backward_mma.hip: mma.sync; backward_wgmma.hip: Hopper's wgmma;
// backward_mfma.hip: AMD's MFMA) share: which (key tile, sequence, KV head) a dK/dV block owns and
// which query tiles see its keys, and which (query tile, sequence, head) a dQ block owns.
#pragma once
#include "common/key_window.h"

namespace hipattn {
namespace flash {

struct KeyBlock {
  int n_block;  // key tile within the sequence
  int batch_index;  // -1: the block has no work (past the end of the varlen work list)
  int head_kv;
};

// The one place that maps a dK/dV block to its work.
// Without a work list (BSHD, or THD sized from max_seqlen_k), grid.x enumerates (key tile, sequence,
// KV head) in one of two orders. Under a causal mask (the window's right side bounded, its left not)
// a key tile's work falls with its index (tile 0 is seen by every query tile, the last by one), and
// blocks start in grid order:
// - key tile fastest: the long tiles of the last sequences and heads start late and run on alone;
//   but each wave's blocks belong to a few sequences, which share their Q and dO in L2;
// - key tile first ((sequence, KV head) fastest): every tile 0 starts in the first wave and the
//   short tiles fill the last; but each wave reads many sequences' Q and dO.
// The imbalance grows with a block's length (with grouped-query heads each block walks every query
// head of its group) and with the tiles per sequence; the lost reuse grows with the bytes a block
// reads per product, Q and dO rows of HEAD_DIM columns for BLOCK_N keys. Measured on an H100
// (BENCHMARKS.md), forward+backward:
// - grouped-query heads, 4 KV heads: key tile first 13-16% faster at head_dims 64 and 128 (S
//   1024-8192), and 1.2-1.5x slower at 256, whose 64-key tiles read four times head_dim 128's bytes
//   per product (S 512-8192);
// - one head per block: key tile first 5% slower at head_dim 128 (S 1024-2048); at head_dim 64
//   (128-key tiles, half the bytes per product) 2-3% slower at S 512, even at S 1024, and 2-6%
//   faster at S 2048-16384.
// So key tile first is taken with grouped-query heads where a tile holds at least HEAD_DIM keys, and
// with one head per block where it holds at least twice HEAD_DIM keys and a sequence at least
// kMhaKeyTileFirstTiles tiles; everywhere else the key tile is fastest.
// With a work list (THD: p.varlen_records, hipattn/varlen_metadata.py), grid.x enumerates (work-list
// key block, KV head), the head fastest, so every real block comes before the idle tail of the
// host-sized grid; the block finds its sequence by a binary search for the last record whose
// first_key_block is not past its key block (sequences without blocks share their successor's
// first_key_block and are never found). Every order puts a sequence's tile 0 before its later
// tiles: under causal masking it sees the most query rows.
constexpr unsigned int kMhaKeyTileFirstTiles = 16;

template <int BLOCK_N, int HEAD_DIM>
HIPATTN_DEVICE KeyBlock key_block_of(unsigned int block, const FlashBackwardParams& p) {
  const unsigned int heads_kv = static_cast<unsigned int>(p.heads_kv);
  if (p.varlen_records == nullptr) {
    const unsigned int n_blocks = static_cast<unsigned int>((p.max_seqlen_k + BLOCK_N - 1) / BLOCK_N);
    const bool causal = p.window_right < p.max_seqlen_q && p.window_left >= p.max_seqlen_k;
    const bool key_tile_first =
        causal && (p.heads_q > p.heads_kv ? HEAD_DIM <= BLOCK_N
                                          : 2 * HEAD_DIM <= BLOCK_N && n_blocks >= kMhaKeyTileFirstTiles);
    const unsigned int problems = static_cast<unsigned int>(p.batch) * heads_kv;
    const unsigned int problem = key_tile_first ? block % problems : block / n_blocks;
    const unsigned int n_block = key_tile_first ? block / problems : block % n_blocks;
    return {static_cast<int>(n_block), static_cast<int>(problem / heads_kv), static_cast<int>(problem % heads_kv)};
  }
  if (p.batch < 1) return {0, -1, 0};
  const VarlenSequenceRecord* const records = static_cast<const VarlenSequenceRecord*>(p.varlen_records);
  const long long work = block / heads_kv;
  int lo = 0;
  int hi = p.batch - 1;
  while (lo < hi) {
    const int mid = hi - (hi - lo) / 2;
    if (records[mid].first_key_block <= work) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const long long n_block = work - records[lo].first_key_block;
  const int key_length = records[lo].key_length;
  const int blocks = key_length / BLOCK_N + (key_length % BLOCK_N != 0);
  if (n_block < 0 || n_block >= blocks) return {0, -1, 0};
  return {static_cast<int>(n_block), lo, static_cast<int>(block % heads_kv)};
}

// A dQ block's work: the deterministic dQ kernels' grid.x enumerates (query tile, sequence, query
// head), the query tile fastest and the last tile first: under causal masking it sees the most keys.
struct QueryBlock {
  int m_block;  // query tile within the sequence
  int batch_index;
  int head;
};

HIPATTN_DEVICE QueryBlock query_block_of(unsigned int block, int m_blocks, int heads_q) {
  const unsigned int problem = block / static_cast<unsigned int>(m_blocks);
  return {m_blocks - 1 - static_cast<int>(block % static_cast<unsigned int>(m_blocks)),
          static_cast<int>(problem / static_cast<unsigned int>(heads_q)),
          static_cast<int>(problem % static_cast<unsigned int>(heads_q))};
}

// The query tiles of BLOCK_M rows, [first, first + count), whose rows see some of the keys
// [n0, n0 + keys): the rows of common/key_window.h's rows_seeing.
struct QueryTiles {
  int first;
  int count;
};

template <int BLOCK_M>
HIPATTN_DEVICE QueryTiles query_tiles_seeing(int n0, int keys, int len_q, int diagonal, KeyWindow window) {
  const RowRange rows = rows_seeing(n0, n0 + keys, diagonal, window, len_q);
  const int first = rows.first / BLOCK_M;
  return {first, rows.end > rows.first ? (rows.end + BLOCK_M - 1) / BLOCK_M - first : 0};
}

}  // namespace flash
}  // namespace hipattn
