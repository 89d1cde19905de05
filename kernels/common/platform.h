// hipattn platform layer: the HIP device names the kernels are written with, on both compilers.
//
// Kernels are HIP C++. hiprtc understands them natively; under NVRTC this header maps the few HIP
// spellings hipattn uses onto CUDA, the way HIP's own NVIDIA platform does. Nothing here includes a
// vendor header: NVRTC has no include path by default and hiprtc 5.2's bf16 header does not build
// (PLATFORM_NOTES.md), so hipattn carries its own numeric types (types.h).
#pragma once

#if defined(__HIPCC_RTC__) || defined(__HIP__)
#define HIPATTN_AMD 1
#elif defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define HIPATTN_NVIDIA 1
#else
#error "hipattn kernels compile with hiprtc (AMD) or NVRTC (NVIDIA)"
#endif

#define HIPATTN_DEVICE __device__ __forceinline__

namespace hipattn {

// Lanes that execute in lockstep: the one place the kernels learn the warp size. The host reads the
// same number from Target.warp_size.
#if defined(HIPATTN_AMD)
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
#else
constexpr int kWarpSize = 32;
#endif

// Butterfly exchange among groups of `width` lanes (a power of two up to kWarpSize). Every lane of
// the warp must take part: teams are whole warps or aligned fractions of one.
HIPATTN_DEVICE float shfl_xor(float value, int lane_mask, int width) {
#if defined(HIPATTN_AMD)
  return __shfl_xor(value, lane_mask, width);
#else
  return __shfl_xor_sync(0xffffffffu, value, lane_mask, width);
#endif
}

HIPATTN_DEVICE float bits_to_float(unsigned int bits) { return __uint_as_float(bits); }
HIPATTN_DEVICE unsigned int float_to_bits(float value) { return __float_as_uint(value); }

// exp2 with the hardware's fast approximation: softmax is computed in base 2 (scale folded with log2 e).
HIPATTN_DEVICE float fast_exp2(float x) {
#if defined(HIPATTN_AMD)
  return __builtin_amdgcn_exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

HIPATTN_DEVICE float fast_log2(float x) {
#if defined(HIPATTN_AMD)
  return __builtin_amdgcn_logf(x);
#else
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

HIPATTN_DEVICE void atomic_add(float* address, float value) { atomicAdd(address, value); }

}  // namespace hipattn
