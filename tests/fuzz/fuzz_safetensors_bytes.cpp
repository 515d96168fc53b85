// libFuzzer harness: a whole safetensors file in memory, as the loader walks it before any
// allocation: the 8-byte header length against the bytes present, the header, and every
// tensor's byte range against the data that follows. lazy::Error is the only way out.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <lazytensor/io.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 8) return 0;
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t{data[i]} << (8 * i);
  if (n > size - 8) return 0;  // the loader refuses this before parsing (tested elsewhere)
  const std::string_view text(reinterpret_cast<const char*>(data) + 8, static_cast<std::size_t>(n));
  try {
    const auto header = lazy::io::detail::parse_safetensors_header(text, "fuzz");
    lazy::io::detail::check_safetensors_layout(header, size - 8 - n, "fuzz");
  } catch (const lazy::Error&) {
  }
  return 0;
}
