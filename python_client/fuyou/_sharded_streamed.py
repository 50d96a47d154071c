"""ShardedStreamedMode: ``offload_params=True`` and ``fuyou.stream_parameters``
on one rank of a data-parallel job (issue 24; the job names, the node's
daemon and the shard are _data_parallel.py's).

Where each rank fetches its weights from: **a copy in its own job.** Every
rank's job ``<job>.rank<r>-of<w>`` registers every chunk of the model
(``store_weights``), but only the chunks of its shard (``take_shard`` of the
module-aligned plan, made at ``bind``) are the rank's to update; the others
are copies, refreshed after every commit from their owners. So:

- forward and backward fetch every module's weights from the rank's own
  fuyoud, through the unchanged weight cache, prefetches and saved-tensor
  handles, and hold **no collective**: a collective per fetch would have to
  happen on every rank at once, but whether a block is fetched or found in
  the cache depends on when the sender thread freed gradient bytes, which
  differs between ranks, and two ranks disagreeing inside autograd's hooks
  deadlock. The fetch stays as local, and as fast, as in one process;
- ``model.state_dict()`` is a local call on any rank (``torch.save`` on rank 0
  alone works), as the copies hold every weight;
- the price: each rank's job stores every chunk (weights, fp32 master and the
  copies' unused moments: the SSD bytes of the model times the world size,
  not divided by it), and each step ends with the owners' new fp32 masters
  broadcast and imported into the other ranks' copies (one import, which
  rewrites their working weights, per rank and step).

The step, on every rank alike:

1. backward (``PassReductions``, _dp_pass_reductions.py): in the step's
   last pass (as far as known: the passes the last step made) each chunk of
   the whole plan is all-reduced as soon as the pass completed it, in plan
   order, and this rank sends its own chunks' averages to its daemon
   speculatively as they arrive; at the pass's end (autograd's callback,
   inside ``backward()``) the rest start, all are waited for and the
   averages are written into ``.grad`` on every rank. So the loop sees what
   DDP leaves: ``clip_grad_norm_``, GradScaler's unscale or a ``mul_``
   between backward and step() act on the global gradients, alike on every
   rank. An earlier accumulation pass reduces nothing; a pass after the one
   expected averages again (exact: the mean of avg(g1) + g2_r is
   avg(g1) + avg(g2));
2. step(): a step none of whose passes averaged (fewer than expected) is
   averaged here (``average_gradients``); with loss scaling an inf/nan
   anywhere skips the step on every rank (one all-reduce of a flag); the own
   chunks sent in backward whose ``.grad`` changed since (fingerprints, as
   the resident mode's: the loop's clip or mul_, another pass, new
   hyper-parameters) are redone from ``.grad``, all of them when
   ``max_grad_norm`` clips by the global norm (the owners' sums of squares
   all-reduced); the own chunks not sent yet go from ``.grad``; this rank's
   job commits, and every gradient goes (``.grad`` is None after step());
3. the owners' new masters reach every rank's copies (``refresh_copies``)
   and the weight cache is dropped, so the next forward fetches the new
   weights everywhere. Its imports are the first writes of the rank's job
   after the commit (to the extents that hold the step before, and a new
   manifest): first every rank waits for its step to be durable and agrees
   that all are (``DurableGate``, _dp_durable.py), so that a node's fuyoud
   that crashes before its step was durable leaves every rank able to go back
   to the step before.

After every module is registered (``stream_parameters`` or the last
``materialize``, on every rank) the ranks check that they are all new or all
resumed at the same step and refresh the copies from the owners (a crash
between an owner's commit and the copies' import is repaired there).
``model.load_state_dict`` writes the rank's whole job (own chunks and copies):
call it on every rank; step() refuses to go on when the ranks' loads differ.

The ranks make the same number of backward passes a step, each reaching
some trainable parameter (as under DDP): a rank with one more averaging pass
waits in its reductions up to the group's timeout, then raises. Every
reduction is done when ``backward()`` returns, so they share the
optimizer's group with step()'s collectives and the loop's own.

Not in this slice: freeing the gradients of a chunk during backward (they
stay in ``.grad`` until step(), and each averaging pass's buffers hold them
once more until its end: twice the gradients at a pass's end); a hook sees
a reduction done only at a later hook, so on a small model most own chunks
are sent at the pass's end (still inside ``backward()``); the first step of
an accumulating loop that did not declare ``accumulation_steps`` averages
every pass (later steps only the last); DDP (its parameters are
placeholders); another world size (resharding a streamed job raises on
every rank, before anything is registered, naming the old jobs and how to go
on: its rank jobs hold a copy of every chunk, which _reshard.py does not
read).
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ._dp_durable import DurableGate
from ._dp_pass_reductions import PassReductions
from ._placeholders import assign_grad
from ._errors import FailedPrecondition
from ._fingerprints import changed_chunks, fingerprint
from ._pass_end import PassEnd
from ._protocol import REDO_CLIPPED, REDO_GRADIENTS_CHANGED, STATE_MASTER
from ._streamed import StreamedMode

__all__ = ["ShardedStreamedMode"]


class ShardedStreamedMode(StreamedMode):
    """The streamed mode of one rank (see the module doc)."""

    def weights_error(self):
        """An edit of the fetched weights inside a forward (StreamedMode's) on
        any rank refuses the step on every rank: one all-reduce of the first
        edited parameter's index a step (one rank refusing alone would leave
        the others in a collective)."""
        edited = self.edited_in_forward()
        first = torch.tensor([edited[0] if edited else -1], dtype=torch.int64)
        first = first.to(self.dp._device(self.pipeline.params[0]))
        dist.all_reduce(first, op=dist.ReduceOp.MAX, group=self.dp.group)
        index = int(first.item())
        if index < 0:
            return None
        return self.edit_error(index, f" on a rank of data-parallel job {self.dp.base_job!r}")

    def __init__(self, opt, pipeline, session):
        self.dp = opt._data_parallel
        _refuse_reshard(self.dp)
        self._opt = weakref.ref(opt)
        self._accumulated: Dict[int, set] = {}  # id(block) -> its members with a gradient
        self.reductions: Optional[PassReductions] = None  # once every module is registered
        self.durable_gate: Optional[DurableGate] = None  # likewise
        self._pass_open = False
        self._pass_end = PassEnd(self, "_backward_ended")  # pass_ended, from autograd
        self._sent_in_pass: List = []  # own chunks sent from this pass's averages
        self._changed: set = set()  # chunk ids sent in backward and changed since (step())
        super().__init__(opt, pipeline, session)
        self.offload.own_chunks = self.dp.take_shard
        self.offload.after_registration = self._registered

    # ------------------------------------------------------------ hooks
    # grad_arriving is the streamed mode's: the block is held for backward (no
    # FreedGrad is made: the gradients stay in .grad, averaged at the pass's end).

    def grad_accumulated(self, index: int) -> None:
        """Counts the pass (the first hook queues its end), starts the chunks
        it completed, sends the own chunks whose average arrived; once every
        member of a block has a gradient, its backward hold goes."""
        pipeline = self.pipeline
        if not pipeline.hooks_live():
            return
        block = self.offload.layout.of_param.get(index)
        if block is not None:
            seen = self._accumulated.setdefault(id(block), set())
            seen.add(index)
            if len(seen) == len(block.members):
                seen.clear()
                self.offload.weights.release_backward(block)
        reductions = self.reductions
        if reductions is None:
            return
        try:
            if not self._pass_open:
                self._pass_open = True
                reductions.pass_started()
                self._pass_end.arm()
            self._send_averaged(reductions.accumulated(index), in_hook=True)
        except BaseException as e:
            pipeline.failed = e
            raise

    def _backward_ended(self) -> None:
        """Autograd's callback at the end of a backward pass (``PassEnd``)."""
        with self.pipeline.lock:
            self.pass_ended()

    def pass_ended(self) -> None:
        """The end of a backward pass (autograd's callback): the averages go into
        .grad on every rank, the own chunks not sent yet are sent, and those
        sent from this pass leave the fingerprint of .grad for step()."""
        if not self._pass_open:
            return
        self._pass_open = False
        pipeline = self.pipeline
        try:
            self._send_averaged(self.reductions.pass_ended(), in_hook=False)
            for c in self._sent_in_pass:
                sent = pipeline.step.sent.get(c.chunk_id)
                if sent is not None:
                    sent.fingerprint = fingerprint(c)
            self._sent_in_pass = []
        except BaseException as e:
            pipeline.failed = e
            raise

    def _send_averaged(self, arrived: List, in_hook: bool) -> None:
        """Sends this rank's chunks whose average arrived, speculatively (not a
        chunk sent before in this step: step() finds it changed and redoes it)."""
        pipeline = self.pipeline
        grad_scale = pipeline.hook_grad_scale()
        if grad_scale is None:
            return  # overlap off, an overflow: step() sends them
        for c in arrived:
            if c.chunk_id in pipeline.step.sent:
                continue
            if pipeline.send(c, grad_scale, speculative=True,
                             packed=self.reductions.averaged_chunk(c)):
                self._sent_in_pass.append(c)
                counts = self.reductions.counts
                if in_hook:
                    counts.sent_in_hooks += 1
                else:
                    counts.sent_at_pass_end += 1

    # ------------------------------------------------------------ step
    def finish_step(self, scaler, max_grad_norm) -> bool:
        """The streamed step on this rank's chunks from the averaged .grad
        (the passes averaged it, or here when none did), then the owners' new
        masters into every rank's copies. Every rank commits or skips alike."""
        if not self.offload.registered:
            raise FailedPrecondition(
                f"step() of data-parallel job {self.dp.base_job!r} before its model is "
                "registered: call fuyou.stream_parameters(model, opt) on every rank first")
        self._accumulated.clear()
        self.pass_ended()  # a pass whose end autograd did not run (not expected)
        self._check_loads_agree()
        params = self.pipeline.params
        if not self.reductions.averaged:  # the same on every rank: the same passes
            self._zeros_where_others_have_grads(params)
            self.dp.average_gradients(params)
            self.reductions.counts.averaged_at_step += 1
        if scaler.enabled:
            self.pipeline.wait_sent()  # the sender's inf/nan check of the chunks sent
            bad = self.pipeline.step.overflow or not _all_finite(params)
            if self.dp.global_sum(1.0 if bad else 0.0, params[0]) > 0:
                self.pipeline.step.mark_overflow()  # on every rank alike
        committed = super().finish_step(scaler, max_grad_norm)
        if committed:
            self.refresh_copies()
        return committed

    def _settle(self, inv_scale: float, clipping: bool) -> List[float]:
        """The own chunks sent in backward whose .grad changed since (the loop's
        clip_grad_norm_, unscale, mul_, another pass, new hyper-parameters) are
        to be redone; with clipping, the global norm (the owners' sums of
        squares, all-reduced)."""
        pipeline = self.pipeline
        pipeline.wait_sent()
        changed, squares = changed_chunks(pipeline.plan.chunks, pipeline.step.sent,
                                          pipeline.hyper_now)
        self._changed = {c.chunk_id for c in changed}
        if not clipping:
            return []
        return [self.dp.global_sum(sum(squares.values()), pipeline.params[0])]

    def _redo_sent(self, grad_scale: float, clipped: bool) -> None:
        """The chunks sent in backward again from .grad: changed, or clipped."""
        pipeline = self.pipeline
        for c in pipeline.step.sent_chunks():
            if c.chunk_id in self._changed:
                pipeline.redo(c, grad_scale, REDO_GRADIENTS_CHANGED)
            elif clipped:
                pipeline.redo(c, grad_scale, REDO_CLIPPED)
            if pipeline.step.overflow:
                break
        self._changed = set()

    def _send_unsent(self, grad_scale: float) -> None:
        """Sends the own chunks not sent in backward from ``.grad`` (the sender
        thread copies them; nothing is freed in between, as a parameter may
        span two of the chunks); the step's end drops every gradient (``.grad``
        is None after step() on every rank: the daemon of the chunk's owner has
        it)."""
        pipeline = self.pipeline
        for c in pipeline.plan.chunks:
            if c.chunk_id not in pipeline.step.sent:
                pipeline.send(c, grad_scale)
                if pipeline.step.overflow:
                    break
        pipeline.wait_sent()

    def _step_ended(self, committed: bool) -> None:
        super()._step_ended(committed)
        self._pass_end.disarm()  # a pass whose end never ran (its backward raised)
        self._sent_in_pass = []
        self._changed = set()
        if self.reductions is not None:
            self.reductions.step_ended()

    def _zeros_where_others_have_grads(self, params) -> None:
        """A parameter with a gradient on some ranks gets zeros on the others
        (as DDP gives it), shaped as the parameter, not as its placeholder."""
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        has = has.to(self.dp._device(params[0]))  # NCCL reduces CUDA tensors
        dist.all_reduce(has, group=self.dp.group)
        for p, shape, n in zip(params, self.pipeline.param_shapes, has.tolist()):
            if n > 0 and p.grad is None:
                assign_grad(p, shape, torch.zeros(shape, dtype=p.dtype, device=p.device))

    def _check_loads_agree(self) -> None:
        loads: list = [None] * self.dp.world_size
        dist.all_gather_object(loads, self.offload.weights_loaded, group=self.dp.group)
        if len(set(loads)) > 1:
            raise FailedPrecondition(
                f"data-parallel job {self.dp.base_job!r}: model.load_state_dict wrote new "
                f"weights a different number of times on the ranks ({loads}); every rank's "
                "job holds a copy of every weight: call model.load_state_dict on every rank")

    # ------------------------------------------------------------ the copies
    def _registered(self) -> None:
        """Every module is registered (on every rank at once): the ranks agree
        on new or resumed, then the copies are made the owners'; the chunks of
        the whole plan are known to the reductions."""
        self.dp.check_resumed_together(self._opt().resumed, self.pipeline.committed_step)
        self.durable_gate = DurableGate(self.dp, self.pipeline)
        self.refresh_copies()
        self.reductions = PassReductions(self.dp, self.pipeline)

    def refresh_copies(self) -> None:
        """Each chunk's fp32 master, broadcast from its owner, replaces the
        other ranks' copy of it (one import per rank: the daemon recomputes the
        copies' working weights); the weight cache is dropped. A collective,
        between steps. After a commit, every rank's step is durable before any
        rank imports (the durable gate: the imports write the extents of the
        step before and commit a manifest)."""
        dp, pipeline = self.dp, self.pipeline
        self.durable_gate.before_writes()
        self.offload.weights.drop_cache()  # no fetch in flight while states move
        wrote = False
        for c in dp.all_chunks:
            owner = dp.owner_of[c.chunk_id]
            master = torch.empty(c.num_elements, dtype=torch.float32)
            if owner == dp.rank:
                pipeline.session.read_state(c.chunk_id, STATE_MASTER, 0, master.numpy())
            moved = master.to(dp._device(master))
            dist.broadcast(moved, src=dp._src(owner), group=dp.group)
            if owner != dp.rank:
                pipeline.states.write(c, STATE_MASTER, moved.cpu())
                wrote = True
        if wrote:
            pipeline.states.commit_import()
        self.offload.weights.drop_cache()

    def close(self) -> None:
        """Closes this rank's session, then waits for every rank (the node
        leader stops an embedded daemon only when no rank uses it)."""
        try:
            super().close()
        finally:
            self.dp.barrier()


