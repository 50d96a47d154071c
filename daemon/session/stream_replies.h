// Pieces the session's stream handling shares between session.cc (steps) and
// session_import.cc (export and import).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "fuyou/v1/offload.pb.h"

namespace fuyou {

// The in-stream reply to a refused request: its code and message, and the chunk
// and step it was about when there were ones.
inline v1::DaemonMessage ErrorReply(const absl::Status& status, std::optional<uint32_t> chunk_id = std::nullopt,
                                    std::optional<int64_t> step = std::nullopt) {
  v1::DaemonMessage reply;
  v1::Error* error = reply.mutable_error();
  error->set_code(static_cast<int32_t>(status.code()));
  error->set_message(std::string(status.message()));
  if (chunk_id) error->set_chunk_id(*chunk_id);
  if (step) error->set_step(*step);
  return reply;
}

}  // namespace fuyou
