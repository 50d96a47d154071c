// MemoryIoEngine: an IoEngine whose state files live in DRAM, for tests (as
// LevelDB's memenv). Tests of the layers above storage (jobs/, state/) run on it
// without io_uring and without O_DIRECT on /tmp; the manifests and directories
// stay on the real filesystem (DirFd), only the state files are in memory.
//
// A file is named by its path (Open) or its directory's path and its name
// (OpenAt); opening the same name again, also after the first file was
// destroyed, gives the same bytes, for as long as the engine lives (a test's
// "restart" reopens the job on the same engine). The checks and status codes
// are the engine's (io_engine.h): misaligned transfers are INVALID_ARGUMENT, a
// read past the end OUT_OF_RANGE, and the FaultInjector is consulted on every
// transfer, Reserve and Sync (-errno results map through the same table).
//
// Transfers complete before ReadAsync/WriteAsync return: the Future is ready,
// so a continuation (Then) runs on the caller's thread. Thread-safe.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "storage/io_engine.h"

namespace fuyou::storage {

class MemoryIoEngine final : public IoEngine {
 public:
  // `fault_injector`: optional, not owned, must outlive the engine.
  explicit MemoryIoEngine(FaultInjector* fault_injector = nullptr) : fault_injector_(fault_injector) {}

  // `owner` is not used: transfers complete at once, nothing waits for a turn.
  absl::StatusOr<std::unique_ptr<StateFile>> Open(const std::filesystem::path& path, bool create,
                                                  IoCounters* counters, IoOwner owner) override;
  absl::StatusOr<std::unique_ptr<StateFile>> OpenAt(const DirFd& dir, const std::string& name, bool create,
                                                    IoCounters* counters, IoOwner owner) override;

  // The bytes file `path` holds now (a copy; empty when there is none).
  std::string Contents(const std::filesystem::path& path) const;

  struct Bytes;  // one file's bytes, shared by its open handles

 private:
  FaultInjector* const fault_injector_;
  mutable std::mutex mutex_;
  std::map<std::filesystem::path, std::shared_ptr<Bytes>> files_;  // guarded by mutex_
};

}  // namespace fuyou::storage
