#include "sarathi_rt/block_allocator.h"

#include <string>

namespace sarathi_rt {

BlockAllocator::BlockAllocator(int64_t num_blocks) {
  if (num_blocks < 0 || num_blocks > INT32_MAX) {
    throw std::invalid_argument("num_blocks must be in [0, 2^31), got " + std::to_string(num_blocks));
  }
  refcount_.assign(static_cast<size_t>(num_blocks), 0);
  free_.reserve(static_cast<size_t>(num_blocks));
  for (int64_t id = num_blocks - 1; id >= 0; --id) free_.push_back(static_cast<int32_t>(id));
}

std::vector<int32_t> BlockAllocator::allocate(int64_t n) {
  if (n < 0) throw std::invalid_argument("n must be >= 0, got " + std::to_string(n));
  if (n > num_free()) {
    throw OutOfBlocks("cannot allocate " + std::to_string(n) + " KV blocks: only " +
                      std::to_string(num_free()) + " of " + std::to_string(num_blocks()) + " are free");
  }
  std::vector<int32_t> ids(free_.end() - n, free_.end());
  free_.resize(free_.size() - static_cast<size_t>(n));
  for (int32_t id : ids) refcount_[static_cast<size_t>(id)] = 1;
  return ids;
}

void BlockAllocator::check_allocated(const std::vector<int32_t>& ids, const char* what) const {
  for (int32_t id : ids) {
    if (id < 0 || id >= num_blocks()) {
      throw std::invalid_argument(std::string(what) + ": block id " + std::to_string(id) +
                                  " is outside [0, " + std::to_string(num_blocks()) + ")");
    }
    if (refcount_[static_cast<size_t>(id)] == 0) {
      throw std::invalid_argument(std::string(what) + ": block " + std::to_string(id) + " is not allocated");
    }
  }
}

void BlockAllocator::free(const std::vector<int32_t>& ids) {
  check_allocated(ids, "free");
  // Decrement first; undo everything if one id is freed more often than it is held
  // (e.g. free([3, 3]) with refcount 1), so a bad call changes nothing.
  std::vector<int32_t> released;
  for (size_t i = 0; i < ids.size(); ++i) {
    int32_t& rc = refcount_[static_cast<size_t>(ids[i])];
    if (rc == 0) {
      for (size_t j = 0; j < i; ++j) ++refcount_[static_cast<size_t>(ids[j])];
      throw std::invalid_argument("free: block " + std::to_string(ids[i]) + " freed more times than it is held");
    }
    if (--rc == 0) released.push_back(ids[i]);
  }
  free_.insert(free_.end(), released.begin(), released.end());
}

void BlockAllocator::incref(const std::vector<int32_t>& ids) {
  check_allocated(ids, "incref");
  for (int32_t id : ids) ++refcount_[static_cast<size_t>(id)];
}

int32_t BlockAllocator::refcount(int64_t id) const {
  if (id < 0 || id >= num_blocks()) {
    throw std::invalid_argument("block id " + std::to_string(id) + " is outside [0, " +
                                std::to_string(num_blocks()) + ")");
  }
  return refcount_[static_cast<size_t>(id)];
}

}  // namespace sarathi_rt
