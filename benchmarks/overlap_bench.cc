// overlap_bench: a client that behaves like a GPU job, against a real fuyoud whose
// optimizer states are several times its DRAM budget (so every step reads and
// writes all states on the SSD).
//
// The job has L layers. Each layer's backward is a timed wait that leaves the host
// CPU free, as a GPU's would; then the layer's chunk of fp32 gradients (real data)
// is copied into a shared-memory slot and GradReady is sent. Four step shapes, run
// interleaved round after round so they see the same machine:
//   (a) backward    the L waits alone, no daemon;
//   (b) optimizer   every chunk sent back to back, weights collected, EndStep;
//   (c) overlapped  each chunk sent right after its layer's wait (by a second
//                   thread, as a GPU's copy engine would: the copy does not
//                   delay the next layer's backward), weights collected as
//                   slots are needed and at the end, EndStep;
//   (d) serial      all of (a), then all of (b) (ZeRO-Infinity's order).
// Reports overlapped / max(a, b) (the paper's claim: close to 1) and serial /
// overlapped, writes a timeline of the last overlapped step (client: backward
// waits; daemon: updates, SSD reads and writes from its FUYOU_TRACE file) as JSON
// and, with --png, as a picture through benchmarks/plot_timeline.py. Then starts a
// fresh daemon per model size and reports its peak RSS (VmHWM) after two steps.
// Each round also times a plain io_uring loop (mixed_io_probe.h: O_DIRECT, QD 32,
// 1 MiB requests, in the daemon's directory) that reads and writes, at once, the
// bytes (b) read and wrote, and reports (b)'s rate as a fraction of the probe's.
//
//   overlap_bench [--layers=24] [--chunk-params=2M] [--budget=128M] [--layer-ms=auto]
//                 [--rounds=3] [--slots=4] [--rss-sizes=256M,1G,2G] [--dir=DIR]
//                 [--json=PATH] [--timeline=PATH] [--png=PATH] [--state-dtype=fp32|bf16|8bit]
//   overlap_bench --compare-state-dtypes [--layers=24] [--chunk-params=2M] [--budget=128M] [--rounds=5]
//
// --layer-ms=auto sets each layer's wait to (b)/L, measured first, so backward and
// optimizer+I/O take about as long: the case where overlap matters most.
// --rss-sizes are bytes of optimizer states (12 per parameter, 8 with bf16 moments); "none" skips them.
// --state-dtype=bf16 registers the chunks with bf16 moments (ChunkSpec.moments_dtype:
// 8 bytes of states a parameter instead of 12), 8bit with 8-bit moments
// (DTYPE_BLOCK8: about 6.03).
// --compare-state-dtypes measures only the SSD-bound step (b), for fp32, bf16
// and 8bit states in one run: one daemon and job each (same budget, layers and
// gradients), interleaved round by round, so all three see the same machine;
// prints each one's median (b), SSD bytes a step and the ratios.
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "bench_daemon.h"
#include "daemon_process.h"
#include "mixed_io_probe.h"
#include "fmt/format.h"
#include "fuyou/admin_client.h"
#include "fuyou/client.h"

#ifndef FUYOU_BENCH_SOURCE_DIR
#define FUYOU_BENCH_SOURCE_DIR "benchmarks"
#endif
#ifndef FUYOU_BENCH_PYTHON
#define FUYOU_BENCH_PYTHON "python3"
#endif

