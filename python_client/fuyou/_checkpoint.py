"""Export a fuyou.AdamW job to a PyTorch checkpoint, and start a job from one.

A checkpoint is a dict (``torch.save`` of it is what ``export_checkpoint`` writes)::

    {"model": {name or param index: fp32 master weights},
     "optimizer": a torch.optim.AdamW state_dict (state: step, exp_avg, exp_avg_sq),
     "fuyou": {"job": ..., "committed_step": ...}}

The states move between the daemon and the job through the session's shared-memory
slots (ReadState / WriteState), never through gRPC messages. An import is written
as one pending change of the job that CommitImport makes durable at once; it does
not advance the job's committed step.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ._chunking import Chunk
from ._errors import FailedPrecondition, InvalidArgument
from ._groups import unsupported_setting
from . import _sharded
from ._chunk_weights import install
from ._pipeline import ChunkPipeline
from ._protocol import STATE_EXP_AVG, STATE_EXP_AVG_SQ, STATE_MASTER
from ._torch_format import HYPER_KEYS, torch_indices, torch_param_groups

__all__ = ["export_state", "torch_state", "committed_states", "moment_bytes", "plan_import",
           "apply_import", "apply_load"]

# --------------------------------------------------------------------- export
def moment_bytes(pipeline: ChunkPipeline) -> int:
    """Bytes of fp32 exp_avg and exp_avg_sq of every trainable parameter."""
    return sum(2 * 4 * math.prod(shape) for shape in pipeline.param_shapes)


def committed_states(opt, pipeline: ChunkPipeline, indices: Optional[List[int]] = None):
    """Per trainable parameter (`pipeline.params` order; `indices`: only those) its
    fp32 (master, exp_avg, exp_avg_sq) shaped like the parameter and its Adam step
    count, read from the daemon at the last committed step: {pidx: (master, m, v, t)}.
    Between steps only. A parameter spanning chunks updated a different number of
    times takes the largest count (a warning says so)."""
    shapes = pipeline.param_shapes  # offload_params: the parameters are placeholders
    wanted = range(len(shapes)) if indices is None else indices
    per_param = {pidx: [torch.empty(math.prod(shapes[pidx]), dtype=torch.float32)
                        for _ in range(3)] for pidx in wanted}
    steps: Dict[int, set] = {pidx: set() for pidx in wanted}
    chunks = pipeline.plan.chunks if indices is None else list(
        {c.chunk_id: c for pidx in wanted for c in pipeline.plan.of_param(pidx)}.values())
    for c in chunks:
        states, _t = pipeline.states.read(c)
        # Adam's t per segment: a parameter without a gradient in some step has
        # fewer updates than the others of its chunk, as in torch.
        for seg, t in zip(c.segments, pipeline.states.update_counts(c)):
            if seg.param_index not in per_param:
                continue
            for dst, src in zip(per_param[seg.param_index], states):
                dst[seg.start:seg.end] = src[seg.offset:seg.offset + seg.numel]
            steps[seg.param_index].add(t)
    out = {}
    for pidx in wanted:
        counts = steps[pidx]
        if len(counts) > 1:
            warnings.warn(f"parameter {pidx} (trainable order) spans chunks updated "
                          f"{sorted(counts)} times; taken with step {max(counts)}")
        master, m, v = (t.view(shapes[pidx]) for t in per_param[pidx])
        out[pidx] = (master, m, v, max(counts, default=0))
    return out


def torch_state(opt, pipeline: ChunkPipeline, states=None) -> Dict[int, dict]:
    """torch.optim.AdamW's ``state`` of `opt` at the last committed step: per
    parameter index (as torch's state_dict numbers them) ``{"step": tensor(float),
    "exp_avg", "exp_avg_sq"}``; parameters never updated have none, as in torch."""
    if states is None:
        states = committed_states(opt, pipeline)
    index = torch_indices(opt.param_groups)
    state: Dict[int, dict] = {}
    for pidx, p in enumerate(pipeline.params):
        _master, m, v, t = states[pidx]
        if t == 0:
            continue  # never updated: torch.optim.AdamW has no state for it either
        state[index[id(p)]] = {"step": torch.tensor(float(t)), "exp_avg": m, "exp_avg_sq": v}
    return state


def export_state(opt, pipeline: ChunkPipeline, model: Optional[torch.nn.Module] = None) -> dict:
    """The checkpoint dict of `opt` (its param_groups, job and committed_step) and
    its chunks' `pipeline` at the last committed step (see the module doc).
    `model` given: "model" is its state_dict with the trainable parameters replaced
    by their fp32 master weights; else "model" maps param index -> fp32 weights."""
    params = pipeline.params  # trainable, by param_index
    states = committed_states(opt, pipeline)
    index = torch_indices(opt.param_groups)
    state = torch_state(opt, pipeline, states)
    # id(param) -> fp32 master, shaped like the param
    masters = {id(p): states[pidx][0] for pidx, p in enumerate(params)}
    groups = torch_param_groups(opt, index)

    if model is not None:
        weights = {}
        for name, t in model.state_dict(keep_vars=True).items():
            master = masters.get(id(t))
            weights[name] = master.clone() if master is not None else t.detach().clone()
    else:
        weights = {}
        for g in opt.param_groups:
            for p in g["params"]:
                i = index[id(p)]
                if i not in weights:
                    master = masters.get(id(p))
                    weights[i] = master.clone() if master is not None else p.detach().float().clone()
    return {"model": weights,
            "optimizer": {"state": state, "param_groups": groups},
            "fuyou": {"job": opt.job, "committed_step": opt.committed_step}}


# --------------------------------------------------------------------- import
@dataclass
class ChunkImport:
    chunk: Chunk
    master: Optional[torch.Tensor]  # fp32, or None: the weights registered from the model
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: List[int]  # per segment of the chunk


@dataclass
class ImportPlan:
    chunks: List[ChunkImport]
    hyper: List[dict]  # per param group: the hyper-parameters to take over


def _load(init_from) -> Tuple[dict, Optional[dict]]:
    source = init_from
    if isinstance(init_from, (str, os.PathLike)):
        source = torch.load(init_from, map_location="cpu")
    if not isinstance(source, dict):
        raise InvalidArgument(f"init_from must be a checkpoint path or dict, not {type(source).__name__}")
    if "state" in source and "param_groups" in source:
        return source, None
    if isinstance(source.get("optimizer"), dict):
        return source["optimizer"], source.get("model")
    raise InvalidArgument("init_from is neither a torch.optim.AdamW state_dict (state, "
                          "param_groups) nor a checkpoint with an 'optimizer' entry")


def _tensor(value, what: str, shape: torch.Size) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise InvalidArgument(f"checkpoint: {what} is not a tensor")
    if value.shape != shape:
        raise InvalidArgument(f"checkpoint: {what} has shape {tuple(value.shape)}, but the "
                              f"parameter has shape {tuple(shape)}")
    return value.detach().to(torch.float32).reshape(-1)


@dataclass
class ShardedImportPlan:
    reader: object  # _sharded.ShardReader: read chunk by chunk when applied


def plan_import(opt, pipeline: ChunkPipeline, init_from, masters_from_model: bool = False):
    """Validates a checkpoint against `opt`'s parameter groups and `pipeline`'s
    parameters and chunks and builds the
    per-chunk states to write. `masters_from_model`: every chunk's master weights
    are the model's current parameters (load_state_dict into a job that may hold
    other weights), unless the checkpoint has weights by parameter index. Talks to no daemon: a bad checkpoint raises
    InvalidArgument before anything is written. A sharded checkpoint (a
    directory or index file, see _sharded.py) is checked from its indexes and
    read chunk by chunk, one shard at a time, when the plan is applied."""
    if _sharded.is_sharded(init_from):
        reader = _sharded.ShardReader(init_from)
        if not reader.has_optimizer_states:
            raise InvalidArgument(f"init_from={str(init_from)!r} is a sharded checkpoint without "
                                  f"optimizer states ({_sharded.OPTIMIZER_INDEX})")
        _sharded.check_optimizer(opt, pipeline, reader)
        return ShardedImportPlan(reader)
    saved, model = _load(init_from)
    groups = saved["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise InvalidArgument(f"checkpoint has {len(groups)} parameter groups, the optimizer "
                              f"{len(opt.param_groups)}")
    saved_index: Dict[int, int] = {}  # id(param) -> index in the checkpoint
    for gi, (sg, g) in enumerate(zip(groups, opt.param_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise InvalidArgument(f"checkpoint group {gi} has {len(sg['params'])} parameters, "
                                  f"the optimizer's {len(g['params'])}")
        why = unsupported_setting(sg)
        if why is not None:
            raise InvalidArgument(f"checkpoint group {gi}: {why}")
        for i, p in zip(sg["params"], g["params"]):
            saved_index.setdefault(id(p), i)
    masters_by_index = model if model and all(isinstance(k, int) for k in model) else None

    per_param = []  # pidx -> (master or None, m, v, step)
    for p, shape in zip(pipeline.params, pipeline.param_shapes):  # p: a placeholder, streamed
        i = saved_index[id(p)]
        st = saved["state"].get(i)
        master = None
        if masters_by_index is not None and i in masters_by_index:
            master = _tensor(masters_by_index[i], f"model weights of parameter {i}", shape)
        if not st:
            zeros = torch.zeros(math.prod(shape), dtype=torch.float32)
            per_param.append((master, zeros, zeros, 0))
            continue
        m = _tensor(st.get("exp_avg"), f"exp_avg of parameter {i}", shape)
        v = _tensor(st.get("exp_avg_sq"), f"exp_avg_sq of parameter {i}", shape)
        step = float(st.get("step", 0))
        if step < 0 or step != int(step):
            raise InvalidArgument(f"checkpoint: step of parameter {i} is {step}, not a count")
        per_param.append((master, m, v, int(step)))

    chunks = []
    for c in pipeline.plan.chunks:
        # Adam's t per segment: parameters of one chunk may have different steps
        # (one without a gradient in some steps), as torch keeps them.
        steps = [per_param[seg.param_index][3] for seg in c.segments]
        has_master = masters_from_model or any(
            per_param[seg.param_index][0] is not None for seg in c.segments)
        master = torch.empty(c.num_elements, dtype=torch.float32) if has_master else None
        m = torch.empty(c.num_elements, dtype=torch.float32)
        v = torch.empty(c.num_elements, dtype=torch.float32)
        for seg in c.segments:
            pm, pmo, pv, _ = per_param[seg.param_index]
            dst = slice(seg.offset, seg.offset + seg.numel)
            m[dst] = pmo[seg.start:seg.end]
            v[dst] = pv[seg.start:seg.end]
            if master is not None:
                master[dst] = (pm if pm is not None else
                               seg.param.detach().float().reshape(-1))[seg.start:seg.end]
        chunks.append(ChunkImport(c, master, m, v, steps))
    hyper = [{k: sg[k] for k in HYPER_KEYS if k in sg} for sg in groups]
    return ImportPlan(chunks, hyper)


def apply_import(opt, pipeline: ChunkPipeline, plan) -> None:
    """Writes the planned states into the freshly created job of `pipeline` (attached
    to its session), commits them, and takes the groups' hyper-parameters over into
    `opt`. The job must be new: importing over trained states would silently mix
    two runs."""
    if isinstance(plan, ShardedImportPlan):
        try:
            _sharded.import_optimizer_states(opt, plan.reader, install=True, pipeline=pipeline)
        finally:
            plan.reader.close()
        return
    if opt.resumed or pipeline.committed_step != 0:
        raise FailedPrecondition(
            f"init_from starts a new job, but job {opt.job!r} already exists (committed step "
            f"{pipeline.committed_step}); choose a new job name or delete the job")
    for ci in plan.chunks:
        if ci.master is not None:
            pipeline.states.write(ci.chunk, STATE_MASTER, ci.master)
        if any(ci.steps):  # a new chunk's moments and counts are already zero
            pipeline.states.write(ci.chunk, STATE_EXP_AVG, ci.exp_avg)
            pipeline.states.write(ci.chunk, STATE_EXP_AVG_SQ, ci.exp_avg_sq)
            pipeline.states.set_update_count(ci.chunk, ci.steps)
    pipeline.states.commit_import()
    with torch.no_grad():
        for ci in plan.chunks:
            if ci.master is not None:
                install(ci.chunk, ci.master.to(ci.chunk.dtype))
    for group, hyper in zip(opt.param_groups, plan.hyper):
        group.update(hyper)


def apply_load(pipeline: ChunkPipeline, plan: ImportPlan) -> None:
    """load_state_dict's import into a job that may hold trained states: every
    chunk's master weights (those the plan has), moments and per-segment step counts (zeros where the
    state dict has none, as torch starts such a parameter afresh) are replaced in
    one atomic CommitImport; the committed step stays. Between steps only."""
    if pipeline.step.in_step:
        raise FailedPrecondition("load_state_dict during a step: call it between steps")
    for ci in plan.chunks:
        if ci.master is not None:  # None: offload_params keeps the daemon's weights
            pipeline.states.write(ci.chunk, STATE_MASTER, ci.master)
        pipeline.states.write(ci.chunk, STATE_EXP_AVG, ci.exp_avg)
        pipeline.states.write(ci.chunk, STATE_EXP_AVG_SQ, ci.exp_avg_sq)
        pipeline.states.set_update_count(ci.chunk, ci.steps)
    pipeline.states.commit_import()
