// General attention forward on Hopper's warpgroup tensor cores (sm_90a): FlashAttention-2's algorithm
// with wgmma.mma_async in place of mma.sync.
//
// A block owns BLOCK_M = 64 * WARPGROUPS query rows of one (sequence, query head); each warpgroup owns
// 64 of them. Per key tile of BLOCK_N keys: S = Q Kᵀ with both operands read by the tensor cores
// straight from shared memory (no ldmatrix: the register file and the load pipe that limited the
// mma.sync kernel stay free), the online softmax on the accumulators (flash/softmax_m16n8.h, the same
// code as the mma.sync forward: a wgmma accumulator holds each warp's 16 rows in mma.sync's layout),
// and O += P V with P from registers and V read from shared memory transposed by the tensor cores.
// With dropout (the SCORE_MODS instantiation, common/dropout.h) the dropped probabilities are zeroed
// between the softmax and P V, as the mma.sync forward zeroes them, so the two agree on every element.
//
// The tensor cores run asynchronously to the warps that issue them, which the schedule uses: per key
// tile i, the warpgroup issues S of tile i + 1 and O += P V of tile i together, runs the softmax of
// tile i + 1 on the CUDA cores while P V is still in flight, and rescales O once it has landed (by
// instruction counts, a tile's exponentials take about a third as long as its matrix products at
// head_dim 128; run in turn, they would leave the tensor cores idle that long). K and V are staged
// with cp.async through a ring of STAGES slots each, one commit group {V[i], K[i + 1]} per tile, so
// the copies run STAGES - 1 tiles ahead.
//
// A warpgroup's products and its output's way out are flash/forward_warpgroup.h's, which the
// warp-specialised kernel (forward_warp_specialised.hip) shares.
//
// Shared tiles are in wgmma's 128-byte swizzled layout (common/wgmma_nvidia.h): the copies read whole
// 128-byte row segments, and neither they nor the tensor cores' reads conflict on banks. At head_dim 96
// a row is a column block and a half: S takes six k16 steps, and O is an m64n96 product. (The
// unswizzled layout, whose conflict-free copies read 64-byte segments, left this kernel bound by L2:
// 76% of its throughput at 250 TFLOP/s on the H200, against 23% at 319 swizzled, same tiles.)
#pragma once
#include "flash/forward_warpgroup.h"
#include "flash/softmax_m16n8.h"
#include "flash/stage_swizzled_cp_async.h"

namespace hipattn {
namespace flash {

// Shared-memory layout of one block, in elements of T: the Q tile (BLOCK_M rows), STAGES K slots and
// STAGES V slots (BLOCK_N rows each), every tile swizzled and 1024-byte aligned, its rows whole 64-column
// blocks (kRowElements: head_dim 96 is stored as 128, and the last 32 columns are never written or
// read). The host's row (hipattn/catalog/flash_forward.py, FlashForwardWgmmaTiles.shared_bytes)
// computes kBytes from the same template arguments.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES>
struct WgmmaForwardTiles {
  static constexpr int kBlockM = 64 * WARPGROUPS;
  static constexpr int kThreads = 128 * WARPGROUPS;
  static constexpr int kRowElements = (HEAD_DIM + 63) / 64 * 64;
  static constexpr int kQElements = kBlockM * kRowElements;
  static constexpr int kSlotElements = BLOCK_N * kRowElements;
  static constexpr int kKOffset = kQElements;
  static constexpr int kVOffset = kQElements + STAGES * kSlotElements;
  static constexpr int kElements = kQElements + 2 * STAGES * kSlotElements;
  static constexpr int kBytes = kElements * static_cast<int>(sizeof(T));

  static_assert(sizeof(T) == 2, "the tensor-core path takes 16-bit inputs");
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 96 || HEAD_DIM == 128 || HEAD_DIM == 256,
                "O is one wgmma's N: 64, 96, 128 or 256");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "S is one wgmma's N: 64 or 128 keys");
  static_assert(WARPGROUPS >= 1 && WARPGROUPS <= 3, "one to three warpgroups (up to 192 query rows)");
  static_assert(STAGES >= 2 && STAGES <= 3, "two or three K/V slots: K of the next tile is read early");
  static_assert(kBytes <= 227 * 1024, "the tiles must fit sm_90's 227 KiB of shared memory");
};

}  // namespace flash

