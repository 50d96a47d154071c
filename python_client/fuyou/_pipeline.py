"""The chunk pipeline of fuyou.AdamW: moves one step's chunks between the
parameters and fuyoud.

It owns everything between a gradient and a new weight: the hooks that count
backward passes per chunk, the session's shared-memory slots, the chunks in
flight, the per-chunk staging copies of new weights that arrive while backward
still runs, and the install of new weights into the parameters. It knows
nothing of torch.optim: the optimizer tells it which hyper-parameters a chunk's
group has now (``hyper``: lr, beta1, beta2, eps, weight_decay, maximize; maximize
negates ``grad_scale``), with which ``grad_scale`` a hook may send a chunk
(``hook_grad_scale``, None: hooks must not send), and when to commit or abandon
a step.

One step, seen from here::

    backward: hook per parameter -> chunk complete -> send(chunk, speculative)
              (a fingerprint of its gradients is kept: fp32 sum, sum of squares)
              slots all busy      -> drain_oldest: new weights to staging
              a hook reaching a chunk already sent: the loop accumulates (the
              chunk's .grad is not zero), or it skipped step() (.grad is None or
              zero: abort(SKIPPED_STEP), a new step begins)
    step():   validate(): the sent chunks' fingerprints again, one pass ->
              redo(chunk) for those whose gradients changed, or all of them with
              the clip coefficient -> send_unsent(grad_scale) -> commit():
              install staged and in-flight chunks' new weights, EndStep
    or        abort(reason): wait for what is in flight, AbortStep, nothing installed

Every method is called with ``lock`` held (the optimizer's lock, shared).

offload_params (``set_offload``): the chunks are planned per module after the
pipeline is made (``set_chunks``) and registered one by one
(``register_chunk(store_weights=True)``); a chunk a pass completes goes to the
OffloadedParams (``chunks_done``), which sends it from ``.grad`` or from a host
copy (``send(packed=)``) and frees the gradients; no fingerprints, no
validation, and new weights are never installed (the daemon keeps them).

Threads. A hook only *enqueues* a chunk: it takes the fingerprint (on the
gradients' device, asynchronously on a GPU), keeps references to the gradient
pieces and records a marker (``_device``: an event on the current CUDA stream,
nothing on the CPU). One sender thread per pipeline takes the jobs in order:
frees a slot when all are busy (the oldest chunk's new weights to staging),
acquires a slot, copies the gradients into it (on a copy stream after the
marker, on a GPU), checks them for inf/nan, sends GradReady. So the autograd
thread never waits for a copy, a slot or the daemon. The sender never takes
``lock``; while jobs are queued it alone touches the chunks in flight and the
staging copies; every step-time method first waits for the queue to drain
(``_flush``), which also raises an error of the sender thread as the
pipeline's failure. A hook that runs after such an error raises it too.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import _device
from ._chunking import Chunk
from ._errors import FailedPrecondition, FuyouError
from ._freed_grad import FreedGrad
from ._sender import Sender

__all__ = ["ChunkPipeline", "Hyper", "LoopStats", "STATE_MASTER", "STATE_EXP_AVG",
           "STATE_EXP_AVG_SQ", "REDO_GRADIENTS_CHANGED", "REDO_CLIPPED",
           "ABORT_SKIPPED_STEP", "ABORT_OVERFLOW"]

# fuyou.v1.StateKind values.
STATE_MASTER, STATE_EXP_AVG, STATE_EXP_AVG_SQ = 1, 2, 3
# fuyou.v1.RedoReason and fuyou.v1.AbortReason values.
REDO_GRADIENTS_CHANGED, REDO_CLIPPED = 1, 2
# fuyou.v1.JournalUse and GradOp.Kind (the binding's JOURNAL_* and GRAD_OP_*).
JOURNAL_NONE, JOURNAL_KEEP, JOURNAL_ADD, JOURNAL_REPLAY = 0, 1, 2, 3
GRAD_OP_MUL, GRAD_OP_DIV = 1, 2
ABORT_SKIPPED_STEP, ABORT_OVERFLOW = 1, 2
# ChunkSpec.segment_elements holds at most this many entries (kMaxChunkSegments);
# a chunk with more is registered as one segment (a missing gradient then counts
# as zeros in it).
MAX_CHUNK_SEGMENTS = 4096


@dataclass
class LoopStats:
    """What the training loop made fuyou do, counted by the client.

    steps: steps committed. speculative_updates: chunk updates sent while
    backward ran. redone_changed / redone_clipped: chunk updates done again at
    step() because the gradients changed after they were sent, or because
    max_grad_norm clipped them. steps_with_redo: steps with at least one redo.
    rolled_back_skipped: chunk updates rolled back because the step was skipped
    (zero_grad or the next backward without step(), or an inf/nan with loss
    scaling). redo_seconds: wall time step() spent on redos (from the first redo
    sent to the last redone chunk's weights back). fingerprint_seconds: wall time
    spent taking the gradients' fingerprints (at send time and at step(); on a
    GPU, launching the reductions and the one wait for their results).
    journaled_bytes: gradient bytes fuyoud kept in its per-step journal
    (offload_params: every chunk sent during backward, and each undeclared
    accumulation pass into one). replayed: chunk updates redone from the
    journal (also counted in redone_changed / redone_clipped).
    """

    steps: int = 0
    speculative_updates: int = 0
    redone_changed: int = 0
    redone_clipped: int = 0
    steps_with_redo: int = 0
    rolled_back_skipped: int = 0
    redo_seconds: float = 0.0
    fingerprint_seconds: float = 0.0
    journaled_bytes: int = 0
    replayed: int = 0


# (lr, beta1, beta2, eps, weight_decay, maximize) of a chunk's parameter group, now.
Hyper = Tuple[float, float, float, float, float, bool]


@dataclass
class _Job:
    """A chunk to send, as the hook or step() saw it."""

    chunk: Chunk
    parts: Optional[list]  # _device.Part per segment; None once copied
    marker: object
    grad_scale: float  # negative for a maximize group
    hyper: Tuple[float, float, float, float, float]  # lr, beta1, beta2, eps, weight_decay
    step: int
    missing_sent: Tuple[int, ...]
    speculative: bool
    redo: int
    earlier: Optional["_Sent"]
    on_copied: Optional[Callable[[], None]] = None  # on the sender thread, after the copy
    journal: int = 0  # fuyou.v1.JournalUse; REPLAY: parts is None from the start
    grad_ops: Tuple[Tuple[int, float], ...] = ()  # fuyou.v1.GradOp (kind, operand)


@dataclass
class _Sent:
    """A chunk sent in the current step."""

    missing: Tuple[int, ...]  # segments without a gradient
    fingerprint: Optional[torch.Tensor]  # fp32 [sum, sum of squares], None: not speculative
    not_updated: Tuple[int, ...]  # segments the daemon leaves alone (segments_without_grad)
    hyper: Optional[tuple] = None  # the group's hyper-parameters it was sent with
    journal_added: bool = False  # the daemon's journal holds an accumulating pass's sum



def _as_byte_buffer(t: torch.Tensor):
    """A writable buffer over a contiguous CPU tensor's bytes (works for bfloat16)."""
    return t.view(torch.uint8).numpy()


