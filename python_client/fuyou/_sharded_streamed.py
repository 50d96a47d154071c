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

1. backward: the gradients stay in ``.grad`` (no chunk is sent or freed
   during backward in this slice: the reduction needs every rank's);
2. step(): a parameter with a gradient on some ranks takes zeros on the
   others, then the gradients are averaged (``average_gradients``: not again
   after DDP); with loss scaling an inf/nan anywhere skips the step on every
   rank; ``max_grad_norm`` clips by the global norm (the owners' sums of
   squares all-reduced); each rank sends its own chunks from ``.grad``,
   commits its job, and every gradient goes (``.grad`` is None after step());
3. the owners' new masters reach every rank's copies (``refresh_copies``)
   and the weight cache is dropped, so the next forward fetches the new
   weights everywhere.

After every module is registered (``stream_parameters`` or the last
``materialize``, on every rank) the ranks check that they are all new or all
resumed at the same step and refresh the copies from the owners (a crash
between an owner's commit and the copies' import is repaired there).
``model.load_state_dict`` writes the rank's whole job (own chunks and copies):
call it on every rank; step() refuses to go on when the ranks' loads differ.

Not in this slice: freeing the gradients of a chunk during backward (they
stay in ``.grad`` until step(), so the device holds every gradient at once),
the overlap of the reduction with backward, ``clip_grad_norm_`` / GradScaler
unscale in the loop on the averaged gradients (they see this rank's own:
use ``max_grad_norm`` / ``loss_scale``), DDP (its parameters are placeholders).
"""

from __future__ import annotations

import weakref
from typing import Dict, List

import torch
import torch.distributed as dist

from ._errors import FailedPrecondition
from ._protocol import STATE_MASTER
from ._streamed import StreamedMode

__all__ = ["ShardedStreamedMode"]


class ShardedStreamedMode(StreamedMode):
    """The streamed mode of one rank (see the module doc)."""

    def __init__(self, opt, pipeline, session):
        self.dp = opt._data_parallel
        self._opt = weakref.ref(opt)
        self._accumulated: Dict[int, set] = {}  # id(block) -> its members with a gradient
        super().__init__(opt, pipeline, session)
        self.offload.own_chunks = self.dp.take_shard
        self.offload.after_registration = self._registered

    # ------------------------------------------------------------ hooks
    # grad_arriving is the streamed mode's: the block is held for backward (no
    # chunk is sent during backward, and no FreedGrad is made, so nothing else).

    def grad_accumulated(self, index: int) -> None:
        """The gradient stays in .grad until step() averages it; once every
        member of its block has one, the block's backward hold goes."""
        if not self.pipeline.hooks_live():
            return
        block = self.offload.layout.of_param.get(index)
        if block is None:
            return
        seen = self._accumulated.setdefault(id(block), set())
        seen.add(index)
        if len(seen) == len(block.members):
            seen.clear()
            self.offload.weights.release_backward(block)

    # ------------------------------------------------------------ step
    def finish_step(self, scaler, max_grad_norm) -> bool:
        """Averages the gradients, then the streamed step on this rank's chunks,
        then the owners' new masters into every rank's copies. Every rank
        commits or skips the step alike."""
        if not self.offload.registered:
            raise FailedPrecondition(
                f"step() of data-parallel job {self.dp.base_job!r} before its model is "
                "registered: call fuyou.stream_parameters(model, opt) on every rank first")
        self._accumulated.clear()
        self._check_loads_agree()
        params = self.pipeline.params
        self._zeros_where_others_have_grads(params)
        self.dp.average_gradients(params)
        if scaler.enabled and not _all_finite(params):
            self.pipeline.step.mark_overflow()  # the same on every rank: the same grads
        committed = super().finish_step(scaler, max_grad_norm)
        if committed:
            self.refresh_copies()
        return committed

    def _settle(self, inv_scale: float, clipping: bool) -> List[float]:
        squares = super()._settle(inv_scale, clipping)
        if not clipping:
            return []
        return [self.dp.global_sum(sum(squares), self.pipeline.params[0])]

    def _send_unsent(self, grad_scale: float) -> None:
        """Sends every own chunk from ``.grad`` (the sender thread copies them;
        nothing is freed in between, as a parameter may span two of the
        chunks); the step's end drops every gradient (``.grad`` is None after
        step() on every rank: the daemon of the chunk's owner has it)."""
        pipeline = self.pipeline
        for c in pipeline.plan.chunks:
            if c.chunk_id not in pipeline.step.sent:
                pipeline.send(c, grad_scale)
                if pipeline.step.overflow:
                    break
        pipeline.wait_sent()

    def _zeros_where_others_have_grads(self, params) -> None:
        """A parameter with a gradient on some ranks gets zeros on the others
        (as DDP gives it), shaped as the parameter, not as its placeholder."""
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        has = has.to(self.dp._device(params[0]))  # NCCL reduces CUDA tensors
        dist.all_reduce(has, group=self.dp.group)
        for p, shape, n in zip(params, self.pipeline.param_shapes, has.tolist()):
            if n > 0 and p.grad is None:
                _set_zero_grad(p, shape)

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
        on new or resumed, then the copies are made the owners'."""
        self.dp.check_resumed_together(self._opt().resumed, self.pipeline.committed_step)
        self.refresh_copies()

    def refresh_copies(self) -> None:
        """Each chunk's fp32 master, broadcast from its owner, replaces the
        other ranks' copy of it (one import per rank: the daemon recomputes the
        copies' working weights); the weight cache is dropped. A collective,
        between steps."""
        dp, pipeline = self.dp, self.pipeline
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


def _set_zero_grad(p, shape) -> None:
    data = p.data  # a placeholder: torch checks .grad's size against it
    p.data = torch.empty(1, dtype=p.dtype, device=p.device).expand(shape)
    p.grad = torch.zeros(shape, dtype=p.dtype, device=p.device)
    p.data = data


def _all_finite(params) -> bool:
    flags = [torch.isfinite(p.grad.detach()).all() for p in params
             if p.grad is not None and torch.is_tensor(p.grad)]
    return not flags or bool(torch.stack(flags).all())
