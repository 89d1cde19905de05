// Where one sequence of a batch lives, read from device-side lengths and clamped to what the host
// promised: shared by the small-seq and flash kernels.
#pragma once
#include "common/platform.h"

namespace hipattn {

struct Sequence {
  int start;   // token index of the sequence's first row (THD: cu_seqlens[b]; BSHD: 0)
  int length;  // rows, clamped to what the host promised
};

HIPATTN_DEVICE int clamp_int(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Varlen (cu_seqlens), per-sequence lengths (seqused) or plain padded batches. Lengths are clamped
// to min(max_seqlen, tile) and the sequence to [0, total): a malformed cu_seqlens gives wrong
// numbers for that sequence but never an out-of-bounds access. Kernels without a tile limit pass
// max_seqlen as `tile`.
HIPATTN_DEVICE Sequence sequence_bounds(const int* cu_seqlens, const int* seqused, int batch_index, int max_seqlen,
                                        int total, int tile) {
  // 64-bit arithmetic: cu_seqlens holds whatever the caller wrote, and the difference of two
  // arbitrary int32 values overflows int32 (undefined behaviour, not a wrap-around we could rely on).
  long long start = 0;
  long long length = max_seqlen;
  if (cu_seqlens != nullptr) {
    start = cu_seqlens[batch_index];
    length = static_cast<long long>(cu_seqlens[batch_index + 1]) - start;
  }
  if (seqused != nullptr) length = seqused[batch_index];
  start = start < 0 ? 0 : (start > total ? total : start);
  long long limit = max_seqlen < tile ? max_seqlen : tile;
  if (limit > total - start) limit = total - start;
  length = length < 0 ? 0 : (length > limit ? limit : length);
  return {static_cast<int>(start), static_cast<int>(length)};
}

// The query and the key sequence of batch entry `batch_index` as a kernel's parameter struct describes
// them (every attention struct carries the sequence fields of hipattn/catalog/fields.py), each clamped
// to `tile` rows.
template <typename Params>
HIPATTN_DEVICE Sequence query_sequence(const Params& p, int batch_index, int tile) {
  return sequence_bounds(static_cast<const int*>(p.cu_seqlens_q), static_cast<const int*>(p.seqused_q), batch_index,
                         p.max_seqlen_q, p.total_q, tile);
}

template <typename Params>
HIPATTN_DEVICE Sequence key_sequence(const Params& p, int batch_index, int tile) {
  return sequence_bounds(static_cast<const int*>(p.cu_seqlens_k), static_cast<const int*>(p.seqused_k), batch_index,
                         p.max_seqlen_k, p.total_k, tile);
}

}  // namespace hipattn
