"""The files of a sharded checkpoint: safetensors shards written one at a time,
and shard files read one tensor at a time.

Written: ``<stem>-00001-of-0000N.safetensors`` files (safetensors with the
``{"format": "pt"}`` metadata ``transformers`` checks) and a
``<stem>.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {key:
file}}``), the layout ``save_pretrained`` writes and ``from_pretrained`` reads.

Read: safetensors shards through ``safetensors.safe_open`` (the file is
memory-mapped and only the tensor asked for is copied out), and torch's ``.bin``
shards (``pytorch_model-*.bin``, older Hugging Face checkpoints and fuyou's own
exports before safetensors) through ``torch.load(mmap=True, weights_only=True)``.
One file is open at a time: moving to a tensor of another file closes the
previous one, so a reader's memory is about one shard (its mapped pages) and one
tensor, whatever the checkpoint's size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ._errors import InvalidArgument

__all__ = ["ShardWriter", "ShardFiles", "release_freed_memory", "read_index", "write_json",
           "keys_of"]

_LIBC = None


def release_freed_memory() -> None:
    """Gives the pages of freed heap memory back to the kernel (glibc's
    malloc_trim(0); nothing elsewhere). Module- and shard-sized buffers freed one
    after another otherwise stay in the process: small allocations made in
    between (gRPC, protobuf, Python) land in the freed block, the next large
    buffer no longer fits there, and the heap grows by about one buffer each
    time, so the peak RSS would follow the model's size. Measured: materializing
    128 MiB of 4 MiB modules raised the peak RSS by 118 MiB without this, 15 MiB
    with it (tests/python/materialize_worker.py)."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)


def write_json(path: Path, value) -> None:
    """`value` as JSON into `path`, atomically (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def read_index(path: Path) -> dict:
    """A ``*.index.json``: checked to hold a weight_map of key -> file name."""
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"checkpoint index {path} cannot be read: {e}") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise InvalidArgument(f"checkpoint index {path} has no weight_map (name -> shard file)")
    return index


# ---------------------------------------------------------------------- writing
class ShardWriter:
    """Writes keys, in a planned order, into safetensors shards of at most
    `shard_bytes` (a tensor larger than that gets a shard of its own). A shard
    is written, and its tensors let go, when its last key is added."""

    def __init__(self, directory: Path, stem: str, plan: List[Tuple[str, int]], shard_bytes: int):
        self.directory = directory
        groups: List[List[str]] = []
        size = 0
        for key, nbytes in plan:
            if not groups or (size + nbytes > shard_bytes and size > 0):
                groups.append([])
                size = 0
            groups[-1].append(key)
            size += nbytes
        n = len(groups)
        self.file_of: Dict[str, str] = {}
        self._last_key: Dict[str, str] = {}
        for i, keys in enumerate(groups, 1):
            name = f"{stem}-{i:05d}-of-{n:05d}.safetensors"
            for key in keys:
                self.file_of[key] = name
            self._last_key[keys[-1]] = name
        self.total_size = sum(nbytes for _k, nbytes in plan)
        self._pending: Dict[str, torch.Tensor] = {}
        self.peak_pending_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        from safetensors.torch import save_file

        if key not in self.file_of:
            raise AssertionError(f"key {key!r} not planned")
        self._pending[key] = tensor.contiguous()
        self.peak_pending_bytes = max(self.peak_pending_bytes, sum(
            t.numel() * t.element_size() for t in self._pending.values()))
        name = self._last_key.get(key)
        if name is not None:  # the shard is full: write it and forget its tensors
            tmp = self.directory / (name + ".tmp")
            save_file(self._pending, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, self.directory / name)
            self._pending = {}
            release_freed_memory()

    def write_index(self, filename: str, metadata: dict) -> None:
        if self._pending:
            raise AssertionError(f"keys never written: {sorted(self._pending)[:5]}")
        write_json(self.directory / filename,
                   {"metadata": dict(metadata, total_size=self.total_size),
                    "weight_map": self.file_of})


# ---------------------------------------------------------------------- reading
class ShardFiles:
    """The tensors of a checkpoint's shard files (`weight_map`: key -> file name
    in `directory`), one file open at a time (see the module doc). The last
    tensor read is kept, so reading one tensor piece by piece (a parameter
    spread over several chunks) reads it once."""

    def __init__(self, directory: Path, weight_map: Dict[str, str]):
        self.directory = directory
        self.weight_map = weight_map
        self._file: Optional[str] = None
        self._open = None        # safe_open handle, or the dict torch.load gave
        self._keys = set()       # the open file's keys
        self._last: Optional[Tuple[str, torch.Tensor]] = None
        self.loads = 0           # files opened so far

    def _select(self, key: str):
        name = self.weight_map.get(key)
        if name is None:
            raise InvalidArgument(f"checkpoint {self.directory} has no tensor {key!r}")
        if name != self._file:
            self.close()  # let the previous file go before the next one opens
            path = self.directory / name
            if not path.is_file():
                raise InvalidArgument(f"checkpoint {self.directory}: shard {name} (holding "
                                      f"{key!r}) is missing")
            self._open = _open_shard(path)
            self._keys = set(self._open.keys())
            self._file = name
            self.loads += 1
        return name

    def get(self, key: str) -> torch.Tensor:
        """The tensor `key`, a CPU tensor of its own (do not write into it)."""
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        name = self._select(key)
        self._last = None
        value = None
        if key in self._keys:
            value = self._open[key] if isinstance(self._open, dict) else self._open.get_tensor(key)
        if not torch.is_tensor(value):
            raise InvalidArgument(f"checkpoint shard {self.directory / name} has no tensor "
                                  f"{key!r}, though its index says so")
        self._last = (key, value)
        return value

    def shape(self, key: str) -> torch.Size:
        """The shape of `key`, from the file's header (safetensors) or its mapped
        tensor (.bin): no tensor is copied."""
        self._select(key)
        if isinstance(self._open, dict):
            return self.get(key).shape
        if key not in self._keys:
            raise InvalidArgument(f"checkpoint shard {self.directory / self._file} has no "
                                  f"tensor {key!r}, though its index says so")
        return torch.Size(self._open.get_slice(key).get_shape())

    def files(self) -> List[str]:
        return sorted(set(self.weight_map.values()))

    def close(self) -> None:
        self._last = None
        handle, self._open, self._file, self._keys = self._open, None, None, set()
        if handle is not None and not isinstance(handle, dict):
            handle.__exit__(None, None, None)
        release_freed_memory()


def _open_shard(path: Path):
    """A safetensors file's open handle, or the dict of a torch.save'd file."""
    if path.name.endswith(".safetensors"):
        from safetensors import safe_open
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
            return handle.__enter__()
        except Exception as e:  # safetensors raises its own error types
            raise InvalidArgument(f"checkpoint shard {path} is not a safetensors file: "
                                  f"{e}") from None
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # a file of torch's legacy (non-zip) format cannot be mapped
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict):
        raise InvalidArgument(f"checkpoint shard {path} is not a dict of tensors")
    return loaded


def keys_of(path: Path) -> List[str]:
    """The tensor names of one shard file (a safetensors file's header only)."""
    handle = _open_shard(path)
    try:
        return list(handle.keys())
    finally:
        if not isinstance(handle, dict):
            handle.__exit__(None, None, None)
