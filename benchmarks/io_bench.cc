// io_bench: sequential write then read of one file through
//   (a) fuyou's StateFile (IoEngine),
//   (b) a minimal io_uring loop (the ceiling our engine can reach), and
//   (c) fio --ioengine=io_uring,
// all O_DIRECT, same request size and queue depth, from huge-page buffers.
//
//   io_bench [--dir=DIR] [--size=2G] [--bs=1M] [--qd=32] [--repeat=1] [--json=PATH] [--fio=fio|none]
//
// DIR defaults to the folder of this binary (a build directory). The file is
// removed at the end.
#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "bench_daemon.h"
#include "fmt/format.h"
#include "storage/aligned_buffer.h"
#include "storage/io_engine.h"

namespace fuyou::storage {
namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  std::filesystem::path dir;
  uint64_t size = uint64_t{2} << 30;
  uint64_t bs = uint64_t{1} << 20;
  unsigned qd = 32;
  int repeat = 1;
  std::string json;
  std::string fio = "fio";
};

[[noreturn]] void Die(const std::string& message) {
  fmt::print(stderr, "io_bench: {}\n", message);
  std::exit(1);
}

using bench::ParseBytes;

Config ParseArgs(int argc, char** argv) {
  Config c;
  c.dir = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string("--") + name + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("dir")) c.dir = v;
    else if (const char* v = value("size")) c.size = ParseBytes(v);
    else if (const char* v = value("bs")) c.bs = ParseBytes(v);
    else if (const char* v = value("qd")) c.qd = static_cast<unsigned>(std::stoul(v));
    else if (const char* v = value("repeat")) c.repeat = std::max(1, std::stoi(v));
    else if (const char* v = value("json")) c.json = v;
    else if (const char* v = value("fio")) c.fio = v;
    else Die("unknown argument " + arg + " (see the comment at the top of io_bench.cc)");
  }
  if (c.size % c.bs != 0 || c.bs % kBlockSize != 0) Die("--size must be a multiple of --bs, --bs of 4096");
  return c;
}

// (a) fuyou's engine: qd transfers of bs bytes in flight; each callback starts the next.
double OursGBps(const Config& c, StateFile& file, AlignedBuffer& buffer, bool write) {
  const uint64_t total = c.size / c.bs;
  const uint64_t slots = buffer.size() / c.bs;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t completed = 0;
  std::atomic<uint64_t> next{0};
  std::string error;
  std::function<void()> issue = [&] {
    const uint64_t i = next.fetch_add(1);
    if (i >= total) return;
    auto slot = buffer.span().subspan((i % slots) * c.bs, c.bs);
    auto done = [&](absl::Status status) {
      if (status.ok()) issue();
      std::lock_guard<std::mutex> lock(mu);
      if (!status.ok() && error.empty()) error = status.ToString();
      ++completed;
      cv.notify_all();
    };
    auto then = [done](const absl::Status& status) {
      done(status);
      return absl::OkStatus();
    };
    if (write) (void)file.WriteAsync(i * c.bs, slot).Then(then);
    else (void)file.ReadAsync(i * c.bs, slot).Then(then);
  };
  const auto start = Clock::now();
  for (unsigned k = 0; k < c.qd; ++k) issue();
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return completed == total || !error.empty(); });
    if (!error.empty()) Die(error);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return static_cast<double>(c.size) / seconds / 1e9;
}

// (b) the plainest io_uring loop with the same settings.
double PlainLoopGBps(const Config& c, const std::filesystem::path& path, AlignedBuffer& buffer, bool write) {
  const int fd = open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  if (fd < 0) Die(fmt::format("open {}: {}", path.string(), std::strerror(errno)));
  io_uring ring;
  if (int ret = io_uring_queue_init(c.qd, &ring, 0); ret < 0) Die(fmt::format("io_uring: {}", std::strerror(-ret)));
  const uint64_t total = c.size / c.bs;
  const uint64_t slots = buffer.size() / c.bs;
  uint64_t issued = 0, completed = 0, in_flight = 0;
  const auto start = Clock::now();
  while (completed < total) {
    while (in_flight < c.qd && issued < total) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      std::byte* data = buffer.data() + (issued % slots) * c.bs;
      if (write) io_uring_prep_write(sqe, fd, data, static_cast<unsigned>(c.bs), issued * c.bs);
      else io_uring_prep_read(sqe, fd, data, static_cast<unsigned>(c.bs), issued * c.bs);
      ++issued;
      ++in_flight;
    }
    io_uring_cqe* cqe;
    if (int ret = io_uring_submit_and_wait(&ring, 1); ret < 0) Die(fmt::format("submit: {}", std::strerror(-ret)));
    unsigned head, n = 0;
    io_uring_for_each_cqe(&ring, head, cqe) {
      if (cqe->res != static_cast<int>(c.bs)) Die(fmt::format("plain loop: result {}", cqe->res));
      ++n;
    }
    io_uring_cq_advance(&ring, n);
    completed += n;
    in_flight -= n;
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  io_uring_queue_exit(&ring);
  close(fd);
  return static_cast<double>(c.size) / seconds / 1e9;
}

