// General attention forward on Hopper (sm_90a) with warpgroups in two roles: one producer warpgroup
// stages Q, K and V into shared memory, and CONSUMERS warpgroups of 64 query rows each run the wgmma
// products and the softmax on them, each at its own pace.
//
// The FlashAttention-2-class kernel (forward_wgmma.hip) has every thread issue copies and the block
// meet at a __syncthreads per key tile, so the slowest warpgroup sets every warpgroup's pace and the
// copies' address arithmetic and registers sit in the compute loop. Here the ring of STAGES K slots
// and STAGES V slots is guarded by mbarriers (common/async_pipeline_nvidia.h): a slot's "full" barrier
// completes when the producer's copies into it have landed, its "empty" barrier when every consumer
// thread is done reading it. The producer gives most of its registers to the consumers (setmaxnreg),
// which hold S, P twice and O in fp32 at up to 128-key tiles.
//
// The producer loads tiles with Hopper's copy engine: one thread issues a tensor-map copy per 64-column
// swizzle block of a tile (FlashForwardTmaParams' q_map, k_map, v_map, encoded on the host: 4-D maps
// of [batch, token, head, dim], hipattn/ops/tensor_map_fields.py), which lands in wgmma's 128-byte
// swizzled layout and completes its bytes on the slot's full barrier; the other producer threads
// arrive on it plainly, so that a full barrier counts 128 arrivals whoever filled its slot. Rows past
// the array read as zeros, and rows past the sequence inside the array are left as they are: K's
// scores there are masked by selection and Q's rows are never stored. V's rows past the sequence must
// be zeros (P is 0 there, and 0 x NaN is NaN), so a V tile that ends past its sequence (only ever the
// first one visited: tiles go last first) is copied by the producer's 128 threads with cp.async
// instead, zeros by copies that read nothing, each thread's arrival made by the hardware once its
// copies have landed (flash/stage_swizzled_cp_async.h). Those copies are made by the generic proxy and
// read by the tensor cores (the async proxy), so the consumers fence the two after their wait.
//
// A consumer warpgroup runs the FA2-class kernel's software pipeline: per key tile i, S of tile i + 1
// and O += P V of tile i are issued together, and the softmax of tile i + 1 runs on the CUDA cores
// while P V is in flight. With PING_PONG the consumers also take turns to issue those products (named
// barriers, one per consumer, passed round in a ring), so that while one warpgroup's products occupy
// the tensor cores the others run their softmax: a warpgroup's exponentials take about half as long as
// its products at head_dim 128, and unordered, the warpgroups would often contend for the tensor cores
// together and then leave them idle together. The products and the output's way out through the
// consumer's Q rows are flash/forward_warpgroup.h's, as in the FA2-class kernel; masks, score
// modifiers, dropout and sinks enter through the same code as there (flash/online_softmax_m16n8.h,
// common/score_mods.h, common/dropout.h, common/sink.h).
//
// The grid may be persistent: a block walks work items (query tile, sequence, head), in units of one
// item or of a pair of query tiles from both ends of a sequence (flash/forward_block.h, ItemWalk). The
// K/V ring and the turns run on from one item into the next, and Q has two slots, so that the
// producer copies the next item's Q and first key tiles while the consumers finish this one's last
// products and write its output; a block per item pays those copies unoverlapped. The host picks the
// grid (hipattn/ops/flash.py, forward_grid): persistent for a batch of equal sequences, in pairs under
// a causal mask or a window.
#pragma once
#include "common/async_pipeline_nvidia.h"
#include "flash/forward_warpgroup.h"
#include "flash/softmax_m16n8.h"
#include "flash/stage_swizzled_cp_async.h"

