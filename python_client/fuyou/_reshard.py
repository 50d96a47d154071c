"""Resharding a data-parallel job to another world size (issue 24), and the
deletions that go with it; see _dp_jobs.py for when it happens and why the
order below keeps the committed states safe.

Every rank has registered its own chunks of the new split on its new, empty
job (``J.rank<r>-of<T>``). Then, for each old rank job in turn, the node
leader of the node whose daemon holds it (the *reader*) opens a session on
it, registers the old rank's chunks (they all exist: the chunk counts were
compared first, so nothing is added to the old job), reads each chunk's
committed fp32 master, exp_avg and exp_avg_sq and per-segment Adam counts
(ReadState), and hands them to the chunk's new owner: in its own process, or
with ``dist.send``/``dist.recv`` (every rank walks the chunks in the same
order, so each transfer pairs one reader with one owner). The owner writes
them into its pending import (WriteState, SetUpdateCount) and installs the
master into the model. A failure on either side is remembered, the walk goes
on without it, and every rank raises at the end (no rank waits for a peer
that gave up). Then every rank commits its import (one atomic manifest commit
each); only when all did, rank 0 creates the marker job, every rank's job
takes the old step, the node leaders delete the old jobs, and rank 0 deletes
the marker.

The old jobs are only read: killed anywhere before the marker exists, the
reshard is simply run again at the next start (the new jobs, still at step 0,
are deleted first). The marker holds the old jobs' committed step N; once it
exists each new job goes on from N (an empty import that sets a new job's
step: CommitImport's resume_step), so the steps count on as in an
uninterrupted run; killed before every rank did, the next start finishes it
(``finish_reshard``). Adam's counts come from the old jobs, so the updates
match an uninterrupted run. Traffic: every chunk's states cross the group
once (12 bytes a parameter).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from ._admin import admin_client
from ._chunk_states import ChunkStates
from ._chunk_weights import gather_weights, install
from ._chunking import DTYPE_CODES
from ._connection import open_session
from ._dp_jobs import JobRecord, marker_job
from ._errors import FailedPrecondition
from ._protocol import STATE_EXP_AVG, STATE_EXP_AVG_SQ, STATE_MASTER

__all__ = ["delete_on_nodes", "finish_reshard", "reshard"]


def _gather_errors(dp, mine: Optional[str]) -> List[str]:
    """Every rank's error (None: none), as "rank r: ..."; a collective (none
    for a world of one process: _reshard_one.py)."""
    if dp.world_size == 1:
        return [f"rank 0: {mine}"] if mine else []
    errors: list = [None] * dp.world_size
    dist.all_gather_object(errors, mine, group=dp.group)
    return [f"rank {r}: {e}" for r, e in enumerate(errors) if e]


def _raise_if_any(dp, mine: Optional[str], what: str) -> None:
    failed = _gather_errors(dp, mine)
    if failed:
        raise FailedPrecondition(f"fuyou.AdamW of job {dp.base_job!r} (rank {dp.rank} of "
                                 f"{dp.world_size}): {what}: " + "; ".join(failed))


def delete_on_nodes(dp, records: List[JobRecord], timeout: float, what: str) -> None:
    """Each node leader deletes the `records` its node's daemon holds (a job
    already gone is fine); a collective that raises on every rank when any
    deletion failed."""
    error = None
    if dp.leader:
        try:
            admin = None
            for j in records:
                if j.node != dp.node:
                    continue
                admin = admin or admin_client(dp.node_address[j.node], timeout)
                try:
                    admin.delete_job(j.name)
                except Exception as e:
                    if "does not exist" not in str(e):
                        raise
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    _raise_if_any(dp, error, what)


def _open_source(dp, record: JobRecord, chunks, connection, moments_dtype: int) -> ChunkStates:
    """A session on old job `record` with `chunks` (its shard) registered."""
    if record.chunks != len(chunks):
        raise FailedPrecondition(
            f"job {record.name!r} has {record.chunks} chunk(s), this model's plan gives its "
            f"rank {len(chunks)}: build the optimizer over the same model, parameter groups "
            "and chunk_bytes as the job was trained with")
    at = dp.world_plan.resume_at_step
    session = open_session(record.name, connection.num_slots, connection.slot_bytes,
                           f"reshard of {dp.base_job} by rank {dp.rank}",
                           dp.node_address[record.node], connection.timeout,
                           min(connection.timeout, 5.0),
                           **({} if at is None else {"resume_at_step": at}))
    states = ChunkStates(chunks, moments_dtype)
    states.session = session
    try:
        for c in chunks:
            if not states.register(c, gather_weights(c)):
                raise FailedPrecondition(f"job {record.name!r} has no chunk {c.chunk_id:#x}")
    except BaseException:
        session.close()
        raise
    return states


def _import(states: ChunkStates, c, master, exp_avg, exp_avg_sq, counts: List[int]) -> None:
    states.write(c, STATE_MASTER, master)
    states.write(c, STATE_EXP_AVG, exp_avg)
    states.write(c, STATE_EXP_AVG_SQ, exp_avg_sq)
    states.set_update_count(c, counts)
    with torch.no_grad():
        install(c, master.to(c.dtype))


def reshard(dp, pipeline, connection) -> int:
    """Imports the states of ``dp.world_plan``'s source jobs into this rank's
    job (see the module doc); returns the chunks imported here. A collective."""
    plan = dp.world_plan
    chunks = dp.all_chunks
    old_world = plan.source_world
    ranges = dp.shard_ranges(old_world)  # empty for an old rank that owned no chunk
    states = pipeline.states
    failure: Optional[str] = None
    imported = 0
    for old_rank, (start, end) in enumerate(ranges):
        if start == end:
            continue  # its job holds only its step marker (_sharded_mode.py)
        record = plan.source_jobs[old_rank]
        reader = dp.leader_of(record.node)
        source = None
        if dp.rank == reader:
            try:
                source = _open_source(dp, record, chunks[start:end], connection,
                                      states.moments_dtype)
            except Exception as e:
                failure = failure or f"reading {record.name!r}: {type(e).__name__}: {e}"
        try:
            for c in chunks[start:end]:
                owner = dp.owner_of[c.chunk_id]
                if dp.rank not in (reader, owner):
                    continue
                got = None
                if dp.rank == reader and source is not None and failure is None:
                    try:
                        (master, m, v), _t = source.read(c)
                        got = (master, m, v, source.update_counts(c))
                    except Exception as e:
                        failure = f"reading {record.name!r}: {type(e).__name__}: {e}"
                if reader != owner:
                    got = _hand_over(dp, c, got, reader, owner)
                    if got is None and dp.rank == owner:
                        failure = failure or f"rank {reader} could not read {record.name!r}"
                if dp.rank == owner and got is not None and failure is None:
                    try:
                        _import(states, c, *got)
                        imported += 1
                    except Exception as e:
                        failure = f"importing chunk {c.chunk_id:#x}: {type(e).__name__}: {e}"
        finally:
            if source is not None:
                source.session.close()
    if failure is None and imported:
        try:
            states.commit_import()
        except Exception as e:
            failure = f"committing the import: {type(e).__name__}: {e}"
    _raise_if_any(dp, failure, f"the reshard from {old_world} to {dp.world_size} ranks failed "
                               f"(the jobs of {old_world} ranks are unchanged)")
    _commit(dp, pipeline, plan, connection.timeout)
    return imported


def _hand_over(dp, c, got, reader: int, owner: int):
    """The reader's (master, m, v, counts) of chunk `c`, on the owner (None
    when the reader had none); the reader sends, the owner receives."""
    device = dp._device(c.segments[0].param)
    n, segs = c.num_elements, len(c.segments)
    if dp.rank == reader:
        header = torch.zeros(1 + segs, dtype=torch.int64)
        if got is not None:
            header[0] = 1
            header[1:] = torch.tensor(got[3], dtype=torch.int64)
        dist.send(header.to(device), dst=dp._src(owner), group=dp.group)
        if got is not None:
            dist.send(torch.cat(got[:3]).to(device), dst=dp._src(owner), group=dp.group)
        return None
    header = torch.empty(1 + segs, dtype=torch.int64, device=device)
    dist.recv(header, src=dp._src(reader), group=dp.group)
    header = header.cpu()
    if int(header[0]) == 0:
        return None
    flat = torch.empty(3 * n, dtype=torch.float32, device=device)
    dist.recv(flat, src=dp._src(reader), group=dp.group)
    flat = flat.cpu()
    return flat[:n], flat[n:2 * n], flat[2 * n:], [int(t) for t in header[1:]]


def _make_marker(marker: JobRecord, dp, timeout: float) -> None:
    """Creates the marker job at the old jobs' step (marker.committed_step).
    fuyoud removes a job its creating session left without a chunk, so the
    marker holds one chunk of one fp32 element."""
    session = open_session(marker.name, 1, 4096, f"reshard marker of {dp.base_job}",
                           dp.node_address[marker.node], timeout, min(timeout, 5.0))
    try:
        one = torch.zeros(1, dtype=torch.float32)
        session.register_chunk(0, 1, DTYPE_CODES[torch.float32], DTYPE_CODES[torch.float32],
                               one.view(torch.uint8).numpy())
        if marker.committed_step > 0:
            session.commit_import(resume_step=marker.committed_step)
    finally:
        session.close()


def _commit(dp, pipeline, plan, timeout: float) -> None:
    """Every rank committed its import: the marker, holding the old jobs'
    step; then finish_reshard."""
    marker = JobRecord(marker_job(dp.base_job, dp.world_size), dp.nodes[0], plan.source_step, 0)
    error = None
    if dp.rank == 0:
        try:
            _make_marker(marker, dp, timeout)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    _raise_if_any(dp, error, "the reshard's marker job could not be made (the old jobs are kept)")
    finish_reshard(dp, pipeline, marker, plan.delete_after, timeout)


def finish_reshard(dp, pipeline, marker: JobRecord, old_jobs: List[JobRecord],
                   timeout: float) -> None:
    """The end of a reshard whose marker exists, a collective: this rank's job,
    still at step 0, goes on from the marker's step (the old jobs'); once every
    rank's did, `old_jobs` are deleted, then the marker. Cut anywhere, the next
    start runs it again (_dp_jobs.py: ``finishes_reshard``)."""
    error = None
    if marker.committed_step > 0 and pipeline.committed_step == 0:
        try:
            pipeline.continue_steps_from(marker.committed_step)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    _raise_if_any(dp, error, f"the resharded jobs could not go on from step "
                             f"{marker.committed_step} (the next start sets it)")
    delete_on_nodes(dp, old_jobs, timeout,
                    "the old jobs could not all be deleted after the reshard (the next start "
                    "finishes it)")
    delete_on_nodes(dp, [marker], timeout, "the reshard's marker job could not be deleted")
