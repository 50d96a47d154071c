#include "session_health.h"

#include <utility>

#include "fmt/format.h"

namespace fuyou::internal {

absl::Status SessionHealth::CheckUsable(const absl::Status& closed) {
  if (closing_) return closed;
  if (!lost_.ok()) return lost_;
  if (!fatal_.ok()) return fatal_;
  if (!session_error_.ok()) return std::exchange(session_error_, absl::OkStatus());
  return absl::OkStatus();
}

void SessionHealth::OnDaemonError(const absl::Status& error, bool waited) {
  if ((absl::IsAborted(error) || absl::IsInternal(error)) && fatal_.ok()) fatal_ = error;
  if (!waited && session_error_.ok()) session_error_ = error;
}

absl::Status SessionHealth::BreakProtocol(const std::string& who, const absl::Status& why) {
  protocol_error_ = absl::InternalError(fmt::format(
      "protocol error on the stream of {}: {}; the session is unusable, close it", who, std::string(why.message())));
  if (fatal_.ok()) fatal_ = protocol_error_;
  return protocol_error_;
}

absl::Status SessionHealth::OnStreamEnd(const grpc::Status& status, const std::string& who,
                                        const absl::Status& closed) {
  stream_ended_ = true;
  if (closing_) return closed;
  std::string reason =
      status.ok() ? std::string("the daemon ended the session's stream") : status.error_message();
  if (reason.empty()) reason = fmt::format("gRPC status {}", static_cast<int>(status.error_code()));
  lost_ = absl::UnavailableError(fmt::format("connection to fuyoud lost: {} ({})", reason, who));
  return lost_;
}

}  // namespace fuyou::internal
