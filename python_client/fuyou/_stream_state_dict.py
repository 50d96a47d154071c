"""``state_dict`` and ``load_state_dict`` of a streamed model (issue 19, item 3).

Between uses a streamed parameter is an empty placeholder; its weights live in
fuyoud. Without these hooks ``model.state_dict()`` would hold tensors of shape
``(0,)`` and ``torch.save`` would silently lose the trained model, and
``model.load_state_dict`` would fail torch's shape check against the
placeholders. :class:`StreamedStateDict` hooks every module of the model
(``fuyou.stream_parameters`` installs it, once per optimizer)::

    state_dict()        each module's state-dict hook replaces the entries of its
                        streamed parameters by their weights at the last
                        committed step, fetched module by module (the weight
                        cache's fetch), in the parameter's dtype, shape and
                        device; a tied parameter is fetched once per call and
                        its names share one tensor, as torch's do
    load_state_dict()   each module's pre-hook takes its streamed parameters'
                        entries out of torch's way (checking them as torch
                        does: tensor, shape) and keeps references to them; the
                        post-hook of the module the load started at writes them,
                        if no error was found, as the chunks' fp32 masters (the
                        daemon recomputes the stored working weights) in one
                        import, leaving m, v and the step counts as they are,
                        and drops the weight cache

``keep_vars=True`` gives the parameters themselves, as torch does (the
placeholders): fuyou's own exports rely on their identity.

Both run between steps only. ``state_dict`` refuses to hold more than
``limit_bytes`` of streamed weights (:func:`default_state_dict_limit`): a larger
model is saved with ``fuyou.export_checkpoint(opt, path, model,
shard_bytes=...)``, one chunk at a time.
"""

from __future__ import annotations

import os
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ._errors import FailedPrecondition
from ._protocol import STATE_MASTER
from ._sizes import parse_size

__all__ = ["StreamedStateDict", "default_state_dict_limit", "STATE_DICT_LIMIT_ENV",
           "DEFAULT_STATE_DICT_LIMIT"]

STATE_DICT_LIMIT_ENV = "FUYOU_STATE_DICT_LIMIT"
DEFAULT_STATE_DICT_LIMIT = 8 << 30  # bytes; or a quarter of the host's RAM when less


