// Conversions between fp32 and the parameter dtypes (fp32, bf16, fp16), with
// the roundings torch uses (round to nearest even). Vectorised where the CPU
// allows (the ISA the kernel chose, adamw_kernel.h DetectIsa), with the same
// results on every ISA. Used to initialise master weights from a job's
// weights, to return weights on resume, and to store working weights.
#pragma once

#include <cstddef>

#include "fuyou/dtype.h"

namespace fuyou::optimizer {

// Converts n values of `src_dtype` at `src` to fp32 at `dst`.
void ConvertToFloat32(const void* src, DType src_dtype, float* dst, size_t n);
// Converts n fp32 values at `src` to `dst_dtype` at `dst`.
void ConvertFromFloat32(const float* src, void* dst, DType dst_dtype, size_t n);

}  // namespace fuyou::optimizer