namespace fuyou::bench {
namespace {

struct Config {
  uint32_t layers = 24;
  uint64_t chunk_params = uint64_t{2} << 20;
  uint64_t budget = uint64_t{128} << 20;
  double layer_ms = -1;  // auto
  int rounds = 3;
  uint32_t slots = 4;
  std::vector<uint64_t> rss_sizes = {uint64_t{256} << 20, uint64_t{1} << 30, uint64_t{2} << 30};
  std::filesystem::path dir;
  std::string json, timeline, png;
  DType moments_dtype = DType::kFloat32;  // --state-dtype
  bool compare_state_dtypes = false;
};

Config ParseArgs(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string("--") + name + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("layers")) c.layers = static_cast<uint32_t>(std::stoul(v));
    else if (const char* v = value("chunk-params")) c.chunk_params = ParseBytes(v);
    else if (const char* v = value("budget")) c.budget = ParseBytes(v);
    else if (const char* v = value("layer-ms")) c.layer_ms = std::string(v) == "auto" ? -1 : std::stod(v);
    else if (const char* v = value("rounds")) c.rounds = std::max(1, std::stoi(v));
    else if (const char* v = value("slots")) c.slots = std::max(1u, static_cast<uint32_t>(std::stoul(v)));
    else if (const char* v = value("rss-sizes")) {
      c.rss_sizes.clear();
      if (std::string(v) != "none") {
        for (const auto& s : Split(v)) c.rss_sizes.push_back(ParseBytes(s));
      }
    } else if (const char* v = value("dir")) c.dir = v;
    else if (const char* v = value("json")) c.json = v;
    else if (const char* v = value("timeline")) c.timeline = v;
    else if (const char* v = value("png")) c.png = v;
    else if (const char* v = value("state-dtype")) {
      const std::string d(v);
      if (d != "fp32" && d != "bf16" && d != "8bit") Die("overlap_bench: --state-dtype is fp32, bf16 or 8bit");
      c.moments_dtype = d == "bf16" ? DType::kBFloat16 : d == "8bit" ? DType::kBlock8 : DType::kFloat32;
    } else if (arg == "--compare-state-dtypes") {
      c.compare_state_dtypes = true;
    }
    else Die("overlap_bench: unknown argument " + arg + " (see the comment at the top of overlap_bench.cc)");
  }
  if (c.layers == 0 || c.chunk_params == 0) Die("overlap_bench: --layers and --chunk-params must be > 0");
  return c;
}

template <typename T>
T Check(absl::StatusOr<T> value, const std::string& what) {
  if (!value.ok()) Die(fmt::format("overlap_bench: {}: {}", what, value.status().ToString()));
  return std::move(*value);
}
void Check(const absl::Status& status, const std::string& what) {
  if (!status.ok()) Die(fmt::format("overlap_bench: {}: {}", what, status.ToString()));
}

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct Interval {
  uint32_t chunk;
  int64_t start_us, end_us;
};

// One job on one daemon: L chunks, a slot window, the model's weights.
class Job {
 public:
  Job(const testing::DaemonProcess& daemon, uint32_t layers, uint64_t chunk_params, uint32_t slots,
      DType moments_dtype = DType::kFloat32)
      : layers_(layers), n_(chunk_params) {
    session_ = Check(Session::Open({.job = "overlap", .num_slots = slots, .slot_bytes = 4 * n_},
                                   daemon.client_options()),
                     "open session");
    weights_.resize(static_cast<size_t>(layers_) * n_);
    for (size_t k = 0; k < weights_.size(); ++k) weights_[k] = 0.02f * static_cast<float>(k % 101) - 1.0f;
    grads_.resize(n_);
    for (uint64_t k = 0; k < n_; ++k) grads_[k] = 1e-3f * static_cast<float>(k % 17) - 8e-3f;
    // Registered in forward order; backward produces the last layer's gradients first.
    for (uint32_t layer = 0; layer < layers_; ++layer) {
      Check(session_->RegisterChunk({.chunk_id = layer, .num_elements = n_, .moments_dtype = moments_dtype},
                                    WeightBytes(layer)),
            "register chunk");
    }
    step_ = session_->committed_step() + 1;
  }

  // Copies the gradients of `layer` into a slot (first collecting the oldest chunk
  // in flight when every slot is taken) and sends GradReady.
  void Send(uint32_t layer) {
    if (in_flight_.size() == session_->num_slots()) CollectOldest();
    const uint32_t slot = Check(session_->AcquireSlot(kTimeout), "acquire slot");
    std::memcpy(session_->GradRegion(slot).data(), grads_.data(), 4 * n_);
    Check(session_->SendGradReady(layer, slot, step_, hyper_), "send GradReady");
    in_flight_.push_back(layer);
  }
  void CollectOldest() {
    const uint32_t layer = in_flight_.front();
    in_flight_.pop_front();
    const uint32_t slot = Check(session_->WaitParams(layer, kTimeout), "wait params");
    std::memcpy(WeightBytes(layer).data(), session_->ParamRegion(slot).data(), 4 * n_);
    session_->ReleaseSlot(slot);
  }
  void EndStep() {
    while (!in_flight_.empty()) CollectOldest();
    Check(session_->EndStep(step_).status(), "end step");
    ++step_;
  }
  // Every chunk back to back, then EndStep: optimizer + I/O alone.
  void OptimizerStep() {
    for (uint32_t i = 0; i < layers_; ++i) Send(layers_ - 1 - i);
    EndStep();
  }
  uint32_t layers() const { return layers_; }
  Session& session() { return *session_; }

