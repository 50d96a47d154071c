#include "format.h"

#include <algorithm>
#include <cmath>

#include "fmt/format.h"
#include "fuyou/printable_text.h"

namespace fuyou::ctl {
namespace {

// "1.5", "12.3", "456": three significant digits, at most two decimals.
std::string ThreeDigits(double value) {
  if (value >= 100) return fmt::format("{:.0f}", value);
  if (value >= 10) return fmt::format("{:.1f}", value);
  return fmt::format("{:.2f}", value);
}

}  // namespace

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  // 1023.99 MiB would print as "1024 MiB"; show it as the next unit instead.
  if (std::round(value) >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  return fmt::format("{} {}", ThreeDigits(value), kUnits[unit]);
}

std::string FormatGbps(double gbps) {
  if (!(gbps > 0)) return "0 B/s";
  const double bytes = gbps * 1e9;
  if (bytes >= 1e9) return fmt::format("{} GB/s", ThreeDigits(gbps));
  if (bytes >= 1e6) return fmt::format("{} MB/s", ThreeDigits(bytes / 1e6));
  if (bytes >= 1e3) return fmt::format("{} kB/s", ThreeDigits(bytes / 1e3));
  return fmt::format("{:.0f} B/s", bytes);
}

std::string FormatCount(double count) {
  if (!(count > 0)) return "0";
  static constexpr const char* kSuffix[] = {"", " K", " M", " G", " T", " P"};
  size_t unit = 0;
  while (count >= 1000 && unit + 1 < std::size(kSuffix)) {
    count /= 1000;
    ++unit;
  }
  if (unit == 0) return count == std::floor(count) ? fmt::format("{:.0f}", count) : ThreeDigits(count);
  return ThreeDigits(count) + kSuffix[unit];
}

std::string FormatDuration(double seconds) {
  if (!(seconds > 0)) return "0s";
  const auto total = static_cast<uint64_t>(seconds);
  const uint64_t days = total / 86400, hours = total % 86400 / 3600, minutes = total % 3600 / 60,
                 secs = total % 60;
  if (days > 0) return fmt::format("{}d {}h", days, hours);
  if (hours > 0) return fmt::format("{}h {}m", hours, minutes);
  if (minutes > 0) return fmt::format("{}m {}s", minutes, secs);
  return fmt::format("{}s", secs);
}

std::string FormatPercent(double part, double whole) {
  if (!(whole > 0)) return "-";
  return fmt::format("{:.1f}%", 100.0 * part / whole);
}

std::string FormatRedoLine(uint64_t speculative, uint64_t redone_changed, uint64_t redone_clipped,
                           uint64_t rolled_back_skipped_step, double redo_seconds) {
  return fmt::format(
      "speculative updates {}, redone {} (changed {}, clipped {}), rolled back (skipped steps) {}, redo time {} s",
      speculative, redone_changed + redone_clipped, redone_changed, redone_clipped, rolled_back_skipped_step,
      redo_seconds > 0 ? ThreeDigits(redo_seconds) : std::string("0"));
}

std::string FormatWeightsLine(uint64_t fetches, uint64_t cache_hits, uint64_t bytes_read) {
  return fmt::format("fetches {}, {} from DRAM ({}), {} read from storage", fetches, cache_hits,
                     FormatPercent(static_cast<double>(cache_hits), static_cast<double>(fetches)),
                     FormatBytes(bytes_read));
}

std::string FormatJournalLine(uint64_t bytes, uint64_t spilled_bytes, uint64_t replays, double replay_seconds) {
  return fmt::format("journaled {} ({} spilled), {} replays in {:.2f} s", FormatBytes(bytes),
                     FormatBytes(spilled_bytes), replays, replay_seconds);
}

std::string Printable(std::string_view text) { return PrintableText(text, Unprintable::kHexEscape); }

Table::Table(std::vector<std::string> header) : header_(std::move(header)) {}

void Table::AddRow(std::vector<std::string> row) {
  row.resize(header_.size());
  for (std::string& cell : row) cell = Printable(cell);
  rows_.push_back(std::move(row));
}

std::string Table::ToString() const {
  std::vector<size_t> width(header_.size());
  for (size_t c = 0; c < header_.size(); ++c) width[c] = header_[c].size();
  for (const auto& row : rows_) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string text;
    for (size_t c = 0; c < cells.size(); ++c) {
      text += cells[c];
      if (c + 1 < cells.size()) text += std::string(width[c] - cells[c].size() + 2, ' ');
    }
    text.erase(text.find_last_not_of(' ') + 1);
    out += text + "\n";
  };
  line(header_);
  for (const auto& row : rows_) line(row);
  return out;
}

}  // namespace fuyou::ctl
