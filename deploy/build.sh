#!/usr/bin/env bash
# Configures and builds fuyou into ./build (RelWithDebInfo, Ninja, all cores).
# Extra arguments go to the configure step, e.g. deploy/build.sh -DFUYOU_BUILD_BENCHMARKS=OFF.
# Set BUILD_DIR to build elsewhere. The main job and the test command both build
# through here with the same flags, so the second one builds nothing new; it
# compiles through ccache when installed (CCACHE_DIR to keep the cache elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  # Paths relative to the checkout, so that clones elsewhere share the cache.
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
  # Without this, ccache hashes the working directory into every -g compile
  # and a clone at another path (a worktree, CI's fresh clone) rebuilds all.
  export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
fi

cmake -S . -B "$BUILD_DIR" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython3_EXECUTABLE="$PWD/${FUYOU_VENV:-.venv}/bin/python" \
  "${launcher[@]}" \
  "$@"
cmake --build "$BUILD_DIR" -j"$(nproc)"
