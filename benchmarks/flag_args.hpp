#pragma once
// `--name value` arguments of the benchmark programs that are not Google Benchmark ones
// (the MPI benchmarks, whose every process takes part in every measurement).

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace bench {

/// One flag: its name and the number it sets.
struct Flag {
  const char* name;
  double* value;
};

/// Sets each flag's value from argv; prints `usage` and exits on anything else.
inline void parse_flags(int argc, char** argv, const std::vector<Flag>& flags, const char* usage) {
  for (int i = 1; i < argc; i += 2) {
    bool known = false;
    for (const auto& f : flags) {
      if (argv[i] == std::string(f.name) && i + 1 < argc) {
        *f.value = std::atof(argv[i + 1]);
        known = true;
      }
    }
    if (!known) {
      std::fprintf(stderr, "usage: %s\n", usage);
      std::exit(2);
    }
  }
}

}  // namespace bench
