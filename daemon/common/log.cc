#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace fuyou::log {
namespace {

std::atomic<Level> g_level{Level::kInfo};

// syslog priorities for journald's "<N>" line prefix.
int SyslogPriority(Level level) {
  switch (level) {
    case Level::kError: return 3;
    case Level::kWarn: return 4;
    case Level::kInfo: return 6;
    default: return 7;
  }
}

std::string_view LevelName(Level level) {
  switch (level) {
    case Level::kTrace: return "TRACE";
    case Level::kDebug: return "DEBUG";
    case Level::kInfo: return "INFO";
    case Level::kWarn: return "WARN";
    case Level::kError: return "ERROR";
  }
  return "?";
}

}  // namespace

Level CurrentLevel() { return g_level.load(std::memory_order_relaxed); }
void SetLevel(Level level) { g_level.store(level, std::memory_order_relaxed); }

bool ParseLevel(std::string_view text, Level* level) {
  static constexpr std::pair<std::string_view, Level> kNames[] = {
      {"trace", Level::kTrace}, {"debug", Level::kDebug}, {"info", Level::kInfo},
      {"warn", Level::kWarn},   {"error", Level::kError}};
  for (const auto& [name, value] : kNames) {
    if (text == name) {
      *level = value;
      return true;
    }
  }
  return false;
}

void Write(Level level, std::string_view message) {
  static const bool to_journal = std::getenv("JOURNAL_STREAM") != nullptr;
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  if (to_journal) {
    fmt::print(stderr, "<{}>{}\n", SyslogPriority(level), message);
  } else {
    fmt::print(stderr, "fuyoud {} {}\n", LevelName(level), message);
  }
  std::fflush(stderr);
}

}  // namespace fuyou::log
