"""The jobs of a data-parallel job on its nodes' daemons, and what a start with
a world size does with them (issue 24): resume, start new, or reshard.

A job ``J`` trained with W ranks is the per-rank jobs ``J.rank<r>-of<W>``; a
single-process job is ``J`` itself (a world of 1). ``JobInventory`` holds what
each node's daemon lists of them (name -> node, committed step, chunks);
``plan_world`` decides, the same on every rank, for a start with world T:

- only T's jobs (or none): resume them (or start new);
- another world's jobs hold the training (the *source*): reshard from it
  into T (_reshard.py). The jobs of every world other than the source are
  leftovers of an interrupted reshard, never trained: deleted first
  (``delete_first``). The source's jobs are deleted only after every rank
  committed its import and the marker job ``J.resharded-to-<T>`` exists
  (``delete_after``, then the marker): so an interrupted reshard leaves
  the source usable, and a finished one whose deletions were interrupted is
  recognised by its marker.

Rank jobs one step apart (a crash between the ranks' commits, see
_dp_commit.py) resume at the lower step (``resume_at_step``): fuyoud keeps
each job's manifest before its last commit and goes back to it.

Which world is the source: the one named by a marker (a reshard into it
committed); else the one world with a committed step > 0 (the import keeps a
reshard's target at step 0 until its marker exists); else, when T has no
jobs, the one other world. Anything else (two trained worlds, a source with
ranks missing or at different steps) is refused with the jobs named.

The steps go on: the marker job's committed step is the old jobs' step N,
and only after the marker exists does each new job take N (an empty import
that sets it, _reshard.py). So a marker's world has jobs at N or still at 0,
all holding the resharded states: resumed (T's own: ``finishes_reshard``) or
resharded from (another T), they go on from the marker's N, and the marker is
deleted only once every rank took N.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

__all__ = ["JobRecord", "WorldPlan", "job_of_rank", "marker_job", "jobs_on_daemon",
           "plan_world"]


@dataclass(frozen=True)
class JobRecord:
    """One job of the data-parallel job as a node's daemon lists it."""
    name: str
    node: str
    committed_step: int
    chunks: int


@dataclass
class WorldPlan:
    """What a start with world `world` does (see the module doc)."""
    world: int
    source_world: Optional[int] = None  # None: no reshard
    source_jobs: List[JobRecord] = field(default_factory=list)  # by old rank
    source_step: int = 0
    delete_first: List[JobRecord] = field(default_factory=list)
    delete_after: List[JobRecord] = field(default_factory=list)  # then the marker
    marker: Optional[JobRecord] = None  # the marker found: a reshard into its world committed
    # The step every rank job of the resumed world (or of the source) has, when a
    # crash left them one step apart: the sessions open at it (OpenSession's
    # resume_at_step), which takes the jobs one step ahead back by one commit.
    resume_at_step: Optional[int] = None
    error: Optional[str] = None

    @property
    def reshard(self) -> bool:
        return self.source_world is not None

    @property
    def finishes_reshard(self) -> bool:
        """A resume that ends a reshard into its own world (its marker found):
        the ranks' jobs still at step 0 go on from the marker's step, then the
        marker is deleted (_reshard.finish_reshard)."""
        return not self.reshard and self.marker is not None


def job_of_rank(base: str, rank: int, world: int) -> str:
    """The job of `rank` of `world` ranks (`base` itself for a world of 1)."""
    return base if world == 1 else f"{base}.rank{rank}-of{world}"


def marker_job(base: str, world: int) -> str:
    """The empty job that says a reshard of `base` into `world` ranks committed."""
    return f"{base}.resharded-to-{world}"


def jobs_on_daemon(listed: List[dict], base: str, node: str) -> List[JobRecord]:
    """The jobs of `base` among a daemon's ``list_jobs()`` answer."""
    pattern = re.compile(re.escape(base) + r"(\.rank\d+-of\d+|\.resharded-to-\d+)?$")
    return [JobRecord(j["name"], node, int(j["committed_step"]), int(j["chunks"]))
            for j in listed if pattern.match(j["name"])]


