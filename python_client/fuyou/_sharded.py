"""Sharded checkpoints: written chunk by chunk from fuyoud, read one tensor at a time.

A sharded export is a directory in the Hugging Face layout (the files are
_shard_files.py's: safetensors, one shard written at a time)::

    model.safetensors.index.json     {"metadata": {...}, "weight_map": {name: shard}}
    model-00001-of-0000N.safetensors the weights of each shard
    config.json                      the model's config, for a transformers model
    optimizer.safetensors.index.json {"metadata": {...}, "weight_map": {key: shard}}
    optimizer-00001-of-0000M.safetensors
                                     {"state.<i>.exp_avg": ..., "state.<i>.exp_avg_sq": ...}

The weights are what ``from_pretrained`` reads: the model's ``state_dict``
names, fp32 master weights for the trained parameters, a tied parameter once
(under its first name), buffers and frozen parameters as they are. The index
metadata adds ``fuyou`` (job, committed_step, each name's shape and dtype), so a
reader checks a model against it before it reads a shard. The optimizer's index
holds what is small: torch's ``param_groups`` (parameters by index, as
``torch.optim.AdamW.state_dict()`` numbers them), each parameter's step count,
shape and name; its shards the moments.

Read: the same layout, a Hugging Face checkpoint (``model.safetensors`` alone,
or sharded; ``pytorch_model.bin`` shards too), and fuyou's exports of before
safetensors (``pytorch_model.bin.index.json`` with ``optimizer.bin.index.json``).

Writing reads the daemon one chunk at a time (ReadState through the session's
slot) and writes each shard as soon as it is full: memory is a shard of weights,
a shard of moments and the chunks whose parameters are not all written yet.
Reading keeps at most one weights file and one optimizer file open (mapped).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ._errors import FailedPrecondition, InvalidArgument
from ._chunk_weights import install as install_weights
from ._protocol import STATE_EXP_AVG, STATE_EXP_AVG_SQ, STATE_MASTER
from ._shard_files import ShardFiles, ShardWriter, keys_of, read_index, release_freed_memory
from ._torch_format import HYPER_KEYS, torch_indices, torch_param_groups

__all__ = ["export_sharded", "ShardReader", "import_optimizer_states", "is_sharded",
           "WEIGHTS_INDEX", "OPTIMIZER_INDEX", "release_freed_memory"]

WEIGHTS_INDEX = "model.safetensors.index.json"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
# Read too: Hugging Face's single files and .bin shards, fuyou's exports before safetensors.
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
BIN_INDEXES = ("pytorch_model.bin.index.json", "optimizer.bin.index.json")
FORMAT = "fuyou-sharded-v1"
_INDEX_SUFFIX = ".index.json"


def is_sharded(path) -> bool:
    """True when `path` is a directory with a weights index or a single weights
    file of Hugging Face's names, or an index file."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    p = Path(path)
    if p.is_dir():
        return any(p.glob("*" + _INDEX_SUFFIX)) or any((p / f).is_file() for f in SINGLE_FILES)
    return str(p).endswith(_INDEX_SUFFIX)


def _shapes_of(pipeline) -> Dict[int, torch.Size]:
    """id(param) -> shape of each trained parameter: the shapes the pipeline
    remembered when it was made (an offload_params parameter is an empty
    placeholder between uses), else the parameters' own."""
    remembered = getattr(pipeline, "param_shapes", None)
    if remembered is not None:
        return {id(p): torch.Size(s) for p, s in zip(pipeline.params, remembered)}
    return {id(p): p.shape for p in pipeline.params}


# ---------------------------------------------------------------------- writing
def _groups_json(opt, index: Dict[int, int]) -> list:
    """torch's param_groups of `opt`, as JSON takes them (betas a list)."""
    groups = torch_param_groups(opt, index)
    for saved in groups:
        saved["betas"] = list(saved["betas"])
    return groups


