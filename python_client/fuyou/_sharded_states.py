"""The optimizer states of a data-parallel job read and written as one
(issue 24): ``state_dict``, ``load_state_dict``, ``export_checkpoint`` and
``opt.state[p]`` of a ``fuyou.AdamW`` in a group of several ranks.

Each rank's job ``<job>.rank<r>-of<w>`` holds only its own chunks' states
(_data_parallel.py). What torch users expect, and what this module gives:

- ``opt.state_dict()`` is the **full** state dict on **every** rank, as
  FSDP's ``FULL_STATE_DICT`` and ZeroRedundancyOptimizer's
  ``consolidate_state_dict`` give it: torch.optim.AdamW's format over all
  parameters (``param_groups`` as torch packs them, ``state`` with each
  parameter's ``step``, ``exp_avg``, ``exp_avg_sq`` at the last committed
  step), so ``torch.optim.AdamW.load_state_dict`` of a single process
  continues from it exactly. It is a **collective**: call it on every rank
  (``sd = opt.state_dict(); if rank == 0: torch.save(sd, path)``), as with
  FSDP; called on one rank alone it raises FailedPrecondition after the
  optimizer's ``timeout`` (``all_ranks_arrive``: a count of the calls in the
  group's store, so that it never waits in a collective no other rank
  entered). Each rank reads
  its chunks' moments from its daemon and the ranks all-gather them
  (``all_gather_object``), so every rank holds the moments of the whole model
  for a moment: the same ``state_dict_max_bytes`` limit as one process keeps
  ``state`` empty above it (a warning names ``export_checkpoint``). Its
  ``"fuyou"`` entry names the base job, the world size and the whole chunk
  plan.
- ``opt.load_state_dict(sd)`` on every rank (each ``torch.load``s the same
  file): a state dict of this job at its committed step imports nothing;
  otherwise (torch.optim.AdamW's, a single-process fuyou job's, another
  world size's, this job's at another step) each rank imports the moments
  and step counts of its own chunks, with the model's current parameters as
  masters (load the model first, as with torch), one atomic import per
  rank's job. Also a collective: the ranks first check that they all loaded
  the same state dict (a digest of its moments and steps) and that none found
  it wrong, so every rank raises alike and nothing is written; an import
  that fails on one rank after others wrote is reported on every rank.
- ``opt.export_checkpoint(path, model)``: the single-process checkpoint
  (``{"model", "optimizer", "fuyou"}``, fp32 masters) of the whole model on
  every rank, gathered like ``state_dict``; a collective; ``path`` is written
  by the group's rank 0 only (one file, not one per rank; on several nodes,
  rank 0's file system). It loads into ``fuyou.AdamW(init_from=...)`` of a
  data-parallel job (each rank imports its chunks) or of a single process,
  and into ``torch.optim.AdamW``.
- ``opt.state[p]`` is **local**, as ZeroRedundancyOptimizer's and FSDP's
  ``optimizer.state`` are: it iterates over the parameters whose chunks are
  all this rank's, and ``opt.state[p]`` of another rank's parameter raises
  FailedPrecondition naming the owner and ``state_dict()`` (never a silent
  empty mapping: torch would have states there).
"""

from __future__ import annotations

import hashlib
import time
import warnings
import weakref
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import _checkpoint
from ._chunk_plan import ChunkPlan
from ._errors import FailedPrecondition, InvalidArgument
from ._optimizer_state import assemble_state_dict

__all__ = ["build_state_dict", "load_daemon_states", "export_state", "state_owner_error",
           "local_param", "all_ranks_arrive", "run_together", "WholeJob"]


# --------------------------------------------------------------------- collectives
_GATE_POLL_S = 0.005
_gates: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # dp -> [instance, calls]
_instances: Dict[str, int] = {}  # base job -> DataParallel objects gated in this process


def _group_store(group):
    """The torch.distributed store of `group` (a private table of torch's), or
    None where this torch has none: then no gate."""
    try:
        from torch.distributed import distributed_c10d as c10d
        entry = c10d._pg_map.get(group if group is not None else c10d.GroupMember.WORLD)
        return entry[1] if entry is not None else None
    except Exception:
        return None


