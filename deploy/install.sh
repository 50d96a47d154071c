#!/usr/bin/env bash
# Installs a built fuyou (run deploy/build.sh first) system-wide:
#   - binaries, headers and clientlib under PREFIX (default /usr/local):
#     cmake --install build --prefix PREFIX
#   - the systemd unit as /etc/systemd/system/fuyoud.service
#   - the config as /etc/fuyou/fuyoud.toml, only when none exists (an existing
#     one is left alone; the shipped default is put beside it as .dist)
#   - the system group and user `fuyou`: the daemon runs as that user with no
#     capability; members of the group may use its sockets. An existing
#     /var/lib/fuyou (made by a root-run fuyoud of an older release) is given to it.
# It does not enable or start the service; it prints how to.
# Uses sudo when not run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${PREFIX:-/usr/local}
BUILD_DIR=${BUILD_DIR:-build}

if [[ $(id -u) -eq 0 ]]; then SUDO=(); else SUDO=(sudo); fi

if [[ ! -x $BUILD_DIR/daemon/fuyoud ]]; then
  echo "install: $BUILD_DIR/daemon/fuyoud not found; run deploy/build.sh first" >&2
  exit 1
fi

"${SUDO[@]}" cmake --install "$BUILD_DIR" --prefix "$PREFIX"
"${SUDO[@]}" install -D -m 0644 README.md "$PREFIX/share/doc/fuyou/README.md"
"${SUDO[@]}" install -D -m 0644 -t "$PREFIX/share/doc/fuyou/docs" docs/*.md

if [[ $PREFIX != /usr/local ]]; then
  echo "install: note: the unit runs /usr/local/bin/fuyoud; edit ExecStart= for PREFIX=$PREFIX" >&2
fi
"${SUDO[@]}" install -D -m 0644 deploy/fuyoud.service /etc/systemd/system/fuyoud.service

if [[ -e /etc/fuyou/fuyoud.toml ]]; then
  echo "install: keeping the existing /etc/fuyou/fuyoud.toml (default written to fuyoud.toml.dist)"
  "${SUDO[@]}" install -D -m 0644 deploy/fuyoud.toml /etc/fuyou/fuyoud.toml.dist
else
  "${SUDO[@]}" install -D -m 0644 deploy/fuyoud.toml /etc/fuyou/fuyoud.toml
fi

if ! getent group fuyou >/dev/null; then
  "${SUDO[@]}" groupadd --system fuyou
fi
if ! getent passwd fuyou >/dev/null; then
  "${SUDO[@]}" useradd --system --gid fuyou --home-dir /var/lib/fuyou --no-create-home \
    --shell /usr/sbin/nologin --comment "fuyou offload daemon" fuyou
fi
# A data directory from a release whose fuyoud ran as root: the daemon, now
# user fuyou, must own its job states (systemd's StateDirectory= would also do
# this at the next start; doing it here makes `fuyoud` by hand work too).
if [[ -d /var/lib/fuyou ]]; then
  "${SUDO[@]}" chown -R fuyou:fuyou /var/lib/fuyou
  "${SUDO[@]}" chmod 0700 /var/lib/fuyou
fi

if [[ -d /run/systemd/system ]]; then
  "${SUDO[@]}" systemctl daemon-reload
fi

cat <<MSG
install: done. Next:
  systemctl enable --now fuyoud          # start it now and at boot
  usermod -aG fuyou USER                 # let USER connect (log in again after)
  $PREFIX/bin/fuyouctl status
Storage paths other than /var/lib/fuyou: add them to /etc/fuyou/fuyoud.toml and to
ReadWritePaths= (systemctl edit fuyoud), and give them to the daemon's user:
  chown -R fuyou:fuyou DIR && chmod 0700 DIR
MSG
