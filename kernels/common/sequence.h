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
  int start = 0;
  int length = max_seqlen;
  if (cu_seqlens != nullptr) {
    start = cu_seqlens[batch_index];
    length = cu_seqlens[batch_index + 1] - start;
  }
  if (seqused != nullptr) length = seqused[batch_index];
  start = clamp_int(start, 0, total);
  const int limit = max_seqlen < tile ? max_seqlen : tile;
  length = clamp_int(length, 0, limit < total - start ? limit : total - start);
  return {start, length};
}

}  // namespace hipattn
