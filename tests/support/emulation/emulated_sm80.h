// The NVIDIA sm_80 of the emulated device (emulated_device.h): warp32, and the PTX instructions the
// mma.sync kernels use. kernels/common/platform.h, types.h and mma_nvidia.h call these in their
// HIPATTN_EMULATION branches, one function per instruction, its operands in the instruction's order.
// Semantics and fragment layouts are PTX ISA's description of each instruction (written from that
// description, not from the kernels).
//
// Shared memory is addressed as the hardware's shared window: a shared address (cvta.to.shared) is
// the byte offset into the block's dynamic shared memory, and ldmatrix and cp.async check theirs
// against the bytes the launch reserved and against their alignment. Three choices make missing
// synchronisation visible:
//   - cp.async copies land when a wait of the issuing thread (cp.async.wait_group, wait_all) covers
//     them, not at issue: a missing or too-weak wait reads what the shared memory held before (at
//     the block's start, 0xff: NaN). A thread that exits with copies it never waited for is an error.
//   - an ldmatrix row that holds bytes a copy in flight (issued, its thread not yet past a wait that
//     covers it) writes is an error, whatever the values read are then used for.
//   - ldmatrix reads each row as the lane that gives its address arrives at the instruction: a row
//     that other lanes write (plain stores, or their copies landing at their own waits) without a
//     barrier in between is read as it was, since a thread runs until it waits (threads in rank
//     order: what a later lane writes is not there yet; what an earlier one wrote already is).
// What this cannot show: a missing barrier whose two accesses some other collective operation
// happens to order (lanes read a tile with ldmatrix, then one overwrites it with no __syncwarp in
// between, but an mma or a shuffle of all lanes is), a race whose writer runs before its reader, the
// hardware's timing, and ex2.approx's and lg2.approx's approximation error (exact here).
// bar.sync counts threads here, where the hardware counts whole warps: the same for kernels whose
// warps reach it whole.
#pragma once
#include <deque>

namespace hipattn_emulation {

enum NvidiaOperation : unsigned int {
  kShflXorSync = 1u << 8,  // variant: width
  kSyncWarp = 2u << 8,
  kLdmatrix = 3u << 8,  // variant: matrices, | kTransposed
  kMma = 4u << 8,       // variant: 0 bf16, 1 f16
  kMovmatrix = 5u << 8,
};
constexpr unsigned int kTransposed = 0x10;

inline std::string tag_name(unsigned int tag) {
  const unsigned int variant = tag & 0xffu;
  switch (tag & ~kWholeGroup & ~0xffu) {
    case kShflXorSync:
      return "__shfl_xor_sync (width " + std::to_string(variant) + ")";
    case kSyncWarp:
      return "__syncwarp";
    case kLdmatrix:
      return "ldmatrix.x" + std::to_string(variant & 0xfu) + (variant & kTransposed ? ".trans" : "");
    case kMma:
      return std::string("mma.sync.m16n8k16.") + (variant ? "f16" : "bf16");
    case kMovmatrix:
      return "movmatrix.trans";
    default:
      return "no operation";
  }
}

// ---- shared memory ----

// cvta.to.shared: the shared-window address of a generic pointer into shared memory.
inline unsigned int cvta_to_shared(const void* pointer) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(hipattn::shared_bytes);
  const uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
  if (address < base || address >= base + hipattn::kEmulatedSharedBytes)
    fail("cvta.to.shared of a pointer outside the block's dynamic shared memory");
  return static_cast<unsigned int>(address - base);
}

// Where `bytes` at shared address `address` are, after checking they are aligned to `bytes` and lie
// in the dynamic shared memory the launch reserved.
inline unsigned char* shared_at(unsigned int address, unsigned int bytes, const char* what) {
  const unsigned int reserved = block().dynamic_shared_bytes;
  if (address % bytes != 0)
    fail(std::string(what) + " at shared address " + std::to_string(address) + ", not " + std::to_string(bytes) +
         "-byte aligned");
  if (static_cast<unsigned long long>(address) + bytes > reserved)
    fail(std::string(what) + " at shared address " + std::to_string(address) + ", past the " +
         std::to_string(reserved) + " bytes of dynamic shared memory the launch reserved");
  return hipattn::shared_bytes + address;
}

// ---- cp.async: per thread, the copies issued since its last commit and its committed groups ----

struct AsyncCopy {
  unsigned int target;
  const void* source;
  unsigned int bytes;
};

struct ThreadCopies {
  std::vector<AsyncCopy> open;
  std::deque<std::vector<AsyncCopy>> committed;  // oldest first
};

