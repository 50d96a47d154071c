"""Sharded checkpoints: written chunk by chunk from fuyoud, read one shard at a time.

A sharded export is a directory::

    pytorch_model.bin.index.json     {"metadata": {...}, "weight_map": {name: shard}}
    pytorch_model-00001-of-0000N.bin torch.save({name: tensor}) of each shard
    optimizer.bin.index.json         {"metadata": {...}, "weight_map": {key: shard}}
    optimizer-00001-of-0000M.bin     {"state.<i>.exp_avg": ..., "state.<i>.exp_avg_sq": ...}

The weights are the HuggingFace layout (``from_pretrained`` reads them): the
model's ``state_dict`` names, fp32 master weights for the trained parameters, a
tied parameter once (under its first name), buffers and frozen parameters as they
are. The index metadata adds ``fuyou`` (job, committed_step, each name's shape
and dtype), so a reader checks a model against it before it reads a shard. The
optimizer's index holds what is small: torch's ``param_groups`` (parameters by
index, as ``torch.optim.AdamW.state_dict()`` numbers them), each parameter's step
count, shape and name; its shards the moments.

Writing reads the daemon one chunk at a time (ReadState through the session's
slot) and writes each shard as soon as it is full: memory is a shard of weights,
a shard of moments and the chunks whose parameters are not all written yet.
Reading keeps at most one weights shard and one optimizer shard in memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ._errors import FailedPrecondition, InvalidArgument
from ._chunk_weights import install as install_weights
from ._protocol import STATE_EXP_AVG, STATE_EXP_AVG_SQ, STATE_MASTER
from ._torch_format import HYPER_KEYS, torch_indices, torch_param_groups

__all__ = ["export_sharded", "ShardReader", "import_optimizer_states", "is_sharded",
           "WEIGHTS_INDEX", "OPTIMIZER_INDEX"]

WEIGHTS_INDEX = "pytorch_model.bin.index.json"
OPTIMIZER_INDEX = "optimizer.bin.index.json"
FORMAT = "fuyou-sharded-v1"
_INDEX_SUFFIX = ".index.json"


_LIBC = None


def release_freed_memory() -> None:
    """Gives the pages of freed heap memory back to the kernel (glibc's
    malloc_trim(0); nothing elsewhere). Module- and shard-sized buffers freed one
    after another otherwise stay in the process: small allocations made in
    between (gRPC, protobuf, Python) land in the freed block, the next large
    buffer no longer fits there, and the heap grows by about one buffer each
    time, so the peak RSS would follow the model's size. Measured: materializing
    128 MiB of 4 MiB modules raised the peak RSS by 118 MiB without this, 15 MiB
    with it (tests/python/materialize_worker.py)."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)


def is_sharded(path) -> bool:
    """True when `path` is a directory with a weights index, or an index file."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    p = Path(path)
    return (p.is_dir() and any(p.glob("*" + _INDEX_SUFFIX))) or str(p).endswith(_INDEX_SUFFIX)


def _shapes_of(pipeline) -> Dict[int, torch.Size]:
    """id(param) -> shape of each trained parameter: the shapes the pipeline
    remembered when it was made (an offload_params parameter is an empty
    placeholder between uses), else the parameters' own."""
    remembered = getattr(pipeline, "param_shapes", None)
    if remembered is not None:
        return {id(p): torch.Size(s) for p, s in zip(pipeline.params, remembered)}
    return {id(p): p.shape for p in pipeline.params}


