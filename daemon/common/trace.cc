#include "common/trace.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace fuyou::trace {
namespace {

struct TraceFile {
  std::mutex mutex;
  std::FILE* file = nullptr;

  TraceFile() {
    const char* path = std::getenv("FUYOU_TRACE");
    if (path == nullptr || *path == '\0') return;
    file = std::fopen(path, "a");
    if (file != nullptr) std::setvbuf(file, nullptr, _IOLBF, 1 << 16);
  }
};

TraceFile& Instance() {
  static TraceFile* trace = new TraceFile();  // never destroyed: completions may record late
  return *trace;
}

}  // namespace

bool Enabled() { return Instance().file != nullptr; }

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Record(const char* event, uint32_t chunk, int64_t start_us, int64_t end_us) {
  TraceFile& trace = Instance();
  if (trace.file == nullptr) return;
  std::lock_guard lock(trace.mutex);
  std::fprintf(trace.file, "{\"event\":\"%s\",\"chunk\":%u,\"start_us\":%lld,\"end_us\":%lld}\n", event, chunk,
               static_cast<long long>(start_us), static_cast<long long>(end_us));
}

}  // namespace fuyou::trace
