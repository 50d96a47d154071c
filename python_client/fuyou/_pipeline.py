"""The chunk pipeline of fuyou.AdamW: moves one step's chunks between the
parameters and fuyoud.

It knows nothing of torch.optim nor of the two modes (resident, streamed: see
_resident.py and _streamed.py, which drive it): the optimizer tells it which
hyper-parameters a chunk's group has now (``hyper``: lr, beta1, beta2, eps,
weight_decay, maximize; maximize negates ``grad_scale``), with which
``grad_scale`` a hook may send a chunk (``hook_grad_scale``, None: hooks must
not send), and when to commit or abandon a step. It is a facade over parts
with one idea each:

- ``plan`` (_chunk_plan.py): the chunks and which parameters each holds;
- ``states`` (_chunk_states.py): registration and the committed states
  (ReadState, an import), the per-segment update counts (``update_counts``);
- ``passes`` (_passes.py): backward passes per parameter and chunk, the
  passes per step;
- ``slots`` (_slots.py): the sender thread, the chunks in flight, the
  staging copies of new weights, the slot views, the copy machinery;
- ``step`` (_step_record.py): this step's chunks sent and its flags
  (overflow, accumulating);
- ``_link`` (_session_link.py): the session and the job's applied and
  durable steps as the daemon answered them;
- ``_owner`` (``PipelineOwner``): what it asks the optimizer (its lock, a
  group's hyper-parameters now, a hook's ``grad_scale``);
- here: the session's lifetime and the step's traffic (``send``, ``redo``,
  ``replay``, ``journal_add``, ``commit``, ``abort``).

One step: a mode's hook calls ``count_pass(index)`` and sends the chunks it
completed; at step() the mode redoes or replays what changed, then ``commit``
(staged and in-flight new weights installed, EndStep) or ``abort(reason)``
(wait for what is in flight, AbortStep, nothing installed).

Every method is called with ``lock`` held (the optimizer's lock, shared); the
sender thread never takes it. Every step-time method first waits for the
sender's queue (``_flush``), which also raises an error of the sender thread
as the pipeline's failure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from . import _device
from ._chunk_plan import ChunkPlan
from ._chunk_states import ChunkStates
from ._chunk_weights import gather_weights, grad_parts, install
from ._chunking import Chunk
from ._errors import FuyouError
from ._fingerprints import missing_grads
from ._loop_stats import LoopStats
from ._passes import PassCounter
from ._session_link import SessionLink
from ._protocol import (ABORT_OVERFLOW, ABORT_SKIPPED_STEP, JOURNAL_ADD, JOURNAL_KEEP,
                        JOURNAL_REPLAY, MAX_CHUNK_SEGMENTS, REDO_CLIPPED,
                        REDO_GRADIENTS_CHANGED, Hyper)
from ._slots import ChunksInFlight, Sent, SendJob
from ._step_record import StepRecord

__all__ = ["ChunkPipeline", "LoopStats", "PipelineOwner"]


@dataclass(frozen=True)
class PipelineOwner:
    """What the pipeline asks of the optimizer that drives it."""

    lock: object  # held around every call of the pipeline, taken by the hooks
    hyper: Callable[[int], Hyper]  # group index -> the group's hyper-parameters now
    hook_grad_scale: Callable[[], Optional[float]]  # for a hook's send; None: do not send


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
        accumulation_steps: backward passes per step as the loop's hint.
        timeout: seconds any wait on the daemon may take.
        install_weights: new weights go into the parameters (False: offload_params).
        commit_empty_steps: every step() that is not skipped commits a step in
            the job, even one in which this pipeline sent no chunk (a
            data-parallel rank: every rank's job counts the same steps, so
            that the ranks resume together). False: a step with nothing sent
            leaves the job as it was.
    """

    def __init__(self, chunks: List[Chunk], params: List[torch.Tensor], *,
                 lock, hyper: Callable[[int], Hyper],
                 hook_grad_scale: Callable[[], Optional[float]], check_finite: bool,
                 accumulation_steps: int, timeout: float, install_weights: bool = True,
                 moments_dtype: int = 1, commit_empty_steps: bool = False):
        self.params = params
        # Shape of each parameter when the pipeline was made: a parameter whose
        # weights live in fuyoud (offload_params) is an empty placeholder between uses.
        self.param_shapes = [tuple(p.shape) for p in params]
        self.failed: Optional[BaseException] = None
        self.commit_empty_steps = commit_empty_steps
        self.stats = LoopStats()
        self._owner = PipelineOwner(lock, hyper, hook_grad_scale)
        self._link = SessionLink()
        self.passes = PassCounter(accumulation_steps)
        self.slots = ChunksInFlight(_device.for_params(params), timeout, check_finite,
                                     install_weights)
        # moments_dtype: the chunks' m and v dtype code (AdamW state_dtype).
        self.states = ChunkStates([], moments_dtype)
        self.set_chunks(chunks)

    @property
    def lock(self):
        """The owner's lock, held around every call."""
        return self._owner.lock

    # ------------------------------------------------------------ plan
    def set_chunks(self, chunks: List[Chunk]) -> None:
        """Sets the chunk plan (before any chunk is registered): offload_params
        plans the chunks from the model's modules after the optimizer was made."""
        self.plan = ChunkPlan(chunks, len(self.params))
        self.states.set_chunks(chunks)
        self._reset_step()

    # ------------------------------------------------------------ session
    def attach(self, session, register: bool = True, reserved_slots: int = 0) -> bool:
        """Registers every chunk with `session` (a fuyou._fuyou.Session or a fake).
        A chunk the job already has gets the daemon's weights installed into the
        parameters. Returns True when any chunk was resumed. `register` False
        (offload_params): registers nothing (``states.register`` does it later);
        `reserved_slots` of the session's slots are left to weight fetches."""
        num_slots = int(session.num_slots) - int(reserved_slots)
        if num_slots < 1:
            raise ValueError(f"session has {session.num_slots} slots, {reserved_slots} reserved")
        self._link.attach(session)
        self.states.session = session
        self.slots.attach(session, num_slots, f"fuyou-sender-{id(self):x}")
        resumed_any = False
        if register:
            with torch.no_grad():
                for c in self.plan.chunks:
                    buf = gather_weights(c)
                    if self.states.register(c, buf):
                        install(c, buf)
                        resumed_any = True
        self.slots.pin()
        return resumed_any

    @property
    def session(self):
        """The session (None when detached); offload_params fetches through it."""
        return self._link.session

    def set_device(self) -> None:
        """Chooses the copy machinery again from the parameters' devices (after
        offload_params placed its placeholders on the modules' devices)."""
        self.slots.device = _device.for_params(self.params)

    @property
    def attached(self) -> bool:
        return self._link.session is not None

    @property
    def committed_step(self) -> int:
        """Last step the daemon applied for the job (EndStep answered)."""
        return self._link.committed

    @property
    def durable_step(self) -> int:
        """Last step the daemon reported durable, what a crash keeps: the
        applied step, or the one before while its commit runs on in the daemon."""
        return self._link.durable

    def wait_durable(self) -> None:
        """Waits until the last applied step is durable (fuyoud's WaitDurable; at
        once when it was reported durable): durable_step is committed_step after."""
        self._link.wait_durable()

    def continue_steps_from(self, step: int) -> None:
        """The job, rebuilt by an import and at committed step 0, goes on from
        `step` (a reshard keeps the old jobs' count): one CommitImport that
        sets it. Between steps, with nothing of the import pending."""
        self._link.commit_import_at(step)

    def close(self) -> None:
        """Abandons a step in progress (unless the pipeline failed) and closes the
        session. Errors closing the session are raised only when nothing failed
        before. The owner removes its hooks first."""
        session = self._link.session
        if session is None:
            return
        try:
            if self.failed is None:
                try:  # a step in progress is abandoned, not committed
                    self._flush()
                    self.slots.drain_all()
                    if self.step.in_step:
                        self._link.abort_step()
                except FuyouError:
                    pass
                except BaseException as e:  # the sender's error: nothing to abandon
                    self.failed = e
        finally:
            self._link.detach()
            self.states.session = None
            self.slots.stop()
        try:
            session.close()
        except FuyouError:
            if self.failed is None:
                raise

    def detach(self) -> None:
        """Stops the sender thread and unpins the slots without talking to the
        daemon: for an owner that closes the session itself (a failed start)."""
        self.slots.stop()
        self._link.detach()
        self.states.session = None

    # ------------------------------------------------------------ passes
    def reset_passes(self) -> None:
        """Forgets the backward passes counted so far (zero_grad before any send)."""
        self.passes.reset(self.plan.chunks, len(self.params))

    def hooks_live(self) -> bool:
        """Whether a hook should act: attached and not failed."""
        return self._link.session is not None and self.failed is None

    def count_pass(self, index: int) -> List[Chunk]:
        """Parameter `index` accumulated a gradient: the chunks not sent yet in
        this step that this completed. Raises (and fails) on a sender error."""
        sender = self.slots.sender
        if sender is not None and sender.error is not None:
            self.failed = sender.error
            raise self.failed
        return self.passes.count(index, self.plan.of_param(index), self.plan.params_of,
                                 self.step.sent.__contains__)

    # ------------------------------------------------------------ per step
    def hook_grad_scale(self) -> Optional[float]:
        """``grad_scale`` for a chunk sent during backward; None: do not send now."""
        return self._owner.hook_grad_scale()

    def hyper_now(self, group_index: int) -> Hyper:
        """The group's hyper-parameters now."""
        return self._owner.hyper(group_index)

    def send(self, c: Chunk, grad_scale: float, *, speculative: bool = False,
             redo: int = 0, earlier: Optional[Sent] = None,
             packed: Optional[Tuple[torch.Tensor, Tuple[int, ...]]] = None,
             on_copied: Optional[Callable[[], None]] = None, journal: bool = False,
             fingerprint: Optional[torch.Tensor] = None) -> bool:
        """Enqueues the chunk for the sender thread, which copies its gradients
        into a slot and sends GradReady; never blocks. A chunk without any
        gradient is not sent, unless it is a redo (which then undoes the step's
        update of it). `packed` (offload_params): the gradients as one flat
        tensor laid out as the chunk, and the segments without any, instead of
        the parameters' ``.grad``. `fingerprint`: of the gradients sent (the
        resident mode validates with it at step()). `on_copied` runs on the
        sender thread once the gradients are in the slot. `journal`: the daemon
        keeps the gradients for the step (JOURNAL_KEEP), for ``replay`` and
        ``journal_add``. Returns whether the chunk was enqueued."""
        missing = packed[1] if packed is not None else missing_grads(c)
        if len(missing) == len(c.segments) and not redo:
            return False  # no gradient at all: the chunk is not updated this step
        if len(c.segments) > MAX_CHUNK_SEGMENTS:
            missing_sent: Tuple[int, ...] = ()  # one segment: zeros stand in
        else:
            missing_sent = missing
        if packed is not None:
            parts, grads = [], []
            flat = packed[0]  # on the host: no device work to wait for
            for i, seg in enumerate(c.segments):
                piece = None if i in missing else flat[seg.offset:seg.offset + seg.numel]
                parts.append((seg.offset, seg.numel, piece))
        else:
            parts, grads, _ = grad_parts(c)
        hyper = self.hyper_now(c.group_index)
        job = self._job(c, parts, grad_scale, missing_sent, redo=redo, earlier=earlier,
                        journal=JOURNAL_KEEP if journal else 0, grad_ops=(),
                        marker=self.slots.device.marker(grads), speculative=speculative,
                        on_copied=on_copied)
        self.step.put(c.chunk_id, Sent(missing, fingerprint, missing_sent, hyper))
        if journal:
            self.stats.journaled_bytes += c.nbytes
        if speculative:
            self.stats.speculative_updates += 1
        self.slots.submit(job)
        return True

    def redo(self, c: Chunk, grad_scale: float, reason: int,
             packed: Optional[Tuple[torch.Tensor, Tuple[int, ...]]] = None) -> None:
        """Sends chunk `c` again in this step with its gradients as they are now
        (or `packed`, as ``send`` takes it): the daemon drops its update of the
        step and updates again from the committed states. Its earlier new
        weights (in flight or staged) are dropped."""
        self._drop_earlier(c.chunk_id)
        earlier = self.step.take(c.chunk_id)
        self.send(c, grad_scale, redo=reason, earlier=earlier, packed=packed)
        self._count_redo(reason)

    def replay(self, c: Chunk, grad_scale: float, grad_ops, reason: int,
               dropped: Tuple[int, ...] = ()) -> None:
        """Updates chunk `c` again in this step from the daemon's journal of its
        gradients (sent with ``journal=True``) after `grad_ops` (the loop's
        in-place mul_/div_ since), with `grad_scale` and the group's
        hyper-parameters now: nothing is copied. `dropped`: segments whose
        ``.grad`` the loop set to None since: left alone, as torch skips them."""
        cid = c.chunk_id
        self._drop_earlier(cid)
        earlier = self.step.take(cid)
        missing = tuple(sorted(set(earlier.missing) | set(dropped)))
        not_updated = tuple(sorted(set(earlier.not_updated) | set(dropped)))
        self.slots.submit(self._job(c, None, grad_scale, not_updated, redo=reason,
                                     earlier=earlier, journal=JOURNAL_REPLAY,
                                     grad_ops=grad_ops))
        self.step.put(cid, Sent(missing, None, not_updated, self.hyper_now(c.group_index),
                                journal_added=earlier.journal_added))
        self._count_redo(reason)
        self.stats.replayed += 1

    def journal_add(self, c: Chunk, grad_scale: float, grad_ops, earlier: Sent) -> None:
        """An undeclared backward pass completed chunk `c`, whose gradients the
        daemon journaled in this step (``earlier``: ``step.take``): its ``.grad``
        (zeros where a parameter has no new gradient) is added to the journal
        after `grad_ops`, and the chunk updated again from the sum."""
        cid = c.chunk_id
        self._drop_earlier(cid)
        parts, grads, now_missing = grad_parts(c)
        missing = tuple(i for i in earlier.missing if i in now_missing)
        not_updated = missing if len(c.segments) <= MAX_CHUNK_SEGMENTS else ()
        self.slots.submit(self._job(c, parts, grad_scale, not_updated,
                                     redo=REDO_GRADIENTS_CHANGED, earlier=earlier,
                                     journal=JOURNAL_ADD, grad_ops=grad_ops,
                                     marker=self.slots.device.marker(grads)))
        self.step.put(cid, Sent(missing, None, not_updated, self.hyper_now(c.group_index),
                                journal_added=True))
        self._count_redo(REDO_GRADIENTS_CHANGED)
        self.stats.replayed += 1
        self.stats.journaled_bytes += c.nbytes

    def journal_stats(self, c: Chunk) -> Tuple[List[float], List[float]]:
        """Per segment, the sum of squares and the largest magnitude of the
        chunk's journaled gradients after its last update (waits for it)."""
        self._flush()
        self.slots.collect(c.chunk_id)
        stats = self._link.session.journal_stats(c.chunk_id)
        if stats is None:
            raise FuyouError(f"fuyoud sent no journal statistics for chunk {c.chunk_id:#x}")
        return [float(x) for x in stats[0]], [float(x) for x in stats[1]]

    def wait_sent(self) -> None:
        """Waits until every chunk enqueued so far was sent to the daemon (or
        failed: the sender's error is raised). step() does this itself; tests and
        benchmarks that look at the daemon between backward and step() call it."""
        with self.lock:
            self._flush()

    def commit(self) -> None:
        """Installs every sent chunk's new weights into the parameters and commits
        the step (nothing to commit when nothing was sent, unless
        ``commit_empty_steps``). Learns the passes per step of an accumulating
        loop."""
        self._flush()
        self.slots.install_all()
        step = self.step
        if step.redo_started is not None:
            self.stats.redo_seconds += time.monotonic() - step.redo_started
            self.stats.steps_with_redo += 1
        self.passes.learn(step.accumulating)
        if step.in_step or self.commit_empty_steps:
            self._link.end_step()
            self.states.count_committed((cid, s.not_updated) for cid, s in step.sent.items())
            self.stats.steps += 1
        self._reset_step()

    def abort(self, reason: int = 0) -> None:
        """Abandons the step: waits for the chunks in flight, rolls back what the
        daemon updated (AbortStep with `reason`), installs nothing."""
        self._flush()
        self.slots.drain_all()
        if self.step.in_step:
            self._link.abort_step(reason=reason)
            if reason in (ABORT_SKIPPED_STEP, ABORT_OVERFLOW):
                self.stats.rolled_back_skipped += len(self.step.sent)
        self._reset_step()

    # ------------------------------------------------------------ internals
    def _reset_step(self) -> None:
        self.slots.reset()
        self.step = StepRecord(self.plan, lambda: self.slots.overflow_pending)
        self.reset_passes()

    def _job(self, c: Chunk, parts, grad_scale: float, missing_sent, *, redo: int, earlier,
             journal: int, grad_ops, marker=None, speculative: bool = False,
             on_copied=None) -> SendJob:
        hyper = self.hyper_now(c.group_index)
        if hyper.maximize:  # torch's maximize: Adam on -grad
            grad_scale = -grad_scale
        return SendJob(c, parts, marker, float(grad_scale), hyper, self._link.next_step,
                       tuple(missing_sent), speculative, redo, earlier, on_copied,
                       journal=journal, grad_ops=tuple(grad_ops))

    def _drop_earlier(self, cid: int) -> None:
        self.step.mark_redo()
        self.slots.drop_earlier(cid)

    def _count_redo(self, reason: int) -> None:
        if reason == REDO_CLIPPED:
            self.stats.redone_clipped += 1
        else:
            self.stats.redone_changed += 1

    def _flush(self) -> None:
        """Waits until the sender thread ran every queued job; raises its error.
        Chunks it found inf/nan in are taken out of the step (overflow)."""
        for job in self.slots.flush():
            self.step.mark_overflow()
            cid = job.chunk.chunk_id
            if job.earlier is not None:
                self.step.put(cid, job.earlier)
            else:
                self.step.discard(cid)
            if job.speculative:
                self.stats.speculative_updates -= 1
            if job.redo == REDO_CLIPPED:
                self.stats.redone_clipped -= 1
            elif job.redo:
                self.stats.redone_changed -= 1

