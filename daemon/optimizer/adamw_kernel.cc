#include "optimizer/adamw_kernel.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/fair_mutex.h"
#include "common/future.h"
#include "optimizer/adamw_kernel_internal.h"

namespace fuyou::optimizer {
namespace internal {

StepConstants MakeStepConstants(const AdamWStepParams& p) {
  const double lr = p.lr;
  const double beta1 = p.beta1;
  const double beta2 = p.beta2;
  const double t = static_cast<double>(p.step);
  const double bc1 = 1.0 - std::pow(beta1, t);
  const double bc2 = 1.0 - std::pow(beta2, t);
  const double step_size = lr / bc1;
  const double bc2_sqrt = std::sqrt(bc2);
  StepConstants c;
  c.decay = static_cast<float>(1.0 - lr * static_cast<double>(p.weight_decay));
  c.beta1 = p.beta1;
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = p.beta2;
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.step_size = static_cast<float>(step_size);
  c.bc2_sqrt = static_cast<float>(bc2_sqrt);
  c.eps = p.eps;
  c.grad_scale = p.grad_scale;
  c.simd_step_size = static_cast<float>(step_size * bc2_sqrt);
  c.simd_eps = static_cast<float>(static_cast<double>(p.eps) * bc2_sqrt);
  c.rounding_key = StochasticRoundingKey(p.step);
  return c;
}

namespace {

// The reference: torch.optim.AdamW's order of operations, one rounding per torch op.
// kBf16Moments: m and v are bf16, widened on load and rounded on store (m to
// nearest even, v stochastically), the arithmetic unchanged.
template <DType kGrad, DType kOut, bool kBf16Moments>
void ScalarLoop(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end) {
  float* __restrict p = b.master;
  float* __restrict m32 = static_cast<float*>(b.exp_avg);
  float* __restrict v32 = static_cast<float*>(b.exp_avg_sq);
  uint16_t* __restrict m16 = static_cast<uint16_t*>(b.exp_avg);
  uint16_t* __restrict v16 = static_cast<uint16_t*>(b.exp_avg_sq);
  for (size_t i = begin; i < end; ++i) {
    float g = ScalarLoadGrad<kGrad>(b.grad, i);
    if (c.grad_scale != 1.0f) g = g * c.grad_scale;
    float pi = p[i] * c.decay;
    float mi = (kBf16Moments ? BFloat16ToFloat(m16[i]) : m32[i]) * c.beta1;
    mi = mi + c.one_minus_beta1 * g;
    float vi = (kBf16Moments ? BFloat16ToFloat(v16[i]) : v32[i]) * c.beta2;
    vi = vi + (c.one_minus_beta2 * g) * g;
    float denom = std::sqrt(vi) / c.bc2_sqrt;
    denom = denom + c.eps;
    pi = pi - (c.step_size * mi) / denom;
    p[i] = pi;
    if constexpr (kBf16Moments) {
      m16[i] = FloatToBFloat16(mi);
      v16[i] = FloatToBFloat16Stochastic(vi, RoundingNoise(c.rounding_key, b.first_element + i));
    } else {
      m32[i] = mi;
      v32[i] = vi;
    }
    ScalarStoreWeight<kOut>(b.weights_out, i, pi);
  }
}

template <DType kGrad, DType kOut>
void ScalarDispatchMoments(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end) {
  if (b.moments_dtype == DType::kBFloat16) return ScalarLoop<kGrad, kOut, true>(c, b, begin, end);
  return ScalarLoop<kGrad, kOut, false>(c, b, begin, end);
}

template <DType kGrad>
void ScalarDispatchOut(const StepConstants& c, const AdamWBuffers& b, size_t begin,
                       size_t end) {
  if (b.weights_out == nullptr) return ScalarDispatchMoments<kGrad, DType::kUnspecified>(c, b, begin, end);
  switch (b.weight_dtype) {
    case DType::kFloat32: return ScalarDispatchMoments<kGrad, DType::kFloat32>(c, b, begin, end);
    case DType::kBFloat16: return ScalarDispatchMoments<kGrad, DType::kBFloat16>(c, b, begin, end);
    case DType::kFloat16: return ScalarDispatchMoments<kGrad, DType::kFloat16>(c, b, begin, end);
    default: return;
  }
}

}  // namespace

void UpdateRangeScalar(const StepConstants& c, const AdamWBuffers& b, size_t begin,
                       size_t end) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return ScalarDispatchOut<DType::kFloat32>(c, b, begin, end);
    case DType::kBFloat16: return ScalarDispatchOut<DType::kBFloat16>(c, b, begin, end);
    case DType::kFloat16: return ScalarDispatchOut<DType::kFloat16>(c, b, begin, end);
    default: return;
  }
}

}  // namespace internal

