// One warpgroup's share of a Hopper (sm_90a) flash forward: its 64 query rows of the block's Q tile
// against K and V tiles in a ring of shared-memory slots, all in wgmma's 128-byte swizzled layout
// (common/wgmma_nvidia.h). The products' descriptors and their issue, and the output's way out through
// the warpgroup's own Q rows, shared by the FA2-class kernel (forward_wgmma.hip), whose threads also
// copy the tiles, and the warp-specialised one (forward_warp_specialised.hip), whose producer does.
#pragma once
#include "common/wgmma_nvidia.h"
#include "flash/forward_block.h"

namespace hipattn {
namespace flash {

// S = Q Kᵀ and O += P V for one warpgroup. Q and K are K-major operands: a k16 step is 32 bytes along
// their 128-byte rows (then the next column block), 8-row atoms are 1024 bytes apart. V is the
// MN-major B of P V: a k16 step is 16 keys (two atoms), and its 64-column blocks are BLOCK_N rows
// apart. The warpgroup's Q rows start 64 rows into each column block of the BLOCK_M-row Q tile.
// Iteration i reads slot i % STAGES.
template <typename T, int HEAD_DIM, int BLOCK_N, int BLOCK_M, int STAGES>
struct WarpgroupProducts {
  // Constants as enumerators, which have no storage: static data members of a struct that has objects
  // become global variables in the PTX.
  enum : int {
    kNTiles = BLOCK_N / 8,                 // 8-key accumulator tiles of S
    kDTiles = HEAD_DIM / 8,                // 8-column accumulator tiles of O
    kRowElements = (HEAD_DIM + 63) / 64 * 64,  // a row in whole swizzle blocks: 96 is stored as 128
    kSlotBytes = BLOCK_N * kRowElements * static_cast<int>(sizeof(T)),
  };
  // The descriptors of every k16 step of one product, formed before the fence that opens a batch, so
  // that nothing but wgmmas runs between the fence and the commits.
  typedef wgmma::u64 ScoreSteps[HEAD_DIM / 16];
  typedef wgmma::u64 ValueSteps[BLOCK_N / 16];

  wgmma::u64 q_descriptor, k_descriptor, v_descriptor;

  HIPATTN_DEVICE WarpgroupProducts(const T* q_tile, const T* k_slots, const T* v_slots, int warpgroup)
      : q_descriptor(wgmma::descriptor(mma::shared_address(q_tile + 64 * warpgroup * 64), wgmma::kRowBytes,
                                       wgmma::kAtomBytes)),
        k_descriptor(wgmma::descriptor(mma::shared_address(k_slots), wgmma::kRowBytes, wgmma::kAtomBytes)),
        v_descriptor(wgmma::descriptor(mma::shared_address(v_slots), BLOCK_N * wgmma::kRowBytes, wgmma::kAtomBytes)) {}

  HIPATTN_DEVICE wgmma::u64 key_tile(int i) const { return wgmma::advance(k_descriptor, (i % STAGES) * kSlotBytes); }
  HIPATTN_DEVICE wgmma::u64 value_tile(int i) const { return wgmma::advance(v_descriptor, (i % STAGES) * kSlotBytes); }

  HIPATTN_DEVICE void score_steps(ScoreSteps& q_steps, ScoreSteps& k_steps, int i) const {
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      q_steps[ks] = wgmma::pin(wgmma::advance(q_descriptor, wgmma::k_major_step<BLOCK_M>(ks)));
      k_steps[ks] = wgmma::pin(wgmma::advance(key_tile(i), wgmma::k_major_step<BLOCK_N>(ks)));
    }
  }

  HIPATTN_DEVICE void value_steps(ValueSteps& steps, int i) const {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) steps[kk] = wgmma::pin(wgmma::advance(value_tile(i), 2 * wgmma::kAtomBytes * kk));
  }

  // S = Q Kᵀ into s, one wgmma group, committed and not waited for.
  static HIPATTN_DEVICE void issue_scores(float (&s)[kNTiles][4], const ScoreSteps& q_steps, const ScoreSteps& k_steps) {
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) wgmma::mma_ss<T, BLOCK_N>(s, q_steps[ks], k_steps[ks], ks > 0);
    wgmma::commit();
  }

  // O += P V with P from registers (the m16n8 layout of n-tiles 2kk and 2kk + 1 is the m16k16 A layout
  // of k-step kk), one wgmma group, committed and not waited for.
  static HIPATTN_DEVICE void issue_values(float (&o)[kDTiles][4], const unsigned int (&p_packed)[kNTiles][2],
                                          const ValueSteps& v_steps) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      const unsigned int a[4] = {p_packed[2 * kk][0], p_packed[2 * kk][1], p_packed[2 * kk + 1][0],
                                 p_packed[2 * kk + 1][1]};
      wgmma::mma_rs<T, HEAD_DIM>(o, a, v_steps[kk], 1);
    }
    wgmma::commit();
  }
};

// O's accumulator rows times inv_sum, rounded to T, into the Q tile at the rows of accumulator row g
// (`o_row`, and o_row + 8): once every warp of the warpgroup has read its Q rows for the last time.
template <typename T, int BLOCK_M, int D_TILES>
HIPATTN_DEVICE void stage_output(T* q_tile, const float (&o)[D_TILES][4], const float (&inv_sum)[2], int o_row, int t) {
#pragma unroll
  for (int d = 0; d < D_TILES; ++d)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<unsigned int*>(q_tile + wgmma::swizzled_offset<BLOCK_M>(o_row + 8 * r, 8 * d + 2 * t)) =
          mma::pack2<T>(o[d][2 * r] * inv_sum[r], o[d][2 * r + 1] * inv_sum[r]);
}

// The warpgroup's 64 staged rows (`warpgroup_first` is the first one's row in the sequence) out to O
// with 16-byte stores, rows past the block's left alone: once the whole warpgroup has staged them.
template <typename T, int HEAD_DIM, int BLOCK_M>
HIPATTN_DEVICE void write_output(const FlashForwardParams& p, const ForwardBlock& b, const T* q_tile, int warpgroup,
                                 int warpgroup_first) {
  constexpr int kChunks = HEAD_DIM / 8;
  const int rows = b.row_end - warpgroup_first < 64 ? b.row_end - warpgroup_first : 64;
  T* const o_rows = static_cast<T*>(p.o) + b.batch_index * p.o_batch_stride +
                    static_cast<long long>(b.seq_q.start + warpgroup_first) * p.o_token_stride +
                    b.head * p.o_head_stride;
  for (int c = threadIdx.x % 128; c < 64 * kChunks; c += 128) {
    const int row = c / kChunks;
    const int col = (c % kChunks) * 8;
    if (row < rows)
      *reinterpret_cast<Vec<T, 8>*>(o_rows + row * p.o_token_stride + col) =
          *reinterpret_cast<const Vec<T, 8>*>(q_tile + wgmma::swizzled_offset<BLOCK_M>(64 * warpgroup + row, col));
  }
}

}  // namespace flash
}  // namespace hipattn