namespace hipattn {
namespace flash {

// Shared-memory layout of one block: two Q slots (64 rows per consumer each: a persistent block's
// next item's Q lands while this one's output leaves through the other), STAGES K slots and STAGES V
// slots (BLOCK_N rows each), every tile swizzled and 1024-byte aligned, rows in whole 64-column blocks
// (head_dim 96 is stored as 128); then the barriers, 8 bytes each: per Q slot full and empty, and per
// ring slot K full, V full, K empty, V empty. The host's row (hipattn/catalog/flash_forward.py,
// FlashForwardWarpSpecialisedTiles.shared_bytes) computes kBytes from the same template arguments.
template <typename T, int HEAD_DIM, int BLOCK_N, int CONSUMERS, int STAGES>
struct WarpSpecialisedForwardTiles {
  static constexpr int kBlockM = 64 * CONSUMERS;
  static constexpr int kThreads = 128 * (CONSUMERS + 1);
  static constexpr int kRowElements = (HEAD_DIM + 63) / 64 * 64;
  static constexpr int kQElements = kBlockM * kRowElements;
  static constexpr int kSlotElements = BLOCK_N * kRowElements;
  static constexpr int kKOffset = 2 * kQElements;
  static constexpr int kVOffset = kKOffset + STAGES * kSlotElements;
  static constexpr int kElements = kVOffset + STAGES * kSlotElements;
  static constexpr int kBarrierOffset = kElements * static_cast<int>(sizeof(T));  // bytes
  static constexpr int kBarriers = 4 + 4 * STAGES;
  static constexpr int kBytes = kBarrierOffset + 8 * kBarriers;
  // Registers per thread. The launch reserves kLaunchRegisters for every thread (__launch_bounds__ with
  // one block per SM: the 64K-register file over the block's threads, in ptxas's units of 8); the
  // producer then keeps what its copy loop needs and the consumers share the rest, in multiples of 8.
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegisters = CONSUMERS >= 3 ? 32 : 24;
  static constexpr int kShare = (kLaunchRegisters * (CONSUMERS + 1) - kProducerRegisters) / CONSUMERS / 8 * 8;
  static constexpr int kConsumerRegisters = kShare > 240 ? 240 : kShare;

  static_assert(sizeof(T) == 2, "the tensor-core path takes 16-bit inputs");
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 96 || HEAD_DIM == 128 || HEAD_DIM == 256,
                "O is one wgmma's N: 64, 96, 128 or 256");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "S is one wgmma's N: 64 or 128 keys");
  static_assert(CONSUMERS >= 1 && CONSUMERS <= 3, "one to three consumer warpgroups (up to 192 query rows)");
  static_assert(STAGES >= 2 && STAGES <= 4, "two to four K/V slots: K of the next tile is read early");
  static_assert(kBytes <= 227 * 1024, "the tiles must fit sm_90's 227 KiB of shared memory");
};

// Named barriers: 1 + c is consumer c's own (its epilogue), kFirstTurnBarrier + c the one it waits on
// for its turn at the tensor cores.
constexpr unsigned int kFirstTurnBarrier = 4;

}  // namespace flash

