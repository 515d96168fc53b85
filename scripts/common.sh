# Shared helpers for scripts/test.sh and scripts/demo.sh. Source it; do not run it.
# shellcheck shell=bash disable=SC2034  # variables are used by the sourcing scripts

# Repository root (the parent of scripts/).
LT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Let ccache hit across clones in different directories (CI builds a fresh clone).
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$LT_ROOT}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
# The tests use a precompiled header; ccache caches such compiles only with these.
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"

# Parallelism for builds and ctest (override with JOBS=N).
JOBS="${JOBS:-$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)}"

# A heading, with the time since the script started (the CI log then shows each stage's cost).
section() {
  printf '\n\033[1;34m==== %s (at %dm%02ds) ====\033[0m\n' "$*" $((SECONDS / 60)) $((SECONDS % 60))
}

die() {
  printf '\033[1;31merror:\033[0m %s\n' "$*" >&2
  exit 1
}

# ensure_packages pkg...  — install the Debian packages that are missing (dpkg -s).
# Skipped (with a note) on systems without dpkg.
ensure_packages() {
  if ! command -v dpkg >/dev/null 2>&1; then
    echo "note: dpkg not found; not checking system packages ($*)"
    return 0
  fi
  local missing=() pkg
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    return 0
  fi
  section "installing missing packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "missing packages (${missing[*]}) and not root, no sudo"
    sudo=(sudo -E)
  fi
  "${sudo[@]}" apt-get update
  "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
}

# Extra CMake arguments shared by every configure: use ccache when available.
cmake_launcher_args() {
  if command -v ccache >/dev/null 2>&1; then
    echo "-DCMAKE_CXX_COMPILER_LAUNCHER=$(command -v ccache)"
  fi
}
