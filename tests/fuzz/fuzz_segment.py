"""Gives a fuzzed session its shared-memory segment, honestly or not.

The daemon speaks one of two protocols, told apart by the OpenSessionResponse:
- `segment_socket` (field 8) is set: the client creates the segment itself as a
  sealed memfd and passes it over that Unix socket (SCM_RIGHTS) with one line,
  "<session id>\\n"; the daemon answers one line, "OK" or "ERR <CODE> <message>".
- otherwise `segment_name` (field 2) names a /dev/shm object the daemon created
  for the caller, which the client opens and maps.
The pb2 modules are generated from whichever proto is in the tree, so the field
is looked up in the descriptor rather than assumed.

`HANDOVERS` lists the ways of handing a memfd over, the honest one first; every
other one must be refused by the daemon without harm.
"""

import fcntl
import mmap
import os
import socket
import tempfile

# Segments larger than this are not created or mapped by the fuzzer (the daemon
# under test runs with a small --max-segment; a larger size is a refusal to probe,
# not memory to spend).
MAP_LIMIT = 64 << 20
REPLY_TIMEOUT_S = 60.0

HANDOVERS = ["proper", "no_fd", "unsealed", "too_small", "too_large", "garbage_line", "no_newline", "huge_line",
             "two_fds", "pipe_fd", "regular_file", "wrong_session", "empty", "proper_twice"]


class Segment:
    """A mapped segment (and the fd behind it) held by the fuzzer."""

    def __init__(self, fd, size):
        self.fd = fd
        self.size = size
        self.map = mmap.mmap(fd, size) if size > 0 else None

    def write(self, offset, data):
        if self.map is None or offset < 0 or offset >= self.size:
            return
        data = data[: self.size - offset]
        self.map[offset:offset + len(data)] = data

    def close(self):
        if self.map is not None:
            self.map.close()
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def response_field(message, name):
    """Field `name` of `message`, or None when its proto has no such field."""
    if name not in message.DESCRIPTOR.fields_by_name:
        return None
    return getattr(message, name)


def give_segment(response, handover="proper"):
    """Gives the session of `response` (an OpenSessionResponse) its segment.

    Returns (segment or None, outcome): outcome is the daemon's reply line for a
    memfd handover ("OK", "ERR ..."), or what happened to a /dev/shm open.
    """
    segment_socket = response_field(response, "segment_socket")
    if segment_socket:
        return _hand_over_memfd(segment_socket, response.session_id, response.segment_bytes, handover)
    return _open_shm(response.segment_name, response.segment_bytes)


def _open_shm(name, size):
    if not name or "/" in name or name in (".", ".."):
        return None, f"no usable segment name {name[:40]!r}"
    try:
        fd = os.open("/dev/shm/" + name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        return None, f"open: {error.strerror}"
    actual = os.fstat(fd).st_size
    if actual != size or size > MAP_LIMIT:
        os.close(fd)
        return None, f"segment has {actual} bytes, response says {size}"
    return Segment(fd, size), "OK"


def _memfd(size, seal=True):
    fd = os.memfd_create("fuyou-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if size > 0:
        os.posix_fallocate(fd, 0, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def _exchange(path, payload, fds, half_close=False):
    """Sends one message (with `fds`) on a new connection to `path`; returns the reply line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(REPLY_TIMEOUT_S)
        try:
            sock.connect(path)
        except OSError as error:
            return f"connect: {error.strerror}"
        try:
            if fds:
                socket.send_fds(sock, [payload], fds)
            elif payload:
                sock.sendall(payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < 65536:
                part = sock.recv(4096)
                if not part:
                    break
                reply += part
        except socket.timeout:
            raise AssertionError(f"the segment socket {path} did not answer within {REPLY_TIMEOUT_S:.0f} s")
        except OSError as error:  # the daemon may hang up on garbage: that is a fine answer
            return f"socket: {error.strerror}"
    return reply.decode("utf-8", "replace").strip()


def _hand_over_memfd(path, session_id, size, handover):
    line = session_id.encode() + b"\n"
    if size > MAP_LIMIT and handover in ("proper", "proper_twice", "unsealed", "too_large"):
        handover = "too_small"  # do not spend the memory; still a handover to judge
    fd = -1
    extra = []
    try:
        if handover in ("proper", "proper_twice"):
            fd = _memfd(size)
            reply = _exchange(path, line, [fd])
            if handover == "proper_twice" and reply == "OK":
                second = _memfd(size)
                extra.append(second)
                again = _exchange(path, line, [second])
                if again == "OK":
                    raise AssertionError(f"the daemon took a second segment for session {session_id}")
            if reply == "OK":
                segment = Segment(fd, size)
                fd = -1
                return segment, reply
            return None, reply
        if handover == "no_fd":
            return None, _exchange(path, line, [])
        if handover == "unsealed":
            fd = _memfd(size, seal=False)
            return None, _expect_refusal(_exchange(path, line, [fd]), handover)
        if handover in ("too_small", "too_large"):
            wrong = max(size - 4096, 0) if handover == "too_small" else size + 4096
            fd = _memfd(min(wrong, MAP_LIMIT + 4096))
            reply = _exchange(path, line, [fd])
            # Too small must be refused (the daemon would fault past its end); a
            # larger segment is harmless, and either answer is fine.
            return None, _expect_refusal(reply, handover) if wrong < size else reply
        if handover == "garbage_line":
            fd = _memfd(4096)
            return None, _exchange(path, b"\xff\x00 garbage \x1b[2J\n", [fd])
        if handover == "no_newline":
            fd = _memfd(4096)
            return None, _exchange(path, session_id.encode(), [fd], half_close=True)
        if handover == "huge_line":
            return None, _exchange(path, b"s" * (1 << 20) + b"\n", [], half_close=True)
        if handover == "two_fds":
            fd = _memfd(size if size <= MAP_LIMIT else 4096)
            extra.append(_memfd(4096))
            return None, _exchange(path, line, [fd, extra[0]])
        if handover == "pipe_fd":
            read_end, write_end = os.pipe()
            extra += [read_end, write_end]
            return None, _expect_refusal(_exchange(path, line, [read_end]), handover)
        if handover == "regular_file":
            tmp = tempfile.TemporaryFile()
            extra.append(os.dup(tmp.fileno()))
            tmp.close()
            os.ftruncate(extra[0], min(size, MAP_LIMIT))
            return None, _expect_refusal(_exchange(path, line, [extra[0]]), handover)
        if handover == "wrong_session":
            fd = _memfd(size if size <= MAP_LIMIT else 4096)
            unknown = "s-" + os.urandom(8).hex()
            return None, _expect_refusal(_exchange(path, unknown.encode() + b"\n", [fd]), handover)
        if handover == "empty":
            return None, _exchange(path, b"", [], half_close=True)
        raise ValueError(f"unknown handover {handover}")
    finally:
        if fd >= 0:
            os.close(fd)
        for other in extra:
            os.close(other)


def _expect_refusal(reply, handover):
    if reply == "OK":
        raise AssertionError(f"the daemon accepted a segment handed over as '{handover}'")
    return reply
