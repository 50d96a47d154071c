#include "config/option_table.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <optional>

#include "fmt/format.h"

namespace fuyou {
namespace {

using P = OptionParser;
using Path = std::filesystem::path;

constexpr std::string_view kLogLevels[] = {"trace", "debug", "info", "warn", "error"};
constexpr std::string_view kDurabilityModes[] = {"step-atomic"};  // DurabilityMode's order

const DaemonOption kOptions[] = {
    {.table = "daemon", .key = "socket", .flag = "--socket", .parser = P::kPath, .field = &DaemonConfig::socket_path,
     .default_text = "$FUYOU_SOCKET, /run/fuyou/fuyoud.sock for root, else $XDG_RUNTIME_DIR/fuyou/fuyoud.sock",
     .help = "Unix socket to serve on", .expected = "expected a non-empty path string"},
    {.table = "daemon", .key = "socket_mode", .flag = "--socket-mode", .parser = P::kOctalMode,
     .field = &DaemonConfig::socket_mode, .default_text = "0660", .help = "octal permissions of the socket",
     .expected = "expected an octal mode string such as \"0660\""},
    {.table = "daemon", .key = "log_level", .flag = "--log-level", .parser = P::kEnum,
     .field = &DaemonConfig::log_level, .default_text = "info", .help = "trace|debug|info|warn|error",
     .expected = "expected trace|debug|info|warn|error", .choices = kLogLevels},
    {.table = "storage", .key = "paths", .flag = "--data-dir,--storage-path", .parser = P::kPathList,
     .field = &DaemonConfig::storage_paths,
     .default_text = "$FUYOU_DATA_DIR, /var/lib/fuyou for root, else ~/.local/share/fuyou",
     .help = "storage directory for optimizer states, one per SSD; repeat for several",
     .expected = "expected a non-empty array of directory strings"},
    {.table = "storage", .key = "io_queue_depth", .flag = "--io-depth", .parser = P::kCount,
     .field = &DaemonConfig::io_queue_depth, .default_text = "64", .help = "io_uring queue depth per storage path",
     .expected = "expected 1..4096", .min = 1, .max = 4096},
    {.table = "storage", .key = "allow_buffered", .flag = "", .parser = P::kBool,
     .field = &DaemonConfig::allow_buffered_io, .default_text = "true",
     .help = "on filesystems without O_DIRECT (tmpfs): open buffered with a warning (true), or refuse (false)", .expected = "expected true or false"},
    {.table = "storage", .key = "job_quota", .flag = "--job-quota", .parser = P::kAutoSize,
     .field = &DaemonConfig::job_quota_bytes, .default_text = "auto",
     .help = "most storage one job may reserve, e.g. 100GiB, \"unlimited\", or \"auto\": a quarter of the storage "
             "paths' size"},
    {.table = "storage", .key = "reserved_free", .flag = "--reserved-free", .parser = P::kAutoSize,
     .field = &DaemonConfig::reserved_free_bytes, .default_text = "auto",
     .help = "free space kept on each storage path for administrators' jobs, e.g. 4GiB, or \"auto\": 1% of the "
             "path, 64MiB..4GiB"},
    {.table = "memory", .key = "dram_budget", .flag = "--dram-budget", .parser = P::kSize,
     .field = &DaemonConfig::dram_budget_bytes, .default_text = "2GiB",
     .help = "DRAM for optimizer states, e.g. 4GiB"},
    {.table = "memory", .key = "max_segment_bytes", .flag = "--max-segment", .parser = P::kSize,
     .field = &DaemonConfig::max_segment_bytes, .default_text = "8GiB",
     .help = "largest shared-memory segment a session may ask for"},
    {.table = "optimizer", .key = "worker_threads", .flag = "--threads", .parser = P::kCount,
     .field = &DaemonConfig::worker_threads, .default_text = "0", .help = "optimizer worker threads, 0 = all cores",
     .expected = "expected 0..1024", .min = 0, .max = 1024},
    {.table = "durability", .key = "mode", .flag = "", .parser = P::kEnum, .field = &DaemonConfig::durability,
     .default_text = "step-atomic", .help = "\"step-atomic\": a crash costs at most the step in flight",
     .expected = "only \"step-atomic\" is implemented (\"in-place\" is not offered yet)", .choices = kDurabilityModes},
    {.table = "durability", .key = "commit_every_steps", .flag = "--commit-every-steps", .parser = P::kCount,
     .field = &DaemonConfig::commit_every_steps, .default_text = "1",
     .help = "make every Nth step durable; a crash loses at most N-1 acknowledged steps",
     .expected = "expected 1..1000000 (1 = every step durable)", .min = 1, .max = kMaxCommitEverySteps},
    {.table = "durability", .key = "commit_every_seconds", .flag = "--commit-every-seconds", .parser = P::kSeconds,
     .field = &DaemonConfig::commit_every_seconds, .default_text = "0",
     .help = "also make a step durable when this many seconds passed since the last durable one, 0 = off",
     .expected = "expected seconds >= 0 (0 = off)"},
    {.table = "", .key = "", .flag = "--drain-seconds", .parser = P::kSeconds, .field = &DaemonConfig::drain_seconds,
     .default_text = "10", .help = "on SIGTERM, how long sessions may finish their step",
     .expected = "expected seconds >= 0"},
    {.table = "limits", .key = "max_sessions", .flag = "--max-sessions", .parser = P::kCount,
     .field = &DaemonConfig::max_sessions, .default_text = "256", .help = "live sessions of all users together",
     .expected = "expected an integer in 1..65536", .min = 1, .max = kMaxSessionsCeiling},
    {.table = "limits", .key = "max_sessions_per_user", .flag = "--max-sessions-per-user", .parser = P::kCount,
     .field = &DaemonConfig::max_sessions_per_user, .default_text = "8", .help = "live sessions of one user",
     .expected = "expected an integer in 1..65536", .min = 1, .max = kMaxSessionsCeiling},
    {.table = "limits", .key = "max_segment_bytes_per_user", .flag = "--max-segment-bytes-per-user",
     .parser = P::kSize, .field = &DaemonConfig::max_segment_bytes_per_user, .default_text = "16GiB",
     .help = "shared-memory segment bytes of one user's live sessions, e.g. 16GiB"},
    {.table = "limits", .key = "max_journal_bytes_per_user", .flag = "--max-journal-bytes-per-user",
     .parser = P::kSize, .field = &DaemonConfig::max_journal_bytes_per_user, .default_text = "256GiB",
     .help = "gradient journal bytes (DRAM and spilled) of one user's live sessions, e.g. 64GiB"},
    {.table = "limits", .key = "max_activation_bytes_per_user", .flag = "--max-activation-bytes-per-user",
     .parser = P::kSize, .field = &DaemonConfig::max_activation_bytes_per_user, .default_text = "256GiB",
     .help = "activation scratch bytes (SpillActivation, whole blocks) of one user's live sessions, e.g. 64GiB"},
    {.table = "limits", .key = "max_client_info_bytes", .flag = "--max-client-info-bytes", .parser = P::kSize,
     .field = &DaemonConfig::max_client_info_bytes, .default_text = "1KiB",
     .help = "longest client_info a session may carry"},
    {.table = "limits", .key = "idle_session_timeout", .flag = "--idle-session-timeout", .parser = P::kSeconds,
     .field = &DaemonConfig::idle_session_timeout_seconds, .default_text = "14400",
     .help = "seconds an attached session may go without a message before it is closed; 0 = never",
     .expected = "expected seconds >= 0 (0 = never)"},
    {.table = "limits", .key = "max_jobs_per_user", .flag = "--max-jobs-per-user", .parser = P::kCount,
     .field = &DaemonConfig::max_jobs_per_user, .default_text = "64",
     .help = "jobs one user may have on the storage tier, 0 = no limit", .expected = "expected 0..1000000 (0: no limit)",
     .min = 0, .max = 1'000'000},
    {.table = "limits", .key = "max_storage_bytes_per_user", .flag = "--max-storage-per-user", .parser = P::kAutoSize,
     .field = &DaemonConfig::max_storage_bytes_per_user, .default_text = "auto",
     .help = "most storage all of one user's jobs may reserve, e.g. 1TiB, \"unlimited\", or \"auto\": a quarter "
             "of the storage paths' size"},
    {.table = "limits", .key = "max_storage_bytes_all_users", .flag = "--max-storage-all-users",
     .parser = P::kAutoSize, .field = &DaemonConfig::max_storage_bytes_all_users, .default_text = "auto",
     .help = "most storage the jobs of all users but root and the daemon's own may reserve together (the rest is "
             "kept for those), e.g. 2TiB, \"unlimited\", or \"auto\": half the storage paths' size"},
    {.table = "limits", .key = "max_connections", .flag = "--max-connections", .parser = P::kCount,
     .field = &DaemonConfig::max_connections, .default_text = "1024", .help = "gRPC connections of all users together",
     .expected = "expected an integer in 1..1048576", .min = 1, .max = kMaxConnectionsCeiling},
    {.table = "limits", .key = "max_connections_per_user", .flag = "--max-connections-per-user", .parser = P::kCount,
     .field = &DaemonConfig::max_connections_per_user, .default_text = "64", .help = "gRPC connections of one user",
     .expected = "expected an integer in 1..1048576", .min = 1, .max = kMaxConnectionsCeiling},
    {.table = "limits", .key = "idle_connection_timeout", .flag = "--idle-connection-timeout", .parser = P::kSeconds,
     .field = &DaemonConfig::idle_connection_timeout_seconds, .default_text = "300",
     .help = "seconds a connection may carry no RPC before it is closed; 0 = never",
     .expected = "expected seconds >= 0 (0 = never)"},
    {.table = "metrics", .key = "listen", .flag = "--metrics-listen", .parser = P::kText,
     .field = &DaemonConfig::metrics_listen, .default_text = "off",
     .help = "host:port to serve Prometheus metrics on (GET /metrics), e.g. 127.0.0.1:9464; \"\" = off",
     .expected = "expected \"host:port\" such as \"127.0.0.1:9464\", or \"\" (off)"},
};

// A value as given: a TOML node, or a flag's values.
struct Given {
  const toml::node* node = nullptr;
  const std::vector<std::string>* texts = nullptr;

