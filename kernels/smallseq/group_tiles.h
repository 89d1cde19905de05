// Shared by the tensor-core small-seq kernels for grouped heads (GQA/MQA: G = Hq / Hkv query heads
// share each KV head): the walk over a team's run of (sequence, KV head) groups, the stacked query
// rows of a group, and their copies in and out of 16-row chunk tiles.
//
// One team serves a whole group, so a group's K and V rows are staged once, not once per query
// head. The group's G * len_q query rows are stacked query-major (row r is query i = r / G of the
// group's head h = r % G, call head head_kv * G + h) and walked in chunks of 16 rows, one m16 tile
// each: G * len_q rows fill ceil(G * len_q / 16) tiles, where one problem per head would fill
// G * ceil(len_q / 16), mostly empty (at G = 4 and lengths drawn from 1..17, 2.6 tiles a group
// instead of 4.2). Stacked query-major, the 16 rows of a chunk are 16 / G consecutive tokens of the
// group's G adjacent heads: contiguous runs of G * head_dim elements in a THD or BSHD tensor.
#pragma once
#include "smallseq/mma_tiles.h"

namespace hipattn {
namespace smallseq {

constexpr int kChunkRows = 16;  // stacked query rows per chunk: one m16 tile

// U, const when T is: a byte pointer into a tensor keeps the tensor's constness.
template <typename T, typename U>
struct CopyConst {
  using type = U;
};
template <typename T, typename U>
struct CopyConst<const T, U> {
  using type = const U;
};

// A group's stacked query rows: how many, and row -> (query, head of the group). The query is
// r * ceil(2^32 / G) / 2^32, exact while r * (ceil(2^32 / G) * G - 2^32) < 2^32, which holds for
// every r < 17 * G when G <= 15894; the host sends larger groups to the portable kernels
// (catalog.smallseq.SMALLSEQ_GQA_MAX_GROUP).
struct StackedRows {
  int group;
  unsigned int reciprocal;  // ceil(2^32 / group); unused for a group of one
  int count;                // group * len_q

