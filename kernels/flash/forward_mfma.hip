// General attention forward on AMD matrix cores (gfx90a, gfx94x; wave64): FlashAttention-2 with
// MFMA 16x16x16, the counterpart of forward_mma.hip.
//
// The algorithm, the grid and every convention are forward_mma.hip's: a block owns BLOCK_M query rows
// of one (sequence, query head), one wave per 16 of them; it walks the visible key tiles last first;
// per tile, scores on the matrix cores (common/score_mods.h turns dot products into scores, with
// any softcap and ALiBi), an online softmax in base 2 on the accumulators, and the
// probabilities reused in registers for the product with V; the keys a row sees are
// common/key_window.h's window, masked scores become -inf by selection, a row that sees no key gets O = 0 and LSE = +inf, and a block
// finds its (query tile, sequence, head) and its keys with the same flash/forward_block.h. What differs is what the hardware forces:
//
// - Transposed products. A wave computes Sᵀ = K Qᵀ and Oᵀ = Vᵀ Pᵀ. With the 16x16x16 layouts
//   (mma_amd.h) a lane then owns one query row, lane % 16, from start to end: four of every 16 of its
//   scores, four of every 16 of its O columns, and its running max and sum. Sᵀ's accumulator is, as
//   it stands, the B operand Pᵀ of the second product (no LDS round trip, no lane permutation); a row
//   reduction is two shuffles over the four lanes that share the row; rescaling O needs none. (Not
//   transposed, the 16x16 accumulator of S does not match the A layout of P V, and O's rows would
//   sit in other lanes than their max and sum.) The 32x32x8 instruction would allow the same trick
//   with 32 rows per wave; 16x16x16 keeps NVIDIA's 16 rows per wave, so both kernels share BLOCK_M
//   granularity and tile reasoning, and a lane's share of a 16-key tile stays 4 scores.
// - Q stays in registers: each lane loads its row's B fragments once from global memory, so LDS holds
//   only the K tile and the transposed V tile.
// - V is staged transposed (Vᵀ: HEAD_DIM rows of BLOCK_N keys), transposed in registers on its way
//   in, so that the A operand of Oᵀ = Vᵀ Pᵀ (4 consecutive keys of one V column) is one 8-byte LDS
//   read: there is no ldmatrix.trans.
// - No cp.async: tiles move global -> registers -> LDS. The loads of V[i] are issued before S of tile
//   i and those of K[i + 1] before the softmax, and are written to LDS after them: FA2's interleaved
//   schedule with one K and one V buffer, the copies overlapping the math through registers.
// - O goes from registers straight to global memory: a lane holds 4 consecutive columns of its row.
#pragma once
#include "common/dropout.h"
#include "common/mma_amd.h"
#include "common/score_mods.h"
#include "flash/forward_block.h"

namespace hipattn {
namespace flash {

// LDS layout of one block, in elements of T: the K tile (BLOCK_N rows of HEAD_DIM), then Vᵀ
// (HEAD_DIM rows of BLOCK_N keys); both pitches are padded by 4 elements (8 bytes). The 16 lanes of a
// quarter read one 8-byte fragment from each of 16 consecutive rows: a pitch of 2 x (odd) 4-byte
// words puts those reads on 16 distinct bank pairs, all 32 banks. The host's row
// (hipattn/catalog/flash_forward.py, FlashForwardMfmaTiles.shared_bytes) computes kBytes from the same
// template arguments with the same formula; the launcher passes that as dynamic shared memory.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
struct MfmaForwardTiles {
  static constexpr int kWaves = BLOCK_M / mfma::kTile;  // one wave per 16 query rows
  static constexpr int kThreads = kWaves * kWarpSize;
  static constexpr int kKPitch = HEAD_DIM + 4;
  static constexpr int kVPitch = BLOCK_N + 4;
  static constexpr int kVOffset = BLOCK_N * kKPitch;
  static constexpr int kElements = kVOffset + HEAD_DIM * kVPitch;
  static constexpr int kBytes = kElements * static_cast<int>(sizeof(T));

