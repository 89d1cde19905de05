// The AMD gfx90a of the emulated device (emulated_device.h): wave64, HIP's cross-lane shuffle, and
// MFMA 16x16x16 with the fragment layouts of AMD's matrix instruction calculator (written from that
// description, not from the kernels). With HIPATTN_EMULATED_GFX950 defined it is a gfx950 instead,
// which also has the 16x16x32 MFMA.
#pragma once

#define __AMDGCN_WAVEFRONT_SIZE 64
#if defined(HIPATTN_EMULATED_GFX950)
#define __gfx950__ 1
#else
#define __gfx90a__ 1
#endif

namespace hipattn_emulation {

constexpr int kMfmaTile = 16;

enum AmdOperation : unsigned int { kShflXor = 1u << 8, kMfma = 2u << 8 };

inline std::string tag_name(unsigned int tag) {
  switch (tag & ~0xffu) {
    case kShflXor:
      return "__shfl_xor (width " + std::to_string(tag & 0xffu) + ")";
    case kMfma:
      return "an MFMA";
    default:
      return "no operation";
  }
}

inline void on_block_start(int) {}
inline void on_thread_exit(int) {}

// HIP's __shfl_xor: the value of lane (lane ^ mask) within the caller's aligned group of `width`
// lanes (xor_source). Lanes of the group that have exited are left out.
inline float shfl_xor(float value, int lane_mask, int width) {
  Collective exchange(width, kShflXor | static_cast<unsigned int>(width));
  std::memcpy(exchange.mine(0), &value, sizeof value);
  exchange.meet();
  float result;
  std::memcpy(&result, exchange.of(xor_source(lane_id(), lane_mask, width), 0), sizeof result);
  return result;
}

// D = A B + C for one 16x16xK MFMA, fp32 accumulation, K = 4 x the 16-bit elements a lane holds. With
// column = lane % 16 and quarter = lane / 16 (AMD's matrix instruction calculator): a lane holds
// A[column][n quarter + e] and B[n quarter + e][column], e < n, and C, D[4 quarter + e][column],
// e = 0..3. n = 4: v_mfma_f32_16x16x16f16 / bf16_1k; n = 8: gfx950's v_mfma_f32_16x16x32_f16 / bf16.
template <typename Operand, typename Accumulator, typename ToFloat>
inline Accumulator mfma_16x16(Operand a, Operand b, Accumulator c, ToFloat to_float) {
  constexpr int kPerLane = sizeof(Operand) / 2;
  static_assert((kPerLane == 4 || kPerLane == 8) && sizeof(Accumulator) == 16,
                "four or eight 16-bit operands, four fp32 sums");
  Collective exchange(kWave, kMfma);
  std::memcpy(exchange.mine(0), &a, sizeof a);
  std::memcpy(exchange.mine(1), &b, sizeof b);
  exchange.meet();
  const int lane = lane_id();
  const int column = lane % kMfmaTile;
  const int quarter = lane / kMfmaTile;
  Accumulator d = c;
  for (int e = 0; e < 4; ++e) {
    const int row = 4 * quarter + e;
    float sum = 0.0f;
    for (int k = 0; k < 4 * kPerLane; ++k) {
      unsigned short a_bits, b_bits;
      std::memcpy(&a_bits, exchange.of(row + kMfmaTile * (k / kPerLane), 0) + 2 * (k % kPerLane), 2);
      std::memcpy(&b_bits, exchange.of(column + kMfmaTile * (k / kPerLane), 1) + 2 * (k % kPerLane), 2);
      sum += to_float(a_bits) * to_float(b_bits);
    }
    d[e] += sum;
  }
  return d;
}

template <typename Operand, typename Accumulator, typename ToFloat>
inline Accumulator mfma_16x16x16(Operand a, Operand b, Accumulator c, ToFloat to_float) {
  static_assert(sizeof(Operand) == 8, "four 16-bit operands");
  return mfma_16x16(a, b, c, to_float);
}

template <typename Operand, typename Accumulator, typename ToFloat>
inline Accumulator mfma_16x16x32(Operand a, Operand b, Accumulator c, ToFloat to_float) {
  static_assert(sizeof(Operand) == 16, "eight 16-bit operands");
  return mfma_16x16(a, b, c, to_float);
}

}  // namespace hipattn_emulation

inline float __shfl_xor(float value, int lane_mask, int width) {
  return ::hipattn_emulation::shfl_xor(value, lane_mask, width);
}
