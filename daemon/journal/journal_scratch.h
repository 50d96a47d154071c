// JournalScratch: where gradient journals go when the DRAM budget cannot hold
// them: one scratch file per session and storage path, in <root>/journal/.
//
// Scratch files are never part of a job: they are not in any manifest, never
// committed, and hold only the current step's journals of one live session.
// Create removes everything an earlier daemon left in <root>/journal/ (a daemon
// that died mid-step), so a restart starts with no scratch. A session's files
// are created on first spill, truncated at step end, and unlinked when the
// session ends (JournalSpillFiles' destructor).
//
// I/O goes through the daemon's IoEngine (O_DIRECT, io_uring), striped by
// journal: each new spill goes to the next storage path in turn.
//
// Storage: a session's scratch is admitted by the daemon's StorageBudget
// (ScratchCharge) as a registration is: every Allocate is checked against the
// user's max_storage_bytes_per_user (with the user's jobs and other scratch)
// and the free space kept on the paths (commits, reserved_free) before a byte
// is allocated, and held from then until Clear or the files' end.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "jobs/storage_budget.h"
#include "storage/dir_fd.h"
#include "storage/io_engine.h"

namespace fuyou {

class JournalSpillFiles;

// Where a session's scratch is admitted: `budget` (null: not checked) for
// `uid`, `what` naming it in refusals ("the gradient journal scratch").
struct ScratchCharge {
  StorageBudget* budget = nullptr;
  uid_t uid = 0;
  std::string what = "the scratch";
};

class JournalScratch {
 public:
  // Makes <root>/journal (0700) under every root and empties it. `counters`
  // (one per root, may be empty; not owned) receive the scratch traffic.
  // FAILED_PRECONDITION when a root is not a writable directory.
  // `dir_name` is the folder under each root: "journal" for gradient journals,
  // "activations" for the activation scratch (activation_spill.h), which uses
  // the same files the same way.
  static absl::StatusOr<std::unique_ptr<JournalScratch>> Create(const std::vector<std::filesystem::path>& roots,
                                                                storage::IoEngine& io,
                                                                std::vector<storage::IoCounters*> counters = {},
                                                                std::string_view dir_name = kJournalDirName);
  static constexpr std::string_view kJournalDirName = "journal";
  static constexpr std::string_view kActivationDirName = "activations";

  // The scratch files of session `session_id`, none created yet, admitted by
  // `charge`, their transfers `io_owner`'s (the session's, storage/io_engine.h
  // "Owners"). Must not outlive this JournalScratch (nor the charge's budget).
  std::unique_ptr<JournalSpillFiles> ForSession(const std::string& session_id, ScratchCharge charge = {},
                                                storage::IoOwner io_owner = storage::IoOwner());

  size_t roots() const { return dirs_.size(); }

 private:
  friend class JournalSpillFiles;
  JournalScratch(storage::IoEngine& io, std::vector<storage::DirFd> dirs, std::vector<storage::IoCounters*> counters)
      : io_(io), dirs_(std::move(dirs)), counters_(std::move(counters)) {}

  storage::IoEngine& io_;
  std::vector<storage::DirFd> dirs_;  // <root>/journal
  std::vector<storage::IoCounters*> counters_;
};

// One session's scratch files. Not thread-safe (the session serialises its use).
class JournalSpillFiles {
 public:
  // Where one journal lies: file (storage path index), offset and length, all
  // multiples of storage::kBlockSize.
  struct Location {
    uint32_t file = 0;
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };

  ~JournalSpillFiles();  // closes and unlinks the files, gives the charge back
  JournalSpillFiles(const JournalSpillFiles&) = delete;
  JournalSpillFiles& operator=(const JournalSpillFiles&) = delete;

  // Space for `bytes` (a multiple of kBlockSize) on the next storage path in
  // turn, admitted by the charge's StorageBudget and then allocated on the
  // device (fallocate). RESOURCE_EXHAUSTED, with nothing allocated or held:
  // the budget refuses it (its message names the limit and the setting), or
  // the device is full (the path named).
  absl::StatusOr<Location> Allocate(uint64_t bytes);
  // Blocking, O_DIRECT transfers of a whole location; `buffer` is aligned and
  // exactly location.bytes long.
  absl::Status Write(const Location& location, std::span<const std::byte> buffer);
  absl::Status Read(const Location& location, std::span<std::byte> buffer);
  // The same, asynchronous (storage/io_engine.h: the Future is set on a
  // completion thread); `buffer` must stay alive until it is ready. A bad
  // location gives a ready Future with INTERNAL. Called on the session's thread.
  [[nodiscard]] storage::IoFuture WriteAsync(const Location& location, std::span<const std::byte> buffer);
  [[nodiscard]] storage::IoFuture ReadAsync(const Location& location, std::span<std::byte> buffer);
  // Frees every location (the files are truncated to 0; later Allocates start
  // over) and gives the charge back. No transfer may be in flight.
  void Clear();

  // Bytes allocated now, over all files.
  uint64_t allocated_bytes() const;
  // The path of storage path `file`'s scratch file (tests).
  std::filesystem::path path(uint32_t file) const;

 private:
  friend class JournalScratch;
  JournalSpillFiles(JournalScratch& scratch, std::string name, ScratchCharge charge, storage::IoOwner io_owner);

  struct File {
    std::unique_ptr<storage::StateFile> file;  // null until the first Allocate on this path
    uint64_t end = 0;                          // bytes allocated
  };
  JournalScratch& scratch_;
  const std::string name_;
  const ScratchCharge charge_;
  const storage::IoOwner io_owner_;
  uint64_t held_ = 0;  // bytes held in charge_.budget (allocated_bytes())
  std::vector<File> files_;
  uint32_t next_ = 0;  // the storage path of the next Allocate
};

}  // namespace fuyou
