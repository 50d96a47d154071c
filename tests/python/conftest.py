"""Fixtures: a real fuyoud per test module (from $FUYOU_DAEMON or the repo build),
and an in-process fake session, behind one `backend` fixture.

Under CTest (FUYOU_DAEMON set) a missing daemon binary is a failure; run by hand
without one, the daemon-backed tests are skipped and the fake-backed ones run.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
if str(REPO / "python_client") not in sys.path:
    sys.path.insert(0, str(REPO / "python_client"))

import fuyou  # noqa: E402
import fake_session  # noqa: E402

_job_counter = itertools.count()


def pytest_configure(config):
    # Selectable with -m: e.g. -m "not slow" for a quick pass.
    config.addinivalue_line("markers", "slow: takes more than a few seconds (a real Prometheus server, ...)")
    config.addinivalue_line("markers", "integration: drives real external programs besides fuyoud")


def daemon_binary():
    env = os.environ.get("FUYOU_DAEMON")
    if env:
        return env if os.access(env, os.X_OK) else None
    for candidate in sorted(REPO.glob("build*/daemon/fuyoud")):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def native_available() -> bool:
    try:
        import fuyou._fuyou  # noqa: F401
        return True
    except ImportError:
        return False


def require_daemon():
    binary = daemon_binary()
    if binary is None or not native_available():
        why = ("fuyoud binary not found" if binary is None
               else "fuyou._fuyou binding not built")
        if os.environ.get("FUYOU_DAEMON"):
            pytest.fail(f"FUYOU_DAEMON={os.environ['FUYOU_DAEMON']} set but {why}")
        pytest.skip(why)
    return binary


def start_daemon(tmp: Path, name: str = "d") -> fuyou.EmbeddedDaemon:
    binary = require_daemon()
    data = tmp / f"{name}-data"
    extra = os.environ.get("FUYOU_TEST_DAEMON_ARGS", "--dram-budget 256MiB").split()
    return fuyou.EmbeddedDaemon(data_dir=str(data), socket_path=str(tmp / f"{name}.sock"),
                                extra_args=extra, binary=binary)


@pytest.fixture(scope="module")
def daemon():
    """A real fuyoud on a temporary socket and data dir, for the whole module."""
    require_daemon()
    with tempfile.TemporaryDirectory(prefix="fuyou-test-") as tmp:
        d = start_daemon(Path(tmp))
        try:
            yield d
        finally:
            code = d.stop()
            if code not in (0, -15, None):
                print(f"fuyoud exited with {code}; log:\n{d.log_tail()}")


class Backend:
    """Makes fuyou.AdamW optimizers on one backend (fake or real daemon)."""

    def __init__(self, name, address, daemon=None):
        self.name = name
        self.address = address
        self.daemon = daemon

    def new_job(self, prefix="job") -> str:
        return f"{prefix}-{os.getpid()}-{next(_job_counter)}"

    def adamw(self, params, **kw):
        kw.setdefault("job", self.new_job())
        kw.setdefault("address", self.address)
        kw.setdefault("timeout", 20.0)
        return fuyou.AdamW(params, **kw)


@pytest.fixture
def fake_backend(monkeypatch):
    monkeypatch.setattr(fuyou._connection, "open_session", fake_session.open_fake)
    fake_session.JOBS.clear()
    return Backend("fake", "fake:local")


@pytest.fixture(params=["fake", "daemon"])
def backend(request, monkeypatch):
    if request.param == "fake":
        monkeypatch.setattr(fuyou._connection, "open_session", fake_session.open_fake)
        fake_session.JOBS.clear()
        return Backend("fake", "fake:local")
    d = request.getfixturevalue("daemon")
    return Backend("daemon", d.address, d)
