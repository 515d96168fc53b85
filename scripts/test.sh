#!/usr/bin/env bash
# Build lazytensor and run its tests.
#
#   scripts/test.sh                              Release build (-march=native) in $BUILD_DIR (default: build), run ctest
#   scripts/test.sh --sanitize address,undefined ASan+UBSan build in build-asan, run the whole suite
#   scripts/test.sh --sanitize thread            TSan build in build-tsan, run tests labelled "tsan"
#   scripts/test.sh --all                        everything CI runs: tests (benchmarks not built), single-header check and
#                                                smoke test, installed-package / add_subdirectory / FetchContent
#                                                consumers, ASan+UBSan suite, TSan suite
#   scripts/test.sh [...] -- <ctest args>        extra arguments for ctest (e.g. -- -R shape)
#
# Environment: BUILD_DIR, ASAN_BUILD_DIR, TSAN_BUILD_DIR, JOBS, CXX (single-header smoke compiler),
#              SANITIZER_CXX (compiler of the sanitizer builds; default clang++ when installed).
set -euo pipefail

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$LT_ROOT"

usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

mode=normal
sanitize=""
ctest_extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --all) mode=all ;;
    --sanitize) [ $# -ge 2 ] || die "--sanitize needs a value (address,undefined | thread)"
                mode=sanitize; sanitize="$2"; shift ;;
    --sanitize=*) mode=sanitize; sanitize="${1#--sanitize=}" ;;
    -h|--help) usage; exit 0 ;;
    --) shift; ctest_extra=("$@"); break ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
  shift
done

ensure_packages cmake g++ make libeigen3-dev libxsimd-dev libgtest-dev libbenchmark-dev ccache \
  libopenmpi-dev openmpi-bin \
  zlib1g-dev dataset-fashion-mnist gnuplot-nox
case "$mode:${SANITIZER_CXX:-clang++}" in
  normal:*) ;;
  *:clang*)
    # The sanitizer builds use Clang (see run_sanitized); its sanitizer runtimes are a
    # package of their own (libclang-rt-dev: the one of Debian's default Clang).
    ensure_packages clang libclang-rt-dev ;;
esac

# --------------------------------------------------------------------------------------------
run_default() {
  local dir="${BUILD_DIR:-build}" benchmarks="${1:-ON}"
  section "configure + build ($dir, Release, LAZYTENSOR_NATIVE=ON)"
  # The library's compiled runtime and the examples build at -O2 (a third faster to compile
  # than -O3, same vectorized code paths); the tests at -Og with -O2's strict aliasing
  # (tests/CMakeLists.txt: ~0.7x -O1's compile time, the same xsimd kernels); benchmarks
  # add -O3 themselves (lazytensor_bench_flags).
  cmake -S . -B "$dir" \
    -DCMAKE_BUILD_TYPE=Release \
    "-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG" \
    "-DLAZYTENSOR_TEST_OPTIMIZE=-Og -fstrict-aliasing" \
    -DLAZYTENSOR_NATIVE=ON \
    -DLAZYTENSOR_SANITIZE= \
    -DLAZYTENSOR_BUILD_TESTS=ON \
    -DLAZYTENSOR_BUILD_EXAMPLES=ON \
    "-DLAZYTENSOR_BUILD_BENCHMARKS=$benchmarks"
  cmake --build "$dir" -j"$JOBS"
  section "tests ($dir)"
  ctest --test-dir "$dir" --output-on-failure --no-tests=error -j"$JOBS" "${ctest_extra[@]}"
}