def _all_finite(params) -> bool:
    flags = [torch.isfinite(p.grad.detach()).all() for p in params
             if p.grad is not None and torch.is_tensor(p.grad)]
    return not flags or bool(torch.stack(flags).all())


def _refuse_reshard(dp) -> None:
    """A streamed job trained with another world size is not resharded (its
    rank jobs hold a copy of every chunk, which _reshard.py does not read):
    raises on every rank before anything is registered, so the old jobs stay
    as they are and nothing trains anew beside them."""
    plan = dp.world_plan
    if plan.finishes_reshard:
        raise FailedPrecondition(
            f"fuyou.AdamW of job {dp.base_job!r} (rank {dp.rank} of {dp.world_size}): a "
            f"reshard of the job into {dp.world_size} ranks was cut short (its marker job "
            f"{plan.marker.name!r} is there); start it once without offload_params to finish it")
    if not plan.reshard:
        return
    old = (f"the single-process job {dp.base_job!r}" if plan.source_world == 1 else
           f"the jobs {dp.base_job}.rank<r>-of{plan.source_world}")
    raise FailedPrecondition(
        f"fuyou.AdamW of job {dp.base_job!r} (rank {dp.rank} of {dp.world_size}): the job "
        f"was trained with {plan.source_world} rank(s) ({old}, step {plan.source_step}); "
        f"resharding it to {dp.world_size} ranks with offload_params is not implemented: "
        f"resume it with {plan.source_world} rank(s), or save model.state_dict() and "
        "opt.state_dict() there and load both into a new job on the new ranks")

