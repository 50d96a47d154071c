"""Issue 32, the third attack: a real fuyoud run as root, unprivileged peers
(uid 65534 as the attacker, a victim uid of its own) started with setuid, as
the earlier rounds' tests do.

- the client checks the connection it uses: while the victim's default socket
  is flipped between root's daemon and the attacker's, no session of the victim
  opens on the attacker's daemon; each try opens on root's or is refused as
  ``fuyou.UntrustedDaemon`` (the issue's layout, /tmp/fuyou-<uid> an attacker's
  link into a root-owned sticky directory, and plain sockets renamed into place,
  which only the check of the connection itself can tell apart);
- a checked admin client connects again through the same check after the
  daemon closed its idle connection;
- the daemon refuses a socket directory reached through another user's link.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from conftest import require_daemon

import fuyou
from test_security_round2 import _as

REPO = pathlib.Path(__file__).resolve().parents[2]
ATTACKER = 65534
VICTIM = 61235  # a uid no other test uses: its /tmp/fuyou-<uid> is ours to make
TRIES = 60

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")


def _attackers_link_to_a_sticky_directory(shared_dir: pathlib.Path):
    """The attack's set-up: /tmp/fuyou-<VICTIM> made the attacker's link to a
    root-owned sticky directory, as without XDG_RUNTIME_DIR: (directory, link)."""
    sticky = shared_dir / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    link = pathlib.Path(f"/tmp/fuyou-{VICTIM}")
    if link.is_symlink() or link.is_file():
        link.unlink()
    shutil.rmtree(link, ignore_errors=True)
    os.symlink(sticky, link)
    os.lchown(link, ATTACKER, ATTACKER)
    return sticky, link


def run_python(script: str, uid: int, env_extra=None, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python_client")
    env["HOME"] = "/tmp"
    for name in ("FUYOU_SOCKET", "XDG_RUNTIME_DIR", "FUYOU_DATA_DIR"):
        env.pop(name, None)
    env["FUYOU_EMBEDDED"] = "0"
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_as(uid))


@pytest.fixture
def shared_dir():
    """A root-owned sticky directory (as /tmp)."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="fuyou-sec3-"))
    os.chmod(tmp, 0o1777)
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def root_daemon(tmp: pathlib.Path, *args) -> fuyou.EmbeddedDaemon:
    """Root's fuyoud on a 0666 socket, as an administrator runs it."""
    return fuyou.EmbeddedDaemon(data_dir=str(tmp / "root-data"), socket_path=str(tmp / "root.sock"),
                                extra_args=["--dram-budget", "64MiB", "--socket-mode", "0666", "--drain-seconds",
                                            "0", *args], binary=require_daemon())


def attacker_daemon(tmp: pathlib.Path) -> tuple:
    """The attacker's own fuyoud, in the attacker's own directory: (process,
    socket path, data directory)."""
    home = tmp / "attacker"
    home.mkdir()
    os.chown(home, ATTACKER, ATTACKER)
    os.chmod(home, 0o755)
    socket_path, data = home / "fuyoud.sock", home / "data"
    process = subprocess.Popen([require_daemon(), "--socket", str(socket_path), "--data-dir", str(data),
                                "--dram-budget", "64MiB", "--socket-mode", "0666", "--drain-seconds", "0"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_as(ATTACKER))
    deadline = time.monotonic() + 20
    while not socket_path.exists():
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return process, socket_path, data


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=20)


# The victim's plain fuyou.AdamW with no address, TRIES times in one process.
VICTIM_TRIES = """
    import torch, fuyou
    model = torch.nn.Linear(8, 8)
    opened = refused = 0
    for i in range({tries}):
        try:
            opt = fuyou.AdamW(model.parameters(), job="private-model")
        except fuyou.UntrustedDaemon as e:
            refused += 1
            last = str(e)
            continue
        model(torch.ones(1, 8)).sum().backward()
        opt.step()
        opt.close()
        opened += 1
    print("opened", opened, "refused", refused, flush=True)
    if refused:
        print("last refusal:", last, flush=True)
"""


def outcome(result: subprocess.CompletedProcess) -> tuple:
    assert result.returncode == 0, result.stdout + result.stderr
    print(result.stdout)
    words = result.stdout.split()
    return int(words[1]), int(words[3])


class Flipper:
    """Swaps what `path` names between `choices` (each renamed into place), in a
    thread of this process or, with `uid`, in a process of that user."""

    SCRIPT = """
        import os, sys, time
        path, choices = sys.argv[1], sys.argv[2:]
        staged = path + ".staged"
        i = 0
        while True:
            try:
                os.unlink(staged)
            except FileNotFoundError:
                pass
            os.symlink(choices[i % len(choices)], staged)
            os.rename(staged, path)
            i += 1
    """

    def __init__(self, path: pathlib.Path, choices, uid=None):
        self.process, self.thread, self.stopped = None, None, threading.Event()
        if uid is not None:  # an unprivileged attacker can only flip links it owns
            self.process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(self.SCRIPT), str(path),
                                             *map(str, choices)], preexec_fn=_as(uid))
        else:  # plain sockets renamed into place: no link for any path check to see
            self.thread = threading.Thread(target=self._flip_plain, args=(path, list(choices)), daemon=True)
            self.thread.start()
        deadline = time.monotonic() + 10
        while not os.path.lexists(path):
            assert time.monotonic() < deadline, "the flipper did not start"
            time.sleep(0.01)

    def _flip_plain(self, path, choices):
        staged = path.with_name(path.name + ".staged")
        i = 0
        while not self.stopped.is_set():
            try:
                os.unlink(staged)
            except FileNotFoundError:
                pass
            os.link(choices[i % len(choices)], staged)
            os.rename(staged, path)
            i += 1

    def stop(self):
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        else:
            self.stopped.set()
            self.thread.join()


