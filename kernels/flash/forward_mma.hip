// General attention forward on NVIDIA tensor cores (sm_80+): FlashAttention-2 with mma.sync m16n8k16.
//
// A block owns BLOCK_M query rows of one (sequence, query head); each of its BLOCK_M / 16 warps owns
// 16 of those rows from start to end. The block walks the key tiles of BLOCK_N keys that its rows
// can see, last tile first (the tiles that need masking come first; the rest run unmasked). Per tile:
// S = Q Kᵀ on the tensor cores, an online softmax on the accumulators in base 2 (softmax_scale·log2 e
// folded into one multiply), and O += P V with the probabilities reused in registers as the A
// operand (the m16n8 accumulator layout of two adjacent n-tiles is the m16k16 A layout). O stays in
// fp32 registers until the end; LSE is written in fp32.
//
// K and V tiles are staged in shared memory with cp.async through a ring of STAGES slots each,
// interleaved as FlashAttention-2 does: V of a tile loads while S of that tile is computed, K of a
// later tile while P V is. With STAGES = 1 that is FA2's schedule (one K and one V buffer); each
// extra stage lets the copies run one more tile ahead.
//
// Conventions (flash-attn's): causal is bottom-right aligned, query i sees key j when
// j <= i + len_k - len_q; a row that sees no key gets O = 0 and LSE = +inf. Sequence lengths read
// from the device are clamped to the host's max_seqlen and total (sequence_bounds), and the grid
// covers ceil(max_seqlen_q / BLOCK_M) query tiles per (sequence, head): blocks whose tile starts past
// their sequence's real length return at once.
#pragma once
#include "common/mma_nvidia.h"
#include "common/sequence.h"

namespace hipattn {
namespace flash {

// Shared-memory layout of one block, in elements of T: the Q tile, then STAGES K slots, then
// STAGES V slots, each row padded by 8 elements (16 bytes) so the eight row reads of an ldmatrix hit
// distinct banks. hipattn/families.py's flash_forward_shared_bytes computes kBytes from the same
// template arguments with the same formula; the launcher passes that as dynamic shared memory.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES>
struct ForwardTiles {
  static constexpr int kPitch = HEAD_DIM + 8;
  static constexpr int kWarps = BLOCK_M / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kChunks = HEAD_DIM / 8;  // 16-byte pieces of a row
  static constexpr int kQElements = BLOCK_M * kPitch;
  static constexpr int kSlotElements = BLOCK_N * kPitch;
  static constexpr int kKOffset = kQElements;
  static constexpr int kVOffset = kQElements + STAGES * kSlotElements;
  static constexpr int kElements = kQElements + 2 * STAGES * kSlotElements;
  static constexpr int kBytes = kElements * static_cast<int>(sizeof(T));

  static_assert(sizeof(T) == 2, "the tensor-core path takes 16-bit inputs");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim is a multiple of 16 up to 256");
  static_assert(BLOCK_M % 16 == 0 && BLOCK_M >= 16 && BLOCK_M <= 128, "one warp per 16 query rows, at most 8 warps");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16, "key tiles are whole k-steps of P V");
  static_assert(STAGES >= 1 && STAGES <= 3, "one to three K/V slots");
  // 99 KiB is the opt-in limit of the smallest sm_80+ parts (sm_86, sm_89); every shipped tile
  // fits it, so one table serves every NVIDIA target.
  static_assert(kBytes <= 99 * 1024, "the tiles must fit 99 KiB of shared memory");
};

// Copy rows [0, rows) of a BLOCK_N- or BLOCK_M-row tile with cp.async; rows [rows, tile_rows) are
// zero-filled when ZERO_TAIL (V: a stale NaN times a probability of 0 would poison O) and left
// alone otherwise (K, Q: their rows only reach scores that are masked or rows that are never stored).
template <typename T, int HEAD_DIM, int THREADS, bool ZERO_TAIL>
HIPATTN_DEVICE void stage_tile(T* tile, const T* first_row, long long token_stride, int rows, int tile_rows) {
  constexpr int kChunks = HEAD_DIM / 8;
  constexpr int kPitch = HEAD_DIM + 8;
  const int limit = ZERO_TAIL ? tile_rows : rows;
  for (int c = threadIdx.x; c < limit * kChunks; c += THREADS) {
    const int row = c / kChunks;
    const int chunk = c % kChunks;
    T* destination = tile + row * kPitch + chunk * 8;
    if (row < rows) {
      mma::copy_async_16(destination, first_row + row * token_stride + chunk * 8);
    } else {
      *reinterpret_cast<Vec<T, 8>*>(destination) = Vec<T, 8>{};
    }
  }
}

}  // namespace flash

