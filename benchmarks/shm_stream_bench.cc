// shm_stream_bench: the data plane against single-thread memcpy, in one run.
//
// Spawns a real fuyoud (private socket and data directory, FUYOU_TRACE on, a DRAM
// budget that keeps every chunk resident so no SSD read is on the path) and, for
// each chunk size, hands the chunk's fp32 gradients through the session's shared
// memory and takes its weights back, once per step, with
//   copy:      PushGradients + PullParams (clientlib copies in and out), and
//   zero-copy: AcquireSlot, memcpy into GradRegion (what a GPU's D2H copy does),
//              SendGradReady, WaitParams, memcpy out of ParamRegion, ReleaseSlot.
// The daemon's trace gives each update's kernel time; the data plane time is the
// client's wall time for the chunk minus that. Beside every transfer the bench
// times memcpy of the same bytes (gradients in, weights out) between private
// buffers on one thread, interleaved, so the ratio sees the same machine state.
//
//   shm_stream_bench [--sizes=4K,16M,64M] [--iters=8] [--json=PATH] [--keep]
//
// Sizes are gradient bytes (fp32, so elements = size / 4). EndStep (commit,
// write-back, fsync) is outside the timed part.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "bench_daemon.h"
#include "daemon_process.h"
#include "fmt/format.h"
#include "fmt/ranges.h"
#include "fuyou/client.h"

namespace fuyou::bench {
namespace {

struct Config {
  std::vector<uint64_t> sizes = {uint64_t{4} << 10, uint64_t{16} << 20, uint64_t{64} << 20};
  int iters = 8;
  std::string json;
  bool keep = false;
};

struct Row {
  std::string api;
  uint64_t bytes = 0;  // gradient bytes; the same again come back as weights
  double memcpy_us = 0, plane_us = 0, roundtrip_us = 0, kernel_us = 0, overhead_us = 0;
  double memcpy_gbps() const { return 2.0 * bytes / memcpy_us / 1e3; }
  double plane_gbps() const { return 2.0 * bytes / plane_us / 1e3; }
  double ratio() const { return memcpy_us / plane_us; }
};

Config ParseArgs(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string("--") + name + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("sizes")) {
      c.sizes.clear();
      for (const auto& s : Split(v)) c.sizes.push_back(ParseBytes(s));
    } else if (const char* v = value("iters")) c.iters = std::max(2, std::stoi(v));
    else if (const char* v = value("json")) c.json = v;
    else if (arg == "--keep") c.keep = true;
    else Die("shm_stream_bench: unknown argument " + arg + " (see the comment at the top of shm_stream_bench.cc)");
  }
  return c;
}

template <typename T>
T Check(absl::StatusOr<T> value, const char* what) {
  if (!value.ok()) Die(fmt::format("shm_stream_bench: {}: {}", what, value.status().ToString()));
  return std::move(*value);
}
void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) Die(fmt::format("shm_stream_bench: {}: {}", what, status.ToString()));
}

double Us(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }

