// A CPU stand-in for an AMD GPU (wave64, MFMA 16x16x16), for running the AMD kernels in tests on a
// machine without one: tests/support/emulation.py compiles a kernel's compile unit with g++, this header
// force-included and HIPATTN_EMULATION defined (kernels/common/platform.h then takes its AMD
// branches).
//
// Every GPU thread of a block is a fiber (ucontext) on one OS thread, so the block's threads run one
// at a time and switch only where the hardware makes them meet: __syncthreads (the block), and the
// cross-lane operations, which exchange values through per-lane slots between two barriers of the
// lanes taking part: __shfl_xor's aligned group of `width` lanes (the kernels' contract: every lane
// of the group calls it, other groups of the wave may be elsewhere), and an MFMA's whole wave. Blocks run one after another. Shared memory is one buffer (dynamic) and function-
// local statics (__shared__ arrays); global memory is host memory. Because fibers never preempt each
// other, a read-modify-write (atomicAdd) is atomic.
//
// What this checks: the kernels' indexing, masking, reductions and synchronisation, and their use of
// the MFMA fragment layouts as AMD's matrix instruction calculator documents them (the layouts below
// are written from that description, not from the kernels). What it cannot: timing, memory-model
// subtleties beyond barriers, and the hardware's own rounding inside an MFMA (fp32 here).
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n)
#define __launch_bounds__(...)
#define __AMDGCN_WAVEFRONT_SIZE 64
#define __gfx90a__ 1

// The block's dynamic shared memory: kernels declare `extern __shared__ ... shared_bytes[]` inside
// namespace hipattn, which tests/support/emulation.py turns into a plain extern declaration of this array.
namespace hipattn {
constexpr unsigned int kEmulatedSharedBytes = 256 * 1024;
alignas(1024) inline unsigned char shared_bytes[kEmulatedSharedBytes];
}  // namespace hipattn

namespace hipattn_emulation {

constexpr int kWave = __AMDGCN_WAVEFRONT_SIZE;
constexpr int kMfmaTile = 16;

struct Dim3 {
  unsigned int x, y, z;
};

struct Fiber {
  ucontext_t context;
  Dim3 index;
  bool done;
};

// One block's fibers and their meeting points. Barriers count generations: a fiber that arrives
// waits until the generation moves on, which the last live arrival does.
struct Block {
  std::vector<Fiber> fibers;
  std::vector<char> stacks;
  ucontext_t scheduler;
  int current = 0;
  int live = 0;
  Dim3 block_dim{1, 1, 1}, grid_dim{1, 1, 1}, block_index{0, 0, 0};
  long long block_arrived = 0, block_generation = 0;
  // Lane-group barriers, per (wave, log2 width, first lane of the group).
  std::vector<int> group_arrived;
  std::vector<long long> group_generation;
  std::vector<unsigned char> exchange;  // per wave: kWave lanes x 2 slots of 16 bytes
  long long releases = 0;               // barrier releases and finished fibers: progress, for deadlocks
  void (*body)(const void*) = nullptr;
  const void* params = nullptr;
};

inline Block& block() {
  static Block b;
  return b;
}

inline int thread_rank() {
  const Block& b = block();
  const Dim3 t = b.fibers[b.current].index;
  return static_cast<int>(t.x + b.block_dim.x * (t.y + b.block_dim.y * t.z));
}

inline void yield() {
  Block& b = block();
  swapcontext(&b.fibers[b.current].context, &b.scheduler);
}

inline void block_barrier() {
  Block& b = block();
  const long long generation = b.block_generation;
  if (++b.block_arrived == b.live) {
    b.block_arrived = 0;
    ++b.block_generation;
    ++b.releases;
    return;
  }
  while (b.block_generation == generation) yield();
}

constexpr int kWidthLevels = 7;  // group widths 1, 2, ..., 64

inline int width_level(int width) {
  int level = 0;
  while ((1 << level) < width) ++level;
  return level;
}

// The barrier slot of the aligned group of `width` lanes that `rank` belongs to, and its live lanes.
inline size_t group_slot(int rank, int width) {
  const int wave = rank / kWave;
  const int first = (rank % kWave) & ~(width - 1);
  return (static_cast<size_t>(wave) * kWidthLevels + width_level(width)) * kWave + first;
}

inline int group_live(int rank, int width) {
  const Block& b = block();
  const int first = rank - (rank % kWave) + ((rank % kWave) & ~(width - 1));
  int live = 0;
  for (int r = first; r < first + width && r < static_cast<int>(b.fibers.size()); ++r) live += !b.fibers[r].done;
  return live;
}

inline void group_barrier(int width) {
  Block& b = block();
  const int rank = thread_rank();
  const size_t slot = group_slot(rank, width);
  const long long generation = b.group_generation[slot];
  if (++b.group_arrived[slot] == group_live(rank, width)) {
    b.group_arrived[slot] = 0;
    ++b.group_generation[slot];
    ++b.releases;
    return;
  }
  while (b.group_generation[slot] == generation) yield();
}

// This lane's exchange slot `slot` (16 bytes), and lane `lane`'s of the same wave.
inline unsigned char* slot_of(int lane, int slot) {
  Block& b = block();
  const int wave = thread_rank() / kWave;
  return b.exchange.data() + ((static_cast<size_t>(wave) * kWave + lane) * 2 + slot) * 16;
}

inline int lane_id() { return thread_rank() % kWave; }

// HIP's __shfl_xor: the value of lane (lane ^ mask) within the caller's aligned group of `width`
// lanes; a source outside the group reads the caller's own value.
inline float shfl_xor(float value, int lane_mask, int width) {
  const int lane = lane_id();
  std::memcpy(slot_of(lane, 0), &value, sizeof value);
  group_barrier(width);
  int source = lane ^ lane_mask;
  if (source >= ((lane + width) & ~(width - 1))) source = lane;
  float result;
  std::memcpy(&result, slot_of(source, 0), sizeof result);
  group_barrier(width);
  return result;
}

// D = A B + C for one 16x16x16 MFMA, fp32 accumulation. With column = lane % 16 and quarter =
// lane / 16 (AMD's matrix instruction calculator, v_mfma_f32_16x16x16f16 / bf16_1k): a lane holds
// A[column][4 quarter + e], B[4 quarter + e][column] and C, D[4 quarter + e][column], e = 0..3.
template <typename Operand, typename Accumulator, typename ToFloat>
inline Accumulator mfma_16x16x16(Operand a, Operand b, Accumulator c, ToFloat to_float) {
  static_assert(sizeof(Operand) == 8 && sizeof(Accumulator) == 16, "four 16-bit operands, four fp32 sums");
  const int lane = lane_id();
  std::memcpy(slot_of(lane, 0), &a, sizeof a);
  std::memcpy(slot_of(lane, 1), &b, sizeof b);
  group_barrier(kWave);
  const int column = lane % kMfmaTile;
  const int quarter = lane / kMfmaTile;
  Accumulator d = c;
  for (int e = 0; e < 4; ++e) {
    const int row = 4 * quarter + e;
    float sum = 0.0f;
    for (int k = 0; k < kMfmaTile; ++k) {
      unsigned short a_bits, b_bits;
      std::memcpy(&a_bits, slot_of(row + kMfmaTile * (k / 4), 0) + 2 * (k % 4), 2);
      std::memcpy(&b_bits, slot_of(column + kMfmaTile * (k / 4), 1) + 2 * (k % 4), 2);
      sum += to_float(a_bits) * to_float(b_bits);
    }
    d[e] += sum;
  }
  group_barrier(kWave);
  return d;
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

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "hipattn emulation: %s\n", what);
  std::abort();
}