run_sanitized() {
  local kind="$1" dir ctest_args=() norandom=()
  case "$kind" in
    address,undefined|undefined,address|address|undefined)
      dir="${ASAN_BUILD_DIR:-build-asan}"
      export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1}"
      export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
      ;;
    thread)
      dir="${TSAN_BUILD_DIR:-build-tsan}"
      export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"
      ctest_args=(-L tsan)
      ;;
    *) die "unsupported sanitizer '$kind' (use address,undefined | thread)" ;;
  esac
  # Sanitizer runtimes can trip over high ASLR entropy on recent kernels; run without
  # address randomization when the sandbox allows it.
  if command -v setarch >/dev/null 2>&1 && setarch "$(uname -m)" -R true >/dev/null 2>&1; then
    norandom=(setarch "$(uname -m)" -R)
  fi
  section "configure + build ($dir, sanitize=$kind)"
  # No -g (reports name functions from the symbol table). ASan+UBSan at -O0: the element-wise
  # and reduction tests instantiate hundreds of kernels, and instrumented -O1 spends ~45% more
  # compile time on them than -O0, which runs the suite ~2.3x slower (1.5 min -> ~3.5 min):
  # the trade saves ~10 min of CI. TSan keeps -O1 (its concurrent tests wait on each other, and
  # -O0 would stretch their races' timing).
  local opt=-O0
  if [ "$kind" = thread ]; then opt=-O1; fi
  # Clang compiles the instrumented tests in about half GCC's time (test_gradcheck.cpp at -O0
  # with ASan+UBSan: 66 s against 135 s of CPU on a Zen 3), and the Release build already
  # covers GCC, so the sanitizers also give the suite a second compiler.
  # SANITIZER_CXX overrides the choice.
  local san_cxx="${SANITIZER_CXX:-}"
  if [ -z "$san_cxx" ]; then
    if command -v clang++ >/dev/null 2>&1; then san_cxx=clang++; else san_cxx=g++; fi
  fi
  # A build folder configured with another compiler starts over: CMake would reset its cache
  # itself, dropping this command's other -D options (and with them the sanitizers).
  local cached
  cached="$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$dir/CMakeCache.txt" 2>/dev/null || true)"
  if [ -n "$cached" ] && [ "$cached" != "$(command -v "$san_cxx" || echo "$san_cxx")" ]; then
    echo "note: $dir was configured with $cached; configuring it again for $san_cxx"
    rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
  fi
  cmake -S . -B "$dir" \
    "-DCMAKE_CXX_COMPILER=$san_cxx" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$opt" \
    -DLAZYTENSOR_TEST_OPTIMIZE= \
    -DLAZYTENSOR_NATIVE=OFF \
    "-DLAZYTENSOR_SANITIZE=$kind" \
    -DLAZYTENSOR_BUILD_TESTS=ON \
    -DLAZYTENSOR_BUILD_EXAMPLES=OFF \
    -DLAZYTENSOR_BUILD_BENCHMARKS=OFF
  if [ "$kind" = thread ]; then
    # Only the concurrent parts run under TSan: build just those.
    cmake --build "$dir" -j"$JOBS" --target lazytensor_tsan_tests
  else
    cmake --build "$dir" -j"$JOBS"
  fi
  section "tests ($dir, sanitize=$kind${ctest_args[*]:+, ctest ${ctest_args[*]}})"
  "${norandom[@]}" ctest --test-dir "$dir" --output-on-failure --no-tests=error -j"$JOBS" \
    "${ctest_args[@]}" "${ctest_extra[@]}"
}

run_amalgamate_check() {
  section "single header: staleness check"
  cmake -DCHECK=ON -P scripts/amalgamate.cmake
}