  std::optional<std::string> Text() const {
    if (node != nullptr) return node->is_string() ? node->value<std::string>() : std::nullopt;
    return texts->back();
  }
};

using Parsed = std::variant<uint64_t, double, bool, std::string, std::vector<Path>>;

absl::Status Problem(std::string_view what) { return absl::InvalidArgumentError(std::string(what)); }

std::string Expected(const DaemonOption& option, std::string_view otherwise) {
  return std::string(option.expected.empty() ? otherwise : option.expected);
}

absl::StatusOr<Parsed> ParseSize(const DaemonOption& option, const Given& given) {
  if (given.node != nullptr && given.node->is_integer()) {
    int64_t integer = *given.node->value<int64_t>();
    if (integer < 0) return Problem("must not be negative");
    return uint64_t(integer);
  }
  auto text = given.Text();
  if (!text) return Problem(Expected(option, "expected a size such as \"4GiB\" or an integer of bytes"));
  if (option.parser == P::kAutoSize) {
    auto bytes = ParseAutoByteSize(*text);
    if (!bytes.ok()) return bytes.status();
    return *bytes;
  }
  auto bytes = ParseByteSize(*text);
  if (!bytes.ok()) return bytes.status();
  return *bytes;
}

absl::StatusOr<Parsed> ParseCount(const DaemonOption& option, const Given& given) {
  std::optional<int64_t> value;
  if (given.node != nullptr) {
    if (given.node->is_integer()) value = given.node->value<int64_t>();
  } else {
    const std::string& text = given.texts->back();
    int64_t parsed = 0;
    auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), parsed);
    if (error == std::errc() && end == text.data() + text.size()) value = parsed;
  }
  if (!value || *value < option.min || *value > option.max) {
    return Problem(Expected(option, fmt::format("expected an integer in {}..{}", option.min, option.max)));
  }
  return uint64_t(*value);
}

