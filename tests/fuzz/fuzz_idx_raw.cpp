// libFuzzer harness: lazy::data::read_idx on a file holding the input as is (a raw IDX file,
// or, when it starts with gzip's magic, a gzip stream). lazy::Error is the only way out.
#include <cstddef>
#include <cstdint>

#include "fuzz_common.hpp"
#include "fuzz_idx.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = fuzz::write_temp("idx", data, size);
  fuzz::read_idx_and_touch(path);
  return 0;
}
