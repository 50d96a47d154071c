"""Where saved activations live between forward and backward: the packed
objects of the saved-tensor hooks and the bytes they hold on each tier.

``ActivationStore.keep(t)`` / ``.offload(t)`` return a :class:`SavedActivation`
(the object the pack hook hands to autograd); ``.unpack(saved)`` returns the
tensor for backward. A saved activation is accounted from its pack until
autograd drops it (``__del__``): ``device_bytes`` counts what is on the device
now (kept tensors, copies still in flight, tensors brought back), ``host_bytes``
the host copies; ``peak_device_bytes`` / ``peak_host_bytes`` the most since
:meth:`ActivationStore.reset_peaks`; ``traffic`` (:class:`TransferCounts`)
what was moved.

The copies themselves are _activation_copies.py's. On CUDA the device tensor
is let go as soon as its copy out's completion event has fired (checked at
every pack, and waited for when a new copy would take the device past
``device_limit``). Copies back are started ahead of need by
:meth:`prefetch_before` (reverse of pack order, one layer ahead); the current
stream waits for their event at unpack. On the CPU a copy out is complete at
once and the original is let go, so the accounting is the same as on CUDA.

The SSD tier (``.offload(t, layer, ssd=True)``, with an :class:`SsdTier`
given; :class:`SpilledActivations` is the store's side of it): the host copy
is made as above, then spilled to the daemon by the tier's worker and let go
once written (``ssd_bytes`` counts what is spilled now, the tier's ``stats``
the traffic). In backward the prefetch queues recalls (into host memory) one
layer ahead like the copies back of the host tier; unpack waits for its
recall (or makes one on demand) and then brings the host copy back as the
host tier does. When no spilled activation is alive any more the store
queues a drop, so the daemon frees the scratch at once (it would anyway at
the step's end).

A tensor whose memory overlaps itself (an expanded tensor) is kept, never
copied.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Deque, Dict, List, Optional

import torch

from ._activation_copies import DeviceHostCopies

__all__ = ["ActivationStore", "SavedActivation", "footprint_bytes", "ByteGauge",
           "TransferCounts"]

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


class ByteGauge:
    """Bytes held on one tier now (``bytes``) and the most since the last
    :meth:`reset_peak` (``peak``)."""

    __slots__ = ("bytes", "peak")

    def __init__(self):
        self.bytes = self.peak = 0

    def add(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.peak:
            self.peak = self.bytes

    def sub(self, n: int) -> None:
        self.bytes -= n

    def reset_peak(self) -> None:
        self.peak = self.bytes


class TransferCounts:
    """What a store moved: bytes copied out to host memory and back,
    copies back (or recalls) started ahead of need (``prefetches``) and
    unpacks whose copy back had not been started (``on_demand``)."""

    __slots__ = ("bytes_moved_out", "bytes_moved_back", "prefetches", "on_demand")

    def __init__(self):
        self.bytes_moved_out = self.bytes_moved_back = 0
        self.prefetches = self.on_demand = 0


class PackOrder:
    """One forward's packs: the moved activations in pack order (the
    prefetch walks it backwards from the one unpacked) and the tensors
    packed, so a tensor saved twice is packed once."""

    def __init__(self):
        self._moved: List[weakref.ref] = []
        self._recent: Dict[int, weakref.ref] = {}  # id(tensor) -> SavedActivation

    def new_forward(self) -> None:
        self._moved = []
        self._recent = {}

    def packed(self, t: torch.Tensor) -> Optional[SavedActivation]:
        """The activation `t` was packed as in this forward, if it was."""
        ref = self._recent.get(id(t))
        saved = ref() if ref is not None else None
        if saved is not None and saved.source is not None and saved.source() is t:
            return saved
        return None

    def remember(self, t: torch.Tensor, saved: SavedActivation) -> None:
        try:
            saved.source = weakref.ref(t)
        except TypeError:
            return
        self._recent[id(t)] = weakref.ref(saved)

    def moved(self, saved: SavedActivation) -> None:
        """`saved` was copied out: it takes the next position."""
        saved.order = len(self._moved)
        self._moved.append(weakref.ref(saved))

    def at(self, order: int) -> Optional[SavedActivation]:
        """The moved activation at `order` (None: gone, or no such position)."""
        return self._moved[order]() if 0 <= order < len(self._moved) else None


class SpilledActivations:
    """The store's side of the SSD tier: the bytes spilled now, how many
    spilled activations autograd still holds un-recalled (at none the
    daemon's scratch is dropped), and the spills the tier's worker reports
    written (their host copies can go). ``tier``: the SsdTier, or None."""

    def __init__(self, tier):
        self.tier = tier
        self.gauge = ByteGauge()
        self._alive = 0
        self._written: Deque[weakref.ref] = collections.deque()  # appended by the worker

    def start(self, saved: SavedActivation, host: torch.Tensor) -> None:
        """Queues the spill of `saved`'s host copy `host`."""
        saved.layout = (host.shape, host.stride(), host.dtype)
        saved.key, saved.spill = self.tier.spill(host, saved.nbytes, saved.done)
        self.gauge.add(saved.nbytes)
        self._alive += 1
        ref, written, tier = weakref.ref(saved), self._written, self.tier

        def done(future):
            if future.exception() is None:
                written.append(ref)
            else:  # the host copy stays: the activation is on the host tier now
                tier.spill_failed(future.exception())

        saved.spill.add_done_callback(done)
        if saved.tier == HOST:
            saved.tier = SPILLED

    def released(self, saved: SavedActivation) -> None:
        """`saved`'s spilled copy is no longer wanted (recalled or freed)."""
        self.gauge.sub(saved.nbytes)
        self._alive -= 1
        if self._alive == 0 and self.tier is not None:
            self.tier.drop()

    def start_recall(self, saved: SavedActivation, pin: bool) -> None:
        """Queues the recall of `saved` into a new host tensor."""
        shape, stride, dtype = saved.layout
        saved.recall = self.tier.recall(saved.key, shape, stride, dtype, saved.nbytes, pin)
        self.released(saved)

    def reap(self, host: ByteGauge) -> None:
        """The activations whose spill is written (the tier's worker queued
        them taking no lock: a thread waiting for a recall may hold the
        store's) let go of their host copy, unless backward uses it."""
        while self._written:
            saved = self._written.popleft()()
            if saved is None or saved.store is None or saved.host_tensor is None:
                continue
            if saved.recall is None and saved.device_tensor is not saved.host_tensor:
                saved.host_tensor = None
                host.sub(saved.nbytes)


class ActivationStore:
    """The tiers' accounting and copies for one model's saved activations.

    ``device_limit`` (bytes or None): a copy out waits for earlier copies to
    complete rather than take ``device_bytes`` past it (a stall, on CUDA only;
    CPU copies complete at once). ``prefetch_layers``: copies back are started
    for the layer being unpacked and this many layers before it."""

    def __init__(self, device: torch.device, device_limit: Optional[int] = None,
                 prefetch_layers: int = 1, ssd=None):
        self.copies = DeviceHostCopies(device)
        self.device_limit = device_limit
        self.prefetch_layers = int(prefetch_layers)
        self._lock = threading.RLock()
        self.on_device = ByteGauge()
        self.on_host = ByteGauge()
        self.traffic = TransferCounts()
        self.spills = SpilledActivations(ssd)  # ssd: an SsdTier, or None: no SSD tier
        self.order = PackOrder()
        self._pending: Deque[SavedActivation] = collections.deque()  # copies out in flight

    # ------------------------------------------------------------ accounting
    @property
    def ssd(self):
        """The SsdTier, or None."""
        return self.spills.tier

    @property
    def device_bytes(self) -> int:
        return self.on_device.bytes

    @property
    def peak_device_bytes(self) -> int:
        return self.on_device.peak

    @property
    def host_bytes(self) -> int:
        return self.on_host.bytes

    @property
    def peak_host_bytes(self) -> int:
        return self.on_host.peak

    @property
    def ssd_bytes(self) -> int:
        return self.spills.gauge.bytes

    @property
    def peak_ssd_bytes(self) -> int:
        return self.spills.gauge.peak

    def reset_peaks(self) -> None:
        with self._lock:
            self.on_device.reset_peak()
            self.on_host.reset_peak()

    def _forget(self, saved: SavedActivation) -> None:
        with self._lock:
            if saved.device_tensor is not None:
                self.on_device.sub(saved.nbytes)
            if saved.host_tensor is not None:
                self.on_host.sub(saved.nbytes)
            if saved.key is not None and saved.recall is None:
                self.spills.released(saved)
            saved.device_tensor = saved.host_tensor = None
            saved.store = None

    def new_forward(self) -> None:
        """Called at the start of each forward: a new pack order."""
        with self._lock:
            self.order.new_forward()

    # ------------------------------------------------------------ pack
    def keep(self, t: torch.Tensor, layer: Optional[int]) -> SavedActivation:
        """`t` stays on the device (accounted)."""
        with self._lock:
            saved = self.order.packed(t)
            if saved is not None:
                return saved
            saved = SavedActivation(self, layer, t)
            self.on_device.add(saved.nbytes)
            self.order.remember(t, saved)
            return saved

    def offload(self, t: torch.Tensor, layer: Optional[int], ssd: bool = False) -> SavedActivation:
        """A host copy of `t`; the device tensor is let go once the copy is
        complete. With `ssd` (the store has an SSD tier) the host copy is then
        spilled to the daemon and let go once written. Falls back to
        :meth:`keep` for self-overlapping tensors."""
        with self._lock:
            saved = self.order.packed(t)
            if saved is not None:
                return saved
            if _overlaps(t):
                return self.keep(t, layer)
            saved = SavedActivation(self, layer, t)
            self.on_device.add(saved.nbytes)
            self._reap()
            self.spills.reap(self.on_host)
            self._make_room(saved.nbytes)
            host, saved.done = self.copies.copy_out(t)
            if saved.done is not None:
                saved.tier = IN_FLIGHT
                self._pending.append(saved)
            else:
                saved.tier = HOST
                saved.device_tensor = None
                self.on_device.sub(saved.nbytes)
            saved.host_tensor = host
            self.on_host.add(saved.nbytes)
            self.traffic.bytes_moved_out += saved.nbytes
            self.order.moved(saved)
            self.order.remember(t, saved)
            if ssd and self.ssd is not None and saved.nbytes > 0:
                self.spills.start(saved, host)
            return saved

    def _reap(self) -> None:
        """Lets go of the device tensors whose copy out has completed."""
        while self._pending and self._pending[0].done.query():
            self._release_device(self._pending.popleft())

    def _release_device(self, saved: SavedActivation) -> None:
        if saved.tier == IN_FLIGHT and saved.device_tensor is not None:
            saved.device_tensor = None
            self.on_device.sub(saved.nbytes)
        saved.tier = SPILLED if saved.key is not None else HOST

    def _make_room(self, nbytes: int) -> None:
        limit = self.device_limit
        while (limit is not None and self._pending
               and self.on_device.bytes > limit):
            oldest = self._pending.popleft()
            oldest.done.synchronize()
            self._release_device(oldest)

    def finish_forward(self) -> None:
        """Lets go of the completed copies (the rest at the next pack or unpack)."""
        with self._lock:
            if self.copies.cuda:
                self._reap()
            self.spills.reap(self.on_host)

    # ------------------------------------------------------------ unpack
    def unpack(self, saved: SavedActivation) -> torch.Tensor:
        with self._lock:
            self.spills.reap(self.on_host)
            if saved.device_tensor is not None:
                if saved.back is not None:
                    self.copies.wait_for(saved.device_tensor, saved.back)
                    saved.back = None
                t = saved.device_tensor
            else:
                ahead = saved.recall is not None  # a prefetch started its recall
                if saved.host_tensor is None and saved.key is not None:
                    self._take_recall(saved)
                if saved.host_tensor is None:
                    raise RuntimeError("a saved activation was unpacked after it was released")
                if not ahead:
                    self.traffic.on_demand += 1
                self._bring_back(saved, wait=True)
                t = saved.device_tensor
            if saved.order >= 0:
                self.prefetch_before(saved.order)
            return t

    def _take_recall(self, saved: SavedActivation) -> None:
        """Waits for `saved`'s recall (started now when none is): its host copy."""
        if saved.recall is None:
            self.spills.start_recall(saved, self.copies.cuda)
        host = saved.recall.result()  # a failed recall (DATA_LOSS, ...) raises here
        saved.host_tensor = host
        self.on_host.add(saved.nbytes)

    def _bring_back(self, saved: SavedActivation, wait: bool) -> None:
        dev, saved.back = self.copies.copy_back(saved.host_tensor, saved.done, wait)
        if saved.tier == IN_FLIGHT:
            self._release_device(saved)
            if saved in self._pending:
                self._pending.remove(saved)
        saved.device_tensor = dev
        self.on_device.add(saved.nbytes)
        self.traffic.bytes_moved_back += saved.nbytes

    def prefetch_before(self, order: int) -> None:
        """Starts copies back for the moved tensors packed before position
        `order` (the next ones backward needs) that belong to the same layer
        or up to ``prefetch_layers`` layers before it, while the device stays
        within ``device_limit``."""
        here = self.order.at(order)
        if here is None or here.layer is None:
            return
        lowest = here.layer - self.prefetch_layers
        k = order - 1
        while k >= 0:
            saved = self.order.at(k)
            k -= 1
            if saved is None or (saved.host_tensor is None and saved.key is None):
                continue
            if saved.layer is None or saved.layer < lowest:
                break
            if saved.device_tensor is not None:
                continue  # still there (copy out in flight) or back already
            if saved.host_tensor is None:  # spilled: read it back into host memory ahead
                if saved.recall is None:
                    self.traffic.prefetches += 1
                    self.spills.start_recall(saved, self.copies.cuda)
                continue
            if self.device_limit is not None and \
                    self.on_device.bytes + saved.nbytes > self.device_limit:
                break
            self.traffic.prefetches += 1
            self._bring_back(saved, wait=False)
