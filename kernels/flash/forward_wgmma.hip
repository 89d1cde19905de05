// General attention forward on Hopper's warpgroup tensor cores (sm_90a): FlashAttention-2's algorithm
// with wgmma.mma_async in place of mma.sync.
//
// A block owns BLOCK_M = 64 * WARPGROUPS query rows of one (sequence, query head); each warpgroup owns
// 64 of them. Per key tile of BLOCK_N keys: S = Q Kᵀ with both operands read by the tensor cores
// straight from shared memory (no ldmatrix: the register file and the load pipe that limited the
// mma.sync kernel stay free), the online softmax on the accumulators (flash/forward_common.h, the same
// code as the mma.sync forward: a wgmma accumulator holds each warp's 16 rows in mma.sync's layout),
// and O += P V with P from registers and V read from shared memory transposed by the tensor cores.
//
// K and V are staged with cp.async through a ring of STAGES slots each, interleaved as in the mma.sync
// forward: V of a tile loads while S of that tile is computed and its softmax runs, K of a later tile
// while P V runs; each stage past the first lets the copies run one more tile ahead.
// Shared tiles are in wgmma's interleaved core-matrix layout (common/wgmma_nvidia.h), written one
// 16-byte chunk per cp.async in address order, so neither the copies nor the tensor cores' reads
// conflict on banks. Two or three blocks share a multiprocessor, so one block's softmax overlaps
// another's matrix products.
#pragma once
#include "common/wgmma_nvidia.h"
#include "flash/forward_common.h"

namespace hipattn {
namespace flash {

// Shared-memory layout of one block, in elements of T: the Q tile (BLOCK_M rows), STAGES K slots and
// STAGES V slots (BLOCK_N rows each), every tile in the core layout. hipattn/families.py's
// flash_forward_wgmma_shared_bytes computes kBytes from the same template arguments.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES>
struct WgmmaForwardTiles {
  static constexpr int kBlockM = 64 * WARPGROUPS;
  static constexpr int kThreads = 128 * WARPGROUPS;
  static constexpr int kQElements = kBlockM * HEAD_DIM;
  static constexpr int kSlotElements = BLOCK_N * HEAD_DIM;
  static constexpr int kKOffset = kQElements;
  static constexpr int kVOffset = kQElements + STAGES * kSlotElements;
  static constexpr int kElements = kQElements + 2 * STAGES * kSlotElements;
  static constexpr int kBytes = kElements * static_cast<int>(sizeof(T));

  static_assert(sizeof(T) == 2, "the tensor-core path takes 16-bit inputs");
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 96 || HEAD_DIM == 128 || HEAD_DIM == 256,
                "O is one wgmma's N: 64, 96, 128 or 256 (common/wgmma_nvidia.h's shapes)");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "S is one wgmma's N: 64 or 128 keys");
  static_assert(WARPGROUPS >= 1 && WARPGROUPS <= 2, "one or two warpgroups");
  static_assert(STAGES >= 1 && STAGES <= 3, "one to three K/V slots");
  static_assert(kBytes <= 227 * 1024, "the tiles must fit sm_90's 227 KiB of shared memory");
};

// Copy rows [0, rows) of a tile of tile_rows rows into the core layout with cp.async; rows past `rows`
// are zero-filled when ZERO_TAIL (V, Q: their products must stay finite) and left alone otherwise (K:
// their scores are masked by selection). Chunk c (16 bytes) lands at byte 16 c: consecutive threads
// fill consecutive 16-byte slots, eight rows of one column chunk per 128-byte core matrix.
template <typename T, int HEAD_DIM, int THREADS, bool ZERO_TAIL>
HIPATTN_DEVICE void stage_core_tile(T* tile, const T* first_row, long long token_stride, int rows, int tile_rows) {
  constexpr int kChunks = HEAD_DIM / 8;  // 16-byte chunks per row
  for (int c = threadIdx.x; c < tile_rows * kChunks; c += THREADS) {
    const int row = (c / (8 * kChunks)) * 8 + c % 8;
    const int chunk = (c / 8) % kChunks;
    T* const destination = tile + 8 * c;
    if (row < rows) {
      mma::copy_async_16(destination, first_row + row * token_stride + chunk * 8);
    } else if (ZERO_TAIL) {
      *reinterpret_cast<Vec<T, 8>*>(destination) = Vec<T, 8>{};
    }
  }
}

}  // namespace flash

