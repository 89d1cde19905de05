// NVIDIA Hopper warpgroup tensor-core helpers (sm_90a only): wgmma.mma_async m64nNk16 with fp32
// accumulators, operands in shared memory described by matrix descriptors, A optionally in registers.
//
// A warpgroup is four consecutive warps starting at a warp index divisible by 4; all 128 threads
// issue every wgmma together. For m64nN, warp w of the group owns rows 16w .. 16w + 15 and its
// accumulators are laid out like mma.sync's m16n8 C fragment repeated over the N / 8 column tiles:
// d[n][0..1] is row g, columns 8n + 2t, 8n + 2t + 1 and d[n][2..3] row g + 8 (g = lane / 4,
// t = lane % 4). A from registers has mma.sync's m16k16 A fragment layout, per warp.
//
// Shared tiles use the 128-byte swizzle: a tile of ROWS rows and COLS 16-bit columns is stored as
// COLS / 64 column blocks (rounded up: head_dim 96 takes two, the second half used), each ROWS rows of
// 128 bytes, and within a row the 16-byte chunk j of a block sits at position j ^ (row % 8)
// (swizzled_offset). Eight rows make one 1024-byte swizzle atom; every tile starts on a 1024-byte
// boundary. A warp's copies can then read whole 128-byte row segments from global memory and still
// write eight distinct bank groups per phase, and the tensor cores read the layout without conflicts.
// The tensor cores apply the swizzle to the addresses they form, so an operand may start inside a row
// (a K-major k16 step 32 bytes along it; an MN-major operand of N = 32 at its 64th byte) or end inside
// one (N = 96 over a block and a half).
#pragma once
#include "common/mma_nvidia.h"

#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma_nvidia.h needs the sm_90a target (wgmma exists only there)"
#endif

namespace hipattn {
namespace wgmma {

typedef unsigned long long u64;

constexpr int kRowBytes = 128;    // one row of a column block: 64 16-bit columns
constexpr int kAtomBytes = 1024;  // eight rows: the unit the swizzle repeats over

// Element offset of (row, col) in a swizzled shared tile of ROWS rows.
template <int ROWS>
HIPATTN_DEVICE constexpr int swizzled_offset(int row, int col) {
  return (col / 64) * ROWS * 64 + row * 64 + (((col / 8) % 8) ^ (row % 8)) * 8 + col % 8;
}

// A matrix descriptor of a swizzled tile: start address, the "leading" byte offset (MN-major operands:
// between 64-column blocks; unused by K-major ones, whose k16 step stays inside one 128-byte row), the
// "stride" byte offset (between 8-row atoms) and the 128-byte swizzle mode (1 in bits 62-63). Byte
// offsets added later (k steps) are added as (bytes >> 4) to the address field.
HIPATTN_DEVICE u64 descriptor(unsigned int shared_address, int leading_bytes, int stride_bytes) {
  return static_cast<u64>((shared_address & 0x3ffffu) >> 4) | (static_cast<u64>(leading_bytes >> 4) << 16) |
         (static_cast<u64>(stride_bytes >> 4) << 32) | (1ull << 62);
}

HIPATTN_DEVICE constexpr u64 advance(u64 descriptor, int bytes) { return descriptor + static_cast<u64>(bytes >> 4); }

// Byte offset of k16 step `ks` of a K-major operand of ROWS rows: 32 bytes along a 128-byte row, then
// the next column block.
template <int ROWS>
HIPATTN_DEVICE constexpr int k_major_step(int ks) {
  return (ks % 4) * 32 + (ks / 4) * ROWS * kRowBytes;
}

// Before the first wgmma of a batch whose accumulator or A registers other instructions touched.
HIPATTN_DEVICE void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
HIPATTN_DEVICE void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
HIPATTN_DEVICE void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// Shared memory written by ordinary stores or cp.async (the generic proxy) and read next by wgmma
// (the async proxy): each writing thread fences after its writes complete, before the barrier.
HIPATTN_DEVICE void fence_shared_for_async_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Hopper's copy engine adds `bytes` of fp32 from shared memory into global memory, asynchronously
// to the thread, which hands over an address instead of holding the values in registers until the
// load/store unit has taken them (as a run of red.global does: BENCHMARKS.md, run 6). Both addresses
// are 16-byte aligned and `bytes` is a multiple of 16. The shared words are written by the generic
// proxy: fence_shared_for_async_proxy() in each writing thread first.
HIPATTN_DEVICE void bulk_reduce_add(float* global, unsigned int shared_address, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(global),
               "r"(shared_address), "r"(bytes)
               : "memory");
}
// The thread's bulk operations issued since its last commit form one group.
HIPATTN_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until at most PENDING of the thread's groups are still reading their shared memory (which may then
// be written again).
template <int PENDING>
HIPATTN_DEVICE void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(PENDING) : "memory");
}
// Until every group of the thread is complete, its global writes performed.
HIPATTN_DEVICE void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Adds four adjacent fp32 words (16-byte aligned) into global memory in one reduction (sm_90's vector
// red): for a share of dQ with no shared memory left to stage it for the copy engine.
HIPATTN_DEVICE void reduce_add_quad(float* global, float x, float y, float z, float w) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(global), "f"(x), "f"(y), "f"(z), "f"(w)
               : "memory");
}

