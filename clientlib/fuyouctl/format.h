// Human-readable numbers and plain-text tables for fuyouctl's output.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fuyou::ctl {

// Bytes in binary units: "512 B", "1.5 KiB", "3.25 GiB", "1.0 TiB".
std::string FormatBytes(uint64_t bytes);
// A transfer rate given in GB/s (1e9 bytes per second, as the daemon reports):
// "0 B/s", "850 MB/s", "3.21 GB/s".
std::string FormatGbps(double gbps);
// A count with an SI suffix: "999", "12.3 K", "4.56 M", "7.89 G", "1.2 T".
std::string FormatCount(double count);
// A duration: "45s", "12m 5s", "3h 12m", "4d 2h".
std::string FormatDuration(double seconds);
// A percentage of part in whole: "37.5%", or "-" when whole is 0.
std::string FormatPercent(double part, double whole);

// What speculation cost (GetStatsResponse fields 19-23), on one line:
// "speculative updates 40, redone 6 (changed 2, clipped 4), rolled back (skipped
// steps) 8, redo time 0.13 s".
std::string FormatRedoLine(uint64_t speculative, uint64_t redone_changed, uint64_t redone_clipped,
                           uint64_t rolled_back_skipped_step, double redo_seconds);

// Streamed working weights (GetStatsResponse fields 24-26), on one line:
// "fetches 120, 90 from DRAM (75.0%), 1.50 MiB read from storage".
std::string FormatWeightsLine(uint64_t fetches, uint64_t cache_hits, uint64_t bytes_read);
// "journaled 1.5 GiB (256 MiB spilled), 12 replays in 0.40 s": the gradient
// journal's line of `fuyouctl stats`.
std::string FormatJournalLine(uint64_t bytes, uint64_t spilled_bytes, uint64_t replays, double replay_seconds);

// Text from the daemon made safe for the terminal: every control byte (ESC, CR,
// LF, DEL, C1, bidirectional overrides) and invalid UTF-8 becomes "\xHH"
// (fuyou/printable_text.h). Applied to everything fuyouctl prints that the
// daemon sent, whatever the daemon claims to have sanitised.
std::string Printable(std::string_view text);

// A table printed with columns padded to their widest cell.
class Table {
 public:
  explicit Table(std::vector<std::string> header);
  // Columns beyond the header's are dropped; missing ones are left empty. Every
  // cell goes through Printable.
  void AddRow(std::vector<std::string> row);
  size_t rows() const { return rows_.size(); }
  // Header and rows, columns separated by two spaces, each line ending in '\n'.
  std::string ToString() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace fuyou::ctl
