"""BackwardHooks: the two autograd hooks per parameter that tell a mode (the
resident or the streamed one, see _resident.py and _streamed.py) about each
gradient of a backward pass.

Before a parameter's gradient accumulates (a tensor hook) ``mode.grad_arriving(index)``
runs; after (torch 2.1's ``register_post_accumulate_grad_hook``)
``mode.grad_accumulated(index)``.
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
        self._handles: list = []

    def install(self, indices: Iterable[int]) -> None:
        """Hooks parameters `indices`."""
        mode_ref, lock = self._mode, self._lock
        for index in indices:
            p = self._params[index]

            def before(grad, index=index):
                mode = mode_ref()
                if mode is not None:
                    with lock:
                        mode.grad_arriving(index)
                return None

            def after(param, index=index):
                mode = mode_ref()
                if mode is not None:
                    with lock:
                        mode.grad_accumulated(index)

            self._handles.append(p.register_hook(before))
            self._handles.append(p.register_post_accumulate_grad_hook(after))

    def remove(self) -> None:
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles = []
