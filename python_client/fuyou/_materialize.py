"""Building a model that fits nowhere but the SSD: ``init_empty`` and ``materialize``.

::

    with fuyou.init_empty(job="big"):
        model = GPT(config)              # parameters hold no memory
    opt = fuyou.AdamW(model.parameters(), offload_params=True)   # job "big"
    fuyou.materialize(model, opt)        # or checkpoint="ckpt/" to load one
    handle = fuyou.stream_parameters(model, opt, device_budget="2GiB")

Inside ``init_empty`` every parameter a module registers is moved to the ``meta``
device, so the modules' own initialisation (``reset_parameters`` in their
``__init__``, ``nn.init`` calls) costs nothing. torch 1.13 cannot turn a meta
tensor into a CPU one in place (``Parameter.data = cpu_tensor`` is refused
between meta and CPU), and the optimizer must hold the parameters that the model
holds; so when the block ends each meta parameter is replaced, in every module
that holds it (ties are kept), by an *empty* CPU parameter: the right shape,
dtype and ``requires_grad``, whose storage is a single element seen through zero
strides. Such a parameter holds no memory and must not be read: ``materialize``
gives it storage. Cast the model (``.to(torch.bfloat16)``) inside the block,
where it is free; outside it a cast would allocate every parameter.

``materialize`` goes through ``model.modules()`` one module at a time: it gives
the module's own parameters (``recurse=False``) real CPU storage, fills them
(``init(module)`` under ``torch.no_grad()``, else the module's ``reset_parameters()``, or the tensors of a
sharded checkpoint) and hands them to ``optimizer.offload.register_module``,
which sends them to fuyoud and releases their storage. Host memory is one module
and one checkpoint shard, never the model.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.nn as nn

from . import _sharded
from ._errors import InvalidArgument
from ._host_malloc import keep_large_buffers_mmapped

__all__ = ["init_empty", "materialize", "is_empty", "job_of"]

_EMPTY = "_fuyou_empty"   # attribute of a parameter that init_empty left without storage
_JOB = "_fuyou_job"       # attribute: the job given to init_empty
_state = threading.local()


def is_empty(p: torch.Tensor) -> bool:
    """True for a parameter that ``init_empty`` built and nothing materialized yet."""
    return bool(getattr(p, _EMPTY, False)) or p.is_meta


def job_of(params) -> Optional[str]:
    """The job given to ``init_empty`` for these parameters (tensors, or dicts of
    parameter groups), when they all name the same one; else None."""
    jobs = set()
    for item in params:
        tensors = item["params"] if isinstance(item, dict) else [item]
        if torch.is_tensor(tensors):
            tensors = [tensors]
        for p in tensors:
            jobs.add(getattr(p, _JOB, None))
    return jobs.pop() if len(jobs) == 1 else None


def _empty_like(p: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of p's shape and dtype over one element of storage."""
    one = torch.empty(1, dtype=p.dtype)
    return one.as_strided(tuple(p.shape), (0,) * p.dim())


@contextlib.contextmanager
def init_empty(job: Optional[str] = None) -> Iterator[None]:
    """Modules built in the block get parameters that hold no memory (see the
    module doc): ``meta`` tensors while the block runs, empty CPU parameters of
    the same shape after it. Buffers are created as usual (they are small and
    often computed, e.g. rotary frequencies) and stay on the CPU.

    ``job``: recorded on the parameters, so that ``fuyou.AdamW(params,
    offload_params=True)`` opened over them without ``job=`` takes this one.
    Not thread-safe with other threads building modules at the same time."""
    if getattr(_state, "active", False):
        raise InvalidArgument("fuyou.init_empty blocks do not nest")
    keep_large_buffers_mmapped()  # each parameter built on the CPU is freed (_host_malloc.py)
    created: Dict[int, nn.Parameter] = {}
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is None or param.is_meta:
            if param is not None:
                created.setdefault(id(param), param)
            return
        meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        meta.__dict__.update(param.__dict__)
        module._parameters[name] = meta
        created[id(meta)] = meta

    _state.active = True
    nn.Module.register_parameter = register_parameter
    roots: List[nn.Module] = []
    original_init = nn.Module.__init__

    def module_init(module, *args, **kwargs):
        original_init(module, *args, **kwargs)
        roots.append(module)

    nn.Module.__init__ = module_init
    try:
        yield
    finally:
        nn.Module.register_parameter = original
        nn.Module.__init__ = original_init
        _state.active = False
    _replace_meta(roots, list(created.values()), job)


