#include "common/crash_point.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <cstdlib>
#include <cstring>

#include "fmt/format.h"

namespace fuyou::crash_point {
namespace {

// The armed point; written only before threads start.
CrashSpec g_spec;
std::atomic<uint64_t> g_passes{0};

void CrashNow(const char* name, uint64_t hit) {
  // One write(2): no allocation-free guarantee is needed, but keep it short.
  std::string line = fmt::format("fuyoud: crash point {}:{} reached (FUYOU_CRASH_AT); raising SIGKILL\n", name, hit);
  (void)!::write(STDERR_FILENO, line.data(), line.size());
  ::raise(SIGKILL);
}

}  // namespace

namespace internal {
bool armed = false;
void (*on_crash)(const char* name, uint64_t hit) = CrashNow;
}  // namespace internal

absl::StatusOr<CrashSpec> ParseCrashSpec(std::string_view text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(
        fmt::format("crash point '{}' is not <name>:<N> (e.g. manifest_renamed:2)", text));
  }
  const std::string_view name = text.substr(0, colon);
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) {
      return absl::InvalidArgumentError(
          fmt::format("crash point '{}': the name '{}' may hold only [a-z0-9_]", text, name));
    }
  }
  const std::string_view number = text.substr(colon + 1);
  uint64_t hit = 0;
  auto [end, error] = std::from_chars(number.data(), number.data() + number.size(), hit);
  if (number.empty() || error != std::errc() || end != number.data() + number.size() || hit == 0) {
    return absl::InvalidArgumentError(
        fmt::format("crash point '{}': the hit count '{}' is not an integer >= 1", text, number));
  }
  return CrashSpec{std::string(name), hit};
}

void Arm(const CrashSpec& spec) {
  g_spec = spec;
  g_passes.store(0, std::memory_order_relaxed);
  internal::armed = !spec.name.empty();
}

absl::Status ArmFromEnvironment() {
  const char* value = std::getenv("FUYOU_CRASH_AT");
  if (value == nullptr || *value == '\0') return absl::OkStatus();
  absl::StatusOr<CrashSpec> spec = ParseCrashSpec(value);
  if (!spec.ok()) {
    return absl::InvalidArgumentError(fmt::format("FUYOU_CRASH_AT: {}", std::string(spec.status().message())));
  }
  Arm(*spec);
  return absl::OkStatus();
}

uint64_t Pass(const char* name) {
  if (!internal::armed || std::strcmp(name, g_spec.name.c_str()) != 0) return 0;
  const uint64_t count = g_passes.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (count == g_spec.hit) internal::on_crash(name, count);
  return count;
}

}  // namespace fuyou::crash_point
