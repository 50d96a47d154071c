#!/usr/bin/env bash
# The Debian package installs and runs (ctest deb_package_test, label package).
#
#   1. cpack builds fuyou_<version>_amd64.deb from the build tree (seconds);
#   2. its control data: the conffile /etc/fuyou/fuyoud.toml, dependencies from
#      dpkg-shlibdeps (libgrpc++, libprotobuf, liburing, ...), the maintainer scripts;
#   3. dpkg --root=<empty dir> --force-script-chrootless installs it into a clean
#      root (its own dpkg database, /etc/passwd and /etc/group only): the postinst
#      runs with DPKG_ROOT and creates the user and group fuyou and /var/lib/fuyou
#      there. No debootstrap without network: the root holds only the package, so
#      the installed binaries run with the host's shared libraries (the same
#      Debian bookworm libraries the package depends on);
#   4. <root>/usr/bin/fuyoud --version and <root>/usr/bin/fuyouctl --help run from
#      the installed files (the Python client is the wheel: tests/python/test_wheel.py);
#   5. an upgrade (installing the package again) keeps a changed
#      /etc/fuyou/fuyoud.toml and a job file under /var/lib/fuyou; removing the
#      package keeps both too.
set -euo pipefail
build=$1
version=$2
here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "deb_test: FAIL: $*" >&2; exit 1; }

deb=$("$here/build_deb.sh" "$build" "$version")
echo "deb_test: built $deb ($(stat -c %s "$deb") bytes)"
[[ $(basename "$deb") == fuyou_${version}_amd64.deb ]] || fail "unexpected name $deb"

# 2. Control data.
dpkg-deb --info "$deb"
control=$(dpkg-deb --field "$deb")
conffiles=$(dpkg-deb --ctrl-tarfile "$deb" | tar -xOf - ./conffiles)
[[ $conffiles == /etc/fuyou/fuyoud.toml ]] || fail "conffiles is '$conffiles', want /etc/fuyou/fuyoud.toml"
for dep in libgrpc++ libprotobuf liburing libsystemd; do
  grep -q "^Depends:.*$dep" <<<"$control" || fail "Depends lacks $dep: $(grep ^Depends <<<"$control")"
done
contents=$(dpkg-deb --contents "$deb")
for file in ./usr/bin/fuyoud ./usr/bin/fuyouctl ./usr/lib/systemd/system/fuyoud.service ./etc/fuyou/fuyoud.toml; do
  grep -qF " $file" <<<"$contents" || fail "the package lacks $file"
done

# 3. Install into an empty root.
root=$(mktemp -d /tmp/fuyou-deb-root.XXXXXX)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root"/var/lib/dpkg/{info,updates,triggers} "$root/etc" "$root/usr/sbin"
touch "$root/var/lib/dpkg/status" "$root/var/lib/dpkg/available"
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
printf 'root:x:0:\n' >"$root/etc/group"
printf 'root:*::0:99999:7:::\n' >"$root/etc/shadow"
printf 'root:*::\n' >"$root/etc/gshadow"
chmod 0640 "$root/etc/shadow" "$root/etc/gshadow"
install_deb() {
  # --force-depends: the root has no other package; the binaries use the host's libraries.
  dpkg --root="$root" --force-script-chrootless --force-depends --force-not-root -i "$deb" \
    || fail "dpkg -i into $root failed"
}
install_deb
dpkg --root="$root" -s fuyou | grep -q '^Status: install ok installed' || fail "fuyou not installed in $root"
grep -q '^fuyou:' "$root/etc/passwd" || fail "postinst did not create the user fuyou"
grep -q '^fuyou:' "$root/etc/group" || fail "postinst did not create the group fuyou"
[[ $(stat -c %a "$root/var/lib/fuyou") == 700 ]] || fail "/var/lib/fuyou is not 0700"
[[ $(stat -c %U "$root/var/lib/fuyou") != root || $(grep '^fuyou:' "$root/etc/passwd" | cut -d: -f3) == 0 ]] \
  || true  # owner is the root's uid of fuyou; the host may not know that name
grep -q '^ExecStart=/usr/bin/fuyoud ' "$root/usr/lib/systemd/system/fuyoud.service" \
  || fail "the unit does not run /usr/bin/fuyoud"
dpkg --root="$root" --status fuyou | grep -q '^Conffiles:' || fail "dpkg records no conffile"
dpkg --root="$root" --status fuyou | grep -A1 '^Conffiles:' | grep -q '/etc/fuyou/fuyoud.toml' \
  || fail "/etc/fuyou/fuyoud.toml is not a conffile in dpkg's database"

# 4. The installed files run.
"$root/usr/bin/fuyoud" --version | tee /dev/stderr | grep -q "$version" || fail "fuyoud --version"
"$root/usr/bin/fuyouctl" --help >/dev/null || fail "fuyouctl --help"
! grep -q 'dist-packages' <<<"$contents" || fail "the package holds Python files (the client is the wheel)"

# 5. Upgrade and remove keep the config and the job states.
echo '# changed by the operator' >>"$root/etc/fuyou/fuyoud.toml"
mkdir -p "$root/var/lib/fuyou/users/1000/jobs/j" && echo states >"$root/var/lib/fuyou/users/1000/jobs/j/states.bin"
install_deb
grep -q 'changed by the operator' "$root/etc/fuyou/fuyoud.toml" || fail "the upgrade replaced the changed config"
[[ -f $root/var/lib/fuyou/users/1000/jobs/j/states.bin ]] || fail "the upgrade lost /var/lib/fuyou"
dpkg --root="$root" --force-script-chrootless --force-not-root -r fuyou || fail "dpkg -r"
[[ ! -e $root/usr/bin/fuyoud ]] || fail "remove left /usr/bin/fuyoud"
grep -q 'changed by the operator' "$root/etc/fuyou/fuyoud.toml" || fail "remove deleted the config"
[[ -f $root/var/lib/fuyou/users/1000/jobs/j/states.bin ]] || fail "remove lost /var/lib/fuyou"
echo "deb_test: OK"
