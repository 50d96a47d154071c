// DirFd: an open directory, and the one way fuyoud creates, opens, renames and
// removes anything under a storage path.
//
// Every name is one path component, resolved relative to the directory's fd
// (openat, mkdirat, renameat, unlinkat) and never through a symbolic link:
// files are opened with O_NOFOLLOW, directories with O_DIRECTORY|O_NOFOLLOW. A
// symlink (or a file of the wrong type) where fuyoud expects its own file or
// directory fails the operation with FAILED_PRECONDITION naming the path, and
// nothing outside the directory is touched. Only the storage root itself, which
// the administrator configured, is opened through links (OpenRoot).
//
// Modes are set explicitly, not left to the umask: directories fuyoud creates get
// the mode asked for (0700 for users/<uid> and job directories), files 0600.
// Errors use the errno table of common/errno_code.h.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fuyou::storage {

// Owns one file descriptor (closed on destruction).
class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  int Release();
  void Reset();

 private:
  int fd_;
};

class DirFd {
 public:
  DirFd() = default;

  // Opens the directory `path` (a configured storage root; links are followed).
  static absl::StatusOr<DirFd> OpenRoot(const std::filesystem::path& path);

  // Opens the subdirectory `name`. NOT_FOUND when absent; FAILED_PRECONDITION
  // when it is a symlink or not a directory.
  absl::StatusOr<DirFd> OpenDir(const std::string& name) const;
  // Opens the subdirectory `name`, creating it with exactly `mode` when absent
  // (`*created`, if given, says whether it did).
  absl::StatusOr<DirFd> OpenOrCreateDir(const std::string& name, mode_t mode, bool* created = nullptr) const;

  // Opens the regular file `name` with `flags` | O_NOFOLLOW | O_CLOEXEC (mode
  // 0600 when O_CREAT creates it). FAILED_PRECONDITION when it is a symlink, not
  // a regular file, or has more than one hard link.
  absl::StatusOr<UniqueFd> OpenFile(const std::string& name, int flags) const;
  // Writes `bytes` to a new file `name` (an old one is unlinked first, never
  // followed or truncated), fsyncs it; the file is 0600.
  absl::Status WriteNewFile(const std::string& name, const std::string& bytes) const;
  // Reads the regular file `name` whole, at most `max_bytes`.
  absl::StatusOr<std::string> ReadFile(const std::string& name, size_t max_bytes) const;

  // renameat within this directory, or into `to_dir`.
  absl::Status Rename(const std::string& from, const std::string& to) const;
  absl::Status RenameTo(const std::string& from, const DirFd& to_dir, const std::string& to) const;
  // unlinkat of a file (never follows a link: a link is removed, not its target).
  absl::Status Unlink(const std::string& name) const;
  // unlinkat(AT_REMOVEDIR) of an empty subdirectory.
  absl::Status RemoveDir(const std::string& name) const;
  // Names in the directory, without "." and "..".
  absl::StatusOr<std::vector<std::string>> List() const;
  absl::Status Sync() const;

  bool valid() const { return fd_.get() >= 0; }
  int get() const { return fd_.get(); }
  // For messages: the path this directory was reached by.
  const std::filesystem::path& path() const { return path_; }

 private:
  DirFd(UniqueFd fd, std::filesystem::path path) : fd_(std::move(fd)), path_(std::move(path)) {}

  UniqueFd fd_;
  std::filesystem::path path_;
};

}  // namespace fuyou::storage
