"""Saved tensors that are weights or buffers (or views of one), told apart
from activations by activation offload's pack hook (issue 23): never
offloaded, handed to the parameter stream (fuyou.stream_parameters) when the
model has one, else kept as they are."""

from __future__ import annotations

import weakref

import torch

__all__ = ["SavedWeights"]


class _Weight:
    """A saved weight handed to the parameter stream's pack hook."""

    __slots__ = ("stream", "packed")

    def __init__(self, stream, packed):
        self.stream, self.packed = stream, packed


class SavedWeights:
    """The weights of `model` as its forward saves them. ``explicit_stream``:
    the parameter stream given to offload_activations (None: the one found on
    the model at each forward); ``stream``: the one of this forward;
    ``seen``: saved tensors recognised as weights or buffers."""

    def __init__(self, model: torch.nn.Module, explicit_stream=None):
        self.model = model
        self.explicit_stream = explicit_stream
        self.stream = None
        self.seen = 0
        self._ptrs: set = set()

    def new_forward(self) -> None:
        """At each forward: the model's parameter stream and its weights' storages now."""
        self.stream = self.explicit_stream or _parameter_stream_of(self.model)
        self._ptrs = _storage_ptrs(self.model)

    def is_weight(self, t: torch.Tensor) -> bool:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return True
        if t.numel() == 0:
            return False
        return t.data_ptr() - t.storage_offset() * t.element_size() in self._ptrs

    def pack(self, t: torch.Tensor):
        """What the pack hook saves for the weight `t`."""
        self.seen += 1
        stream = self.stream
        if stream is not None:
            packed = stream._pack(t)
            if packed is not t:
                return _Weight(stream, packed)
        return t

    @staticmethod
    def unpack(saved):
        """The tensor of what :meth:`pack` saved (`saved` itself when it is one)."""
        if isinstance(saved, _Weight):
            return saved.stream._unpack(saved.packed)
        return saved


def _storage_ptrs(model) -> set:
    ptrs = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.numel():
            ptrs.add(t.data_ptr() - t.storage_offset() * t.element_size())
    return ptrs


def _parameter_stream_of(model):
    """The open fuyou.stream_parameters handle of `model`, or None."""
    from ._stream import stream_of
    return stream_of(model)
