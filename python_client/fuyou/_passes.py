"""PassCounter: the backward passes of one step, per parameter and per chunk.

A chunk is *complete* for a pass when every parameter with a segment in it has
accumulated that pass's gradient; ``count`` returns the chunks a parameter's
accumulation completed (the caller decides whether to send them). The passes
per step the loop makes are learned at commit (``learn``): a chunk is sent at
its k-th pass, k the larger of ``accumulation_steps`` and what was learned."""

from __future__ import annotations

from typing import Callable, Dict, List

from ._chunking import Chunk

__all__ = ["PassCounter"]


class PassCounter:
    """Counts passes for the chunk layout given to ``reset``."""

    def __init__(self, accumulation_steps: int):
        self.accumulation_steps = int(accumulation_steps)
        self._learned = 1
        self.rounds: Dict[int, int] = {}  # chunk id -> passes that completed it
        self._reached: Dict[int, int] = {}  # chunk id -> members in the next pass
        self.param_passes: List[int] = []  # per parameter: passes accumulated

    @property
    def passes_per_step(self) -> int:
        """Backward passes per step a hook waits for before it sends a chunk: the
        accumulation_steps hint, or more when the loop was seen accumulating."""
        return max(self.accumulation_steps, self._learned)

    def reset(self, chunks: List[Chunk], num_params: int) -> None:
        """Forgets the passes counted so far (a new step, or zero_grad)."""
        self.rounds = {c.chunk_id: 0 for c in chunks}
        self._reached = {c.chunk_id: 0 for c in chunks}
        self.param_passes = [0] * num_params

    def count(self, index: int, chunks_of_param: List[Chunk], members_of: Callable[[int], List[int]],
              skip: Callable[[int], bool]) -> List[Chunk]:
        """Parameter `index` accumulated one more pass: the chunks of
        `chunks_of_param` (not `skip`ped: sent in this step) that this completed."""
        self.param_passes[index] += 1
        passes = self.param_passes[index]
        done = []
        for c in chunks_of_param:
            cid = c.chunk_id
            if skip(cid) or passes != self.rounds[cid] + 1:
                continue
            self._reached[cid] += 1
            members = members_of(cid)
            if self._reached[cid] == len(members):
                self.rounds[cid] += 1
                self._reached[cid] = sum(
                    1 for i in members if self.param_passes[i] >= self.rounds[cid] + 1)
                done.append(c)
        return done

    def learn(self, accumulating: bool) -> None:
        """At commit: an accumulating step sets the passes per step to the most a
        parameter made; a step with fewer passes than learned lowers it (a loop
        that accumulates again is seen again, and that step's updates redone)."""
        passes = max(self.param_passes, default=1)
        if accumulating:
            self._learned = max(self._learned, passes)
        elif 0 < passes < self._learned:
            self._learned = passes
