#include "server/daemon_server.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"
#include "jobs/job_registry.h"
#include "journal/journal_scratch.h"
#include "jobs/storage_budget.h"
#include "metrics/metrics_http.h"
#include "metrics/metrics_text.h"
#include "optimizer/adamw_kernel.h"
#include "state/state_cache.h"
#include "server/admin_service.h"
#include "server/offload_service.h"
#include "server/peer_listener.h"
#include "server/socket_path.h"
#include "server/stats_report.h"
#include "session/session_registry.h"
#include "server/segment_listener.h"
#include "fuyou/segment_handover.h"
#include "stats/daemon_stats.h"
#include "storage/fault_spec.h"
#include "storage/io_engine.h"

namespace fuyou {
namespace fs = std::filesystem;
namespace {

// Holds flock(LOCK_EX) on <root>/fuyoud.lock so two daemons never share a
// storage path. A lock lives on an inode: when the data directory is deleted (and
// perhaps re-created) under a running daemon, the lock no longer guards the path.
// Refresh, called by the reaper every few seconds, notices that the lock file is
// no longer the inode it holds, and re-creates and re-locks it (logging an
// error), so a second daemon started on the path is refused again.
class StoragePathLock {
 public:
  static absl::StatusOr<std::unique_ptr<StoragePathLock>> Acquire(const fs::path& root) {
    auto lock = std::unique_ptr<StoragePathLock>(new StoragePathLock(root));
    FUYOU_RETURN_IF_ERROR(lock->Lock());
    return lock;
  }
  ~StoragePathLock() {
    if (fd_ >= 0) ::close(fd_);
  }

  void Refresh() {
    struct stat st {};
    const fs::path path = root_ / "fuyoud.lock";
    if (::lstat(path.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_) return;
    log::Error("{} is gone or was replaced under the running daemon (was the data directory deleted?); "
               "re-creating and re-locking it",
               path.string());
    if (absl::Status status = Lock(); !status.ok()) {
      log::Error("storage path {} is not locked any more: {}", root_.string(), status.message());
    }
  }

 private:
  explicit StoragePathLock(fs::path root) : root_(std::move(root)) {}

  absl::Status Lock() {
    std::error_code ec;
    fs::create_directories(root_, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          fmt::format("cannot create storage path {}: {}", root_.string(), ec.message()));
    }
    const fs::path path = root_ / "fuyoud.lock";
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return ErrnoStatus(errno, fmt::format("cannot open {}", path.string()));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);
      return absl::FailedPreconditionError(
          fmt::format("storage path {} is in use by another fuyoud (it holds {})", root_.string(), path.string()));
    }
    struct stat st {};
    ::fstat(fd, &st);
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
    dev_ = st.st_dev;
    ino_ = st.st_ino;
    return absl::OkStatus();
  }

  const fs::path root_;
  int fd_ = -1;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

// O_DIRECT support of a storage path, found by opening a probe file through the
// engine (which logs the fallback or refuses the path).
absl::StatusOr<bool> ProbeDirectIo(storage::IoEngine& io, const fs::path& root) {
  FUYOU_ASSIGN_OR_RETURN(storage::DirFd dir, storage::DirFd::OpenRoot(root));
  constexpr char kProbe[] = ".fuyoud-probe";
  auto file = io.OpenAt(dir, kProbe, /*create=*/true, nullptr, storage::IoOwner());
  if (!file.ok()) return file.status();
  bool direct = (*file)->direct_io();
  file->reset();
  dir.Unlink(kProbe).IgnoreError();
  return direct;
}

// The largest gRPC message the daemon accepts. Requests are small: an
// OpenSession's client_info is bounded by [limits] max_client_info_bytes (64 KiB
// at most) and a RegisterChunks names one chunk per slot (64 at most, tens of
// bytes each); data moves through the shared-memory segment. gRPC's default of
// 4 MiB leaves ample room and bounds what one bad message costs to parse.
constexpr int kMaxReceiveMessageBytes = 4 << 20;

// Descriptors one live session can hold: its connection, its Stream's, one state
// file per storage path, and a spare for a segment being created.
constexpr uint64_t kDescriptorsPerSession = 3;
// Descriptors the daemon needs besides its sessions (gRPC, io_uring, logs, admin calls).
constexpr uint64_t kDescriptorReserve = 256;

// Raises the soft limit on open files to the hard limit (systemd's default soft
// limit of 1024 is reached long before [limits] max_sessions), and warns when
// even that is too low for max_sessions. Returns the soft limit now in force.
rlim_t RaiseOpenFileLimit(const DaemonConfig& config) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 0;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) {
      limit = raised;
    } else {
      log::Warn("cannot raise the open-file limit from {} to {}: {}", limit.rlim_cur, limit.rlim_max,
                std::strerror(errno));
    }
  }
  const uint64_t needed =
      config.max_sessions * (kDescriptorsPerSession + config.storage_paths.size()) + kDescriptorReserve;
  if (limit.rlim_cur < needed) {
    log::Warn("the open-file limit of {} is below the {} descriptors that [limits] max_sessions = {} may need: "
              "raise LimitNOFILE= in the unit (or ulimit -n) or lower max_sessions",
              limit.rlim_cur, needed, config.max_sessions);
  }
  return limit.rlim_cur;
}

