#pragma once
// The little JSON that file headers need, written by us and strict: a cursor that reads
// objects, strings and non-negative integers exactly as RFC 8259 spells them (and nothing
// else: no comments, no trailing commas, no NaN, no leading zeros, valid UTF-8 only), and
// a writer for strings. Callers read the schema they expect with these primitives, so a
// hostile header never builds a document tree bigger than what the caller keeps.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>

namespace lazy::io::detail {

/// Length of the valid UTF-8 sequence starting at s[i], or 0 when it is invalid (overlong
/// forms, surrogates and code points above U+10FFFF are invalid, as RFC 3629 says).
std::size_t utf8_sequence_length(std::string_view s, std::size_t i);

/// True when `s` is valid UTF-8.
bool valid_utf8(std::string_view s);

/// Appends `s` as a JSON string literal: quotes, backslashes and control characters are
/// escaped (the short forms where JSON has them), everything else is copied as is.
void append_json_string(std::string& out, std::string_view s);

/// A read position in a JSON text. Every method throws FormatError("<where>: <what> at
/// byte <pos>") on anything that is not exactly what was asked for.
class JsonCursor {
 public:
  JsonCursor(std::string_view text, std::string where) : s_(text), where_(std::move(where)) {}

  std::size_t pos() const { return i_; }
  bool at_end() const { return i_ >= s_.size(); }

  /// Skips JSON whitespace (space, tab, line feed, carriage return).
  void skip_ws();
  /// The next non-whitespace character (or '\0' at the end), without consuming it.
  char peek();
  /// Consumes `c` (after whitespace), else FormatError.
  void expect(char c);
  /// Consumes `c` when it comes next.
  bool accept(char c);

  /// Reads a string literal, decoding escapes (\uXXXX with surrogate pairs) to UTF-8.
  std::string string();

  /// Reads a non-negative integer literal that fits in 64 bits. Signs, fractions,
  /// exponents and leading zeros are rejected: sizes and offsets are whole numbers.
  std::uint64_t uint64();

  /// Throws FormatError naming the position.
  [[noreturn]] void fail(const std::string& what) const;

  /// A short quote of the text at the cursor, for messages.
  std::string found() const;

 private:
  static int hex_value(char c);
  std::uint32_t hex4();
  static void append_utf8(std::string& out, std::uint32_t cp);
  void escape(std::string& out);

  std::string_view s_;
  std::string where_;
  std::size_t i_ = 0;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::size_t utf8_sequence_length(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  std::size_t n;
  std::uint32_t cp;
  if (c >= 0xC2 && c <= 0xDF)
    n = 2, cp = c & 0x1Fu;
  else if (c >= 0xE0 && c <= 0xEF)
    n = 3, cp = c & 0x0Fu;
  else if (c >= 0xF0 && c <= 0xF4)
    n = 4, cp = c & 0x07u;
  else
    return 0;
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0u) != 0x80u) return 0;
    cp = (cp << 6) | (b(k) & 0x3Fu);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10FFFF ||
      (cp >= 0xD800 && cp <= 0xDFFF))
    return 0;
  return n;
}

LAZYTENSOR_INLINE bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

LAZYTENSOR_INLINE void append_json_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  out += '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 0xF];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

LAZYTENSOR_INLINE void JsonCursor::skip_ws() {
  while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
    ++i_;
}

LAZYTENSOR_INLINE char JsonCursor::peek() {
  skip_ws();
  return at_end() ? '\0' : s_[i_];
}

LAZYTENSOR_INLINE void JsonCursor::expect(char c) {
  if (peek() != c) fail(std::string("expected '") + c + "', found " + found());
  ++i_;
}

LAZYTENSOR_INLINE bool JsonCursor::accept(char c) {
  if (peek() != c) return false;
  ++i_;
  return true;
}

