"""FetchedEdits: in-place edits of a streamed module's fetched weights made
while the module held them (issue 31, item 2, second round).

With ``offload_params`` a module's parameters are views of its fetched block
only during its forward (and its backward); the weights themselves live in
fuyoud. An edit there, ``self.weight.data.mul_(0.5)`` in the module's own
forward, changes only the fetched copy: the next fetch, and the daemon's
update, start from the old weights. torch's parameter keeps the edit. fuyou
cannot take it into the masters at that point (the forward and its backward
read the fetched copy; the update may already be under way), so it refuses
the next step() naming the parameter (StreamedMode.weights_error). An edit
through the parameter itself bumps its version counter, which that check reads;
one through ``.data`` does not, so the values are looked at here.

``fetched`` takes each member's [sum, sum of squares] (float32 on the block's
device, not waited for) when a block's weights arrive; ``evicted`` takes them
again as the block goes, and ``edited`` (at step()) takes those of the blocks
still resident, then compares every pair in one wait per device. fuyou's own
writes of a fetched block (an edit between steps, which it writes into the
masters) call ``refresh``.

Cost: two reductions over each fetched block (at its fetch and as it goes) and
one wait per device at step().
"""

from __future__ import annotations

import collections
from typing import Dict, List, Tuple

import torch

from ._fingerprints import same_values

__all__ = ["FetchedEdits"]


class FetchedEdits:
    """The looks of the fetched blocks of one WeightCache (see the module doc)."""

    def __init__(self):
        self._base: Dict[int, Tuple[object, torch.Tensor]] = {}  # id(block) -> (block, look)
        self._gone: List[Tuple[object, torch.Tensor, torch.Tensor]] = []  # evicted since step()

    def fetched(self, block) -> None:
        """`block`'s buffer holds the weights fuyoud sent."""
        self._base[id(block)] = (block, _look(block))

    refresh = fetched  # fuyou changed the buffer itself and wrote the change into the masters

    def evicted(self, block) -> None:
        """`block`'s buffer is about to go."""
        entry = self._base.pop(id(block), None)
        if entry is not None and block.buffer is not None:
            self._gone.append((block, entry[1], _look(block)))

    def edited(self, resident) -> List[Tuple[object, object]]:
        """(block, member) of every parameter whose fetched weights changed
        since they were fetched (`resident`: the blocks with a buffer now);
        the looks start again from now."""
        pairs = list(self._gone)
        self._gone = []
        for block in resident:
            entry = self._base.get(id(block))
            if entry is not None and block.buffer is not None:
                now = _look(block)
                pairs.append((block, entry[1], now))
                self._base[id(block)] = (block, now)
        by_device: Dict[torch.device, list] = collections.defaultdict(list)
        for block, before, now in pairs:
            by_device[now.device].append((block, torch.stack((before, now))))
        found = []
        for items in by_device.values():
            flat = torch.cat([t.reshape(-1) for _, t in items]).cpu().tolist()
            pos = 0
            for block, t in items:
                n = t.shape[1]
                before, now = flat[pos:pos + 2 * n], flat[pos + 2 * n:pos + 4 * n]
                pos += 4 * n
                found += [(block, m) for i, m in enumerate(block.members)
                          if not same_values(before[2 * i:2 * i + 2], now[2 * i:2 * i + 2])]
        return found

    def forget(self) -> None:
        """The step committed or was refused: evicted blocks are not looked at again."""
        self._gone = []


def _look(block) -> torch.Tensor:
    """[members, 2]: each member's [sum, sum of squares] of its fetched weights."""
    buf = block.buffer
    rows = []
    for m in block.members:
        nbytes = m.numel * torch.empty((), dtype=m.dtype).element_size()
        w = buf[m.byte_offset:m.byte_offset + nbytes].view(m.dtype)
        rows.append(torch.stack((torch.sum(w, dtype=torch.float32),
                                 torch.linalg.vector_norm(w, dtype=torch.float32).square())))
    if not rows:
        return torch.zeros((0, 2), dtype=torch.float32, device=buf.device)
    return torch.stack(rows)
