#include "format.h"

#include <gtest/gtest.h>

namespace fuyou::ctl {
namespace {

TEST(FormatBytesTest, UsesBinaryUnits) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 30), "3.00 GiB");
  EXPECT_EQ(FormatBytes(uint64_t{250} << 20), "250 MiB");
  EXPECT_EQ(FormatBytes((uint64_t{1} << 40) - 1), "1.00 TiB");
}

TEST(FormatGbpsTest, PicksAReadableUnit) {
  EXPECT_EQ(FormatGbps(0), "0 B/s");
  EXPECT_EQ(FormatGbps(3.214), "3.21 GB/s");
  EXPECT_EQ(FormatGbps(0.85), "850 MB/s");
  EXPECT_EQ(FormatGbps(12e-6), "12.0 kB/s");
}

TEST(FormatCountTest, UsesSiSuffixes) {
  EXPECT_EQ(FormatCount(0), "0");
  EXPECT_EQ(FormatCount(999), "999");
  EXPECT_EQ(FormatCount(12.5), "12.5");
  EXPECT_EQ(FormatCount(12345), "12.3 K");
  EXPECT_EQ(FormatCount(4.56e9), "4.56 G");
}

TEST(FormatDurationTest, ShowsTwoUnits) {
  EXPECT_EQ(FormatDuration(45.7), "45s");
  EXPECT_EQ(FormatDuration(725), "12m 5s");
  EXPECT_EQ(FormatDuration(3 * 3600 + 12 * 60 + 7), "3h 12m");
  EXPECT_EQ(FormatDuration(4 * 86400 + 2 * 3600), "4d 2h");
}

TEST(FormatPercentTest, HandlesZeroWhole) {
  EXPECT_EQ(FormatPercent(3, 8), "37.5%");
  EXPECT_EQ(FormatPercent(1, 0), "-");
}

TEST(FormatRedoLineTest, NamesEveryCounter) {
  EXPECT_EQ(FormatRedoLine(40, 2, 4, 8, 0.126),
            "speculative updates 40, redone 6 (changed 2, clipped 4), rolled back (skipped steps) 8, redo time 0.13 s");
  EXPECT_EQ(FormatRedoLine(0, 0, 0, 0, 0),
            "speculative updates 0, redone 0 (changed 0, clipped 0), rolled back (skipped steps) 0, redo time 0 s");
  EXPECT_EQ(FormatRedoLine(1, 0, 1, 0, 12.5),
            "speculative updates 1, redone 1 (changed 0, clipped 1), rolled back (skipped steps) 0, redo time 12.5 s");
}

TEST(FormatJournalLineTest, NamesEveryCounter) {
  EXPECT_EQ(FormatJournalLine(3 * 1024 * 1024, 1024 * 1024, 12, 0.4),
            "journaled 3.00 MiB (1.00 MiB spilled), 12 replays in 0.40 s");
  EXPECT_EQ(FormatJournalLine(0, 0, 0, 0), "journaled 0 B (0 B spilled), 0 replays in 0.00 s");
}

TEST(FormatWeightsLineTest, NamesEveryCounter) {
  EXPECT_EQ(FormatWeightsLine(120, 90, 1536 * 1024), "fetches 120, 90 from DRAM (75.0%), 1.50 MiB read from storage");
  EXPECT_EQ(FormatWeightsLine(0, 0, 0), "fetches 0, 0 from DRAM (-), 0 B read from storage");
  EXPECT_EQ(FormatWeightsLine(3, 0, 4096), "fetches 3, 0 from DRAM (0.0%), 4.00 KiB read from storage");
}

TEST(TableTest, PadsColumnsToTheWidestCell) {
  Table table({"NAME", "SIZE"});
  table.AddRow({"a-long-name", "1 B"});
  table.AddRow({"b"});
  EXPECT_EQ(table.ToString(),
            "NAME         SIZE\n"
            "a-long-name  1 B\n"
            "b\n");
}

TEST(PrintableTest, EscapesWhatATerminalWouldInterpret) {
  EXPECT_EQ(Printable("pid 42 on host"), "pid 42 on host");
  EXPECT_EQ(Printable("\x1b]0;pwned\x07\x1b[2J"), "\\x1b]0;pwned\\x07\\x1b[2J");
  EXPECT_EQ(Printable("a\rb\nc\x7f"), "a\\x0db\\x0ac\\x7f");
  EXPECT_EQ(Printable("\xff\xc3\xa9"), "\\xff\xc3\xa9") << "invalid UTF-8 escaped, valid kept";
}

TEST(TableTest, EscapesEveryCell) {
  Table table({"JOB", "CLIENT"});
  table.AddRow({"gpt", "\x1b[31mred\x1b[0m\rFAKE"});
  const std::string text = table.ToString();
  EXPECT_EQ(text.find('\x1b'), std::string::npos) << text;
  EXPECT_EQ(text.find('\r'), std::string::npos) << text;
  EXPECT_NE(text.find("\\x1b[31mred\\x1b[0m\\x0dFAKE"), std::string::npos) << text;
}

}  // namespace
}  // namespace fuyou::ctl
