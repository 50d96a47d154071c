#include "storage/spare_buffers.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace fuyou::storage {

std::optional<AlignedBuffer> SpareBuffers::Take(size_t size) {
  auto it = std::find_if(buffers_.rbegin(), buffers_.rend(), [&](const AlignedBuffer& b) { return b.size() == size; });
  if (it == buffers_.rend()) return std::nullopt;
  AlignedBuffer buffer = std::move(*it);
  buffers_.erase(std::next(it).base());
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