inline void fiber_entry() {
  Block& b = block();
  b.body(b.params);
  Fiber& self = b.fibers[b.current];
  self.done = true;
  --b.live;
  ++b.releases;
  // Threads that have exited no longer hold a barrier up.
  if (b.live > 0 && b.block_arrived == b.live) {
    b.block_arrived = 0;
    ++b.block_generation;
  }
  const int rank = thread_rank();
  for (int width = 1; width <= kWave; width *= 2) {
    const size_t slot = group_slot(rank, width);
    if (b.group_arrived[slot] > 0 && b.group_arrived[slot] == group_live(rank, width)) {
      b.group_arrived[slot] = 0;
      ++b.group_generation[slot];
    }
  }
  swapcontext(&self.context, &b.scheduler);
}

// Run `body(params)` over the grid, block by block. Returns 0, or 1 on a deadlock (threads of a
// block waiting at a barrier that the others never reach).
inline int launch(Dim3 grid, Dim3 block_dim, void (*body)(const void*), const void* params) {
  constexpr size_t kStack = 256 * 1024;
  Block& b = block();
  const int threads = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  const int waves = (threads + kWave - 1) / kWave;
  b.fibers.assign(threads, Fiber{});
  if (b.stacks.size() < threads * kStack) b.stacks.resize(threads * kStack);
  b.exchange.assign(static_cast<size_t>(waves) * kWave * 2 * 16, 0);
  b.block_dim = block_dim;
  b.grid_dim = grid;
  b.body = body;
  b.params = params;
  for (unsigned int bz = 0; bz < grid.z; ++bz)
    for (unsigned int by = 0; by < grid.y; ++by)
      for (unsigned int bx = 0; bx < grid.x; ++bx) {
        b.block_index = Dim3{bx, by, bz};
        // Shared memory starts each block as garbage, as on the GPU: NaN in every 16- and 32-bit float.
        std::memset(hipattn::shared_bytes, 0xff, sizeof hipattn::shared_bytes);
        b.live = threads;
        b.block_arrived = 0;
        b.group_arrived.assign(static_cast<size_t>(waves) * kWidthLevels * kWave, 0);
        b.group_generation.assign(static_cast<size_t>(waves) * kWidthLevels * kWave, 0);
        for (int t = 0; t < threads; ++t) {
          Fiber& f = b.fibers[t];
          f.index = Dim3{t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y)};
          f.done = false;
          getcontext(&f.context);
          f.context.uc_stack.ss_sp = b.stacks.data() + t * kStack;
          f.context.uc_stack.ss_size = kStack;
          f.context.uc_link = nullptr;
          makecontext(&f.context, fiber_entry, 0);
        }
        int idle_passes = 0;
        while (b.live > 0) {
          const long long before = b.releases;
          for (int t = 0; t < threads; ++t) {
            if (b.fibers[t].done) continue;
            b.current = t;
            swapcontext(&b.scheduler, &b.fibers[t].context);
          }
          idle_passes = b.releases == before ? idle_passes + 1 : 0;
          if (idle_passes > 2) return 1;
        }
      }
  return 0;
}

}  // namespace hipattn_emulation

#define threadIdx (::hipattn_emulation::block().fibers[::hipattn_emulation::block().current].index)
#define blockIdx (::hipattn_emulation::block().block_index)
#define blockDim (::hipattn_emulation::block().block_dim)
#define gridDim (::hipattn_emulation::block().grid_dim)

inline void __syncthreads() { ::hipattn_emulation::block_barrier(); }
inline float __shfl_xor(float value, int lane_mask, int width) {
  return ::hipattn_emulation::shfl_xor(value, lane_mask, width);
}
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
