// hipattn platform layer: the HIP device names the kernels are written with, on both compilers.
//
// Kernels are HIP C++. hiprtc understands them natively; under NVRTC this header maps the few HIP
// spellings hipattn uses onto CUDA, the way HIP's own NVIDIA platform does. Nothing here includes a
// vendor header: NVRTC has no include path by default and hiprtc 5.2's bf16 header does not build
// (docs/ARCHITECTURE.md, "The two backends"), so hipattn carries its own numeric types (types.h).
#pragma once

// HIPATTN_EMULATION is a build on a CPU, for tests: g++ force-includes
// tests/support/emulation/emulated_device.h (threads as fibers), which defines the device names used
// here, of an AMD gfx90a (wave64) or, with HIPATTN_EMULATED_NVIDIA, of an NVIDIA sm_80 (warp32). Its
// NVIDIA build replaces each inline-asm instruction with the emulation's function of that instruction.
#if defined(HIPATTN_EMULATION) && defined(HIPATTN_EMULATED_NVIDIA)
#define HIPATTN_NVIDIA 1
#elif defined(__HIPCC_RTC__) || defined(__HIP__) || defined(HIPATTN_EMULATION)
#define HIPATTN_AMD 1
#elif defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define HIPATTN_NVIDIA 1
#else
#error "hipattn kernels compile with hiprtc (AMD) or NVRTC (NVIDIA)"
#endif

#define HIPATTN_DEVICE __device__ __forceinline__

namespace hipattn {

// Lanes that execute in lockstep: the one place the kernels learn the warp size. The host reads the
// same number from Target.warp_size, by the same rule: RDNA (gfx10, gfx11, gfx12) compiles wave32 by
// default, as hiprtc does, and GCN and CDNA run wave64. The family macros are what every AMD compiler
// defines (hiprtc 5.2 and LLVM 22 alike); LLVM 22 no longer predefines __AMDGCN_WAVEFRONT_SIZE.
#if defined(HIPATTN_AMD) && (defined(__GFX10__) || defined(__GFX11__) || defined(__GFX12__))
constexpr int kWarpSize = 32;
#elif defined(HIPATTN_AMD)
constexpr int kWarpSize = 64;
#else
constexpr int kWarpSize = 32;
#endif

// The lanes of the calling lane's aligned group of `width` lanes, as a warp mask. NVIDIA needs the
// mask to name exactly the lanes that take part: two teams sharing a warp may branch apart.
HIPATTN_DEVICE unsigned int group_mask(int width) {
#if defined(HIPATTN_AMD)
  (void)width;
  return 0u;  // AMD's cross-lane reads take no mask
#else
  if (width >= 32) return 0xffffffffu;
  const unsigned int lane = threadIdx.x % 32;
  return ((1u << width) - 1u) << (lane & ~static_cast<unsigned int>(width - 1));
#endif
}

// Butterfly exchange of a float or a 32-bit word within the aligned group of `width` lanes (a power
// of two up to 32); every lane of `mask` (from group_mask(width)) must take part.
template <typename V>
HIPATTN_DEVICE V shfl_xor(V value, int lane_mask, int width, unsigned int mask) {
  static_assert(sizeof(V) == 4, "one 32-bit register per lane");
#if defined(HIPATTN_AMD)
  (void)mask;
  return __shfl_xor(value, lane_mask, width);
#else
  return __shfl_xor_sync(mask, value, lane_mask, width);
#endif
}

HIPATTN_DEVICE float bits_to_float(unsigned int bits) { return __uint_as_float(bits); }
HIPATTN_DEVICE unsigned int float_to_bits(float value) { return __float_as_uint(value); }
HIPATTN_DEVICE float infinity() { return bits_to_float(0x7f800000u); }

// The softmax is computed in base 2: scores are scaled by softmax_scale * log2(e) and exponentiated with
// exp2; an LSE in base 2 times ln(2) is the natural-log LSE the host sees.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// exp2 with the hardware's fast approximation.
HIPATTN_DEVICE float fast_exp2(float x) {
#if defined(HIPATTN_AMD)
  return exp2f(x);  // lowers to v_exp_f32
#elif defined(HIPATTN_EMULATION)
  return ::hipattn_emulation::ex2_approx_ftz_f32(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

HIPATTN_DEVICE float fast_log2(float x) {
#if defined(HIPATTN_AMD)
  return log2f(x);  // lowers to v_log_f32
#elif defined(HIPATTN_EMULATION)
  return ::hipattn_emulation::lg2_approx_ftz_f32(x);
#else
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// tanh for softcap (common/score_mods.h). NVIDIA has an instruction for it (sm_75+, relative error
// about 2^-11, what flash-attn's softcap uses); AMD has none, so tanh(x) = 1 - 2 / (1 + e^2x) from the
// exponential, exact to about 1e-7 and correct at the extremes (e^2x = inf gives 1, 0 gives -1).
HIPATTN_DEVICE float fast_tanh(float x) {
#if defined(HIPATTN_AMD)
  return 1.0f - 2.0f / (1.0f + exp2f(2.0f * kLog2e * x));
#elif defined(HIPATTN_EMULATION)
  return ::hipattn_emulation::tanh_approx_f32(x);
#else
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

HIPATTN_DEVICE void atomic_add(float* address, float value) { atomicAdd(address, value); }

}  // namespace hipattn
