// Where fuyoud listens and keeps its data when nothing is configured. Shared by
// the daemon, clientlib and fuyouctl so that both sides agree with no setup.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace fuyou {

// The system-wide socket of a daemon started by systemd (deploy/fuyoud.service).
inline constexpr const char* kSystemSocketPath = "/run/fuyou/fuyoud.sock";
inline constexpr const char* kSystemDataDir = "/var/lib/fuyou";

// A private per-user directory for the socket of a daemon started by hand:
// $XDG_RUNTIME_DIR/fuyou, else /tmp/fuyou-<uid>.
inline std::filesystem::path UserRuntimeDir() {
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    return std::filesystem::path(xdg) / "fuyou";
  }
  return std::filesystem::path("/tmp") / ("fuyou-" + std::to_string(::getuid()));
}

// The socket a client connects to, in order: $FUYOU_SOCKET; the system socket when
// it exists (or when running as root); the per-user socket.
inline std::filesystem::path DefaultSocketPath() {
  if (const char* env = std::getenv("FUYOU_SOCKET"); env != nullptr && *env != '\0') {
    return env;
  }
  std::error_code ec;
  if (::getuid() == 0 || std::filesystem::exists(kSystemSocketPath, ec)) return kSystemSocketPath;
  return UserRuntimeDir() / "fuyoud.sock";
}

// The socket a daemon started with no configuration listens on: $FUYOU_SOCKET, the
// system socket for root, else the per-user socket.
inline std::filesystem::path DefaultDaemonSocketPath() {
  if (const char* env = std::getenv("FUYOU_SOCKET"); env != nullptr && *env != '\0') {
    return env;
  }
  if (::getuid() == 0) return kSystemSocketPath;
  return UserRuntimeDir() / "fuyoud.sock";
}

// The data directory of a daemon started with no configuration: $FUYOU_DATA_DIR,
// /var/lib/fuyou for root, else $XDG_DATA_HOME/fuyou or ~/.local/share/fuyou.
inline std::filesystem::path DefaultDataDir() {
  if (const char* env = std::getenv("FUYOU_DATA_DIR"); env != nullptr && *env != '\0') return env;
  if (::getuid() == 0) return kSystemDataDir;
  if (const char* xdg = std::getenv("XDG_DATA_HOME"); xdg != nullptr && *xdg != '\0') {
    return std::filesystem::path(xdg) / "fuyou";
  }
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home != nullptr ? home : "/tmp") / ".local/share/fuyou";
}

}  // namespace fuyou