def export_sharded(opt, pipeline, path, model: Optional[torch.nn.Module], shard_bytes: int,
                   job: Optional[dict] = None) -> dict:
    """Writes the sharded checkpoint of `opt`'s job at its last commit into the
    directory `path` (see the module doc). `model`: names from its state_dict;
    None: parameters named by their index (as strings). `pipeline`: what is
    read (its params, plan and states: a data-parallel job's whole plan, read
    from every rank, _dp_export.py); `job`: the indexes' "fuyou" entry (by
    default opt's job and committed step). Returns the two indexes."""
    if shard_bytes < 1:
        raise InvalidArgument(f"shard_bytes must be positive, got {shard_bytes}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    params = pipeline.params
    pidx_of = {id(p): i for i, p in enumerate(params)}
    shape_of = _shapes_of(pipeline)
    index = torch_indices(opt.param_groups)

    # What goes where, in the model's order: (name, tensor or None for a trained param).
    entries: List[Tuple[str, torch.Tensor]] = []
    seen = set()
    if model is not None:
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue  # a tied parameter, under its first name
            seen.add(id(t))
            entries.append((name, t))
    else:
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    entries.append((str(index[id(p)]), p))
    missing = [i for i, p in enumerate(params) if id(p) not in seen]
    if missing:
        raise InvalidArgument(f"export_checkpoint: {len(missing)} trained parameters (first: "
                              f"index {index[id(params[missing[0]])]}) are not in the model "
                              "given; pass the model the optimizer trains")

    chunks_of: List[List[tuple]] = [[] for _ in params]
    for c in pipeline.plan.chunks:
        for seg in c.segments:
            chunks_of[seg.param_index].append((c, seg))
    unheld = [i for i, held in enumerate(chunks_of) if not held]
    if unheld:  # never written from memory no chunk filled
        raise FailedPrecondition(
            f"export_checkpoint of job {opt.job!r}: {len(unheld)} trained parameters (first: "
            f"index {index[id(params[unheld[0]])]}) are in no chunk this export reads")
    steps: List[int] = [0] * len(params)
    for c in pipeline.plan.chunks:
        for seg, t in zip(c.segments, pipeline.states.update_counts(c)):
            steps[seg.param_index] = max(steps[seg.param_index], int(t))

    shapes: Dict[str, list] = {}
    dtypes: Dict[str, str] = {}
    weight_plan, opt_plan = [], []
    for name, t in entries:
        pidx = pidx_of.get(id(t))
        if pidx is not None:
            shape = shape_of[id(t)]
            numel = shape.numel()
            weight_plan.append((name, numel * 4))
            shapes[name], dtypes[name] = list(shape), "torch.float32"
            if steps[pidx] > 0:
                i = index[id(t)]
                opt_plan += [(f"state.{i}.exp_avg", numel * 4), (f"state.{i}.exp_avg_sq", numel * 4)]
        else:
            weight_plan.append((name, t.numel() * t.element_size()))
            shapes[name], dtypes[name] = list(t.shape), str(t.dtype)
    weights = ShardWriter(directory, "model", weight_plan, shard_bytes)
    moments = ShardWriter(directory, "optimizer", opt_plan, shard_bytes)

    remaining = {c.chunk_id: len(c.segments) for c in pipeline.plan.chunks}
    cache: Dict[int, List[torch.Tensor]] = {}
    peak_chunk_bytes = 0
    for name, t in entries:
        pidx = pidx_of.get(id(t))
        if pidx is None:
            weights.add(name, t.detach().clone())
            continue
        shape = shape_of[id(t)]
        per = [torch.empty(shape.numel(), dtype=torch.float32) for _ in range(3)]
        for c, seg in chunks_of[pidx]:
            states = cache.get(c.chunk_id)
            if states is None:
                states, _t = pipeline.states.read(c)
                cache[c.chunk_id] = states
                peak_chunk_bytes = max(peak_chunk_bytes,
                                       sum(s.numel() * 12 for s in (x[0] for x in cache.values())))
            for dst, src in zip(per, states):
                dst[seg.start:seg.end] = src[seg.offset:seg.offset + seg.numel]
            remaining[c.chunk_id] -= 1
            if remaining[c.chunk_id] == 0:
                del cache[c.chunk_id]
        master, m, v = (x.view(shape) for x in per)
        weights.add(name, master)
        if steps[pidx] > 0:
            i = index[id(t)]
            moments.add(f"state.{i}.exp_avg", m)
            moments.add(f"state.{i}.exp_avg_sq", v)
        del per, master, m, v

    job = job or {"job": opt.job, "committed_step": opt.committed_step}
    weights.write_index(WEIGHTS_INDEX, {"format": "pt", "fuyou": dict(
        job, version=FORMAT, shapes=shapes, dtypes=dtypes)})
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_json_file", None)):  # a transformers model
        config.to_json_file(str(directory / "config.json"))  # what from_pretrained reads first
    names = {}
    for name, t in entries:
        if id(t) in pidx_of:
            names[str(index[id(t)])] = name
    moments.write_index(OPTIMIZER_INDEX, {"fuyou": dict(
        job, version=FORMAT,
        param_groups=_groups_json(opt, index),
        steps={str(index[id(p)]): steps[i] for i, p in enumerate(params) if steps[i] > 0},
        shapes={str(index[id(p)]): list(shape_of[id(p)]) for p in params},
        names=names)})
    return {"directory": str(directory), "weights": weights.file_of, "optimizer": moments.file_of,
            "peak_bytes": weights.peak_pending_bytes + moments.peak_pending_bytes + peak_chunk_bytes,
            "fuyou": job}


# ---------------------------------------------------------------------- reading
def _find_weights(p: Path):
    """(directory, weight_map, index metadata, path of the optimizer index that
    goes with it) of the checkpoint at `p`: a directory (its weights index, else
    Hugging Face's single file), an index file, or a single weights file."""
    single = None
    if p.is_dir():
        names = [WEIGHTS_INDEX, BIN_INDEXES[0]]
        index_path = next((p / n for n in names if (p / n).is_file()), None)
        if index_path is None:
            found = sorted(x for x in p.glob("*" + _INDEX_SUFFIX)
                           if not x.name.startswith("optimizer."))
            index_path = found[0] if found else None
        if index_path is None:
            single = next((p / n for n in SINGLE_FILES if (p / n).is_file()), None)
            if single is None:
                raise InvalidArgument(
                    f"checkpoint directory {p} has no {WEIGHTS_INDEX} (or other *.index.json) "
                    f"and no {' or '.join(SINGLE_FILES)}: not a Hugging Face or fuyou checkpoint")
    elif p.is_file() and p.name.endswith(_INDEX_SUFFIX):
        index_path = p
    elif p.is_file() and p.name.endswith((".safetensors", ".bin")):
        index_path, single = None, p
    else:
        raise InvalidArgument(f"checkpoint {p}: neither a directory with a *.index.json or "
                              "model.safetensors, nor an index file, nor a weights file")
    if single is not None:
        return single.parent, {k: single.name for k in keys_of(single)}, {}, None
    index = read_index(index_path)
    pairs = {WEIGHTS_INDEX: OPTIMIZER_INDEX, BIN_INDEXES[0]: BIN_INDEXES[1]}
    opt = pairs.get(index_path.name)
    return (index_path.parent, index["weight_map"], index.get("metadata") or {},
            index_path.parent / opt if opt else None)


class ShardReader:
    """A checkpoint in the Hugging Face layout (a directory, a weights index file
    or one weights file; see the module doc), read one tensor at a time."""

    def __init__(self, path):
        self.directory, weight_map, self.metadata, opt_path = _find_weights(Path(path))
        self.weights = ShardFiles(self.directory, weight_map)
        self.optimizer_meta: Optional[dict] = None
        self.moments: Optional[ShardFiles] = None
        if opt_path is not None and opt_path.is_file():
            opt_index = read_index(opt_path)
            self.optimizer_meta = (opt_index.get("metadata") or {}).get("fuyou")
            self.moments = ShardFiles(self.directory, opt_index["weight_map"])

    @property
    def has_optimizer_states(self) -> bool:
        return self.optimizer_meta is not None

    def has(self, name: str) -> bool:
        return name in self.weights.weight_map

    def tensor(self, name: str) -> torch.Tensor:
        return self.weights.get(name)

    def close(self) -> None:
        self.weights.close()
        if self.moments is not None:
            self.moments.close()

    # -------------------------------------------------------------- model
    def _shapes(self) -> Dict[str, torch.Size]:
        """Every tensor's shape: from the index's metadata when a fuyou export
        wrote it, else from each shard's header (safetensors) or mapped tensors
        (.bin), one file at a time."""
        known = (self.metadata.get("fuyou") or {}).get("shapes")
        if isinstance(known, dict) and set(known) >= set(self.weights.weight_map):
            return {k: torch.Size(v) for k, v in known.items()}
        shapes = {}
        for name in self.weights.files():
            keys = [k for k, f in self.weights.weight_map.items() if f == name]
            for k in keys:
                shapes[k] = self.weights.shape(k)
        self.weights.close()
        return shapes

    def check_model(self, model: torch.nn.Module) -> None:
        """Raises InvalidArgument, before anything is loaded or registered, when
        the checkpoint names a tensor the model lacks, lacks one of the model's
        parameters, or has another shape for one."""
        aliases: Dict[int, List[str]] = {}
        tensors = model.state_dict(keep_vars=True)
        for name, t in tensors.items():
            aliases.setdefault(id(t), []).append(name)
        unknown = sorted(set(self.weights.weight_map) - set(tensors))
        if unknown:
            raise InvalidArgument(
                f"checkpoint {self.directory} holds {len(unknown)} tensors the model does not "
                f"have (first: {unknown[:3]}); it is not a checkpoint of this model")
        missing = []
        for name, p in model.named_parameters():
            if not any(self.has(a) for a in aliases[id(p)]):
                missing.append(name)
        if missing:
            raise InvalidArgument(
                f"checkpoint {self.directory} lacks {len(missing)} of the model's parameters "
                f"(first: {missing[:3]}); it is not a checkpoint of this model")
        shapes = self._shapes()
        for name, t in tensors.items():
            if name in shapes and shapes[name] != t.shape:
                raise InvalidArgument(
                    f"checkpoint {self.directory}: {name!r} has shape {tuple(shapes[name])} "
                    f"there, {tuple(t.shape)} in the model; it is not a checkpoint of this model")
        self._aliases = aliases

    def parameter(self, model: torch.nn.Module, name: str, p: torch.Tensor) -> torch.Tensor:
        """The checkpoint's tensor for parameter `p` (named `name` or one of its tied aliases)."""
        for alias in [name] + [a for a in self._aliases.get(id(p), []) if a != name]:
            if self.has(alias):
                t = self.tensor(alias)
                if t.shape != p.shape:
                    raise InvalidArgument(f"checkpoint {self.directory}: {alias!r} has shape "
                                          f"{tuple(t.shape)}, the model's {tuple(p.shape)}")
                return t
        raise InvalidArgument(f"checkpoint {self.directory} has no tensor for {name!r}")


# ---------------------------------------------------------------------- import
def check_optimizer(opt, pipeline, reader: ShardReader) -> Dict[int, int]:
    """Checks the checkpoint's optimizer index against `opt`'s groups and the
    parameters' shapes; returns id(param) -> its index in the checkpoint."""
    meta = reader.optimizer_meta
    groups = meta.get("param_groups") or []
    where = f"checkpoint {reader.directory}"
    if len(groups) != len(opt.param_groups):
        raise InvalidArgument(f"{where} has {len(groups)} parameter groups, the optimizer "
                              f"{len(opt.param_groups)}")
    saved_index: Dict[int, int] = {}
    for gi, (sg, g) in enumerate(zip(groups, opt.param_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise InvalidArgument(f"{where}: group {gi} has {len(sg['params'])} parameters, "
                                  f"the optimizer's {len(g['params'])}")
        for i, p in zip(sg["params"], g["params"]):
            saved_index.setdefault(id(p), int(i))
    shapes = meta.get("shapes") or {}
    shape_of = _shapes_of(pipeline)
    for p in pipeline.params:
        i = saved_index[id(p)]
        want = list(shape_of[id(p)])
        if shapes.get(str(i)) != want:
            raise InvalidArgument(f"{where}: parameter {i} has shape {shapes.get(str(i))} there, "
                                  f"{want} in the optimizer")
        if str(i) not in (meta.get("names") or {}):
            raise InvalidArgument(f"{where}: parameter {i} has no weights in the checkpoint")
    return saved_index


def import_optimizer_states(opt, reader: ShardReader, model=None, *, install: bool = False,
                            pipeline=None) -> None:
    """Writes the checkpoint's fp32 masters, moments and step counts into `opt`'s
    new job, chunk by chunk, commits them as one import and takes the groups'
    hyper-parameters over. `install`: also copy the masters into the parameters
    (an ordinary fuyou.AdamW; an offload one's parameters are placeholders)."""
    pipeline = pipeline if pipeline is not None else opt.pipeline
    if getattr(opt, "resumed", False) or pipeline.committed_step != 0:
        raise FailedPrecondition(
            f"importing the optimizer states of {reader.directory} starts a new job, but job "
            f"{opt.job!r} already exists (committed step {pipeline.committed_step}); choose a "
            "new job name or delete the job")
    saved_index = check_optimizer(opt, pipeline, reader)
    meta = reader.optimizer_meta
    steps = {int(k): int(v) for k, v in (meta.get("steps") or {}).items()}
    names = {int(k): v for k, v in (meta.get("names") or {}).items()}
    counts = {c.chunk_id: [steps.get(saved_index[id(seg.param)], 0) for seg in c.segments]
              for c in pipeline.plan.chunks}
    # One state at a time over all chunks: one chunk's buffer and one shard in
    # memory, each shard read once per pass (a pass per parameter group's
    # chunks; the moments' shards are read twice, for exp_avg and exp_avg_sq).
    passes = ((STATE_MASTER, reader.weights, lambda i: names[i]),
              (STATE_EXP_AVG, reader.moments, lambda i: f"state.{i}.exp_avg"),
              (STATE_EXP_AVG_SQ, reader.moments, lambda i: f"state.{i}.exp_avg_sq"))
    for kind, shards, key in passes:
        for c in pipeline.plan.chunks:
            if kind != STATE_MASTER and not any(counts[c.chunk_id]):
                continue  # a new chunk's moments are already zero
            values = torch.zeros(c.num_elements, dtype=torch.float32)
            for seg, t in zip(c.segments, counts[c.chunk_id]):
                if kind == STATE_MASTER or t:
                    i = saved_index[id(seg.param)]
                    values[seg.offset:seg.offset + seg.numel] = \
                        shards.get(key(i)).reshape(-1)[seg.start:seg.end]
            pipeline.states.write(c, kind, values)
            if install and kind == STATE_MASTER:
                with torch.no_grad():
                    install_weights(c, values.to(c.dtype))
            del values
        shards.close()
        release_freed_memory()
    for c in pipeline.plan.chunks:
        if any(counts[c.chunk_id]):
            pipeline.states.set_update_count(c, counts[c.chunk_id])
    pipeline.states.commit_import()
    for group, sg in zip(opt.param_groups, meta["param_groups"]):
        hyper = {k: sg[k] for k in HYPER_KEYS if k in sg}
        if "betas" in hyper:
            hyper["betas"] = tuple(hyper["betas"])
        group.update(hyper)
