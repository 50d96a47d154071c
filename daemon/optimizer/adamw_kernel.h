// AdamWKernel: the CPU optimizer of fuyoud. One call updates one chunk.
//
// Semantics are torch.optim.AdamW's (decoupled weight decay, bias correction):
//   g       = grad * grad_scale
//   master  = master * (1 - lr * weight_decay)
//   m       = beta1 * m + (1 - beta1) * g
//   v       = beta2 * v + (1 - beta2) * g * g
//   denom   = sqrt(v) / sqrt(1 - beta2^t) + eps
//   master -= (lr / (1 - beta1^t)) * m / denom
//   weights_out = master rounded to weight_dtype (round-to-nearest-even)
// States: master fp32, m and v fp32, bf16 or 8-bit blocks (AdamWBuffers); gradients and weights are fp32, bf16
// or fp16.
// AVX-512 and AVX2 paths are chosen at run time; a scalar path is the fallback and
// the reference.
//
// Precision: the scalar path rounds exactly where torch does (one rounding per torch
// op, bias corrections in double), so with float-exact hyper-parameters it lands
// within one float ulp of torch. The SIMD paths use FMA and fold torch's two
// divisions into one (step_size*sqrt(bc2) * m / (sqrt(v) + eps*sqrt(bc2))): a few ulp
// of the update away from the scalar path. Within one ISA an element's result never
// depends on how [0, n) was split into ranges or threads.
// Note: the hyper-parameters are floats; torch computes 1 - beta with the Python
// double (0.9 rather than 0.9f), so for betas that are not exact in float the two
// can differ by one ulp in (1 - beta).
// Preconditions (checked by the caller, e.g. the session layer): step >= 1, valid
// dtypes (kUnspecified is ignored and the call does nothing; so are moments of
// a dtype other than fp32, bf16 or 8-bit blocks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "common/fair_queue.h"
#include "fuyou/dtype.h"

namespace fuyou::optimizer {

struct AdamWStepParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
  float grad_scale = 1.0f;
  int64_t step = 1;  // Adam's t for bias correction: 1 on a chunk's first update
};

// The buffers of one chunk update. `master` holds n fp32 values, `exp_avg` and
// `exp_avg_sq` n values of moments_dtype; all three are updated in place.
// `grad` holds n values of grad_dtype; `weights_out` receives n values of
// weight_dtype (may be null: no output). No buffer may overlap another.
//
// moments_dtype is kFloat32, kBFloat16 or kBlock8 (ChunkLayout::moments_dtype). With
// bf16 moments the kernel widens m and v to fp32 on load, computes exactly as
// with fp32 moments (the master update uses the unrounded fp32 m and v), and
// rounds on store: m to nearest even, v stochastically (v's per-step change,
// (1 - beta2) = 0.1% of v, is below half a bf16 ulp (2^-9 = 0.2%), so nearest
// rounding would freeze v: it could grow but never decay). The stochastic
// rounding is keyed by (step, first_element + i): deterministic, the same on
// every ISA and every split (adamw_kernel_internal.h).
//
// With 8-bit moments (DType::kBlock8, optimizer/block8_codec.h) exp_avg and
// exp_avg_sq hold one 8-bit code per element and exp_avg_scales and
// exp_avg_sq_scales the fp32 scale of each block of kMomentBlockElements
// elements of the chunk: scale k covers chunk elements [256k, 256k + 256), so
// the scales are indexed by (first_element + i) / 256 and are the chunk's, not
// offset with the range. The kernel decodes a block's m and v, updates them in
// fp32 (the master with the unrounded values, as for bf16), and encodes the
// block with new scales, in one pass: m to the nearest code, sqrt(v)
// stochastically (keyed as bf16 v). A range that covers part of a block reads
// and re-encodes the block's other elements too (their codes may move by one
// rounding under the block's new scale; their m and v are not updated): the
// codes of a block outside [0, chunk_elements) are never touched, and ranges
// run at the same time must not share a block (AdamWKernel::Update splits on
// block boundaries). m, v and their codes are computed with the same
// operations on every ISA: the stored codes and scales are the same bits on
// every path and every split; the master, as for fp32 moments, within a few ulp.
struct AdamWBuffers {
  float* master = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType moments_dtype = DType::kFloat32;
  // Index in the chunk of element 0 of these buffers (a sub-range of a chunk
  // passes its offset): the key of v's stochastic rounding.
  uint64_t first_element = 0;
  // 8-bit moments only: the chunk's block scales of m and v, and its element
  // count (where its last block ends).
  float* exp_avg_scales = nullptr;
  float* exp_avg_sq_scales = nullptr;
  uint64_t chunk_elements = 0;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  void* weights_out = nullptr;
  DType weight_dtype = DType::kFloat32;
  size_t n = 0;
};

