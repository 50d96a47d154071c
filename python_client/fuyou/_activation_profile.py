"""Measuring what the activation planner needs: the links' bandwidths (a probe
copy) and, over one forward and backward, each layer's forward and backward
time, the bytes it saves for backward and its inputs' bytes.

Forward time: the wall time of the layer's forward (CUDA synchronized before
and after, in the profiled step only). Backward time: between the gradient
reaching the layer's outputs and reaching its inputs, seen by
:class:`_BackwardMark` (an identity autograd function on both, in the
profiled step only; values and gradients pass through unchanged). A layer
whose inputs need no gradient gets twice its forward time. Time outside the
layers (``other_s``): the forward time outside them, times three (its
backward taken as twice its forward).
"""

from __future__ import annotations

import time
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ._activation_plan import LayerProfile, Profile
from ._tensor_tree import pass_through

__all__ = ["measure_link_bandwidth", "LayerRecorder", "StepProfiling", "BackwardClock",
           "tensor_bytes"]

PROBE_BYTES = 16 << 20


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in `obj` (tensors, tuples, lists, dict values)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x) for x in obj.values())
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_link_bandwidth(device: torch.device, nbytes: int = PROBE_BYTES,
                           repeats: int = 3) -> Tuple[float, float]:
    """(device-to-host, host-to-device) bytes/s: the best of `repeats` copies
    of `nbytes`. CUDA: pinned host memory, timed with events. CPU: a memcpy
    between two host tensors (the same figure both ways)."""
    device = torch.device(device)
    n = max(1, nbytes // 4)
    if device.type == "cuda":
        dev = torch.empty(n, dtype=torch.float32, device=device)
        host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        best = [float("inf"), float("inf")]
        for _ in range(repeats):
            for k, (dst, src) in enumerate(((host, dev), (dev, host))):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                best[k] = min(best[k], start.elapsed_time(end) / 1e3)
        return n * 4 / max(best[0], 1e-9), n * 4 / max(best[1], 1e-9)
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    bw = n * 4 / max(best, 1e-9)
    return bw, bw


class BackwardClock:
    """When the gradient reached each marked (layer, side) in the profiled
    backward (CUDA synchronized first); at the first mark it queues
    `on_backward_end` to run when that backward ends."""

    def __init__(self, device: torch.device, on_backward_end=None):
        self.device = device
        self.on_backward_end = on_backward_end
        self.times: Dict[Tuple[int, str], float] = {}
        self.backward_seen = False
        self._ref = weakref.ref(self)

    def mark(self, key) -> None:
        _sync(self.device)
        self.times[key] = time.perf_counter()
        if not self.backward_seen and self.on_backward_end is not None:
            torch.autograd.Variable._execution_engine.queue_callback(self.on_backward_end)
        self.backward_seen = True

    def marked(self, obj, key):
        """`obj` with its tensors that require grad passed through _BackwardMark."""
        ref = self._ref
        return pass_through(obj, lambda *tensors: _BackwardMark.apply(ref, key, *tensors))

    def between(self, index: int) -> Optional[float]:
        """Seconds from the gradient reaching layer `index`'s outputs to its
        inputs (None: not both seen, or out of order)."""
        t_out, t_in = self.times.get((index, "out")), self.times.get((index, "in"))
        if t_out is not None and t_in is not None and t_in >= t_out:
            return t_in - t_out
        return None


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward notes the time under (layer, side)."""

    @staticmethod
    def forward(ctx, clock_ref, key, *tensors):
        ctx.clock_ref, ctx.key = clock_ref, key
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors) if len(tensors) > 1 else tensors[0].detach()

    @staticmethod
    def backward(ctx, *grads):
        clock = ctx.clock_ref()
        if clock is not None:
            clock.mark(ctx.key)
        return (None, None) + grads


class LayerRecorder:
    """Collects one profiled step: call :meth:`run_layer` for each layer's
    forward, :meth:`saved` for each tensor packed, and :meth:`profile` after
    the backward (``clock``: its :class:`BackwardClock`)."""

    def __init__(self, names: List[str], device: torch.device, on_backward_end=None):
        self.names = names
        self.device = torch.device(device)
        n = len(names)
        self.forward_s = [0.0] * n
        self.saved_bytes = [0] * n
        self.input_bytes = [0] * n
        self.outside_bytes = 0
        self.forward_total_s = 0.0
        self.clock = BackwardClock(self.device, on_backward_end)

    def saved(self, layer: Optional[int], nbytes: int) -> None:
        if layer is None:
            self.outside_bytes += nbytes
        else:
            self.saved_bytes[layer] += nbytes

    def run_layer(self, index: int, fn, args, kwargs):
        """Runs one layer's forward, timed, its inputs and outputs marked."""
        self.input_bytes[index] += tensor_bytes(args) + tensor_bytes(kwargs)
        marked_args, _ = self.clock.marked(args, (index, "in"))
        _sync(self.device)
        t0 = time.perf_counter()
        out = fn(*marked_args, **kwargs)
        _sync(self.device)
        self.forward_s[index] += time.perf_counter() - t0
        out, _ = self.clock.marked(out, (index, "out"))
        return out

    def profile(self, d2h: float, h2d: float, ssd_write: Optional[float],
                ssd_read: Optional[float]) -> Profile:
        layers = []
        for i, name in enumerate(self.names):
            bwd = self.clock.between(i)
            if bwd is None:
                bwd = 2.0 * self.forward_s[i]
            layers.append(LayerProfile(name=name, forward_s=self.forward_s[i], backward_s=bwd,
                                       saved_bytes=self.saved_bytes[i],
                                       input_bytes=self.input_bytes[i]))
        outside_fwd = max(0.0, self.forward_total_s - sum(self.forward_s))
        return Profile(layers=layers, d2h=d2h, h2d=h2d, ssd_write=ssd_write, ssd_read=ssd_read,
                       other_s=3.0 * outside_fwd, outside_bytes=self.outside_bytes)


class StepProfiling:
    """Which step is profiled, and its recording until it is a profile:
    ``requested`` (the next forward is profiled), the recorder of the
    forward running (``recording``), the one whose backward is to come
    (``pending``) and the profile made last (``last_profile``).
    ``ssd_bandwidth``: the SSD tier's bytes/s in a profile (None: no tier)."""

    def __init__(self, names: List[str], device: torch.device,
                 ssd_bandwidth: Optional[float], requested: bool):
        self.names = names
        self.device = device
        self.ssd_bandwidth = ssd_bandwidth
        self.requested = requested
        self.recording: Optional[LayerRecorder] = None
        self.pending: Optional[LayerRecorder] = None
        self.last_profile: Optional[Profile] = None

    def start_forward(self, on_backward_end) -> Optional[LayerRecorder]:
        """The recorder of the forward starting now (None: not profiled)."""
        if self.requested:
            self.recording = LayerRecorder(self.names, self.device, on_backward_end)
            self.requested = False
        return self.recording

    def forward_ended(self, recorder: Optional[LayerRecorder], seconds: float) -> None:
        """`recorder`'s forward took `seconds`: its backward is to come."""
        if recorder is not None:
            recorder.forward_total_s = seconds
            self.recording, self.pending = None, recorder

    def take_profile(self) -> Profile:
        """The profile of the pending step (its backward ended, or none ran
        through a layer), with the links' bandwidths measured now."""
        recorder, self.pending = self.pending, None
        d2h, h2d = measure_link_bandwidth(self.device)
        profile = recorder.profile(d2h, h2d, self.ssd_bandwidth, self.ssd_bandwidth)
        self.last_profile = profile
        self.requested = False
        return profile
