"""The sharded export of a data-parallel job (issue 24):
``fuyou.export_checkpoint(opt, path, model, shard_bytes=)`` on every rank, a
collective, writes the single-process layout of _sharded.py (the HuggingFace
index and shards of fp32 weights, the moments' index and shards) of the
**whole** job into ``path`` on rank 0, which loads as any sharded checkpoint
(``init_from=`` of a data-parallel or a single-process job, or
``fuyou.materialize``).

Each rank's job holds only its own chunks' states (the streamed mode's copies
of the other chunks hold their weights, not their moments), so rank 0 writes
and the owners read: rank 0 walks the model as _sharded.export_sharded does,
and for each chunk it needs it broadcasts the chunk's id; the chunk's owner
reads its committed states from its own daemon and sends them
(``dist.send``), the others wait for the next id. So rank 0 holds the chunks
of one parameter at a time, as a single process does, and no rank the whole
model. Rank 0 broadcasts the end (-1) when it is done or failed; a rank that
could not read its chunk sends a refusal instead, goes on serving, and every
rank raises every rank's error at the end (``run_together``). The per-segment
Adam counts (a few integers a chunk) are all-gathered first.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import _sharded
from ._errors import FailedPrecondition
from ._sharded_states import WholeJob, all_ranks_arrive, run_together

__all__ = ["export_sharded_together"]

_END = -1


def export_sharded_together(opt, path, model: Optional[torch.nn.Module], shard_bytes: int) -> dict:
    """Writes the sharded checkpoint of data-parallel `opt`'s whole job into
    the directory `path` on rank 0 (see the module doc); returns rank 0's
    summary on every rank. A collective; between steps, the mode quiesced."""
    what = "fuyou.export_checkpoint(shard_bytes=)"
    all_ranks_arrive(opt, what)
    dp, pipeline = opt._data_parallel, opt.pipeline
    counts: Dict[int, List[int]] = {}
    for own in run_together(dp, lambda: {c.chunk_id: pipeline.states.update_counts(c)
                                      for c in pipeline.plan.chunks}, what):
        counts.update(own)
    link = _ChunkLink(dp, pipeline)
    if dp.rank == 0:
        job = {"job": dp.base_job, "committed_step": opt.committed_step,
               "data_parallel": {"world_size": dp.world_size}}
        whole = WholeJob(pipeline, dp.all_chunks, _OwnersStates(link, counts))

        def work():
            try:
                return _sharded.export_sharded(opt, whole, path, model, shard_bytes, job)
            finally:
                link.announce(_END)
    else:
        work = link.serve
    return run_together(dp, work, what)[0]


class _ChunkLink:
    """Rank 0 asks for a chunk (broadcast of its id), its owner answers
    (a header, then master, exp_avg and exp_avg_sq in one tensor)."""

    def __init__(self, dp, pipeline):
        self.dp = dp
        self.pipeline = pipeline
        self.device = dp._device(pipeline.params[0])
        self.own = {c.chunk_id: c for c in pipeline.plan.chunks}

    def announce(self, chunk_id: int) -> None:
        """Rank 0: the chunk wanted next (_END: no more)."""
        wanted = torch.tensor([chunk_id], dtype=torch.int64, device=self.device)
        dist.broadcast(wanted, src=self.dp._src(0), group=self.dp.group)

    def receive(self, c) -> List[torch.Tensor]:
        """Rank 0: chunk `c`'s (master, exp_avg, exp_avg_sq) from its owner."""
        owner = self.dp.owner_of[c.chunk_id]
        self.announce(c.chunk_id)
        if owner == 0:
            states, _t = self.pipeline.states.read(self.own[c.chunk_id])
            return states
        n = c.num_elements
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(header, src=self.dp._src(owner), group=self.dp.group)
        if int(header.cpu()[0]) == 0:
            raise FailedPrecondition(f"rank {owner} could not read chunk {c.chunk_id:#x} of its job")
        flat = torch.empty(3 * n, dtype=torch.float32, device=self.device)
        dist.recv(flat, src=self.dp._src(owner), group=self.dp.group)
        flat = flat.cpu()
        return [flat[:n], flat[n:2 * n], flat[2 * n:]]

    def serve(self) -> None:
        """Any other rank: answers for its own chunks until rank 0 ends; then
        raises the first error it met (after answering every request)."""
        error: Optional[Exception] = None
        while True:
            wanted = torch.empty(1, dtype=torch.int64, device=self.device)
            dist.broadcast(wanted, src=self.dp._src(0), group=self.dp.group)
            chunk_id = int(wanted.cpu()[0])
            if chunk_id == _END:
                break
            c = self.own.get(chunk_id)
            if c is None:
                continue
            states = None
            if error is None:
                try:
                    states, _t = self.pipeline.states.read(c)
                except Exception as e:  # refused to rank 0, raised at the end
                    error = e
            header = torch.tensor([0 if states is None else 1], dtype=torch.int64)
            dist.send(header.to(self.device), dst=self.dp._src(0), group=self.dp.group)
            if states is not None:
                dist.send(torch.cat(states).to(self.device), dst=self.dp._src(0),
                          group=self.dp.group)
        if error is not None:
            raise error


class _OwnersStates:
    """``pipeline.states`` as export_sharded reads it, over the whole plan:
    each chunk from its owner, the counts gathered before."""

    def __init__(self, link: _ChunkLink, counts: Dict[int, List[int]]):
        self._link = link
        self._counts = counts

    def read(self, c):
        return self._link.receive(c), max(self._counts[c.chunk_id], default=0)

    def update_counts(self, c) -> List[int]:
        return list(self._counts[c.chunk_id])
