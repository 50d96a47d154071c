"""DataParallel: one fuyou.AdamW of a torch.distributed job (issue 24).

With ``torch.distributed`` initialised over more than one rank (the default
group, or ``fuyou.AdamW(..., process_group=group)``) each rank's optimizer:

- opens its own session on the per-rank job ``<job>.rank<r>-of<w>``
  (``rank_job``), so the daemon's one-session-per-job rule holds and each rank
  resumes its own states;
- shares one fuyoud per node (``connect``): the lowest rank of each node (the
  *node leader*) finds the daemon as a single process does (``address``, the
  default socket, else the embedded one it starts) and tells the other ranks
  of its node where it is; the leader stops an embedded daemon only after every
  rank closed (``barrier``). A node is a hostname, or ``$FUYOU_NODE_ID`` where
  set (``node_identity``: two daemons on one machine, or a host whose name
  several machines share);
- lists the job's jobs on every node's daemon and decides, the same on every
  rank, whether to resume, start new or reshard from another world size
  (_dp_jobs.py, ``world_plan``; the reshard itself: _reshard.py);
- owns a contiguous run of whole chunks of the chunk plan (``take_shard``),
  balanced by bytes and the same on every rank (none for the last ranks when
  the plan has fewer chunks than ranks). Whole chunks: each chunk's
  states live in one rank's daemon files, and its I/O (read, update, write
  back) stays as large as without data parallelism;
- has each chunk's gradients averaged over the ranks during backward and
  written into ``.grad`` at its end, as DDP does (_dp_overlap.py), or, when every rank already holds the same (DDP averaged
  them), averages nothing (``average_gradients``); sends only its chunks, and
  after the commit broadcasts each chunk's new weights from its owner
  (``broadcast_weights``).

``process_group=False`` opts out: a plain single-process optimizer on `job`
itself, though torch.distributed is initialised.

Collectives use the group's backend: CUDA tensors for NCCL, CPU ones for gloo.
"""

from __future__ import annotations

import os
import socket
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ._chunk_weights import gather_weights, install
from ._chunking import Chunk
from ._dp_jobs import WorldPlan, jobs_on_daemon, plan_world
from ._errors import FailedPrecondition, InvalidArgument
from ._reshard import delete_on_nodes
from .daemon import resolve_address

__all__ = ["DataParallel", "for_optimizer", "node_identity", "shard_ranges", "split_by_bytes"]


def node_identity() -> str:
    """The node this process runs on, which decides the ranks that share one
    fuyoud: ``$FUYOU_NODE_ID`` when set and not empty, else the hostname."""
    return os.environ.get("FUYOU_NODE_ID", "").strip() or socket.gethostname()

BUCKET_BYTES = 32 << 20  # gradients all-reduced together


def for_optimizer(process_group, job: str, offload_params: bool,
                  init_from) -> Optional["DataParallel"]:
    """The data-parallel side of an optimizer, or None: `process_group` False
    (the opt-out), torch.distributed not initialised (and no `process_group`),
    or a group of one rank (each of which trains as a single process, on `job`
    itself)."""
    if process_group is False:
        return None
    if process_group is True:
        raise InvalidArgument(
            f"fuyou.AdamW of job {job!r}: process_group=True is not a process group; pass "
            "None (the default group when torch.distributed is initialised), a group, or "
            "False (a single-process optimizer)")
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return None
    return DataParallel(group, job)


def split_by_bytes(sizes: List[int], parts: int) -> List[Tuple[int, int]]:
    """`parts` contiguous ranges [start, end) over items of `sizes` whose byte
    totals are as even as the items allow (each boundary at the prefix
    nearest its share), none empty while there are items enough. With fewer
    items than parts (a small model at the default chunk_bytes) item i is
    part i's and the last parts are empty: a rank may own no chunk, and the
    chunk plan never depends on the world size (a job reshards between any
    two)."""
    n = len(sizes)
    if n < parts:
        return [(min(r, n), min(r + 1, n)) for r in range(parts)]
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + int(s))
    total = prefix[-1]
    bounds = [0]
    for r in range(1, parts):
        target = total * r / parts
        lo, hi = bounds[-1] + 1, n - (parts - r)  # every range keeps one item
        best = min(range(lo, hi + 1), key=lambda k: (abs(prefix[k] - target), k))
        bounds.append(best)
    bounds.append(n)
    return [(bounds[r], bounds[r + 1]) for r in range(parts)]


def shard_ranges(chunks: List[Chunk], world: int) -> List[Tuple[int, int]]:
    """The [start, end) of each rank's run of `chunks` with `world` ranks (one
    range with one rank), balanced by bytes: how a job trained so split them."""
    if world == 1:
        return [(0, len(chunks))]
    return split_by_bytes([c.nbytes for c in chunks], world)