class ChunkPipeline:
    """The chunks of one optimizer and their way to the daemon and back.

    Args:
        chunks, params: from ``plan_chunks`` (chunks in registration order, the
            unique trainable parameters by ``param_index``).
        lock: the owner's lock; held around every call, taken by the hooks.
        hyper: group index -> the group's current hyper-parameters.
        hook_grad_scale: ``grad_scale`` for a chunk a hook completes, or None
            when hooks must not send (overlap off, an overflow).
        check_finite: refuse to send a chunk whose gradients hold inf or nan
            (loss scaling): ``overflow`` becomes True instead.
        accumulation_steps: backward passes per step as the loop's hint; a hook
            sends a chunk at its k-th pass, k the larger of this and the passes
            per step learned from the loop (see ``passes_per_step``).
        timeout: seconds any wait on the daemon may take.
    """

    def __init__(self, chunks: List[Chunk], params: List[torch.Tensor], *,
                 lock: threading.RLock, hyper: Callable[[int], Hyper],
                 hook_grad_scale: Callable[[], Optional[float]], check_finite: bool,
                 accumulation_steps: int, timeout: float):
        self.params = params
        # Shape of each parameter when the pipeline was made: a parameter whose
        # weights live in fuyoud (offload_params) is an empty placeholder between uses.
        self.param_shapes = [tuple(p.shape) for p in params]
        self.lock = lock
        self.accumulation_steps = int(accumulation_steps)
        self.timeout = float(timeout)
        self.failed: Optional[BaseException] = None
        self.stats = LoopStats()
        self._learned_passes = 1
        self._hyper = hyper
        self._hook_grad_scale = hook_grad_scale
        self._check_finite = check_finite
        self._session = None
        self._num_slots = 0
        self._reserved_slots = 0
        self._committed = 0
        # offload_params: the OffloadedParams that decides what happens to a chunk
        # whose gradients are complete (see set_offload); None: send it as usual.
        self._offload = None
        self.install_weights = True
        self._staging: Dict[int, torch.Tensor] = {}
        self._views: Dict[tuple, torch.Tensor] = {}
        self._hook_nodes: list = []
        self._hook_handles: list = []
        self._device = _device.for_params(params)
        self._sender: Optional[Sender] = None
        self._overflowed: List[_Job] = []
        self.set_chunks(chunks)

    def set_chunks(self, chunks: List[Chunk]) -> None:
        """Sets the chunk plan (before any chunk is registered): offload_params
        plans the chunks from the model's modules after the optimizer was made."""
        self.chunks = chunks
        self._chunks_of_param: List[List[Chunk]] = [[] for _ in self.params]
        for c in chunks:
            for seg in c.segments:
                if not self._chunks_of_param[seg.param_index] or \
                        self._chunks_of_param[seg.param_index][-1] is not c:
                    self._chunks_of_param[seg.param_index].append(c)
        self._chunk_by_id = {c.chunk_id: c for c in chunks}
        self._chunk_params = {c.chunk_id: sorted({s.param_index for s in c.segments})
                              for c in chunks}
        # Per chunk, per segment: Adam updates committed (the daemon's count).
        self._segment_counts: Dict[int, List[int]] = {c.chunk_id: [0] * len(c.segments)
                                                      for c in chunks}
        self._reset_step()

    def set_offload(self, offload) -> None:
        """Hands the chunks whose gradients are complete to `offload`
        (offload_params): ``offload.grad_arriving(index)`` runs before a
        parameter's gradient accumulates, ``offload.chunks_done(chunks, round)``
        after, with the chunks that the pass completed; new weights the daemon
        returns are not installed into the parameters (the next forward fetches
        them)."""
        self._offload = offload
        self.install_weights = False
        self.accumulation_steps = max(1, self.accumulation_steps)

    def chunk(self, chunk_id: int) -> Chunk:
        return self._chunk_by_id[chunk_id]

    def chunks_of_param(self, index: int) -> List[Chunk]:
        return self._chunks_of_param[index]

    def set_device(self) -> None:
        """Chooses the copy machinery again from the parameters' devices (after
        offload_params placed its placeholders on the modules' devices)."""
        self._device = _device.for_params(self.params)

    # ------------------------------------------------------------ session
    def attach(self, session, register: bool = True, reserved_slots: int = 0) -> bool:
        """Registers every chunk with `session` (a fuyou._fuyou.Session or a fake).
        A chunk the job already has gets the daemon's weights installed into the
        parameters. Returns True when any chunk was resumed. `register` False
        (offload_params): registers nothing (``register_chunk`` does it later);
        `reserved_slots` of the session's slots are left to weight fetches."""
        self._session = session
        self._reserved_slots = int(reserved_slots)
        self._num_slots = int(session.num_slots) - self._reserved_slots
        if self._num_slots < 1:
            raise ValueError(f"session has {session.num_slots} slots, {reserved_slots} reserved")

        self._committed = int(session.committed_step)
        resumed_any = False
        if register:
            with torch.no_grad():
                for c in self.chunks:
                    buf = self.gather_weights(c)
                    if self.register_chunk(c, buf):
                        self.install(c, buf)
                        resumed_any = True
        self.pin_slots()
        self._sender = Sender(f"fuyou-sender-{id(self):x}")
        return resumed_any

    def register_chunk(self, c: Chunk, buf: torch.Tensor, store_weights: bool = False) -> bool:
        """Registers chunk `c` with the session; `buf` (packed, on the CPU) holds
        a new chunk's initial weights, or receives a resumed chunk's committed
        ones. `store_weights`: the daemon keeps the chunk's working weights
        (offload_params). Returns True when the chunk was resumed."""
        segments = ([seg.numel for seg in c.segments]
                    if len(c.segments) <= MAX_CHUNK_SEGMENTS else [])
        extra = {"store_weights": True} if store_weights else {}
        try:
            registered = self._session.register_chunk(
                c.chunk_id, c.num_elements, c.dtype_code, c.dtype_code,
                _as_byte_buffer(buf), layout_fingerprint=c.layout_fingerprint,
                segment_elements=segments, **extra)
        except FailedPrecondition as e:
            if "fingerprint" not in e.message:
                raise
            raise FailedPrecondition(
                f"{e.message} (this model's chunk {c.chunk_id:#x} holds "
                f"{c.layout_description()})", e.code) from None
        resumed, count = bool(registered[0]), int(registered[1])
        per_segment = list(registered[2]) if len(registered) > 2 else []
        if len(per_segment) != len(c.segments):
            per_segment = [count] * len(c.segments)
        self._segment_counts[c.chunk_id] = [int(t) for t in per_segment]
        return resumed

    @property
    def session(self):
        """The session (None when detached); offload_params fetches through it."""
        return self._session

    def pin_slots(self) -> None:
        """On CUDA: registers the session's slots with CUDA (DMA copies)."""
        session = self._session
        if self._device.streams and not self._device.pinned:
            slots = int(session.num_slots)
            self._device.pin([session.grad_region(slot) for slot in range(slots)] +
                             [session.param_region(slot) for slot in range(slots)])

    @property
    def attached(self) -> bool:
        return self._session is not None

    @property
    def committed_step(self) -> int:
        """Last step the daemon committed for the job."""
        return self._committed

    @property
    def in_step(self) -> bool:
        """True while the step has chunks sent and not yet committed or abandoned."""
        return bool(self._sent)

    @property
    def passes_per_step(self) -> int:
        """Backward passes per step a hook waits for before it sends a chunk: the
        accumulation_steps hint, or more when the loop was seen accumulating."""
        return max(self.accumulation_steps, self._learned_passes)

    def close(self) -> None:
        """Removes the hooks, abandons a step in progress (unless the pipeline
        failed) and closes the session. Errors closing the session are raised
        only when nothing failed before."""
        self.remove_hooks()
        session = self._session
        if session is None:
            return
        try:
            if self.failed is None:
                try:  # a step in progress is abandoned, not committed
                    self._flush()
                    self._drain_all(session)
                    if self._sent:
                        session.abort_step(self._committed + 1)
                except FuyouError:
                    pass
                except BaseException as e:  # the sender's error: nothing to abandon
                    self.failed = e
        finally:
            self._session = None
            if self._sender is not None:
                self._sender.stop()
            self._device.unpin()  # before the session's mapping goes away
            self._views.clear()
        try:
            session.close()
        except FuyouError:
            if self.failed is None:
                raise

    def detach(self) -> None:
        """Stops the sender thread and unpins the slots without talking to the
        daemon: for an owner that closes the session itself (a failed start)."""
        if self._sender is not None:
            self._sender.stop()
        self._device.unpin()
        self._views.clear()
        self._session = None

    # ------------------------------------------------------------ states
    def read_states(self, c: Chunk) -> Tuple[List[torch.Tensor], int]:
        """The chunk's committed fp32 (master, exp_avg, exp_avg_sq) and its update
        count. Between steps only."""
        states = [torch.empty(c.num_elements, dtype=torch.float32) for _ in range(3)]
        t = 0
        for kind, buf in zip((STATE_MASTER, STATE_EXP_AVG, STATE_EXP_AVG_SQ), states):
            t = self._session.read_state(c.chunk_id, kind, 0, buf.numpy())
        return states, int(t)

    def segment_update_counts(self, c: Chunk) -> List[int]:
        """Committed Adam updates of each of the chunk's segments (a parameter
        without a gradient in a step is not updated, as in torch)."""
        return list(self._segment_counts[c.chunk_id])

    def write_state(self, c: Chunk, kind: int, values: torch.Tensor) -> None:
        """Replaces one fp32 state of the chunk, as part of the pending import."""
        self._session.write_state(c.chunk_id, kind, 0, values.numpy())

    def set_update_count(self, c: Chunk, counts: List[int]) -> None:
        """Sets the Adam step count of each of the chunk's segments, as part of the
        pending import (a chunk registered as one segment takes the largest)."""
        counts = [int(t) for t in counts]
        largest = max(counts)
        if len(set(counts)) == 1 or len(c.segments) > MAX_CHUNK_SEGMENTS:
            self._session.set_update_count(c.chunk_id, largest)
            counts = [largest] * len(c.segments)
        else:
            self._session.set_update_count(c.chunk_id, largest, segment_update_counts=counts)
        self._segment_counts[c.chunk_id] = counts

    def commit_import(self) -> None:
        """Makes the pending import durable (one atomic commit)."""
        self._session.commit_import()

    # ------------------------------------------------------------ weights
    def gather_weights(self, c: Chunk) -> torch.Tensor:
        """The chunk's current weights, packed, on the CPU."""
        buf = torch.empty(c.num_elements, dtype=c.dtype)
        for seg in c.segments:
            buf[seg.offset:seg.offset + seg.numel].copy_(
                seg.param.detach().reshape(-1)[seg.start:seg.end])
        return buf

    def install(self, c: Chunk, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Copies packed weights `src` of chunk `c` into its parameters (on the
        current stream; `non_blocking`: the caller waits before `src` changes)."""
        for seg in c.segments:
            part = src[seg.offset:seg.offset + seg.numel]
            data = seg.param.data
            if data.is_contiguous():
                data.view(-1)[seg.start:seg.end].copy_(part, non_blocking=non_blocking)
            else:
                flat = data.reshape(-1).clone()
                flat[seg.start:seg.end].copy_(part)
                data.copy_(flat.view_as(data))

    # ------------------------------------------------------------ hooks
    def install_hooks(self, indices: Optional[List[int]] = None) -> None:
        """Two hooks per parameter (of `indices`; None: all). Before its gradient
        accumulates (a tensor hook): a chunk already sent in this step means the
        loop accumulates or skipped step(). After (a hook on its AccumulateGrad
        node): counts backward passes per chunk and sends a chunk when its last
        gradient of the step is in. The parameter must have its full shape, dtype
        and device now: its AccumulateGrad node takes them."""
        self_ref = weakref.ref(self)
        for index in (range(len(self.params)) if indices is None else indices):
            p = self.params[index]
            node = p.expand_as(p).grad_fn.next_functions[0][0]  # AccumulateGrad
            self._hook_nodes.append(node)  # the node must outlive the hook

            def before(grad, index=index):
                pipeline = self_ref()
                if pipeline is not None:
                    pipeline._on_grad_arriving(index)
                return None

            def after(grad_inputs, grad_outputs, index=index):
                pipeline = self_ref()
                if pipeline is not None:
                    pipeline._on_grad_accumulated(index)

            self._hook_handles.append(p.register_hook(before))
            self._hook_handles.append(node.register_hook(after))

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._hook_handles = []
        self._hook_nodes = []

    def reset_passes(self) -> None:
        """Forgets the backward passes counted so far (zero_grad before any send)."""
        self._rounds = {c.chunk_id: 0 for c in self.chunks}
        self._reached = {c.chunk_id: 0 for c in self.chunks}
        self._param_passes = [0] * len(self.params)

    def _on_grad_arriving(self, index: int) -> None:
        """Before parameter `index` accumulates a gradient of a backward pass."""
        with self.lock:
            if self._session is None or self.failed is not None:
                return
            if self._offload is not None:
                self._offload.grad_arriving(index)
                return
            sent = [c for c in self._chunks_of_param[index]
                    if c.chunk_id in self._sent and c.chunk_id not in self._checked]
            if not sent:
                return
            for c in sent:
                self._checked.add(c.chunk_id)
            try:
                if self._all_zeroed(sent):
                    # zero_grad (the model's) and a new backward without step():
                    # the loop skipped the step.
                    self.abort(ABORT_SKIPPED_STEP)
                    self._param_passes[index] = 0
                else:
                    # One more backward pass into gradients already sent: the loop
                    # accumulates; step() redoes these chunks and learns the passes.
                    self._accumulating = True
            except BaseException as e:
                self.failed = e
                raise

    def _hyper_now(self, group_index: int) -> tuple:
        """The group's (lr, beta1, beta2, eps, weight_decay, maximize) now, as floats."""
        return tuple(float(x) for x in self._hyper(group_index))

    def _all_zeroed(self, chunks: List[Chunk]) -> bool:
        """Whether every gradient of the chunks' parameters is None or all zeros, as
        a zero_grad leaves them: then a backward pass reaching a chunk already sent
        means the loop skipped step(). One parameter whose gradient is legitimately
        zero (or None) beside others with gradients does not make it so (one check
        per chunk and step, one wait for the device)."""
        grads = [self.params[i].grad for c in chunks for i in self._chunk_params[c.chunk_id]]
        flags = [g.detach().ne(0).any() for g in grads if g is not None]
        return not flags or not bool(torch.stack(flags).any())

    def _on_grad_accumulated(self, index: int) -> None:
        with self.lock:
            if self._session is None or self.failed is not None:
                return
            if self._sender is not None and self._sender.error is not None:
                self.failed = self._sender.error
                raise self.failed
            self._param_passes[index] += 1
            passes = self._param_passes[index]
            done = []
            for c in self._chunks_of_param[index]:
                cid = c.chunk_id
                if cid in self._sent:
                    continue
                if passes == self._rounds[cid] + 1:
                    self._reached[cid] += 1
                    members = self._chunk_params[cid]
                    if self._reached[cid] == len(members):
                        self._rounds[cid] += 1
                        self._reached[cid] = sum(
                            1 for i in members if self._param_passes[i] >= self._rounds[cid] + 1)
                        if self._offload is not None:
                            done.append(c)
                            continue
                        if self._rounds[cid] < self.passes_per_step:
                            continue
                        grad_scale = self._hook_grad_scale()
                        if grad_scale is None:
                            continue
                        try:
                            self.send(c, grad_scale, speculative=True)
                        except BaseException as e:
                            self.failed = e
                            raise
            if done:
                try:
                    self._offload.chunks_done(done, self._rounds)
                except BaseException as e:
                    if not isinstance(e, FailedPrecondition):
                        self.failed = e
                    raise

    @property
    def param_passes(self) -> List[int]:
        """Per parameter, the backward passes of this step that accumulated into it."""
        return self._param_passes

    def sent_ids(self):
        """Ids of the chunks sent in this step (a view)."""
        return self._sent.keys()

    def chunk_rounds(self, chunk_id: int) -> int:
        """Backward passes of this step that completed the chunk's gradients."""
        return self._rounds[chunk_id]

    # ------------------------------------------------------------ per step
    @property
    def overflow(self) -> bool:
        """True when a chunk's gradients held inf or nan (with check_finite), as
        far as the sender thread has seen (exact after any step-time method)."""
        return self._overflow or bool(self._overflowed)

    def mark_overflow(self) -> None:
        """The step cannot be committed (a non-finite gradient norm, say)."""
        self._overflow = True

    def fingerprints(self, chunks: List[Chunk]) -> List[Optional[torch.Tensor]]:
        """Per chunk, fp32 [sum, sum of squares] of its current gradients on their
        device (None: no gradient at all), without waiting for the device."""
        return [self._fingerprint(c) for c in chunks]

    def validate(self, squares: bool) -> Tuple[List[Chunk], Dict[int, float]]:
        """At step(): the chunks sent speculatively whose gradients changed since
        they were sent (fingerprint or missing gradients differ), and, with
        `squares`, every chunk's current sum of squares of its gradients (chunks
        without any left out; else only the sent ones'), in one pass over the
        gradients and one wait for the device."""
        self._flush()
        started = time.perf_counter()
        chunks = self.chunks if squares else [
            self._chunk_by_id[cid] for cid, s in self._sent.items() if s.fingerprint is not None]
        now = self.fingerprints(chunks)
        by_device: Dict[torch.device, list] = collections.defaultdict(list)
        changed: List[Chunk] = []
        for c, fp in zip(chunks, now):
            sent = self._sent.get(c.chunk_id)
            if sent is not None and sent.fingerprint is not None:
                if sent.missing != self._missing(c) or (fp is None) != (sent.fingerprint is None) \
                        or sent.hyper != self._hyper_now(c.group_index):
                    changed.append(c)  # or lr, betas, ... set between backward and step()
                elif fp is not None:
                    by_device[fp.device].append((c, torch.stack((fp, sent.fingerprint))))
            if fp is not None:
                by_device[fp.device].append((c, fp))
        sums_of_squares: Dict[int, float] = {}
        for items in by_device.values():
            flat = torch.cat([t.reshape(-1) for _, t in items]).cpu().tolist()
            pos = 0
            for c, t in items:
                n = t.numel()
                values = flat[pos:pos + n]
                pos += n
                if n == 2:
                    sums_of_squares[c.chunk_id] = values[1]
                elif not _same(values[0:2], values[2:4]):
                    changed.append(c)
        self.stats.fingerprint_seconds += time.perf_counter() - started
        return changed, sums_of_squares

    def redo(self, c: Chunk, grad_scale: float, reason: int) -> None:
        """Sends chunk `c` again in this step with its gradients as they are now:
        the daemon drops its update of the step and updates again from the
        committed states. Its earlier new weights (in flight or staged) are dropped."""
        self._drop_earlier(c.chunk_id)
        earlier = self._sent.pop(c.chunk_id)
        self.send(c, grad_scale, redo=reason, earlier=earlier)
        self._count_redo(reason)

    def _drop_earlier(self, cid: int) -> None:
        """Before a chunk is sent again in the step: its earlier new weights (in
        flight or staged) are dropped, on the sender thread in order with the sends."""
        session = self._session
        if self._redo_started is None:
            self._redo_started = time.monotonic()

        def drop() -> None:
            if cid in self._inflight:
                del self._inflight[cid]
                session.release_slot(self._wait(session, cid))
            self._staged.discard(cid)

        self._sender.submit(drop)

    def _count_redo(self, reason: int) -> None:
        if reason == REDO_CLIPPED:
            self.stats.redone_clipped += 1
        else:
            self.stats.redone_changed += 1

    def replay(self, c: Chunk, grad_scale: float, grad_ops, reason: int) -> None:
        """Updates chunk `c` again in this step from the daemon's journal of its
        gradients (sent with ``journal=True``) after `grad_ops` (the loop's
        in-place mul_/div_ since), with `grad_scale`: nothing is copied."""
        cid = c.chunk_id
        self._drop_earlier(cid)
        earlier = self._sent.pop(cid)
        self._enqueue(c, None, grad_scale, earlier.not_updated, redo=reason, earlier=earlier,
                      journal=JOURNAL_REPLAY, grad_ops=grad_ops)
        self._sent[cid] = _Sent(earlier.missing, None, earlier.not_updated, earlier.hyper,
                                journal_added=earlier.journal_added)
        self._count_redo(reason)
        self.stats.replayed += 1

    def journal_add(self, c: Chunk, grad_scale: float, grad_ops, earlier: "_Sent") -> None:
        """An undeclared backward pass completed chunk `c`, whose gradients the
        daemon journaled in this step (``earlier``: ``take_sent``): its ``.grad``
        (zeros where a parameter has no new gradient) is added to the journal
        after `grad_ops`, and the chunk updated again from the sum."""
        cid = c.chunk_id
        self._drop_earlier(cid)
        parts, grads, now_missing = [], [], set()
        for i, seg in enumerate(c.segments):
            g = seg.param.grad
            if g is None or isinstance(g, FreedGrad):  # no new gradient: zeros
                parts.append((seg.offset, seg.numel, None))
                now_missing.add(i)
            else:
                g = g.detach()
                grads.append(g)
                parts.append((seg.offset, seg.numel, g.reshape(-1)[seg.start:seg.end]))
        missing = tuple(i for i in earlier.missing if i in now_missing)
        not_updated = missing if len(c.segments) <= MAX_CHUNK_SEGMENTS else ()
        self._enqueue(c, parts, grad_scale, not_updated, redo=REDO_GRADIENTS_CHANGED,
                      earlier=earlier, journal=JOURNAL_ADD, grad_ops=grad_ops,
                      marker=self._device.marker(grads))
        self._sent[cid] = _Sent(missing, None, not_updated, journal_added=True)
        self._count_redo(REDO_GRADIENTS_CHANGED)
        self.stats.replayed += 1
        self.stats.journaled_bytes += c.nbytes

    def take_sent(self, chunk_id: int) -> "_Sent":
        """Takes chunk `chunk_id` out of the step's sent chunks (an accumulating
        pass will send it again: ``journal_add``)."""
        return self._sent.pop(chunk_id)

    def sent_info(self, chunk_id: int) -> Optional["_Sent"]:
        return self._sent.get(chunk_id)

    def chunk_params(self, chunk_id: int) -> List[int]:
        """Indices of the parameters with a segment in the chunk."""
        return self._chunk_params[chunk_id]

    def mark_accumulating(self) -> None:
        """The loop made one more backward pass into a chunk sent in this step:
        commit() learns the passes per step."""
        self._accumulating = True

    def journal_stats(self, c: Chunk) -> Tuple[List[float], List[float]]:
        """Per segment, the sum of squares and the largest magnitude of the
        chunk's journaled gradients after its last update (waits for it)."""
        session = self._session
        self._flush()
        if c.chunk_id in self._inflight:
            del self._inflight[c.chunk_id]
            session.release_slot(self._wait(session, c.chunk_id))
        stats = session.journal_stats(c.chunk_id)
        if stats is None:
            raise FuyouError(f"fuyoud sent no journal statistics for chunk {c.chunk_id:#x}")
        return [float(x) for x in stats[0]], [float(x) for x in stats[1]]

    def _enqueue(self, c: Chunk, parts, grad_scale: float, missing_sent, *, redo: int,
                 earlier, journal: int, grad_ops, marker=None) -> None:
        lr, beta1, beta2, eps, weight_decay, maximize = self._hyper(c.group_index)
        if maximize:
            grad_scale = -grad_scale
        job = _Job(c, parts, marker, float(grad_scale),
                   (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay)),
                   self._committed + 1, tuple(missing_sent), False, redo, earlier,
                   journal=journal, grad_ops=tuple(grad_ops))
        self._sender.submit(lambda: self._send_now(job))

    def send_unsent(self, grad_scale: float) -> None:
        """Sends every chunk not sent yet in this step (stops at an overflow)."""
        for c in self.chunks:
            if c.chunk_id not in self._sent:
                self.send(c, grad_scale)
                if self.overflow:
                    break
        self._flush()

    def sent_chunks(self) -> List[Chunk]:
        """The chunks sent in this step, in send order."""
        return [self._chunk_by_id[cid] for cid in self._sent]

    def send(self, c: Chunk, grad_scale: float, *, speculative: bool = False,
             redo: int = 0, earlier: Optional[_Sent] = None,
             packed: Optional[Tuple[torch.Tensor, Tuple[int, ...]]] = None,
             on_copied: Optional[Callable[[], None]] = None, journal: bool = False) -> bool:
        """Enqueues the chunk for the sender thread, which copies its gradients
        into a slot and sends GradReady; never blocks. A chunk without any
        gradient is not sent, unless it is a redo (which then undoes the step's
        update of it). `packed` (offload_params): the gradients as one flat
        tensor laid out as the chunk, and the segments without any, instead of
        the parameters' ``.grad``; no fingerprint is taken then. `on_copied`
        runs on the sender thread once the gradients are in the slot.
        `journal`: the daemon keeps the gradients for the step (JOURNAL_KEEP),
        for ``replay`` and ``journal_add``. Returns whether the chunk was enqueued."""
        missing = packed[1] if packed is not None else self._missing(c)
        if len(missing) == len(c.segments) and not redo:
            return False  # no gradient at all: the chunk is not updated this step
        fingerprint = None
        if speculative and packed is None and self._offload is None:
            started = time.perf_counter()
            fingerprint = self._fingerprint(c)
            self.stats.fingerprint_seconds += time.perf_counter() - started
        if len(c.segments) > MAX_CHUNK_SEGMENTS:
            missing_sent: Tuple[int, ...] = ()  # one segment: zeros stand in
        else:
            missing_sent = missing
        parts, grads = [], []
        if packed is not None:
            flat = packed[0]  # on the host: no device work to wait for
            for i, seg in enumerate(c.segments):
                piece = None if i in missing else flat[seg.offset:seg.offset + seg.numel]
                parts.append((seg.offset, seg.numel, piece))
        for seg in (c.segments if packed is None else ()):
            g = seg.param.grad
            if g is None:
                parts.append((seg.offset, seg.numel, None))
            else:
                g = g.detach()
                grads.append(g)
                parts.append((seg.offset, seg.numel, g.reshape(-1)[seg.start:seg.end]))
        hyper = self._hyper_now(c.group_index)
        lr, beta1, beta2, eps, weight_decay, maximize = hyper
        if maximize:  # torch's maximize: Adam on -grad
            grad_scale = -grad_scale
        job = _Job(c, parts, self._device.marker(grads), float(grad_scale),
                   (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay)),
                   self._committed + 1, missing_sent, speculative, redo, earlier, on_copied,
                   journal=JOURNAL_KEEP if journal else 0)
        self._sent[c.chunk_id] = _Sent(missing, fingerprint, missing_sent, hyper)
        if journal:
            self.stats.journaled_bytes += c.nbytes
        if speculative:
            self.stats.speculative_updates += 1
        self._sender.submit(lambda: self._send_now(job))
        return True

    def _send_now(self, job: _Job) -> None:
        """On the sender thread: slot, copy, inf/nan check, GradReady."""
        session, c = self._session, job.chunk
        if session is None:
            return
        if len(self._inflight) >= self._num_slots:
            self._drain_oldest(session)
        slot = session.acquire_slot(self.timeout)
        try:
            if job.journal != JOURNAL_REPLAY:  # a replay's gradients are in the daemon
                dst = self._view(slot, "grad", c.dtype)[:c.num_elements]
                self._device.copy_grads(dst, job.parts, job.marker)
                job.parts = job.marker = None  # the gradients may go now
                if job.on_copied is not None:
                    job.on_copied()
                if self._check_finite and not bool(torch.isfinite(dst).all()):
                    session.release_slot(slot)
                    self._overflowed.append(job)
                    return
            lr, beta1, beta2, eps, weight_decay = job.hyper
            journal = ({"journal": job.journal, "grad_ops": [list(op) for op in job.grad_ops]}
                       if job.journal else {})
            session.send_grad_ready(c.chunk_id, slot, job.step, lr, beta1, beta2, eps,
                                    weight_decay, job.grad_scale,
                                    segments_without_grad=list(job.missing_sent),
                                    speculative=job.speculative, redo=job.redo, **journal)
        except BaseException:
            try:
                session.release_slot(slot)
            except Exception:
                pass
            raise
        self._inflight[c.chunk_id] = slot

    def commit(self) -> None:
        """Installs every sent chunk's new weights into the parameters and commits
        the step (nothing to commit when nothing was sent). Learns the passes per
        step of an accumulating loop."""
        session = self._session
        self._flush()
        for cid in list(self._staged):
            self.install(self._chunk_by_id[cid], self._staging[cid])
        slots = []
        try:
            while self._inflight:
                cid, _ = self._inflight.popitem(last=False)
                c = self._chunk_by_id[cid]
                slot = self._wait(session, cid)
                slots.append(slot)
                if self.install_weights:
                    self.install(c, self._view(slot, "param", c.dtype)[:c.num_elements],
                                 non_blocking=True)
        finally:
            self._device.installed()  # the copies out of the slots are done
            for slot in slots:
                session.release_slot(slot)
        if self._redo_started is not None:
            self.stats.redo_seconds += time.monotonic() - self._redo_started
            self.stats.steps_with_redo += 1
        passes = max(self._param_passes, default=1)
        if self._accumulating:
            self._learned_passes = max(self._learned_passes, passes)
        elif 0 < passes < self._learned_passes:
            # The loop now makes fewer passes per step: wait for fewer (a loop that
            # accumulates again is seen again, and that step's updates redone).
            self._learned_passes = passes
        if self._sent:
            committed, _chunks = session.end_step(self._committed + 1)
            self._committed = int(committed)
            for cid, sent in self._sent.items():
                counts = self._segment_counts[cid]
                for i in range(len(counts)):
                    if i not in sent.not_updated:
                        counts[i] += 1
            self.stats.steps += 1
        self._reset_step()

    def abort(self, reason: int = 0) -> None:
        """Abandons the step: waits for the chunks in flight, rolls back what the
        daemon updated (AbortStep with `reason`), installs nothing."""
        session = self._session
        self._flush()
        self._drain_all(session)
        if self._sent:
            session.abort_step(self._committed + 1, reason=reason)
            if reason in (ABORT_SKIPPED_STEP, ABORT_OVERFLOW):
                self.stats.rolled_back_skipped += len(self._sent)
        self._reset_step()

    # ------------------------------------------------------------ internals
    def _reset_step(self) -> None:
        self._inflight: "collections.OrderedDict[int, int]" = collections.OrderedDict()
        self._sent: Dict[int, _Sent] = {}
        self._staged: set = set()
        self._checked: set = set()
        self._overflow = False
        self._accumulating = False
        self._redo_started: Optional[float] = None
        self.reset_passes()

    def _missing(self, c: Chunk) -> Tuple[int, ...]:
        return tuple(i for i, seg in enumerate(c.segments) if seg.param.grad is None)

    def _fingerprint(self, c: Chunk) -> Optional[torch.Tensor]:
        sums, squares = [], []
        for seg in c.segments:
            g = seg.param.grad
            if g is None:
                continue
            g = g.detach()
            piece = g.reshape(-1) if seg.numel == g.numel() else g.reshape(-1)[seg.start:seg.end]
            sums.append(torch.sum(piece, dtype=torch.float32))
            squares.append(torch.linalg.vector_norm(piece, dtype=torch.float32).square())
        if not sums:
            return None
        if len(sums) == 1:
            return torch.stack((sums[0], squares[0]))
        return torch.stack((torch.stack(sums).sum(), torch.stack(squares).sum()))

    def hook_grad_scale(self) -> Optional[float]:
        """``grad_scale`` for a chunk sent during backward; None: do not send now."""
        return self._hook_grad_scale()

    def slot_view(self, slot: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The slot's "grad" or "param" region as a flat tensor of `dtype`."""
        return self._view(slot, kind, dtype)

    def _view(self, slot: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        key = (slot, kind, dtype)
        v = self._views.get(key)
        if v is None:
            region = (self._session.grad_region(slot) if kind == "grad"
                      else self._session.param_region(slot))
            esize = torch.empty((), dtype=dtype).element_size()
            v = torch.frombuffer(region, dtype=dtype, count=len(region) // esize)
            self._views[key] = v
        return v

    def _wait(self, session, chunk_id: int) -> int:
        return session.wait_params(chunk_id, self.timeout)

    def _drain_oldest(self, session) -> None:
        """Frees a slot during backward: the oldest chunk's new weights go to its
        staging copy (the parameters may still be needed by backward)."""
        cid, _ = self._inflight.popitem(last=False)
        c = self._chunk_by_id[cid]
        slot = self._wait(session, cid)
        if not self.install_weights:  # offload_params: the daemon keeps the weights
            session.release_slot(slot)
            return
        self._staging[cid] = self._device.stage(
            self._view(slot, "param", c.dtype)[:c.num_elements], self._staging.get(cid))
        session.release_slot(slot)
        self._staged.add(cid)

    def wait_sent(self) -> None:
        """Waits until every chunk enqueued so far was sent to the daemon (or
        failed: the sender's error is raised). step() does this itself; tests and
        benchmarks that look at the daemon between backward and step() call it."""
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        """Waits until the sender thread ran every queued job; raises its error.
        Chunks it found inf/nan in are taken out of the step (overflow)."""
        if self._sender is None:
            return
        self._sender.flush()
        overflowed, self._overflowed = self._overflowed, []
        for job in overflowed:
            self._overflow = True
            cid = job.chunk.chunk_id
            if job.earlier is not None:
                self._sent[cid] = job.earlier
            else:
                self._sent.pop(cid, None)
            if job.speculative:
                self.stats.speculative_updates -= 1
            if job.redo == REDO_CLIPPED:
                self.stats.redone_clipped -= 1
            elif job.redo:
                self.stats.redone_changed -= 1

    def _drain_all(self, session) -> None:
        while self._inflight:
            cid, _ = self._inflight.popitem(last=False)
            slot = self._wait(session, cid)
            session.release_slot(slot)


def _same(a: List[float], b: List[float]) -> bool:
    """Exact equality of two fingerprints; nan equals nan (the same gradients)."""
    return all(x == y or (x != x and y != y) for x, y in zip(a, b))
