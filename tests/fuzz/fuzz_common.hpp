// Shared by the fuzz harnesses: a private temporary file per harness process, for the
// readers that take a path.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

namespace fuzz {

/// Writes `size` bytes to this process's file `name` in the temporary directory; returns
/// its path (rewritten on every call, so one file serves a whole fuzzing run).
inline std::string write_temp(const char* name, const std::uint8_t* data, std::size_t size) {
  static const std::string dir = std::filesystem::temp_directory_path().string();
  const std::string path = dir + "/lazytensor_fuzz_" + std::to_string(::getpid()) + "_" + name;
  static const struct Remove {  // the file goes when the run ends
    std::string p;
    ~Remove() { std::remove(p.c_str()); }
  } remove_at_exit{path};
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace fuzz
