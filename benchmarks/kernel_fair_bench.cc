// kernel_fair_bench: a small job's step beside a hog of another user on the real
// AdamW kernel (issue 32 item 2), with the kernel's fair turns (slices of
// slice_bytes, by uid then by session) and with the one FIFO of whole chunk
// updates the kernel had before (every caller one flow, no slices).
//
//   kernel_fair_bench [--threads=2] [--hog-sessions=2] [--hog-elements=16M]
//                     [--small-chunks=2] [--small-elements=256K] [--think-ms=5]
//                     [--seconds=4] [--slice-bytes=4M] [--modes=fair,fifo]
//
// The small job (uid 0, one session) runs steps: --think-ms of sleep (its
// forward and backward, off the kernel), then its --small-chunks updates of
// --small-elements each, one after another, as a session's GradReady calls do.
// The hog (uid 65534) runs --hog-sessions sessions, each updating its own chunk
// of --hog-elements back to back. All states fp32, fp32 gradients, fp32 weights
// out. Per mode, three phases of --seconds: the small job alone, the hog alone,
// both. Printed: the small job's update time and step time (p50, max) alone and
// beside the hog with their ratios, and the hog's throughput (elements/s) alone
// and beside the small job, with the small job's share of the kernel alone.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_daemon.h"
#include "common/fair_queue.h"
#include "fmt/format.h"
#include "optimizer/adamw_kernel.h"

namespace fuyou::optimizer {
namespace {

using Clock = std::chrono::steady_clock;
using bench::Die;
using bench::ParseBytes;

struct Config {
  unsigned threads = 2;
  int hog_sessions = 2;
  uint64_t hog_elements = uint64_t{16} << 20;
  int small_chunks = 2;
  uint64_t small_elements = uint64_t{256} << 10;
  double think_ms = 5;
  double seconds = 4;
  uint64_t slice_bytes = AdamWKernel::kDefaultSliceBytes;
  std::vector<std::string> modes = {"fair", "fifo"};
};

Config ParseArgs(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string("--") + name + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("threads")) c.threads = static_cast<unsigned>(std::stoul(v));
    else if (const char* v = value("hog-sessions")) c.hog_sessions = std::max(1, std::stoi(v));
    else if (const char* v = value("hog-elements")) c.hog_elements = ParseBytes(v);
    else if (const char* v = value("small-chunks")) c.small_chunks = std::max(1, std::stoi(v));
    else if (const char* v = value("small-elements")) c.small_elements = ParseBytes(v);
    else if (const char* v = value("think-ms")) c.think_ms = std::stod(v);
    else if (const char* v = value("seconds")) c.seconds = std::stod(v);
    else if (const char* v = value("slice-bytes")) c.slice_bytes = ParseBytes(v);
    else if (const char* v = value("modes")) c.modes = bench::Split(v);
    else Die("unknown argument " + arg + " (see the comment at the top of kernel_fair_bench.cc)");
  }
  return c;
}

// One chunk's fp32 states, gradient and weights.
struct Chunk {
  explicit Chunk(uint64_t n) : master(n, 0.5f), m(n, 0.0f), v(n, 0.0f), grad(n, 0.01f), out(n) {}
  AdamWBuffers Buffers() {
    AdamWBuffers b;
    b.master = master.data();
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    b.grad = grad.data();
    b.weights_out = out.data();
    b.n = master.size();
    return b;
  }
  std::vector<float> master, m, v, grad, out;
};

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[std::min(values.size() - 1, static_cast<size_t>(q * static_cast<double>(values.size())))];
}

struct SmallFigures {
  std::vector<double> update_ms;  // the step's chunk updates
  std::vector<double> step_ms;    // think + updates
  double busy_fraction = 0;       // of the phase, in updates
};

struct Phase {
  SmallFigures small;
  double hog_elements_per_second = 0;
};

