// SpecFaultInjector: a FaultInjector described by a line of text, so that tests
// of a real fuyoud can fill its disk or break its reads without a special disk.
// TEST-ONLY: fuyoud reads it from FUYOU_TEST_FAULTS at start-up and logs a
// warning; never set it on a production daemon.
//
// The text is one or more rules separated by ';':
//   <op>:<ERRNO>[:after=<N>][:job=<NAME>][:dir=<NAME>]
//   <op>:HOLD:until=<FILE>[:after=<N>][:job=<NAME>][:dir=<NAME>]
//     op     read | write | reserve | sync
//     ERRNO  ENOSPC | EDQUOT | EIO | EROFS
//     HOLD   the operation completes, unchanged, only once FILE exists (an
//            absolute path without ':' or ';'), at most kHoldLimit later: the
//            completion thread waits, so the ring's other completions wait
//            too. For tests of what must not wait for an operation (a spill's
//            write, issue 23), without a timed assertion.
//     after  the first N matching operations pass; the (N+1)-th and every later
//            one fails with ERRNO, or is held (default 0: all)
//     job    only files of the job NAME match (a path with a "jobs/NAME"
//            component); default: every file
//     dir    only files in a directory NAME match (a path with a NAME
//            component before the file's name, e.g. "activations")
// Examples: "reserve:ENOSPC", "write:ENOSPC:after=3:job=a",
// "read:EIO:after=2:job=b;sync:EIO:job=c".
//
// Reads and writes are counted per request the engine makes (a transfer larger
// than IoEngineOptions::max_request_bytes is several requests, and a short
// transfer that is continued is counted again); reserve and sync per call. An
// operation the kernel already failed keeps its own error. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/io_engine.h"

namespace fuyou::storage {

struct FaultRule {
  FaultInjector::Op op = FaultInjector::Op::kWrite;
  int error = 0;          // errno, > 0; 0 for a HOLD
  std::string hold_until;  // a HOLD's file; empty for an errno
  uint64_t after = 0;     // operations that pass before the first failure
  std::string job;        // empty: every file
  std::string dir;        // empty: every directory
};

// The longest a HOLD keeps one operation waiting.
inline constexpr int kHoldLimitSeconds = 60;

// Parses the text above; INVALID_ARGUMENT naming the bad rule otherwise.
absl::StatusOr<std::vector<FaultRule>> ParseFaultSpec(std::string_view text);

class SpecFaultInjector final : public FaultInjector {
 public:
  explicit SpecFaultInjector(std::vector<FaultRule> rules);
  // ParseFaultSpec, then the injector.
  static absl::StatusOr<std::unique_ptr<SpecFaultInjector>> FromSpec(std::string_view text);

  int64_t Adjust(Op op, const std::filesystem::path& file, uint64_t offset, uint64_t length,
                 int64_t result) override;

  // Operations failed on purpose so far.
  uint64_t injected() const { return injected_.load(std::memory_order_relaxed); }

 private:
  struct Rule {
    FaultRule rule;
    std::atomic<uint64_t> seen{0};
  };
  std::vector<std::unique_ptr<Rule>> rules_;
  std::atomic<uint64_t> injected_{0};
};

}  // namespace fuyou::storage
