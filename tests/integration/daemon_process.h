// DaemonProcess: a real fuyoud started for a test on a private socket and data
// directory, stopped (SIGTERM, then SIGKILL) when the object goes away.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "fuyou/client.h"
#include "fuyou/client_segment.h"
#include "fuyou/v1/offload.pb.h"
#include "test_support/temp_dir.h"

namespace fuyou::testing {

using fuyou::TempDir;  // a fresh directory under /tmp, removed on destruction

// Spawns `program` with `args` and this process's environment, with `env`
// ("NAME=VALUE" entries) added or replacing; returns the pid or -1.
pid_t Spawn(const std::string& program, const std::vector<std::string>& args,
            const std::vector<std::string>& env = {});
// Spawn as `uid` (uid, gid `uid`, no supplementary groups): fork, drop the
// groups and ids, exec. Needs root. Returns the pid or -1.
pid_t SpawnAs(uid_t uid, const std::string& program, const std::vector<std::string>& args,
              const std::vector<std::string>& env = {});
// Runs `program` with `args` as `uid` (as SpawnAs) and waits for it; returns its
// exit status (-1 when it did not exit normally), with its stdout and stderr,
// written to `output_file` on the way, in `*output`. Needs root.
int RunAs(uid_t uid, const std::string& program, const std::vector<std::string>& args,
          const std::filesystem::path& output_file, std::string* output);
// The "key=value" lines of a helper client's output (RunAs), as a map; other
// lines are ignored.
std::map<std::string, std::string> KeyValues(const std::string& text);

// For raw-protocol tests: creates the segment an OpenSession answer asks for and
// hands it to the daemon, as clientlib does; the segment (mapped, its fd still
// open) or the handover's error.
absl::StatusOr<std::unique_ptr<ClientSegment>> HandOverNewSegment(const v1::OpenSessionResponse& opened);

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
  // Runs the next Start as `uid` (group `uid`, no supplementary groups), as
  // root can; -1: as this process. The test makes the socket directory and the
  // data directory's parent writable for that uid.
  void set_run_as(uid_t uid) { run_as_ = uid; }

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
  uid_t run_as_ = static_cast<uid_t>(-1);
};

}  // namespace fuyou::testing
