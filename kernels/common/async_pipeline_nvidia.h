// Hopper's machinery for kernels whose warpgroups take separate roles, a producer that fills a ring of
// shared-memory slots and consumers that compute on them (sm_90a only): shared-memory barriers
// (mbarrier), copies that complete on one (the copy engine's tensor-map loads, cp.async), turns
// between consumers, and register reallocation between the roles (setmaxnreg).
//
// An mbarrier counts arrivals: once the count it was initialised with has arrived, its current phase
// completes and the next begins. A waiter names the phase it needs by its parity (0 for the first,
// then 1, 0, ...); waiting with the parity of the phase before the first returns at once, which lets
// a producer treat every slot as released before its first use. Arrivals release and waits acquire at
// CTA scope, so shared-memory writes made before an arrival are visible to the threads its phase lets
// through.
#pragma once
#include "common/mma_nvidia.h"

#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "async_pipeline_nvidia.h needs the sm_90a target (setmaxnreg exists only there)"
#endif

namespace hipattn {
namespace mbarrier {

// One thread initialises each barrier; the block synchronises before anyone arrives or waits.
HIPATTN_DEVICE void init(unsigned int barrier, unsigned int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(barrier), "r"(arrivals) : "memory");
}

HIPATTN_DEVICE void arrive(unsigned int barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
}

// After one thread's inits, before the block's barrier: the copy engine sees the barriers initialised.
HIPATTN_DEVICE void publish_inits() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// The thread's arrival, and `bytes` more that the copy engine's copies (load_tile) complete on the
// barrier before its phase can.
HIPATTN_DEVICE void arrive_expecting(unsigned int barrier, unsigned int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(bytes) : "memory");
}

// The thread's arrival, made by the hardware once every cp.async the thread issued before it has
// landed: the thread itself goes on at once. It counts against the barrier's initial count (noinc).
HIPATTN_DEVICE void arrive_when_copies_land(unsigned int barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(barrier) : "memory");
}

// Until the phase of `parity` has completed. try_wait suspends the thread for a while inside the
// instruction before it reports failure, so the loop does not spin on the issue slots.
HIPATTN_DEVICE void wait(unsigned int barrier, unsigned int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_again:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_again;\n}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}

}  // namespace mbarrier

// The copy engine moves one box of a 4-D tensor map (a TensorMap kernel parameter, passed with
// __grid_constant__ so that its address is the parameter's own) at coordinates c0..c3, innermost
// first, into shared memory at `shared` (1024-byte aligned for the 128-byte swizzle), and completes
// the box's bytes on `barrier`. Elements outside the map's dimensions land as zeros.
HIPATTN_DEVICE void load_tile(void* shared, const void* map, int c0, int c1, int c2, int c3, unsigned int barrier) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
      ::"r"(mma::shared_address(shared)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2),
      "r"(c3), "r"(barrier)
      : "memory");
}

// 16 bytes global -> shared with cp.async, or 16 zero bytes when !valid (the copy then reads nothing),
// so that a tile's every byte lands through the copies that arrive_when_copies_land tracks.
HIPATTN_DEVICE void copy_async_16_or_zero(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(mma::shared_address(shared)), "l"(global),
               "r"(valid ? 16 : 0)
               : "memory");
}

// 4 bytes global -> shared with cp.async, or 4 zero bytes when !valid: one fp32 row statistic.
HIPATTN_DEVICE void copy_async_4_or_zero(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(mma::shared_address(shared)), "l"(global),
               "r"(valid ? 4 : 0)
               : "memory");
}

// Named barriers whose ID is a run-time value, for consumer warpgroups that take turns. ptxas then
// reserves all 16 of the block's barriers, which costs nothing to a kernel that runs one block per SM.
// `sync` waits until THREADS threads have arrived (itself included); `arrive` counts itself and goes on.
template <int THREADS>
HIPATTN_DEVICE void barrier_sync(unsigned int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(THREADS) : "memory");
}
template <int THREADS>
HIPATTN_DEVICE void barrier_arrive(unsigned int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(THREADS) : "memory");
}

// A warpgroup gives up registers (release) or takes them (claim) to REGISTERS per thread, every thread
// of it together; the block's total stays within the register file the launch reserved.
template <int REGISTERS>
HIPATTN_DEVICE void release_registers_to() {
  static_assert(REGISTERS % 8 == 0 && REGISTERS >= 24 && REGISTERS <= 256, "setmaxnreg takes 24..256, by 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGISTERS));
}
template <int REGISTERS>
HIPATTN_DEVICE void claim_registers_to() {
  static_assert(REGISTERS % 8 == 0 && REGISTERS >= 24 && REGISTERS <= 256, "setmaxnreg takes 24..256, by 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGISTERS));
}

}  // namespace hipattn