  HIPATTN_DEVICE int query(int row) const {
    if (group == 1) return row;
    // The reciprocal passes through opaque so that its widening stays beside the multiply, which then
    // compiles to one 32 x 32 -> 64-bit multiply (a widened copy hoisted out of a loop made it a
    // 64 x 64-bit one).
    const unsigned long long product =
        static_cast<unsigned long long>(static_cast<unsigned int>(row)) * mma::opaque(reciprocal);
    return static_cast<int>(product >> 32);
  }
};

HIPATTN_DEVICE StackedRows stacked_rows(int group) {
  // 0xffffffff / G + 1 is ceil(2^32 / G) for every G > 1 (a power of two included).
  return StackedRows{group, group > 1 ? 0xffffffffu / static_cast<unsigned int>(group) + 1u : 0u, 0};
}

// One (sequence, KV head) group of a team's run, with its sequences' bounds.
struct Group {
  int batch_index;
  int head_kv;
  Sequence q;
  Sequence k;
};

// Groups are numbered sequence-major (index = batch_index * heads_kv + head_kv). Only a team's first
// group is found by a division; the next ones step from it (next_group).
template <int TILE, typename Params>
HIPATTN_DEVICE Group group_bounds(const Params& p, int batch_index, int head_kv) {
  return Group{batch_index, head_kv,
               sequence_bounds(static_cast<const int*>(p.cu_seqlens_q), static_cast<const int*>(p.seqused_q),
                               batch_index, p.max_seqlen_q, p.total_q, TILE),
               sequence_bounds(static_cast<const int*>(p.cu_seqlens_k), static_cast<const int*>(p.seqused_k),
                               batch_index, p.max_seqlen_k, p.total_k, TILE)};
}

template <int TILE, typename Params>
HIPATTN_DEVICE Group group_at(const Params& p, long long index) {
  return group_bounds<TILE>(p, static_cast<int>(index / p.heads_kv), static_cast<int>(index % p.heads_kv));
}

// The group `step` further on (a step is a block's team count, at most 32), so the loop runs at most
// step / heads_kv + 1 times. Past the last group (batch_index == batch) nothing is read.
template <int TILE, typename Params>
HIPATTN_DEVICE Group next_group(const Params& p, const Group& x, int step) {
  int batch_index = x.batch_index;
  int head_kv = x.head_kv + step;
  while (head_kv >= p.heads_kv) {
    head_kv -= p.heads_kv;
    ++batch_index;
  }
  if (batch_index == x.batch_index || batch_index >= p.batch) return Group{batch_index, head_kv, x.q, x.k};
  return group_bounds<TILE>(p, batch_index, head_kv);
}

// A team's run of groups: a block owns TEAMS * problems_per_team consecutive groups and its teams take
// every TEAMS-th of them, so the teams of a block work on neighbouring KV heads of a sequence at the
// same time. first_group finds a team's first (false for a team with none: it returns before any
// barrier), next_group_of_block the one after x (false past the block's groups or the batch). The end
// is computed from blockIdx and the parameters each time, not held in a register: beside the
// backward's accumulators, a loop counter was what ptxas spilled.
template <int TILE, int TEAMS, typename Params>
HIPATTN_DEVICE bool first_group(const Params& p, int team, Group& x) {
  const long long first = static_cast<long long>(blockIdx.x) * TEAMS * p.problems_per_team + team;
  if (first >= static_cast<long long>(p.batch) * p.heads_kv) return false;
  x = group_at<TILE>(p, first);
  return true;
}

template <int TILE, int TEAMS, typename Params>
HIPATTN_DEVICE bool next_group_of_block(const Params& p, Group& x) {
  x = next_group<TILE>(p, x, TEAMS);
  const long long index = static_cast<long long>(x.batch_index) * p.heads_kv + x.head_kv;
  return x.batch_index < p.batch && index < static_cast<long long>(blockIdx.x + 1) * TEAMS * p.problems_per_team;
}

// The element (query 0, head 0 of the group, column 0) of group x's stacked rows in Q, O or their
// gradients.
template <typename T>
HIPATTN_DEVICE T* group_rows(T* tensor, const Group& x, const StackedRows& stacked, long long batch_stride,
                             long long token_stride, long long head_stride) {
  return tensor + (x.batch_index * batch_stride + x.q.start * token_stride + x.head_kv * stacked.group * head_stride);
}

// Calls visit(tile_row, rows) for each row of the chunk of stacked rows [first, first + count), count
// <= kChunkRows, of which this lane moves a 16-byte piece (RowCopy's geometry: row lane / pieces, then every
// kRowsPerPass-th), where rows[n] points at that stacked row's piece in tensor n: `group_rows[n]`
// (query 0, head 0 of the group, the lane's piece) plus query * token_stride[n] + head *
// head_stride[n] elements. Only the lane's first row is divided; each pass then moves the byte
// pointers by a constant (kRowsPerPass rows: kRowsPerPass / G queries and kRowsPerPass % G heads), or,
// when the head passes the group's end, by another (one query more, G heads fewer). A division and two
// 64-bit products per row took about 20 instructions a copy; this takes 8. Its first row still costs
// a division and the products each call; the forward walks with StackedRowCursor instead, which pays
// them once a group.
template <typename T, int COLS, int N, typename Pointer, typename Visit>
HIPATTN_DEVICE void for_lane_stacked_rows(const StackedRows& stacked, int first, int count, int lane,
                                          Pointer* const (&group_rows)[N], const long long (&token_stride)[N],
                                          const long long (&head_stride)[N], Visit visit) {
  using Byte = typename CopyConst<Pointer, unsigned char>::type;
  constexpr int kStep = RowCopy<T, COLS>::kRowsPerPass;
  constexpr long long kElement = sizeof(T);
  int row = lane / RowCopy<T, COLS>::kPieces;
  if (row >= count) return;
  const int query = stacked.query(first + row);
  int head = first + row - query * stacked.group;
  const int step_queries = stacked.query(kStep);
  const int step_heads = kStep - step_queries * stacked.group;  // < G: at most one wrap a pass
  Byte* rows[N];
  long long step[N], wrapped_step[N];
#pragma unroll
  for (int n = 0; n < N; ++n) {
    rows[n] = reinterpret_cast<Byte*>(group_rows[n] + (query * token_stride[n] + head * head_stride[n]));
    step[n] = (step_queries * token_stride[n] + step_heads * head_stride[n]) * kElement;
    wrapped_step[n] = step[n] + (token_stride[n] - stacked.group * head_stride[n]) * kElement;
  }
  // A chunk holds at most kChunkRows rows, so a lane makes at most kChunkRows / kStep passes: unrolled
  // that far, the loop has no trip count to work out and no remainder to branch around.
#pragma unroll
  for (int pass = 0; pass < kChunkRows / kStep; ++pass, row += kStep) {
    if (row >= count) return;
    visit(row, rows);
    head += step_heads;
    const bool wraps = head >= stacked.group;
    head -= wraps ? stacked.group : 0;
#pragma unroll
    for (int n = 0; n < N; ++n) rows[n] += wraps ? wrapped_step[n] : step[n];
  }
}

// A lane's place in one tensor's stacked rows of a group, carried from chunk to chunk. A lane moves
// rows lane / pieces + k * kRowsPerPass of every chunk, and kChunkRows is a whole number of passes,
// so the row after its last one in a chunk is its first one in the next: the pointer and head that a
// full chunk's walk leaves are where the next chunk's walk starts. Dividing the lane's first row into
// (query, head), the 64-bit pointer products and the two steps then happen once a group (start), not
// once a chunk and tensor as in for_lane_stacked_rows (about 50 instructions before the first copy
// at head_dim 64; a walk now starts within about 15). Element is T, or const T for a tensor only read.
template <typename Element, int COLS>
struct StackedRowCursor {
  using Copy = RowCopy<Element, COLS>;
  using Byte = typename CopyConst<Element, unsigned char>::type;
  static constexpr int kStep = Copy::kRowsPerPass;
  static_assert(kChunkRows % kStep == 0, "a chunk is whole passes, so a lane's rows carry on into the next");

