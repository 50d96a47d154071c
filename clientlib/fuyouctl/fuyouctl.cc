// fuyouctl: the command-line admin client of fuyoud.
//
//   fuyouctl status                 health and a one-screen summary
//   fuyouctl stats [--watch] [--json]
//   fuyouctl top [--once | --iterations N] [--interval S]   live view, one frame a second
//   fuyouctl sessions | jobs        live sessions, jobs on the storage tier (the ranks
//                                   of a data-parallel job as one job, lists_view.h)
//   fuyouctl delete-job NAME
//   fuyouctl copy-job SRC DST
//
// Exit status 0 on success, 1 with a message on stderr on any error (for example
// when the daemon is not running).
#include <pwd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <ctime>
#include <iostream>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fmt/format.h"
#include "format.h"
#include "lists_view.h"
#include "stats_view.h"
#include "top.h"
#include "fuyou/admin_client.h"
#include "fuyou/defaults.h"
#include "google/protobuf/message.h"
#include "google/protobuf/util/json_util.h"

namespace fuyou::ctl {
namespace {

std::atomic<bool> g_interrupted{false};

void OnSigint(int) { g_interrupted = true; }

absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message, bool pretty) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = pretty;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  auto status = google::protobuf::util::MessageToJsonString(message, &out, options);
  if (!status.ok()) {
    return absl::InternalError(fmt::format("cannot print {} as JSON: {}", message.GetTypeName(),
                                           std::string(status.message())));
  }
  if (!pretty) return out;
  if (!out.empty() && out.back() == '\n') out.pop_back();  // one newline added by the caller
  return out;
}

absl::Status PrintJson(const google::protobuf::Message& message, bool pretty = true) {
  absl::StatusOr<std::string> json = ToJson(message, pretty);
  if (!json.ok()) return json.status();
  fmt::print("{}\n", *json);
  return absl::OkStatus();
}

std::string UserName(uint32_t uid) {
  struct passwd entry {};
  struct passwd* result = nullptr;
  char buffer[1024];
  if (::getpwuid_r(uid, &entry, buffer, sizeof(buffer), &result) == 0 && result != nullptr) {
    return result->pw_name;
  }
  return std::to_string(uid);
}

std::string Ago(int64_t unix_seconds) {
  if (unix_seconds <= 0) return "-";
  const double age = static_cast<double>(std::time(nullptr) - unix_seconds);
  return age < 1 ? "just now" : FormatDuration(age) + " ago";
}

absl::Status RunStatus(AdminClient& admin, const std::string& socket, bool json) {
  absl::StatusOr<v1::HealthResponse> health = admin.Health();
  if (!health.ok()) return health.status();
  absl::StatusOr<v1::GetStatsResponse> stats = admin.GetStats();
  if (!stats.ok()) return stats.status();
  if (json) {
    absl::StatusOr<std::string> h = ToJson(*health, false);
    absl::StatusOr<std::string> s = ToJson(*stats, false);
    if (!h.ok()) return h.status();
    if (!s.ok()) return s.status();
    fmt::print("{{\"socket\":\"{}\",\"health\":{},\"stats\":{}}}\n", socket, *h, *s);
    return absl::OkStatus();
  }
  fmt::print("fuyoud {} at {}: {}, up {}, AdamW kernel {}\n", Printable(health->version()), Printable(socket),
             Printable(health->status()), FormatDuration(health->uptime_seconds()), Printable(health->kernel_isa()));
  if (IsUserScope(*stats)) {
    fmt::print("sessions  {} live (yours)\n", stats->live_sessions());
    fmt::print("yours     {} steps committed, {} chunk updates, {} params updated, {} read, {} written\n",
               stats->steps_committed(), FormatCount(static_cast<double>(stats->chunk_updates())),
               FormatCount(static_cast<double>(stats->params_updated())), FormatBytes(stats->bytes_read()),
               FormatBytes(stats->bytes_written()));
    return absl::OkStatus();
  }
  fmt::print("sessions  {} live\n", stats->live_sessions());
  fmt::print("DRAM      {}\n", DramLine(*stats));
  fmt::print("storage   {} path{}\n", stats->storage_size(), stats->storage_size() == 1 ? "" : "s");
  fmt::print("totals    {} steps committed, {} chunk updates, {} params updated\n",
             stats->steps_committed(), FormatCount(static_cast<double>(stats->chunk_updates())),
             FormatCount(static_cast<double>(stats->params_updated())));
  return absl::OkStatus();
}