namespace {

using internal::StepConstants;

bool CpuSupports(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2:
#if defined(FUYOU_OPTIMIZER_HAVE_AVX2)
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
#else
      return false;
#endif
    case Isa::kAvx512:
#if defined(FUYOU_OPTIMIZER_HAVE_AVX512)
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
      return false;
#endif
  }
  return false;
}

Isa DetectIsaUncached() {
  Isa best = Isa::kScalar;
  if (CpuSupports(Isa::kAvx2)) best = Isa::kAvx2;
  if (CpuSupports(Isa::kAvx512)) best = Isa::kAvx512;
  // FUYOU_OPTIMIZER_ISA=scalar|avx2|avx512 lowers the choice (for tests and
  // comparisons); it never selects an ISA the CPU lacks.
  if (const char* env = std::getenv("FUYOU_OPTIMIZER_ISA"); env != nullptr) {
    const std::string want(env);
    Isa wanted = best;
    if (want == "scalar") wanted = Isa::kScalar;
    if (want == "avx2") wanted = Isa::kAvx2;
    if (want == "avx512") wanted = Isa::kAvx512;
    if (static_cast<int>(wanted) < static_cast<int>(best) && CpuSupports(wanted)) best = wanted;
  }
  return best;
}

bool ValidDTypes(const AdamWBuffers& b) {
  const bool block8 = b.moments_dtype == DType::kBlock8 && b.exp_avg_scales != nullptr &&
                      b.exp_avg_sq_scales != nullptr && b.first_element + b.n <= b.chunk_elements;
  return IsValidDType(b.grad_dtype) &&
         (b.moments_dtype == DType::kFloat32 || b.moments_dtype == DType::kBFloat16 || block8) &&
         (b.weights_out == nullptr || IsValidDType(b.weight_dtype));
}

void RunRangeBlock8(Isa isa, const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end) {
  switch (isa) {
#if defined(FUYOU_OPTIMIZER_HAVE_AVX512)
    case Isa::kAvx512:
      return internal::UpdateRangeBlock8(internal::UpdateBlock8Avx512, internal::EncodeBlock8Avx512, c, b, begin, end);
#endif
#if defined(FUYOU_OPTIMIZER_HAVE_AVX2)
    case Isa::kAvx2:
      return internal::UpdateRangeBlock8(internal::UpdateBlock8Avx2, internal::EncodeBlock8Avx2, c, b, begin, end);
#endif
    default:
      return internal::UpdateRangeBlock8(internal::UpdateBlock8Scalar, internal::EncodeBlock8Scalar, c, b, begin, end);
  }
}

void RunRange(Isa isa, const StepConstants& c, const AdamWBuffers& b, size_t begin,
              size_t end) {
  if (begin >= end) return;
  if (b.moments_dtype == DType::kBlock8) return RunRangeBlock8(isa, c, b, begin, end);
  switch (isa) {
#if defined(FUYOU_OPTIMIZER_HAVE_AVX512)
    case Isa::kAvx512: return internal::UpdateRangeAvx512(c, b, begin, end);
#endif
#if defined(FUYOU_OPTIMIZER_HAVE_AVX2)
    case Isa::kAvx2: return internal::UpdateRangeAvx2(c, b, begin, end);
#endif
    default: return internal::UpdateRangeScalar(c, b, begin, end);
  }
}

// Ranges handed to threads start on multiples of this many elements (256 bytes of
// fp32 state), so no two threads share a cache line of any buffer.
constexpr size_t kAlignElements = 64;

// Rounds `at` (an element of `b`, <= b.n) up to where a slice or a thread's
// range may start: a multiple of kAlignElements, or with 8-bit moments the
// start of a block of the chunk (so that no two ranges share a block).
size_t AlignRangeStart(const AdamWBuffers& b, size_t at) {
  if (b.moments_dtype != DType::kBlock8) {
    return std::min(b.n, (at + kAlignElements - 1) / kAlignElements * kAlignElements);
  }
  const uint64_t element = b.first_element + at;
  const uint64_t aligned = (element + kMomentBlockElements - 1) / kMomentBlockElements * kMomentBlockElements;
  return static_cast<size_t>(std::min<uint64_t>(b.n, aligned - b.first_element));
}
// Below this many elements per thread, waking a worker costs more than it saves.
constexpr size_t kMinElementsPerThread = 32 * 1024;

}  // namespace

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