inline std::vector<ThreadCopies>& async_copies() {
  static std::vector<ThreadCopies> copies;
  return copies;
}

// Per 4-byte word of the shared memory, the copies in flight (issued, not yet landed) that write it.
// An ldmatrix row that holds such a word reads bytes a copy may still be writing: a race whatever
// the values read are used for, since only a wait of the issuing thread and a barrier after it order
// a copy before another thread's read.
inline std::vector<unsigned short>& words_in_flight() {
  static std::vector<unsigned short> words;
  return words;
}

inline void count_in_flight(const AsyncCopy& copy, int change) {
  for (unsigned int word = copy.target / 4; word < (copy.target + copy.bytes) / 4; ++word)
    words_in_flight()[word] = static_cast<unsigned short>(words_in_flight()[word] + change);
}

inline void check_settled(unsigned int address, unsigned int bytes, const char* what) {
  for (unsigned int word = address / 4; word < (address + bytes) / 4; ++word)
    if (words_in_flight()[word] != 0)
      fail(std::string(what) + " at shared address " + std::to_string(address) +
           " reads bytes that a cp.async still in flight writes (its thread has not waited for it)");
}

inline void on_block_start(int threads) {
  async_copies().assign(threads, ThreadCopies{});
  words_in_flight().assign(hipattn::kEmulatedSharedBytes / 4, 0);
}

inline void on_thread_exit(int rank) {
  const ThreadCopies& copies = async_copies()[rank];
  bool pending = !copies.open.empty();
  for (const std::vector<AsyncCopy>& group : copies.committed) pending = pending || !group.empty();
  if (pending) fail("the thread exits with cp.async copies it never waited for");
}

// cp.async.{ca,cg}.shared.global [target], [source], bytes.
inline void cp_async(unsigned int target, const void* source, unsigned int bytes) {
  shared_at(target, bytes, "cp.async");
  if (reinterpret_cast<uintptr_t>(source) % bytes != 0)
    fail("cp.async of " + std::to_string(bytes) + " bytes from a global address not aligned to them");
  async_copies()[thread_rank()].open.push_back(AsyncCopy{target, source, bytes});
  count_in_flight(async_copies()[thread_rank()].open.back(), +1);
}

inline void cp_async_commit_group() {
  ThreadCopies& copies = async_copies()[thread_rank()];
  copies.committed.push_back(std::move(copies.open));
  copies.open.clear();
}

// cp.async.wait_group pending: the thread's committed groups but the newest `pending` land.
inline void cp_async_wait_group(int pending) {
  ThreadCopies& copies = async_copies()[thread_rank()];
  while (copies.committed.size() > static_cast<size_t>(pending)) {
    for (const AsyncCopy& copy : copies.committed.front()) {
      std::memcpy(hipattn::shared_bytes + copy.target, copy.source, copy.bytes);
      count_in_flight(copy, -1);
    }
    copies.committed.pop_front();
  }
}

// cp.async.wait_all: commit_group, then wait_group 0.
inline void cp_async_wait_all() {
  cp_async_commit_group();
  cp_async_wait_group(0);
}

// ---- warp-collective operations ----

// The width of the aligned group of lanes a __shfl_xor_sync or __syncwarp mask names. The kernels
// name aligned groups (platform.h's group_mask); other masks are not emulated.
inline int mask_group_width(unsigned int mask, int lane, const char* what) {
  const int width = __builtin_popcount(mask);
  const unsigned int group = width >= 32 ? 0xffffffffu : ((1u << width) - 1u) << (lane & ~(width - 1));
  if (width == 0 || (width & (width - 1)) != 0 || mask != group)
    fail(std::string(what) + " with mask " + std::to_string(mask) + ": only masks of aligned groups of lanes are emulated");
  return width;
}

// __shfl_xor_sync(mask, value, lane_mask, width): every lane of `mask` takes part; the source lane
// follows xor_source and must be one of them.
inline float shfl_xor_sync(unsigned int mask, float value, int lane_mask, int width) {
  const int lane = lane_id();
  const int group = mask_group_width(mask, lane, "__shfl_xor_sync");
  if (width < 1 || width > kWave || (width & (width - 1)) != 0)
    fail("__shfl_xor_sync of width " + std::to_string(width) + ": a power of two up to 32");
  Collective exchange(group, kWholeGroup | kShflXorSync | static_cast<unsigned int>(width));
  std::memcpy(exchange.mine(0), &value, sizeof value);
  exchange.meet();
  const int source = xor_source(lane, lane_mask, width);
  if (((mask >> source) & 1u) == 0)
    fail("__shfl_xor_sync reads lane " + std::to_string(source) + ", which its mask leaves out");
  float result;
  std::memcpy(&result, exchange.of(source, 0), sizeof result);
  return result;
}

