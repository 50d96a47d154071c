"""A small GPT-style decoder in plain PyTorch, and a byte-level tokenizer.

Used by finetune_gpt.py to show fuyou.AdamW on a real (if tiny) language model.
Nothing here depends on fuyou.

Model: token + learned position embeddings, N pre-LayerNorm blocks of causal
multi-head self-attention and a GELU MLP, a final LayerNorm, and an LM head tied
to the token embedding. Written for torch 1.13 (Debian 12): no
F.scaled_dot_product_attention, so attention is spelled out.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F


class ByteTokenizer:
    """Byte-level tokenizer: UTF-8 bytes are the tokens, vocabulary size 256.

    Lossless for any text (decode(encode(s)) == s), no training, no files.
    """

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """Returns the UTF-8 bytes of `text` as a 1-D int64 tensor."""
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)

    def decode(self, tokens) -> str:
        """Inverse of encode; invalid UTF-8 (e.g. a cut multi-byte char) is replaced."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128  # longest sequence the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 192
    dropout: float = 0.0


# Presets for --model. Parameter counts are for vocab 256 and block 128.
PRESETS: Dict[str, GPTConfig] = {
    "nano": GPTConfig(n_layer=2, n_head=2, n_embd=64),      # ~0.1M params, for tests
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128),     # ~0.8M
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=192),    # ~1.8M
    "medium": GPTConfig(n_layer=6, n_head=6, n_embd=384),   # ~10.8M
    # ~25.4M: the main job's (deploy/main-job.sh); fuyou's fp32 states, 12 bytes a
    # parameter (305 MB), are 4.5x the embedded fuyoud's smallest DRAM budget (64 MiB)
    "main": GPTConfig(n_layer=8, n_head=8, n_embd=512),
    "large": GPTConfig(n_layer=12, n_head=12, n_embd=768),  # ~85M, not for 2 CPU cores
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        hs = c // self.n_head
        q = q.view(b, t, self.n_head, hs).transpose(1, 2)  # (b, h, t, hs)
        k = k.view(b, t, self.n_head, hs).transpose(1, 2)
        v = v.view(b, t, self.n_head, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Distinct parameters (the tied LM head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx: (batch, time) token ids, time <= block_size.

        Returns (logits of shape (batch, time, vocab), loss or None). The loss is
        the mean cross-entropy against `targets`, computed in float32.
        """
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = x @ self.tok_emb.weight.t()  # tied LM head
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None) -> torch.Tensor:
        """Samples max_new_tokens tokens after idx (batch, time); returns the whole sequence."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.block_size:]
            logits, _ = self(ctx)
            logits = logits[:, -1, :].float() / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
