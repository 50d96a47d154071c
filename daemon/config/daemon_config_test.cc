#include "config/daemon_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "config/command_line.h"
#include "config/option_table.h"
#include "fmt/format.h"

namespace fuyou {
namespace {

TEST(ParseByteSize, BinaryAndDecimalUnits) {
  EXPECT_EQ(*ParseByteSize("4GiB"), uint64_t{4} << 30);
  EXPECT_EQ(*ParseByteSize("512 MiB"), uint64_t{512} << 20);
  EXPECT_EQ(*ParseByteSize("1.5G"), 1'500'000'000u);
  EXPECT_EQ(*ParseByteSize("1073741824"), uint64_t{1} << 30);
  EXPECT_EQ(*ParseByteSize("2kb"), 2000u);
}

TEST(ParseByteSize, RejectsNonsenseWithAMessage) {
  auto bad_unit = ParseByteSize("4 parsecs");
  ASSERT_FALSE(bad_unit.ok());
  EXPECT_NE(bad_unit.status().message().find("unknown unit"), std::string::npos);
  EXPECT_FALSE(ParseByteSize("").ok());
  EXPECT_FALSE(ParseByteSize("GiB").ok());
}

TEST(ApplyTomlText, ReadsEverySection) {
  DaemonConfig config = DefaultDaemonConfig();
  const char* text = R"(
[daemon]
socket = "/tmp/x.sock"
socket_mode = "0600"
log_level = "debug"
[storage]
paths = ["/a", "/b"]
io_queue_depth = 32
allow_buffered = false
[memory]
dram_budget = "1GiB"
max_segment_bytes = 1048576
[optimizer]
worker_threads = 3
[durability]
mode = "step-atomic"
)";
  ASSERT_TRUE(ApplyTomlText(text, "test", &config).ok());
  EXPECT_EQ(config.socket_path, "/tmp/x.sock");
  EXPECT_EQ(config.socket_mode, 0600u);
  EXPECT_EQ(config.log_level, "debug");
  ASSERT_EQ(config.storage_paths.size(), 2u);
  EXPECT_EQ(config.storage_paths[1], "/b");
  EXPECT_EQ(config.io_queue_depth, 32u);
  EXPECT_FALSE(config.allow_buffered_io);
  EXPECT_EQ(config.dram_budget_bytes, uint64_t{1} << 30);
  EXPECT_EQ(config.max_segment_bytes, 1048576u);
  EXPECT_EQ(config.worker_threads, 3u);
  EXPECT_TRUE(ValidateConfig(config).ok());
}

TEST(ApplyTomlText, MetricsAreOffByDefaultAndListenWhereTold) {
  DaemonConfig config = DefaultDaemonConfig();
  EXPECT_EQ(config.metrics_listen, "") << "the Prometheus endpoint is off unless configured";
  ASSERT_TRUE(ApplyTomlText("[metrics]\nlisten = \"127.0.0.1:9464\"\n", "test", &config).ok());
  EXPECT_EQ(config.metrics_listen, "127.0.0.1:9464");
  auto wrong_type = ApplyTomlText("[metrics]\nlisten = 9464\n", "test", &config);
  EXPECT_NE(wrong_type.message().find("metrics.listen"), std::string::npos) << wrong_type;
  auto unknown = ApplyTomlText("[metrics]\nport = 9464\n", "test", &config);
  EXPECT_NE(unknown.message().find("metrics.port"), std::string::npos) << unknown;
}

TEST(ApplyTomlText, UnknownKeyIsNamed) {
  DaemonConfig config = DefaultDaemonConfig();
  absl::Status status = ApplyTomlText("[memory]\ndram_budgte = \"1GiB\"\n", "cfg.toml", &config);
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("memory.dram_budgte"), std::string::npos) << status.message();
}

TEST(ApplyTomlText, WrongTypeAndSyntaxErrorsAreReported) {
  DaemonConfig config = DefaultDaemonConfig();
  EXPECT_EQ(ApplyTomlText("[storage]\npaths = \"/one\"\n", "t", &config).code(), absl::StatusCode::kInvalidArgument);
  absl::Status syntax = ApplyTomlText("[daemon\n", "t", &config);
  EXPECT_EQ(syntax.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(syntax.message().find("syntax"), std::string::npos);
  EXPECT_EQ(ApplyTomlText("[durability]\nmode = \"yolo\"\n", "t", &config).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ApplyTomlText, DurabilityIntervalIsEveryStepUnlessSet) {
  DaemonConfig config = DefaultDaemonConfig();
  EXPECT_EQ(config.commit_every_steps, 1u);
  EXPECT_EQ(config.commit_every_seconds, 0.0);
  ASSERT_TRUE(ApplyTomlText("[durability]\ncommit_every_steps = 10\ncommit_every_seconds = 30.5\n", "t", &config).ok());
  EXPECT_EQ(config.commit_every_steps, 10u);
  EXPECT_EQ(config.commit_every_seconds, 30.5);
  EXPECT_TRUE(ValidateConfig(config).ok());
  for (const char* bad : {"commit_every_steps = 0", "commit_every_steps = -3", "commit_every_steps = 1000001",
                          "commit_every_steps = \"ten\"", "commit_every_seconds = -1", "commit_every_seconds = nan"}) {
    absl::Status refused = ApplyTomlText(std::string("[durability]\n") + bad + "\n", "t", &config);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(refused.message().find("durability.commit_every"), std::string::npos) << refused.message();
  }
  config.commit_every_steps = 0;  // as a flag of 0 leaves it
  EXPECT_EQ(ValidateConfig(config).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ApplyTomlText, JobQuotaIsAutoUnlessSet) {
  DaemonConfig config = DefaultDaemonConfig();
  EXPECT_EQ(config.job_quota_bytes, kAutoBytes);  // a quarter of the storage paths (DaemonServer::Start)
  ASSERT_TRUE(ApplyTomlText("[storage]\njob_quota = \"100GiB\"\n", "t", &config).ok());
  EXPECT_EQ(config.job_quota_bytes, uint64_t{100} << 30);
  ASSERT_TRUE(ApplyTomlText("[storage]\njob_quota = \"unlimited\"\n", "t", &config).ok());
  EXPECT_EQ(config.job_quota_bytes, 0u);
  absl::Status bad = ApplyTomlText("[storage]\njob_quota = \"lots\"\n", "t", &config);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("storage.job_quota"), std::string::npos) << bad.message();
}

TEST(ApplyTomlText, ConnectionAndStorageLimits) {
  DaemonConfig config = DefaultDaemonConfig();
  EXPECT_EQ(config.max_connections, 1024u);
  EXPECT_EQ(config.max_connections_per_user, 64u);
  EXPECT_EQ(config.idle_connection_timeout_seconds, 300);
  EXPECT_EQ(config.max_storage_bytes_per_user, kAutoBytes);
  EXPECT_EQ(config.reserved_free_bytes, kAutoBytes);
  ASSERT_TRUE(ApplyTomlText("[limits]\nmax_connections = 100\nmax_connections_per_user = 10\n"
                            "idle_connection_timeout = 30\nmax_storage_bytes_per_user = \"1TiB\"\n"
                            "[storage]\nreserved_free = \"2GiB\"\njob_quota = \"auto\"\n",
                            "t", &config)
                  .ok());
  EXPECT_EQ(config.max_connections, 100u);
  EXPECT_EQ(config.max_connections_per_user, 10u);
  EXPECT_EQ(config.idle_connection_timeout_seconds, 30);
  EXPECT_EQ(config.max_storage_bytes_per_user, uint64_t{1} << 40);
  EXPECT_EQ(config.reserved_free_bytes, uint64_t{2} << 30);
  EXPECT_EQ(config.job_quota_bytes, kAutoBytes);
  ASSERT_TRUE(ApplyTomlText("[limits]\nmax_storage_bytes_per_user = \"unlimited\"\n", "t", &config).ok());
  EXPECT_EQ(config.max_storage_bytes_per_user, 0u);
  EXPECT_EQ(ApplyTomlText("[limits]\nmax_connections = 0\n", "t", &config).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyTomlText("[limits]\nidle_connection_timeout = -1\n", "t", &config).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateConfig(config).ok());
}

TEST(ApplyTomlText, MaxJobsPerUserDefaultsTo64) {
  DaemonConfig config = DefaultDaemonConfig();
  EXPECT_EQ(config.max_jobs_per_user, 64u);
  ASSERT_TRUE(ApplyTomlText("[limits]\nmax_jobs_per_user = 3\n", "t", &config).ok());
  EXPECT_EQ(config.max_jobs_per_user, 3u);
  absl::Status bad = ApplyTomlText("[limits]\nmax_jobs_per_user = -1\n", "t", &config);
  EXPECT_NE(bad.message().find("limits.max_jobs_per_user"), std::string::npos) << bad.message();
}

TEST(ApplyTomlText, LimitsHaveBoundedDefaults) {
  const DaemonConfig config = DefaultDaemonConfig();
  EXPECT_EQ(config.max_sessions, 256u);
  EXPECT_EQ(config.max_sessions_per_user, 8u);
  EXPECT_EQ(config.max_segment_bytes_per_user, uint64_t{16} << 30);
  EXPECT_EQ(config.max_client_info_bytes, 1024u);
  EXPECT_EQ(config.idle_session_timeout_seconds, 4 * 3600.0);
  EXPECT_TRUE(ValidateConfig(config).ok());
}

TEST(ApplyTomlText, ReadsTheLimitsSection) {
  DaemonConfig config = DefaultDaemonConfig();
  const char* text = R"(
[limits]
max_sessions = 32
max_sessions_per_user = 4
max_segment_bytes_per_user = "2GiB"
max_client_info_bytes = "512B"
idle_session_timeout = 1.5
)";
  absl::Status status = ApplyTomlText(text, "t", &config);
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_EQ(config.max_sessions, 32u);
  EXPECT_EQ(config.max_sessions_per_user, 4u);
  EXPECT_EQ(config.max_segment_bytes_per_user, uint64_t{2} << 30);
  EXPECT_EQ(config.max_client_info_bytes, 512u);
  EXPECT_EQ(config.idle_session_timeout_seconds, 1.5);
  EXPECT_TRUE(ValidateConfig(config).ok());
  ASSERT_TRUE(ApplyTomlText("[limits]\nidle_session_timeout = 0\n", "t", &config).ok());
  EXPECT_EQ(config.idle_session_timeout_seconds, 0.0) << "0 means never";
}

TEST(ApplyTomlText, BadLimitsAreNamed) {
  const std::pair<const char*, const char*> cases[] = {
      {"[limits]\nmax_sessions = 0\n", "limits.max_sessions"},
      {"[limits]\nmax_sessions_per_user = \"many\"\n", "limits.max_sessions_per_user"},
      {"[limits]\nmax_segment_bytes_per_user = \"lots\"\n", "limits.max_segment_bytes_per_user"},
      {"[limits]\nmax_client_info_bytes = -1\n", "limits.max_client_info_bytes"},
      {"[limits]\nidle_session_timeout = -5\n", "limits.idle_session_timeout"},
      {"[limits]\nmax_sesions = 3\n", "limits.max_sesions"},
  };
  for (const auto& [text, key] : cases) {
    DaemonConfig config = DefaultDaemonConfig();
    absl::Status status = ApplyTomlText(text, "t", &config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(status.message().find(key), std::string::npos) << status.message();
  }
}

TEST(ValidateConfig, RefusesLimitsOutOfBounds) {
  DaemonConfig config = DefaultDaemonConfig();
  config.max_sessions = 4;
  config.max_sessions_per_user = 5;
  EXPECT_TRUE(ValidateConfig(config).ok()) << "max_sessions binds first; not a contradiction";
  config.max_sessions_per_user = 0;
  absl::Status status = ValidateConfig(config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("max_sessions_per_user"), std::string::npos) << status.message();
  config = DefaultDaemonConfig();
  config.max_client_info_bytes = uint64_t{1} << 30;  // would let 256 sessions pin 256 GiB of RSS
  EXPECT_FALSE(ValidateConfig(config).ok());
  config = DefaultDaemonConfig();
  config.max_segment_bytes_per_user = 4096;
  EXPECT_FALSE(ValidateConfig(config).ok());
}

TEST(ValidateConfig, RejectsTinyBudgetAndDuplicatePaths) {
  DaemonConfig config = DefaultDaemonConfig();
  config.dram_budget_bytes = 1 << 20;
  EXPECT_FALSE(ValidateConfig(config).ok());
  config = DefaultDaemonConfig();
  config.storage_paths = {"/a", "/a"};
  EXPECT_FALSE(ValidateConfig(config).ok());
}

// A non-default value for every setting of the option table, as TOML and as a flag's values.
struct Example {
  std::string toml;
  std::vector<std::string> flag;
};
const std::map<std::string, Example>& Examples() {
  static const std::map<std::string, Example> examples = {
      {"daemon.socket", {"\"/tmp/t.sock\"", {"/tmp/t.sock"}}},
      {"daemon.socket_mode", {"\"0600\"", {"0600"}}},
      {"daemon.log_level", {"\"debug\"", {"debug"}}},
      {"storage.paths", {"[\"/a\", \"/b\"]", {"/a", "/b"}}},
      {"storage.io_queue_depth", {"32", {"32"}}},
      {"storage.allow_buffered", {"false", {"false"}}},
      {"storage.job_quota", {"\"unlimited\"", {"unlimited"}}},
      {"storage.reserved_free", {"\"4GiB\"", {"4GiB"}}},
      {"memory.dram_budget", {"\"1GiB\"", {"1GiB"}}},
      {"memory.max_segment_bytes", {"\"1MiB\"", {"1MiB"}}},
      {"optimizer.worker_threads", {"3", {"3"}}},
      {"durability.mode", {"\"step-atomic\"", {"step-atomic"}}},  // the only mode: the default
      {"durability.commit_every_steps", {"10", {"10"}}},
      {"durability.commit_every_seconds", {"2.5", {"2.5"}}},
      {"--drain-seconds", {"", {"0.5"}}},
      {"limits.max_sessions", {"5", {"5"}}},
      {"limits.max_sessions_per_user", {"2", {"2"}}},
      {"limits.max_segment_bytes_per_user", {"\"2GiB\"", {"2GiB"}}},
      {"limits.max_journal_bytes_per_user", {"\"3GiB\"", {"3GiB"}}},
      {"limits.max_activation_bytes_per_user", {"\"5GiB\"", {"5GiB"}}},
      {"limits.max_client_info_bytes", {"\"2KiB\"", {"2KiB"}}},
      {"limits.idle_session_timeout", {"60", {"60"}}},
      {"limits.max_jobs_per_user", {"0", {"0"}}},
      {"limits.max_storage_bytes_per_user", {"\"1TiB\"", {"1TiB"}}},
      {"limits.max_storage_bytes_all_users", {"\"2TiB\"", {"2TiB"}}},
      {"limits.max_connections", {"10", {"10"}}},
      {"limits.max_connections_per_user", {"3", {"3"}}},
      {"limits.idle_connection_timeout", {"0", {"0"}}},
      {"metrics.listen", {"\"127.0.0.1:9464\"", {"127.0.0.1:9464"}}},
  };
  return examples;
}

// Parses `args` (after the program name) as fuyoud's command line.
absl::StatusOr<DaemonConfig> FromCommandLine(std::vector<std::string> args) {
  CLI::App app;
  DaemonCommandLine command_line(app);
  std::vector<const char*> argv = {"fuyoud"};
  for (const auto& arg : args) argv.push_back(arg.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& error) {
    return absl::InvalidArgumentError(error.what());
  }
  return command_line.Resolve();
}

TEST(OptionTable, EveryEntryRoundTripsThroughTomlAndFlag) {
  const DaemonConfig defaults = DefaultDaemonConfig();
  for (const DaemonOption& option : DaemonOptions()) {
    const std::string name = OptionName(option);
    SCOPED_TRACE(name);
    auto example = Examples().find(name);
    ASSERT_NE(example, Examples().end()) << "add an example for the new setting " << name;
    std::optional<DaemonConfig> from_toml, from_flag;
    if (!option.key.empty()) {
      DaemonConfig config = DefaultDaemonConfig();
      std::string text = fmt::format("[{}]\n{} = {}\n", option.table, option.key, example->second.toml);
      absl::Status status = ApplyTomlText(text, "test", &config);
      ASSERT_TRUE(status.ok()) << status;
      from_toml = config;
    }
    if (!option.flag.empty()) {
      std::vector<std::string> args;
      for (const auto& value : example->second.flag) args.insert(args.end(), {std::string(FlagName(option)), value});
      auto config = FromCommandLine(args);
      ASSERT_TRUE(config.ok()) << config.status();
      from_flag = *config;
    }
    ASSERT_TRUE(from_toml || from_flag) << "a setting with neither a TOML key nor a flag";
    if (from_toml && from_flag) {
      EXPECT_TRUE(*from_toml == *from_flag) << "TOML and flag disagree";
    }
    const DaemonConfig& result = from_toml ? *from_toml : *from_flag;
    if (name != "durability.mode") {
      EXPECT_FALSE(result == defaults) << "the example did not change the config";
    }
    EXPECT_TRUE(ValidateConfig(result).ok()) << ValidateConfig(result);
  }
}

TEST(OptionTable, DocumentedDefaultsAreTheBuiltInOnes) {
  for (const DaemonOption& option : DaemonOptions()) {
    if (option.parser == OptionParser::kPath || option.parser == OptionParser::kPathList ||
        option.parser == OptionParser::kText) {
      continue;  // described in words ($FUYOU_SOCKET ..., "off")
    }
    SCOPED_TRACE(OptionName(option));
    DaemonConfig config = DefaultDaemonConfig();
    ASSERT_TRUE(ApplyFlag(option, {std::string(option.default_text)}, &config).ok());
    EXPECT_TRUE(config == DefaultDaemonConfig()) << "default_text is not the built-in default";
  }
}

TEST(OptionTable, UnknownKeysAndTablesAreRefused) {
  for (const DaemonOption& option : DaemonOptions()) {
    if (option.key.empty()) continue;
    DaemonConfig config = DefaultDaemonConfig();
    absl::Status status = ApplyTomlText(fmt::format("[{}]\nbogus = 1\n", option.table), "test", &config);
    EXPECT_FALSE(status.ok());
    EXPECT_NE(status.message().find(fmt::format("{}.bogus", option.table)), std::string::npos) << status;
  }
  DaemonConfig config = DefaultDaemonConfig();
  absl::Status table = ApplyTomlText("[nosuch]\nx = 1\n", "test", &config);
  EXPECT_NE(table.message().find("nosuch"), std::string::npos) << table;
  absl::Status top = ApplyTomlText("drain_seconds = 1\n", "test", &config);
  EXPECT_NE(top.message().find("drain_seconds"), std::string::npos) << top;
  EXPECT_TRUE(config == DefaultDaemonConfig());
  EXPECT_FALSE(FromCommandLine({"--no-such-flag", "1"}).ok());
}

TEST(DaemonCommandLine, BadValuesNameTheFlagAndTheProblem) {
  for (const auto& [args, expected] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--max-sessions", "0"}, "1..65536"},
           {{"--dram-budget", "4 parsecs"}, "unknown unit"},
           {{"--socket-mode", "999"}, "octal"},
           {{"--log-level", "loud"}, "trace|debug"},
           {{"--drain-seconds", "soon"}, "seconds"},
           {{"--job-quota", "lots"}, "not a size"}}) {
    auto config = FromCommandLine(args);
    ASSERT_FALSE(config.ok()) << args[0];
    EXPECT_NE(config.status().message().find(args[0]), std::string::npos) << config.status();
    EXPECT_NE(config.status().message().find(expected), std::string::npos) << config.status();
  }
}

TEST(DaemonCommandLine, FlagsOverTheFileOverDefaults) {
  std::string file = ::testing::TempDir() + "/fuyoud_precedence.toml";
  std::ofstream(file) << "[memory]\ndram_budget = \"1GiB\"\n[limits]\nmax_sessions = 5\n";
  auto config = FromCommandLine({"--config", file, "--max-sessions", "7"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->dram_budget_bytes, uint64_t{1} << 30);  // the file over the default
  EXPECT_EQ(config->max_sessions, 7u);                      // the flag over the file
  EXPECT_EQ(config->max_sessions_per_user, DefaultDaemonConfig().max_sessions_per_user);
  std::ofstream(file) << "[limits]\nmax_sessions = 0\n";
  auto bad = FromCommandLine({"--config", file});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("limits.max_sessions"), std::string::npos) << bad.status();
  EXPECT_FALSE(FromCommandLine({"--config", file + ".missing"}).ok()) << "--config must name an existing file";
}

TEST(DaemonCommandLine, HelpListsEveryFlag) {
  CLI::App app;
  DaemonCommandLine command_line(app);
  std::string help = app.help();
  EXPECT_NE(help.find("--config"), std::string::npos);
  for (const DaemonOption& option : DaemonOptions()) {
    if (!option.flag.empty()) {
      EXPECT_NE(help.find(FlagName(option)), std::string::npos) << help;
    }
  }
}

}  // namespace
}  // namespace fuyou
