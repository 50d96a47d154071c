// Adam moments as 8-bit blocks (DType::kBlock8) to and from fp32, for what
// reads or writes them outside the kernel: export (ReadState), import
// (WriteState) and tests. The codes and scales are laid out as ChunkLayout
// says (jobs/chunk_layout.h): one code per element, one fp32 scale per block
// of kMomentBlockElements elements of the chunk.
#pragma once

#include <cstdint>
#include <span>

namespace fuyou::optimizer {

enum class Moment { kExpAvg, kExpAvgSq };

// The values of chunk elements [first, first + out.size()) of moment `which`,
// exactly as the kernel reads them.
void DecodeBlock8(Moment which, const uint8_t* codes, const float* scales, uint64_t first, std::span<float> out);

// Stores `values` as chunk elements [first, first + values.size()) of moment
// `which` of a chunk of chunk_elements elements. Every block the range touches
// gets a new scale; its elements outside the range keep their values up to one
// rounding under it. Rounds to the nearest code (v: ties up), so the same
// values always give the same bytes; a negative v is stored as its magnitude.
// Precondition: first + values.size() <= chunk_elements.
void EncodeBlock8(Moment which, uint8_t* codes, float* scales, uint64_t chunk_elements, uint64_t first,
                  std::span<const float> values);

}  // namespace fuyou::optimizer