# ---------------------------------------------------------------------- writing
class _ShardWriter:
    """Writes keys, in a planned order, into shards of at most `shard_bytes`
    (a tensor larger than that gets a shard of its own)."""

    def __init__(self, directory: Path, stem: str, plan: List[Tuple[str, int]], shard_bytes: int):
        self.directory = directory
        groups: List[List[str]] = []
        size = 0
        for key, nbytes in plan:
            if not groups or (size + nbytes > shard_bytes and size > 0):
                groups.append([])
                size = 0
            groups[-1].append(key)
            size += nbytes
        n = len(groups)
        self.file_of: Dict[str, str] = {}
        self._last_key: Dict[str, str] = {}
        for i, keys in enumerate(groups, 1):
            name = f"{stem}-{i:05d}-of-{n:05d}.bin"
            for key in keys:
                self.file_of[key] = name
            self._last_key[keys[-1]] = name
        self.total_size = sum(nbytes for _k, nbytes in plan)
        self._pending: Dict[str, torch.Tensor] = {}
        self.peak_pending_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key not in self.file_of:
            raise AssertionError(f"key {key!r} not planned")
        self._pending[key] = tensor
        self.peak_pending_bytes = max(self.peak_pending_bytes, sum(
            t.numel() * t.element_size() for t in self._pending.values()))
        name = self._last_key.get(key)
        if name is not None:  # the shard is full: write it and forget its tensors
            tmp = self.directory / (name + ".tmp")
            torch.save(self._pending, tmp)
            os.replace(tmp, self.directory / name)
            self._pending = {}
            release_freed_memory()

    def write_index(self, filename: str, metadata: dict) -> None:
        if self._pending:
            raise AssertionError(f"keys never written: {sorted(self._pending)[:5]}")
        index = {"metadata": dict(metadata, total_size=self.total_size),
                 "weight_map": self.file_of}
        tmp = self.directory / (filename + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, self.directory / filename)


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
    weights = _ShardWriter(directory, "pytorch_model", weight_plan, shard_bytes)
    moments = _ShardWriter(directory, "optimizer", opt_plan, shard_bytes)

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
class _OneShard:
    """The tensors of one shard file at a time."""

    def __init__(self, directory: Path, weight_map: Dict[str, str]):
        self.directory = directory
        self.weight_map = weight_map
        self._file: Optional[str] = None
        self._tensors: Optional[dict] = None
        self.loads = 0

    def get(self, key: str) -> torch.Tensor:
        name = self.weight_map[key]
        if name != self._file:
            self._tensors = None  # let the previous shard go before the next one loads
            self._file = None
            release_freed_memory()
            path = self.directory / name
            if not path.is_file():
                raise InvalidArgument(f"checkpoint {self.directory}: shard {name} (holding "
                                      f"{key!r}) is missing")
            loaded = torch.load(path, map_location="cpu")
            if not isinstance(loaded, dict):
                raise InvalidArgument(f"checkpoint shard {path} is not a dict of tensors")
            self._tensors, self._file = loaded, name
            self.loads += 1
        value = self._tensors.get(key)
        if not torch.is_tensor(value):
            raise InvalidArgument(f"checkpoint shard {self.directory / name} has no tensor "
                                  f"{key!r}, though its index says so")
        return value

    def files(self) -> List[str]:
        return sorted(set(self.weight_map.values()))

    def close(self) -> None:
        self._tensors = None
        self._file = None


def _read_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"checkpoint index {path} cannot be read: {e}") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise InvalidArgument(f"checkpoint index {path} has no weight_map (name -> shard file)")
    return index


class ShardReader:
    """A sharded checkpoint (directory or weights index file), read one shard at a time."""

    def __init__(self, path):
        p = Path(path)
        if p.is_dir():
            index_path = p / WEIGHTS_INDEX
            if not index_path.is_file():
                found = sorted(x for x in p.glob("*" + _INDEX_SUFFIX) if x.name != OPTIMIZER_INDEX)
                if not found:
                    raise InvalidArgument(f"checkpoint directory {p} has no {WEIGHTS_INDEX} (or "
                                          "other *.index.json): not a sharded checkpoint")
                index_path = found[0]
        elif p.is_file() and p.name.endswith(_INDEX_SUFFIX):
            index_path = p
        else:
            raise InvalidArgument(f"checkpoint {p}: neither a directory with a *.index.json "
                                  "nor an index file")
        self.directory = index_path.parent
        index = _read_index(index_path)
        self.metadata = index.get("metadata") or {}
        self.weights = _OneShard(self.directory, index["weight_map"])
        opt_path = self.directory / OPTIMIZER_INDEX
        self.optimizer_meta: Optional[dict] = None
        self.moments: Optional[_OneShard] = None
        if index_path.name == WEIGHTS_INDEX and opt_path.is_file():
            opt_index = _read_index(opt_path)
            self.optimizer_meta = (opt_index.get("metadata") or {}).get("fuyou")
            self.moments = _OneShard(self.directory, opt_index["weight_map"])

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
        wrote it, else by reading each shard once (one at a time)."""
        known = (self.metadata.get("fuyou") or {}).get("shapes")
        if isinstance(known, dict) and set(known) >= set(self.weights.weight_map):
            return {k: torch.Size(v) for k, v in known.items()}
        shapes = {}
        for name in self.weights.files():
            keys = [k for k, f in self.weights.weight_map.items() if f == name]
            for k in keys:
                shapes[k] = self.weights.get(k).shape
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
