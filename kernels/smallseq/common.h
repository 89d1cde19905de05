// Shared by the small-sequence forward and backward kernels: team geometry, sequence bounds and the
// keys a row sees.
//
// One attention problem is one (sequence, head) pair of at most TILE query and TILE key tokens. A
// team of HEAD_DIM/4 lanes owns a problem: each lane holds 4 consecutive elements of every row, so
// a row is read with one 8-byte access per lane, coalesced across the team. Q·Kᵀ dot products are
// summed across the team with reduce_scatter; P·V style products need no communication at all.
#pragma once
#include "common/dropout.h"
#include "common/key_window.h"
#include "common/score_mods.h"
#include "common/sequence.h"
#include "common/sink.h"
#include "common/team.h"
#include "common/types.h"

namespace hipattn {
namespace smallseq {

constexpr int kElementsPerLane = 4;

template <int HEAD_DIM, int TILE, int BLOCK_THREADS>
struct Geometry {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "small-seq head_dim is 64, 128 or 256");
  static constexpr int kTeamLanes = HEAD_DIM / kElementsPerLane;                // 16, 32 or 64
  static constexpr int kReduceLanes = kTeamLanes < 32 ? kTeamLanes : 32;        // shuffle width
  static constexpr int kSlices = kTeamLanes / kReduceLanes;                     // partial sums per entry
  static constexpr int kTeamsPerBlock = BLOCK_THREADS / kTeamLanes;
  static constexpr int kTilePad = (TILE + 3) / 4 * 4;                           // row pitch of score tiles
  static constexpr int kEntries = TILE * TILE;                                  // score entries, key-major
  static constexpr int kGroups = (kEntries + kReduceLanes - 1) / kReduceLanes;  // reduce_scatter rounds
  static_assert(BLOCK_THREADS % kTeamLanes == 0, "a block holds whole teams");
};

// Sequence bounds live in common/sequence.h, shared with the flash kernels.
using hipattn::Sequence;
using hipattn::sequence_bounds;

// The keys query row i sees, [first, end) (common/key_window.h's rule: flash-attn's window,
// bottom-right aligned for unequal lengths; causal is right = 0). Found once per row, so that each
// score's test is two 32-bit compares. first <= end always, and end <= length_k, so contains(j)
// also keeps keys past the sequence out.
struct RowKeys {
  int first;
  int end;
  HIPATTN_DEVICE bool contains(int j) const { return j >= first && j < end; }
};

HIPATTN_DEVICE RowKeys row_keys(int i, int length_q, int length_k, KeyWindow w) {
  const int diagonal = length_k - length_q;
  return {first_visible_key(i, diagonal, w, length_k), visible_key_end(i, diagonal, w, length_k)};
}

// Address of this lane's 4 elements of row `token` of a [batch, token, head, dim] tensor.
template <typename T>
HIPATTN_DEVICE const T* row_pointer(const void* base, long long batch_stride, long long token_stride,
                                    long long head_stride, int batch_index, int token, int head, int lane) {
  return static_cast<const T*>(base) + batch_index * batch_stride + token * token_stride + head * head_stride +
         lane * kElementsPerLane;
}

template <typename T>
HIPATTN_DEVICE T* row_pointer(void* base, long long batch_stride, long long token_stride, long long head_stride,
                              int batch_index, int token, int head, int lane) {
  return static_cast<T*>(base) + batch_index * batch_stride + token * token_stride + head * head_stride +
         lane * kElementsPerLane;
}

}  // namespace smallseq
}  // namespace hipattn