run_single_header_smoke() {
  local src=tests/single_header/main.cpp
  if [ ! -f "$src" ]; then
    section "single header: smoke test skipped ($src not present)"
    return 0
  fi
  section "single header: smoke test"
  local eigen_inc cxx=("${CXX:-g++}")
  eigen_inc="$(pkg-config --cflags-only-I eigen3 2>/dev/null || true)"
  [ -n "$eigen_inc" ] || eigen_inc="-I/usr/include/eigen3"
  command -v ccache >/dev/null 2>&1 && cxx=(ccache "${cxx[@]}")
  # shellcheck disable=SC2086  # eigen_inc may hold several -I flags
  "${cxx[@]}" -std=c++20 -O2 -Wall -Wextra -Wpedantic -pthread \
    -I single_include $eigen_inc "$src" -o "$tmp/single_header_smoke"
  "$tmp/single_header_smoke"
  echo "single header smoke test: OK"
  # The MPI backend from the single header: mpicxx, LAZYTENSOR_WITH_MPI, 2 processes.
  if command -v mpicxx >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
    section "single header: MPI smoke test (mpirun -np 2)"
    local mpicxx=(mpicxx)
    command -v ccache >/dev/null 2>&1 && mpicxx=(ccache mpicxx)
    # shellcheck disable=SC2086
    "${mpicxx[@]}" -std=c++20 -O1 -Wall -Wextra -pthread -DLAZYTENSOR_WITH_MPI=1 \
      -I single_include $eigen_inc tests/single_header/mpi_main.cpp -o "$tmp/single_header_mpi"
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      mpirun -np 2 --oversubscribe "$tmp/single_header_mpi"
    echo "single header MPI smoke test: OK"
  fi
}

run_package_consumers() {
  local launcher
  launcher="$(cmake_launcher_args)"
  local common=(-DCMAKE_BUILD_TYPE=Release ${launcher:+"$launcher"})

  section "package: install + find_package consumer"
  cmake --install "${BUILD_DIR:-build}" --prefix "$tmp/prefix"
  # The installed library comes from the Release build above, compiled with -march=native:
  # its consumer must use the same instruction set (core/config.hpp; a mismatch does not link).
  cmake -S tests/package -B "$tmp/pkg-find" "${common[@]}" -DCMAKE_CXX_FLAGS=-march=native \
    "-DCMAKE_PREFIX_PATH=$tmp/prefix" -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON
  grep -q "^lazytensor_DIR:PATH=$tmp/prefix/" "$tmp/pkg-find/CMakeCache.txt" \
    || die "find_package(lazytensor) did not pick up the freshly installed package"
  cmake --build "$tmp/pkg-find" -j"$JOBS"
  "$tmp/pkg-find/lazytensor_package_test"
  "$tmp/pkg-find/lazytensor_package_compiled_test"
  echo "find_package consumers (header-only and lazytensor::compiled): OK"
  if [ -x "$tmp/pkg-find/lazytensor_package_mpi_test" ] && command -v mpirun >/dev/null 2>&1; then
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      mpirun -np 2 --oversubscribe "$tmp/pkg-find/lazytensor_package_mpi_test"
    echo "find_package consumer of lazytensor::mpi (mpirun -np 2): OK"
  fi

  section "package: add_subdirectory consumer"
  cmake -S tests/package/subdir -B "$tmp/pkg-subdir" "${common[@]}"
  cmake --build "$tmp/pkg-subdir" -j"$JOBS"
  "$tmp/pkg-subdir/lazytensor_subdir_test"
  echo "add_subdirectory consumer: OK"

  section "package: FetchContent consumer"
  cmake -S tests/package/subdir -B "$tmp/pkg-fetch" "${common[@]}" -DCONSUMER_USE_FETCHCONTENT=ON
  cmake --build "$tmp/pkg-fetch" -j"$JOBS"
  "$tmp/pkg-fetch/lazytensor_subdir_test"
  echo "FetchContent consumer: OK"
}

# --------------------------------------------------------------------------------------------
case "$mode" in
  normal)
    run_default
    ;;
  sanitize)
    run_sanitized "$sanitize"
    ;;
  all)
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/lazytensor-ci.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    # CI leaves the benchmarks out (~4 min of -O3 compiles that test nothing):
    # scripts/bench_report.py and a plain scripts/test.sh build them.
    run_default OFF
    run_amalgamate_check
    run_single_header_smoke
    run_package_consumers
    run_sanitized address,undefined
    run_sanitized thread
    section "all checks passed"
    ;;
esac
