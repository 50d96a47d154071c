"""ChunkReductions: each chunk's gradients reduced to the rank that owns it
while backward goes on (issue 24: the overlap of a data-parallel step).

A data-parallel rank owns whole chunks (_data_parallel.py). Its backward hooks
(``ShardedResidentMode.grad_accumulated``) count the passes of every chunk of
the whole plan; once a chunk is complete for the step's last pass
(``passes_per_step``, the resident mode's accumulation rule) its reduction
starts at once, ``torch.distributed.reduce(..., dst=owner, async_op=True)``,
so chunk *i* travels while backward computes chunk *i+1*; at the next hooks the
owner finds it done and sends the averaged gradients to its daemon
(speculatively, as the resident mode sends its chunks).

Why ``reduce`` to the owner, not ``all_reduce``: only the owner updates a chunk
(the others get its new weights by broadcast after the commit), and a reduce
moves about half the bytes of an all-reduce (which is a reduce-scatter and an
all-gather). gloo has no reduce_scatter in torch 1.13; with whole-chunk shards
a reduce to each chunk's owner is what a reduce-scatter would do.

Rules that keep every rank's collectives in the same order:

- *One round a step.* Every chunk is reduced once a round, in plan order: a
  chunk complete out of order waits for the ones before it (``_cursor``).
  Which of them start in backward and which at step() may differ between the
  ranks (a rank with overlap off starts them all at step()); the sequence does
  not. Each reduction carries one more element per segment: 1 where this rank
  has a gradient, so the owner knows which parameters no rank has (not updated,
  as torch leaves a parameter without a gradient) and which some lack (zeros,
  as DDP does). The sum is divided by the world size, as DDP averages.
- *Agreed at step()* (``settle``): the rest of the round starts; a fingerprint
  of the gradients each rank sent (the resident mode's, _fingerprints.py) is
  compared with ``.grad`` now, and the chunks changed on any rank (one
  all-reduce of flags: one more backward pass, an in-place edit) are reduced
  again. When they changed and ``.grad`` is now the same on every rank (a
  model wrapped in DDP: DDP's own all-reduce wrote the average into ``.grad``
  at the end of backward), the round is dropped and ``ddp_averages`` set: the
  next steps start no reductions at all (DDP's all-reduce is kept, not
  replaced), until a step finds the gradients not averaged.
- *A round begun is finished*: zero_grad() after a backward without step()
  (a skipped step) starts the rest of the round and drops it.
- *A group of their own.* The reductions and the agreements of step() run on
  a process group made for them (``dist.new_group`` over the default group's
  ranks, when the optimizer's group is the default one), so a collective of
  the loop's own (a loss all-reduced for logging between backward and step())
  never pairs with a reduction that one rank started in backward and another
  only at step(). A group passed as ``process_group=`` is used as it is (a
  new group must be made by every rank of the default group alike): the loop
  then must not use it between backward and step().

``skip_ddp_allreduce(ddp_model)`` replaces DDP's all-reduce instead: a comm
hook that reduces nothing leaves each rank's own gradients in ``.grad``, and
fuyou's reductions (with the owners' daemon updates during backward) average
them. For a DDP model whose every trainable parameter a fuyou.AdamW of the
same group trains.

``finish_reduced_step`` is step() on the averaged gradients: an inf/nan in any
reduced chunk (loss scaling) or a non-finite norm skips the step on every rank
(one all-reduce of [sum of squares, overflow]); ``max_grad_norm`` clips by the
norm of the averaged gradients; a chunk sent during backward is redone when it
was reduced again, its group's hyper-parameters changed, or the norm clipped.
``.grad`` is never written: it keeps this rank's own gradients (DDP's average
under DDP).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _native
from ._chunk_plan import ChunkPlan
from ._chunking import Chunk
from ._fingerprints import fingerprint, missing_grads
from ._mode import clip_coefficient
from ._passes import PassCounter
from ._protocol import ABORT_OVERFLOW, REDO_CLIPPED, REDO_GRADIENTS_CHANGED

__all__ = ["ChunkReductions", "ReductionCounts", "finish_reduced_step", "skip_ddp_allreduce"]


@dataclass
class ReductionCounts:
    """What the reductions did since the optimizer was made (tests read them)."""

    started_in_backward: int = 0  # chunk reductions a backward hook started
    started_at_step: int = 0  # ... that step() or zero_grad() started (the rest of a round)
    reduced_again: int = 0  # chunks reduced again at step(): changed on some rank
    sent_in_backward: int = 0  # own chunks sent to the daemon before step()
    rounds: int = 0  # rounds finished (steps, skipped steps)
    rounds_dropped_for_ddp: int = 0  # rounds whose gradients DDP had averaged already


class _Reduction:
    """One chunk's reduction this round: its buffer (this rank's gradients as
    the chunk lays them out, then one presence flag per segment; on the owner,
    after the reduce, their average and the ranks that had each), the work,
    and what was sent (fingerprint, segments without gradient)."""

    __slots__ = ("flat", "work", "fingerprint", "local_missing", "missing", "finished")

    def __init__(self, flat, work, fp, local_missing):
        self.flat = flat
        self.work = work
        self.fingerprint = fp  # of this rank's .grad when started
        self.local_missing = local_missing  # this rank's segments without a gradient
        self.missing = local_missing  # on the owner, once finished: no rank's
        self.finished = False  # the owner's average is in `flat` (or a non-owner let go)


class ChunkReductions:
    """The reductions of one rank's optimizer (see the module doc). Every method
    runs with the optimizer's lock held; ``settle``, ``finish_round`` and
    ``wait_all`` are collectives of the data-parallel group."""

    def __init__(self, dp, pipeline):
        self.dp = dp
        self.pipeline = pipeline
        self.chunks: List[Chunk] = list(dp.all_chunks)
        self.plan = ChunkPlan(self.chunks, len(pipeline.params))
        self._position = {c.chunk_id: i for i, c in enumerate(self.chunks)}
        self.passes = PassCounter(1)
        self.counts = ReductionCounts()
        self.ddp_averages = False  # learned: the loop's gradients arrive averaged (DDP)
        self.gate = None  # a DurableGate (_dp_durable.py): passed before any reduction starts
        self._own_group = dp.group is None or dp.group is dist.group.WORLD
        # every rank of the default group makes it, in the same order (optimizers alike)
        # with the default group's timeout (new_group's own default is 30 min: a
        # reduction with a rank gone would wait that long)
        self.group = (dist.new_group(backend=dp.backend, timeout=_timeout_of(dp.group))
                      if self._own_group else dp.group)
        self._reset()

    def close(self) -> None:
        """Lets the group made for the reductions go (not a collective)."""
        group, self.group = self.group, None
        if self._own_group and group is not None:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group(group)
            except Exception:  # the default group went first (interpreter exit)
                pass

    # ------------------------------------------------------------ round state
    def _reset(self) -> None:
        self.passes.reset(self.chunks, len(self.pipeline.params))
        self._cursor = 0  # chunks before it were started this round
        self._ready: set = set()  # complete for the step's last pass, not started
        self._reached: set = set()  # started chunks a later pass reached
        self._by_id: Dict[int, _Reduction] = {}
        self._unfinished: collections.deque = collections.deque()  # chunk ids, in start order
        self._again: set = set()  # chunk ids reduced a second time this round
        self._counted_pass = False

    @property
    def round_open(self) -> bool:
        """A backward pass was counted, or a reduction started, since the round began."""
        return self._counted_pass or self._cursor > 0

    def owns(self, c: Chunk) -> bool:
        return self.dp.owner_of[c.chunk_id] == self.dp.rank

    # ------------------------------------------------------------ hooks
    def arriving(self, index: int) -> bool:
        """Before parameter `index` accumulates: whether this pass reaches a
        chunk already started this round (the loop accumulates more passes than
        expected; settle() reduces it again)."""
        again = [c for c in self.plan.of_param(index)
                 if c.chunk_id in self._by_id and c.chunk_id not in self._reached]
        self._reached.update(c.chunk_id for c in again)
        return bool(again)

    def accumulated(self, index: int, may_start: bool) -> List[Chunk]:
        """After parameter `index` accumulated: counts the pass, starts the
        chunks now complete in plan order (`may_start`: overlap on, not under
        DDP), and returns this rank's chunks whose reduction finished (their
        average is ready for the daemon, not sent yet)."""
        self._counted_pass = True
        per_step = self.pipeline.passes.passes_per_step
        for c in self.passes.count(index, self.plan.of_param(index), self.plan.params_of,
                                   self._started):
            if self.passes.rounds[c.chunk_id] >= per_step:
                self._ready.add(c.chunk_id)
        if may_start:
            while self._cursor < len(self.chunks) and \
                    self.chunks[self._cursor].chunk_id in self._ready:
                self._start(self.chunks[self._cursor], in_backward=True)
        return self._finished_own()

    def _started(self, chunk_id: int) -> bool:
        return self._position[chunk_id] < self._cursor

    # ------------------------------------------------------------ starting
    def _start(self, c: Chunk, in_backward: bool) -> None:
        """Starts chunk `c`'s reduce to its owner (the next of the round, or a
        second one of a changed chunk at step()). First, after a commit, the
        durable gate's agreement starts (a no-op but after a commit; finished
        before the step's first send)."""
        if self.gate is not None:
            self.gate.start(self.group)  # finished before the first send
        dp = self.dp
        fp = fingerprint(c)  # before the copy: a DDP bucket view may still change
        missing = missing_grads(c)
        dev = dp._device(c.segments[0].param)
        dtype = c.dtype if dev.type == "cuda" else torch.float32  # gloo: sums in fp32
        n, k = c.num_elements, len(c.segments)
        flat = torch.empty(n + k, dtype=dtype, device=dev)
        for i, seg in enumerate(c.segments):
            piece = flat[seg.offset:seg.offset + seg.numel]
            g = seg.param.grad
            if g is None:
                piece.zero_()
            else:
                piece.copy_(g.detach().reshape(-1)[seg.start:seg.end])
        flat[n:] = torch.tensor([0.0 if i in missing else 1.0 for i in range(k)], dtype=dtype)
        work = dist.reduce(flat, dst=dp._src(dp.owner_of[c.chunk_id]), op=dist.ReduceOp.SUM,
                           group=self.group, async_op=True)
        again = c.chunk_id in self._by_id
        self._by_id[c.chunk_id] = _Reduction(flat, work, fp, missing)
        self._unfinished.append(c.chunk_id)
        if again:
            self._again.add(c.chunk_id)
            self.counts.reduced_again += 1
        else:
            self._cursor += 1
            self._ready.discard(c.chunk_id)
            if in_backward:
                self.counts.started_in_backward += 1
            else:
                self.counts.started_at_step += 1

    def start_rest(self) -> None:
        """Starts every chunk of the round not started yet, in plan order."""
        while self._cursor < len(self.chunks):
            self._start(self.chunks[self._cursor], in_backward=False)

    # ------------------------------------------------------------ finishing
    def _finish(self, c: Chunk, r: _Reduction, wait: bool) -> bool:
        """Whether `c`'s reduction is done (waits when `wait`); the owner's sum
        becomes the average, a non-owner lets its buffer go."""
        if r.finished:
            return True
        if not wait and not r.work.is_completed():
            return False
        r.work.wait()  # raises a failed collective's error
        r.finished = True
        if not self.owns(c):
            r.flat = None
            return True
        n = c.num_elements
        present = r.flat[n:].tolist()
        r.missing = tuple(i for i, v in enumerate(present) if v <= 0)
        r.flat = r.flat[:n].div_(self.dp.world_size)
        return True

    def _finished_own(self) -> List[Chunk]:
        """Finishes the reductions done so far, oldest first (a non-owner's
        buffer goes at once); this rank's chunks among them."""
        out = []
        while self._unfinished:
            cid = self._unfinished[0]
            c = self.plan.chunk(cid)
            if not self._finish(c, self._by_id[cid], wait=False):
                break
            self._unfinished.popleft()
            if self.owns(c):
                out.append(c)
        return out

    def wait_all(self) -> None:
        """Waits for every reduction started this round (in the order started)."""
        while self._unfinished:
            cid = self._unfinished.popleft()
            self._finish(self.plan.chunk(cid), self._by_id[cid], wait=True)

    def averaged(self, c: Chunk) -> Tuple[torch.Tensor, Tuple[int, ...]]:
        """This rank's chunk `c` averaged over the ranks, laid out as the chunk,
        and the segments no rank has a gradient for: ``ChunkPipeline.send``'s
        ``packed``. After ``wait_all``, or once ``accumulated`` returned it."""
        r = self._by_id[c.chunk_id]
        return r.flat, r.missing

    def count_sent_in_backward(self) -> None:
        self.counts.sent_in_backward += 1

    def reduced_again(self, c: Chunk) -> bool:
        return c.chunk_id in self._again

    # ------------------------------------------------------------ step()
    def settle(self) -> bool:
        """At step(), a collective: starts the rest of the round, then reduces
        again the chunks whose gradients changed on any rank since they were
        sent. Returns True (the round dropped, ``ddp_averages`` set) when they
        changed and are now the same on every rank: DDP averaged them."""
        self.start_rest()
        flags = [0] * len(self.chunks)
        for i, c in enumerate(self.chunks):
            r = self._by_id[c.chunk_id]
            if missing_grads(c) != r.local_missing or \
                    not _same_fingerprint(fingerprint(c), r.fingerprint):
                flags[i] = 1
        agreed = self._all_reduce(torch.tensor(flags, dtype=torch.int32), dist.ReduceOp.MAX)
        changed = [c for c, f in zip(self.chunks, agreed.tolist()) if f]
        if not changed:
            return False
        if self._same_on_every_rank():
            self.wait_all()
            self.ddp_averages = True
            self.counts.rounds_dropped_for_ddp += 1
            return True
        self.wait_all()  # before a chunk's buffer is replaced
        for c in changed:
            self._start(c, in_backward=False)
        return False

    def finish_round(self) -> None:
        """Ends the round (after the step's commit or abort); a round begun in a
        step the loop skipped (zero_grad after backward) is finished first, so
        every rank's next round starts at the same collective."""
        if self.round_open:
            self.start_rest()
            self.wait_all()
            self.counts.rounds += 1
        self._reset()

    def _same_on_every_rank(self) -> bool:
        """Whether ``.grad`` is the same on every rank now: per chunk the sum,
        the sum of squares and a position-weighted sum (fp64), their minimum
        and maximum over the ranks equal; segments without a gradient count."""
        stats = []
        for c in self.chunks:
            s = torch.zeros(4, dtype=torch.float64)
            for i, seg in enumerate(c.segments):
                g = seg.param.grad
                if g is None:
                    s[3] += 2.0 ** i if i < 50 else 1.0
                    continue
                piece = g.detach().reshape(-1)[seg.start:seg.end].double().cpu()
                weights = torch.arange(seg.offset, seg.offset + seg.numel,
                                       dtype=torch.float64) % 251 + 1
                s[0] += piece.sum()
                s[1] += piece.square().sum()
                s[2] += torch.dot(piece, weights)
            stats.append(s)
        mine = torch.cat(stats) if stats else torch.zeros(1, dtype=torch.float64)
        lowest = self._all_reduce(mine.clone(), dist.ReduceOp.MIN)
        highest = self._all_reduce(mine.clone(), dist.ReduceOp.MAX)
        return torch.equal(lowest, highest)  # a nan anywhere: not the same

    def _all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        dev = self.dp._device(self.pipeline.params[0])
        t = t.to(dev)
        dist.all_reduce(t, op=op, group=self.group)
        return t.cpu()

    # ------------------------------------------------------------ the own chunks
    def own_squares(self, chunks: List[Chunk]) -> float:
        """The sum of squares of this rank's averaged chunks (fp64)."""
        total = 0.0
        for c in chunks:
            flat = self._by_id[c.chunk_id].flat
            if flat.device.type == "cpu" and flat.dtype == torch.float32:
                total += _native.module().sum_and_squares([(flat.data_ptr(), flat.numel())])[1]
            else:
                total += float(flat.double().square().sum())
        return total

    def own_finite(self, chunks: List[Chunk]) -> bool:
        flags = [torch.isfinite(self._by_id[c.chunk_id].flat).all() for c in chunks]
        return not flags or bool(torch.stack(flags).all())

    def agree(self, squares: float, overflow: bool) -> Tuple[float, bool]:
        """(the ranks' sums of squares summed, whether any rank overflowed): one
        all-reduce."""
        t = self._all_reduce(torch.tensor([squares, 1.0 if overflow else 0.0],
                                          dtype=torch.float64), dist.ReduceOp.SUM)
        return float(t[0]), bool(t[1] > 0)