// The lowest fd number at which a new gRPC connection is refused: the
// descriptors above are kept for what open sessions need (their state files,
// segments, manifest.tmp at each commit, handovers) and for the daemon itself.
// The reserve is what max_sessions may need, at most half the limit.
int MaxConnectionFd(const DaemonConfig& config, rlim_t open_files) {
  if (open_files == 0 || open_files == RLIM_INFINITY) return 0;
  const uint64_t limit = std::min<uint64_t>(open_files, INT32_MAX);
  const uint64_t wanted =
      uint64_t{config.max_sessions} * (kDescriptorsPerSession + config.storage_paths.size()) + kDescriptorReserve;
  const uint64_t reserve = std::min<uint64_t>(wanted, limit / 2);
  return static_cast<int>(limit - reserve);
}

// When PeerListener shuts down a connection that carries no call: after gRPC's
// own idle timer (GRPC_ARG_MAX_CONNECTION_IDLE_MS, the same timeout) had time
// to close it gracefully with a GOAWAY, which a real client follows. What is
// left then is a peer that never completed the HTTP/2 handshake or ignores it.
std::chrono::milliseconds IdleShutdownAfter(double idle_timeout_seconds) {
  if (idle_timeout_seconds <= 0) return std::chrono::milliseconds(0);
  const double grace = std::min(idle_timeout_seconds, 30.0);
  return std::chrono::milliseconds(static_cast<int64_t>(std::min((idle_timeout_seconds + grace) * 1000, 1e12)));
}

// Resolves the "auto" storage settings from the paths' sizes (statvfs).
void ResolveStorageDefaults(DaemonConfig& config) {
  const StorageDefaults defaults = StorageDefaultsFor(config.storage_paths);
  if (config.job_quota_bytes == kAutoBytes) config.job_quota_bytes = defaults.job_quota_bytes;
  if (config.max_storage_bytes_per_user == kAutoBytes) config.max_storage_bytes_per_user = defaults.max_bytes_per_user;
  if (config.max_storage_bytes_all_users == kAutoBytes) {
    config.max_storage_bytes_all_users = defaults.max_bytes_all_users;
  }
  if (config.reserved_free_bytes == kAutoBytes) config.reserved_free_bytes = defaults.reserved_free_bytes;
}

// How often the reaper looks for sessions never attached or idle for too long:
// every 5 s, or a quarter of a shorter idle timeout (a test may use 1 s).
std::chrono::milliseconds ReaperPeriod(double idle_timeout_seconds) {
  double seconds = 5.0;
  if (idle_timeout_seconds > 0) seconds = std::clamp(idle_timeout_seconds / 4, 0.05, 5.0);
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

}  // namespace

class DaemonServer::Impl {
 public:
  DaemonConfig config;
  std::vector<std::unique_ptr<StoragePathLock>> locks;
  std::unique_ptr<DaemonStats> stats;
  std::unique_ptr<storage::SpecFaultInjector> faults;  // test-only; outlives io
  std::unique_ptr<storage::IoEngine> io;
  std::unique_ptr<optimizer::AdamWKernel> kernel;
  std::unique_ptr<StateCache> cache;
  std::unique_ptr<JobRegistry> jobs;
  std::unique_ptr<JournalScratch> journal_scratch;  // gradient journals beyond DRAM
  std::unique_ptr<JournalScratch> activation_scratch;  // SpillActivation (activation offload's ssd tier)
  std::unique_ptr<SessionRegistry> sessions;
  std::unique_ptr<OffloadService> offload;
  std::unique_ptr<StatsReport> report;  // GetStats' daemon-wide figures, for admin and metrics
  std::unique_ptr<AdminService> admin;
  std::unique_ptr<metrics::MetricsHttpServer> metrics;  // null when [metrics] listen is off
  std::unique_ptr<PeerListener> listener;
  // Where clients hand over their segments; stopped before `sessions` goes.
  fs::path segment_socket;
  std::unique_ptr<SegmentListener> segment_listener;
  std::unique_ptr<grpc::Server> server;

