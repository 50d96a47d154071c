// ReplyWriter: the one writer of a session stream's answers
// (OffloadService::Stream). Answers are queued by Send, from the stream's
// handler and from I/O completion threads (an activation transfer answered
// when it completes, issue 23), and written in the order queued by a thread of
// the writer's own: an answer whose I/O completes late never holds up the
// handler, and no completion thread ever waits on the client.
//
// Bounded: a Send with wait_for_room (the handler's) waits while kMaxQueued
// answers are queued, so a client that does not read its answers stops being
// read, as when the handler wrote them itself; a completion's Send never
// waits (those in flight are bounded by ActivationSpill::kMaxTransfers).
// After a Write fails (the client is gone) the rest are dropped unwritten.
// `written` runs on the writer's thread after each answer, written or dropped.
//
// Thread-safe. Finish (and the destructor) waits until every answer queued
// before it has been written or dropped, then joins the thread; nothing may
// be sent after it.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "fuyou/v1/offload.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fuyou {

class ReplyWriter {
 public:
  using Stream = grpc::ServerReaderWriter<v1::DaemonMessage, v1::ClientMessage>;
  // Most answers queued before the handler's Send waits.
  static constexpr size_t kMaxQueued = 256;

  // `stream` must outlive the writer.
  ReplyWriter(Stream& stream, std::function<void(const v1::DaemonMessage&)> written);
  ~ReplyWriter();
  ReplyWriter(const ReplyWriter&) = delete;
  ReplyWriter& operator=(const ReplyWriter&) = delete;

  void Send(v1::DaemonMessage answer, bool wait_for_room);
  // True once a Write failed: the stream is broken.
  bool broken() const;
  void Finish();

 private:
  void Run();

  Stream& stream_;
  const std::function<void(const v1::DaemonMessage&)> written_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<v1::DaemonMessage> queue_;  // guarded by mutex_
  bool broken_ = false;                  // guarded by mutex_
  bool finishing_ = false;               // guarded by mutex_
  std::thread thread_;                   // last: started when the rest is ready
};

}  // namespace fuyou