absl::StatusOr<Parsed> ParseSeconds(const DaemonOption& option, const Given& given) {
  std::optional<double> seconds;
  if (given.node != nullptr) {
    seconds = given.node->value<double>();  // an integer or a float
  } else {
    const std::string& text = given.texts->back();
    double parsed = 0;
    auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), parsed);
    if (error == std::errc() && end == text.data() + text.size()) seconds = parsed;
  }
  if (!seconds || !std::isfinite(*seconds) || *seconds < 0) return Problem(Expected(option, "expected seconds >= 0"));
  return *seconds;
}

absl::StatusOr<Parsed> ParseBool(const DaemonOption& option, const Given& given) {
  if (given.node != nullptr) {
    if (auto value = given.node->value<bool>(); value && given.node->is_boolean()) return *value;
  } else if (given.texts->back() == "true" || given.texts->back() == "false") {
    return given.texts->back() == "true";
  }
  return Problem(Expected(option, "expected true or false"));
}

absl::StatusOr<Parsed> ParsePathList(const DaemonOption& option, const Given& given) {
  std::vector<Path> paths;
  if (given.node != nullptr) {
    const toml::array* array = given.node->as_array();
    if (array == nullptr || array->empty()) return Problem(Expected(option, "expected a non-empty array of paths"));
    for (const auto& element : *array) {
      auto value = element.value<std::string>();
      if (!value || value->empty() || !element.is_string()) return Problem("every entry must be a path string");
      paths.emplace_back(*value);
    }
  } else {
    for (const auto& text : *given.texts) {
      if (text.empty()) return Problem("every entry must be a non-empty path");
      paths.emplace_back(text);
    }
  }
  return paths;
}

