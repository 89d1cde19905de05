// The online softmax of one warp's 16-row accumulator tile in mma.sync's m16n8 C-fragment layout (rows
// g and g + 8, columns 2t and 2t + 1 of each 8-column tile, g = lane / 4, t = lane % 4), independent of
// any kernel's parameters: the flash forwards (flash/softmax_m16n8.h adds their masks and LSE) and the
// tensor-core decode kernel (decode/forward_mma.hip) share it.
#pragma once
#include "common/mma_nvidia.h"
#include "common/score_mods.h"

namespace hipattn {
namespace flash {

// One key tile's online softmax for a warp's 16-row tile, in base 2: turns the dot products into
// scores (`scores`, common/score_mods.h: softmax_scale·log2 e and any score modifiers), masks (masked
// scores become -inf by selection: a NaN from a stale K row is discarded, not multiplied), moves the
// running max, rescales the running sums, and returns P rounded to T as the A operand of P V (the
// m16n8 layout of n-tiles 2kk and 2kk + 1 is the m16k16 A layout of k-step kk) and the factor O's rows
// must be multiplied by (rescale), which the caller applies once no tensor-core product into O is in
// flight. row_sum is this lane's share of its rows' sums.
// The keys [first[r], end[r]) accumulator row r (0: row g, 1: row g + 8) sees, and the key on its
// diagonal (row + len_k - len_q), from which a score modifier measures a key's distance.
struct RowKeys {
  int first[2];
  int end[2];
  int diagonal[2];
};

// A tile's dot products turned into scores, masked by selection (online_softmax's first step): a
// functor rather than a generic lambda, which some NVRTC versions take for host code, so that
// Scores::visit can call it with the softcap's presence fixed at compile time.
template <int N_TILES>
struct TileScores {
  float (&s)[N_TILES][4];
  bool masked;
  int n0;
  const RowKeys& keys;
  int t;

  template <typename Score>
  HIPATTN_DEVICE void operator()(const Score& score) const {
    // Key n0 + 8n + 2t + (e & 1)'s offset from row r's diagonal: a base per row plus constants.
    const float base[2] = {static_cast<float>(n0 + 2 * t - keys.diagonal[0]),
                           static_cast<float>(n0 + 2 * t - keys.diagonal[1])};
    if (masked) {
#pragma unroll
      for (int n = 0; n < N_TILES; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + 8 * n + 2 * t + (e & 1);
          s[n][e] = key >= keys.first[e / 2] && key < keys.end[e / 2]
                        ? score(s[n][e], base[e / 2] + static_cast<float>(8 * n + (e & 1)))
                        : -infinity();
        }
    } else {
#pragma unroll
      for (int n = 0; n < N_TILES; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = score(s[n][e], base[e / 2] + static_cast<float>(8 * n + (e & 1)));
    }
  }
};

template <typename T, int N_TILES, typename Scores>
HIPATTN_DEVICE void online_softmax(float (&s)[N_TILES][4], float (&row_max)[2], float (&row_sum)[2],
                                   unsigned int (&p_packed)[N_TILES][2], float (&correction)[2], bool masked, int n0,
                                   const RowKeys& keys, const Scores& scores, int t) {
  scores.visit(TileScores<N_TILES>{s, masked, n0, keys, t});
  float tile_max[2] = {row_max[0], row_max[1]};
#pragma unroll
  for (int n = 0; n < N_TILES; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
  float reference[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // A row's scores live in the 4 lanes of one quad.
    tile_max[r] = fmaxf(tile_max[r], shfl_xor(tile_max[r], 1, 32, 0xffffffffu));
    tile_max[r] = fmaxf(tile_max[r], shfl_xor(tile_max[r], 2, 32, 0xffffffffu));
    // A row that has seen nothing yet keeps max -inf; subtracting 0 instead makes every p 0
    // (exp2(-inf) = 0) rather than NaN (-inf - -inf).
    reference[r] = tile_max[r] == -infinity() ? 0.0f : tile_max[r];
    correction[r] = fast_exp2(row_max[r] - reference[r]);  // 0 when row_max was -inf
    row_max[r] = tile_max[r];
    row_sum[r] *= correction[r];
  }
#pragma unroll
  for (int n = 0; n < N_TILES; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = fast_exp2(s[n][e] - reference[e / 2]);
      row_sum[e / 2] += s[n][e];
    }
    // Rounded to T at once: P lives on as half as many registers until P V.
    p_packed[n][0] = mma::pack2<T>(s[n][0], s[n][1]);  // row g
    p_packed[n][1] = mma::pack2<T>(s[n][2], s[n][3]);  // row g + 8
  }
}

// O's accumulator rows times the online softmax's correction factors.
template <int D_TILES>
HIPATTN_DEVICE void rescale(float (&o)[D_TILES][4], const float (&correction)[2]) {
#pragma unroll
  for (int d = 0; d < D_TILES; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[d][e] *= correction[e / 2];
}

}  // namespace flash
}  // namespace hipattn