enum class Isa { kScalar, kAvx2, kAvx512 };
std::string_view IsaName(Isa isa);
// Best instruction set this CPU supports (and the build compiled in). The
// environment variable FUYOU_OPTIMIZER_ISA=scalar|avx2|avx512 can lower the choice
// (never raise it past what the CPU has). Read once, on the first call.
Isa DetectIsa();
// Whether this CPU (and the build) can run `isa`. kScalar is always supported.
bool IsaSupported(Isa isa);

// Updates elements [begin, end) on the calling thread with the given ISA.
// Precondition: the ISA is supported by this CPU. With 8-bit moments: the
// elements of the blocks [begin, end) touches are not updated by another
// thread meanwhile.
void AdamWUpdateRange(Isa isa, const AdamWStepParams& params, const AdamWBuffers& buffers,
                      size_t begin, size_t end);

// The dtype conversions (ConvertToFloat32, ConvertFromFloat32) are in
// optimizer/dtype_convert.h.

// Splits updates over a fixed pool of worker threads, and shares the pool
// between users by the bytes of work. Thread-safe: concurrent Update calls (from
// different sessions) take turns. An update runs as slices of about
// slice_bytes() of state traffic each (master, m, v, gradient and weights read
// or written), one slice at a time on every thread; before each slice the
// caller waits for its turn in a FairMutex (common/fair_mutex.h) keyed by its
// `tenant` (user = uid, flow = session), whose quantum is one slice. So the
// users with updates waiting get one slice each per round, however many
// sessions or however big the chunks of each: an update of a user that
// arrives waits for at most one slice of each other user's (plus the slice
// running), and a session alone gets every thread for every slice.
// Slicing does not change results: an element's result never depends on how
// [0, n) is split (see Precision above), and Update returns only once every
// slice is done, so what the caller does after (checksums, the write-back, the
// commit) sees the whole chunk updated.
class AdamWKernel {
 public:
  // The default slice_bytes: 4 MiB of state traffic, about 200Ki fp32 elements,
  // some 0.2-1 ms of work.
  static constexpr uint64_t kDefaultSliceBytes = uint64_t{4} << 20;

  // threads == 0 means std::thread::hardware_concurrency(). isa defaults to DetectIsa();
  // an isa this CPU cannot run falls back to DetectIsa(). The calling thread of
  // Update does one share of the work; threads - 1 workers do the rest. Slices of
  // fewer than 32Ki elements per thread use fewer threads (below 64Ki: the caller
  // alone). slice_bytes is raised to what gives every thread 32Ki fp32 elements.
  explicit AdamWKernel(unsigned threads = 0);
  AdamWKernel(unsigned threads, Isa isa, uint64_t slice_bytes = kDefaultSliceBytes);
  ~AdamWKernel();
  AdamWKernel(const AdamWKernel&) = delete;
  AdamWKernel& operator=(const AdamWKernel&) = delete;

  // Updates the whole chunk, blocking until every slice is done; `tenant` is whose
  // turns it takes (FairKey{} for the daemon's own work and tests). Ranges given
  // to threads start on multiples of 64 elements (with 8-bit moments: on block
  // boundaries of the chunk, first_element + begin a multiple of 256).
  void Update(const AdamWStepParams& params, const AdamWBuffers& buffers, FairKey tenant = {});

  // The bytes of state traffic of one slice (the FairMutex's quantum).
  uint64_t slice_bytes() const;
  unsigned threads() const;
  Isa isa() const;

 private:
  class Pool;
  std::unique_ptr<Pool> pool_;
};

}  // namespace fuyou::optimizer
