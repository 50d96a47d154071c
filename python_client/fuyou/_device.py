"""The device-specific steps of the chunk pipeline: copying a chunk's gradients
into its shared-memory slot, staging new weights, and pinning the slots.

Two implementations with one interface, picked by ``for_params``:

- ``CpuDevice``: plain synchronous copies (CPU parameters; also parameters that
  are spread over several devices). No streams, no events: the pipeline's
  queue, sender thread and ordering are the same, so CI tests them without a GPU.
- ``CudaDevice``: every parameter on one CUDA device. The gradient hook records
  an event on the current stream (``marker``); the sender thread makes a
  device-to-host copy stream wait on it and copies into the pinned slot
  (``non_blocking``), then waits for the copy's completion event itself: the
  autograd thread never waits for a copy. New weights go host-to-device on a
  second copy stream into a device staging tensor per chunk. The segment's slots
  are registered with CUDA (``cudaHostRegister``) so both copies are DMA.

Every method except ``marker`` runs on the sender thread or at step(); ``marker``
runs in the gradient hook and must never block the host.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["CpuDevice", "CudaDevice", "for_params", "is_pinned"]

log = logging.getLogger("fuyou")

# (offset in the slot, element count, source gradient piece or None: zeros)
Part = Tuple[int, int, Optional[torch.Tensor]]


def for_params(params: Sequence[torch.Tensor]):
    """CudaDevice when every parameter is on one CUDA device, else CpuDevice."""
    devices = {p.device for p in params}
    if len(devices) == 1:
        (device,) = devices
        if device.type == "cuda":
            return CudaDevice(device)
    return CpuDevice()


class CpuDevice:
    """Synchronous copies on the calling thread."""

    streams = False

    def marker(self, grads: List[torch.Tensor]):
        return None

    def copy_grads(self, dst: torch.Tensor, parts: List[Part], marker) -> None:
        for offset, numel, src in parts:
            piece = dst[offset:offset + numel]
            if src is None:
                piece.zero_()
            else:
                piece.copy_(src)

    def stage(self, src: torch.Tensor, staging: Optional[torch.Tensor]) -> torch.Tensor:
        if staging is None or staging.numel() != src.numel():
            staging = torch.empty(src.numel(), dtype=src.dtype)
        staging.copy_(src)
        return staging

    def installed(self) -> None:
        pass

    def pin(self, regions) -> None:
        pass

    def unpin(self) -> None:
        pass

    @property
    def pinned(self) -> bool:
        return False


class CudaDevice:
    """Copies on two side streams of `device`, synchronised by events."""

    streams = True

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._registered: List[int] = []
        self.pin_error: Optional[str] = None

    def marker(self, grads: List[torch.Tensor]):
        """On the autograd thread: an event after the kernels that produced
        `grads`; the gradients are marked as used by the copy stream, so the
        caching allocator does not hand their memory out before the copy ran
        (the pipeline also keeps references until the copy is enqueued)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        for g in grads:
            g.record_stream(self.d2h)
        return event

    def copy_grads(self, dst: torch.Tensor, parts: List[Part], marker) -> None:
        """On the sender thread: copies the chunk into the slot on the copy stream
        after `marker`, then waits (this thread only) for the copy to finish."""
        for offset, numel, src in parts:
            if src is None:
                dst[offset:offset + numel].zero_()
        with torch.cuda.stream(self.d2h):
            if marker is not None:
                self.d2h.wait_event(marker)
            for offset, numel, src in parts:
                if src is not None:
                    dst[offset:offset + numel].copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h)
        done.synchronize()

    def stage(self, src: torch.Tensor, staging: Optional[torch.Tensor]) -> torch.Tensor:
        """New weights from the (pinned) slot to device memory on the h2d stream;
        returns once the copy is done, so the slot can be released. step()
        installs from the staging tensor on the current stream."""
        if staging is None or staging.numel() != src.numel():
            staging = torch.empty(src.numel(), dtype=src.dtype, device=self.device)
        with torch.cuda.stream(self.h2d):
            staging.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d)
        done.synchronize()
        return staging

    def installed(self) -> None:
        """At step(), after the installs from slots were enqueued on the current
        stream: waits for them (the slots are released next), which also leaves
        the parameters ready on the current stream."""
        torch.cuda.current_stream(self.device).synchronize()

    def pin(self, regions) -> None:
        """Registers the range that holds every slot region (writable buffers of
        one mapping: the session's segment) with CUDA, in one cudaHostRegister.
        A failure (RLIMIT_MEMLOCK, say) is logged and the copies go through
        pageable memory: correct, slower, and each copy then blocks the sender
        thread for its whole duration."""
        spans = []
        for region in regions:
            t = torch.frombuffer(region, dtype=torch.uint8)
            if t.numel():
                spans.append((t.data_ptr(), t.data_ptr() + t.numel()))
        if not spans:
            return
        start, end = min(s for s, _ in spans), max(e for _, e in spans)
        try:
            err = torch.cuda.cudart().cudaHostRegister(start, end - start, 1)  # Portable
            code = int(getattr(err, "value", err))
        except Exception as e:  # an old torch without the call, say
            code, err = -1, e
        if code != 0:
            self.pin_error = (f"cudaHostRegister of the session's {end - start}-byte slots "
                              f"failed ({err}); raise RLIMIT_MEMLOCK (ulimit -l) to pin them")
            log.warning("fuyou: %s; copies go through pageable memory", self.pin_error)
            return
        self._registered.append(start)

    def unpin(self) -> None:
        """Unregisters what pin registered (before the mapping goes away)."""
        if not self._registered:
            return
        cudart = torch.cuda.cudart()
        torch.cuda.synchronize(self.device)
        for ptr in self._registered:
            cudart.cudaHostUnregister(ptr)
        self._registered = []

    @property
    def pinned(self) -> bool:
        return bool(self._registered)


def is_pinned(t: torch.Tensor) -> bool:
    """Whether CUDA knows `t`'s host memory as pinned (cudaPointerGetAttributes,
    through torch's is_pinned)."""
    return bool(torch.cuda.is_available() and t.is_pinned())
