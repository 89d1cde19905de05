// Shared by the MFMA small-seq kernels (AMD gfx90a, gfx94x; wave64): the workgroup of one (sequence,
// KV head), the stacked query rows of its group, fragments read straight from global memory, and the
// partial scores its waves sum through LDS.
//
// A workgroup serves one (sequence, KV head) problem and every query head of its group, so K and V
// are read from memory once per group, and Q, dO, O and dQ once per head. The group's query rows are
// stacked, head after head, len_q rows each, and cut into 16-row tiles (the N of every MFMA of the
// transposed frame, see flash/forward_mfma.hip): a group of G heads of 17 rows fills ceil(17 G / 16)
// tiles instead of 2 G, and shorter sequences pack as tightly (G = 4, len_q = 8: 2 tiles, not 4).
// Keys are the M of the scores, at most TILE <= 17 of them: one 16-row tile, and one more whose only
// row is key 16.
//
// WAVES waves split head_dim: wave w owns columns [w C, w C + C), C = HEAD_DIM / WAVES. Each computes
// its share of the scores (a dot product over its columns), the waves add their shares through LDS
// in wave order (so every wave holds the same scores, bit for bit, and takes the same softmax), and
// each produces the outputs of its own columns. One wave per problem holds every fragment of
// head_dim in registers; splitting bounds a wave's registers by C instead (the backward's dK and dV
// accumulators alone are 2 TILE HEAD_DIM floats per problem).
//
// Rows are read and written with 16-byte accesses: quarter q of a wave moves elements 8 q .. 8 q + 7
// of every 32 of a wave's columns, and those 8 feed two k-steps (mma_amd.h's load_operand_pair). So
// k-step s covers, in quarter q, the columns
//     column(s, q, e) = 32 (s / 2) + 8 q + 4 (s % 2) + e,     e = 0..3,
// which is also where output tile s keeps its accumulator rows 4 q + e: output tiles 2 j and 2 j + 1
// of a row are one 16-byte store.
#pragma once
#include "common/mma_amd.h"
#include "smallseq/common.h"

namespace hipattn {
namespace smallseq {

template <int HEAD_DIM, int TILE, int WAVES>
struct MfmaGeometry {
  static constexpr int kColumns = HEAD_DIM / WAVES;  // a wave's share of head_dim
  static constexpr int kSteps = kColumns / 16;       // k-steps over them; 16-column output tiles
  static constexpr int kKeyTiles = (TILE + 15) / 16;
  static constexpr int kThreads = WAVES * 64;
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "small-seq head_dim is 64, 128 or 256");
  static_assert(HEAD_DIM % WAVES == 0 && kColumns % 32 == 0, "each wave owns whole 32-column pieces of a row");
  static_assert(TILE >= 1 && TILE <= 17, "keys past 16 are at most one: key tile 1 has a single row");
};

// Stacked query row `row` of the group whose first head is `first_head`: its head and token, and whether
// it exists (rows past group * len_q are padding of the last tile).
struct StackedRow {
  int head;
  int token;
  bool in;
};

HIPATTN_DEVICE StackedRow stacked_row(int row, int len_q, int group, int first_head) {
  const bool in = row < group * len_q;
  const int g = in ? row / len_q : 0;
  return {first_head + g, in ? row - g * len_q : 0, in};
}

// The operands of one row over a wave's columns (`first` points at its first column), zero when the
// row does not exist: x[s] holds the columns column(s, quarter, 0..3).
template <typename T, int STEPS>
HIPATTN_DEVICE void load_row(const T* first, bool in, int quarter, mfma::Operand (&x)[STEPS]) {
#pragma unroll
  for (int j = 0; j < STEPS / 2; ++j) {
    const mfma::OperandPair pair = in ? mfma::load_operand_pair(first + 32 * j + 8 * quarter)
                                      : mfma::OperandPair{mfma::zero_operand(), mfma::zero_operand()};
    x[2 * j] = pair.low;
    x[2 * j + 1] = pair.high;
  }
}

// Output tiles x[s] of one row (accumulator rows 4 quarter + e are the columns column(s, quarter, e)),
// times `scale` and rounded to T.
template <typename T, int STEPS>
HIPATTN_DEVICE void store_row(T* first, const mfma::Accumulator (&x)[STEPS], float scale, int quarter) {
#pragma unroll
  for (int j = 0; j < STEPS / 2; ++j) {
    mfma::store_operand_pair(first + 32 * j + 8 * quarter, mfma::to_operand<T>(x[2 * j] * scale),
                             mfma::to_operand<T>(x[2 * j + 1] * scale));
  }
}

// LDS of the waves' partial scores, in floats: per wave and tensor (the forward's Sᵀ; the backward's
// Sᵀ and dPᵀ), key tile 0's accumulators (64 lanes x 4), then key 16's scores of the tile's 16 queries
// (accumulator element 0 of quarter 0, the one real row of key tile 1). Two buffers, by query tile
// parity: a wave may write tile m + 1's while another still reads tile m's, so one barrier per tile
// suffices. One wave exchanges nothing. The host's rows (hipattn/catalog/smallseq_mfma.py,
// _exchange_bytes) compute kBytes with the same formula.
template <int WAVES, int TENSORS, int KEY_TILES>
struct ScoreExchange {
  static constexpr int kTensorFloats = 64 * 4 + (KEY_TILES > 1 ? 16 : 0);
  static constexpr int kBufferFloats = WAVES * TENSORS * kTensorFloats;
  static constexpr int kBytes = WAVES > 1 ? 2 * kBufferFloats * static_cast<int>(sizeof(float)) : 0;
};

// Replace each wave's partial scores `s` of query tile `tile` by their sum over the waves, added in
// wave order by every wave. Called by every thread of the workgroup (a barrier when WAVES > 1).
// Elements of key tile 1 other than key 16 come back 0: they are keys past TILE, masked by the caller.
template <int WAVES, int TENSORS, int KEY_TILES>
HIPATTN_DEVICE void sum_over_waves(float* exchange, int tile, int wave, int lane,
                                   mfma::Accumulator (&s)[TENSORS][KEY_TILES]) {
  if constexpr (WAVES > 1) {
    using X = ScoreExchange<WAVES, TENSORS, KEY_TILES>;
    float* const buffer = exchange + (tile % 2) * X::kBufferFloats;
#pragma unroll
    for (int t = 0; t < TENSORS; ++t) {
      float* const mine = buffer + (wave * TENSORS + t) * X::kTensorFloats;
      *reinterpret_cast<mfma::Accumulator*>(mine + 4 * lane) = s[t][0];
      if constexpr (KEY_TILES > 1) {
        if (lane < 16) mine[64 * 4 + lane] = s[t][1][0];
      }
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < TENSORS; ++t) {
      mfma::Accumulator total = mfma::zero_accumulator();
      float key16 = 0.0f;
#pragma unroll
      for (int w = 0; w < WAVES; ++w) {
        const float* const theirs = buffer + (w * TENSORS + t) * X::kTensorFloats;
        total += *reinterpret_cast<const mfma::Accumulator*>(theirs + 4 * lane);
        if constexpr (KEY_TILES > 1) key16 += lane < 16 ? theirs[64 * 4 + lane] : 0.0f;
      }
      s[t][0] = total;
      if constexpr (KEY_TILES > 1) s[t][1] = mfma::Accumulator{key16, 0.0f, 0.0f, 0.0f};
    }
  } else {
    (void)exchange, (void)tile, (void)wave, (void)lane, (void)s;
  }
}

}  // namespace smallseq
}  // namespace hipattn