  Byte* piece;             // the lane's piece of its next stacked row
  int head;                // that row's head in the group
  int step_heads;          // kRowsPerPass % G
  long long step;          // bytes from a row to the one kRowsPerPass on
  long long wrapped_step;  // the same when the head passes the group's end (one query on, G heads back)

  // At the lane's first row of the group's first chunk. `group_rows` is the element (query 0, head 0
  // of the group, first column).
  HIPATTN_DEVICE static StackedRowCursor start(Element* group_rows, long long token_stride, long long head_stride,
                                               const StackedRows& stacked, int lane) {
    constexpr long long kElement = sizeof(Element);
    const int row = lane / Copy::kPieces;
    const int query = stacked.query(row);
    const int head = row - query * stacked.group;
    const int step_queries = stacked.query(kStep);
    const int step_heads = kStep - step_queries * stacked.group;  // < G: at most one wrap a pass
    const long long step = (step_queries * token_stride + step_heads * head_stride) * kElement;
    // Left in sight, ptxas rebuilt wrapped_step from the parameters in every walk (9 instructions);
    // hidden, it keeps the two registers, and the head_dim 64 kernel still fits its 96.
    return StackedRowCursor{
        reinterpret_cast<Byte*>(group_rows + (lane % Copy::kPieces) * Copy::kPieceElements +
                                (query * token_stride + head * head_stride)),
        head, step_heads, step, mma::opaque_64(step + (token_stride - stacked.group * head_stride) * kElement)};
  }