// Accumulators are written by the tensor cores until wait(): pinning each register through an
// empty asm after the wait keeps the compiler from moving their reads above it (and, before a
// batch, their writes below the fence).
template <int N_TILES>
HIPATTN_DEVICE void pin(float (&d)[N_TILES][4]) {
#pragma unroll
  for (int n = 0; n < N_TILES; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[n][e])::"memory");
}

// A operands from registers are read by the tensor cores until wait() as well: pinning them after
// the wait keeps them live until then, so the compiler cannot reuse their registers for values
// computed while the product is in flight.
template <int N_TILES>
HIPATTN_DEVICE void pin(unsigned int (&a)[N_TILES][2]) {
#pragma unroll
  for (int n = 0; n < N_TILES; ++n) asm volatile("" : "+r"(a[n][0]), "+r"(a[n][1])::"memory");
}

// A descriptor computed here stays computed here: the compiler may not sink the arithmetic between the
// wgmmas of a batch (the kernels form every descriptor of a batch before its fence).
HIPATTN_DEVICE u64 pin(u64 descriptor) {
  asm volatile("" : "+l"(descriptor));
  return descriptor;
}

// d (+)= A B for one k16 step, m64nN. ss: A and B from shared memory, both K-major (rows of A and
// of B contiguous along K). ss_mn: both MN-major (A's columns contiguous along M, B's rows along N:
// both transpose bits set). ss_k_mn: A K-major, B MN-major. rs: A from registers, B MN-major.
// `accumulate` 0 overwrites d.
template <typename T, int N>
HIPATTN_DEVICE void mma_ss(float (&d)[N / 8][4], u64 a, u64 b, int accumulate);
template <typename T, int N>
HIPATTN_DEVICE void mma_ss_mn(float (&d)[N / 8][4], u64 a, u64 b, int accumulate);
template <typename T, int N>
HIPATTN_DEVICE void mma_ss_k_mn(float (&d)[N / 8][4], u64 a, u64 b, int accumulate);
template <typename T, int N>
HIPATTN_DEVICE void mma_rs(float (&d)[N / 8][4], const unsigned int (&a)[4], u64 b, int accumulate);

// Inline-asm operand lists: "%0, %1, ..." for the accumulators in tens, and their "+f" constraints
// in eights (d[n][e] is register 4n + e). The constraint lists are function-like macros, passed by
// name and invoked inside HIPATTN_WGMMA, so that their commas do not split the outer macro's arguments.
#define HIPATTN_OPS_UNITS "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
#define HIPATTN_OPS_TENS(t) \
  "%" #t "0, %" #t "1, %" #t "2, %" #t "3, %" #t "4, %" #t "5, %" #t "6, %" #t "7, %" #t "8, %" #t "9, "
#define HIPATTN_OPS_16 HIPATTN_OPS_UNITS "%10, %11, %12, %13, %14, %15"
#define HIPATTN_OPS_32 HIPATTN_OPS_UNITS HIPATTN_OPS_TENS(1) HIPATTN_OPS_TENS(2) "%30, %31"
#define HIPATTN_OPS_48 \
  HIPATTN_OPS_UNITS HIPATTN_OPS_TENS(1) HIPATTN_OPS_TENS(2) HIPATTN_OPS_TENS(3) "%40, %41, %42, %43, %44, %45, %46, %47"
#define HIPATTN_OPS_64 \
  HIPATTN_OPS_UNITS HIPATTN_OPS_TENS(1) HIPATTN_OPS_TENS(2) HIPATTN_OPS_TENS(3) HIPATTN_OPS_TENS(4) \
  HIPATTN_OPS_TENS(5) "%60, %61, %62, %63"
#define HIPATTN_OPS_128                                                                                      \
  HIPATTN_OPS_UNITS HIPATTN_OPS_TENS(1) HIPATTN_OPS_TENS(2) HIPATTN_OPS_TENS(3) HIPATTN_OPS_TENS(4)          \
  HIPATTN_OPS_TENS(5) HIPATTN_OPS_TENS(6) HIPATTN_OPS_TENS(7) HIPATTN_OPS_TENS(8) HIPATTN_OPS_TENS(9)        \
  HIPATTN_OPS_TENS(10) HIPATTN_OPS_TENS(11) "%120, %121, %122, %123, %124, %125, %126, %127"
#define HIPATTN_ACC_8(n) \
  "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3]), "+f"(d[n + 1][0]), "+f"(d[n + 1][1]), \
  "+f"(d[n + 1][2]), "+f"(d[n + 1][3])
