#include "storage/spare_buffers.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace fuyou::storage {

std::optional<AlignedBuffer> SpareBuffers::Take(size_t size) {
  auto best = buffers_.end();
  for (auto it = buffers_.begin(); it != buffers_.end(); ++it) {
    // Ties: the newest (its pages the likeliest to be in the CPU's caches).
    if (it->size() >= size && (best == buffers_.end() || it->size() <= best->size())) best = it;
  }
  if (size == 0 || best == buffers_.end()) return std::nullopt;
  AlignedBuffer buffer = std::move(*best);
  buffers_.erase(best);
  buffer.ShrinkTo(size);
  return buffer;
}

void SpareBuffers::ZeroFrom(AlignedBuffer& buffer, size_t keep) {
  keep = std::min(keep, buffer.size());
  std::memset(buffer.data() + keep, 0, buffer.size() - keep);
}

void SpareBuffers::Put(AlignedBuffer buffer) {
  if (buffer.size() == 0 || max_buffers_ == 0) return;
  if (buffers_.size() == max_buffers_) buffers_.erase(buffers_.begin());
  buffers_.push_back(std::move(buffer));
}

bool SpareBuffers::FreeOne() {
  if (buffers_.empty()) return false;
  buffers_.erase(buffers_.begin());
  return true;
}

uint64_t SpareBuffers::bytes() const {
  uint64_t total = 0;
  for (const AlignedBuffer& buffer : buffers_) total += buffer.size();
  return total;
}

}  // namespace fuyou::storage
