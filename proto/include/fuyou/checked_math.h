// Checked arithmetic for every size computed from client input (and from
// anything read back from disk): the one place where fuyou multiplies, adds and
// rounds sizes. Each function returns std::nullopt when the exact result does not
// fit in uint64_t, instead of wrapping; callers turn that into an error naming
// the values (a refused request changes nothing).
//
// The rule for callers: cap a size that a client chose before it is multiplied
// or rounded (a chunk's elements against its slot, a slot against the daemon's
// max_segment_bytes), and compute every product, sum and rounding through these
// helpers, so that no size is ever the remainder of an overflow.
//
//   std::optional<uint64_t> bytes = CheckedMul(num_elements, 12);
//   if (!bytes) return absl::InvalidArgumentError(...);
#pragma once

#include <cstdint>
#include <optional>

namespace fuyou {

// a + b, or nullopt when it overflows.
constexpr std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

// a * b, or nullopt when it overflows.
constexpr std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// The smallest multiple of `alignment` that is >= `value`, or nullopt when that
// multiple is above UINT64_MAX or `alignment` is 0. Never wraps to a small value
// (the unchecked (value + alignment - 1) / alignment * alignment gives 0 for
// value >= 2^64 - alignment + 1).
constexpr std::optional<uint64_t> CheckedAlignUp(uint64_t value, uint64_t alignment) {
  if (alignment == 0) return std::nullopt;
  const uint64_t remainder = value % alignment;
  if (remainder == 0) return value;
  return CheckedAdd(value, alignment - remainder);
}

// Chains of checked operations: each overload passes nullopt through, so
//   CheckedAdd(CheckedMul(a, b), c)
// is nullopt when any step overflows.
constexpr std::optional<uint64_t> CheckedAdd(std::optional<uint64_t> a, uint64_t b) {
  if (!a) return std::nullopt;
  return CheckedAdd(*a, b);
}
constexpr std::optional<uint64_t> CheckedAdd(std::optional<uint64_t> a, std::optional<uint64_t> b) {
  if (!a || !b) return std::nullopt;
  return CheckedAdd(*a, *b);
}
constexpr std::optional<uint64_t> CheckedMul(std::optional<uint64_t> a, uint64_t b) {
  if (!a) return std::nullopt;
  return CheckedMul(*a, b);
}
constexpr std::optional<uint64_t> CheckedMul(std::optional<uint64_t> a, std::optional<uint64_t> b) {
  if (!a || !b) return std::nullopt;
  return CheckedMul(*a, *b);
}
constexpr std::optional<uint64_t> CheckedAlignUp(std::optional<uint64_t> value, uint64_t alignment) {
  if (!value) return std::nullopt;
  return CheckedAlignUp(*value, alignment);
}

}  // namespace fuyou
