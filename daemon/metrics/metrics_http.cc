#include "metrics/metrics_http.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/asio/steady_timer.hpp>
#include <charconv>
#include <cstdio>
#include <list>
#include <map>
#include <utility>
#include <optional>
#include <thread>

#include "common/log.h"
#include "fmt/format.h"
#include "metrics/metrics_text.h"

namespace fuyou::metrics {
namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

absl::StatusOr<HostPort> ParseHostPort(std::string_view address) {
  const auto bad = [&] {
    return absl::InvalidArgumentError(fmt::format(
        "metrics address '{}' is not \"host:port\" (e.g. \"127.0.0.1:9464\", \"[::1]:9464\"; port 0..65535)",
        address));
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) return bad();
  std::string_view host = address.substr(0, colon);
  const std::string_view port_text = address.substr(colon + 1);
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return bad();
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string_view::npos) {
    return bad();  // an IPv6 address needs brackets
  }
  unsigned port = 0;
  auto [end, error] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (error != std::errc() || end != port_text.data() + port_text.size() || port > 65535) return bad();
  return HostPort{std::string(host), static_cast<uint16_t>(port)};
}

std::optional<uint32_t> SocketOwnerUid(std::string_view text, uint32_t peer_ip, uint16_t peer_port, uint32_t local_ip,
                                       uint16_t local_port) {
  // /proc/net/tcp prints an address as the 32-bit word in memory order (on x86,
  // little endian: 127.0.0.1 is 0100007F) and the port in hex.
  const auto endpoint = [](uint32_t ip, uint16_t port) {
    return fmt::format("{:08X}:{:04X}", __builtin_bswap32(ip), port);
  };
  const std::string wanted_local = endpoint(peer_ip, peer_port);
  const std::string wanted_remote = endpoint(local_ip, local_port);
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(start, end - start);
    start = end + 1;
    // sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
    std::string_view fields[8];
    size_t count = 0, at = 0;
    while (count < 8 && at < line.size()) {
      while (at < line.size() && line[at] == ' ') ++at;
      const size_t from = at;
      while (at < line.size() && line[at] != ' ') ++at;
      if (from < at) fields[count++] = line.substr(from, at - from);
    }
    if (count < 8 || fields[1] != wanted_local || fields[2] != wanted_remote) continue;
    uint32_t uid = 0;
    auto [ptr, error] = std::from_chars(fields[7].data(), fields[7].data() + fields[7].size(), uid);
    if (error == std::errc()) return uid;
  }
  return std::nullopt;
}

namespace {

// Who a connection counts against for kMaxConnectionsPerSource.
std::string SourceOf(const tcp::socket& socket) {
  beast::error_code ec;
  const tcp::endpoint remote = socket.remote_endpoint(ec);
  if (ec) return "?";
  const tcp::endpoint local = socket.local_endpoint(ec);
  if (!ec && remote.address().is_v4() && remote.address().is_loopback()) {
    if (FILE* file = std::fopen("/proc/net/tcp", "re")) {
      std::string text;
      char chunk[65536];
      size_t got = 0;
      while (text.size() < (size_t{16} << 20) && (got = std::fread(chunk, 1, sizeof chunk, file)) > 0) {
        text.append(chunk, got);
      }
      std::fclose(file);
      if (auto uid = SocketOwnerUid(text, remote.address().to_v4().to_uint(), remote.port(),
                                    local.address().to_v4().to_uint(), local.port())) {
        return fmt::format("uid {}", *uid);
      }
    }
  }
  return remote.address().to_string();
}

// One client connection: read one request (bounded in size and time), answer, close.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // `release` runs once, when the connection is gone or evicted (on the
  // server's thread).
  Connection(tcp::socket socket, std::string source, const std::function<std::string()>& render,
             std::function<void()> release)
      : stream_(std::move(socket)), source_(std::move(source)), render_(render), release_(std::move(release)) {}
  ~Connection() { Release(); }

  const std::string& source() const { return source_; }
  // True until its request head has arrived.
  bool reading_head() const { return reading_head_; }
  // Gives its place back now and closes it (its pending read then ends).
  void Evict() {
    Release();
    Close();
  }

  void Start() {
    parser_.emplace();
    parser_->header_limit(MetricsHttpServer::kMaxHeaderBytes);
    parser_->body_limit(0);
    stream_.expires_after(MetricsHttpServer::kHeadTimeout);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void Close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

 private:
  void Release() {
    if (release_) std::exchange(release_, nullptr)();
  }

  void OnRead(beast::error_code ec) {
    reading_head_ = false;
    if (ec == http::error::header_limit) return Reply(http::status::request_header_fields_too_large, "", "");
    if (ec == http::error::body_limit || ec == http::error::unexpected_body) {
      return Reply(http::status::payload_too_large, "", "");
    }
    if (ec == http::error::end_of_stream || ec == beast::error::timeout || ec == asio::error::operation_aborted) {
      return Close();
    }
    if (ec) return Reply(http::status::bad_request, "", "");
    const auto& request = parser_->get();
    if (request.method() != http::verb::get && request.method() != http::verb::head) {
      return Reply(http::status::method_not_allowed, "only GET /metrics is served\n", "text/plain");
    }
    std::string_view target(request.target().data(), request.target().size());
    target = target.substr(0, target.find('?'));  // Prometheus may add parameters
    if (target != "/metrics") return Reply(http::status::not_found, "only /metrics is served\n", "text/plain");
    head_only_ = request.method() == http::verb::head;
    Reply(http::status::ok, render_(), kContentType);
  }

  void Reply(http::status status, std::string body, std::string_view content_type) {
    response_.result(status);
    response_.version(11);
    response_.set(http::field::server, "fuyoud");
    if (!content_type.empty()) {
      response_.set(http::field::content_type, beast::string_view(content_type.data(), content_type.size()));
    }
    response_.keep_alive(false);
    response_.body() = std::move(body);
    response_.prepare_payload();
    if (head_only_) response_.body().clear();
    stream_.expires_after(MetricsHttpServer::kIoTimeout);
    http::async_write(stream_, response_, [self = shared_from_this()](beast::error_code, size_t) { self->Close(); });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_{MetricsHttpServer::kMaxHeaderBytes};
  std::optional<http::request_parser<http::empty_body>> parser_;
  http::response<http::string_body> response_;
  bool head_only_ = false;
  std::string source_;
  bool reading_head_ = true;
  const std::function<std::string()>& render_;
  std::function<void()> release_;
};

}  // namespace

class MetricsHttpServer::Impl {
 public:
  Impl(std::function<std::string()> render) : render(std::move(render)), acceptor(io) {}

