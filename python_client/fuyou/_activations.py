"""fuyou.offload_activations: saved activations swapped out to host memory
during forward and back for backward, or recomputed, by a per-layer plan
(issue 23; see _activation_plan.py for the cost model and the search,
_activation_store.py for the tiers and copies).

One step, seen from here::

    model.forward (wrapped)   saved-tensor hooks pushed (on top of any that
                              fuyou.stream_parameters pushed in its pre-hook)
      layer i forward         (wrapped) the current layer is i; a ``recompute``
                              layer runs under torch.utils.checkpoint
                              (use_reentrant=False); its inputs are held
      pack(t)                 a weight or buffer (or a view of one): never
                              offloaded (handed to the parameter stream when
                              there is one, else kept as it is); an activation
                              of a ``host`` layer of at least ``min_bytes``:
                              copied out (ActivationStore.offload); any other:
                              kept and accounted
    backward
      unpack(saved)           its tensor (waiting for, or starting, its copy
                              back), and prefetch of the ones packed before it

The first step after install is profiled when no plan is given: every layer
kept, its times and bytes measured (_activation_profile.py), then the planner
picks the plan for the steps after it, printed as a table (``verbose``) and
kept as ``handle.plan``.

The SSD tier (``ssd=``: a daemon address or a fuyou.AdamW, for a session of
its own at that daemon, or a session; _activation_ssd.py): an ``ssd``
layer's activations are copied to host memory as for ``host``, then spilled
to the daemon's storage tier (scratch files striped over its storage paths,
never committed, dropped at the step's end, the session's end, or as soon as
none is alive) and recalled one layer ahead in backward. Without ``ssd=`` the
automatic planner plans without it (where host memory is short it picks
recomputation instead), and ``apply`` of a plan that chooses ``ssd`` for
some layer raises FailedPrecondition naming them. Budgets
are never exceeded silently: a step whose measured device peak exceeds the
budget logs a warning.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import List, Optional, Sequence, Union

import torch
import torch.utils.checkpoint

from ._activation_plan import CHOICES, HOST, KEEP, RECOMPUTE, SSD, Plan, plan_activations
from ._activation_profile import LayerRecorder, measure_link_bandwidth
from ._activation_store import ActivationStore, SavedActivation, footprint_bytes
from ._errors import FailedPrecondition, InvalidArgument
from ._sizes import parse_size

__all__ = ["offload_activations", "ActivationOffload", "ssd_tier_available"]

log = logging.getLogger("fuyou")


def ssd_tier_available() -> bool:
    """Whether this client can spill activations to a daemon's storage tier
    (the binding has SpillActivation); a handle uses it only with ``ssd=``."""
    try:
        from . import _native
        return hasattr(_native.module().Session, "spill_activation")
    except Exception:
        return False


def _default_host_budget() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def find_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The children of the model's largest nn.ModuleList (the repeated blocks)."""
    best: List[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(best):
            best = list(m)
    return best


def offload_activations(model: torch.nn.Module, device_budget: Union[int, str, None] = None,
                        host_budget: Union[int, str, None] = None,
                        min_bytes: Union[int, str] = "64KiB", *,
                        plan: Union[None, str, Sequence[str], Plan] = None,
                        layers: Optional[Sequence[torch.nn.Module]] = None,
                        ssd_bandwidth: Optional[float] = None, parameter_stream=None,
                        prefetch_layers: int = 1, verbose: bool = True,
                        ssd=None) -> "ActivationOffload":
    """Installs activation offload on `model` and returns its handle (also a
    context manager; ``remove()`` uninstalls).

    ``device_budget``: the most bytes of saved activations the plan may keep
    on the device (None: unbounded, so the planner keeps everything unless
    told otherwise); ``host_budget``: the most bytes of host copies (None:
    half the host's RAM). Both take bytes or sizes such as ``"64MiB"``.
    ``min_bytes``: smaller saved tensors are always kept. ``plan``: None (the
    first step is profiled and planned), one of ``"keep"``, ``"host"``,
    ``"recompute"`` for every layer, a list of choices (one per layer) or a
    :class:`Plan`. ``layers``: the modules the plan is made of (default: the
    children of the model's largest nn.ModuleList). ``ssd_bandwidth``
    (bytes/s): used for planning only where an SSD tier exists (see the module
    docstring). ``parameter_stream``: the handle of ``fuyou.stream_parameters``
    on this model (found by itself when not given), whose saved weights stay
    its own. ``prefetch_layers``: backward brings a layer's offloaded tensors
    back while this many later layers still run their backward (the cost
    model assumes 1). ``ssd``: where the SSD tier's activations go: a daemon
    address or a fuyou.AdamW (a session of the handle's own at that daemon,
    on a job of its own, closed and the job deleted by ``remove()``), or a
    fuyou._fuyou.Session used as it is (it must leave the tier a slot); None:
    no SSD tier.
    """
    if getattr(model, "_fuyou_activation_offload", None) is not None:
        raise InvalidArgument("offload_activations is already installed on this model: "
                              "call remove() on its handle first")
    return ActivationOffload(model, device_budget, host_budget, min_bytes, plan, layers,
                             ssd_bandwidth, parameter_stream, prefetch_layers, verbose, ssd)


class _Weight:
    """A saved weight handed to the parameter stream's pack hook."""

    __slots__ = ("stream", "packed")

    def __init__(self, stream, packed):
        self.stream, self.packed = stream, packed


class ActivationOffload:
    """The handle of :func:`offload_activations`.

    ``plan``: the :class:`Plan` in use (None before profiling, or for a plan
    given as choices); ``choices``: the per-layer choices in use;
    ``store``: the :class:`ActivationStore` (``device_bytes``,
    ``peak_device_bytes``, ``host_bytes``, ``peak_host_bytes``,
    ``bytes_moved_out`` / ``bytes_moved_back``, ``prefetches``);
    ``weights_seen``: saved tensors recognised as weights or buffers (never
    offloaded). :meth:`profile` re-profiles at the next step."""

    def __init__(self, model, device_budget, host_budget, min_bytes, plan, layers,
                 ssd_bandwidth, parameter_stream, prefetch_layers, verbose, ssd=None):
        self.model = model
        self.layers = list(layers) if layers is not None else find_layers(model)
        if not self.layers:
            raise InvalidArgument("offload_activations found no layers: the model has no "
                                  "nn.ModuleList; name them with layers=[...]")
        self.names = [_name_in(model, m) for m in self.layers]
        self.device_budget = (None if device_budget is None
                              else parse_size(device_budget, "device_budget"))
        self.host_budget = (_default_host_budget() if host_budget is None
                            else parse_size(host_budget, "host_budget"))
        self.min_bytes = parse_size(min_bytes, "min_bytes")
        self.ssd_bandwidth = ssd_bandwidth
        self.verbose = verbose
        self._explicit_stream = parameter_stream
        self.device = _model_device(model)
        if not isinstance(prefetch_layers, int) or prefetch_layers < 0:
            raise ValueError(f"prefetch_layers must be an int >= 0, got {prefetch_layers!r}")
        tier = None
        if ssd is not None:
            from ._activation_ssd import open_ssd_tier
            tier = open_ssd_tier(ssd)
        self.store = ActivationStore(self.device, self.device_budget, prefetch_layers, ssd=tier)
        self.plan: Optional[Plan] = None
        self.choices: List[str] = [KEEP] * len(self.layers)
        self.last_profile = None
        self.weights_seen = 0
        self.steps = 0
        self._recorder: Optional[LayerRecorder] = None  # the forward being profiled
        self._pending: Optional[LayerRecorder] = None  # profiled, its backward to come
        self._profile_next = plan is None
        self._current: List[Optional[int]] = []
        self._in_forward = False
        self._weight_ptrs: set = set()
        self._stream = None
        self._warned = False
        self._removed = False
        self._probe, self._probe_hit = None, False
        if plan is not None:
            self.apply(plan)
        self._saved_forwards = []
        self._install()
        model._fuyou_activation_offload = self

    # ------------------------------------------------------------ install
    def _install(self) -> None:
        ref = weakref.ref(self)
        targets = [(self.model, None)] + [(m, i) for i, m in enumerate(self.layers)]
        for module, index in targets:
            had = "forward" in module.__dict__
            original = module.forward
            self._saved_forwards.append((module, had, module.__dict__.get("forward")))
            module.forward = (_root_forward(ref, original) if index is None
                              else _layer_forward(ref, index, original))

    def remove(self) -> None:
        """Restores the model as it was: its and its layers' forward methods,
        no hooks left (idempotent). Saved activations of a forward whose
        backward has not run stay valid."""
        if self._removed:
            return
        self._removed = True
        for module, had, previous in reversed(self._saved_forwards):
            if had:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)
        self._saved_forwards = []
        if getattr(self.model, "_fuyou_activation_offload", None) is self:
            del self.model._fuyou_activation_offload
        if self.store.ssd is not None:
            self.store.ssd.close()

    def __enter__(self) -> "ActivationOffload":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------ plans
    def apply(self, plan: Union[str, Sequence[str], Plan]) -> None:
        """Uses `plan` from the next forward on (see offload_activations)."""
        if isinstance(plan, Plan):
            choices = list(plan.choices)
        elif isinstance(plan, str):
            choices = [plan] * len(self.layers)
        else:
            choices = list(plan)
        bad = [c for c in choices if c not in CHOICES]
        if bad or len(choices) != len(self.layers):
            raise InvalidArgument(f"a plan is one of {CHOICES} per layer ({len(self.layers)} "
                                  f"layers), got {choices!r}")
        ssd = [n for n, c in zip(self.names, choices) if c == SSD]
        if ssd and self.store.ssd is None:
            raise FailedPrecondition(
                f"the activation plan puts layers {ssd} on the SSD tier, which needs a daemon "
                "session: pass ssd= (a fuyou.AdamW, a session or the daemon's address) to "
                "offload_activations, plan with a larger host_budget, or let the planner choose "
                "(it recomputes where host memory is short)")
        self.choices = choices
        self.plan = plan if isinstance(plan, Plan) else None
        self._profile_next = False

    def profile(self) -> None:
        """Profiles the next step (every layer kept) and plans from it."""
        self._profile_next = True

    def plan_from(self, profile) -> Plan:
        """The plan for `profile` within this handle's budgets."""
        budget = self.device_budget if self.device_budget is not None else 1 << 62
        allowed = CHOICES if self.store.ssd is not None else (KEEP, HOST, RECOMPUTE)
        return plan_activations(profile, budget, self.host_budget, allowed=allowed)

    def _end_of_backward(self) -> None:
        if self._pending is not None:
            self._finish_profile()

    def _finish_profile(self) -> None:
        recorder, self._pending = self._pending, None
        d2h, h2d = measure_link_bandwidth(self.device)
        ssd = self.ssd_bandwidth if self.store.ssd is not None else None
        profile = recorder.profile(d2h, h2d, ssd, ssd)
        self.last_profile = profile
        self._profile_next = False
        plan = self.plan_from(profile)  # ValueError (out of backward) when nothing fits
        self.apply(plan)
        if self.verbose:
            print(f"fuyou activation plan for {type(self.model).__name__}:\n{plan.table()}")

    # ------------------------------------------------------------ forward
    def _root_forward(self, original, args, kwargs):
        if self._in_forward or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        self._in_forward = True
        self._stream = self._explicit_stream or _parameter_stream_of(self.model)
        self._weight_ptrs = _storage_ptrs(self.model)
        self.store.new_forward()
        self.store.reset_peaks()
        if self._pending is not None:  # a profiled forward with no backward through a layer
            self._finish_profile()
        if self._profile_next:
            self._recorder = LayerRecorder(self.names, self.device, self._end_of_backward)
            self._profile_next = False
        recorder = self._recorder
        t0 = time.perf_counter()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = original(*args, **kwargs)
        finally:
            self._in_forward = False
            self._current = []
            self.store.finish_forward()
        self.steps += 1
        if recorder is not None:
            recorder.forward_total_s = time.perf_counter() - t0
            self._recorder, self._pending = None, recorder
        return out

    def _layer_forward(self, index, original, args, kwargs):
        if not self._in_forward:  # a recomputation in backward, or a bare call
            if self.choices[index] == RECOMPUTE and torch.is_grad_enabled():
                self._hooks_on_top()  # the same saves as in forward (a user's checkpoint
                #                       matches its recomputation's saves by count)
            return original(*args, **kwargs)
        self._current.append(index)
        try:
            if self._recorder is not None:
                return self._recorder.run_layer(index, original, args, kwargs)
            if (self.choices[index] == RECOMPUTE and torch.is_grad_enabled()
                    and self._hooks_on_top()):
                held = _hold_inputs(args)
                return torch.utils.checkpoint.checkpoint(original, *held, use_reentrant=False,
                                                         **kwargs)
            return original(*args, **kwargs)
        finally:
            self._current.pop()

    # ------------------------------------------------------------ hooks
    def _hooks_on_top(self) -> bool:
        """Whether a tensor saved now reaches this handle's pack hook (not, for
        one, inside a user's torch.utils.checkpoint, which recomputes the
        layer already: checkpointing it again would nest recomputations). The
        probe saves two tensors; a recomputation makes the same probe."""
        probe = torch.zeros(1, requires_grad=True)
        self._probe, self._probe_hit = probe, False
        try:
            probe * probe
        finally:
            self._probe = None
        return self._probe_hit

    def _is_weight(self, t: torch.Tensor) -> bool:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return True
        if t.numel() == 0:
            return False
        return t.data_ptr() - t.storage_offset() * t.element_size() in self._weight_ptrs

    def _pack(self, t: torch.Tensor):
        if t is self._probe:
            self._probe_hit = True
            return t
        if self._is_weight(t):
            self.weights_seen += 1
            stream = self._stream
            if stream is not None:
                packed = stream._pack(t)
                if packed is not t:
                    return _Weight(stream, packed)
            return t
        layer = self._current[-1] if self._current else None
        if self._recorder is not None:
            self._recorder.saved(layer, footprint_bytes(t))
        choice = KEEP if layer is None else self.choices[layer]
        if choice in (HOST, SSD) and footprint_bytes(t) >= self.min_bytes:
            saved = self.store.offload(t, layer, ssd=choice == SSD)
        else:
            saved = self.store.keep(t, layer)
        self._check_budget()
        return saved

    def _unpack(self, saved):
        if isinstance(saved, SavedActivation):
            return self.store.unpack(saved)
        if isinstance(saved, _Weight):
            return saved.stream._unpack(saved.packed)
        return saved

    def _check_budget(self) -> None:
        budget = self.device_budget
        if budget is not None and self._recorder is None and not self._warned and self.store.device_bytes > budget:
            self._warned = True
            log.warning("fuyou: saved activations on the device (%d bytes) exceed "
                        "device_budget %d: the plan was made for smaller inputs; call "
                        "handle.profile() to plan again", self.store.device_bytes, budget)


