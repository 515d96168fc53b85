// libFuzzer harness: lazy::io::load on a file holding the input, then every loaded tensor
// read back (values summed, so each buffer is touched). lazy::Error is the only way out.
#include <cstddef>
#include <cstdint>

#include <lazytensor/io.hpp>
#include <lazytensor/tensor.hpp>

#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = fuzz::write_temp("safetensors", data, size);
  try {
    const lazy::StateDict sd = lazy::io::load(path);
    for (const auto& name : sd.keys()) {
      const lazy::AnyTensor& t = sd.at(name);
      volatile std::int64_t n = t.numel();
      (void)n;
      t.visit([](const auto& typed) {
        const auto* p = typed.data();
        unsigned char sink = 0;
        const auto* bytes = reinterpret_cast<const unsigned char*>(p);
        for (std::int64_t i = 0; i < typed.numel() * static_cast<std::int64_t>(sizeof(*p)); ++i) sink ^= bytes[i];
        volatile unsigned char keep = sink;
        (void)keep;
      });
    }
  } catch (const lazy::Error&) {
  }
  return 0;
}