absl::Status RunStats(AdminClient& admin, bool watch, double interval_s, bool json) {
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  if (watch) std::signal(SIGINT, OnSigint);
  do {
    absl::StatusOr<v1::GetStatsResponse> stats = admin.GetStats();
    if (!stats.ok()) return stats.status();
    if (json) {
      // One object per line under --watch, so that the output is JSON Lines.
      if (absl::Status status = PrintJson(*stats, !watch); !status.ok()) return status;
    } else {
      if (watch && tty) fmt::print("\033[H\033[2J");
      fmt::print("{}", RenderStats(*stats));
      if (watch) fmt::print("\n");
    }
    std::fflush(stdout);
    if (!watch) break;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(interval_s);
    while (!g_interrupted && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } while (!g_interrupted);
  return absl::OkStatus();
}

absl::StatusOr<TopSample> SampleTop(AdminClient& admin) {
  TopSample sample;
  absl::StatusOr<v1::GetStatsResponse> stats = admin.GetStats();
  if (!stats.ok()) return stats.status();
  absl::StatusOr<v1::ListSessionsResponse> sessions = admin.ListSessions();
  if (!sessions.ok()) return sessions.status();
  sample.stats = std::move(*stats);
  sample.sessions = std::move(*sessions);
  sample.when = std::chrono::steady_clock::now();
  return sample;
}

// Sleeps `seconds` unless interrupted; false when interrupted.
bool Pause(double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!g_interrupted && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return !g_interrupted;
}

// Each frame's rates cover the interval before it: the first frame comes one
// interval after the start. `iterations` 0: until interrupted.
absl::Status RunTop(AdminClient& admin, double interval_s, int64_t iterations) {
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  std::signal(SIGINT, OnSigint);
  absl::StatusOr<TopSample> previous = SampleTop(admin);
  if (!previous.ok()) return previous.status();
  for (int64_t frame = 0; iterations == 0 || frame < iterations; ++frame) {
    if (!Pause(interval_s)) break;
    absl::StatusOr<TopSample> now = SampleTop(admin);
    if (!now.ok()) return now.status();
    // On a terminal each frame replaces the last; into a pipe, frames follow
    // each other, separated by a blank line.
    if (tty) fmt::print("\033[H\033[2J");
    else if (frame > 0) fmt::print("\n");
    fmt::print("{}", RenderTop(*previous, *now, UserName));
    std::fflush(stdout);
    previous = std::move(now);
  }
  return absl::OkStatus();
}

absl::Status RunSessions(AdminClient& admin, bool json) {
  absl::StatusOr<v1::ListSessionsResponse> sessions = admin.ListSessions();
  if (!sessions.ok()) return sessions.status();
  if (json) return PrintJson(*sessions);
  fmt::print("{}", RenderSessions(*sessions, UserName));
  return absl::OkStatus();
}

absl::Status RunJobs(AdminClient& admin, bool json, bool all_users) {
  absl::StatusOr<v1::ListJobsResponse> jobs = admin.ListJobs(all_users);
  if (!jobs.ok()) return jobs.status();
  if (json) return PrintJson(*jobs);
  fmt::print("{}", RenderJobs(*jobs, UserName, Ago));
  return absl::OkStatus();
}

absl::Status RunCopyJob(AdminClient& admin, const std::string& src, const std::string& dst) {
  absl::StatusOr<v1::CopyJobResponse> copied = admin.CopyJob(src, dst);
  if (!copied.ok()) return copied.status();
  fmt::print("copied job '{}' into '{}': {} of states, committed step {}\n", Printable(src), Printable(dst),
             FormatBytes(copied->bytes_copied()), copied->committed_step());
  return absl::OkStatus();
}

absl::Status RunDeleteJob(AdminClient& admin, const std::string& name) {
  absl::StatusOr<v1::DeleteJobResponse> deleted = admin.DeleteJob(name);
  if (!deleted.ok()) return deleted.status();
  fmt::print("deleted job '{}': freed {}\n", Printable(name), FormatBytes(deleted->bytes_freed()));
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  CLI::App app{"fuyouctl: inspect and manage the fuyoud offload daemon"};
  app.require_subcommand(1);
  app.fallthrough();
  std::string socket = DefaultSocketPath().string();
  double timeout_s = 10;
  CLI::Option* socket_option =
      app.add_option("--socket", socket, "Socket of fuyoud ($FUYOU_SOCKET, else the system or per-user socket)")
          ->capture_default_str();
  app.add_option("--timeout", timeout_s, "Seconds to wait for the daemon to connect and answer")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  bool json = false;
  CLI::App* status = app.add_subcommand("status", "Health of the daemon and a short summary");
  status->add_flag("--json", json, "Print health and stats as one JSON object");

  bool watch = false;
  double interval_s = 1.0;
  CLI::App* stats = app.add_subcommand("stats", "Storage traffic, optimizer throughput, memory");
  stats->add_flag("--watch,-w", watch, "Refresh until interrupted");
  stats->add_option("--interval,-n", interval_s, "Seconds between refreshes under --watch")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  stats->add_flag("--json", json, "Print the GetStats response as JSON (one line per refresh under --watch)");

  bool once = false;
  int64_t iterations = 0;
  double top_interval_s = 1.0;
  CLI::App* top = app.add_subcommand("top", "Live view: storage GB/s, sessions' updates/s and latency, DRAM, cache");
  top->add_flag("--once", once, "Print one frame (its rates cover one interval) and exit");
  top->add_option("--iterations", iterations, "Print N frames and exit (default: until interrupted)")
      ->check(CLI::Range(int64_t{1}, int64_t{1'000'000'000}));
  top->add_option("--interval,-n", top_interval_s, "Seconds between frames")
      ->check(CLI::Range(0.05, 3600.0))
      ->capture_default_str();

  CLI::App* sessions = app.add_subcommand("sessions", "Live sessions");
  sessions->add_flag("--json", json, "Print as JSON");
  CLI::App* jobs = app.add_subcommand("jobs", "Your jobs on the storage tier");
  jobs->add_flag("--json", json, "Print as JSON");
  bool all_users = false;
  jobs->add_flag("--all-users", all_users, "Every user's jobs (root and the daemon's user only)");
  std::string job_name;
  CLI::App* delete_job = app.add_subcommand("delete-job", "Delete a job and free its space");
  delete_job->add_option("NAME", job_name, "Job to delete")->required();
  std::string copy_src, copy_dst;
  CLI::App* copy_job =
      app.add_subcommand("copy-job", "Fork a job: a new job DST gets SRC's committed states, copied in the daemon");
  copy_job->add_option("SRC", copy_src, "Job to copy (not open in a session)")->required();
  copy_job->add_option("DST", copy_dst, "New job's name (must not exist)")->required();

  CLI11_PARSE(app, argc, argv);

  ClientOptions options;
  // With no --socket the default address is left to clientlib, which checks
  // that the daemon there is one this user may trust (channel.h).
  if (socket_option->count() > 0) options.address = socket.starts_with("unix:") ? socket : "unix:" + socket;
  options.rpc_timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  options.connect_timeout = options.rpc_timeout;
  absl::StatusOr<std::unique_ptr<AdminClient>> admin = AdminClient::Connect(options);
  absl::Status result = admin.status();
  if (result.ok()) {
    if (status->parsed()) result = RunStatus(**admin, socket, json);
    else if (stats->parsed()) result = RunStats(**admin, watch, interval_s, json);
    else if (top->parsed()) result = RunTop(**admin, top_interval_s, once ? 1 : iterations);
    else if (sessions->parsed()) result = RunSessions(**admin, json);
    else if (jobs->parsed()) result = RunJobs(**admin, json, all_users);
    else if (delete_job->parsed()) result = RunDeleteJob(**admin, job_name);
    else if (copy_job->parsed()) result = RunCopyJob(**admin, copy_src, copy_dst);
  }
  if (!result.ok()) {
    std::cerr << "fuyouctl: " << Printable(std::string(result.message())) << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace fuyou::ctl

int main(int argc, char** argv) { return fuyou::ctl::Main(argc, argv); }
