"""offload_params: a model's working weights live in fuyoud, not in the model.

``fuyou.AdamW(..., offload_params=True)`` keeps every trainable parameter's
weights in the daemon (ChunkSpec.store_weights: a fourth chunk state beside the
fp32 master, m and v). Between uses a parameter is an empty placeholder (no
storage; its shape, dtype and device are remembered by its block).
:class:`OffloadedParams` (``optimizer.offload``) plans the chunks from the
model's modules and registers them; three parts do the rest:

- ``layout`` (:class:`ModuleBlocks`, _module_blocks.py): the blocks, which
  module owns and uses which, the block of each chunk and parameter;

- ``weights`` (:class:`WeightCache`, _weight_cache.py): fetches a module's
  weights on demand into a fresh tensor on the module's device, keeps released
  ones in an LRU cache within the device budget, counts live bytes;
- ``gradients`` (:class:`OffloadedGradients`, _offload_grads.py): sends and
  frees a chunk's gradients once a pass completed them, or keeps them on the
  host for clipping and accumulation;
- ``placeholders`` (:class:`PlaceholderUses`, _placeholder_uses.py): a
  parameter used outside the forward of the modules that hold it (a tied
  head, a penalty, an edit) is fetched for the use (_placeholders.py).

Units::

    module ----- owns ----> Block (its own trainable parameters, recurse=False,
                             packed in its chunks one after another in one buffer)
    module --- uses ---> Blocks of its own parameters' owners (a tied parameter is
                          owned by one module and used by several)

``fuyou.stream_parameters`` (_stream.py) installs the module hooks that acquire
and release blocks. Every method runs with the optimizer's lock held.
"""

from __future__ import annotations

import os
import stat
import weakref
from typing import List, Optional

import torch

from ._admin import admin_client
from ._chunk_weights import gather_weights
from ._chunking import plan_module_chunks
from .daemon import socket_path_of, to_address
from ._errors import FailedPrecondition, InvalidArgument
from ._materialize import is_empty
from ._module_blocks import ModuleBlocks
from ._offload_grads import OffloadedGradients
from ._placeholder_uses import PlaceholderUses
from ._placeholders import become_placeholder
from ._weight_cache import Block, WeightCache, placeholder
from ._weight_fetches import FETCH_SLOTS

__all__ = ["OffloadedParams", "Block", "FETCH_SLOTS"]


def _mode(path: str) -> int:
    try:
        return os.stat(path).st_mode
    except OSError:
        return 0


