#!/usr/bin/env bash
# The MLP training step of this checkout against the same step built from an older
# revision (default ef138d9, the last commit before the performance engine), both
# compiled from benchmarks/history/mlp_step.cpp with the same flags and run alternately
# (this machine's speed drifts; alternation keeps both sides in the same conditions).
#
#   scripts/mlp_step_vs_revision.sh [REV] [THREADS] [PAIRS]
#
# Prints each pair's ms per step and the median ratio old/new (> 1: this checkout faster).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rev=${1:-ef138d9}
threads=${2:-1}
pairs=${3:-5}
cxx=${CXX:-g++}
flags=(-std=c++20 -O3 -DNDEBUG -march=native -pthread -isystem /usr/include/eigen3)
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/old" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$root" worktree add --detach -q "$work/old" "$rev"
"$cxx" "${flags[@]}" -I "$work/old/include" "$root/benchmarks/history/mlp_step.cpp" -o "$work/mlp_old"
"$cxx" "${flags[@]}" -I "$root/include" "$root/benchmarks/history/mlp_step.cpp" -o "$work/mlp_new"
ratios=()
for ((i = 1; i <= pairs; ++i)); do
  old=$(LAZYTENSOR_NUM_THREADS=$threads "$work/mlp_old")
  new=$(LAZYTENSOR_NUM_THREADS=$threads "$work/mlp_new")
  ratio=$(python3 -c "print(f'{$old / $new:.3f}')")
  ratios+=("$ratio")
  echo "pair $i: $rev $old ms/step, this checkout $new ms/step, ratio $ratio"
done
python3 -c "import statistics, sys; print(f'median ratio ($rev / this checkout, $threads thread(s)): {statistics.median(map(float, sys.argv[1:])):.3f}x')" "${ratios[@]}"
