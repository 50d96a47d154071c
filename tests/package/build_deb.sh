#!/usr/bin/env bash
# Builds the Debian package from build tree $1 (already built) and prints its
# path: $1/packages/fuyou_<version>_amd64.deb. Used by the package tests.
set -euo pipefail
build=$1
version=$2
deb=$build/packages/fuyou_${version}_amd64.deb
rm -f "$deb"
(cd "$build" && cpack -G DEB --config CPackConfig.cmake >"$build/packages-cpack.log" 2>&1) || {
  cat "$build/packages-cpack.log" >&2
  echo "build_deb: cpack failed (log above)" >&2
  exit 1
}
[[ -f $deb ]] || { echo "build_deb: cpack wrote no $deb" >&2; ls "$build/packages" >&2; exit 1; }
echo "$deb"