  // Calls visit(tile_row, piece) for each of the lane's rows among the `count` <= kChunkRows rows of
  // the chunk the cursor stands at. After a full chunk the cursor stands at the next chunk; after a
  // partial one (the group's last) it is spent. Each pass moves the pointer by kRowsPerPass rows
  // (kRowsPerPass / G queries and kRowsPerPass % G heads), or, when the head passes the group's end,
  // by one query more and G heads fewer.
  template <typename Visit>
  HIPATTN_DEVICE void walk_chunk(const StackedRows& stacked, int count, int lane, Visit visit) {
    const int row = lane / Copy::kPieces;
    const int left = count - row;  // the lane's rows: those of its passes below `left` (compared with constants)
    // Unrolled to the kChunkRows / kStep passes a chunk holds: no trip count, no remainder.
#pragma unroll
    for (int pass = 0; pass < kChunkRows / kStep; ++pass) {
      if (pass * kStep >= left) return;
      visit(row + pass * kStep, piece);
      head += step_heads;
      const bool wraps = head >= stacked.group;
      head -= wraps ? stacked.group : 0;
      piece += wraps ? wrapped_step : step;
    }
  }
};

// Write the first `rows` rows of a chunk tile out to stacked rows [first, first + rows).
template <typename T, int COLS>
HIPATTN_DEVICE void store_stacked_rows(T* group_rows, long long token_stride, long long head_stride,
                                       const unsigned char* tile, const StackedRows& stacked, int first, int rows,
                                       int lane) {
  using Copy = RowCopy<T, COLS>;
  using Piece = Vec<T, Copy::kPieceElements>;
  const int piece = lane % Copy::kPieces;
  const unsigned char* const source = tile + piece * 16;
  T* const targets[1] = {group_rows + piece * Copy::kPieceElements};
  const long long token_strides[1] = {token_stride}, head_strides[1] = {head_stride};
  for_lane_stacked_rows<T, COLS>(stacked, first, rows, lane, targets, token_strides, head_strides,
                                 [&](int row, unsigned char* const (&target)[1]) {
                                   *reinterpret_cast<Piece*>(target[0]) =
                                       *reinterpret_cast<const Piece*>(source + row * Copy::kPitchBytes);
                                 });
}

// Issue the copies of the first `rows` stacked rows of the chunk a cursor of one tensor stands at into a
// chunk tile (rows COLS + 8 elements apart, `tile` a shared-state-space address: TilePlaces::
// warp_address, cheaper to form than a generic pointer's conversion), moving the cursor on.
template <typename T, int COLS>
HIPATTN_DEVICE void stage_stacked_rows(unsigned int tile, StackedRowCursor<const T, COLS>& cursor,
                                       const StackedRows& stacked, int rows, int lane) {
  using Copy = RowCopy<T, COLS>;
  const unsigned int target = tile + (lane % Copy::kPieces) * 16;
  cursor.walk_chunk(stacked, rows, lane, [&](int row, const unsigned char* source) {
    mma::copy_async_16(target + row * Copy::kPitchBytes, source);
  });
}

// Write the first `rows` rows of a chunk tile out to the chunk a cursor stands at, moving it on.
template <typename T, int COLS>
HIPATTN_DEVICE void store_stacked_rows(StackedRowCursor<T, COLS>& cursor, const unsigned char* tile,
                                       const StackedRows& stacked, int rows, int lane) {
  using Copy = RowCopy<T, COLS>;
  using Piece = Vec<T, Copy::kPieceElements>;
  const unsigned char* const source = tile + (lane % Copy::kPieces) * 16;
  cursor.walk_chunk(stacked, rows, lane, [&](int row, unsigned char* target) {
    *reinterpret_cast<Piece*>(target) = *reinterpret_cast<const Piece*>(source + row * Copy::kPitchBytes);
  });
}

// Where a warp's and its team's tiles lie: byte offsets in the block's shared memory, from which
// each phase rebuilds the addresses it needs (through mma::opaque, so that the compiler does not hoist
// them). Held for the whole kernel, every tile address took a register of its own (two for a generic
// pointer) across the slow-path call a warp barrier compiles to, and ptxas spilled them there: in the
// backward beside 96 accumulators, in the forward around that call alone.
struct TilePlaces {
  unsigned char* shared;  // the block's shared memory
  int warp;               // this warp's tiles (its zero row first)
  int team;               // its team's tiles

