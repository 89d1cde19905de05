// Dropout of the attention probabilities: flash-attn's dropout_p, forward and backward.
//
// Which probabilities are dropped is a pure function of the call's 64-bit seed and the element's
// place: (sequence, query head, query row, key), rows and keys counted from the sequence's start. No
// kernel's tiling enters it, so a forward, both backward schedules, every vendor's kernels and the
// host's reference (hipattn/dropout.py) agree on every element.
//
// The random numbers are Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"),
// keyed by the seed. Element (row i, key j) of stream bh = sequence * heads_q + query head is 16-bit
// lane 2 w + h of the counter (i, 4 (j / 32) + (j % 8) / 2, bh, 0), with w = (j % 32) / 8 and h = j % 2
// (h = 0: the word's low half). It is kept when that value is at least `threshold`, round(dropout_p
// · 65536): the drop rate is dropout_p to within 2^-17.
//
// The counter is laid out for the tensor cores' m16n8 accumulators, where a lane holds keys 2t and
// 2t + 1 of every 8 for a row: one Philox call gives a lane all eight of its values among 32 keys, and
// the word w of the result is the packed pair of 8-key tile w, in the order the kernels pack P. Other
// layouts call it per pair of keys and use what they need.
//
// Kept probabilities are scaled by 1 / (1 - dropout_p) where P meets V (the forward folds the factor
// into O's normalization; the backward into dV's and dP's products); the softmax's sum and the LSE
// are those of the undropped probabilities, as flash-attn's.
//
// Dropout<false> keeps everything and compiles to nothing (its active() is a constant false, so the
// kernels' `if (dropout.active())` blocks vanish): the plain instantiations are unchanged.
// Dropout<true> is read from the parameter struct at run time; threshold 0 (dropout_p = 0) keeps
// everything, and kernels test active() once per tile rather than once per element.
#pragma once
#include "common/platform.h"

