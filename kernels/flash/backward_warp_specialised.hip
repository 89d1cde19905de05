// General attention backward, the dK/dV kernel (with dQ's share added atomically), on Hopper (sm_90a)
// with warpgroups in two roles: one producer warpgroup stages every query tile's Q, dO, LSE and Delta
// into a ring of STAGES slots, and two consumer warpgroups of 64 keys each run
// flash/backward_warpgroup.h's products on them, as in backward_wgmma.hip.
//
// backward_wgmma.hip has every thread issue the next tile's copies and the block meet at a
// __syncthreads per query tile, so the copies' address arithmetic and registers sit in the compute
// loop and both warpgroups wait for the slower. Here a slot's "full" mbarrier
// (common/async_pipeline_nvidia.h) completes when the producer's copies into it have landed and its
// "empty" one when every consumer thread is done with it, so the producer runs up to STAGES tiles
// ahead. The consumers meet once per query tile, before dQ reads the dSᵀ both wrote; dSᵀ has two
// buffers, so a warpgroup writing the next tile's never waits for the other's dQ of this one (which it
// passed at that meeting). The producer gives most of its registers to the consumers (setmaxnreg).
//
// The producer copies a whole query tile's Q and dO with the copy engine (FlashBackwardTmaParams' q_map
// and dout_map, hipattn/ops/tensor_map_fields.py: a box per 64-column swizzle block, landing in wgmma's
// 128-byte swizzled layout). A tile that ends past its sequence (the last of a sequence) must have
// zeros there (its rows are B operands of dK and dV, met by P = 0, and 0 x NaN is NaN), so its 128
// threads copy it with cp.async instead, zeros by copies that read nothing (as the forward's producer
// copies a partial V tile, forward_warp_specialised.hip). LSE and Delta go by 4-byte cp.async, one row
// per thread (a sequence's rows start anywhere in a varlen array, too unaligned for the copy engine),
// zeros past the sequence: P there is 0 by selection (the warpgroup's mask covers rows past len_q), and
// dSᵀ = 0 x (0 - 0). K and V, copied once per block, go by cp.async with zeros past the sequence.
// A full barrier counts one arrival per producer thread, made by the hardware once the thread's
// cp.asyncs have landed, and one more by the leading thread: the copy engine's bytes, or a plain one.
#pragma once
#include "common/async_pipeline_nvidia.h"
#include "flash/backward_warpgroup.h"
#include "flash/stage_swizzled_cp_async.h"

namespace hipattn {
namespace flash {

// Shared-memory layout of a block, in elements of T, then fp32 row statistics, staged dQ and the
// barriers; every tile swizzled and 1024-byte aligned, rows in whole 64-column blocks:
//   K, V        128 rows each (two consumers of 64 keys)
//   Q, dO       STAGES slots of BLOCK_M rows each
//   dSᵀ         two buffers of 128 keys x BLOCK_M queries
//   LSE, Delta  fp32, STAGES slots of BLOCK_M each: [slot][LSE | Delta]
//   dQ          fp32, per consumer 64 rows of its kDqColumns, each row padded by 8 words
//   barriers    8 bytes each: K and V's full, then per slot full and empty
// The host's row (hipattn/catalog/flash_backward.py, FlashDkdvWarpSpecialisedTiles.shared_bytes)
// computes kBytes from the same arguments.
template <typename T, int HEAD_DIM, int BLOCK_M, int STAGES>
struct WarpSpecialisedKeyBlockTiles : KeyBlockShape<T, HEAD_DIM, 2, 1, BLOCK_M> {
  using Shape = KeyBlockShape<T, HEAD_DIM, 2, 1, BLOCK_M>;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = Shape::kKeyElements;
  static constexpr int kQOffset = 2 * Shape::kKeyElements;
  static constexpr int kDoOffset = kQOffset + STAGES * Shape::kQueryElements;
  static constexpr int kDsOffset = kDoOffset + STAGES * Shape::kQueryElements;
  static constexpr int kElements = kDsOffset + 2 * Shape::kScoreElements;
  static constexpr int kStatsOffsetBytes = kElements * static_cast<int>(sizeof(T));
  static constexpr int kDqOffsetBytes = kStatsOffsetBytes + STAGES * 2 * BLOCK_M * static_cast<int>(sizeof(float));
  static constexpr int kBarrierOffsetBytes =
      kDqOffsetBytes + kConsumers * 64 * Shape::kDqPitch * static_cast<int>(sizeof(float));
  static constexpr int kBarriers = 1 + 2 * STAGES;
  static constexpr int kBytes = kBarrierOffsetBytes + 8 * kBarriers;
  // Registers per thread, as the warp-specialised forward splits them: the launch reserves
  // kLaunchRegisters for every thread, the producer keeps 24 and the consumers share the rest.
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kShare = (kLaunchRegisters * (kConsumers + 1) - kProducerRegisters) / kConsumers / 8 * 8;
  static constexpr int kConsumerRegisters = kShare > 240 ? 240 : kShare;

