// Helpers shared by the benchmarks that drive a real fuyoud: argument parsing,
// medians, the daemon's trace file (FUYOU_TRACE, see daemon/common/trace.h) and
// its peak RSS.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

namespace fuyou::bench {

using Clock = std::chrono::steady_clock;

[[noreturn]] inline void Die(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::exit(1);
}

// "64M", "4K", "1G", "1000" -> bytes.
inline uint64_t ParseBytes(const std::string& text) {
  size_t end = 0;
  const uint64_t value = std::stoull(text, &end);
  const std::string suffix = text.substr(end);
  if (suffix.empty()) return value;
  switch (suffix[0]) {
    case 'k': case 'K': return value << 10;
    case 'm': case 'M': return value << 20;
    case 'g': case 'G': return value << 30;
    default: Die("bad size: " + text);
  }
}

inline std::vector<std::string> Split(const std::string& text, char sep = ',') {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = text.find(sep, start);
    parts.push_back(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return parts;
}

inline double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Microseconds on the clock the daemon's trace uses (CLOCK_MONOTONIC).
inline int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
}

struct TraceEvent {
  std::string event;  // update | ssd_read | ssd_write
  uint32_t chunk = 0;
  int64_t start_us = 0;
  int64_t end_us = 0;
};

// Reads the JSON lines the daemon wrote to its FUYOU_TRACE file.
inline std::vector<TraceEvent> ReadTrace(const std::filesystem::path& path) {
  static const std::regex line_re(
      R"re(\{"event":"(\w+)","chunk":(\d+),"start_us":(-?\d+),"end_us":(-?\d+)\})re");
  std::vector<TraceEvent> events;
  std::ifstream in(path);
  std::string line;
  std::smatch m;
  while (std::getline(in, line)) {
    if (!std::regex_match(line, m, line_re)) continue;
    events.push_back({m[1], static_cast<uint32_t>(std::stoul(m[2])), std::stoll(m[3]), std::stoll(m[4])});
  }
  return events;
}

// A field of /proc/<pid>/status in KiB (VmHWM = peak RSS, VmRSS = current), or -1.
inline int64_t ProcStatusKiB(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

}  // namespace fuyou::bench