template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int STAGES>
__global__ void __launch_bounds__(BLOCK_M * 2) flash_forward_mma(const FlashForwardParams p) {
  using Tiles = flash::ForwardTiles<T, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES>;
  constexpr int kThreads = Tiles::kThreads;
  constexpr int kPitch = Tiles::kPitch;
  constexpr int kNTiles = BLOCK_N / 8;    // 8-key accumulator tiles of S
  constexpr int kDTiles = HEAD_DIM / 8;   // 8-column accumulator tiles of O
  // Every async-copy group is committed in the same order by every thread: Q+K[0], then V[0], K[1],
  // V[1], ... (empty groups past the last tile). Waiting for K[n] or V[n] leaves the newest
  // 2 STAGES - 2 groups in flight.
  constexpr int kInFlight = 2 * STAGES - 2;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);

  // ---- which (query tile, sequence, head): the query tile varies fastest, heaviest (last) first ----
  const int m_blocks = (p.max_seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const unsigned int problem = blockIdx.x / static_cast<unsigned int>(m_blocks);
  const int m_block = m_blocks - 1 - static_cast<int>(blockIdx.x % static_cast<unsigned int>(m_blocks));
  const int head = static_cast<int>(problem % static_cast<unsigned int>(p.heads_q));
  const int batch_index = static_cast<int>(problem / static_cast<unsigned int>(p.heads_q));
  const int head_kv = head / (p.heads_q / p.heads_kv);

  const Sequence seq_q = sequence_bounds(static_cast<const int*>(p.cu_seqlens_q),
                                         static_cast<const int*>(p.seqused_q), batch_index, p.max_seqlen_q,
                                         p.total_q, p.max_seqlen_q);
  const Sequence seq_k = sequence_bounds(static_cast<const int*>(p.cu_seqlens_k),
                                         static_cast<const int*>(p.seqused_k), batch_index, p.max_seqlen_k,
                                         p.total_k, p.max_seqlen_k);
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;
  const int m0 = m_block * BLOCK_M;
  if (m0 >= len_q) return;  // uniform over the block, before any barrier

  // Keys this block's stored rows can see: [0, key_end). Causal: its last row, row_end - 1, sees keys
  // up to row_end - 1 + len_k - len_q.
  const int diagonal = len_k - len_q;  // query i sees key j <= i + diagonal when causal
  const int row_end = len_q < m0 + BLOCK_M ? len_q : m0 + BLOCK_M;
  int key_end = len_k;
  if (p.causal) key_end = clamp_int(row_end + diagonal, 0, len_k);
  const int n_tiles = (key_end + BLOCK_N - 1) / BLOCK_N;

  const T* const q_rows = static_cast<const T*>(p.q) + batch_index * p.q_batch_stride +
                          static_cast<long long>(seq_q.start + m0) * p.q_token_stride + head * p.q_head_stride;
  const T* const k_rows = static_cast<const T*>(p.k) + batch_index * p.k_batch_stride +
                          static_cast<long long>(seq_k.start) * p.k_token_stride + head_kv * p.k_head_stride;
  const T* const v_rows = static_cast<const T*>(p.v) + batch_index * p.v_batch_stride +
                          static_cast<long long>(seq_k.start) * p.v_token_stride + head_kv * p.v_head_stride;
  T* const q_tile = shared;
  T* const k_slots = shared + Tiles::kKOffset;
  T* const v_slots = shared + Tiles::kVOffset;

  // Iteration i handles key tile n_tiles - 1 - i; these issue its K or V copies (or nothing past
  // the last iteration) and always commit, so that the group count stays uniform.
  auto load_k = [&](int i) {
    if (i < n_tiles) {
      const int n0 = (n_tiles - 1 - i) * BLOCK_N;
      const int rows = len_k - n0 < BLOCK_N ? len_k - n0 : BLOCK_N;
      flash::stage_tile<T, HEAD_DIM, kThreads, false>(k_slots + (i % STAGES) * Tiles::kSlotElements,
                                                      k_rows + n0 * p.k_token_stride, p.k_token_stride, rows,
                                                      BLOCK_N);
    }
    mma::commit_async_copies();
  };
  auto load_v = [&](int i) {
    if (i < n_tiles) {
      const int n0 = (n_tiles - 1 - i) * BLOCK_N;
      const int rows = len_k - n0 < BLOCK_N ? len_k - n0 : BLOCK_N;
      flash::stage_tile<T, HEAD_DIM, kThreads, true>(v_slots + (i % STAGES) * Tiles::kSlotElements,
                                                     v_rows + n0 * p.v_token_stride, p.v_token_stride, rows,
                                                     BLOCK_N);
    }
    mma::commit_async_copies();
  };

  // ---- prologue: Q with K of the first tile, then V/K pairs up to the ring's depth ----
  {
    const int rows = len_q - m0 < BLOCK_M ? len_q - m0 : BLOCK_M;
    // Q rows past the sequence are zeroed: they only feed rows that are never stored, but zeros keep
    // every lane's arithmetic finite.
    flash::stage_tile<T, HEAD_DIM, kThreads, true>(q_tile, q_rows, p.q_token_stride, rows, BLOCK_M);
  }
  load_k(0);
#pragma unroll
  for (int s = 0; s + 1 < STAGES; ++s) {
    load_v(s);
    load_k(s + 1);
  }

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // accumulator rows g and g + 8 of the warp's 16
  const int t = lane % 4;  // accumulator column pair 2t, 2t + 1 of each 8-column tile
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  // Per accumulator row r (g, g + 8): keys [0, key_limit[r]) are visible to it.
  int key_limit[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = m0 + 16 * warp + g + 8 * r;
    key_limit[r] = p.causal ? clamp_int(row + diagonal + 1, 0, len_k) : len_k;
  }
  // A tile needs masking when it reaches past the sequence or past the first row's diagonal.
  const int unmasked_end = p.causal ? clamp_int(m0 + diagonal + 1, 0, len_k) : len_k;

  float o[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float row_max[2] = {-infinity(), -infinity()};  // in the scaled base-2 domain
  float row_sum[2] = {0.0f, 0.0f};                // this lane's share of the row; summed at the end

  const T* const q_warp = q_tile + 16 * warp * kPitch;
  for (int i = 0; i < n_tiles; ++i) {
    const int n0 = (n_tiles - 1 - i) * BLOCK_N;
    const T* const k_tile = k_slots + (i % STAGES) * Tiles::kSlotElements;
    const T* const v_tile = v_slots + (i % STAGES) * Tiles::kSlotElements;

    mma::wait_async_copies_except<kInFlight>();  // K[i] (and Q) have landed for this thread
    __syncthreads();                             // ... for every thread; V[i - 1]'s slot is free
    load_v(i + STAGES - 1);

    // ---- S = Q Kᵀ: 16 rows x BLOCK_N keys per warp ----
    float s[kNTiles][4];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      unsigned int a[4];
      mma::ldmatrix_x4(a, q_warp + (lane % 16) * kPitch + 16 * ks + 8 * (lane / 16));
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        unsigned int b[4];
        mma::ldmatrix_x4(b, k_tile + (16 * np + 8 * (lane / 16) + lane % 8) * kPitch + 16 * ks + 8 * ((lane / 8) % 2));
        mma::mma_16816<T>(s[2 * np], a, b[0], b[1]);
        mma::mma_16816<T>(s[2 * np + 1], a, b[2], b[3]);
      }
    }

    // ---- online softmax, base 2; masked scores become -inf by selection (a NaN from a stale K
    // row is discarded, not multiplied) ----
    if (n0 + BLOCK_N > unmasked_end) {
#pragma unroll
      for (int n = 0; n < kNTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + 8 * n + 2 * t + (e & 1);
          s[n][e] = key < key_limit[e / 2] ? s[n][e] * scale_log2 : -infinity();
        }
    } else {
#pragma unroll
      for (int n = 0; n < kNTiles; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
    }
    float tile_max[2] = {row_max[0], row_max[1]};
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
    float reference[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // A row's BLOCK_N scores live in the 4 lanes of one quad.
      tile_max[r] = fmaxf(tile_max[r], shfl_xor(tile_max[r], 1, 32, 0xffffffffu));
      tile_max[r] = fmaxf(tile_max[r], shfl_xor(tile_max[r], 2, 32, 0xffffffffu));
      // A row that has seen nothing yet keeps max -inf; subtracting 0 instead makes every p 0
      // (exp2(-inf) = 0) rather than NaN (-inf - -inf).
      reference[r] = tile_max[r] == -infinity() ? 0.0f : tile_max[r];
      const float correction = fast_exp2(row_max[r] - reference[r]);  // 0 when row_max was -inf
      row_max[r] = tile_max[r];
      row_sum[r] *= correction;
#pragma unroll
      for (int d = 0; d < kDTiles; ++d) {
        o[d][2 * r] *= correction;
        o[d][2 * r + 1] *= correction;
      }
    }
#pragma unroll
    for (int n = 0; n < kNTiles; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = fast_exp2(s[n][e] - reference[e / 2]);
        row_sum[e / 2] += s[n][e];
      }

    mma::wait_async_copies_except<kInFlight>();  // V[i] has landed for this thread
    __syncthreads();                             // ... for every thread; K[i]'s slot is free
    load_k(i + STAGES);

    // ---- O += P V: n-tiles 2 kk and 2 kk + 1 of P are the A operand of k-step kk ----
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      unsigned int pa[4];
      pa[0] = mma::pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = mma::pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = mma::pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = mma::pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
        unsigned int b[4];
        mma::ldmatrix_x4_trans(b, v_tile + (16 * kk + lane % 8 + 8 * ((lane / 8) % 2)) * kPitch + 16 * dp +
                                      8 * (lane / 16));
        mma::mma_16816<T>(o[2 * dp], pa, b[0], b[1]);
        mma::mma_16816<T>(o[2 * dp + 1], pa, b[2], b[3]);
      }
    }
  }
  // Every thread's copies have landed, and (the barrier) every other thread's too: with no key tile
  // at all, another warp's copy of this warp's Q rows could otherwise land over its staged O.
  mma::wait_async_copies();
  __syncthreads();

  // ---- epilogue: normalise, LSE, and O through the warp's own Q rows (only this warp read them) ----
  float inv_sum[2];
  const int row0 = m0 + 16 * warp + g;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += shfl_xor(row_sum[r], 1, 32, 0xffffffffu);
    row_sum[r] += shfl_xor(row_sum[r], 2, 32, 0xffffffffu);
    inv_sum[r] = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    const int row = row0 + 8 * r;
    if (t == 0 && row < len_q) {
      static_cast<float*>(p.lse)[batch_index * p.lse_batch_stride + head * p.lse_head_stride + seq_q.start + row] =
          row_sum[r] > 0.0f ? (row_max[r] + fast_log2(row_sum[r])) * 0.6931471805599453f : infinity();
    }
  }
  T* const o_stage = const_cast<T*>(q_warp);
  __syncwarp();
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      *reinterpret_cast<unsigned int*>(o_stage + (g + 8 * r) * kPitch + 8 * d + 2 * t) =
          mma::pack2<T>(o[d][2 * r] * inv_sum[r], o[d][2 * r + 1] * inv_sum[r]);
    }
  __syncwarp();
  const int warp_first = m0 + 16 * warp;
  const int rows = len_q - warp_first < 16 ? len_q - warp_first : 16;
  T* const o_rows = static_cast<T*>(p.o) + batch_index * p.o_batch_stride +
                    static_cast<long long>(seq_q.start + warp_first) * p.o_token_stride + head * p.o_head_stride;
  for (int c = lane; c < rows * Tiles::kChunks; c += 32) {
    const int r = c / Tiles::kChunks;
    const int chunk = c % Tiles::kChunks;
    *reinterpret_cast<Vec<T, 8>*>(o_rows + r * p.o_token_stride + chunk * 8) =
        *reinterpret_cast<const Vec<T, 8>*>(o_stage + r * kPitch + chunk * 8);
  }
}

}  // namespace hipattn
