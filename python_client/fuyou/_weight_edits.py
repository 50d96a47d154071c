"""WeightEdits: the resident mode's watch on the model's weights between its
steps (issue 31, item 2).

In the resident mode fuyoud holds each chunk's fp32 master and step() installs
the master's new values into the parameters. A loop may change the weights
itself in between: WGAN's ``p.data.clamp_``, a ``no_grad`` rescale,
``module.reset_parameters()``, ``model.load_state_dict(...)``. torch's AdamW
steps from whatever the parameter holds, so fuyou must too.

``remember`` takes, per chunk, the weights' sum and sum of squares (float64)
and each parameter's version counter and storage; ``edited`` takes them again
and returns the chunks where any differs (the version catches an edit through
the parameter that keeps both sums, a permutation; the sums catch ``.data``
edits, which torch does not count). ``take_into_masters`` writes those chunks'
weights into their masters in one import: an element the loop did not change
keeps its fp32 master (a bf16 parameter keeps its precision), a changed one
becomes the new value.

Cost: one read of the weights after each commit and one at each step() (the
fingerprint of float32 CPU weights is the binding's double-precision pass, the
others torch's on their device, one wait per device); an edit costs reading
the edited chunks' masters and one CommitImport, and that step's updates sent
during backward are redone at step() (they began from the old masters).
"""

from __future__ import annotations

import collections
from typing import Dict, List, Tuple

import torch

from . import _native
from ._chunk_weights import gather_weights
from ._chunking import Chunk
from ._fingerprints import same_values
from ._protocol import STATE_MASTER

__all__ = ["WeightEdits"]

_Look = Tuple[Tuple[float, float], Tuple[Tuple[int, int], ...]]


class WeightEdits:
    """The weights of `pipeline`'s chunks as last installed (see the module doc)."""

    def __init__(self, pipeline, chunks=None):
        """`chunks`: the chunks watched (a callable; default the pipeline's
        plan; a data-parallel rank watches every rank's)."""
        self.pipeline = pipeline
        self._chunks = chunks if chunks is not None else (lambda: pipeline.plan.chunks)
        self._seen: Dict[int, _Look] = {}
        self.sums: Dict[int, Tuple[float, float]] = {}  # chunk id -> at the last ``edited``

    def remember(self) -> None:
        """The parameters hold the masters' values now (a commit installed them,
        a registration or an import wrote them)."""
        self._seen = _look(self._chunks())

    def edited(self) -> List[Chunk]:
        """The chunks whose weights changed since ``remember``."""
        chunks = self._chunks()
        now = _look(chunks)
        self.sums = {cid: look[0] for cid, look in now.items()}
        return [c for c in chunks if not _same(now[c.chunk_id], self._seen.get(c.chunk_id))]

    def take_into_masters(self, chunks: List[Chunk]) -> None:
        """Writes `chunks`' weights into their masters, in one CommitImport
        (between steps): unchanged elements keep the fp32 master."""
        states = self.pipeline.states
        with torch.no_grad():
            for c in chunks:
                master = states.read_master(c)
                now = gather_weights(c)
                kept = master.to(c.dtype) == now
                states.write(c, STATE_MASTER, torch.where(kept, master, now.to(torch.float32)))
        states.commit_import()
        self.remember()


def _look(chunks: List[Chunk]) -> Dict[int, _Look]:
    """Per chunk: (sum, sum of squares) of its weights and the (version,
    storage) of each segment's parameter; one wait per device."""
    sums: Dict[int, Tuple[float, float]] = {}
    by_device: Dict[torch.device, list] = collections.defaultdict(list)
    native = _native.module()
    for c in chunks:
        pieces = [seg.param.detach().reshape(-1)[seg.start:seg.end] for seg in c.segments]
        if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in pieces):
            sums[c.chunk_id] = tuple(native.sum_and_squares(
                [(p.data_ptr(), p.numel()) for p in pieces]))
        else:
            flat = torch.cat([p.to(torch.float64) for p in pieces])
            by_device[flat.device].append((c.chunk_id, torch.stack(
                (flat.sum(), flat.square().sum()))))
    for items in by_device.values():
        values = torch.stack([t for _, t in items]).cpu().tolist()
        for (cid, _), pair in zip(items, values):
            sums[cid] = tuple(pair)
    return {c.chunk_id: (sums[c.chunk_id],
                         tuple((seg.param._version, seg.param.data_ptr()) for seg in c.segments))
            for c in chunks}


def _same(a: _Look, b) -> bool:
    """Equal looks; nan equals nan (the same weights)."""
    if b is None:
        return False
    (sa, va), (sb, vb) = a, b
    return va == vb and same_values(sa, sb)
