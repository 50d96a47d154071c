#include "common/checksum.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <vector>

namespace fuyou {
namespace {

std::vector<unsigned char> Pattern(size_t size) {
  std::vector<unsigned char> bytes(size);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& b : bytes) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  return bytes;
}

// The on-disk format: whatever loop the dispatch picks, the bits are XXH3_64bits'.
TEST(Checksum64, GivesXxh3Bits_AtEveryLengthAndAlignment) {
  const std::vector<unsigned char> bytes = Pattern(8192 + 64);
  for (size_t offset : {0, 1, 3, 8, 31}) {
    for (size_t length = 0; length <= 8192; length += (length < 300 ? 1 : 97)) {
      ASSERT_EQ(Checksum64(bytes.data() + offset, length), XXH3_64bits(bytes.data() + offset, length))
          << "offset " << offset << " length " << length;
    }
  }
}

TEST(Checksum64, GivesXxh3Bits_ForAChunkSizedBuffer) {
  const std::vector<unsigned char> bytes = Pattern(size_t{3} << 20 | 123);
  EXPECT_EQ(Checksum64(bytes.data(), bytes.size()), XXH3_64bits(bytes.data(), bytes.size()));
}

}  // namespace
}  // namespace fuyou
