"""The copies of saved activations between the device and host memory
(activation offload, issue 23; _activation_store.py decides what is copied
and when).

On CUDA a copy out runs on a side stream after the current stream's work,
into pinned host memory, and records an event that says when it is complete;
a copy back runs on a second stream after the copy out's event. On the CPU
the "device" is the CPU: a copy out is a synchronous memcpy into a separate
host tensor and a copy back returns the host copy as it is.

Host copies keep the source's sizes and strides (``empty_strided``), so
backward sees the same layout and gives bit-identical gradients.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["DeviceHostCopies"]


class DeviceHostCopies:
    """The side streams of one device's copies (none on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._d2h = self._h2d = None
        if self.cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)

    def host_like(self, shape, stride, dtype) -> torch.Tensor:
        """An empty host tensor of that layout (pinned on CUDA)."""
        return torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=self.cuda)

    def copy_out(self, t: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """A host copy of `t` and, on CUDA, the event of its completion (the
        copy is in flight until then; `t` is kept for the side stream). On
        the CPU the copy is complete at return (event None)."""
        host = self.host_like(t.shape, t.stride(), t.dtype)
        if not self.cuda:
            host.copy_(t)
            return host, None
        current = torch.cuda.current_stream(self.device)
        self._d2h.wait_stream(current)
        with torch.cuda.stream(self._d2h):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._d2h)
        t.record_stream(self._d2h)
        return host, done

    def copy_back(self, host: torch.Tensor, after, wait: bool
                  ) -> Tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """A device copy of `host`, started after `after` (the copy out's
        event, or None) and the event of its completion; with `wait` the
        current stream waits for it (event None). On the CPU: `host` itself."""
        if not self.cuda:
            return host, None
        if after is not None:
            self._h2d.wait_event(after)
        with torch.cuda.stream(self._h2d):
            dev = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype,
                                      device=self.device)
            dev.copy_(host, non_blocking=True)
            back = torch.cuda.Event()
            back.record(self._h2d)
        if not wait:
            return dev, back
        self.wait_for(dev, back)
        return dev, None

    def wait_for(self, dev: torch.Tensor, back) -> None:
        """The current stream waits for a copy back (`back`) of `dev`."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(back)
        dev.record_stream(current)
