// Which (query tile, sequence, head) a block of a flash forward owns and which keys it visits: shared
// by the forwards (forward_mma.hip: mma.sync; forward_wgmma.hip and forward_warp_specialised.hip:
// Hopper's wgmma; forward_mfma.hip: AMD's MFMA), written without any vendor's instructions.
//
// Conventions (flash-attn's): the keys a row sees are common/key_window.h's bottom-right aligned
// window (causal is its right side at 0); a row that sees no key gets O = 0 and LSE = +inf. Sequence
// lengths read from the device are clamped to the host's max_seqlen and total (sequence_bounds), and
// the grid covers ceil(max_seqlen_q / BLOCK_M) query tiles per (sequence, head): blocks whose tile
// lies past their sequence's real length return at once. A block visits the key tiles its rows' windows
// reach, last first: the tiles that need masking at the window's right edge come first, then the
// unmasked middle, then the left edge's.
#pragma once
#include "common/key_window.h"
#include "common/sink.h"

namespace hipattn {
namespace flash {

struct ForwardBlock {
  int batch_index, head, head_kv;
  Sequence seq_q, seq_k;
  int m0;            // the block's first query row in its sequence
  int row_end;       // one past its last: the block computes and stores rows [m0, row_end)
  int diagonal;        // len_k - len_q: the window's alignment (common/key_window.h)
  KeyWindow window;
  int tile_end;        // one past the last key tile of BLOCK_N the block's rows see
  int n_tiles;         // key tiles the block visits: tile_end - n_tiles is the first
  int unmasked_begin;  // tiles starting at or after this, and ending at or before
  int unmasked_end;    // this, need no mask
  const void* q;     // row m0 of Q, and row 0 of K and V, for this (sequence, head)
  const void* k;
  const void* v;
};

// The work items of a forward are query tiles of BLOCK_M rows for max_seqlen_q, times sequences, times
// query heads (the host's grid for one item per block: hipattn/ops/flash.py, grid_blocks), numbered
// as forward_block reads them. A block that walks items takes units blockIdx.x, + gridDim.x, ...: a
// unit is one item, or with p.pair_query_tiles the pair of one (sequence, head)'s query tiles f and
// m - 1 - f counted from its end (the middle one alone when m is odd). Under a causal mask a tile's
// keys grow linearly along the sequence, so every pair costs the same, and a fixed stride over
// pairs is balanced where one over single tiles is not; the pairs of one head stay next to each
// other, so the blocks running together still share its K and V in L2.
template <int BLOCK_M>
struct ItemWalk {
  unsigned int m_blocks;  // query tiles per (sequence, head)
  unsigned int per_head;  // units per (sequence, head)
  unsigned int units;
  bool paired;

  HIPATTN_DEVICE explicit ItemWalk(const FlashForwardParams& p)
      : m_blocks(static_cast<unsigned int>((p.max_seqlen_q + BLOCK_M - 1) / BLOCK_M)),
        per_head(p.pair_query_tiles ? (m_blocks + 1) / 2 : m_blocks),
        units(per_head * static_cast<unsigned int>(p.batch) * static_cast<unsigned int>(p.heads_q)),
        paired(p.pair_query_tiles != 0) {}

