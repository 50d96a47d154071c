"""The fuzzing worker: a hypothesis state machine that drives one fuyoud through
every RPC of proto/fuyou/v1 (offload.proto and admin.proto) and every stream
message, with structured values at the edges and byte-mutated messages, through
sessions that are opened, given a segment (honestly or not), attached, attached
twice, used, half-used, abandoned, closed and closed twice.

Run by rpc_fuzz.py as an unprivileged user, beside a legitimate job of another
user. Fails (exit 1, with hypothesis's failing sequence of steps) when:
- the daemon dies or stops answering Health (checked after every step);
- an RPC ends UNKNOWN (an exception escaped a handler) or gets no answer within
  RPC_TIMEOUT_S (a hang), or a stream message gets no reply;
- the daemon does what it must refuse: accepts a second stream on an attached
  session, closes a session twice, acts on another user's session or job, shows
  another user's session, accepts a bad segment handover (fuzz_segment.py);
- a limit of issue 20 does not hold: more connections of this uid stay open
  than --max-connections-per-user, or its jobs (CopyJob's copies included)
  hold more storage than --max-storage-per-user.
Exit 0 after --seconds of fuzzing otherwise; prints what it sent and got.

Usage: fuzz_worker.py --socket PATH --daemon-pid PID --seconds N
                      [--max-connections-per-user N] [--max-storage-per-user BYTES]
"""

import argparse
import collections
import functools
import os
import queue
import socket
import struct
import sys
import threading
import time
import traceback

import grpc
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import HypothesisException
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import admin_pb2 as apb
import fuzz_segment
import fuzz_values as fv
import offload_pb2 as pb

# Generous: the daemon runs under ASan on a loaded machine. An answer this late is a hang.
RPC_TIMEOUT_S = 60.0
STREAM_DEADLINE_S = 900.0
MAX_LIVE_SESSIONS = 4
# Sessions left unattached for the daemon's reaper, per worker: each holds a slot
# of the per-user session limit until it is reaped.
MAX_FORGOTTEN = 4

OFFLOAD = "/fuyou.v1.Offload/"
ADMIN = "/fuyou.v1.Admin/"
UNARY = {
    "OpenSession": (OFFLOAD, pb.OpenSessionRequest, pb.OpenSessionResponse),
    "RegisterChunks": (OFFLOAD, pb.RegisterChunksRequest, pb.RegisterChunksResponse),
    "CloseSession": (OFFLOAD, pb.CloseSessionRequest, pb.CloseSessionResponse),
    "Health": (ADMIN, apb.HealthRequest, apb.HealthResponse),
    "GetStats": (ADMIN, apb.GetStatsRequest, apb.GetStatsResponse),
    "ListSessions": (ADMIN, apb.ListSessionsRequest, apb.ListSessionsResponse),
    "ListJobs": (ADMIN, apb.ListJobsRequest, apb.ListJobsResponse),
    "DeleteJob": (ADMIN, apb.DeleteJobRequest, apb.DeleteJobResponse),
    "CopyJob": (ADMIN, apb.CopyJobRequest, apb.CopyJobResponse),
}
DTYPE_BYTES = {1: 4, 2: 2, 3: 2}
OK = grpc.StatusCode.OK


class DaemonDied(AssertionError):
    pass