  static_assert(!Shape::kSharedKeys, "each consumer owns 64 keys and every column of their dK and dV");
  static_assert(BLOCK_M <= 128, "a producer thread copies one row of LSE and Delta per tile");
  static_assert(STAGES >= 2 && STAGES <= 4, "two to four query-tile slots");
  static_assert(kDqOffsetBytes % 16 == 0, "staged dQ rows are 16-byte aligned, as the copy engine's bulk reductions need");
  static_assert(kBytes <= 227 * 1024, "the tiles must fit sm_90's 227 KiB of shared memory");
};

// The consumers' named barrier (0 is __syncthreads').
constexpr unsigned int kConsumersBarrier = 1;

}  // namespace flash

template <typename T, int HEAD_DIM, int BLOCK_M, int STAGES, bool WRITE_DQ, bool SCORE_MODS>
__global__ void __launch_bounds__(384, 1)
    flash_backward_dkdv_warp_specialised(const __grid_constant__ FlashBackwardTmaParams p) {
  using Tiles = flash::WarpSpecialisedKeyBlockTiles<T, HEAD_DIM, BLOCK_M, STAGES>;
  using Warpgroup = flash::KeyBlockWarpgroup<typename Tiles::Shape, T, WRITE_DQ, SCORE_MODS>;
  static_assert(Tiles::kThreads == 384, "the launch bound is the layout's threads");
  constexpr int kBlockN = Tiles::kBlockN;
  constexpr int kBlockM = Tiles::kBlockM;
  constexpr int kConsumerThreads = 128 * Tiles::kConsumers;
  extern __shared__ __align__(1024) unsigned char shared_bytes[];
  T* const shared = reinterpret_cast<T*>(shared_bytes);
  float* const stats = reinterpret_cast<float*>(shared_bytes + Tiles::kStatsOffsetBytes);

  const flash::KeyBlock block = flash::key_block_of<kBlockN, HEAD_DIM>(blockIdx.x, p);
  if (block.batch_index < 0) return;  // past the work list's last key block; before any barrier
  const int batch_index = block.batch_index;
  const Sequence seq_q = query_sequence(p, batch_index, p.max_seqlen_q);
  const Sequence seq_k = key_sequence(p, batch_index, p.max_seqlen_k);
  const int len_q = seq_q.length;
  const int len_k = seq_k.length;
  const int n0 = block.n_block * kBlockN;
  if (n0 >= len_k) return;  // no key of this sequence here; uniform over the block, before any barrier
  const int keys = len_k - n0 < kBlockN ? len_k - n0 : kBlockN;

  // Every query head of the KV head's group walks the same query tiles; the work list is (group head,
  // query tile) flattened, so the copies run ahead across heads.
  const flash::QueryTiles seeing =
      flash::query_tiles_seeing<kBlockM>(n0, keys, len_q, len_k - len_q, key_window(p));
  const int group = p.heads_q / p.heads_kv;
  const int first_head = block.head_kv * group;
  const int tiles = group * seeing.count;  // zero: no query sees these keys, and dK = dV = 0 is written
  auto head_of = [&](int i) { return first_head + i / seeing.count; };
  auto m0_of = [&](int i) { return (seeing.first + i % seeing.count) * kBlockM; };
  auto rows_of = [&](int m0) { return len_q - m0 < kBlockM ? len_q - m0 : kBlockM; };

  const flash::KeyBlockTilesAt<T> at{shared + Tiles::kKOffset,
                                     shared + Tiles::kVOffset,
                                     shared + Tiles::kQOffset,
                                     shared + Tiles::kDoOffset,
                                     shared + Tiles::kDsOffset,
                                     nullptr,
                                     reinterpret_cast<float*>(shared_bytes + Tiles::kDqOffsetBytes)};
  // Barrier addresses: K and V's full, then per slot s: full, empty. Item i goes to slot i % STAGES,
  // the slot's (i / STAGES)-th use.
  const unsigned int barriers = mma::shared_address(shared_bytes + Tiles::kBarrierOffsetBytes);
  const unsigned int kv_full = barriers;
  auto full = [&](int s) { return barriers + 8u * (1 + 2 * s); };
  auto empty = [&](int s) { return barriers + 8u * (2 + 2 * s); };
  auto phase = [](int i) { return static_cast<unsigned int>(i / STAGES) & 1u; };

  if (threadIdx.x == 0) {
    mbarrier::init(kv_full, 128);
    for (int s = 0; s < STAGES; ++s) {
      mbarrier::init(full(s), 128 + 1);  // each producer thread's copies, and the leader's arrival
      mbarrier::init(empty(s), kConsumerThreads);
    }
    mbarrier::publish_inits();
  }
  __syncthreads();  // the last block-wide barrier: from here the roles meet only at mbarriers

  if (threadIdx.x < 128) {
    // ---- producer ----
    release_registers_to<Tiles::kProducerRegisters>();
    const bool leader = threadIdx.x == 0;
    {
      const long long token = seq_k.start + n0;
      flash::produce_tile<T, HEAD_DIM, kBlockN, flash::TileTail::kZeroByCopy>(
          at.k, static_cast<const T*>(p.k) + batch_index * p.k_batch_stride + token * p.k_token_stride +
                    block.head_kv * p.k_head_stride,
          p.k_token_stride, keys);
      flash::produce_tile<T, HEAD_DIM, kBlockN, flash::TileTail::kZeroByCopy>(
          at.v, static_cast<const T*>(p.v) + batch_index * p.v_batch_stride + token * p.v_token_stride +
                    block.head_kv * p.v_head_stride,
          p.v_token_stride, keys);
      mbarrier::arrive_when_copies_land(kv_full);
    }
    // A varlen call's arrays are one batch of tokens (batch stride 0), its maps one batch deep.
    const int q_batch = p.q_batch_stride != 0 ? batch_index : 0;
    const int do_batch = p.dout_batch_stride != 0 ? batch_index : 0;
    for (int i = 0; i < tiles; ++i) {
      const int s = i % STAGES;
      const int head = head_of(i);
      const int m0 = m0_of(i);
      const int rows = rows_of(m0);
      const long long token = seq_q.start + m0;
      mbarrier::wait(empty(s), phase(i) ^ 1u);
      T* const q_slot = at.q_slots + s * Tiles::kQueryElements;
      T* const do_slot = at.do_slots + s * Tiles::kQueryElements;
      if (threadIdx.x < kBlockM) {
        const int r = threadIdx.x < rows ? threadIdx.x : 0;  // a zero row's copy still names a real address
        float* const lse_slot = stats + s * 2 * kBlockM;
        copy_async_4_or_zero(
            lse_slot + threadIdx.x,
            static_cast<const float*>(p.lse) + batch_index * p.lse_batch_stride + head * p.lse_head_stride + token + r,
            threadIdx.x < rows);
        copy_async_4_or_zero(lse_slot + kBlockM + threadIdx.x,
                                       static_cast<const float*>(p.softmax_d) + batch_index * p.softmax_d_batch_stride +
                                           head * p.softmax_d_head_stride + token + r,
                                       threadIdx.x < rows);
      }
      if (rows == kBlockM) {
        if (leader) {
          mbarrier::arrive_expecting(full(s), 2 * Tiles::kQueryElements * static_cast<int>(sizeof(T)));
          for (int c = 0; c < Tiles::kRowElements; c += 64) {
            load_tile(q_slot + c * kBlockM, &p.q_map, c, head, static_cast<int>(token), q_batch, full(s));
            load_tile(do_slot + c * kBlockM, &p.dout_map, c, head, static_cast<int>(token), do_batch, full(s));
          }
        }
      } else {
        flash::produce_tile<T, HEAD_DIM, kBlockM, flash::TileTail::kZeroByCopy>(
            q_slot, static_cast<const T*>(p.q) + batch_index * p.q_batch_stride + token * p.q_token_stride +
                        head * p.q_head_stride,
            p.q_token_stride, rows);
        flash::produce_tile<T, HEAD_DIM, kBlockM, flash::TileTail::kZeroByCopy>(
            do_slot, static_cast<const T*>(p.dout) + batch_index * p.dout_batch_stride +
                         token * p.dout_token_stride + head * p.dout_head_stride,
            p.dout_token_stride, rows);
        if (leader) mbarrier::arrive(full(s));
      }
      mbarrier::arrive_when_copies_land(full(s));
    }
    mma::wait_async_copies();  // no thread leaves with copies in flight
    return;
  }

  // ---- consumers ----
  claim_registers_to<Tiles::kConsumerRegisters>();
  const unsigned int thread = threadIdx.x - 128;
  const Warpgroup warpgroup(p, at, batch_index, seq_q, len_k, n0, first_head, thread);
  float dk[Warpgroup::kDTiles][4];
  float dv[Warpgroup::kDTiles][4];
#pragma unroll
  for (int d = 0; d < Warpgroup::kDTiles; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.0f;

  // K and V (cp.async: the generic proxy) before the tensor cores read them; also before the epilogue
  // stages dK and dV over them, tiles or none.
  mbarrier::wait(kv_full, 0);
  wgmma::fence_shared_for_async_proxy();
  for (int i = 0; i < tiles; ++i) {
    const int s = i % STAGES;
    const int m0 = m0_of(i);
    mbarrier::wait(full(s), phase(i));
    if (rows_of(m0) < kBlockM) wgmma::fence_shared_for_async_proxy();  // copied by the producer's threads
    const float* const lse_slot = stats + s * 2 * kBlockM;
    warpgroup.query_tile(dk, dv, head_of(i), m0, s, lse_slot, lse_slot + kBlockM, (i & 1) * Tiles::kScoreElements,
                         [] { barrier_sync<kConsumerThreads>(flash::kConsumersBarrier); });
    mbarrier::arrive(empty(s));  // every product reading the slot has completed
  }
  // dQ's last additions are complete before the block's shared memory is released, and every consumer
  // is done reading K and V, which now stage dK and dV for wide stores.
  warpgroup.finish_dq();
  barrier_sync<kConsumerThreads>(flash::kConsumersBarrier);

  // ---- epilogue: dK and dV through the K and V tiles, rows past the sequence skipped ----
  warpgroup.stage_gradients(dk, dv);
  barrier_sync<kConsumerThreads>(flash::kConsumersBarrier);
  flash::write_gradients<T, HEAD_DIM, kBlockN, kConsumerThreads>(p, at.k, at.v, batch_index, block.head_kv,
                                                                 seq_k.start + n0, keys, thread);
}

}  // namespace hipattn
