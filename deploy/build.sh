#!/usr/bin/env bash
# Configures and builds fuyou into ./build (RelWithDebInfo, Ninja, all cores).
# Extra arguments go to the configure step, e.g. deploy/build.sh -DFUYOU_BUILD_BENCHMARKS=OFF.
# Set BUILD_DIR to build elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}

cmake -S . -B "$BUILD_DIR" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython3_EXECUTABLE=/usr/bin/python3 \
  "$@"
cmake --build "$BUILD_DIR" -j"$(nproc)"
