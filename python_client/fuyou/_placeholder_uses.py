"""PlaceholderUses (``offload.placeholders``): what a use of a streamed
parameter outside the forward of the modules that hold it does (issue 31,
item 5; the placeholders themselves are _placeholders.py's).

- a read (``F.linear(h, wte.weight)`` in the model's own forward, an L2 penalty
  after it, ``p.norm()`` under ``no_grad``, ``p.detach()`` read): the
  parameter's block is fetched (the weight cache's acquire), the operation runs
  on the real weights, the block is let go. When the result needs a backward,
  it passes through an autograd function that holds the block again before the
  operation's backward (the stream's ``hold_for_use``), as the module hooks do
  for a module; a step committed (or ``load_state_dict``) between the use and
  its backward is refused, as a saved weight is;
- an in-place change between steps (``with torch.no_grad(): p.mul_(0.5)``,
  ``p.data.clamp_(-c, c)``, ``nn.init.*_(p)``, ``p.data = t``): taken, as
  ``model.load_state_dict`` takes new weights: the block is fetched, the
  operation runs on it, and the parameter's new values are written as its
  chunks' fp32 masters (m, v and the step counts stay). During a forward or
  between ``backward()`` and ``step()`` it is refused, naming the parameter;
- ``to()``, ``float()`` and the like of a placeholder give a tensor without
  values: an operation on it is refused.

Costs: a read fetches the block once per use (a cache hit while it is cached)
and, with autograd, holds it again in backward until its gradients are sent:
a penalty over every parameter holds every block at once during backward, so
live bytes may reach the model's weights (not the device budget). An edit
costs one import of the edited chunks (a read and a write of their masters).
"""

from __future__ import annotations

import weakref
from typing import Dict, List

import torch

from ._errors import FailedPrecondition
from ._placeholders import (DerivedPlaceholder, Placeholder, is_alias, param_of,
                            placeholder_class)
from ._tensor_tree import pass_through

__all__ = ["PlaceholderUses"]


