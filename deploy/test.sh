#!/usr/bin/env bash
# The test command (.ci/run runs it): installs dependencies, builds, runs every
# C++ and Python test registered with CTest, then the sanitizer pass. Exits
# non-zero when anything fails.
#
#   1. build/ (RelWithDebInfo): every test except label `fuzz`.
#   2. build-asan/ (ASan + UBSan, -O1, without the Python module and benchmarks):
#      the C++ unit and integration tests of label `sanitizer`, then the RPC fuzz
#      test (label `fuzz`) against the sanitized fuyoud.
#
# Arguments select tests of step 1 and skip step 2 (unless FUYOU_SANITIZERS=1):
#   deploy/test.sh -L python      deploy/test.sh -R Storage      deploy/test.sh -L fuzz
#
# CTest labels:
#   unit          C++ unit tests (also labelled by part: storage, optimizer, wire, clientlib)
#   integration   a real fuyoud process: the C++ integration tests, python_tests, rpc_fuzz
#   python        the pytest suite (build/ only; the Python module is not sanitized)
#   gpu           needs CUDA (built only where nvcc exists; never sanitized)
#   sanitizer     the C++ tests that step 2 runs under ASan + UBSan
#   slow          too slow for step 2: run in step 1 only (none today: the whole C++
#                 suite takes 1-2 min under ASan + UBSan on 2 cores)
#   package       the Debian package (cpack) installed into an empty root with dpkg --root,
#                 and systemd-analyze verify of its unit (tests/package/; ~20 s)
#   fuzz          rpc_fuzz: hypothesis-generated and mutated messages on every RPC
#                 against fuyoud, beside a legitimate job of another user
#
# Environment:
#   FUYOU_SANITIZERS=0|1    skip step 2 / run it even when arguments were given
#   FUYOU_FUZZ_SECONDS=N    how long rpc_fuzz fuzzes (default 60)
#   CTEST_PARALLEL_LEVEL=N  runs tests side by side
#   ASAN_OPTIONS, UBSAN_OPTIONS, LSAN_OPTIONS  override the defaults built into
#                           sanitized binaries (cmake/sanitizer_options.cc)
# Compiles through ccache when it is installed (CCACHE_DIR to keep it elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  # Paths relative to the checkout, so that clones elsewhere share the cache.
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
fi

elapsed() { echo "test.sh: $1 took $((SECONDS - $2)) s"; }

start=$SECONDS
deploy/build.sh "${launcher[@]}"
elapsed "build" "$start"

start=$SECONDS
if [[ $# -gt 0 ]]; then
  ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure "$@"
else
  ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -LE fuzz
fi
elapsed "tests in ${BUILD_DIR:-build}" "$start"

if [[ ${FUYOU_SANITIZERS:-$([[ $# -eq 0 ]] && echo 1 || echo 0)} != 1 ]]; then
  exit 0
fi

start=$SECONDS
BUILD_DIR=build-asan deploy/build.sh "${launcher[@]}" \
  -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-g -O1" "-DCMAKE_C_FLAGS_DEBUG=-g -O1" \
  -DFUYOU_SANITIZE=address,undefined -DFUYOU_BUILD_PYTHON=OFF -DFUYOU_BUILD_BENCHMARKS=OFF
elapsed "sanitizer build" "$start"

start=$SECONDS
ctest --test-dir build-asan --output-on-failure -L sanitizer -LE fuzz
elapsed "sanitizer tests" "$start"

start=$SECONDS
ctest --test-dir build-asan --output-on-failure -L fuzz
elapsed "fuzz test" "$start"
