// io_fair_bench: how long one session's read waits behind another session's
// flood of write-backs on one ring, with the queue's turns (two IoOwners) and
// without them (both files of one owner: one FIFO, as every session shared
// before the turns). Both in one run, alternating, so the ratio compares like
// with like on the same disk.
//
//   io_fair_bench [--dir=DIR] [--flood=64M] [--bs=1M] [--qd=8] [--read=1M] [--rounds=10]
//
// Each round queues --flood bytes of writes (requests of --bs, all at once) to
// one file, then one read of --read bytes from another, and times the read from
// its submission to its Future; then waits for the writes. DIR defaults to the
// folder of this binary (a build directory); it must allow O_DIRECT. The files
// are removed at the end.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_daemon.h"
#include "fmt/format.h"
#include "storage/aligned_buffer.h"
#include "storage/io_engine.h"

namespace fuyou::storage {
namespace {

using Clock = std::chrono::steady_clock;
using bench::Die;
using bench::ParseBytes;

struct Config {
  std::filesystem::path dir;
  uint64_t flood = uint64_t{64} << 20;
  uint64_t bs = uint64_t{1} << 20;
  unsigned qd = 8;
  uint64_t read = uint64_t{1} << 20;
  int rounds = 10;
};

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
    else if (const char* v = value("flood")) c.flood = ParseBytes(v);
    else if (const char* v = value("bs")) c.bs = ParseBytes(v);
    else if (const char* v = value("qd")) c.qd = static_cast<unsigned>(std::stoul(v));
    else if (const char* v = value("read")) c.read = ParseBytes(v);
    else if (const char* v = value("rounds")) c.rounds = std::max(1, std::stoi(v));
    else Die("unknown argument " + arg + " (see the comment at the top of io_fair_bench.cc)");
  }
  if (c.flood % c.bs != 0 || c.bs % kBlockSize != 0 || c.read % kBlockSize != 0 || c.read == 0) {
    Die("--flood must be a multiple of --bs, --bs and --read of 4096");
  }
  return c;
}

struct Files {
  std::unique_ptr<StateFile> flood;
  std::unique_ptr<StateFile> reader;
};

Files OpenPair(IoEngine& engine, const Config& c, const std::string& tag, IoOwner flood_owner, IoOwner read_owner) {
  auto path = [&](const char* name) { return c.dir / fmt::format("io_fair_bench.{}.{}.{}.dat", getpid(), tag, name); };
  absl::StatusOr<std::unique_ptr<StateFile>> flood = engine.Open(path("flood"), /*create=*/true, nullptr, flood_owner);
  if (!flood.ok()) Die(flood.status().ToString());
  absl::StatusOr<std::unique_ptr<StateFile>> reader = engine.Open(path("read"), /*create=*/true, nullptr, read_owner);
  if (!reader.ok()) Die(reader.status().ToString());
  if (!(*flood)->direct_io()) Die(fmt::format("{} is not on a filesystem with O_DIRECT", c.dir.string()));
  if (absl::Status s = (*flood)->Reserve(c.flood); !s.ok()) Die(s.ToString());
  return Files{*std::move(flood), *std::move(reader)};
}

// One round: the flood, then the read; returns the read's latency in ms.
double ReadBehindFloodMs(const Config& c, Files& files, AlignedBuffer& flood_data, AlignedBuffer& read_data) {
  std::vector<IoFuture> writes;
  for (uint64_t at = 0; at < c.flood; at += c.bs) {
    writes.push_back(files.flood->WriteAsync(at, flood_data.span().subspan(at, c.bs)));
  }
  const auto start = Clock::now();
  if (absl::Status s = files.reader->ReadAsync(0, read_data.span()).status(); !s.ok()) Die(s.ToString());
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  for (IoFuture& write : writes) {
    if (absl::Status s = write.status(); !s.ok()) Die(s.ToString());
  }
  return ms;
}

int Main(int argc, char** argv) {
  const Config c = ParseArgs(argc, argv);
  std::filesystem::create_directories(c.dir);
  IoEngineOptions options;
  options.queue_depth = c.qd;
  options.max_request_bytes = c.bs;
  absl::StatusOr<std::unique_ptr<IoEngine>> engine = IoEngine::Create(options);
  if (!engine.ok()) Die(engine.status().ToString());

  const IoOwner shared = IoOwner::Next();
  Files fifo = OpenPair(**engine, c, "fifo", shared, shared);
  Files turns = OpenPair(**engine, c, "turns", IoOwner::Next(), IoOwner::Next());
  absl::StatusOr<AlignedBuffer> flood_data = AlignedBuffer::Allocate(c.flood);
  absl::StatusOr<AlignedBuffer> read_data = AlignedBuffer::Allocate(c.read);
  if (!flood_data.ok()) Die(flood_data.status().ToString());
  if (!read_data.ok()) Die(read_data.status().ToString());
  std::memset(flood_data->data(), 0x5a, flood_data->size());
  std::memset(read_data->data(), 0xa5, read_data->size());
  for (Files* files : {&fifo, &turns}) {
    if (absl::Status s = files->reader->Write(0, read_data->span()); !s.ok()) Die(s.ToString());
    if (absl::Status s = files->flood->Write(0, flood_data->span()); !s.ok()) Die(s.ToString());  // allocate
  }

  fmt::print("io_fair_bench: {}: a read of {} KiB behind {} MiB of another session's writes ({} KiB requests, "
             "queue depth {}), {} rounds each\n",
             c.dir.string(), c.read >> 10, c.flood >> 20, c.bs >> 10, c.qd, c.rounds);
  std::vector<double> fifo_ms;
  std::vector<double> turns_ms;
  for (int r = 0; r < c.rounds; ++r) {
    fifo_ms.push_back(ReadBehindFloodMs(c, fifo, *flood_data, *read_data));
    turns_ms.push_back(ReadBehindFloodMs(c, turns, *flood_data, *read_data));
  }
  const double fifo_median = bench::Median(fifo_ms);
  const double turns_median = bench::Median(turns_ms);
  fmt::print("{:<28} {:>12}\n", "queue", "read ms (median)");
  fmt::print("{:<28} {:>12.2f}\n", "one FIFO (one owner)", fifo_median);
  fmt::print("{:<28} {:>12.2f}\n", "turns (two owners)", turns_median);
  fmt::print("FIFO / turns: {:.1f}x\n", turns_median > 0 ? fifo_median / turns_median : 0.0);

  for (Files* files : {&fifo, &turns}) {
    const std::filesystem::path flood_path = files->flood->path();
    const std::filesystem::path read_path = files->reader->path();
    files->flood.reset();
    files->reader.reset();
    std::filesystem::remove(flood_path);
    std::filesystem::remove(read_path);
  }
  return 0;
}

}  // namespace
}  // namespace fuyou::storage

int main(int argc, char** argv) { return fuyou::storage::Main(argc, argv); }