  // The block's step-th item (its units blockIdx.x, + gridDim.x, ..., each in one or two steps): false
  // past its last unit; kNoItem for the missing half of an odd count's middle tile.
  enum : unsigned int { kNoItem = 0xffffffffu };  // an enumerator: no storage in the PTX
  HIPATTN_DEVICE bool at(unsigned int step, unsigned int& item) const {
    const unsigned int unit = blockIdx.x + (paired ? step / 2 : step) * gridDim.x;
    if (unit >= units) return false;
    if (!paired) {
      item = unit;
      return true;
    }
    const unsigned int first = unit % per_head;
    const unsigned int from_last = step % 2 == 0 ? first : m_blocks - 1 - first;
    item = step % 2 == 1 && from_last == first ? kNoItem : unit / per_head * m_blocks + from_last;
    return true;
  }
};

// Work item `item`'s problem (a block's blockIdx.x, or one of the items a persistent block walks):
// the query tile varies fastest, heaviest (last) first. An `empty` item (tile past the sequence's
// length) has nothing to compute or store; a block skips it before any barrier.
//
// Tiles are counted from the sequence's start, or with END_ALIGNED from its end, so that a partial
// tile (len_q not a multiple of BLOCK_M) holds the first rows rather than the last. Its cost is then
// the keys its own rows see: under a causal mask one key tile instead of the most of any tile (at
// S = 1024 and 192-row tiles, a third of the causal work went to such padding), and without a mask
// the same.
template <typename T, int BLOCK_M, int BLOCK_N, bool END_ALIGNED = false>
HIPATTN_DEVICE ForwardBlock forward_block(const FlashForwardParams& p, unsigned int item, bool& empty) {
  ForwardBlock b;
  const int m_blocks = (p.max_seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const unsigned int problem = item / static_cast<unsigned int>(m_blocks);
  const int from_last = static_cast<int>(item % static_cast<unsigned int>(m_blocks));  // 0: the last rows
  b.head = static_cast<int>(problem % static_cast<unsigned int>(p.heads_q));
  b.batch_index = static_cast<int>(problem / static_cast<unsigned int>(p.heads_q));
  b.head_kv = b.head / (p.heads_q / p.heads_kv);
  b.seq_q = query_sequence(p, b.batch_index, p.max_seqlen_q);
  b.seq_k = key_sequence(p, b.batch_index, p.max_seqlen_k);
  const int len_q = b.seq_q.length;
  const int len_k = b.seq_k.length;
  if (END_ALIGNED) {
    b.row_end = len_q - from_last * BLOCK_M;
    b.m0 = b.row_end > BLOCK_M ? b.row_end - BLOCK_M : 0;
    empty = b.row_end <= 0;
  } else {
    b.m0 = (m_blocks - 1 - from_last) * BLOCK_M;
    b.row_end = len_q < b.m0 + BLOCK_M ? len_q : b.m0 + BLOCK_M;
    empty = b.m0 >= len_q;
  }
  // Keys the block's stored rows see: from its first row's first key to its last row's last.
  b.diagonal = len_k - len_q;
  b.window = key_window(p);
  const int key_begin = first_visible_key(b.m0, b.diagonal, b.window, len_k);
  const int key_end = b.row_end > b.m0 ? visible_key_end(b.row_end - 1, b.diagonal, b.window, len_k) : 0;
  b.tile_end = (key_end + BLOCK_N - 1) / BLOCK_N;
  b.n_tiles = key_end > key_begin ? b.tile_end - key_begin / BLOCK_N : 0;
  // A tile needs no mask when every row sees all of it: it starts at or after the last row's first
  // key and ends at or before the first row's last (and the sequence's end).
  b.unmasked_begin = first_visible_key(b.row_end - 1, b.diagonal, b.window, len_k);
  b.unmasked_end = visible_key_end(b.m0, b.diagonal, b.window, len_k);
  b.q = static_cast<const T*>(p.q) + b.batch_index * p.q_batch_stride +
        static_cast<long long>(b.seq_q.start + b.m0) * p.q_token_stride + b.head * p.q_head_stride;
  b.k = static_cast<const T*>(p.k) + b.batch_index * p.k_batch_stride +
        static_cast<long long>(b.seq_k.start) * p.k_token_stride + b.head_kv * p.k_head_stride;
  b.v = static_cast<const T*>(p.v) + b.batch_index * p.v_batch_stride +
        static_cast<long long>(b.seq_k.start) * p.v_token_stride + b.head_kv * p.v_head_stride;
  return b;
}

}  // namespace flash
}  // namespace hipattn