def all_ranks_arrive(opt, what: str) -> None:
    """Waits until every rank of the group has called `what` (state_dict,
    load_state_dict, export_checkpoint) as often as this one, at most the
    optimizer's ``timeout``: a counter per call in the group's store. A call
    on one rank alone then raises FailedPrecondition on it, instead of waiting
    in a collective that no other rank enters (gloo's 30 minutes, or for ever)."""
    dp = opt._data_parallel
    store = _group_store(dp.group)
    if store is None:
        return
    gate = _gates.get(dp)
    if gate is None:  # the ranks make their optimizers in the same order
        _instances[dp.base_job] = _instances.get(dp.base_job, 0) + 1
        gate = _gates[dp] = [_instances[dp.base_job], 0]
    key = f"fuyou.collective/{dp.base_job}/{gate[0]}/{gate[1]}"
    arrived = store.add(key, 1)
    deadline = time.monotonic() + opt.timeout
    while arrived < dp.world_size:
        if time.monotonic() > deadline:
            store.add(key, -1)  # the next call on this rank waits on the same count
            raise FailedPrecondition(
                f"{what} of data-parallel job {dp.base_job!r} is a collective: only "
                f"{arrived} of the {dp.world_size} ranks called it within {opt.timeout:g} s "
                "(the optimizer's timeout); call it on every rank, e.g. "
                "sd = opt.state_dict(); if rank == 0: torch.save(sd, path)")
        time.sleep(_GATE_POLL_S)
        arrived = store.add(key, 0)
    gate[1] += 1


def run_together(dp, work: Callable[[], object], what: str) -> List[object]:
    """Runs `work` on this rank and all-gathers the results; when any rank's
    raised, every rank raises (a rank whose own work failed raises its own
    error). A collective."""
    result, error = None, None
    try:
        result = work()
    except Exception as e:  # every rank must hear of it
        error = e
    gathered: list = [None] * dp.world_size
    text = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(gathered, (text, result), group=dp.group)
    if error is not None:
        raise error
    failed = [f"rank {r}: {t}" for r, (t, _) in enumerate(gathered) if t]
    if failed:
        raise FailedPrecondition(f"{what} of job {dp.base_job!r}: another rank failed: "
                                 + "; ".join(failed))
    return [res for _, res in gathered]


class _GatheredStates:
    """``pipeline.states`` as committed_states reads it, over every rank's
    chunks: {chunk id: ([master, exp_avg, exp_avg_sq], per-segment counts)}.
    A state not gathered reads as zeros."""

    def __init__(self, per_chunk: Dict[int, tuple]):
        self._per_chunk = per_chunk

    def read(self, c):
        states, counts = self._per_chunk[c.chunk_id]
        states = [s if s is not None else torch.zeros(1).expand(c.num_elements) for s in states]
        return states, max(counts, default=0)

    def update_counts(self, c) -> List[int]:
        return list(self._per_chunk[c.chunk_id][1])


class WholeJob:
    """What _checkpoint's committed_states / torch_state / export_state and
    _sharded.export_sharded read of a pipeline (its params and their shapes,
    its plan, its states), over the whole chunk plan of every rank: `states`
    reads any chunk (read, update_counts), wherever it is."""

    def __init__(self, pipeline, all_chunks, states):
        self.params = pipeline.params
        self.param_shapes = pipeline.param_shapes
        self.plan = ChunkPlan(all_chunks, len(pipeline.params))
        self.states = states


def _gather_whole_job(opt, with_masters: bool, what: str) -> WholeJob:
    """Every rank's chunks' committed states (masters too when `with_masters`)
    on every rank. A collective; between steps."""
    dp, pipeline = opt._data_parallel, opt.pipeline

    def read_own():
        opt._mode.quiesce()  # streamed: no weight fetch in flight while states are read
        own = {}
        for c in pipeline.plan.chunks:
            (master, m, v), _t = pipeline.states.read(c)
            own[c.chunk_id] = ([master if with_masters else None, m, v],
                               pipeline.states.update_counts(c))
        return own

    per_chunk: Dict[int, tuple] = {}
    for own in run_together(dp, read_own, what):
        per_chunk.update(own)
    return WholeJob(pipeline, dp.all_chunks, _GatheredStates(per_chunk))


def _any_rank(dp, flag: bool) -> bool:
    flags: list = [None] * dp.world_size
    dist.all_gather_object(flags, bool(flag), group=dp.group)
    return any(flags)


