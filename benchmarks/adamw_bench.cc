// adamw_bench: the CPU AdamW kernel against an Adam-shaped memory-bandwidth probe,
// measured side by side in one run, for each thread count.
//
//   adamw_bench [--n=ELEMENTS] [--threads=1,2] [--reps=7] [--isa=avx512|avx2|scalar]
//               [--json=PATH]
//
// Rows (n elements each, far beyond the caches by default):
//   probe        read p,g,m,v; write p,m,v (fp32, 28 B/elem), trivial arithmetic
//   fp32         kernel: fp32 grad, no weights output          (28 B/elem)
//   fp32+out     kernel: fp32 grad, fp32 weights output        (32 B/elem)
//   bf16         kernel: bf16 grad, bf16 weights output        (28 B/elem)
//   fp16         kernel: fp16 grad, fp16 weights output        (28 B/elem)
//   bf16+mv      kernel: bf16 grad and output, bf16 m and v    (20 B/elem)
//   8bit+mv      kernel: bf16 grad and output, 8-bit m and v   (16 B/elem + scales)
// Variants run round-robin, --reps rounds after one warm-up round; the table gives
// the best round (and the median), and the ratio of each to the probe's.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "optimizer/adamw_kernel.h"
#include "optimizer/dtype_convert.h"

namespace fuyou::bench {
void AdamShapedProbeAvx512(float* p, const float* g, float* m, float* v, size_t begin,
                           size_t end);
}  // namespace fuyou::bench

