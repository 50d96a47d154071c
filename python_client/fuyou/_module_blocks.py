"""ModuleBlocks (``offload.layout``): the blocks of an offload_params model
and who owns and uses each.

A block is one module's own trainable parameters (``recurse=False``) packed in
its chunks (_weight_cache.py's ``Block``). A module *owns* at most one block;
its forward *uses* the blocks of its own parameters' owners (a tied parameter
is owned by one module and used by several). Each chunk and each parameter
(by ``param_index``) belongs to one block. Empty until ``fill`` (at
``OffloadedParams.bind``); the WeightCache and OffloadedGradients made before
see it filled, as they hold this object."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ._chunking import Chunk
from ._weight_cache import Block, make_block

__all__ = ["ModuleBlocks"]


class ModuleBlocks:
    """The blocks of the bound model (see the module doc)."""

    def __init__(self):
        self.model: Optional[torch.nn.Module] = None
        self.modules: List[Tuple[str, torch.nn.Module]] = []  # model.named_modules()
        self.blocks: List[Block] = []
        self.of_chunk: Dict[int, Block] = {}  # chunk id -> its block
        self.of_param: Dict[int, Block] = {}  # param_index -> its owner's block
        self._of_module: Dict[int, Block] = {}  # id(module) -> the block it owns
        self._uses: Dict[int, List[Block]] = {}  # id(module) -> blocks its forward needs

    def fill(self, model: torch.nn.Module, modules: List[Tuple[str, torch.nn.Module]],
             by_module: Dict[str, List[Chunk]], params: List[torch.Tensor]) -> None:
        """The blocks of `model` (`modules`: its named modules) from the chunks
        of each module's own parameters (`by_module`, by module name); `params`:
        the optimizer's trainable parameters by param_index."""
        by_name = dict(modules)
        for name, mine in by_module.items():
            block = make_block(name, mine)
            self.blocks.append(block)
            self._of_module[id(by_name[name])] = block
            for c in mine:
                self.of_chunk[c.chunk_id] = block
            for m in block.members:
                self.of_param[m.index] = block
        index_of = {id(p): i for i, p in enumerate(params)}
        for name, module in modules:
            uses: List[Block] = []
            for p in module.parameters(recurse=False):
                i = index_of.get(id(p))
                b = self.of_param.get(i) if i is not None else None
                if b is not None and b not in uses:
                    uses.append(b)
            if uses:
                self._uses[id(module)] = uses
        self.modules = modules
        self.model = model

    def owned_by(self, module: torch.nn.Module) -> Optional[Block]:
        """The block of `module`'s own parameters; None when it owns none."""
        return self._of_module.get(id(module))

    def uses(self, module: torch.nn.Module) -> List[Block]:
        """The blocks `module`'s forward needs (its own parameters' owners)."""
        return self._uses.get(id(module), [])

    def replace_param(self, old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
        """Puts `new` wherever `old` is in the modules and the blocks' members."""
        for _name, module in self.modules:
            for key, value in list(module._parameters.items()):
                if value is old:
                    module._parameters[key] = new
        for b in self.blocks:
            for m in b.members:
                if m.param is old:
                    m.param = new
