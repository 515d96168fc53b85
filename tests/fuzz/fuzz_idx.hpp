// Shared by the two IDX harnesses: read a file and touch every byte of what was read.
#pragma once

#include <string>

#include <lazytensor/data/idx.hpp>

namespace fuzz {

/// Reads the IDX file at `path` and touches every byte; lazy::Error is the only way out.
inline void read_idx_and_touch(const std::string& path) {
  try {
    const auto a = lazy::data::read_idx(path);
    unsigned sink = 0;
    for (const auto b : a.data) sink += b;
    volatile unsigned keep = sink;
    (void)keep;
  } catch (const lazy::Error&) {
  }
}

}  // namespace fuzz
