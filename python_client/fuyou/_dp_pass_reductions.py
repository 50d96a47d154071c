"""PassReductions: a streamed data-parallel rank's gradients averaged while
its backward pass runs, and written into ``.grad`` at the pass's end (issue
24: the overlap of the streamed mode, and ``.grad`` as DDP leaves it).

A backward pass is seen from its first hook to its end (a callback the mode
queues on autograd's engine from that hook). A pass *averages* when it is the
step's last as far as known: its number in the step is at least the passes the
last step made (the ``accumulation_steps`` hint before any step). In such a
pass:

- each chunk of the whole plan (``dp.all_chunks``, every rank's) whose every
  parameter accumulated this pass's gradient is all-reduced at once
  (``async_op``), in plan order: a chunk complete out of order waits for the
  ones before it, so every rank starts the same sequence of collectives
  (which ones start in a hook and which at the pass's end may differ). Each
  buffer carries one more element per segment: 1 where this rank has a
  gradient (a parameter some rank has takes zeros on the others, as DDP
  gives; one no rank has stays None, as torch leaves it);
- the hooks poll the reductions done so far, oldest first; the mode sends
  this rank's own chunks among them to its daemon at once (speculatively);
- at the pass's end the rest of the chunks start (a chunk with a parameter
  this pass did not reach), every reduction is waited for, and the averages
  (sum / world size) are written into ``.grad`` on every rank. So the loop's
  ``clip_grad_norm_``, GradScaler's unscale or ``p.grad.mul_`` after
  ``backward()`` see the global gradients, alike on every rank.

Averaging again at a later pass of the same step (a loop that accumulates
more passes than the last step made) stays exact: after the first average
``.grad`` is avg(g1) + g2_r on rank r, and its mean over the ranks is
avg(g1) + avg(g2). An earlier pass (``passes < expected``) reduces nothing:
its gradients stay this rank's until the last pass averages their sum.

The ranks must make the same number of backward passes a step (as DDP
requires); a step none of whose passes averaged (fewer than expected) is
averaged at step() instead (``DataParallel.average_gradients``). Every
reduction is done before ``backward()`` returns, so the optimizer's own
process group carries them: a collective of the loop after backward never
meets one in flight. Every method runs with the optimizer's lock held.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from ._chunk_grads import ChunkAverage
from ._chunk_plan import ChunkPlan
from ._chunking import Chunk
from ._placeholders import assign_grad

__all__ = ["PassReductions", "PassReductionCounts"]


@dataclass
class PassReductionCounts:
    """What the reductions did since the optimizer was made (tests read them)."""

    started_in_hooks: int = 0  # chunk all-reduces a backward hook started
    started_at_pass_end: int = 0  # ... the end of a pass started (a chunk it did not complete)
    averaged_at_step: int = 0  # steps whose gradients step() averaged (no pass did)
    sent_in_hooks: int = 0  # own chunks sent to the daemon from a backward hook
    sent_at_pass_end: int = 0  # ... at the end of a pass (inside backward())
    passes: int = 0  # backward passes seen
    passes_averaged: int = 0  # of which their end wrote the averages into .grad


class PassReductions:
    """The reductions of one streamed rank (see the module doc). Made once every
    chunk of the plan is known (the model registered on every rank)."""

    def __init__(self, dp, pipeline):
        self.dp = dp
        self.pipeline = pipeline
        self.chunks: List[Chunk] = list(dp.all_chunks)
        self.plan = ChunkPlan(self.chunks, len(pipeline.params))
        self.counts = PassReductionCounts()
        self._expected = max(1, int(pipeline.passes.accumulation_steps))
        self.passes = 0  # passes seen this step
        self.averaged = False  # some pass of this step wrote the averages
        self.averaging = False  # the open pass averages
        self._reset_pass()

    def _reset_pass(self) -> None:
        self._reached: Dict[int, int] = collections.defaultdict(int)  # chunk -> members done
        self._ready: set = set()  # complete in this pass, not started
        self._cursor = 0  # chunks before it started in this pass
        self._by_id: Dict[int, ChunkAverage] = {}
        self._unfinished: collections.deque = collections.deque()  # chunk ids, start order

    def owns(self, c: Chunk) -> bool:
        return self.dp.owner_of[c.chunk_id] == self.dp.rank

    # ------------------------------------------------------------ a pass
    def pass_started(self) -> None:
        """The first hook of a backward pass: whether it averages is decided."""
        self._reset_pass()
        self.passes += 1
        self.counts.passes += 1
        self.averaging = self.passes >= self._expected

    def accumulated(self, index: int) -> List[Chunk]:
        """Parameter `index` accumulated this pass's gradient: starts the chunks
        now complete in plan order; returns this rank's chunks whose average
        arrived since (for the daemon). Nothing in a pass that does not average."""
        if not self.averaging:
            return []
        for c in self.plan.of_param(index):
            self._reached[c.chunk_id] += 1
            if self._reached[c.chunk_id] == len(self.plan.params_of(c.chunk_id)):
                self._ready.add(c.chunk_id)
        while self._cursor < len(self.chunks) and self.chunks[self._cursor].chunk_id in self._ready:
            self._start(self.chunks[self._cursor], in_hook=True)
        return self._finished_own()

    def pass_ended(self) -> List[Chunk]:
        """The pass's end (inside ``backward()``): the rest of the chunks start,
        every reduction is waited for and the averages go into ``.grad``.
        Returns this rank's chunks finished since the hooks last looked."""
        if not self.averaging:
            return []
        self.averaging = False
        while self._cursor < len(self.chunks):
            self._start(self.chunks[self._cursor], in_hook=False)
        arrived = self._finished_own(wait=True)
        for c in self.chunks:
            self._write(c, self._by_id[c.chunk_id])
        self.averaged = True
        self.counts.passes_averaged += 1
        return arrived

    def averaged_chunk(self, c: Chunk) -> Tuple[torch.Tensor, Tuple[int, ...]]:
        """Chunk `c`'s average laid out as the chunk and its segments no rank
        has a gradient for (``ChunkPipeline.send``'s ``packed``); once
        ``accumulated`` or ``pass_ended`` returned it, until the next pass."""
        r = self._by_id[c.chunk_id]
        return r.flat, r.missing

    def step_ended(self) -> None:
        """The step is over (committed, skipped, abandoned): the passes it made
        are what the next step's last pass is expected to be (alike on every
        rank: they make the same passes)."""
        if self.passes > 0:
            self._expected = self.passes
        self.passes = 0
        self.averaged = False
        self.averaging = False
        self._reset_pass()

    # ------------------------------------------------------------ internals
    def _start(self, c: Chunk, in_hook: bool) -> None:
        """Starts chunk `c`'s all-reduce (the next of the pass)."""
        self._by_id[c.chunk_id] = ChunkAverage(c, self.dp, self.dp.group)
        self._unfinished.append(c.chunk_id)
        self._cursor += 1
        self._ready.discard(c.chunk_id)
        if in_hook:
            self.counts.started_in_hooks += 1
        else:
            self.counts.started_at_pass_end += 1

    def _finished_own(self, wait: bool = False) -> List[Chunk]:
        """Finishes the reductions done so far, oldest first (all of them when
        `wait`): each buffer becomes the average; this rank's chunks among them."""
        out = []
        while self._unfinished:
            cid = self._unfinished[0]
            c = self.plan.chunk(cid)
            if not self._by_id[cid].finish(c, self.dp.world_size, wait):
                break
            self._unfinished.popleft()
            if self.owns(c):
                out.append(c)
        return out

    def _write(self, c: Chunk, r: ChunkAverage) -> None:
        """Chunk `c`'s average into ``.grad`` (a parameter without a gradient
        here that another rank has gets one)."""
        params, shapes = self.pipeline.params, self.pipeline.param_shapes
        for i, seg in enumerate(c.segments):
            if i in r.missing:
                continue
            p = params[seg.param_index]
            shape = shapes[seg.param_index]
            if p.grad is None:
                assign_grad(p, shape, torch.zeros(shape, dtype=p.dtype, device=p.device))
            elif not p.grad.is_contiguous():
                assign_grad(p, shape, p.grad.contiguous())
            avg = r.flat[seg.offset:seg.offset + seg.numel]
            p.grad.detach().view(-1)[seg.start:seg.end].copy_(avg.to(p.grad.device))