  std::mutex mutex;
  std::condition_variable stop_requested;
  bool stopping = false;
  bool stopped = false;
  std::thread reaper;

  void RunReaper() {
    const double idle_timeout = config.idle_session_timeout_seconds;
    std::unique_lock lock(mutex);
    while (!stop_requested.wait_for(lock, ReaperPeriod(idle_timeout), [&] { return stopping; })) {
      lock.unlock();
      sessions->ReapUnattached(std::chrono::seconds(30));
      for (auto& path_lock : locks) path_lock->Refresh();
      if (idle_timeout > 0) sessions->ReapIdle(std::chrono::duration<double>(idle_timeout));
      lock.lock();
    }
  }
};

absl::StatusOr<std::unique_ptr<DaemonServer>> DaemonServer::Start(const DaemonConfig& config) {
  FUYOU_RETURN_IF_ERROR(ValidateConfig(config));
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  const rlim_t open_files = RaiseOpenFileLimit(config);
  for (const fs::path& root : config.storage_paths) {
    auto lock = StoragePathLock::Acquire(root);
    if (!lock.ok()) return lock.status();
    impl->locks.push_back(std::move(*lock));
  }
  ResolveStorageDefaults(impl->config);
  impl->stats = std::make_unique<DaemonStats>(config.storage_paths);
  storage::IoEngineOptions io_options;
  io_options.queue_depth = config.io_queue_depth;
  io_options.allow_buffered_fallback = config.allow_buffered_io;
  if (!config.test_faults.empty()) {
    auto faults = storage::SpecFaultInjector::FromSpec(config.test_faults);
    if (!faults.ok()) {
      return absl::InvalidArgumentError(fmt::format("FUYOU_TEST_FAULTS: {}", faults.status().message()));
    }
    impl->faults = std::move(*faults);
    io_options.fault_injector = impl->faults.get();
    log::Warn("FUYOU_TEST_FAULTS='{}' is set: storage faults are injected on purpose (test only)",
              config.test_faults);
  }
  auto io = storage::IoEngine::Create(io_options);
  if (!io.ok()) return io.status();
  impl->io = std::move(*io);
  std::vector<bool> direct_io;
  for (const fs::path& root : config.storage_paths) {
    auto direct = ProbeDirectIo(*impl->io, root);
    if (!direct.ok()) return direct.status();
    direct_io.push_back(*direct);
  }
  impl->kernel = std::make_unique<optimizer::AdamWKernel>(config.worker_threads);
  impl->cache = std::make_unique<StateCache>(config.dram_budget_bytes);
  auto jobs = JobRegistry::Create(config.storage_paths, *impl->io, *impl->stats,
                                  JobRegistryOptions{.max_jobs_per_user = config.max_jobs_per_user,
                                                     .storage = StorageBudgetOptions{
                                                         .max_bytes_per_user = impl->config.max_storage_bytes_per_user,
                                                         .max_bytes_all_users = impl->config.max_storage_bytes_all_users,
                                                         .reserved_free_bytes = impl->config.reserved_free_bytes}});
  if (!jobs.ok()) return jobs.status();
  impl->jobs = std::move(*jobs);
  // Gradient journals spill to <root>/journal; what a dead daemon left there goes now.
  std::vector<storage::IoCounters*> path_counters;
  for (size_t i = 0; i < config.storage_paths.size(); ++i) path_counters.push_back(impl->stats->path_counters(i));
  auto journal_scratch = JournalScratch::Create(config.storage_paths, *impl->io, path_counters);
  if (!journal_scratch.ok()) return journal_scratch.status();
  impl->journal_scratch = std::move(*journal_scratch);
  // Spilled activations go to <root>/activations, emptied the same way.
  auto activation_scratch =
      JournalScratch::Create(config.storage_paths, *impl->io, path_counters, JournalScratch::kActivationDirName);
  if (!activation_scratch.ok()) return activation_scratch.status();
  impl->activation_scratch = std::move(*activation_scratch);
  SessionServices services{*impl->jobs, *impl->cache, *impl->kernel, *impl->stats};
  services.journal_scratch = impl->journal_scratch.get();
  services.activation_scratch = impl->activation_scratch.get();
  services.job_quota_bytes = impl->config.job_quota_bytes;
  services.storage_budget = &impl->jobs->storage_budget();
  services.durability = DurabilityInterval{.every_steps = config.commit_every_steps,
                                           .every_seconds = config.commit_every_seconds};
  SessionLimits limits;
  limits.max_sessions = config.max_sessions;
  limits.max_sessions_per_user = config.max_sessions_per_user;
  limits.max_segment_bytes_per_user = config.max_segment_bytes_per_user;
  limits.max_client_info_bytes = config.max_client_info_bytes;
  limits.max_journal_bytes_per_user = config.max_journal_bytes_per_user;
  limits.max_activation_bytes_per_user = config.max_activation_bytes_per_user;
  impl->sessions = std::make_unique<SessionRegistry>(services, config.max_segment_bytes, limits);
  impl->report = std::make_unique<StatsReport>(*impl->stats, *impl->sessions, *impl->cache, direct_io);
  // The Prometheus endpoint, when configured, on a thread of its own; it reads
  // what GetStats reads.
  if (!config.metrics_listen.empty()) {
    auto metrics = metrics::MetricsHttpServer::Start(config.metrics_listen, [raw = impl.get()] {
      v1::GetStatsResponse stats;
      raw->report->FillDaemonScope(/*rates=*/false, &stats);
      return metrics::RenderMetrics({stats, raw->stats->chunk_update_seconds.Snapshot(),
                                     raw->stats->step_seconds.Snapshot(), FUYOU_VERSION});
    });
    if (!metrics.ok()) return metrics.status();
    impl->metrics = std::move(*metrics);
    // Logged before the control socket accepts: whoever waits for the socket
    // finds the address in the log.
    log::Info("Prometheus metrics on http://{}:{}/metrics",
              config.metrics_listen.substr(0, config.metrics_listen.rfind(':')), impl->metrics->port());
  }
  // Two sockets side by side, prepared alike: gRPC, and the segment socket
  // where each client passes its segment's memfd (fuyou/segment_handover.h).
  // The daemon needs no privilege for either: it never creates a segment.
  impl->segment_socket = fs::absolute(config.socket_path).string() + std::string(kSegmentSocketSuffix);
  FUYOU_RETURN_IF_ERROR(PrepareSocketPath(config.socket_path, config.socket_mode));
  FUYOU_RETURN_IF_ERROR(PrepareSocketPath(impl->segment_socket, config.socket_mode));
  auto listener = PeerListener::Listen(config.socket_path, config.socket_mode,
                                       ConnectionLimits{.max_connections = config.max_connections,
                                                        .max_connections_per_user = config.max_connections_per_user,
                                                        .max_connection_fd = MaxConnectionFd(config, open_files)},
                                       IdleShutdownAfter(config.idle_connection_timeout_seconds));
  if (!listener.ok()) return listener.status();
  impl->listener = std::move(*listener);
  auto segment_listener = SegmentListener::Listen(
      impl->segment_socket, config.socket_mode,
      [sessions = impl->sessions.get()](const PeerCredentials& peer, const std::string& id, int fd) {
        return sessions->AdoptSegment(id, peer.uid, fd);
      });
  if (!segment_listener.ok()) {
    std::error_code ec;
    fs::remove(config.socket_path, ec);
    return segment_listener.status();
  }
  impl->segment_listener = std::move(*segment_listener);
  impl->offload = std::make_unique<OffloadService>(*impl->sessions, impl->listener.get(), impl->segment_socket);
  impl->admin = std::make_unique<AdminService>(impl->listener.get(), *impl->report, *impl->sessions, *impl->jobs,
                                               *impl->cache, std::string(optimizer::IsaName(impl->kernel->isa())));

  // The daemon accepts connections itself (to learn each peer's uid) and hands
  // them to a gRPC server that has no listening port of its own.
  grpc::ServerBuilder builder;
  builder.RegisterService(impl->offload.get());
  builder.RegisterService(impl->admin.get());
  builder.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(impl->listener->CallCounter());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  // A connection with no RPC in flight for this long gets a GOAWAY and is
  // closed; a client reconnects on its next call. Sessions keep their Stream
  // call open, so a training job is never idle. PeerListener shuts down the
  // connections gRPC's timer does not close (no HTTP/2 handshake).
  if (config.idle_connection_timeout_seconds > 0) {
    builder.AddChannelArgument(
        GRPC_ARG_MAX_CONNECTION_IDLE_MS,
        static_cast<int>(std::min(config.idle_connection_timeout_seconds * 1000, double{INT32_MAX})));
  }
  impl->server = builder.BuildAndStart();
  if (!impl->server) {
    return absl::UnavailableError(fmt::format("cannot start the gRPC server for {}", config.socket_path.string()));
  }
  impl->listener->Serve(impl->server.get());
  impl->segment_listener->Serve();
  impl->reaper = std::thread([raw = impl.get()] { raw->RunReaper(); });
  log::Info("fuyoud {} serving on {} and segment socket {} (mode {:04o}); storage: {}; DRAM budget {} MiB; {} worker "
            "threads ({})",
            FUYOU_VERSION, config.socket_path.string(), impl->segment_socket.string(), config.socket_mode,
            [&] {
              std::string paths;
              for (size_t i = 0; i < config.storage_paths.size(); ++i) {
                paths += fmt::format("{}{}{}", i ? ", " : "", config.storage_paths[i].string(),
                                     direct_io[i] ? "" : " (buffered)");
              }
              return paths;
            }(),
            config.dram_budget_bytes >> 20, impl->kernel->threads(), optimizer::IsaName(impl->kernel->isa()));
  log::Info("limits: {} sessions in all, {} and {} MiB of segments per user, client_info up to {} bytes, idle "
            "sessions closed after {}; open-file limit {}",
            config.max_sessions, config.max_sessions_per_user, config.max_segment_bytes_per_user >> 20,
            config.max_client_info_bytes,
            config.idle_session_timeout_seconds > 0 ? fmt::format("{} s", config.idle_session_timeout_seconds)
                                                    : std::string("never"),
            open_files);
  const auto bytes_or_unlimited = [](uint64_t bytes) {
    return bytes == 0 ? std::string("unlimited") : fmt::format("{} MiB", bytes >> 20);
  };
  log::Info("limits: {} connections in all, {} per user, idle connections closed after {}, new connections refused "
            "from fd {}; storage: {} per job, {} per user, {} for all users but administrators together, {} kept free on "
            "each path for administrators",
            config.max_connections, config.max_connections_per_user,
            config.idle_connection_timeout_seconds > 0 ? fmt::format("{} s", config.idle_connection_timeout_seconds)
                                                       : std::string("never"),
            MaxConnectionFd(config, open_files), bytes_or_unlimited(impl->config.job_quota_bytes),
            bytes_or_unlimited(impl->config.max_storage_bytes_per_user),
            bytes_or_unlimited(impl->config.max_storage_bytes_all_users),
            impl->config.reserved_free_bytes != 0 ? fmt::format("{} MiB", impl->config.reserved_free_bytes >> 20)
                                                  : std::string("nothing"));
  return std::unique_ptr<DaemonServer>(new DaemonServer(std::move(impl)));
}