def _same_fingerprint(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    x, y = a.tolist(), b.tolist()
    return all(p == q or (p != p and q != q) for p, q in zip(x, y))


def finish_reduced_step(pipeline, reductions: ChunkReductions, scaler,
                        max_grad_norm: Optional[float], before_commit) -> bool:
    """step() of a rank whose chunks fuyou reduced (after ``settle``): see the
    module doc. Every rank commits or skips alike: ``before_commit(True)`` once
    the own chunks' updates are answered (the ranks' agreement, which raises
    when another rank is not ready), ``before_commit(False)`` when they
    failed here. Returns whether committed."""
    own = pipeline.plan.chunks
    if reductions.gate is not None:
        reductions.gate.finish()  # every rank's last step durable before a send
    reductions.wait_all()
    pipeline.wait_sent()  # the sends of backward, and the sender's inf/nan check
    clipping = max_grad_norm is not None
    squares = reductions.own_squares(own) if clipping else 0.0
    overflow = pipeline.step.overflow or (scaler.enabled and not reductions.own_finite(own))
    total, overflow = reductions.agree(squares, overflow)
    coef = 1.0
    if not overflow and clipping:
        coef = clip_coefficient([total], max_grad_norm, scaler)
        overflow = not math.isfinite(coef)
    if overflow:
        pipeline.abort(ABORT_OVERFLOW)
        scaler.update(overflow=True)
        return False
    grad_scale = coef / scaler.scale
    try:
        for c in own:
            packed = reductions.averaged(c)
            sent = pipeline.step.sent.get(c.chunk_id)
            if sent is None:
                pipeline.send(c, grad_scale, packed=packed)
            elif reductions.reduced_again(c) or sent.hyper != pipeline.hyper_now(c.group_index):
                pipeline.redo(c, grad_scale, REDO_GRADIENTS_CHANGED, packed=packed)
            elif coef < 1.0:
                pipeline.redo(c, grad_scale, REDO_CLIPPED, packed=packed)
        pipeline.wait_sent()
    except BaseException:
        before_commit(False)
        raise
    before_commit(True)
    pipeline.commit()
    scaler.update(overflow=False)
    return True


def _timeout_of(group):
    """The timeout `group` (None: the default group) was made with."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg.options._timeout
    except AttributeError:  # a backend without options
        return dist.distributed_c10d.default_pg_timeout


def _reduce_nothing(state, bucket):
    """A DDP comm hook: the bucket as it is (this rank's gradients, undivided)."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def skip_ddp_allreduce(model) -> None:
    """Makes DistributedDataParallel `model` all-reduce nothing: each rank's
    ``.grad`` keeps its own gradients, and ``fuyou.AdamW`` (of the same group,
    over all of the model's trainable parameters) reduces each chunk to its
    owner during backward, the owners' daemon updates overlapping the rest of
    backward (with DDP's own all-reduce they wait for step()). Call it once,
    before the first backward. Only for a model that fuyou.AdamW trains: any
    other optimizer would step on each rank's own gradients."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"skip_ddp_allreduce takes a DistributedDataParallel model, not "
                        f"{type(model).__name__}")
    model.register_comm_hook(None, _reduce_nothing)