class Daemon:
    """The daemon under test: one channel, every RPC as bytes in and out, and tallies."""

    def __init__(self, socket_path, pid, seconds):
        self.channel = grpc.insecure_channel("unix:" + socket_path,
                                             options=[("grpc.max_receive_message_length", 64 << 20)])
        self.pid = pid
        self.end = time.monotonic() + seconds
        self.unary = {name: self.channel.unary_unary(prefix + name) for name, (prefix, _, _) in UNARY.items()}
        self.tally = collections.Counter()
        self.uid = os.getuid()
        self.seen_jobs = {}  # name -> owner uid, from ListJobs
        self.foreign_sessions = set()  # ids of other users' sessions that the daemon showed
        self.forgotten = 0
        self.fresh_jobs = 0
        self.socket_path = socket_path
        self.max_connections_per_user = 0  # 0: not checked
        self.max_storage_per_user = 0

    def out_of_time(self):
        return time.monotonic() >= self.end

    def call(self, name, request):
        """Sends `request` (a message, or raw bytes) to RPC `name`; returns (code, parsed response or None)."""
        raw = request if isinstance(request, (bytes, bytearray)) else request.SerializeToString()
        details = ""
        try:
            reply = self.unary[name](bytes(raw), timeout=RPC_TIMEOUT_S)
            code, response = OK, UNARY[name][2].FromString(reply)
        except grpc.RpcError as error:
            code, response, details = error.code(), None, error.details() or ""
        # INTERNAL is either a request gRPC could not parse or the daemon's own
        # failure: the tally keeps the start of its message, to tell them apart.
        suffix = f" ({details[:50]})" if code == grpc.StatusCode.INTERNAL or os.environ.get("FUYOU_FUZZ_DETAILS") else ""
        kind = "bytes" if isinstance(request, (bytes, bytearray)) else "message"
        self.tally[f"{name} ({kind}) {code.name}{suffix}"] += 1
        self.judge(name, code, details)
        return code, response

    def judge(self, what, code, details):
        if code == grpc.StatusCode.UNKNOWN:
            raise AssertionError(f"{what} ended UNKNOWN (an exception escaped a handler?): {details[:300]}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.check_alive()
            raise AssertionError(f"{what} got no answer within {RPC_TIMEOUT_S:.0f} s: the daemon hangs")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
            self.check_alive()

    def check_alive(self):
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            raise DaemonDied(f"fuyoud (pid {self.pid}) is gone")
        except PermissionError:
            pass  # alive, and another user's
        try:
            self.unary["Health"](b"", timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as error:
            raise DaemonDied(f"fuyoud (pid {self.pid}) does not answer Health: {error.code().name} {error.details()}")


def _still_open(s):
    """False once the daemon closed or shut down connection `s` (what it sent is read away)."""
    s.setblocking(False)
    try:
        while s.recv(4096):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


DAEMON = None  # set by main()
_END = object()


class StreamCall:
    """One Offload.Stream call driven message by message: send, then wait for the reply."""

    def __init__(self):
        self._requests = queue.Queue()
        self._replies = queue.Queue()
        self.ended = None  # (code name, details) once the stream ended
        self.attached = False
        self.let_go = False  # half-closed or cancelled by the fuzzer
        method = DAEMON.channel.stream_stream(OFFLOAD + "Stream")
        self._call = method(iter(self._requests.get, _END), timeout=STREAM_DEADLINE_S)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for raw in self._call:
                self._replies.put(raw)
            self._replies.put((OK, ""))
        except grpc.RpcError as error:
            self._replies.put((error.code(), error.details() or ""))

    def send(self, raw, label):
        """Sends one message; returns a DaemonMessage, or None once the stream has ended."""
        if self.ended is not None:
            return None
        self._requests.put(bytes(raw))
        return self.reply(label)

    def reply(self, label):
        try:
            item = self._replies.get(timeout=RPC_TIMEOUT_S)
        except queue.Empty:
            DAEMON.check_alive()
            raise AssertionError(f"stream message {label}: no reply within {RPC_TIMEOUT_S:.0f} s: the daemon hangs")
        if isinstance(item, tuple):
            code, details = item
            self.ended = (code.name, details)
            DAEMON.tally[f"Stream/{label} ended {code.name}"] += 1
            if code != grpc.StatusCode.CANCELLED or not self.let_go:
                DAEMON.judge(f"Stream/{label}", code, details)
            return None
        message = pb.DaemonMessage.FromString(item)
        DAEMON.tally[f"Stream/{label} -> {message.WhichOneof('kind')}"] += 1
        return message

    def half_close(self):
        self.let_go = True
        self._requests.put(_END)

    def cancel(self):
        self.let_go = True
        self._requests.put(_END)
        self._call.cancel()


class FuzzSession:
    """What the fuzzer knows of a session it opened."""

    def __init__(self, response):
        self.response = response
        self.id = response.session_id
        self.segment = None
        self.streams = []
        self.chunks = {}  # chunk_id -> ChunkSpec the daemon accepted
        self.next_step = response.committed_step + 1

    def fill_region(self, slot, params, kind, count, dtype):
        """Writes `count` elements of `kind` (FILLS) into a slot's gradient or
        parameter region, as far as the mapped segment reaches."""
        if self.segment is None:
            return
        slot_bytes = self.response.slot_bytes
        offset = 4096 + (2 * slot + (1 if params else 0)) * slot_bytes
        room = min(slot_bytes, max(0, self.segment.size - offset)) // DTYPE_BYTES.get(dtype, 4)
        if room > 0:
            self.segment.write(offset, fill_bytes(kind, min(count, room), dtype))

    def stream(self):
        """The stream attached to this session and still open, or None."""
        for stream in self.streams:
            if stream.attached and stream.ended is None and not stream.let_go:
                return stream
        return None

    def let_go(self):
        for stream in self.streams:
            if stream.ended is None:
                stream.cancel()
        if self.segment is not None:
            self.segment.close()
            self.segment = None


def fill_bytes(kind, count, dtype):
    """`count` elements of `dtype` holding `kind` of values."""
    size = DTYPE_BYTES.get(dtype, 4)
    if kind == "random":
        return os.urandom(count * size)
    value = {"zero": 0.0, "small": 0.01, "one": 1.0, "nan": float("nan"), "inf": float("inf"),
             "huge": 3.0e38, "denormal": 1e-40}[kind]
    if size == 4:
        return struct.pack("<f", value) * count
    return struct.pack("<e", value if abs(value) < 65504 or value != value else float("inf")) * count


FILLS = ["small", "zero", "one", "nan", "inf", "huge", "denormal", "random"]


def fail(trace, error):
    """Reports the first problem found, with the steps of its example, and exits.

    Hypothesis would replay the example to report it, but a replay against a
    daemon whose state moved on does not do the same thing (it calls that Flaky):
    the steps as they ran are the report."""
    print("fuzz_worker: FAILED. The steps of the failing example, as they ran:", flush=True)
    for line in trace:
        print("  " + line)
    print("fuzz_worker: " + "".join(traceback.format_exception(error)), flush=True)
    print(f"fuzz_worker: {type(error).__name__}: {error}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _short(value):
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 300 else text[:300] + f"...({len(text)} chars)"


def step(method):
    """A rule or invariant whose call is recorded; any exception in it ends the run (fail)."""

    @functools.wraps(method)
    def wrapper(self, **kwargs):
        if method.__name__ != "daemon_alive":
            self.trace.append(f"{method.__name__}({', '.join(f'{k}={_short(v)}' for k, v in kwargs.items())})")
        try:
            return method(self, **kwargs)
        except HypothesisException:
            raise  # hypothesis's own control flow
        except Exception as error:  # noqa: BLE001 (a fuzzer bug is reported the same way)
            fail(self.trace, error)

    return wrapper


class DaemonFuzz(RuleBasedStateMachine):
    """The rules draw all their inputs first, in a shape that does not depend on
    what the daemon answered (hypothesis replays choices and requires the same
    draws from them), then act; a rule that finds nothing to act on does nothing."""

    def __init__(self):
        super().__init__()
        self.live = []
        self.closed_ids = []
        self.jobs = set()  # job names this example opened
        self.trace = []  # the steps of this example so far

    def _attached(self):
        return [s for s in self.live if s.stream() is not None]

    def _track(self, job, response):
        if response.segment_bytes < 4096 + 2 * response.num_slots * min(response.slot_bytes, 1 << 40):
            DAEMON.tally["OpenSession accepted: a segment smaller than its slots"] += 1
        session = FuzzSession(response)
        session.job = job
        self.live.append(session)
        if job:
            self.jobs.add(job)
        return session

    def _close(self, session):
        code, _ = DAEMON.call("CloseSession", pb.CloseSessionRequest(session_id=session.id))
        session.let_go()
        if session in self.live:
            self.live.remove(session)
        self.closed_ids.append(session.id)
        return code

    # --- the start of every example ------------------------------------------

    @initialize(job=st.sampled_from(fv.HEALTHY_JOB_NAMES), num_slots=st.integers(1, 4),
                slot_bytes=st.sampled_from([8192, 65536]))
    @step
    def healthy_session(self, job, num_slots, slot_bytes):
        """Starts from a session that works: opened on one of a few jobs, given its
        segment, attached, with chunks registered. Chunk sizes and dtypes depend
        only on the job and the chunk, so a later example resumes the job."""
        request = pb.OpenSessionRequest(job=job, num_slots=num_slots, slot_bytes=slot_bytes, client_info="fuzz")
        code, response = DAEMON.call("OpenSession", request)
        if code != OK:
            return
        session = self._track(job, response)
        session.segment, _ = fuzz_segment.give_segment(response, "proper")
        stream = StreamCall()
        session.streams.append(stream)
        reply = stream.send(pb.ClientMessage(attach=pb.Attach(session_id=session.id)).SerializeToString(), "attach")
        stream.attached = reply is not None and reply.WhichOneof("kind") == "attached"
        salt = fv.JOB_NAMES.index(job)
        chunks = [pb.ChunkSpec(chunk_id=i, num_elements=1000 + 111 * i + salt, param_dtype=1 + (i + salt) % 3,
                               grad_dtype=1 + i % 3, slot=i) for i in range(num_slots)]
        for spec in chunks:
            session.fill_region(spec.slot, True, "small", spec.num_elements, spec.param_dtype)
        code, _ = DAEMON.call("RegisterChunks", pb.RegisterChunksRequest(session_id=session.id, chunks=chunks))
        if code == OK:
            session.chunks = {spec.chunk_id: spec for spec in chunks}

    # --- every step ----------------------------------------------------------

    @invariant()
    @step
    def daemon_alive(self):
        DAEMON.check_alive()

    # --- OpenSession -----------------------------------------------------------

    @rule(request=fv.open_request(), fresh=st.integers(0, 3), mutate=st.booleans(),
          edits=fv.mutated(b"\x0a\x04fz-a\x10\x01\x18\x80\x40"), then_register=st.booleans(),
          chunks=st.lists(fv.chunk_spec(), min_size=1, max_size=2))
    @step
    def open_session(self, request, fresh, mutate, edits, then_register, chunks):
        """A structured request, or mutated bytes (of a fixed valid request, so that
        the draws do not depend on the structured one). Hypothesis likes to repeat
        a value, so a sane job name is mostly replaced by a fresh one: the job is
        then not already open."""
        if len(self.live) >= MAX_LIVE_SESSIONS:
            self._close(self.live[0])
        if fresh and request.job in fv.OPEN_JOB_NAMES:
            DAEMON.fresh_jobs += 1
            request.job = f"fz-n{DAEMON.fresh_jobs}"
        code, response = DAEMON.call("OpenSession", edits if mutate else request)
        if code != OK:
            return
        session = self._track("" if mutate else request.job, response)
        if then_register:  # at once, before the session is closed by another rule
            for spec in chunks:
                if spec.slot < 4:
                    spec.slot %= max(response.num_slots, 1)
            self._register(session, chunks, "small")

    @rule(i=fv.index(), slots=st.integers(1, 4), slot_bytes=st.sampled_from([4096, 65536]))
    @step
    def open_seen_job(self, i, slots, slot_bytes):
        """OpenSession on a job name the daemon showed (another user's, when
        ListJobs shows them): the legitimate job beside the fuzzer fails if one of
        its jobs is touched."""
        if not DAEMON.seen_jobs or len(self.live) >= MAX_LIVE_SESSIONS:
            return
        job = fv.choose(sorted(DAEMON.seen_jobs), i)
        code, response = DAEMON.call("OpenSession", pb.OpenSessionRequest(job=job, num_slots=slots,
                                                                           slot_bytes=slot_bytes))
        if code == OK:
            self._track(job, response)

    # --- the segment -----------------------------------------------------------

    @rule(i=fv.index(), handover=st.sampled_from(fuzz_segment.HANDOVERS))
    @step
    def give_segment(self, i, handover):
        if not self.live:
            return
        session = fv.choose(self.live, i)
        segment, outcome = fuzz_segment.give_segment(session.response, handover)
        DAEMON.tally[f"segment {handover} -> {outcome.split(' ')[0][:24]}"] += 1
        if segment is not None:
            if session.segment is not None:
                session.segment.close()
            session.segment = segment

    @rule(i=fv.index(), offset=st.integers(0, 2**24), garbage=st.binary(min_size=1, max_size=64))
    @step
    def scribble(self, i, offset, garbage):
        """The client writes anything anywhere in its segment, header included."""
        mapped = [s for s in self.live if s.segment]
        if mapped:
            segment = fv.choose(mapped, i).segment
            segment.write(offset % segment.size, garbage)

    # --- the stream ----------------------------------------------------------------

    @rule(i=fv.index())
    @step
    def attach(self, i):
        """Attach, also to a session that already has a stream (must be refused)."""
        if not self.live:
            return
        session = fv.choose(self.live, i)
        already = session.stream() is not None
        stream = StreamCall()
        session.streams.append(stream)
        reply = stream.send(pb.ClientMessage(attach=pb.Attach(session_id=session.id)).SerializeToString(), "attach")
        if reply is not None and reply.WhichOneof("kind") == "attached":
            if already:
                raise AssertionError(f"session {session.id} accepted a second stream while one is attached")
            stream.attached = True

    @rule(i=fv.index())
    @step
    def attach_race(self, i):
        """Two streams send Attach for one session at the same time: at most one may win."""
        if not self.live:
            return
        session = fv.choose(self.live, i)
        before = session.stream() is not None
        streams = [StreamCall(), StreamCall()]
        session.streams += streams
        raw = pb.ClientMessage(attach=pb.Attach(session_id=session.id)).SerializeToString()
        for stream in streams:
            stream._requests.put(raw)
        replies = [stream.reply("attach race") for stream in streams]
        winners = [s for s, r in zip(streams, replies) if r is not None and r.WhichOneof("kind") == "attached"]
        if len(winners) + before > 1:
            raise AssertionError(f"session {session.id}: {len(winners)} racing streams attached "
                                 f"(one was attached before: {before})")
        for stream in winners:
            stream.attached = True

    @rule(i=fv.index(), first=fv.stream_message(["s-0000000000000000", ""], 1), use_known=st.booleans(),
          mutate=st.booleans(), edits=fv.mutated(b"\x0a\x14\x0a\x12s-0123456789abcdef"))
    @step
    def attach_unknown(self, i, first, use_known, mutate, edits):
        """A stream whose first message is anything: an Attach for a closed
        session or another user's, another kind, or bytes."""
        known = sorted(DAEMON.foreign_sessions) + self.closed_ids[-4:]
        if use_known and known:
            first = pb.ClientMessage(attach=pb.Attach(session_id=fv.choose(known, i)))
        raw = edits if mutate else first.SerializeToString()
        stream = StreamCall()
        reply = stream.send(raw, "first")
        if reply is not None and reply.WhichOneof("kind") == "attached":
            attached_to = reply.attached.session_id
            if attached_to in DAEMON.foreign_sessions or attached_to in self.closed_ids:
                raise AssertionError(f"a stream attached to session {attached_to}, not this user's or closed")
        stream.cancel()

    @rule(i=fv.index(), message=fv.stream_message(["s-0000000000000000"], 1), next_step=st.booleans(),
          own_id=st.booleans(), mutate=st.integers(0, 3), edits=fv.mutated(b"\x12\x0a\x08\x01\x10\x00\x18\x00"))
    @step
    def stream_message(self, i, message, next_step, own_id, mutate, edits):
        """Any message on an attached stream; GradReady/EndStep/AbortStep often
        name the session's next step, Attach often its own id."""
        attached = self._attached()
        if not attached:
            return
        session = fv.choose(attached, i)
        kind = message.WhichOneof("kind") or "none"
        body = getattr(message, kind) if kind != "none" else None
        if next_step and kind in ("grad_ready", "end_step", "abort_step"):
            body.step = session.next_step
        if own_id and kind == "attach":
            body.session_id = session.id
        raw = edits if mutate == 0 else message.SerializeToString()
        self._observe(session, session.stream().send(raw, "mutated" if mutate == 0 else kind))

    def _observe(self, session, reply):
        if reply is not None and reply.WhichOneof("kind") == "step_committed":
            session.next_step = reply.step_committed.step + 1

    @rule(i=fv.index(), fill=st.sampled_from(FILLS), hyper=fv.hyper(), journal=st.booleans(),
          op=st.sampled_from([0.0, 0.5, 1e-30, 65504.0, float("inf"), float("nan")]))
    @step
    def train_step(self, i, fill, hyper, journal, op):
        """A whole step, as a client would send it (with values of its choosing);
        with `journal`, every chunk is kept (JOURNAL_USE_KEEP) and replayed with
        one op before the step ends, as the streamed mode's redo does."""
        journal = journal and "journal" in pb.GradReady.DESCRIPTOR.fields_by_name
        ready = [s for s in self.live if s.stream() and s.chunks]
        if not ready:
            return
        session = fv.choose(ready, i)
        step = session.next_step
        num_slots = max(session.response.num_slots, 1)
        for chunk_id, spec in sorted(session.chunks.items()):
            slot = spec.slot % num_slots
            session.fill_region(slot, False, fill, spec.num_elements, spec.grad_dtype)
            stream = session.stream()
            if stream is None:
                return
            grad = pb.GradReady(step=step, chunk_id=chunk_id, slot=slot, hyper=hyper)
            if journal:
                grad.journal = pb.JOURNAL_USE_KEEP
            stream.send(pb.ClientMessage(grad_ready=grad).SerializeToString(), "grad_ready")
            if journal:
                grad.journal = pb.JOURNAL_USE_REPLAY
                grad.redo = pb.REDO_REASON_GRADIENTS_CHANGED
                grad.grad_ops.add(kind=pb.GradOp.KIND_MUL, operand=op)
                stream.send(pb.ClientMessage(grad_ready=grad).SerializeToString(), "grad_ready")
        stream = session.stream()
        if stream is not None:
            self._observe(session, stream.send(pb.ClientMessage(end_step=pb.EndStep(step=step)).SerializeToString(),
                                               "end_step"))

    # --- RegisterChunks ------------------------------------------------------------

    @rule(i=fv.index(), chunks=fv.rarely(fv.many_chunk_specs(), st.lists(fv.chunk_spec(), max_size=4), one_in=8),
          fill=st.sampled_from(FILLS), mutate=st.integers(0, 4), edits=fv.mutated(
              b"\x0a\x12s-0123456789abcdef\x12\x0a\x08\x00\x10\xe8\x07\x18\x01\x20\x01"))
    @step
    def register_chunks(self, i, chunks, fill, mutate, edits):
        """RegisterChunks on an own session (weights written into the slots
        first), or mutated bytes (whose session id rarely parses)."""
        if mutate == 0 or not self.live:
            code, _ = DAEMON.call("RegisterChunks", edits)
            if code == OK:  # which chunks were taken is unknown: forget them all
                for session in self.live:
                    session.chunks.clear()
            return
        self._register(fv.choose(self.live, i), chunks, fill)

    def _register(self, session, chunks, fill):
        for spec in chunks[:8]:
            session.fill_region(spec.slot % max(session.response.num_slots, 1), True, fill, spec.num_elements,
                                spec.param_dtype)
        code, _ = DAEMON.call("RegisterChunks", pb.RegisterChunksRequest(session_id=session.id, chunks=chunks))
        if code == OK:
            for spec in chunks:
                session.chunks[spec.chunk_id] = spec
                if spec.num_elements > session.response.slot_bytes:
                    DAEMON.tally["RegisterChunks accepted: a chunk larger than its slot"] += 1

    # --- the end of a session ----------------------------------------------------

    @rule(i=fv.index())
    @step
    def close_session(self, i):
        if self.live:
            self._close(fv.choose(self.live, i))

    @rule(i=fv.index())
    @step
    def close_again(self, i):
        if not self.closed_ids:
            return
        session_id = fv.choose(self.closed_ids, i)
        code, _ = DAEMON.call("CloseSession", pb.CloseSessionRequest(session_id=session_id))
        if code == OK:
            raise AssertionError(f"session {session_id} was closed twice")

    @rule(i=fv.index(), how=st.sampled_from(["cancel", "half_close", "forget"]))
    @step
    def abandon(self, i, how):
        """The client goes away without CloseSession: its stream is cancelled or
        half-closed, or (a few times) it never attached and is left to the reaper."""
        if not self.live:
            return
        session = fv.choose(self.live, i)
        stream = session.stream()
        # Only sessions of fresh jobs are left to the reaper: one on a job the
        # examples start with would keep that job busy for the reaper's grace.
        forgettable = session.job not in fv.JOB_NAMES and DAEMON.forgotten < MAX_FORGOTTEN
        if stream is None and (how != "forget" or not forgettable):
            self._close(session)
            return
        if stream is None:
            DAEMON.forgotten += 1
        elif how == "half_close":
            stream.half_close()
            stream.reply("half-closed")  # the daemon ends the stream and the session
        session.let_go()
        self.live.remove(session)

    # --- another user's things -------------------------------------------------------

    @rule(i=fv.index())
    @step
    def touch_foreign_session(self, i):
        if not DAEMON.foreign_sessions:
            return
        session_id = fv.choose(sorted(DAEMON.foreign_sessions), i)
        for name, request in (("RegisterChunks", pb.RegisterChunksRequest(session_id=session_id)),
                              ("CloseSession", pb.CloseSessionRequest(session_id=session_id))):
            code, _ = DAEMON.call(name, request)
            if code == OK:
                raise AssertionError(f"uid {DAEMON.uid}: {name} on session {session_id} of another user succeeded")

    # --- Admin -------------------------------------------------------------------

    @rule(name=st.sampled_from(["Health", "GetStats", "ListSessions", "ListJobs"]), all_users=st.booleans())
    @step
    def admin(self, name, all_users):
        request = UNARY[name][1]()
        if all_users and "all_users" in request.DESCRIPTOR.fields_by_name:
            request.all_users = True  # ListJobs of every user: root's view
        code, response = DAEMON.call(name, request)
        if code != OK:
            return
        if name == "ListSessions":
            for info in response.sessions:
                if info.uid != DAEMON.uid:
                    DAEMON.foreign_sessions.add(info.session_id)
                    raise AssertionError(f"uid {DAEMON.uid} was shown session {info.session_id} of uid {info.uid}")
        if name == "ListJobs":
            for job in response.jobs:
                DAEMON.seen_jobs[job.name] = job.owner_uid

    @rule(name=fv.job_name(), i=fv.index(), seen=st.booleans())
    @step
    def delete_job(self, name, i, seen):
        if seen and DAEMON.seen_jobs:
            name = fv.choose(sorted(DAEMON.seen_jobs), i)
        code, _ = DAEMON.call("DeleteJob", apb.DeleteJobRequest(name=name))
        if code == OK:
            DAEMON.seen_jobs.pop(name, None)

    @rule(name=st.sampled_from(sorted(UNARY)), job=fv.job_name(), edits=st.data())
    @step
    def any_rpc_mutated(self, name, job, edits):
        request = UNARY[name][1]()
        if name == "DeleteJob":
            request.name = job
        raw = edits.draw(fv.mutated(request.SerializeToString()), label="bytes")
        code, response = DAEMON.call(name, raw)
        if name == "OpenSession" and code == OK:
            self._track("", response)

    # --- the limits of issue 20 -------------------------------------------------------

    @rule(count=st.integers(1, 48), garbage=st.binary(max_size=32))
    @step
    def connection_flood(self, count, garbage):
        """Opens `count` raw connections (some sending a few bytes) and holds them:
        no more than the per-user cap stay open, and the daemon still answers."""
        if not DAEMON.max_connections_per_user:
            return
        held = []
        try:
            for n in range(count):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(DAEMON.socket_path)
                    if garbage and n % 2:
                        s.send(garbage)
                    held.append(s)
                except OSError:
                    s.close()
            time.sleep(0.3)
            open_now = sum(_still_open(s) for s in held)
            # The worker's own channel holds a connection of this uid too.
            if open_now > DAEMON.max_connections_per_user:
                raise AssertionError(f"{open_now} connections of uid {DAEMON.uid} are open, over the cap of "
                                     f"{DAEMON.max_connections_per_user}")
        finally:
            for s in held:
                s.close()
        DAEMON.check_alive()

    @rule(src=fv.job_name(), dst=fv.job_name(), i=fv.index(), seen=st.booleans())
    @step
    def copy_job(self, src, dst, i, seen):
        if seen and DAEMON.seen_jobs:
            src = fv.choose(sorted(DAEMON.seen_jobs), i)
        code, _ = DAEMON.call("CopyJob", apb.CopyJobRequest(src=src, dst=dst))
        if code != OK or not DAEMON.max_storage_per_user:
            return
        self.jobs.add(dst)
        code, listed = DAEMON.call("ListJobs", apb.ListJobsRequest())
        if code == OK:
            used = sum(job.bytes_on_storage for job in listed.jobs)
            if used > DAEMON.max_storage_per_user:
                raise AssertionError(f"after CopyJob {src!r} -> {dst!r} uid {DAEMON.uid}'s jobs hold {used} bytes, "
                                     f"over --max-storage-per-user {DAEMON.max_storage_per_user}")

    def teardown(self):
        try:
            for session in list(self.live):
                self._close(session)
            for job in self.jobs - set(fv.JOB_NAMES):
                DAEMON.call("DeleteJob", apb.DeleteJobRequest(name=job))
        except Exception as error:  # noqa: BLE001
            self.trace.append("teardown()")
            fail(self.trace, error)


def main():
    global DAEMON
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--daemon-pid", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-connections-per-user", type=int, default=0)
    parser.add_argument("--max-storage-per-user", type=int, default=0)
    args = parser.parse_args()
    DAEMON = Daemon(args.socket, args.daemon_pid, args.seconds)
    DAEMON.max_connections_per_user = args.max_connections_per_user
    DAEMON.max_storage_per_user = args.max_storage_per_user
    DAEMON.check_alive()
    # Hypothesis has no time budget: runs of a few examples, each sized to the
    # time left from how long the last examples took.
    runs = examples = 0
    started = time.monotonic()
    per_example = 1.0
    while not DAEMON.out_of_time():
        left = DAEMON.end - time.monotonic()
        count = max(2, min(50, int(left / per_example)))
        options = settings(max_examples=count, stateful_step_count=25, deadline=None, database=None,
                           phases=[Phase.generate], suppress_health_check=list(HealthCheck), print_blob=True,
                           report_multiple_bugs=False)
        began = time.monotonic()
        run_state_machine_as_test(DaemonFuzz, settings=options)
        per_example = max(0.05, (time.monotonic() - began) / count)
        runs += 1
        examples += count
    calls = sum(DAEMON.tally.values())
    print(f"fuzz_worker (uid {DAEMON.uid}): {examples} examples in {runs} runs, {calls} calls "
          f"in {time.monotonic() - started:.0f} s; what the daemon answered:")
    for key, count in sorted(DAEMON.tally.items()):
        print(f"  {count:6d}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