  // One thread runs `io`: the counts below need no lock.
  void Accept() {
    acceptor.async_accept(io, [this](beast::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
      if (ec) {
        // EMFILE and the like: pause instead of spinning (the listener stays readable).
        accept_pause.expires_after(std::chrono::milliseconds(100));
        accept_pause.async_wait([this](beast::error_code wait_ec) {
          if (!wait_ec) Accept();
        });
        return;
      }
      std::string source = SourceOf(socket);
      // A source at its bound gives up its oldest connection still sending its
      // head; a full server takes that place from the source that has most.
      if (per_source[source] >= kMaxConnectionsPerSource) EvictOldestReading(source);
      if (open >= kMaxConnections) EvictOldestReading(LargestSource());
      if (open >= kMaxConnections || per_source[source] >= kMaxConnectionsPerSource) {
        if (per_source[source] == 0) per_source.erase(source);
        beast::error_code ignored;
        socket.close(ignored);  // too many at once: the scraper retries
      } else {
        ++open;
        ++per_source[source];
        auto connection = std::make_shared<Connection>(std::move(socket), source, render, [this, source] {
          --open;
          if (auto it = per_source.find(source); it != per_source.end() && --it->second == 0) per_source.erase(it);
        });
        connections.push_back(connection);
        connection->Start();
      }
      Accept();
    });
  }

  std::string LargestSource() const {
    std::string largest;
    size_t most = 0;
    for (const auto& [source, count] : per_source) {
      if (count > most) largest = source, most = count;
    }
    return largest;
  }

  // Closes the oldest connection of `source` that has not sent its head yet,
  // and forgets the connections that are gone.
  void EvictOldestReading(const std::string& source) {
    for (auto it = connections.begin(); it != connections.end();) {
      std::shared_ptr<Connection> connection = it->lock();
      if (!connection) {
        it = connections.erase(it);
        continue;
      }
      if (connection->source() == source && connection->reading_head()) {
        connections.erase(it);
        connection->Evict();
        return;
      }
      ++it;
    }
  }

  // Declared before `io`: connections still queued in `io` when it is
  // destroyed refer to both.
  std::function<std::string()> render;
  size_t open = 0;
  std::map<std::string, size_t> per_source;
  std::list<std::weak_ptr<Connection>> connections;  // oldest first
  asio::io_context io{1};
  tcp::acceptor acceptor;
  asio::steady_timer accept_pause{io};
  std::thread thread;
  bool stopped = false;
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(std::string_view address,
                                                                              std::function<std::string()> render) {
  auto host_port = ParseHostPort(address);
  if (!host_port.ok()) return host_port.status();
  const std::string host = host_port->host == "localhost" ? "127.0.0.1" : host_port->host;
  beast::error_code ec;
  const asio::ip::address ip = asio::ip::make_address(host, ec);
  if (ec) {
    return absl::InvalidArgumentError(fmt::format(
        "metrics address '{}': '{}' is not a numeric IP address (use e.g. 127.0.0.1, ::1 or 0.0.0.0)", address,
        host_port->host));
  }
  auto impl = std::make_unique<Impl>(std::move(render));
  const tcp::endpoint endpoint(ip, host_port->port);
  const auto fail = [&](std::string_view what) {
    return absl::UnavailableError(fmt::format("cannot {} the metrics address {}: {} (choose another [metrics] listen "
                                              "or --metrics-listen)",
                                              what, address, ec.message()));
  };
  if (impl->acceptor.open(endpoint.protocol(), ec)) return fail("open");
  if (impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec)) return fail("configure");
  if (impl->acceptor.bind(endpoint, ec)) return fail("bind");
  if (impl->acceptor.listen(asio::socket_base::max_listen_connections, ec)) return fail("listen on");
  if (!ip.is_loopback()) {
    log::Warn("metrics on {} can be read by anyone who reaches that address: they show every user's activity",
              address);
  }
  impl->Accept();
  impl->thread = std::thread([raw = impl.get()] { raw->io.run(); });
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl)));
}

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

uint16_t MetricsHttpServer::port() const {
  beast::error_code ec;
  return impl_->acceptor.local_endpoint(ec).port();
}

void MetricsHttpServer::Stop() {
  if (impl_->stopped) return;
  impl_->stopped = true;
  // On the server's thread: close the listening socket, then stop, abandoning
  // open connections (their sockets close when the io_context goes).
  asio::post(impl_->io, [raw = impl_.get()] {
    beast::error_code ignored;
    raw->acceptor.close(ignored);
    raw->io.stop();
  });
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace fuyou::metrics