class PlaceholderUses:
    """The uses of one offload's placeholders (see the module doc). Every
    method takes the optimizer's lock (an RLock: fuyou's own code may touch
    a placeholder while holding it)."""

    def __init__(self, offload):
        self._offload = weakref.ref(offload)
        self.cls = placeholder_class(self)  # the offload's Placeholder class
        self.edits_taken = 0  # in-place edits written into the masters
        self.edit_versions: Dict[int, int] = {}  # param_index -> its version after the edit

    # ------------------------------------------------------------ names
    def describe(self, param) -> str:
        """``parameter 'h.0.weight' of job 'x' (module 'h.0', also held by 'head')``."""
        offload = self._offload()
        if offload is None or param is None:
            return "a streamed parameter"
        holders, names = [], []
        for mname, module in offload.layout.modules:
            for pname, p in module._parameters.items():
                if p is param:
                    holders.append(mname or "the model itself")
                    names.append(f"{mname}.{pname}" if mname else pname)
        opt = offload._optimizer()
        job = f" of job {opt.job!r}" if opt is not None else ""
        if not names:
            return f"a streamed parameter{job}"
        also = f", also held by {', '.join(repr(h) for h in holders[1:])}" if holders[1:] else ""
        return f"parameter {names[0]!r}{job} (module {holders[0]!r}{also})"

    def shape_of(self, param):
        """`param`'s real shape (a torch.Size; None when unknown)."""
        offload = self._offload()
        if offload is None:
            return None
        for b in offload.blocks:
            for m in b.members:
                if m.param is param:
                    return torch.Size(m.shape)
        return None

    def _block_of(self, offload, param):
        for b in offload.blocks:
            for m in b.members:
                if m.param is param:
                    return b, m
        raise FailedPrecondition(f"{self.describe(param)} is streamed but belongs to no block "
                                 "of the bound model")

    def _stream(self, offload, param, name: str):
        streams = [s for s in offload._streams if not s._closed]
        if not streams or not offload.registered:
            raise FailedPrecondition(
                f"{self.describe(param)} is streamed (offload_params) and is an empty "
                f"placeholder between uses; {name} needs its weights, but the model has no "
                "open fuyou.stream_parameters handle to fetch them: open one first (or read "
                "the weights with model.state_dict())")
        return streams[-1]

    # ------------------------------------------------------------ a use
    def use(self, found: List[torch.Tensor], func, args, kwargs, written):
        """Runs `func` with the weights of the placeholders in `found` fetched
        (`written`: the one it changes in place, or None)."""
        name = getattr(func, "__name__", "this operation")
        offload = self._offload()
        params = []
        for t in found:
            p = param_of(t)
            if p is None or not is_alias(t):
                raise FailedPrecondition(
                    f"{self.describe(p)} is streamed (offload_params): between uses it is an "
                    f"empty placeholder, and {name} was called on a tensor made from it by "
                    "to(), float() or the like, which holds no values. Use the parameter itself "
                    "(under torch.no_grad() for a read: fuyou fetches its weights for the "
                    "operation), or model.state_dict() for a copy of the weights")
            if all(q is not p for q in params):
                params.append(p)
        if offload is None:
            raise FailedPrecondition(f"{name} of a streamed parameter whose optimizer is gone")
        edited = param_of(written) if written is not None else None  # before it is fetched
        needs_backward = torch.is_grad_enabled() and any(
            isinstance(t, Placeholder) and t.requires_grad for t in found)
        with offload._lock:
            stream = self._stream(offload, params[0], name)
            if edited is not None:
                self._check_editable(offload, edited, name)
            held = []
            try:
                for p in params:
                    b, _m = self._block_of(offload, p)
                    offload.weights.acquire(b)
                    held.append(b)
                real_args, real_kwargs = _real(args), _real(kwargs or {})
                out = func(*real_args, **real_kwargs)
                if edited is not None:
                    b, m = self._block_of(offload, edited)
                    values = {m.index: (b, m, edited.detach().clone())}
                    offload.weights.edits.refresh(b)  # into the masters below: not lost
                step, loaded = offload.committed_step, offload.weights_loaded
            finally:
                for b in held:
                    offload.weights.release(b)
            if edited is not None:
                offload.state_dict_hooks._write_masters(offload, values)
                self.edits_taken += 1
                self.edit_versions[m.index] = edited._version
                return written if out is not None and _is_real_of(out, real_args) else out
        if needs_backward:
            blocks = [self._block_of(offload, p)[0] for p in params]
            return stream.hold_for_use(out, blocks, step, loaded, self.describe(params[0]))
        return out

    def assign(self, param, value: torch.Tensor):
        """``param.data = value`` on a placeholder: taken as an edit (the
        shape must be the parameter's)."""
        offload = self._offload()
        if offload is None:
            raise FailedPrecondition("a streamed parameter whose optimizer is gone")
        with offload._lock:
            b, m = self._block_of(offload, param)
            if tuple(value.shape) != tuple(m.shape):
                raise FailedPrecondition(
                    f"{self.describe(param)} is streamed (offload_params): .data = a tensor of "
                    f"shape {tuple(value.shape)} would change its shape {tuple(m.shape)}, which a "
                    "streamed parameter cannot; build the model with the new shape")
            self._stream(offload, param, ".data =")
            self._check_editable(offload, param, ".data =")
            offload.state_dict_hooks._write_masters(offload, {m.index: (b, m, value.detach())})
            self.edits_taken += 1
            self.edit_versions[m.index] = param._version

    def _check_editable(self, offload, param, name: str) -> None:
        opt = offload._optimizer()
        pipeline = offload._pipeline
        if offload.state_dict_hooks is None:
            raise FailedPrecondition(
                f"{self.describe(param)} is streamed: {name} changes its weights, which needs "
                "fuyou.stream_parameters(model, opt) first")
        if pipeline.step.in_step or any(pipeline.passes.param_passes):
            raise FailedPrecondition(
                f"{self.describe(param)} is streamed (offload_params) and {name} changes it in "
                "place between backward() and step(): the update of its chunk may already be "
                "under way in fuyoud. Change it after optimizer.step() (fuyou writes it into the "
                "masters), or with model.load_state_dict(...) between steps")
        if any(b.refs > 0 for b in offload.blocks):
            raise FailedPrecondition(
                f"{self.describe(param)} is streamed (offload_params) and {name} changes it in "
                "place during a forward: change it between steps (after optimizer.step()), "
                "where fuyou writes it into the masters")
        if opt is not None:
            opt._check_usable()


def _real(tree):
    """`tree` (args or kwargs, one level of lists) with every tensor made
    from a placeholder by ``.data`` / ``detach()`` replaced by its parameter's
    weights now fetched (detached, as they were)."""
    def swap(o):
        if isinstance(o, DerivedPlaceholder):
            p = param_of(o)
            with torch._C.DisableTorchFunctionSubclass():
                return p.detach()
        return o

    def one(o):
        if isinstance(o, (list, tuple)):
            return type(o)(swap(x) for x in o)
        return swap(o)

    if isinstance(tree, dict):
        return {k: one(v) for k, v in tree.items()}
    return tuple(one(a) for a in tree)


def _is_real_of(out, real_args) -> bool:
    return bool(real_args) and out is real_args[0]
