#!/usr/bin/env bash
# Runs the file readers' fuzz harnesses (tests/fuzz/) for longer than CI does.
#
#   scripts/fuzz.sh [SECONDS] [NAME...]     each harness for SECONDS (default 600), one per core
#   FUZZ_RUNS=N scripts/fuzz.sh ...         ... or until it has run N inputs, if sooner
#
# Builds them in $FUZZ_BUILD_DIR (default build-fuzz: Clang, ASan+UBSan, libFuzzer). Each
# starts from its seed corpus and keeps what it finds in <build>/tests/fuzz/found_<name>, so a
# second run continues; a finding is saved as <build>/tests/fuzz/crash_<name>_* and the script
# fails. Prints each harness's input count and time (libFuzzer's final stats).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-600}
shift || true
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(safetensors_json safetensors_bytes safetensors_file idx_raw idx_gzip)
dir=${FUZZ_BUILD_DIR:-$root/build-fuzz}
jobs=${JOBS:-$(nproc)}
max_runs=${FUZZ_RUNS:--1}
# The harnesses that read files write each input to a temporary file: in memory, they run
# about 5x faster than on disk.
if [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then export TMPDIR=/dev/shm; fi
cmake -S "$root" -B "$dir" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -DLAZYTENSOR_NATIVE=OFF -DLAZYTENSOR_SANITIZE=address,undefined \
  -DLAZYTENSOR_BUILD_TESTS=ON -DLAZYTENSOR_BUILD_EXAMPLES=OFF -DLAZYTENSOR_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$dir" -j"$jobs" --target lazytensor_fuzzers
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
fuzz="$dir/tests/fuzz"
pids=() logs=()
status=0
run_one() {
  local name=$1 log="$fuzz/fuzz_$name.log"
  mkdir -p "$fuzz/found_$name"
  "$fuzz/fuzz_$name" -max_total_time="$seconds" -runs="$max_runs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    "-artifact_prefix=$fuzz/crash_${name}_" "$fuzz/found_$name" "$root/tests/fuzz/corpus/$name" >"$log" 2>&1
}
for name in "${names[@]}"; do
  run_one "$name" &
  pids+=($!) logs+=("$name")
  if [ ${#pids[@]} -ge "$jobs" ]; then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
for name in "${names[@]}"; do
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$fuzz/fuzz_$name.log" | tail -1)
  secs=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$fuzz/fuzz_$name.log" | tail -1)
  echo "fuzz_$name: ${runs:-?} inputs (${secs:-?}/s)$(ls "$fuzz"/crash_"${name}"_* >/dev/null 2>&1 && echo ', FINDINGS: see crash_* files')"
done
exit $status
