// MixedIoProbe: the plainest io_uring loop that moves a given number of bytes
// read and written at once (O_DIRECT, one ring, a fixed queue depth and request
// size), the ceiling for a step that reads and writes that much.
//
// The probe file holds a read region and a write region side by side (as a
// job's committed and shadow extents) and is written once before it is timed,
// so that neither region is an unwritten extent. Requests alternate between
// reads and writes in proportion to their volumes, so both are in flight
// together from the start to the end, as in a step's pipeline. Dies on any
// error (a benchmark, not a library).
#pragma once

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "fmt/format.h"

namespace fuyou::bench {

struct MixedIoProbeConfig {
  uint64_t read_bytes = 0;
  uint64_t write_bytes = 0;
  unsigned queue_depth = 32;
  uint64_t request_bytes = uint64_t{1} << 20;
};

class MixedIoProbe {
 public:
  // Creates and fills `dir`/mixed-io-probe.bin (removed by the destructor).
  MixedIoProbe(const std::filesystem::path& dir, const MixedIoProbeConfig& config)
      : config_(config), path_(dir / "mixed-io-probe.bin") {
    const uint64_t bs = config_.request_bytes;
    read_requests_ = (config_.read_bytes + bs - 1) / bs;
    write_requests_ = (config_.write_bytes + bs - 1) / bs;
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    if (fd_ < 0) Fail(fmt::format("open {}: {}", path_.string(), std::strerror(errno)));
    if (::posix_memalign(&buffer_, 4096, bs * config_.queue_depth) != 0) Fail("posix_memalign failed");
    std::memset(buffer_, 0x5a, bs * config_.queue_depth);
    if (::io_uring_queue_init(config_.queue_depth, &ring_, 0) < 0) Fail("io_uring_queue_init failed");
    // Written once, untimed: every block of both regions exists on the device.
    Run(0, read_requests_ + write_requests_);
    if (::fdatasync(fd_) != 0) Fail(fmt::format("fdatasync {}: {}", path_.string(), std::strerror(errno)));
  }
  ~MixedIoProbe() {
    ::io_uring_queue_exit(&ring_);
    ::close(fd_);
    std::free(buffer_);
    std::error_code ignored;
    std::filesystem::remove(path_, ignored);
  }
  MixedIoProbe(const MixedIoProbe&) = delete;
  MixedIoProbe& operator=(const MixedIoProbe&) = delete;

  // Seconds to read the read region and write the write region, at once.
  double MeasureSeconds() {
    const auto start = std::chrono::steady_clock::now();
    Run(read_requests_ + write_requests_, 0);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

 private:
  [[noreturn]] static void Fail(const std::string& what) {
    fmt::print(stderr, "mixed_io_probe: {}\n", what);
    std::exit(1);
  }

  // `mixed` requests interleaved (request k is a read while reads are behind
  // their share of the first k), then `writes_only` writes over both regions.
  void Run(uint64_t mixed, uint64_t writes_only) {
    const uint64_t bs = config_.request_bytes;
    const uint64_t total = mixed + writes_only;
    uint64_t issued = 0, completed = 0, in_flight = 0, reads_issued = 0, writes_issued = 0;
    while (completed < total) {
      while (in_flight < config_.queue_depth && issued < total) {
        io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_);
        auto* data = static_cast<char*>(buffer_) + (issued % config_.queue_depth) * bs;
        if (issued < mixed) {
          // Reads' share of the requests so far, in integers: reads * issued / mixed.
          const bool read = writes_issued == write_requests_ ||
                            (reads_issued < read_requests_ && reads_issued * mixed <= read_requests_ * issued);
          if (read) {
            ::io_uring_prep_read(sqe, fd_, data, static_cast<unsigned>(bs), reads_issued++ * bs);
          } else {
            ::io_uring_prep_write(sqe, fd_, data, static_cast<unsigned>(bs), (read_requests_ + writes_issued++) * bs);
          }
        } else {
          ::io_uring_prep_write(sqe, fd_, data, static_cast<unsigned>(bs), (issued - mixed) * bs);
        }
        ++issued;
        ++in_flight;
      }
      if (int ret = ::io_uring_submit_and_wait(&ring_, 1); ret < 0) Fail(fmt::format("submit: {}", std::strerror(-ret)));
      io_uring_cqe* cqe = nullptr;
      unsigned head = 0, reaped = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        if (cqe->res != static_cast<int>(bs)) Fail(fmt::format("a request returned {}", cqe->res));
        ++reaped;
      }
      ::io_uring_cq_advance(&ring_, reaped);
      completed += reaped;
      in_flight -= reaped;
    }
  }

  const MixedIoProbeConfig config_;
  const std::filesystem::path path_;
  uint64_t read_requests_ = 0, write_requests_ = 0;
  int fd_ = -1;
  void* buffer_ = nullptr;
  io_uring ring_{};
};

}  // namespace fuyou::bench
