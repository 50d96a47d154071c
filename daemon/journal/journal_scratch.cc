#include "journal/journal_scratch.h"

#include "common/log.h"
#include "common/status_util.h"
#include "fmt/format.h"

namespace fuyou {
namespace {

// A session id as a file name: the id itself when it is plain, else its hash.
std::string FileNameFor(const std::string& session_id) {
  bool plain = !session_id.empty() && session_id.size() <= 64;
  for (char c : session_id) {
    plain = plain && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-' ||
                      c == '_');
  }
  if (plain) return session_id + ".spill";
  return fmt::format("{:016x}.spill", std::hash<std::string>{}(session_id));
}

}  // namespace

absl::StatusOr<std::unique_ptr<JournalScratch>> JournalScratch::Create(const std::vector<std::filesystem::path>& roots,
                                                                       storage::IoEngine& io,
                                                                       std::vector<storage::IoCounters*> counters,
                                                                       std::string_view dir_name) {
  std::vector<storage::DirFd> dirs;
  for (const std::filesystem::path& root : roots) {
    FUYOU_ASSIGN_OR_RETURN(storage::DirFd root_dir, storage::DirFd::OpenRoot(root));
    FUYOU_ASSIGN_OR_RETURN(storage::DirFd dir, root_dir.OpenOrCreateDir(std::string(dir_name), 0700));
    // What an earlier daemon left: journals of sessions that no longer exist.
    FUYOU_ASSIGN_OR_RETURN(std::vector<std::string> names, dir.List());
    for (const std::string& name : names) {
      if (absl::Status removed = dir.Unlink(name); !removed.ok()) {
        log::Warn("cannot remove the leftover scratch file {}: {}", (dir.path() / name).string(),
                  removed.message());
      } else {
        log::Info("removed the leftover scratch file {}", (dir.path() / name).string());
      }
    }
    dirs.push_back(std::move(dir));
  }
  counters.resize(dirs.size(), nullptr);
  return std::unique_ptr<JournalScratch>(new JournalScratch(io, std::move(dirs), std::move(counters)));
}

std::unique_ptr<JournalSpillFiles> JournalScratch::ForSession(const std::string& session_id, ScratchCharge charge,
                                                              storage::IoOwner io_owner) {
  return std::unique_ptr<JournalSpillFiles>(
      new JournalSpillFiles(*this, FileNameFor(session_id), std::move(charge), io_owner));
}

JournalSpillFiles::JournalSpillFiles(JournalScratch& scratch, std::string name, ScratchCharge charge,
                                     storage::IoOwner io_owner)
    : scratch_(scratch),
      name_(std::move(name)),
      charge_(std::move(charge)),
      io_owner_(io_owner),
      files_(scratch.dirs_.size()) {}

JournalSpillFiles::~JournalSpillFiles() {
  for (size_t i = 0; i < files_.size(); ++i) {
    if (!files_[i].file) continue;
    files_[i].file.reset();  // waits for its transfers, closes
    scratch_.dirs_[i].Unlink(name_).IgnoreError();
  }
  if (charge_.budget != nullptr && held_ != 0) charge_.budget->GiveScratch(charge_.uid, held_);
}

absl::StatusOr<JournalSpillFiles::Location> JournalSpillFiles::Allocate(uint64_t bytes) {
  if (files_.empty()) {
    return absl::ResourceExhaustedError("the daemon has no storage path for gradient journal scratch files");
  }
  if (bytes == 0 || bytes % storage::kBlockSize != 0) {
    return absl::InvalidArgumentError(fmt::format("a journal spill of {} bytes is not whole blocks", bytes));
  }
  // Admitted first (nothing is created for a refusal), as if striped over the
  // paths, as a session's spills together are; the grant covers the bytes
  // until the fallocate makes the free space show them.
  StorageBudget::Grant grant;
  if (charge_.budget != nullptr) {
    FUYOU_ASSIGN_OR_RETURN(grant, charge_.budget->Admit(charge_.uid, bytes, charge_.what));
  }
  const uint32_t index = next_;
  next_ = (next_ + 1) % static_cast<uint32_t>(files_.size());
  File& file = files_[index];
  if (!file.file) {
    FUYOU_ASSIGN_OR_RETURN(file.file, scratch_.io_.OpenAt(scratch_.dirs_[index], name_, /*create=*/true,
                                                           scratch_.counters_[index], io_owner_));
  }
  if (file.end > UINT64_MAX - bytes) return absl::ResourceExhaustedError("journal scratch file offset overflow");
  if (absl::Status reserved = file.file->Reserve(file.end + bytes); !reserved.ok()) {
    return absl::Status(reserved.code(), fmt::format("cannot allocate {} bytes of {} in {}: {}", bytes, charge_.what,
                                                     file.file->path().string(), reserved.message()));
  }
  if (charge_.budget != nullptr) charge_.budget->HoldScratch(charge_.uid, bytes);
  held_ += bytes;
  Location location{index, file.end, bytes};
  file.end += bytes;
  return location;
}

absl::Status JournalSpillFiles::Write(const Location& location, std::span<const std::byte> buffer) {
  File& file = files_.at(location.file);
  if (!file.file || buffer.size() != location.bytes) return absl::InternalError("journal spill write: bad location");
  return file.file->Write(location.offset, buffer);
}

absl::Status JournalSpillFiles::Read(const Location& location, std::span<std::byte> buffer) {
  File& file = files_.at(location.file);
  if (!file.file || buffer.size() != location.bytes) return absl::InternalError("journal spill read: bad location");
  return file.file->Read(location.offset, buffer);
}

storage::IoFuture JournalSpillFiles::WriteAsync(const Location& location, std::span<const std::byte> buffer) {
  if (location.file >= files_.size() || !files_[location.file].file || buffer.size() != location.bytes) {
    return MakeReadyFuture<void>(absl::InternalError("scratch write: bad location"));
  }
  return files_[location.file].file->WriteAsync(location.offset, buffer);
}

storage::IoFuture JournalSpillFiles::ReadAsync(const Location& location, std::span<std::byte> buffer) {
  if (location.file >= files_.size() || !files_[location.file].file || buffer.size() != location.bytes) {
    return MakeReadyFuture<void>(absl::InternalError("scratch read: bad location"));
  }
  return files_[location.file].file->ReadAsync(location.offset, buffer);
}

void JournalSpillFiles::Clear() {
  for (File& file : files_) {
    if (file.file && file.end != 0) {
      if (absl::Status truncated = file.file->Truncate(0); !truncated.ok()) {
        log::Warn("cannot free gradient journal scratch {}: {}", file.file->path().string(), truncated.message());
      }
    }
    file.end = 0;
  }
  next_ = 0;
  if (charge_.budget != nullptr && held_ != 0) charge_.budget->GiveScratch(charge_.uid, held_);
  held_ = 0;
}

uint64_t JournalSpillFiles::allocated_bytes() const {
  uint64_t total = 0;
  for (const File& file : files_) total += file.end;
  return total;
}

std::filesystem::path JournalSpillFiles::path(uint32_t file) const { return scratch_.dirs_.at(file).path() / name_; }

}  // namespace fuyou
