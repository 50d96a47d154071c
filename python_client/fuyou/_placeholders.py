"""What a streamed parameter is between its uses, and what happens when the
model uses it anyway (issue 31, item 5).

With ``offload_params`` a trainable parameter's weights live in fuyoud; between
the forwards of the modules that hold it the parameter is an empty placeholder
(``.data`` has no elements). The module hooks of ``fuyou.stream_parameters``
fetch it for those modules, but a model may use a parameter elsewhere: GPT-2's
head ``F.linear(h, self.wte.weight)`` in the model's own forward, an L2 penalty
``sum(p.pow(2).sum() for p in model.parameters())`` after it, a weight norm
logged under ``no_grad``. On the empty tensor such a use would give torch's
size errors or, worse, a silent wrong answer (a penalty of 0).

So between uses a streamed parameter's class is :class:`Placeholder` (a
``torch.nn.Parameter``, made per optimizer by :func:`placeholder_class`), whose
``__torch_function__`` sees every torch operation on it (its owner,
_placeholder_uses.py's PlaceholderUses, decides):

- reading its metadata, setting ``.grad``, hooks, ``to()`` and the like (the
  ``_PLUMBING`` names) run as on any parameter; ``size()`` and ``dim()`` give
  its real shape (``nn.init``'s fan computations ask them), ``.shape`` and
  ``numel()`` the placeholder's (empty); a tensor returned by ``.data``,
  ``detach()`` or ``to()`` is a :class:`DerivedPlaceholder`;
- any other operation is *followed*: the parameter's block is fetched, the
  operation runs on the real weights, the block is let go; a result that
  needs a backward holds the block again for it. ``.data`` and ``detach()``
  (aliases) are followed alike, without autograd;
- an in-place change (``mul_``, ``copy_``, ``p[...] =``, an ``nn.init``
  function, ``p.data = t``) of the parameter or an alias between steps runs on
  the fetched block and is written into the masters; during a forward or
  between ``backward()`` and ``step()`` it is refused, naming the parameter;
- an operation on a tensor made by ``to()``/``float()``/``double()`` (no
  values, no alias) is refused, naming the parameter.

The cost: one class assignment per parameter when its block is fetched or let
go; operations on parameters in use (the normal case) never reach Python.
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["Placeholder", "DerivedPlaceholder", "placeholder_class", "is_placeholder",
           "become_placeholder", "become_weights", "param_of", "is_alias", "assign_grad"]

# Operations that do not read a parameter's values: they run as on any parameter.
_PLUMBING = frozenset({
    "__get__", "__set__", "__delete__", "__repr__", "__format__",
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride",
    "storage_offset", "data_ptr", "untyped_storage", "_typed_storage", "storage",
    "is_contiguous", "is_floating_point", "is_complex", "is_signed", "get_device",
    "is_pinned", "is_shared", "_is_view", "is_inference", "is_neg", "is_conj",
    "_is_zerotensor", "register_hook", "register_post_accumulate_grad_hook",
    "requires_grad_", "retain_grad", "_has_compatible_shallow_copy_type",
    "detach", "to", "cpu", "cuda", "float", "half", "double", "bfloat16", "type",
    "share_memory_", "pin_memory", "as_subclass",
})


def _name(func) -> str:
    return getattr(func, "__name__", "") or ""


def _in_place(func, args, kwargs) -> bool:
    """True when `func` writes into its first argument (``mul_``, ``copy_``,
    ``__setitem__``, ``__iadd__``)."""
    name = _name(func)
    if name.endswith("_") and not name.endswith("__") and name not in _PLUMBING:
        return True
    return name == "__setitem__" or (name.startswith("__i") and name.endswith("__")
                                     and name not in ("__index__", "__int__", "__invert__"))


def _placeholders_in(args, kwargs):
    """The Placeholder / DerivedPlaceholder tensors among `args` and `kwargs`
    (one level of lists and tuples: ``torch.cat([...])``)."""
    found = []

    def look(o):
        if isinstance(o, (Placeholder, DerivedPlaceholder)):
            found.append(o)
        elif isinstance(o, (list, tuple)):
            for x in o:
                if isinstance(x, (Placeholder, DerivedPlaceholder)):
                    found.append(x)

    for a in args:
        look(a)
    for a in (kwargs or {}).values():
        look(a)
    return found


def _run_plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


_INTERNAL = threading.local()  # fuyou's own writes of .data (a placeholder shaped for .grad)

# What nn.init's fan computations ask (Linear.reset_parameters reads the weight's
# fan for its bias): the parameter's real shape. ``.shape`` and ``numel()`` stay
# the placeholder's (empty), as fuyou and its users test them.
_SHAPED = ("size", "dim", "ndimension")
_METADATA = ("__get__", "__set__", "__delete__", "__repr__", "__format__")
_ALIASES = ("detach", "__get__")  # same values as the parameter: .data, detach()
_VIEWS = ("T", "mT", "H", "mH", "real", "imag")  # properties that are views of the values


def _property_of(func) -> str:
    """The name of the property whose ``__get__`` `func` is."""
    return getattr(getattr(func, "__self__", None), "__name__", "")


def _dispatch(func, args, kwargs):
    """What every operation on a placeholder or a tensor made from one does
    (see the module doc)."""
    name = _name(func)
    found = _placeholders_in(args, kwargs)
    if name == "__set__" and func == _DATA_SET and isinstance(args[0], Placeholder) \
            and not getattr(_INTERNAL, "depth", 0) and _has_values(args[1]):
        return _owner_of(args[0], name).assign(args[0], args[1])
    if name in _SHAPED and isinstance(args[0], Placeholder):
        shape = _owner_of(args[0], name).shape_of(args[0])
        if shape is not None:
            dim = args[1] if len(args) > 1 else (kwargs or {}).get("dim")
            return len(shape) if name != "size" else shape if dim is None else shape[dim]
    if name in _PLUMBING and not (name == "__get__" and _property_of(func) in _VIEWS):
        out = _run_plain(func, args, kwargs)
        if name in _METADATA and not (name == "__get__" and func == _DATA_GET):
            return out
        return _derived_tree(out, found, alias=name in _ALIASES)
    owner = _owner_of(found[0] if found else None, name)
    written = _written(func, args, kwargs)
    return owner.use(found, func, args, kwargs, written)


class Placeholder(torch.nn.Parameter):
    """A streamed parameter between its uses (see the module doc). Its
    subclass made by :func:`placeholder_class` knows the owner (the offload's
    PlaceholderUses), which fetches the weights for a use."""

    _owner = staticmethod(lambda: None)  # a weakref to the PlaceholderUses

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)


class DerivedPlaceholder(torch.Tensor):
    """A tensor made from a placeholder without reading it (``.data``,
    ``detach()``, ``to()``): empty. An alias (``.data``, ``detach()``: the
    parameter's own values) is followed as the parameter is, without autograd;
    any other (``to()``, ``float()``) is refused, naming the parameter."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)


_DATA_GET = torch.Tensor.data.__get__
_DATA_SET = torch.Tensor.data.__set__


def _has_values(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, (Placeholder, DerivedPlaceholder)) \
        and t.numel() > 0


def _written(func, args, kwargs):
    """The placeholder (or tensor made from one) that `func` writes into: its
    first argument for ``mul_``, ``copy_``, ``__setitem__``, ``__iadd__``, or
    its ``out=``; None when it only reads them."""
    out = (kwargs or {}).get("out")
    if isinstance(out, (Placeholder, DerivedPlaceholder)):
        return out
    first = args[0] if args else next(
        (kwargs[k] for k in ("tensor", "input", "self") if k in (kwargs or {})), None)
    if isinstance(first, (Placeholder, DerivedPlaceholder)) and _in_place(func, args, kwargs):
        return first  # nn.init's functions pass it as tensor=
    return None


def _derived(out, source, alias: bool):
    """`out` (a plain tensor made from `source` without reading it) as a
    DerivedPlaceholder that remembers `source`'s parameter; `alias`: it has
    the parameter's own values (``.data``, ``detach()``)."""
    if not isinstance(out, torch.Tensor) or isinstance(out, (Placeholder, DerivedPlaceholder)):
        return out
    param = param_of(source)
    with torch._C.DisableTorchFunctionSubclass():
        d = out.as_subclass(DerivedPlaceholder)
    d._fuyou_param = weakref.ref(param) if param is not None else None
    d._fuyou_alias = alias and getattr(source, "_fuyou_alias", True) \
        and out.dtype == source.dtype and out.device == source.device
    return d


def _derived_tree(out, sources, alias: bool):
    if not sources or not isinstance(out, torch.Tensor) or out.numel() != 0:
        return out  # a bool, an int, a size; or values that are real
    return _derived(out, sources[0], alias)


def param_of(t):
    """The streamed parameter `t` is or was made from (None: gone)."""
    if isinstance(t, Placeholder):
        return t
    ref = getattr(t, "_fuyou_param", None)
    return ref() if ref is not None else None


def is_alias(t) -> bool:
    """`t` is the parameter itself or has its values (``.data``, ``detach()``)."""
    return isinstance(t, Placeholder) or bool(getattr(t, "_fuyou_alias", False))


class _NoOwner:
    """The owner of a placeholder whose optimizer is gone: every use refused."""

    def __init__(self, param):
        self._param = param

    def _error(self, name: str):
        from ._errors import FailedPrecondition
        return FailedPrecondition(
            "a streamed parameter (offload_params) is an empty placeholder and its optimizer is "
            f"closed: {name or 'this operation'} cannot fetch its weights. Read them before "
            "closing the optimizer (model.state_dict(), fuyou.export_checkpoint)")

    def use(self, found, func, args, kwargs, written):
        raise self._error(_name(func))

    def shape_of(self, param):
        return None

    def assign(self, param, value):
        raise self._error(".data = ")


def _owner_of(t, name: str):
    param = param_of(t)
    owner = type(param)._owner() if isinstance(param, Placeholder) else None
    return owner if owner is not None else _NoOwner(param)


class internal_writes:
    """fuyou's own ``.data`` writes of a placeholder (shaped for ``.grad``
    while torch checks it) go through as they are."""

    def __enter__(self):
        _INTERNAL.depth = getattr(_INTERNAL, "depth", 0) + 1

    def __exit__(self, *exc):
        _INTERNAL.depth -= 1


def assign_grad(p: torch.Tensor, shape, grad) -> None:
    """``p.grad = grad`` for a streamed parameter (an empty placeholder: torch
    checks ``.grad``'s size against ``p.data``)."""
    with internal_writes():
        data = p.data
        if tuple(data.shape) == tuple(shape):  # in use: its weights are there
            p.grad = grad
            return
        p.data = torch.empty(1, dtype=p.dtype, device=p.device).expand(shape)
        p.grad = grad
        p.data = data


def placeholder_class(owner) -> type:
    """The Placeholder class of one PlaceholderUses (held weakly)."""
    return type("Placeholder", (Placeholder,), {"_owner": staticmethod(weakref.ref(owner)),
                                                 "__module__": __name__})


def is_placeholder(t) -> bool:
    return isinstance(t, (Placeholder, DerivedPlaceholder))


def become_placeholder(param: torch.nn.Parameter, data: torch.Tensor, cls) -> None:
    """`param` holds `data` (an empty tensor) and is a `cls` placeholder; only
    a plain ``torch.nn.Parameter`` changes class (a subclass of the user's keeps
    its own)."""
    param.data = data
    if cls is not None and type(param) is torch.nn.Parameter:
        param.__class__ = cls


def become_weights(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    """`param` holds `data` (a view of its block's buffer): a plain parameter again."""
    if isinstance(param, Placeholder):
        param.__class__ = torch.nn.Parameter
    param.data = data
