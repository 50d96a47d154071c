#include "server/connection_table.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include "fmt/format.h"

namespace fuyou {

bool ConnectionTable::StillOpen(int fd, const Entry& entry) {
  struct stat info {};
  return ::fstat(fd, &info) == 0 && S_ISSOCK(info.st_mode) && info.st_dev == entry.dev && info.st_ino == entry.ino;
}

void ConnectionTable::EraseLocked(std::map<int, Entry>::iterator it) {
  auto of_uid = per_uid_.find(it->second.peer.uid);
  if (of_uid != per_uid_.end() && --of_uid->second == 0) per_uid_.erase(of_uid);
  connections_.erase(it);
}

absl::Status ConnectionTable::Admit(int fd, const PeerCredentials& peer) {
  struct stat info {};
  if (::fstat(fd, &info) != 0) return absl::InternalError(fmt::format("fstat of connection fd {} failed", fd));
  std::lock_guard lock(mutex_);
  // The kernel gave us `fd`: whatever connection had that number is gone.
  if (auto it = connections_.find(fd); it != connections_.end()) EraseLocked(it);
  SweepLocked();
  if (limits_.max_connection_fd > 0 && fd >= limits_.max_connection_fd) {
    return absl::ResourceExhaustedError(fmt::format(
        "connection of uid {} refused: the daemon has {} descriptors open and keeps the rest of its open-file limit "
        "for the commits and segment handovers of open sessions ({} gRPC connections open); raise LimitNOFILE= in "
        "the unit (or ulimit -n), or lower [limits] max_connections",
        peer.uid, fd, connections_.size()));
  }
  const size_t of_uid = per_uid_.count(peer.uid) ? per_uid_[peer.uid] : 0;
  if (of_uid >= limits_.max_connections_per_user) {
    return absl::ResourceExhaustedError(fmt::format(
        "connection of uid {} refused: uid {} has {} connections open, the limit of max_connections_per_user ({}); "
        "close idle channels, or raise [limits] max_connections_per_user / --max-connections-per-user",
        peer.uid, peer.uid, of_uid, limits_.max_connections_per_user));
  }
  if (connections_.size() >= limits_.max_connections) {
    return absl::ResourceExhaustedError(fmt::format(
        "connection of uid {} refused: {} connections are open, the limit of max_connections ({}); raise [limits] "
        "max_connections / --max-connections",
        peer.uid, connections_.size(), limits_.max_connections));
  }
  connections_[fd] = Entry{peer, info.st_dev, info.st_ino, 0, std::chrono::steady_clock::now()};
  last_peer_[fd] = peer;
  ++per_uid_[peer.uid];
  return absl::OkStatus();
}

std::optional<PeerCredentials> ConnectionTable::PeerOf(int fd) const {
  std::lock_guard lock(mutex_);
  auto it = last_peer_.find(fd);
  if (it == last_peer_.end()) return std::nullopt;
  return it->second;
}

void ConnectionTable::SweepLocked() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (StillOpen(it->first, it->second)) {
      ++it;
    } else {
      auto gone = it++;
      EraseLocked(gone);
    }
  }
}

size_t ConnectionTable::Sweep() {
  std::lock_guard lock(mutex_);
  SweepLocked();
  return connections_.size();
}

void ConnectionTable::CallStarted(int fd) {
  std::lock_guard lock(mutex_);
  if (auto it = connections_.find(fd); it != connections_.end()) ++it->second.calls;
}

void ConnectionTable::CallEnded(int fd) {
  std::lock_guard lock(mutex_);
  auto it = connections_.find(fd);
  if (it == connections_.end() || it->second.calls == 0) return;
  if (--it->second.calls == 0) it->second.idle_since = std::chrono::steady_clock::now();
}

size_t ConnectionTable::CloseIdle(std::chrono::steady_clock::duration timeout, std::chrono::steady_clock::time_point now) {
  std::lock_guard lock(mutex_);
  size_t closed = 0;
  for (auto it = connections_.begin(); it != connections_.end();) {
    const bool open = StillOpen(it->first, it->second);
    if (open && (it->second.calls != 0 || now - it->second.idle_since < timeout)) {
      ++it;
      continue;
    }
    if (open) {
      ::shutdown(it->first, SHUT_RDWR);
      ++closed;
    }
    auto gone = it++;
    EraseLocked(gone);
  }
  return closed;
}

size_t ConnectionTable::CountOf(uid_t uid) const {
  std::lock_guard lock(mutex_);
  auto it = per_uid_.find(uid);
  return it == per_uid_.end() ? 0 : it->second;
}

size_t ConnectionTable::total() const {
  std::lock_guard lock(mutex_);
  return connections_.size();
}

}  // namespace fuyou
