#!/usr/bin/env bash
# Builds, on this (build) machine, what the GPU machine needs to run fuyou's GPU
# check, into one folder (under 64 MiB) that travels with the working tree:
#
#   gpu-bundle/fuyoud            the daemon (from ./build, built if needed)
#   gpu-bundle/lib/*.so*         every shared library fuyoud and the binding need
#                                 that is not glibc's (ldd), so neither needs Debian's libs
#   gpu-bundle/lib-cxx/          Debian's libstdc++ and libgcc_s, used there only if needed
#   gpu-bundle/python/fuyou/_fuyou.cpython-312-*.so
#                                the binding built for pyenv's Python 3.12 (the GPU
#                                machine's Python: 3.12 with torch 2.x)
#
# Then, there:  deploy/gpu-check.sh   (runs the GPU tests, the loop check and the benchmark)
#
# Usage: deploy/gpu-bundle.sh            (BUNDLE=dir, BUILD_DIR=build, PY312=python3.12 to override)
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
BUILD312=${BUILD312:-build-py312}
BUNDLE=${BUNDLE:-gpu-bundle}
PY312=${PY312:-$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)}
if [[ -z "$PY312" || ! -x "$PY312" ]]; then
  echo "gpu-bundle: no Python 3.12 found (set PY312=/path/to/python3.12)" >&2
  exit 2
fi
# pybind11's CMake files from the project's venv (deploy/install-deps.sh)
PYBIND11_DIR=$(.venv/bin/python -c "import pybind11; print(pybind11.get_cmake_dir())")
LAUNCH=()
if command -v ccache >/dev/null; then
  LAUNCH=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi

# 1. fuyoud from the normal build.
if [[ ! -x "$BUILD_DIR/daemon/fuyoud" ]]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPython3_EXECUTABLE="$PWD/.venv/bin/python" "${LAUNCH[@]}"
fi
ninja -C "$BUILD_DIR" fuyoud

# 2. The binding for Python 3.12: a second build tree that builds only _fuyou
#    (the venv's pybind11 headers against pyenv's Python 3.12 headers). It writes
#    python_client/fuyou/_fuyou.cpython-312-*.so next to Debian's build of it.
cmake -S . -B "$BUILD312" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython3_EXECUTABLE="$PY312" -Dpybind11_DIR="$PYBIND11_DIR" \
  -DPYBIND11_PYTHON_VERSION=3.12 -DPYTHON_EXECUTABLE="$PY312" \
  -DFUYOU_BUILD_TESTS=ON -DFUYOU_BUILD_BENCHMARKS=ON "${LAUNCH[@]}" >/dev/null
ninja -C "$BUILD312" _fuyou
BINDING=$(ls python_client/fuyou/_fuyou.cpython-312-*.so | head -1)

# 3. The folder: binaries, then every library they load that glibc does not provide.
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/lib" "$BUNDLE/python/fuyou"
cp "$BUILD_DIR/daemon/fuyoud" "$BUNDLE/fuyoud"
cp "$BINDING" "$BUNDLE/python/fuyou/"
strip --strip-debug "$BUNDLE/fuyoud" "$BUNDLE/python/fuyou/"*.so
is_glibc() {
  case "$(basename "$1")" in
    ld-linux*|libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libresolv.so*) return 0 ;;
    *) return 1 ;;
  esac
}
for bin in "$BUNDLE/fuyoud" "$BUNDLE"/python/fuyou/*.so; do
  ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
    is_glibc "$lib" && continue
    [[ "$lib" == *libpython3.12* ]] && continue  # the GPU machine's Python has its own
    [[ -e "$BUNDLE/lib/$(basename "$lib")" ]] || cp -L "$lib" "$BUNDLE/lib/"
  done
done
strip --strip-debug "$BUNDLE"/lib/*.so* 2>/dev/null || true
# The C++ runtime goes apart: the GPU machine's Python (and torch) may need a newer
# libstdc++ than Debian's; gpu-check.sh adds lib-cxx only where the system's is too old.
mkdir -p "$BUNDLE/lib-cxx"
mv "$BUNDLE"/lib/libstdc++.so* "$BUNDLE"/lib/libgcc_s.so* "$BUNDLE/lib-cxx/" 2>/dev/null || true

# 4. Checks: fuyoud starts with only the bundle's libs; the size fits.
env -i LD_LIBRARY_PATH="$BUNDLE/lib:$BUNDLE/lib-cxx" "$BUNDLE/fuyoud" --version
env -i LD_LIBRARY_PATH="$BUNDLE/lib:$BUNDLE/lib-cxx" "$PY312" -c \
  "import importlib.util as u, sys; s = u.spec_from_file_location('_fuyou', sys.argv[1]); \
m = u.module_from_spec(s); s.loader.exec_module(m); print('binding for', sys.version.split()[0], 'loads')" \
  "$BUNDLE"/python/fuyou/_fuyou.cpython-312-*.so
SIZE=$(du -sm "$BUNDLE" | cut -f1)
echo "gpu-bundle: $BUNDLE is ${SIZE} MiB ($(ls "$BUNDLE/lib" | wc -l) libraries)"
if (( SIZE >= 64 )); then
  echo "gpu-bundle: $BUNDLE is ${SIZE} MiB, over the 64 MiB a device run carries" >&2
  exit 1
fi
echo "gpu-bundle: ready; on the GPU machine run: deploy/gpu-check.sh"
