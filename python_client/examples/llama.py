"""The main job's model: a ``transformers`` Llama built from a config file of
configs/ (random init; nothing is downloaded), trained on bytes (vocabulary 256,
gpt.ByteTokenizer).

:class:`LlamaLM` puts ``transformers.LlamaForCausalLM`` behind the interface
finetune_gpt.py trains (the example GPT's): ``model(x, y) -> (logits, loss)``
with the loss over every position (``y`` is ``x`` shifted by one, as the data
pipeline makes it), ``num_parameters()``, ``generate(prompt, n, generator=)``.
The Hugging Face model itself is ``model.hf``: ``model.hf.save_pretrained(dir)``
writes it in safetensors and ``AutoModelForCausalLM.from_pretrained(dir)``
loads it.

Presets (``--model``), each ``configs/llama-<name>.json``; parameter counts for
vocabulary 256, untied embeddings:

    nano    width  64, 2 layers,  0.13M   (tests)
    tiny    width 128, 4 layers,  0.8M
    small   width 192, 4 layers,  1.8M
    medium  width 384, 6 layers, 10.8M
    main    width 512, 8 layers, 25.6M   (deploy/main-job.sh: 307 MB of fp32 states)
"""
from __future__ import annotations

import os
import pathlib
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config file, never a hub

CONFIGS = pathlib.Path(__file__).resolve().parent / "configs"
PRESETS = sorted(p.stem[len("llama-"):] for p in CONFIGS.glob("llama-*.json"))


def config_path(preset: str) -> pathlib.Path:
    return CONFIGS / f"llama-{preset}.json"


def load_config(path: pathlib.Path):
    import transformers
    return transformers.LlamaConfig.from_json_file(str(path))


class LlamaLM(nn.Module):
    """A ``transformers.LlamaForCausalLM`` (``self.hf``) trained as the example
    GPT is (see the module doc)."""

    def __init__(self, config):
        super().__init__()
        import transformers
        self.hf = transformers.LlamaForCausalLM(config)
        self.block_size = int(config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        if idx.shape[1] > self.block_size:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds block_size "
                             f"{self.block_size} (max_position_embeddings)")
        logits = self.hf(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, self.vocab_size),
                                   targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int,
                 generator: Optional[torch.Generator] = None, temperature: float = 1.0):
        """Samples `max_new_tokens` tokens after `idx` (B, T), one at a time from
        the softmax of the last position's logits (the last block_size tokens)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.block_size:])
            probs = torch.softmax(logits[:, -1, :].float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
        return idx
