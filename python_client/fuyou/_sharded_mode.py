"""ShardedResidentMode: the resident mode of one rank of a data-parallel job
(``fuyou.AdamW`` in a torch.distributed group of more than one rank; see
_data_parallel.py for the job names, the node's daemon and the shard).

- Chunks: the whole plan is made on every rank; this rank registers and sends
  only its own (``DataParallel.take_shard``). At construction every rank
  checks that all ranks' jobs are new or resumed at the same step, then each
  chunk's weights are broadcast from its owner (a resumed owner installed the
  daemon's).
- Backward: no hooks (no overlap in this slice): the gradients are whole only
  after they are averaged over the ranks, at step().
- Another world size: the job's states are resharded into the new per-rank
  jobs after registration (_reshard.py), before the weights are broadcast.
- step(): the gradients averaged (``average_gradients``; skipped when every
  rank already has the same, as after DDP); with loss scaling, an inf/nan in
  any averaged gradient skips the step on every rank alike; ``max_grad_norm``
  clips by the global norm (the ranks' sums of squares of their chunks
  all-reduced); the own chunks sent, every rank's agreement (_dp_commit.py),
  the step committed in this rank's job, and every chunk's new weights
  broadcast from its owner.
- Between steps: state_dict, export_checkpoint, ``opt.state[p]`` and
  load_state_dict raise (each rank's job holds only its chunks' states).
"""

from __future__ import annotations

from typing import List

import torch

from ._dp_commit import agree_to_commit
from ._reshard import reshard
from ._resident import ResidentMode

__all__ = ["ShardedResidentMode"]

_STATES_PER_RANK = ("the states of a data-parallel job are split over the ranks' jobs "
                    "({job}.rank<r>-of<w>); reading or writing them as one (state_dict, "
                    "export_checkpoint, opt.state[p], load_state_dict) is not implemented yet")


class ShardedResidentMode(ResidentMode):
    """The resident mode of one rank (see the module doc)."""

    def __init__(self, opt, pipeline, session):
        self.dp = opt._data_parallel
        super().__init__(opt, pipeline, session)
        self._overlap = False
        if self.dp.world_plan.reshard:
            reshard(self.dp, pipeline, opt._connection)
            opt.resumed = True
        self.dp.check_resumed_together(opt.resumed, pipeline.committed_step)
        self.dp.broadcast_weights()

    def finish_step(self, scaler, max_grad_norm) -> bool:
        """Averages the gradients, then the resident step on this rank's chunks,
        then the new weights of every chunk from its owner. Every rank commits
        or skips the step alike."""
        params = self.pipeline.params
        self.dp.average_gradients(params)
        if scaler.enabled and not _all_finite(params):
            self.pipeline.step.mark_overflow()  # the same on every rank: the same grads
        committed = super().finish_step(scaler, max_grad_norm)
        if committed:
            self.dp.broadcast_weights()
        return committed

    def _settle(self, inv_scale: float, clipping: bool) -> List[float]:
        squares = super()._settle(inv_scale, clipping)
        if not clipping:
            return []
        return [self.dp.global_sum(sum(squares), self.pipeline.params[0])]

    def _send_unsent(self, grad_scale: float) -> None:
        """Sends this rank's unsent chunks, then waits for every rank to have
        its updates answered (the step commits on all ranks or on none)."""
        like = self.pipeline.params[0]
        step = self.pipeline.committed_step + 1
        try:
            super()._send_unsent(grad_scale)
        except BaseException:
            try:
                agree_to_commit(self.dp, False, step, like)
            except Exception:
                pass
            raise
        agree_to_commit(self.dp, True, step, like)

    def close(self) -> None:
        """Closes this rank's session, then waits for every rank, so that the
        node leader stops an embedded daemon only when no rank uses it."""
        try:
            super().close()
        finally:
            self.dp.barrier()

    def quiesce(self) -> None:
        raise NotImplementedError(_STATES_PER_RANK.format(job=self.dp.base_job))

    def check_import(self, job: str) -> None:
        raise NotImplementedError(_STATES_PER_RANK.format(job=self.dp.base_job))

    def check_fork(self, source: str, job: str) -> None:
        raise NotImplementedError(_STATES_PER_RANK.format(job=self.dp.base_job))


def _all_finite(params: List[torch.Tensor]) -> bool:
    flags = [torch.isfinite(p.grad.detach()).all() for p in params if p.grad is not None]
    return not flags or bool(torch.stack(flags).all())
