#!/usr/bin/env bash
# Installs every build, test and run dependency of fuyou:
#
#   1. the C++ side from Debian 12's packages (below). Packages that dpkg reports as
#      installed are skipped, and `apt-get update` runs only when something is
#      missing and the package lists are older than an hour (or absent).
#   2. the Python side from PyPI into a venv of the project's own, .venv/ (torch 2,
#      numpy, pytest, ... and the wheel's build tools), every version pinned in
#      deploy/python-lock.txt. The wheels are kept in a wheelhouse
#      (~/.cache/fuyou/wheels), so a second venv (a fresh clone, CI) installs
#      without the network; the venv is made anew only when the lock file or the
#      Python changes (.venv/.fuyou-lock holds what it was made from).
#
# Environment:
#   FUYOU_PYTHON=/usr/bin/python3
#                            the interpreter the venv is made from (3.10 or newer,
#                            with its headers: the binding compiles against them).
#                            Debian's by default: every user can run it, which the
#                            tests that train as another uid need (a pyenv Python
#                            under /root is not); any other works for one user.
#   FUYOU_VENV=.venv         where the venv goes
#   FUYOU_WHEELHOUSE=DIR     where the wheels are kept
# Uses sudo only when not run as root.
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
  # the venv (step 2): Debian's Python 3.11 with its venv module and headers
  python3-venv python3-dev
  # a real Prometheus server that scrapes fuyoud (tests/python/test_metrics.py)
  prometheus
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
  echo "install-deps: all ${#PACKAGES[@]} Debian packages already installed"
else
  echo "install-deps: installing ${missing[*]}"
  # Refresh the package lists unless a refresh happened in the last hour.
  lists=/var/lib/apt/lists
  if [[ -z $(find "$lists" -maxdepth 1 -name '*_InRelease' -mmin -60 -print -quit 2>/dev/null) ]]; then
    "${SUDO[@]}" apt-get update
  fi
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${missing[@]}"
fi

# 2. The venv.
cd "$(dirname "$0")/.."
lock=deploy/python-lock.txt
venv=${FUYOU_VENV:-.venv}
python=${FUYOU_PYTHON:-/usr/bin/python3}
wheelhouse=${FUYOU_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/fuyou/wheels}
if ! "$python" -c 'import sys, sysconfig, os, venv
sys.exit(sys.version_info < (3, 10) or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
  echo "install-deps: $python is not a Python 3.10+ with venv and its headers (Python.h); set FUYOU_PYTHON" >&2
  exit 1
fi
made_from="$("$python" -c 'import sys; print(sys.version)' | head -1) $(realpath "$(command -v "$python")") $(sha256sum < "$lock")"
if [[ -x $venv/bin/python && -f $venv/.fuyou-lock && $(cat "$venv/.fuyou-lock") == "$made_from" ]]; then
  echo "install-deps: $venv is up to date with $lock"
  exit 0
fi
echo "install-deps: making $venv from $lock (wheels kept in $wheelhouse)"
rm -rf -- "$venv"
"$python" -m venv "$venv"
mkdir -p "$wheelhouse"
offline() { "$venv/bin/pip" install -q --no-index --find-links "$wheelhouse" -r "$lock"; }
if ! offline 2>/dev/null; then
  "$venv/bin/pip" download -q -d "$wheelhouse" -r "$lock"
  offline
fi
echo "$made_from" > "$venv/.fuyou-lock"
echo "install-deps: $venv ready: $("$venv/bin/python" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
