// Attention against a KV cache on AMD matrix cores (gfx90a, gfx94x, gfx950; wave64): decode/forward.hip's
// work (one block per sequence, KV head and split; a KV head's query-head group packed into the rows)
// with the dot products on MFMA 16x16x16, the counterpart of decode/forward_mma.hip.
//
// A block holds 16 query rows and WAVES waves; each wave walks its own runs of 16 keys (run r of the
// split goes to wave r % WAVES) with no LDS and no barrier until the end:
//   - Transposed products, as flash/forward_mfma.hip: Sᵀ = K Qᵀ, then Oᵀ = Vᵀ Pᵀ. A lane owns query row
//     lane % 16: four of each run's 16 scores, its running max and sum, and 8 consecutive columns of
//     each 32 of O. Sᵀ's accumulator, rounded, is the B operand Pᵀ as it stands.
//   - Operands straight from global memory, 16 bytes a lane: quarter q of the wave reads elements
//     8q .. 8q + 7 of every 32 columns of its key's K row (and Q row), which feed two k-steps (a product
//     contracts in any order its two operands agree on). V rows are read the same way and turned into
//     Vᵀ operands in registers by an MFMA with the identity (mma_amd.h's transpose), so O's columns come
//     out in that same order: a lane's 8 columns of each 32 are consecutive.
//   - The next run's K and V rows are loaded while this run is computed.
// The waves' softmax states merge through LDS at the end (decode/merge.h). A lane's scores are its
// row's: with SCORE_MODS, the modifiers of that row's query head (common/score_mods.h).
#pragma once
#include "common/mma_amd.h"
#include "common/score_mods.h"
#include "decode/cache.h"
#include "decode/merge.h"

namespace hipattn {
namespace decode {

// The block's layout. The host's row (hipattn/catalog/decode.py, DecodeMfmaTiles) reads kThreads from
// the same numbers; the merge buffers are static LDS.
template <int HEAD_DIM, int WAVES>
struct MfmaLayout {
  static constexpr int kRows = 16;
  static constexpr int kRunKeys = 16;
  static constexpr int kThreads = 64 * WAVES;
  static constexpr int kPairs = HEAD_DIM / 32;  // 16-byte pieces of a row a lane reads: two k-steps each
  static constexpr int kMergePitch = HEAD_DIM + 4;  // floats
  static constexpr int kMergeBytes = WAVES * kRows * (kMergePitch + 2) * 4;

  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "head_dim is a multiple of 32 up to 256");
  static_assert(WAVES >= 1 && WAVES <= 4, "one to four waves");
  // 64 KiB is a workgroup's LDS on gfx90a and gfx94x.
  static_assert(kMergeBytes <= 64 * 1024, "the merge buffers must fit 64 KiB of LDS");
};

}  // namespace decode

template <typename T, int HEAD_DIM, int WAVES, bool SCORE_MODS>
__global__ void __launch_bounds__(64 * WAVES) decode_forward_mfma(const DecodeForwardParams p) {
  using L = decode::MfmaLayout<HEAD_DIM, WAVES>;
  constexpr int kPairs = L::kPairs;
  static_assert(kWarpSize == 64, "MFMA kernels run 64-lane waves");
  __shared__ float merge_max[WAVES * L::kRows];
  __shared__ float merge_sum[WAVES * L::kRows];
  __shared__ float merge_o[WAVES * L::kRows * L::kMergePitch];

  // grid: x (sequence, KV head), y split, z chunk of 16 query rows.
  const int b = blockIdx.x / p.heads_kv;
  const int kv_head = blockIdx.x % p.heads_kv;
  const int split = blockIdx.y;
  const int group = p.heads_q / p.heads_kv;
  const int row0 = blockIdx.z * L::kRows;
  const int rows = p.seqlen_q * group - row0 < L::kRows ? p.seqlen_q * group - row0 : L::kRows;
  const int wave = threadIdx.x / 64;
  const int lane = threadIdx.x % 64;
  const int column = lane % 16;  // this lane's query row, and its key within a run
  const int quarter = lane / 16;

  const decode::CacheAddress address = decode::cache_address(p, b, kv_head);
  const decode::KeyRange range = decode::key_range(p, b);
  int share = (range.total - range.start + p.splits - 1) / p.splits;
  share = (share + L::kRunKeys - 1) / L::kRunKeys * L::kRunKeys;
  const long long first = range.start + static_cast<long long>(split) * share;
  const int key_begin = first < range.total ? static_cast<int>(first) : range.total;
  const int key_end = key_begin + share < range.total ? key_begin + share : range.total;

  // Qᵀ operands of this lane's row (zeros for rows past the block's).
  mfma::OperandPair q[kPairs];
  const int token = (row0 + column) / group;
  const int head = kv_head * group + (row0 + column) % group;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    q[j] = {mfma::zero_operand(), mfma::zero_operand()};
    if (column < rows)
      q[j] = mfma::load_operand_pair<T>(static_cast<const T*>(p.q) + b * p.q_batch_stride + token * p.q_token_stride +
                                        head * p.q_head_stride + 32 * j + 8 * quarter);
  }
  const decode::TokenKeys seen = column < rows ? decode::token_keys(p, range, token) : decode::TokenKeys{0, 0};
  const int diagonal = decode::token_diagonal(p, range, token);
  const Scores<SCORE_MODS> scores = scores_of<SCORE_MODS>(p, b, head);
  const mfma::Operand identity = mfma::shifted_identity<T>(0);

  // A run's K and V rows for this lane: key `column` of the run, 8 of every 32 columns.
  const T* const k_cache = static_cast<const T*>(p.k) + address.k;
  const T* const v_cache = static_cast<const T*>(p.v) + address.v;
  auto load_run = [&](int j0, mfma::OperandPair (&k_rows)[kPairs], mfma::OperandPair (&v_rows)[kPairs]) {
    const int key = j0 + column;
    const bool present = j0 < key_end && key < key_end;
    const decode::TokenSlot slot = present ? decode::token_slot(p, address, key) : decode::TokenSlot{0, 0};
    const T* const k_row = k_cache + decode::slot_offset(slot, p.k_batch_stride, p.k_token_stride) + 8 * quarter;
    const T* const v_row = v_cache + decode::slot_offset(slot, p.v_batch_stride, p.v_token_stride) + 8 * quarter;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      k_rows[j] = v_rows[j] = {mfma::zero_operand(), mfma::zero_operand()};
      if (present) {
        k_rows[j] = mfma::load_operand_pair<T>(k_row + 32 * j);
        v_rows[j] = mfma::load_operand_pair<T>(v_row + 32 * j);
      }
    }
  };

  float row_max = -infinity(), row_sum = 0.0f;
  mfma::Accumulator o[2 * kPairs];  // Oᵀ: [2j] columns 32j + 8q .. + 3, [2j + 1] the next 4
