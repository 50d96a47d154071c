"""FreedGrad: what a streamed parameter's ``.grad`` is once fuyou sent its
gradients to fuyoud and freed them (offload_params).

Why a stand-in and not None: the loops users write read and change ``.grad``
between ``backward()`` and ``step()`` (``clip_grad_norm_``, GradScaler's
``unscale_``, a hand-written ``p.grad.div_(scale)``, an inf check,
``model.zero_grad()``). With ``None`` they silently do nothing. A FreedGrad has
the parameter's shape, dtype and device but no storage, and answers exactly
those questions:

- norms (``torch.norm``, ``Tensor.norm``, ``linalg.vector_norm``; 2 and inf):
  from statistics taken when the gradients were sent (torch's own norm of the
  real ``.grad``), or read from the daemon's journal after an accumulating pass;
- ``mul_`` / ``div_`` by a number (or a one-element tensor): recorded, and
  replayed by the daemon on its journaled copy of the step's gradients
  (``GradReady.grad_ops``), so the update uses what torch would;
- ``zero_`` (``zero_grad(set_to_none=False)``, ``model.zero_grad()``): a zero
  gradient, which updates the parameter as torch does;
- ``isfinite`` / ``isinf`` / ``isnan`` (``.all()``/``.any()`` of them): from the
  finiteness of the statistics;
- GradScaler's ``_amp_foreach_non_finite_check_and_unscale_``: both at once.

Anything else (``clamp_`` of ``clip_grad_value_``, reading values) raises
:class:`FreedGradError`, which says what to use instead: nothing is a silent
no-op. The record behind a FreedGrad (:class:`GradRecord`) is owned by
``_offload_grads.OffloadedGradients``, which decides when its ops are sent.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch

from ._errors import FuyouError
from ._protocol import GRAD_OP_DIV, GRAD_OP_MUL

__all__ = ["FreedGrad", "GradRecord", "FreedGradError", "OP_MUL", "OP_DIV", "is_freed"]

# fuyou.v1.GradOp.Kind values.
OP_MUL, OP_DIV = GRAD_OP_MUL, GRAD_OP_DIV

_aten = torch.ops.aten
_NORMS = {_aten.norm.Scalar, _aten.norm.ScalarOpt_dim, _aten.linalg_vector_norm.default}
_INPLACE_SCALE = {_aten.mul_.Tensor: OP_MUL, _aten.mul_.Scalar: OP_MUL,
                  _aten.div_.Tensor: OP_DIV, _aten.div_.Scalar: OP_DIV}


class FreedGradError(FuyouError):
    """An operation on a freed streamed gradient that fuyou cannot honour."""

    default_code = "FAILED_PRECONDITION"


class GradRecord:
    """One parameter's freed gradients.

    Journaled (``host`` None): ``stats`` gives ``(norm2, max_abs)``, 0-dim
    tensors in the gradient's dtype on its device, as torch's ``norm(g, 2)``
    and ``g.abs().max()`` give them for the gradients the daemon holds (before
    ``ops``); ``ops`` lists the in-place ``(OP_MUL | OP_DIV, factor)`` since.
    On the host (``host``: views of the chunks' host copies): ops apply to the
    copies at once and the statistics are computed from them. ``zeroed``: the
    gradient is zero. ``stale``: the step that made it is over (committed or
    abandoned): it can still be read and zeroed, not scaled.
    """

    def __init__(self, name: str, stats: Optional[Callable[[], Tuple[torch.Tensor, torch.Tensor]]],
                 host: Optional[List[torch.Tensor]] = None):
        self.name = name
        self.host = host
        self._stats_fn = stats
        self._stats: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.ops: List[Tuple[int, float]] = []
        self.zeroed = False
        self.stale = False

    @property
    def scale(self) -> float:
        """The product of the ops' factors (a division counts as 1/x)."""
        s = 1.0
        for kind, x in self.ops:
            s = s * x if kind == OP_MUL else s / x
        return s

    def stats(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.host is not None:
            flat = self.host[0] if len(self.host) == 1 else torch.cat(self.host)
            return torch.norm(flat, 2.0), flat.abs().max()
        if self._stats is None:
            self._stats = self._stats_fn()
            self._stats_fn = None
        return self._stats

    def finite(self) -> bool:
        if self.zeroed:
            return True
        norm2, max_abs = self.stats()
        return bool(torch.isfinite(norm2)) and bool(torch.isfinite(max_abs)) and \
            math.isfinite(self.scale)

    def scale_by(self, kind: int, factor: float) -> None:
        if self.zeroed or factor == 1.0:
            return  # 0 * x is 0 (x finite), x * 1 and x / 1 are x: nothing to replay
        if self.stale:
            raise FreedGradError(
                f"in-place {'mul_' if kind == OP_MUL else 'div_'} on the gradient of {self.name} "
                "after step(): the step's gradients were freed when step() committed it. "
                "Change gradients between backward() and step(), and call zero_grad() "
                "before the next backward()")
        if self.host is not None:
            for t in self.host:
                t.mul_(factor) if kind == OP_MUL else t.div_(factor)
            return
        self.ops.append((kind, float(factor)))

    def zero(self) -> None:
        if self.host is not None and not self.stale:
            for t in self.host:
                t.zero_()
        self.zeroed = True
        self.ops = []
        self.host = None
        self._stats = None
        self._stats_fn = None

    def settle(self) -> None:
        """The step is over: the daemon's journal and the host copies are gone.
        The statistics as the loop left them stay readable."""
        if self.zeroed or self.stale:
            self.stale = True
            return
        norm2, max_abs = self.stats()
        scale = abs(self.scale)
        if scale != 1.0:
            norm2, max_abs = ((t.float() * scale).to(t.dtype) for t in (norm2, max_abs))
        self._stats, self._stats_fn, self.host, self.ops = (norm2, max_abs), None, None, []
        self.stale = True


def _norm_args(g: torch.Tensor, func, args, kwargs) -> float:
    """The order of a norm call (2 or inf); raises for anything else."""
    if func is _aten.linalg_vector_norm.default:
        ord_ = kwargs.get("ord", args[1] if len(args) > 1 else 2)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
        keepdim = kwargs.get("keepdim", args[3] if len(args) > 3 else False)
        dtype = kwargs.get("dtype", args[4] if len(args) > 4 else None)
    else:
        ord_ = kwargs.get("p", args[1] if len(args) > 1 else 2)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
        keepdim = kwargs.get("keepdim", args[3] if len(args) > 3 else False)
        dtype = kwargs.get("dtype", None)
    ord_ = 2.0 if ord_ is None else float(ord_)
    whole = dim in (None, []) or sorted(int(d) % max(g.dim(), 1) for d in dim) == \
        list(range(g.dim()))
    if not whole or keepdim or dtype is not None or ord_ not in (2.0, math.inf):
        raise FreedGradError(
            f"norm(ord={ord_}, dim={dim}, keepdim={keepdim}, dtype={dtype}) of a streamed "
            "gradient that fuyou sent and freed: only the whole tensor's 2-norm and inf-norm "
            "are known (what clip_grad_norm_ asks); use max_grad_norm= on fuyou.AdamW for "
            "other clipping")
    return ord_


def _scalar(x) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise FreedGradError(
                "in-place mul_/div_ of a streamed gradient by a tensor of "
                f"{x.numel()} elements: only a number (or a one-element tensor) can be "
                "replayed on the daemon's copy")
        return float(x.item())
    return float(x)


class FreedGrad(torch.Tensor):
    """The ``.grad`` of a streamed parameter after fuyou sent its gradients."""

    record: GradRecord
    absolute: bool

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, device: torch.device, record: GradRecord,
                absolute: bool = False):
        r = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=device, requires_grad=False)
        r.record = record
        r.absolute = absolute
        return r

    def __repr__(self) -> str:
        r = self.record
        state = "zero" if r.zeroed else ("stale" if r.stale else f"{len(r.ops)} op(s) pending")
        return (f"FreedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"{state}: the gradients of {r.name} are in fuyoud)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.isfinite, torch.Tensor.isfinite):
            return _finiteness(args[0])
        with torch._C.DisableTorchFunction():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args else None
        if func in (_aten.detach.default, _aten.alias.default):
            return self
        if func is _aten._amp_foreach_non_finite_check_and_unscale_.default:
            return _amp_unscale(*args)
        if func is _aten._foreach_zero_.default:
            real = [t for t in args[0] if not isinstance(t, FreedGrad)]
            for t in args[0]:
                if isinstance(t, FreedGrad):
                    t.record.zero()
            if real:
                torch._foreach_zero_(real)
            return None
        if isinstance(self, FreedGrad):
            record = self.record
            if func in _NORMS and not self.absolute:
                ord_ = _norm_args(self, func, args, kwargs)
                return _norm(self, ord_)
            if func is _aten.abs.default and not self.absolute:
                return FreedGrad(self.shape, self.dtype, self.device, record, absolute=True)
            if func in (_aten.max.default, _aten.amax.default) and self.absolute:
                return _norm(self, math.inf)
            if func in _INPLACE_SCALE and not self.absolute:
                record.scale_by(_INPLACE_SCALE[func], _scalar(args[1]))
                return self
            if func is _aten.zero_.default and not self.absolute:
                record.zero()
                return self
            if func in (_aten.isinf.default, _aten.isnan.default):
                # inf and nan are not told apart: either means "not finite".
                return torch.tensor(not record.finite(), device=self.device).expand(self.shape)
        name = self.record.name if isinstance(self, FreedGrad) else "a parameter"
        hint = ("torch.nn.utils.clip_grad_value_ is not supported with offload_params: use "
                "clip_grad_norm_ or max_grad_norm= on fuyou.AdamW"
                if func in (_aten.clamp_.default, _aten.clamp.default) else
                "what works on it: torch.norm / clip_grad_norm_ (2 and inf), mul_/div_ by a "
                "number, zero_(), isfinite/isinf/isnan; for the values, call step() and "
                "read the weights, or keep gradients with fuyou.AdamW(overlap=False)")
        raise FreedGradError(
            f"{func} on the gradient of {name}: fuyou sent this step's gradients to fuyoud "
            f"and freed them (offload_params); {hint}")


