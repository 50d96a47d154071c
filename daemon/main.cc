// fuyoud: the fuyou offload daemon. See README.md and deploy/fuyoud.toml.
#include <signal.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/crash_point.h"
#include "common/log.h"
#include "common/status_util.h"
#include "config/daemon_config.h"
#include "server/daemon_server.h"

namespace {

int Fail(const absl::Status& status) {
  fuyou::log::Error("{}", status.message());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fuyoud: the fuyou offload daemon (CPU AdamW with optimizer states on NVMe SSDs)"};
  app.set_version_flag("--version", FUYOU_VERSION);
  std::string config_file;
  std::string socket;
  std::vector<std::string> data_dirs;
  std::string dram_budget;
  std::string max_segment;
  std::string job_quota;
  int threads = -1;
  int64_t max_jobs_per_user = -1;
  int io_depth = -1;
  std::string log_level;
  std::string socket_mode;
  double drain_seconds = -1;
  int64_t commit_every_steps = -1;
  double commit_every_seconds = -1;
  int64_t max_sessions = -1;
  int64_t max_sessions_per_user = -1;
  std::string max_segment_bytes_per_user;
  std::string max_journal_bytes_per_user;
  std::string max_client_info_bytes;
  double idle_session_timeout = -1;
  std::optional<std::string> metrics_listen;
  std::string max_storage_per_user;
  std::string reserved_free;
  int64_t max_connections = -1;
  int64_t max_connections_per_user = -1;
  double idle_connection_timeout = -1;
  app.add_option("--config", config_file, "TOML config file (see deploy/fuyoud.toml)")->check(CLI::ExistingFile);
  app.add_option("--socket", socket, "Unix socket to serve on (default: $FUYOU_SOCKET, /run/fuyou/fuyoud.sock for "
                                     "root, else $XDG_RUNTIME_DIR/fuyou/fuyoud.sock)");
  app.add_option("--socket-mode", socket_mode, "octal permissions of the socket (default 0660)");
  app.add_option("--data-dir,--storage-path", data_dirs,
                 "storage directory for optimizer states, one per SSD; repeat for several (default: "
                 "$FUYOU_DATA_DIR, /var/lib/fuyou for root, else ~/.local/share/fuyou)");
  app.add_option("--dram-budget", dram_budget, "DRAM for optimizer states, e.g. 4GiB (default 2GiB)");
  app.add_option("--job-quota", job_quota,
                 "most storage one job may reserve, e.g. 100GiB, \"unlimited\", or \"auto\": a quarter of the "
                 "storage paths' size (default auto)");
  app.add_option("--max-storage-per-user", max_storage_per_user,
                 "most storage all of one user's jobs may reserve, e.g. 1TiB, \"unlimited\", or \"auto\": half the "
                 "storage paths' size (default auto)");
  app.add_option("--reserved-free", reserved_free,
                 "free space kept on each storage path for administrators' jobs, e.g. 4GiB, or \"auto\": 1% of the "
                 "path, 64MiB..4GiB (default auto)");
  app.add_option("--max-connections", max_connections, "gRPC connections of all users together (default 1024)");
  app.add_option("--max-connections-per-user", max_connections_per_user,
                 "gRPC connections of one user (default 64)");
  app.add_option("--idle-connection-timeout", idle_connection_timeout,
                 "seconds a connection may carry no RPC before it is closed; 0 = never (default 300)");
  app.add_option("--max-segment", max_segment, "largest shared-memory segment a session may ask for (default 8GiB)");
  app.add_option("--max-jobs-per-user", max_jobs_per_user, "jobs one user may have on the storage tier, 0 = no limit (default 64)")
      ->check(CLI::Range(int64_t{0}, int64_t{1'000'000}));
  app.add_option("--threads", threads, "optimizer worker threads, 0 = all cores (default 0)");
  app.add_option("--io-depth", io_depth, "io_uring queue depth per storage path (default 64)");
  app.add_option("--drain-seconds", drain_seconds, "on SIGTERM, how long sessions may finish their step (default 10)");
  app.add_option("--commit-every-steps", commit_every_steps,
                 "make every Nth step durable; a crash loses at most N-1 acknowledged steps (default 1)");
  app.add_option("--commit-every-seconds", commit_every_seconds,
                 "also make a step durable when this many seconds passed since the last durable one, 0 = off (default 0)");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error (default info)");
  app.add_option("--max-sessions", max_sessions, "live sessions of all users together (default 256)");
  app.add_option("--max-sessions-per-user", max_sessions_per_user, "live sessions of one user (default 8)");
  app.add_option("--max-segment-bytes-per-user", max_segment_bytes_per_user,
                 "shared-memory segment bytes of one user's live sessions, e.g. 16GiB (default 16GiB)");
  app.add_option("--max-journal-bytes-per-user", max_journal_bytes_per_user,
                 "gradient journal bytes (DRAM and spilled) of one user's live sessions, e.g. 64GiB (default 256GiB)");
  app.add_option("--max-client-info-bytes", max_client_info_bytes,
                 "longest client_info a session may carry (default 1KiB)");
  app.add_option("--idle-session-timeout", idle_session_timeout,
                 "seconds an attached session may go without a message before it is closed; 0 = never "
                 "(default 14400)");
  app.add_option("--metrics-listen", metrics_listen,
                 "host:port to serve Prometheus metrics on (GET /metrics), e.g. 127.0.0.1:9464; \"\" = off "
                 "(default off)");
  CLI11_PARSE(app, argc, argv);

  fuyou::DaemonConfig config = fuyou::DefaultDaemonConfig();
  if (!config_file.empty()) {
    if (auto status = fuyou::ApplyTomlFile(config_file, &config); !status.ok()) return Fail(status);
  }
  if (!socket.empty()) config.socket_path = socket;
  if (!socket_mode.empty()) {
    char* end = nullptr;
    unsigned long mode = std::strtoul(socket_mode.c_str(), &end, 8);
    if (*end != '\0' || mode > 0777) return Fail(absl::InvalidArgumentError("--socket-mode expects an octal mode such as 0660"));
    config.socket_mode = static_cast<uint32_t>(mode);
  }
  if (!data_dirs.empty()) config.storage_paths.assign(data_dirs.begin(), data_dirs.end());
  if (!dram_budget.empty()) {
    auto bytes = fuyou::ParseByteSize(dram_budget);
    if (!bytes.ok()) return Fail(absl::InvalidArgumentError("--dram-budget: " + std::string(bytes.status().message())));
    config.dram_budget_bytes = *bytes;
  }
  if (!max_segment.empty()) {
    auto bytes = fuyou::ParseByteSize(max_segment);
    if (!bytes.ok()) return Fail(absl::InvalidArgumentError("--max-segment: " + std::string(bytes.status().message())));
    config.max_segment_bytes = *bytes;
  }
  for (auto [flag, text, target] : {std::tuple{"--job-quota", &job_quota, &config.job_quota_bytes},
                                     std::tuple{"--max-storage-per-user", &max_storage_per_user,
                                                &config.max_storage_bytes_per_user},
                                     std::tuple{"--reserved-free", &reserved_free, &config.reserved_free_bytes}}) {
    if (text->empty()) continue;
    auto bytes = fuyou::ParseAutoByteSize(*text);
    if (!bytes.ok()) return Fail(absl::InvalidArgumentError(std::string(flag) + ": " + std::string(bytes.status().message())));
    *target = *bytes;
  }
  if (max_jobs_per_user >= 0) config.max_jobs_per_user = static_cast<uint32_t>(max_jobs_per_user);
  if (threads >= 0) config.worker_threads = static_cast<unsigned>(threads);
  if (io_depth > 0) config.io_queue_depth = static_cast<unsigned>(io_depth);
  if (drain_seconds >= 0) config.drain_seconds = drain_seconds;
  // Out of range (0, > 2^32) is refused by ValidateConfig with a message.
  if (commit_every_steps != -1) {
    config.commit_every_steps = static_cast<uint32_t>(std::clamp<int64_t>(commit_every_steps, 0, UINT32_MAX));
  }
  if (commit_every_seconds != -1) config.commit_every_seconds = commit_every_seconds;
  // Out-of-range counts become 0 or UINT32_MAX, which ValidateConfig refuses with a message.
  auto count = [](int64_t value) { return static_cast<uint32_t>(std::clamp<int64_t>(value, 0, UINT32_MAX)); };
  if (max_sessions != -1) config.max_sessions = count(max_sessions);
  if (max_sessions_per_user != -1) config.max_sessions_per_user = count(max_sessions_per_user);
  if (!max_segment_bytes_per_user.empty()) {
    auto bytes = fuyou::ParseByteSize(max_segment_bytes_per_user);
    if (!bytes.ok()) {
      return Fail(absl::InvalidArgumentError("--max-segment-bytes-per-user: " + std::string(bytes.status().message())));
    }
    config.max_segment_bytes_per_user = *bytes;
  }
  if (!max_journal_bytes_per_user.empty()) {
    auto bytes = fuyou::ParseByteSize(max_journal_bytes_per_user);
    if (!bytes.ok()) {
      return Fail(absl::InvalidArgumentError("--max-journal-bytes-per-user: " + std::string(bytes.status().message())));
    }
    config.max_journal_bytes_per_user = *bytes;
  }
  if (!max_client_info_bytes.empty()) {
    auto bytes = fuyou::ParseByteSize(max_client_info_bytes);
    if (!bytes.ok()) {
      return Fail(absl::InvalidArgumentError("--max-client-info-bytes: " + std::string(bytes.status().message())));
    }
    config.max_client_info_bytes = *bytes;
  }
  if (idle_session_timeout != -1) config.idle_session_timeout_seconds = idle_session_timeout;
  if (max_connections != -1) config.max_connections = count(max_connections);
  if (max_connections_per_user != -1) config.max_connections_per_user = count(max_connections_per_user);
  if (idle_connection_timeout != -1) config.idle_connection_timeout_seconds = idle_connection_timeout;
  if (metrics_listen) config.metrics_listen = *metrics_listen;
  if (!log_level.empty()) config.log_level = log_level;
  fuyou::log::Level level;
  if (!fuyou::log::ParseLevel(config.log_level, &level)) {
    return Fail(absl::InvalidArgumentError("log level '" + config.log_level + "' is not trace|debug|info|warn|error"));
  }
  fuyou::log::SetLevel(level);
  // Test-only hooks, read from the environment (see common/crash_point.h and
  // storage/fault_spec.h); both log loudly when set.
  if (auto status = fuyou::crash_point::ArmFromEnvironment(); !status.ok()) return Fail(status);
  if (fuyou::crash_point::internal::armed) {
    fuyou::log::Warn("FUYOU_CRASH_AT={} is set: fuyoud will kill itself at that crash point (test only)",
                     std::getenv("FUYOU_CRASH_AT"));
  }
  if (const char* faults = std::getenv("FUYOU_TEST_FAULTS")) config.test_faults = faults;
  if (::geteuid() == 0) {
    // Clients create their segments themselves and pass the fds over the segment
    // socket, so fuyoud needs no privilege; root only widens what a bug can do.
    fuyou::log::Warn(
        "fuyoud is running as root, which it does not need; deploy/fuyoud.service runs it as the system user "
        "fuyou with no capabilities");
  }

  // Signals are taken synchronously by this thread; every other thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto server = fuyou::DaemonServer::Start(config);
  if (!server.ok()) return Fail(server.status());
  sd_notify(0, "READY=1\nSTATUS=serving");

  int received = 0;
  sigwait(&signals, &received);
  fuyou::log::Info("received {}; draining sessions and stopping", received == SIGTERM ? "SIGTERM" : "SIGINT");
  sd_notify(0, "STOPPING=1");
  (*server)->Shutdown();
  return 0;
}
