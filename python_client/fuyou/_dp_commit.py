"""The ranks' agreement before a data-parallel step commits (issue 24).

Each rank commits its own job (EndStep of its session). A step is committed
by a rank only once every rank has handed all of its updates of the step to
its daemon (``agree_to_commit``, after the last GradReady was sent and before
the ParamsReady answers are waited for and EndStep): a rank that fails or dies
before that point (in backward, in the gradients' reduction, while its chunks
are sent) makes every other rank raise there, so none commits the step and
the job resumes at the step before on every rank. An update its daemon fails
after the agreement fails that rank's EndStep: as a death after the
agreement below. A killed peer is noticed at once (gloo: its connection
closes); a peer that hangs is waited for up to the process group's timeout
(``init_process_group(timeout=)``).

After the agreement, a rank that dies before its own EndStep (a few
milliseconds) leaves the ranks' jobs one step apart: the others committed
step N, its job stayed at N - 1. The next start resumes every rank at N - 1
(_dp_jobs.py ``resume_at_step``): fuyoud keeps each job's manifest before its
last commit (manifest.prev.pb) and, asked to (OpenSession.resume_at_step),
commits it again. Its states are intact: step N - 1's extents are the
shadows step N + 1's updates write, and no rank sends one before every rank
is past step N's collectives (the weights' broadcast), which the dead rank
never reaches.

A node's fuyoud that crashes after answering EndStep N but before N was
durable (its commit runs on in the background) leaves that rank's job at
N - 1 too: the other ranks must not have written since N (their step N + 1
updates go to the extents holding N - 1). _dp_durable.py's ``DurableGate``
makes sure of it: after a commit, before its next write, each rank waits for
its step N to be durable (fuyoud's WaitDurable) and agrees with every rank
that theirs is.
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
