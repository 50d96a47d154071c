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

__all__ = ["BackwardHooks", "SPARSE_GRADIENT"]

SPARSE_GRADIENT = ("fuyou.AdamW does not support sparse gradients (torch.optim.AdamW neither): "
                   "build the embedding with sparse=False (nn.Embedding's default)")


class BackwardHooks:
    """The hooks installed on some of `params` for `mode`."""

    def __init__(self, params: List[torch.Tensor], lock: threading.RLock, mode):
        self._params = params
        self._lock = lock
        self._mode = weakref.ref(mode)
        self._handles: list = []
        self._hooked: set = set()  # parameter indices with hooks
        self._waiting: set = set()  # ... to hook once they require grad (frozen now)

    def install(self, indices: Iterable[int]) -> None:
        """Hooks parameters `indices`; a frozen one (torch hooks only tensors
        that require grad) once ``install_unfrozen`` finds it unfrozen."""
        mode_ref, lock = self._mode, self._lock
        for index in indices:
            p = self._params[index]
            if index in self._hooked:
                continue
            if not p.requires_grad:
                self._waiting.add(index)
                continue
            self._waiting.discard(index)
            self._hooked.add(index)

            def before(grad, index=index):
                mode = mode_ref()
                if mode is not None:
                    with lock:
                        mode.grad_arriving(index)
                return None

            def after(param, index=index):
                if param.grad is not None and param.grad.is_sparse:
                    raise TypeError(SPARSE_GRADIENT)
                mode = mode_ref()
                if mode is not None:
                    with lock:
                        mode.grad_accumulated(index)

            self._handles.append(p.register_hook(before))
            self._handles.append(p.register_post_accumulate_grad_hook(after))

    def install_unfrozen(self) -> None:
        """Hooks the parameters ``install`` left waiting that require grad now."""
        if self._waiting:
            self.install([i for i in sorted(self._waiting) if self._params[i].requires_grad])

    def remove(self) -> None:
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles = []
        self._hooked = set()
        self._waiting = set()
