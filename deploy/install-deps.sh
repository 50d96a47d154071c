#!/usr/bin/env bash
# Installs every build, test and run dependency of fuyou from Debian 12's packages.
#
# Idempotent and fast on a machine that already has them: packages that dpkg
# reports as installed are skipped, and `apt-get update` runs only when something
# is missing and the package lists are older than an hour (or absent).
# Uses sudo only when not run as root. No PyPI: the Python side uses Debian's
# python3-* packages with /usr/bin/python3.
set -euo pipefail

PACKAGES=(
  # toolchain (ccache: deploy/test.sh compiles through it when present)
  cmake ninja-build g++ pkg-config ccache
  # C++ libraries (gRPC/protobuf, io_uring, Boost.Interprocess, fmt, CLI11,
  # toml++, xxHash, sd_notify)
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  liburing-dev libboost-dev libfmt-dev libcli11-dev libtomlplusplus-dev
  libxxhash-dev libsystemd-dev
  # C++ tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # Python client (pybind11 module) and the example / Python tests
  pybind11-dev python3-pybind11 python3-dev python3-torch python3-numpy
  python3-pytest python3-tqdm python3-matplotlib python3-grpcio python3-protobuf
  # the RPC fuzz test (tests/fuzz)
  python3-hypothesis
  # the Prometheus endpoint's tests: the exposition parser, and a real server
  # that scrapes fuyoud (tests/python/test_metrics.py)
  python3-prometheus-client prometheus
  # An optimized BLAS for Debian's torch. Without it torch falls back to the
  # reference libblas3 and a matmul runs ~20x slower (6 vs 140 GFLOPS on 2 cores),
  # which makes the example and the torch.optim baselines crawl.
  libopenblas0-pthread
  # I/O baseline for the storage benchmarks
  fio
  # the Debian package and its tests (label package): cpack's dpkg-shlibdeps,
  # dpkg --root, useradd in the postinst, systemd-analyze verify of the unit
  dpkg-dev passwd systemd
)

if [[ $(id -u) -eq 0 ]]; then
  SUDO=()
else
  SUDO=(sudo)
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)
  if [[ $status != ii* ]]; then
    missing+=("$pkg")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"

# Refresh the package lists unless a refresh happened in the last hour.
lists=/var/lib/apt/lists
if [[ -z $(find "$lists" -maxdepth 1 -name '*_InRelease' -mmin -60 -print -quit 2>/dev/null) ]]; then
  "${SUDO[@]}" apt-get update
fi

"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y --no-install-recommends "${missing[@]}"
