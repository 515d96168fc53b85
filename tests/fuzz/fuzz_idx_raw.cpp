// libFuzzer harness: lazy::data::read_idx on a file holding the input as is (a raw IDX file,
// or, when it starts with gzip's magic, a gzip stream). lazy::Error is the only way out.
#include <cstddef>
#include <cstdint>

#include <lazytensor/data/idx.hpp>

#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = fuzz::write_temp("idx", data, size);
  try {
    const auto a = lazy::data::read_idx(path);
    unsigned sink = 0;
    for (const auto b : a.data) sink += b;
    volatile unsigned keep = sink;
    (void)keep;
  } catch (const lazy::Error&) {
  }
  return 0;
}
