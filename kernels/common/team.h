// Teams: groups of lanes that share one attention problem, splitting head_dim between them.
#pragma once
#include "common/platform.h"

namespace hipattn {

// After the call, lane l (of each aligned group of W lanes) holds the sum over the W lanes of
// partial[l]: a reduce-scatter. It costs W-1 shuffles per lane for W independent sums, where W
// separate butterfly reductions would cost W*log2(W). Called by every lane of the group.
template <int W>
HIPATTN_DEVICE float reduce_scatter(float (&partial)[W], int lane) {
  const unsigned int mask = group_mask(W);
#pragma unroll
  for (int width = W / 2; width >= 1; width /= 2) {
    // The upper half of each pair keeps entries [width, 2*width) and sends [0, width) away.
    const bool upper = (lane & width) != 0;
#pragma unroll
    for (int k = 0; k < width; ++k) {
      const float send = upper ? partial[k] : partial[k + width];
      const float keep = upper ? partial[k + width] : partial[k];
      partial[k] = keep + shfl_xor(send, width, W, mask);
    }
  }
  return partial[0];
}

}  // namespace hipattn
