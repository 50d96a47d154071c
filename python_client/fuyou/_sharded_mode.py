"""ShardedResidentMode: the resident mode of one rank of a data-parallel job
(``fuyou.AdamW`` in a torch.distributed group of more than one rank; see
_data_parallel.py for the job names, the node's daemon and the shard).

- Chunks: the whole plan is made on every rank; this rank registers and sends
  only its own (``DataParallel.take_shard``). At construction every rank
  checks that all ranks' jobs are new or resumed at the same step, then each
  chunk's weights are broadcast from its owner (a resumed owner installed the
  daemon's).
- Backward (the hooks, always installed): each chunk complete for the step's
  last pass is all-reduced at once, and the owner sends the average to its
  daemon as soon as it is there; at the end of the pass every rank's
  ``.grad`` holds the average, as DDP leaves it (``ChunkReductions``,
  _dp_overlap.py: the round, the order, the accumulation and DDP rules); with
  overlap off every reduction starts at the end of the pass.
- Another world size: the job's states are resharded into the new per-rank
  jobs after registration (_reshard.py), before the weights are broadcast.
- step(): ``settle`` (the rest of the round; the chunks the loop edited alike
  on every rank taken from ``.grad``, a per-rank edit refused on every rank;
  DDP detected), then ``finish_reduced_step`` (_dp_step.py): an inf/nan in
  any averaged chunk (loss scaling) skips the step on every rank;
  ``max_grad_norm`` clips by the global norm (the owners' sums of squares
  all-reduced); the own chunks sent or redone, every rank's agreement
  (_dp_commit.py: the step commits on every rank or on none), the step
  committed in this rank's job, and every chunk's new weights broadcast from
  its owner.
- Under DDP (its all-reduce already averaged ``.grad``; kept, not replaced,
  from the step after the one that found it): nothing is reduced
  (``average_gradients`` finds every rank's the same), the own chunks go from ``.grad`` at step() as in the resident mode,
  and the global norm and the overflow are agreed as above. With
  ``fuyou.skip_ddp_allreduce(ddp_model)`` DDP reduces nothing and the
  reductions above replace its all-reduce.
- Between steps: state_dict, load_state_dict and export_checkpoint are
  collectives over the ranks' jobs, ``opt.state[p]`` is this rank's
  (_sharded_states.py); so is the sharded export (``shard_bytes=``,
  _dp_export.py), written by rank 0.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from ._chunking import Chunk
from ._dp_overlap import ChunkReductions
from ._dp_commit import agree_to_commit
from ._dp_durable import DurableGate
from ._dp_step import finish_reduced_step
from ._pass_end import PassEnd
from ._reshard import finish_reshard, reshard
from ._errors import FailedPrecondition
from ._resident import ResidentMode
from ._weight_edits import WeightEdits

__all__ = ["ShardedResidentMode"]

class ShardedResidentMode(ResidentMode):
    """The resident mode of one rank (see the module doc)."""

    def __init__(self, opt, pipeline, session):
        self.dp = opt._data_parallel
        super().__init__(opt, pipeline, session)
        self.edits = WeightEdits(pipeline, chunks=lambda: self.dp.all_chunks)
        self._overlap = True  # the hooks count every pass; whether they start: hook_grad_scale
        self.reductions = ChunkReductions(self.dp, pipeline)
        self._pass_end = PassEnd(self, "_backward_ended")  # the averages into .grad
        if not pipeline.plan.chunks:  # before a reshard imports into the job
            opt.resumed = _register_step_marker(pipeline)
        plan = self.dp.world_plan
        if plan.reshard:
            reshard(self.dp, pipeline, opt._connection)
            opt.resumed = True
        elif plan.finishes_reshard:
            finish_reshard(self.dp, pipeline, plan.marker, [], opt._connection.timeout)
        self.dp.check_resumed_together(opt.resumed, pipeline.committed_step)
        self.durable_gate = DurableGate(self.dp, pipeline)
        self.reductions.gate = self.durable_gate  # before the first reduction of a round
        self.dp.broadcast_weights()

    # ------------------------------------------------------------ hooks
    def grad_arriving(self, index: int) -> None:
        """A pass reaching a chunk reduced this round: the loop accumulates
        (step() reduces the chunk again; the pipeline learns the passes)."""
        if self.pipeline.hooks_live() and not self.reductions.ddp_averages \
                and self.reductions.arriving(index):
            self.pipeline.step.mark_accumulating()

    def grad_accumulated(self, index: int) -> None:
        """Starts the reductions this pass completed; sends the own chunks whose
        average arrived."""
        pipeline = self.pipeline
        if not pipeline.hooks_live():
            return
        try:
            pipeline.count_pass(index)  # the passes the pipeline learns at commit
            if self.reductions.ddp_averages:
                return  # DDP reduces; the own chunks go at step()
            self._pass_end.arm()
            grad_scale = pipeline.hook_grad_scale()
            arrived = self.reductions.accumulated(index, may_start=grad_scale is not None)
            if grad_scale is None:
                return
            if arrived:
                self.durable_gate.finish()  # every rank's last step durable before a send
            for c in arrived:  # (those not sent now go at step())
                if pipeline.send(c, grad_scale, speculative=True,
                                 packed=self.reductions.averaged(c)):
                    self.reductions.count_sent_in_backward()
        except BaseException as e:
            pipeline.failed = e
            raise

    def _backward_ended(self) -> None:
        """At the end of a backward pass: the averages into ``.grad`` (the
        pass's reductions waited for); sends the own chunks that became ready."""
        pipeline = self.pipeline
        with pipeline.lock:
            if not pipeline.hooks_live() or self.reductions.ddp_averages:
                return
            try:
                ready = self.reductions.pass_ended()
                grad_scale = pipeline.hook_grad_scale()
                if ready and grad_scale is not None:
                    self.durable_gate.finish()  # every rank's last step durable before a send
                for c in ready if grad_scale is not None else ():
                    if c.chunk_id not in pipeline.step.sent and pipeline.send(
                            c, grad_scale, speculative=True,
                            packed=self.reductions.averaged(c)):
                        self.reductions.count_sent_in_backward()
            except BaseException as e:
                pipeline.failed = e
                raise

    # ------------------------------------------------------------ step
    def finish_step(self, scaler, max_grad_norm) -> bool:
        """The step on the gradients fuyou reduced (or DDP averaged), then the
        new weights of every chunk from its owner. Every rank commits or skips
        the step alike."""
        reductions = self.reductions
        self._pass_end.disarm()
        if not reductions.ddp_averages:
            averaged = not reductions.settle()  # the round's collectives end on every rank
            if averaged:
                self.dp.steps_averaged += 1  # fuyou alone averaged this step's gradients
            self._take_weight_edits()
            committed = finish_reduced_step(self.pipeline, reductions, scaler, max_grad_norm,
                                            before_commit=self._agree_to_commit)
        else:
            committed = self._finish_averaged(scaler, max_grad_norm)
        reductions.finish_round()
        if committed:
            self.dp.broadcast_weights()
            self._remember_weights()  # every chunk's weights are its owner's now
        return committed

    # ------------------------------------------------------------ weight edits
    def _step_starting(self) -> None:
        """(DDP's path: the resident step.) The loop's edits, as below."""
        self._take_weight_edits()

    def _step_ended(self, committed: bool) -> None:
        """As the resident mode, but the weights are remembered after every
        chunk's owner broadcast them (``finish_step``)."""
        if self._overlap:
            self.hooks.install_unfrozen()

    def _take_weight_edits(self) -> None:
        """The loop's edits of the weights since the last step (``p.data.clamp_``,
        a ``no_grad`` rescale, ``reset_parameters()``), a collective: every rank
        looks at every chunk's weights; the chunks edited on any rank must hold
        the same sums on every rank (an edit made alike, as DDP's replicas need),
        else every rank refuses, naming them; each owner takes its edited
        chunks into its masters (as the resident mode of one process), after
        the updates this step sent during backward were abandoned (they began
        from the old masters; step() sends them again). Cost: one read of the
        weights and one all-reduce of a flag per chunk a step; an edit, one
        more all-reduce and an import of the owner's edited chunks."""
        chunks = self.dp.all_chunks
        edited = {c.chunk_id for c in self.edits.edited()}
        flags = torch.tensor([int(c.chunk_id in edited) for c in chunks], dtype=torch.int32)
        union = self.reductions.all_reduce(flags, dist.ReduceOp.MAX).tolist()
        touched = [c for c, f in zip(chunks, union) if f]
        if not touched:
            return
        sums = torch.tensor([x for c in touched for x in self.edits.sums[c.chunk_id]],
                            dtype=torch.float64).nan_to_num(nan=1e300, posinf=1e301,
                                                            neginf=-1e301)
        high = self.reductions.all_reduce(torch.cat([sums, -sums]), dist.ReduceOp.MAX)
        n = len(sums)
        apart = [touched[i // 2] for i in range(n) if float(high[i]) != -float(high[n + i])]
        if apart:
            shapes = self.pipeline.param_shapes
            names = sorted({seg.param_index for c in apart for seg in c.segments})
            described = ", ".join(f"{i} {tuple(shapes[i])}" for i in names)
            raise FailedPrecondition(
                f"fuyou.AdamW of job {self.dp.base_job!r} (rank {self.dp.rank} of "
                f"{self.dp.world_size}): the weights of parameters {described} (by index in "
                "the optimizer's groups, with their shapes) were "
                "edited outside step() differently on the ranks (or on some ranks only); each "
                "chunk's master lives on one rank, so an edit must be made alike on every "
                "rank, as DDP's replicas need: make it on every rank, or write the weights "
                "with opt.load_state_dict / fuyou.export_checkpoint and init_from")
        if self.pipeline.step.in_step:
            self.pipeline.abort()  # the updates sent in backward began from the old masters
        own = {c.chunk_id for c in self.pipeline.plan.chunks}
        mine = [c for c in touched if c.chunk_id in own]
        if mine:
            self.edits.take_into_masters(mine)
        else:
            self.edits.remember()

    def _finish_averaged(self, scaler, max_grad_norm) -> bool:
        """The resident step on this rank's chunks from ``.grad``, averaged
        here unless every rank already holds the same (DDP)."""
        params = self.pipeline.params
        if self.dp.average_gradients(params):
            self.reductions.ddp_averages = False  # not DDP after all: reduce in backward again
        if scaler.enabled and not _all_finite(params):
            self.pipeline.step.mark_overflow()  # the same on every rank: the same grads
        return super().finish_step(scaler, max_grad_norm)

    def _settle(self, inv_scale: float, clipping: bool) -> List[float]:
        squares = super()._settle(inv_scale, clipping)
        if not clipping:
            return []
        return [self.dp.global_sum(sum(squares), self.pipeline.params[0])]

    def zero_grad(self) -> None:
        """A round begun in a step the loop skipped is finished (every rank
        starts its next one at the same collective), then as the resident mode."""
        pipeline = self.pipeline
        self._pass_end.disarm()
        if pipeline.attached and pipeline.failed is None:
            try:
                self.reductions.finish_round()
            except BaseException as e:
                pipeline.failed = e
                raise
        super().zero_grad()

    def _send_unsent(self, grad_scale: float) -> None:
        """Sends this rank's unsent chunks (the step from ``.grad``), then the
        agreement. First (DDP averaged: no reduction ran) every rank's last
        step is durable (the gate; a no-op once a reduction passed it)."""
        try:
            self.durable_gate.before_writes()
            super()._send_unsent(grad_scale)
        except BaseException:
            self._agree_to_commit(False)
            raise
        self._agree_to_commit(True)

    def _agree_to_commit(self, ready: bool) -> None:
        """Waits for every rank to have its updates of the step answered (the
        step commits on all ranks or on none; raises when another is not
        ready). Not `ready`: tells the others so, and returns."""
        step = self.pipeline.committed_step + 1
        if ready:
            agree_to_commit(self.dp, True, step, self.pipeline.params[0])
            return
        try:
            agree_to_commit(self.dp, False, step, self.pipeline.params[0])
        except Exception:
            pass

    def close(self) -> None:
        """Closes this rank's session, then waits for every rank, so that the
        node leader stops an embedded daemon only when no rank uses it."""
        try:
            super().close()
        finally:
            self.reductions.close()
            self.dp.barrier()


# The chunk a rank that owns none registers (never in a plan: group 255's last id).
STEP_MARKER_CHUNK_ID = 0xFFFF_FFFF


def _register_step_marker(pipeline) -> bool:
    """A rank that owns no chunk (a model of fewer chunks than ranks) registers
    a one-element chunk of its own, never sent: fuyoud keeps a job from its
    first chunk on, and this rank's job must exist and count the steps it
    commits (empty ones) for a resume or a reshard to find it at the step of
    the others. Returns whether it was resumed."""
    marker = Chunk(STEP_MARKER_CHUNK_ID, 0, torch.float32, torch.device("cpu"), [], 1)
    return pipeline.states.register(marker, torch.zeros(1))


def _all_finite(params: List[torch.Tensor]) -> bool:
    flags = [torch.isfinite(p.grad.detach()).all() for p in params if p.grad is not None]
    return not flags or bool(torch.stack(flags).all())
