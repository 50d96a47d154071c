"""Where saved activations live between forward and backward: the packed
objects of the saved-tensor hooks and the bytes they hold on each tier.

``ActivationStore.keep(t)`` / ``.offload(t)`` return a :class:`SavedActivation`
(the object the pack hook hands to autograd); ``.unpack(saved)`` returns the
tensor for backward. A saved activation is accounted from its pack until
autograd drops it (``__del__``): ``device_bytes`` counts what is on the device
now (kept tensors, copies still in flight, tensors brought back), ``host_bytes``
the host copies; ``peak_device_bytes`` / ``peak_host_bytes`` the most since
:meth:`ActivationStore.reset_peaks`.

On CUDA a copy out runs on a side stream after an event recorded on the
current stream, into pinned host memory; the device tensor is let go as soon
as the copy's completion event has fired (checked at every pack, and waited
for when a new copy would take the device past ``device_limit``). Copies back
run on a second stream, started ahead of need by :meth:`prefetch_before`
(reverse of pack order, one layer ahead); the current stream waits for their event at unpack.
On the CPU the "device" is the CPU: a copy out is a synchronous memcpy into a
separate host tensor and the original is let go at once, so the accounting is
the same as on CUDA; a host copy is returned as it is at unpack.

The SSD tier (``.offload(t, layer, ssd=True)``, with an :class:`SsdTier`
given): the host copy is made as above, then spilled to the daemon by the
tier's worker and let go once written (``ssd_bytes`` counts what is spilled
now, ``bytes_spilled`` / ``bytes_recalled`` the traffic). In backward the
prefetch queues recalls (into host memory) one layer ahead like the copies
back of the host tier; unpack waits for its recall (or makes one on demand)
and then brings the host copy back as the host tier does. When no spilled
activation is alive any more the store queues a drop, so the daemon frees
the scratch at once (it would anyway at the step's end).

Host copies keep the source's sizes and strides (``empty_strided``), so
backward sees the same layout and gives bit-identical gradients. A tensor
whose memory overlaps itself (an expanded tensor) is kept, never copied.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Deque, Dict, List, Optional

import torch

__all__ = ["ActivationStore", "SavedActivation", "footprint_bytes"]

DEVICE, IN_FLIGHT, HOST, SPILLED = "device", "in_flight", "host", "ssd"


def footprint_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor's elements span in its storage (sizes and strides)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return span * t.element_size()


def _overlaps(t: torch.Tensor) -> bool:
    check = getattr(torch, "_debug_has_internal_overlap", None)
    if check is not None:
        return check(t) != 0
    return any(st == 0 and s > 1 for s, st in zip(t.shape, t.stride()))


class SavedActivation:
    """One saved tensor as autograd holds it. ``layer``: the index of the
    layer whose forward saved it (None outside layers); ``tier``: where it is
    (device, in_flight, host)."""

    __slots__ = ("store", "layer", "nbytes", "tier", "device_tensor", "host_tensor", "done",
                 "back", "order", "source", "key", "spill", "recall", "layout", "__weakref__")

    def __init__(self, store: "ActivationStore", layer: Optional[int], t: torch.Tensor):
        self.store = store
        self.layer = layer
        self.nbytes = footprint_bytes(t)
        self.tier = DEVICE
        self.device_tensor: Optional[torch.Tensor] = t
        self.host_tensor: Optional[torch.Tensor] = None
        self.done = None   # CUDA event: copy out complete
        self.back = None   # CUDA event: copy back (prefetch) complete
        self.order = -1    # position in the store's pack order of moved tensors
        self.source = None  # weakref to the packed tensor (dedupe)
        self.key = None     # SSD tier: the key it was spilled under (None: not spilled)
        self.spill = None   # SSD tier: the spill's future
        self.recall = None  # SSD tier: the recall's future (its result: the host copy)
        self.layout = None  # SSD tier: (shape, stride, dtype) of the host copy

    def __del__(self):
        store = self.store
        if store is not None:
            store._forget(self)


class ActivationStore:
    """The tiers' accounting and copies for one model's saved activations.

    ``device_limit`` (bytes or None): a copy out waits for earlier copies to
    complete rather than take ``device_bytes`` past it (a stall, on CUDA only;
    CPU copies complete at once). ``prefetch_layers``: copies back are started
    for the layer being unpacked and this many layers before it."""

    def __init__(self, device: torch.device, device_limit: Optional[int] = None,
                 prefetch_layers: int = 1, ssd=None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.device_limit = device_limit
        self.prefetch_layers = int(prefetch_layers)
        self._lock = threading.RLock()
        self.device_bytes = self.host_bytes = 0
        self.peak_device_bytes = self.peak_host_bytes = 0
        self.bytes_moved_out = self.bytes_moved_back = 0
        self.prefetches = 0
        self.on_demand = 0  # unpacks whose copy back had not been started
        self.ssd = ssd  # an SsdTier, or None: no SSD tier
        self.ssd_bytes = self.peak_ssd_bytes = 0
        self._ssd_alive = 0  # spilled activations autograd still holds, not yet recalled
        self._written: Deque[weakref.ref] = collections.deque()  # spills done (appended by the worker)
        self._pending: Deque[SavedActivation] = collections.deque()  # copies out in flight
        self._moved: List[weakref.ref] = []  # moved tensors in pack order (this forward)
        self._recent: Dict[int, weakref.ref] = {}  # id(tensor) -> SavedActivation (dedupe)
        self._d2h = self._h2d = None
        if self.cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)

    # ------------------------------------------------------------ accounting
    def _add_device(self, n: int) -> None:
        self.device_bytes += n
        if self.device_bytes > self.peak_device_bytes:
            self.peak_device_bytes = self.device_bytes

    def _add_host(self, n: int) -> None:
        self.host_bytes += n
        if self.host_bytes > self.peak_host_bytes:
            self.peak_host_bytes = self.host_bytes

    def reset_peaks(self) -> None:
        with self._lock:
            self.peak_device_bytes = self.device_bytes
            self.peak_host_bytes = self.host_bytes

    def _forget(self, saved: SavedActivation) -> None:
        with self._lock:
            if saved.device_tensor is not None:
                self.device_bytes -= saved.nbytes
            if saved.host_tensor is not None:
                self.host_bytes -= saved.nbytes
            if saved.key is not None and saved.recall is None:
                self._ssd_released(saved)
            saved.device_tensor = saved.host_tensor = None
            saved.store = None

    def _ssd_released(self, saved: SavedActivation) -> None:
        """`saved`'s spilled copy is no longer wanted (recalled or freed)."""
        self.ssd_bytes -= saved.nbytes
        self._ssd_alive -= 1
        if self._ssd_alive == 0 and self.ssd is not None:
            self.ssd.drop()

    def _reap_spills(self) -> None:
        """The activations whose spill is written (the tier's worker queued
        them in ``_written``, taking no lock: a thread waiting for a recall
        may hold it) let go of their host copy, unless backward uses it."""
        while self._written:
            saved = self._written.popleft()()
            if saved is None or saved.store is None or saved.host_tensor is None:
                continue
            if saved.recall is None and saved.device_tensor is not saved.host_tensor:
                saved.host_tensor = None
                self.host_bytes -= saved.nbytes

    def new_forward(self) -> None:
        """Called at the start of each forward: a new pack order."""
        with self._lock:
            self._moved = []
            self._recent = {}

    # ------------------------------------------------------------ pack
    def _dedupe(self, t: torch.Tensor) -> Optional[SavedActivation]:
        ref = self._recent.get(id(t))
        saved = ref() if ref is not None else None
        if saved is not None and saved.source is not None and saved.source() is t:
            return saved
        return None

    def _remember(self, t: torch.Tensor, saved: SavedActivation) -> None:
        try:
            saved.source = weakref.ref(t)
        except TypeError:
            return
        self._recent[id(t)] = weakref.ref(saved)

    def keep(self, t: torch.Tensor, layer: Optional[int]) -> SavedActivation:
        """`t` stays on the device (accounted)."""
        with self._lock:
            saved = self._dedupe(t)
            if saved is not None:
                return saved
            saved = SavedActivation(self, layer, t)
            self._add_device(saved.nbytes)
            self._remember(t, saved)
            return saved

    def offload(self, t: torch.Tensor, layer: Optional[int], ssd: bool = False) -> SavedActivation:
        """A host copy of `t`; the device tensor is let go once the copy is
        complete. With `ssd` (the store has an SSD tier) the host copy is then
        spilled to the daemon and let go once written. Falls back to
        :meth:`keep` for self-overlapping tensors."""
        with self._lock:
            saved = self._dedupe(t)
            if saved is not None:
                return saved
            if _overlaps(t):
                return self.keep(t, layer)
            saved = SavedActivation(self, layer, t)
            self._add_device(saved.nbytes)
            self._reap()
            self._reap_spills()
            self._make_room(saved.nbytes)
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu",
                                       pin_memory=self.cuda)
            if self.cuda:
                current = torch.cuda.current_stream(self.device)
                self._d2h.wait_stream(current)
                with torch.cuda.stream(self._d2h):
                    host.copy_(t, non_blocking=True)
                    saved.done = torch.cuda.Event()
                    saved.done.record(self._d2h)
                t.record_stream(self._d2h)
                saved.tier = IN_FLIGHT
                self._pending.append(saved)
            else:
                host.copy_(t)
                saved.tier = HOST
                saved.device_tensor = None
                self.device_bytes -= saved.nbytes
            saved.host_tensor = host
            self._add_host(saved.nbytes)
            self.bytes_moved_out += saved.nbytes
            saved.order = len(self._moved)
            self._moved.append(weakref.ref(saved))
            self._remember(t, saved)
            if ssd and self.ssd is not None and saved.nbytes > 0:
                self._start_spill(saved, host)
            return saved

    def _start_spill(self, saved: SavedActivation, host: torch.Tensor) -> None:
        saved.layout = (host.shape, host.stride(), host.dtype)
        saved.key, saved.spill = self.ssd.spill(host, saved.nbytes, saved.done)
        self.ssd_bytes += saved.nbytes
        self.peak_ssd_bytes = max(self.peak_ssd_bytes, self.ssd_bytes)
        self._ssd_alive += 1
        ref, written, tier = weakref.ref(saved), self._written, self.ssd

        def done(future):
            if future.exception() is None:
                written.append(ref)
            else:  # the host copy stays: the activation is on the host tier now
                tier.spill_failed(future.exception())

        saved.spill.add_done_callback(done)
        if saved.tier == HOST:
            saved.tier = SPILLED

    def _reap(self) -> None:
        """Lets go of the device tensors whose copy out has completed."""
        while self._pending and self._pending[0].done.query():
            self._release_device(self._pending.popleft())

    def _release_device(self, saved: SavedActivation) -> None:
        if saved.tier == IN_FLIGHT and saved.device_tensor is not None:
            saved.device_tensor = None
            self.device_bytes -= saved.nbytes
        saved.tier = SPILLED if saved.key is not None else HOST

    def _make_room(self, nbytes: int) -> None:
        limit = self.device_limit
        while (limit is not None and self._pending
               and self.device_bytes > limit):
            oldest = self._pending.popleft()
            oldest.done.synchronize()
            self._release_device(oldest)

    def finish_forward(self) -> None:
        """Lets go of the completed copies (the rest at the next pack or unpack)."""
        with self._lock:
            if self.cuda:
                self._reap()
            self._reap_spills()

    # ------------------------------------------------------------ unpack
    def unpack(self, saved: SavedActivation) -> torch.Tensor:
        with self._lock:
            self._reap_spills()
            if saved.device_tensor is not None:
                if saved.back is not None:
                    torch.cuda.current_stream(self.device).wait_event(saved.back)
                    saved.device_tensor.record_stream(torch.cuda.current_stream(self.device))
                    saved.back = None
                t = saved.device_tensor
            else:
                ahead = saved.recall is not None  # a prefetch started its recall
                if saved.host_tensor is None and saved.key is not None:
                    self._take_recall(saved)
                if saved.host_tensor is None:
                    raise RuntimeError("a saved activation was unpacked after it was released")
                if not ahead:
                    self.on_demand += 1
                self._bring_back(saved, wait=True)
                t = saved.device_tensor
            if saved.order >= 0:
                self.prefetch_before(saved.order)
            return t

    def _start_recall(self, saved: SavedActivation) -> None:
        shape, stride, dtype = saved.layout
        saved.recall = self.ssd.recall(saved.key, shape, stride, dtype, saved.nbytes, self.cuda)
        self._ssd_released(saved)

    def _take_recall(self, saved: SavedActivation) -> None:
        """Waits for `saved`'s recall (started now when none is): its host copy."""
        if saved.recall is None:
            self._start_recall(saved)
        host = saved.recall.result()  # a failed recall (DATA_LOSS, ...) raises here
        saved.host_tensor = host
        self._add_host(saved.nbytes)

    def _bring_back(self, saved: SavedActivation, wait: bool) -> None:
        host = saved.host_tensor
        if self.cuda:
            self._h2d.wait_event(saved.done)
            with torch.cuda.stream(self._h2d):
                dev = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype,
                                          device=self.device)
                dev.copy_(host, non_blocking=True)
                saved.back = torch.cuda.Event()
                saved.back.record(self._h2d)
            if wait:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(saved.back)
                dev.record_stream(current)
                saved.back = None
        else:
            dev = host  # the device is the host: the copy is returned as it is
        if saved.tier == IN_FLIGHT:
            self._release_device(saved)
            if saved in self._pending:
                self._pending.remove(saved)
        saved.device_tensor = dev
        self._add_device(saved.nbytes)
        self.bytes_moved_back += saved.nbytes

    def prefetch_before(self, order: int) -> None:
        """Starts copies back for the moved tensors packed before position
        `order` (the next ones backward needs) that belong to the same layer
        or up to ``prefetch_layers`` layers before it, while the device stays
        within ``device_limit``."""
        here = self._moved[order]() if order < len(self._moved) else None
        if here is None or here.layer is None:
            return
        lowest = here.layer - self.prefetch_layers
        k = order - 1
        while k >= 0:
            saved = self._moved[k]()
            k -= 1
            if saved is None or (saved.host_tensor is None and saved.key is None):
                continue
            if saved.layer is None or saved.layer < lowest:
                break
            if saved.device_tensor is not None:
                continue  # still there (copy out in flight) or back already
            if saved.host_tensor is None:  # spilled: read it back into host memory ahead
                if saved.recall is None:
                    self.prefetches += 1
                    self._start_recall(saved)
                continue
            if self.device_limit is not None and \
                    self.device_bytes + saved.nbytes > self.device_limit:
                break
            self.prefetches += 1
            self._bring_back(saved, wait=False)