# --------------------------------------------------------------------- state_dict
def build_state_dict(opt) -> dict:
    """The full state dict of a data-parallel `opt` on every rank (see the
    module doc). A collective."""
    opt._check_usable()
    all_ranks_arrive(opt, "opt.state_dict()")
    dp, pipeline = opt._data_parallel, opt.pipeline
    size = _checkpoint.moment_bytes(pipeline)  # every parameter's: the whole model
    limit = opt.state_dict_max_bytes
    in_step = _any_rank(dp, pipeline.step.in_step)
    included = (limit is None or size <= limit) and not in_step
    state: dict = {}
    if in_step:
        warnings.warn(
            f"fuyou.AdamW.state_dict of data-parallel job {dp.base_job!r} during a step "
            "(backward without step() on some rank): the state dict holds a reference to the "
            "job only, without the moments; call it after step() or zero_grad() on every "
            "rank", stacklevel=3)
    elif included:
        whole = _gather_whole_job(opt, with_masters=False, what="state_dict")
        state = _checkpoint.torch_state(opt, whole)
    else:
        warnings.warn(
            f"fuyou.AdamW.state_dict of data-parallel job {dp.base_job!r}: the moments take "
            f"{size / 2**30:.2f} GiB, more than state_dict_max_bytes={limit}; the state dict "
            "holds a reference to the job only. For a portable checkpoint use "
            "opt.export_checkpoint(path) on every rank, or raise opt.state_dict_max_bytes "
            "(None: no limit)", stacklevel=3)
    return assemble_state_dict(opt, state, included, dp.base_job, dp.all_chunks,
                               data_parallel={"world_size": dp.world_size})


# --------------------------------------------------------------------- load_state_dict
def _digest(state_dict: dict) -> str:
    """What the ranks compare to know they loaded the same state dict: its
    groups' sizes, the fuyou entry's job and step, and every state's step
    and moments (their fp64 sums)."""
    h = hashlib.sha256()
    h.update(repr([len(g["params"]) for g in state_dict["param_groups"]]).encode())
    extra = state_dict.get("fuyou") or {}
    h.update(repr((extra.get("job"), extra.get("committed_step"))).encode())
    for key in sorted(state_dict.get("state", {}), key=repr):
        st = state_dict["state"][key]
        parts = [repr(key), repr(float(st.get("step", 0)) if isinstance(st, dict) else st)]
        for name in ("exp_avg", "exp_avg_sq"):
            t = st.get(name) if isinstance(st, dict) else None
            if torch.is_tensor(t):
                parts.append(repr((tuple(t.shape), float(t.detach().double().sum()))))
        h.update("|".join(parts).encode())
    return h.hexdigest()


