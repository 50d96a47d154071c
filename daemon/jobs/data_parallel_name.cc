#include "jobs/data_parallel_name.h"

#include <charconv>

namespace fuyou {
namespace {

// `digits` as a number when it is 1-6 decimal digits without a leading zero
// (but "0"), at most kMaxDataParallelWorldSize.
std::optional<uint32_t> CanonicalNumber(std::string_view digits) {
  if (digits.empty() || digits.size() > 6) return std::nullopt;
  if (digits.size() > 1 && digits.front() == '0') return std::nullopt;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  uint32_t value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (error != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  if (value > kMaxDataParallelWorldSize) return std::nullopt;
  return value;
}

}  // namespace

std::optional<DataParallelName> ParseDataParallelName(std::string_view name) {
  constexpr std::string_view kRank = ".rank";
  constexpr std::string_view kOf = "-of";
  const size_t at = name.rfind(kRank);
  if (at == std::string_view::npos || at == 0) return std::nullopt;
  const std::string_view numbers = name.substr(at + kRank.size());
  const size_t of = numbers.find(kOf);
  if (of == std::string_view::npos) return std::nullopt;
  const std::optional<uint32_t> rank = CanonicalNumber(numbers.substr(0, of));
  const std::optional<uint32_t> world_size = CanonicalNumber(numbers.substr(of + kOf.size()));
  if (!rank || !world_size || *world_size == 0 || *rank >= *world_size) return std::nullopt;
  return DataParallelName{std::string(name.substr(0, at)), *rank, *world_size};
}

std::string DataParallelJobName(std::string_view job, uint32_t rank, uint32_t world_size) {
  return std::string(job) + ".rank" + std::to_string(rank) + "-of" + std::to_string(world_size);
}

}  // namespace fuyou
