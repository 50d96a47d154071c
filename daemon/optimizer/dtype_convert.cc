#include "optimizer/dtype_convert.h"

#include <algorithm>
#include <cassert>
#include <cstdint>

#include "optimizer/adamw_kernel.h"
#include "optimizer/adamw_kernel_internal.h"

namespace fuyou::optimizer {

void ConvertToFloat32(const void* src, DType src_dtype, float* dst, size_t n) {
#if defined(FUYOU_OPTIMIZER_HAVE_AVX512)
  if (DetectIsa() == Isa::kAvx512) return internal::ToFloat32Avx512(src, src_dtype, dst, n);
#endif
#if defined(FUYOU_OPTIMIZER_HAVE_AVX2)
  if (DetectIsa() == Isa::kAvx2) return internal::ToFloat32Avx2(src, src_dtype, dst, n);
#endif
  const auto* s16 = static_cast<const uint16_t*>(src);
  switch (src_dtype) {
    case DType::kFloat32:
      std::copy_n(static_cast<const float*>(src), n, dst);
      return;
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) dst[i] = internal::BFloat16ToFloat(s16[i]);
      return;
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) dst[i] = internal::HalfToFloat(s16[i]);
      return;
    default: assert(false && "ConvertToFloat32: invalid dtype"); return;
  }
}

void ConvertFromFloat32(const float* src, void* dst, DType dst_dtype, size_t n) {
#if defined(FUYOU_OPTIMIZER_HAVE_AVX512)
  if (DetectIsa() == Isa::kAvx512) return internal::FromFloat32Avx512(src, dst, dst_dtype, n);
#endif
#if defined(FUYOU_OPTIMIZER_HAVE_AVX2)
  if (DetectIsa() == Isa::kAvx2) return internal::FromFloat32Avx2(src, dst, dst_dtype, n);
#endif
  auto* d16 = static_cast<uint16_t*>(dst);
  switch (dst_dtype) {
    case DType::kFloat32:
      std::copy_n(src, n, static_cast<float*>(dst));
      return;
    case DType::kBFloat16:
      for (size_t i = 0; i < n; ++i) d16[i] = internal::FloatToBFloat16(src[i]);
      return;
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) d16[i] = internal::FloatToHalf(src[i]);
      return;
    default: assert(false && "ConvertFromFloat32: invalid dtype"); return;
  }
}

}  // namespace fuyou::optimizer