 private:
  static constexpr std::chrono::milliseconds kTimeout{120000};
  std::span<std::byte> WeightBytes(uint32_t layer) {
    return {reinterpret_cast<std::byte*>(weights_.data() + static_cast<size_t>(layer) * n_), 4 * n_};
  }

  uint32_t layers_;
  uint64_t n_;
  std::unique_ptr<Session> session_;
  std::vector<float> weights_, grads_;
  std::deque<uint32_t> in_flight_;
  int64_t step_ = 1;
  AdamWHyper hyper_;
};

// One layer's backward: a wait that leaves the CPU free.
Interval Backward(uint32_t layer, double layer_ms) {
  const int64_t start = NowUs();
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(layer_ms));
  return {layer, start, NowUs()};
}

struct Figures {
  std::vector<double> a, b, c, d, probe;
};

struct StorageBytes {
  uint64_t read = 0, written = 0;
};

StorageBytes BytesMoved(const testing::DaemonProcess& daemon) {
  auto admin = Check(AdminClient::Connect(daemon.client_options()), "admin connect");
  auto stats = Check(admin->GetStats(), "GetStats");
  StorageBytes total;
  for (const auto& path : stats.storage()) {
    total.read += path.bytes_read();
    total.written += path.bytes_written();
  }
  return total;
}

std::filesystem::path WorkDir(const Config& c, const testing::TempDir& tmp) {
  if (c.dir.empty()) return tmp.path();
  std::filesystem::path dir = c.dir / fmt::format("overlap-bench-{}", ::getpid());
  std::filesystem::create_directories(dir);
  return dir;
}

// Seconds within [start_us, end_us] that at least one event named in `names`
// was running (the union of their intervals).
double BusySeconds(const std::vector<TraceEvent>& events, int64_t start_us, int64_t end_us,
                   const std::vector<std::string>& names) {
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const TraceEvent& e : events) {
    if (std::find(names.begin(), names.end(), e.event) == names.end()) continue;
    const int64_t s = std::max(e.start_us, start_us), t = std::min(e.end_us, end_us);
    if (s < t) spans.push_back({s, t});
  }
  std::sort(spans.begin(), spans.end());
  int64_t total = 0, cur_s = 0, cur_e = 0;
  for (auto [s, t] : spans) {
    if (s > cur_e) {
      total += cur_e - cur_s;
      cur_s = s;
      cur_e = t;
    } else {
      cur_e = std::max(cur_e, t);
    }
  }
  return static_cast<double>(total + cur_e - cur_s) / 1e6;
}

struct RssRow {
  uint64_t state_bytes = 0;
  uint32_t chunks = 0;
  int64_t hwm_kib = 0;
  double step_s = 0;
};

// Bytes of states a parameter: fp32 master + m + v, or fp32 master + bf16 m and v,
// or fp32 master + 8-bit m and v (and a scale per 256, rounded away here).
uint64_t StateBytesPerParam(DType moments) {
  return moments == DType::kBFloat16 ? 8 : moments == DType::kBlock8 ? 6 : 12;
}
uint64_t StateBytesPerParam(const Config& c) { return StateBytesPerParam(c.moments_dtype); }

