// DaemonProcess: a real fuyoud started for a test on a private socket and data
// directory, stopped (SIGTERM, then SIGKILL) when the object goes away.
#pragma once

#include <sys/types.h>

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

// Spawns `program` with `args`; returns the pid or -1.
pid_t Spawn(const std::string& program, const std::vector<std::string>& args);

class DaemonProcess {
 public:
  // `extra_args` are appended to --socket/--data-dir.
  explicit DaemonProcess(const std::filesystem::path& dir, std::vector<std::string> extra_args = {});
  ~DaemonProcess();

  // Starts fuyoud and waits until its admin API answers (up to 20 s).
  absl::Status Start();
  // SIGTERM and wait; returns the exit status (as from waitpid), -1 if not running.
  int Stop();
  // SIGKILL and reap.
  void Kill();

  ClientOptions client_options() const;
  const std::filesystem::path& socket_path() const { return socket_path_; }
  const std::filesystem::path& data_dir() const { return data_dir_; }
  pid_t pid() const { return pid_; }

 private:
  std::filesystem::path socket_path_;
  std::filesystem::path data_dir_;
  std::vector<std::string> extra_args_;
  pid_t pid_ = -1;
};

}  // namespace fuyou::testing
