// Reference-counted allocator of KV-cache block ids. Pure host code, no tensors.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace sarathi_rt {

// Thrown when an allocation asks for more blocks than are free; nothing is allocated.
class OutOfBlocks : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A block is free (refcount 0, on the free stack), used (refcount > 0), or cached-free:
// refcount 0 but its contents are kept for prefix caching, on an LRU list. Allocation
// takes free blocks first and evicts the least recently released cached-free block only
// when none is left, so num_free counts both kinds.
class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks);

  // All-or-nothing: either n blocks (refcount 1, no longer cached) or OutOfBlocks.
  std::vector<int32_t> allocate(int64_t n);
  // Drops one reference of each id; at zero a block returns to the free stack, or to the
  // back of the LRU list if it is cached. The whole call is checked before anything
  // changes, so a bad id leaves the allocator untouched.
  void free(const std::vector<int32_t>& ids);
  // Adds one reference to each (already allocated) id, for blocks shared between requests.
  void incref(const std::vector<int32_t>& ids);
  // incref that also takes cached-free blocks back into use (a prefix-cache hit).
  void reuse(const std::vector<int32_t>& ids);
  // Marks used blocks as cached: at refcount zero they stay reusable until evicted.
  void mark_cached(const std::vector<int32_t>& ids);

  int64_t num_free() const { return static_cast<int64_t>(free_.size()) + num_cached_free_; }
  int64_t num_cached_free() const { return num_cached_free_; }
  int64_t num_blocks() const { return static_cast<int64_t>(refcount_.size()); }
  int32_t refcount(int64_t id) const;
  bool is_cached(int64_t id) const;

 private:
  void check_ids(const std::vector<int32_t>& ids, const char* what, bool allow_cached_free) const;
  void lru_unlink(int32_t id);
  void lru_push_back(int32_t id);

  std::vector<int32_t> free_;      // a stack; lowest ids are handed out first
  std::vector<int32_t> refcount_;  // 0 = free or cached-free
  std::vector<uint8_t> cached_;
  // Doubly linked LRU list of cached-free blocks through prev_/next_; -1 ends it.
  std::vector<int32_t> prev_, next_;
  int32_t lru_head_ = -1, lru_tail_ = -1;
  int64_t num_cached_free_ = 0;
};

}  // namespace sarathi_rt
