#!/usr/bin/env bash
# The test command: installs dependencies, builds (the same build/ as the main
# job: after deploy/main-job.sh nothing new is compiled), runs every C++ and
# Python test registered with CTest once. Exits non-zero when anything fails.
#
#   1. build/ (RelWithDebInfo): every test (the RPC fuzz test included).
#   2. only with FUYOU_SANITIZERS=1 (what .ci/run sets): build-asan/ (ASan +
#      UBSan, -O1, line tables only (-g1: the reports' file:line, a fifth less
#      compile time than -g), without the Python module and benchmarks): the C++ unit and
#      integration tests of label `sanitizer`, then the RPC fuzz test (label
#      `fuzz`) against the sanitized fuyoud; step 1 then leaves fuzz to it.
#
# Arguments select tests of step 1:
#   deploy/test.sh -L python      deploy/test.sh -R Storage      deploy/test.sh -L fuzz
#
# CTest labels:
#   unit          C++ unit tests (also labelled by part: storage, optimizer, wire, clientlib)
#   integration   a real fuyoud process: the C++ integration tests, python_tests, rpc_fuzz
#   python        the pytest suite (build/ only; the Python module is not sanitized)
#   gpu           needs CUDA (built only where nvcc exists; never sanitized)
#   sanitizer     the C++ tests that step 2 runs under ASan + UBSan
#   slow          too slow for step 2: run in step 1 only (python_data_parallel_tests,
#                 the gloo ranks of issue 24, run alone: the whole C++
#                 suite takes 1-2 min under ASan + UBSan on 2 cores)
#   package       the Debian package (cpack) installed into an empty root with dpkg --root,
#                 and systemd-analyze verify of its unit (tests/package/; ~20 s)
#   fuzz          rpc_fuzz: hypothesis-generated and mutated messages on every RPC
#                 against fuyoud, beside a legitimate job of another user
#
# Environment:
#   FUYOU_SANITIZERS=0|1    skip step 2 (the default) / run it
#   FUYOU_FUZZ_SECONDS=N    how long rpc_fuzz fuzzes (default 60)
#   CTEST_PARALLEL_LEVEL=N  runs tests side by side
#   ASAN_OPTIONS, UBSAN_OPTIONS, LSAN_OPTIONS  override the defaults built into
#                           sanitized binaries (cmake/sanitizer_options.cc)
# Compiles through ccache when it is installed (deploy/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh

elapsed() { echo "test.sh: $1 took $((SECONDS - $2)) s"; }
sanitizers=${FUYOU_SANITIZERS:-0}

start=$SECONDS
deploy/build.sh
elapsed "build" "$start"

start=$SECONDS
if [[ $# -gt 0 ]]; then
  ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure "$@"
elif [[ $sanitizers == 1 ]]; then
  ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -LE fuzz
else
  ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure
fi
elapsed "tests in ${BUILD_DIR:-build}" "$start"

if [[ $sanitizers != 1 ]]; then
  exit 0
fi

start=$SECONDS
BUILD_DIR=build-asan deploy/build.sh \
  -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-g1 -O1" "-DCMAKE_C_FLAGS_DEBUG=-g1 -O1" \
  -DFUYOU_SANITIZE=address,undefined -DFUYOU_BUILD_PYTHON=OFF -DFUYOU_BUILD_BENCHMARKS=OFF
elapsed "sanitizer build" "$start"

start=$SECONDS
ctest --test-dir build-asan --output-on-failure -L sanitizer -LE fuzz
elapsed "sanitizer tests" "$start"

start=$SECONDS
ctest --test-dir build-asan --output-on-failure -L fuzz
elapsed "fuzz test" "$start"