DaemonServer::DaemonServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DaemonServer::~DaemonServer() { Shutdown(); }

void DaemonServer::Shutdown() {
  Impl& impl = *impl_;
  {
    std::lock_guard lock(impl.mutex);
    if (impl.stopped) return;
    impl.stopped = true;
    impl.stopping = true;
  }
  impl.stop_requested.notify_all();
  if (impl.reaper.joinable()) impl.reaper.join();
  if (impl.metrics) impl.metrics->Stop();
  impl.sessions->StartDraining();
  const auto drain_deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(impl.config.drain_seconds);
  if (impl.sessions->size() > 0) {
    log::Info("draining: waiting up to {} s for {} session(s) to close", impl.config.drain_seconds,
              impl.sessions->size());
  }
  while (impl.sessions->size() > 0 && std::chrono::steady_clock::now() < drain_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // Sessions still open lose only their uncommitted step.
  impl.sessions->CloseAll();
  impl.listener->Stop();
  impl.segment_listener->Stop();
  impl.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  impl.server->Wait();
  std::error_code ec;
  fs::remove(impl.config.socket_path, ec);
  fs::remove(impl.segment_socket, ec);
  log::Info("fuyoud stopped; sockets {} and {} removed", impl.config.socket_path.string(),
            impl.segment_socket.string());
}

}  // namespace fuyou