LAZYTENSOR_INLINE std::string JsonCursor::string() {
  if (peek() != '"') fail("expected a string, found " + found());
  ++i_;
  std::string out;
  for (;;) {
    if (at_end()) fail("unterminated string");
    const auto c = static_cast<unsigned char>(s_[i_]);
    if (c == '"') {
      ++i_;
      return out;
    }
    if (c < 0x20) fail("unescaped control character in a string");
    if (c == '\\') {
      escape(out);
      continue;
    }
    const std::size_t n = utf8_sequence_length(s_, i_);
    if (n == 0) fail("invalid UTF-8 in a string");
    out.append(s_.substr(i_, n));
    i_ += n;
  }
}

LAZYTENSOR_INLINE std::uint64_t JsonCursor::uint64() {
  peek();
  const std::size_t start = i_;
  if (at_end() || s_[i_] < '0' || s_[i_] > '9')
    fail("expected a non-negative integer, found " + found());
  if (s_[i_] == '0' && i_ + 1 < s_.size() && s_[i_ + 1] >= '0' && s_[i_ + 1] <= '9')
    fail("leading zero in a number");
  std::uint64_t v = 0;
  while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
    const auto d = static_cast<std::uint64_t>(s_[i_] - '0');
    if (v > (UINT64_MAX - d) / 10) {
      i_ = start;
      fail("integer does not fit in 64 bits");
    }
    v = v * 10 + d;
    ++i_;
  }
  if (i_ < s_.size() && (s_[i_] == '.' || s_[i_] == 'e' || s_[i_] == 'E'))
    fail("expected an integer, found a fraction or exponent");
  return v;
}

LAZYTENSOR_INLINE void JsonCursor::fail(const std::string& what) const {
  throw FormatError(where_ + ": " + what + " at byte " + std::to_string(i_) + " of the header");
}

LAZYTENSOR_INLINE std::string JsonCursor::found() const {
  if (at_end()) return "the end of the header";
  std::string q;
  for (std::size_t k = i_; k < s_.size() && k < i_ + 12; ++k) {
    const auto c = static_cast<unsigned char>(s_[k]);
    q += (c >= 0x20 && c < 0x7F) ? static_cast<char>(c) : '?';
  }
  return "'" + q + "'";
}

LAZYTENSOR_INLINE int JsonCursor::hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

LAZYTENSOR_INLINE std::uint32_t JsonCursor::hex4() {
  if (i_ + 4 > s_.size()) fail("truncated \\u escape");
  std::uint32_t v = 0;
  for (int k = 0; k < 4; ++k) {
    const int h = hex_value(s_[i_ + static_cast<std::size_t>(k)]);
    if (h < 0) fail("invalid hex digit in a \\u escape");
    v = v * 16 + static_cast<std::uint32_t>(h);
  }
  i_ += 4;
  return v;
}

LAZYTENSOR_INLINE void JsonCursor::append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

LAZYTENSOR_INLINE void JsonCursor::escape(std::string& out) {
  ++i_;  // the backslash
  if (at_end()) fail("truncated escape");
  const char e = s_[i_++];
  switch (e) {
    case '"':
      out += '"';
      return;
    case '\\':
      out += '\\';
      return;
    case '/':
      out += '/';
      return;
    case 'b':
      out += '\b';
      return;
    case 'f':
      out += '\f';
      return;
    case 'n':
      out += '\n';
      return;
    case 'r':
      out += '\r';
      return;
    case 't':
      out += '\t';
      return;
    case 'u':
      break;
    default:
      --i_;
      fail("invalid escape");
  }
  std::uint32_t cp = hex4();
  if (cp >= 0xDC00 && cp <= 0xDFFF) fail("unpaired low surrogate in a \\u escape");
  if (cp >= 0xD800 && cp <= 0xDBFF) {
    if (i_ + 2 > s_.size() || s_[i_] != '\\' || s_[i_ + 1] != 'u')
      fail("unpaired high surrogate in a \\u escape");
    i_ += 2;
    const std::uint32_t lo = hex4();
    if (lo < 0xDC00 || lo > 0xDFFF) fail("unpaired high surrogate in a \\u escape");
    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
  }
  append_utf8(out, cp);
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io::detail