// --compare-state-dtypes: step (b) for fp32, bf16 and 8-bit moments, in turns.
int CompareStateDtypes(const Config& c) {
  struct Side {
    const char* name;
    DType moments;
    std::unique_ptr<testing::TempDir> tmp;
    std::unique_ptr<testing::DaemonProcess> daemon;
    std::unique_ptr<Job> job;
    std::vector<double> b;
    uint64_t read = 0, written = 0;
  };
  std::vector<Side> sides;
  for (auto [name, moments] : {std::pair{"fp32", DType::kFloat32}, std::pair{"bf16", DType::kBFloat16},
                               std::pair{"8bit", DType::kBlock8}}) {
    Side side{name, moments};
    side.tmp = std::make_unique<testing::TempDir>();
    side.daemon = std::make_unique<testing::DaemonProcess>(
        WorkDir(c, *side.tmp), std::vector<std::string>{"--dram-budget", std::to_string(c.budget), "--log-level", "warn"});
    Check(side.daemon->Start(), "start fuyoud");
    side.job = std::make_unique<Job>(*side.daemon, c.layers, c.chunk_params, c.slots, moments);
    side.job->OptimizerStep();  // warm-up
    fmt::print("{}: {} layers x {} params = {} MiB of states, DRAM budget {} MiB ({:.1f}x)\n", name, c.layers,
               c.chunk_params, (StateBytesPerParam(moments) * c.chunk_params * c.layers) >> 20, c.budget >> 20,
               static_cast<double>(StateBytesPerParam(moments) * c.chunk_params * c.layers) /
                   static_cast<double>(c.budget));
    sides.push_back(std::move(side));
  }
  for (int round = 0; round < c.rounds; ++round) {
    for (Side& side : sides) {
      const StorageBytes before = BytesMoved(*side.daemon);
      const auto t0 = Clock::now();
      side.job->OptimizerStep();
      side.b.push_back(Seconds(t0, Clock::now()));
      const StorageBytes after = BytesMoved(*side.daemon);
      side.read = after.read - before.read;
      side.written = after.written - before.written;
    }
  }
  fmt::print("\n{:<6} {:>12} {:>14} {:>16} {:>12}\n", "states", "(b) median s", "SSD read MiB", "SSD written MiB",
             "fp32 / this");
  const double fp32 = Median(sides[0].b);
  for (Side& side : sides) {
    fmt::print("{:<6} {:>12.3f} {:>14} {:>16} {:>11.2f}x\n", side.name, Median(side.b), side.read >> 20,
               side.written >> 20, fp32 / Median(side.b));
  }
  fmt::print("8bit vs bf16: {:.2f}x (goals: 8bit >= 1.8x fp32, >= 1.15x bf16)\n",
             Median(sides[1].b) / Median(sides[2].b));
  for (Side& side : sides) {
    Check(side.job->session().Close(), "close");
    side.job.reset();
    side.daemon->Stop();
  }
  return 0;
}

RssRow MeasureRss(const Config& c, uint64_t state_bytes) {
  testing::TempDir tmp;
  const std::filesystem::path dir = WorkDir(c, tmp);
  testing::DaemonProcess daemon(dir, {"--dram-budget", std::to_string(c.budget), "--log-level", "warn"});
  Check(daemon.Start(), "start fuyoud");
  const auto layers =
      static_cast<uint32_t>(std::max<uint64_t>(1, state_bytes / (StateBytesPerParam(c) * c.chunk_params)));
  RssRow row{state_bytes, layers, 0, 0};
  {
    Job job(daemon, layers, c.chunk_params, c.slots, c.moments_dtype);
    for (int s = 0; s < 2; ++s) {
      const auto t0 = Clock::now();
      job.OptimizerStep();
      row.step_s = Seconds(t0, Clock::now());
    }
    row.hwm_kib = ProcStatusKiB(daemon.pid(), "VmHWM");
    Check(job.session().Close(), "close");
  }
  daemon.Stop();
  if (!c.dir.empty()) std::filesystem::remove_all(dir);
  return row;
}

