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

class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks);

  // All-or-nothing: either n fresh blocks (refcount 1) or OutOfBlocks.
  std::vector<int32_t> allocate(int64_t n);
  // Drops one reference of each id; a block returns to the pool at zero. The whole call
  // is checked before anything changes, so a bad id leaves the allocator untouched.
  void free(const std::vector<int32_t>& ids);
  // Adds one reference to each (already allocated) id, for blocks shared between requests.
  void incref(const std::vector<int32_t>& ids);

  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_blocks() const { return static_cast<int64_t>(refcount_.size()); }
  int32_t refcount(int64_t id) const;

 private:
  void check_allocated(const std::vector<int32_t>& ids, const char* what) const;

  std::vector<int32_t> free_;      // a stack; lowest ids are handed out first
  std::vector<int32_t> refcount_;  // 0 = free
};

}  // namespace sarathi_rt