template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, bool SCORE_MODS>
__global__ void __launch_bounds__(128 * WARPGROUPS) flash_forward_wgmma(const FlashForwardParams p) {
  using Tiles = flash::WgmmaForwardTiles<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES>;
  constexpr int kBlockM = Tiles::kBlockM;
  constexpr int kThreads = Tiles::kThreads;
  constexpr int kNTiles = BLOCK_N / 8;   // 8-key accumulator tiles of S
  constexpr int kDTiles = HEAD_DIM / 8;  // 8-column accumulator tiles of O
  // Copies are committed in groups, in the same order by every thread: {Q, K[0]}, then {V[0], K[1]},
  // {V[1], K[2]}, ... (empty past the last tile). Iteration i needs {V[i], K[i + 1]}, with the newest
  // STAGES - 2 groups still in flight.
  constexpr int kInFlight = STAGES - 2;
  extern __shared__ __align__(1024) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);

  bool empty;
  // Tiles counted from the sequence's end: 192-row tiles leave a partial one at most lengths.
  const flash::ForwardBlock b = flash::forward_block<T, kBlockM, BLOCK_N, true>(p, blockIdx.x, empty);
  if (empty) return;  // uniform over the block, before any barrier
  const int len_k = b.seq_k.length;
  T* const q_tile = shared;
  T* const k_slots = shared + Tiles::kKOffset;
  T* const v_slots = shared + Tiles::kVOffset;

  // Iteration i handles key tile tile_end - 1 - i, in slot i % STAGES. V rows past the sequence are
  // zeroed (P is 0 there, and 0 x NaN is NaN); K rows are left alone (their scores are masked by
  // selection). Two lambdas, not one generic one: NVRTC 13.0 (the H200 image's) rejects a
  // lambda with an `auto` parameter in device code as a host function.
  auto key_start = [&](int i) { return (b.tile_end - 1 - i) * BLOCK_N; };  // iteration i's first key
  auto tile_rows = [&](int i) { return len_k - key_start(i) < BLOCK_N ? len_k - key_start(i) : BLOCK_N; };
  auto stage_k = [&](int i) {
    flash::stage_swizzled_tile<T, HEAD_DIM, BLOCK_N, kThreads, flash::TileTail::kLeave>(
        k_slots + (i % STAGES) * Tiles::kSlotElements, static_cast<const T*>(b.k) + key_start(i) * p.k_token_stride,
        p.k_token_stride, tile_rows(i));
  };
  auto stage_v = [&](int i) {
    flash::stage_swizzled_tile<T, HEAD_DIM, BLOCK_N, kThreads, flash::TileTail::kZeroByStore>(
        v_slots + (i % STAGES) * Tiles::kSlotElements, static_cast<const T*>(b.v) + key_start(i) * p.v_token_stride,
        p.v_token_stride, tile_rows(i));
  };
  auto load_group = [&](int i) {  // {V[i], K[i + 1]}
    if (i < b.n_tiles) stage_v(i);
    if (i + 1 < b.n_tiles) stage_k(i + 1);
    mma::commit_async_copies();
  };

  {
    // Q rows past the block's are zeroed: they only feed rows that are never stored, but zeros keep
    // every lane's arithmetic finite.
    const int rows = b.row_end - b.m0;
    flash::stage_swizzled_tile<T, HEAD_DIM, kBlockM, kThreads, flash::TileTail::kZeroByStore>(
        q_tile, static_cast<const T*>(b.q), p.q_token_stride, rows);
    if (b.n_tiles > 0) stage_k(0);
    mma::commit_async_copies();
  }
