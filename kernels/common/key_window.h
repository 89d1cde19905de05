// Which keys a query row sees: the one mask rule every attention kernel applies (flash-attn's
// conventions). With diagonal = len_k - len_q (the window is bottom-right aligned), query i of a
// sequence sees key j when
//     i + diagonal - window_left  <=  j  <=  i + diagonal + window_right.
// The host encodes everything as these two numbers: causal is window_right = 0, and a side with no
// bound gets max_seqlen, wider than any sequence, so no kernel branches on which sides are bounded
// (hipattn/ops/fields.py: kernel_window). A row whose window holds no key of its sequence sees
// nothing: O = 0, LSE = +inf.
//
// Score modifiers (softcap, ALiBi) act on the visible scores only, so they slot in after this test.
#pragma once
#include "common/sequence.h"

namespace hipattn {

struct KeyWindow {
  int left;   // keys before the diagonal a row sees (>= 0)
  int right;  // keys after it (>= 0; 0 is causal)
};

template <typename Params>
HIPATTN_DEVICE KeyWindow key_window(const Params& p) {
  return {p.window_left, p.window_right};
}

// 64-bit sums: row + diagonal + max_seqlen can pass INT_MAX for lengths near the int32 limit.
HIPATTN_DEVICE int clamp_sum(long long sum, int hi) {
  return sum < 0 ? 0 : (sum > hi ? hi : static_cast<int>(sum));
}

// The first key query `row` sees, in [0, len_k].
HIPATTN_DEVICE int first_visible_key(int row, int diagonal, KeyWindow w, int len_k) {
  return clamp_sum(static_cast<long long>(row) + diagonal - w.left, len_k);
}

// One past the last key query `row` sees, in [0, len_k].
HIPATTN_DEVICE int visible_key_end(int row, int diagonal, KeyWindow w, int len_k) {
  return clamp_sum(static_cast<long long>(row) + diagonal + w.right + 1, len_k);
}

HIPATTN_DEVICE bool key_in_window(int row, int key, int diagonal, KeyWindow w) {
  const long long offset = static_cast<long long>(key) - row - diagonal;
  return offset >= -w.left && offset <= w.right;
}

// The query rows that see some key of [key_begin, key_end): [first, end), in [0, len_q]. The
// backward's key-block kernels visit these rows' tiles only.
struct RowRange {
  int first;
  int end;
};

HIPATTN_DEVICE RowRange rows_seeing(int key_begin, int key_end, int diagonal, KeyWindow w, int len_q) {
  // Row i sees key j when j - diagonal - right <= i <= j - diagonal + left.
  return {clamp_sum(static_cast<long long>(key_begin) - diagonal - w.right, len_q),
          clamp_sum(static_cast<long long>(key_end) - 1 - diagonal + w.left + 1, len_q)};
}

}  // namespace hipattn