def test_a_link_flipped_by_another_user_never_lands_on_the_attackers_daemon(shared_dir):
    # The layout: no XDG_RUNTIME_DIR; the attacker made /tmp/fuyou-<victim>
    # a link to a root-owned sticky directory, and flips fuyoud.sock there between
    # root's daemon (which passes a check of the daemon's uid) and its own.
    root = root_daemon(shared_dir)
    attacker, attacker_socket, attacker_data = attacker_daemon(shared_dir)
    sticky, link = _attackers_link_to_a_sticky_directory(shared_dir)
    flipper = Flipper(sticky / "fuyoud.sock", [root.socket_path, attacker_socket], uid=ATTACKER)
    try:
        result = run_python(VICTIM_TRIES.format(tries=TRIES), VICTIM)
    finally:
        flipper.stop()
        link.unlink()
        stop(attacker)
        root.stop()
    opened, refused = outcome(result)
    assert not list(attacker_data.glob(f"users/{VICTIM}")), "a session of the victim reached the attacker's daemon"
    # The attacker's link is seen before anything connects: every try is refused.
    assert (opened, refused) == (0, TRIES), result.stdout
    assert f"symbolic link {link}" in result.stdout and "uid 65534" in result.stdout, result.stdout


def test_a_socket_swapped_between_checks_never_lands_on_the_attackers_daemon(shared_dir):
    # Plain sockets (root's and the attacker's, hard links of each daemon's own)
    # renamed in turn into the victim's default path, in a directory the victim
    # trusts: a check of the path, or of another connection, cannot tell when
    # the socket changes; only the check of the connection used can.
    root = root_daemon(shared_dir)
    attacker, attacker_socket, attacker_data = attacker_daemon(shared_dir)
    xdg = shared_dir / "xdg"
    (xdg / "fuyou").mkdir(parents=True)
    os.chmod(xdg, 0o755)
    os.chmod(xdg / "fuyou", 0o755)
    flipper = Flipper(xdg / "fuyou" / "fuyoud.sock", [root.socket_path, attacker_socket])
    try:
        result = run_python(VICTIM_TRIES.format(tries=TRIES), VICTIM, {"XDG_RUNTIME_DIR": str(xdg)})
    finally:
        flipper.stop()
        stop(attacker)
        root.stop()
    opened, refused = outcome(result)
    assert not list(attacker_data.glob(f"users/{VICTIM}")), "a session of the victim reached the attacker's daemon"
    assert opened + refused == TRIES, result.stdout
    assert opened > 0, "root's daemon never answered: " + result.stdout
    if refused:
        assert "runs as uid 65534" in result.stdout, result.stdout


def test_a_checked_admin_client_reconnects_through_the_check(shared_dir):
    # A default address's admin client lives on the connection it checked; after
    # the daemon closed it (idle), the next call connects and checks again.
    xdg = shared_dir / "xdg"
    (xdg / "fuyou").mkdir(parents=True)
    os.chmod(xdg, 0o755)
    os.chmod(xdg / "fuyou", 0o755)
    daemon = fuyou.EmbeddedDaemon(data_dir=str(shared_dir / "root-data"), socket_path=str(xdg / "fuyou" / "fuyoud.sock"),
                                  extra_args=["--dram-budget", "64MiB", "--socket-mode", "0666", "--drain-seconds",
                                              "0", "--idle-connection-timeout", "1"], binary=require_daemon())
    script = """
        import time, fuyou
        admin = fuyou.admin_client()
        print("first", admin.health()["status"], flush=True)
        time.sleep(3)  # past the daemon's idle timeout: it closed this connection
        print("again", admin.health()["status"], len(admin.list_jobs()), flush=True)
    """
    try:
        result = run_python(script, VICTIM, {"XDG_RUNTIME_DIR": str(xdg)})
    finally:
        daemon.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "first" in result.stdout and "again" in result.stdout, result.stdout + result.stderr


def test_the_daemon_refuses_a_socket_directory_reached_through_another_users_link(shared_dir):
    binary = require_daemon()
    sticky, link = _attackers_link_to_a_sticky_directory(shared_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("FUYOU_SOCKET", "XDG_RUNTIME_DIR")}
    env["FUYOU_DATA_DIR"] = str(shared_dir / "victim-data")
    try:
        # The victim's own fuyoud with its default socket, /tmp/fuyou-<uid>/fuyoud.sock.
        daemon = subprocess.Popen([binary, "--dram-budget", "64MiB"], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, preexec_fn=_as(VICTIM))
        try:
            code = daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
            pytest.fail("fuyoud served through the attacker's link")
        stderr = daemon.stderr.read()
        assert code != 0
        assert f"symbolic link {link}" in stderr and "belongs to uid 65534" in stderr, stderr
        assert not (sticky / "fuyoud.sock").exists()
    finally:
        link.unlink()
