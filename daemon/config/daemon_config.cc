#include "config/daemon_config.h"

#include <toml++/toml.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <sstream>

#include "fmt/format.h"
#include "common/status_util.h"
#include "config/option_table.h"
#include "fuyou/defaults.h"

namespace fuyou {
DaemonConfig DefaultDaemonConfig() {
  DaemonConfig config;
  config.socket_path = DefaultDaemonSocketPath();
  config.storage_paths = {DefaultDataDir()};
  return config;
}

absl::StatusOr<uint64_t> ParseAutoByteSize(std::string_view text) {
  if (text == "auto") return kAutoBytes;
  if (text == "unlimited") return uint64_t{0};
  return ParseByteSize(text);
}

absl::StatusOr<uint64_t> ParseByteSize(std::string_view text) {
  std::string trimmed;
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) trimmed.push_back(c);
  }
  size_t unit_start = 0;
  while (unit_start < trimmed.size() &&
         (std::isdigit(static_cast<unsigned char>(trimmed[unit_start])) || trimmed[unit_start] == '.')) {
    ++unit_start;
  }
  double number = 0;
  auto [end, error] = std::from_chars(trimmed.data(), trimmed.data() + unit_start, number);
  if (unit_start == 0 || error != std::errc() || end != trimmed.data() + unit_start) {
    return absl::InvalidArgumentError(fmt::format("'{}' is not a size (examples: 4GiB, 512MiB, 1073741824)", text));
  }
  std::string unit = trimmed.substr(unit_start);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  static constexpr std::pair<std::string_view, double> kUnits[] = {
      {"", 1},           {"b", 1},          {"kib", 0x1p10}, {"mib", 0x1p20}, {"gib", 0x1p30},
      {"tib", 0x1p40},   {"k", 1e3},        {"kb", 1e3},     {"m", 1e6},      {"mb", 1e6},
      {"g", 1e9},        {"gb", 1e9},       {"t", 1e12},     {"tb", 1e12}};
  for (const auto& [name, factor] : kUnits) {
    if (unit == name) return static_cast<uint64_t>(std::llround(number * factor));
  }
  return absl::InvalidArgumentError(
      fmt::format("'{}' has an unknown unit '{}' (use KiB, MiB, GiB, TiB or KB, MB, GB, TB)", text, unit));
}

absl::Status ApplyTomlText(std::string_view text, std::string_view origin, DaemonConfig* config) {
  toml::table root;
  try {
    root = toml::parse(text, origin);
  } catch (const toml::parse_error& error) {
    std::ostringstream where;
    where << error.source().begin;
    return absl::InvalidArgumentError(
        fmt::format("{}: TOML syntax error at {}: {}", origin, where.str(), error.description()));
  }
  return ApplyTomlRoot(root, origin, config);
}

absl::Status ApplyTomlFile(const std::filesystem::path& file, DaemonConfig* config) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) {
    return absl::NotFoundError(fmt::format("config file {} does not exist", file.string()));
  }
  std::FILE* handle = std::fopen(file.c_str(), "rb");
  if (handle == nullptr) return absl::PermissionDeniedError(fmt::format("cannot read config file {}", file.string()));
  std::string text;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, handle)) > 0) text.append(buffer, n);
  std::fclose(handle);
  return ApplyTomlText(text, file.string(), config);
}

namespace {

absl::Status ValidateLimits(const DaemonConfig& config) {
  if (config.max_sessions < 1 || config.max_sessions > kMaxSessionsCeiling) {
    return absl::InvalidArgumentError(
        fmt::format("[limits] max_sessions {} is outside 1..{}", config.max_sessions, kMaxSessionsCeiling));
  }
  // A per-user limit above max_sessions is allowed: max_sessions then binds first.
  if (config.max_sessions_per_user < 1 || config.max_sessions_per_user > kMaxSessionsCeiling) {
    return absl::InvalidArgumentError(fmt::format("[limits] max_sessions_per_user {} is outside 1..{}",
                                                  config.max_sessions_per_user, kMaxSessionsCeiling));
  }
  if (config.max_segment_bytes_per_user < (uint64_t{1} << 20)) {
    return absl::InvalidArgumentError("[limits] max_segment_bytes_per_user must be at least 1 MiB");
  }
  if (config.max_client_info_bytes < kMinClientInfoBytes || config.max_client_info_bytes > kMaxClientInfoBytesCeiling) {
    return absl::InvalidArgumentError(fmt::format("[limits] max_client_info_bytes {} is outside {}..{}",
                                                  config.max_client_info_bytes, kMinClientInfoBytes,
                                                  kMaxClientInfoBytesCeiling));
  }
  if (config.commit_every_steps < 1 || config.commit_every_steps > kMaxCommitEverySteps) {
    return absl::InvalidArgumentError(fmt::format(
        "[durability] commit_every_steps {} is outside 1..{} (1 = every step durable)", config.commit_every_steps,
        kMaxCommitEverySteps));
  }
  if (!std::isfinite(config.commit_every_seconds) || config.commit_every_seconds < 0) {
    return absl::InvalidArgumentError(fmt::format(
        "[durability] commit_every_seconds {} is not a number of seconds >= 0 (0 = off)", config.commit_every_seconds));
  }
  if (config.max_connections < 1 || config.max_connections > kMaxConnectionsCeiling ||
      config.max_connections_per_user < 1 || config.max_connections_per_user > kMaxConnectionsCeiling) {
    return absl::InvalidArgumentError(fmt::format(
        "[limits] max_connections {} and max_connections_per_user {} must be in 1..{}", config.max_connections,
        config.max_connections_per_user, kMaxConnectionsCeiling));
  }
  if (!std::isfinite(config.idle_connection_timeout_seconds) || config.idle_connection_timeout_seconds < 0) {
    return absl::InvalidArgumentError(fmt::format("[limits] idle_connection_timeout {} is not a number of seconds >= 0",
                                                  config.idle_connection_timeout_seconds));
  }
  if (!std::isfinite(config.idle_session_timeout_seconds) || config.idle_session_timeout_seconds < 0) {
    return absl::InvalidArgumentError(fmt::format("[limits] idle_session_timeout {} is not a number of seconds >= 0",
                                                  config.idle_session_timeout_seconds));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateConfig(const DaemonConfig& config) {
  if (config.socket_path.empty()) return absl::InvalidArgumentError("the socket path is empty");
  if (config.storage_paths.empty()) return absl::InvalidArgumentError("no storage path is configured");
  if (config.dram_budget_bytes < (uint64_t{64} << 20)) {
    return absl::InvalidArgumentError(
        fmt::format("dram budget of {} bytes is below the minimum of 64 MiB", config.dram_budget_bytes));
  }
  if (config.max_segment_bytes < (uint64_t{1} << 20)) {
    return absl::InvalidArgumentError("max_segment_bytes must be at least 1 MiB");
  }
  FUYOU_RETURN_IF_ERROR(ValidateLimits(config));
  for (size_t i = 0; i < config.storage_paths.size(); ++i) {
    for (size_t j = i + 1; j < config.storage_paths.size(); ++j) {
      if (config.storage_paths[i] == config.storage_paths[j]) {
        return absl::InvalidArgumentError(
            fmt::format("storage path {} is listed twice", config.storage_paths[i].string()));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace fuyou
