#include "pending_requests.h"

#include "fmt/format.h"

namespace fuyou::internal {
namespace {

// The one answer kind, besides Error, that answers a request of `kind`.
v1::DaemonMessage::KindCase AnswerKind(RequestKind kind) {
  switch (kind) {
    case RequestKind::kAttach: return v1::DaemonMessage::kAttached;
    case RequestKind::kGradReady: return v1::DaemonMessage::kParamsReady;
    case RequestKind::kFetchWeights: return v1::DaemonMessage::kWeightsFetched;
    case RequestKind::kEndStep: return v1::DaemonMessage::kStepCommitted;
    case RequestKind::kAbortStep: return v1::DaemonMessage::kStepAborted;
    case RequestKind::kReadState: return v1::DaemonMessage::kStateRead;
    case RequestKind::kWriteState: return v1::DaemonMessage::kStateWritten;
    case RequestKind::kSetUpdateCount: return v1::DaemonMessage::kUpdateCountSet;
    case RequestKind::kCommitImport: return v1::DaemonMessage::kImportCommitted;
    case RequestKind::kSpillActivation: return v1::DaemonMessage::kActivationSpilled;
    case RequestKind::kRecallActivation: return v1::DaemonMessage::kActivationRecalled;
    case RequestKind::kDropActivations: return v1::DaemonMessage::kActivationsDropped;
    case RequestKind::kWaitDurable: return v1::DaemonMessage::kStepDurable;
  }
  return v1::DaemonMessage::KIND_NOT_SET;
}

// The answer's message name, for errors ("an answer with no kind" for none).
std::string AnswerName(const v1::DaemonMessage& answer) {
  if (answer.kind_case() == v1::DaemonMessage::KIND_NOT_SET) return "an answer with no kind set";
  const auto* field = v1::DaemonMessage::descriptor()->FindFieldByNumber(answer.kind_case());
  return field == nullptr ? "an answer of an unknown kind" : field->message_type()->name();
}

}  // namespace

const char* RequestName(RequestKind kind) {
  switch (kind) {
    case RequestKind::kAttach: return "Attach";
    case RequestKind::kGradReady: return "GradReady";
    case RequestKind::kFetchWeights: return "FetchWeights";
    case RequestKind::kEndStep: return "EndStep";
    case RequestKind::kAbortStep: return "AbortStep";
    case RequestKind::kReadState: return "ReadState";
    case RequestKind::kWriteState: return "WriteState";
    case RequestKind::kSetUpdateCount: return "SetUpdateCount";
    case RequestKind::kCommitImport: return "CommitImport";
    case RequestKind::kSpillActivation: return "SpillActivation";
    case RequestKind::kRecallActivation: return "RecallActivation";
    case RequestKind::kDropActivations: return "DropActivations";
    case RequestKind::kWaitDurable: return "WaitDurable";
  }
  return "an unknown request";
}

RequestMatch OfKind(RequestKind kind) {
  return [kind](const PendingRequest& request) { return request.kind == kind; };
}

RequestMatch OfChunk(RequestKind kind, uint32_t chunk_id) {
  return [kind, chunk_id](const PendingRequest& request) {
    return request.kind == kind && request.chunk_id == chunk_id;
  };
}

bool IsStateTransfer(RequestKind kind) {
  return kind == RequestKind::kReadState || kind == RequestKind::kWriteState ||
         kind == RequestKind::kSetUpdateCount || kind == RequestKind::kCommitImport;
}

absl::Status StatusFromError(const v1::Error& error) {
  int code = error.code();
  if (code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    code = static_cast<int>(absl::StatusCode::kUnknown);
  }
  return absl::Status(static_cast<absl::StatusCode>(code), error.message());
}

uint64_t PendingRequests::Add(PendingRequest request) {
  request.answered = false;
  request.status = absl::OkStatus();
  request.answer.Clear();
  const uint64_t id = next_id_++;
  entries_.emplace(id, Entry{std::move(request), false});
  return id;
}

PendingRequest* PendingRequests::Find(uint64_t id) {
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.abandoned) return nullptr;
  return &it->second.request;
}

std::optional<PendingRequest> PendingRequests::Take(uint64_t id) {
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.abandoned) return std::nullopt;
  PendingRequest request = std::move(it->second.request);
  entries_.erase(it);
  return request;
}

void PendingRequests::Abandon(uint64_t id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  if (it->second.request.answered) {
    entries_.erase(it);
  } else {
    it->second.abandoned = true;
  }
}

absl::StatusOr<PendingRequests::Delivery> PendingRequests::Deliver(const v1::DaemonMessage& answer) {
  const uint64_t id = answer.request_id();
  if (id == 0) {
    return absl::InternalError(fmt::format(
        "fuyoud sent {} without a request id: it is older than this client, which needs fuyoud to echo "
        "ClientMessage.request_id; upgrade fuyoud",
        AnswerName(answer)));
  }
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.request.answered) {
    return absl::InternalError(fmt::format(
        "fuyoud sent {} for request {}, which this client {}", AnswerName(answer), id,
        it == entries_.end() ? "has not sent or no longer waits for" : "already has an answer to"));
  }
  PendingRequest& request = it->second.request;
  if (!answer.has_error() && answer.kind_case() != AnswerKind(request.kind)) {
    return absl::InternalError(fmt::format("fuyoud answered request {} (a {}) with {}", id,
                                           RequestName(request.kind), AnswerName(answer)));
  }
  Delivery delivery{id, nullptr, request.kind};
  if (it->second.abandoned) {
    entries_.erase(it);
    return delivery;
  }
  request.answered = true;
  request.status = answer.has_error() ? StatusFromError(answer.error()) : absl::OkStatus();
  request.answer = answer;
  delivery.request = &request;
  return delivery;
}

void PendingRequests::FailAll(const absl::Status& status) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.abandoned) {
      it = entries_.erase(it);
      continue;
    }
    PendingRequest& request = it->second.request;
    if (!request.answered) {
      request.answered = true;
      request.status = status;
    }
    ++it;
  }
}

std::optional<uint64_t> PendingRequests::FindOldest(const RequestMatch& match) const {
  for (const auto& [id, entry] : entries_) {
    if (!entry.abandoned && match(entry.request)) return id;
  }
  return std::nullopt;
}

std::vector<const PendingRequest*> PendingRequests::Select(const RequestMatch& match) const {
  std::vector<const PendingRequest*> selected;
  for (const auto& [id, entry] : entries_) {
    if (!entry.abandoned && match(entry.request)) selected.push_back(&entry.request);
  }
  return selected;
}

}  // namespace fuyou::internal
