// DaemonServer: fuyoud as a value. Start builds every part from a DaemonConfig
// and serves gRPC on the Unix socket; Shutdown drains and stops it.
//
//   auto server = DaemonServer::Start(config);   // socket bound, ready
//   ...                                          // until SIGTERM
//   server->Shutdown();                          // drain, flush, remove socket
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "config/daemon_config.h"

namespace fuyou {

class DaemonServer {
 public:
  static absl::StatusOr<std::unique_ptr<DaemonServer>> Start(const DaemonConfig& config);
  ~DaemonServer();

  // Refuses new sessions, gives live sessions up to config.drain_seconds to
  // close, closes the rest (their uncommitted steps roll back; committed states
  // are already durable), stops gRPC and removes the socket. Idempotent.
  void Shutdown();

  class Impl;

 private:
  explicit DaemonServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fuyou
