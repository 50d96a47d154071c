"""A job trained by W data-parallel ranks, resumed by one process (issue 24:
resharding back to a world of one).

A single-process ``fuyou.AdamW`` on job ``J`` whose session finds ``J`` new
(committed step 0) lists the daemon's jobs of ``J`` (``plan_one_process``,
_dp_jobs.py's ``plan_world`` with a world of 1). When ranks' jobs
``J.rank<r>-of<W>`` hold the training, the resident mode imports them into
``J`` once its chunks are registered (``reshard_into_one_process``): the same
walk as a reshard between worlds (_reshard.py), run by a world of one
(``OneProcessWorld``) that reads every old rank's chunks itself, with no
collective. The safety is _reshard.py's: the old jobs are only read, the
import commits atomically, then the marker ``J.resharded-to-1`` is made (at
the old jobs' step), ``J`` goes on from that step, the old jobs are deleted,
the marker deleted; killed anywhere, the next start finishes it (an import
before the marker is run again: every chunk of ``J`` is written anew, so
``J``'s leftovers are overwritten, not deleted; after the marker, the step and
the deletions are finished, which is why a trained ``J`` is looked at too when
its marker is there).

Only the ranks' jobs on the daemon this process reaches can be read: a job
whose ranks ran on several nodes' daemons is refused (``plan_world`` names the
ranks missing). The streamed mode (``offload_params``) registers its chunks
only when the model is bound, so there this raises and says how to go on.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ._chunking import Chunk
from ._data_parallel import shard_ranges
from ._dp_jobs import WorldPlan, jobs_on_daemon, marker_job, plan_world
from ._errors import FailedPrecondition
from ._reshard import delete_on_nodes, finish_reshard, reshard

__all__ = ["OneProcessWorld", "plan_one_process", "reshard_into_one_process"]

_NODE = ""  # the one daemon this process reaches (jobs_on_daemon's node)


def plan_one_process(connection, session) -> Optional[WorldPlan]:
    """The plan of a single process whose session on ``connection.job`` found
    the job new, or trained with a reshard's marker still there (``plan_world``
    for a world of one, without the job itself among the leftovers to
    delete); None for a trained job without one, or when the daemon's admin
    API cannot be asked (a fake session). Raises when the job's worlds cannot
    be decided."""
    from . import _native
    from ._admin import admin_client
    if not isinstance(session, _native.module().Session):
        return None
    try:
        listed = admin_client(connection.address, min(connection.timeout, 10.0)).list_jobs()
    except Exception:  # the admin API refused: nothing to compare with
        return None
    job = connection.job
    jobs = jobs_on_daemon(listed, job, _NODE)
    if int(session.committed_step) != 0 and all(j.name != marker_job(job, 1) for j in jobs):
        return None  # a trained job resumes as any other (a marker: its reshard's end is due)
    plan = plan_world(job, 1, jobs)
    if plan.error is not None:
        raise FailedPrecondition(f"fuyou.AdamW of job {job!r}: {plan.error}")
    # The job itself (new, or an interrupted import's leftover) is this
    # session's: it is written anew by the import, never deleted under it.
    plan.delete_first = [j for j in plan.delete_first if j.name != job]
    return plan


class OneProcessWorld:
    """What _reshard.py asks of a data-parallel rank, for a world of one
    process that owns every chunk and reads every old rank's job itself."""

    rank = 0
    world_size = 1
    leader = True
    group = None
    node = _NODE

    def __init__(self, job: str, plan: WorldPlan, chunks: List[Chunk], address: str):
        self.base_job = job
        self.world_plan = plan
        self.all_chunks = list(chunks)
        self.owner_of: Dict[int, int] = {c.chunk_id: 0 for c in chunks}
        self.nodes = [_NODE]
        self.node_address = {_NODE: address}

    def shard_ranges(self, world: int) -> List[Tuple[int, int]]:
        return shard_ranges(self.all_chunks, world)

    def leader_of(self, node: str) -> int:
        return 0

    def _device(self, like: torch.Tensor) -> torch.device:
        return like.device


def reshard_into_one_process(opt, pipeline, connection, plan: WorldPlan) -> int:
    """Deletes `plan`'s leftovers, then imports the old ranks' states into
    this process's job when `plan` reshards (the chunks are registered);
    returns the chunks imported. Sets ``opt.resumed`` when it imported."""
    world = OneProcessWorld(connection.job, plan, pipeline.plan.chunks, connection.address)
    if plan.delete_first:
        delete_on_nodes(world, plan.delete_first, connection.timeout,
                        "the leftovers of an interrupted reshard could not be deleted")
    if plan.finishes_reshard:
        finish_reshard(world, pipeline, plan.marker, [], connection.timeout)
    if not plan.reshard:
        return 0
    if not pipeline.states.session or not pipeline.plan.chunks:
        raise FailedPrecondition(
            f"fuyou.AdamW of job {connection.job!r}: the job was trained with "
            f"{plan.source_world} data-parallel ranks, and its chunks are not registered yet")
    imported = reshard(world, pipeline, connection)
    opt.resumed = True
    return imported


def refuse_streamed(job: str, plan: Optional[WorldPlan]) -> None:
    """The streamed mode registers at bind: it cannot reshard the ranks' jobs."""
    if plan is not None and plan.finishes_reshard:
        raise FailedPrecondition(
            f"fuyou.AdamW of job {job!r}: a reshard of the job into one process was cut "
            f"short (its marker job {plan.marker.name!r} is there); start it once without "
            "offload_params to finish it")
    if plan is not None and plan.reshard:
        raise FailedPrecondition(
            f"fuyou.AdamW of job {job!r}: the job was trained with {plan.source_world} "
            f"data-parallel ranks (jobs {job}.rank<r>-of{plan.source_world}, step "
            f"{plan.source_step}); resharding them into one process with offload_params is "
            f"not implemented: resume it under torch.distributed with its {plan.source_world} "
            "ranks, or save model.state_dict() and opt.state_dict() there and load both "
            "into a new job")
