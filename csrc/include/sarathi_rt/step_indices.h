// The step's index arrays, built in one pass from the chunks the scheduler planned: the
// host side of the scheduler-to-model hand-off (ModelRunner.prepare). Plain C++ with no
// framework types, so any host language can call it and the tests compare it with a
// Python reference.
#pragma once

#include <cstdint>

#include "sarathi_rt/common.h"

namespace sarathi_rt {

// One request's chunk of the step: tokens [token_offset, token_offset + num_tokens) of
// the flat token ids, at positions start_pos.. of its sequence; its block table is
// blocks [table_offset, table_offset + num_blocks) of the flat tables.
struct StepChunk {
  int64_t token_offset = 0;
  int64_t num_tokens = 0;
  int64_t start_pos = 0;
  int64_t table_offset = 0;
  int64_t num_blocks = 0;
  int64_t num_targets = 0;  // prompt positions whose logits score the prompt's next tokens
  int64_t num_samples = 0;  // rows sampled from the chunk's last position: 0, or 1 + forks
  // Speculative decoding: the chunk's last num_draft tokens are proposals to verify, so
  // its one sample draws from each of its last 1 + num_draft positions.
  int64_t num_draft = 0;
};

struct StepIndicesInput {
  const StepChunk* chunks = nullptr;
  int64_t batch = 0;
  const int64_t* token_ids = nullptr;
  const int32_t* block_tables = nullptr;
  int64_t block_size = 0;
  int64_t max_position = 0;  // the model's max_position_embeddings
  int64_t vocab_size = 0;
};

// Sizes of the two output buffers:
//   int64 [3 * tokens + rows]: token ids, positions, slot mapping, logits rows (per chunk:
//         its prompt targets' rows, then its sampled rows: a verifying chunk's last
//         1 + num_draft positions in order);
//   int32 [2 * batch + 1 + batch * width]: cu_seqlens_q, seqlens_k, block tables padded
//         with block 0 to the widest table.
struct StepIndicesSizes {
  int64_t tokens = 0;
  int64_t width = 0;
  int64_t rows = 0;
  int64_t longs() const { return 3 * tokens + rows; }
  int64_t ints(int64_t batch) const { return 2 * batch + 1 + batch * width; }
};

// Validates every chunk (non-empty, start_pos >= 0, within max_position, a block table
// covering its positions, no more prompt targets than tokens, drafts only in a chunk with
// one sample, no prompt targets and more tokens than drafts, token ids in the
// vocabulary) and sizes the buffers. On failure `bad_chunk` names the chunk (-1: the
// token ids, or the batch as a whole).
Status step_indices_sizes(const StepIndicesInput& in, StepIndicesSizes* sizes, int64_t* bad_chunk);

// Fills the buffers of a batch step_indices_sizes accepted.
void write_step_indices(const StepIndicesInput& in, const StepIndicesSizes& sizes, int64_t* longs, int32_t* ints);

}  // namespace sarathi_rt
