// AMD wave-level matrix-core helpers (CDNA2 gfx90a, CDNA3 gfx940/941/942, CDNA4 gfx950; wave64): MFMA 16x16x16
// with fp32 accumulation for 16-bit inputs.
//
// Fragment layouts, from AMD's matrix instruction calculator (github.com/ROCm/
// amd_matrix_instruction_calculator, `--detail-instruction` for v_mfma_f32_16x16x16f16 and
// v_mfma_f32_16x16x16bf16_1k on CDNA2, and their CDNA3 spellings v_mfma_f32_16x16x16_f16/_bf16,
// which keep the same layout). With column = lane % 16 and quarter = lane / 16, a lane holds:
//   A (16x16, M x K): row `column`, k = 4 quarter .. 4 quarter + 3
//   B (16x16, K x N): column `column`, k = 4 quarter .. 4 quarter + 3
//   C/D (16x16 fp32): column `column`, rows 4 quarter .. 4 quarter + 3 (Accumulator elements 0..3)
// An Operand holds its four k in ascending order (k % 4 = element; elements 0 and 1 share the low
// register). Two consequences the kernels build on:
//   - both operands are "4 consecutive k of one row of A / one column of B": from a matrix stored with
//     k contiguous, a lane's fragment is one 8-byte load;
//   - D has the B layout with D's rows as B's k: an accumulator rounded to 16 bits (to_operand) is the
//     B operand of a next product that contracts over D's rows, with no data movement between lanes.
#pragma once
#include "common/types.h"

#if !defined(HIPATTN_AMD)
#error "mma_amd.h is for AMD targets; NVIDIA kernels use mma_nvidia.h"
#endif
#if !(defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__))
// gfx908 has MFMA but not the 4-wide bf16 (_1k) instructions; RDNA has WMMA, not MFMA.
#error "mma_amd.h needs the MFMA 16x16x16 f16 and bf16_1k instructions of gfx90a, gfx94x or gfx950"
#endif

namespace hipattn {
namespace mfma {

// typedef NAME: N elements of T in registers, as clang's ext_vector_type (hiprtc), or as g++ spells
// the same vector (in bytes) in the CPU emulation of tests (common/platform.h). Kernels index their
// elements with [i], which both compilers accept.
#if defined(HIPATTN_EMULATION)
#define HIPATTN_VECTOR_TYPEDEF(T, N, NAME) typedef T NAME __attribute__((vector_size((N) * sizeof(T))))
#else
#define HIPATTN_VECTOR_TYPEDEF(T, N, NAME) typedef T NAME __attribute__((ext_vector_type(N)))
#endif

// The instructions' operand and accumulator registers, as the builtins take them. bf16 operands
// travel as 16-bit integers (the builtin's signature); fp16 ones are bit-cast at the call.
HIPATTN_VECTOR_TYPEDEF(short, 4, Operand);
HIPATTN_VECTOR_TYPEDEF(float, 4, Accumulator);
HIPATTN_VECTOR_TYPEDEF(_Float16, 4, HalfOperand);

// The edge of every MFMA tile: M = N = K = 16.
constexpr int kTile = 16;

HIPATTN_DEVICE Operand zero_operand() { return Operand{0, 0, 0, 0}; }
HIPATTN_DEVICE Accumulator zero_accumulator() { return Accumulator{0.0f, 0.0f, 0.0f, 0.0f}; }

// d = a * b + c for one 16x16x16 tile, fp32 accumulation.
template <typename T>
HIPATTN_DEVICE Accumulator mfma_16x16x16(Operand a, Operand b, Accumulator c);

template <>
HIPATTN_DEVICE Accumulator mfma_16x16x16<bf16_t>(Operand a, Operand b, Accumulator c) {
#if defined(HIPATTN_EMULATION)
  return hipattn_emulation::mfma_16x16x16(a, b, c, hipattn_emulation::bf16_bits_to_float);
#else
  return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, 0, 0, 0);
#endif
}

template <>
HIPATTN_DEVICE Accumulator mfma_16x16x16<half_t>(Operand a, Operand b, Accumulator c) {
#if defined(HIPATTN_EMULATION)
  return hipattn_emulation::mfma_16x16x16(a, b, c, hipattn_emulation::half_bits_to_float);
#else
  return __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(HalfOperand, a), __builtin_bit_cast(HalfOperand, b),
                                              c, 0, 0, 0);
#endif
}

