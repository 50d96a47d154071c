"""SlotRegions: the shared-memory slots of one session as a pipeline sees
them: the session, how many slots its gradients may hold at once (the rest are
left to weight fetches), and flat tensor views of the slots' regions (made
once per slot, region and dtype; ``torch.frombuffer`` over the mapping, no copy)."""

from __future__ import annotations

from typing import Dict

import torch

__all__ = ["SlotRegions"]


class SlotRegions:
    """The slots of the attached session (none before ``attach``)."""

    def __init__(self):
        self.session = None  # None: detached; a queued job then does nothing
        self.num_slots = 0  # slots gradients may hold at once
        self._views: Dict[tuple, torch.Tensor] = {}

    def attach(self, session, num_slots: int) -> None:
        self.session = session
        self.num_slots = int(num_slots)

    def view(self, slot: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The slot's "grad" or "param" region as a flat tensor of `dtype`."""
        key = (slot, kind, dtype)
        v = self._views.get(key)
        if v is None:
            region = (self.session.grad_region(slot) if kind == "grad"
                      else self.session.param_region(slot))
            esize = torch.empty((), dtype=dtype).element_size()
            v = torch.frombuffer(region, dtype=dtype, count=len(region) // esize)
            self._views[key] = v
        return v

    def pin(self, device) -> None:
        """On CUDA: registers every slot of the session with CUDA (DMA copies)."""
        session = self.session
        if device.streams and not device.pinned:
            slots = int(session.num_slots)
            device.pin([session.grad_region(slot) for slot in range(slots)] +
                       [session.param_region(slot) for slot in range(slots)])

    def drop_views(self) -> None:
        """Forgets the views (before the session's mapping goes away)."""
        self._views.clear()
