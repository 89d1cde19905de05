// The flash forwards' masks and final LSE for one warp's 16-row accumulator tile in mma.sync's m16n8
// C-fragment layout (rows g and g + 8, columns 2t and 2t + 1 of each 8-column tile), around the
// online softmax of flash/online_softmax_m16n8.h: shared by the NVIDIA flash forwards (forward_mma.hip:
// mma.sync; forward_wgmma.hip and forward_warp_specialised.hip: Hopper's wgmma, whose accumulators
// have the same per-warp layout).
#pragma once
#include "common/dropout.h"
#include "common/mma_nvidia.h"
#include "flash/forward_block.h"
#include "flash/online_softmax_m16n8.h"

namespace hipattn {
namespace flash {

// The keys accumulator row r (0: row g, 1: row g + 8) of the 16-row tile whose row g is `row_g` (in
// the sequence) sees.
HIPATTN_DEVICE RowKeys row_keys(const ForwardBlock& b, int row_g) {
  RowKeys keys;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    keys.first[r] = first_visible_key(row_g + 8 * r, b.diagonal, b.window, b.seq_k.length);
    keys.end[r] = visible_key_end(row_g + 8 * r, b.diagonal, b.window, b.seq_k.length);
    keys.diagonal[r] = row_g + 8 * r + b.diagonal;
  }
  return keys;
}

// Dropout's keep bits of a warp's 16-row tile (rows row_g and row_g + 8 of the sequence, keys from n0),
// the m16n8 layout common/dropout.h's counters are laid out for: row g's m16n8_bits, then row g + 8's
// from bit 2 N_TILES.
template <int N_TILES, typename Dropout>
HIPATTN_DEVICE unsigned long long keep_bits(const Dropout& dropout, int row_g, int n0, int t) {
  static_assert(N_TILES <= 16, "both rows' keep bits fit one 64-bit word");
  return dropout.template m16n8_bits<N_TILES>(row_g, n0, t) |
         dropout.template m16n8_bits<N_TILES>(row_g + 8, n0, t) << (2 * N_TILES);
}

// Zeroes the dropped probabilities of a warp's 16-row tile of packed P, by keep_bits's bits.
template <int N_TILES>
HIPATTN_DEVICE void drop(unsigned int (&p_packed)[N_TILES][2], unsigned long long bits) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    unsigned int mask[N_TILES];
    m16n8_masks(bits >> (2 * N_TILES * r), mask);
#pragma unroll
    for (int n = 0; n < N_TILES; ++n) p_packed[n][r] &= mask[n];
  }
}

// The end of a warp's 16-row tile: sums each row over its quad, writes LSE (natural log) for the
// block's rows and returns in inv_sum what O's accumulators are multiplied by: 1 / sum (0 for a row
// that saw no key, whose LSE is +inf). With a learnable sink (`sink_log2`, base 2; -inf: none,
// common/sink.h's sink_log2), the sink joins the sum and the LSE, and a row that saw no key
// gets O = 0 and LSE = the sink.
HIPATTN_DEVICE void finish_rows(const FlashForwardParams& p, const ForwardBlock& b, int row_g,
                                const float (&row_max)[2], const float (&row_sum)[2], float (&inv_sum)[2], int t,
                                float sink_log2 = -infinity()) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += shfl_xor(sum, 1, 32, 0xffffffffu);
    sum += shfl_xor(sum, 2, 32, 0xffffffffu);
    float lse;
    finish_row(row_max[r], sum, sink_log2, inv_sum[r], lse);
    const int row = row_g + 8 * r;
    if (t == 0 && row < b.row_end) {
      static_cast<float*>(p.lse)[b.batch_index * p.lse_batch_stride + b.head * p.lse_head_stride +
                                 b.seq_q.start + row] = lse;
    }
  }
}

}  // namespace flash
}  // namespace hipattn
