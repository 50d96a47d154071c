// Logging to stderr through fmt: one line per event, "<level> <message>", which
// journald stores with the right priority thanks to the "<N>" prefix when
// stderr is the journal (JOURNAL_STREAM is set).
#pragma once

#include <fmt/core.h>

#include <atomic>
#include <string_view>

namespace fuyou::log {

enum class Level { kTrace = 0, kDebug, kInfo, kWarn, kError };

Level CurrentLevel();
void SetLevel(Level level);
// Parses "trace|debug|info|warn|error"; false when unknown.
bool ParseLevel(std::string_view text, Level* level);
void Write(Level level, std::string_view message);

template <typename... Args>
void Info(fmt::format_string<Args...> format, Args&&... args) {
  if (CurrentLevel() <= Level::kInfo) Write(Level::kInfo, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void Warn(fmt::format_string<Args...> format, Args&&... args) {
  if (CurrentLevel() <= Level::kWarn) Write(Level::kWarn, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void Error(fmt::format_string<Args...> format, Args&&... args) {
  if (CurrentLevel() <= Level::kError) Write(Level::kError, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void Debug(fmt::format_string<Args...> format, Args&&... args) {
  if (CurrentLevel() <= Level::kDebug) Write(Level::kDebug, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace fuyou::log
