#include "metrics/metrics_http.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <charconv>
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

namespace {

// One client connection: read one request (bounded in size and time), answer, close.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, const std::function<std::string()>& render, std::atomic<size_t>& open)
      : stream_(std::move(socket)), render_(render), open_(open) {}
  ~Connection() { open_.fetch_sub(1); }

  void Start() {
    parser_.emplace();
    parser_->header_limit(MetricsHttpServer::kMaxHeaderBytes);
    parser_->body_limit(0);
    stream_.expires_after(MetricsHttpServer::kIoTimeout);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void Close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

 private:
  void OnRead(beast::error_code ec) {
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
  const std::function<std::string()>& render_;
  std::atomic<size_t>& open_;
};

}  // namespace

class MetricsHttpServer::Impl {
 public:
  Impl(std::function<std::string()> render) : render(std::move(render)), acceptor(io) {}

  void Accept() {
    acceptor.async_accept(asio::make_strand(io), [this](beast::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
      if (!ec) {
        if (open.fetch_add(1) >= kMaxConnections) {
          open.fetch_sub(1);
          beast::error_code ignored;
          socket.close(ignored);  // too many at once: the scraper retries
        } else {
          std::make_shared<Connection>(std::move(socket), render, open)->Start();
        }
      }
      Accept();
    });
  }

  // Declared before `io`: connections still queued in `io` when it is
  // destroyed refer to both.
  std::function<std::string()> render;
  std::atomic<size_t> open{0};
  asio::io_context io{1};
  tcp::acceptor acceptor;
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
