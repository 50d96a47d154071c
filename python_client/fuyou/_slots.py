"""ChunksInFlight: one step's traffic through the session's shared-memory slots.

It owns the sender thread (_sender.py), the chunks whose GradReady went out and
whose new weights have not been collected (``inflight``: chunk id -> chunk, in
send order), the per-chunk staging copies of new weights collected early
(_staged_weights.py), and the session's slots with their tensor views
(_slot_regions.py). The pipeline submits ``SendJob``s; the sender
thread takes them in order: frees a slot when all are busy (the oldest chunk's
new weights to staging), acquires one, copies the gradients in (on a copy
stream after the job's marker, on a GPU), checks them for inf/nan
(``check_finite``), sends GradReady.

While jobs are queued the sender thread alone touches ``inflight`` and the
staging copies; every other method is called after ``flush`` (which waits for
the queue and returns the jobs refused as inf/nan) with the optimizer's lock
held."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ._chunk_weights import install
from ._chunking import Chunk
from ._protocol import JOURNAL_REPLAY, Hyper
from ._sender import Sender
from ._slot_regions import SlotRegions
from ._staged_weights import StagedWeights

__all__ = ["ChunksInFlight", "SendJob", "Sent"]


@dataclass
class Sent:
    """A chunk sent in the current step."""

    missing: Tuple[int, ...]  # segments without a gradient
    fingerprint: Optional[torch.Tensor]  # fp32 [sum, sum of squares], None: not speculative
    not_updated: Tuple[int, ...]  # segments the daemon leaves alone (segments_without_grad)
    hyper: Optional[Hyper] = None  # the group's hyper-parameters it was sent with
    journal_added: bool = False  # the daemon's journal holds an accumulating pass's sum


@dataclass
class SendJob:
    """A chunk to send, as the hook or step() saw it."""

    chunk: Chunk
    parts: Optional[list]  # _device.Part per segment; None once copied
    marker: object
    grad_scale: float  # negative for a maximize group
    hyper: Hyper  # its group's (maximize is in grad_scale already)
    step: int
    missing_sent: Tuple[int, ...]
    speculative: bool
    redo: int
    earlier: Optional[Sent]
    on_copied: Optional[Callable[[], None]] = None  # on the sender thread, after the copy
    journal: int = 0  # fuyou.v1.JournalUse; REPLAY: parts is None from the start
    grad_ops: Tuple[Tuple[int, float], ...] = ()  # fuyou.v1.GradOp (kind, operand)


class ChunksInFlight:
    """The slots of one session (``attach``) for one pipeline.

    Args:
        device: the copy machinery (_device.py); replaceable as ``device``.
        timeout: seconds any wait on the daemon may take.
        check_finite: refuse to send gradients holding inf or nan.
        install_weights: new weights go into the parameters (False with
            offload_params: the daemon keeps them, slots are just released).
    """

    def __init__(self, device, timeout: float, check_finite: bool, install_weights: bool):
        self.device = device
        self.sender: Optional[Sender] = None
        self._timeout = float(timeout)
        self._check_finite = check_finite
        self._install_weights = install_weights
        self._regions = SlotRegions()
        self._staged = StagedWeights()
        self._overflowed: List[SendJob] = []
        self.reset()

    @property
    def session(self):
        """The attached session; None once stopped."""
        return self._regions.session

    def attach(self, session, num_slots: int, name: str) -> None:
        self._regions.attach(session, num_slots)
        self.sender = Sender(name)

    def reset(self) -> None:
        """A new step: nothing in flight, nothing staged."""
        self.inflight: "collections.OrderedDict[int, Chunk]" = collections.OrderedDict()
        self._staged.reset()

    @property
    def overflow_pending(self) -> bool:
        """The sender refused a chunk as inf/nan since the last ``flush``."""
        return bool(self._overflowed)

    def submit(self, job: SendJob) -> None:
        """Queues `job` for the sender thread; never blocks."""
        self.sender.submit(lambda: self._send_now(job))

    def drop_earlier(self, cid: int) -> None:
        """Before a chunk is sent again in the step: its earlier new weights (in
        flight or staged) are dropped, on the sender thread in order with the sends."""
        session = self.session

        def drop() -> None:
            if cid in self.inflight:
                del self.inflight[cid]
                session.release_slot(self._wait(cid, session))
            self._staged.discard(cid)

        self.sender.submit(drop)

    def flush(self) -> List[SendJob]:
        """Waits until the sender thread ran every queued job (raises its error);
        returns the jobs it refused as inf/nan since the last flush."""
        if self.sender is None:
            return []
        self.sender.flush()
        overflowed, self._overflowed = self._overflowed, []
        return overflowed

    def collect(self, cid: int) -> None:
        """Waits for chunk `cid`'s update, if in flight, and frees its slot."""
        if cid in self.inflight:
            del self.inflight[cid]
            self.session.release_slot(self._wait(cid))

    def drain_all(self) -> None:
        """Waits for every chunk in flight and frees the slots (nothing installed)."""
        while self.inflight:
            cid, _ = self.inflight.popitem(last=False)
            self.session.release_slot(self._wait(cid))

    def install_all(self) -> None:
        """At commit: the staged chunks' and then the in-flight chunks' new
        weights into their parameters (in-flight ones only with install_weights);
        every slot is released."""
        session = self.session
        self._staged.install_all()
        slots = []
        try:
            while self.inflight:
                cid, c = self.inflight.popitem(last=False)
                slot = self._wait(cid)
                slots.append(slot)
                if self._install_weights:
                    install(c, self.view(slot, "param", c.dtype)[:c.num_elements],
                            non_blocking=True)
        finally:
            self.device.installed()  # the copies out of the slots are done
            for slot in slots:
                session.release_slot(slot)

    def view(self, slot: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The slot's "grad" or "param" region as a flat tensor of `dtype`."""
        return self._regions.view(slot, kind, dtype)

    def pin(self) -> None:
        """On CUDA: registers the session's slots with CUDA (DMA copies)."""
        self._regions.pin(self.device)

    def stop(self) -> None:
        """Stops the sender thread and unpins the slots (before the session's
        mapping goes away); the session is forgotten first, so a job still
        queued does nothing."""
        self._regions.session = None
        if self.sender is not None:
            self.sender.stop()
        self.device.unpin()
        self._regions.drop_views()

    # ------------------------------------------------------------ sender thread
    def _send_now(self, job: SendJob) -> None:
        """On the sender thread: slot, copy, inf/nan check, GradReady."""
        session, c = self.session, job.chunk
        if session is None:
            return
        if len(self.inflight) >= self._regions.num_slots:
            self._drain_oldest(session)
        slot = session.acquire_slot(self._timeout)
        try:
            if job.journal != JOURNAL_REPLAY:  # a replay's gradients are in the daemon
                dst = self.view(slot, "grad", c.dtype)[:c.num_elements]
                self.device.copy_grads(dst, job.parts, job.marker)
                job.parts = job.marker = None  # the gradients may go now
                if job.on_copied is not None:
                    job.on_copied()
                if self._check_finite and not bool(torch.isfinite(dst).all()):
                    session.release_slot(slot)
                    self._overflowed.append(job)
                    return
            journal = ({"journal": job.journal, "grad_ops": [list(op) for op in job.grad_ops]}
                       if job.journal else {})
            session.send_grad_ready(c.chunk_id, slot, job.step, job.hyper, job.grad_scale,
                                    segments_without_grad=list(job.missing_sent),
                                    speculative=job.speculative, redo=job.redo, **journal)
        except BaseException:
            try:
                session.release_slot(slot)
            except Exception:
                pass
            raise
        self.inflight[c.chunk_id] = c

    def _drain_oldest(self, session) -> None:
        """Frees a slot during backward: the oldest chunk's new weights go to its
        staging copy (the parameters may still be needed by backward)."""
        cid, c = self.inflight.popitem(last=False)
        slot = self._wait(cid, session)
        if not self._install_weights:  # offload_params: the daemon keeps the weights
            session.release_slot(slot)
            return
        self._staged.stage(c, self.view(slot, "param", c.dtype)[:c.num_elements], self.device)
        session.release_slot(slot)

    def _wait(self, chunk_id: int, session=None) -> int:
        return (session or self.session).wait_params(chunk_id, self._timeout)
