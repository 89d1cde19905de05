// Where a KV cache's rows live and which of them a query sees, for the kernels that read the cache
// (decode/forward.hip, decode/forward_mma.hip, decode/forward_mfma.hip) and the one that writes it
// (decode/append.hip). Every index read from device memory is clamped to what the host described
// (cache batch entries or pages, the block table's width, the capacity), so a bad cache_seqlens,
// block table or batch index gives wrong numbers but never an access out of bounds.
#pragma once
#include "common/key_window.h"
#include "common/types.h"

namespace hipattn {
namespace decode {

// The smallest power of two >= N (a template: NVRTC compiles no unannotated constexpr function).
template <int N>
struct NextPowerOfTwo {
  static constexpr int value = N <= 1 ? 1 : 2 * NextPowerOfTwo<(N + 1) / 2>::value;
};
template <>
struct NextPowerOfTwo<1> {
  static constexpr int value = 1;
};

// Tokens in sequence b's cache before this call's append (cache_seqlens, a device array or one host int).
template <typename Params>
HIPATTN_DEVICE int cache_length(const Params& p, int b) {
  const int* lengths = static_cast<const int*>(p.cache_seqlens);
  const int length = lengths != nullptr ? lengths[b] : p.cache_seqlen;
  return clamp_int(length, 0, p.cache_capacity);
}

// Sequence b's rows of one KV head: key j is token j % page_size of page pages[j / page_size] with a
// block table, else token j of cache batch entry cache_batch_idx[b] (or b).
struct CacheAddress {
  long long k;        // element offset of the sequence's K rows (contiguous) or of the head (paged)
  long long v;
  const int* pages;   // the sequence's block table row, or null
};

// The batch entry of a contiguous cache that sequence b uses: cache_batch_idx[b], or b.
template <typename Params>
HIPATTN_DEVICE int cache_entry(const Params& p, int b) {
  const int* batch_index = static_cast<const int*>(p.cache_batch_idx);
  return batch_index != nullptr ? clamp_int(batch_index[b], 0, p.cache_entries - 1) : b;
}

template <typename Params>
HIPATTN_DEVICE CacheAddress cache_address(const Params& p, int b, int kv_head) {
  if (p.block_table != nullptr)
    return {kv_head * p.k_head_stride, kv_head * p.v_head_stride,
            static_cast<const int*>(p.block_table) + b * p.block_table_batch_stride};
  const long long entry = cache_entry(p, b);
  return {entry * p.k_batch_stride + kv_head * p.k_head_stride, entry * p.v_batch_stride + kv_head * p.v_head_stride,
          nullptr};
}

// Where token `j` of the sequence is: its page (0 when not paged) and its token within the page (j).
struct TokenSlot {
  long long page;
  int token;
};

template <typename Params>
HIPATTN_DEVICE TokenSlot token_slot(const Params& p, const CacheAddress& a, int j) {
  if (a.pages == nullptr) return {0, j};
  const int page = clamp_int(a.pages[clamp_int(j / p.page_size, 0, p.pages_per_sequence - 1)], 0, p.cache_entries - 1);
  return {page, j % p.page_size};
}

// Element offset of a slot's row from the address's base (`batch_stride` is a page's stride when paged).
HIPATTN_DEVICE long long slot_offset(const TokenSlot& slot, long long batch_stride, long long token_stride) {
  return slot.page * batch_stride + slot.token * token_stride;
}

template <typename Params>
HIPATTN_DEVICE long long token_offset(const Params& p, const CacheAddress& a, int j, long long batch_stride,
                                      long long token_stride) {
  return slot_offset(token_slot(p, a, j), batch_stride, token_stride);
}

// The keys a sequence's rows may see: [start, total), total = the cache's tokens after the append.
// The window (common/key_window.h, aligned with the cache's end) cuts the start to the first key
// its first query token sees: the later tokens' windows start no earlier, so the splits share out
// only keys some row sees.
struct KeyRange {
  int start;  // cache_leftpad[b] or the window's first key, whichever is later
  int total;
};

template <typename Params>
HIPATTN_DEVICE KeyRange key_range(const Params& p, int b) {
  const long long appended = static_cast<long long>(cache_length(p, b)) + p.seqlen_new;
  const int total = static_cast<int>(appended < p.cache_capacity ? appended : p.cache_capacity);
  const int* leftpad = static_cast<const int*>(p.cache_leftpad);
  const int padding = leftpad != nullptr ? clamp_int(leftpad[b], 0, total) : 0;
  const int window_start = first_visible_key(0, total - p.seqlen_q, key_window(p), total);
  return {padding > window_start ? padding : window_start, total};
}

// The keys [first, end) query token `token` of seqlen_q sees: the mask. The window's diagonal
// aligns the last query token with the last key (bottom-right); leftpad only moves the start.
struct TokenKeys {
  int first;
  int end;
};

template <typename Params>
HIPATTN_DEVICE TokenKeys token_keys(const Params& p, const KeyRange& range, int token) {
  const int diagonal = range.total - p.seqlen_q;
  const int first = first_visible_key(token, diagonal, key_window(p), range.total);
  return {first > range.start ? first : range.start, visible_key_end(token, diagonal, key_window(p), range.total)};
}

// The key on query token `token`'s diagonal (the window's, as token_keys aligns it), from which a score
// modifier measures a key's distance (common/score_mods.h). flash-attn counts ALiBi's positions from
// cache_leftpad, in the key's and in len_k alike, so the padding cancels out of the distance.
template <typename Params>
HIPATTN_DEVICE int token_diagonal(const Params& p, const KeyRange& range, int token) {
  return token + range.total - p.seqlen_q;
}

}  // namespace decode
}  // namespace hipattn
