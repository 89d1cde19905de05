// A CPU stand-in for a GPU, for running hipattn's kernels in tests on a machine without one:
// tests/support/emulation.py compiles a kernel's compile unit with g++, this header force-included
// and HIPATTN_EMULATION defined. The device is an AMD gfx90a (wave64, MFMA 16x16x16:
// emulated_gfx90a.h), or, with HIPATTN_EMULATED_NVIDIA also defined, an NVIDIA sm_80 (warp32,
// mma.sync, ldmatrix, cp.async, named barriers: emulated_sm80.h); kernels/common/platform.h then
// takes that vendor's branches.
//
// Every GPU thread of a block is a fiber (fibers.h) on one OS thread, so the block's threads run one
// at a time and switch only where the hardware makes them meet: block barriers (__syncthreads, and
// NVIDIA's named barriers), and the cross-lane operations, which exchange values through per-lane
// slots at a barrier of the lanes taking part (a Collective): __shfl_xor's aligned group of lanes
// (the kernels' contract: every lane of the group calls it, other groups of the wave may be
// elsewhere), an MFMA's whole wave, an mma.sync's or ldmatrix's whole warp. A thread runs until it
// waits at such a point, so it runs ahead of the threads it has not synchronised with, and reads
// what they have not written yet. Blocks run one after another. Shared memory is one buffer
// (dynamic) and function-local statics (__shared__ arrays); global memory is host memory. Because
// fibers never preempt each other, a read-modify-write (atomicAdd) is atomic.
//
// What this checks: the kernels' indexing, masking, reductions and synchronisation, and their use of
// the vendor's fragment layouts as its documentation gives them (written from that description, not
// from the kernels). What it cannot: timing, memory-model subtleties beyond barriers, and the
// hardware's own rounding inside a matrix instruction (fp32 sums in k order here). A kernel error the
// emulation detects (a barrier that deadlocks, lanes of a warp at different collective operations, an
// access outside the block's shared memory) ends the launch with a message instead of a result.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fibers.h"

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n)
#define __launch_bounds__(...)

// The block's dynamic shared memory: kernels declare `extern __shared__ ... shared_bytes[]`, which
// tests/support/emulation.py turns into a pointer to this array.
namespace hipattn {
constexpr unsigned int kEmulatedSharedBytes = 256 * 1024;
alignas(1024) inline unsigned char shared_bytes[kEmulatedSharedBytes];
}  // namespace hipattn

