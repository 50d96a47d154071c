#!/usr/bin/env bash
# `systemd-analyze verify` passes on the unit as the Debian package installs it
# (ctest systemd_unit_verify_test, label package): the package is built and
# unpacked (dpkg -x) into a temporary root that also holds a copy of the host's
# systemd units (the targets the unit refers to, e.g. sysinit.target, which a
# bare root lacks), and the unit is verified with --root pointing there, so
# ExecStart=/usr/bin/fuyoud is checked against the installed binary (verify
# fails when it is missing). Any warning naming the unit (an unknown key, a bad
# value) fails the test too. Exits 77 (skipped) only when systemd-analyze is
# missing.
set -euo pipefail
build=$1
version=$2
here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "unit_verify_test: FAIL: $*" >&2; exit 1; }
if ! command -v systemd-analyze >/dev/null; then
  echo "unit_verify_test: SKIP: systemd-analyze not installed (deploy/install-deps.sh installs systemd)"
  exit 77
fi
deb=$("$here/build_deb.sh" "$build" "$version")
root=$(mktemp -d /tmp/fuyou-unit-root.XXXXXX)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/usr/lib/systemd"
cp -a /usr/lib/systemd/system "$root/usr/lib/systemd/"
dpkg -x "$deb" "$root"
unit=$root/usr/lib/systemd/system/fuyoud.service
[[ -f $unit ]] || fail "the package has no /usr/lib/systemd/system/fuyoud.service"
out=$(systemd-analyze verify --root="$root" --man=no /usr/lib/systemd/system/fuyoud.service 2>&1) \
  || { rc=$?; echo "$out" >&2; fail "systemd-analyze verify exited $rc"; }
echo "$out"
# verify prints problems as warnings and may still exit 0: any line about the unit fails.
if grep -i 'fuyoud' <<<"$out"; then fail "systemd-analyze verify reported the lines above"; fi
echo "unit_verify_test: OK ($(systemd-analyze --version | head -1))"
