// Session::Impl, opening: OpenSession, the segment's creation (a sealed memfd),
// its handover to fuyoud and the check of the header fuyoud wrote into it.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <optional>

#include "channel.h"
#include "fmt/format.h"
#include "fuyou/segment_layout.h"
#include "session_impl.h"

namespace fuyou {
namespace {

using internal::RpcError;
using internal::SetDeadline;

std::string DefaultClientInfo() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return fmt::format("clientlib pid {} on {}", ::getpid(), host);
}


}  // namespace

absl::Status Session::Impl::Start(const SessionOptions& options) {
  v1::OpenSessionRequest request;
  request.set_job(options.job);
  request.set_num_slots(options.num_slots);
  request.set_slot_bytes(options.slot_bytes);
  request.set_client_info(options.client_info.empty() ? DefaultClientInfo() : options.client_info);
  if (options.resume_at_step) request.set_resume_at_step(*options.resume_at_step);
  v1::OpenSessionResponse response;
  grpc::ClientContext context;
  SetDeadline(context, rpc_timeout());
  grpc::Status rpc = connection_.stub().OpenSession(&context, request, &response);
  if (!rpc.ok()) {
    return RpcError(rpc, fmt::format("OpenSession for job '{}'", options.job), rpc_timeout());
  }
  name_.id = response.session_id();
  memory_.set_layout(response.num_slots(), response.slot_bytes());
  committed_step_.Set(response.committed_step());
  const uint32_t num_slots = memory_.num_slots();
  const uint64_t slot_bytes = memory_.slot_bytes();

  // Checked: the daemon's answer sizes memory this process creates and maps.
  const std::optional<SegmentLayout> layout = SegmentLayout::Checked(num_slots, slot_bytes, UINT64_MAX);
  if (num_slots != options.num_slots || slot_bytes < options.slot_bytes ||
      slot_bytes % kSegmentAlignment != 0 || !layout || response.segment_bytes() != layout->TotalBytes()) {
    return absl::FailedPreconditionError(fmt::format(
        "fuyoud opened {} with {} slots of {} bytes ({} bytes in all), which does not fit the "
        "request of {} slots of {} bytes: client and daemon disagree on the segment layout",
        Who(), num_slots, slot_bytes, response.segment_bytes(), options.num_slots,
        options.slot_bytes));
  }
  if (absl::Status status = CreateSegment(response); !status.ok()) return status;
  memory_.StartPool();
  return Attach();
}

absl::Status Session::Impl::CreateSegment(const v1::OpenSessionResponse& response) {
  const std::filesystem::path socket = response.segment_socket();
  if (!socket.is_absolute()) {
    return absl::FailedPreconditionError(fmt::format(
        "fuyoud opened {} but named no segment socket (\"{}\"): it is older than this client, which "
        "hands over its segment as a memfd; upgrade fuyoud",
        Who(), response.segment_socket()));
  }
  absl::StatusOr<std::unique_ptr<ClientSegment>> segment = ClientSegment::Create(response.segment_bytes());
  if (!segment.ok()) {
    return absl::Status(segment.status().code(), fmt::format("cannot create the segment of {}: {}", Who(),
                                                             std::string(segment.status().message())));
  }
  memory_.Adopt(*std::move(segment));
  if (absl::Status handed = memory_.segment().HandOver(socket, name_.id, rpc_timeout(), daemon_uid_); !handed.ok()) {
    return absl::Status(handed.code(), fmt::format("handing the segment of {} to fuyoud failed: {}", Who(),
                                                   std::string(handed.message())));
  }
  // The fd has done its job: the daemon holds its own mapping.
  memory_.segment().CloseFd();
  // The header fuyoud wrote through its own mapping (before it answered OK)
  // proves that it maps this memory.
  const uint64_t expected = response.segment_bytes();
  SegmentHeader header;
  std::memcpy(&header, memory_.bytes().data(), sizeof(header));
  if (header.magic != kSegmentMagic) {
    return absl::DataLossError(fmt::format(
        "the segment of {} has magic {:#018x}, expected {:#018x}, after fuyoud accepted it: fuyoud "
        "does not map the memory this client created, or is incompatible with this client",
        Who(), header.magic, kSegmentMagic));
  }
  if (header.num_slots != memory_.num_slots() || header.slot_bytes != memory_.slot_bytes() ||
      header.total_bytes != expected) {
    return absl::FailedPreconditionError(fmt::format(
        "the segment of {} has a header of {} slots of {} bytes ({} in all) but "
        "OpenSession announced {} slots of {} bytes ({} in all)",
        Who(), header.num_slots, header.slot_bytes, header.total_bytes, memory_.num_slots(),
        memory_.slot_bytes(), expected));
  }
  return absl::OkStatus();
}

}  // namespace fuyou