int Main(int argc, char** argv) {
  const Config c = ParseArgs(argc, argv);
  const uint64_t max_bytes = *std::max_element(c.sizes.begin(), c.sizes.end());
  // Every chunk stays resident: 2 chunks per size, 12 bytes of states per 4 of gradient.
  uint64_t states = 0;
  for (uint64_t s : c.sizes) states += 2 * 3 * s + (uint64_t{8} << 20);
  const uint64_t budget = std::max<uint64_t>(std::max(states + (uint64_t{256} << 20), 6 * max_bytes + (64 << 20)),
                                             uint64_t{256} << 20);

  testing::TempDir dir;
  const auto trace_path = dir.path() / "trace.jsonl";
  ::setenv("FUYOU_TRACE", trace_path.c_str(), 1);
  testing::DaemonProcess daemon(dir.path(), {"--dram-budget", std::to_string(budget), "--log-level", "warn"});
  Check(daemon.Start(), "start fuyoud");
  ::unsetenv("FUYOU_TRACE");

  auto session = Check(Session::Open({.job = "shm-stream", .num_slots = 2, .slot_bytes = max_bytes},
                                     daemon.client_options()),
                       "open session");
  // Chunk ids: 2*i (copy API) and 2*i+1 (zero-copy API) for size i.
  std::vector<std::vector<std::byte>> weights(2 * c.sizes.size());
  for (size_t i = 0; i < c.sizes.size(); ++i) {
    for (int api = 0; api < 2; ++api) {
      const uint32_t id = static_cast<uint32_t>(2 * i + api);
      ChunkSpec spec{.chunk_id = id, .num_elements = c.sizes[i] / 4};
      weights[id].assign(c.sizes[i], std::byte{0});
      auto* w = reinterpret_cast<float*>(weights[id].data());
      for (uint64_t k = 0; k < spec.num_elements; ++k) w[k] = 0.01f * static_cast<float>(k % 97);
      Check(session->RegisterChunk(spec, weights[id]), "register chunk");
    }
  }
  // Source gradients, and private buffers for the memcpy baseline (pre-faulted).
  std::vector<std::byte> grads(max_bytes), copy_dst(max_bytes), copy_src(max_bytes), copy_out(max_bytes);
  auto* g = reinterpret_cast<float*>(grads.data());
  for (uint64_t k = 0; k < max_bytes / 4; ++k) g[k] = 1e-3f * static_cast<float>(k % 13) - 6e-3f;
  std::memset(copy_dst.data(), 1, max_bytes);
  std::memset(copy_src.data(), 2, max_bytes);
  std::memset(copy_out.data(), 3, max_bytes);

  struct Sample { double memcpy_us, plane_us, roundtrip_us; };
  std::map<uint32_t, std::vector<Sample>> samples;
  AdamWHyper hyper;
  int64_t step = session->committed_step() + 1;
  const auto timeout = std::chrono::milliseconds(60000);
  for (int iter = 0; iter < c.iters + 1; ++iter) {  // iteration 0 warms pages and caches
    for (size_t i = 0; i < c.sizes.size(); ++i) {
      const uint64_t bytes = c.sizes[i];
      for (int api = 0; api < 2; ++api) {
        const uint32_t id = static_cast<uint32_t>(2 * i + api);
        // Baseline: the same bytes, gradients in and weights out, by memcpy.
        const auto m0 = Clock::now();
        std::memcpy(copy_dst.data(), grads.data(), bytes);
        std::memcpy(weights[id].data(), copy_src.data(), bytes);
        const auto m1 = Clock::now();
        Sample s{Us(m0, m1), 0, 0};
        if (api == 0) {
          const auto t0 = Clock::now();
          Check(session->PushGradients(id, step, hyper, std::span<const std::byte>(grads.data(), bytes)), "push");
          const auto t1 = Clock::now();
          Check(session->PullParams(id, weights[id]), "pull");
          const auto t2 = Clock::now();
          s.plane_us = Us(t0, t2);
          s.roundtrip_us = Us(t1, t2);  // includes PullParams' copy out
        } else {
          const auto t0 = Clock::now();
          const uint32_t slot = Check(session->AcquireSlot(timeout), "acquire slot");
          std::memcpy(session->GradRegion(slot).data(), grads.data(), bytes);
          const auto t1 = Clock::now();
          Check(session->SendGradReady(id, slot, step, hyper), "send GradReady");
          const uint32_t ready = Check(session->WaitParams(id, timeout), "wait params");
          const auto t2 = Clock::now();
          std::memcpy(weights[id].data(), session->ParamRegion(ready).data(), bytes);
          session->ReleaseSlot(ready);
          const auto t3 = Clock::now();
          s.plane_us = Us(t0, t3);
          s.roundtrip_us = Us(t1, t2);
        }
        if (iter > 0) samples[id].push_back(s);
        Check(session->EndStep(step).status(), "end step");
        ++step;
      }
    }
  }
  const pid_t pid = daemon.pid();
  const int64_t hwm = ProcStatusKiB(pid, "VmHWM");
  Check(session->Close(), "close");
  session.reset();
  daemon.Stop();

  // Kernel time of each update from the daemon's trace, in order per chunk.
  std::map<uint32_t, std::vector<double>> kernel;
  for (const TraceEvent& e : ReadTrace(trace_path)) {
    if (e.event == "update") kernel[e.chunk].push_back(static_cast<double>(e.end_us - e.start_us));
  }
  std::vector<Row> rows;
  for (size_t i = 0; i < c.sizes.size(); ++i) {
    for (int api = 0; api < 2; ++api) {
      const uint32_t id = static_cast<uint32_t>(2 * i + api);
      const auto& k = kernel[id];
      if (k.size() != samples[id].size() + 1) Die("shm_stream_bench: the daemon's trace does not match the steps");
      std::vector<double> memcpy_us, plane_us, roundtrip_us, kernel_us, overhead_us;
      for (size_t j = 0; j < samples[id].size(); ++j) {
        const Sample& s = samples[id][j];
        const double kus = k[j + 1];
        memcpy_us.push_back(s.memcpy_us);
        plane_us.push_back(s.plane_us - kus);
        roundtrip_us.push_back(s.roundtrip_us);
        kernel_us.push_back(kus);
        // What the hand-over costs beyond the kernel and a memcpy of the same bytes.
        overhead_us.push_back(s.plane_us - kus - s.memcpy_us);
      }
      Row r;
      r.api = api == 0 ? "copy" : "zero-copy";
      r.bytes = c.sizes[i];
      r.memcpy_us = Median(memcpy_us);
      r.plane_us = Median(plane_us);
      r.roundtrip_us = Median(roundtrip_us);
      r.kernel_us = Median(kernel_us);
      r.overhead_us = Median(overhead_us);
      rows.push_back(r);
    }
  }

  fmt::print("shm_stream_bench: {} iterations per row (medians); bytes = gradients in + weights out (2 x size)\n",
             c.iters);
  fmt::print("{:>10} {:>9} | {:>10} {:>8} | {:>10} {:>8} | {:>6} | {:>10} {:>10} {:>12}\n", "api", "size",
             "memcpy us", "GB/s", "plane us", "GB/s", "ratio", "rtt us", "kernel us", "overhead us");
  for (const Row& r : rows) {
    fmt::print("{:>10} {:>8.1f}M | {:>10.1f} {:>8.2f} | {:>10.1f} {:>8.2f} | {:>6.2f} | {:>10.1f} {:>10.1f} {:>12.1f}\n",
               r.api, r.bytes / 1048576.0, r.memcpy_us, r.memcpy_gbps(), r.plane_us, r.plane_gbps(), r.ratio(),
               r.roundtrip_us, r.kernel_us, r.overhead_us);
  }
  fmt::print("plane = client wall time for the chunk minus the daemon's kernel time; ratio = memcpy / plane;\n"
             "overhead = plane minus memcpy (control cost per chunk); rtt = zero-copy SendGradReady->WaitParams\n"
             "daemon peak RSS {} MiB (budget {} MiB)\n",
             hwm / 1024, budget >> 20);
  if (!c.json.empty()) {
    std::FILE* out = std::fopen(c.json.c_str(), "w");
    if (out == nullptr) Die("cannot write " + c.json);
    fmt::print(out, "{{\"benchmark\":\"shm_stream_bench\",\"iters\":{},\"daemon_peak_rss_kib\":{},\"rows\":[", c.iters,
               hwm);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      fmt::print(out,
                 "{}{{\"api\":\"{}\",\"bytes\":{},\"memcpy_us\":{:.2f},\"memcpy_gbps\":{:.3f},\"plane_us\":{:.2f},"
                 "\"plane_gbps\":{:.3f},\"ratio\":{:.4f},\"roundtrip_us\":{:.2f},\"kernel_us\":{:.2f},"
                 "\"overhead_us\":{:.2f}}}",
                 i ? "," : "", r.api, r.bytes, r.memcpy_us, r.memcpy_gbps(), r.plane_us, r.plane_gbps(), r.ratio(),
                 r.roundtrip_us, r.kernel_us, r.overhead_us);
    }
    fmt::print(out, "]}}\n");
    std::fclose(out);
  }
  return 0;
}

}  // namespace
}  // namespace fuyou::bench

int main(int argc, char** argv) { return fuyou::bench::Main(argc, argv); }
