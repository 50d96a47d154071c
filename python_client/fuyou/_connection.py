"""DaemonConnection: where fuyou.AdamW's sessions go, how they are opened, and
the embedded fuyoud the optimizer holds a reference to.

``resolve`` decides the daemon once (``address``, else the default socket, else
an embedded fuyoud: daemon.py's ``resolve_address``; one fuyoud per node in a
data-parallel group: _data_parallel.py), ``open`` opens a session on the job
(the first one and the one a fork reopens), ``release`` gives the embedded
daemon back (the last user stops it). Nothing here knows of torch.optim."""

from __future__ import annotations

import os
import socket
import sys
from typing import Optional

from . import _lifetime
from .daemon import EmbeddedDaemon, resolve_address

__all__ = ["DaemonConnection", "open_session"]


def open_session(job: str, num_slots: int, slot_bytes: int, client_info: str, address: str,
                 rpc_timeout: float, connect_timeout: float, **resume_at_step):
    """Opens a clientlib session (fuyou._fuyou.Session); ``resume_at_step=N``:
    at exactly committed step N (the job's, or the one before its last
    commit). Tests replace this with a fake."""
    from . import _native
    return _native.module().Session.open(
        job=job, num_slots=num_slots, slot_bytes=slot_bytes, client_info=client_info,
        address=address, rpc_timeout=rpc_timeout, connect_timeout=connect_timeout,
        **resume_at_step)


class DaemonConnection:
    """The daemon of one optimizer's job and the shape of its sessions.

    Args:
        job: the session's job (a rank's own job in a data-parallel group).
        timeout: seconds any call to the daemon may take (connecting: at most 5).
        data_parallel: the rank's DataParallel, or None outside such a group.
    """

    def __init__(self, job: str, timeout: float, data_parallel=None):
        self.job = job
        self.timeout = float(timeout)
        self.address: Optional[str] = None  # the gRPC target, once resolved
        self.daemon: Optional[EmbeddedDaemon] = None  # held while this optimizer is open
        self.num_slots = 0
        self.slot_bytes = 0
        self._data_parallel = data_parallel

    def resolve(self, address: Optional[str], embedded: Optional[bool],
                embedded_threads: Optional[int] = None) -> None:
        """Chooses the daemon (may start the shared embedded one, with
        `embedded_threads` optimizer threads when given); a collective in a
        data-parallel group."""
        if self._data_parallel is not None:
            self.address, self.daemon = self._data_parallel.connect(address, embedded, self.timeout)
        else:
            self.address, self.daemon = resolve_address(address, embedded,
                                                        embedded_threads=embedded_threads)

    def open_first(self, num_slots: int, slot_bytes: int):
        """The optimizer's first session, with `num_slots` slots of `slot_bytes`
        (every later ``open`` takes the same); in a data-parallel group every
        rank opens its own or every rank raises."""
        self.num_slots = int(num_slots)
        self.slot_bytes = int(slot_bytes)
        if self._data_parallel is None:
            return self.open()
        return self._data_parallel.open_together(self.open)

    def open(self):
        """A new session on the job."""
        # At most 256 characters (1 KiB of UTF-8): fuyoud refuses a longer client_info.
        info = f"{socket.gethostname()} pid {os.getpid()} {' '.join(sys.argv[:1])}".strip()[:256]
        dp = self._data_parallel  # ranks a crash left one step apart resume together
        at = dp.world_plan.resume_at_step if dp is not None and not dp.world_plan.reshard else None
        return open_session(self.job, self.num_slots, self.slot_bytes, info, self.address,
                            self.timeout, min(self.timeout, 5.0),
                            **({} if at is None else {"resume_at_step": at}))

    def release(self) -> None:
        """Gives back this optimizer's reference to the embedded daemon (idempotent)."""
        daemon, self.daemon = self.daemon, None
        _lifetime.release_daemon(daemon)
