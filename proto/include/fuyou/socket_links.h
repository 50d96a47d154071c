// The symbolic links on the way to a socket directory, and whose they are.
// Shared by the daemon (which refuses to serve in a directory reached through
// another user's link) and clientlib (which refuses to connect through one):
// issue 32, where another user made /tmp/fuyou-<uid> a link into a root-owned
// sticky directory and could repoint it, or the socket in it, at any time.
//
// A link can only be replaced by its owner (in a sticky directory such as /tmp)
// or by whoever may write its directory, so a link owned by an untrusted user
// is a path that user controls. This walk is a check made before the path is
// used, not a lock: the client's guarantee is the SO_PEERCRED check on the
// connection it actually uses (clientlib/src/trusted_socket.h).
#pragma once

#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

namespace fuyou {

// A symbolic link found on the way to a path, and its owner.
struct PathLink {
  std::filesystem::path link;
  uid_t owner = 0;
};

// The first symbolic link on the way to `path` whose owner `trusted(uid)`
// refuses: every component of `path` (made absolute against the working
// directory) is looked at with lstat, and each link is followed into its
// target, whose components are looked at the same way. nullopt when every link
// is trusted, or when a component does not exist (nothing beyond it can be
// reached; the caller reports the missing path). At most 40 links are followed
// (as the kernel's ELOOP), the rest left to the caller's own open.
template <typename Trusted>
std::optional<PathLink> FindUntrustedLink(const std::filesystem::path& path, Trusted trusted) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path absolute = path.is_absolute() ? path : fs::absolute(path, ec);
  if (ec) return std::nullopt;
  // Components still to walk, the next one last.
  std::vector<fs::path> todo;
  auto push_components = [&todo](const fs::path& p) {
    std::vector<fs::path> parts(p.begin(), p.end());
    for (auto it = parts.rbegin(); it != parts.rend(); ++it) todo.push_back(*it);
  };
  push_components(absolute.relative_path());
  fs::path resolved = "/";
  for (int links = 0; !todo.empty();) {
    const fs::path name = todo.back();
    todo.pop_back();
    if (name.empty() || name == ".") continue;
    if (name == "..") {
      resolved = resolved.parent_path();
      continue;
    }
    const fs::path next = resolved / name;
    struct stat info {};
    if (::lstat(next.c_str(), &info) != 0) return std::nullopt;
    if (!S_ISLNK(info.st_mode)) {
      resolved = next;
      continue;
    }
    if (!trusted(info.st_uid)) return PathLink{next, info.st_uid};
    if (++links > 40) return std::nullopt;
    std::string target(static_cast<size_t>(info.st_size > 0 ? info.st_size : 255) + 1, '\0');
    const ssize_t length = ::readlink(next.c_str(), target.data(), target.size());
    if (length < 0 || static_cast<size_t>(length) >= target.size()) return std::nullopt;
    target.resize(static_cast<size_t>(length));
    const fs::path to(target);
    if (to.is_absolute()) resolved = "/";
    push_components(to.relative_path());
  }
  return std::nullopt;
}

}  // namespace fuyou