class OffloadedParams:
    """The trainable parameters of one model whose working weights live in the
    optimizer's job (``optimizer.offload`` of a ``fuyou.AdamW`` opened with
    ``offload_params=True``).

    Life cycle: :meth:`bind` (plans the chunks from the model, once), then
    :meth:`register_module` for every module (``fuyou.stream_parameters`` does
    it for the modules not registered yet; ``fuyou.materialize`` one module at a
    time), then streaming.
    """

    def __init__(self, optimizer, pipeline, hooks):
        """`hooks`: the streamed mode's BackwardHooks, installed on each
        parameter as its module is registered. The chunks follow the
        optimizer's ``chunk_bytes``; waits take its ``timeout``."""
        self._optimizer = weakref.ref(optimizer)
        self._pipeline = pipeline
        self._hooks = hooks
        self.layout = ModuleBlocks()
        self.resumed = False
        self._job_exists: Optional[bool] = None
        self.weights = WeightCache(pipeline, self.layout, optimizer.timeout)
        self.placeholders = PlaceholderUses(self)  # a use outside the modules' forwards
        self.weights.placeholder_class = self.placeholders.cls
        self.gradients = OffloadedGradients(optimizer, pipeline, self.weights, self.layout)
        self._streams: list = []  # the ParameterStreams on the model
        self.read_only: List[torch.Tensor] = []  # frozen, streamed (track_frozen): never sent
        self.state_dict_hooks = None  # a StreamedStateDict once fuyou.stream_parameters ran
        self.weights_loaded = 0  # model.load_state_dict calls that wrote new weights
        # A data-parallel rank's (_sharded_streamed.py): the chunks of the plan
        # this rank sends (all of them: every chunk is registered), and what runs
        # once every module is registered.
        self.own_chunks = lambda chunks: chunks
        self.after_registration = None

    @property
    def _lock(self):
        """The optimizer's lock (the pipeline's)."""
        return self._pipeline.lock

    # ------------------------------------------------------------ planning
    @property
    def model(self) -> Optional[torch.nn.Module]:
        """The bound model; None before ``bind``."""
        return self.layout.model

    @property
    def blocks(self) -> List[Block]:
        """Every module's block (empty before ``bind``)."""
        return self.layout.blocks

    @property
    def bound(self) -> bool:
        return self.model is not None

    def bind(self, model: torch.nn.Module) -> None:
        """Plans the chunks from `model`'s modules (once, before any
        registration): chunks follow modules (never two modules' own parameters
        in one; a module's parameters may need several), in backward order, ids
        stable for the same model and ``chunk_bytes``. The optimizer's trainable
        parameters must all be owned by modules of `model`."""
        with self._lock:
            if self.model is not None:
                if self.model is model:
                    return
                raise InvalidArgument("this optimizer's offload is bound to another model; "
                                      "open one fuyou.AdamW per model")
            opt = self._optimizer()
            modules = list(model.named_modules())
            # track_frozen: the frozen parameters are streamed too, read-only
            self.read_only = [p for p in self._pipeline.params if not p.requires_grad]
            try:
                chunks, unique, by_module = plan_module_chunks(
                    modules, [g["params"] for g in opt.param_groups], opt.chunk_bytes,
                    include_frozen=bool(self.read_only))
            except ValueError as e:
                raise InvalidArgument(f"offload_params for job {opt.job!r}: {e}") from None
            if [id(p) for p in unique] != [id(p) for p in self._pipeline.params]:
                raise InvalidArgument("the optimizer's parameters changed since it was made")
            self._pipeline.set_chunks(self.own_chunks(chunks))
            self.layout.fill(model, modules, by_module, self._pipeline.params)

    def uses(self, module: torch.nn.Module) -> List[Block]:
        """The blocks `module`'s forward needs (its own parameters' owners)."""
        return self.layout.uses(module)

    # ------------------------------------------------------------ registration
    @property
    def job_exists(self) -> bool:
        """True when the job already had chunks in the daemon when it was first
        asked (before this optimizer registered any): a resume, whose committed
        weights replace the modules' values (which need not be initialised)."""
        if self._job_exists is None:
            self._job_exists = self._ask_job_exists()
        return self._job_exists

    def _ask_job_exists(self) -> bool:
        session = self._pipeline.session
        existing = getattr(session, "existing_chunks", None)  # OpenSessionResponse's
        if existing is not None:
            return int(existing) > 0
        if int(session.committed_step) > 0:
            return True
        opt = self._optimizer()
        path = socket_path_of(to_address(opt.address))
        if path is None or not stat.S_ISSOCK(_mode(path)):
            return False  # not a fuyoud socket (a fake session): committed_step decides
        try:  # chunks registered but no step committed yet: the daemon's job list
            jobs = admin_client(opt.address, min(opt.timeout, 5.0)).list_jobs()
        except Exception:
            return False
        return any(j.get("name") == opt.job and int(j.get("chunks", 0)) > 0 for j in jobs)

    @property
    def registered(self) -> bool:
        """Every module's parameters are registered with the daemon."""
        return self.model is not None and all(b.registered for b in self.blocks)

    def register_module(self, module: torch.nn.Module,
                        device: Optional[torch.device] = None) -> bool:
        """Registers the chunks of `module`'s own parameters (``recurse=False``;
        a tied parameter owned by another module is left to it) with
        ``store_weights``. A new chunk takes the parameters' current values; a
        chunk the job already has keeps the daemon's committed weights (the
        current values are ignored, and may be uninitialised or on ``meta``).
        Then each parameter's storage is released: it becomes an empty
        placeholder on `device` (default: its own device, the CPU for ``meta``),
        where its weights are fetched to. Returns True when the module's chunks
        were resumed. Registering a module twice does nothing."""
        with self._lock:
            if self.model is None:
                raise FailedPrecondition("offload: bind(model) before register_module")
            block = self.layout.owned_by(module)
            if block is None or block.registered:
                return False
            opt = self._optimizer()
            pipeline = self._pipeline
            # Parameters without values: on meta, or fuyou.init_empty's empty ones.
            on_meta = any(is_empty(m.param) for m in block.members)
            exists = self.job_exists
            if on_meta and not exists:
                raise FailedPrecondition(
                    f"module {block.name!r} has parameters without values (on the meta device "
                    f"or built in fuyou.init_empty) and job "
                    f"{opt.job!r} is new: initialise them (fuyou.materialize) before they are "
                    "registered")
            resumed_any = False
            with torch.no_grad():
                for c in block.chunks:
                    if on_meta:
                        buf = torch.zeros(c.num_elements, dtype=c.dtype)
                    else:
                        buf = gather_weights(c)
                    resumed = pipeline.states.register(c, buf, store_weights=True)
                    if on_meta and not resumed:
                        raise FailedPrecondition(
                            f"job {opt.job!r} has no chunk {c.chunk_id:#x} for module "
                            f"{block.name!r} (a new chunk got zeros): the model differs from "
                            "the job's; initialise the module and register it again in a new job")
                    resumed_any |= resumed
            if device is None:
                devices = {m.param.device for m in block.members if not m.param.is_meta}
                device = devices.pop() if len(devices) == 1 else torch.device("cpu")
            block.device = torch.device(device)
            for m in block.members:
                if m.param.is_meta:  # set_data cannot leave meta: a new Parameter object
                    self._replace_param(m.param, torch.nn.Parameter(
                        placeholder(m.dtype, block.device), requires_grad=m.param.requires_grad))
                self._hooks.install([m.index])  # on the tensor: they outlive set_data
                become_placeholder(m.param, placeholder(m.dtype, block.device),
                                   self.placeholders.cls)
            block.registered = True
            if resumed_any:
                self.resumed = True
                opt.resumed = True
            if self.registered:
                pipeline.set_device()
                pipeline.slots.pin()
                if self.after_registration is not None:
                    self.after_registration()
            return resumed_any

    def _replace_param(self, old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
        """Puts `new` wherever `old` is: every module holding it, the optimizer's
        groups, the pipeline's parameters and chunks, this offload's blocks."""
        self.layout.replace_param(old, new)
        opt = self._optimizer()
        for group in opt.param_groups:
            group["params"] = [new if q is old else q for q in group["params"]]
        params = self._pipeline.params
        for i, q in enumerate(params):
            if q is old:
                params[i] = new
        for c in self._pipeline.plan.chunks:
            for seg in c.segments:
                if seg.param is old:
                    seg.param = new

    def register_all(self) -> None:
        """Registers every module not registered yet (a model built normally)."""
        for _name, module in self.layout.modules:
            self.register_module(module)

    @property
    def committed_step(self) -> int:
        return self._pipeline.committed_step

    def close(self) -> None:
        """Closes the streams on the model (their hooks go)."""
        for stream in list(self._streams):
            stream.close()