// __syncwarp(mask): a barrier of the mask's lanes that have not exited.
inline void syncwarp(unsigned int mask) {
  Collective barrier(mask_group_width(mask, lane_id(), "__syncwarp"), kSyncWarp);
  barrier.meet();
}

// ldmatrix.sync.aligned.m8n8.xN[.trans].shared.b16: N 8x8 matrices of 16-bit elements; lane l gives
// the address of row l % 8 of matrix l / 8 (lanes 0..8N-1; the others' addresses are not read).
// Register i of a lane holds two elements of matrix i: without .trans row lane / 4, columns
// 2 (lane % 4) and 2 (lane % 4) + 1; with .trans (the matrix read column-major) column lane / 4 of
// rows 2 (lane % 4) and 2 (lane % 4) + 1. The first element is the low half.
template <int N, bool TRANS>
inline void ldmatrix(unsigned int (&r)[N], unsigned int row_address) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
  Collective exchange(kWave, kWholeGroup | kLdmatrix | N | (TRANS ? kTransposed : 0u));
  const int lane = lane_id();
  if (lane < 8 * N) {
    const unsigned char* row = shared_at(row_address, 16, "ldmatrix row");
    check_settled(row_address, 16, "ldmatrix row");
    std::memcpy(exchange.mine(0), row, 16);
  }
  exchange.meet();
  for (int i = 0; i < N; ++i) {
    unsigned short low, high;
    if (!TRANS) {
      const unsigned char* row = exchange.of(8 * i + lane / 4, 0);
      std::memcpy(&low, row + 4 * (lane % 4), 2);
      std::memcpy(&high, row + 4 * (lane % 4) + 2, 2);
    } else {
      std::memcpy(&low, exchange.of(8 * i + 2 * (lane % 4), 0) + 2 * (lane / 4), 2);
      std::memcpy(&high, exchange.of(8 * i + 2 * (lane % 4) + 1, 0) + 2 * (lane / 4), 2);
    }
    r[i] = static_cast<unsigned int>(low) | static_cast<unsigned int>(high) << 16;
  }
}

// movmatrix.sync.aligned.m8n8.trans.b16: lane l holds elements (l / 4, 2 (l % 4)) and (l / 4,
// 2 (l % 4) + 1) of an 8x8 matrix, first in the low half; it gets the same elements of the transpose,
// i.e. elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4) of the matrix.
inline unsigned int movmatrix_trans(unsigned int fragment) {
  Collective exchange(kWave, kWholeGroup | kMovmatrix);
  std::memcpy(exchange.mine(0), &fragment, sizeof fragment);
  exchange.meet();
  const int lane = lane_id();
  auto element = [&](int row, int column) {  // of the matrix: lane 4 row + column / 2, half column % 2
    unsigned int held;
    std::memcpy(&held, exchange.of(4 * row + column / 2, 0), sizeof held);
    return (held >> (16 * (column % 2))) & 0xffffu;
  };
  return element(2 * (lane % 4), lane / 4) | element(2 * (lane % 4) + 1, lane / 4) << 16;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 d, a, b, c with c = d. With
// g = lane / 4 and t = lane % 4 a lane holds (each register's first element in its low half):
//   A (16x16): a0a1 = A[g][2t, 2t+1], a2a3 = A[g+8][2t, 2t+1], a4a5 = A[g][2t+8, 2t+9],
//              a6a7 = A[g+8][2t+8, 2t+9], two elements per register a[0..3]
//   B (16x8):  b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]
//   C, D (16x8 fp32): d[0], d[1] = D[g][2t, 2t+1], d[2], d[3] = D[g+8][2t, 2t+1]
// Products are exact in fp32 for 16-bit inputs; they are summed in k order, then added to C. Each lane
// puts its elements down as floats: A's eight in slots 0 and 1, B's four in slot 2.
template <typename ToFloat>
inline void mma_m16n8k16(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1,
                         unsigned int variant, ToFloat to_float) {
  Collective exchange(kWave, kWholeGroup | kMma | variant);
  const unsigned int registers[6] = {a[0], a[1], a[2], a[3], b0, b1};
  float elements[12];
  for (int i = 0; i < 12; ++i) elements[i] = to_float(static_cast<unsigned short>(registers[i / 2] >> (16 * (i % 2))));
  std::memcpy(exchange.mine(0), elements, 8 * sizeof(float));
  std::memcpy(exchange.mine(2), elements + 8, 4 * sizeof(float));
  exchange.meet();
  // Element `half` of register `reg` of lane `lane`'s A (reg 0..3) or B (reg 4, 5).
  auto element = [&](int lane, int reg, int half) {
    float value;
    const int index = 2 * reg + half;
    std::memcpy(&value, exchange.of(lane, index / 4) + 4 * (index % 4), sizeof value);
    return value;
  };
  // This lane's rows of A (g and g + 8) and columns of B (2t and 2t + 1), over k. By the layouts above,
  // A[row][k] is element k % 2 of register row / 8 + 2 (k / 8) of lane 4 (row % 8) + (k % 8) / 2, and
  // B[k][n] element k % 2 of register k / 8 of lane 4 n + (k % 8) / 2.
  const int g = lane_id() / 4;
  const int t = lane_id() % 4;
  float a_rows[2][16], b_columns[2][16];
  for (int k = 0; k < 16; ++k) {
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
      a_rows[r][k] = element(4 * (row % 8) + (k % 8) / 2, row / 8 + 2 * (k / 8), k % 2);
    }
    for (int c = 0; c < 2; ++c) b_columns[c][k] = element(4 * (2 * t + c) + (k % 8) / 2, 4 + k / 8, k % 2);
  }
  for (int e = 0; e < 4; ++e) {
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += a_rows[e / 2][k] * b_columns[e % 2][k];
    d[e] += sum;
  }
}

