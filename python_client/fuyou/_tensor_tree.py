"""Outputs of a module as trees of tensors: tensors, and tuples (named ones
too), lists and dicts of them. Autograd functions that mark a module's output
(for a backward hook of their own) go through ``pass_through``."""

from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

__all__ = ["pass_through"]


def pass_through(tree, apply: Callable[..., Sequence[torch.Tensor]]) -> Tuple[object, bool]:
    """`tree` with its tensors that require grad replaced by ``apply(*tensors)``
    (one output per input, as a tensor or a tuple), the rest of the tree
    rebuilt around them; ``(tree, False)`` when no tensor requires grad (the
    tree is returned as it is and `apply` is not called)."""
    tensors: List[torch.Tensor] = []

    def collect(o):
        if isinstance(o, torch.Tensor):
            if o.requires_grad:
                tensors.append(o)
        elif isinstance(o, (tuple, list)):
            for x in o:
                collect(x)
        elif isinstance(o, dict):
            for x in o.values():
                collect(x)

    collect(tree)
    if not tensors:
        return tree, False
    out = apply(*tensors)
    out = out if isinstance(out, tuple) else (out,)
    replacement = {id(t): w for t, w in zip(tensors, out)}

    def rebuild(o):
        if isinstance(o, torch.Tensor):
            return replacement.get(id(o), o)
        if isinstance(o, tuple):
            items = [rebuild(x) for x in o]
            return type(o)(*items) if hasattr(o, "_fields") else type(o)(items)
        if isinstance(o, list):
            return type(o)(rebuild(x) for x in o)
        if isinstance(o, dict):
            new = o.copy()
            for k, v in o.items():
                new[k] = rebuild(v)
            return new
        return o

    return rebuild(tree), True