// Runs one phase: the small job and/or the hog for `seconds`.
Phase RunPhase(AdamWKernel& kernel, const Config& c, bool fair, bool with_small, bool with_hog,
               std::vector<std::unique_ptr<Chunk>>& hog_chunks, std::vector<std::unique_ptr<Chunk>>& small_chunks) {
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> hog_elements{0};
  std::vector<std::thread> hogs;
  const auto started = Clock::now();
  if (with_hog) {
    for (int s = 0; s < c.hog_sessions; ++s) {
      hogs.emplace_back([&, s] {
        // fifo: every caller one flow of one user: arrival order, as the kernel's ticket lock served them.
        const FairKey tenant = fair ? FairKey{65534, static_cast<uint64_t>(s + 1)} : FairKey{};
        AdamWStepParams params;
        const AdamWBuffers b = hog_chunks[s]->Buffers();
        while (!stop.load(std::memory_order_relaxed)) {
          ++params.step;
          kernel.Update(params, b, tenant);
          hog_elements += b.n;
        }
      });
    }
  }
  Phase phase;
  if (with_small) {
    const FairKey tenant = fair ? FairKey{0, 1000} : FairKey{};
    AdamWStepParams params;
    double busy = 0;
    while (std::chrono::duration<double>(Clock::now() - started).count() < c.seconds) {
      const auto step_start = Clock::now();
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(c.think_ms));
      const auto update_start = Clock::now();
      ++params.step;
      for (auto& chunk : small_chunks) kernel.Update(params, chunk->Buffers(), tenant);
      const auto end = Clock::now();
      const double update_ms = std::chrono::duration<double, std::milli>(end - update_start).count();
      busy += update_ms;
      phase.small.update_ms.push_back(update_ms);
      phase.small.step_ms.push_back(std::chrono::duration<double, std::milli>(end - step_start).count());
    }
    phase.small.busy_fraction = busy / (1000 * std::chrono::duration<double>(Clock::now() - started).count());
  } else {
    std::this_thread::sleep_for(std::chrono::duration<double>(c.seconds));
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
  const uint64_t done_before_stop = hog_elements.load();
  stop = true;
  for (std::thread& t : hogs) t.join();
  // Chunks finished within the phase (one in flight per session is not counted).
  phase.hog_elements_per_second = static_cast<double>(done_before_stop) / elapsed;
  return phase;
}

void Run(const Config& c) {
  std::vector<std::unique_ptr<Chunk>> hog_chunks, small_chunks;
  for (int s = 0; s < c.hog_sessions; ++s) hog_chunks.push_back(std::make_unique<Chunk>(c.hog_elements));
  for (int s = 0; s < c.small_chunks; ++s) small_chunks.push_back(std::make_unique<Chunk>(c.small_elements));
  fmt::print("kernel_fair_bench: threads={} hog: uid 65534, {} sessions x {} elements; small: uid 0, {} chunks x {} "
             "elements a step, think {} ms; {} s a phase\n",
             c.threads, c.hog_sessions, c.hog_elements, c.small_chunks, c.small_elements, c.think_ms, c.seconds);
  for (const std::string& mode : c.modes) {
    const bool fair = mode == "fair";
    if (!fair && mode != "fifo") Die("--modes takes fair and fifo");
    // fifo: no slices (a slice bigger than any chunk), one flow: the kernel before issue 32.
    AdamWKernel kernel(c.threads, DetectIsa(), fair ? c.slice_bytes : uint64_t{1} << 60);
    const Phase alone = RunPhase(kernel, c, fair, true, false, hog_chunks, small_chunks);
    const Phase hog = RunPhase(kernel, c, fair, false, true, hog_chunks, small_chunks);
    const Phase both = RunPhase(kernel, c, fair, true, true, hog_chunks, small_chunks);
    const double upd_alone = Percentile(alone.small.update_ms, 0.5);
    const double upd_both = Percentile(both.small.update_ms, 0.5);
    const double step_alone = Percentile(alone.small.step_ms, 0.5);
    const double step_both = Percentile(both.small.step_ms, 0.5);
    fmt::print("[{}] slice {} KiB, isa {}\n", mode, fair ? kernel.slice_bytes() >> 10 : 0, IsaName(kernel.isa()));
    fmt::print("  small update ms: alone p50 {:.2f} max {:.2f}; beside the hog p50 {:.2f} max {:.2f}; ratio p50 "
               "{:.2f}x ({} and {} steps)\n",
               upd_alone, Percentile(alone.small.update_ms, 1.0), upd_both, Percentile(both.small.update_ms, 1.0),
               upd_both / upd_alone, alone.small.update_ms.size(), both.small.update_ms.size());
    fmt::print("  small step ms (think + updates): alone p50 {:.2f} max {:.2f}; beside the hog p50 {:.2f} max "
               "{:.2f}; ratio p50 {:.2f}x\n",
               step_alone, Percentile(alone.small.step_ms, 1.0), step_both, Percentile(both.small.step_ms, 1.0),
               step_both / step_alone);
    fmt::print("  hog Melements/s: alone {:.1f}; beside the small job {:.1f} ({:.1f}% of alone); the small job "
               "alone kept the kernel busy {:.1f}% of the time\n",
               hog.hog_elements_per_second / 1e6, both.hog_elements_per_second / 1e6,
               100 * both.hog_elements_per_second / hog.hog_elements_per_second, 100 * alone.small.busy_fraction);
  }
}

}  // namespace
}  // namespace fuyou::optimizer

int main(int argc, char** argv) {
  fuyou::optimizer::Run(fuyou::optimizer::ParseArgs(argc, argv));
  return 0;
}