inline void mma_m16n8k16_bf16(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
  mma_m16n8k16(d, a, b0, b1, 0, bf16_bits_to_float);
}

inline void mma_m16n8k16_f16(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
  mma_m16n8k16(d, a, b0, b1, 1, half_bits_to_float);
}

// bar.sync id, threads: named barrier `id` (1..15; 0 is __syncthreads's) of `threads` threads.
inline void bar_sync(int id, int threads) {
  if (id < 1 || id >= kBlockBarriers) fail("bar.sync " + std::to_string(id) + ": the emulation's named barriers are 1..15");
  if (threads <= 0 || threads % kWave != 0)
    fail("bar.sync for " + std::to_string(threads) + " threads: a multiple of the warp size");
  named_barrier(id, threads);
}

// ---- conversions and approximations ----

// cvt.rn.bf16.f32: round to nearest even; a NaN becomes the canonical NaN.
inline unsigned short cvt_rn_bf16_f32(float x) {
  unsigned int u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16);
}

// cvt.rn.f16.f32: round to nearest even, overflow to infinity.
inline unsigned short cvt_rn_f16_f32(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  unsigned short bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

inline float cvt_f32_f16(unsigned short bits) { return half_bits_to_float(bits); }

// cvt.rn.{bf16x2,f16x2}.f32 d, a, b: a to the upper half of d, b to the lower.
inline unsigned int cvt_rn_bf16x2_f32(float a, float b) {
  return static_cast<unsigned int>(cvt_rn_bf16_f32(a)) << 16 | cvt_rn_bf16_f32(b);
}

inline unsigned int cvt_rn_f16x2_f32(float a, float b) {
  return static_cast<unsigned int>(cvt_rn_f16_f32(a)) << 16 | cvt_rn_f16_f32(b);
}

// .ftz: subnormal inputs and results are flushed to zero of the same sign.
inline float flush_subnormal(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }

// ex2.approx.ftz.f32: 2^x (ex2 of -inf is +0).
inline float ex2_approx_ftz_f32(float x) { return flush_subnormal(std::exp2(flush_subnormal(x))); }

// lg2.approx.ftz.f32: log2 x (lg2 of +0 is -inf, of a negative number NaN).
inline float lg2_approx_ftz_f32(float x) { return std::log2(flush_subnormal(x)); }

// tanh.approx.f32 (the hardware's relative error of about 2^-11 is not modelled: exact here).
inline float tanh_approx_f32(float x) { return std::tanh(x); }

}  // namespace hipattn_emulation

inline float __shfl_xor_sync(unsigned int mask, float value, int lane_mask, int width) {
  return ::hipattn_emulation::shfl_xor_sync(mask, value, lane_mask, width);
}
inline void __syncwarp(unsigned int mask = 0xffffffffu) { ::hipattn_emulation::syncwarp(mask); }
