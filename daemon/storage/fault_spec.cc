#include "storage/fault_spec.h"

#include <cerrno>
#include <charconv>
#include <chrono>
#include <thread>
#include <utility>

#include "fmt/format.h"

namespace fuyou::storage {
namespace {

std::vector<std::string_view> Split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(separator, start);
    parts.push_back(text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

absl::StatusOr<FaultRule> ParseRule(std::string_view text) {
  auto bad = [&](std::string_view problem) {
    return absl::InvalidArgumentError(fmt::format(
        "fault rule '{}': {} (expected <read|write|reserve|sync>:<ENOSPC|EDQUOT|EIO|EROFS|HOLD>[:until=FILE]"
        "[:after=N][:job=NAME][:dir=NAME])",
        text, problem));
  };
  std::vector<std::string_view> fields = Split(text, ':');
  if (fields.size() < 2) return bad("it needs an operation and an errno");
  FaultRule rule;
  static constexpr std::pair<std::string_view, FaultInjector::Op> kOps[] = {{"read", FaultInjector::Op::kRead},
                                                                            {"write", FaultInjector::Op::kWrite},
                                                                            {"reserve", FaultInjector::Op::kReserve},
                                                                            {"sync", FaultInjector::Op::kSync}};
  bool found = false;
  for (const auto& [name, op] : kOps) {
    if (fields[0] == name) {
      rule.op = op;
      found = true;
    }
  }
  if (!found) return bad(fmt::format("unknown operation '{}'", fields[0]));
  static constexpr std::pair<std::string_view, int> kErrors[] = {
      {"ENOSPC", ENOSPC}, {"EDQUOT", EDQUOT}, {"EIO", EIO}, {"EROFS", EROFS}};
  for (const auto& [name, error] : kErrors) {
    if (fields[1] == name) rule.error = error;
  }
  const bool hold = fields[1] == "HOLD";
  if (rule.error == 0 && !hold) return bad(fmt::format("unknown errno '{}'", fields[1]));
  bool have_after = false;
  bool have_job = false;
  bool have_dir = false;
  for (size_t i = 2; i < fields.size(); ++i) {
    std::string_view field = fields[i];
    if (field.starts_with("until=") && hold && rule.hold_until.empty()) {
      rule.hold_until = std::string(field.substr(6));
      if (!rule.hold_until.starts_with('/')) return bad(fmt::format("'{}' is not until=<absolute path>", field));
      continue;
    }
    if (field.starts_with("dir=") && !have_dir) {
      rule.dir = std::string(field.substr(4));
      if (rule.dir.empty() || rule.dir.find('/') != std::string::npos) {
        return bad(fmt::format("'{}' does not name a directory", field));
      }
      have_dir = true;
      continue;
    }
    if (field.starts_with("after=") && !have_after) {
      std::string_view number = field.substr(6);
      auto [end, error] = std::from_chars(number.data(), number.data() + number.size(), rule.after);
      if (number.empty() || error != std::errc() || end != number.data() + number.size()) {
        return bad(fmt::format("'{}' is not after=<integer >= 0>", field));
      }
      have_after = true;
    } else if (field.starts_with("job=") && !have_job) {
      rule.job = std::string(field.substr(4));
      if (rule.job.empty() || rule.job.find('/') != std::string::npos) {
        return bad(fmt::format("'{}' does not name a job", field));
      }
      have_job = true;
    } else {
      return bad(fmt::format("unknown or repeated option '{}'", field));
    }
  }
  if (hold && rule.hold_until.empty()) return bad("HOLD needs until=<absolute path>");
  return rule;
}

// True when a directory of `file`'s path (not its own name) is `dir`.
bool IsFileInDir(const std::filesystem::path& file, const std::string& dir) {
  for (const auto& part : file.parent_path()) {
    if (part == dir) return true;
  }
  return false;
}

// Waits until `file` exists, at most kHoldLimitSeconds.
void HoldUntil(const std::string& file) {
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(kHoldLimitSeconds);
  std::error_code error;
  while (!std::filesystem::exists(file, error) && std::chrono::steady_clock::now() < limit) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// True when `file` has the components "jobs/<job>".
bool IsFileOfJob(const std::filesystem::path& file, const std::string& job) {
  bool after_jobs = false;
  for (const auto& part : file) {
    if (after_jobs && part == job) return true;
    after_jobs = part == "jobs";
  }
  return false;
}

}  // namespace

absl::StatusOr<std::vector<FaultRule>> ParseFaultSpec(std::string_view text) {
  std::vector<FaultRule> rules;
  for (std::string_view part : Split(text, ';')) {
    if (part.empty()) continue;
    absl::StatusOr<FaultRule> rule = ParseRule(part);
    if (!rule.ok()) return rule.status();
    rules.push_back(std::move(*rule));
  }
  if (rules.empty()) return absl::InvalidArgumentError(fmt::format("fault spec '{}' has no rule", text));
  return rules;
}

SpecFaultInjector::SpecFaultInjector(std::vector<FaultRule> rules) {
  for (FaultRule& rule : rules) {
    auto entry = std::make_unique<Rule>();
    entry->rule = std::move(rule);
    rules_.push_back(std::move(entry));
  }
}

absl::StatusOr<std::unique_ptr<SpecFaultInjector>> SpecFaultInjector::FromSpec(std::string_view text) {
  absl::StatusOr<std::vector<FaultRule>> rules = ParseFaultSpec(text);
  if (!rules.ok()) return rules.status();
  return std::make_unique<SpecFaultInjector>(std::move(*rules));
}

int64_t SpecFaultInjector::Adjust(Op op, const std::filesystem::path& file, uint64_t, uint64_t, int64_t result) {
  int64_t adjusted = result;
  for (auto& entry : rules_) {
    const FaultRule& rule = entry->rule;
    if (rule.op != op || (!rule.job.empty() && !IsFileOfJob(file, rule.job))) continue;
    if (!rule.dir.empty() && !IsFileInDir(file, rule.dir)) continue;
    const uint64_t seen = entry->seen.fetch_add(1, std::memory_order_relaxed);
    if (seen < rule.after) continue;
    if (!rule.hold_until.empty()) {
      injected_.fetch_add(1, std::memory_order_relaxed);
      HoldUntil(rule.hold_until);
    } else if (adjusted >= 0) {
      adjusted = -rule.error;
    }
  }
  if (adjusted != result) injected_.fetch_add(1, std::memory_order_relaxed);
  return adjusted;
}

}  // namespace fuyou::storage