Isa DetectIsa() {
  static const Isa isa = DetectIsaUncached();
  return isa;
}

bool IsaSupported(Isa isa) { return CpuSupports(isa); }

void AdamWUpdateRange(Isa isa, const AdamWStepParams& params, const AdamWBuffers& buffers,
                      size_t begin, size_t end) {
  assert(ValidDTypes(buffers));
  if (!ValidDTypes(buffers)) return;
  end = std::min(end, buffers.n);
  RunRange(isa, internal::MakeStepConstants(params), buffers, begin, end);
}

// ---- The worker pool ------------------------------------------------------------

// threads_ - 1 workers plus the calling thread, which takes share 0 of every slice.
// One slice at a time: Update holds turns_ for each slice it runs, and concurrent
// callers (sessions) get it in FairMutex's order (by bytes, per user, then per
// session), so the slices of different updates interleave.
//
// Slices reach the workers as a chain of futures: every worker waits on the
// Future of the next Job, and each Job carries the Future of the one after it.
// RunSlice publishes a Job by setting the pool's Promise (after making a new one
// for the Job after), runs share 0 and waits for the Job's Countdown; the pool
// stops by setting the Promise with CANCELLED. Three small allocations per
// slice that uses workers (the Job, its Countdown's result, the next Job's
// promise), none per element.
class AdamWKernel::Pool {
 public:
  Pool(unsigned threads, Isa isa, uint64_t slice_bytes)
      : threads_(threads == 0 ? DefaultThreads() : threads),
        isa_(isa),
        slice_bytes_(std::max<uint64_t>(slice_bytes, uint64_t{threads_} * kMinElementsPerThread * kMostBytesPerElement)),
        turns_(slice_bytes_) {
    workers_.reserve(threads_ - 1);
    const Future<JobRef> first = next_job_.future();
    // Each worker's lambda moves its copy of `first` (a non-const init-capture:
    // a plain capture of the const local would be const and only copy) into
    // WorkerLoop, which lets go of every Job it has passed. A copy kept in the
    // lambda held the whole chain of Jobs (one per update, now one per slice)
    // for the pool's life, and destroying it recursed once per Job: a stack
    // overflow at shutdown after some 10^6 slices.
    for (unsigned i = 1; i < threads_; ++i) {
      workers_.emplace_back([this, i, next = first]() mutable { WorkerLoop(i, std::move(next)); });
    }
  }

  ~Pool() {
    next_job_.Set(absl::CancelledError("the AdamW kernel pool is stopping"));
    for (std::thread& t : workers_) t.join();
  }

  void Update(const AdamWStepParams& params, const AdamWBuffers& buffers, FairKey tenant) {
    assert(ValidDTypes(buffers));
    if (!ValidDTypes(buffers) || buffers.n == 0) return;
    const StepConstants c = internal::MakeStepConstants(params);
    const uint64_t per_element = BytesPerElement(buffers);
    const size_t slice = static_cast<size_t>(std::max<uint64_t>(1, slice_bytes_ / per_element));
    const size_t n = buffers.n;
    for (size_t begin = 0, end = 0; begin < n; begin = end) {
      end = AlignRangeStart(buffers, std::max(begin + slice, AlignRangeStart(buffers, begin + 1)));
      turns_.Lock(tenant, (end - begin) * per_element);
      RunSlice(c, buffers, begin, end);
      turns_.Unlock();
    }
  }

  unsigned threads() const { return threads_; }
  Isa isa() const { return isa_; }
  uint64_t slice_bytes() const { return slice_bytes_; }

 private:
  // The most state bytes one element moves: fp32 master read and written, fp32
  // m and v read and written, an fp32 gradient read and an fp32 weight written.
  static constexpr uint64_t kMostBytesPerElement = 4 * 2 + 4 * 2 * 2 + 4 + 4;

  // What one element of `b` reads and writes, in bytes: the cost of the work
  // (8-bit moments: a code each, their scales rounded away).
  static uint64_t BytesPerElement(const AdamWBuffers& b) {
    const uint64_t moments = b.moments_dtype == DType::kBFloat16 ? 2 : b.moments_dtype == DType::kBlock8 ? 1 : 4;
    uint64_t bytes = 4 * 2 + moments * 2 * 2 + DTypeSize(b.grad_dtype);
    if (b.weights_out != nullptr) bytes += DTypeSize(b.weight_dtype);
    return bytes;
  }