int Main(int argc, char** argv) {
  Config c = ParseArgs(argc, argv);
  if (c.compare_state_dtypes) return CompareStateDtypes(c);
  const uint64_t state_bytes = StateBytesPerParam(c) * c.chunk_params * c.layers;
  testing::TempDir tmp;
  const std::filesystem::path dir = WorkDir(c, tmp);
  const auto trace_path = dir / "trace.jsonl";
  ::setenv("FUYOU_TRACE", trace_path.c_str(), 1);
  testing::DaemonProcess daemon(dir, {"--dram-budget", std::to_string(c.budget), "--log-level", "warn"});
  Check(daemon.Start(), "start fuyoud");
  ::unsetenv("FUYOU_TRACE");
  fmt::print("overlap_bench: {} layers x {} params = {} MiB of states, DRAM budget {} MiB ({:.1f}x), slots {}\n",
             c.layers, c.chunk_params, state_bytes >> 20, c.budget >> 20,
             static_cast<double>(state_bytes) / static_cast<double>(c.budget), c.slots);

  Figures f;
  std::vector<Interval> last_backward;
  int64_t last_start = 0, last_end = 0;
  int64_t last_b_start = 0, last_b_end = 0;  // the last (b), for its busy times
  uint64_t read_per_step = 0, written_per_step = 0;
  std::unique_ptr<MixedIoProbe> probe;  // made once (b)'s volumes are known
  {
    Job job(daemon, c.layers, c.chunk_params, c.slots, c.moments_dtype);
    job.OptimizerStep();  // warm-up: pages, caches, the daemon's order prediction
    if (c.layer_ms < 0) {
      std::vector<double> b;
      for (int i = 0; i < 2; ++i) {
        const auto t0 = Clock::now();
        job.OptimizerStep();
        b.push_back(Seconds(t0, Clock::now()));
      }
      c.layer_ms = 1e3 * Median(b) / c.layers;
    }
    fmt::print("backward: {} waits of {:.2f} ms\n", c.layers, c.layer_ms);
    for (int round = 0; round < c.rounds; ++round) {
      // (a) backward alone.
      auto t0 = Clock::now();
      for (uint32_t i = 0; i < c.layers; ++i) Backward(c.layers - 1 - i, c.layer_ms);
      f.a.push_back(Seconds(t0, Clock::now()));
      // (b) optimizer + I/O alone.
      const StorageBytes before = BytesMoved(daemon);
      last_b_start = NowUs();
      t0 = Clock::now();
      job.OptimizerStep();
      f.b.push_back(Seconds(t0, Clock::now()));
      last_b_end = NowUs();
      const StorageBytes after = BytesMoved(daemon);
      read_per_step = after.read - before.read;
      written_per_step = after.written - before.written;
      // The plain io_uring probe of the same volumes, read and written at once.
      if (probe == nullptr) {
        probe = std::make_unique<MixedIoProbe>(dir, MixedIoProbeConfig{.read_bytes = read_per_step,
                                                                       .write_bytes = written_per_step});
      }
      f.probe.push_back(probe->MeasureSeconds());
      // (c) overlapped. The hand-over (copy into the slot, GradReady, collecting
      // weights when slots run out) runs on a second thread, as a GPU's copy
      // engine and side stream would, so backward's waits do not include it.
      std::vector<Interval> backward;
      last_start = NowUs();
      t0 = Clock::now();
      {
        std::mutex mu;
        std::condition_variable ready;
        std::deque<uint32_t> queue;
        bool done = false;
        std::thread sender([&] {
          for (;;) {
            std::unique_lock lock(mu);
            ready.wait(lock, [&] { return done || !queue.empty(); });
            if (queue.empty()) return;
            const uint32_t layer = queue.front();
            queue.pop_front();
            lock.unlock();
            job.Send(layer);
          }
        });
        for (uint32_t i = 0; i < c.layers; ++i) {
          const uint32_t layer = c.layers - 1 - i;
          backward.push_back(Backward(layer, c.layer_ms));
          std::lock_guard lock(mu);
          queue.push_back(layer);
          ready.notify_one();
        }
        {
          std::lock_guard lock(mu);
          done = true;
          ready.notify_one();
        }
        sender.join();
      }
      job.EndStep();
      f.c.push_back(Seconds(t0, Clock::now()));
      last_end = NowUs();
      last_backward = std::move(backward);
      // (d) serial: all of backward, then every update.
      t0 = Clock::now();
      for (uint32_t i = 0; i < c.layers; ++i) Backward(c.layers - 1 - i, c.layer_ms);
      job.OptimizerStep();
      f.d.push_back(Seconds(t0, Clock::now()));
    }
    Check(job.session().Close(), "close");
  }
  probe.reset();
  const int64_t main_hwm = ProcStatusKiB(daemon.pid(), "VmHWM");
  daemon.Stop();

  const double a = Median(f.a), b = Median(f.b), cc = Median(f.c), d = Median(f.d), p = Median(f.probe);
  const double of_probe = p / b;  // (b)'s rate as a fraction of the probe's
  const double ratio = cc / std::max(a, b);
  const double speedup = d / cc;
  fmt::print("\n{:<34} {:>10}\n", "step (median of " + std::to_string(c.rounds) + ")", "seconds");
  fmt::print("{:<34} {:>10.3f}\n", "(a) backward alone", a);
  fmt::print("{:<34} {:>10.3f}\n", "(b) optimizer + SSD I/O alone", b);
  fmt::print("{:<34} {:>10.3f}\n", "(c) overlapped (fuyou)", cc);
  fmt::print("{:<34} {:>10.3f}\n", "(d) serial (ZeRO-Infinity order)", d);
  fmt::print("{:<34} {:>10.3f}\n", "(p) plain io_uring, same bytes", p);
  fmt::print("overlapped / max(a, b) = {:.3f} (target <= 1.10); serial / overlapped = {:.2f}x\n", ratio, speedup);
  fmt::print("(b) / probe = {:.3f} of the disk's mixed rate (target >= 0.9): {} MiB read + {} MiB written, "
             "(b) {:.2f} GB/s, probe {:.2f} GB/s (O_DIRECT, QD 32, 1 MiB)\n",
             of_probe, read_per_step >> 20, written_per_step >> 20,
             static_cast<double>(read_per_step + written_per_step) / b / 1e9,
             static_cast<double>(read_per_step + written_per_step) / p / 1e9);
  fmt::print("SSD bytes read per step {} MiB; daemon peak RSS {} MiB (budget {} MiB + {} MiB segment)\n",
             read_per_step >> 20, main_hwm / 1024, c.budget >> 20, (uint64_t{2} * c.slots * 4 * c.chunk_params) >> 20);

  const std::vector<TraceEvent> trace = ReadTrace(trace_path);
  {
    // What bounds (b): the daemon's kernel time (updates, on the CPU) against
    // the time the SSD had a read or a write in flight.
    const double b_s = (last_b_end - last_b_start) / 1e6;
    const double update = BusySeconds(trace, last_b_start, last_b_end, {"update"});
    const double ssd = BusySeconds(trace, last_b_start, last_b_end, {"ssd_read", "ssd_write"});
    fmt::print("last (b) {:.3f} s; busy: update {:.3f} ({:.2f} of it), SSD read or write in flight {:.3f} ({:.2f})\n",
               b_s, update, update / b_s, ssd, ssd / b_s);
  }

  // Timeline of the last overlapped step.
  std::vector<TraceEvent> events;
  for (const TraceEvent& e : trace) {
    if (e.end_us >= last_start && e.start_us <= last_end) events.push_back(e);
  }
  std::map<std::string, double> busy;  // seconds each resource was busy (union of intervals)
  {
    std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> spans;
    for (const Interval& i : last_backward) spans["backward"].push_back({i.start_us, i.end_us});
    for (const TraceEvent& e : events) spans[e.event].push_back({std::max(e.start_us, last_start), std::min(e.end_us, last_end)});
    for (auto& [name, list] : spans) {
      std::sort(list.begin(), list.end());
      int64_t total = 0, cur_s = -1, cur_e = -1;
      for (auto [s, e] : list) {
        if (s > cur_e) {
          total += cur_e - cur_s;
          cur_s = s;
          cur_e = e;
        } else {
          cur_e = std::max(cur_e, e);
        }
      }
      total += cur_e - cur_s;
      busy[name] = total / 1e6;
    }
  }
  const double step_s = (last_end - last_start) / 1e6;
  fmt::print("last overlapped step {:.3f} s; busy: backward {:.3f}, update {:.3f}, ssd_read {:.3f}, ssd_write {:.3f}\n",
             step_s, busy["backward"], busy["update"], busy["ssd_read"], busy["ssd_write"]);
  std::string timeline = c.timeline.empty() ? (dir / "timeline.json").string() : c.timeline;
  if (!c.png.empty() || !c.timeline.empty()) {
    std::FILE* out = std::fopen(timeline.c_str(), "w");
    if (out == nullptr) Die("cannot write " + timeline);
    fmt::print(out, "{{\"step_start_us\":{},\"step_end_us\":{},\"layers\":{},\"layer_ms\":{:.3f},\"events\":[",
               last_start, last_end, c.layers, c.layer_ms);
    bool first = true;
    for (const Interval& i : last_backward) {
      fmt::print(out, "{}{{\"event\":\"backward\",\"chunk\":{},\"start_us\":{},\"end_us\":{}}}", first ? "" : ",",
                 i.chunk, i.start_us, i.end_us);
      first = false;
    }
    for (const TraceEvent& e : events) {
      fmt::print(out, ",{{\"event\":\"{}\",\"chunk\":{},\"start_us\":{},\"end_us\":{}}}", e.event, e.chunk,
                 e.start_us, e.end_us);
    }
    fmt::print(out, "]}}\n");
    std::fclose(out);
    if (!c.timeline.empty()) fmt::print("timeline: {}\n", timeline);
  }
  if (!c.png.empty()) {
    const std::string command =
        fmt::format("{} {}/plot_timeline.py '{}' '{}'", FUYOU_BENCH_PYTHON, FUYOU_BENCH_SOURCE_DIR, timeline, c.png);
    if (std::system(command.c_str()) != 0) fmt::print(stderr, "overlap_bench: plotting failed: {}\n", command);
    else fmt::print("timeline picture: {}\n", c.png);
  }

  // Peak RSS of a fresh daemon per model size, same budget.
  std::vector<RssRow> rss;
  for (uint64_t size : c.rss_sizes) rss.push_back(MeasureRss(c, size));
  if (!rss.empty()) {
    fmt::print("\n{:>12} {:>7} {:>10} {:>14} {:>12}\n", "states MiB", "chunks", "step s", "peak RSS MiB",
               "limit MiB");
    for (const RssRow& r : rss) {
      fmt::print("{:>12} {:>7} {:>10.3f} {:>14} {:>12}\n", r.state_bytes >> 20, r.chunks, r.step_s, r.hwm_kib / 1024,
                 (c.budget >> 20) + 256);
    }
  }
  if (!c.json.empty()) {
    std::FILE* out = std::fopen(c.json.c_str(), "w");
    if (out == nullptr) Die("cannot write " + c.json);
    auto list = [](const std::vector<double>& v) {
      std::string s = "[";
      for (size_t i = 0; i < v.size(); ++i) s += fmt::format("{}{:.4f}", i ? "," : "", v[i]);
      return s + "]";
    };
    fmt::print(out,
               "{{\"benchmark\":\"overlap_bench\",\"layers\":{},\"chunk_params\":{},\"state_bytes\":{},"
               "\"budget_bytes\":{},\"slots\":{},\"layer_ms\":{:.3f},\"rounds\":{},"
               "\"backward_s\":{:.4f},\"optimizer_io_s\":{:.4f},\"overlapped_s\":{:.4f},\"serial_s\":{:.4f},"
               "\"overlapped_over_max\":{:.4f},\"speedup_over_serial\":{:.4f},\"probe_s\":{:.4f},\"optimizer_io_over_probe\":{:.4f},"
               "\"samples\":{{\"backward\":{},\"optimizer_io\":{},\"overlapped\":{},\"serial\":{}}},"
               "\"ssd_bytes_read_per_step\":{},\"ssd_bytes_written_per_step\":{},\"daemon_peak_rss_kib\":{},"
               "\"busy_s\":{{\"step\":{:.4f},\"backward\":{:.4f},\"update\":{:.4f},\"ssd_read\":{:.4f},"
               "\"ssd_write\":{:.4f}}},\"rss\":[",
               c.layers, c.chunk_params, state_bytes, c.budget, c.slots, c.layer_ms, c.rounds, a, b, cc, d, ratio,
               speedup, p, of_probe, list(f.a), list(f.b), list(f.c), list(f.d), read_per_step, written_per_step, main_hwm, step_s, busy["backward"],
               busy["update"], busy["ssd_read"], busy["ssd_write"]);
    for (size_t i = 0; i < rss.size(); ++i) {
      fmt::print(out, "{}{{\"state_bytes\":{},\"chunks\":{},\"step_s\":{:.4f},\"peak_rss_kib\":{}}}", i ? "," : "",
                 rss[i].state_bytes, rss[i].chunks, rss[i].step_s, rss[i].hwm_kib);
    }
    fmt::print(out, "]}}\n");
    std::fclose(out);
  }
  return 0;
}

}  // namespace
}  // namespace fuyou::bench

int main(int argc, char** argv) { return fuyou::bench::Main(argc, argv); }