def _host_ram() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_state_dict_limit() -> int:
    """The limit ``state_dict_limit_bytes=None`` means: ``$FUYOU_STATE_DICT_LIMIT``
    (a size as ``fuyou.parse_size`` reads it) when set, else 8 GiB or a quarter
    of the host's RAM, whichever is less."""
    env = os.environ.get(STATE_DICT_LIMIT_ENV)
    if env is not None and env.strip():
        return parse_size(env, STATE_DICT_LIMIT_ENV)
    ram = _host_ram()
    return min(DEFAULT_STATE_DICT_LIMIT, ram // 4) if ram else DEFAULT_STATE_DICT_LIMIT


class _Saving:
    """What one ``state_dict()`` call fetched so far (keyed by its destination)."""

    __slots__ = ("dest", "generation", "tensors", "nbytes")

    def __init__(self, dest, generation: int):
        self.dest = dest  # a weakref to the destination dict
        self.generation = generation
        self.tensors: Dict[int, List[torch.Tensor]] = {}  # id(block) -> one per member
        self.nbytes = 0


class _Loading:
    """One ``load_state_dict()`` call: the values found for streamed parameters."""

    __slots__ = ("root", "error_msgs", "missing_keys", "values", "taken")

    def __init__(self, root, error_msgs, missing_keys):
        self.root = root
        self.error_msgs = error_msgs
        self.missing_keys = missing_keys
        self.values: Dict[int, Tuple[object, object, torch.Tensor]] = {}  # index -> (block, member, value)
        self.taken: Dict[int, List[str]] = {}  # id(module) -> keys taken out of torch's way


class StreamedStateDict:
    """The state-dict hooks of one offload_params model (see the module doc).

    ``limit_bytes``: the most bytes of streamed weights one ``state_dict()``
    call may hold (the parameters' own dtype). Every method runs with the
    optimizer's lock held.
    """

    def __init__(self, offload, limit_bytes: int):
        self._offload = weakref.ref(offload)
        self.limit_bytes = int(limit_bytes)
        self.generation = 0  # a load_state_dict changed the weights
        self._saving: Optional[_Saving] = None
        self._loading: Optional[_Loading] = None
        self._handles = []
        ref = weakref.ref(self)

        def save_hook(module, destination, prefix, local_metadata):
            hooks = ref()
            if hooks is not None:
                hooks._save(module, destination, prefix)

        def load_pre(module, state_dict, prefix, local_metadata, strict, missing_keys,
                     unexpected_keys, error_msgs):
            hooks = ref()
            if hooks is not None:
                hooks._load_pre(module, state_dict, prefix, missing_keys, error_msgs)

        def load_post(module, incompatible_keys):
            hooks = ref()
            if hooks is not None:
                hooks._load_post(module)

        for _name, module in offload.layout.modules:
            if self._members(module):
                self._handles.append(module._register_state_dict_hook(save_hook))
            self._handles.append(module._register_load_state_dict_pre_hook(load_pre,
                                                                           with_module=True))
            self._handles.append(module.register_load_state_dict_post_hook(load_post))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------ helpers
    def _offload_or_raise(self, what: str):
        offload = self._offload()
        opt = offload._optimizer() if offload is not None else None
        if opt is None or getattr(opt, "_closed", False):
            raise FailedPrecondition(
                f"model.{what}() of a streamed model whose fuyou.AdamW is closed: its weights are "
                "in the daemon's job; open the optimizer on the job again (and "
                "fuyou.stream_parameters) first")
        return offload, opt

    def _members(self, module) -> Dict[str, tuple]:
        """name -> (block, member) of `module`'s own streamed parameters."""
        offload = self._offload()
        if offload is None:
            return {}
        by_param = {}
        for b in offload.uses(module):
            for m in b.members:
                by_param[id(m.param)] = (b, m)
        return {name: by_param[id(p)] for name, p in module._parameters.items()
                if p is not None and id(p) in by_param}

    def _check_between_steps(self, offload, opt, what: str) -> None:
        opt._check_usable()
        pipeline = offload._pipeline
        if pipeline.step.in_step or any(pipeline.passes.param_passes):
            raise FailedPrecondition(
                f"model.{what}() of a streamed model during a step of job {opt.job!r} (a backward "
                "pass ran and step() was not called yet): call it after optimizer.step() (or "
                "zero_grad())")
        if any(b.refs > 0 for b in offload.blocks):
            raise FailedPrecondition(
                f"model.{what}() of a streamed model during its forward: call it between steps")

    # ------------------------------------------------------------ state_dict
    def _save(self, module, destination, prefix: str) -> None:
        members = self._members(module)
        wanted = {name: bm for name, bm in members.items()
                  if prefix + name in destination and destination[prefix + name] is not bm[1].param}
        if not wanted:
            return  # keep_vars=True: the parameters themselves, as torch gives them
        offload, opt = self._offload_or_raise("state_dict")
        with offload._lock:
            self._check_between_steps(offload, opt, "state_dict")
            saving = self._saving_for(destination, offload)
            blocks = []
            for b, _m in wanted.values():
                if id(b) not in saving.tensors and b not in blocks:
                    blocks.append(b)
            need = sum(b.nbytes for b in blocks)
            if saving.nbytes + need > self.limit_bytes:
                self._saving = None
                self._raise_limit(offload, opt, saving.nbytes + need)
            for b in blocks:
                saving.tensors[id(b)] = self._fetch(offload, b)
                saving.nbytes += b.nbytes
            for name, (b, m) in wanted.items():
                position = next(i for i, x in enumerate(b.members) if x is m)
                destination[prefix + name] = saving.tensors[id(b)][position]

    def _saving_for(self, destination, offload) -> _Saving:
        generation = (offload.committed_step, self.generation)
        saving = self._saving
        if saving is not None and saving.dest is not None and saving.dest() is destination \
                and saving.generation == generation:
            return saving
        try:
            dest_ref = weakref.ref(destination, self._saving_done)
        except TypeError:  # a plain dict given as destination: no sharing across modules
            dest_ref = None
        saving = _Saving(dest_ref, generation)
        self._saving = saving if dest_ref is not None else None
        return saving

    def _saving_done(self, dead_ref) -> None:
        saving = self._saving
        if saving is not None and saving.dest is dead_ref:
            self._saving = None

    def _raise_limit(self, offload, opt, would_hold: int) -> None:
        total = sum(b.nbytes for b in offload.blocks)
        raise FailedPrecondition(
            f"model.state_dict() of the streamed model of job {opt.job!r} would hold at least "
            f"{would_hold} bytes of weights (the model's streamed weights are {total} bytes), "
            f"more than state_dict_limit_bytes={self.limit_bytes}: save it with "
            "fuyou.export_checkpoint(opt, path, model, shard_bytes=...) (a sharded checkpoint, "
            "written one chunk at a time; fuyou.materialize(model, opt, checkpoint=path) loads "
            "it), or raise the limit: fuyou.stream_parameters(..., state_dict_limit_bytes=...), "
            f"handle.state_dict_limit_bytes or ${STATE_DICT_LIMIT_ENV}")

    @staticmethod
    def _fetch(offload, block) -> List[torch.Tensor]:
        """The block's committed weights, one tensor per member (its own dtype,
        shape and device), through the weight cache."""
        weights = offload.weights
        weights.acquire(block)
        try:
            return [m.param.detach().clone() for m in block.members]
        finally:
            weights.release(block)

    # ------------------------------------------------------------ load_state_dict
    def _load_pre(self, module, state_dict, prefix: str, missing_keys, error_msgs) -> None:
        loading = self._loading
        if loading is None or loading.error_msgs is not error_msgs:
            loading = _Loading(module, error_msgs, missing_keys)  # the module the load started at
            self._loading = loading
        members = self._members(module)
        taken = []
        for name, (b, m) in members.items():
            key = prefix + name
            if key not in state_dict:
                continue  # torch reports it missing
            value = state_dict.pop(key)
            taken.append(key)
            # torch's own checks (Module._load_from_state_dict), against the real shape
            if not torch.overrides.is_tensor_like(value):
                error_msgs.append(f'While copying the parameter named "{key}", expected '
                                  "torch.Tensor or Tensor-like object from checkpoint but "
                                  f"received {type(value)}")
                continue
            shape = torch.Size(m.shape)
            if len(shape) == 0 and len(value.shape) == 1:
                value = value[0]
            if value.shape != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{value.shape} from checkpoint, the shape in current model "
                                  f"is {shape}.")
                continue
            loading.values[m.index] = (b, m, value)
        if taken:
            loading.taken[id(module)] = taken

    def _load_post(self, module) -> None:
        loading = self._loading
        if loading is None:
            return
        for key in loading.taken.pop(id(module), []):
            if key in loading.missing_keys:  # torch counted the entry taken out as missing
                loading.missing_keys.remove(key)
        if module is not loading.root:
            return
        self._loading = None
        if loading.error_msgs or not loading.values:
            return  # torch raises; nothing was written
        offload, opt = self._offload_or_raise("load_state_dict")
        with offload._lock:
            self._check_between_steps(offload, opt, "load_state_dict")
            self._write_masters(offload, loading.values)

    def _write_masters(self, offload, values) -> None:
        """Writes the loaded values as the fp32 masters of their chunks (each
        rounded to the parameter's dtype first, as torch's copy into the
        parameter would) in one import; m, v and the step counts stay."""
        pipeline = offload._pipeline
        session = pipeline.session
        weights = offload.weights
        weights.drop_cache()  # also waits for the fetches in flight
        touched = []
        for c in (c for b in offload.blocks for c in b.chunks):  # a data-parallel rank's copies too
            if any(seg.param_index in values for seg in c.segments):
                touched.append(c)
        for c in touched:
            master = torch.empty(c.num_elements, dtype=torch.float32)
            if not all(seg.param_index in values for seg in c.segments):
                session.read_state(c.chunk_id, STATE_MASTER, 0, master.numpy())
            with torch.no_grad():
                for seg in c.segments:
                    found = values.get(seg.param_index)
                    if found is None:
                        continue
                    _b, m, value = found
                    flat = value.detach().to(device="cpu", dtype=m.dtype).reshape(-1)
                    master[seg.offset:seg.offset + seg.numel] = flat[seg.start:seg.end].float()
            pipeline.states.write(c, STATE_MASTER, master)
        pipeline.states.commit_import()
        self.generation += 1
        offload.weights_loaded += 1  # weights saved for backward before it are stale
        weights.drop_cache()
