// PendingRequests: the one table of a session's stream requests that wait for
// an answer, keyed by the request id the client puts on each ClientMessage
// and fuyoud echoes on the DaemonMessage that answers it (offload.proto:
// ClientMessage.request_id, DaemonMessage.request_id). Private to clientlib.
//
// A request lives from Add (before it is written to the stream) to Take (its
// waiter took the answer) or, when its waiter gave up (Abandon), to the answer
// that names it. Deliver routes an answer by its id alone: an Error names the
// request it refuses the same way as any other answer, so nothing is guessed
// from which fields an Error has set.
//
// Every byte from the daemon is hostile: an answer whose id is unknown (never
// sent, already answered, or 0 from a daemon that echoes no ids), or whose
// kind does not answer its request's kind, is refused with INTERNAL and the
// table is unchanged. What the answer's fields say (chunk, slot, step) is the
// caller's to check against the request.
//
// Not thread-safe: the session guards it with its own mutex.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fuyou/v1/offload.pb.h"

namespace fuyou::internal {

// What a pending request asked; each kind has one answer kind besides Error.
enum class RequestKind {
  kAttach,          // -> Attached
  kGradReady,       // -> ParamsReady
  kFetchWeights,    // -> WeightsFetched
  kEndStep,         // -> StepCommitted
  kAbortStep,       // -> StepAborted
  kReadState,       // -> StateRead
  kWriteState,      // -> StateWritten
  kSetUpdateCount,  // -> UpdateCountSet
  kCommitImport,    // -> ImportCommitted
  kSpillActivation,   // -> ActivationSpilled
  kRecallActivation,  // -> ActivationRecalled
  kDropActivations,   // -> ActivationsDropped
  kWaitDurable,       // -> StepDurable
};

// The message name of the request kind ("GradReady", ...).
const char* RequestName(RequestKind kind);
// True for the export and import requests (ReadState ... CommitImport).
bool IsStateTransfer(RequestKind kind);
// The status an Error message carries; a code outside google.rpc.Code is UNKNOWN.
absl::Status StatusFromError(const v1::Error& error);

struct PendingRequest {
  RequestKind kind = RequestKind::kAttach;
  // What the request is about, where its kind has one (else 0).
  uint32_t chunk_id = 0;
  uint32_t slot = 0;
  int64_t step = 0;
  // Set by Deliver or FailAll.
  bool answered = false;
  // OK for an answer of the request's own kind; an Error's status; the status
  // FailAll gave. The caller may replace it (an answer that names another slot).
  absl::Status status = absl::OkStatus();
  v1::DaemonMessage answer = {};  // the answer as received (empty when failed)
};

using RequestMatch = std::function<bool(const PendingRequest&)>;
// Requests of `kind`; of `kind` about chunk `chunk_id`.
RequestMatch OfKind(RequestKind kind);
RequestMatch OfChunk(RequestKind kind, uint32_t chunk_id);

class PendingRequests {
 public:
  // What Deliver did with an answer.
  struct Delivery {
    uint64_t id = 0;
    // The request the answer completed, valid until the table changes; null
    // when its waiter had given up (Abandon): the request is gone now.
    PendingRequest* request = nullptr;
    RequestKind kind = RequestKind::kAttach;
  };

  // Adds a request not yet answered and returns its id: never 0, never reused
  // for the table's life.
  uint64_t Add(PendingRequest request);
  // The pending request `id` (answered or not), or null when it is not in the
  // table or was abandoned.
  PendingRequest* Find(uint64_t id);
  // Removes request `id` and returns it; nullopt when it is not in the table or
  // was abandoned.
  std::optional<PendingRequest> Take(uint64_t id);
  // Its waiter gives up on request `id`: the request stays until its answer
  // arrives (which Deliver then drops), so a late answer is not taken for an
  // unknown id. An answered request is removed at once.
  void Abandon(uint64_t id);
  // Routes `answer` to the request its request_id names and marks it
  // answered. INTERNAL (table unchanged) for an unknown or already answered id
  // or an answer of another kind than the request's.
  absl::StatusOr<Delivery> Deliver(const v1::DaemonMessage& answer);
  // Marks every unanswered request answered with `status` (the stream ended,
  // or the daemon broke the protocol); abandoned ones are removed.
  void FailAll(const absl::Status& status);

  // The oldest (lowest id) request, not abandoned, for which `match` is true.
  std::optional<uint64_t> FindOldest(const RequestMatch& match) const;
  // The requests, not abandoned, `match` is true for, oldest first; valid
  // until the table changes.
  std::vector<const PendingRequest*> Select(const RequestMatch& match) const;
  size_t Count(const RequestMatch& match) const { return Select(match).size(); }
  // Every request in the table, abandoned ones included.
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    PendingRequest request;
    bool abandoned = false;
  };

  uint64_t next_id_ = 1;
  std::map<uint64_t, Entry> entries_;  // by id: oldest first
};

}  // namespace fuyou::internal
