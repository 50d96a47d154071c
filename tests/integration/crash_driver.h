// CrashDriver: one fixed, deterministic training job that the crash tests run
// against a daemon that may die under it (crash_loop_test.cc) or inside a client
// that kills itself (crash_loop_client.cc).
//
// The job: kDriverChunks chunks of different sizes and dtypes, kDriverSteps
// steps, gradients a function of (step, chunk) only. In step 3 the driver first
// sends different gradients for two chunks and aborts them (AbortStep), then runs
// the real step 3, so that a rollback that leaked would change the result.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "fuyou/client.h"

namespace fuyou::testing {

inline constexpr int64_t kDriverSteps = 8;
inline constexpr int64_t kDriverAbortedStep = 3;

// The chunks, in registration order.
const std::vector<ChunkSpec>& DriverChunks();
// Slot bytes a session needs for the largest chunk.
uint64_t DriverSlotBytes();

// Weights of every chunk (in its param dtype) after each step of an uninterrupted
// run: history[step][chunk], history[0] = the initial weights.
using WeightHistory = std::vector<std::vector<std::vector<std::byte>>>;

// What the client has seen; updated as each call returns.
struct DriverProgress {
  int64_t opened_at = -1;           // committed step the last session opened at; -1: no session opened
  int chunks_registered = 0;        // registrations answered in the last session (in order)
  int chunks_resumed = 0;           // of those, how many came back resumed
  bool registration_in_flight = false;
  int64_t acked_step = 0;           // last step whose EndStep was answered
  int64_t durable_step = 0;         // its StepCommitted.durable_step (the session's opening step before)
  bool commit_in_flight = false;    // EndStep(acked_step + 1) sent, no answer yet
  std::vector<std::vector<std::byte>> weights;  // latest weights of each chunk
  std::vector<std::string> mismatches;          // failed checks against the expected history
  std::string failed_call;                      // the call that failed, when one did
};

// Called at client-side points: ("pushed", step, k) after the k-th gradient of a
// step was handed over (k from 1), ("pulled", step, k), ("committed", step, 0).
using DriverHook = std::function<void(const std::string& what, int64_t step, int k)>;

// Opens a session on `job`, registers every chunk (resumed ones come back), runs
// the steps from the committed one to kDriverSteps and closes. Returns the first
// call that failed (OK when it ran to the end); `progress` says how far it got.
// With `expected`, every resumed and returned weight is compared bit for bit with
// it (differences go to progress.mismatches); with `record`, the weights after
// each step are stored there (sized kDriverSteps + 1).
absl::Status DriveJob(const ClientOptions& options, const std::string& job, const WeightHistory* expected,
                      DriverProgress& progress, WeightHistory* record = nullptr, const DriverHook& hook = {});

}  // namespace fuyou::testing