#pragma unroll
  for (int d = 0; d < 2 * kPairs; ++d) o[d] = mfma::zero_accumulator();

  const int stride = WAVES * L::kRunKeys;
  mfma::OperandPair k_rows[kPairs], v_rows[kPairs];
  load_run(key_begin + wave * L::kRunKeys, k_rows, v_rows);
  // Every wave runs the same number of runs (the merge's barrier follows); runs past key_end are zeros.
  for (int run0 = key_begin; run0 < key_end; run0 += stride) {
    const int j0 = run0 + wave * L::kRunKeys;
    mfma::OperandPair k_next[kPairs], v_next[kPairs];
    load_run(j0 + stride, k_next, v_next);

    // ---- Sᵀ = K Qᵀ: this lane gets keys 4 quarter .. + 3 of the run for its row ----
    mfma::Accumulator s = mfma::zero_accumulator();
#pragma unroll
    for (int j = 0; j < kPairs; ++j) s = mfma::mfma_two_steps<T>(k_rows[j].low, k_rows[j].high, q[j].low, q[j].high, s);
    float run_max = -infinity();
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = j0 + 4 * quarter + e;
      s[e] = key >= seen.first && key < key_end && key < seen.end ? scores(s[e], key - diagonal) : -infinity();
      run_max = fmaxf(run_max, s[e]);
    }
    // A row's 16 scores live in the four quarters of the lanes with its column.
    run_max = fmaxf(run_max, shfl_xor(run_max, 16, 64, 0u));
    run_max = fmaxf(run_max, shfl_xor(run_max, 32, 64, 0u));
    const float new_max = fmaxf(row_max, run_max);
    const float reference = new_max == -infinity() ? 0.0f : new_max;
    const float correction = fast_exp2(row_max - reference);
    row_max = new_max;
    row_sum *= correction;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[e] = fast_exp2(s[e] - reference);
      row_sum += s[e];
    }
    const mfma::Operand p_operand = mfma::to_operand<T>(s);

    // ---- Oᵀ += Vᵀ Pᵀ, Vᵀ by transposing this run's V rows in registers ----
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mfma::Accumulator& acc = o[2 * j + h];
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] *= correction;
        const mfma::Operand v_t = mfma::transpose<T>(h == 0 ? v_rows[j].low : v_rows[j].high, identity);
        acc = mfma::mfma_16x16x16<T>(v_t, p_operand, acc);
      }
    }
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      k_rows[j] = k_next[j];
      v_rows[j] = v_next[j];
    }
  }

  // ---- the waves' states into LDS, then merged per row ----
  float sum = row_sum;
  sum += shfl_xor(sum, 16, 64, 0u);
  sum += shfl_xor(sum, 32, 64, 0u);
  if (quarter == 0) {
    merge_max[wave * L::kRows + column] = row_max;
    merge_sum[wave * L::kRows + column] = sum;
  }
  float* const o_row = merge_o + (wave * L::kRows + column) * L::kMergePitch;
#pragma unroll
  for (int j = 0; j < kPairs; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_row[32 * j + 8 * quarter + 4 * h + e] = o[2 * j + h][e];
  __syncthreads();
  decode::merge_and_store<T, HEAD_DIM, L::kRows, SCORE_MODS>(p, {merge_max, merge_sum, merge_o, L::kMergePitch}, WAVES,
                                                             rows, row0, group, b, kv_head, split, L::kThreads);
}

}  // namespace hipattn
