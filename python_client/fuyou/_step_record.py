"""StepRecord: what one step has sent so far, and what it learned on the way.

``sent`` maps chunk id -> ``Sent`` in send order: the chunks whose GradReady
went (or is queued) in this step. The record also holds the step's flags:
``overflow`` (a chunk's gradients held inf/nan, or the loop found a
non-finite norm: the step cannot commit), ``accumulating`` (one more backward
pass reached a chunk already sent: the pipeline learns the passes per step at
commit) and when the first redo of the step started (its time is counted at
commit). A new record starts every step (``ChunkPipeline`` replaces it)."""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Mapping, Optional

from ._chunk_plan import ChunkPlan
from ._chunking import Chunk
from ._slots import Sent

__all__ = ["StepRecord"]


class StepRecord:
    """One step's chunks sent. `overflow_pending`: whether the sender thread has
    refused a chunk as inf/nan that the pipeline has not collected yet."""

    def __init__(self, plan: ChunkPlan, overflow_pending: Callable[[], bool]):
        self._plan = plan
        self._overflow_pending = overflow_pending
        self._sent: Dict[int, Sent] = {}
        self._reached: set = set()
        self._overflow = False
        self.accumulating = False
        self.redo_started: Optional[float] = None

    @property
    def sent(self) -> Mapping[int, Sent]:
        """chunk id -> its record, in send order (read only)."""
        return self._sent

    @property
    def in_step(self) -> bool:
        """True while the step has chunks sent and not yet committed or abandoned."""
        return bool(self._sent)

    def sent_chunks(self) -> List[Chunk]:
        """The chunks sent in this step, in send order."""
        return [self._plan.chunk(cid) for cid in self._sent]

    def put(self, chunk_id: int, sent: Sent) -> None:
        """Records chunk `chunk_id` as sent (again, after a redo: at the end)."""
        self._sent[chunk_id] = sent

    def take(self, chunk_id: int) -> Sent:
        """Takes the chunk out of the step's sent chunks (it is sent again next)."""
        return self._sent.pop(chunk_id)

    def discard(self, chunk_id: int) -> None:
        """Forgets the chunk, sent or not (the sender refused it as inf/nan)."""
        self._sent.pop(chunk_id, None)

    def first_reached_sent(self, index: int) -> List[Chunk]:
        """Chunks of parameter `index` sent in this step that a pass reaches
        again, each reported once per step."""
        reached = [c for c in self._plan.of_param(index)
                   if c.chunk_id in self._sent and c.chunk_id not in self._reached]
        self._reached.update(c.chunk_id for c in reached)
        return reached

    @property
    def overflow(self) -> bool:
        """True when a chunk's gradients held inf or nan (with check_finite), as
        far as the sender thread has seen (exact after any step-time method of
        the pipeline), or after ``mark_overflow``."""
        return self._overflow or self._overflow_pending()

    def mark_overflow(self) -> None:
        """The step cannot be committed (a non-finite gradient norm, say)."""
        self._overflow = True

    def mark_accumulating(self) -> None:
        """The loop made one more backward pass into a chunk sent in this step."""
        self.accumulating = True

    def mark_redo(self) -> None:
        """A chunk is sent again in this step; the first call starts the clock."""
        if self.redo_started is None:
            self.redo_started = time.monotonic()