def _replace_meta(modules: List[nn.Module], created: List[nn.Parameter],
                  job: Optional[str]) -> None:
    """Swaps every meta parameter built in the block for an empty CPU parameter,
    in every module of the block that holds it (the same replacement for a tied
    parameter)."""
    replacement: Dict[int, nn.Parameter] = {}
    for p in created:
        if id(p) in replacement:
            continue
        new = type(p)(_empty_like(p), requires_grad=p.requires_grad)
        new.__dict__.update(p.__dict__)
        setattr(new, _EMPTY, True)
        setattr(new, _JOB, job)
        replacement[id(p)] = new
    for module in modules:
        for name, p in module._parameters.items():
            if p is not None and id(p) in replacement:
                module._parameters[name] = replacement[id(p)]


# ------------------------------------------------------------------ materialize
def _owners(model: nn.Module):
    """(module name, module, [(param name, full name, param)]) for each module, in
    model.modules() order; a parameter appears with the first module that holds it."""
    seen = set()
    for prefix, module in model.named_modules():
        own = []
        for name, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            own.append((name, f"{prefix}.{name}" if prefix else name, p))
        yield prefix, module, own


def _give_storage(p: nn.Parameter, shape) -> None:
    if p.is_meta:
        raise InvalidArgument(
            f"fuyou.materialize: a parameter of shape {tuple(shape)} is on the meta device, "
            "whose tensors torch 1.13 cannot give storage in place; build the model in "
            "fuyou.init_empty(), which leaves empty CPU parameters")
    with torch.no_grad():
        p.data = torch.empty(shape, dtype=p.dtype)


@contextlib.contextmanager
def _scratch_for_shared(module: nn.Module, fresh_ids: set, shapes: Dict[int, torch.Size]):
    """A module that also holds parameters a previous module owns (ties) gets
    scratch storage for them while its init runs: what it writes there is
    dropped, the first owner's values stay."""
    saved = []
    for p in module._parameters.values():
        if p is None or id(p) in fresh_ids or id(p) not in shapes:
            continue
        saved.append((p, p.data))
        _give_storage(p, shapes[id(p)])
    try:
        yield
    finally:
        for p, data in saved:
            with torch.no_grad():
                p.data = data


@torch.no_grad()
def _initialise(prefix: str, module: nn.Module, init: Optional[Callable]) -> None:
    if init is not None:
        init(module)
        return
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise InvalidArgument(
            f"fuyou.materialize: module {prefix or '<model>'!r} ({type(module).__name__}) has "
            "parameters of its own but no reset_parameters(); pass init=fn, which is called "
            "with each module and initialises its own parameters (recurse=False)")
    reset()