def _worlds(base: str, jobs: List[JobRecord]) -> Tuple[Dict[int, Dict[int, JobRecord]],
                                                        Dict[int, JobRecord]]:
    rank_job = re.compile(re.escape(base) + r"\.rank(\d+)-of(\d+)$")
    marker = re.compile(re.escape(base) + r"\.resharded-to-(\d+)$")
    worlds: Dict[int, Dict[int, JobRecord]] = {}
    markers: Dict[int, JobRecord] = {}
    for j in jobs:
        m = rank_job.match(j.name)
        if j.name == base:
            worlds.setdefault(1, {})[0] = j
        elif m:
            worlds.setdefault(int(m.group(2)), {})[int(m.group(1))] = j
        elif marker.match(j.name):
            markers[int(marker.match(j.name).group(1))] = j
    return worlds, markers


def _describe(world: int, ranks: Dict[int, JobRecord]) -> str:
    if world == 1:
        return f"the single-process job (step {ranks[0].committed_step})"
    steps = ", ".join(f"rank {r}: step {j.committed_step}" for r, j in sorted(ranks.items()))
    return f"{len(ranks)} of {world} rank jobs ({steps})"


def _common_step(ranks: Dict[int, JobRecord], world: int) -> Optional[int]:
    """The lower step when all `world` rank jobs exist one step apart (a crash
    between the ranks' commits), else None."""
    steps = {j.committed_step for j in ranks.values()}
    if len(ranks) != world or len(steps) != 2 or max(steps) - min(steps) != 1:
        return None
    return min(steps)


def plan_world(base: str, world: int, jobs: List[JobRecord]) -> WorldPlan:
    """What a start of job `base` with `world` ranks does with `jobs` (every
    node's, see the module doc). Pure: the same answer on every rank."""
    plan = WorldPlan(world)
    worlds, markers = _worlds(base, jobs)
    how = (f"delete the jobs of the world you do not want (fuyouctl delete-job, or "
           f"fuyou.admin_client().delete_job) and start again")
    if len(markers) > 1:
        plan.error = (f"job {base!r} has the markers of reshards into {sorted(markers)} ranks; "
                      f"{how}")
        return plan
    if markers:
        source = next(iter(markers))
        plan.marker = markers[source]
    else:
        trained = sorted(w for w, ranks in worlds.items()
                         if any(j.committed_step > 0 for j in ranks.values()))
        others = sorted(w for w in worlds if w != world)
        if not others:
            plan.resume_at_step = _common_step(worlds.get(world, {}), world)
            return plan  # resume or start new
        if len(trained) > 1:
            plan.error = (f"job {base!r} was trained with several world sizes: " + "; ".join(
                f"{w} ranks: {_describe(w, worlds[w])}" for w in trained) + f"; {how}")
            return plan
        if trained:
            source = trained[0]
        elif world not in worlds and len(others) == 1:
            source = others[0]
        else:
            plan.error = (f"job {base!r} has untrained jobs of several world sizes ("
                          + "; ".join(f"{w} ranks: {_describe(w, worlds[w])}" for w in sorted(worlds))
                          + f"), so which one to resume is not known; {how}")
            return plan
    ranks = worlds.get(source, {})
    plan.delete_first = [j for w in sorted(worlds) if w != source
                         for _r, j in sorted(worlds[w].items())]
    if source == world:  # T's own jobs: resume them, the rest are leftovers
        plan.resume_at_step = _common_step(ranks, world)
        return plan
    if plan.marker is not None:  # its world's jobs: at the marker's step, or at 0 still
        steps = {j.committed_step or plan.marker.committed_step for j in ranks.values()}
    else:
        plan.resume_at_step = _common_step(ranks, source)
        steps = {j.committed_step for j in ranks.values()}
        if plan.resume_at_step is not None:
            steps = {plan.resume_at_step}
    if len(ranks) != source or len(steps) != 1:
        plan.error = (f"job {base!r} was trained with {source} ranks, to be resharded to "
                      f"{world}, but it has {_describe(source, ranks)}: the rank jobs must all "
                      f"exist at one committed step (a rank's job lost, or a crash between "
                      f"the ranks' commits); {how}")
        return plan
    plan.source_world = source
    plan.source_jobs = [ranks[r] for r in range(source)]
    plan.source_step = steps.pop()
    plan.delete_after = list(plan.source_jobs)
    if plan.marker is not None:  # of the reshard into `source`, done long ago
        plan.delete_after.append(plan.marker)
    return plan
