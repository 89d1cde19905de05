// Teams: groups of lanes that share one attention problem, splitting head_dim between them.
#pragma once
#include "common/platform.h"

namespace hipattn {

namespace detail {

// One butterfly step of reduce_scatter at a compile-time width, then the next one down. The width
// is a template argument so every index into `partial` is a constant from the start: selecting or
// indexing with anything else makes the compiler move the array to local memory.
template <int W, int WIDTH>
struct ReduceScatterStep {
  HIPATTN_DEVICE static void run(float (&partial)[W], int lane, unsigned int mask) {
    // The upper half of each pair keeps entries [WIDTH, 2*WIDTH) and sends [0, WIDTH) away.
    const bool upper = (lane & WIDTH) != 0;
#pragma unroll
    for (int k = 0; k < WIDTH; ++k) {
      const float lower_value = partial[k];
      const float upper_value = partial[k + WIDTH];
      const float send = upper ? lower_value : upper_value;
      const float keep = upper ? upper_value : lower_value;
      partial[k] = keep + shfl_xor(send, WIDTH, W, mask);
    }
    ReduceScatterStep<W, WIDTH / 2>::run(partial, lane, mask);
  }
};

template <int W>
struct ReduceScatterStep<W, 0> {
  HIPATTN_DEVICE static void run(float (&)[W], int, unsigned int) {}
};

}  // namespace detail

// After the call, lane l (of each aligned group of W lanes) holds the sum over the W lanes of
// partial[l]: a reduce-scatter. It costs W-1 shuffles per lane for W independent sums, where W
// separate butterfly reductions would cost W*log2(W). Called by every lane of the group.
template <int W>
HIPATTN_DEVICE float reduce_scatter(float (&partial)[W], int lane) {
  static_assert(W >= 1 && W <= 32 && (W & (W - 1)) == 0, "W is a power of two up to 32");
  detail::ReduceScatterStep<W, W / 2>::run(partial, lane, group_mask(W));
  return partial[0];
}

}  // namespace hipattn
