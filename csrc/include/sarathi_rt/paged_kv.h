// Paged KV-cache index math, shared by the CPU and CUDA kernels (and so covered by the
// CPU tests). Cache layout: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
#pragma once

#include "sarathi_rt/common.h"

namespace sarathi_rt {

struct PagedKVLayout {
  int64_t num_blocks;
  int64_t block_size;
  int64_t num_kv_heads;
  int64_t head_dim;

  SRT_HOST_DEVICE int64_t num_slots() const { return num_blocks * block_size; }
  // Elements from one token's row (all heads) to the next inside a block.
  SRT_HOST_DEVICE int64_t token_stride() const { return num_kv_heads * head_dim; }
  SRT_HOST_DEVICE int64_t block_stride() const { return block_size * token_stride(); }

  // Element offset of (slot, head, 0), where slot = block * block_size + offset.
  SRT_HOST_DEVICE int64_t slot_offset(int64_t slot, int64_t head) const {
    return slot * token_stride() + head * head_dim;
  }

  // Element offset of (position `pos` of a sequence, head) through its block table row.
  SRT_HOST_DEVICE int64_t position_offset(const int32_t* block_table_row, int64_t pos,
                                          int64_t head) const {
    const int64_t block = block_table_row[pos / block_size];
    return slot_offset(block * block_size + pos % block_size, head);
  }
};

// Bottom-right causal masking for a chunk of q_len queries appended to a sequence that
// now holds kv_len tokens: query i sees cache positions [0, kv_len - q_len + i].
SRT_HOST_DEVICE int64_t num_visible_keys(int64_t kv_len, int64_t q_len, int64_t i) {
  return kv_len - q_len + i + 1;
}

// First key a query sees under a sliding window of `window` keys (0 = no window), given
// the number of keys it sees causally (num_visible_keys): the window holds the query's
// own key and the window - 1 before it.
SRT_HOST_DEVICE int64_t first_visible_key(int64_t visible, int64_t window) {
  return window > 0 && visible > window ? visible - window : 0;
}

SRT_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace sarathi_rt