  // Runs elements [begin, end) of `buffers` on every thread it is worth waking,
  // blocking until all are done. The caller holds turns_.
  void RunSlice(const StepConstants& c, const AdamWBuffers& buffers, size_t begin, size_t end) {
    const size_t n = end - begin;
    const size_t shares = std::min<size_t>(threads_, std::max<size_t>(1, n / kMinElementsPerThread));
    if (shares <= 1) {
      RunRange(isa_, c, buffers, begin, end);
      return;
    }
    size_t per = (n + shares - 1) / shares;
    per = (per + kAlignElements - 1) / kAlignElements * kAlignElements;
    Promise<JobRef> after;
    auto job = std::make_shared<Job>(c, buffers, begin, end, per, shares, after.future());
    const Future<void> done = job->done.future();
    Promise<JobRef> publish = std::exchange(next_job_, std::move(after));
    publish.Set(JobRef(std::move(job)));
    RunRange(isa_, c, buffers, begin, ShareBound(buffers, begin, end, per, 1));
    done.Wait();
  }

  // Where share k of the slice [begin, end) starts: begin + k * per, moved to
  // where a range may start (AlignRangeStart: a no-op for fp32 and bf16
  // moments, whose slices start on multiples of kAlignElements).
  static size_t ShareBound(const AdamWBuffers& b, size_t begin, size_t end, size_t per, size_t k) {
    return k == 0 ? begin : std::min(end, AlignRangeStart(b, std::min(end, begin + k * per)));
  }

  // One slice, [begin, end), split into `shares` ranges of `per` elements; share 0
  // is the caller's, the workers 1..shares-1 Arrive at `done`. The constants
  // and buffers are the caller's, alive until `done` is set.
  struct Job;
  using JobRef = std::shared_ptr<const Job>;
  struct Job {
    Job(const StepConstants& c, const AdamWBuffers& b, size_t begin, size_t end, size_t per, size_t shares,
        Future<JobRef> next)
        : constants(c), buffers(b), begin(begin), end(end), per(per), shares(shares), done(shares - 1),
          next(std::move(next)) {}
    const StepConstants& constants;
    const AdamWBuffers& buffers;
    const size_t begin;
    const size_t end;
    const size_t per;
    const size_t shares;
    mutable Countdown done;
    const Future<JobRef> next;  // the Job after this one, or CANCELLED: the pool stops
  };

  static unsigned DefaultThreads() {
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : hw;
  }

  void WorkerLoop(unsigned index, Future<JobRef> next) const {
    for (;;) {
      const absl::StatusOr<JobRef>& published = next.Wait();
      if (!published.ok()) return;  // the pool is stopping
      const Job& job = **published;
      if (index < job.shares) {  // else this update needs fewer threads
        RunRange(isa_, job.constants, job.buffers, ShareBound(job.buffers, job.begin, job.end, job.per, index),
                 ShareBound(job.buffers, job.begin, job.end, job.per, index + 1));
        job.done.Arrive();  // the caller may return now: job.constants and job.buffers end
      }
      Future<JobRef> after = job.next;  // `job` stays alive (held by `next`) until here
      next = std::move(after);
    }
  }

  const unsigned threads_;
  const Isa isa_;
  const uint64_t slice_bytes_;
  std::vector<std::thread> workers_;
  FairMutex turns_;           // one slice at a time, in fair turns; guards next_job_
  Promise<JobRef> next_job_;  // what the workers wait for: the next slice's Job
};

AdamWKernel::AdamWKernel(unsigned threads) : AdamWKernel(threads, DetectIsa()) {}

AdamWKernel::AdamWKernel(unsigned threads, Isa isa, uint64_t slice_bytes)
    : pool_(std::make_unique<Pool>(threads, CpuSupports(isa) ? isa : DetectIsa(), slice_bytes)) {}

AdamWKernel::~AdamWKernel() = default;

void AdamWKernel::Update(const AdamWStepParams& params, const AdamWBuffers& buffers, FairKey tenant) {
  pool_->Update(params, buffers, tenant);
}

unsigned AdamWKernel::threads() const { return pool_->threads(); }
Isa AdamWKernel::isa() const { return pool_->isa(); }
uint64_t AdamWKernel::slice_bytes() const { return pool_->slice_bytes(); }

}  // namespace fuyou::optimizer
