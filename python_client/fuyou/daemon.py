"""Finding a fuyoud, and starting a private ("embedded") one.

A job normally talks to a long-running fuyoud (systemd, or started by hand). When
none answers and the job allows it, :class:`EmbeddedDaemon` starts a private
fuyoud for the life of the process: socket in a private temporary directory,
states in ``./fuyou-data`` (or ``$FUYOU_DATA_DIR``), stopped with SIGTERM at
close or exit, and killed by the kernel if this process dies first.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Iterable, Optional

from ._errors import DaemonUnavailable, FuyouError, UntrustedDaemon

__all__ = [
    "EmbeddedDaemon",
    "acquire_shared_embedded",
    "release_shared_embedded",
    "default_socket_path",
    "find_daemon_binary",
    "socket_path_of",
    "socket_accepts",
    "check_trusted_socket",
    "UntrustedDaemon",
    "to_address",
]

logger = logging.getLogger("fuyou")

SYSTEM_SOCKET_PATH = "/run/fuyou/fuyoud.sock"
START_TIMEOUT_S = 15.0

# Embedded daemons started by this process, newest last (for admin_stats()).
_EMBEDDED: "weakref.WeakValueDictionary[int, EmbeddedDaemon]" = weakref.WeakValueDictionary()
_EMBEDDED_SEQ = 0


def _user_runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "fuyou"
    return Path("/tmp") / f"fuyou-{os.getuid()}"


def default_socket_path() -> str:
    """The socket a client connects to by default (proto/include/fuyou/defaults.h):
    ``$FUYOU_SOCKET``; the system socket when it exists or when root; else the
    per-user socket ($XDG_RUNTIME_DIR/fuyou/fuyoud.sock or /tmp/fuyou-<uid>/...)."""
    env = os.environ.get("FUYOU_SOCKET")
    if env:
        return env
    if os.getuid() == 0 or os.path.exists(SYSTEM_SOCKET_PATH):
        return SYSTEM_SOCKET_PATH
    return str(_user_runtime_dir() / "fuyoud.sock")


def check_trusted_socket(path: str, timeout: float = 1.0) -> None:
    """Raises :class:`UntrustedDaemon` unless the daemon at the Unix socket
    `path` may be trusted with this user's states, checked as clientlib checks
    every connection to a default address: the socket's directory belongs to
    this user, root or the ``fuyou`` user and only its owner may write it (or it
    is sticky, as /tmp); no symbolic link on the way belongs to anyone else; and
    the process that accepts the connection (SO_PEERCRED, nothing sent) runs as
    one of those uids. Returns when nothing accepts there (the caller reports
    it). A check of this moment only: the sessions and admin clients that
    connect to a default address check the very connection they use, so a
    socket swapped after this check is refused there (issue 32)."""
    from . import _native
    try:
        _native.module().check_trusted_daemon(path, timeout)
    except UntrustedDaemon:
        raise
    except FuyouError:
        return  # nothing accepts there: the caller reports it


def to_address(address_or_path: str) -> str:
    """A gRPC target: a bare filesystem path becomes ``unix:PATH``."""
    if address_or_path.startswith("/") or address_or_path.startswith("."):
        return "unix:" + os.path.abspath(address_or_path)
    return address_or_path


def socket_path_of(address: str) -> Optional[str]:
    """The Unix socket path of a gRPC target, or None for a non-Unix target."""
    if address.startswith("unix://"):
        return address[len("unix://"):] or None
    if address.startswith("unix:"):
        return address[len("unix:"):] or None
    if address.startswith("/"):
        return address
    return None


def socket_accepts(path: str, timeout: float = 1.0) -> bool:
    """True when something accepts connections on the Unix socket `path`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def find_daemon_binary() -> str:
    """The fuyoud an embedded daemon runs: ``$FUYOU_DAEMON``; else the wheel's own
    (``fuyou/bin/fuyoud``, built from the same sources as this binding, so it speaks
    its protocol); else ``fuyoud`` on PATH (the .deb's); else
    ``<repo>/build/daemon/fuyoud`` (a build tree)."""
    env = os.environ.get("FUYOU_DAEMON")
    if env:
        if not os.access(env, os.X_OK):
            raise DaemonUnavailable(f"FUYOU_DAEMON={env} is not an executable file")
        return env
    in_wheel = Path(__file__).resolve().parent / "bin" / "fuyoud"
    if os.access(in_wheel, os.X_OK):
        return str(in_wheel)
    on_path = shutil.which("fuyoud")
    if on_path:
        return on_path
    repo_build = Path(__file__).resolve().parents[2] / "build" / "daemon" / "fuyoud"
    if os.access(repo_build, os.X_OK):
        return str(repo_build)
    raise DaemonUnavailable(
        "cannot start an embedded fuyoud: no binary found (set FUYOU_DAEMON, put fuyoud "
        f"on PATH, or build it at {repo_build})")