// (c) fio, parsed from its JSON report; 0 when fio is unavailable.
double FioGBps(const Config& c, const std::filesystem::path& path, bool write) {
  if (c.fio == "none") return 0;
  const std::filesystem::path report = path.string() + ".fio.json";
  const std::string command = fmt::format(
      "{} --name=io_bench --filename={} --rw={} --bs={} --iodepth={} --ioengine=io_uring --direct=1 --size={} "
      "--output-format=json --output={} > /dev/null 2>&1",
      c.fio, path.string(), write ? "write" : "read", c.bs, c.qd, c.size, report.string());
  const int rc = std::system(command.c_str());
  std::ifstream in(report);
  std::stringstream text;
  text << in.rdbuf();
  std::filesystem::remove(report);
  if (rc != 0) {
    fmt::print(stderr, "io_bench: fio failed (exit {}): {}\n", rc, command);
    return 0;
  }
  const std::string json = text.str();
  std::smatch section;
  const std::regex section_re(write ? R"("write"\s*:\s*\{)" : R"("read"\s*:\s*\{)");
  if (!std::regex_search(json, section, section_re)) Die("no section in fio's report");
  const std::string rest = json.substr(section.position(0));
  std::smatch bw;
  if (!std::regex_search(rest, bw, std::regex(R"("bw_bytes"\s*:\s*(\d+))"))) Die("no bw_bytes in fio's report");
  return std::stod(bw[1].str()) / 1e9;
}

struct Row {
  const char* name;
  double ours, plain, fio;
};

int Main(int argc, char** argv) {
  const Config c = ParseArgs(argc, argv);
  std::filesystem::create_directories(c.dir);
  const std::filesystem::path path = c.dir / fmt::format("io_bench.{}.dat", getpid());

  IoEngineOptions options;
  options.queue_depth = c.qd;
  options.max_request_bytes = c.bs;
  absl::StatusOr<std::unique_ptr<IoEngine>> engine = IoEngine::Create(options);
  if (!engine.ok()) Die(engine.status().ToString());
  absl::StatusOr<std::unique_ptr<StateFile>> file = (*engine)->Open(path, /*create=*/true, nullptr, IoOwner());
  if (!file.ok()) Die(file.status().ToString());
  if (!(*file)->direct_io()) Die(fmt::format("{} is not on a filesystem with O_DIRECT", c.dir.string()));
  if (absl::Status s = (*file)->Reserve(c.size); !s.ok()) Die(s.ToString());
  // Buffer: enough for every request in flight, in 2 MiB pages.
  absl::StatusOr<AlignedBuffer> buffer = AlignedBuffer::Allocate(std::max<uint64_t>(c.bs * c.qd * 2, 64 << 20));
  if (!buffer.ok()) Die(buffer.status().ToString());
  std::memset(buffer->data(), 0x5a, buffer->size());

  fmt::print("io_bench: {} of {} MiB, {} KiB requests, queue depth {}, best of {}\n", path.string(), c.size >> 20,
             c.bs >> 10, c.qd, c.repeat);
  std::vector<Row> rows = {{"write", 0, 0, 0}, {"read", 0, 0, 0}};
  for (int r = 0; r < c.repeat; ++r) {
    for (Row& row : rows) {
      const bool write = std::string(row.name) == "write";
      row.ours = std::max(row.ours, OursGBps(c, **file, *buffer, write));
      row.plain = std::max(row.plain, PlainLoopGBps(c, path, *buffer, write));
      row.fio = std::max(row.fio, FioGBps(c, path, write));
    }
  }
  file->reset();
  engine->reset();
  std::filesystem::remove(path);

  fmt::print("{:<6} {:>10} {:>12} {:>9} {:>10} {:>12}\n", "op", "ours GB/s", "plain GB/s", "fio GB/s",
             "ours/fio", "ours/plain");
  for (const Row& row : rows) {
    fmt::print("{:<6} {:>10.3f} {:>12.3f} {:>9.3f} {:>10.3f} {:>12.3f}\n", row.name, row.ours, row.plain, row.fio,
               row.fio > 0 ? row.ours / row.fio : 0.0, row.plain > 0 ? row.ours / row.plain : 0.0);
  }
  if (!c.json.empty()) {
    std::ofstream out(c.json);
    out << fmt::format(R"({{"dir": "{}", "size_bytes": {}, "request_bytes": {}, "queue_depth": {}, "repeat": {},)",
                       c.dir.string(), c.size, c.bs, c.qd, c.repeat)
        << "\n \"results\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& row = rows[i];
      out << fmt::format(
          R"({}{{"op": "{}", "ours_gbps": {:.4f}, "plain_loop_gbps": {:.4f}, "fio_gbps": {:.4f}, "ours_over_fio": {:.4f}, "ours_over_plain": {:.4f}}})",
          i ? ", " : "", row.name, row.ours, row.plain, row.fio, row.fio > 0 ? row.ours / row.fio : 0.0,
          row.plain > 0 ? row.ours / row.plain : 0.0);
    }
    out << "]}\n";
    if (!out) Die("cannot write " + c.json);
  }
  return 0;
}

}  // namespace
}  // namespace fuyou::storage

int main(int argc, char** argv) { return fuyou::storage::Main(argc, argv); }
