"""Side-by-side training of fuyou.AdamW and torch.optim.AdamW."""

from __future__ import annotations

from helpers import batch

CHUNK_BYTES = 8 << 10  # many small chunks (about 14 for the tiny GPT in fp32)


def split_groups(model, lr=1e-3, wd=0.1, lr_no_decay=2e-3):
    """Two groups like GPT recipes: matrices with weight decay, the rest without."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "lr": lr, "weight_decay": wd},
            {"params": no_decay, "lr": lr_no_decay, "weight_decay": 0.0}]


def step_loss(model, step, scale=None, micro=None, batch_size=4):
    x, y = batch(step, batch_size=batch_size)
    if micro is not None:
        k, i = micro
        per = batch_size // k
        x, y = x[i * per:(i + 1) * per], y[i * per:(i + 1) * per]
    return model(x, y)


# ------------------------------------------------ a GPT for streaming (issue 12)
import math  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class StreamAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # no key bias: see helpers.Block
        self.proj = nn.Linear(d, d)
        self.n_head = n_head

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class StreamBlock(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = StreamAttention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class StreamGPT(nn.Module):
    """A GPT whose every parameter is used through its own module's forward
    (what stream_parameters fetches for): token and position embeddings, blocks,
    final LayerNorm, an LM head tied to the token embedding."""

    def __init__(self, vocab=64, d=32, n_head=4, n_layer=2, seq=16, tied=True):
        super().__init__()
        self.seq = seq
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([StreamBlock(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def stream_batch(step, vocab=64, seq=16, batch_size=4, micro=0):
    g = torch.Generator().manual_seed(7919 * step + micro)
    data = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]
