// Shared by the tensor-core small-seq kernels: a warp's shared tiles, the copies of one head's rows
// in and out of them, and the walk over a team's run of (sequence, head) problems (a team: the one or
// two warps that share a problem).
//
// The kernels move little data per problem and do little math on it, so they are bound by latency:
// what matters is how many warps an SM holds (each stages its own problem) and how few instructions
// a problem takes. Tiles hold exactly TILE rows; fragment rows past a sequence's length read one
// shared zero row instead, so nothing is zeroed per problem and a warp needs as little shared memory
// as its rows. Rows are copied in and out with 16-byte accesses whose addresses advance by constant
// steps.
#pragma once
#include "common/mma_nvidia.h"
#include "smallseq/common.h"

namespace hipattn {
namespace smallseq {

// One warp's shared memory, in bytes from its base: a zero row, then TENSORS tiles of TILE rows
// (forward: Q, K, V; backward: Q, dO, K, V). Rows are padded by 16 bytes so that ldmatrix's eight
// row reads hit distinct banks. The host's rows (hipattn/catalog/smallseq.py, team_bytes) compute the same.
template <typename T, int HEAD_DIM, int TILE, int TENSORS>
struct WarpTiles {
  static constexpr int kPitch = HEAD_DIM + 8;  // elements
  static constexpr int kPitchBytes = kPitch * static_cast<int>(sizeof(T));
  static constexpr int kTileBytes = TILE * kPitchBytes;
  static constexpr int kTilesOffset = kPitchBytes;  // after the zero row
  static constexpr int kBytes = kTilesOffset + TENSORS * kTileBytes;
  static_assert(kPitchBytes % 16 == 0, "cp.async and ldmatrix need 16-byte aligned rows");
};

// Lane geometry of a row copy: each lane moves one 16-byte piece of every kRowsPerPass-th row.
template <typename T, int HEAD_DIM>
struct RowCopy {
  static constexpr int kPieceElements = 16 / static_cast<int>(sizeof(T));
  static constexpr int kPieces = HEAD_DIM / kPieceElements;  // per row
  static constexpr int kRowsPerPass = 32 / kPieces;
  static constexpr int kPitchBytes = (HEAD_DIM + 8) * static_cast<int>(sizeof(T));
  static_assert(kPieces <= 32 && 32 % kPieces == 0, "a warp covers whole rows");
};

// Copy `rows` rows of one head (global, token_stride apart) into a shared tile with cp.async.
template <typename T, int HEAD_DIM>
HIPATTN_DEVICE void stage_rows(unsigned char* tile, const T* first_row, long long token_stride, int rows, int lane) {
  using Copy = RowCopy<T, HEAD_DIM>;
  const int row = lane / Copy::kPieces;
  const int piece = lane % Copy::kPieces;
  const T* source = first_row + row * token_stride + piece * Copy::kPieceElements;
  unsigned int target = mma::shared_address(tile) + row * Copy::kPitchBytes + piece * 16;
  for (int r = row; r < rows; r += Copy::kRowsPerPass) {
    mma::copy_async_16(target, source);
    source += Copy::kRowsPerPass * token_stride;
    target += Copy::kRowsPerPass * Copy::kPitchBytes;
  }
}

// Write the first `rows` rows of a shared tile out to one head's rows (global, token_stride apart).
template <typename T, int HEAD_DIM>
HIPATTN_DEVICE void store_rows(T* first_row, long long token_stride, const unsigned char* tile, int rows, int lane) {
  using Copy = RowCopy<T, HEAD_DIM>;
  using Piece = Vec<T, Copy::kPieceElements>;
  const int row = lane / Copy::kPieces;
  const int piece = lane % Copy::kPieces;
  T* target = first_row + row * token_stride + piece * Copy::kPieceElements;
  const unsigned char* source = tile + row * Copy::kPitchBytes + piece * 16;
  for (int r = row; r < rows; r += Copy::kRowsPerPass) {
    *reinterpret_cast<Piece*>(target) = *reinterpret_cast<const Piece*>(source);
    target += Copy::kRowsPerPass * token_stride;
    source += Copy::kRowsPerPass * Copy::kPitchBytes;
  }
}

// Zero `bytes` bytes of a warp's shared memory (16-byte multiple).
HIPATTN_DEVICE void zero_bytes(unsigned char* first, int bytes, int lane) {
  for (int c = lane; c < bytes / 16; c += 32) reinterpret_cast<Vec<unsigned int, 4>*>(first)[c] = Vec<unsigned int, 4>{};
}

// The shared address ldmatrix takes for fragment row `row` of a tile: the staged row, or the zero
// row past `length`.
HIPATTN_DEVICE unsigned int row_or_zero(unsigned int tile, unsigned int zero, int row, int length, int pitch_bytes) {
  return row < length ? tile + row * pitch_bytes : zero;
}

// Named barrier FIRST + team for team < TEAMS, each barrier's ID an immediate (mma::named_barrier).
template <int FIRST, int TEAMS, int THREADS>
struct TeamBarriers {
  static_assert(FIRST + TEAMS - 1 <= 15, "named barriers 1..15: at most 15 teams of several warps a block");
  HIPATTN_DEVICE static void sync(int team) {
    if (team == 0) mma::named_barrier<FIRST, THREADS>();
    else TeamBarriers<FIRST + 1, TEAMS - 1, THREADS>::sync(team - 1);
  }
};
template <int FIRST, int THREADS>
struct TeamBarriers<FIRST, 1, THREADS> {
  HIPATTN_DEVICE static void sync(int) { mma::named_barrier<FIRST, THREADS>(); }
};

// The barrier between the hand-over points of the SPLIT warps of a team, one of the block's TEAMS:
// __syncwarp for a team of one (its own lanes order its shared-memory accesses), __syncthreads for a
// block of one team, else named barrier 1 + team.
template <int SPLIT, int TEAMS>
HIPATTN_DEVICE void team_sync(int team) {
  if constexpr (SPLIT == 1) __syncwarp();
  else if constexpr (TEAMS == 1) __syncthreads();
  else TeamBarriers<1, TEAMS, 32 * SPLIT>::sync(team);
}

// The partial score sums (S; the backward also dP) that one warp of a team of two hands the other:
// accumulators of two 16-row query tiles by three 8-key tiles, TENSORS of them. Each accumulator
// tile's 32 lane fragments lie side by side, so the 16-byte stores and loads meet no bank conflict.
// Of the second query tile only rows 16..23 travel: rows 24..31 are past any TILE <= 24.
template <int TENSORS>
struct ScoreExchange {
  static constexpr int kSecondTileOffset = TENSORS * 3 * 32 * 16;
  static constexpr int kBytes = kSecondTileOffset + TENSORS * 3 * 32 * 8;
};

template <int TENSORS>
HIPATTN_DEVICE void hand_over_scores(unsigned char* exchange, int tensor, const float (&sums)[2][3][4], int lane) {
  using Exchange = ScoreExchange<TENSORS>;
#pragma unroll
  for (int nt = 0; nt < 3; ++nt) {
    const int fragment = (tensor * 3 + nt) * 32 + lane;
    const float* first = sums[0][nt];
    reinterpret_cast<Vec<float, 4>*>(exchange)[fragment] = Vec<float, 4>{{first[0], first[1], first[2], first[3]}};
    reinterpret_cast<Vec<float, 2>*>(exchange + Exchange::kSecondTileOffset)[fragment] =
        Vec<float, 2>{{sums[1][nt][0], sums[1][nt][1]}};
  }
}

// Add the partial sums the other warp handed over to this warp's own.
template <int TENSORS>
HIPATTN_DEVICE void add_handed_scores(const unsigned char* exchange, int tensor, float (&sums)[2][3][4], int lane) {
  using Exchange = ScoreExchange<TENSORS>;
#pragma unroll
  for (int nt = 0; nt < 3; ++nt) {
    const int fragment = (tensor * 3 + nt) * 32 + lane;
    const Vec<float, 4> first = reinterpret_cast<const Vec<float, 4>*>(exchange)[fragment];
    const Vec<float, 2> second =
        reinterpret_cast<const Vec<float, 2>*>(exchange + Exchange::kSecondTileOffset)[fragment];
#pragma unroll
    for (int e = 0; e < 4; ++e) sums[0][nt][e] += first.elements[e];
    sums[1][nt][0] += second.elements[0];
    sums[1][nt][1] += second.elements[1];
  }
}

// One (sequence, head) problem of a team's run, with its sequences' bounds.
struct Problem {
  int batch_index;
  int head;
  Sequence q;
  Sequence k;
};

// Problems are numbered sequence-major (index = batch_index * HEADS + head): a team whose next problem
// is in the same sequence keeps its bounds instead of reading cu_seqlens again.
template <int HEADS, int TILE, typename Params>
HIPATTN_DEVICE Problem locate_problem(const Params& p, long long index, const Problem& previous) {
  Problem x{static_cast<int>(index / HEADS), static_cast<int>(index % HEADS), previous.q, previous.k};
  if (x.batch_index != previous.batch_index) {
    x.q = sequence_bounds(static_cast<const int*>(p.cu_seqlens_q), static_cast<const int*>(p.seqused_q),
                          x.batch_index, p.max_seqlen_q, p.total_q, TILE);
    x.k = sequence_bounds(static_cast<const int*>(p.cu_seqlens_k), static_cast<const int*>(p.seqused_k),
                          x.batch_index, p.max_seqlen_k, p.total_k, TILE);
  }
  return x;
}

HIPATTN_DEVICE Problem no_problem() { return Problem{-1, 0, Sequence{0, 0}, Sequence{0, 0}}; }

// A team's run: problems first, first + step, ... below end. A block owns TEAMS * problems_per_team
// consecutive problems and its teams take every TEAMS-th of them, so the teams of a block work on
// neighbouring heads of a sequence at the same time and their rows sit side by side in memory.
struct Run {
  long long first;
  int step;
  long long end;
};

HIPATTN_DEVICE Run team_run(long long problems, int problems_per_team, int teams_per_block, int team) {
  const long long block_problems = static_cast<long long>(teams_per_block) * problems_per_team;
  const long long block_first = static_cast<long long>(blockIdx.x) * block_problems;
  const long long end = block_first + block_problems;
  return Run{block_first + team, teams_per_block, end < problems ? end : problems};
}

}  // namespace smallseq
}  // namespace hipattn