#if defined(__gfx950__)
// gfx950's 16x16x32 MFMA: a lane holds eight k of a row (A) or a column (B) where the 16x16x16 one
// holds four, in the same lanes; the accumulator is laid out as the 16x16x16 one's.
HIPATTN_VECTOR_TYPEDEF(short, 8, WideOperand);

template <typename T>
HIPATTN_DEVICE Accumulator mfma_16x16x32_wide(WideOperand a, WideOperand b, Accumulator c);

#if !defined(HIPATTN_EMULATION)
// The builtins take bf16 as clang's __bf16 and fp16 as _Float16 vectors.
HIPATTN_VECTOR_TYPEDEF(__bf16, 8, WideBf16Operand);
HIPATTN_VECTOR_TYPEDEF(_Float16, 8, WideHalfOperand);
#endif

template <>
HIPATTN_DEVICE Accumulator mfma_16x16x32_wide<bf16_t>(WideOperand a, WideOperand b, Accumulator c) {
#if defined(HIPATTN_EMULATION)
  return hipattn_emulation::mfma_16x16x32(a, b, c, hipattn_emulation::bf16_bits_to_float);
#else
  return __builtin_amdgcn_mfma_f32_16x16x32_bf16(__builtin_bit_cast(WideBf16Operand, a),
                                                 __builtin_bit_cast(WideBf16Operand, b), c, 0, 0, 0);
#endif
}

template <>
HIPATTN_DEVICE Accumulator mfma_16x16x32_wide<half_t>(WideOperand a, WideOperand b, Accumulator c) {
#if defined(HIPATTN_EMULATION)
  return hipattn_emulation::mfma_16x16x32(a, b, c, hipattn_emulation::half_bits_to_float);
#else
  return __builtin_amdgcn_mfma_f32_16x16x32_f16(__builtin_bit_cast(WideHalfOperand, a),
                                                __builtin_bit_cast(WideHalfOperand, b), c, 0, 0, 0);
#endif
}
#endif

// d = a * b + c over two k-steps, (a0, b0) then (a1, b1), each a 16x16x16 step's operands. A
// product contracts over k in any order its two operands agree on, so on gfx950 the two steps' four
// elements, concatenated alike in both operands, are one 16x16x32 step (twice the 16x16x16 rate).
// Elsewhere the two steps run one after the other, as a loop over them would.
template <typename T>
HIPATTN_DEVICE Accumulator mfma_two_steps(Operand a0, Operand a1, Operand b0, Operand b1, Accumulator c) {
#if defined(__gfx950__)
  return mfma_16x16x32_wide<T>(WideOperand{a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3]},
                               WideOperand{b0[0], b0[1], b0[2], b0[3], b1[0], b1[1], b1[2], b1[3]}, c);
#else
  return mfma_16x16x16<T>(a1, b1, mfma_16x16x16<T>(a0, b0, c));
#endif
}

// Four consecutive 16-bit elements from an 8-byte-aligned address (LDS or global).
template <typename T>
HIPATTN_DEVICE Operand load_operand(const T* source) {
  static_assert(sizeof(T) == 2, "MFMA operands here are 16-bit");
  return *reinterpret_cast<const Operand*>(source);
}

template <typename T>
HIPATTN_DEVICE void store_operand(T* destination, Operand value) {
  static_assert(sizeof(T) == 2, "MFMA operands here are 16-bit");
  *reinterpret_cast<Operand*>(destination) = value;
}

