#include "storage/dir_fd.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "common/errno_code.h"
#include "fmt/format.h"

namespace fuyou::storage {
namespace fs = std::filesystem;
namespace {

// The status of a failed syscall on `path`; a refused link reads as one.
absl::Status PathError(int err, std::string_view verb, const fs::path& path) {
  if (err == ELOOP) {
    return absl::FailedPreconditionError(
        fmt::format("cannot {} {}: it is a symbolic link, and fuyoud never follows links under a storage path; "
                    "remove it",
                    verb, path.string()));
  }
  return absl::Status(ErrnoCode(err), fmt::format("cannot {} {}: {}", verb, path.string(), std::strerror(err)));
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = other.Release();
  }
  return *this;
}

int UniqueFd::Release() { return std::exchange(fd_, -1); }

void UniqueFd::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

absl::StatusOr<DirFd> DirFd::OpenRoot(const fs::path& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return PathError(errno, "open directory", path);
  return DirFd(std::move(fd), path);
}

absl::StatusOr<DirFd> DirFd::OpenDir(const std::string& name) const {
  const fs::path path = path_ / name;
  UniqueFd fd(::openat(fd_.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOTDIR) {
      // A symlink to a directory reads as ELOOP; a symlink to a file or a plain
      // file as ENOTDIR: say which.
      struct stat st {};
      if (::fstatat(fd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
        return PathError(ELOOP, "open directory", path);
      }
    }
    return PathError(err, "open directory", path);
  }
  return DirFd(std::move(fd), path);
}

absl::StatusOr<DirFd> DirFd::OpenOrCreateDir(const std::string& name, mode_t mode, bool* created) const {
  if (created != nullptr) *created = false;
  if (::mkdirat(fd_.get(), name.c_str(), mode) == 0) {
    if (created != nullptr) *created = true;
    absl::StatusOr<DirFd> dir = OpenDir(name);
    if (!dir.ok()) return dir.status();
    // The umask may have cleared bits; the mode is what we asked for.
    if (::fchmod(dir->get(), mode) != 0) return PathError(errno, "set the mode of", dir->path());
    return dir;
  }
  if (errno != EEXIST) return PathError(errno, "create directory", path_ / name);
  return OpenDir(name);
}

absl::StatusOr<UniqueFd> DirFd::OpenFile(const std::string& name, int flags) const {
  const fs::path path = path_ / name;
  UniqueFd fd(::openat(fd_.get(), name.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (fd.get() < 0) return PathError(errno, "open", path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return PathError(errno, "stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(
        fmt::format("cannot open {}: it is not a regular file; remove it", path.string()));
  }
  if (st.st_nlink > 1) {
    return absl::FailedPreconditionError(fmt::format(
        "cannot open {}: it has {} hard links, and fuyoud only writes files it created; remove it", path.string(),
        st.st_nlink));
  }
  return fd;
}

absl::Status DirFd::WriteNewFile(const std::string& name, const std::string& bytes) const {
  const fs::path path = path_ / name;
  if (::unlinkat(fd_.get(), name.c_str(), 0) != 0 && errno != ENOENT) return PathError(errno, "remove", path);
  absl::StatusOr<UniqueFd> fd = OpenFile(name, O_WRONLY | O_CREAT | O_EXCL);
  if (!fd.ok()) return fd.status();
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd->get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return PathError(n < 0 ? errno : EIO, "write", path);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd->get()) != 0) return PathError(errno, "fsync", path);
  return absl::OkStatus();
}

absl::StatusOr<std::string> DirFd::ReadFile(const std::string& name, size_t max_bytes) const {
  const fs::path path = path_ / name;
  absl::StatusOr<UniqueFd> fd = OpenFile(name, O_RDONLY);
  if (!fd.ok()) return fd.status();
  std::string bytes;
  char buffer[65536];
  while (true) {
    const ssize_t n = ::read(fd->get(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PathError(errno, "read", path);
    if (n == 0) break;
    if (bytes.size() + static_cast<size_t>(n) > max_bytes) {
      return absl::FailedPreconditionError(
          fmt::format("cannot read {}: it is larger than {} bytes", path.string(), max_bytes));
    }
    bytes.append(buffer, static_cast<size_t>(n));
  }
  return bytes;
}

absl::Status DirFd::Rename(const std::string& from, const std::string& to) const { return RenameTo(from, *this, to); }

absl::Status DirFd::RenameTo(const std::string& from, const DirFd& to_dir, const std::string& to) const {
  if (::renameat(fd_.get(), from.c_str(), to_dir.get(), to.c_str()) != 0) {
    const int err = errno;
    return absl::Status(ErrnoCode(err), fmt::format("cannot rename {} to {}: {}", (path_ / from).string(),
                                                    (to_dir.path() / to).string(), std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::Status DirFd::Unlink(const std::string& name) const {
  if (::unlinkat(fd_.get(), name.c_str(), 0) != 0) return PathError(errno, "remove", path_ / name);
  return absl::OkStatus();
}

absl::Status DirFd::RemoveDir(const std::string& name) const {
  if (::unlinkat(fd_.get(), name.c_str(), AT_REMOVEDIR) != 0) {
    return PathError(errno, "remove directory", path_ / name);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> DirFd::List() const {
  // fdopendir takes the fd it is given: list through a duplicate.
  const int dup = ::openat(fd_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dup < 0) return PathError(errno, "list", path_);
  DIR* dir = ::fdopendir(dup);
  if (dir == nullptr) {
    const int err = errno;
    ::close(dup);
    return PathError(err, "list", path_);
  }
  std::vector<std::string> names;
  errno = 0;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  const int err = errno;
  ::closedir(dir);
  if (err != 0) return PathError(err, "list", path_);
  return names;
}

absl::Status DirFd::Sync() const {
  if (::fsync(fd_.get()) != 0) return PathError(errno, "fsync directory", path_);
  return absl::OkStatus();
}

}  // namespace fuyou::storage
