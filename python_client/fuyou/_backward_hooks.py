"""BackwardHooks: the two autograd hooks per parameter that tell a mode (the
resident or the streamed one, see _resident.py and _streamed.py) about each
gradient of a backward pass.

Before a parameter's gradient accumulates (a tensor hook) ``mode.grad_arriving(index)``
runs; after (a hook on its AccumulateGrad node) ``mode.grad_accumulated(index)``.
Both run with ``lock`` held. The mode is held weakly: hooks of a closed or
collected optimizer do nothing."""

from __future__ import annotations

import threading
import weakref
from typing import Iterable, List

import torch

__all__ = ["BackwardHooks"]


class BackwardHooks:
    """The hooks installed on some of `params` for `mode`."""

    def __init__(self, params: List[torch.Tensor], lock: threading.RLock, mode):
        self._params = params
        self._lock = lock
        self._mode = weakref.ref(mode)
        self._nodes: list = []
        self._handles: list = []

    def install(self, indices: Iterable[int]) -> None:
        """Hooks parameters `indices`. Each must have its full shape, dtype and
        device now: its AccumulateGrad node takes them."""
        mode_ref, lock = self._mode, self._lock
        for index in indices:
            p = self._params[index]
            node = p.expand_as(p).grad_fn.next_functions[0][0]  # AccumulateGrad
            self._nodes.append(node)  # the node must outlive the hook

            def before(grad, index=index):
                mode = mode_ref()
                if mode is not None:
                    with lock:
                        mode.grad_arriving(index)
                return None

            def after(grad_inputs, grad_outputs, index=index):
                mode = mode_ref()
                if mode is not None:
                    with lock:
                        mode.grad_accumulated(index)

            self._handles.append(p.register_hook(before))
            self._handles.append(node.register_hook(after))

    def remove(self) -> None:
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles = []
        self._nodes = []