def _notice(message: str) -> None:
    """One line to the user: through logging when the application configured it,
    else straight to stderr (an INFO record would otherwise be dropped)."""
    if logger.handlers or logging.getLogger().handlers:
        logger.info(message)
    else:
        print(message, file=sys.stderr, flush=True)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:  # pragma: no cover - best effort
        pass


def _tail(path: Path, max_bytes: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-max_bytes:].decode("utf-8", "replace").strip()


class EmbeddedDaemon:
    """A private fuyoud owned by this process.

    ``EmbeddedDaemon(data_dir=None, socket_path=None, extra_args=())`` starts
    ``fuyoud --socket PATH --data-dir DIR [extra_args...]`` and returns once the
    socket accepts connections (or raises :class:`DaemonUnavailable` with the
    daemon's stderr tail after 15 s). ``address`` is its gRPC target. ``stop()``
    (also on ``with`` exit and at interpreter exit) sends SIGTERM, waits, then
    SIGKILLs. Its output goes to ``log_path``.
    """

    def __init__(self, data_dir: Optional[str] = None, socket_path: Optional[str] = None,
                 extra_args: Iterable[str] = (), *, binary: Optional[str] = None,
                 start_timeout: float = START_TIMEOUT_S):
        self.binary = binary or find_daemon_binary()
        if data_dir is None:
            data_dir = os.environ.get("FUYOU_DATA_DIR") or os.path.join(os.getcwd(), "fuyou-data")
        self.data_dir = os.path.abspath(data_dir)
        os.makedirs(self.data_dir, exist_ok=True)
        self._tmpdir = tempfile.mkdtemp(prefix="fuyou-embedded-")
        os.chmod(self._tmpdir, 0o700)
        self.socket_path = os.path.abspath(socket_path) if socket_path else os.path.join(
            self._tmpdir, "fuyoud.sock")
        self.log_path = Path(self._tmpdir) / "fuyoud.log"
        self.address = "unix:" + self.socket_path
        self.args = [self.binary, "--socket", self.socket_path, "--data-dir", self.data_dir,
                     *map(str, extra_args)]
        self._proc: Optional[subprocess.Popen] = None
        self._start(start_timeout)
        global _EMBEDDED_SEQ
        _EMBEDDED_SEQ += 1
        _EMBEDDED[_EMBEDDED_SEQ] = self
        # Stop at interpreter exit even if the user never calls stop().
        self._atexit = weakref.WeakMethod(self.stop)
        atexit.register(_stop_at_exit, self._atexit)
        _notice(f"fuyou: started an embedded fuyoud (pid {self._proc.pid}) at {self.address}; "
                f"states in {self.data_dir}; log {self.log_path}")

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _start(self, timeout: float) -> None:
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent, close_fds=True)
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                tail = _tail(self.log_path)
                self._proc = None
                raise DaemonUnavailable(
                    f"embedded fuyoud ({' '.join(self.args)}) exited with status {code} "
                    f"before accepting connections; its output:\n{tail}")
            if os.path.exists(self.socket_path) and socket_accepts(self.socket_path, 0.5):
                return
            if time.monotonic() > deadline:
                tail = _tail(self.log_path)
                self._kill()
                raise DaemonUnavailable(
                    f"embedded fuyoud ({' '.join(self.args)}) did not accept connections on "
                    f"{self.socket_path} within {timeout:.0f} s; its output:\n{tail}")
            time.sleep(0.02)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """Stops the daemon (SIGTERM, then SIGKILL after `timeout` s); idempotent.
        Returns its exit status."""
        proc, self._proc = self._proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    logger.warning("fuyou: embedded fuyoud (pid %d) ignored SIGTERM for %.0f s; "
                                   "killing it", proc.pid, timeout)
                    proc.kill()
                    proc.wait()
            code = proc.returncode
            if code in (0, -signal.SIGTERM):  # keep the log of a daemon that failed
                shutil.rmtree(self._tmpdir, ignore_errors=True)
        return code

    def log_tail(self, max_bytes: int = 4000) -> str:
        return _tail(self.log_path, max_bytes)

    def __enter__(self) -> "EmbeddedDaemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):
        try:
            self.stop(timeout=5.0)
        except Exception:
            pass

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running() else "stopped"
        return f"EmbeddedDaemon({self.address}, data_dir={self.data_dir!r}, {state})"


def _stop_at_exit(ref) -> None:
    stop = ref()
    if stop is not None:
        try:
            stop()
        except Exception:
            pass


