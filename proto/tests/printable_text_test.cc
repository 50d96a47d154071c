#include "fuyou/printable_text.h"

#include <gtest/gtest.h>

#include <string>

namespace fuyou {
namespace {

std::string Question(std::string_view text) { return PrintableText(text, Unprintable::kQuestionMark); }
std::string Escaped(std::string_view text) { return PrintableText(text, Unprintable::kHexEscape); }

TEST(PrintableTextTest, KeepsPrintableAsciiAndUtf8) {
  EXPECT_EQ(Question("host-1 pid 42 train.py --lr=3e-4"), "host-1 pid 42 train.py --lr=3e-4");
  EXPECT_EQ(Question("caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x9a\x80"), "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x9a\x80");
  EXPECT_EQ(Question(""), "");
}

TEST(PrintableTextTest, ReplacesControlBytesEscAndDel) {
  EXPECT_EQ(Question("\x1b[31mred\x1b]0;title\x07"), "?[31mred?]0;title?");
  EXPECT_EQ(Escaped("\x1b[2J\x7f\ttab\nline\r"), "\\x1b[2J\\x7f\\x09tab\\x0aline\\x0d");
  EXPECT_EQ(Question(std::string("nul\0byte", 8)), "nul?byte");
}

TEST(PrintableTextTest, ReplacesC1ControlsRawAndEncoded) {
  EXPECT_EQ(Escaped("\x9b" "31m"), "\\x9b31m") << "0x9b is the one-byte CSI of 8-bit terminals";
  EXPECT_EQ(Escaped("\xc2\x9b" "31m"), "\\xc2\\x9b31m") << "U+009B encoded in UTF-8";
}

TEST(PrintableTextTest, ReplacesInvalidUtf8ByteByByte) {
  EXPECT_EQ(Question("\xff\xfe"), "??");
  EXPECT_EQ(Question("\xc0\xaf"), "??") << "overlong '/'";
  EXPECT_EQ(Question("\xed\xa0\x80"), "???") << "a surrogate";
  EXPECT_EQ(Question("\xf4\x90\x80\x80"), "????") << "above U+10FFFF";
  EXPECT_EQ(Question("ab\xe6\x97"), "ab??") << "truncated at the end";
  EXPECT_EQ(Question("\xe6" "ok"), "?ok") << "what follows a bad lead byte is kept";
}

TEST(PrintableTextTest, ReplacesCharactersThatReorderOrHideText) {
  EXPECT_EQ(Question("a\xe2\x80\xae" "b"), "a???b") << "U+202E RIGHT-TO-LEFT OVERRIDE";
  EXPECT_EQ(Question("a\xe2\x81\xa6" "b"), "a???b") << "U+2066 LEFT-TO-RIGHT ISOLATE";
  EXPECT_EQ(Question("a\xe2\x80\xa8" "b"), "a???b") << "U+2028 LINE SEPARATOR";
  EXPECT_EQ(Question("\xef\xbb\xbf" "x"), "???x") << "U+FEFF";
}

TEST(PrintableTextTest, OutputIsAlwaysPrintable) {
  // Every byte value, alone and after a lead byte: nothing below 0x20, no DEL, no
  // raw C1 byte survives.
  for (int first = 0; first < 256; ++first) {
    for (int second : {0x00, 0x1b, 0x41, 0x80, 0x9b, 0xbf, 0xc3}) {
      std::string text = {static_cast<char>(first), static_cast<char>(second)};
      for (Unprintable how : {Unprintable::kQuestionMark, Unprintable::kHexEscape}) {
        const std::string out = PrintableText(text, how);
        for (size_t i = 0; i < out.size(); ++i) {
          const auto c = static_cast<unsigned char>(out[i]);
          ASSERT_TRUE(c >= 0x20 && c != 0x7f) << "byte " << int(c) << " in the output for " << first << "," << second;
          ASSERT_FALSE(c == 0xc2 && i + 1 < out.size() && static_cast<unsigned char>(out[i + 1]) < 0xa0)
              << "a C1 control survived for " << first << "," << second;
        }
      }
    }
  }
}

}  // namespace
}  // namespace fuyou
