// See step_indices.h.
#include "sarathi_rt/step_indices.h"

#include <algorithm>
#include <string>

namespace sarathi_rt {

Status step_indices_sizes(const StepIndicesInput& in, StepIndicesSizes* sizes, int64_t* bad_chunk) {
  *bad_chunk = -1;
  if (in.batch <= 0) return Status::Invalid("step has no chunks");
  if (in.block_size <= 0) return Status::Invalid("block_size must be positive");
  StepIndicesSizes s;
  for (int64_t b = 0; b < in.batch; ++b) {
    const StepChunk& c = in.chunks[b];
    const int64_t end = c.start_pos + c.num_tokens;
    *bad_chunk = b;
    if (c.num_tokens <= 0 || c.start_pos < 0) return Status::Invalid("empty chunk or negative start_pos");
    if (end > in.max_position) {
      return Status::Invalid("reaches position " + std::to_string(end - 1) +
                             ", beyond the model's max_position_embeddings (" + std::to_string(in.max_position) + ")");
    }
    // Too short a table would be padded with block 0; block ids themselves are
    // range-checked by the attention plan and write_kv.
    if (c.num_blocks * in.block_size < end) {
      return Status::Invalid("block_table of " + std::to_string(c.num_blocks) + " blocks does not map positions 0.." +
                             std::to_string(end - 1) + " into blocks of " + std::to_string(in.block_size));
    }
    if (c.num_targets > c.num_tokens || c.num_targets < 0 || c.num_samples < 0) {
      return Status::Invalid(std::to_string(c.num_targets) + " prompt_targets for a chunk of " +
                             std::to_string(c.num_tokens) + " tokens");
    }
    if (c.num_draft < 0 || (c.num_draft > 0 && (c.num_samples != 1 || c.num_targets != 0 ||
                                                 c.num_draft >= c.num_tokens))) {
      return Status::Invalid(std::to_string(c.num_draft) + " draft tokens in a chunk of " +
                             std::to_string(c.num_tokens) + " tokens with " + std::to_string(c.num_samples) +
                             " samples and " + std::to_string(c.num_targets) +
                             " prompt_targets (drafts need one sample, no prompt targets and a token before them)");
    }
    s.tokens += c.num_tokens;
    s.width = std::max(s.width, c.num_blocks);
    s.rows += c.num_targets + c.num_samples + c.num_draft;
  }
  *bad_chunk = -1;
  const auto [lo, hi] = std::minmax_element(in.token_ids, in.token_ids + s.tokens);
  if (*lo < 0 || *hi >= in.vocab_size) {
    return Status::Invalid("token ids must be in [0, " + std::to_string(in.vocab_size) + ")");
  }
  *sizes = s;
  return Status::Ok();
}

void write_step_indices(const StepIndicesInput& in, const StepIndicesSizes& sizes, int64_t* longs, int32_t* ints) {
  const int64_t bs = in.block_size;
  int64_t* ids = longs;
  int64_t* positions = longs + sizes.tokens;
  int64_t* slots = longs + 2 * sizes.tokens;
  int64_t* rows = longs + 3 * sizes.tokens;
  int32_t* cu_seqlens = ints;
  int32_t* seqlens_k = ints + in.batch + 1;
  int32_t* tables = ints + 2 * in.batch + 1;
  std::copy(in.token_ids, in.token_ids + sizes.tokens, ids);
  int64_t total = 0;  // tokens so far
  cu_seqlens[0] = 0;
  for (int64_t b = 0; b < in.batch; ++b) {
    const StepChunk& c = in.chunks[b];
    const int32_t* table = in.block_tables + c.table_offset;
    for (int64_t i = 0; i < c.num_tokens; ++i) {
      const int64_t p = c.start_pos + i;
      positions[total + i] = p;
      slots[total + i] = static_cast<int64_t>(table[p / bs]) * bs + p % bs;
    }
    for (int64_t i = 0; i < c.num_targets; ++i) *rows++ = total + i;
    total += c.num_tokens;
    // Every sample of the request draws from the chunk's last row; a verifying chunk's
    // one sample draws from each of its last 1 + num_draft rows.
    for (int64_t i = c.num_draft; i > 0; --i) *rows++ = total - 1 - i;
    for (int64_t i = 0; i < c.num_samples; ++i) *rows++ = total - 1;
    cu_seqlens[b + 1] = static_cast<int32_t>(total);
    seqlens_k[b] = static_cast<int32_t>(c.start_pos + c.num_tokens);
    int32_t* row = tables + b * sizes.width;
    std::copy(table, table + c.num_blocks, row);
    std::fill(row + c.num_blocks, row + sizes.width, 0);
  }
}

}  // namespace sarathi_rt