// An accumulator rounded to T (to nearest even), element for element: the B operand of a product
// that contracts over the accumulator's rows (see the layouts above).
template <typename T>
HIPATTN_DEVICE Operand to_operand(Accumulator x) {
  static_assert(sizeof(T) == 2, "MFMA operands here are 16-bit");
  Operand y;
#pragma unroll
  for (int e = 0; e < 4; ++e) y[e] = static_cast<short>(from_float<T>(x[e]).bits);
  return y;
}

// 16 and 8 bytes as 32-bit words: a 16-byte access stays one instruction this way (a struct of
// 16-bit elements gets split into 16-bit accesses, one register each).
HIPATTN_VECTOR_TYPEDEF(unsigned int, 4, Words4);
HIPATTN_VECTOR_TYPEDEF(unsigned int, 2, Words2);

// Two operands from 8 consecutive 16-bit elements (a 16-byte-aligned address): elements 0..3 are
// `low`, 4..7 `high`. A product contracts over k in any order its two operands agree on, so a row
// read this way feeds two k-steps with one access where load_operand would take two.
struct OperandPair {
  Operand low, high;
};

template <typename T>
HIPATTN_DEVICE OperandPair load_operand_pair(const T* source) {
  static_assert(sizeof(T) == 2, "MFMA operands here are 16-bit");
  const Words4 w = *reinterpret_cast<const Words4*>(source);
  return {__builtin_bit_cast(Operand, Words2{w[0], w[1]}), __builtin_bit_cast(Operand, Words2{w[2], w[3]})};
}

template <typename T>
HIPATTN_DEVICE void store_operand_pair(T* destination, Operand low, Operand high) {
  static_assert(sizeof(T) == 2, "MFMA operands here are 16-bit");
  const Words2 l = __builtin_bit_cast(Words2, low), h = __builtin_bit_cast(Words2, high);
  *reinterpret_cast<Words4*>(destination) = Words4{l[0], l[1], h[0], h[1]};
}

// The B operand of a product that moves the columns of A by `shift`: B[k][n] = 1 where n = k + shift.
// Loop-invariant; kernels build it once.
template <typename T>
HIPATTN_DEVICE Operand shifted_identity(int shift) {
  const int lane = static_cast<int>(threadIdx.x) % 64;
  const short one = static_cast<short>(from_float<T>(1.0f).bits);
  Operand b;
#pragma unroll
  for (int e = 0; e < 4; ++e) b[e] = lane % kTile == 4 * (lane / kTile) + e + shift ? one : short{0};
  return b;
}

// The operand of a 16x16 tile's transpose, in registers: where `x` holds M[c][4q + e] (lane c + 16 q,
// the A or B layout of M), the result holds M[4q + e][c - shift], 0 where c - shift is not a column
// (`identity` is shifted_identity<T>(shift)). One MFMA does it: D = M B has D[m][n] = M[m][n - shift],
// and the accumulator layout hands lane n + 16 q rows m = 4 q + e. Products with 1 and 0 and their
// fp32 sums are exact, so the elements come back unchanged and the bf16 bits are the top half of
// the fp32 ones (gfx90a's MFMA flushes subnormal inputs to zero; a transposed operand only ever
// feeds another MFMA, which would flush them anyway). AMD has no transposing LDS read before gfx950,
// and this costs neither LDS space nor a barrier. exact_bits: the 16 bits of a float that is a T value
// already.
template <typename T>
HIPATTN_DEVICE short exact_bits(float x);

template <>
HIPATTN_DEVICE short exact_bits<bf16_t>(float x) { return static_cast<short>(float_to_bits(x) >> 16); }

template <>
HIPATTN_DEVICE short exact_bits<half_t>(float x) { return static_cast<short>(from_float<half_t>(x).bits); }

template <typename T>
HIPATTN_DEVICE Operand transpose(Operand x, Operand identity) {
  const Accumulator d = mfma_16x16x16<T>(x, identity, zero_accumulator());
  Operand y;
#pragma unroll
  for (int e = 0; e < 4; ++e) y[e] = exact_bits<T>(d[e]);
  return y;
}

}  // namespace mfma
}  // namespace hipattn