  static_assert(sizeof(T) == 2, "the matrix-core path takes 16-bit inputs");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim is a multiple of 16 up to 256");
  static_assert(BLOCK_M % 16 == 0 && BLOCK_M >= 16 && BLOCK_M <= 256, "one wave per 16 query rows, at most 16 waves");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16, "key tiles are whole k-steps of Vᵀ Pᵀ");
  // 64 KiB is a workgroup's LDS limit on gfx90a and gfx94x.
  static_assert(kBytes <= 64 * 1024, "the tiles must fit 64 KiB of LDS");
};

// 16 and 8 bytes as 32-bit words: staged tiles travel as integer vectors, so that a 16-byte load
// stays one instruction (a struct of 16-bit elements gets split into 16-bit loads, one register each).
HIPATTN_VECTOR_TYPEDEF(unsigned int, 4, Words4);
HIPATTN_VECTOR_TYPEDEF(unsigned int, 2, Words2);

// One thread's share of a K tile between its global load and its LDS store: 16-byte pieces, row
// after row. Rows [rows, BLOCK_N) are zeros: their scores are masked, zeros keep them finite.
template <typename T, int HEAD_DIM, int BLOCK_N, int THREADS>
struct KTileStage {
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte pieces of a row
  static constexpr int kTotal = BLOCK_N * kChunks;
  static constexpr int kPieces = (kTotal + THREADS - 1) / THREADS;
  Words4 piece[kPieces];

  HIPATTN_DEVICE void fetch(const T* first_row, long long token_stride, int rows) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * THREADS;
      const int row = c / kChunks;
      piece[i] = Words4{0u, 0u, 0u, 0u};
      if (c < kTotal && row < rows) {
        piece[i] = *reinterpret_cast<const Words4*>(first_row + row * token_stride + (c % kChunks) * 8);
      }
    }
  }

  // Rows are only 8-byte aligned in LDS (pitch HEAD_DIM + 4): two 8-byte stores per piece.
  HIPATTN_DEVICE void put(T* tile, int pitch) const {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * THREADS;
      if (c < kTotal) {
        T* const destination = tile + (c / kChunks) * pitch + (c % kChunks) * 8;
        *reinterpret_cast<Words2*>(destination) = Words2{piece[i][0], piece[i][1]};
        *reinterpret_cast<Words2*>(destination + 4) = Words2{piece[i][2], piece[i][3]};
      }
    }
  }
};

// One thread's share of a V tile, stored transposed: an item is 4 consecutive rows (keys) x 8
// columns, loaded as four 16-byte pieces and written as eight 8-byte Vᵀ pieces (4 keys of one
// column each). The row group varies fastest over the threads, so a wave's LDS stores fill
// consecutive 8-byte slots of each Vᵀ row. Rows [rows, BLOCK_N) are zeros: a stale NaN times a
// probability of 0 would poison O.
template <typename T, int HEAD_DIM, int BLOCK_N, int THREADS>
struct VTileStage {
  static constexpr int kChunks = HEAD_DIM / 8;
  static constexpr int kGroups = BLOCK_N / 4;
  static constexpr int kTotal = kGroups * kChunks;
  static constexpr int kItems = (kTotal + THREADS - 1) / THREADS;
  Words4 rows4[kItems][4];  // [item][key]: columns 2w (low half) and 2w + 1 (high half) in word w

