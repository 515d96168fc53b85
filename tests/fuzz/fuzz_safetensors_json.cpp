// libFuzzer harness: the safetensors header parser (our strict JSON cursor, schema-directed)
// on arbitrary text, then the layout check of what it accepted. Anything but a lazy::Error
// escaping (std::bad_alloc, another exception), or a sanitizer report, is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <lazytensor/io.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto header = lazy::io::detail::parse_safetensors_header(text, "fuzz");
    lazy::io::detail::check_safetensors_layout(header, std::uint64_t{1} << 20, "fuzz");
  } catch (const lazy::Error&) {
  }
  return 0;
}
