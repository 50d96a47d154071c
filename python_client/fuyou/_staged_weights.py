"""StagedWeights: new weights collected from a slot before commit.

When every slot is busy during backward, the sender thread frees the oldest
one: that chunk's new weights are copied into its staging tensor (one per
chunk, reused from step to step) and installed into the parameters only at
commit, because backward may still need the old ones. A chunk sent again in
the step (a redo) drops its staged weights."""

from __future__ import annotations

from typing import Dict

import torch

from ._chunk_weights import install
from ._chunking import Chunk

__all__ = ["StagedWeights"]


class StagedWeights:
    """The staging copies of one pipeline; touched by the sender thread while
    jobs are queued and otherwise with the optimizer's lock held."""

    def __init__(self):
        self._copies: Dict[int, torch.Tensor] = {}  # chunk id -> its staging tensor
        self._staged: Dict[int, Chunk] = {}  # chunks staged in this step

    def stage(self, c: Chunk, src: torch.Tensor, device) -> None:
        """Copies chunk `c`'s new weights `src` (a slot's view) into its staging
        tensor, by `device`'s copy machinery (_device.py)."""
        cid = c.chunk_id
        self._copies[cid] = device.stage(src, self._copies.get(cid))
        self._staged[cid] = c

    def discard(self, chunk_id: int) -> None:
        """The chunk's staged weights are stale (it is sent again)."""
        self._staged.pop(chunk_id, None)

    def install_all(self) -> None:
        """At commit: every staged chunk's weights into its parameters."""
        for cid, c in list(self._staged.items()):
            install(c, self._copies[cid])

    def reset(self) -> None:
        """A new step: nothing staged (the tensors are kept for reuse)."""
        self._staged = {}
