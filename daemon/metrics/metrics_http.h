// MetricsHttpServer: serves GET /metrics over HTTP/1.1 for Prometheus (Boost.Beast).
//
//   auto server = MetricsHttpServer::Start("127.0.0.1:9464", [&] { return RenderMetrics(...); });
//   server->port();   // the bound port (useful with port 0)
//   server->Stop();   // also done by the destructor
//
// Only GET (and HEAD) of /metrics is answered, with 200 and the text that
// `render` returns; any other path is 404, any other method 405. A request may
// carry no body and at most kMaxHeaderBytes of headers (431 beyond). The server
// runs on a thread of its own, so a slow or stuck client never holds up the
// daemon's sessions: each connection has kHeadTimeout to send its request head
// and kIoTimeout to take the answer; at most kMaxConnections are open at once,
// and at most kMaxConnectionsPerSource from one source. A source is the peer's
// uid for a loopback peer (found in /proc/net/tcp, so that local users are told
// apart), else its IP address. A new connection of a source at its bound
// closes that source's oldest connection still sending its head (else it is
// closed); on a full server it closes that of the source with most connections.
// So a user holding half-sent requests (issue 20) fills only their own share,
// and a scrape gets through. One request per
// connection (the answer says "Connection: close").
//
// Anyone who can reach the address sees every figure (all users' activity):
// the default is off, and a non-loopback address is logged as a warning.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace fuyou::metrics {

class MetricsHttpServer {
 public:
  static constexpr size_t kMaxHeaderBytes = 8 * 1024;
  static constexpr size_t kMaxConnections = 32;
  static constexpr size_t kMaxConnectionsPerSource = 4;
  static constexpr std::chrono::seconds kHeadTimeout{2};
  static constexpr std::chrono::seconds kIoTimeout{10};

  // Binds `address` ("IPv4:port", "[IPv6]:port" or "localhost:port"; port 0
  // picks a free one) and starts serving. `render` is called on the server's
  // thread for each GET /metrics; it must be thread-safe with respect to the
  // rest of the daemon. INVALID_ARGUMENT for a malformed address, UNAVAILABLE
  // when it cannot be bound (in use, not local).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(std::string_view address,
                                                                    std::function<std::string()> render);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The port it listens on.
  uint16_t port() const;
  // Closes the listening socket and every connection and joins the thread. Idempotent.
  void Stop();

  class Impl;

 private:
  explicit MetricsHttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Splits "host:port" ("[v6]:port" for IPv6). INVALID_ARGUMENT, naming the
// setting's expected form, when the shape or the port (0..65535) is wrong.
struct HostPort {
  std::string host;
  uint16_t port = 0;
};
absl::StatusOr<HostPort> ParseHostPort(std::string_view address);

// The uid that owns the IPv4 TCP socket bound to `peer_ip:peer_port` and
// connected to `local_ip:local_port` (host byte order), from the text of
// /proc/net/tcp; nullopt when no line matches.
std::optional<uint32_t> SocketOwnerUid(std::string_view proc_net_tcp, uint32_t peer_ip, uint16_t peer_port,
                                       uint32_t local_ip, uint16_t local_port);

}  // namespace fuyou::metrics
