// Checksum64: the XXH3-64 of a byte range, the checksum of every state extent,
// manifest, journal entry and activation spill fuyoud writes and verifies.
//
// Contract: the bits are XXH3_64bits' on every CPU (they are part of the
// on-disk format). On x86-64 the call goes through libxxhash's runtime
// dispatch, which runs its AVX2 or AVX-512 loop where the CPU has one; the
// library's plain entry point runs the SSE2 loop only (1.8x slower here, and
// every byte fuyoud reads or writes is hashed once).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__x86_64__)
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#else
#include <xxhash.h>
#endif

namespace fuyou {

inline uint64_t Checksum64(const void* bytes, size_t size) {
#if defined(__x86_64__)
  return XXH3_64bits_dispatch(bytes, size);
#else
  return XXH3_64bits(bytes, size);
#endif
}

}  // namespace fuyou
