// Which entries of a backward key block's transposed tile a row of queries sees, as a word of bits:
// the mask rule of common/key_window.h, formed before a tile's products are issued, while the scores
// hold no registers, and applied after its exponentials, which then run straight-line in every tile.
//
// A lane of an m16n8 accumulator tile with keys as rows and queries as columns holds, per 8-query
// tile n, entries e = 0..3: key `key` + c_k and query m0 + 2t + c_q, with c_k = 8 (e / 2) and
// c_q = 8 n + (e & 1). Entry (n, e) is bit 4 n + e, as the dropout keep bits of the same layout
// (Dropout::transposed_m16n8_bits), so that m16n8_masks spreads either into packed-pair masks.
#pragma once
#include "common/key_window.h"

namespace hipattn {

// Each test compares the entry's compile-time offsets with bounds formed once per lane, in 32 bits.
// A window side may be as wide as any sequence, so the window's range of c_k - c_q is clamped to one
// that no offset reaches (|c_k - c_q| < 8 Q_TILES).
template <typename Bits, int Q_TILES>
HIPATTN_DEVICE Bits transposed_visible_bits(int key, int m0, int t, int len_q, int len_k, int diagonal,
                                            KeyWindow window) {
  static_assert(4 * Q_TILES <= 8 * static_cast<int>(sizeof(Bits)), "four bits per query tile fit the word");
  const int queries_left = len_q - m0 - 2 * t;  // visible: c_q < queries_left
  const int keys_left = len_k - key;            // visible: c_k < keys_left
  // In the window: -left <= key + c_k - query - c_q - diagonal <= right.
  const long long from_diagonal = static_cast<long long>(key) - m0 - 2 * t - diagonal;
  auto clamped = [](long long x) {
    return static_cast<int>(x < -(1ll << 30) ? -(1ll << 30) : x > (1ll << 30) ? (1ll << 30) : x);
  };
  const int lowest = clamped(-static_cast<long long>(window.left) - from_diagonal);
  const int highest = clamped(static_cast<long long>(window.right) - from_diagonal);
  Bits bits = 0;
#pragma unroll
  for (int n = 0; n < Q_TILES; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c_q = 8 * n + (e & 1);
      const int c_k = 8 * (e / 2);
      const bool visible = c_q < queries_left && c_k < keys_left && c_k - c_q >= lowest && c_k - c_q <= highest;
      bits |= static_cast<Bits>(visible ? 1u : 0u) << (4 * n + e);
    }
  return bits;
}

}  // namespace hipattn
