"""The lifetime of fuyou.AdamW optimizers in this process: which are open (so a
load_state_dict of another job finds that job's optimizer), and their close at
interpreter exit, before the embedded daemon they share stops.

An optimizer ``enter``s when its session is open and ``leave``s in close();
``release_daemon`` gives back its reference to the shared embedded fuyoud
(daemon.py counts the users and stops it with the last)."""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Optional

from .daemon import release_shared_embedded

__all__ = ["enter", "leave", "find_open", "release_daemon"]

_OPEN: "weakref.WeakSet" = weakref.WeakSet()  # this process's open optimizers


class _CloseAtExit:
    """atexit handler of one optimizer (weakly held): closes it if still open."""

    def __init__(self, opt):
        self._ref = weakref.ref(opt)

    def __call__(self) -> None:
        opt = self._ref()
        if opt is not None:
            try:
                opt.close()
            except Exception as e:  # at exit: say it, never raise
                print(f"fuyou: closing job {opt.job!r} at exit failed: {e}", file=sys.stderr)


def enter(opt) -> object:
    """`opt` is open: it is closed at exit (registered after the embedded
    daemon's own exit handler, so it runs first). Returns the token ``leave``
    takes."""
    closer = _CloseAtExit(opt)
    atexit.register(closer)
    _OPEN.add(opt)
    return closer


def leave(opt, token: Optional[object]) -> None:
    """`opt` is closing: no longer open, nothing to do at exit."""
    _OPEN.discard(opt)
    if token is not None:
        atexit.unregister(token)


def find_open(job: str, address: str):
    """The open optimizer of this process on `job` of the daemon at `address`."""
    for opt in list(_OPEN):
        if opt.job == job and opt.address == address and not opt._closed:
            return opt
    return None


def release_daemon(daemon) -> None:
    """Gives back one reference to the embedded daemon (None: none was held)."""
    if daemon is not None:
        release_shared_embedded(daemon)
