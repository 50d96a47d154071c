// SessionHealth: whether a session may still be used, and if not, why: closed
// by the caller, its connection to the daemon lost, a fatal error from the
// daemon (ABORTED, INTERNAL, or a broken protocol), or a refusal nobody waited
// for (reported once, by the next call). Private to clientlib.
//
// Not thread-safe: the session guards it with its own mutex, together with its
// request table. `who` in the messages names the session ("job 'x' (session y)").
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace fuyou::internal {

class SessionHealth {
 public:
  // The status that refuses a new call, or OK: closed (`closed`), the connection
  // lost, a fatal error, or a refusal not yet reported (reported once).
  absl::Status CheckUsable(const absl::Status& closed);

  // The caller closes the session: every later call is refused with its closed error.
  void BeginClose() { closing_ = true; }
  bool closing() const { return closing_; }

  // An Error from the daemon, about a request that `waited` (its waiter takes
  // the error) or not (its waiter gave up: the next call reports it). ABORTED
  // and INTERNAL make the session unusable.
  void OnDaemonError(const absl::Status& error, bool waited);

  // The daemon broke the protocol, as `why` says: returns the INTERNAL status
  // that every pending request and every later call gets. Messages after it are
  // not trusted (trusts_stream).
  absl::Status BreakProtocol(const std::string& who, const absl::Status& why);
  bool trusts_stream() const { return protocol_error_.ok(); }

  // The stream ended with `status`: returns the status every pending request
  // gets (`closed` when the session was closing; else UNAVAILABLE "connection to
  // fuyoud lost: ...", which every later call gets too).
  absl::Status OnStreamEnd(const grpc::Status& status, const std::string& who, const absl::Status& closed);
  // True once the stream has ended.
  bool stream_ended() const { return stream_ended_; }
  // The connection loss, or OK.
  const absl::Status& lost() const { return lost_; }

 private:
  bool closing_ = false;
  bool stream_ended_ = false;
  absl::Status lost_;            // connection to the daemon lost
  absl::Status fatal_;           // ABORTED / INTERNAL from the daemon, or protocol_error_
  absl::Status protocol_error_;  // the daemon broke the protocol: later messages are ignored
  absl::Status session_error_;   // refusal nobody waited for; reported once
};

}  // namespace fuyou::internal
