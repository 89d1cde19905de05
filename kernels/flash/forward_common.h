// What the NVIDIA flash forwards (forward_mma.hip: mma.sync; forward_wgmma.hip: Hopper's wgmma)
// share: which (query tile, sequence, head) a block owns and which keys it visits, the online
// softmax of one warp's 16-row accumulator tile, and the final LSE of its rows. Both kernels hold S
// and O in the same per-warp layout (mma.sync's m16n8 C fragment: rows g and g + 8, columns 2t and
// 2t + 1 of each 8-column tile), so these helpers serve both.
//
// Conventions (flash-attn's): causal is bottom-right aligned, query i sees key j when
// j <= i + len_k - len_q; a row that sees no key gets O = 0 and LSE = +inf. Sequence lengths read
// from the device are clamped to the host's max_seqlen and total (sequence_bounds), and the grid
// covers ceil(max_seqlen_q / BLOCK_M) query tiles per (sequence, head): blocks whose tile lies past
// their sequence's real length return at once. Key tiles are visited last first: the tiles that need
// masking come first, the rest run unmasked.
#pragma once
#include "common/mma_nvidia.h"
#include "common/sequence.h"

namespace hipattn {
namespace flash {

struct ForwardBlock {
  int batch_index, head, head_kv;
  Sequence seq_q, seq_k;
  int m0;            // the block's first query row in its sequence
  int row_end;       // one past its last: the block computes and stores rows [m0, row_end)
  int diagonal;      // query i sees key j <= i + diagonal when causal
  int n_tiles;       // key tiles of BLOCK_N the block's rows can see
  int unmasked_end;  // key tiles ending at or before this need no mask
  const void* q;     // row m0 of Q, and row 0 of K and V, for this (sequence, head)
  const void* k;
  const void* v;
};

// The block's problem: the query tile varies fastest over blockIdx.x, heaviest (last) first.
// `empty` blocks (tile past the sequence's length) return before any barrier.
//
// Tiles are counted from the sequence's start, or with END_ALIGNED from its end, so that a partial
// tile (len_q not a multiple of BLOCK_M) holds the first rows rather than the last. Its cost is then
// the keys its own rows see: under a causal mask one key tile instead of the most of any tile (at
// S = 1024 and 192-row tiles, a third of the causal work went to such padding), and without a mask
// the same.
template <typename T, int BLOCK_M, int BLOCK_N, bool END_ALIGNED = false>
HIPATTN_DEVICE ForwardBlock forward_block(const FlashForwardParams& p, bool& empty) {
  ForwardBlock b;
  const int m_blocks = (p.max_seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const unsigned int problem = blockIdx.x / static_cast<unsigned int>(m_blocks);
  const int from_last = static_cast<int>(blockIdx.x % static_cast<unsigned int>(m_blocks));  // 0: the last rows
  b.head = static_cast<int>(problem % static_cast<unsigned int>(p.heads_q));
  b.batch_index = static_cast<int>(problem / static_cast<unsigned int>(p.heads_q));
  b.head_kv = b.head / (p.heads_q / p.heads_kv);
  b.seq_q = sequence_bounds(static_cast<const int*>(p.cu_seqlens_q), static_cast<const int*>(p.seqused_q),
                            b.batch_index, p.max_seqlen_q, p.total_q, p.max_seqlen_q);
  b.seq_k = sequence_bounds(static_cast<const int*>(p.cu_seqlens_k), static_cast<const int*>(p.seqused_k),
                            b.batch_index, p.max_seqlen_k, p.total_k, p.max_seqlen_k);
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
  // Keys the block's stored rows can see: [0, key_end). Causal: its last row, row_end - 1, sees keys
  // up to row_end - 1 + diagonal.
  b.diagonal = len_k - len_q;
  const int key_end = p.causal ? clamp_int(b.row_end + b.diagonal, 0, len_k) : len_k;
  b.n_tiles = (key_end + BLOCK_N - 1) / BLOCK_N;
  // A tile needs masking when it reaches past the sequence or past the first row's diagonal.
  b.unmasked_end = p.causal ? clamp_int(b.m0 + b.diagonal + 1, 0, len_k) : len_k;
  b.q = static_cast<const T*>(p.q) + b.batch_index * p.q_batch_stride +
        static_cast<long long>(b.seq_q.start + b.m0) * p.q_token_stride + b.head * p.q_head_stride;
  b.k = static_cast<const T*>(p.k) + b.batch_index * p.k_batch_stride +
        static_cast<long long>(b.seq_k.start) * p.k_token_stride + b.head_kv * p.k_head_stride;
  b.v = static_cast<const T*>(p.v) + b.batch_index * p.v_batch_stride +
        static_cast<long long>(b.seq_k.start) * p.v_token_stride + b.head_kv * p.v_head_stride;
  return b;
}

// Keys [0, key_limit[r]) are visible to accumulator row r (0: row g, 1: row g + 8) of the 16-row
// tile whose row g is `row_g` (in the sequence).
HIPATTN_DEVICE void key_limits(const FlashForwardParams& p, const ForwardBlock& b, int row_g, int (&key_limit)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
    key_limit[r] = p.causal ? clamp_int(row_g + 8 * r + b.diagonal + 1, 0, b.seq_k.length) : b.seq_k.length;
}

// One key tile's online softmax for a warp's 16-row tile, in base 2 (softmax_scale·log2 e folded into
// `scale_log2`): masks (masked scores become -inf by selection: a NaN from a stale K row is discarded,
// not multiplied), moves the running max, rescales the running sums, and returns P rounded to T as the
// A operand of P V (the m16n8 layout of n-tiles 2kk and 2kk + 1 is the m16k16 A layout of k-step kk)
// and the factor O's rows must be multiplied by (rescale), which the caller applies once no tensor-core
// product into O is in flight. row_sum is this lane's share of its rows' sums.
template <typename T, int N_TILES>
HIPATTN_DEVICE void online_softmax(float (&s)[N_TILES][4], float (&row_max)[2], float (&row_sum)[2],
                                   unsigned int (&p_packed)[N_TILES][2], float (&correction)[2], bool masked, int n0,
                                   const int (&key_limit)[2], float scale_log2, int t) {
  if (masked) {
#pragma unroll
    for (int n = 0; n < N_TILES; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = n0 + 8 * n + 2 * t + (e & 1);
        s[n][e] = key < key_limit[e / 2] ? s[n][e] * scale_log2 : -infinity();
      }
  } else {
#pragma unroll
    for (int n = 0; n < N_TILES; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
  }
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

// The end of a warp's 16-row tile: sums each row over its quad, writes LSE (natural log) for the
// block's rows and returns 1 / sum in inv_sum (0 for a row that saw no key, whose LSE is +inf).
HIPATTN_DEVICE void finish_rows(const FlashForwardParams& p, const ForwardBlock& b, int row_g,
                                const float (&row_max)[2], const float (&row_sum)[2], float (&inv_sum)[2], int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += shfl_xor(sum, 1, 32, 0xffffffffu);
    sum += shfl_xor(sum, 2, 32, 0xffffffffu);
    inv_sum[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int row = row_g + 8 * r;
    if (t == 0 && row < b.row_end) {
      static_cast<float*>(p.lse)[b.batch_index * p.lse_batch_stride + b.head * p.lse_head_stride +
                                 b.seq_q.start + row] =
          sum > 0.0f ? (row_max[r] + fast_log2(sum)) * 0.6931471805599453f : infinity();
    }
  }
}

}  // namespace flash
}  // namespace hipattn
