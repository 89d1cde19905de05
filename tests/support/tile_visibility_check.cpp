// Checks kernels/flash/tile_visibility.h against the mask rule itself (key_in_window and the two
// lengths), entry by entry, on random tiles: lengths up to the int32 limit, windows from causal to
// unbounded, and tiles placed across the sequences' ends and the window's edges, where the bits change.
// Prints "checked <entries> mismatches <count>", then the first mismatch if any; tests/test_tile_visibility.py
// builds and runs it with the emulated device's header (g++).
#include "common/platform.h"
#include "flash/tile_visibility.h"

#include <cstdio>
#include <cstdlib>

namespace {

unsigned long long state;

unsigned long long next() {  // splitmix64
  unsigned long long z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

long long uniform(long long lo, long long hi) {  // [lo, hi]
  return lo + static_cast<long long>(next() % static_cast<unsigned long long>(hi - lo + 1));
}

// Lengths stay under the int32 limit by more than a tile: the kernels' row and key indices are ints.
constexpr long long kLongest = (1ll << 31) - 256;

long long length() { return next() % 2 ? uniform(1, 300) : uniform(1, kLongest); }

int window_side(long long max_seqlen) {
  switch (next() % 4) {
    case 0: return 0;                                     // causal's right side
    case 1: return static_cast<int>(uniform(1, 200));
    case 2: return static_cast<int>(uniform(1, kLongest));
    default: return static_cast<int>(max_seqlen);         // no bound: the host passes max_seqlen
  }
}

long long checked = 0, mismatches = 0;

template <typename Bits, int Q_TILES>
void check_one() {
  const long long len_q = length(), len_k = length();
  const long long max_seqlen = uniform(len_q > len_k ? len_q : len_k, kLongest);
  const hipattn::KeyWindow window{window_side(max_seqlen), window_side(max_seqlen)};
  const int diagonal = static_cast<int>(len_k - len_q);
  const int t = static_cast<int>(uniform(0, 3));
  // A tile's first query lies in its sequence; its keys start anywhere a block of 64 reaches.
  const long long m0 = next() % 2 ? uniform(0, len_q - 1) : uniform(len_q > 128 ? len_q - 128 : 0, len_q - 1);
  long long key;
  switch (next() % 3) {
    case 0: key = uniform(0, len_k + 63); break;
    case 1: key = m0 + diagonal - window.left + uniform(-80, 80); break;   // the window's left edge
    default: key = m0 + diagonal + window.right + uniform(-80, 80); break;  // its right edge
  }
  if (key < 0) key = uniform(0, 15);
  if (key > len_k + 63) key = len_k + uniform(0, 63);
  const Bits bits = hipattn::transposed_visible_bits<Bits, Q_TILES>(
      static_cast<int>(key), static_cast<int>(m0), t, static_cast<int>(len_q), static_cast<int>(len_k), diagonal,
      window);
  for (int n = 0; n < Q_TILES; ++n)
    for (int e = 0; e < 4; ++e) {
      const long long query = m0 + 2 * t + 8 * n + (e & 1);
      const long long row_key = key + 8 * (e / 2);
      const bool expected = query < len_q && row_key < len_k &&
                            hipattn::key_in_window(static_cast<int>(query), static_cast<int>(row_key), diagonal, window);
      const bool got = ((bits >> (4 * n + e)) & 1u) != 0;
      ++checked;
      if (got != expected && mismatches++ == 0)
        std::printf("first mismatch: Q_TILES %d len_q %lld len_k %lld window (%d, %d) m0 %lld t %d key %lld "
                    "entry (%d, %d): got %d, expected %d\n",
                    Q_TILES, len_q, len_k, window.left, window.right, m0, t, key, n, e, got, expected);
    }
}

}  // namespace

int main(int argc, char** argv) {
  const long long tiles = argc > 1 ? std::atoll(argv[1]) : 100000;
  state = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  for (long long i = 0; i < tiles; ++i) {
    check_one<unsigned int, 4>();               // head_dim 256: 32 queries per warpgroup
    check_one<unsigned int, 8>();               // 64 queries
    check_one<unsigned long long, 16>();        // head_dim 64's 128-query tiles
  }
  std::printf("checked %lld mismatches %lld\n", checked, mismatches);
  return mismatches != 0;
}