def threads_beside_cpu_training(torch_threads: int) -> int:
    """fuyoud's optimizer threads (``--threads``) when it shares this machine's
    cores with a training on the CPU that runs `torch_threads` intra-op threads:
    the cores those leave, at least one. More would only preempt backward's
    threads (on 2 cores, 2 daemon threads beside torch made the main job's step
    slower than 1: 493 vs 459 ms, benchmarks/RESULTS.md)."""
    return max(1, (os.cpu_count() or 1) - max(1, int(torch_threads)))


def resolve_address(address: Optional[str], embedded: Optional[bool],
                    probe_timeout: float = 2.0, *,
                    embedded_threads: Optional[int] = None) -> tuple[str, Optional[EmbeddedDaemon]]:
    """Decides where a job connects: returns (gRPC target, embedded daemon or None).

    - `address` given: used as is; DaemonUnavailable when its socket does not accept.
    - else the default socket (FUYOU_SOCKET / system / per-user) when it accepts,
      unless embedded is True;
    - else, unless embedded is False or $FUYOU_EMBEDDED=0, the process's shared
      EmbeddedDaemon (started on first use, with ``--threads
      embedded_threads`` when given; give it back with release_shared_embedded).
    """
    if address:
        address = to_address(address)
        path = socket_path_of(address)
        if path is not None:
            _require_listening(path, address, probe_timeout, hint="")
        return address, None
    env_embedded = os.environ.get("FUYOU_EMBEDDED", "").strip().lower()
    if env_embedded in ("0", "false", "no", "off") and embedded is None:
        embedded = False
    path = default_socket_path()
    if embedded is not True and os.path.exists(path) and socket_accepts(path, probe_timeout):
        # Who serves it is checked on the session's own connection (clientlib's
        # ConnectTrusted, for a default socket): a check here would look the
        # path up once more and prove nothing about the connection used.
        return "unix:" + path, None
    if embedded is False:
        why = ("embedded=False" if env_embedded not in ("0", "false", "no", "off")
               else "FUYOU_EMBEDDED=0")
        _require_listening(path, "unix:" + path, probe_timeout,
                           hint=f" An embedded daemon was not started because {why}.")
        return "unix:" + path, None
    daemon = acquire_shared_embedded(embedded_threads)
    return daemon.address, daemon


# The embedded daemon the optimizers of this process share, with how many use it.
_SHARED_LOCK = threading.Lock()
_SHARED: Optional[EmbeddedDaemon] = None
_SHARED_USERS = 0


def acquire_shared_embedded(threads: Optional[int] = None) -> EmbeddedDaemon:
    """The process's shared embedded daemon, started on first use: every optimizer
    that needs an embedded fuyoud opens its own job on this one (one fuyoud per
    data directory; a second would find the storage in use). `threads`: its
    ``--threads`` when this call starts it (None: fuyoud's default, every core).
    Pair each call with :func:`release_shared_embedded`."""
    global _SHARED, _SHARED_USERS
    with _SHARED_LOCK:
        if _SHARED is None or not _SHARED.running():
            extra = () if threads is None else ("--threads", str(int(threads)))
            _SHARED, _SHARED_USERS = EmbeddedDaemon(extra_args=extra), 0
        _SHARED_USERS += 1
        return _SHARED


def release_shared_embedded(daemon: EmbeddedDaemon) -> None:
    """One user less of `daemon`; the last one stops it. A daemon that is not the
    shared one (started by hand) is stopped at once."""
    global _SHARED, _SHARED_USERS
    with _SHARED_LOCK:
        if daemon is not _SHARED:
            stop = True
        else:
            _SHARED_USERS -= 1
            stop = _SHARED_USERS <= 0
            if stop:
                _SHARED, _SHARED_USERS = None, 0
    if stop:
        daemon.stop()


def resolve_admin_address() -> str:
    """For admin calls with no address: the default socket when it accepts, else
    the newest running embedded daemon of this process, else the default socket."""
    path = default_socket_path()
    if os.path.exists(path) and socket_accepts(path, 1.0):
        return "unix:" + path  # checked on the admin client's own connection
    for key in sorted(_EMBEDDED.keys(), reverse=True):
        daemon = _EMBEDDED.get(key)
        if daemon is not None and daemon.running():
            return daemon.address
    return "unix:" + path


def _require_listening(path: str, address: str, timeout: float, hint: str) -> None:
    if not os.path.exists(path):
        why = "the socket does not exist"
    elif not socket_accepts(path, timeout):
        why = "the socket refuses connections (stale socket of a stopped daemon?)"
    else:
        return
    raise DaemonUnavailable(
        f"no fuyoud is listening at {address}: {why}. Start one (`systemctl start fuyoud`, "
        f"or `fuyoud --socket {path}`), point FUYOU_SOCKET or address= at a running one, or "
        f"let fuyou start an embedded daemon (embedded=None/True).{hint}")