  HIPATTN_DEVICE unsigned char* warp_bytes(int offset) const { return shared + mma::opaque(warp) + offset; }
  HIPATTN_DEVICE unsigned char* team_bytes(int offset) const { return shared + mma::opaque(team) + offset; }
  HIPATTN_DEVICE unsigned int warp_address(int offset) const {
    return mma::shared_address(shared) + mma::opaque(warp) + offset;
  }
  HIPATTN_DEVICE unsigned int team_address(int offset) const {
    return mma::shared_address(shared) + mma::opaque(team) + offset;
  }
};

// Partial score sums of one 16-row chunk (accumulators of three 8-key tiles, TENSORS of them: S, and
// in the backward dP) that a warp hands another of its team. Each accumulator tile's 32 lane
// fragments lie side by side, so the 16-byte stores and loads meet no bank conflict.
template <int TENSORS>
struct ChunkExchange {
  static constexpr int kBytes = TENSORS * 3 * 32 * 16;
};

HIPATTN_DEVICE void hand_over_chunk_scores(unsigned char* slot, int tensor, const float (&sums)[3][4], int lane) {
#pragma unroll
  for (int nt = 0; nt < 3; ++nt)
    reinterpret_cast<Vec<float, 4>*>(slot)[(tensor * 3 + nt) * 32 + lane] =
        Vec<float, 4>{{sums[nt][0], sums[nt][1], sums[nt][2], sums[nt][3]}};
}

HIPATTN_DEVICE void add_chunk_scores(const unsigned char* slot, int tensor, float (&sums)[3][4], int lane) {
#pragma unroll
  for (int nt = 0; nt < 3; ++nt) {
    const Vec<float, 4> other = reinterpret_cast<const Vec<float, 4>*>(slot)[(tensor * 3 + nt) * 32 + lane];
#pragma unroll
    for (int e = 0; e < 4; ++e) sums[nt][e] += other.elements[e];
  }
}

// The keys a stacked row sees, [first, end) (row_keys' rule, for the row's query), or none for a row
// past the group's rows.
HIPATTN_DEVICE RowKeys stacked_row_keys(int row, int query, const StackedRows& stacked, int len_q, int len_k,
                                        KeyWindow w) {
  if (row >= stacked.count) return RowKeys{0, 0};
  return row_keys(query, len_q, len_k, w);
}

// Keys [first, end) of [0, 24) as a bit mask, shifted right by 2 t (t = lane % 4): the key of a lane's
// accumulator element (nt, e) of three 8-key tiles is 8 nt + 2 t + (e & 1), so its bit is the
// compile-time 8 nt + (e & 1). One mask per row, where comparing keys would hold 8 nt + 2 t + (e & 1)
// for every (nt, e) in registers of its own. (1 << end) - (1 << first) sets bits first .. end - 1:
// row_keys gives first <= end <= len_k <= 24 (and first = end for none).
HIPATTN_DEVICE unsigned int key_bits(RowKeys keys, int t) {
  return ((1u << keys.end) - (1u << keys.first)) >> (2 * t);
}

HIPATTN_DEVICE bool key_bit(unsigned int bits, int nt, int e) { return ((bits >> (8 * nt + (e & 1))) & 1u) != 0; }

}  // namespace smallseq
}  // namespace hipattn
