// The varlen backward's work list (hipattn/varlen_metadata.py), derived on the device: one record
// per sequence, bit for bit what the host packer writes. Launched as one block; each chunk of
// BLOCK_THREADS sequences gives one sequence to each thread, and an inclusive scan of the key
// blocks in shared memory (plain loads, stores and barriers: the same on wave32 and wave64) finds
// each sequence's place in the list, the running total carried from chunk to chunk.
//
// The bound: the host sized the dK/dV grid for key_block_bound blocks. The running total never
// decreases, so the sequences whose blocks would pass it form a suffix (malformed cu_seqlens only);
// they get key_length 0, and their first_key_block is where the blocks that fit end.
#pragma once
#include "common/sequence.h"

namespace hipattn {

template <int BLOCK_THREADS>
__global__ void __launch_bounds__(BLOCK_THREADS) varlen_records(const VarlenRecordsParams p) {
  static_assert(BLOCK_THREADS >= 1 && (BLOCK_THREADS & (BLOCK_THREADS - 1)) == 0, "a power-of-two block");
  // 64-bit sums: a malformed batch's unclamped total can pass 2^31 blocks.
  __shared__ long long scan[BLOCK_THREADS];
  __shared__ long long fitting_end;  // end of the blocks that fit the bound, over every chunk so far
  const int t = threadIdx.x;
  const long long bound = p.key_block_bound;
  if (t == 0) fitting_end = 0;
  long long carried = 0;  // key blocks of the chunks before this one
  for (int chunk = 0; chunk < p.batch; chunk += BLOCK_THREADS) {
    const int b = chunk + t;
    Sequence seq_q = {0, 0};
    Sequence seq_k = {0, 0};
    long long blocks = 0;
    if (b < p.batch) {
      // The clamp the attention kernels apply, from the same function.
      seq_q = query_sequence(p, b, p.max_seqlen_q);
      seq_k = key_sequence(p, b, p.max_seqlen_k);
      blocks = (static_cast<long long>(seq_k.length) + p.block_n - 1) / p.block_n;
    }
    scan[t] = blocks;
    __syncthreads();  // also orders fitting_end's first write before any read
    for (int offset = 1; offset < BLOCK_THREADS; offset *= 2) {
      const long long earlier = t >= offset ? scan[t - offset] : 0;
      __syncthreads();
      scan[t] += earlier;
      __syncthreads();
    }
    const long long end = carried + scan[t];  // inclusive: this sequence's blocks end here
    const bool fits = end <= bound;
    // The one thread where fitting stops in this chunk (or its last thread, if all fit) moves the end.
    const bool next_fits = t + 1 < BLOCK_THREADS && carried + scan[t + 1] <= bound;
    if (fits && !next_fits) fitting_end = end;
    __syncthreads();
    if (b < p.batch) {
      const long long start = end - blocks;
      VarlenSequenceRecord record;
      record.query_start = seq_q.start;
      record.query_length = seq_q.length;
      record.key_start = seq_k.start;
      record.key_length = fits ? seq_k.length : 0;
      record.first_key_block = static_cast<int>(start < fitting_end ? start : fitting_end);
      static_cast<VarlenSequenceRecord*>(p.records)[b] = record;
    }
    carried += scan[BLOCK_THREADS - 1];
    __syncthreads();  // every thread has read scan before the next chunk writes it
  }
}

}  // namespace hipattn