def _norm(g: FreedGrad, ord_: float) -> torch.Tensor:
    record = g.record
    if record.zeroed:
        return torch.zeros((), dtype=g.dtype, device=g.device)
    norm2, max_abs = record.stats()
    base = norm2 if ord_ == 2.0 else max_abs
    scale = abs(record.scale)
    if scale == 1.0:
        return base.clone()
    return (base.float() * scale).to(g.dtype)


def _finiteness(g) -> torch.Tensor:
    if not isinstance(g, FreedGrad):
        with torch._C.DisableTorchFunction():
            return torch.isfinite(g)
    return torch.tensor(g.record.finite(), device=g.device).expand(g.shape)


def _amp_unscale(grads, found_inf: torch.Tensor, inv_scale: torch.Tensor):
    """GradScaler.unscale_'s fused check-and-unscale over a list of gradients."""
    real = [t for t in grads if not isinstance(t, FreedGrad)]
    factor = float(inv_scale.item())
    for t in grads:
        if isinstance(t, FreedGrad):
            if not t.record.finite():
                found_inf.fill_(1.0)
            t.record.scale_by(OP_MUL, factor)
    if real:
        torch._amp_foreach_non_finite_check_and_unscale_(real, found_inf, inv_scale)
    return None


def is_freed(t: Optional[torch.Tensor]) -> bool:
    return isinstance(t, FreedGrad)
