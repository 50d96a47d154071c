#!/usr/bin/env bash
# Installs a built fuyou (run deploy/build.sh first) system-wide:
#   - binaries, headers and clientlib under PREFIX (default /usr/local):
#     cmake --install build --prefix PREFIX
#   - the systemd unit as /etc/systemd/system/fuyoud.service
#   - the config as /etc/fuyou/fuyoud.toml, only when none exists (an existing
#     one is left alone; the shipped default is put beside it as .dist)
#   - the system group `fuyou`, whose members may use the daemon's socket
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

if [[ -d /run/systemd/system ]]; then
  "${SUDO[@]}" systemctl daemon-reload
fi

cat <<MSG
install: done. Next:
  systemctl enable --now fuyoud          # start it now and at boot
  usermod -aG fuyou USER                 # let USER connect (log in again after)
  $PREFIX/bin/fuyouctl status
Storage paths other than /var/lib/fuyou: add them to /etc/fuyou/fuyoud.toml and to
ReadWritePaths= (systemctl edit fuyoud).
MSG
