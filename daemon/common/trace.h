// Trace: an optional timeline of the daemon's work, read by benchmarks/plot_timeline.py.
//
// Off unless the environment variable FUYOU_TRACE names a file when the daemon
// first records; then every Record appends one JSON line
//   {"event":"update","chunk":3,"start_us":123,"end_us":456}
// where times are CLOCK_MONOTONIC microseconds, the clock a client on the same
// machine reads through std::chrono::steady_clock. When off, Record costs one
// branch. Thread-safe.
#pragma once

#include <cstdint>

namespace fuyou::trace {

// True when FUYOU_TRACE is set and its file could be opened.
bool Enabled();
// CLOCK_MONOTONIC in microseconds.
int64_t NowUs();
// Appends one event ("update", "ssd_read", "ssd_write") when tracing is on.
void Record(const char* event, uint32_t chunk, int64_t start_us, int64_t end_us);

}  // namespace fuyou::trace
