#include "sarathi_rt/block_allocator.h"

#include <algorithm>
#include <string>

namespace sarathi_rt {

BlockAllocator::BlockAllocator(int64_t num_blocks) {
  if (num_blocks < 0 || num_blocks > INT32_MAX) {
    throw std::invalid_argument("num_blocks must be in [0, 2^31), got " + std::to_string(num_blocks));
  }
  const auto n = static_cast<size_t>(num_blocks);
  refcount_.assign(n, 0);
  cached_.assign(n, 0);
  prev_.assign(n, -1);
  next_.assign(n, -1);
  free_.reserve(n);
  for (int64_t id = num_blocks - 1; id >= 0; --id) free_.push_back(static_cast<int32_t>(id));
}

void BlockAllocator::lru_unlink(int32_t id) {
  const int32_t p = prev_[static_cast<size_t>(id)], n = next_[static_cast<size_t>(id)];
  (p >= 0 ? next_[static_cast<size_t>(p)] : lru_head_) = n;
  (n >= 0 ? prev_[static_cast<size_t>(n)] : lru_tail_) = p;
  prev_[static_cast<size_t>(id)] = next_[static_cast<size_t>(id)] = -1;
  --num_cached_free_;
}

void BlockAllocator::lru_push_back(int32_t id) {
  prev_[static_cast<size_t>(id)] = lru_tail_;
  next_[static_cast<size_t>(id)] = -1;
  (lru_tail_ >= 0 ? next_[static_cast<size_t>(lru_tail_)] : lru_head_) = id;
  lru_tail_ = id;
  ++num_cached_free_;
}

std::vector<int32_t> BlockAllocator::allocate(int64_t n) {
  if (n < 0) throw std::invalid_argument("n must be >= 0, got " + std::to_string(n));
  if (n > num_free()) {
    throw OutOfBlocks("cannot allocate " + std::to_string(n) + " KV blocks: only " +
                      std::to_string(num_free()) + " of " + std::to_string(num_blocks()) + " are free");
  }
  const int64_t from_stack = std::min<int64_t>(n, static_cast<int64_t>(free_.size()));
  std::vector<int32_t> ids(free_.end() - from_stack, free_.end());
  free_.resize(free_.size() - static_cast<size_t>(from_stack));
  while (static_cast<int64_t>(ids.size()) < n) {  // evict the least recently released
    const int32_t id = lru_head_;
    lru_unlink(id);
    cached_[static_cast<size_t>(id)] = 0;
    ids.push_back(id);
  }
  for (int32_t id : ids) refcount_[static_cast<size_t>(id)] = 1;
  return ids;
}

void BlockAllocator::check_ids(const std::vector<int32_t>& ids, const char* what, bool allow_cached_free) const {
  for (int32_t id : ids) {
    if (id < 0 || id >= num_blocks()) {
      throw std::invalid_argument(std::string(what) + ": block id " + std::to_string(id) +
                                  " is outside [0, " + std::to_string(num_blocks()) + ")");
    }
    const auto i = static_cast<size_t>(id);
    if (refcount_[i] == 0 && !(allow_cached_free && cached_[i])) {
      throw std::invalid_argument(std::string(what) + ": block " + std::to_string(id) + " is not allocated");
    }
  }
}

void BlockAllocator::free(const std::vector<int32_t>& ids) {
  check_ids(ids, "free", false);
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
  for (int32_t id : released) {
    if (cached_[static_cast<size_t>(id)]) {
      lru_push_back(id);
    } else {
      free_.push_back(id);
    }
  }
}

void BlockAllocator::incref(const std::vector<int32_t>& ids) {
  check_ids(ids, "incref", false);
  for (int32_t id : ids) ++refcount_[static_cast<size_t>(id)];
}

void BlockAllocator::reuse(const std::vector<int32_t>& ids) {
  check_ids(ids, "reuse", true);
  for (int32_t id : ids) {
    if (refcount_[static_cast<size_t>(id)]++ == 0) lru_unlink(id);
  }
}

void BlockAllocator::mark_cached(const std::vector<int32_t>& ids) {
  check_ids(ids, "mark_cached", false);
  for (int32_t id : ids) cached_[static_cast<size_t>(id)] = 1;
}

int32_t BlockAllocator::refcount(int64_t id) const {
  if (id < 0 || id >= num_blocks()) {
    throw std::invalid_argument("block id " + std::to_string(id) + " is outside [0, " +
                                std::to_string(num_blocks()) + ")");
  }
  return refcount_[static_cast<size_t>(id)];
}

bool BlockAllocator::is_cached(int64_t id) const {
  refcount(id);  // range check
  return cached_[static_cast<size_t>(id)] != 0;
}

}  // namespace sarathi_rt
