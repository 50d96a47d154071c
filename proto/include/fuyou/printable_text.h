// Text that came from another process, made safe to keep and to print on a
// terminal. fuyoud stores a session's client_info through it (kQuestionMark) and
// fuyouctl passes everything the daemon sends through it again before printing
// (kHexEscape), so neither a client nor a daemon can put escape sequences, cursor
// movements or a forged line on an operator's terminal.
//
// Kept: printable ASCII (0x20-0x7E) and well-formed UTF-8 of printable
// characters (U+00A0 and above). Replaced, one replacement per byte: C0 controls
// (NUL, TAB, LF, CR, ESC, ...), DEL, the C1 controls U+0080-U+009F (in UTF-8, or
// as raw bytes: 0x9B is the one-byte CSI), the characters that reorder or hide
// text (bidirectional overrides and isolates, U+061C, U+200E/F, U+2028/9,
// U+FEFF), and every byte of invalid, overlong or truncated UTF-8.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace fuyou {

enum class Unprintable {
  kQuestionMark,  // '?' for each byte
  kHexEscape,     // "\xHH" for each byte
};

namespace printable_internal {

// Length of the well-formed UTF-8 sequence at text[i] and its code point, or 0.
inline size_t DecodeUtf8(std::string_view text, size_t i, uint32_t* code_point) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(text[k]); };
  const uint8_t lead = byte(i);
  size_t length = 0;
  uint32_t value = 0;
  uint8_t low = 0x80, high = 0xBF;  // allowed range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2, value = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3, value = lead & 0x0F;
    if (lead == 0xE0) low = 0xA0;   // overlong
    if (lead == 0xED) high = 0x9F;  // surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4, value = lead & 0x07;
    if (lead == 0xF0) low = 0x90;   // overlong
    if (lead == 0xF4) high = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  for (size_t k = 1; k < length; ++k) {
    const uint8_t next = byte(i + k);
    if (next < (k == 1 ? low : 0x80) || next > (k == 1 ? high : 0xBF)) return 0;
    value = (value << 6) | (next & 0x3F);
  }
  *code_point = value;
  return length;
}

inline bool IsPrintableCodePoint(uint32_t c) {
  if (c < 0xA0) return false;  // C1 controls (ASCII is handled byte by byte)
  if (c == 0x061C || c == 0x200E || c == 0x200F || c == 0x2028 || c == 0x2029 || c == 0xFEFF) return false;
  if (c >= 0x202A && c <= 0x202E) return false;  // bidirectional embeddings and overrides
  if (c >= 0x2066 && c <= 0x2069) return false;  // bidirectional isolates
  return true;
}

}  // namespace printable_internal

// `text` with every unprintable byte replaced as `how` says (see the top of this file).
inline std::string PrintableText(std::string_view text, Unprintable how) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const auto byte = static_cast<uint8_t>(text[i]);
    if (byte >= 0x20 && byte <= 0x7E) {
      out.push_back(static_cast<char>(byte));
      ++i;
      continue;
    }
    uint32_t code_point = 0;
    const size_t length = byte >= 0x80 ? printable_internal::DecodeUtf8(text, i, &code_point) : 0;
    if (length > 0 && printable_internal::IsPrintableCodePoint(code_point)) {
      out.append(text.substr(i, length));
      i += length;
      continue;
    }
    // One byte at a time: the rest of a bad sequence may be printable text.
    if (how == Unprintable::kQuestionMark) {
      out.push_back('?');
    } else {
      out += "\\x";
      out.push_back(kHex[byte >> 4]);
      out.push_back(kHex[byte & 0xF]);
    }
    ++i;
  }
  return out;
}

}  // namespace fuyou
