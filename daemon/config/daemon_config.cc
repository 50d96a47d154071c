#include "config/daemon_config.h"

#include <toml++/toml.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <sstream>

#include "fmt/format.h"
#include "common/status_util.h"
#include "fuyou/defaults.h"

namespace fuyou {
namespace {

absl::Status KeyError(std::string_view origin, std::string_view key, std::string_view problem) {
  return absl::InvalidArgumentError(fmt::format("{}: key '{}': {}", origin, key, problem));
}

// Applies the settings of `table` through `apply(key, node)` after rejecting keys
// not in `known`.
absl::Status CheckKnownKeys(const toml::table& table, std::string_view section,
                            std::initializer_list<std::string_view> known, std::string_view origin) {
  for (const auto& [key, node] : table) {
    bool found = false;
    for (auto name : known) found = found || key.str() == name;
    if (!found) {
      return KeyError(origin, fmt::format("{}.{}", section, key.str()), "unknown setting");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ReadByteSize(const toml::node& node, std::string_view origin, std::string_view key) {
  if (auto integer = node.value<int64_t>(); integer && node.is_integer()) {
    if (*integer < 0) return KeyError(origin, key, "must not be negative");
    return static_cast<uint64_t>(*integer);
  }
  if (auto text = node.value<std::string>()) {
    auto bytes = ParseByteSize(*text);
    if (!bytes.ok()) return KeyError(origin, key, std::string(bytes.status().message()));
    return *bytes;
  }
  return KeyError(origin, key, "expected a size such as \"4GiB\" or an integer of bytes");
}

absl::StatusOr<uint32_t> ReadCount(const toml::node& node, std::string_view origin, std::string_view key,
                                   uint32_t max) {
  auto value = node.value<int64_t>();
  if (!value || !node.is_integer() || *value < 1 || *value > int64_t{max}) {
    return KeyError(origin, key, fmt::format("expected an integer in 1..{}", max));
  }
  return static_cast<uint32_t>(*value);
}

// "auto", "unlimited" (0) or a size.
absl::StatusOr<uint64_t> ReadAutoByteSize(const toml::node& node, std::string_view origin, std::string_view key) {
  if (auto text = node.value<std::string>(); text && *text == "auto") return kAutoBytes;
  if (auto text = node.value<std::string>(); text && *text == "unlimited") return uint64_t{0};
  return ReadByteSize(node, origin, key);
}

// The [limits] settings of issue 20: connections and storage per user.
absl::Status ApplyConnectionAndStorageLimits(const toml::table& limits, std::string_view origin,
                                             DaemonConfig* config) {
  if (const auto* node = limits.get("max_storage_bytes_per_user")) {
    auto bytes = ReadAutoByteSize(*node, origin, "limits.max_storage_bytes_per_user");
    if (!bytes.ok()) return bytes.status();
    config->max_storage_bytes_per_user = *bytes;
  }
  if (const auto* node = limits.get("max_connections")) {
    auto count = ReadCount(*node, origin, "limits.max_connections", kMaxConnectionsCeiling);
    if (!count.ok()) return count.status();
    config->max_connections = *count;
  }
  if (const auto* node = limits.get("max_connections_per_user")) {
    auto count = ReadCount(*node, origin, "limits.max_connections_per_user", kMaxConnectionsCeiling);
    if (!count.ok()) return count.status();
    config->max_connections_per_user = *count;
  }
  if (const auto* node = limits.get("idle_connection_timeout")) {
    auto seconds = node->value<double>();
    if (!seconds || !std::isfinite(*seconds) || *seconds < 0) {
      return KeyError(origin, "limits.idle_connection_timeout", "expected seconds >= 0 (0 = never)");
    }
    config->idle_connection_timeout_seconds = *seconds;
  }
  return absl::OkStatus();
}

// The [limits] section.
absl::Status ApplyLimitsTable(const toml::table& limits, std::string_view origin, DaemonConfig* config) {
  FUYOU_RETURN_IF_ERROR(CheckKnownKeys(limits, "limits",
                                       {"max_sessions", "max_sessions_per_user", "max_segment_bytes_per_user",
                                        "max_journal_bytes_per_user", "max_client_info_bytes", "idle_session_timeout",
                                        "max_jobs_per_user", "max_storage_bytes_per_user", "max_connections",
                                        "max_connections_per_user", "idle_connection_timeout"},
                                       origin));
  if (const auto* node = limits.get("max_sessions")) {
    auto count = ReadCount(*node, origin, "limits.max_sessions", kMaxSessionsCeiling);
    if (!count.ok()) return count.status();
    config->max_sessions = *count;
  }
  if (const auto* node = limits.get("max_sessions_per_user")) {
    auto count = ReadCount(*node, origin, "limits.max_sessions_per_user", kMaxSessionsCeiling);
    if (!count.ok()) return count.status();
    config->max_sessions_per_user = *count;
  }
  if (const auto* node = limits.get("max_segment_bytes_per_user")) {
    auto bytes = ReadByteSize(*node, origin, "limits.max_segment_bytes_per_user");
    if (!bytes.ok()) return bytes.status();
    config->max_segment_bytes_per_user = *bytes;
  }
  if (const auto* node = limits.get("max_journal_bytes_per_user")) {
    auto bytes = ReadByteSize(*node, origin, "limits.max_journal_bytes_per_user");
    if (!bytes.ok()) return bytes.status();
    config->max_journal_bytes_per_user = *bytes;
  }
  if (const auto* node = limits.get("max_client_info_bytes")) {
    auto bytes = ReadByteSize(*node, origin, "limits.max_client_info_bytes");
    if (!bytes.ok()) return bytes.status();
    config->max_client_info_bytes = *bytes;
  }
  if (const auto* node = limits.get("idle_session_timeout")) {
    auto seconds = node->value<double>();  // an integer or a float
    if (!seconds || !std::isfinite(*seconds) || *seconds < 0) {
      return KeyError(origin, "limits.idle_session_timeout", "expected seconds >= 0 (0 = never)");
    }
    config->idle_session_timeout_seconds = *seconds;
  }
  if (const auto* node = limits.get("max_jobs_per_user")) {
    auto value = node->value<int64_t>();
    if (!value || *value < 0 || *value > 1'000'000) {
      return KeyError(origin, "limits.max_jobs_per_user", "expected 0..1000000 (0: no limit)");
    }
    config->max_jobs_per_user = static_cast<uint32_t>(*value);
  }
  return ApplyConnectionAndStorageLimits(limits, origin, config);
}

}  // namespace

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
  if (auto status = CheckKnownKeys(root, "", {"daemon", "storage", "memory", "limits", "optimizer", "durability", "metrics"}, origin);
      !status.ok()) {
    return status;
  }
  auto table_of = [&](std::string_view name) { return root[name].as_table(); };

  if (const toml::table* daemon = table_of("daemon")) {
    if (auto s = CheckKnownKeys(*daemon, "daemon", {"socket", "socket_mode", "log_level"}, origin); !s.ok()) return s;
    if (const auto* node = daemon->get("socket")) {
      auto value = node->value<std::string>();
      if (!value || value->empty()) return KeyError(origin, "daemon.socket", "expected a non-empty path string");
      config->socket_path = *value;
    }
    if (const auto* node = daemon->get("socket_mode")) {
      auto value = node->value<std::string>();
      uint32_t mode = 0;
      if (!value || value->empty() ||
          std::from_chars(value->data(), value->data() + value->size(), mode, 8).ec != std::errc() || mode > 0777) {
        return KeyError(origin, "daemon.socket_mode", "expected an octal mode string such as \"0660\"");
      }
      config->socket_mode = mode;
    }
    if (const auto* node = daemon->get("log_level")) {
      auto value = node->value<std::string>();
      if (!value) return KeyError(origin, "daemon.log_level", "expected trace|debug|info|warn|error");
      config->log_level = *value;
    }
  }
  if (const toml::table* storage = table_of("storage")) {
    if (auto s = CheckKnownKeys(*storage, "storage", {"paths", "io_queue_depth", "allow_buffered", "job_quota", "reserved_free"}, origin); !s.ok()) {
      return s;
    }
    if (const auto* node = storage->get("paths")) {
      const toml::array* paths = node->as_array();
      if (paths == nullptr || paths->empty()) {
        return KeyError(origin, "storage.paths", "expected a non-empty array of directory strings");
      }
      config->storage_paths.clear();
      for (const auto& element : *paths) {
        auto value = element.value<std::string>();
        if (!value || value->empty()) return KeyError(origin, "storage.paths", "every entry must be a path string");
        config->storage_paths.emplace_back(*value);
      }
    }
    if (const auto* node = storage->get("io_queue_depth")) {
      auto value = node->value<int64_t>();
      if (!value || *value < 1 || *value > 4096) return KeyError(origin, "storage.io_queue_depth", "expected 1..4096");
      config->io_queue_depth = static_cast<unsigned>(*value);
    }
    if (const auto* node = storage->get("allow_buffered")) {
      auto value = node->value<bool>();
      if (!value) return KeyError(origin, "storage.allow_buffered", "expected true or false");
      config->allow_buffered_io = *value;
    }
    if (const auto* node = storage->get("job_quota")) {
      auto bytes = ReadAutoByteSize(*node, origin, "storage.job_quota");
      if (!bytes.ok()) return bytes.status();
      config->job_quota_bytes = *bytes;
    }
    if (const auto* node = storage->get("reserved_free")) {
      auto bytes = ReadAutoByteSize(*node, origin, "storage.reserved_free");
      if (!bytes.ok()) return bytes.status();
      config->reserved_free_bytes = *bytes;
    }
  }
  if (const toml::table* memory = table_of("memory")) {
    if (auto s = CheckKnownKeys(*memory, "memory", {"dram_budget", "max_segment_bytes"}, origin); !s.ok()) return s;
    if (const auto* node = memory->get("dram_budget")) {
      auto bytes = ReadByteSize(*node, origin, "memory.dram_budget");
      if (!bytes.ok()) return bytes.status();
      config->dram_budget_bytes = *bytes;
    }
    if (const auto* node = memory->get("max_segment_bytes")) {
      auto bytes = ReadByteSize(*node, origin, "memory.max_segment_bytes");
      if (!bytes.ok()) return bytes.status();
      config->max_segment_bytes = *bytes;
    }
  }
  if (const toml::table* optimizer = table_of("optimizer")) {
    if (auto s = CheckKnownKeys(*optimizer, "optimizer", {"worker_threads"}, origin); !s.ok()) return s;
    if (const auto* node = optimizer->get("worker_threads")) {
      auto value = node->value<int64_t>();
      if (!value || *value < 0 || *value > 1024) return KeyError(origin, "optimizer.worker_threads", "expected 0..1024");
      config->worker_threads = static_cast<unsigned>(*value);
    }
  }
  if (const toml::table* durability = table_of("durability")) {
    if (auto s = CheckKnownKeys(*durability, "durability", {"mode", "commit_every_steps", "commit_every_seconds"}, origin); !s.ok()) return s;
    if (const auto* node = durability->get("mode")) {
      auto value = node->value<std::string>();
      if (!value || *value != "step-atomic") {
        return KeyError(origin, "durability.mode",
                        "only \"step-atomic\" is implemented (\"in-place\" is not offered yet)");
      }
      config->durability = DurabilityMode::kStepAtomic;
    }
    if (const auto* node = durability->get("commit_every_steps")) {
      auto value = node->value<int64_t>();
      if (!value || *value < 1 || *value > kMaxCommitEverySteps) {
        return KeyError(origin, "durability.commit_every_steps", "expected 1..1000000 (1 = every step durable)");
      }
      config->commit_every_steps = static_cast<uint32_t>(*value);
    }
    if (const auto* node = durability->get("commit_every_seconds")) {
      auto seconds = node->value<double>();
      if (!seconds || !std::isfinite(*seconds) || *seconds < 0) {
        return KeyError(origin, "durability.commit_every_seconds", "expected seconds >= 0 (0 = off)");
      }
      config->commit_every_seconds = *seconds;
    }
  }
  if (const toml::table* limits = table_of("limits")) FUYOU_RETURN_IF_ERROR(ApplyLimitsTable(*limits, origin, config));
  if (const toml::table* metrics = table_of("metrics")) {
    FUYOU_RETURN_IF_ERROR(CheckKnownKeys(*metrics, "metrics", {"listen"}, origin));
    if (const auto* node = metrics->get("listen")) {
      auto value = node->value<std::string>();
      if (!value) return KeyError(origin, "metrics.listen", "expected \"host:port\" such as \"127.0.0.1:9464\", or \"\" (off)");
      config->metrics_listen = *value;
    }
  }
  return absl::OkStatus();
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