def _root_forward(ref, original):
    def forward(*args, **kwargs):
        handle = ref()
        if handle is None:
            return original(*args, **kwargs)
        return handle._root_forward(original, args, kwargs)
    return forward


def _layer_forward(ref, index, original):
    def forward(*args, **kwargs):
        handle = ref()
        if handle is None:
            return original(*args, **kwargs)
        return handle._layer_forward(index, original, args, kwargs)
    return forward


class _HoldInputs(torch.autograd.Function):
    """Identity that saves its inputs for backward, so the pack hook accounts
    a recomputed layer's inputs (what the checkpoint holds) for as long as
    the layer's graph lives."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.save_for_backward(*tensors)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def _hold_inputs(args):
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not idx:
        return args
    held = _HoldInputs.apply(*(args[i] for i in idx))
    out = list(args)
    for i, h in zip(idx, held):
        out[i] = h
    return tuple(out)


def _name_in(model, module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name or type(m).__name__
    return type(module).__name__


def _model_device(model) -> torch.device:
    for p in model.parameters():
        if p.numel():
            return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _storage_ptrs(model) -> set:
    ptrs = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.numel():
            ptrs.add(t.data_ptr() - t.storage_offset() * t.element_size())
    return ptrs


def _parameter_stream_of(model):
    """The fuyou.stream_parameters handle whose root pre-hook is on `model`."""
    from ._stream import ParameterStream
    for hook in list(model._forward_pre_hooks.values()):
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if isinstance(value, weakref.ref):
                value = value()
            if isinstance(value, ParameterStream) and not value._closed:
                return value
    return None
