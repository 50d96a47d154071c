"""LiveBytes: what an offload_params model holds on its devices now and at
most: the resident blocks' bytes (fetched weights, in use or cached) and the
gradients not yet sent.

The resident bytes change with the optimizer's lock held; the gradient bytes
also from the sender thread (once it copied a chunk's gradients out), under a
lock of their own."""

from __future__ import annotations

import threading

__all__ = ["LiveBytes"]


class LiveBytes:
    """The live-bytes count of one WeightCache."""

    def __init__(self):
        self.resident = 0  # bytes of blocks with a buffer
        self.peak = 0  # the most ``now`` seen since the last reset (settable)
        self._grads = 0
        self._grads_lock = threading.Lock()

    @property
    def now(self) -> int:
        """Resident weights plus gradients held, in bytes."""
        return self.resident + self._grads

    @property
    def grads(self) -> int:
        return self._grads

    def note(self) -> None:
        """Raises the peak to what is live now."""
        live = self.resident + self._grads
        if live > self.peak:
            self.peak = live

    def add_grads(self, n: int) -> None:
        """Gradients of `n` bytes (negative: freed); any thread."""
        with self._grads_lock:
            self._grads += n
        self.note()

    def reset_grads(self) -> None:
        """No gradient is held any more (the step is over)."""
        with self._grads_lock:
            self._grads = 0
