#!/usr/bin/env bash
# Build and run the lazytensor demo example: Fashion-MNIST training (examples/fashion_mnist).
# Arguments are passed to the example; without any, it runs DEMO_ARGS (the MLP for 3
# epochs on one replica per hardware thread).
#
#   scripts/demo.sh [example args...]      e.g. scripts/demo.sh --model cnn --epochs 5
#
# Environment: DEMO_BUILD_DIR (default: build-demo), JOBS.
set -euo pipefail

# ---- what the demo is (change these when the headline example changes) ---------------------
DEMO_TARGET="${DEMO_TARGET:-fashion_mnist}"                    # CMake target to build
DEMO_EXE="${DEMO_EXE:-examples/fashion_mnist/fashion_mnist}"   # executable, relative to the build dir
DEMO_ARGS=(--model mlp --epochs 3)                             # used when no argument is given
DEMO_PACKAGES=(cmake g++ make libeigen3-dev libxsimd-dev ccache zlib1g-dev dataset-fashion-mnist)
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

if [ "$#" -eq 0 ]; then
  set -- "${DEMO_ARGS[@]}"
fi
section "run $DEMO_EXE $*"
exec "$dir/$DEMO_EXE" "$@"
