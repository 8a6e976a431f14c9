// Params structs and launchers of the paged-KV ops. Kernels see raw pointers only.
#pragma once

#include "sarathi_rt/common.h"
#include "sarathi_rt/paged_kv.h"

namespace sarathi_rt {

// Scatters this step's keys and values into their cache slots.
struct WriteKVParams {
  const void* key = nullptr;    // [num_tokens, num_kv_heads, head_dim], last dim contiguous
  const void* value = nullptr;  // same shape as key
  void* k_cache = nullptr;      // PagedKVLayout, contiguous
  void* v_cache = nullptr;
  const int64_t* slot_mapping = nullptr;  // [num_tokens]; negative = skip (padding)
  int64_t num_tokens = 0;
  int64_t key_token_stride = 0, key_head_stride = 0;  // in elements
  int64_t value_token_stride = 0, value_head_stride = 0;
  PagedKVLayout layout{};
  DType dtype = DType::kFloat32;
  // CUDA: wait for the kernel so an out-of-range slot fails this call. Without it the
  // kernel still writes no out-of-range slot, and the next write_kv call on that device
  // reports it (no host sync per call).
  bool sync_check = true;
  int32_t device = 0;  // CUDA device index of the tensors
};

// One launch for a batch mixing prefill chunks and decodes (requests back to back in q).
struct HybridAttentionParams {
  const void* q = nullptr;  // [total_q, num_q_heads, head_dim], last dim contiguous
  void* out = nullptr;      // [total_q, num_q_heads, head_dim], last dim contiguous
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1]
  const int32_t* seqlens_k = nullptr;     // [batch]
  const int32_t* block_tables = nullptr;  // [batch, max_blocks_per_seq]
  int64_t batch = 0;
  int64_t total_q = 0;
  int64_t num_q_heads = 0;
  int64_t max_blocks_per_seq = 0;
  int64_t q_token_stride = 0, q_head_stride = 0;
  int64_t out_token_stride = 0, out_head_stride = 0;
  float scale = 1.0f;
  // Sliding window: query i of a request sees only the last `window` keys up to itself,
  // positions (i - window, i] (Mistral's sliding_window, Gemma's local layers); 0 = all
  // keys. A per-call value, so each layer passes its own; a plan is built for one window.
  int64_t window = 0;
  // Logit soft-capping (Gemma 2): scores become softcap * tanh(scale * q.k / softcap)
  // before the softmax; 0 = off.
  float softcap = 0.0f;
  PagedKVLayout layout{};
  DType dtype = DType::kFloat32;
};

// Checks window >= 0 and softcap finite and >= 0 (0 = off for both), naming the argument.
Status validate_attention_options(const HybridAttentionParams& p);

// Checks the host-side index arrays (cu_seqlens_q, seqlens_k, block tables) against the
// cache; the CPU launcher calls it, and the CUDA path calls it on host copies.
Status validate_attention_indices(const HybridAttentionParams& p);
Status validate_slot_mapping(const WriteKVParams& p);

Status write_kv_cpu(const WriteKVParams& p);
Status hybrid_attention_cpu(const HybridAttentionParams& p);

#if defined(SARATHI_RT_WITH_CUDA)
Status write_kv_cuda(const WriteKVParams& p, void* stream);
#endif

}  // namespace sarathi_rt
