// NVIDIA warp-level tensor-core helpers (sm_80+): ldmatrix, mma.sync m16n8k16, cp.async.
//
// Fragment layouts are PTX's for mma.m16n8k16 with .row.col operands. With g = lane / 4 and
// t = lane % 4, a lane holds: A (16x16) rows g and g+8, columns 2t, 2t+1 and 2t+8, 2t+9;
// B (16x8) rows (k) 2t, 2t+1, 2t+8, 2t+9 of column g; C (16x8) rows g and g+8, columns 2t, 2t+1.
//
// Each inline-asm instruction has a HIPATTN_EMULATION branch (common/platform.h): the CPU
// emulation's function of that instruction, operands in the same order, so that the kernels run on
// an emulated sm_80 in tests (tests/support/emulation/emulated_sm80.h).
#pragma once
#include "common/types.h"

#if !defined(HIPATTN_NVIDIA)
#error "mma_nvidia.h is for NVIDIA targets; AMD kernels use the portable path"
#endif

namespace hipattn {
namespace mma {

HIPATTN_DEVICE unsigned int shared_address(const void* pointer) {
#if defined(HIPATTN_EMULATION)
  return ::hipattn_emulation::cvta_to_shared(pointer);
#else
  unsigned int address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
  return address;
#endif
}

// `x`, hidden from the optimiser. A shared tile's base address passed through this at the top of a
// loop keeps each fragment address inside the loop "base + constant", which ptxas folds into the
// ldmatrix's immediate offset; otherwise the compiler hoists every unrolled fragment address out of
// the loop into a register of its own (80 of them in the flash forward, which then spills).
HIPATTN_DEVICE unsigned int opaque(unsigned int x) {
#if !defined(HIPATTN_EMULATION)
  asm volatile("" : "+r"(x));
#endif
  return x;
}

// A 64-bit `x`, hidden from the optimiser: a value computed once that ptxas would otherwise compute
// again at each use (from kernel parameters, which look cheap to it) stays in the registers it was
// computed into.
HIPATTN_DEVICE long long opaque_64(long long x) {
#if !defined(HIPATTN_EMULATION)
  asm volatile("" : "+l"(x));
#endif
  return x;
}

// Four 8x8 b16 matrices from a shared-state-space address (shared_address); lane l gives the row
// address of matrix l / 8.
HIPATTN_DEVICE void ldmatrix_x4(unsigned int (&r)[4], unsigned int row_address) {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::ldmatrix<4, false>(r, row_address);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_address));
#endif
}

HIPATTN_DEVICE void ldmatrix_x4_trans(unsigned int (&r)[4], unsigned int row_address) {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::ldmatrix<4, true>(r, row_address);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_address));
#endif
}

// The same, from a generic pointer into shared memory.
HIPATTN_DEVICE void ldmatrix_x4(unsigned int (&r)[4], const void* row) { ldmatrix_x4(r, shared_address(row)); }

HIPATTN_DEVICE void ldmatrix_x4_trans(unsigned int (&r)[4], const void* row) {
  ldmatrix_x4_trans(r, shared_address(row));
}

// Two 8x8 matrices; lanes 0..15 give the row addresses.
HIPATTN_DEVICE void ldmatrix_x2(unsigned int (&r)[2], unsigned int row_address) {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::ldmatrix<2, false>(r, row_address);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(row_address));
#endif
}

HIPATTN_DEVICE void ldmatrix_x2(unsigned int (&r)[2], const void* row) { ldmatrix_x2(r, shared_address(row)); }

HIPATTN_DEVICE void ldmatrix_x2_trans(unsigned int (&r)[2], const void* row) {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::ldmatrix<2, true>(r, shared_address(row));
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(row)));
#endif
}

// The transpose of an 8x8 b16 matrix held as a fragment (lane l: row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1, as ldmatrix without .trans or a packed accumulator pair gives it): the same lane then
// holds row l / 4 of the transpose. In registers, where a transposed write through shared memory
// takes a 16-bit store per element (sm_75+).
HIPATTN_DEVICE unsigned int movmatrix_trans(unsigned int fragment) {
#if defined(HIPATTN_EMULATION)
  return ::hipattn_emulation::movmatrix_trans(fragment);
#else
  unsigned int transposed;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(transposed) : "r"(fragment));
  return transposed;
#endif
}

// Barrier ID (1..15; 0 is __syncthreads's) over THREADS threads, whole warps: warps that share a
// problem meet here without holding up the rest of their block. The ID is an immediate: with an ID in
// a register ptxas reserves all 16 of the block's barriers, and an SM's barriers then held only 4 such
// blocks (ncu's occupancy limit by barriers), where shared memory allowed 5 or 7.
template <int ID, int THREADS>
HIPATTN_DEVICE void named_barrier() {
  static_assert(ID >= 1 && ID <= 15, "barrier 0 is __syncthreads's; an SM's blocks have 16");
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::bar_sync(ID, THREADS);
#else
  asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(THREADS) : "memory");
#endif
}

// d += a * b for one 16x8x16 tile, fp32 accumulation.
template <typename T>
HIPATTN_DEVICE void mma_16816(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1);

template <>
HIPATTN_DEVICE void mma_16816<bf16_t>(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::mma_m16n8k16_bf16(d, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

template <>
HIPATTN_DEVICE void mma_16816<half_t>(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::mma_m16n8k16_f16(d, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats rounded to one register of two 16-bit values, `low` in the low half.
template <typename T>
HIPATTN_DEVICE unsigned int pack2(float low, float high);

template <>
HIPATTN_DEVICE unsigned int pack2<bf16_t>(float low, float high) {
#if defined(HIPATTN_EMULATION)
  return ::hipattn_emulation::cvt_rn_bf16x2_f32(high, low);
#else
  unsigned int r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(high), "f"(low));
  return r;
#endif
}

template <>
HIPATTN_DEVICE unsigned int pack2<half_t>(float low, float high) {
#if defined(HIPATTN_EMULATION)
  return ::hipattn_emulation::cvt_rn_f16x2_f32(high, low);
#else
  unsigned int r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(high), "f"(low));
  return r;
#endif
}

// 16 bytes global -> shared without a register round trip; completes at wait_async_copies().
HIPATTN_DEVICE void copy_async_16(unsigned int target, const void* global) {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::cp_async(target, global, 16);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(target), "l"(global));
#endif
}

HIPATTN_DEVICE void copy_async_16(void* shared, const void* global) { copy_async_16(shared_address(shared), global); }

// 4 bytes global -> shared (cp.async takes 4-byte copies through L1 only, .ca): one fp32 row statistic.
HIPATTN_DEVICE void copy_async_4(void* shared, const void* global) {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::cp_async(shared_address(shared), global, 4);
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(shared_address(shared)), "l"(global));
#endif
}

HIPATTN_DEVICE void wait_async_copies() {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::cp_async_wait_all();
#else
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Pipelines: close the copies issued since the last commit into one group (an empty group is fine
// and completes at once), then wait until at most PENDING of the newest groups are still in flight.
HIPATTN_DEVICE void commit_async_copies() {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::cp_async_commit_group();
#else
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int PENDING>
HIPATTN_DEVICE void wait_async_copies_except() {
#if defined(HIPATTN_EMULATION)
  ::hipattn_emulation::cp_async_wait_group(PENDING);
#else
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

}  // namespace mma
}  // namespace hipattn