template <typename T, int HEAD_DIM, int BLOCK_N, int CONSUMERS, int STAGES, bool PING_PONG, bool SCORE_MODS>
__global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
    flash_forward_warp_specialised(const __grid_constant__ FlashForwardTmaParams p) {
  using Tiles = flash::WarpSpecialisedForwardTiles<T, HEAD_DIM, BLOCK_N, CONSUMERS, STAGES>;
  static_assert(!PING_PONG || CONSUMERS >= 2, "turns need two consumers at least");
  constexpr int kBlockM = Tiles::kBlockM;
  constexpr int kNTiles = BLOCK_N / 8;   // 8-key accumulator tiles of S
  constexpr int kDTiles = HEAD_DIM / 8;  // 8-column accumulator tiles of O
  extern __shared__ __align__(1024) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);

  // The block walks units blockIdx.x, blockIdx.x + gridDim.x, ..., each one item or a pair of them
  // (flash/forward_block.h, ItemWalk; one item when the grid has one block per item). Both roles
  // derive every item's problem themselves, skip the same empty ones, and count the same two
  // positions: `visited`, the items visited (item v uses Q slot v % 2, its (v / 2)-th use), and
  // `ring`, the key tiles of the items before (the item's key tile i is ring position ring + i: slot
  // (ring + i) % STAGES, its ((ring + i) / STAGES)-th use).
  const flash::ItemWalk<kBlockM> walk(p);
  T* const k_slots = shared + Tiles::kKOffset;
  T* const v_slots = shared + Tiles::kVOffset;
  auto q_tile = [&](int visited) { return shared + (visited % 2) * Tiles::kQElements; };
  // Barrier addresses: per Q slot full and empty, then per ring slot s: K full, V full, K empty, V empty.
  const unsigned int barriers = mma::shared_address(shared_bytes + Tiles::kBarrierOffset);
  auto q_full = [&](int visited) { return barriers + 8u * (visited % 2); };
  auto q_empty = [&](int visited) { return barriers + 8u * (2 + visited % 2); };
  auto k_full = [&](int r) { return barriers + 8u * (4 + 4 * (r % STAGES)); };
  auto v_full = [&](int r) { return barriers + 8u * (5 + 4 * (r % STAGES)); };
  auto k_empty = [&](int r) { return barriers + 8u * (6 + 4 * (r % STAGES)); };
  auto v_empty = [&](int r) { return barriers + 8u * (7 + 4 * (r % STAGES)); };
  auto q_phase = [](int visited) { return static_cast<unsigned int>(visited / 2) & 1u; };
  auto phase = [](int r) { return static_cast<unsigned int>(r / STAGES) & 1u; };

  if (threadIdx.x == 0) {
    // Full barriers count the producer's 128 arrivals, empty ones every consumer thread's.
    for (int v = 0; v < 2; ++v) {
      mbarrier::init(q_full(v), 128);
      mbarrier::init(q_empty(v), 128 * CONSUMERS);
    }
    for (int s = 0; s < STAGES; ++s) {
      mbarrier::init(k_full(s), 128);
      mbarrier::init(v_full(s), 128);
      mbarrier::init(k_empty(s), 128 * CONSUMERS);
      mbarrier::init(v_empty(s), 128 * CONSUMERS);
    }
    mbarrier::publish_inits();
  }
  __syncthreads();  // the last block-wide barrier: from here the roles meet only at mbarriers

  if (threadIdx.x < 128) {
    // ---- producer: per item Q, then K[0], K[1], V[0], K[2], V[1], ...: iteration i - 1 needs K[i]
    // and V[i - 1]. It runs ahead into the next item as far as the free slots let it, so that the
    // next item's Q and first key tiles land while the consumers finish this one. ----
    release_registers_to<Tiles::kProducerRegisters>();
    const bool leader = threadIdx.x == 0;
    // One thread copies a tile through its map, a box per 64-column block; the others arrive.
    auto load = [&](T* tile, int rows, const TensorMap& map, int head, int token, int batch, unsigned int full) {
      if (leader) {
        mbarrier::arrive_expecting(full, rows * Tiles::kRowElements * static_cast<int>(sizeof(T)));
        for (int c = 0; c < Tiles::kRowElements; c += 64)
          load_tile(tile + c * rows, &map, c, head, token, batch, full);
      } else {
        mbarrier::arrive(full);
      }
    };
    int visited = 0, ring = 0;
    unsigned int item;
    for (unsigned int step = 0; walk.at(step, item); ++step) {
      if (item == walk.kNoItem) continue;
      bool empty;
      // Tiles counted from the sequence's end: a partial tile holds the first rows (flash/forward_block.h).
      const flash::ForwardBlock b = flash::forward_block<T, kBlockM, BLOCK_N, true>(p, item, empty);
      if (empty) continue;
      const int len_k = b.seq_k.length;
      // Iteration i handles key tile tile_end - 1 - i.
      auto key_start = [&](int i) { return (b.tile_end - 1 - i) * BLOCK_N; };
      // A varlen call's arrays are one batch of tokens (batch stride 0), its maps one batch deep.
      const int q_batch = p.q_batch_stride != 0 ? b.batch_index : 0;
      const int k_batch = p.k_batch_stride != 0 ? b.batch_index : 0;
      const int v_batch = p.v_batch_stride != 0 ? b.batch_index : 0;
      // The Q slot is free once the consumers have written out the output they staged in it.
      mbarrier::wait(q_empty(visited), q_phase(visited) ^ 1u);
      load(q_tile(visited), kBlockM, p.q_map, b.head, b.seq_q.start + b.m0, q_batch, q_full(visited));
      for (int i = 0; i <= b.n_tiles; ++i) {
        if (i < b.n_tiles) {
          const int r = ring + i;
          mbarrier::wait(k_empty(r), phase(r) ^ 1u);
          load(k_slots + (r % STAGES) * Tiles::kSlotElements, BLOCK_N, p.k_map, b.head_kv,
               b.seq_k.start + key_start(i), k_batch, k_full(r));
        }
        if (i > 0) {
          const int j = i - 1;
          const int r = ring + j;
          mbarrier::wait(v_empty(r), phase(r) ^ 1u);
          T* const slot = v_slots + (r % STAGES) * Tiles::kSlotElements;
          if (key_start(j) + BLOCK_N > len_k) {  // a partial V tile: cp.async, its tail zeroed
            flash::produce_tile<T, HEAD_DIM, BLOCK_N, flash::TileTail::kZeroByCopy>(
                slot, static_cast<const T*>(b.v) + key_start(j) * p.v_token_stride, p.v_token_stride,
                len_k - key_start(j));
            mbarrier::arrive_when_copies_land(v_full(r));
          } else {
            load(slot, BLOCK_N, p.v_map, b.head_kv, b.seq_k.start + key_start(j), v_batch, v_full(r));
          }
        }
      }
      ++visited;
      ring += b.n_tiles;
    }
    mma::wait_async_copies();  // no thread leaves with copies in flight
    return;
  }

  // ---- consumers ----
  claim_registers_to<Tiles::kConsumerRegisters>();
  const int consumer = threadIdx.x / 128 - 1;  // its 64 rows of the Q tile
  const int warp = (threadIdx.x / 32) % 4;     // within the warpgroup
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  // Waits for a slot's copies; those of a partial V tile (cp.async, the generic proxy) are then ordered
  // before the tensor cores' reads.
  auto await_full = [&](unsigned int barrier, unsigned int parity, bool copied_by_threads) {
    mbarrier::wait(barrier, parity);
    if (copied_by_threads) wgmma::fence_shared_for_async_proxy();
  };
  // A consumer thread is done with a slot once its wgmmas reading it have completed. Every thread
  // arrives: one lane per warp would take a branch (or a predicate) inside the wgmma pipeline, and
  // ptxas then serialises the wgmmas (warning C7513).
  auto release = [&](unsigned int barrier) { mbarrier::arrive(barrier); };
  // Turns at the tensor cores: consumer c waits for c - 1 (cyclically) to have issued its batch. The
  // ring of turns runs on across items: every consumer issues the same batches (n_tiles + 1 per item).
  const unsigned int own_turn = flash::kFirstTurnBarrier + consumer;
  const unsigned int next_turn = flash::kFirstTurnBarrier + (consumer + 1) % CONSUMERS;
  auto take_turn = [&] {
    if (PING_PONG) barrier_sync<256>(own_turn);
  };
  auto pass_turn = [&] {
    if (PING_PONG) barrier_arrive<256>(next_turn);
  };
  bool turns_begun = false;

  using Products = flash::WarpgroupProducts<T, HEAD_DIM, BLOCK_N, kBlockM, STAGES>;
  using ScoreSteps = typename Products::ScoreSteps;
  using ValueSteps = typename Products::ValueSteps;
  int visited = 0, ring = 0;
  unsigned int item;
  for (unsigned int step = 0; walk.at(step, item); ++step) {
    if (item == walk.kNoItem) continue;
    bool empty;
    const flash::ForwardBlock b = flash::forward_block<T, kBlockM, BLOCK_N, true>(p, item, empty);
    if (empty) continue;
    const int len_k = b.seq_k.length;
    auto key_start = [&](int i) { return (b.tile_end - 1 - i) * BLOCK_N; };
    // Iteration i's V tile ends past the sequence: the producer copied it with cp.async.
    auto v_tile_is_partial = [&](int i) { return key_start(i) + BLOCK_N > len_k; };
    const Scores<SCORE_MODS> scores = scores_of<SCORE_MODS>(p, b.batch_index, b.head);
    const Dropout<SCORE_MODS> dropout = dropout_of<SCORE_MODS>(p, b.batch_index, b.head);
    const int consumer_first = b.m0 + 64 * consumer;  // the consumer's first query row in the sequence
    const int warp_first = consumer_first + 16 * warp;
    const flash::RowKeys keys = flash::row_keys(b, warp_first + g);
    T* const q = q_tile(visited);

    float o[kDTiles][4];
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float row_max[2] = {-infinity(), -infinity()};  // scaled base-2 domain
    float row_sum[2] = {0.0f, 0.0f};

    const Products products(q, k_slots, v_slots, consumer);
    auto softmax = [&](float(&s)[kNTiles][4], int i, unsigned int(&p_packed)[kNTiles][2], float(&correction)[2]) {
      const int n0 = key_start(i);
      flash::online_softmax<T>(s, row_max, row_sum, p_packed, correction,
                               n0 < b.unmasked_begin || n0 + BLOCK_N > b.unmasked_end, n0, keys, scores, t);
    };
    auto drop = [&](unsigned int(&p_packed)[kNTiles][2], int i) {
      if (dropout.active())
        flash::drop(p_packed, flash::keep_bits<kNTiles>(dropout, warp_first + g, key_start(i), t));
    };

    unsigned int p_packed[kNTiles][2];  // P of the current tile, in T: the A operand of its P V
    await_full(q_full(visited), q_phase(visited), false);  // also before the epilogue's staging of O over Q
    if (b.n_tiles > 0) {
      // The first turn is consumer 0's: the last consumer hands it over before anyone has issued.
      if (PING_PONG && !turns_begun && consumer == CONSUMERS - 1) barrier_arrive<256>(flash::kFirstTurnBarrier);
      turns_begun = true;
      await_full(k_full(ring), phase(ring), false);
      float s[kNTiles][4];
      ScoreSteps q_steps, k_steps;
      products.score_steps(q_steps, k_steps, ring);
      take_turn();
      wgmma::fence();
      Products::issue_scores(s, q_steps, k_steps);
      pass_turn();
      wgmma::wait<0>();
      wgmma::pin(s);
      release(k_empty(ring));
      float correction[2];  // O is still 0: nothing to rescale
      softmax(s, 0, p_packed, correction);
      drop(p_packed, 0);
    }
    // The loop is unrolled as the FA2-class kernel's is, for the same ptxas behaviour (forward_wgmma.hip).
#pragma unroll(SCORE_MODS ? 2 : 1)
    for (int i = 0; i + 1 < b.n_tiles; ++i) {
      const int r = ring + i;
      await_full(k_full(r + 1), phase(r + 1), false);
      await_full(v_full(r), phase(r), v_tile_is_partial(i));
      float s[kNTiles][4];
      ScoreSteps q_steps, k_steps;
      ValueSteps v_steps;
      products.score_steps(q_steps, k_steps, r + 1);
      products.value_steps(v_steps, r);
      take_turn();
      wgmma::pin(o);
      wgmma::fence();
      Products::issue_scores(s, q_steps, k_steps);
      Products::issue_values(o, p_packed, v_steps);
      pass_turn();
      wgmma::wait<1>();  // S of tile i + 1 (groups complete in order; P V may still run)
      wgmma::pin(s);
      release(k_empty(r + 1));
      unsigned int p_next[kNTiles][2];
      float correction[2];
      softmax(s, i + 1, p_next, correction);
      wgmma::wait<0>();
      wgmma::pin(o);
      wgmma::pin(p_packed);
      release(v_empty(r));
      flash::rescale(o, correction);
      drop(p_next, i + 1);
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) p_packed[n][0] = p_next[n][0], p_packed[n][1] = p_next[n][1];
    }
    if (b.n_tiles > 0) {
      const int last = b.n_tiles - 1;
      await_full(v_full(ring + last), phase(ring + last), v_tile_is_partial(last));
      ValueSteps v_steps;
      products.value_steps(v_steps, ring + last);
      take_turn();
      wgmma::pin(o);
      wgmma::fence();
      Products::issue_values(o, p_packed, v_steps);
      pass_turn();
      wgmma::wait<0>();
      wgmma::pin(o);
      release(v_empty(ring + last));
    }

    // ---- epilogue: normalise, LSE, and O through the consumer's own Q rows (only it read them) ----
    const int o_row = 64 * consumer + 16 * warp + g;  // accumulator row g's row in the Q tile
    float inv_sum[2];
    flash::finish_rows(p, b, warp_first + g, row_max, row_sum, inv_sum, t, sink_log2<SCORE_MODS>(p, b.head));
    inv_sum[0] *= dropout.scale();  // the kept probabilities' 1 / (1 - dropout_p)
    inv_sum[1] *= dropout.scale();
    // Every warp of the warpgroup has read its Q rows for the last time (the barrier below orders the
    // other warps' wgmma reads before these writes as well).
    barrier_sync<128>(1 + consumer);
    flash::stage_output<T, kBlockM>(q, o, inv_sum, o_row, t);
    barrier_sync<128>(1 + consumer);
    flash::write_output<T, HEAD_DIM, kBlockM>(p, b, q, consumer, consumer_first);
    // The slot's next Q is written by the copy engine (the async proxy) over what these threads
    // wrote and read: order their accesses before it, then hand the slot back.
    wgmma::fence_shared_for_async_proxy();
    release(q_empty(visited));
    ++visited;
    ring += b.n_tiles;
  }
  // Consumer 0 takes the turn the last consumer passed last, so that no arrival outlives the block.
  if (PING_PONG && turns_begun && consumer == 0) take_turn();
}

}  // namespace hipattn