#define HIPATTN_ACC_16() HIPATTN_ACC_8(0), HIPATTN_ACC_8(2)
#define HIPATTN_ACC_32() HIPATTN_ACC_16(), HIPATTN_ACC_8(4), HIPATTN_ACC_8(6)
#define HIPATTN_ACC_48() HIPATTN_ACC_32(), HIPATTN_ACC_8(8), HIPATTN_ACC_8(10)
#define HIPATTN_ACC_64() HIPATTN_ACC_32(), HIPATTN_ACC_8(8), HIPATTN_ACC_8(10), HIPATTN_ACC_8(12), HIPATTN_ACC_8(14)
#define HIPATTN_ACC_128()                                                                                     \
  HIPATTN_ACC_64(), HIPATTN_ACC_8(16), HIPATTN_ACC_8(18), HIPATTN_ACC_8(20), HIPATTN_ACC_8(22), HIPATTN_ACC_8(24), \
  HIPATTN_ACC_8(26), HIPATTN_ACC_8(28), HIPATTN_ACC_8(30)

// The specialisations per (type, N). I0.. are the operand numbers after the N / 2 accumulators. The
// shared-memory forms differ only in the transpose immediates of A and B (TRANSPOSE: "0, 0" K-major,
// "1, 1" MN-major, "0, 1" A K-major and B MN-major).
#define HIPATTN_WGMMA_SS(NAME, TRANSPOSE, TYPE, PTX_TYPE, N, OPS, ACC, I0, I1, I2)                          \
  template <>                                                                                              \
  HIPATTN_DEVICE void NAME<TYPE, N>(float (&d)[N / 8][4], u64 a, u64 b, int accumulate) {                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I2 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N     \
                 "k16.f32." PTX_TYPE "." PTX_TYPE " {" OPS "}, %" #I0 ", %" #I1 ", p, 1, 1, " TRANSPOSE ";\n}\n" \
                 : ACC()                                                                                   \
                 : "l"(a), "l"(b), "r"(accumulate));                                                       \
  }
#define HIPATTN_WGMMA(TYPE, PTX_TYPE, N, OPS, ACC, I0, I1, I2, I3, I4, I5)                                  \
  HIPATTN_WGMMA_SS(mma_ss, "0, 0", TYPE, PTX_TYPE, N, OPS, ACC, I0, I1, I2)                                 \
  HIPATTN_WGMMA_SS(mma_ss_mn, "1, 1", TYPE, PTX_TYPE, N, OPS, ACC, I0, I1, I2)                              \
  HIPATTN_WGMMA_SS(mma_ss_k_mn, "0, 1", TYPE, PTX_TYPE, N, OPS, ACC, I0, I1, I2)                            \
  template <>                                                                                              \
  HIPATTN_DEVICE void mma_rs<TYPE, N>(float (&d)[N / 8][4], const unsigned int (&a)[4], u64 b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I5 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N     \
                 "k16.f32." PTX_TYPE "." PTX_TYPE " {" OPS "}, {%" #I0 ", %" #I1 ", %" #I2 ", %" #I3 "}, %" #I4 \
                 ", p, 1, 1, 1;\n}\n"                                                                      \
                 : ACC()                                                                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));                   \
  }

#define HIPATTN_WGMMA_BOTH_TYPES(N, OPS, ACC, I0, I1, I2, I3, I4, I5)     \
  HIPATTN_WGMMA(bf16_t, "bf16", N, OPS, ACC, I0, I1, I2, I3, I4, I5) \
  HIPATTN_WGMMA(half_t, "f16", N, OPS, ACC, I0, I1, I2, I3, I4, I5)

HIPATTN_WGMMA_BOTH_TYPES(32, HIPATTN_OPS_16, HIPATTN_ACC_16, 16, 17, 18, 19, 20, 21)
HIPATTN_WGMMA_BOTH_TYPES(64, HIPATTN_OPS_32, HIPATTN_ACC_32, 32, 33, 34, 35, 36, 37)
HIPATTN_WGMMA_BOTH_TYPES(96, HIPATTN_OPS_48, HIPATTN_ACC_48, 48, 49, 50, 51, 52, 53)
HIPATTN_WGMMA_BOTH_TYPES(128, HIPATTN_OPS_64, HIPATTN_ACC_64, 64, 65, 66, 67, 68, 69)
HIPATTN_WGMMA_BOTH_TYPES(256, HIPATTN_OPS_128, HIPATTN_ACC_128, 128, 129, 130, 131, 132, 133)

#undef HIPATTN_WGMMA_BOTH_TYPES
#undef HIPATTN_WGMMA
#undef HIPATTN_WGMMA_SS
#undef HIPATTN_ACC_128
#undef HIPATTN_ACC_64
#undef HIPATTN_ACC_48
#undef HIPATTN_ACC_32
#undef HIPATTN_ACC_16
#undef HIPATTN_ACC_8
#undef HIPATTN_OPS_128
#undef HIPATTN_OPS_64
#undef HIPATTN_OPS_48
#undef HIPATTN_OPS_32
#undef HIPATTN_OPS_16
#undef HIPATTN_OPS_TENS
#undef HIPATTN_OPS_UNITS

}  // namespace wgmma
}  // namespace hipattn
