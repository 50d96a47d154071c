"""The ranks' agreement before a data-parallel step commits (issue 24).

Each rank commits its own job (EndStep of its session). A step is committed
by a rank only once every rank has all of its updates of the step answered by
its daemon (``agree_to_commit``, after the last ParamsReady and before
EndStep): a rank that fails or dies before that point (in backward, in the
gradients' reduction, while its chunks are updated) makes every other rank
raise there, so none commits the step and the job resumes at the step before
on every rank. A killed peer is noticed at once (gloo: its connection
closes); a peer that hangs is waited for up to the process group's timeout
(``init_process_group(timeout=)``).

What stays open: a rank that dies between this agreement and its own EndStep
(a few milliseconds), or a daemon that crashes before it made the step
durable while another node's did, leaves the ranks' jobs one step apart. The
daemon keeps only its last durable manifest and cannot go back a step, so
that job is refused at the next start (the message names every rank's step,
_data_parallel.py ``check_resumed_together``). Closing it needs the daemon to
keep the previous manifest, which stays valid while no rank has begun the
next step's write-backs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._errors import FailedPrecondition

__all__ = ["agree_to_commit"]


def agree_to_commit(dp, ready: bool, step: int, like: torch.Tensor) -> None:
    """Returns when every rank is `ready` to commit `step`; else raises
    FailedPrecondition on every rank that is still there. A collective."""
    flag = torch.tensor([1 if ready else 0], dtype=torch.int32, device=dp._device(like))
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=dp.group)
    except RuntimeError as e:
        raise FailedPrecondition(
            f"fuyou.AdamW of job {dp.base_job!r} (rank {dp.rank} of {dp.world_size}): "
            f"another rank left during step {step} ({e}); no rank commits it, the job "
            f"resumes at step {step - 1}") from e
    if ready and int(flag.item()) == 0:
        raise FailedPrecondition(
            f"fuyou.AdamW of job {dp.base_job!r} (rank {dp.rank} of {dp.world_size}): "
            f"another rank failed in step {step}; no rank commits it, the job resumes at "
            f"step {step - 1}")
