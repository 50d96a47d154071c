// DaemonConfig: every setting of fuyoud, with defaults that need no config file.
// Sources, later ones winning: built-in defaults, the TOML file (--config), flags;
// every setting is one entry of the option table (option_table.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace fuyou {

enum class DurabilityMode {
  kStepAtomic,  // a step's states go to shadow extents; the manifest commit flips them
};

// A byte setting whose value DaemonServer::Start derives from the storage paths.
inline constexpr uint64_t kAutoBytes = UINT64_MAX;

struct DaemonConfig {
  std::filesystem::path socket_path;       // default: DefaultDaemonSocketPath()
  uint32_t socket_mode = 0660;
  std::string log_level = "info";
  std::vector<std::filesystem::path> storage_paths;  // default: {DefaultDataDir()}
  unsigned io_queue_depth = 64;
  bool allow_buffered_io = true;
  // Most bytes one job may reserve on storage (both extents of every chunk, over
  // all paths); 0 = unlimited; kAutoBytes (the default): a quarter of the
  // storage paths' size (statvfs), resolved by DaemonServer::Start. Enforced
  // when chunks are registered.
  uint64_t job_quota_bytes = kAutoBytes;
  // [storage] reserved_free: free bytes kept on every storage path that only
  // administrators' registrations (root, the daemon's user) may take, so that
  // another user cannot fill the disk under them. kAutoBytes (the default): 1%
  // of the path's size, at least 64 MiB and at most 4 GiB; 0 = none.
  uint64_t reserved_free_bytes = kAutoBytes;
  uint64_t dram_budget_bytes = uint64_t{2} << 30;
  uint64_t max_segment_bytes = uint64_t{8} << 30;
  unsigned worker_threads = 0;  // 0: all cores
  DurabilityMode durability = DurabilityMode::kStepAtomic;
  // [durability] commit_every_steps / commit_every_seconds: how often a step is
  // made durable (its states synced and the manifest committed). 1 (the
  // default): every step; N: every Nth step, and a crash loses at most the last
  // N-1 acknowledged steps. commit_every_seconds > 0 (with N > 1) also makes a
  // step durable once that many seconds passed since the last durable one; 0 =
  // off (a period alone: N = kMaxCommitEverySteps). In
  // between, chunks kept in the DRAM tier are not written back (state/chunk_store.h).
  uint32_t commit_every_steps = 1;
  double commit_every_seconds = 0;
  // Seconds a SIGTERM waits for sessions to finish their step before closing them.
  double drain_seconds = 10.0;

  // [limits]: what the daemon holds for all users together and for one user (uid).
  // Root and the daemon's own user are bound by them like everyone else. A request
  // over a limit is refused with RESOURCE_EXHAUSTED naming the limit, its value, the
  // current use and the setting that raises it; the refusal changes nothing.
  uint32_t max_sessions = 256;                               // live sessions, all users together
  uint32_t max_sessions_per_user = 8;                        // live sessions of one uid
  uint64_t max_segment_bytes_per_user = uint64_t{16} << 30;  // sum of the segments of one uid's live sessions
  // Gradient journals (GradReady.journal) of one uid's live sessions, in DRAM and
  // spilled to storage together; a KEEP beyond it is RESOURCE_EXHAUSTED.
  uint64_t max_journal_bytes_per_user = uint64_t{256} << 30;
  // Activation scratch (SpillActivation) of one uid's live sessions, in whole
  // blocks; a spill beyond it is RESOURCE_EXHAUSTED.
  uint64_t max_activation_bytes_per_user = uint64_t{256} << 30;
  uint64_t max_client_info_bytes = 1024;                     // client_info of one session
  uint32_t max_jobs_per_user = 64;                           // jobs of one uid on the storage tier; 0 = unlimited
  // Bytes reserved on storage by all of one uid's jobs (CopyJob's copies
  // included, and its spilled scratch); 0 = unlimited; kAutoBytes (the
  // default): a quarter of the storage paths' size.
  uint64_t max_storage_bytes_per_user = kAutoBytes;
  // The same summed over all ordinary uids (every uid but root and the
  // daemon's own, which are not bound by it: the rest of the storage is kept
  // for them); 0 = unlimited; kAutoBytes (the default): half the storage paths' size.
  uint64_t max_storage_bytes_all_users = kAutoBytes;
  // gRPC connections on the control socket (issue 20). A connection over a limit
  // is closed at accept; the refusals are logged at a bounded rate.
  uint32_t max_connections = 1024;          // all users together
  uint32_t max_connections_per_user = 64;   // one uid
  // A connection that carries no RPC for this long is closed (gRPC's
  // max_connection_idle: a GOAWAY; clients reconnect on their next call); 0 = never.
  double idle_connection_timeout_seconds = 300;
  // An attached session with no stream message for this long is closed (its
  // uncommitted step rolls back, as when the client disconnects); 0 = never.
  double idle_session_timeout_seconds = 4 * 3600;
  // [metrics] listen: "host:port" where GET /metrics serves the Prometheus text
  // format (metrics/metrics_http.h); empty = off, the default. The figures are
  // every user's activity: keep it on a loopback address unless the network
  // in between is trusted.
  std::string metrics_listen;
  // TEST-ONLY: storage faults to inject (FUYOU_TEST_FAULTS; see storage/fault_spec.h).
  std::string test_faults;

  friend bool operator==(const DaemonConfig&, const DaemonConfig&) = default;
};

// Built-in defaults for the calling user (see proto/include/fuyou/defaults.h).
DaemonConfig DefaultDaemonConfig();

// Overlays the settings found in a TOML file onto `config`. Unknown keys and
// wrong types are INVALID_ARGUMENT naming the key; a missing file is NOT_FOUND.
absl::Status ApplyTomlFile(const std::filesystem::path& file, DaemonConfig* config);
// Same, from TOML text (for tests and error messages, `origin` names the source).
absl::Status ApplyTomlText(std::string_view text, std::string_view origin, DaemonConfig* config);

// "auto" -> kAutoBytes, "unlimited" -> 0, else ParseByteSize (for --job-quota,
// --max-storage-per-user, --reserved-free).
absl::StatusOr<uint64_t> ParseAutoByteSize(std::string_view text);

// "4GiB", "512MiB", "1.5G", "1073741824" -> bytes. Binary (KiB, MiB, GiB, TiB) and
// decimal (KB/K, MB/M, GB/G, TB/T) units; INVALID_ARGUMENT otherwise.
absl::StatusOr<uint64_t> ParseByteSize(std::string_view text);

// Bounds of the [limits] settings (ValidateConfig refuses values outside them).
inline constexpr uint32_t kMaxSessionsCeiling = 65536;
inline constexpr uint32_t kMaxConnectionsCeiling = 1 << 20;
inline constexpr uint64_t kMinClientInfoBytes = 64;
inline constexpr uint64_t kMaxClientInfoBytesCeiling = 64 * 1024;
inline constexpr uint32_t kMaxCommitEverySteps = 1000000;

// Checks cross-field constraints (paths given, budget >= 64 MiB, ...).
absl::Status ValidateConfig(const DaemonConfig& config);

}  // namespace fuyou