template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES>
__global__ void __launch_bounds__(128 * WARPGROUPS) flash_forward_wgmma(const FlashForwardParams p) {
  using Tiles = flash::WgmmaForwardTiles<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES>;
  constexpr int kBlockM = Tiles::kBlockM;
  constexpr int kThreads = Tiles::kThreads;
  constexpr int kNTiles = BLOCK_N / 8;   // 8-key accumulator tiles of S
  constexpr int kDTiles = HEAD_DIM / 8;  // 8-column accumulator tiles of O
  constexpr int kRowBlock = wgmma::kRowBlockBytes<HEAD_DIM>;
  // Every async-copy group is committed in the same order by every thread: Q+K[0], then V[0], K[1],
  // V[1], ... (empty groups past the last tile). Waiting for K[n] or V[n] leaves the newest
  // 2 STAGES - 2 groups in flight.
  constexpr int kInFlight = 2 * STAGES - 2;
  extern __shared__ __align__(128) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);

  bool empty;
  const flash::ForwardBlock b = flash::forward_block<T, kBlockM, BLOCK_N>(p, empty);
  if (empty) return;  // uniform over the block, before any barrier
  const int len_k = b.seq_k.length;
  T* const q_tile = shared;
  T* const k_slots = shared + Tiles::kKOffset;
  T* const v_slots = shared + Tiles::kVOffset;

  // Iteration i handles key tile n_tiles - 1 - i; these issue its K or V copies (or nothing past the
  // last iteration) and always commit, so that every thread's group count stays the same.
  auto tile_rows = [&](int i) {
    const int n0 = (b.n_tiles - 1 - i) * BLOCK_N;
    return len_k - n0 < BLOCK_N ? len_k - n0 : BLOCK_N;
  };
  auto load_k = [&](int i) {
    if (i < b.n_tiles)
      flash::stage_core_tile<T, HEAD_DIM, kThreads, false>(
          k_slots + (i % STAGES) * Tiles::kSlotElements, static_cast<const T*>(b.k) + (b.n_tiles - 1 - i) * BLOCK_N * p.k_token_stride, p.k_token_stride,
          tile_rows(i), BLOCK_N);
    mma::commit_async_copies();
  };
  auto load_v = [&](int i) {
    if (i < b.n_tiles)
      flash::stage_core_tile<T, HEAD_DIM, kThreads, true>(
          v_slots + (i % STAGES) * Tiles::kSlotElements, static_cast<const T*>(b.v) + (b.n_tiles - 1 - i) * BLOCK_N * p.v_token_stride, p.v_token_stride,
          tile_rows(i), BLOCK_N);
    mma::commit_async_copies();
  };

  {
    // Q rows past the sequence are zeroed: they only feed rows that are never stored, but zeros keep
    // every lane's arithmetic finite.
    const int rows = b.seq_q.length - b.m0 < kBlockM ? b.seq_q.length - b.m0 : kBlockM;
    flash::stage_core_tile<T, HEAD_DIM, kThreads, true>(q_tile, static_cast<const T*>(b.q), p.q_token_stride, rows,
                                                        kBlockM);
  }
  load_k(0);