#pragma unroll
  for (int i = 0; i + 1 < STAGES; ++i) load_group(i);

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;  // within the warpgroup
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const Scores<SCORE_MODS> scores = scores_of<SCORE_MODS>(p, b.batch_index, b.head);
  const Dropout<SCORE_MODS> dropout = dropout_of<SCORE_MODS>(p, b.batch_index, b.head);
  const int warpgroup_first = b.m0 + 64 * warpgroup;  // the warpgroup's first query row in the sequence
  const int warp_first = warpgroup_first + 16 * warp;
  const flash::RowKeys keys = flash::row_keys(b, warp_first + g);

  float o[kDTiles][4];
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float row_max[2] = {-infinity(), -infinity()};  // scaled base-2 domain
  float row_sum[2] = {0.0f, 0.0f};

  using Products = flash::WarpgroupProducts<T, HEAD_DIM, BLOCK_N, kBlockM, STAGES>;
  using ScoreSteps = typename Products::ScoreSteps;
  using ValueSteps = typename Products::ValueSteps;
  const Products products(q_tile, k_slots, v_slots, warpgroup);
  auto softmax = [&](float(&s)[kNTiles][4], int i, unsigned int(&p_packed)[kNTiles][2], float(&correction)[2]) {
    const int n0 = key_start(i);
    flash::online_softmax<T>(s, row_max, row_sum, p_packed, correction,
                             n0 < b.unmasked_begin || n0 + BLOCK_N > b.unmasked_end, n0, keys, scores, t);
  };
  // Dropout zeroes tile i's probabilities after the row sums took them (common/dropout.h).
  auto drop = [&](unsigned int(&p_packed)[kNTiles][2], int i) {
    if (dropout.active())
      flash::drop(p_packed, flash::keep_bits<kNTiles>(dropout, warp_first + g, key_start(i), t));
  };

  // Software pipeline, one key tile deep: while the tensor cores compute P V of tile i, they also
  // compute S of tile i + 1, whose softmax then runs on the CUDA cores. O is rescaled for tile i + 1
  // only after P V of tile i has landed in it.
  unsigned int p_packed[kNTiles][2];  // P of the current tile, in T: the A operand of its P V
  if (b.n_tiles > 0) {
    mma::wait_async_copies_except<STAGES - 1>();  // {Q, K[0]} have landed for this thread
    wgmma::fence_shared_for_async_proxy();
    __syncthreads();  // ... for every thread
    float s[kNTiles][4];
    ScoreSteps q_steps, k_steps;
    products.score_steps(q_steps, k_steps, 0);
    wgmma::fence();
    Products::issue_scores(s, q_steps, k_steps);
    wgmma::wait<0>();
    wgmma::pin(s);
    float correction[2];  // O is still 0: nothing to rescale
    softmax(s, 0, p_packed, correction);
    drop(p_packed, 0);
  }
  // Iteration i's copies: {V[i], K[i + 1]} have landed for every thread, and every warpgroup is done
  // with V[i - 1] and K[i], whose slots the copies of tile i + STAGES - 1 then take.
  auto await_tile = [&](int i) {
    mma::wait_async_copies_except<kInFlight>();
    wgmma::fence_shared_for_async_proxy();
    __syncthreads();
    load_group(i + STAGES - 1);
  };
  // Every tile but the last issues S of the next one with its own P V; the last tile runs alone (ptxas
  // serialises every wgmma of a loop whose S product is issued conditionally: warning C7514).
  // The modified kernels' loop is unrolled by two: NVRTC 13.0's ptxas otherwise serialises every wgmma
  // of the kernel (warning C7513: non-wgmma instructions define a wgmma's input registers inside a
  // pipeline stage) once the softmax that overlaps P V measures ALiBi distances. Unrolled, the two
  // iterations hold alternate tiles' P in registers of their own, with no copy at the loop's end (the
  // likely difference). The plain loop, unrolled, is the one serialised, so it stays rolled.
#pragma unroll(SCORE_MODS ? 2 : 1)
  for (int i = 0; i + 1 < b.n_tiles; ++i) {
    await_tile(i);
    float s[kNTiles][4];
    ScoreSteps q_steps, k_steps;
    ValueSteps v_steps;
    products.score_steps(q_steps, k_steps, i + 1);
    products.value_steps(v_steps, i);
    wgmma::pin(o);
    wgmma::fence();
    Products::issue_scores(s, q_steps, k_steps);
    Products::issue_values(o, p_packed, v_steps);
    wgmma::wait<1>();  // S of tile i + 1 (groups complete in order; P V may still run)
    wgmma::pin(s);
    unsigned int p_next[kNTiles][2];
    float correction[2];
    softmax(s, i + 1, p_next, correction);
    wgmma::wait<0>();
    wgmma::pin(o);
    wgmma::pin(p_packed);
    flash::rescale(o, correction);
    // Dropped only now, after P V has landed: the Philox rounds made while the products run left
    // ptxas no registers at head_dim 256 and measured slower at 128 (they delay the softmax).
    drop(p_next, i + 1);
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) p_packed[n][0] = p_next[n][0], p_packed[n][1] = p_next[n][1];
  }
  if (b.n_tiles > 0) {
    await_tile(b.n_tiles - 1);
    ValueSteps v_steps;
    products.value_steps(v_steps, b.n_tiles - 1);
    wgmma::pin(o);
    wgmma::fence();
    Products::issue_values(o, p_packed, v_steps);
    wgmma::wait<0>();
    wgmma::pin(o);
  }
  // Every thread's copies have landed, and (the barrier) every other thread's too: with no key tile at
  // all, another thread's copy of Q could otherwise land over the staged O.
  mma::wait_async_copies();
  __syncthreads();

  // ---- epilogue: normalise, LSE, and O through the warpgroup's own Q rows (only it read them) ----
  const int o_row = 64 * warpgroup + 16 * warp + g;  // accumulator row g's row in the Q tile
  float inv_sum[2];
  flash::finish_rows(p, b, warp_first + g, row_max, row_sum, inv_sum, t, sink_log2<SCORE_MODS>(p, b.head));
  inv_sum[0] *= dropout.scale();  // the kept probabilities' 1 / (1 - dropout_p)
  inv_sum[1] *= dropout.scale();
  flash::stage_output<T, kBlockM>(q_tile, o, inv_sum, o_row, t);
  __syncthreads();
  flash::write_output<T, HEAD_DIM, kBlockM>(p, b, q_tile, warpgroup, warpgroup_first);
}

}  // namespace hipattn