def materialize(model: nn.Module, optimizer=None, *, init: Optional[Callable] = None,
                checkpoint=None, device=None) -> nn.Module:
    """Gives the parameters of `model` (built in ``init_empty``) their values,
    one module at a time in ``model.modules()`` order, and hands each module to
    ``optimizer.offload.register_module``, which sends them to fuyoud and frees
    them. Returns `model`.

    - `optimizer`: a ``fuyou.AdamW`` opened with ``offload_params=True`` over the
      model's parameters; None materializes the model on the CPU and keeps it
      (a reference model, or one for an ordinary ``fuyou.AdamW`` built after).
    - `init`: ``init(module)`` initialises the module's own parameters
      (``recurse=False``); it is called for every module that has parameters of
      its own, in order (seed torch before for a reproducible model). Default:
      the module's ``reset_parameters()`` (an error names a module without one).
      A parameter shared by several modules (tied) takes the values of the first
      module that holds it; what a later module's init writes into it is dropped.
    - `checkpoint`: a sharded checkpoint (a directory with a HuggingFace-style
      index json, as ``fuyou.export_checkpoint(..., shard_bytes=)`` writes, or the
      index file itself): every parameter is loaded from it, one shard in memory
      at a time. Names and shapes are checked against the model before anything
      is registered. When it holds optimizer states (a fuyou export) and the job
      is new, they are imported too (fp32 masters, moments, step counts and the
      groups' hyper-parameters; one chunk and one shard in memory at a time).
    - On a resumed job (``optimizer.offload.job_exists``) nothing is initialised
      or loaded: registration takes the daemon's committed weights (parameters
      the daemon does not hold, frozen ones, are still initialised or loaded,
      with their module; the optimizer states are not imported).
    - `device`: where the modules' weights are fetched to when streamed
      (``register_module``'s device; default the CPU). Values are always made
      on the CPU and sent from there.

    Buffers are given CPU storage (zeros when a module made them on ``meta``),
    loaded from the checkpoint when it holds them, moved to `device` when given,
    and kept in the model.
    """
    offload = None
    if optimizer is not None:
        offload = getattr(optimizer, "offload", None)
        if offload is None:
            raise InvalidArgument(
                f"fuyou.materialize: the optimizer of job {getattr(optimizer, 'job', '?')!r} "
                "was not opened with offload_params=True, so it cannot take weights module by "
                "module; open it with offload_params=True, or materialize(model) without an "
                "optimizer first and build the optimizer after")
        offload.bind(model)
    resume = offload is not None and bool(offload.job_exists)
    if init is not None and checkpoint is not None:
        raise InvalidArgument("fuyou.materialize: give init= or checkpoint=, not both")
    reader = None
    if checkpoint is not None:
        reader = _sharded.ShardReader(checkpoint)
        reader.check_model(model)
    # Parameters the daemon will hold; others (frozen, or not given to the
    # optimizer) stay in the model with their values, also on a resume.
    offloaded = {id(p) for p in optimizer.pipeline.params} if offload is not None else set()
    shapes: Dict[int, torch.Size] = {}  # id(param) -> shape, for ties
    try:
        for prefix, module, own in _owners(model):
            _materialize_buffers(prefix, module, reader, device)
            if not own:
                continue
            # A resumed module whose parameters are all in the daemon needs no
            # values: registration takes the committed ones.
            needs_values = not resume or any(id(p) not in offloaded for _n, _f, p in own)
            for _name, _full, p in own:
                shapes[id(p)] = p.shape
                if needs_values:
                    _give_storage(p, p.shape)
            if needs_values:
                if reader is not None:
                    with torch.no_grad():
                        for _name, full, p in own:
                            p.copy_(reader.parameter(model, full, p))
                else:
                    fresh = {id(p) for _n, _f, p in own}
                    with _scratch_for_shared(module, fresh, shapes):
                        _initialise(prefix, module, init)
                for _name, _full, p in own:
                    if hasattr(p, _EMPTY):
                        delattr(p, _EMPTY)
            if offload is not None:
                offload.register_module(module, device=device)
                _sharded.release_freed_memory()  # else the heap grows a module each time
        if reader is not None and offload is not None and reader.has_optimizer_states \
                and not resume:
            _sharded.import_optimizer_states(optimizer, reader, model)
    finally:
        if reader is not None:
            reader.close()
    return model


def _materialize_buffers(prefix: str, module: nn.Module, reader, device) -> None:
    for name, b in list(module._buffers.items()):
        if b is None:
            continue
        full = f"{prefix}.{name}" if prefix else name
        if b.is_meta:
            b = torch.zeros(b.shape, dtype=b.dtype)
            module._buffers[name] = b
        if reader is not None and reader.has(full):
            with torch.no_grad():
                b.copy_(reader.tensor(full))
        if device is not None:
            module._buffers[name] = b.to(device)