  HIPATTN_DEVICE void fetch(const T* first_row, long long token_stride, int rows) {
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * THREADS;
      const int group = c % kGroups;
      const int chunk = c / kGroups;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = 4 * group + j;
        rows4[i][j] = Words4{0u, 0u, 0u, 0u};
        if (c < kTotal && row < rows) {
          rows4[i][j] = *reinterpret_cast<const Words4*>(first_row + row * token_stride + chunk * 8);
        }
      }
    }
  }

  HIPATTN_DEVICE void put(T* transposed, int pitch) const {
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * THREADS;
      if (c < kTotal) {
        const int group = c % kGroups;
        const int chunk = c / kGroups;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          // Column 2w gathers the low halves of word w of the four keys, column 2w + 1 the high halves.
          const unsigned int k0 = rows4[i][0][w], k1 = rows4[i][1][w], k2 = rows4[i][2][w], k3 = rows4[i][3][w];
          const Words2 even{(k0 & 0xffffu) | (k1 << 16), (k2 & 0xffffu) | (k3 << 16)};
          const Words2 odd{(k0 >> 16) | (k1 & 0xffff0000u), (k2 >> 16) | (k3 & 0xffff0000u)};
          *reinterpret_cast<Words2*>(transposed + (8 * chunk + 2 * w) * pitch + 4 * group) = even;
          *reinterpret_cast<Words2*>(transposed + (8 * chunk + 2 * w + 1) * pitch + 4 * group) = odd;
        }
      }
    }
  }
};

}  // namespace flash

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, bool SCORE_MODS>
__global__ void __launch_bounds__(BLOCK_M / 16 * 64) flash_forward_mfma(const FlashForwardParams p) {
  using Tiles = flash::MfmaForwardTiles<T, HEAD_DIM, BLOCK_M, BLOCK_N>;
  static_assert(kWarpSize == 64, "the MFMA layouts of mma_amd.h are wave64's");
  static_assert(Tiles::kThreads == BLOCK_M / 16 * 64, "__launch_bounds__ above is Tiles::kThreads");
  constexpr int kThreads = Tiles::kThreads;
  constexpr int kDSteps = HEAD_DIM / 16;  // k-steps of Sᵀ = K Qᵀ; 16-column tiles of Oᵀ
  static_assert(kDSteps % 2 == 0, "k-steps run in pairs (mma_amd.h mfma_two_steps)");
  constexpr int kKeySteps = BLOCK_N / 16;  // 16-key tiles of Sᵀ; k-steps of Oᵀ = Vᵀ Pᵀ
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const k_tile = reinterpret_cast<T*>(shared_bytes);
  T* const v_transposed = k_tile + Tiles::kVOffset;

  // ---- which (query tile, sequence, head), and the keys its rows see (flash/forward_block.h) ----
  bool empty;
  const flash::ForwardBlock b = flash::forward_block<T, BLOCK_M, BLOCK_N>(p, blockIdx.x, empty);
  if (empty) return;  // uniform over the block, before any barrier
  const int len_q = b.seq_q.length;
  const int len_k = b.seq_k.length;
  const T* const k_rows = static_cast<const T*>(b.k);
  const T* const v_rows = static_cast<const T*>(b.v);
  // Real rows of the tile starting at key n0 (the first tile walked, the last one, may be partial).
  auto tile_rows = [&](int n0) { return len_k - n0 < BLOCK_N ? len_k - n0 : BLOCK_N; };

  const int wave = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int column = lane % 16;   // this lane's query row among its wave's 16: a column of Sᵀ and Oᵀ
  const int quarter = lane / 16;  // it holds keys (Sᵀ rows) and O columns (Oᵀ rows) 4 quarter .. + 3 of each 16
  const int row = b.m0 + 16 * wave + column;  // within the sequence
  const Scores<SCORE_MODS> scores = scores_of<SCORE_MODS>(p, b.batch_index, b.head);
  const Dropout<SCORE_MODS> dropout = dropout_of<SCORE_MODS>(p, b.batch_index, b.head);
  const int row_diagonal = row + b.diagonal;  // the key a score modifier measures this row's distances from
  // Keys [key_first, key_limit) are visible to this lane's row.
  const int key_first = first_visible_key(row, b.diagonal, b.window, len_k);
  const int key_limit = visible_key_end(row, b.diagonal, b.window, len_k);

  // ---- K of the first tile on its way to LDS; Q's B fragments (Qᵀ, k = head_dim) into registers ----
  flash::KTileStage<T, HEAD_DIM, BLOCK_N, kThreads> k_stage;
  flash::VTileStage<T, HEAD_DIM, BLOCK_N, kThreads> v_stage;
  if (b.n_tiles > 0) {
    const int n0 = (b.tile_end - 1) * BLOCK_N;
    k_stage.fetch(k_rows + n0 * p.k_token_stride, p.k_token_stride, tile_rows(n0));
  }
  // Q rows past the sequence are zeros: they only feed rows that are never stored, but zeros keep
  // every lane's arithmetic finite.
  mfma::Operand q_fragment[kDSteps];
  {
    const T* const q_row = static_cast<const T*>(b.q) + static_cast<long long>(16 * wave + column) * p.q_token_stride;
#pragma unroll
    for (int d = 0; d < kDSteps; ++d) {
      q_fragment[d] = row < len_q ? mfma::load_operand(q_row + 16 * d + 4 * quarter) : mfma::zero_operand();
    }
  }
  if (b.n_tiles > 0) k_stage.put(k_tile, Tiles::kKPitch);

  mfma::Accumulator o[kDSteps];  // Oᵀ: o[d][e] is O[row][16 d + 4 quarter + e]
#pragma unroll
  for (int d = 0; d < kDSteps; ++d) o[d] = mfma::zero_accumulator();
  float row_max = -infinity();  // in the scaled base-2 domain
  float row_sum = 0.0f;         // this lane's share of the row; summed over the quarters at the end

  for (int i = 0; i < b.n_tiles; ++i) {
    const int n0 = (b.tile_end - 1 - i) * BLOCK_N;
    v_stage.fetch(v_rows + n0 * p.v_token_stride, p.v_token_stride, tile_rows(n0));
    __syncthreads();  // K[i] is in LDS for every wave, and every wave is done with Vᵀ[i - 1]

    // ---- Sᵀ = K Qᵀ: BLOCK_N keys x the wave's 16 rows; s[n][e] is S[row][n0 + 16 n + 4 quarter + e] ----
    mfma::Accumulator s[kKeySteps];
#pragma unroll
    for (int n = 0; n < kKeySteps; ++n) s[n] = mfma::zero_accumulator();
#pragma unroll
    for (int d = 0; d < kDSteps; d += 2)
#pragma unroll
      for (int n = 0; n < kKeySteps; ++n) {
        const T* k_row = k_tile + (16 * n + column) * Tiles::kKPitch + 4 * quarter;
        s[n] = mfma::mfma_two_steps<T>(mfma::load_operand(k_row + 16 * d), mfma::load_operand(k_row + 16 * (d + 1)),
                                       q_fragment[d], q_fragment[d + 1], s[n]);
      }

    v_stage.put(v_transposed, Tiles::kVPitch);
    if (i + 1 < b.n_tiles) {
      const int next = n0 - BLOCK_N;
      k_stage.fetch(k_rows + next * p.k_token_stride, p.k_token_stride, tile_rows(next));
    }

    // ---- online softmax, base 2; masked scores become -inf by selection (a NaN from a bad K row is
    // discarded, not multiplied) ----
    if (n0 < b.unmasked_begin || n0 + BLOCK_N > b.unmasked_end) {
#pragma unroll
      for (int n = 0; n < kKeySteps; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + 16 * n + 4 * quarter + e;
          s[n][e] = key >= key_first && key < key_limit ? scores(s[n][e], key - row_diagonal) : -infinity();
        }
    } else if constexpr (SCORE_MODS) {
#pragma unroll
      for (int n = 0; n < kKeySteps; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = scores(s[n][e], n0 + 16 * n + 4 * quarter + e - row_diagonal);
    } else {
      // Plain scores ignore the offset: one multiply of the whole accumulator (packed on gfx90a and later).
#pragma unroll
      for (int n = 0; n < kKeySteps; ++n) s[n] *= scores.scale_log2;
    }
    float tile_max = row_max;
#pragma unroll
    for (int n = 0; n < kKeySteps; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) tile_max = fmaxf(tile_max, s[n][e]);
    // A row's BLOCK_N scores live in its four lanes column + 16 quarter.
    tile_max = fmaxf(tile_max, shfl_xor(tile_max, 16, kWarpSize, group_mask(kWarpSize)));
    tile_max = fmaxf(tile_max, shfl_xor(tile_max, 32, kWarpSize, group_mask(kWarpSize)));
    // A row that has seen nothing yet keeps max -inf; subtracting 0 instead makes every p 0
    // (exp2(-inf) = 0) rather than NaN (-inf - -inf).
    const float reference = tile_max == -infinity() ? 0.0f : tile_max;
    const float correction = fast_exp2(row_max - reference);  // 0 when row_max was -inf
    row_max = tile_max;
    row_sum *= correction;
#pragma unroll
    for (int d = 0; d < kDSteps; ++d) o[d] *= correction;
#pragma unroll
    for (int n = 0; n < kKeySteps; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = fast_exp2(s[n][e] - reference);
        row_sum += s[n][e];
      }
    // Dropout zeroes probabilities after the row sum took them (common/dropout.h): 4 keys per call pair.
    if (dropout.active()) {
#pragma unroll
      for (int n = 0; n < kKeySteps; ++n) {
        const unsigned int kept = dropout.keep_run4(row, n0 + 16 * n + 4 * quarter);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = (kept >> e & 1u) != 0 ? s[n][e] : 0.0f;
      }
    }

    __syncthreads();  // Vᵀ[i] is in LDS for every wave, and every wave is done with K[i]
    if (i + 1 < b.n_tiles) k_stage.put(k_tile, Tiles::kKPitch);

    // ---- Oᵀ += Vᵀ Pᵀ: the accumulator of key tile kk, rounded to T, is the B operand of k-step kk ----
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk) {
      const mfma::Operand p_fragment = mfma::to_operand<T>(s[kk]);
#pragma unroll
      for (int d = 0; d < kDSteps; ++d) {
        const mfma::Operand v_fragment =
            mfma::load_operand(v_transposed + (16 * d + column) * Tiles::kVPitch + 16 * kk + 4 * quarter);
        o[d] = mfma::mfma_16x16x16<T>(v_fragment, p_fragment, o[d]);
      }
    }
  }

  // ---- epilogue: the row's sum over its four lanes, LSE, and O normalised straight to global ----
  row_sum += shfl_xor(row_sum, 16, kWarpSize, group_mask(kWarpSize));
  row_sum += shfl_xor(row_sum, 32, kWarpSize, group_mask(kWarpSize));
  if (row >= len_q) return;  // after the last barrier and shuffle
  float inv_sum, lse;
  finish_row(row_max, row_sum, sink_log2<SCORE_MODS>(p, b.head), inv_sum, lse);
  if (quarter == 0) {
    static_cast<float*>(p.lse)[b.batch_index * p.lse_batch_stride + b.head * p.lse_head_stride + b.seq_q.start + row] =
        lse;
  }
  inv_sum *= dropout.scale();  // with dropout, the kept probabilities' 1 / (1 - dropout_p) too
  T* const o_row = static_cast<T*>(p.o) + b.batch_index * p.o_batch_stride +
                   static_cast<long long>(b.seq_q.start + row) * p.o_token_stride + b.head * p.o_head_stride;
#pragma unroll
  for (int d = 0; d < kDSteps; ++d) mfma::store_operand(o_row + 16 * d + 4 * quarter, mfma::to_operand<T>(o[d] * inv_sum));
}

}  // namespace hipattn
