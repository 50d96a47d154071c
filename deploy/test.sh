#!/usr/bin/env bash
# The test command: installs dependencies, builds, runs every C++ and Python test
# that is registered with CTest. Exits non-zero when anything fails.
# Extra arguments go to ctest, e.g. deploy/test.sh -L python, or -R Storage;
# CTEST_PARALLEL_LEVEL=2 runs tests side by side.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
deploy/build.sh
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure "$@"
