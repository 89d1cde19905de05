// hipattn numeric types: 16-bit storage types with fp32 compute, and vectors for wide loads.
#pragma once
#include "common/platform.h"

namespace hipattn {

// Storage-only 16-bit floats. Arithmetic always happens in fp32 after to_float().
struct bf16_t {
  unsigned short bits;
};
struct half_t {
  unsigned short bits;
};

HIPATTN_DEVICE float to_float(float x) { return x; }
HIPATTN_DEVICE float to_float(bf16_t x) { return bits_to_float(static_cast<unsigned int>(x.bits) << 16); }
HIPATTN_DEVICE float to_float(half_t x) {
#if defined(HIPATTN_AMD)
  return static_cast<float>(__builtin_bit_cast(_Float16, x.bits));
#elif defined(HIPATTN_EMULATION)
  return ::hipattn_emulation::cvt_f32_f16(x.bits);
#else
  float y;
  asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(x.bits));
  return y;
#endif
}

// fp32 -> 16-bit, round to nearest even (what PyTorch and the tensor cores do).
template <typename T>
HIPATTN_DEVICE T from_float(float x);

template <>
HIPATTN_DEVICE float from_float<float>(float x) { return x; }

template <>
HIPATTN_DEVICE bf16_t from_float<bf16_t>(float x) {
  bf16_t y;
#if defined(HIPATTN_AMD)
  unsigned int u = float_to_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    y.bits = 0x7fc0;  // quiet NaN: rounding must not turn a NaN payload into infinity
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    y.bits = static_cast<unsigned short>(u >> 16);
  }
#elif defined(HIPATTN_EMULATION)
  y.bits = ::hipattn_emulation::cvt_rn_bf16_f32(x);
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(y.bits) : "f"(x));
#endif
  return y;
}

template <>
HIPATTN_DEVICE half_t from_float<half_t>(float x) {
  half_t y;
#if defined(HIPATTN_AMD)
  y.bits = __builtin_bit_cast(unsigned short, static_cast<_Float16>(x));
#elif defined(HIPATTN_EMULATION)
  y.bits = ::hipattn_emulation::cvt_rn_f16_f32(x);
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(y.bits) : "f"(x));
#endif
  return y;
}

// N consecutive elements moved as one aligned access (N * sizeof(T) = 4, 8 or 16 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T elements[N];
};

template <typename T, int N>
HIPATTN_DEVICE void load_as_float(const T* source, float (&out)[N]) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(source);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(v.elements[i]);
}

template <typename T, int N>
HIPATTN_DEVICE void store_from_float(T* destination, const float (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.elements[i] = from_float<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(destination) = v;
}

}  // namespace hipattn