namespace hipattn_emulation {

// Lanes that execute in lockstep: a wave (AMD) or a warp (NVIDIA).
#if defined(HIPATTN_EMULATED_NVIDIA)
constexpr int kWave = 32;
#else
constexpr int kWave = 64;
#endif

struct Dim3 {
  unsigned int x, y, z;
};

struct Fiber {
  Context context;
  Dim3 index;
  bool done;
};

// Barriers count generations: a thread that arrives waits until the generation moves on, which the
// last arrival does.
struct Barrier {
  int arrived = 0;
  int expected = 0;  // named barriers: the thread count the arrivals of this generation named
  long long generation = 0;
};

// Barrier 0 is __syncthreads's; NVIDIA's named barriers are 1..15.
constexpr int kBlockBarriers = 16;

// What one lane of a collective operation puts down for the others: three 16-byte slots of operands.
struct LaneSlots {
  unsigned char bytes[3][16];
};

constexpr int kWidthLevels = 7;  // lane-group widths 1, 2, ..., 64

struct Block {
  std::vector<Fiber> fibers;
  std::vector<unsigned char> stacks;
  Context scheduler;
  int current = 0;
  int live = 0;
  Dim3 block_dim{1, 1, 1}, grid_dim{1, 1, 1}, block_index{0, 0, 0};
  unsigned int dynamic_shared_bytes = 0;
  Barrier barriers[kBlockBarriers];
  // Lane-group barriers, per (wave, width level, first lane of the group): the group's lanes that have
  // not exited, its arrivals, and the tag of the operation its lanes of this generation meet at.
  std::vector<int> group_live;
  std::vector<int> group_arrived;
  std::vector<long long> group_generation;
  std::vector<unsigned int> group_tag;
  // Collective operations' slots, per (wave, width level, parity, lane); and per (thread, width
  // level) how many the thread has taken part in, whose parity picks the set of slots.
  std::vector<LaneSlots> exchange;
  std::vector<unsigned int> collectives;
  long long releases = 0;  // barrier releases and finished fibers: progress, for deadlocks
  std::string error;       // set by fail(): the launch ends with it
  void (*body)(const void*) = nullptr;
  const void* params = nullptr;
};

inline Block& block() {
  static Block b;
  return b;
}

// The vendor's per-thread state (emulated_gfx90a.h, emulated_sm80.h): reset as a block starts, and
// checked as each thread ends.
inline void on_block_start(int threads);
inline void on_thread_exit(int rank);

inline int thread_rank() {
  const Block& b = block();
  const Dim3 t = b.fibers[b.current].index;
  return static_cast<int>(t.x + b.block_dim.x * (t.y + b.block_dim.y * t.z));
}

inline int lane_id() { return thread_rank() % kWave; }

inline void yield() {
  Block& b = block();
  switch_context(b.fibers[b.current].context, b.scheduler);
}

// Ends the launch: the scheduler sees the error and returns it; this fiber is never resumed.
[[noreturn]] inline void fail(const std::string& what) {
  Block& b = block();
  if (b.error.empty()) {
    const Dim3 i = b.block_index;
    b.error = "block (" + std::to_string(i.x) + ", " + std::to_string(i.y) + ", " + std::to_string(i.z) +
              "), thread " + std::to_string(thread_rank()) + ": " + what;
  }
  yield();
  std::abort();  // not reached: the scheduler abandons a failed launch
}

// Arrive at `barrier` and wait for the rest of its `expected` arrivals.
inline void arrive(Barrier& barrier, int expected) {
  Block& b = block();
  const long long generation = barrier.generation;
  if (++barrier.arrived == expected) {
    barrier.arrived = 0;
    ++barrier.generation;
    ++b.releases;
    return;
  }
  while (barrier.generation == generation) yield();
}

// __syncthreads: every thread of the block that has not exited.
inline void sync_block() { arrive(block().barriers[0], block().live); }

// Named barrier `id` for `threads` threads: every arrival of one generation must name the same count.
inline void named_barrier(int id, int threads) {
  Barrier& barrier = block().barriers[id];
  if (barrier.arrived == 0) barrier.expected = threads;
  if (barrier.expected != threads)
    fail("barrier " + std::to_string(id) + " reached for " + std::to_string(threads) +
         " threads while others wait at it for " + std::to_string(barrier.expected));
  arrive(barrier, threads);
}

inline int width_level(int width) {
  int level = 0;
  while ((1 << level) < width) ++level;
  return level;
}

// The barrier slot of the aligned group of `width` lanes that `rank` belongs to.
inline size_t group_slot(int rank, int width) {
  const int wave = rank / kWave;
  const int first = (rank % kWave) & ~(width - 1);
  return (static_cast<size_t>(wave) * kWidthLevels + width_level(width)) * kWave + first;
}

// Tags of collective operations: the operation in the high bits, its variant (width, matrix count,
// type) in the low ones, and kWholeGroup where every lane of the group must take part: a lane that has
// exited makes the operation an error, not a smaller group.
constexpr unsigned int kWholeGroup = 1u << 31;

inline std::string tag_name(unsigned int tag);  // the vendor's names, for messages

// The barrier of the caller's aligned group of `width` lanes at the operation `tag`; every lane that
// arrives in one generation must come for the same operation.
inline void group_barrier(int width, unsigned int tag) {
  Block& b = block();
  const int rank = thread_rank();
  const size_t slot = group_slot(rank, width);
  if (b.group_arrived[slot] == 0) {
    b.group_tag[slot] = tag;
  } else if (b.group_tag[slot] != tag) {
    fail("lanes of a wave at different operations: this one at " + tag_name(tag) + ", others of its group at " +
         tag_name(b.group_tag[slot]));
  }
  const long long generation = b.group_generation[slot];
  const int live = b.group_live[slot];
  if (++b.group_arrived[slot] == live) {
    if ((tag & kWholeGroup) && live < width)
      fail(tag_name(tag) + " with " + std::to_string(live) + " of its " + std::to_string(width) +
           " lanes: the others have exited");
    b.group_arrived[slot] = 0;
    ++b.group_generation[slot];
    ++b.releases;
    return;
  }
  while (b.group_generation[slot] == generation) yield();
}

inline LaneSlots* slot_set(int rank, int level, unsigned int parity) {
  Block& b = block();
  const int wave = rank / kWave;
  return b.exchange.data() + ((static_cast<size_t>(wave) * kWidthLevels + level) * 2 + parity) * kWave;
}

// One collective operation of the calling lane with the other lanes of its aligned group of `width`:
// fill mine(), meet(), then read of(lane). A group's lanes alternate between two sets of slots from
// one operation to the next, so one barrier per operation suffices: a lane writes a set again only
// past the next operation's barrier, which the group's lanes reach only once done reading this one.
class Collective {
 public:
  Collective(int width, unsigned int tag) : width_(width), tag_(tag) {
    Block& b = block();
    rank_ = thread_rank();
    level_ = width_level(width);
    const unsigned int count = b.collectives[static_cast<size_t>(rank_) * kWidthLevels + level_]++;
    slots_ = slot_set(rank_, level_, count & 1u);
  }

