// DaemonProcess: a real fuyoud started for a test on a private socket and data
// directory, stopped (SIGTERM, then SIGKILL) when the object goes away.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "fuyou/client.h"

namespace fuyou::testing {

// A fresh directory under /tmp, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Spawns `program` with `args` and this process's environment, with `env`
// ("NAME=VALUE" entries) added or replacing; returns the pid or -1.
pid_t Spawn(const std::string& program, const std::vector<std::string>& args,
            const std::vector<std::string>& env = {});

class DaemonProcess {
 public:
  // `extra_args` are appended to --socket/--data-dir; `env` ("NAME=VALUE") is
  // added to the daemon's environment (e.g. FUYOU_CRASH_AT, FUYOU_TEST_FAULTS).
  explicit DaemonProcess(const std::filesystem::path& dir, std::vector<std::string> extra_args = {},
                         std::vector<std::string> env = {});
  ~DaemonProcess();

  // Starts fuyoud and waits until its admin API answers (up to 20 s).
  absl::Status Start();
  // SIGTERM and wait; returns the exit status (as from waitpid), -1 if not running.
  int Stop();
  // SIGKILL and reap.
  void Kill();
  // Waits up to `timeout` for the daemon to exit by itself (a crash point) and
  // reaps it; returns the status as from waitpid, or -1 on timeout or when it is
  // not running.
  int WaitForExit(std::chrono::milliseconds timeout);
  // The environment of the next Start.
  void set_env(std::vector<std::string> env) { env_ = std::move(env); }

  ClientOptions client_options() const;
  const std::filesystem::path& socket_path() const { return socket_path_; }
  const std::filesystem::path& data_dir() const { return data_dir_; }
  pid_t pid() const { return pid_; }

 private:
  std::filesystem::path socket_path_;
  std::filesystem::path data_dir_;
  std::vector<std::string> extra_args_;
  std::vector<std::string> env_;
  pid_t pid_ = -1;
};

}  // namespace fuyou::testing