absl::StatusOr<Parsed> ParseText(const DaemonOption& option, const Given& given) {
  auto text = given.Text();
  if (!text) return Problem(Expected(option, "expected a string"));
  switch (option.parser) {
    case P::kPath:
      if (text->empty()) return Problem(Expected(option, "expected a non-empty path string"));
      break;
    case P::kEnum:
      if (std::find(option.choices.begin(), option.choices.end(), *text) == option.choices.end()) {
        return Problem(Expected(option, "expected one of the documented values"));
      }
      break;
    case P::kOctalMode: {
      uint32_t mode = 0;
      auto [end, error] = std::from_chars(text->data(), text->data() + text->size(), mode, 8);
      if (text->empty() || error != std::errc() || end != text->data() + text->size() || mode > 0777) {
        return Problem(Expected(option, "expected an octal mode such as \"0660\""));
      }
      return uint64_t{mode};
    }
    default:
      break;
  }
  return *text;
}

absl::StatusOr<Parsed> Parse(const DaemonOption& option, const Given& given) {
  switch (option.parser) {
    case P::kSize:
    case P::kAutoSize:
      return ParseSize(option, given);
    case P::kCount:
      return ParseCount(option, given);
    case P::kSeconds:
      return ParseSeconds(option, given);
    case P::kBool:
      return ParseBool(option, given);
    case P::kPathList:
      return ParsePathList(option, given);
    case P::kPath:
    case P::kText:
    case P::kEnum:
    case P::kOctalMode:
      return ParseText(option, given);
  }
  return Problem("unhandled parser");
}

