#include "server/reply_writer.h"

#include <utility>

namespace fuyou {

ReplyWriter::ReplyWriter(Stream& stream, std::function<void(const v1::DaemonMessage&)> written)
    : stream_(stream), written_(std::move(written)), thread_([this] { Run(); }) {}

ReplyWriter::~ReplyWriter() { Finish(); }

void ReplyWriter::Send(v1::DaemonMessage answer, bool wait_for_room) {
  std::unique_lock lock(mutex_);
  if (wait_for_room) changed_.wait(lock, [&] { return queue_.size() < kMaxQueued || broken_; });
  queue_.push_back(std::move(answer));
  changed_.notify_all();
}

bool ReplyWriter::broken() const {
  std::lock_guard lock(mutex_);
  return broken_;
}

void ReplyWriter::Finish() {
  {
    std::lock_guard lock(mutex_);
    finishing_ = true;
    changed_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void ReplyWriter::Run() {
  std::unique_lock lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return !queue_.empty() || finishing_; });
    if (queue_.empty()) return;  // finishing, and everything queued is done
    v1::DaemonMessage answer = std::move(queue_.front());
    queue_.pop_front();
    const bool write = !broken_;
    changed_.notify_all();  // room for a waiting Send
    lock.unlock();
    const bool wrote = write && stream_.Write(answer);
    if (written_) written_(answer);
    lock.lock();
    if (write && !wrote) broken_ = true;
  }
}

}  // namespace fuyou
