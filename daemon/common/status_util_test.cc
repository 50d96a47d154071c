#include "common/status_util.h"

#include <gtest/gtest.h>

#include <string>

namespace fuyou {
namespace {

TEST(QuoteForErrorTest, ShortPrintableTextIsQuotedAsIs) {
  EXPECT_EQ(QuoteForError("llama-prod"), "'llama-prod'");
  EXPECT_EQ(QuoteForError(""), "''");
}

TEST(QuoteForErrorTest, NonPrintableBytesQuotesAndBackslashesAreEscaped) {
  EXPECT_EQ(QuoteForError("a\x1b[2Jb"), "'a\\x1b[2Jb'");
  EXPECT_EQ(QuoteForError(std::string("nul\0x", 5)), "'nul\\x00x'");
  EXPECT_EQ(QuoteForError("it's\\"), "'it\\x27s\\x5c'");
  EXPECT_EQ(QuoteForError("\xff\x80"), "'\\xff\\x80'");
}

TEST(QuoteForErrorTest, LongTextIsCutAndItsLengthNamed) {
  const std::string name(10000, 'n');
  const std::string quoted = QuoteForError(name);
  EXPECT_EQ(quoted, "'" + std::string(64, 'n') + "'...(10000 bytes)");
  EXPECT_EQ(QuoteForError(std::string(64, 'n')), "'" + std::string(64, 'n') + "'");
  EXPECT_EQ(QuoteForError("abcdef", 3), "'abc'...(6 bytes)");
  // Escaping can grow each byte to 4: the bound still holds.
  EXPECT_LE(QuoteForError(std::string(10000, '\x01')).size(), 64u * 4 + 32);
}

}  // namespace
}  // namespace fuyou