def _load_action(opt, state_dict: dict, extra: Optional[dict]) -> str:
    """"none" (this job at its committed step; a fresh job and no moments),
    "import" (the state dict's moments into every rank's chunks) or "keep"
    (this job at another step, no moments: a warning); raises for a state
    dict of another job without moments."""
    dp = opt._data_parallel
    groups = state_dict["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise InvalidArgument(
            f"load_state_dict: the state dict has {len(groups)} parameter groups, the "
            f"optimizer of job {dp.base_job!r} {len(opt.param_groups)}")
    for i, (sg, g) in enumerate(zip(groups, opt.param_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise InvalidArgument(
                f"load_state_dict: group {i} of the state dict has {len(sg['params'])} "
                f"parameters, the optimizer's {len(g['params'])}")
    moments = extra is None or bool(extra.get("state_included"))
    same_job = extra is not None and extra.get("job") == dp.base_job and \
        (extra.get("data_parallel") or {}).get("world_size") == dp.world_size
    if same_job and extra.get("committed_step") == opt.committed_step:
        mine = [(c.chunk_id, c.num_elements, str(c.dtype)) for c in dp.all_chunks]
        saved = [tuple(c) for c in extra.get("chunks", [])]
        if saved and saved != mine:
            raise InvalidArgument(
                f"state_dict was saved with a different chunk layout ({len(saved)} chunks, "
                f"chunk_bytes={extra.get('chunk_bytes')}) than this optimizer's ({len(mine)} "
                f"chunks, chunk_bytes={opt.chunk_bytes}); build the optimizer with the same "
                "model, parameter groups and chunk_bytes")
        return "none"
    if not moments:
        if same_job:
            return "keep"
        raise NotImplementedError(
            f"load_state_dict into data-parallel job {dp.base_job!r} of a state dict of job "
            f"{extra.get('job')!r} without its moments (saved over state_dict_max_bytes): a "
            "data-parallel job imports the moments the state dict holds; save it with a "
            "larger state_dict_max_bytes, or export that job with "
            "fuyou.export_checkpoint(opt, directory, model, shard_bytes=...) (a sharded "
            "checkpoint, read one chunk at a time) and start this one with init_from=directory")
    if extra is None and not state_dict.get("state") and opt.committed_step == 0 \
            and not opt.resumed:
        return "none"
    if opt.pipeline.step.in_step:
        raise FailedPrecondition(f"load_state_dict into job {dp.base_job!r} during a step: "
                                 "call it between steps")
    opt._mode.check_import(dp.base_job)  # streamed: the model registered first
    return "import"


def load_daemon_states(opt, state_dict: dict, extra: Optional[dict]) -> None:
    """Checks `state_dict` on every rank, then imports each rank's share of it
    (see the module doc). A collective."""
    all_ranks_arrive(opt, "opt.load_state_dict()")
    dp, pipeline = opt._data_parallel, opt.pipeline
    local: dict = {}  # this rank's action and import plan

    def check():  # what the ranks compare: the action and the state dict's digest
        local["action"] = _load_action(opt, state_dict, extra)
        if local["action"] == "import":  # streamed: the daemons keep their weights
            local["plan"] = _checkpoint.plan_import(opt, pipeline, state_dict,
                                                    masters_from_model=opt.offload is None)
        return local["action"], _digest(state_dict)

    views = run_together(dp, check, "load_state_dict")
    if len(set(views)) > 1:
        said = ", ".join(f"rank {r}: {a} ({d[:8]})" for r, (a, d) in enumerate(views))
        raise InvalidArgument(
            f"load_state_dict into data-parallel job {dp.base_job!r}: the ranks loaded "
            f"different state dicts ({said}); load the same one on every rank")
    if local["action"] == "keep":
        warnings.warn(
            f"state_dict is from step {extra.get('committed_step')}, but data-parallel job "
            f"{dp.base_job!r} is committed at step {opt.committed_step} in the daemons, which "
            "hold the weights and moments, and the state dict holds no moments (over "
            "state_dict_max_bytes); hyper-parameters and loss scale were loaded")
    if local["action"] != "import":
        return
    run_together(dp, lambda: _checkpoint.apply_load(pipeline, local["plan"]),
              "load_state_dict (the ranks that did not fail imported their chunks: load it "
              "again on every rank)")
    if opt.offload is not None:
        opt.offload.weights.drop_cache()


# --------------------------------------------------------------------- export
def export_state(opt, model: Optional[torch.nn.Module]) -> dict:
    """The single-process checkpoint dict of the whole data-parallel job on
    every rank (_checkpoint.export_state over every rank's chunks). A
    collective; between steps."""
    all_ranks_arrive(opt, "opt.export_checkpoint()")
    dp = opt._data_parallel
    whole = _gather_whole_job(opt, with_masters=True, what="export_checkpoint")
    checkpoint = _checkpoint.export_state(opt, whole, model)
    checkpoint["fuyou"].update(job=dp.base_job, data_parallel={"world_size": dp.world_size})
    return checkpoint


# --------------------------------------------------------------------- opt.state[p]
def local_param(opt, pidx: int) -> bool:
    """Whether every chunk holding trainable parameter `pidx` is this rank's."""
    dp = opt._data_parallel
    return all(dp.owner_of[c.chunk_id] == dp.rank
               for c in dp.all_chunks for seg in c.segments if seg.param_index == pidx)


def state_owner_error(opt, pidx: int) -> Optional[Exception]:
    """Why ``opt.state[p]`` of trainable parameter `pidx` cannot be read on this
    rank (its states are in other ranks' jobs), or None."""
    if local_param(opt, pidx):
        return None
    dp = opt._data_parallel
    owners = sorted({dp.owner_of[c.chunk_id] for c in dp.all_chunks
                     for seg in c.segments if seg.param_index == pidx})
    return FailedPrecondition(
        f"opt.state[p] on rank {dp.rank} of data-parallel job {dp.base_job!r}: the states of "
        f"parameter {pidx} (trainable order) are in the job of rank(s) "
        f"{', '.join(map(str, owners))}; opt.state holds this rank's parameters only (as "
        "ZeroRedundancyOptimizer's); read opt.state_dict()['state'] (a collective: call it on "
        "every rank) for every parameter's")


# --------------------------------------------------------------------- init_from
def import_together(opt, pipeline, plan) -> None:
    """``init_from`` of a data-parallel job: each rank writes its own chunks'
    share of the checkpoint into its new job (_checkpoint.apply_import), then
    every chunk's weights are broadcast from its owner. A collective: an
    import that fails on one rank raises on every rank."""
    run_together(opt._data_parallel, lambda: _checkpoint.apply_import(opt, pipeline, plan),
              "init_from")
    opt._data_parallel.broadcast_weights()
