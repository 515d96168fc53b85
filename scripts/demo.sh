#!/usr/bin/env bash
# Build and run the lazytensor demo example. Extra arguments are passed to the example.
#
#   scripts/demo.sh [example args...]
#
# Environment: DEMO_BUILD_DIR (default: build-demo), JOBS.
set -euo pipefail

# ---- what the demo is (change these when the headline example changes) ---------------------
DEMO_TARGET="${DEMO_TARGET:-quickstart}"                  # CMake target to build
DEMO_EXE="${DEMO_EXE:-examples/quickstart/quickstart}"    # executable, relative to the build dir
DEMO_PACKAGES=(cmake g++ make libeigen3-dev libxsimd-dev libboost-dev ccache)
# ---------------------------------------------------------------------------------------------

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$LT_ROOT"

dir="${DEMO_BUILD_DIR:-build-demo}"

ensure_packages "${DEMO_PACKAGES[@]}"

section "configure + build $DEMO_TARGET ($dir)"
cmake -S . -B "$dir" \
  -DCMAKE_BUILD_TYPE=Release \
  -DLAZYTENSOR_NATIVE=ON \
  -DLAZYTENSOR_BUILD_TESTS=OFF \
  -DLAZYTENSOR_BUILD_BENCHMARKS=OFF \
  -DLAZYTENSOR_BUILD_EXAMPLES=ON
cmake --build "$dir" -j"$JOBS" --target "$DEMO_TARGET"

section "run $DEMO_EXE $*"
exec "$dir/$DEMO_EXE" "$@"
