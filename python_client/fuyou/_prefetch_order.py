"""PrefetchOrder: the order in which the first forward and the first backward
needed a streamed model's blocks, and the prefetches it gives later steps.

The first pass of each direction records the blocks as they are needed; from
then on, each block needed moves the position in that order and the chunks of
the next blocks not resident are fetched ahead, at most ``prefetch`` fetches in
flight (looked ahead over ``4 * prefetch`` blocks). A block out of the recorded
order is looked for from the start; one never recorded prefetches nothing."""

from __future__ import annotations

from typing import Dict, List

from ._weight_cache import Block

__all__ = ["PrefetchOrder", "DIRECTIONS"]

DIRECTIONS = ("forward", "backward")


class PrefetchOrder:
    """The two recorded orders of one ParameterStream; `prefetch`: chunk
    fetches in flight ahead of their use (0: none)."""

    def __init__(self, prefetch: int):
        self.prefetch = int(prefetch)
        self._orders: Dict[str, List[Block]] = {d: [] for d in DIRECTIONS}
        self._recorded: Dict[str, bool] = {d: False for d in DIRECTIONS}
        self._pos: Dict[str, int] = {d: 0 for d in DIRECTIONS}

    def restart(self, direction: str) -> None:
        """A new pass in `direction` begins."""
        self._pos[direction] = 0

    def pass_ended(self, direction: str) -> None:
        """A pass in `direction` ended: a recorded order is final."""
        if self._orders[direction]:
            self._recorded[direction] = True

    def advance(self, direction: str, block: Block, weights) -> None:
        """Notes that `block` was needed now; prefetches the next chunks in the
        order the first pass needed them (recorded then) through `weights`
        (the WeightCache)."""
        order = self._orders[direction]
        if not self._recorded[direction]:
            order.append(block)
            return
        pos = self._pos[direction]
        try:
            j = order.index(block, pos)
        except ValueError:
            try:
                j = order.index(block)
            except ValueError:
                return
        self._pos[direction] = j + 1
        if self.prefetch <= 0:
            return
        for b in order[j + 1:j + 1 + 4 * self.prefetch]:
            if b.buffer is not None:
                continue
            for c in b.chunks:
                if weights.fetches_in_flight >= self.prefetch:
                    return
                weights.prefetch(c)
