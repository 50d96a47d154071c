"""Exceptions of the fuyou package.

Every failure that comes from the daemon or from clientlib is a :class:`FuyouError`
whose ``code`` is the gRPC status code name (``"UNAVAILABLE"``,
``"INVALID_ARGUMENT"``, ...) and whose message is the daemon's (or clientlib's)
own, which names the job, chunk, slot or step concerned.
"""

from __future__ import annotations

__all__ = [
    "FuyouError",
    "DaemonUnavailable",
    "InvalidArgument",
    "FailedPrecondition",
    "DeadlineExceeded",
    "UntrustedDaemon",
    "from_status",
]


class FuyouError(RuntimeError):
    """A request to fuyoud failed. ``code`` is the gRPC code name."""

    default_code = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code or self.default_code
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def __reduce__(self):  # picklable across processes (multiprocessing, pytest-xdist)
        return (type(self), (self.message, self.code))


class DaemonUnavailable(FuyouError):
    """No daemon answers at the address, or the connection to it broke."""

    default_code = "UNAVAILABLE"


class InvalidArgument(FuyouError):
    """The request was malformed (sizes, dtypes, names, slots)."""

    default_code = "INVALID_ARGUMENT"


class FailedPrecondition(FuyouError):
    """The request does not fit the state (e.g. the job already has a live session)."""

    default_code = "FAILED_PRECONDITION"


class UntrustedDaemon(FailedPrecondition):
    """The daemon at a default address could not be trusted with this user's
    states, and nothing was sent to it: its socket is reached through a
    directory or a symbolic link another user controls, or the process that
    accepted the connection runs as someone other than this user, root or the
    ``fuyou`` user (issues 20 and 32). The connection checked is the connection
    used (clientlib's ConnectTrusted)."""


class DeadlineExceeded(FuyouError):
    """The daemon did not answer within the timeout."""

    default_code = "DEADLINE_EXCEEDED"


_BY_CODE = {
    "UNAVAILABLE": DaemonUnavailable,
    "INVALID_ARGUMENT": InvalidArgument,
    "OUT_OF_RANGE": InvalidArgument,
    "FAILED_PRECONDITION": FailedPrecondition,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
}


def from_status(code: str, message: str, untrusted_daemon: bool = False) -> FuyouError:
    """Builds the exception for a non-OK status (used by the C++ binding);
    `untrusted_daemon`: clientlib refused the daemon (fuyou::IsUntrustedDaemon)."""
    code = (code or "UNKNOWN").upper()
    if untrusted_daemon:
        return UntrustedDaemon(message, code)
    return _BY_CODE.get(code, FuyouError)(message, code)
