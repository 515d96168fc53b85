// libFuzzer harness: the input is an IDX file's contents, gzip-compressed here (zlib's
// deflate) and read back through the reader's inflate path, so the fuzzer explores the IDX
// structure behind a valid gzip stream (mutating the compressed bytes would mostly break
// its checksums). Every 16th input is also cut short inside the stream. lazy::Error is the
// only way out.
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_common.hpp"
#include "fuzz_idx.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  z_stream zs{};
  if (deflateInit2(&zs, 1, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) std::abort();
  std::vector<std::uint8_t> gz(deflateBound(&zs, static_cast<uLong>(size)) + 64);
  zs.next_in = const_cast<Bytef*>(data);
  zs.avail_in = static_cast<uInt>(size);
  zs.next_out = gz.data();
  zs.avail_out = static_cast<uInt>(gz.size());
  if (deflate(&zs, Z_FINISH) != Z_STREAM_END) std::abort();
  gz.resize(zs.total_out);
  deflateEnd(&zs);
  if (size && data[0] % 16 == 15) gz.resize(gz.size() / 2);
  const std::string path = fuzz::write_temp("idx.gz", gz.data(), gz.size());
  fuzz::read_idx_and_touch(path);
  return 0;
}