#pragma unroll
  for (int s = 0; s + 1 < STAGES; ++s) {
    load_v(s);
    load_k(s + 1);
  }

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;  // within the warpgroup
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  const int warpgroup_first = b.m0 + 64 * warpgroup;  // the warpgroup's first query row in the sequence
  const int warp_first = warpgroup_first + 16 * warp;
  int key_limit[2];
  flash::key_limits(p, b, warp_first + g, key_limit);

  float o[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float row_max[2] = {-infinity(), -infinity()};  // scaled base-2 domain
  float row_sum[2] = {0.0f, 0.0f};

  // Descriptors. Q and K are K-major operands (core matrices adjacent along head_dim are one core
  // apart, along rows one row block apart); V is the MN-major B of P V (along keys, its K dimension,
  // one row block apart; along head_dim one core apart). A k16 step is two cores of Q and K, two row
  // blocks of V.
  const wgmma::u64 q_descriptor = wgmma::descriptor(
      mma::shared_address(q_tile + 64 * warpgroup * HEAD_DIM), wgmma::kCoreBytes, kRowBlock);
  const wgmma::u64 k_descriptor = wgmma::descriptor(mma::shared_address(k_slots), wgmma::kCoreBytes, kRowBlock);
  const wgmma::u64 v_descriptor = wgmma::descriptor(mma::shared_address(v_slots), kRowBlock, wgmma::kCoreBytes);
  constexpr int kSlotBytes = Tiles::kSlotElements * static_cast<int>(sizeof(T));

  for (int i = 0; i < b.n_tiles; ++i) {
    const int n0 = (b.n_tiles - 1 - i) * BLOCK_N;
    const wgmma::u64 k_tile = wgmma::advance(k_descriptor, (i % STAGES) * kSlotBytes);
    const wgmma::u64 v_tile = wgmma::advance(v_descriptor, (i % STAGES) * kSlotBytes);
    mma::wait_async_copies_except<kInFlight>();  // K[i] (and Q) have landed for this thread
    wgmma::fence_shared_for_async_proxy();
    __syncthreads();  // ... for every thread; every warpgroup's P V of the last tile is done with V[i - 1]
    load_v(i + STAGES - 1);

    // ---- S = Q Kᵀ ----
    float s[kNTiles][4];
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
      wgmma::mma_ss<T, BLOCK_N>(s, wgmma::advance(q_descriptor, 2 * wgmma::kCoreBytes * ks),
                                wgmma::advance(k_tile, 2 * wgmma::kCoreBytes * ks), ks > 0);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(s);

    unsigned int p_packed[kNTiles][2];
    flash::online_softmax<T>(s, o, row_max, row_sum, p_packed, n0 + BLOCK_N > b.unmasked_end, n0, key_limit,
                             scale_log2, t);

    mma::wait_async_copies_except<kInFlight>();  // V[i] has landed for this thread
    wgmma::fence_shared_for_async_proxy();
    __syncthreads();  // ... for every thread; every warpgroup's S is done with K[i]
    load_k(i + STAGES);

    // ---- O += P V ----
    wgmma::pin(o);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      const unsigned int a[4] = {p_packed[2 * kk][0], p_packed[2 * kk][1], p_packed[2 * kk + 1][0],
                                 p_packed[2 * kk + 1][1]};
      wgmma::mma_rs<T, HEAD_DIM>(o, a, wgmma::advance(v_tile, 2 * kRowBlock * kk), 1);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(o);
  }
  // Every thread's copies have landed, and (the barrier) every other thread's too: with no key tile at
  // all, another thread's copy of Q could otherwise land over the staged O.
  mma::wait_async_copies();
  __syncthreads();

  // ---- epilogue: normalise, LSE, and O through the warpgroup's own Q rows (only it read them) ----
  T* const o_stage = q_tile + 64 * warpgroup * HEAD_DIM;
  float inv_sum[2];
  flash::finish_rows(p, b, warp_first + g, row_max, row_sum, inv_sum, t);
#pragma unroll
  for (int d = 0; d < kDTiles; ++d)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<unsigned int*>(o_stage + wgmma::core_offset<HEAD_DIM>(16 * warp + g + 8 * r, 8 * d + 2 * t)) =
          mma::pack2<T>(o[d][2 * r] * inv_sum[r], o[d][2 * r + 1] * inv_sum[r]);
  __syncthreads();
  constexpr int kChunks = HEAD_DIM / 8;
  const int rows = b.seq_q.length - warpgroup_first < 64 ? b.seq_q.length - warpgroup_first : 64;
  T* const o_rows = static_cast<T*>(p.o) + b.batch_index * p.o_batch_stride +
                    static_cast<long long>(b.seq_q.start + warpgroup_first) * p.o_token_stride +
                    b.head * p.o_head_stride;
  for (int c = threadIdx.x % 128; c < 64 * kChunks; c += 128) {
    const int row = (c / (8 * kChunks)) * 8 + c % 8;
    const int chunk = (c / 8) % kChunks;
    if (row < rows)
      *reinterpret_cast<Vec<T, 8>*>(o_rows + row * p.o_token_stride + chunk * 8) =
          *reinterpret_cast<const Vec<T, 8>*>(o_stage + 8 * c);
  }
}

}  // namespace hipattn