  unsigned char* mine(int slot) { return slots_[rank_ % kWave].bytes[slot]; }
  const unsigned char* of(int lane, int slot) const { return slots_[lane].bytes[slot]; }

  void meet() { group_barrier(width_, tag_); }

 private:
  int width_;
  unsigned int tag_;
  int rank_ = 0;
  int level_ = 0;
  LaneSlots* slots_ = nullptr;
};

// The value of lane (lane ^ lane_mask) of the caller's aligned group of `width` lanes, HIP's and
// CUDA's rule alike: a source past the end of the group reads the caller's own value.
inline int xor_source(int lane, int lane_mask, int width) {
  const int source = lane ^ lane_mask;
  return source >= ((lane + width) & ~(width - 1)) ? lane : source;
}

inline float bf16_bits_to_float(unsigned short bits) {
  const unsigned int word = static_cast<unsigned int>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

inline float half_bits_to_float(unsigned short bits) {
  _Float16 value;
  std::memcpy(&value, &bits, sizeof value);
  return static_cast<float>(value);
}

inline void release_on_exit(int rank) {
  Block& b = block();
  // Threads that have exited no longer hold up __syncthreads.
  Barrier& all = b.barriers[0];
  if (b.live > 0 && all.arrived > 0 && all.arrived == b.live) {
    all.arrived = 0;
    ++all.generation;
  }
  for (int width = 1; width <= kWave; width *= 2) {
    const size_t slot = group_slot(rank, width);
    --b.group_live[slot];
    if (b.group_arrived[slot] > 0 && b.group_arrived[slot] == b.group_live[slot]) {
      if (b.group_tag[slot] & kWholeGroup) fail("exits while lanes of its group wait at " + tag_name(b.group_tag[slot]));
      b.group_arrived[slot] = 0;
      ++b.group_generation[slot];
    }
  }
}

[[noreturn]] inline void fiber_entry() {
  Block& b = block();
  b.body(b.params);
  on_thread_exit(thread_rank());
  Fiber& self = b.fibers[b.current];
  self.done = true;
  --b.live;
  ++b.releases;
  release_on_exit(thread_rank());
  switch_context(self.context, b.scheduler);
  std::abort();  // a finished fiber is never resumed
}

// Launch results, as tests/support/emulation.py reads them.
constexpr int kLaunched = 0;
constexpr int kDeadlock = 1;
constexpr int kFailed = 2;  // block().error says why

// Run `body(params)` over the grid, block by block, with `shared_bytes` of dynamic shared memory.
inline int launch(Dim3 grid, Dim3 block_dim, unsigned int shared_bytes, void (*body)(const void*),
                  const void* params) {
  constexpr size_t kStack = 256 * 1024;
  Block& b = block();
  const int threads = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  const int waves = (threads + kWave - 1) / kWave;
  b.error.clear();
  if (shared_bytes > hipattn::kEmulatedSharedBytes) {
    b.error = std::to_string(shared_bytes) + " bytes of dynamic shared memory: the emulation has " +
              std::to_string(hipattn::kEmulatedSharedBytes);
    return kFailed;
  }
  b.fibers.assign(threads, Fiber{});
  if (b.stacks.size() < threads * kStack) b.stacks.resize(threads * kStack);
  b.block_dim = block_dim;
  b.grid_dim = grid;
  b.dynamic_shared_bytes = shared_bytes;
  b.body = body;
  b.params = params;
  for (unsigned int bz = 0; bz < grid.z; ++bz)
    for (unsigned int by = 0; by < grid.y; ++by)
      for (unsigned int bx = 0; bx < grid.x; ++bx) {
        b.block_index = Dim3{bx, by, bz};
        // Shared memory starts each block as garbage, as on the GPU: NaN in every 16- and 32-bit float.
        std::memset(hipattn::shared_bytes, 0xff, sizeof hipattn::shared_bytes);
        b.live = threads;
        for (Barrier& barrier : b.barriers) barrier = Barrier{};
        b.group_live.assign(static_cast<size_t>(waves) * kWidthLevels * kWave, 0);
        for (int t = 0; t < threads; ++t)
          for (int width = 1; width <= kWave; width *= 2) ++b.group_live[group_slot(t, width)];
        b.group_arrived.assign(static_cast<size_t>(waves) * kWidthLevels * kWave, 0);
        b.group_generation.assign(static_cast<size_t>(waves) * kWidthLevels * kWave, 0);
        b.group_tag.assign(static_cast<size_t>(waves) * kWidthLevels * kWave, 0);
        b.exchange.assign(static_cast<size_t>(waves) * kWidthLevels * 2 * kWave, LaneSlots{});
        b.collectives.assign(static_cast<size_t>(threads) * kWidthLevels, 0);
        on_block_start(threads);
        for (int t = 0; t < threads; ++t) {
          Fiber& f = b.fibers[t];
          f.index = Dim3{t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y)};
          f.done = false;
          start_context(f.context, b.stacks.data() + t * kStack, kStack, fiber_entry);
        }
        int idle_passes = 0;
        while (b.live > 0) {
          const long long before = b.releases;
          for (int t = 0; t < threads; ++t) {
            if (b.fibers[t].done) continue;
            b.current = t;
            switch_context(b.scheduler, b.fibers[t].context);
            if (!b.error.empty()) return kFailed;
          }
          idle_passes = b.releases == before ? idle_passes + 1 : 0;
          if (idle_passes > 2) return kDeadlock;
        }
      }
  return kLaunched;
}

}  // namespace hipattn_emulation

#define threadIdx (::hipattn_emulation::block().fibers[::hipattn_emulation::block().current].index)
#define blockIdx (::hipattn_emulation::block().block_index)
#define blockDim (::hipattn_emulation::block().block_dim)
#define gridDim (::hipattn_emulation::block().grid_dim)

inline void __syncthreads() { ::hipattn_emulation::sync_block(); }
inline float __uint_as_float(unsigned int bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
inline unsigned int __float_as_uint(float value) {
  unsigned int bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}
inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}

#if defined(HIPATTN_EMULATED_NVIDIA)
#include "emulated_sm80.h"
#else
#include "emulated_gfx90a.h"
#endif