namespace hipattn {

// 32 x 32 -> 64-bit product, returned as its high word with the low word in `low`: one mul.wide or
// v_mul_hi/v_mul_lo pair on the hardware.
HIPATTN_DEVICE unsigned int multiply_high_low(unsigned int a, unsigned int b, unsigned int& low) {
  const unsigned long long product = static_cast<unsigned long long>(a) * b;
  low = static_cast<unsigned int>(product);
  return static_cast<unsigned int>(product >> 32);
}

// Philox4x32 with 10 rounds: the four 32-bit words of counter x under key (k0, k1), in place. The
// rounds are unrolled by UNROLL: fully by default; a caller that makes its calls in a rolled loop can
// roll the rounds too, so that the ten round keys, uniform over a wave, are not all hoisted into
// scalar registers ahead of the loop (on AMD they pushed a kernel past its 102 SGPRs).
template <int UNROLL = 10>
HIPATTN_DEVICE void philox4x32_10(unsigned int (&x)[4], unsigned int k0, unsigned int k1) {
  constexpr unsigned int kMultiplier0 = 0xD2511F53u;
  constexpr unsigned int kMultiplier1 = 0xCD9E8D57u;
  constexpr unsigned int kWeyl0 = 0x9E3779B9u;  // the golden ratio's fraction, and sqrt(3) - 1
  constexpr unsigned int kWeyl1 = 0xBB67AE85u;
#pragma unroll UNROLL
  for (int round = 0; round < 10; ++round) {
    unsigned int low0, low1;
    const unsigned int high0 = multiply_high_low(kMultiplier0, x[0], low0);
    const unsigned int high1 = multiply_high_low(kMultiplier1, x[2], low1);
    const unsigned int y0 = high1 ^ x[1] ^ k0;
    const unsigned int y2 = high0 ^ x[3] ^ k1;
    x[0] = y0;
    x[1] = low1;
    x[2] = y2;
    x[3] = low0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
}

// Word w (0..3, known only at run time) of a Philox result, by selection: indexing the array with w
// would place it in local memory.
HIPATTN_DEVICE unsigned int select_word(const unsigned int (&x)[4], int w) {
  return w == 0 ? x[0] : w == 1 ? x[1] : w == 2 ? x[2] : x[3];
}

template <bool ENABLED>
struct Dropout;

template <>
struct Dropout<false> {
  HIPATTN_DEVICE bool active() const { return false; }
  HIPATTN_DEVICE float scale() const { return 1.0f; }
  HIPATTN_DEVICE void words(int row, int stripe, int pair, unsigned int (&x)[4]) const {
    (void)row;
    (void)stripe;
    (void)pair;
    x[0] = x[1] = x[2] = x[3] = 0xffffffffu;
  }
  HIPATTN_DEVICE bool kept(unsigned int word, bool high) const {
    (void)word;
    (void)high;
    return true;
  }
  HIPATTN_DEVICE unsigned int keep_run4(int row, int key) const {
    (void)row;
    (void)key;
    return 0xfu;
  }
  HIPATTN_DEVICE unsigned int row_bits32(int row) const {
    (void)row;
    return 0xffffffffu;
  }
  template <int N_TILES>
  HIPATTN_DEVICE unsigned long long m16n8_bits(int row, int n0, int t) const {
    (void)row;
    (void)n0;
    (void)t;
    return ~0ull;
  }
  template <int Q_TILES>
  HIPATTN_DEVICE unsigned long long transposed_m16n8_bits(int key0, int query0, int t) const {
    (void)key0;
    (void)query0;
    (void)t;
    return ~0ull;
  }
  template <typename Params>
  HIPATTN_DEVICE Dropout with_head(const Params& p, int sequence, int head) const {
    (void)p;
    (void)sequence;
    (void)head;
    return *this;
  }
};

template <>
struct Dropout<true> {
  unsigned int threshold;  // round(dropout_p · 65536); 0 keeps everything
  float keep_scale;        // 1 / (1 - dropout_p)
  // The call's 64-bit seed, read where words() needs it (an L1 hit) rather than held: two registers
  // live through a whole kernel pushed the modified wgmma dK/dV kernel past its 255-register bound.
  const unsigned long long* seed;
  unsigned int stream;  // sequence * heads_q + query head

  HIPATTN_DEVICE bool active() const { return threshold != 0u; }
  HIPATTN_DEVICE float scale() const { return keep_scale; }

  // The random words of query row `row` for the keys j with j / 32 == stripe and (j % 8) / 2 == pair:
  // word w holds keys 32 stripe + 8 w + 2 pair (low half) and + 1 (high half). UNROLL is Philox's.
  template <int UNROLL = 10>
  HIPATTN_DEVICE void words(int row, int stripe, int pair, unsigned int (&x)[4]) const {
    x[0] = static_cast<unsigned int>(row);
    x[1] = static_cast<unsigned int>(4 * stripe + pair);
    x[2] = stream;
    x[3] = 0u;
    const unsigned long long key = *seed;
    philox4x32_10<UNROLL>(x, static_cast<unsigned int>(key), static_cast<unsigned int>(key >> 32));
  }
  // Whether the low (high = false) or high half of a random word keeps its element.
  HIPATTN_DEVICE bool kept(unsigned int word, bool high) const {
    return (high ? word >> 16 : word & 0xffffu) >= threshold;
  }
  // Four consecutive keys key .. key + 3 (key a multiple of 4) of one row, as bits 0..3: two calls.
  HIPATTN_DEVICE unsigned int keep_run4(int row, int key) const {
    unsigned int first[4], second[4];
    words(row, key / 32, (key % 8) / 2, first);
    words(row, key / 32, (key % 8) / 2 + 1, second);
    const unsigned int low = select_word(first, (key % 32) / 8);
    const unsigned int high = select_word(second, (key % 32) / 8);
    return (kept(low, false) ? 1u : 0u) | (kept(low, true) ? 2u : 0u) | (kept(high, false) ? 4u : 0u) |
           (kept(high, true) ? 8u : 0u);
  }
  // The keep bits of keys 0..31 of row `row`, bit j for key j: the whole of a row the small-seq kernels
  // hold (at most 17 keys), in four calls, one per pair (j % 8) / 2. A rolled loop, as m16n8_bits's,
  // of Philox calls with rolled rounds: the MFMA small-seq forward, which holds a whole row's K and V
  // in registers, has no scalar registers left for ten hoisted round keys.
  HIPATTN_DEVICE unsigned int row_bits32(int row) const {
    unsigned int bits = 0u;
#pragma unroll 1
    for (int pair = 0; pair < 4; ++pair) {
      unsigned int x[4];
      words<1>(row, 0, pair, x);
#pragma unroll
      for (int w = 0; w < 4; ++w)
        bits |= ((kept(x[w], false) ? 1u : 0u) | (kept(x[w], true) ? 2u : 0u)) << (8 * w + 2 * pair);
    }
    return bits;
  }
  // The keep bits of row `row` in the m16n8 accumulator layout: bit 2n (and 2n + 1) for key
  // n0 + 8 n + 2 t (and + 1), n0 a multiple of 8 N_TILES; m16n8_masks spreads them into packed-pair
  // masks. With whole 32-key stripes, one call per stripe. The calls run in a rolled loop: one Philox
  // body in the kernel rather than one per stripe, whose copies would grow the kernel with dropout off too.
  template <int N_TILES>
  HIPATTN_DEVICE unsigned long long m16n8_bits(int row, int n0, int t) const {
    static_assert(N_TILES <= 32, "two keep bits per 8-key tile fit one 64-bit word");
    constexpr int kTilesPerCall = N_TILES % 4 == 0 ? 4 : 1;  // a call's words are four 8-key tiles
    unsigned long long bits = 0ull;
#pragma unroll 1
    for (int first = 0; first < N_TILES; first += kTilesPerCall) {
      const int key = n0 + 8 * first;
      unsigned int x[4];
      words(row, key / 32, t, x);
#pragma unroll
      for (int w = 0; w < kTilesPerCall; ++w) {
        const unsigned int word = kTilesPerCall == 4 ? x[w] : select_word(x, (key % 32) / 8);
        const unsigned long long pair = (kept(word, false) ? 1ull : 0ull) | (kept(word, true) ? 2ull : 0ull);
        bits |= pair << (2 * (first + w));
      }
    }
    return bits;
  }
  // The keep bits of a lane's entries in a transposed m16n8 tile (keys as rows, queries as columns:
  // the backward's dK/dV kernels): bit 4 n + e for entry e of query tile n, keys key0 (e < 2) and
  // key0 + 8, queries query0 + 8 n + 2 t + (e & 1). With key0 % 16 < 8 both keys lie in one call's
  // words (key0 % 32) / 8 and the next, at half key0 % 2, and the other half of those words holds
  // key0 ^ 1 and key0 ^ 1 + 8: the keys of lane ^ 4 (g ^ 1, the same t). So each lane of that pair calls
  // for one of the two queries, 2 t + key0 % 2, keeps its own half and hands the other to its partner,
  // which called for the other query: one call per query tile, and one shuffle. Every lane of the warp
  // takes part, with key0 = (a multiple of 16) + lane / 4 and t = lane % 4. A rolled loop, as
  // m16n8_bits's: unrolled, the Philox copies made the modified kernels a third larger.
  template <int Q_TILES>
  HIPATTN_DEVICE unsigned long long transposed_m16n8_bits(int key0, int query0, int t) const {
    static_assert(Q_TILES <= 16, "two keep bits per 8-query tile and key pair fit one 32-bit word");
    const bool high = (key0 & 1) != 0;  // this lane's half of each word; its partner's is the other
    const int near_word = (key0 % 32) / 8;
    unsigned int own = 0u, partners = 0u;  // bits 2 n (key0 or its partner's) and 2 n + 1 (+ 8)
#pragma unroll 1
    for (int n = 0; n < Q_TILES; ++n) {
      unsigned int x[4];
      words(query0 + 8 * n + 2 * t + (high ? 1 : 0), key0 / 32, (key0 % 8) / 2, x);
      const unsigned int near = select_word(x, near_word), far = select_word(x, near_word + 1);
      own |= ((kept(near, high) ? 1u : 0u) | (kept(far, high) ? 2u : 0u)) << (2 * n);
      partners |= ((kept(near, !high) ? 1u : 0u) | (kept(far, !high) ? 2u : 0u)) << (2 * n);
    }
    // The partner's call for this lane's other query, 2 t + 1 - key0 % 2, in this lane's half.
    const unsigned int theirs = shfl_xor(partners, 4, 32, 0xffffffffu);
    const unsigned int even = high ? theirs : own, odd = high ? own : theirs;  // queries 2 t and 2 t + 1
    unsigned long long bits = 0ull;
#pragma unroll
    for (int n = 0; n < Q_TILES; ++n) {
      const unsigned long long e = (even >> (2 * n)) & 3u, o = (odd >> (2 * n)) & 3u;
      bits |= ((e & 1u) | (o & 1u) << 1 | (e >> 1) << 2 | (o >> 1) << 3) << (4 * n);
    }
    return bits;
  }
  template <typename Params>
  HIPATTN_DEVICE Dropout with_head(const Params& p, int sequence, int head) const {
    Dropout d = *this;
    d.stream = static_cast<unsigned int>(sequence * p.heads_q + head);
    return d;
  }
};

// m16n8_bits's keep bits as the packed-pair masks of a row: mask[n] keeps (0xffff) or drops (0) the low
// and high halves of 8-key tile n's pair, as the kernels pack P.
template <int N_TILES>
HIPATTN_DEVICE void m16n8_masks(unsigned long long bits, unsigned int (&mask)[N_TILES]) {
#pragma unroll
  for (int n = 0; n < N_TILES; ++n) {
    const unsigned long long pair = bits >> (2 * n);
    mask[n] = ((pair & 1ull) != 0 ? 0x0000ffffu : 0u) | ((pair & 2ull) != 0 ? 0xffff0000u : 0u);
  }
}

// The dropout of query head `head` of sequence `sequence`, from a parameter struct with the dropout
// fields of hipattn/catalog/fields.py (dropout_threshold: 0 for none; dropout_scale; dropout_seed: a
// device pointer to the call's 64-bit seed, read only when dropout is on). Plain kernels read none.
template <bool ENABLED, typename Params>
HIPATTN_DEVICE Dropout<ENABLED> dropout_of(const Params& p, int sequence, int head) {
  Dropout<ENABLED> dropout;
  if constexpr (ENABLED) {
    dropout.threshold = static_cast<unsigned int>(p.dropout_threshold);
    dropout.keep_scale = p.dropout_scale;
    dropout.seed = static_cast<const unsigned long long*>(p.dropout_seed);
    dropout.stream = static_cast<unsigned int>(sequence * p.heads_q + head);
  } else {
    (void)p;
    (void)sequence;
    (void)head;
  }
  return dropout;
}

}  // namespace hipattn
