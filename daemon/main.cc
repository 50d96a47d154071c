// fuyoud: the fuyou offload daemon. See README.md and deploy/fuyoud.toml.
#include <signal.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <utility>

#include "common/crash_point.h"
#include "common/log.h"
#include "common/status_util.h"
#include "config/command_line.h"
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
  fuyou::DaemonCommandLine command_line(app);
  CLI11_PARSE(app, argc, argv);
  auto resolved = command_line.Resolve();
  if (!resolved.ok()) return Fail(resolved.status());
  fuyou::DaemonConfig config = *std::move(resolved);
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
