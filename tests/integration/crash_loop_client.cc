// The crash driver's job in a process of its own that kills itself with SIGKILL
// at a chosen client-side point, as a training process dies mid-step.
// Usage: crash_loop_client <socket> <job> <pushed|pulled|committed> <step> <k>
// Exit status: killed by SIGKILL at the point; 1 when a call failed first; 3 when
// the job ended without reaching the point.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "crash_driver.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: crash_loop_client <socket> <job> <pushed|pulled|committed> <step> <k>\n");
    return 2;
  }
  fuyou::ClientOptions options;
  options.address = std::string("unix:") + argv[1];
  const std::string point = argv[3];
  const int64_t step = std::atoll(argv[4]);
  const int k = std::atoi(argv[5]);
  fuyou::testing::DriverProgress progress;
  absl::Status status = fuyou::testing::DriveJob(
      options, argv[2], nullptr, progress, nullptr, [&](const std::string& what, int64_t at_step, int at_k) {
        if (what == point && at_step == step && at_k == k) ::raise(SIGKILL);
      });
  if (!status.ok()) {
    std::fprintf(stderr, "crash_loop_client: %s\n", progress.failed_call.c_str());
    return 1;
  }
  return 3;
}
