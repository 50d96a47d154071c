"""The admin side of fuyoud from Python: ``fuyou.admin_client`` and
``fuyou.admin_stats`` (re-exported by the package), and what the private modules
that need the admin API (forking a job, asking whether a job exists) import."""

from __future__ import annotations

from typing import Optional

from . import _native
from .daemon import _require_listening, resolve_admin_address, socket_path_of, to_address

__all__ = ["admin_client", "admin_stats"]


def admin_client(address: Optional[str] = None, timeout: float = 10.0):
    """A connected fuyou._fuyou.AdminClient (health, get_stats, list_sessions,
    list_jobs, delete_job). `address` None: the default socket, or else the
    embedded daemon this process started."""
    target = to_address(address) if address else resolve_admin_address()
    path = socket_path_of(target)
    if path is not None:
        _require_listening(path, target, min(timeout, 2.0), hint="")
    return _native.module().AdminClient.connect(target, timeout)


def admin_stats(address: Optional[str] = None, timeout: float = 10.0) -> dict:
    """fuyoud's GetStats as a dict: scope ("daemon" for root and the daemon's
    user; "user" for anyone else, whose counters are their own activity only and
    who get no storage paths or DRAM figures), uid, storage (list of dicts with
    path, bytes_read, bytes_written, read_gbps, write_gbps, direct_io; empty in
    scope "user"), and every other GetStatsResponse field by its name
    (proto/fuyou/v1/admin.proto): bytes_read, bytes_written, read_gbps,
    write_gbps (totals), chunk_updates, params_updated, cache_hits, cache_misses,
    live_sessions, steps_committed, uptime_seconds, the redo, weights and journal
    counters, ..."""
    return admin_client(address, timeout).get_stats()