class DataParallel:
    """The rank's place in `group` and the collectives of its optimizer."""

    def __init__(self, group, job: str):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.base_job = job
        self.backend = dist.get_backend(group)
        self.all_chunks: List[Chunk] = []
        self.owner_of: dict = {}  # chunk id -> group rank
        self.leader = False  # this rank found the node's daemon for the others
        self.node = ""  # node_identity() of this rank
        self.nodes: List[str] = []  # node of each group rank
        self.node_address: dict = {}  # node -> its daemon's gRPC target
        self.world_plan = WorldPlan(self.world_size)  # resume, new, or reshard
        self.steps_averaged = 0  # steps whose gradients this side averaged (not DDP)

    # ------------------------------------------------------------ naming, shard
    @property
    def rank_job(self) -> str:
        """This rank's job: ``<job>.rank<r>-of<w>``."""
        return f"{self.base_job}.rank{self.rank}-of{self.world_size}"

    def take_shard(self, chunks: List[Chunk]) -> List[Chunk]:
        """Remembers the whole plan and returns this rank's chunks."""
        self.all_chunks = list(chunks)
        ranges = split_by_bytes([c.nbytes for c in chunks], self.world_size)
        for r, (start, end) in enumerate(ranges):
            for c in chunks[start:end]:
                self.owner_of[c.chunk_id] = r
        start, end = ranges[self.rank]
        return list(chunks[start:end])

    def shard_ranges(self, world: int) -> List[Tuple[int, int]]:
        """The [start, end) of each rank's chunks in ``all_chunks`` with `world`
        ranks: the split of a job trained so (``shard_ranges``)."""
        return shard_ranges(self.all_chunks, world)

    def leader_of(self, node: str) -> int:
        """The group rank that leads `node`."""
        return self.nodes.index(node)

    # ------------------------------------------------------------ the node's daemon
    def connect(self, address: Optional[str], embedded: Optional[bool], timeout: float):
        """(gRPC target, embedded daemon held or None) of this node's fuyoud, as
        ``daemon.resolve_address`` gives it to the node leader; a collective.
        Also lists the job's jobs on every node and decides ``world_plan``
        (refused on every rank when it cannot be decided), deleting the
        leftovers of an interrupted reshard."""
        nodes: list = [None] * self.world_size
        dist.all_gather_object(nodes, node_identity(), group=self.group)
        self.nodes, me = nodes, nodes[self.rank]
        self.node = me
        self.leader = nodes.index(me) == self.rank
        found, daemon, error, jobs = None, None, None, []
        if self.leader:
            try:
                found, daemon = resolve_address(address, embedded)
                jobs = self._jobs_on(found, me)
            except Exception as e:  # every rank must hear of it
                error = f"{type(e).__name__}: {e}"
        answers: list = [None] * self.world_size
        dist.all_gather_object(answers, (me, found, error, jobs), group=self.group)
        errors = [f"rank {r}: {a[2]}" for r, a in enumerate(answers) if a[2]]
        self.node_address = {a[0]: a[1] for a in answers if a[1]}
        self.world_plan = plan_world(self.base_job, self.world_size,
                                     [j for a in answers for j in a[3]])
        if not errors and self.world_plan.error:
            errors = [self.world_plan.error]
        if errors:
            if daemon is not None:
                from ._lifetime import release_daemon
                release_daemon(daemon)
            raise FailedPrecondition(
                f"fuyou.AdamW of job {self.base_job!r} (rank {self.rank} of "
                f"{self.world_size}): " + "; ".join(errors))
        try:
            delete_on_nodes(self, self.world_plan.delete_first, timeout,
                            "the leftovers of an interrupted reshard could not be deleted")
        except BaseException:
            if daemon is not None:
                from ._lifetime import release_daemon
                release_daemon(daemon)
            raise
        return self.node_address[me], daemon

    def _jobs_on(self, target: str, node: str) -> list:
        """The job's jobs on the daemon at `target` (none when its admin API
        refuses: the sessions then decide alone)."""
        from ._admin import admin_client
        try:
            listed = admin_client(target).list_jobs()
        except Exception:
            return []
        return jobs_on_daemon(listed, self.base_job, node)

    def open_together(self, open_session):
        """``open_session()`` on every rank; when any rank's fails, every rank
        raises (its own session closed) instead of waiting in a collective for
        a rank that left. A collective."""
        session, error = None, None
        try:
            session = open_session()
        except Exception as e:
            error = e
        errors: list = [None] * self.world_size
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: "
                               f"{error}", group=self.group)
        if error is not None:
            raise error
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed:
            try:
                session.close()
            except Exception:
                pass
            raise FailedPrecondition(
                f"fuyou.AdamW of job {self.base_job!r}: another rank could not open its "
                "session: " + "; ".join(failed))
        return session

    def check_resumed_together(self, resumed: bool, committed_step: int) -> None:
        """Every rank's job is new, or every one resumed at the same step; else
        raises on every rank (a collective)."""
        views: list = [None] * self.world_size
        dist.all_gather_object(views, (bool(resumed), int(committed_step)), group=self.group)
        if len(set(views)) > 1:
            said = ", ".join(f"rank {r}: {'resumed at step ' + str(s) if res else 'new'}"
                             for r, (res, s) in enumerate(views))
            raise FailedPrecondition(
                f"fuyou.AdamW of job {self.base_job!r}: the per-rank jobs disagree ({said}); "
                "each rank must resume its own job at the same committed step (a rank's "
                "job lost or a crash between the ranks' commits); delete the jobs to start "
                "over")

    def barrier(self) -> None:
        """Waits for every rank (before the node leader stops its daemon); does
        nothing once the process group is gone (at interpreter exit)."""
        try:
            if dist.is_initialized():
                dist.barrier(group=self.group)
        except Exception:
            pass

    # ------------------------------------------------------------ collectives
    def _device(self, like: torch.Tensor) -> torch.device:
        if self.backend == "nccl":
            return like.device if like.is_cuda else torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _src(self, group_rank: int) -> int:
        """The global rank of `group_rank` (what broadcast's src takes)."""
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
        return get(self.group, group_rank)

    def average_gradients(self, params: List[torch.Tensor]) -> bool:
        """Makes every rank's ``.grad`` the average over the ranks, as DDP does: a
        parameter some rank has a gradient for takes zeros on the others; one no
        rank has keeps None. When every rank's gradients are already the same
        (DDP averaged them) nothing is reduced; the test compares, per bucket,
        the sum, the sum of squares and a position-weighted sum. Returns whether
        it reduced."""
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        dev = self._device(params[0]) if params else torch.device("cpu")
        has = has.to(dev)
        dist.all_reduce(has, group=self.group)
        present = [p for p, n in zip(params, has.tolist()) if n > 0]
        partial = [p for p, n in zip(params, has.tolist()) if 0 < n < self.world_size]
        for p in partial:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buckets = _buckets(present)
        flats = [torch.cat([p.grad.detach().reshape(-1) for p in b]).to(dev) for b in buckets]
        if not partial and self._already_same(flats, dev):
            return False
        for b, flat in zip(buckets, flats):
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world_size)
            pos = 0
            for p in b:
                n = p.grad.numel()  # a streamed parameter is a placeholder
                p.grad.detach().copy_(flat[pos:pos + n].view_as(p.grad))
                pos += n
        self.steps_averaged += 1
        return True

    def _already_same(self, flats: List[torch.Tensor], dev: torch.device) -> bool:
        if not flats:
            return True
        sums = []
        for flat in flats:
            f = flat.double()
            weights = torch.arange(f.numel(), device=f.device, dtype=torch.float64) % 251 + 1
            sums.append(torch.stack((f.sum(), f.square().sum(), torch.dot(f, weights))))
        mine = torch.cat(sums).to(dev)
        lowest, highest = mine.clone(), mine.clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=self.group)
        return torch.equal(lowest, highest)  # a nan anywhere: reduced (and overflows)

    def global_sum(self, value: float, like: torch.Tensor) -> float:
        """`value` summed over the ranks (fp64)."""
        t = torch.tensor([value], dtype=torch.float64, device=self._device(like))
        dist.all_reduce(t, group=self.group)
        return float(t.item())

    def broadcast_weights(self) -> None:
        """Every chunk's weights from its owner into every rank's parameters."""
        with torch.no_grad():
            for c in self.all_chunks:
                owner = self.owner_of[c.chunk_id]
                param = c.segments[0].param
                buf = gather_weights(c).to(self._device(param))
                dist.broadcast(buf, src=self._src(owner), group=self.group)
                if owner != self.rank:
                    install(c, buf.to(param.device))


def _buckets(params: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """`params` in order, grouped by gradient dtype and device into buckets of
    about BUCKET_BYTES."""
    out: List[List[torch.Tensor]] = []
    open_by_kind: dict = {}  # (dtype, device) -> [bucket, bytes]
    for p in params:
        kind = (p.grad.dtype, p.grad.device)
        entry = open_by_kind.get(kind)
        if entry is None or entry[1] >= BUCKET_BYTES:
            entry = open_by_kind[kind] = [[], 0]
            out.append(entry[0])
        entry[0].append(p)
        entry[1] += p.grad.numel() * p.grad.element_size()
    return out
