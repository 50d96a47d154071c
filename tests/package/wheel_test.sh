#!/usr/bin/env bash
# The wheel installs into a clean venv and trains (ctest wheel_test, label package):
#
#   1. `pip wheel` of the repository root builds fuyou-<version>-cp3XX-*.whl with
#      scikit-build-core driving the project's CMake (pyproject.toml; no build
#      isolation: the build tools are the project venv's, pinned in
#      deploy/python-lock.txt); its build tree is BUILD-wheel, beside BUILD at the same
#      depth, so ccache serves the same compiles and a rerun
#      compiles only what changed;
#   2. the wheel holds the package, the binding, fuyou/bin/fuyoud and fuyouctl;
#   3. a new venv (the project venv's base interpreter, nothing else) gets the wheel
#      and its dependencies (torch, numpy) from the wheelhouse install-deps.sh keeps,
#      without the network;
#   4. outside the repository, with no FUYOU_DAEMON and no PYTHONPATH, that venv's
#      python trains a small model 3 steps with fuyou.AdamW against the embedded
#      fuyoud the wheel ships, and matches torch.optim.AdamW; fuyouctl runs from the
#      venv's PATH.
# Usage: wheel_test.sh BUILD_DIR PYTHON   (PYTHON: the project venv's)
set -euo pipefail
build=$(realpath "$1")
python=$2
repo=$(cd "$(dirname "$0")/../.." && pwd)
wheelhouse=${FUYOU_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/fuyou/wheels}
fail() { echo "wheel_test: FAIL: $*" >&2; exit 1; }

tmp=$(mktemp -d /tmp/fuyou-wheel-test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# 1. Build.
# The compilers and ccache settings of deploy/build.sh, so that ccache serves the
# compiles build/ made (scikit-build-core would otherwise pick gcc/g++).
export CC=cc CXX=c++
if command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR=$repo CCACHE_NOHASHDIR=1
fi
start=$SECONDS
"$python" -m pip wheel --no-build-isolation --no-deps -q -w "$tmp/dist" \
  --config-settings=build-dir="$build-wheel" "$repo" || fail "pip wheel failed"
wheel=$(ls "$tmp"/dist/fuyou-*.whl)
echo "wheel_test: built $(basename "$wheel") ($(stat -c %s "$wheel") bytes) in $((SECONDS - start)) s"

# 2. Contents.
contents=$("$python" -m zipfile -l "$wheel")
for file in fuyou/__init__.py fuyou/optimizer.py fuyou/_fuyou.cpython- fuyou/bin/fuyoud \
  .data/scripts/fuyouctl; do
  grep -qF "$file" <<<"$contents" || fail "the wheel lacks $file"
done
! grep -q 'build/\|tests/' <<<"$contents" || fail "the wheel holds build or test files"

# 3. A clean venv.
start=$SECONDS
base=$("$python" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
"$base" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q --no-index --find-links "$wheelhouse" "$wheel" \
  || fail "pip install of the wheel into a clean venv failed"
echo "wheel_test: installed into a clean venv in $((SECONDS - start)) s"

# 4. Train, from outside the repository, with the wheel's own daemon.
cd "$tmp"
env -u FUYOU_DAEMON -u PYTHONPATH -u FUYOU_EMBEDDED FUYOU_DATA_DIR="$tmp/data" \
  "$tmp/venv/bin/python" - <<'EOF' || fail "training with the installed wheel failed"
import copy, os, fuyou, torch
assert "site-packages" in fuyou.__file__, fuyou.__file__
from fuyou.daemon import find_daemon_binary
assert find_daemon_binary() == os.path.join(os.path.dirname(fuyou.__file__), "bin", "fuyoud")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
ref = copy.deepcopy(model)
opt = fuyou.AdamW(model.parameters(), lr=1e-2, job="wheel-test", chunk_bytes=1024)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
for step in range(3):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print("wheel_test: 3 steps match torch.optim.AdamW; committed step", opt.committed_step)
opt.close()
EOF
"$tmp/venv/bin/fuyouctl" --help >/dev/null || fail "fuyouctl from the venv's PATH"
echo "wheel_test: OK"
