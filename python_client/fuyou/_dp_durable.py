"""DurableGate: no data-parallel rank writes a step before every rank's last
step is durable (issue 24, "never lose a step").

fuyoud answers EndStep N once the step is applied; its durable commit runs
on in the background while the next step's forward runs. Until every rank's
step N is durable, some rank may still come back at N - 1 after a crash of
its node's fuyoud (or of the machine), and then every rank must go back to
N - 1 (_dp_jobs.py ``resume_at_step``: fuyoud keeps the manifest before the
last commit). A rank can go back only while it has not written since N
committed: its next write (a GradReady of N + 1, or an import into its job)
goes to the extents that still hold N - 1, and the next manifest commit
replaces the one before N.

So, after a step committed and before this rank writes its job again,
``before_writes`` (a collective, at a point every rank reaches in the same
order of collectives):

1. waits until this rank's last committed step is durable (fuyoud's
   WaitDurable; nothing is sent when EndStep's answer already said so);
2. agrees with every rank, in one all-reduce of a flag, that theirs is too.

A rank whose wait failed (its fuyoud crashed, or its durable commit failed)
tells the others and raises its own error; every other rank raises
FailedPrecondition there, before it wrote anything of the next step: every
rank's job can then go back to the step the failed rank resumes at.

After a step that committed nothing new (nothing since the last gate) it is a
no-op on every rank alike (the ranks commit together: ``agree_to_commit``),
without a collective.

Cost: the commit of N normally ends during step N + 1's forward, before the
gate runs, so the wait is ~0; the all-reduce of one int32 remains. The time
spent here is ``LoopStats.durable_wait_seconds`` (``opt.loop_stats``), the
gates passed ``durable_gates``.

Where the modes call it: the streamed mode (_sharded_streamed.py) at the
start of ``refresh_copies`` after a commit, whose imports are the first
writes after it; the resident mode (_dp_overlap.py / _sharded_mode.py)
starts it before a round's first reduction (``start``: its own wait, then
the all-reduce started, on the reductions' group, without waiting: in a
backward hook a peer may first be in a collective of the loop) and finishes
it before the step's first send (``finish``), and in step() before the sends
when no reduction ran (DDP averaged the gradients: ``before_writes``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ._errors import FailedPrecondition

__all__ = ["DurableGate"]


class DurableGate:
    """The gate of one rank's pipeline (see the module doc)."""

    def __init__(self, dp, pipeline):
        self.dp = dp
        self.pipeline = pipeline
        # The last step every rank agreed is durable: the job's committed step
        # at the start is durable on every rank (a resume takes the ranks to it).
        self._agreed = pipeline.committed_step
        self._pending = None  # (step, flag, work, own error) of an agreement started

    def before_writes(self, group=None) -> None:
        """Returns once every rank's last committed step is durable; raises on
        every rank otherwise (see the module doc): ``start`` then ``finish``.
        A collective of `group` (default: the optimizer's), but a no-op, on
        every rank alike, when nothing was committed since the last agreement:
        it may be called before every write of a step."""
        self.start(group)
        self.finish()

    def start(self, group=None) -> None:
        """Waits until this rank's last committed step is durable (its own
        daemon only) and starts the agreement: an all-reduce of `group`
        (default: the optimizer's) that ``finish`` waits for. Never waits for
        another rank, so it may run in a backward hook where a peer may first
        be in a collective of the loop on another group (the resident mode
        starts it before a round's first reduction, on the reductions'
        group, and finishes it before its first send). A no-op when nothing
        was committed since the last agreement, or once started."""
        pipeline = self.pipeline
        step = pipeline.committed_step
        if step <= self._agreed or self._pending is not None:
            return
        started = time.monotonic()
        own_error = None
        try:
            pipeline.wait_durable()
        except Exception as e:  # the daemon's error, or its stream gone
            own_error = e
        flag = torch.tensor([0 if own_error is not None else 1], dtype=torch.int32,
                            device=self.dp._device(pipeline.params[0]))
        try:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MIN,
                                   group=self.dp.group if group is None else group,
                                   async_op=True)
        except RuntimeError as e:
            work = e
        self._pending = (step, flag, work, own_error)
        pipeline.stats.durable_wait_seconds += time.monotonic() - started

    def finish(self) -> None:
        """Waits for the agreement ``start`` began (nothing to do without one)
        and raises on every rank unless every rank's step is durable: this
        rank's own error, or FailedPrecondition."""
        if self._pending is None:
            return
        step, flag, work, own_error = self._pending
        self._pending = None
        pipeline = self.pipeline
        who = (f"fuyou.AdamW of job {self.dp.base_job!r} (rank {self.dp.rank} of "
               f"{self.dp.world_size})")
        started = time.monotonic()
        try:
            if isinstance(work, Exception):
                raise work
            work.wait()
        except RuntimeError as e:
            if own_error is not None:
                raise own_error from e
            raise FailedPrecondition(
                f"{who}: another rank left before its step {step} was durable ({e}); no rank "
                f"writes step {step + 1}: restart every rank, which resume at the step every "
                "rank's job has durable") from e
        finally:
            pipeline.stats.durable_wait_seconds += time.monotonic() - started
        if own_error is not None:
            raise own_error
        if int(flag.item()) == 0:
            raise FailedPrecondition(
                f"{who}: another rank's step {step} is not durable (its fuyoud failed); no rank "
                f"writes step {step + 1}: restart every rank, which resume at the step every "
                "rank's job has durable")
        pipeline.stats.durable_gates += 1
        self._agreed = step
