// The first step of a KV-cache call: append the new keys and values to the cache in place, with
// rotary embedding applied to the keys, and write the rotated queries the attention step reads.
//
// New token i of sequence b lands at cache position cache_seqlens[b] + i (of cache batch entry
// cache_batch_idx[b], or of the pages block_table[b] names), unless that is past the cache's
// capacity: the host refuses what it can see, and the kernel drops what it cannot. Rotary position
// of a new key: its cache position; of query token t: cache_seqlens[b] + t when `q_positions_advance`
// (causal and windowed calls), else cache_seqlens[b] for every query token.
//
// Each thread owns one pair of elements of one row: (2i, 2i + 1) interleaved (GPT-J style), or
// (i, i + rotary_dim / 2) otherwise (GPT-NeoX style); past rotary_dim elements are copied. Rotation
// is computed in fp32 and rounded once. Values are copied bit for bit.
#pragma once
#include "decode/cache.h"

namespace hipattn {
namespace decode {

struct PairSlots {
  int first, second;  // element indices of the pair
  int angle;          // its column of rotary_cos/sin, or -1: copied unrotated
};

template <typename Params>
HIPATTN_DEVICE PairSlots pair_slots(const Params& p, int pair) {
  const int half = p.rotary_dim / 2;
  if (p.rotary_interleaved) return {2 * pair, 2 * pair + 1, 2 * pair < p.rotary_dim ? pair : -1};
  if (pair < half) return {pair, pair + half, pair};
  const int first = p.rotary_dim + 2 * (pair - half);
  return {first, first + 1, -1};
}

// Rotates (x, y) by the angle of `position` in column `angle` (rounded to T, as the tables are).
template <typename T, typename Params>
HIPATTN_DEVICE void rotate(const Params& p, int position, int angle, float& x, float& y) {
  if (angle < 0) return;
  const long long at = static_cast<long long>(clamp_int(position, 0, p.rotary_positions - 1)) * p.rotary_stride + angle;
  const float cos = to_float(static_cast<const T*>(p.rotary_cos)[at]);
  const float sin = to_float(static_cast<const T*>(p.rotary_sin)[at]);
  const float rx = x * cos - y * sin;
  y = x * sin + y * cos;
  x = rx;
}

}  // namespace decode

template <typename T>
__global__ void __launch_bounds__(128) decode_append(const DecodeAppendParams p) {
  const int pairs = p.head_dim / 2;
  const long long index = static_cast<long long>(blockIdx.x) * 128 + threadIdx.x;
  const long long kv_pairs = static_cast<long long>(p.batch) * p.seqlen_new * p.heads_kv * pairs;
  const long long q_pairs = p.rotate_q ? static_cast<long long>(p.batch) * p.seqlen_q * p.heads_q * pairs : 0;
  if (index >= kv_pairs + q_pairs) return;

  if (index < kv_pairs) {
    const int pair = static_cast<int>(index % pairs);
    long long row = index / pairs;
    const int head = static_cast<int>(row % p.heads_kv);
    row /= p.heads_kv;
    const int token = static_cast<int>(row % p.seqlen_new);
    const int b = static_cast<int>(row / p.seqlen_new);
    const long long position = static_cast<long long>(decode::cache_length(p, b)) + token;
    if (position >= p.cache_capacity) return;
    const int at = static_cast<int>(position);
    const decode::CacheAddress address = decode::cache_address(p, b, head);
    const long long k_row = address.k + decode::token_offset(p, address, at, p.k_batch_stride, p.k_token_stride);
    const long long v_row = address.v + decode::token_offset(p, address, at, p.v_batch_stride, p.v_token_stride);
    const decode::PairSlots slots = decode::pair_slots(p, pair);
    const T* const k_new = static_cast<const T*>(p.k_new) + b * p.k_new_batch_stride + token * p.k_new_token_stride +
                           head * p.k_new_head_stride;
    const T* const v_new = static_cast<const T*>(p.v_new) + b * p.v_new_batch_stride + token * p.v_new_token_stride +
                           head * p.v_new_head_stride;
    float x = to_float(k_new[slots.first]), y = to_float(k_new[slots.second]);
    if (p.rotary_cos != nullptr) {
      decode::rotate<T>(p, at, slots.angle, x, y);
      static_cast<T*>(p.k)[k_row + slots.first] = from_float<T>(x);
      static_cast<T*>(p.k)[k_row + slots.second] = from_float<T>(y);
    } else {
      static_cast<T*>(p.k)[k_row + slots.first] = k_new[slots.first];
      static_cast<T*>(p.k)[k_row + slots.second] = k_new[slots.second];
    }
    static_cast<T*>(p.v)[v_row + slots.first] = v_new[slots.first];
    static_cast<T*>(p.v)[v_row + slots.second] = v_new[slots.second];
    return;
  }

  const long long q_index = index - kv_pairs;
  const int pair = static_cast<int>(q_index % pairs);
  long long row = q_index / pairs;
  const int head = static_cast<int>(row % p.heads_q);
  row /= p.heads_q;
  const int token = static_cast<int>(row % p.seqlen_q);
  const int b = static_cast<int>(row / p.seqlen_q);
  const int position = decode::cache_length(p, b) + (p.q_positions_advance ? token : 0);
  const decode::PairSlots slots = decode::pair_slots(p, pair);
  const T* const q = static_cast<const T*>(p.q) + b * p.q_batch_stride + token * p.q_token_stride + head * p.q_head_stride;
  float x = to_float(q[slots.first]), y = to_float(q[slots.second]);
  decode::rotate<T>(p, position, slots.angle, x, y);
  T* const q_rotated = static_cast<T*>(p.q_rotated) + b * p.q_rotated_batch_stride + token * p.q_rotated_token_stride +
                       head * p.q_rotated_head_stride;
  q_rotated[slots.first] = from_float<T>(x);
  q_rotated[slots.second] = from_float<T>(y);
}

}  // namespace hipattn
