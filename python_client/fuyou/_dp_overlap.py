"""ChunkReductions: each chunk's gradients averaged over the ranks while
backward goes on, and the average written into ``.grad`` at the end of the
backward pass, as DDP leaves it (issue 24: the overlap of a data-parallel
step).

A data-parallel rank owns whole chunks (_data_parallel.py). Its backward hooks
(``ShardedResidentMode.grad_accumulated``) count the passes of every chunk of
the whole plan; once a chunk is complete for the step's last pass
(``passes_per_step``, the resident mode's accumulation rule) its reduction
starts at once, ``torch.distributed.all_reduce(..., async_op=True)``, so chunk
*i* travels while backward computes chunk *i+1*; at the next hooks the owner
finds it done and sends the average to its daemon (speculatively, as the
resident mode sends its chunks).

*DDP's semantics.* At the end of the backward pass (``PassEnd``, after DDP's
own end-of-backward callback) the pass's reductions are waited for and every
rank's ``.grad`` becomes the average over the ranks: a parameter some rank has
a gradient for gets one on every rank (zeros where it had none, the sum
divided by the world size, as DDP averages), one no rank has stays None. So a
``clip_grad_norm_``, an unscale or an inf check of the loop between backward
and step() sees the global gradients and decides alike on every rank, as
under DDP and as in one process. An all-reduce, not a reduce to the owner: it
moves about twice the bytes (a reduce-scatter and an all-gather), the price of
the average on every rank (gloo has no reduce_scatter in torch 1.13; the
owners' daemon updates need only their own chunks); every rank keeps its
buffers until the pass end (a copy of the gradients, as DDP's buckets are), a
non-owner drops them once written. A pass before the step's
last (accumulation, ``accumulation_steps`` or the passes learned) reduces
nothing: ``.grad`` keeps the rank's own sum, as under DDP's ``no_sync``.

Rules that keep every rank's collectives in the same order:

- *One round a step.* Every chunk is reduced once a round, in plan order: a
  chunk complete out of order waits for the ones before it (``_cursor``);
  what is left starts at the end of the pass (or at step(), when no pass
  ended the round). Which start in backward and which at the pass end may
  differ between the ranks (a rank with overlap off starts them all at the
  pass end); the sequence does not. Each reduction carries one more element
  per segment: 1 where this rank has a gradient, so every rank knows which
  parameters no rank has.
- *A pass more than expected* (the loop accumulates more passes than counted:
  undeclared accumulation, learned at the commit) reaches chunks already
  averaged: at its end the ranks agree (one all-reduce of flags) on the chunks
  reached and reduce them again. The average of a sum that holds an average
  is exact: mean_r(avg(g1) + g2_r) = avg(g1) + avg(g2).
- *Agreed at step()* (``settle``): the rest of the round starts; a fingerprint
  of ``.grad`` as the pass end wrote it (_fingerprints.py) is compared with
  ``.grad`` now, in one all-reduce of flags. A chunk the loop changed alike on
  every rank (a clip, an unscale: ``.grad`` the same on every rank) is taken
  from ``.grad`` and redone; one changed differently on some rank (a per-rank
  edit of the averaged gradients) raises on every rank: fuyou updates each
  chunk once for every rank and cannot step on per-rank gradients. So does an
  edit of gradients no pass end averaged (a step with fewer backward passes
  than counted, the loop editing each rank's own sum in between): only a
  declared pass count can make that exact.
- *DDP found.* A model wrapped in DDP writes DDP's average into ``.grad`` at
  the end of backward, before the pass end: ``.grad`` written since the hook
  (``grad_stamp``) on any rank, agreed at step(), sets ``ddp_averages``: the
  next steps start no reductions at all (DDP's all-reduce is kept, not
  replaced), until a step finds the gradients not averaged. The loop's own
  edits come after the pass end and are never taken for DDP's.
- *A round begun is finished*: zero_grad() after a backward without step()
  (a skipped step) starts the rest of the round and drops it.
- *A group of their own.* The reductions and the agreements run on a process
  group made for them (``dist.new_group`` over the default group's ranks, when
  the optimizer's group is the default one), so a collective of the loop's own
  (a loss all-reduced for logging) never pairs with a reduction. A group
  passed as ``process_group=`` is used as it is (a new group must be made by
  every rank of the default group alike): the loop then must not use it during
  backward or between backward and step().

``skip_ddp_allreduce(ddp_model)`` (_ddp_skip.py) replaces DDP's all-reduce
instead: DDP reduces nothing and copies each rank's own gradients back into
``.grad``; the pass end overwrites them with fuyou's averages.

step() on the averages: ``finish_reduced_step`` (_dp_step.py).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ._chunk_grads import ChunkAverage, read_grads, write_grads
from ._chunk_plan import ChunkPlan
from ._chunking import Chunk
from ._ddp_skip import reduces_nothing
from ._errors import FailedPrecondition
from ._fingerprints import fingerprint, missing_grads
from ._pass_end import grad_stamp
from ._passes import PassCounter

__all__ = ["ChunkReductions", "ReductionCounts"]



@dataclass
class ReductionCounts:
    """What the reductions did since the optimizer was made (tests read them)."""

    started_in_backward: int = 0  # chunk reductions a backward hook started
    started_at_pass_end: int = 0  # ... the end of a backward pass started (the rest of a round)
    started_at_step: int = 0  # ... step() or zero_grad() started (no pass end did)
    reduced_again: int = 0  # chunks reduced again: a pass more than counted reached them
    edited_in_loop: int = 0  # chunks the loop changed alike on every rank, taken from .grad
    sent_in_backward: int = 0  # own chunks sent to the daemon before step()
    rounds: int = 0  # rounds finished (steps, skipped steps)
    rounds_found_ddp: int = 0  # rounds in which DDP wrote its average into .grad too


class _Reduction(ChunkAverage):
    """One chunk's reduction this round (``ChunkAverage``), and ``.grad`` as
    the pass end wrote it (fingerprint, segments without)."""

    __slots__ = ("written", "written_missing")

    def __init__(self, c: Chunk, dp, group):
        super().__init__(c, dp, group)
        self.written: Optional[object] = None  # the fingerprint of .grad once written
        self.written_missing: Optional[Tuple[int, ...]] = None  # None: not written yet


class ChunkReductions:
    """The reductions of one rank's optimizer (see the module doc). Every method
    runs with the optimizer's lock held; ``pass_ended``, ``settle``,
    ``finish_round`` and ``wait_all`` are collectives of the group."""

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
        self._reached_in_pass: set = set()  # ... in the pass going on
        self._by_id: Dict[int, _Reduction] = {}
        self._unfinished: collections.deque = collections.deque()  # chunk ids, in start order
        self._changed: set = set()  # chunk ids whose average changed after it was first ready
        self._counted_pass = False
        self._averaged = False  # a pass end wrote the round's averages into .grad
        self._hook_stamps: Dict[int, object] = {}  # param index -> grad_stamp after its hook
        self._end_stamps: Optional[List[object]] = None  # every .grad's at the last pass end
        self._rewritten = False  # .grad written between a hook and its pass end (DDP)

    @property
    def round_open(self) -> bool:
        """A backward pass was counted, or a reduction started, since the round began."""
        return self._counted_pass or self._cursor > 0

    def owns(self, c: Chunk) -> bool:
        return self.dp.owner_of[c.chunk_id] == self.dp.rank

    # ------------------------------------------------------------ hooks
    def arriving(self, index: int) -> bool:
        """Before parameter `index` accumulates: whether this pass reaches a
        chunk already started this round for the first time (the loop
        accumulates more passes than expected; the pass end reduces it again)."""
        started = [c for c in self.plan.of_param(index) if c.chunk_id in self._by_id]
        self._reached_in_pass.update(c.chunk_id for c in started)
        again = [c for c in started if c.chunk_id not in self._reached]
        self._reached.update(c.chunk_id for c in again)
        return bool(again)

    def accumulated(self, index: int, may_start: bool) -> List[Chunk]:
        """After parameter `index` accumulated: counts the pass, starts the
        chunks now complete in plan order (`may_start`: overlap on), and
        returns this rank's chunks whose reduction finished (their average is
        ready for the daemon, not sent yet)."""
        self._counted_pass = True
        self._hook_stamps[index] = grad_stamp(self.pipeline.params[index])
        per_step = self.pipeline.passes.passes_per_step
        for c in self.passes.count(index, self.plan.of_param(index), self.plan.params_of,
                                   self._started):
            if self.passes.rounds[c.chunk_id] >= per_step:
                self._ready.add(c.chunk_id)
        if may_start:
            while self._cursor < len(self.chunks) and \
                    self.chunks[self._cursor].chunk_id in self._ready:
                self._start(self.chunks[self._cursor], "backward")
        return self._finished_own()

    def _started(self, chunk_id: int) -> bool:
        return self._position[chunk_id] < self._cursor

    # ------------------------------------------------------------ starting
    def _start(self, c: Chunk, when: str) -> None:
        """Starts chunk `c`'s all-reduce (the next of the round, or a second one:
        `when` "again"). First, after a commit, the durable gate's agreement
        starts (a no-op but after a commit; finished before the step's first
        send)."""
        if self.gate is not None:
            self.gate.start(self.group)  # finished before the first send
        self._by_id[c.chunk_id] = _Reduction(c, self.dp, self.group)
        self._unfinished.append(c.chunk_id)
        if when == "again":
            self._changed.add(c.chunk_id)
            self.counts.reduced_again += 1
            return
        self._cursor += 1
        self._ready.discard(c.chunk_id)
        if when == "backward":
            self.counts.started_in_backward += 1
        elif when == "pass end":
            self.counts.started_at_pass_end += 1
        else:
            self.counts.started_at_step += 1

    def start_rest(self, when: str = "step") -> None:
        """Starts every chunk of the round not started yet, in plan order."""
        while self._cursor < len(self.chunks):
            self._start(self.chunks[self._cursor], when)

    # ------------------------------------------------------------ finishing
    def _finish(self, c: Chunk, r: _Reduction, wait: bool) -> bool:
        """Whether `c`'s reduction is done (waits when `wait`); the sum becomes
        the average."""
        return r.finish(c, self.dp.world_size, wait)

    def _finished_own(self) -> List[Chunk]:
        """Finishes the reductions done so far, oldest first; this rank's
        chunks among them."""
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

    def wait_all(self) -> List[Chunk]:
        """Waits for every reduction started this round (in the order started);
        this rank's chunks among those not finished before."""
        out = []
        while self._unfinished:
            cid = self._unfinished.popleft()
            c = self.plan.chunk(cid)
            self._finish(c, self._by_id[cid], wait=True)
            if self.owns(c):
                out.append(c)
        return out

    def averaged(self, c: Chunk) -> Tuple[torch.Tensor, Tuple[int, ...]]:
        """This rank's chunk `c` averaged over the ranks, laid out as the chunk,
        and the segments no rank has a gradient for: ``ChunkPipeline.send``'s
        ``packed``. After ``wait_all``, or once returned as finished."""
        r = self._by_id[c.chunk_id]
        return r.flat, r.missing

    def count_sent_in_backward(self) -> None:
        self.counts.sent_in_backward += 1

    def changed(self, c: Chunk) -> bool:
        """Whether `c`'s average changed after it was first ready (reduced
        again, or edited alike by the loop): a send of it is redone."""
        return c.chunk_id in self._changed

    # ------------------------------------------------------------ pass end
    def pass_ended(self) -> List[Chunk]:
        """At the end of a backward pass: when it was the step's last (a chunk
        is due), the rest of the round starts and every chunk's average goes
        into ``.grad``; a pass after that reduces again the chunks it reached
        on any rank. Returns this rank's chunks whose average is ready now."""
        params = self.pipeline.params
        ddp_wrote = any(grad_stamp(params[i]) != s for i, s in self._hook_stamps.items()
                        if not reduces_nothing(params[i]))
        self._rewritten |= ddp_wrote
        self._hook_stamps = {}
        reached, self._reached_in_pass = self._reached_in_pass, set()
        if not self._averaged:
            if self._cursor == 0 and not self._ready:
                self._stamp_pass_end()
                return []  # a pass before the step's last: .grad stays this rank's
            self.start_rest("pass end")
            chunks = self.chunks
        else:
            flags = [1 if c.chunk_id in reached else 0 for c in self.chunks]
            agreed = self.all_reduce(torch.tensor(flags, dtype=torch.int32), dist.ReduceOp.MAX)
            chunks = [c for c, f in zip(self.chunks, agreed.tolist()) if f]
            for c in chunks:
                self._start(c, "again")
        ready = self.wait_all()
        if not ddp_wrote:  # DDP's averages stay where it wrote them (settle takes them)
            for c in chunks:
                self._write(c)
        self._averaged = True
        self._stamp_pass_end()
        return ready

    def _write(self, c: Chunk) -> None:
        """The average of `c` into ``.grad``; what was written is remembered."""
        r = self._by_id[c.chunk_id]
        write_grads(c, r.flat, r.missing)
        r.written = fingerprint(c)
        r.written_missing = missing_grads(c)
        if not self.owns(c):
            r.flat = None  # only the owner sends it

    def _stamp_pass_end(self) -> None:
        self._end_stamps = [grad_stamp(p) for p in self.pipeline.params]

    # ------------------------------------------------------------ step()
    def settle(self) -> bool:
        """At step(), a collective: starts and finishes the rest of the round,
        takes the chunks the loop changed alike on every rank from ``.grad``,
        raises on every rank when it changed them differently. Returns whether
        DDP wrote its averages into ``.grad`` (``ddp_averages`` is then set)."""
        unwritten = [c for c in self.chunks if c.chunk_id not in self._by_id
                     or self._by_id[c.chunk_id].written_missing is None]
        edited_own = self._end_stamps is not None and any(
            grad_stamp(self.pipeline.params[i]) != self._end_stamps[i]
            for c in unwritten for i in self.plan.params_of(c.chunk_id))
        self.start_rest()
        self.wait_all()
        flags = [0] * (len(self.chunks) + 2)
        for i, c in enumerate(self.chunks):
            r = self._by_id[c.chunk_id]
            if r.written_missing is not None and (
                    missing_grads(c) != r.written_missing
                    or not _same_fingerprint(fingerprint(c), r.written)):
                flags[i] = 1
        flags[-2], flags[-1] = int(self._rewritten), int(edited_own)
        agreed = self.all_reduce(torch.tensor(flags, dtype=torch.int32),
                                 dist.ReduceOp.MAX).tolist()
        if agreed[-2]:
            # DDP wrote its averages into .grad (on every rank alike): they are
            # the step's gradients. fuyou's own reductions of this round may
            # have read them on one rank and the raw ones on another (a
            # parameter unused on some rank: its chunks were started after
            # DDP's write there), so every chunk is taken from .grad.
            for c in self.chunks:
                self._take_from_grads(c, edited=False)
            self.ddp_averages = True
            self.counts.rounds_found_ddp += 1
            return True
        if agreed[-1]:
            raise FailedPrecondition(self._message(_EDITED_OWN))
        changed = [c for c, f in zip(self.chunks, agreed) if f]
        if changed and not self._same_on_every_rank(changed):
            raise FailedPrecondition(self._message(_EDITED_APART.format(
                params=sorted({i for c in changed for i in self.plan.params_of(c.chunk_id)}))))
        for c in changed:
            self._take_from_grads(c)
        for c in unwritten:  # the average where the loop's .grad is (as DDP leaves it)
            self._write(c)
        return False

    def _take_from_grads(self, c: Chunk, edited: bool = True) -> None:
        """Chunk `c`'s average is ``.grad`` now (the same on every rank: the
        loop `edited` it alike, or DDP averaged it): a new buffer (the sender
        may still read the old one). DDP's average equal to fuyou's bit for bit
        (every chunk when no parameter is unused: with two ranks both are
        (a + b) / 2 exactly) changes nothing, so nothing sent is redone."""
        r = self._by_id[c.chunk_id]
        flat = None
        if self.owns(c):
            flat = torch.empty(c.num_elements, dtype=torch.float32 if r.flat.device.type == "cpu"
                               else r.flat.dtype, device=r.flat.device)
            read_grads(c, flat)
            if not edited and missing_grads(c) == r.missing and torch.equal(flat, r.flat):
                return
        self._changed.add(c.chunk_id)
        self.counts.edited_in_loop += int(edited)
        if flat is not None:
            r.flat, r.missing = flat, missing_grads(c)

    def _message(self, what: str) -> str:
        dp = self.dp
        return (f"fuyou.AdamW of data-parallel job {dp.base_job!r} (rank {dp.rank} of "
                f"{dp.world_size}): {what}; edit .grad alike on every rank after the "
                f"step's last backward pass, or let fuyou clip and unscale (max_grad_norm=, "
                f"loss_scale=), or wrap the model in DDP")

    def finish_round(self) -> None:
        """Ends the round (after the step's commit or abort); a round begun in a
        step the loop skipped (zero_grad after backward) is finished first, so
        every rank's next round starts at the same collective."""
        if self.round_open:
            self.start_rest()
            self.wait_all()
            self.counts.rounds += 1
        self._reset()

    def _same_on_every_rank(self, chunks: List[Chunk]) -> bool:
        """Whether ``.grad`` of `chunks` is the same on every rank now: per chunk
        the sum, the sum of squares and a position-weighted sum (fp64), their
        minimum and maximum over the ranks equal; segments without a gradient
        count; an inf or a nan counts as itself."""
        stats = []
        for c in chunks:
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
            stats.append(torch.nan_to_num(s, nan=3e300, posinf=2e300, neginf=-2e300))
        mine = torch.cat(stats)
        lowest = self.all_reduce(mine.clone(), dist.ReduceOp.MIN)
        highest = self.all_reduce(mine.clone(), dist.ReduceOp.MAX)
        return torch.equal(lowest, highest)

    def all_reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        """`t` reduced over the ranks by `op` on the reductions' group (a
        collective), back on the host."""
        dev = self.dp._device(self.pipeline.params[0])
        t = t.to(dev)
        dist.all_reduce(t, op=op, group=self.group)
        return t.cpu()


_EDITED_APART = ("the loop changed .grad differently on the ranks after fuyou averaged it at "
                 "the end of backward (parameters {params} by index; as DDP does, .grad held "
                 "the same average on every rank): a per-rank edit, a .grad set to None or an "
                 "inf put in on one rank alone; fuyou updates each chunk once for all ranks "
                 "and cannot step on per-rank gradients")
_EDITED_OWN = ("the loop changed .grad after a backward pass that was not the step's last as "
               "fuyou counts them (accumulation_steps=, or the passes learned from earlier "
               "steps): .grad still held each rank's own gradients, and an average of what the "
               "loop made of them (a clip by each rank's norm) is not what torch computes; "
               "declare accumulation_steps= as the passes of every step")


def _same_fingerprint(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    x, y = a.tolist(), b.tolist()
    return all(p == q or (p != p and q != q) for p, q in zip(x, y))


def _timeout_of(group):
    """The timeout `group` (None: the default group) was made with."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg.options._timeout
    except AttributeError:  # a backend without options
        return dist.distributed_c10d.default_pg_timeout