namespace {

using fuyou::DType;
using fuyou::DTypeSize;
using namespace fuyou::optimizer;

// 64-byte aligned buffer, first touched (zeroed) on allocation.
struct Buffer {
  explicit Buffer(size_t bytes) : size(bytes) {
    data = static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    if (data == nullptr) {
      std::fprintf(stderr, "adamw_bench: out of memory allocating %zu bytes\n", bytes);
      std::exit(1);
    }
    std::memset(data, 0, bytes);
  }
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  float* f() { return reinterpret_cast<float*>(data); }
  uint8_t* data;
  size_t size;
};

void ProbeScalar(float* p, const float* g, float* m, float* v, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    m[i] = m[i] * 0.5f + g[i];
    v[i] = v[i] * 0.5f + g[i];
    p[i] = p[i] * 0.5f + m[i];
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Row {
  unsigned threads;
  std::string name;
  double bytes_per_elem;
  double seconds;  // best round
  double median_seconds;
  size_t n;
  double elems_per_s() const { return n / seconds; }
  double gb_per_s() const { return n * bytes_per_elem / seconds / 1e9; }
};

const Row& ProbeOf(const std::vector<Row>& rows, const Row& r) {
  for (const Row& q : rows) {
    if (q.threads == r.threads && q.name == "probe") return q;
  }
  return r;
}

std::vector<unsigned> ParseThreads(const std::string& s) {
  std::vector<unsigned> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    out.push_back(static_cast<unsigned>(std::stoul(s.substr(pos, comma - pos))));
    pos = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  size_t n = size_t{64} << 20;
  std::vector<unsigned> thread_counts = {1, 2};
  int reps = 7;
  std::string json_path;
  Isa isa = DetectIsa();
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    auto value = [&](const char* key) -> const char* {
      const size_t len = std::strlen(key);
      return arg.compare(0, len, key) == 0 ? arg.c_str() + len : nullptr;
    };
    if (const char* v = value("--n=")) {
      n = std::stoull(v);
    } else if (const char* v = value("--threads=")) {
      thread_counts = ParseThreads(v);
    } else if (const char* v = value("--reps=")) {
      reps = std::max(1, std::atoi(v));
    } else if (const char* v = value("--json=")) {
      json_path = v;
    } else if (const char* v = value("--isa=")) {
      const std::string s = v;
      isa = s == "scalar" ? Isa::kScalar : s == "avx2" ? Isa::kAvx2 : Isa::kAvx512;
      if (!IsaSupported(isa)) {
        std::fprintf(stderr, "adamw_bench: this CPU cannot run --isa=%s\n", v);
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: adamw_bench [--n=ELEMENTS] [--threads=1,2] [--reps=7] "
                   "[--isa=avx512|avx2|scalar] [--json=PATH]\n");
      return 2;
    }
  }
  n = std::max<size_t>(n, 64);

  Buffer p(n * 4), m(n * 4), v(n * 4), g32(n * 4), g16(n * 2), out(n * 4);
  for (size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;  // [-1, 1]
    p.f()[i] = x;
    g32.f()[i] = 0.01f * x;
  }
  ConvertFromFloat32(g32.f(), g16.data, DType::kBFloat16, n);  // overwritten per dtype below
  const bool probe_avx512 = __builtin_cpu_supports("avx512f");

  std::printf("adamw_bench: n=%zu elements (%.1f MiB of fp32 states), isa=%s, probe=%s, "
              "%d rounds\n",
              n, n * 12.0 / (1 << 20), std::string(IsaName(isa)).c_str(),
              probe_avx512 ? "avx512" : "scalar", reps);

  // The machine may be shared: every variant runs once per round, round after round,
  // so a burst of foreign load hits all of them alike. We report the best round
  // (what the hardware allows) and the median.
  Buffer pp(n * 4), pm(n * 4), pv(n * 4);  // the probe's own states
  Buffer m16(n * 2), v16(n * 2);           // bf16 moments (the bf16+mv row)
  // 8-bit moments (the 8bit+mv row): codes and a scale per block of 256.
  const size_t blocks = (n + fuyou::kMomentBlockElements - 1) / fuyou::kMomentBlockElements;
  Buffer m8(n), v8(n), m8s(blocks * 4), v8s(blocks * 4);
  std::vector<Row> rows;
  for (unsigned threads : thread_counts) {
    struct Variant {
      const char* name;
      bool probe;
      DType grad;
      bool with_out;
      double bytes;
      std::vector<double> secs;
      bool bf16_moments = false;
      bool block8_moments = false;
    };
    std::vector<Variant> variants = {{"probe", true, DType::kFloat32, false, 28, {}},
                                     {"fp32", false, DType::kFloat32, false, 28, {}},
                                     {"fp32+out", false, DType::kFloat32, true, 32, {}},
                                     {"bf16", false, DType::kBFloat16, true, 28, {}},
                                     {"fp16", false, DType::kFloat16, true, 28, {}},
                                     {"bf16+mv", false, DType::kBFloat16, true, 20, {}, true},
                                     {"8bit+mv", false, DType::kBFloat16, true, 16, {}, false, true}};
    // Fresh, sane states for this thread count.
    std::memcpy(p.data, g32.data, n * 4);
    std::memset(m.data, 0, n * 4);
    std::memset(v.data, 0, n * 4);
    std::memset(m16.data, 0, n * 2);
    std::memset(v16.data, 0, n * 2);
    for (Buffer* b : {&m8, &v8, &m8s, &v8s}) std::memset(b->data, 0, b->size);
    std::memcpy(pp.data, g32.data, n * 4);
    std::memset(pm.data, 0, n * 4);
    std::memset(pv.data, 0, n * 4);
    AdamWKernel kernel(threads, isa);
    int64_t step = 0;

    auto run_probe = [&] {
      // Split like the kernel does; one std::thread per extra share.
      const size_t per = (n + threads - 1) / threads / 64 * 64 + 64;
      auto share = [&](unsigned t) {
        const size_t b = std::min(n, t * per), e = std::min(n, b + per);
        (probe_avx512 ? fuyou::bench::AdamShapedProbeAvx512 : ProbeScalar)(pp.f(), g32.f(),
                                                                          pm.f(), pv.f(), b, e);
      };
      std::vector<std::thread> extra;
      for (unsigned t = 1; t < threads; ++t) extra.emplace_back(share, t);
      share(0);
      for (std::thread& th : extra) th.join();
    };
    auto run_kernel = [&](const Variant& c) {
      AdamWBuffers b;
      b.master = p.f();
      b.exp_avg = c.bf16_moments ? m16.data : m.data;
      b.exp_avg_sq = c.bf16_moments ? v16.data : v.data;
      b.moments_dtype = c.bf16_moments ? DType::kBFloat16 : DType::kFloat32;
      if (c.block8_moments) {
        b.exp_avg = m8.data;
        b.exp_avg_sq = v8.data;
        b.moments_dtype = DType::kBlock8;
        b.exp_avg_scales = m8s.f();
        b.exp_avg_sq_scales = v8s.f();
        b.chunk_elements = n;
      }
      b.grad = c.grad == DType::kFloat32 ? static_cast<const void*>(g32.data) : g16.data;
      b.grad_dtype = c.grad;
      b.weights_out = c.with_out ? out.data : nullptr;
      b.weight_dtype = c.grad;
      b.n = n;
      AdamWStepParams params;
      params.step = ++step;
      kernel.Update(params, b);
    };
    for (int round = 0; round <= reps; ++round) {  // round 0 warms up
      for (Variant& c : variants) {
        // Both 16-bit gradient variants share g16: convert before the clock starts.
        if (c.grad != DType::kFloat32) ConvertFromFloat32(g32.f(), g16.data, c.grad, n);
        const auto t0 = std::chrono::steady_clock::now();
        if (c.probe) {
          run_probe();
        } else {
          run_kernel(c);
        }
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (round > 0) c.secs.push_back(secs);
      }
    }
    for (const Variant& c : variants) {
      rows.push_back({threads, c.name, c.bytes, *std::min_element(c.secs.begin(), c.secs.end()),
                      Median(c.secs), n});
    }
  }

  std::printf("\n%-8s %-9s %9s %9s %9s %8s %10s %12s\n", "threads", "variant", "best ms",
              "median ms", "Gelem/s", "GB/s", "vs probe", "(median)");
  for (const Row& r : rows) {
    const Row& probe = ProbeOf(rows, r);
    std::printf("%-8u %-9s %9.2f %9.2f %9.3f %8.2f %9.1f%% %11.1f%%\n", r.threads,
                r.name.c_str(), r.seconds * 1e3, r.median_seconds * 1e3, r.elems_per_s() / 1e9,
                r.gb_per_s(), 100.0 * probe.seconds / r.seconds,
                100.0 * probe.median_seconds / r.median_seconds);
  }

  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << "{\n  \"n\": " << n << ",\n  \"isa\": \"" << IsaName(isa) << "\",\n  \"reps\": " << reps
      << ",\n  \"probe_isa\": \"" << (probe_avx512 ? "avx512" : "scalar") << "\",\n  \"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const Row& probe = ProbeOf(rows, r);
      char line[640];
      std::snprintf(line, sizeof line,
                    "    {\"threads\": %u, \"variant\": \"%s\", \"bytes_per_elem\": %.0f, "
                    "\"best_seconds\": %.6f, \"median_seconds\": %.6f, \"elems_per_s\": %.6e, "
                    "\"gb_per_s\": %.3f, \"ratio_vs_probe\": %.4f, "
                    "\"ratio_vs_probe_median\": %.4f}%s\n",
                    r.threads, r.name.c_str(), r.bytes_per_elem, r.seconds, r.median_seconds,
                    r.elems_per_s(), r.gb_per_s(), probe.seconds / r.seconds,
                    probe.median_seconds / r.median_seconds, i + 1 < rows.size() ? "," : "");
      f << line;
    }
    f << "  ]\n}\n";
    if (!f) {
      std::fprintf(stderr, "adamw_bench: cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::printf("\nwrote %s\n", json_path.c_str());
  }
  return 0;
}