// Writes a parsed value into the option's field; the table pairs each parser
// with a field of the type it yields (daemon_config_test.cc exercises every entry).
void Store(const DaemonOption& option, Parsed value, DaemonConfig* config) {
  std::visit(
      [&](auto field) {
        using T = std::remove_reference_t<decltype(config->*field)>;
        if constexpr (std::is_same_v<T, uint64_t> || std::is_same_v<T, uint32_t>) {
          config->*field = static_cast<T>(std::get<uint64_t>(value));  // kCount's range fits the field
        } else if constexpr (std::is_same_v<T, double> || std::is_same_v<T, bool>) {
          config->*field = std::get<T>(value);
        } else if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, Path>) {
          config->*field = std::get<std::string>(value);
        } else if constexpr (std::is_same_v<T, std::vector<Path>>) {
          config->*field = std::move(std::get<std::vector<Path>>(value));
        } else {
          static_assert(std::is_same_v<T, DurabilityMode>);
          auto index = std::find(option.choices.begin(), option.choices.end(), std::get<std::string>(value)) -
                       option.choices.begin();
          config->*field = static_cast<DurabilityMode>(index);
        }
      },
      option.field);
}

absl::Status KeyError(std::string_view origin, std::string_view key, std::string_view problem) {
  return absl::InvalidArgumentError(fmt::format("{}: key '{}': {}", origin, key, problem));
}

bool HasTable(std::string_view table) {
  return std::any_of(std::begin(kOptions), std::end(kOptions),
                     [&](const DaemonOption& option) { return !option.key.empty() && option.table == table; });
}

const DaemonOption* FindKey(std::string_view table, std::string_view key) {
  for (const auto& option : kOptions) {
    if (!option.key.empty() && option.table == table && option.key == key) return &option;
  }
  return nullptr;
}

}  // namespace

std::span<const DaemonOption> DaemonOptions() { return kOptions; }

std::string_view FlagName(const DaemonOption& option) { return option.flag.substr(0, option.flag.find(',')); }

std::string OptionName(const DaemonOption& option) {
  if (option.key.empty()) return std::string(FlagName(option));
  return fmt::format("{}.{}", option.table, option.key);
}

absl::Status ApplyTomlRoot(const toml::table& root, std::string_view origin, DaemonConfig* config) {
  // Unknown tables and keys first, so that a misspelt key is named before any value is used.
  for (const auto& [name, node] : root) {
    if (!HasTable(name.str())) return KeyError(origin, fmt::format(".{}", name.str()), "unknown setting");
    const toml::table* table = node.as_table();
    if (table == nullptr) return KeyError(origin, name.str(), "expected a table of settings");
    for (const auto& [key, value] : *table) {
      if (FindKey(name.str(), key.str()) == nullptr) {
        return KeyError(origin, fmt::format("{}.{}", name.str(), key.str()), "unknown setting");
      }
    }
  }
  for (const auto& option : kOptions) {
    if (option.key.empty()) continue;
    const toml::table* table = root[option.table].as_table();
    const toml::node* node = table == nullptr ? nullptr : table->get(option.key);
    if (node == nullptr) continue;
    auto value = Parse(option, Given{.node = node});
    if (!value.ok()) return KeyError(origin, OptionName(option), std::string(value.status().message()));
    Store(option, *std::move(value), config);
  }
  return absl::OkStatus();
}

absl::Status ApplyFlag(const DaemonOption& option, const std::vector<std::string>& values, DaemonConfig* config) {
  if (values.empty()) return absl::InvalidArgumentError(fmt::format("{}: expected a value", FlagName(option)));
  auto value = Parse(option, Given{.texts = &values});
  if (!value.ok()) {
    return absl::InvalidArgumentError(fmt::format("{}: {}", FlagName(option), std::string(value.status().message())));
  }
  Store(option, *std::move(value), config);
  return absl::OkStatus();
}

}  // namespace fuyou
