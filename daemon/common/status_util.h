// Small helpers for errors as values at fuyoud's boundaries.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/errno_code.h"
#include "fmt/format.h"
#include "grpcpp/support/status.h"

// Debian's abseil has its own string_view (Status::message()); let fmt print it.
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<std::string_view> {
  template <typename FormatContext>
  auto format(absl::string_view text, FormatContext& context) const {
    return fmt::formatter<std::string_view>::format(std::string_view(text.data(), text.size()), context);
  }
};

namespace fuyou {

// absl and gRPC share the canonical code numbers.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

// A client-chosen string (job name, session id, ...) fit to be echoed in an error
// message or a log line: in single quotes, each byte outside printable ASCII
// (and the quote and backslash) escaped as \xNN, and cut after `max_bytes`
// bytes of input with "...(N bytes)" naming the full length. A 10 kB name thus
// costs at most a few hundred bytes of message and cannot carry escape
// sequences to an operator's terminal.
inline std::string QuoteForError(std::string_view text, size_t max_bytes = 64) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string quoted = "'";
  const size_t shown = text.size() < max_bytes ? text.size() : max_bytes;
  for (size_t i = 0; i < shown; ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte >= 0x20 && byte < 0x7f && byte != '\\' && byte != '\'') {
      quoted += static_cast<char>(byte);
    } else {
      quoted += "\\x";
      quoted += kHex[byte >> 4];
      quoted += kHex[byte & 0xf];
    }
  }
  quoted += '\'';
  if (shown < text.size()) quoted += "...(" + std::to_string(text.size()) + " bytes)";
  return quoted;
}

// "<what>: <strerror(err)>" with the code ErrnoCode (common/errno_code.h) gives
// the errno; that table is the one mapping of fuyoud (ENOSPC/EDQUOT/EMFILE ->
// RESOURCE_EXHAUSTED, EIO -> DATA_LOSS, ELOOP (a symlink refused) ->
// FAILED_PRECONDITION, ...).
inline absl::Status ErrnoStatus(int err, std::string_view what) {
  return absl::Status(ErrnoCode(err), std::string(what) + ": " + std::strerror(err));
}

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define FUYOU_RETURN_IF_ERROR(expr)          \
  do {                                       \
    if (absl::Status _s = (expr); !_s.ok()) { \
      return _s;                             \
    }                                        \
  } while (0)

#define FUYOU_CONCAT_INNER(a, b) a##b
#define FUYOU_CONCAT(a, b) FUYOU_CONCAT_INNER(a, b)
// `lhs = value of expr` or return its error status.
#define FUYOU_ASSIGN_OR_RETURN(lhs, expr)                                  \
  auto FUYOU_CONCAT(_statusor_, __LINE__) = (expr);                        \
  if (!FUYOU_CONCAT(_statusor_, __LINE__).ok()) {                          \
    return FUYOU_CONCAT(_statusor_, __LINE__).status();                    \
  }                                                                        \
  lhs = std::move(*FUYOU_CONCAT(_statusor_, __LINE__))

}  // namespace fuyou
